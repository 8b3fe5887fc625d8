"""wo_a reading the attention's MXFP8 output (models/attention.py WO_A_MXFP8; on CUDA by default):
decode steps of the engine against the same steps with bf16 attention output. The MXFP8 rounding of
the attention output (e4m3, one UE8M0 scale per 32 values: <= 2^-4 relative per element) is the
only difference; prefill steps (more than STREAM_MAX_M rows) must stay identical. A wrong layout (groups,
scales) gives errors of order 1; the MXFP8 rounding alone gives ~0.1 on the random tiny model (CPU: the
bf16 path has no activation rounding there) and, on the GPU, errors of the order of the FP8 activation
rounding the bf16 path already has (per-128 e4m3 casts in the linears)."""
import pytest
import torch

from engine_util import run_chunks
from v4_oracle import ids, rel_err

from deepfuse.models import attention as attn_mod


def _both(model, x, cuts, monkeypatch, **kw):
    monkeypatch.setattr(attn_mod, "WO_A_MXFP8", False)
    ref = run_chunks(model, x, cuts, **kw)
    monkeypatch.setattr(attn_mod, "WO_A_MXFP8", True)
    mx = run_chunks(model, x, cuts, **kw)
    return ref, mx


@torch.no_grad()
def test_tiny_fp8_cpu_decode_steps(monkeypatch, tmp_path):
    from deepfuse.models import tiny

    model = tiny.load(tmp_path, quant="fp8", dtype=torch.float32)
    assert model.layers[0].attn.wo_a.fmt == "fp8"
    x = ids(2, 140, model.cfg.vocab_size, seed=5)
    cuts = [0, 130] + list(range(131, 141))
    ref, mx = _both(model, x, cuts, monkeypatch)
    assert torch.equal(ref[:, :130], mx[:, :130])  # the prefill step (260 rows) keeps bf16
    err = rel_err(mx[:, 130:], ref[:, 130:])
    print(f"tiny fp32, wo_a from MXFP8: decode logits rel err {err:.2e}")
    assert 0 < err <= 0.15


@pytest.mark.gpu
@torch.no_grad()
def test_flash_width_gpu_decode_steps(monkeypatch):
    from deepfuse import ops
    from deepfuse.models import random as rnd
    from deepfuse.models.config import CSA, HCA, SWA

    cfg = rnd.flash_config([SWA, CSA, HCA])
    model = rnd.build(cfg, device="cuda", dtype=torch.bfloat16, quant="fp8", expert_quant="fp8")
    x = ids(2, 1040, cfg.vocab_size, seed=12).cuda()
    cuts = [0, 1024] + list(range(1025, 1041))
    ref, mx = _both(model, x, cuts, monkeypatch, kv_dtype="fp8", page_size=64)
    assert torch.equal(ref[:, :1024], mx[:, :1024])
    err = rel_err(mx[:, 1024:], ref[:, 1024:])
    ops.set_activation_quant(False)
    try:
        exact = _both(model, x, cuts, monkeypatch, kv_dtype="fp8", page_size=64)[0]
    finally:
        ops.set_activation_quant(True)
    yard = rel_err(ref[:, 1024:], exact[:, 1024:])
    print(f"V4-Flash width, wo_a from MXFP8: decode logits rel err {err:.2e} (FP8 activations vs exact: {yard:.2e})")
    assert torch.isfinite(mx).all() and 0 < err <= max(2 * yard, 0.02)
