"""The Engram kernels (csrc/engram) against the references of ops/engram.py: n-gram hash
(exact integers), gather + dequantisation of FP8 / UE8M0 rows (exact: every byte pattern of
values and exponents, NaN included), the fused hash + gather, the gate (a stated bound); table
in device memory and in page-locked host memory (UVA) give identical bits; bad inputs raise
naming the argument; CUDA graph capture; the side-stream prefetch (engine/engram_state.py).
Fresh random inputs, poisoned outputs, every element checked."""
import numpy as np
import pytest
import torch

from deepfuse import ops
from deepfuse.engine.engram_state import EngramPrefetch, attach_prefetch
from deepfuse.ops import engram as E
from deepfuse.ops._fallback import NoKernelError

pytestmark = pytest.mark.gpu
DEV = "cuda"
POISON = 12345.0  # never a dequantised value (4 significant bits times a power of two)
BF16_REL = 2.0 ** -7  # largest relative spacing of bf16


@pytest.fixture(autouse=True)
def _kernels_on():
    prev = E.set_kernels(True)
    yield
    E.set_kernels(prev)


def _g(seed, dev="cpu"):
    return torch.Generator(device=dev).manual_seed(seed)


def _table(R, D, g):
    """Random e4m3 bytes (NaN patterns included) and random exponent bytes 0..255, on the CPU."""
    w = torch.randint(0, 256, (R, D), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = torch.randint(0, 256, (R, D // 32), generator=g, dtype=torch.uint8)
    return w, s


def _consts(L, M, H, vocab, seed):
    primes = torch.from_numpy(E.hash_primes(L, M, H, vocab))
    offsets = torch.from_numpy(E.hash_offsets(primes.numpy()))
    mult = torch.from_numpy(E.hash_multipliers([seed + i for i in range(L)], M, 99092))
    return mult, primes, offsets


def _same(out, ref):
    """Equal values (NaN where NaN), every element; out on the GPU, ref anywhere."""
    torch.testing.assert_close(out.cpu(), ref.cpu(), rtol=0, atol=0, equal_nan=True)


# ----------------------------------------------------------------------------- hash
@pytest.mark.parametrize("L,M,H,N,idt,wrap", [
    (1, 2, 1, 1, torch.int64, False), (2, 4, 8, 1001, torch.int64, False), (3, 3, 2, 37, torch.int32, False),
    (2, 4, 8, 257, torch.int64, True), (1, 5, 3, 99, torch.int32, True)])
def test_hash(L, M, H, N, idt, wrap):
    g = _g(N + M)
    mult, primes, offsets = _consts(L, M, H, 16_000_000 if H == 8 else 1000 + N, seed=N)
    if wrap:  # any int64 multipliers: the products wrap around (as torch's int64 products)
        i64 = np.iinfo(np.int64)
        mult = torch.from_numpy(np.random.default_rng(N).integers(i64.min, i64.max, (L, M), dtype=np.int64))
    wide = torch.randint(-5 if wrap else 0, 99092, (N, M + 3), generator=g).to(idt)
    ngram = wide[:, 1:M + 1]  # a row stride of M + 3
    ref = E.engram_hash_ref(ngram, mult, primes, offsets)
    out = ops.engram_hash(ngram.to(DEV), mult.to(DEV), primes.to(DEV), offsets.to(DEV))
    assert out.dtype == torch.int64 and out.shape == (N, L, (M - 1) * H)
    assert torch.equal(out.cpu(), ref)


# ----------------------------------------------------------------------------- lookup
@pytest.mark.parametrize("R,D,C,N", [(97, 32, 3, 1), (5003, 256, 24, 257), (131, 96, 6, 33), (64, 256, 2, 1001)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lookup(R, D, C, N, out_dtype):
    g = _g(R * 7 + D + C)
    w, s = _table(R, D, g)
    ids = torch.randint(0, R, (N, C), generator=g)
    ids.view(-1)[: min(2, N * C)] = torch.tensor([0, R - 1])[: min(2, N * C)]  # both ends of the table
    ref = E.engram_lookup_ref(w, s, ids, out_dtype)
    wd, sd = w.to(DEV), s.to(DEV)
    for idt in (torch.int64, torch.int32):
        _same(ops.engram_lookup(wd, sd, ids.to(DEV, idt), out_dtype), ref)
    # ids as one layer's columns of [N, L, C] (a row stride of 3C); poisoned output buffer
    h = torch.randint(0, R, (N, 3, C), generator=g)
    h[:, 1] = ids
    out = torch.full((N, C, D), POISON, dtype=out_dtype, device=DEV)
    E.lookup_into(out, wd, sd, h.to(DEV)[:, 1])
    _same(out, ref)
    # the same table in page-locked host memory (UVA reads): the same bits
    wh, sh = E.to_host(w), E.to_host(s)
    assert wh.is_pinned() and sh.is_pinned()
    host = ops.engram_lookup(wh, sh, ids.to(DEV), out_dtype)
    assert host.device.type == "cuda"
    assert torch.equal(host.view(torch.uint8), ops.engram_lookup(wd, sd, ids.to(DEV), out_dtype).view(torch.uint8))


def test_lookup_every_byte():
    """Every (e4m3 byte, exponent byte) pair once: 256 x 256 values, all three out dtypes."""
    vals = torch.arange(256, dtype=torch.uint8).repeat(256, 1)  # row e: all 256 value bytes
    w = vals.reshape(256 * 8, 32).view(torch.float8_e4m3fn)  # 8 rows of 32 per exponent
    s = torch.arange(256, dtype=torch.uint8).repeat_interleave(8).reshape(-1, 1)
    ids = torch.randperm(w.shape[0], generator=_g(3)).reshape(-1, 4)
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        _same(ops.engram_lookup(w.to(DEV), s.to(DEV), ids.to(DEV), dt), E.engram_lookup_ref(w, s, ids, dt))


def test_lookup_out_of_range_rows_are_zero():
    w, s = _table(50, 64, _g(5))
    ids = torch.tensor([[0, -1, 49], [50, 7, 1 << 40]])
    out = ops.engram_lookup(w.to(DEV), s.to(DEV), ids.to(DEV), torch.float32).cpu()
    ok = (ids >= 0) & (ids < 50)
    assert (out[~ok] == 0).all()
    _same(out[ok], E.engram_lookup_ref(w, s, ids[ok].reshape(1, -1), torch.float32)[0])


# ----------------------------------------------------------------------------- fused hash + gather
@pytest.mark.parametrize("M,H,N,D", [(4, 8, 513, 256), (3, 2, 7, 32), (2, 3, 1, 64)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_embed(M, H, N, D, out_dtype):
    g = _g(M * 100 + N)
    mult, primes, offsets = _consts(2, M, H, 300, seed=M)
    R = int(primes[1].sum())
    w, s = _table(R, D, g)
    ngram = torch.randint(0, 99092, (N, M), generator=g)
    ref = E.engram_embed_ref(ngram, mult[1], primes[1], offsets[1], w, s, out_dtype)
    nd = ngram.to(DEV)
    out = E.engram_embed(nd, mult[1].to(DEV), primes[1].to(DEV), offsets[1].to(DEV), w.to(DEV), s.to(DEV), out_dtype)
    _same(out, ref)
    # the same as hash then lookup, and with the table in host memory
    ids = ops.engram_hash(nd, mult.to(DEV), primes.to(DEV), offsets.to(DEV))[:, 1]
    two = ops.engram_lookup(w.to(DEV), s.to(DEV), ids, out_dtype)
    host = E.engram_embed(nd.int(), mult[1].to(DEV), primes[1].to(DEV), offsets[1].to(DEV), E.to_host(w),
                          E.to_host(s), out_dtype)
    assert torch.equal(out.view(torch.uint8), two.view(torch.uint8))
    assert torch.equal(out.view(torch.uint8), host.view(torch.uint8))


# ----------------------------------------------------------------------------- gate
def _gate_inputs(N, n, d, dtype, g, zero_k=False):
    x = torch.randn(N, n, d, generator=g) * 2
    kv = torch.randn(N, n + 1, d, generator=g)
    if zero_k:  # dot == 0 exactly: the gate is 1/2
        kv[::2, :n] = 0
    wh = torch.rand(n, d, generator=g) + 0.5
    we = torch.rand(n, d, generator=g) + 0.5
    return x.to(dtype), kv.to(dtype), wh, we


@pytest.mark.parametrize("N,n,d", [(1, 4, 5120), (33, 4, 256), (7, 1, 8), (129, 2, 1000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("zero_k", [False, True])
def test_gate(N, n, d, dtype, zero_k):
    x, kv, wh, we = _gate_inputs(N, n, d, dtype, _g(N * d + n), zero_k)
    for clamp, eps in ((1e-6, 1e-6), (0.05, 1e-20)):
        ref = E.engram_gate_ref(x, kv, wh, we, clamp, eps).float()
        out = ops.engram_gate(x.to(DEV), kv.to(DEV), wh.to(DEV), we.to(DEV), clamp, eps).cpu()
        assert out.dtype == dtype and out.shape == x.shape
        # Bound: the kernel's sums run in another order than torch's (the gate moves by ~1e-7
        # relative), so out = x + g v differs by <= 1e-5 |v| in fp32, plus one rounding of the
        # result to bf16 (one bf16 spacing of |ref|).
        v = kv[:, n:].float().abs()
        tol = 1e-5 * (v + ref.abs()) + 1e-6 + (BF16_REL * ref.abs() if dtype == torch.bfloat16 else 0)
        err = (out.float() - ref).abs()
        assert (err <= tol).all(), f"max err {err.max().item()}, {(err > tol).sum().item()} values over"


# ----------------------------------------------------------------------------- errors
def test_bad_inputs_name_the_argument():
    w, s = _table(40, 64, _g(9))
    wd, sd = w.to(DEV), s.to(DEV)
    ids = torch.randint(0, 40, (5, 3), device=DEV)
    with pytest.raises(TypeError, match="table"):
        ops.engram_lookup(wd.view(torch.uint8), sd, ids)
    with pytest.raises(ValueError, match="scale"):
        ops.engram_lookup(wd, sd[:, :1], ids)
    with pytest.raises(TypeError, match="ids"):
        ops.engram_lookup(wd, sd, ids.float())
    with pytest.raises(ValueError, match="out"):
        E.lookup_into(torch.empty(5, 3, 32, device=DEV), wd, sd, ids)
    # the launcher's own checks (C++): a wrong output shape, a pageable host table
    from deepfuse import _C
    with pytest.raises(ValueError, match="out"):
        _C.engram_lookup(table=wd.view(torch.uint8), scale=sd, ids=ids, out=torch.empty(5, 3, 32, device=DEV))
    with pytest.raises(ValueError, match="table"):
        _C.engram_lookup(table=w.view(torch.uint8), scale=s, ids=ids, out=torch.empty(5, 3, 64, device=DEV))
    # a pageable host table: no kernel reads it (NoKernelError naming it) unless allowed
    with pytest.raises(NoKernelError, match="table"):
        ops.engram_lookup(w, s, ids)
    with ops.allow_reference("engram_lookup"):
        _same(ops.engram_lookup(w, s, ids, torch.float32), E.engram_lookup_ref(w, s, ids.cpu(), torch.float32))
    mult, primes, offsets = (t.to(DEV) for t in _consts(1, 3, 2, 40, seed=1))
    with pytest.raises(ValueError, match="primes"):
        E.engram_embed(ids, mult[0], primes[0, :3], offsets[0, :3], wd, sd)
    with pytest.raises(ValueError, match="multipliers"):
        ops.engram_hash(ids, mult[:, :2], primes, offsets)
    x, kv, wh, we = (t.to(DEV) for t in _gate_inputs(3, 4, 64, torch.float16, _g(1)))
    with pytest.raises(NoKernelError, match="hidden"):
        ops.engram_gate(x, kv, wh, we)
    with pytest.raises(ValueError, match="kv"):
        ops.engram_gate(x.float(), kv[:, :4].float(), wh, we)


# ----------------------------------------------------------------------------- graphs
@pytest.mark.parametrize("host", [False, True])
def test_graph_capture(host):
    g = _g(11)
    mult, primes, offsets = (t.to(DEV) for t in _consts(2, 4, 8, 500, seed=2))
    R = int(primes.sum(1).max())
    w, s = _table(R, 256, g)
    w, s = (E.to_host(w), E.to_host(s)) if host else (w.to(DEV), s.to(DEV))
    ngram = torch.randint(0, 99092, (65, 4), generator=g).to(DEV)
    ops.engram_hash(ngram, mult, primes, offsets)  # warm-up (allocator, first-call work)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        hashes = ops.engram_hash(ngram, mult, primes, offsets)
        ops.engram_lookup(w, s, hashes[:, 0], torch.bfloat16)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        hashes = ops.engram_hash(ngram, mult, primes, offsets)
        rows = ops.engram_lookup(w, s, hashes[:, 0], torch.bfloat16)
        fused = E.engram_embed(ngram, mult[1], primes[1], offsets[1], w, s, torch.float32)
    for seed in (12, 13):
        ngram.copy_(torch.randint(0, 99092, (65, 4), generator=_g(seed)).to(DEV))
        rows.fill_(POISON)
        fused.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        want = ops.engram_hash(ngram, mult, primes, offsets)
        assert torch.equal(hashes, want)
        _same(rows, ops.engram_lookup(w, s, want[:, 0], torch.bfloat16))
        _same(fused, ops.engram_lookup(w, s, want[:, 1], torch.float32))


# ----------------------------------------------------------------------------- prefetch
@pytest.mark.parametrize("host", [False, True])
def test_prefetch_side_stream(host):
    g = _g(21)
    mult, primes, offsets = (t.to(DEV) for t in _consts(2, 4, 8, 2000, seed=3))
    tabs = []
    for l in range(2):
        w, s = _table(int(primes[l].sum()), 256, g)
        tabs.append((E.to_host(w), E.to_host(s)) if host else (w.to(DEV), s.to(DEV)))
    pf = EngramPrefetch(tabs, max_tokens=300, cols=24, dtype=torch.bfloat16, device=DEV)
    a = torch.randn(2048, 2048, device=DEV)
    for step, N in enumerate((300, 17, 255)):
        ngram = torch.randint(0, 99092, (N, 4), generator=_g(100 + step)).to(DEV)
        hashes = ops.engram_hash(ngram, mult, primes, offsets)
        pf.start(hashes)
        del hashes  # its memory must not be reused before the side stream has read it
        junk = torch.randint(0, 10, (N, 2, 24), device=DEV)  # may take the freed block
        for _ in range(4):  # the layers before the Engram layer
            a = torch.tanh(a @ a * 1e-3)
        want = ops.engram_hash(ngram, mult, primes, offsets)
        for l in range(2):
            rows = pf.rows(l).clone()
            assert rows.shape == (N, 24, 256)
            _same(rows, ops.engram_lookup(*tabs[l], want[:, l], torch.bfloat16))
        del junk


@pytest.mark.parametrize("placement", ["device", "host"])
def test_prefetch_in_model_steps(placement):
    """attach_prefetch on the tiny V4.1 model's hasher and tables: the step's lookups return
    the prefetched rows, equal to the direct lookups; ids the prefetch did not start (e.g. cut
    by a replay) fall back to the lookup."""
    from deepfuse.models import tiny
    from deepfuse.models.v41_random import random_model
    from deepfuse.models.v41_config import V41Config

    # built on the CPU (its token map needs no tokenizer); only the tables move (the hasher's
    # constants follow the ids)
    model = random_model(V41Config.from_dict(tiny.CONFIG_V41), device="cpu", dtype=torch.float32, quant=None,
                         expert_quant=None)
    hasher = model.engram_hasher
    tables = model.engram_tables()
    for t in tables:
        t.place(t.weight, t.scale, torch.device(DEV), placement)
    N = 23
    ids = torch.randint(0, model.cfg.vocab_size, (N,), generator=_g(4)).to(DEV)
    positions = torch.arange(N, device=DEV) + 5
    starts = torch.full((N,), 5, device=DEV)
    hist = torch.randint(0, 1000, (N, hasher.max_ngram - 1), generator=_g(5)).to(DEV)
    plain = hasher.step_hashes(ids, positions, starts, hist)
    want = [t(plain[:, l], torch.float32) for l, t in enumerate(tables)]
    pf = attach_prefetch(model, max_tokens=64, dtype=torch.float32, device=DEV)
    assert pf is not None
    h = hasher.step_hashes(ids, positions, starts, hist)
    assert torch.equal(h, plain) and pf.n == N
    for l, t in enumerate(tables):
        got = t(h[:, l], torch.float32)
        assert got.data_ptr() == pf.bufs[l].data_ptr()  # served from the prefetch buffer
        _same(got, want[l])
        other = t(plain[:, l], torch.float32)  # not the started ids: looked up as before
        assert other.data_ptr() != pf.bufs[l].data_ptr()
        _same(other, want[l])


def _engine_tokens(model, prompts, **kw):
    from deepfuse.engine import LLM, SamplingParams

    llm = LLM(model, max_model_len=64, max_num_batched_tokens=32, **kw)
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=1))
    return llm.engine, [(o.token_ids, o.logprobs) for o in outs]


def test_engine_prefetch_host_tables():
    """The engine attaches the prefetch (engram_state.engine_prefetch, before the memory plan)
    when the tiny V4.1 model's tables sit in pinned host memory on CUDA: its steps' Engram rows
    come from the prefetch buffers, and tokens and logprobs equal the same engine without the
    prefetch (the switch model.engram_prefetch = False) bit for bit. A second engine on the
    model reuses the prefetch; HBM tables get none."""
    import dataclasses

    from deepfuse.engine.engram_state import detach_prefetch
    from deepfuse.models import tiny
    from deepfuse.models.v41_config import V41Config
    from deepfuse.models.v41_random import random_model

    cfg = dataclasses.replace(V41Config.from_dict(tiny.CONFIG_V41), engram_placement="host").validate()
    model = random_model(cfg, device=DEV, dtype=torch.bfloat16, quant=None, expert_quant=None, seed=3)
    assert all(t.weight.device.type == "cpu" and t.weight.is_pinned() for t in model.engram_tables())
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=_g(n)).tolist() for n in (5, 17, 30)]
    eng, got = _engine_tokens(model, prompts)
    pf = eng.engram_prefetch
    assert pf is not None and pf is model._engram_prefetch and pf.max_tokens == 32
    assert attach_prefetch(model, 16) is pf  # no device given: host tables, the model's GPU (weights are buffers)
    served = []
    rows = pf.rows
    pf.rows = lambda l: served.append(l) or rows(l)
    eng2, again = _engine_tokens(model, prompts)
    assert eng2.engram_prefetch is pf and again == got and len(served) >= 2 * len(model.engram_tables())
    detach_prefetch(model)
    model.engram_prefetch = False
    eng3, plain = _engine_tokens(model, prompts)
    assert eng3.engram_prefetch is None and plain == got
    hbm = random_model(dataclasses.replace(cfg, engram_placement="device"), device=DEV, dtype=torch.bfloat16,
                       quant=None, expert_quant=None, seed=3)
    eng4, dev_out = _engine_tokens(hbm, prompts)
    assert eng4.engram_prefetch is None and [t for t, _ in dev_out] == [t for t, _ in got]


# ----------------------------------------------------------------------------- sanitizer
@pytest.mark.sanitize
def test_engram_sanitize_small():
    """Every kernel of csrc/engram once, small, for compute-sanitizer (tools/gpu/gpu_run.sh)."""
    g = _g(31)
    mult, primes, offsets = (t.to(DEV) for t in _consts(2, 3, 2, 50, seed=4))
    R = int(primes.sum(1).max())
    w, s = _table(R, 64, g)
    ngram = torch.randint(0, 99092, (9, 3), generator=g).to(DEV)
    hashes = ops.engram_hash(ngram, mult, primes, offsets)
    for tw, ts in ((w.to(DEV), s.to(DEV)), (E.to_host(w), E.to_host(s))):
        rows = ops.engram_lookup(tw, ts, hashes[:, 1], torch.bfloat16)
        fused = E.engram_embed(ngram, mult[1], primes[1], offsets[1], tw, ts, torch.bfloat16)
        _same(fused, rows)
        _same(rows, E.engram_lookup_ref(w, s, hashes[:, 1].cpu(), torch.bfloat16))
    x, kv, wh, we = (t.to(DEV) for t in _gate_inputs(5, 4, 40, torch.bfloat16, g))
    out = ops.engram_gate(x, kv, wh, we)
    torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all()
