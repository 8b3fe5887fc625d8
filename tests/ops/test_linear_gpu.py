"""quant_linear on the GPU (fp8 block-scaled and mxfp4 weights) against its reference.

The kernels quantise activations to FP8 per token per 128 (the reference does not), so the
check is against an emulation of that rounding (every element: |y - emu| <= 2e-2 |emu| +
1e-2 max|emu|) and against the exact reference (relative Frobenius error <= 0.05).
M <= 64 runs our weight-streaming kernel, larger M cuBLASLt (fp8) or our kernel (mxfp4).
"""
import pytest
import torch

from deepfuse import ops
from deepfuse.ops import linear as L

pytestmark = pytest.mark.gpu
DEV = "cuda"


def make_weight(N, K, fmt, scale_fmt, g):
    w = torch.randn(N, K, device=DEV, generator=g) * K ** -0.5
    if fmt == "fp8":
        return ops.fp8_block_cast(w, (128, 128), scale_fmt=scale_fmt)
    return ops.mxfp4_cast(w)


def emulated(x, w, s, fmt):
    q, sc = ops.fp8_per_token_cast(x.float().contiguous(), 128)
    xq = ops.fp8_per_token_dequant(q, sc, dtype=torch.float32)
    return xq @ L.dequant_weight(w, s, fmt).T


@pytest.mark.parametrize("fmt,scale_fmt", [("fp8", "ue8m0"), ("fp8", "fp32"), ("mxfp4", None)])
@pytest.mark.parametrize("M,K,N", [(1, 4096, 1024), (7, 1024, 4096), (64, 512, 640), (65, 4096, 1024),
                                   (300, 1024, 768), (1, 8192, 512), (33, 16384, 256)])
def test_quant_linear_matches_reference(fmt, scale_fmt, M, K, N):
    g = torch.Generator(device=DEV).manual_seed(M * 31 + N)
    w, s = make_weight(N, K, fmt, scale_fmt, g)
    x = torch.randn(M, K, device=DEV, generator=g).to(torch.bfloat16)
    y = ops.quant_linear(x, w, s, fmt)
    assert y.dtype == torch.bfloat16 and y.shape == (M, N) and torch.isfinite(y).all()
    emu = emulated(x, w, s, fmt)
    yf = y.float()
    bad = (yf - emu).abs() > 2e-2 * emu.abs() + 1e-2 * emu.abs().max()
    assert not bad.any(), f"{int(bad.sum())} off; max {(yf - emu).abs().max().item():.3g}"
    ref = L.quant_linear_ref(x.float(), w, s, fmt)
    assert ((yf - ref).norm() / ref.norm()).item() <= 0.05


@pytest.mark.parametrize("shape", [(3, 5, 160), (2, 96)])
def test_quant_linear_fp32_batched_and_tails(shape):
    """fp32 x with leading batch dims, K not a multiple of 128, N not a multiple of 64."""
    g = torch.Generator(device=DEV).manual_seed(7)
    K, N = shape[-1], 200
    w, s = make_weight(N, K, "fp8", "fp32", g)
    x = torch.randn(*shape, device=DEV, generator=g)
    y = ops.quant_linear(x, w, s, "fp8")
    assert y.dtype == torch.float32 and y.shape == (*shape[:-1], N)
    emu = emulated(x.reshape(-1, K), w, s, "fp8").view(*shape[:-1], N)
    torch.testing.assert_close(y, emu, rtol=2e-2, atol=1e-2 * emu.abs().max().item())


def test_activation_quant_switch_runs_the_reference():
    g = torch.Generator(device=DEV).manual_seed(1)
    w, s = make_weight(256, 512, "fp8", "ue8m0", g)
    x = torch.randn(4, 512, device=DEV, generator=g).to(torch.bfloat16)
    L.set_activation_quant(False)
    try:
        y = ops.quant_linear(x, w, s, "fp8")
    finally:
        L.set_activation_quant(True)
    torch.testing.assert_close(y, L.quant_linear_ref(x, w, s, "fp8"), rtol=0, atol=0)
    assert not torch.equal(ops.quant_linear(x, w, s, "fp8"), y)


def test_quant_linear_graph_capturable():
    g = torch.Generator(device=DEV).manual_seed(2)
    w, s = make_weight(1024, 2048, "fp8", "ue8m0", g)
    x = torch.randn(8, 2048, device=DEV, generator=g).to(torch.bfloat16)
    want = ops.quant_linear(x, w, s, "fp8")
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        ops.quant_linear(x, w, s, "fp8")
    torch.cuda.current_stream().wait_stream(st)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = ops.quant_linear(x, w, s, "fp8")
    y.fill_(float("nan"))
    graph.replay()
    assert torch.equal(y, want)


@pytest.mark.sanitize
def test_linear_sanitize_small():
    g = torch.Generator(device=DEV).manual_seed(3)
    for fmt in ("fp8", "mxfp4"):
        w, s = make_weight(192, 256, fmt, "ue8m0", g)
        for M in (3, 80):
            x = torch.randn(M, 256, device=DEV, generator=g).to(torch.bfloat16)
            assert torch.isfinite(ops.quant_linear(x, w, s, fmt)).all()
        wg, sg = make_weight(4 * 128, 256, fmt, "ue8m0", g)
        for M in (1, 70):
            xg = torch.randn(M, 4, 256, device=DEV, generator=g).to(torch.bfloat16)
            assert torch.isfinite(ops.grouped_linear(xg, wg, sg, fmt)).all()
    torch.cuda.synchronize()


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("lead,G,Kg,R", [((1,), 8, 4096, 1024), ((5, 3), 2, 256, 128), ((300,), 4, 512, 256)])
def test_grouped_linear_matches_reference(fmt, lead, G, Kg, R):
    """V4's wo_a: block-diagonal projection, group g of x through weight rows g R .. (g + 1) R."""
    g = torch.Generator(device=DEV).manual_seed(G * Kg + R)
    w, s = make_weight(G * R, Kg, fmt, "ue8m0", g)
    x = torch.randn(*lead, G, Kg, device=DEV, generator=g).to(torch.bfloat16)
    y = ops.grouped_linear(x, w, s, fmt)
    assert y.shape == (*lead, G, R) and y.dtype == torch.bfloat16
    wd = L.dequant_weight(w, s, fmt).view(G, R, Kg)
    q, sc = ops.fp8_per_token_cast(x.reshape(-1, Kg).float().contiguous(), 128)
    xq = ops.fp8_per_token_dequant(q, sc, dtype=torch.float32).view(*lead, G, Kg)
    emu = torch.einsum("...gk,grk->...gr", xq, wd)
    yf = y.float()
    bad = (yf - emu).abs() > 2e-2 * emu.abs() + 1e-2 * emu.abs().max()
    assert not bad.any(), int(bad.sum())
    ref = L.grouped_linear_ref(x.float(), w, s, fmt)
    assert ((yf - ref).norm() / ref.norm()).item() <= 0.05
