"""quant_linear on the GPU (fp8 block-scaled and mxfp4 weights) against its reference.

The kernels quantise activations to FP8 per token per 128 (the reference does not), so the
check is against an emulation of that rounding (every element: |y - emu| <= 2e-2 |emu| +
1e-2 max|emu|) and against the exact reference (relative Frobenius error <= 0.05).
Dense fp8 M <= 64 runs the persistent kernel (persist_linear.cu; launcher argument persist), dense
M <= 64 otherwise the one-launch streaming kernel (stream_linear.cu; the launcher's stream_max_m=0
selects the grouped kernel, checked on the same inputs), grouped weights the grouped kernel, larger
M cuBLASLt (fp8) or our kernel (mxfp4).
mxfp4 with fp32 x is also held to |y - emu| <= 2^-10 sum_k |xq_k w_k| (emu in float64), with
UE8M0 group scales spread within each 128-K chunk: the bound of the tensor cores' reduced
precision accumulation (docs/notes/moe.md, "MXFP4 group scales folded") that any accumulation
order of the kernel (per 32-value group, or folded per 128-K chunk) must meet.
The fp8_linear launcher's own checks (dtype, shape, device) run on the CPU too.
"""
import pytest
import torch

from deepfuse import _ext, ops
from deepfuse.ops import linear as L

gpu = pytest.mark.gpu
DEV = "cuda"
needs_ext = pytest.mark.skipif(not _ext.has_cuda_kernels(), reason="needs the compiled extension")


def make_weight(N, K, fmt, scale_fmt, g):
    w = torch.randn(N, K, device=DEV, generator=g) * K ** -0.5
    if fmt == "fp8":
        return ops.fp8_block_cast(w, (128, 128), scale_fmt=scale_fmt)
    return ops.mxfp4_cast(w)


def emulated(x, w, s, fmt):
    q, sc = ops.fp8_per_token_cast(x.float().contiguous(), 128)
    xq = ops.fp8_per_token_dequant(q, sc, dtype=torch.float32)
    return xq @ L.dequant_weight(w, s, fmt).T


@gpu
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


def spread_mx_scales(s, spread, g):
    """UE8M0 group exponents moved down by 0..spread each (apart within a 128-K chunk);
    spread < 0: one group of one row per 8 chunks moved down by -spread (a rare outlier)."""
    s = s.to(torch.int16)
    if spread >= 0:
        s = s - torch.randint(0, spread + 1, s.shape, device=DEV, generator=g, dtype=torch.int16)
    else:
        s[3, 1::32] += spread
    return s.clamp(1, 254).to(torch.uint8)


@gpu
@pytest.mark.parametrize("spread", [0, 11, 40, -30])  # group exponents 0, <= 11, <= 40 apart, one outlier
@pytest.mark.parametrize("M,K,N", [(1, 2048, 512), (33, 1024, 320), (80, 1024, 256)])
def test_quant_linear_mxfp4_within_the_accumulation_bound(spread, M, K, N):
    g = torch.Generator(device=DEV).manual_seed(M + K + spread)
    w, s = make_weight(N, K, "mxfp4", None, g)
    s = spread_mx_scales(s, spread, g)
    x = torch.randn(M, K, device=DEV, generator=g)
    y = ops.quant_linear(x, w, s, "mxfp4")
    assert y.dtype == torch.float32 and torch.isfinite(y).all()
    q, sc = ops.fp8_per_token_cast(x, 128)
    xq = ops.fp8_per_token_dequant(q, sc, dtype=torch.float32).double()
    wd = L.dequant_weight(w, s, "mxfp4").double()
    err, mag = (y.double() - xq @ wd.T).abs(), xq.abs() @ wd.abs().T
    print(f"mxfp4 spread {spread} M={M}: max |y - emu| / sum|xw| = {(err / mag.clamp_min(1e-300)).max().item():.3g}")
    assert (err <= 2.0 ** -10 * mag).all()


@gpu
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


@gpu
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


@gpu
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


@gpu
@pytest.mark.sanitize
def test_linear_sanitize_small():
    g = torch.Generator(device=DEV).manual_seed(3)
    for fmt in ("fp8", "mxfp4"):
        w, s = make_weight(192, 256, fmt, "ue8m0", g)
        if fmt == "mxfp4":  # one outlier group scale per 8 chunks
            s = spread_mx_scales(s, -30, g)
        for M in (3, 80):
            x = torch.randn(M, 256, device=DEV, generator=g).to(torch.bfloat16)
            assert torch.isfinite(ops.quant_linear(x, w, s, fmt)).all()
        wk, sk = make_weight(192, 2048, fmt, "ue8m0", g)  # 16 chunks: the streaming kernel's cluster K splits
        for M in (5, 40):
            x = torch.randn(M, 2048, device=DEV, generator=g).to(torch.bfloat16)
            out = torch.empty(M, 192, dtype=torch.bfloat16, device=DEV)
            assert torch.isfinite(_launch(x, wk, sk, out, 64, 8)).all()
        for K, N, M in ((256, 25600, 64), (2048, 3264, 3)):  # two warpgroups: no K split / cluster splits
            wk, sk = make_weight(N, K, fmt, "ue8m0", g)
            x = torch.randn(M, K, device=DEV, generator=g).to(torch.bfloat16)
            out = torch.empty(M, N, dtype=torch.bfloat16, device=DEV)
            assert torch.isfinite(_launch(x, wk, sk, out, 64, 8, wgs=2, policy=1)).all()
        wg, sg = make_weight(4 * 128, 256, fmt, "ue8m0", g)
        for M in (1, 70):
            xg = torch.randn(M, 4, 256, device=DEV, generator=g).to(torch.bfloat16)
            assert torch.isfinite(ops.grouped_linear(xg, wg, sg, fmt)).all()
    torch.cuda.synchronize()


@gpu
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


# ----------------------------------------------------------------------------- the streaming kernel (M <= 64)
def _launch(x, w, s, out, stream_max_m, splits=8, wgs=1, policy=0):
    work = torch.empty(_ext._C.fp8_linear_workspace_bytes(x=x, w=w, w_scale=s), dtype=torch.uint8, device=DEV)
    _ext._C.fp8_linear(x=x, w=w, w_scale=s, out=out, workspace=work, stream_max_m=stream_max_m,
                       stream_max_splits=splits, stream_wgs=wgs, stream_policy=policy)
    return out


def _check_against_emulation(y, x, w, s, fmt):
    emu = emulated(x, w, s, fmt)
    yf = y.float()
    assert torch.isfinite(yf).all(), "unwritten (poisoned) or non-finite outputs"
    bad = (yf - emu).abs() > 2e-2 * emu.abs() + 1e-2 * emu.abs().max()
    assert not bad.any(), f"{int(bad.sum())} off; max {(yf - emu).abs().max().item():.3g}"
    ref = L.quant_linear_ref(x.float(), w, s, fmt)
    assert ((yf - ref).norm() / ref.norm()).item() <= 0.05


# (K, N): one K split (wq_b-like), cluster K splits (2..8), odd N, K % 128 != 0 (fp8 only)
STREAM_SHAPES = [(1024, 4096), (4096, 512), (2048, 200), (8192, 320), (512, 1000), (160, 328)]


@gpu
@pytest.mark.parametrize("splits", [8, 1])
@pytest.mark.parametrize("fmt,scale_fmt", [("fp8", "ue8m0"), ("fp8", "fp32"), ("mxfp4", None)])
@pytest.mark.parametrize("M", [1, 2, 7, 8, 33, 64])
@pytest.mark.parametrize("K,N", STREAM_SHAPES)
def test_stream_linear_matches_reference(fmt, scale_fmt, M, K, N, splits):
    """Fresh random inputs, out poisoned with NaN, every element against the emulation bound;
    the grouped kernel (stream_max_m=0) on the same inputs within the same bound. splits 8: every
    shape through the streaming kernel (cluster K splits where its plan has them); 1: the default
    policy (only plans without K splits stream, the others run the grouped kernel)."""
    if fmt == "mxfp4" and K % 128:
        pytest.skip("mxfp4 needs K % 128 == 0")
    g = torch.Generator(device=DEV).manual_seed(M * 1009 + K + N)
    w, s = make_weight(N, K, fmt, scale_fmt, g)
    x = torch.randn(M, K, device=DEV, generator=g).to(torch.bfloat16)
    y = _launch(x, w, s, torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=DEV), 64, splits)
    _check_against_emulation(y, x, w, s, fmt)
    if splits == 8:
        y_old = _launch(x, w, s, torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=DEV), 0)
        _check_against_emulation(y_old, x, w, s, fmt)
    y2 = _launch(x, w, s, torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=DEV), 64, splits)
    assert torch.equal(y, y2), "not deterministic"


# (K, N) whose plans at M = 33 / 64 are one CTA per SM with >= 2 weight tiles (where stream_wgs=2
# runs two warpgroups; M <= 16 plans keep one): wq_b-like without K splits and with a partly filled
# last CTA (N = 33000: 516 tiles), cluster K splits (8192 x 4096), odd N (BT = 32 at M = 33).
WGS_SHAPES = [(1024, 33000), (8192, 4096), (2048, 20000)]


@gpu
@pytest.mark.parametrize("policy", [0, 1])
@pytest.mark.parametrize("splits", [8, 1])
@pytest.mark.parametrize("fmt,scale_fmt", [("fp8", "ue8m0"), ("fp8", "fp32"), ("mxfp4", None)])
@pytest.mark.parametrize("M", [1, 8, 33, 64])
@pytest.mark.parametrize("K,N", WGS_SHAPES)
def test_stream_linear_two_warpgroups(fmt, scale_fmt, M, K, N, splits, policy):
    """stream_wgs=2 (two consumer warpgroups per CTA), both plan policies: out poisoned, every
    element within the emulation bound, bit-equal to one warpgroup under the same policy (the same
    per-tile chunk order, promotions and split order) and to a second call."""
    if fmt == "mxfp4" and K % 128:
        pytest.skip("mxfp4 needs K % 128 == 0")
    g = torch.Generator(device=DEV).manual_seed(M * 7 + K + N + splits)
    w, s = make_weight(N, K, fmt, scale_fmt, g)
    x = torch.randn(M, K, device=DEV, generator=g).to(torch.bfloat16)
    poisoned = lambda: torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=DEV)  # noqa: E731
    y = _launch(x, w, s, poisoned(), 64, splits, wgs=2, policy=policy)
    _check_against_emulation(y, x, w, s, fmt)
    assert torch.equal(y, _launch(x, w, s, poisoned(), 64, splits, wgs=1, policy=policy)), "differs from one warpgroup"
    assert torch.equal(y, _launch(x, w, s, poisoned(), 64, splits, wgs=2, policy=policy)), "not deterministic"


@gpu
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("M,K,N", [(1, 4096, 256), (5, 1024, 640), (64, 8192, 128)])
def test_stream_linear_fp32_in_and_out(fmt, M, K, N):
    g = torch.Generator(device=DEV).manual_seed(M + K + N + 5)
    w, s = make_weight(N, K, fmt, "fp32", g)
    x = torch.randn(M, K, device=DEV, generator=g) * 3.0
    x[0, :128] *= 1e-3  # a token group of small values: its own fp32 scale
    y = _launch(x, w, s, torch.full((M, N), float("nan"), device=DEV), 64)
    assert y.dtype == torch.float32
    _check_against_emulation(y, x, w, s, fmt)


@gpu
@pytest.mark.parametrize("wgs", [1, 2])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_stream_linear_graph_capturable(fmt, wgs, monkeypatch):
    """One graph holding split-K (cluster) calls and a call without K splits (wq_b's shape);
    replay after poisoning, then with new inputs."""
    monkeypatch.setattr(L, "STREAM_MAX_SPLITS", 8)
    monkeypatch.setattr(L, "STREAM_WGS", wgs)
    monkeypatch.setattr(L, "PERSIST_FP8", False)  # the streaming kernel (the persistent one: its own test)
    g = torch.Generator(device=DEV).manual_seed(11)
    w1, s1 = make_weight(512, 8192, fmt, "ue8m0", g)
    w2, s2 = make_weight(4096, 1024, fmt, "ue8m0", g)
    w3, s3 = make_weight(32768, 1024, fmt, "ue8m0", g)
    x1 = torch.randn(3, 8192, device=DEV, generator=g).to(torch.bfloat16)
    x2 = torch.randn(40, 1024, device=DEV, generator=g).to(torch.bfloat16)
    x3 = torch.randn(1, 1024, device=DEV, generator=g).to(torch.bfloat16)
    calls = [(x1, w1, s1), (x2, w2, s2), (x3, w3, s3)]
    want = [ops.quant_linear(x, w, s, fmt) for x, w, s in calls]
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        ops.quant_linear(x1, w1, s1, fmt)
    torch.cuda.current_stream().wait_stream(st)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ys = [ops.quant_linear(x, w, s, fmt) for x, w, s in calls]
    for y in ys:
        y.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(y, w) for y, w in zip(ys, want))
    x1.copy_(torch.randn(3, 8192, device=DEV, generator=g).to(torch.bfloat16))  # new inputs, same graph
    x3.copy_(torch.randn(1, 1024, device=DEV, generator=g).to(torch.bfloat16))
    graph.replay()
    _check_against_emulation(ys[0], x1, w1, s1, fmt)
    _check_against_emulation(ys[2], x3, w3, s3, fmt)


# ----------------------------------------------------------------------------- the persistent kernel (fp8, M <= 64)
def _launch_persist(x, w, s, out):
    work = torch.empty(_ext._C.fp8_linear_workspace_bytes(x=x, w=w, w_scale=s, persist=True), dtype=torch.uint8,
                       device=DEV)
    work.fill_(0xFF)  # stale workspace: NaN bytes where nothing is written
    _ext._C.fp8_linear(x=x, w=w, w_scale=s, out=out, workspace=work, stream_max_m=0, persist=True)
    return out


# (K, N): wq_b (256 tiles, no K split), wo_b (32 tiles: K splits), 4 tiles x 32 chunks (many splits),
# a partial last tile (N = 200, 1000, 33000), K % 128 != 0 (a partial chunk), K = 128.
PERSIST_SHAPES = [(1024, 32768), (8192, 4096), (4096, 512), (2048, 200), (512, 1000), (160, 328), (1024, 33000),
                  (128, 384)]


@gpu
@pytest.mark.parametrize("scale_fmt", ["ue8m0", "fp32"])
@pytest.mark.parametrize("M", [1, 7, 16, 17, 33, 63, 64])
@pytest.mark.parametrize("K,N", PERSIST_SHAPES)
def test_persist_linear_matches_reference(scale_fmt, M, K, N):
    """persist=True: fresh random inputs, out poisoned with NaN, workspace stale, every element
    within the emulation bound; bit-equal to a second call (split order fixed: deterministic)."""
    g = torch.Generator(device=DEV).manual_seed(M * 131 + K + N)
    w, s = make_weight(N, K, "fp8", scale_fmt, g)
    x = torch.randn(M, K, device=DEV, generator=g).to(torch.bfloat16)
    poisoned = lambda: torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=DEV)  # noqa: E731
    y = _launch_persist(x, w, s, poisoned())
    _check_against_emulation(y, x, w, s, "fp8")
    assert torch.equal(y, _launch_persist(x, w, s, poisoned())), "not deterministic"


@gpu
@pytest.mark.parametrize("M,K,N", [(1, 4096, 256), (5, 1024, 640), (64, 8192, 128), (40, 1024, 4096)])
def test_persist_linear_fp32_in_and_out(M, K, N):
    g = torch.Generator(device=DEV).manual_seed(M + K + N + 9)
    w, s = make_weight(N, K, "fp8", "fp32", g)
    x = torch.randn(M, K, device=DEV, generator=g) * 3.0
    x[0, :128] *= 1e-3  # a token group of small values: its own fp32 scale
    y = _launch_persist(x, w, s, torch.full((M, N), float("nan"), device=DEV))
    assert y.dtype == torch.float32
    _check_against_emulation(y, x, w, s, "fp8")


@gpu
def test_persist_linear_runs_its_kernels(monkeypatch):
    """PERSIST_FP8 routes quant_linear's dense fp8 M <= 64 to the persistent kernel (and its
    reduction where the plan splits K); not grouped weights, not M > 64."""
    monkeypatch.setattr(L, "PERSIST_FP8", True)
    g = torch.Generator(device=DEV).manual_seed(12)
    w1, s1 = make_weight(32768, 1024, "fp8", "ue8m0", g)
    w2, s2 = make_weight(4096, 8192, "fp8", "ue8m0", g)

    def names(fn):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return " ".join(e.key for e in prof.key_averages())

    for M in (1, 64):
        x1 = torch.randn(M, 1024, device=DEV, generator=g).to(torch.bfloat16)
        x2 = torch.randn(M, 8192, device=DEV, generator=g).to(torch.bfloat16)
        n1 = names(lambda: ops.quant_linear(x1, w1, s1, "fp8"))
        assert "persist_linear_kernel" in n1 and "persist_reduce_kernel" not in n1, n1
        n2 = names(lambda: ops.quant_linear(x2, w2, s2, "fp8"))
        assert "persist_linear_kernel" in n2 and "persist_reduce_kernel" in n2, n2
    x3 = torch.randn(65, 1024, device=DEV, generator=g).to(torch.bfloat16)
    assert "persist_linear_kernel" not in names(lambda: ops.quant_linear(x3, w1, s1, "fp8"))


@gpu
def test_persist_linear_graph_capturable(monkeypatch):
    """One graph holding K-split (cast, main, reduction: PDL-chained) and unsplit calls, M 1 / 40, and
    an mxfp4 call; replay after poisoning, then with new inputs."""
    monkeypatch.setattr(L, "PERSIST_FP8", True)
    monkeypatch.setattr(L, "PERSIST_MX", True)
    g = torch.Generator(device=DEV).manual_seed(13)
    w1, s1 = make_weight(512, 8192, "fp8", "ue8m0", g)
    w2, s2 = make_weight(4096, 1024, "fp8", "fp32", g)
    w3, s3 = make_weight(32768, 1024, "fp8", "ue8m0", g)
    w4, s4 = make_weight(4096, 8192, "mxfp4", None, g)
    x1 = torch.randn(3, 8192, device=DEV, generator=g).to(torch.bfloat16)
    x2 = torch.randn(40, 1024, device=DEV, generator=g).to(torch.bfloat16)
    x3 = torch.randn(1, 1024, device=DEV, generator=g).to(torch.bfloat16)
    x4 = torch.randn(5, 8192, device=DEV, generator=g).to(torch.bfloat16)
    calls = [(x1, w1, s1, "fp8"), (x2, w2, s2, "fp8"), (x3, w3, s3, "fp8"), (x4, w4, s4, "mxfp4")]
    want = [ops.quant_linear(*c) for c in calls]
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        ops.quant_linear(*calls[0])
    torch.cuda.current_stream().wait_stream(st)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ys = [ops.quant_linear(*c) for c in calls]
    for y in ys:
        y.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(y, w) for y, w in zip(ys, want))
    for x, _, _, _ in calls:  # new inputs, same graph
        x.copy_(torch.randn(x.shape, device=DEV, generator=g).to(torch.bfloat16))
    graph.replay()
    for y, (x, w, s, fmt) in zip(ys, calls):
        _check_against_emulation(y, x, w, s, fmt)


MX_PERSIST_SHAPES = [(1024, 32768), (8192, 4096), (4096, 512), (2048, 200), (512, 1000), (1024, 33000), (128, 384)]


@gpu
@pytest.mark.parametrize("M", [1, 7, 8, 9, 17, 32])
@pytest.mark.parametrize("K,N", MX_PERSIST_SHAPES)
def test_persist_linear_mxfp4_matches_reference(M, K, N):
    """persist=True with mxfp4 weights (M <= 32): out poisoned, workspace stale, every element within
    the emulation bound, bit-equal to a second call."""
    g = torch.Generator(device=DEV).manual_seed(M * 17 + K + N)
    w, s = make_weight(N, K, "mxfp4", None, g)
    x = torch.randn(M, K, device=DEV, generator=g).to(torch.bfloat16)
    poisoned = lambda: torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=DEV)  # noqa: E731
    y = _launch_persist(x, w, s, poisoned())
    _check_against_emulation(y, x, w, s, "mxfp4")
    assert torch.equal(y, _launch_persist(x, w, s, poisoned())), "not deterministic"


@gpu
@pytest.mark.parametrize("spread", [0, 11, 40, -30])
@pytest.mark.parametrize("M,K,N", [(1, 2048, 512), (19, 1024, 320), (32, 4096, 4096)])
def test_persist_linear_mxfp4_within_the_accumulation_bound(spread, M, K, N):
    """fp32 x and out, UE8M0 group scales spread within each 128-K chunk: |y - emu| <= 2^-10 sum|xq w|."""
    g = torch.Generator(device=DEV).manual_seed(M + K + spread + 3)
    w, s = make_weight(N, K, "mxfp4", None, g)
    s = spread_mx_scales(s, spread, g)
    x = torch.randn(M, K, device=DEV, generator=g)
    y = _launch_persist(x, w, s, torch.full((M, N), float("nan"), device=DEV))
    q, sc = ops.fp8_per_token_cast(x, 128)
    xq = ops.fp8_per_token_dequant(q, sc, dtype=torch.float32).double()
    wd = L.dequant_weight(w, s, "mxfp4").double()
    err, mag = (y.double() - xq @ wd.T).abs(), xq.abs() @ wd.abs().T
    assert torch.isfinite(y).all() and (err <= 2.0 ** -10 * mag).all()


@gpu
def test_persist_linear_mxfp4_runs_its_kernel(monkeypatch):
    monkeypatch.setattr(L, "PERSIST_MX", True)
    g = torch.Generator(device=DEV).manual_seed(15)
    w, s = make_weight(4096, 8192, "mxfp4", None, g)
    for M, want in ((1, True), (32, True), (33, False)):
        x = torch.randn(M, 8192, device=DEV, generator=g).to(torch.bfloat16)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            y = ops.quant_linear(x, w, s, "mxfp4")
            torch.cuda.synchronize()
        names = " ".join(e.key for e in prof.key_averages())
        assert ("persist_linear_mx_kernel" in names) == want, names
        _check_against_emulation(y, x, w, s, "mxfp4")


@gpu
@pytest.mark.sanitize
def test_persist_linear_sanitize():
    """The persistent kernels under compute-sanitizer: K splits + reduction, no split, partial tiles /
    chunks, M 1 / 17 / 33 / 64 (mxfp4: 1 / 17 / 32), bf16 and fp32."""
    g = torch.Generator(device=DEV).manual_seed(14)
    for K, N, M, fmt in ((2048, 384, 1, "fp8"), (1024, 3000, 64, "fp8"), (160, 328, 17, "fp8"), (8192, 256, 33, "fp8"),
                         (2048, 384, 1, "mxfp4"), (1024, 3000, 32, "mxfp4"), (8192, 200, 17, "mxfp4")):
        w, s = make_weight(N, K, fmt, "ue8m0", g)
        x = torch.randn(M, K, device=DEV, generator=g)
        y = _launch_persist(x.to(torch.bfloat16), w, s, torch.empty(M, N, dtype=torch.bfloat16, device=DEV))
        assert torch.isfinite(y).all()
        assert torch.isfinite(_launch_persist(x, w, s, torch.empty(M, N, device=DEV))).all()
    torch.cuda.synchronize()


@needs_ext
def test_fp8_linear_launcher_rejects_bad_stream_settings():
    a = _launch_args()
    with pytest.raises(ValueError, match=r"fp8_linear: argument 'stream_max_m' must be >= 0 \(got -1\)"):
        _ext._C.fp8_linear(**a, stream_max_m=-1)
    with pytest.raises(ValueError, match=r"fp8_linear: argument 'stream_max_splits' must be 1, 2, 4 or 8 \(got 3\)"):
        _ext._C.fp8_linear(**a, stream_max_splits=3)
    with pytest.raises(ValueError, match=r"fp8_linear: argument 'stream_wgs' must be 1 or 2 \(got 3\)"):
        _ext._C.fp8_linear(**a, stream_wgs=3)
    with pytest.raises(ValueError, match=r"fp8_linear: argument 'stream_policy' must be 0 or 1 \(got 2\)"):
        _ext._C.fp8_linear(**a, stream_policy=2)


# ----------------------------------------------------------------------------- the C++ launcher's checks
FP8 = torch.float8_e4m3fn


def _launch_args(M=4, K=256, N=192, G=0, fmt="fp8", device="cpu"):
    """fp8_linear launcher arguments, every one well formed (x [M, K], or [M, G, K] with w [G * N, K])."""
    rows = N * max(G, 1)
    if fmt == "fp8":
        w = torch.zeros(rows, K, dtype=FP8, device=device)
        s = torch.zeros(-(-rows // 128), -(-K // 128), device=device)
    else:
        w = torch.zeros(rows, K // 2, dtype=torch.uint8, device=device)
        s = torch.zeros(rows, K // 32, dtype=torch.uint8, device=device)
    lead = (M, G) if G else (M,)
    return dict(x=torch.zeros(*lead, K, dtype=torch.bfloat16, device=device), w=w, w_scale=s,
                out=torch.empty(*lead, N, dtype=torch.bfloat16, device=device),
                workspace=torch.empty(1 << 20, dtype=torch.uint8, device=device))


@needs_ext
@pytest.mark.parametrize("change, match", [
    (dict(), r"fp8_linear: argument 'x' must be a CUDA tensor \(got bfloat16\[4, 256\] on cpu\)"),
    (dict(G=2, N=128), r"argument 'x' must be a CUDA tensor \(got bfloat16\[4, 2, 256\]"),
    (dict(fmt="mxfp4"), r"argument 'x' must be a CUDA tensor"),
    (dict(x=torch.zeros(4, 256, dtype=torch.float16)), r"argument 'x' must be bfloat16 or float32"),
    (dict(x=torch.zeros(256, dtype=torch.bfloat16)), r"argument 'x' must have 2 dims \(\[M, K\]\) or 3"),
    (dict(x=torch.zeros(4, 200, dtype=torch.bfloat16)), r"argument 'x' must have K % 32 == 0"),
    (dict(x=torch.zeros(256, 4, dtype=torch.bfloat16).t()), r"argument 'x' must be contiguous"),
    (dict(w=torch.zeros(192, 256, dtype=torch.bfloat16)), r"argument 'w' must be float8_e4m3fn or uint8"),
    (dict(w=torch.zeros(192, 128, dtype=FP8)), r"argument 'w' must have shape \[192, 256\]"),
    (dict(w_scale=torch.zeros(1, 2)), r"argument 'w_scale' must have shape \[2, 2\]"),
    (dict(w_scale=torch.zeros(2, 2, dtype=torch.bfloat16)), r"argument 'w_scale' must be float32 or uint8"),
    (dict(w_scale=None), r"argument 'w_scale' is required"),
    (dict(out=torch.empty(4, 192, dtype=torch.float16)), r"argument 'out' must be bfloat16 or float32"),
    (dict(out=torch.empty(4, 191, dtype=torch.bfloat16)), r"argument 'out' must have shape \[4, 192\]"),
    (dict(workspace=torch.empty(1 << 18)), r"argument 'workspace' must be uint8"),
])
def test_fp8_linear_launcher_rejects(change, match):
    a = dict(_launch_args(**{k: change[k] for k in ("G", "N", "fmt") if k in change}),
             **{k: v for k, v in change.items() if k not in ("G", "N", "fmt")})
    with pytest.raises(ValueError, match=match):
        _ext._C.fp8_linear(**a)


@needs_ext
def test_fp8_linear_launcher_rejects_formats_and_groups():
    a = _launch_args(fmt="mxfp4")
    a["w_scale"] = a["w_scale"].float()
    with pytest.raises(ValueError, match=r"argument 'w_scale' must be uint8 \(got float32\[192, 8\]"):
        _ext._C.fp8_linear(**a)
    a = _launch_args(fmt="mxfp4", K=96)
    with pytest.raises(ValueError, match=r"argument 'x' must have K % 128 == 0 for an mxfp4 w"):
        _ext._C.fp8_linear(**a)
    a = _launch_args(G=3, N=64)  # fp8 groups: whole 128-row scale blocks per group
    with pytest.raises(ValueError, match=r"argument 'w' \(fp8, grouped\) must have a multiple of 128 rows"):
        _ext._C.fp8_linear(**a)
    a = _launch_args(G=2, N=128)
    a["w"] = a["w"][:255]
    with pytest.raises(ValueError, match=r"argument 'w' must have a multiple of the 2 groups of x as rows"):
        _ext._C.fp8_linear(**a)
    a = _launch_args(G=2, N=128)
    a["out"] = torch.empty(4, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"argument 'out' must have shape \[4, 2, 128\]"):
        _ext._C.fp8_linear(**a)
    a = _launch_args()
    with pytest.raises(ValueError, match=r"fp8_linear_workspace_bytes: argument 'x' must be a CUDA tensor"):
        _ext._C.fp8_linear_workspace_bytes(x=a["x"], w=a["w"], w_scale=a["w_scale"])
    with pytest.raises(TypeError):  # tensors, not a problem tuple
        _ext._C.fp8_linear_workspace_bytes((4, 256, 192, False, 0, 0, False, 0))


class _CpuC:
    """_C with a workspace size for CPU tensors (the real one needs x's device)."""

    def __getattr__(self, name):
        return getattr(_ext._C, name)

    def fp8_linear_workspace_bytes(self, **kw):
        with pytest.raises(ValueError, match="fp8_linear_workspace_bytes: argument 'x' must be a CUDA tensor"):
            _ext._C.fp8_linear_workspace_bytes(**kw)
        return 1 << 20


@needs_ext
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_linear_kernel_paths_pass_the_launcher_checks(monkeypatch, fmt):
    """The CUDA registrations' keywords, dtypes and shapes pass every launcher check but the
    device one (CPU tensors here, so the launcher refuses before any launch)."""
    monkeypatch.setattr(_ext, "ext", lambda device: _CpuC())
    a = _launch_args(fmt=fmt)
    with pytest.raises(ValueError, match="fp8_linear: argument 'x' must be a CUDA tensor"):
        L._quant_linear.kernels["cuda"](a["x"].view(2, 2, 256), a["w"], a["w_scale"], fmt)
    a = _launch_args(fmt=fmt, G=2, N=128)
    with pytest.raises(ValueError, match=r"fp8_linear: argument 'x' must be a CUDA tensor \(got bfloat16\[4, 2, 256\]"):
        L._grouped_linear.kernels["cuda"](a["x"].view(2, 2, 2, 256), a["w"], a["w_scale"], fmt)


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_fp8_linear_launcher_rejects_mixed_devices_and_small_workspace():
    a = _launch_args(device=DEV)
    a["w_scale"] = a["w_scale"].cpu()
    with pytest.raises(ValueError, match="argument 'w_scale' must be a CUDA tensor"):
        _ext._C.fp8_linear(**a)
    a = _launch_args(M=3, device=DEV)
    need = _ext._C.fp8_linear_workspace_bytes(x=a["x"], w=a["w"], w_scale=a["w_scale"])
    a["workspace"] = a["workspace"][:need - 256]
    with pytest.raises(ValueError, match=f"argument 'workspace' must hold at least {need} bytes"):
        _ext._C.fp8_linear(**a)
    a["workspace"] = torch.empty(need, dtype=torch.uint8, device=DEV)
    _ext._C.fp8_linear(**a)  # the same arguments with a workspace of the size asked for launch
    torch.cuda.synchronize()
    assert torch.equal(a["out"], torch.zeros_like(a["out"]))
