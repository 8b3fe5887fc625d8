"""Fused MoE kernels (csrc/moe) against the references, on the GPU.

moe_experts quantises activations to FP8 e4m3 per token per 128 (x, then h = SwiGLU(...)
rounded to bf16); the reference does not. So each case is checked twice, every element:
- against an emulation of those roundings in torch (`emulated`): |out - emu| <= 2e-2 |emu| +
  2e-2 max|emu| (fp32 summation order, and the rare rounding flip a different order causes);
- against the exact reference: relative Frobenius error <= 0.08 (FP8 activation rounding:
  about 2^-4 / sqrt(3) per element, twice).
Routings: random top-k, all tokens on one expert, empty experts, ids -1 / >= E, the shared
expert; T from 1 to 16384 with odd T; both weight formats; outputs poisoned with NaN first.
Paths: the decode kernels (T <= 256), the prefill kernels (T >= 257: the `prefill` fixture and the `path`
fixture's default setting; mxfp4 ones: tests/ops/test_moe_prefill_gpu.py), the grouped kernels (`path` = "grouped").
"""
import functools

import pytest
import torch

from deepfuse import ops
from deepfuse.ops import moe as M

pytestmark = pytest.mark.gpu
DEV = "cuda"


@functools.lru_cache(maxsize=4)
def make_experts(E, I, d, fmt, seed=0, shared=False, spread=0):
    """spread (mxfp4): every UE8M0 group exponent moved down by 0..spread (group scales of one
    128-K chunk far apart)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    out = {}
    for name, (N, K) in (("w1", (I, d)), ("w3", (I, d)), ("w2", (d, I))):
        w = torch.randn(E * N, K, device=DEV, generator=g) * (K ** -0.5)
        if fmt == "fp8":
            if N % 128:
                qs = [ops.fp8_block_cast(w[e * N:(e + 1) * N].contiguous(), (128, 128), scale_fmt="ue8m0")
                      for e in range(E)]
                q, s = torch.stack([a for a, _ in qs]), torch.stack([b for _, b in qs])
            else:
                q, s = ops.fp8_block_cast(w, (128, 128), scale_fmt="ue8m0")
                q, s = q.view(E, N, K), s.view(E, N // 128, -1)
        else:
            step = max(N, (1 << 24) // K // N * N)  # the reference cast's temporaries stay small
            parts = [ops.mxfp4_cast(w[r:r + step]) for r in range(0, E * N, step)]
            q = torch.cat([a for a, _ in parts]).view(E, N, K // 2)
            s = torch.cat([b for _, b in parts]).view(E, N, K // 32)
            if spread:
                off = torch.randint(0, spread + 1, s.shape, device=DEV, generator=g, dtype=torch.int16)
                s = (s.to(torch.int16) - off).clamp(1, 254).to(torch.uint8)
        out[name] = (q, s)
    sh = None
    if shared:
        ws = []
        for N, K in ((I, d), (I, d), (d, I)):
            w = torch.randn(N, K, device=DEV, generator=g) * (K ** -0.5)
            ws.append(ops.fp8_block_cast(w, (128, 128), scale_fmt="fp32"))
        sh = (ws[0][0], ws[1][0], ws[2][0], ws[0][1], ws[1][1], ws[2][1])
    return out, sh


def qdq_rows(x):
    """FP8 per token per 128 (fp32 scales) and back: the kernel's activation rounding."""
    q, s = ops.fp8_per_token_cast(x.float().contiguous(), 128)
    return ops.fp8_per_token_dequant(q, s, dtype=torch.float32)


def emulated(x, ids, w, ex, fmt, limit, shared):
    T, d = x.shape
    E = ex["w1"][0].shape[0]
    deq = {n: [ops.linear.dequant_weight(ex[n][0][e], ex[n][1][e], fmt) for e in range(E)] for n in ex}
    xq = qdq_rows(x)
    out = torch.zeros(T, d, device=DEV)

    def run(xr, a, b, c):
        h = M.swiglu_ref(xr @ a.T, xr @ b.T, limit).to(torch.bfloat16)
        return qdq_rows(h) @ c.T

    for e in range(E):
        rows, slots = torch.nonzero(ids == e, as_tuple=True)
        if rows.numel():
            y = run(xq[rows], deq["w1"][e], deq["w3"][e], deq["w2"][e])
            out.index_add_(0, rows, y * w[rows, slots].float()[:, None])
    if shared is not None:
        a, b, c = (ops.linear.dequant_weight(shared[i], shared[i + 3], "fp8") for i in range(3))
        out += run(xq, a, b, c)
    return out


def run_kernel(x, ids, w, ex, fmt, limit, shared):
    (a, sa), (b, sb), (c, sc) = ex["w1"], ex["w3"], ex["w2"]
    return ops.moe_experts(x, ids, w, a, b, c, s1=sa, s3=sb, s2=sc, fmt=fmt, limit=limit, shared=shared)


def routing(T, E, k, kind, g):
    if kind == "random":
        ids = torch.rand(T, E, device=DEV, generator=g).topk(k, dim=-1).indices
    elif kind == "one":
        ids = torch.full((T, k), E // 2, device=DEV, dtype=torch.long)
    elif kind == "few":  # most experts empty
        ids = torch.randint(0, 2, (T, k), device=DEV, generator=g) * (E - 1)
    else:  # "dropped": ids -1 and >= E mixed in
        ids = torch.randint(-1, E + 2, (T, k), device=DEV, generator=g)
    return ids, torch.rand(T, k, device=DEV, generator=g) + 0.1


@pytest.fixture(params=["stream", "balanced", "grouped"])
def path(request, monkeypatch):
    """moe_experts' default paths ("stream": T <= 256 the streaming kernels (moe_stream.cu), fp8
    from T = 257 the prefill kernels (moe_prefill.cu), mxfp4 too while ops.moe.PREFILL_MXFP4_MIN_T is on;
    "balanced": the same with the streaming kernels' equal stage ranges per CTA (STREAM_BALANCE_MAX_T)) or
    the grouped kernels at every T ("grouped": PREFILL_MIN_T = 0 turns both formats' prefill kernels off)."""
    grouped = request.param == "grouped"
    monkeypatch.setattr(M, "STREAM_MAX_T", 0 if grouped else 256)
    monkeypatch.setattr(M, "STREAM_MIN_T", {})
    monkeypatch.setattr(M, "PREFILL_MIN_T", 0 if grouped else 257)
    monkeypatch.setattr(M, "STREAM_BALANCE_MAX_T", bal_of(256 if request.param == "balanced" else 0))
    return request.param


def bal_of(t):
    """ops.moe.STREAM_BALANCE_MAX_T for both formats."""
    return {"fp8": t, "mxfp4": t}


def check(out, emu, ref):
    assert torch.isfinite(out).all()
    o = out.float()
    scale = emu.abs().max()
    bad = (o - emu).abs() > 2e-2 * emu.abs() + 2e-2 * scale
    assert not bad.any(), f"{int(bad.sum())} elements off the emulation; max {((o - emu).abs().max() / scale):.3g}"
    rel = ((o - ref.float()).norm() / ref.float().norm()).item()
    assert rel <= 0.08, rel
    return rel


CASES = [  # T, d, I, E, k, kind, shared
    (1, 256, 128, 8, 2, "random", True),
    (3, 256, 128, 8, 2, "dropped", False),
    (8, 256, 128, 8, 2, "one", True),
    (33, 256, 128, 16, 4, "few", False),
    (131, 256, 256, 16, 4, "random", True),
    (257, 256, 128, 8, 2, "random", False),   # prefill tiles
    (1000, 256, 128, 8, 3, "dropped", True),
    (4099, 256, 128, 16, 2, "one", False),    # large plan (several launches)
]


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("T,d,I,E,k,kind,shared", CASES)
def test_moe_experts_matches_reference(fmt, T, d, I, E, k, kind, shared, path):
    g = torch.Generator(device=DEV).manual_seed(T * 7 + E)
    ex, sh = make_experts(E, I, d, fmt, seed=T, shared=shared)
    x = torch.randn(T, d, device=DEV, generator=g).to(torch.bfloat16)
    ids, w = routing(T, E, k, kind, g)
    out = run_kernel(x, ids, w, ex, fmt, 6.0, sh)
    ref = M.moe_experts_ref(x.float(), ids, w, *(ex[n][0] for n in ("w1", "w3", "w2")),
                            *(ex[n][1] for n in ("w1", "w3", "w2")), fmt, 6.0, sh)
    check(out, emulated(x, ids, w, ex, fmt, 6.0, sh), ref)


@pytest.mark.parametrize("spread", [11, 40])
@pytest.mark.parametrize("T,kind", [(1, "random"), (8, "one"), (300, "random")])
def test_moe_experts_mxfp4_spread_group_scales(spread, T, kind, path):
    g = torch.Generator(device=DEV).manual_seed(T + spread)
    ex, sh = make_experts(8, 256, 256, "mxfp4", seed=T, shared=T == 8, spread=spread)
    x = torch.randn(T, 256, device=DEV, generator=g).to(torch.bfloat16)
    ids, w = routing(T, 8, 2, kind, g)
    out = run_kernel(x, ids, w, ex, "mxfp4", 6.0, sh)
    ref = M.moe_experts_ref(x.float(), ids, w, *(ex[n][0] for n in ("w1", "w3", "w2")),
                            *(ex[n][1] for n in ("w1", "w3", "w2")), "mxfp4", 6.0, sh)
    check(out, emulated(x, ids, w, ex, "mxfp4", 6.0, sh), ref)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_moe_experts_more_tokens_than_a_grid_y_extent(fmt):
    """T = 66000 > 65535 (the combine's grid had tokens on y): every row against the
    emulation; over 17M elements a few FP8 rounding flips pass the per-element bound, so
    at most 1e-5 of them may; the rows past 65535 as close as the first ones."""
    T, d, I, E, k = 66000, 256, 128, 8, 2
    g = torch.Generator(device=DEV).manual_seed(11)
    ex, _ = make_experts(E, I, d, fmt, seed=5)
    x = torch.randn(T, d, device=DEV, generator=g).to(torch.bfloat16)
    ids, w = routing(T, E, k, "random", g)
    out = run_kernel(x, ids, w, ex, fmt, 6.0, None).float()
    emu = emulated(x, ids, w, ex, fmt, 6.0, None)
    assert torch.isfinite(out).all()
    bad = (out - emu).abs() > 2e-2 * emu.abs() + 2e-2 * emu.abs().max()
    assert bad.float().mean().item() <= 1e-5, int(bad.sum())
    head, tail = (((out[r] - emu[r]).norm() / emu[r].norm()).item() for r in (slice(0, 464), slice(65536, T)))
    assert tail <= 2 * head + 1e-3, (head, tail)


@pytest.mark.parametrize("T,d,I", [(5, 96, 32), (70, 160, 96), (300, 64, 32), (9, 160, 160), (40, 288, 416)])
def test_moe_experts_fp8_tails_and_fp32_x(T, d, I, path):
    """K not a multiple of 128 (zero-filled chunk), N tails, fp32 activations and scales."""
    g = torch.Generator(device=DEV).manual_seed(d)
    ex, _ = make_experts(4, I, d, "fp8", seed=d)
    x = torch.randn(T, d, device=DEV, generator=g)
    ids, w = routing(T, 4, 2, "random", g)
    out = run_kernel(x, ids, w, ex, "fp8", 0.0, None)
    assert out.dtype == torch.float32
    ref = M.moe_experts_ref(x, ids, w, *(ex[n][0] for n in ("w1", "w3", "w2")),
                            *(ex[n][1] for n in ("w1", "w3", "w2")), "fp8", 0.0, None)
    check(out, emulated(x, ids, w, ex, "fp8", 0.0, None), ref)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("T", [1, 64, 16384])
def test_moe_experts_v4_flash_shape(fmt, T, path):
    if T > 256 and path != "stream":
        pytest.skip("T > 256: the default path only (grouped kernels: the other cases)")
    E, d, I, k = 256, 4096, 2048, 6
    g = torch.Generator(device=DEV).manual_seed(T)
    ex, sh = make_experts(E, I, d, fmt, seed=1, shared=True)
    x = torch.randn(T, d, device=DEV, generator=g).to(torch.bfloat16)
    ids, w = routing(T, E, k, "random", g)
    out = run_kernel(x, ids, w, ex, fmt, 10.0, sh)
    if T > 64:  # the emulation at 16K tokens: sample rows
        rows = torch.randperm(T, device=DEV, generator=g)[:256]
        x, ids, w, out = x[rows], ids[rows], w[rows], out[rows]
    ref = M.moe_experts_ref(x.float(), ids, w, *(ex[n][0] for n in ("w1", "w3", "w2")),
                            *(ex[n][1] for n in ("w1", "w3", "w2")), fmt, 10.0, sh)
    rel = check(out, emulated(x, ids, w, ex, fmt, 10.0, sh), ref)
    print(f"V4-Flash {fmt} T={T}: relative error vs exact reference {rel:.4f}")


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_moe_experts_deterministic_and_graph_capturable(fmt, path):
    T, d, I, E, k = 48, 512, 256, 32, 6
    g = torch.Generator(device=DEV).manual_seed(3)
    ex, sh = make_experts(E, I, d, fmt, seed=3, shared=True)
    x = torch.randn(T, d, device=DEV, generator=g).to(torch.bfloat16)
    ids, w = routing(T, E, k, "random", g)
    first = run_kernel(x, ids, w, ex, fmt, 5.0, sh)
    assert torch.equal(first, run_kernel(x, ids, w, ex, fmt, 5.0, sh))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run_kernel(x, ids, w, ex, fmt, 5.0, sh)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = run_kernel(x, ids, w, ex, fmt, 5.0, sh)
    x2 = torch.randn(T, d, device=DEV, generator=g).to(torch.bfloat16)
    ids2, w2 = routing(T, E, k, "dropped", g)
    x.copy_(x2), ids.copy_(ids2), w.copy_(w2)
    y.fill_(float("nan"))
    graph.replay()
    torch.testing.assert_close(y, run_kernel(x2, ids2, w2, ex, fmt, 5.0, sh), rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("T,E,k,kind", [(200, 64, 6, "random"), (256, 16, 4, "few"), (97, 8, 2, "dropped")])
@pytest.mark.parametrize("bal", [0, 256])
def test_moe_experts_stream_many_tasks(fmt, T, E, k, kind, bal, monkeypatch):
    """The streaming decode kernels where CTAs' tile ranges cross many tasks (and the shared
    expert's tasks), against the emulation; bitwise equal on a second call. bal: STREAM_BALANCE_MAX_T."""
    monkeypatch.setattr(M, "STREAM_BALANCE_MAX_T", bal_of(bal))
    g = torch.Generator(device=DEV).manual_seed(T + E)
    ex, sh = make_experts(E, 256, 512, fmt, seed=E, shared=True)
    x = torch.randn(T, 512, device=DEV, generator=g).to(torch.bfloat16)
    ids, w = routing(T, E, k, kind, g)
    out = run_kernel(x, ids, w, ex, fmt, 6.0, sh)
    ref = M.moe_experts_ref(x.float(), ids, w, *(ex[n][0] for n in ("w1", "w3", "w2")),
                            *(ex[n][1] for n in ("w1", "w3", "w2")), fmt, 6.0, sh)
    check(out, emulated(x, ids, w, ex, fmt, 6.0, sh), ref)
    assert torch.equal(out, run_kernel(x, ids, w, ex, fmt, 6.0, sh))


@pytest.mark.parametrize("T,d,I,kind,shared", [(1, 384, 640, "random", True), (13, 640, 384, "one", False),
                                                 (37, 384, 256, "few", True), (256, 1024, 512, "random", False)])
@pytest.mark.parametrize("bal", [0, 256])
def test_moe_experts_stream_mxfp4_shapes(T, d, I, kind, shared, bal, monkeypatch):
    """mxfp4 decode kernels: K / 128 odd (the last stage holds one chunk), group scales copied 4
    (K / 32 % 16 != 0) or 16 bytes at a time, skewed routings; against the emulation, bitwise equal
    on a second call. bal: STREAM_BALANCE_MAX_T."""
    monkeypatch.setattr(M, "STREAM_BALANCE_MAX_T", bal_of(bal))
    monkeypatch.setattr(M, "STREAM_MIN_T", {})
    E, k = 16, 4
    g = torch.Generator(device=DEV).manual_seed(T + d)
    ex, sh = make_experts(E, I, d, "mxfp4", seed=d + I, shared=shared, spread=11 if T == 13 else 0)
    x = torch.randn(T, d, device=DEV, generator=g).to(torch.bfloat16)
    ids, w = routing(T, E, k, kind, g)
    out = run_kernel(x, ids, w, ex, "mxfp4", 6.0, sh)
    ref = M.moe_experts_ref(x.float(), ids, w, *(ex[n][0] for n in ("w1", "w3", "w2")),
                            *(ex[n][1] for n in ("w1", "w3", "w2")), "mxfp4", 6.0, sh)
    check(out, emulated(x, ids, w, ex, "mxfp4", 6.0, sh), ref)
    assert torch.equal(out, run_kernel(x, ids, w, ex, "mxfp4", 6.0, sh))


# ----------------------------------------------------------------------------- prefill path
@pytest.fixture
def prefill(monkeypatch):
    """The fp8 prefill kernels (moe_prefill.cu: tokens on wgmma's M side, TMA producer warp) from
    T = 257 on."""
    monkeypatch.setattr(M, "PREFILL_MIN_T", 257)


def poison_allocator(nbytes=1 << 30):
    """Leave NaN in memory the caching allocator will hand out next (the op's output, workspace)."""
    t = torch.full((nbytes // 4,), float("nan"), device=DEV)
    del t


PREFILL_CASES = [  # T, d, I, E, k, kind, shared, x dtype
    (257, 256, 128, 8, 2, "random", False, torch.bfloat16),
    (333, 512, 256, 16, 4, "random", True, torch.bfloat16),
    (512, 256, 256, 8, 3, "one", True, torch.bfloat16),       # one hot expert: many tasks of one expert
    (777, 384, 128, 32, 4, "few", False, torch.bfloat16),     # most experts empty
    (1000, 256, 128, 8, 3, "dropped", True, torch.bfloat16),  # ids -1 / >= E
    (4099, 256, 128, 16, 6, "one", False, torch.bfloat16),    # large plan (several launches), 193 tasks
    (301, 256, 384, 8, 2, "random", True, torch.float32),     # fp32 activations, K = 3 chunks
]


@pytest.mark.parametrize("T,d,I,E,k,kind,shared,dt", PREFILL_CASES)
def test_moe_experts_prefill_matches_reference(T, d, I, E, k, kind, shared, dt, prefill):
    g = torch.Generator(device=DEV).manual_seed(T * 13 + E)
    ex, sh = make_experts(E, I, d, "fp8", seed=T + 1, shared=shared)
    x = torch.randn(T, d, device=DEV, generator=g).to(dt)
    ids, w = routing(T, E, k, kind, g)
    poison_allocator()
    out = run_kernel(x, ids, w, ex, "fp8", 6.0, sh)
    assert out.dtype == dt
    ref = M.moe_experts_ref(x.float(), ids, w, *(ex[n][0] for n in ("w1", "w3", "w2")),
                            *(ex[n][1] for n in ("w1", "w3", "w2")), "fp8", 6.0, sh)
    check(out, emulated(x, ids, w, ex, "fp8", 6.0, sh), ref)
    assert torch.equal(out, run_kernel(x, ids, w, ex, "fp8", 6.0, sh))  # bitwise reproducible


@pytest.mark.parametrize("T", [512, 4096])
def test_moe_experts_prefill_v4_flash_shape(T, prefill):
    """V4-Flash (256 experts, top-6, d 4096, I 2048, fp8 shared expert), every element checked."""
    E, d, I, k = 256, 4096, 2048, 6
    g = torch.Generator(device=DEV).manual_seed(T + 5)
    ex, sh = make_experts(E, I, d, "fp8", seed=1, shared=True)
    x = torch.randn(T, d, device=DEV, generator=g).to(torch.bfloat16)
    ids, w = routing(T, E, k, "random", g)
    poison_allocator()
    out = run_kernel(x, ids, w, ex, "fp8", 10.0, sh)
    ref = M.moe_experts_ref(x.float(), ids, w, *(ex[n][0] for n in ("w1", "w3", "w2")),
                            *(ex[n][1] for n in ("w1", "w3", "w2")), "fp8", 10.0, sh)
    rel = check(out, emulated(x, ids, w, ex, "fp8", 10.0, sh), ref)
    print(f"V4-Flash fp8 prefill T={T}: relative error vs exact reference {rel:.4f}")


def check_prefill_graph_replay(fmt, seed, spread=0):
    """T = 600 through the prefill kernels captured in a CUDA graph, replayed on new inputs (and a new
    routing) into a NaN-poisoned output: bit-equal to an eager call, within the bounds of check()."""
    T, d, I, E, k = 600, 512, 256, 32, 6
    g = torch.Generator(device=DEV).manual_seed(seed)
    ex, sh = make_experts(E, I, d, fmt, seed=seed, shared=True, spread=spread)
    x = torch.randn(T, d, device=DEV, generator=g).to(torch.bfloat16)
    ids, w = routing(T, E, k, "random", g)
    run_kernel(x, ids, w, ex, fmt, 5.0, sh)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run_kernel(x, ids, w, ex, fmt, 5.0, sh)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = run_kernel(x, ids, w, ex, fmt, 5.0, sh)
    x2 = torch.randn(T, d, device=DEV, generator=g).to(torch.bfloat16)
    ids2, w2 = routing(T, E, k, "few", g)
    x.copy_(x2), ids.copy_(ids2), w.copy_(w2)
    y.fill_(float("nan"))
    graph.replay()
    torch.testing.assert_close(y, run_kernel(x2, ids2, w2, ex, fmt, 5.0, sh), rtol=0, atol=0)
    ref = M.moe_experts_ref(x2.float(), ids2, w2, *(ex[n][0] for n in ("w1", "w3", "w2")),
                            *(ex[n][1] for n in ("w1", "w3", "w2")), fmt, 5.0, sh)
    check(y, emulated(x2, ids2, w2, ex, fmt, 5.0, sh), ref)


def test_moe_experts_prefill_graph_capturable(prefill):
    check_prefill_graph_replay("fp8", seed=9)


@pytest.mark.sanitize
def test_moe_sanitize_small():
    """Small cases of every kernel path for compute-sanitizer (tools/gpu/gpu_run.sh)."""
    keep = M.STREAM_MAX_T, M.STREAM_MIN_T, M.PREFILL_MIN_T, M.STREAM_BALANCE_MAX_T
    M.STREAM_MIN_T = {}
    for fmt, spread, T in (("fp8", 0, 1), ("mxfp4", 0, 2), ("mxfp4", 40, 2), ("fp8", 0, 300), ("mxfp4", 0, 300),
                           ("fp8", 0, 40), ("mxfp4", 40, 40)):
        for smt, bal in ((0, 0), (256, 0), (256, 256)):  # T > 256: 0 = the grouped kernels, 256 = the default
            M.STREAM_MAX_T, M.STREAM_BALANCE_MAX_T = smt, bal_of(bal)
            M.PREFILL_MIN_T = 0 if smt == 0 else keep[2]
            g = torch.Generator(device=DEV).manual_seed(T)
            ex, sh = make_experts(4, 256, 256, fmt, seed=T, shared=True, spread=spread)
            x = torch.randn(T, 256, device=DEV, generator=g).to(torch.bfloat16)
            ids, w = routing(T, 4, 2, "dropped", g)
            out = run_kernel(x, ids, w, ex, fmt, 6.0, sh)
            assert torch.isfinite(out).all()
    M.STREAM_MAX_T = 256  # mxfp4 decode kernels with K / 128 odd and 16-byte scale copies
    for T, d, I in ((3, 384, 512), (17, 512, 384)):
        g = torch.Generator(device=DEV).manual_seed(T)
        ex, sh = make_experts(4, I, d, "mxfp4", seed=T, shared=True)
        x = torch.randn(T, d, device=DEV, generator=g).to(torch.bfloat16)
        ids, w = routing(T, 4, 2, "dropped", g)
        assert torch.isfinite(run_kernel(x, ids, w, ex, "mxfp4", 6.0, sh)).all()
    M.STREAM_MAX_T, M.STREAM_MIN_T, M.STREAM_BALANCE_MAX_T = keep[0], keep[1], keep[3]
    M.PREFILL_MIN_T = 257  # the fp8 prefill kernels: one hot expert, dropped ids, fp32 x
    for T, kind, dt in ((300, "dropped", torch.bfloat16), (520, "one", torch.bfloat16), (290, "few", torch.float32)):
        g = torch.Generator(device=DEV).manual_seed(T)
        ex, sh = make_experts(4, 256, 256, "fp8", seed=T, shared=True)
        x = torch.randn(T, 256, device=DEV, generator=g).to(dt)
        ids, w = routing(T, 4, 2, kind, g)
        assert torch.isfinite(run_kernel(x, ids, w, ex, "fp8", 6.0, sh)).all()
    M.PREFILL_MIN_T = keep[2]
    logits = torch.randn(5, 64, device=DEV)
    ops.moe_route(logits, 6, bias=torch.randn(64, device=DEV))
    torch.cuda.synchronize()


@pytest.mark.parametrize("score", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("T,E,k", [(1, 256, 6), (37, 384, 6), (500, 64, 8), (3, 1024, 32)])
def test_moe_route_matches_reference(score, T, E, k):
    g = torch.Generator(device=DEV).manual_seed(E + T)
    logits = torch.randn(T, E, device=DEV, generator=g) * 2
    bias = torch.randn(E, device=DEV, generator=g) * 0.1
    w, ids = ops.moe_route(logits, k, bias=bias, route_scale=1.5, score_func=score)
    wr, ir = M.moe_route_ref(logits, bias, k, 1.5, score, None)
    order, order_r = ids.sort(-1), ir.sort(-1)
    assert torch.equal(order.values, order_r.values)
    torch.testing.assert_close(w.gather(-1, order.indices), wr.gather(-1, order_r.indices), rtol=1e-5, atol=1e-6)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_moe_route_hash_path(dtype):
    T, E, k = 40, 256, 6
    g = torch.Generator(device=DEV).manual_seed(1)
    logits = torch.randn(T, E, device=DEV, generator=g)
    hash_ids = torch.randint(0, E, (T, k), device=DEV, generator=g).to(dtype)
    w, ids = ops.moe_route(logits, k, route_scale=2.5, hash_ids=hash_ids)
    wr, ir = M.moe_route_ref(logits, None, k, 2.5, "sqrtsoftplus", hash_ids)
    assert torch.equal(ids, ir)
    torch.testing.assert_close(w, wr, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ the router fused in (moe_gate_experts)
@pytest.fixture
def gate_fused(monkeypatch):
    monkeypatch.setattr(M, "GATE_FUSED_MAX_T", 256)
    monkeypatch.setattr(M, "STREAM_MIN_T", {})


def run_gate(x, gw, k, ex, fmt, limit, shared, **kw):
    (a, sa), (b, sb), (c, sc) = ex["w1"], ex["w3"], ex["w2"]
    return M.moe_gate_experts(x, gw, k, a, b, c, s1=sa, s3=sb, s2=sc, fmt=fmt, limit=limit, shared=shared, **kw)


def check_gate(x, gw, k, ex, fmt, limit, sh, out, w, ids, bias=None, route_scale=1.0, score="sqrtsoftplus",
               hash_ids=None):
    """Routing against moe_route_ref on fp32 logits (ids as sets, weights 1e-5), out bit-equal to moe_experts
    on those ids / weights, and within the bounds of `check` against the emulation and the exact reference."""
    logits = torch.nn.functional.linear(x.float(), gw)
    wr, ir = M.moe_route_ref(logits, bias, k, route_scale, score, hash_ids)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    if hash_ids is None:
        o, orf = ids.sort(-1), ir.sort(-1)
        assert torch.equal(o.values, orf.values)
        torch.testing.assert_close(w.gather(-1, o.indices), wr.gather(-1, orf.indices), rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(ids, ir)
        torch.testing.assert_close(w, wr, rtol=1e-5, atol=1e-6)
    assert torch.equal(out, run_kernel(x, ids, w, ex, fmt, limit, sh))
    if gw.shape[0] > 256:  # many experts: the routing and the bit-equality above (moe_experts' own tests do the rest)
        assert torch.isfinite(out).all()
        return 0.0
    ref = M.moe_experts_ref(x.float(), ids, w, *(ex[n][0] for n in ("w1", "w3", "w2")),
                            *(ex[n][1] for n in ("w1", "w3", "w2")), fmt, limit, sh)
    return check(out, emulated(x, ids, w, ex, fmt, limit, sh), ref)


GATE_CASES = [  # T, d, I, E, k, score, bias, hash, shared, x dtype
    (1, 256, 128, 16, 2, "sqrtsoftplus", True, False, True, torch.bfloat16),
    (5, 256, 128, 64, 6, "sigmoid", True, False, False, torch.float32),
    (8, 512, 256, 256, 6, "sqrtsoftplus", True, True, True, torch.bfloat16),
    (13, 256, 128, 32, 4, "softmax", False, False, True, torch.bfloat16),
    (64, 256, 128, 256, 6, "sqrtsoftplus", True, False, True, torch.bfloat16),
    (3, 256, 128, 1024, 32, "sigmoid", True, False, False, torch.bfloat16),
    (256, 384, 256, 64, 8, "sqrtsoftplus", True, False, True, torch.float32),
]


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("T,d,I,E,k,score,use_bias,use_hash,shared,dt", GATE_CASES)
def test_moe_gate_experts_matches_reference(fmt, T, d, I, E, k, score, use_bias, use_hash, shared, dt, path,
                                            gate_fused):
    g = torch.Generator(device=DEV).manual_seed(T + E)
    ex, sh = make_experts(E, I, d, fmt, seed=E, shared=shared)
    x = torch.randn(T, d, device=DEV, generator=g).to(dt)
    gw = torch.randn(E, d, device=DEV, generator=g) * d ** -0.5
    bias = torch.randn(E, device=DEV, generator=g) * 0.1 if use_bias else None
    hid = torch.randint(0, E, (T, k), device=DEV, generator=g) if use_hash else None
    out, w, ids = run_gate(x, gw, k, ex, fmt, 7.0, sh, bias=bias, route_scale=1.5, score_func=score, hash_ids=hid)
    check_gate(x, gw, k, ex, fmt, 7.0, sh, out, w, ids, bias, 1.5, score, hid)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("T", [1, 8])
def test_moe_gate_experts_v4_flash_shape(fmt, T, gate_fused):
    E, d, I, k = 256, 4096, 2048, 6
    g = torch.Generator(device=DEV).manual_seed(T)
    ex, sh = make_experts(E, I, d, fmt, seed=1, shared=True)
    x = torch.randn(T, d, device=DEV, generator=g).to(torch.bfloat16)
    gw = torch.randn(E, d, device=DEV, generator=g) * d ** -0.5
    bias = torch.randn(E, device=DEV, generator=g) * 0.1
    out, w, ids = run_gate(x, gw, k, ex, fmt, 10.0, sh, bias=bias, route_scale=2.5)
    rel = check_gate(x, gw, k, ex, fmt, 10.0, sh, out, w, ids, bias, 2.5)
    print(f"V4-Flash fused gate {fmt} T={T}: relative error vs exact reference {rel:.4f}")


def test_moe_gate_experts_off_is_the_unfused_ops(monkeypatch):
    monkeypatch.setattr(M, "GATE_FUSED_MAX_T", 0)
    T, d, I, E, k = 4, 256, 128, 16, 2
    g = torch.Generator(device=DEV).manual_seed(5)
    ex, sh = make_experts(E, I, d, "fp8", seed=E, shared=True)
    x = torch.randn(T, d, device=DEV, generator=g).to(torch.bfloat16)
    gw = torch.randn(E, d, device=DEV, generator=g) * d ** -0.5
    out, w, ids = run_gate(x, gw, k, ex, "fp8", 7.0, sh)
    w2, ids2 = ops.moe_route(torch.nn.functional.linear(x.float(), gw), k)
    assert torch.equal(ids, ids2) and torch.equal(w, w2)
    assert torch.equal(out, run_kernel(x, ids2, w2, ex, "fp8", 7.0, sh))


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_moe_gate_experts_deterministic_and_graph_capturable(fmt, path, gate_fused):
    T, d, I, E, k = 24, 512, 256, 64, 6
    g = torch.Generator(device=DEV).manual_seed(4)
    ex, sh = make_experts(E, I, d, fmt, seed=4, shared=True)
    x = torch.randn(T, d, device=DEV, generator=g).to(torch.bfloat16)
    gw = torch.randn(E, d, device=DEV, generator=g) * d ** -0.5
    bias = torch.randn(E, device=DEV, generator=g) * 0.1
    first = run_gate(x, gw, k, ex, fmt, 5.0, sh, bias=bias)
    again = run_gate(x, gw, k, ex, fmt, 5.0, sh, bias=bias)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run_gate(x, gw, k, ex, fmt, 5.0, sh, bias=bias)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = run_gate(x, gw, k, ex, fmt, 5.0, sh, bias=bias)
    x2 = torch.randn(T, d, device=DEV, generator=g).to(torch.bfloat16)
    x.copy_(x2)
    for t in y:
        t.fill_(-1 if t.dtype == torch.int64 else float("nan"))
    graph.replay()
    expect = run_gate(x2, gw, k, ex, fmt, 5.0, sh, bias=bias)
    for a, b in zip(y, expect):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.sanitize
def test_moe_gate_sanitize_small(gate_fused, monkeypatch):
    monkeypatch.setattr(M, "STREAM_BALANCE_MAX_T", bal_of(256))
    for fmt, T, E, k, hashed in (("fp8", 1, 16, 2, False), ("mxfp4", 9, 64, 6, True), ("fp8", 40, 256, 6, False)):
        g = torch.Generator(device=DEV).manual_seed(T)
        ex, sh = make_experts(E, 256, 256, fmt, seed=T, shared=True)
        x = torch.randn(T, 256, device=DEV, generator=g).to(torch.bfloat16)
        gw = torch.randn(E, 256, device=DEV, generator=g) * 0.0625
        hid = torch.randint(-1, E + 1, (T, k), device=DEV, generator=g) if hashed else None
        out, w, ids = run_gate(x, gw, k, ex, fmt, 6.0, sh, bias=torch.randn(E, device=DEV, generator=g),
                               hash_ids=hid)
        assert torch.isfinite(out).all() and torch.isfinite(w).all()
    torch.cuda.synchronize()


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("T", [1, 2, 8])
def test_moe_experts_balanced_split_tiles(fmt, T, monkeypatch):
    """Equal stage ranges per CTA (tiles split between two CTAs, partial sums added by the second to
    finish) at V4-Flash-like widths with few tasks: within rounding of the whole-tile partition (only the
    sum order of split tiles differs), bitwise equal on repeats and in a graph replay."""
    monkeypatch.setattr(M, "STREAM_MIN_T", {})
    E, d, I, k = 64, 2048, 1024, 6
    g = torch.Generator(device=DEV).manual_seed(T + 77)
    ex, sh = make_experts(E, I, d, fmt, seed=77, shared=True)
    x = torch.randn(T, d, device=DEV, generator=g).to(torch.bfloat16)
    ids, w = routing(T, E, k, "random", g)
    whole = run_kernel(x, ids, w, ex, fmt, 8.0, sh)
    monkeypatch.setattr(M, "STREAM_BALANCE_MAX_T", bal_of(256))
    out = run_kernel(x, ids, w, ex, fmt, 8.0, sh)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), whole.float(), rtol=2e-2, atol=2e-2 * whole.float().abs().max().item())
    assert torch.equal(out, run_kernel(x, ids, w, ex, fmt, 8.0, sh))
    ref = M.moe_experts_ref(x.float(), ids, w, *(ex[n][0] for n in ("w1", "w3", "w2")),
                            *(ex[n][1] for n in ("w1", "w3", "w2")), fmt, 8.0, sh)
    check(out, emulated(x, ids, w, ex, fmt, 8.0, sh), ref)
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run_kernel(x, ids, w, ex, fmt, 8.0, sh)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        y = run_kernel(x, ids, w, ex, fmt, 8.0, sh)
    y.fill_(float("nan"))
    graph.replay()
    graph.replay()  # the boundary counters start from zero on every replay (the plan zeroes them)
    assert torch.equal(y, out)
