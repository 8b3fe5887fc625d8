"""deepfuse.models against the transformers oracle (DeepseekV4ForCausalLM), fp32 on the CPU.

Checkpoints are written by the oracle's save_pretrained (and, for the official key naming
with MTP tensors, by models.tiny, then read by the oracle's from_pretrained). Logits must
agree to a relative error (over the whole [B, T, vocab] tensor) of 1e-4; we see ~1e-6.
"""
import warnings

import pytest
import torch

from deepfuse.engine import generate
from engine_util import run_chunks
from v4_oracle import CONFIGS, canonical_ties, ids, load_ours, oracle_checkpoint, rel_err, one_thread  # noqa: F401

pytest.importorskip("transformers")

TOL = 1e-4
# lengths cross the window, ~T/4 CSA entries (>> index_topk) and 2-3 HCA (128:1) entries
LENGTHS = {"hc2": 300, "hc4": 400}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    name = request.param
    m, path = oracle_checkpoint(tmp_path_factory.mktemp("ckpt"), name)
    return name, m, load_ours(path, dtype=torch.float32), path


@torch.no_grad()
def test_full_forward_matches_oracle(pair):
    name, m, ours, _ = pair
    x = ids(2, LENGTHS[name], m.config.vocab_size)
    ref = m(x).logits
    out = ours(x)
    assert out.shape == ref.shape and out.dtype == torch.float32
    err = rel_err(out, ref)
    print(f"{name}: full forward T={x.shape[1]} rel err {err:.2e}")
    assert err <= TOL


@torch.no_grad()
def test_every_layer_kind_present(pair):
    name, m, ours, _ = pair
    kinds = {layer.attn.layer_type for layer in ours.layers}
    assert kinds == {"sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"}
    assert any(layer.ffn.is_hash for layer in ours.layers) and not all(layer.ffn.is_hash for layer in ours.layers)
    assert ours.cfg.hc_mult == m.config.hc_mult


@torch.no_grad()
def test_incremental_decode_matches_full_forward(pair):
    """The engine's flat forward over its paged caches ("auto": lossless): prefill, then one
    token at a time (and a chunked schedule) == one full forward, logits of every row."""
    name, m, ours, _ = pair
    T = 260
    x = ids(2, T, m.config.vocab_size, seed=2)
    full = ours(x)
    inc = run_chunks(ours, x, [0, 100] + list(range(101, T + 1)))
    err = rel_err(inc, full)
    print(f"{name}: prefill 100 + {T - 100} decode steps rel err {err:.2e}")
    assert err <= TOL
    chunked = run_chunks(ours, x, [0, 3, 5, 131, 132, 257, T])
    assert rel_err(chunked, full) <= TOL
    # and the oracle agrees on the same positions
    assert rel_err(full, m(x).logits) <= TOL


@torch.no_grad()
def test_greedy_generation_matches_oracle(pair):
    name, m, ours, _ = pair
    prompt = ids(2, 100, m.config.vocab_size, seed=3)
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # an explicit mask: generate() would otherwise take token 0 (= pad) for padding
        ref = m.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=60, do_sample=False)
    out = generate(ours, prompt, 60)
    assert out.shape == ref.shape == (2, 160)  # crosses the first HCA boundary (128)
    assert torch.equal(out, ref)


@torch.no_grad()
def test_official_naming_checkpoint_loads_in_both(tmp_path):
    """models.tiny writes the official key naming (embed, head, hc_head_fn, attn.kv_norm,
    mtp.0.*); the oracle reads it through its own conversion mapping."""
    from transformers import DeepseekV4ForCausalLM

    from deepfuse.models import tiny

    path = tiny.write(tmp_path / "tiny", dtype=torch.float32)
    ours = load_ours(path, dtype=torch.float32)
    assert len(ours.mtp) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_model = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    x = ids(2, 300, ours.cfg.vocab_size, seed=4)
    with canonical_ties():  # the tiny model's indexer scores tie (ReLU zeros): one tie rule on both sides
        ref = ref_model(x).logits
    err = rel_err(ours(x), ref)
    print(f"tiny (official naming): rel err {err:.2e}")
    assert err <= TOL


@torch.no_grad()
def test_bf16_load_runs_close_to_fp32(pair):
    name, m, ours, path = pair
    x = ids(1, 200, m.config.vocab_size, seed=5)
    b = load_ours(path, dtype=torch.bfloat16)
    assert b.layers[0].attn.wq_a.weight.dtype == torch.bfloat16
    assert b.layers[0].attn_norm.weight.dtype == torch.float32
    out = b(x)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert rel_err(out, ours(x)) < 0.1
