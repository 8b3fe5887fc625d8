"""Dense FP8 linears at large M through the MoE prefill kernel's dense mode (csrc/moe/moe_prefill.cu,
`fp8_linear_prefill`; ops/linear_prefill.py) on the GPU.

Checked like test_linear_gpu.py: fresh random inputs, outputs poisoned with NaN, every element
against the emulation of the kernel's activation rounding (x to FP8 per token per 128; |y - emu| <=
2e-2 |emu| + 1e-2 max|emu|) and the exact reference (relative Frobenius error <= 0.05), a second
call bit-equal; odd M / N / K tails (K % 128 != 0, N % 128 != 0, M % 128 != 0), 128 x 256 and
128 x 128 tiles, UE8M0 and fp32 block scales, bf16 and fp32 x; block-diagonal (wo_a) weights; a row's
result independent of M; the 16-byte-store epilogue (the default) bit-equal to the 4-byte one
(DEEPFUSE_LINEAR_PREFILL_EPI16=0); CUDA-graph capture; the dispatch from quant_linear / grouped_linear at
M >= ops.linear.PREFILL_MIN_M. The launcher's checks run on the CPU too.
"""
import os

import pytest
import torch
from test_linear_gpu import emulated, make_weight

from deepfuse import _ext, ops
from deepfuse.ops import linear as L
from deepfuse.ops import linear_prefill as LP

gpu = pytest.mark.gpu
DEV = "cuda"
needs_ext = pytest.mark.skipif(not _ext.has_cuda_kernels(), reason="needs the compiled extension")


def launch(x, w, s, bn=0, out=None, cluster=-1):
    if out is None:
        shape = (*x.shape[:-1], w.shape[0] // (x.shape[1] if x.dim() == 3 else 1))
        out = torch.full(shape, float("nan"), dtype=x.dtype, device=x.device)
    return LP.run(x, w, s, out, bn, cluster)


# (bn, cluster): the default choice, 128 x 128, 128 x 256, 128 x 256 in 2-CTA clusters (weight tile multicast)
CONFIGS = [(0, -1), (128, 0), (256, 0), (256, 1)]


def check(y, emu, ref):
    yf = y.float()
    assert torch.isfinite(yf).all(), "unwritten (poisoned) or non-finite outputs"
    bad = (yf - emu).abs() > 2e-2 * emu.abs() + 1e-2 * emu.abs().max()
    assert not bad.any(), f"{int(bad.sum())} off; max {(yf - emu).abs().max().item():.3g}"
    assert ((yf - ref).norm() / ref.norm()).item() <= 0.05


# (M, K, N): V4 shapes at small K, M / N / K tails, one m-tile, N below one 256 tile
SHAPES = [(65, 1024, 4096), (300, 1024, 768), (129, 160, 200), (777, 8192, 328), (1000, 4096, 512),
          (4099, 512, 1000), (256, 96, 130)]


@gpu
@pytest.mark.parametrize("bn,cluster", CONFIGS)
@pytest.mark.parametrize("scale_fmt", ["ue8m0", "fp32"])
@pytest.mark.parametrize("M,K,N", SHAPES)
def test_linear_prefill_matches_reference(M, K, N, scale_fmt, bn, cluster):
    g = torch.Generator(device=DEV).manual_seed(M * 7 + K * 3 + N)
    w, s = make_weight(N, K, "fp8", scale_fmt, g)
    x = torch.randn(M, K, device=DEV, generator=g).to(torch.bfloat16)
    x[M // 2, :64] *= 1e-3  # a token group of small values: its own scale
    y = launch(x, w, s, bn, cluster=cluster)
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    check(y, emulated(x, w, s, "fp8"), L.quant_linear_ref(x.float(), w, s, "fp8"))
    assert torch.equal(y, launch(x, w, s, bn, cluster=cluster)), "not deterministic"


@gpu
@pytest.mark.parametrize("M,K,N", [(70, 4096, 256), (513, 1024, 1000)])
def test_linear_prefill_fp32_in_and_out(M, K, N):
    g = torch.Generator(device=DEV).manual_seed(M + K + N)
    w, s = make_weight(N, K, "fp8", "fp32", g)
    x = torch.randn(M, K, device=DEV, generator=g) * 3.0
    y = launch(x, w, s)
    assert y.dtype == torch.float32
    check(y, emulated(x, w, s, "fp8"), L.quant_linear_ref(x, w, s, "fp8"))


@gpu
def test_linear_prefill_row_independent_of_m():
    """A row's result depends on its own inputs only (same bits at M = 65, 300 and 4096, whatever the tiles
    and clusters)."""
    g = torch.Generator(device=DEV).manual_seed(11)
    w, s = make_weight(1024, 2048, "fp8", "ue8m0", g)
    x = torch.randn(4096, 2048, device=DEV, generator=g).to(torch.bfloat16)
    y = launch(x, w, s)
    for m in (65, 300):
        assert torch.equal(launch(x[:m].contiguous(), w, s), y[:m])
    assert torch.equal(launch(x, w, s, 128), y)
    assert torch.equal(launch(x, w, s, 256, cluster=0), y) and torch.equal(launch(x, w, s, 256, cluster=1), y)


@gpu
@pytest.mark.parametrize("M,G,Kg,R", [(300, 8, 4096, 1024), (70, 4, 512, 256), (129, 2, 256, 128), (4097, 2, 384, 384)])
def test_linear_prefill_grouped(M, G, Kg, R):
    """V4's wo_a: group g of x through weight rows g R .. (g + 1) R (R % 256 == 128: the last 256 tile
    of a group reads the next group's rows and stores none of them)."""
    g = torch.Generator(device=DEV).manual_seed(G * Kg + R + M)
    w, s = make_weight(G * R, Kg, "fp8", "ue8m0", g)
    x = torch.randn(M, G, Kg, device=DEV, generator=g).to(torch.bfloat16)
    wd = L.dequant_weight(w, s, "fp8").view(G, R, Kg)
    q, sc = ops.fp8_per_token_cast(x.reshape(-1, Kg).float().contiguous(), 128)
    xq = ops.fp8_per_token_dequant(q, sc, dtype=torch.float32).view(M, G, Kg)
    emu = torch.einsum("mgk,grk->mgr", xq, wd)
    for bn, cluster in CONFIGS:
        y = launch(x, w, s, bn, cluster=cluster)
        assert y.shape == (M, G, R)
        check(y, emu, L.grouped_linear_ref(x.float(), w, s, "fp8"))


@gpu
@pytest.mark.parametrize("bn", [0, 128, 256])
def test_linear_prefill_epi16(monkeypatch, bn):
    """The bf16 epilogue with 16-byte stores (the default; a quad transposes its words) gives the same bits as
    the 4-byte stores (DEEPFUSE_LINEAR_PREFILL_EPI16=0), every element written (NaN-poisoned outputs), grouped too."""
    g = torch.Generator(device=DEV).manual_seed(bn + 1)
    for M, K, N in ((300, 1024, 768), (129, 160, 200), (4099, 512, 1000)):
        w, s = make_weight(N, K, "fp8", "ue8m0", g)
        x = torch.randn(M, K, device=DEV, generator=g).to(torch.bfloat16)
        monkeypatch.setenv("DEEPFUSE_LINEAR_PREFILL_EPI16", "0")
        want = launch(x, w, s, bn)
        monkeypatch.setenv("DEEPFUSE_LINEAR_PREFILL_EPI16", "1")
        y = launch(x, w, s, bn)
        check(y, emulated(x, w, s, "fp8"), L.quant_linear_ref(x.float(), w, s, "fp8"))
        assert torch.equal(y, want)
    wg, sg = make_weight(4 * 256, 512, "fp8", "ue8m0", g)
    xg = torch.randn(70, 4, 512, device=DEV, generator=g).to(torch.bfloat16)
    monkeypatch.setenv("DEEPFUSE_LINEAR_PREFILL_EPI16", "0")
    want = launch(xg, wg, sg, bn)
    monkeypatch.setenv("DEEPFUSE_LINEAR_PREFILL_EPI16", "1")
    assert torch.equal(launch(xg, wg, sg, bn), want)


@gpu
def test_linear_prefill_dispatch(monkeypatch):
    """quant_linear / grouped_linear take the kernel at M >= PREFILL_MIN_M (fp8 only), not below."""
    calls = []
    run = LP.run
    monkeypatch.setattr(LP, "run", lambda *a, **k: calls.append(a[0].shape) or run(*a, **k))
    monkeypatch.setattr(L, "PREFILL_MIN_M", 65)
    g = torch.Generator(device=DEV).manual_seed(5)
    w, s = make_weight(512, 1024, "fp8", "ue8m0", g)
    for lead, want in (((64,), 0), ((65,), 1), ((2, 500), 1)):  # rows: the product of the leading dims
        calls.clear()
        x = torch.randn(*lead, 1024, device=DEV, generator=g).to(torch.bfloat16)
        y = ops.quant_linear(x, w, s, "fp8")
        assert len(calls) == want and y.shape == (*lead, 512)
        check(y.view(-1, 512), emulated(x.view(-1, 1024), w, s, "fp8"),
              L.quant_linear_ref(x.float(), w, s, "fp8").view(-1, 512))
    wg, sg = make_weight(4 * 256, 512, "fp8", "ue8m0", g)
    calls.clear()
    ops.grouped_linear(torch.randn(100, 4, 512, device=DEV, generator=g).to(torch.bfloat16), wg, sg, "fp8")
    assert len(calls) == 1
    calls.clear()
    wm, sm = make_weight(512, 1024, "mxfp4", None, g)
    ops.quant_linear(torch.randn(100, 1024, device=DEV, generator=g).to(torch.bfloat16), wm, sm, "mxfp4")
    assert not calls
    monkeypatch.setattr(L, "PREFILL_MIN_M", 0)
    ops.quant_linear(torch.randn(100, 1024, device=DEV, generator=g).to(torch.bfloat16), w, s, "fp8")
    assert not calls


@gpu
def test_linear_prefill_graph_capturable():
    g = torch.Generator(device=DEV).manual_seed(9)
    w, s = make_weight(768, 1024, "fp8", "ue8m0", g)
    wg, sg = make_weight(2 * 256, 512, "fp8", "ue8m0", g)
    x = torch.randn(333, 1024, device=DEV, generator=g).to(torch.bfloat16)
    xg = torch.randn(200, 2, 512, device=DEV, generator=g).to(torch.bfloat16)
    y = torch.empty(333, 768, dtype=torch.bfloat16, device=DEV)
    yg = torch.empty(200, 2, 256, dtype=torch.bfloat16, device=DEV)
    y2 = torch.empty_like(y)
    launch(x, w, s, out=y), launch(xg, wg, sg, out=yg)  # warm-up (tensor-map entry point, attributes)
    launch(x, w, s, 256, out=y2, cluster=1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch(x, w, s, out=y)
        launch(xg, wg, sg, out=yg)
        launch(x, w, s, 256, out=y2, cluster=1)
    for _ in range(2):
        y.fill_(float("nan")), yg.fill_(float("nan")), y2.fill_(float("nan"))
        x.copy_(torch.randn(333, 1024, device=DEV, generator=g))
        xg.copy_(torch.randn(200, 2, 512, device=DEV, generator=g))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, launch(x, w, s)) and torch.equal(yg, launch(xg, wg, sg))
        assert torch.equal(y2, launch(x, w, s, 256, cluster=1))


@gpu
@pytest.mark.sanitize
def test_linear_prefill_sanitize():
    g = torch.Generator(device=DEV).manual_seed(3)
    for M, K, N, bn, cl in ((129, 160, 200, 256, 0), (70, 384, 258, 128, 0), (200, 256, 512, 0, -1),
                            (300, 384, 200, 256, 1), (129, 256, 256, 256, 1)):
        w, s = make_weight(N, K, "fp8", "ue8m0", g)
        x = torch.randn(M, K, device=DEV, generator=g).to(torch.bfloat16)
        assert torch.isfinite(launch(x, w, s, bn, cluster=cl)).all()
    wg, sg = make_weight(2 * 128, 256, "fp8", "fp32", g)
    xg = torch.randn(130, 2, 256, device=DEV, generator=g).to(torch.bfloat16)
    for bn, cl in ((128, 0), (256, 0), (256, 1)):
        assert torch.isfinite(launch(xg, wg, sg, bn, cluster=cl)).all()
    os.environ["DEEPFUSE_LINEAR_PREFILL_EPI16"] = "0"  # the 4-byte-store epilogue
    try:
        for M, K, N, bn in ((129, 160, 200, 256), (70, 384, 264, 128)):
            w, s = make_weight(N, K, "fp8", "ue8m0", g)
            x = torch.randn(M, K, device=DEV, generator=g).to(torch.bfloat16)
            assert torch.isfinite(launch(x, w, s, bn)).all()
    finally:
        del os.environ["DEEPFUSE_LINEAR_PREFILL_EPI16"]
    torch.cuda.synchronize()


@needs_ext
def test_linear_prefill_launcher_rejects():
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    w = torch.zeros(192, 256, dtype=torch.float8_e4m3fn)
    s = torch.ones(2, 2)
    out = torch.zeros(4, 192, dtype=torch.bfloat16)
    work = torch.zeros(1 << 16, dtype=torch.uint8)
    C = _ext._C
    with pytest.raises(ValueError, match="fp8_linear_prefill: argument 'x' must be a CUDA tensor"):
        C.fp8_linear_prefill(x=x, w=w, w_scale=s, out=out, workspace=work)
    with pytest.raises(ValueError, match="argument 'bn' must be 0, 128 or 256"):
        C.fp8_linear_prefill(x=x, w=w, w_scale=s, out=out, workspace=work, bn=64)
    with pytest.raises(ValueError, match="argument 'out'"):
        C.fp8_linear_prefill(x=x, w=w, w_scale=s, out=out.float(), workspace=work)
    with pytest.raises(ValueError, match="argument 'w_scale'"):
        C.fp8_linear_prefill(x=x, w=w, w_scale=torch.ones(1, 2), out=out, workspace=work)
    with pytest.raises(ValueError, match="argument 'w'"):
        C.fp8_linear_prefill(x=x, w=w.view(torch.uint8), w_scale=s, out=out, workspace=work)
    with pytest.raises(ValueError, match="argument 'M' must be >= 0"):
        C.fp8_linear_prefill_workspace_bytes(M=-1, K=256)
    assert C.fp8_linear_prefill_workspace_bytes(M=4, K=256) == 1024 + 2 * 4 * 4
    assert LP.gap(torch.bfloat16, 4, 1, 256, 192, w, s).startswith("no fp8_linear_prefill kernel for cpu")
    assert LP.preferred(4096, 1, 1024) and LP.preferred(512, 1, 1024) and LP.preferred(4096, 8, 1024)


@gpu
def test_linear_prefill_gap():
    w = torch.zeros(192, 256, dtype=torch.float8_e4m3fn, device=DEV)
    s = torch.ones(2, 2, device=DEV)
    assert LP.gap(torch.bfloat16, 4, 2, 256, 192, w, s) == "grouped needs Kg and R multiples of 128"
    assert LP.gap(torch.float16, 4, 1, 256, 192, w, s) is not None
    assert LP.gap(torch.bfloat16, 4, 1, 256, 192, w, s) is None
