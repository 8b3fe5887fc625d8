"""grouped_linear_mx (MXFP8 activations: e4m3 + UE8M0 per 32, the attention op's out_format="mxfp8",
as wo_a reads them) and block-diagonal weights through the streaming kernel (ops.linear.STREAM_GROUPED).

grouped_linear_mx: the kernel keeps x's e4m3 values and promotes each 32-value group with its scale,
so the check is against the exact product of the dequantised operands (float64): every element
|y - emu| <= 2^-8 |emu| + 2^-10 sum_k |x_k w_k| (bf16 output rounding plus the tensor cores'
reduced-precision accumulation, as the mxfp4 bound of test_linear_gpu.py); outputs poisoned
(launcher calls), a second call bit-equal, M > 64 through the fallback (dequantise, bf16 path),
a CUDA graph replayed with new inputs. STREAM_GROUPED: bf16 x through the streaming kernel against
the per-128 activation rounding's emulation (test_linear_gpu.py's bound).
"""
import pytest
import torch

from deepfuse import _ext, ops
from deepfuse.ops import linear as L

gpu = pytest.mark.gpu
DEV = "cuda"
needs_ext = pytest.mark.skipif(not _ext.has_cuda_kernels(), reason="needs the compiled extension")


def make_weight(N, K, fmt, g):
    w = torch.randn(N, K, device=DEV, generator=g) * K ** -0.5
    if fmt == "fp8":
        return ops.fp8_block_cast(w, (128, 128), scale_fmt="ue8m0")
    return ops.mxfp4_cast(w)


def make_x(lead, G, Kg, g):
    """MXFP8 x with scales spread: some 32-groups of some rows scaled down by 2^-12."""
    x = torch.randn(*lead, G, Kg, device=DEV, generator=g)
    x.view(-1, Kg)[::3, 32:64] *= 2.0 ** -12
    q, s = ops.mxfp8_cast(x.reshape(-1, Kg).contiguous())
    return q.view(*lead, G, Kg), s.view(*lead, G, Kg // 32)


def check(y, xq, xs, w, s, fmt):
    G, Kg = xq.shape[-2], xq.shape[-1]
    R = w.shape[0] // G
    xd = L._mx_dequant(xq, xs, torch.float32).double()
    wd = L.dequant_weight(w, s, fmt).double().view(G, R, Kg)
    emu = torch.einsum("...gk,grk->...gr", xd, wd)
    mag = torch.einsum("...gk,grk->...gr", xd.abs(), wd.abs())
    yf = y.double()
    assert torch.isfinite(yf).all(), "unwritten (poisoned) or non-finite outputs"
    err = (yf - emu).abs()
    bad = err > 2.0 ** -8 * emu.abs() + 2.0 ** -10 * mag
    assert not bad.any(), f"{int(bad.sum())} off; max err / mag {(err / mag.clamp_min(1e-300)).max().item():.3g}"


def check_per128(y, xq, xs, w, s, fmt):
    G, Kg = xq.shape[-2], xq.shape[-1]
    R = w.shape[0] // G
    x = L._mx_dequant(xq, xs, torch.bfloat16).float()
    q, sc = ops.fp8_per_token_cast(x.reshape(-1, Kg).contiguous(), 128)
    xe = ops.fp8_per_token_dequant(q, sc, dtype=torch.float32).view(x.shape)
    emu = torch.einsum("...gk,grk->...gr", xe, L.dequant_weight(w, s, fmt).view(G, R, Kg))
    yf = y.float()
    bad = (yf - emu).abs() > 2e-2 * emu.abs() + 1e-2 * emu.abs().max()
    assert not bad.any(), int(bad.sum())


def launch_mx(xq, xs, w, s, out, splits=8):
    M, G, Kg = xq.shape
    _ext._C.fp8_linear(x=xq, x_scale=xs, w=w, w_scale=s, out=out,
                       workspace=torch.empty(0, dtype=torch.uint8, device=DEV),
                       stream_max_m=64, stream_max_splits=splits, stream_grouped=True)
    return out


# (lead, G, Kg, R): wo_a (8 x 4096 -> 8 x 1024) at M = 1 / 33 / 64, small groups, K % 128 != 0 (fp8),
# M > 64 (the fallback)
MX_CASES = [((1,), 8, 4096, 1024), ((33,), 8, 4096, 1024), ((64,), 8, 4096, 1024), ((5, 3), 2, 256, 128),
            ((7,), 3, 160, 128), ((2,), 1, 1024, 4096), ((70,), 2, 256, 128)]


@gpu
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("lead,G,Kg,R", MX_CASES)
def test_grouped_linear_mx_matches_reference(fmt, lead, G, Kg, R):
    if fmt == "mxfp4" and Kg % 128:
        pytest.skip("mxfp4 needs K % 128 == 0")
    g = torch.Generator(device=DEV).manual_seed(G * Kg + R + sum(lead))
    w, s = make_weight(G * R, Kg, fmt, g)
    xq, xs = make_x(lead, G, Kg, g)
    y = L.grouped_linear_mx(xq, xs, w, s, fmt)
    assert y.shape == (*lead, G, R) and y.dtype == torch.bfloat16
    M = xq.numel() // (G * Kg)
    if M <= 64:
        check(y, xq, xs, w, s, fmt)
    else:  # the fallback (dequantise, grouped_linear): per-128 activation rounding, test_linear_gpu's bound
        check_per128(y, xq, xs, w, s, fmt)
    assert torch.equal(y, L.grouped_linear_mx(xq, xs, w, s, fmt)), "not deterministic"
    if M <= 64:  # the launcher on poisoned outputs, with and without cluster K splits
        x3, s3 = xq.reshape(M, G, Kg), xs.reshape(M, G, Kg // 32)
        for splits in (8, 1):
            out = torch.full((M, G, R), float("nan"), dtype=torch.bfloat16, device=DEV)
            try:
                launch_mx(x3, s3, w, s, out, splits)
            except ValueError as e:  # a plan that needs more K splits than allowed
                assert splits == 1 and "served by the streaming kernel only" in str(e)
                continue
            check(out.view(y.shape), xq, xs, w, s, fmt)
            if splits == 8:
                assert torch.equal(out.view(y.shape), y)


@gpu
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_grouped_linear_mx_graph_capturable(fmt):
    g = torch.Generator(device=DEV).manual_seed(21)
    w, s = make_weight(8 * 1024, 4096, fmt, g)
    xq, xs = make_x((2,), 8, 4096, g)
    want = L.grouped_linear_mx(xq, xs, w, s, fmt)
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        L.grouped_linear_mx(xq, xs, w, s, fmt)
    torch.cuda.current_stream().wait_stream(st)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = L.grouped_linear_mx(xq, xs, w, s, fmt)
    y.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, want)
    xq2, xs2 = make_x((2,), 8, 4096, g)
    xq.copy_(xq2), xs.copy_(xs2)
    graph.replay()
    check(y, xq, xs, w, s, fmt)


@gpu
@pytest.mark.parametrize("splits", [8, 1])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("lead,G,Kg,R", [((1,), 8, 4096, 1024), ((40,), 8, 4096, 1024), ((5, 3), 2, 256, 128),
                                         ((64,), 4, 512, 256)])
def test_grouped_linear_streaming(fmt, lead, G, Kg, R, splits, monkeypatch):
    """bf16 x, block-diagonal w through the streaming kernel (STREAM_GROUPED) within the per-128
    activation rounding's emulation bound, as the grouped kernel on the same inputs; deterministic."""
    monkeypatch.setattr(L, "STREAM_GROUPED", True)
    monkeypatch.setattr(L, "STREAM_MAX_SPLITS", splits)
    g = torch.Generator(device=DEV).manual_seed(G * Kg + R + splits)
    w, s = make_weight(G * R, Kg, fmt, g)
    x = torch.randn(*lead, G, Kg, device=DEV, generator=g).to(torch.bfloat16)
    y = ops.grouped_linear(x, w, s, fmt)
    wd = L.dequant_weight(w, s, fmt).view(G, R, Kg)
    q, sc = ops.fp8_per_token_cast(x.reshape(-1, Kg).float().contiguous(), 128)
    xq = ops.fp8_per_token_dequant(q, sc, dtype=torch.float32).view(*lead, G, Kg)
    emu = torch.einsum("...gk,grk->...gr", xq, wd)
    yf = y.float()
    assert torch.isfinite(yf).all()
    bad = (yf - emu).abs() > 2e-2 * emu.abs() + 1e-2 * emu.abs().max()
    assert not bad.any(), int(bad.sum())
    assert torch.equal(y, ops.grouped_linear(x, w, s, fmt)), "not deterministic"


@gpu
@pytest.mark.sanitize
def test_linear_mx_sanitize_small():
    g = torch.Generator(device=DEV).manual_seed(23)
    for fmt in ("fp8", "mxfp4"):
        for lead, G, Kg, R in (((3,), 2, 256, 128), ((40,), 2, 1024, 128), ((1,), 4, 2048, 256)):
            w, s = make_weight(G * R, Kg, fmt, g)
            xq, xs = make_x(lead, G, Kg, g)
            assert torch.isfinite(L.grouped_linear_mx(xq, xs, w, s, fmt)).all()
            x = torch.randn(*lead, G, Kg, device=DEV, generator=g).to(torch.bfloat16)
            k = (L.STREAM_GROUPED, L.STREAM_MAX_SPLITS)
            L.STREAM_GROUPED, L.STREAM_MAX_SPLITS = True, 8
            try:
                assert torch.isfinite(ops.grouped_linear(x, w, s, fmt)).all()
            finally:
                L.STREAM_GROUPED, L.STREAM_MAX_SPLITS = k
    torch.cuda.synchronize()


@needs_ext
def test_fp8_linear_launcher_checks_mx_x():
    FP8 = torch.float8_e4m3fn
    w = torch.zeros(256, 256, dtype=FP8)
    s = torch.zeros(2, 2)
    a = dict(w=w, w_scale=s, out=torch.empty(4, 2, 128, dtype=torch.bfloat16),
             workspace=torch.empty(0, dtype=torch.uint8))
    x8 = torch.zeros(4, 2, 256, dtype=torch.uint8).view(FP8)
    with pytest.raises(ValueError, match=r"argument 'x' must be bfloat16 or float32"):
        _ext._C.fp8_linear(x=x8, **a)
    with pytest.raises(ValueError, match=r"argument 'x' must be float8_e4m3fn"):
        _ext._C.fp8_linear(x=x8.float().bfloat16(), x_scale=torch.zeros(4, 2, 8, dtype=torch.uint8), **a)
    with pytest.raises(ValueError, match=r"argument 'x_scale' must have shape \[4, 2, 8\]"):
        _ext._C.fp8_linear(x=x8, x_scale=torch.zeros(4, 2, 2, dtype=torch.uint8), **a)
    with pytest.raises(ValueError, match=r"argument 'x_scale' must be uint8"):
        _ext._C.fp8_linear(x=x8, x_scale=torch.zeros(4, 2, 8), **a)
    with pytest.raises(ValueError, match=r"argument 'x' must be a CUDA tensor"):
        _ext._C.fp8_linear(x=x8, x_scale=torch.zeros(4, 2, 8, dtype=torch.uint8), **a)


def test_grouped_linear_mx_checks():
    FP8 = torch.float8_e4m3fn
    w, s = torch.zeros(256, 256, dtype=FP8), torch.zeros(2, 2)
    xq = torch.zeros(4, 2, 256, dtype=torch.uint8).view(FP8)
    with pytest.raises(ValueError, match="xs"):
        L.grouped_linear_mx(xq, torch.zeros(4, 2, 4, dtype=torch.uint8), w, s, "fp8")
    with pytest.raises(ValueError, match="not a multiple of the 3 groups"):
        L.grouped_linear_mx(torch.zeros(4, 3, 256, dtype=torch.uint8).view(FP8),
                            torch.zeros(4, 3, 8, dtype=torch.uint8), w, s, "fp8")
    y = L.grouped_linear_mx(xq, torch.full((4, 2, 8), 127, dtype=torch.uint8), w, s, "fp8")  # the CPU reference
    assert y.shape == (4, 2, 128) and y.dtype == torch.bfloat16 and not y.any()


def test_grouped_linear_mx_opcheck_cpu():
    g = torch.Generator().manual_seed(5)
    w, s = ops.fp8_block_cast(torch.randn(256, 256, generator=g), (128, 128), scale_fmt="ue8m0")
    xq, xs = ops.mxfp8_cast(torch.randn(6, 256, generator=g))
    # (test_schema compares the e4m3 inputs with arithmetic torch lacks on the CPU)
    torch.library.opcheck(torch.ops.deepfuse.grouped_linear_mx.default,
                          (xq.view(3, 2, 256), xs.view(3, 2, 8), w, s, "fp8"),
                          test_utils=("test_autograd_registration", "test_faketensor"))
