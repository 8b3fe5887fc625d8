"""MXFP4 experts on the prefill path (csrc/moe/moe_prefill.cu, moe_prefill_mx_kernel) on the GPU.

The packed e2m1 weights are decoded to e4m3 in shared memory by decode warps, each weight row's
four group scales of a 128-K chunk folded into the decoded values (exact while the chunk's
exponents lie within 14 of their largest; beyond, within 2^-16 of the chunk's largest group scale
per weight), promoted per chunk with 2^(s_max - 133) per weight row. Checked like
test_moe_gpu.py's prefill tests, every element: against the emulation of the kernel's activation
roundings (x and h to FP8 per 128, h to bf16) and against the exact reference (relative
Frobenius error <= 0.08), outputs poisoned with NaN first, bitwise reproducible. The path is set
with ops.moe.PREFILL_MXFP4_MIN_T (the fixture pins it at 257) and checked to have run (the kernel's
name in the profiler's trace). DEEPFUSE_MOE_PREFILL_MX_DEC=3 / DEEPFUSE_MOE_PREFILL_MX_STAGES=4 run the
kernel's other configurations (3 decode warps / 4 stages).
"""
import pytest
import torch
from test_moe_gpu import (DEV, check, check_prefill_graph_replay, emulated, make_experts, poison_allocator, routing,
                          run_kernel)

from deepfuse.ops import moe as M

pytestmark = pytest.mark.gpu
NAMES = ("w1", "w3", "w2")


@pytest.fixture
def mx_prefill(monkeypatch):
    """The prefill kernels for both formats from T = 257 on."""
    monkeypatch.setattr(M, "PREFILL_MIN_T", 257)
    monkeypatch.setattr(M, "PREFILL_MXFP4_MIN_T", 257)


def reference(x, ids, w, ex, limit, sh):
    return M.moe_experts_ref(x.float(), ids, w, *(ex[n][0] for n in NAMES), *(ex[n][1] for n in NAMES), "mxfp4",
                             limit, sh)


def kernels_run(fn):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as pr:
        out = fn()
        torch.cuda.synchronize()
    return out, {e.name for e in pr.events()}


MX_CASES = [  # T, d, I, E, k, kind, shared, x dtype, spread (group exponents moved down by 0..spread)
    (257, 256, 128, 8, 2, "random", False, torch.bfloat16, 0),
    (333, 512, 256, 16, 4, "random", True, torch.bfloat16, 0),
    (512, 256, 256, 8, 3, "one", True, torch.bfloat16, 0),       # one hot expert: many tasks of one expert
    (777, 384, 128, 32, 4, "few", False, torch.bfloat16, 11),    # most experts empty; K = 3 chunks
    (1000, 256, 128, 8, 3, "dropped", True, torch.bfloat16, 14),  # ids -1 / >= E; the exact fold's limit
    (4099, 256, 128, 16, 6, "one", False, torch.bfloat16, 0),    # large plan, 193 tasks
    (301, 256, 384, 8, 2, "random", True, torch.float32, 40),     # fp32 x; spreads past the exact fold
    (531, 640, 384, 16, 4, "random", True, torch.bfloat16, 3),    # odd chunk counts in both GEMMs
]


@pytest.mark.parametrize("T,d,I,E,k,kind,shared,dt,spread", MX_CASES)
def test_mxfp4_prefill_matches_reference(T, d, I, E, k, kind, shared, dt, spread, mx_prefill):
    g = torch.Generator(device=DEV).manual_seed(T * 7 + E)
    ex, sh = make_experts(E, I, d, "mxfp4", seed=T + 3, shared=shared, spread=spread)
    x = torch.randn(T, d, device=DEV, generator=g).to(dt)
    ids, w = routing(T, E, k, kind, g)
    poison_allocator()
    out, names = kernels_run(lambda: run_kernel(x, ids, w, ex, "mxfp4", 6.0, sh))
    assert any("moe_prefill_mx_kernel" in n for n in names), sorted(names)
    assert out.dtype == dt
    check(out, emulated(x, ids, w, ex, "mxfp4", 6.0, sh), reference(x, ids, w, ex, 6.0, sh))
    assert torch.equal(out, run_kernel(x, ids, w, ex, "mxfp4", 6.0, sh))  # bitwise reproducible


@pytest.mark.parametrize("T", [512, 4096])
def test_mxfp4_prefill_v4_flash_shape(T, mx_prefill):
    """V4-Flash (256 experts, top-6, d 4096, I 2048, fp8 shared expert), every element checked."""
    E, d, I, k = 256, 4096, 2048, 6
    g = torch.Generator(device=DEV).manual_seed(T + 5)
    ex, sh = make_experts(E, I, d, "mxfp4", seed=1, shared=True)
    x = torch.randn(T, d, device=DEV, generator=g).to(torch.bfloat16)
    ids, w = routing(T, E, k, "random", g)
    poison_allocator()
    out, names = kernels_run(lambda: run_kernel(x, ids, w, ex, "mxfp4", 10.0, sh))
    assert any("moe_prefill_mx_kernel" in n for n in names)
    rel = check(out, emulated(x, ids, w, ex, "mxfp4", 10.0, sh), reference(x, ids, w, ex, 10.0, sh))
    print(f"V4-Flash mxfp4 prefill T={T}: relative error vs exact reference {rel:.4f}")


def test_mxfp4_prefill_graph_capturable(mx_prefill):
    check_prefill_graph_replay("mxfp4", seed=19, spread=6)


@pytest.mark.sanitize
def test_mxfp4_prefill_sanitize_small():
    """Small mxfp4 prefill cases for compute-sanitizer: routed + shared tiles, dropped ids, spread scales."""
    keep = M.PREFILL_MIN_T, M.PREFILL_MXFP4_MIN_T
    M.PREFILL_MIN_T = M.PREFILL_MXFP4_MIN_T = 257
    try:
        for T, d, I, spread, shared in ((300, 256, 256, 40, True), (261, 384, 128, 0, False)):
            g = torch.Generator(device=DEV).manual_seed(T)
            ex, sh = make_experts(4, I, d, "mxfp4", seed=T, shared=shared, spread=spread)
            x = torch.randn(T, d, device=DEV, generator=g).to(torch.bfloat16)
            ids, w = routing(T, 4, 2, "dropped", g)
            out = run_kernel(x, ids, w, ex, "mxfp4", 6.0, sh)
            check(out, emulated(x, ids, w, ex, "mxfp4", 6.0, sh), reference(x, ids, w, ex, 6.0, sh))
    finally:
        M.PREFILL_MIN_T, M.PREFILL_MXFP4_MIN_T = keep
