"""Weight block cast (fp8_block_cast, TileLang kernel): reference semantics on the CPU,
bit-exact kernel on the GPU."""
import pytest
import torch

from deepfuse import _ext, ops
from deepfuse.ops import cast as C

FP8 = torch.float8_e4m3fn
FMTS = ["fp32", "ue8m0"]
DTYPES = [torch.bfloat16, torch.float32]


def bits32(x: torch.Tensor) -> torch.Tensor:
    return x.float().contiguous().view(torch.int32)


def f32(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


def make_w(N, K, dtype=torch.float32, seed=0, device="cpu", specials=True):
    """Random weights whose 128 x 128 blocks span a wide range of scales, plus special
    blocks: all zero, tiny, subnormal values, inf, NaN, exact e4m3 rounding ties."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g)
    w *= torch.exp2(torch.randint(-24, 24, (N, 1), generator=g).float())
    w *= torch.exp2(torch.randint(-8, 8, (1, K), generator=g).float())
    if specials and N >= 8 and K >= 8:
        bn, bk = -(-N // 128), -(-K // 128)
        blocks = [(i, j) for i in range(bn) for j in range(bk)]
        perm = torch.randperm(len(blocks), generator=g).tolist()
        pick = [blocks[p] for p in perm]

        def region(k):
            i, j = pick[k % len(pick)]
            return slice(i * 128, min(N, i * 128 + 128)), slice(j * 128, min(K, j * 128 + 128))

        r, c = region(0)
        w[r, c] = 0  # all-zero block
        r, c = region(1)
        w[r, c] *= 2.0**-100 / w[r, c].abs().max()  # tiny block
        r, c = region(2)
        w[r, c] *= 2.0**-118 / w[r, c].abs().max()  # subnormal quotients and values
        r, c = region(3)
        w[r, c][0, 0] = float("inf")
        w[r, c][-1, -1] = float("-inf")
        r, c = region(4)
        w[r, c][0, -1] = float("nan")
        r, c = region(5)
        ties = torch.arange(w[r, c].numel()) % 64 / 16.0 + 1 / 32  # odd multiples of 2^-5
        w[r, c] = ties.view(w[r, c].shape) * torch.where(torch.rand(w[r, c].shape, generator=g) < 0.5, -1.0, 1.0)
        w[r, c][0, 0] = 448.0  # amax 448: fp32 scale 1, ue8m0 exponent 0
    return w.to(dtype).to(device)


def ue8m0_exponent_bits(amax: torch.Tensor) -> torch.Tensor:
    """The kernel's exponent rule, from the bits of a finite amax >= 0: a normal amax = 1.f * 2^E
    gives E - 8 + (f > 0.75), clamped to [-127, 127]; zero and subnormals give -127."""
    b = bits32(amax).to(torch.int64)
    e = (b >> 23) - 135 + ((b & 0x7FFFFF) > 0x600000).to(torch.int64)
    return torch.where(b < 0x800000, torch.full_like(e, -127), e.clamp(-127, 127)).to(torch.int32)


def block_view(x, N, K):
    bn, bk = -(-N // 128), -(-K // 128)
    return [(i, j, x[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]) for i in range(bn) for j in range(bk)]


# ----------------------------------------------------------------------------- CPU semantics
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K", [(200, 136), (1, 8), (128, 128), (300, 520)])
def test_reference_partial_blocks(N, K, dtype, fmt):
    """Each block's scale comes from exactly its own (possibly partial) finite values, and
    q = e4m3(x * (1 / s)) or e4m3(x * 2^-e), computed block by block here."""
    w = make_w(N, K, dtype, seed=N * K)
    q, s = ops.fp8_block_cast(w, scale_fmt=fmt)
    assert q.shape == (N, K) and q.dtype == FP8
    assert s.shape == (-(-N // 128), -(-K // 128))
    assert s.dtype == (torch.float32 if fmt == "fp32" else torch.uint8)
    qb = q.view(torch.uint8)
    for i, j, blk in block_view(w.float(), N, K):
        fin = blk[torch.isfinite(blk)]
        amax = fin.abs().max() if fin.numel() else torch.tensor(0.0)
        if fmt == "fp32":
            sv = torch.clamp(amax / 448.0, min=C.FP32_TINY)
            assert bits32(s[i, j]).item() == bits32(sv).item(), (i, j)
            y = blk * (1.0 / sv)
        else:
            e = int(C.ue8m0_exponent(amax.view(1)).item())
            assert s[i, j].item() == e + 127, (i, j)
            y = blk * 2.0**-e
        want = y.clamp(-448, 448).to(FP8).view(torch.uint8)
        got = qb[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
        nan = torch.isnan(y)
        assert torch.equal(got[~nan], want[~nan]), (i, j)
        assert bool(((got[nan] & 0x7F) == 0x7F).all()), "NaN must stay NaN"


@pytest.mark.parametrize("fmt", FMTS)
def test_reference_zeros_inf_nan(fmt):
    w = torch.randn(256, 256)
    w[:128, :128] = 0
    w[:128, 128:] = 0
    w[0, 130] = float("nan")  # a block of zeros and one NaN is still an all-zero block
    w[200, 10] = float("inf")
    w[201, 11] = float("-inf")
    w[202, 12] = float("nan")
    clean = w.clone()
    clean[200, 10] = clean[201, 11] = clean[202, 12] = 0
    q, s = ops.fp8_block_cast(w, scale_fmt=fmt)
    _, s_clean = ops.fp8_block_cast(clean, scale_fmt=fmt)
    smallest = C.FP32_TINY if fmt == "fp32" else 2.0**-127
    sv = C._scale_values(s)
    assert sv[0, 0].item() == smallest and sv[0, 1].item() == smallest
    assert bool((q[:128].float().nan_to_num(0) == 0).all())
    assert torch.isnan(q[0, 130].float())
    assert torch.equal(s[1], s_clean[1]), "inf/NaN must not change a block's scale"
    assert q[200, 10].float().item() == 448 and q[201, 11].float().item() == -448
    assert torch.isnan(q[202, 12].float())


def test_reference_ue8m0_exponent_matches_bit_rule():
    """The kernel computes the UE8M0 exponent from the bits of amax; the reference from frexp.
    They agree on every bf16 magnitude, on powers of two times 448 and their neighbours, and on
    random fp32 (checked exhaustively over all finite fp32 offline)."""
    allbf16 = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    e = torch.arange(-140, 121).float()
    p = 448.0 * torch.exp2(e)
    p = p[torch.isfinite(p)]
    up = torch.nextafter(p, torch.full_like(p, float("inf")))
    dn = torch.nextafter(p, torch.zeros_like(p))
    g = torch.Generator().manual_seed(7)
    rnd = f32(torch.randint(0, 0x7F800000, (1 << 20,), generator=g, dtype=torch.int64))
    edge = torch.tensor([0.0, 1e-45, 1.1754942e-38, 1.17549435e-38, 3.4028235e38, 448.0, 447.99997, 448.00003])
    for a in (allbf16, p, up, dn, rnd, edge):
        assert torch.equal(C.ue8m0_exponent(a), ue8m0_exponent_bits(a))
    # the rule: the smallest 2^e with amax / 2^e <= 448 (exact in float64), e in [-127, 127]
    a = torch.cat([rnd, p, up, dn]).double()
    ee = ue8m0_exponent_bits(a.float()).double()
    ok = a / torch.exp2(ee) <= 448
    smallest = (a / torch.exp2(ee - 1) > 448) | (ee == -127)
    assert bool(ok.all()) and bool(smallest.all())


def test_opcheck_cpu():
    w = make_w(136, 264, seed=5, specials=False)
    for fmt in FMTS:
        torch.library.opcheck(torch.ops.deepfuse.fp8_block_cast.default, (w, 128, 128, fmt))


def has_tilelang_kernels() -> bool:
    return _ext.has_cuda_kernels() and bool(_ext._C.tilelang_kernels())


# ----------------------------------------------------------------------------- GPU kernel
def assert_same(got: torch.Tensor, want: torch.Tensor, what: str):
    """Bitwise equality; e4m3 NaN codes match whatever their sign (the sign of NaN is not part
    of the semantics: x86 keeps it through the reference's division, the GPU does not)."""
    got, want = got.cpu(), want.cpu()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    if want.dtype == FP8:
        a, b = got.view(torch.uint8), want.view(torch.uint8)
        same = (a == b) | (((a & 0x7F) == 0x7F) & ((b & 0x7F) == 0x7F))
    elif want.dtype == torch.float32:
        same = got.view(torch.int32) == want.view(torch.int32)
    else:
        same = got == want
    bad = (~same).nonzero()
    if bad.numel():
        i = tuple(bad[0].tolist())
        raise AssertionError(f"{what}: {bad.shape[0]} of {want.numel()} elements differ; first at {i}: "
                             f"got {got[i].view(torch.uint8) if want.dtype == FP8 else got[i]}, "
                             f"want {want[i].view(torch.uint8) if want.dtype == FP8 else want[i]}")


GUARD = 4096  # poisoned bytes after each output, checked for stray writes


def run_poisoned(w: torch.Tensor, fmt: str, poison: int):
    """Calls the launcher on outputs pre-filled with `poison` bytes (plus guard bytes)."""
    N, K = w.shape
    gn, gk = -(-N // 128), -(-K // 128)
    sbytes = gn * gk * (4 if fmt == "fp32" else 1)
    qbuf = torch.full((N * K + GUARD,), poison, dtype=torch.uint8, device=w.device)
    sbuf = torch.full((sbytes + GUARD,), poison, dtype=torch.uint8, device=w.device)
    q = qbuf[:N * K].view(FP8).view(N, K)
    s = sbuf[:sbytes].view(torch.float32 if fmt == "fp32" else torch.uint8).view(gn, gk)
    _ext.ext(w.device).fp8_block_cast(w=w, q=q, scale=s, scale_fmt=fmt)
    torch.cuda.synchronize()
    assert bool((qbuf[N * K:] == poison).all()), "kernel wrote past q"
    assert bool((sbuf[sbytes:] == poison).all()), "kernel wrote past the scales"
    return q, s


GPU_SHAPES = [(1, 8), (128, 128), (129, 136), (200, 264), (257, 1032), (1000, 1544), (384, 7168), (7168, 256)]


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", GPU_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FMTS)
def test_block_cast_gpu_bit_exact(N, K, dtype, fmt):
    w = make_w(N, K, dtype, seed=N * 7 + K, device="cuda")
    qr, sr = C.fp8_block_cast_ref(w.cpu(), 128, 128, fmt)
    for poison in (0xFF, 0x00):  # every output element must be written by the kernel
        q, s = run_poisoned(w, fmt, poison)
        assert_same(q, qr, f"q (poison {poison:#x})")
        assert_same(s, sr, f"scales (poison {poison:#x})")
    q, s = ops.fp8_block_cast(w, scale_fmt=fmt)  # the public op
    assert_same(q, qr, "q via ops.fp8_block_cast")
    assert_same(s, sr, "scales via ops.fp8_block_cast")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS)
def test_block_cast_gpu_large(fmt):
    w = make_w(4096, 7168, torch.bfloat16, seed=11, device="cuda")
    q, s = ops.fp8_block_cast(w, scale_fmt=fmt)
    qr, sr = C.fp8_block_cast_ref(w.cpu(), 128, 128, fmt)
    assert_same(q, qr, "q")
    assert_same(s, sr, "scales")
    deq = ops.fp8_block_dequant(q, s, dtype=torch.float32)
    fin = torch.isfinite(w.float())
    err = (deq - w.float())[fin].norm() / w.float()[fin].norm()
    assert err.item() < 0.05, f"relative round-trip error {err.item():.3g}"


@pytest.mark.gpu
def test_block_cast_gpu_stream_order():
    """Writes to w just before the cast (same stream) are seen; the launcher allows PDL, so the
    kernel must wait for the previous kernel (griddepcontrol.wait)."""
    N, K = 8192, 7168
    a = make_w(N, K, torch.bfloat16, seed=1, device="cuda", specials=False)
    b = make_w(N, K, torch.bfloat16, seed=2, device="cuda", specials=False)
    w = torch.empty_like(a)
    want = [C.fp8_block_cast_ref(t.cpu(), 128, 128, "fp32") for t in (a, b)]
    outs = []
    for it in range(6):
        w.copy_(a if it % 2 == 0 else b)
        outs.append(ops.fp8_block_cast(w))
    torch.cuda.synchronize()
    for it, (q, s) in enumerate(outs):
        assert_same(q, want[it % 2][0], f"q, iteration {it}")
        assert_same(s, want[it % 2][1], f"scales, iteration {it}")


@pytest.mark.gpu
def test_block_cast_gpu_graph_and_compile():
    w = make_w(1000, 1544, torch.bfloat16, seed=4, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ops.fp8_block_cast(w, scale_fmt="ue8m0")
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        q, s = ops.fp8_block_cast(w, scale_fmt="ue8m0")
    w.copy_(make_w(1000, 1544, torch.bfloat16, seed=5, device="cuda"))
    g.replay()
    qr, sr = C.fp8_block_cast_ref(w.cpu(), 128, 128, "ue8m0")
    assert_same(q, qr, "graph q")
    assert_same(s, sr, "graph scales")
    f = torch.compile(lambda t: ops.fp8_block_cast(t), fullgraph=True)
    q2, s2 = f(w)
    qr2, sr2 = C.fp8_block_cast_ref(w.cpu(), 128, 128, "fp32")
    assert_same(q2, qr2, "compiled q")
    assert_same(s2, sr2, "compiled scales")
    torch.library.opcheck(torch.ops.deepfuse.fp8_block_cast.default, (w[:256].contiguous(), 128, 128, "fp32"))


@pytest.mark.gpu
def test_block_cast_gpu_validation():
    w = make_w(128, 256, torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="multiple of 8"):
        ops.fp8_block_cast(torch.zeros(128, 132, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(ValueError, match="block"):
        ops.fp8_block_cast(w, block=(64, 128))
    with pytest.raises(ValueError, match="aligned"):
        ops.fp8_block_cast(w.view(-1)[4:4 + 127 * 256].view(127, 256))
    q, s = ops.fp8_block_cast(torch.empty(0, 256, dtype=torch.bfloat16, device="cuda"))
    assert q.shape == (0, 256) and s.shape == (0, 2)


@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FMTS)
def test_block_cast_sanitize(dtype, fmt):
    for N, K in [(1, 8), (129, 136), (300, 264)]:
        w = make_w(N, K, dtype, seed=N + K, device="cuda")
        q, s = ops.fp8_block_cast(w, scale_fmt=fmt)
        torch.cuda.synchronize()
        qr, sr = C.fp8_block_cast_ref(w.cpu(), 128, 128, fmt)
        assert_same(q, qr, "q")
        assert_same(s, sr, "scales")
