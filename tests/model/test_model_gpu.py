"""The V4 graph on the GPU (ops run their CUDA kernels where they exist, else their
references) against the CPU fp32 run of the same tiny checkpoint."""
import pytest
import torch

from engine_util import run_chunks
from v4_oracle import ids, rel_err

from deepfuse.models import tiny

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return root, tiny.load(root, dtype=torch.float32)


@torch.no_grad()
def test_fp32_gpu_matches_cpu(ckpt):
    root, cpu = ckpt
    gpu = tiny.load(root, device="cuda", dtype=torch.float32)
    assert gpu.layers[1].attn.wq_a.weight.is_cuda
    x = ids(2, 300, cpu.cfg.vocab_size)
    ref = cpu(x)
    out = gpu(x.cuda())
    assert out.is_cuda and out.dtype == torch.float32
    err = rel_err(out.cpu(), ref)
    print(f"tiny fp32 GPU vs CPU: rel err {err:.2e}")
    assert err <= 1e-3  # reduction order only (a near-tie in the indexer top-k could flip)


@torch.no_grad()
def test_bf16_gpu_close_to_cpu_fp32(ckpt):
    root, cpu = ckpt
    gpu = tiny.load(root, device="cuda", dtype=torch.bfloat16)
    x = ids(2, 300, cpu.cfg.vocab_size, seed=2)
    out = gpu(x.cuda()).cpu()
    assert torch.isfinite(out).all()
    err = rel_err(out, cpu(x))
    print(f"tiny bf16 GPU vs fp32 CPU: rel err {err:.2e}")
    assert err <= 0.2  # bf16 noise flips some MoE / indexer selections of this random model


@torch.no_grad()
def test_gpu_incremental_decode_matches_full(ckpt):
    root, _ = ckpt
    gpu = tiny.load(root, device="cuda", dtype=torch.float32)
    x = ids(2, 160, gpu.cfg.vocab_size, seed=3).cuda()
    full = gpu(x)
    inc = run_chunks(gpu, x, [0, 120] + list(range(121, 161)))
    err = rel_err(inc.cpu(), full.cpu())
    print(f"tiny fp32 GPU prefill 120 + 40 decode vs full: rel err {err:.2e}")
    assert err <= 1e-4


@pytest.mark.parametrize("quant", ["fp8", "mxfp4"])
@torch.no_grad()
def test_quantised_tiny_on_gpu(tmp_path, quant):
    cpu = tiny.load(tmp_path, quant=quant, dtype=torch.float32)
    gpu = tiny.load(tmp_path, quant=quant, device="cuda", dtype=torch.bfloat16)
    assert gpu.layers[1].ffn.experts.fmt == quant and gpu.layers[1].ffn.experts.w1.is_cuda
    x = ids(2, 200, cpu.cfg.vocab_size, seed=4)
    out = gpu(x.cuda()).cpu()
    assert torch.isfinite(out).all()
    assert rel_err(out, cpu(x)) <= 0.2


@pytest.mark.parametrize("experts", ["fp8", "mxfp4"])
@torch.no_grad()
def test_v4_flash_width_kernels_match_reference_path(experts):
    """A 2-layer random V4-Flash-width model (FP8 linears): logits with every kernel (FP8
    activations in the linears and experts) against the same model on the reference paths
    (exact dequantised weights). Bound: relative logits error <= 0.1; greedy agreement is
    reported (random models have flat logits, so it is not asserted beyond 0.5)."""
    from deepfuse import ops
    from deepfuse.models import random as rnd
    from deepfuse.models.config import CSA, SWA

    cfg = rnd.flash_config([SWA, CSA])
    model = rnd.build(cfg, device="cuda", dtype=torch.bfloat16, quant="fp8", expert_quant=experts)
    x = ids(1, 48, cfg.vocab_size, seed=9).cuda()
    fast = model(x)
    ops.set_activation_quant(False)
    try:
        ref = model(x)
    finally:
        ops.set_activation_quant(True)
    err = rel_err(fast, ref)
    agree = (fast.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"V4-Flash width, {experts} experts: logits rel err {err:.4f}, greedy agreement {agree:.3f}")
    assert torch.isfinite(fast).all()
    assert err <= 0.1 and agree >= 0.5


@torch.no_grad()
def test_v4_flash_width_engine_step_kernels_match_references():
    """The engine's flat step at V4-Flash widths (SWA, CSA, HCA layers; FP8 caches; a 2200-token
    prefill in two chunks, so the CSA layer's indexer selects 512 of 550 entries, then decode
    steps) with every kernel against the same model and caches with the kernels switched off
    (references on the GPU; exact dequantised weights). Bound: relative logits error <= 0.1
    over the decode rows; greedy agreement reported."""
    from engine_util import run_chunks

    from deepfuse import _ext
    from deepfuse.models import random as rnd
    from deepfuse.models.config import CSA, HCA, SWA

    cfg = rnd.flash_config([SWA, CSA, HCA])
    model = rnd.build(cfg, device="cuda", dtype=torch.bfloat16, quant="fp8", expert_quant="fp8")
    x = ids(2, 2208, cfg.vocab_size, seed=11).cuda()
    cuts = [0, 1100, 2200] + list(range(2201, 2209))
    fast = run_chunks(model, x, cuts, kv_dtype="fp8", page_size=64)[:, 2200:]
    prev = _ext.set_kernels_enabled(False)
    try:
        ref = run_chunks(model, x, cuts, kv_dtype="fp8", page_size=64)[:, 2200:]
    finally:
        _ext.set_kernels_enabled(prev)
    err = rel_err(fast, ref)
    agree = (fast.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"V4-Flash width engine step (fp8 caches): logits rel err {err:.4f}, greedy agreement {agree:.3f}")
    assert torch.isfinite(fast).all()
    assert err <= 0.1
