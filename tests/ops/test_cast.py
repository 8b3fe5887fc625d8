"""FP8 / MXFP8 casts: reference semantics (CPU) and bit-exact kernels (GPU)."""
import pytest
import torch

from deepfuse import ops
from deepfuse.ops import cast as C

FP8 = torch.float8_e4m3fn


def rand(M, K, dtype=torch.float32, device="cpu"):
    # Wide dynamic range per row so that scales differ across groups.
    x = torch.randn(M, K) * torch.exp2(torch.randint(-20, 20, (M, 1)).float())
    return x.to(dtype).to(device)


def roundtrip_bound(x, s_full):
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 in the normal range; subnormal
    # codes (|y| < 2^-6) have absolute spacing 2^-9, so error <= 2^-10 * s there.
    return torch.maximum(x.abs() * 2.0**-4, s_full * 2.0**-10) * (1 + 1e-6)


# ----------------------------------------------------------------------------- CPU semantics
@pytest.mark.parametrize("fmt", ["fp32", "ue8m0"])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_reference_roundtrip_and_scales(fmt, group):
    x = rand(37, 392)
    q, s = ops.fp8_per_token_cast(x, group, scale_fmt=fmt)
    assert q.dtype == FP8 and q.shape == x.shape
    assert s.shape == (37, -(-392 // group))
    sv = C._scale_values(s)
    amax = C._group_amax(x, group)
    if fmt == "fp32":
        assert s.dtype == torch.float32
        torch.testing.assert_close(s, (amax / 448).clamp(min=C.FP32_TINY), rtol=0, atol=0)
    else:
        assert s.dtype == torch.uint8
        assert bool((amax / sv <= 448).all()), "scale too small: values out of e4m3 range"
        assert bool(((amax / (sv / 2) > 448) | (s == 0)).all()), "scale not the smallest power of two"
    deq = ops.fp8_per_token_dequant(q, s, group, dtype=torch.float32)
    full = C._expand(sv, group, x.shape[1])
    assert bool(((deq - x).abs() <= roundtrip_bound(x, full)).all())


def test_ue8m0_exponent_exact_at_powers_of_two():
    # amax exactly 448 * 2^e must give e; one ulp above must give e + 1.
    e = torch.arange(-100, 100)
    a = 448.0 * torch.exp2(e.float())
    assert torch.equal(C.ue8m0_exponent(a), e.int())
    assert torch.equal(C.ue8m0_exponent(torch.nextafter(a, torch.full_like(a, float("inf")))), (e + 1).int())
    assert C.ue8m0_exponent(torch.tensor([0.0])).item() == -127
    assert C.ue8m0_exponent(torch.tensor([1e-45])).item() == -127  # clamped
    assert C.ue8m0_exponent(torch.tensor([3e38])).item() == 120  # log2(3e38 / 448) = 119.01


def test_zero_groups_inf_nan_and_partial_group():
    x = rand(4, 136)
    x[0, :128] = 0
    x[1, 7] = float("nan")
    x[2, 9] = float("inf")
    x[2, 10] = float("-inf")
    for fmt in ("fp32", "ue8m0"):
        q, s = ops.fp8_per_token_cast(x, 128, scale_fmt=fmt)
        qf = q.float()
        # all-zero group: smallest scale, zero codes
        assert C._scale_values(s)[0, 0].item() == (C.FP32_TINY if fmt == "fp32" else 2.0**-127)
        assert bool((qf[0, :128] == 0).all())
        # NaN stays NaN and does not change the group's scale
        assert torch.isnan(qf[1, 7])
        x1 = x[1:2].clone()
        x1[0, 7] = 0
        assert torch.equal(C._group_amax(x1, 128), C._group_amax(x[1:2], 128))
        # inf saturates to +-448 codes
        assert qf[2, 9].item() == 448 and qf[2, 10].item() == -448
        # partial last group (K = 136): its scale covers only its 8 values
        amax_tail = x[3, 128:].abs().max()
        if fmt == "fp32":
            assert s[3, 1].item() == pytest.approx((amax_tail / 448).item(), rel=1e-7)


def test_pack_ue8m0_layout():
    codes = torch.randint(0, 255, (6, 7), dtype=torch.uint8)
    p = ops.pack_ue8m0(codes)
    assert p.shape == (6, 2) and p.stride() == (1, 8) and p.dtype == torch.int32
    for m in range(6):
        for g in range(7):
            word = int(p[m, g // 4].item()) & 0xFFFFFFFF
            assert (word >> (8 * (g % 4))) & 0xFF == codes[m, g].item()
        assert (int(p[m, 1].item()) & 0xFFFFFFFF) >> 24 == 0  # pad byte
    assert torch.equal(ops.unpack_ue8m0(p, 7), codes)


def test_mxfp8_matches_group32_ue8m0():
    x = rand(9, 200, torch.bfloat16)
    q, s = ops.mxfp8_cast(x)
    q2, s2 = ops.fp8_per_token_cast(x, 32, scale_fmt="ue8m0")
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
    qp, sp = ops.mxfp8_cast(x, packed=True)
    assert torch.equal(ops.unpack_ue8m0(sp, s.shape[1]), s)
    torch.testing.assert_close(ops.mxfp8_dequant(qp, sp), ops.mxfp8_dequant(q, s), rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["fp32", "ue8m0"])
def test_block_cast_reference(fmt):
    w = rand(300, 264)
    q, s = ops.fp8_block_cast(w, scale_fmt=fmt)
    assert s.shape == (3, 3)
    wa = w.abs()
    for i in range(3):
        for j in range(3):
            blk = wa[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            sv = C._scale_values(s)[i, j]
            assert bool((blk.max() / sv <= 448 * (1 + 1e-6)))
    deq = ops.fp8_block_dequant(q, s, dtype=torch.float32)
    full = C._scale_values(s).repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :264]
    assert bool(((deq - w).abs() <= roundtrip_bound(w, full)).all())


def test_validation_errors():
    x = rand(4, 64)
    with pytest.raises(TypeError, match="x has dtype"):
        ops.fp8_per_token_cast(x.half())
    with pytest.raises(ValueError, match="2-D"):
        ops.fp8_per_token_cast(x[0])
    with pytest.raises(ValueError, match="multiple of 8"):
        ops.fp8_per_token_cast(rand(4, 60))
    with pytest.raises(ValueError, match="group"):
        ops.fp8_per_token_cast(x, 48)
    with pytest.raises(ValueError, match="scale_fmt"):
        ops.fp8_per_token_cast(x, scale_fmt="e8m0")
    with pytest.raises(ValueError, match="contiguous last dimension"):
        ops.fp8_per_token_cast(rand(64, 8).t())
    with pytest.raises(TypeError, match="torch.Tensor"):
        ops.mxfp8_cast([[1.0]])
    with pytest.raises(ValueError, match="block"):
        ops.fp8_block_cast(x, block=128)
    with pytest.raises(ValueError, match="scale must have shape"):
        ops.fp8_per_token_dequant(ops.fp8_per_token_cast(x)[0], torch.ones(4, 2))


def test_opcheck_and_compile_cpu():
    x = rand(8, 256)
    torch.library.opcheck(torch.ops.deepfuse.fp8_group_cast.default, (x, 128, "fp32"))
    torch.library.opcheck(torch.ops.deepfuse.fp8_group_cast.default, (x, 32, "ue8m0_packed"))
    torch.library.opcheck(torch.ops.deepfuse.fp8_block_cast.default, (x, 128, 128, "ue8m0"))
    f = torch.compile(lambda t: ops.fp8_per_token_cast(t, 128, scale_fmt="ue8m0"), fullgraph=True, backend="aot_eager")
    q, s = f(x)
    q2, s2 = ops.fp8_per_token_cast(x, 128, scale_fmt="ue8m0")
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)


# ----------------------------------------------------------------------------- GPU kernels
def poison_allocator(nbytes: int) -> None:
    """Fill the caching allocator's free blocks with 0x7e bytes so unwritten outputs show."""
    t = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    t.fill_(0x7E)
    del t


def assert_bytes_equal(a: torch.Tensor, b: torch.Tensor, what: str):
    a, b = a.cpu(), b.cpu()
    assert a.shape == b.shape, f"{what}: shape {a.shape} vs {b.shape}"
    if a.dtype == FP8:
        ab, bb = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
        nan_a, nan_b = (ab & 0x7F) == 0x7F, (bb & 0x7F) == 0x7F
        same = (ab == bb) | (nan_a & nan_b)
    elif a.dtype == torch.float32:
        same = (a.view(torch.int32) == b.view(torch.int32)) | (torch.isnan(a) & torch.isnan(b))
    else:
        same = a == b
    bad = (~same).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.shape[0]} of {a.numel()} elements differ, first at {bad[0].tolist()}"


GPU_SHAPES = [(1, 8), (3, 136), (5, 520), (64, 7168), (257, 4096), (1000, 1544)]


@pytest.mark.gpu
@pytest.mark.parametrize("M,K", GPU_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group,fmt", [(128, "fp32"), (128, "ue8m0"), (64, "fp32"), (32, "ue8m0"), (32, "ue8m0_packed")])
def test_group_cast_gpu_bit_exact(M, K, dtype, group, fmt):
    x = rand(M, K, dtype, "cuda")
    x.view(-1)[torch.randint(0, M * K, (3,))] = float("nan")
    x.view(-1)[torch.randint(0, M * K, (3,))] = float("inf")
    if M > 2:
        x[1] = 0
    poison_allocator(8 * M * K + (1 << 20))
    q, s = torch.ops.deepfuse.fp8_group_cast(x, group, fmt)
    qr, sr = C.fp8_group_cast_ref(x.cpu(), group, fmt)
    assert_bytes_equal(q, qr, "q")
    if fmt == "ue8m0_packed":
        assert s.stride() == sr.stride()
        # the packed buffer including its pad rows: compare the underlying words
        W, ld = s.shape[1], s.stride(1)
        full = torch.as_strided(s, (W, ld), (ld, 1))
        full_r = torch.as_strided(sr, (W, ld), (ld, 1))
        assert_bytes_equal(full, full_r, "packed scales")
    else:
        assert_bytes_equal(s, sr, "scales")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_cast_gpu_scale_boundaries(dtype):
    # Group maxima exactly at 448 * 2^e and one ulp either side, subnormal and tiny maxima:
    # the exponent rule must match the reference at every power-of-two boundary.
    e = torch.arange(-140, 120, dtype=torch.float32)
    a = (448.0 * torch.exp2(e)).to(dtype).float()
    up = torch.nextafter(a, torch.full_like(a, float("inf"))).to(dtype).float()
    dn = torch.nextafter(a, torch.zeros_like(a)).to(dtype).float()
    tiny = torch.tensor([1e-45, 1e-40, 2.0**-127, 2.0**-126, 3e-39, 1e38, 3.3e38])
    amax = torch.cat([a, up, dn, tiny.to(dtype).float()])
    x = torch.rand(amax.numel(), 32) * amax[:, None] * 0.5
    x[:, 7] = -amax
    x = x.to(dtype).cuda()
    for fmt in ("fp32", "ue8m0"):
        q, s = torch.ops.deepfuse.fp8_group_cast(x, 32, fmt)
        qr, sr = C.fp8_group_cast_ref(x.cpu(), 32, fmt)
        assert_bytes_equal(s, sr, f"{fmt} scales")
        assert_bytes_equal(q, qr, f"{fmt} q")


@pytest.mark.gpu
def test_group_cast_gpu_strided_rows_and_empty():
    base = rand(50, 1024, torch.bfloat16, "cuda")
    x = base[:, 128:128 + 512]
    q, s = ops.fp8_per_token_cast(x, 128, scale_fmt="ue8m0")
    qr, sr = C.fp8_group_cast_ref(x.cpu(), 128, "ue8m0")
    assert_bytes_equal(q, qr, "q")
    assert_bytes_equal(s, sr, "s")
    q0, s0 = ops.mxfp8_cast(torch.empty(0, 64, device="cuda"), packed=True)
    assert q0.shape == (0, 64) and s0.shape == (0, 1)


@pytest.mark.gpu
def test_gpu_validation():
    x = rand(4, 64, torch.bfloat16, "cuda")
    with pytest.raises(ValueError, match="16-byte aligned"):
        ops.fp8_per_token_cast(x.view(-1)[4:4 + 192].view(3, 64))
    with pytest.raises(ValueError, match="row stride"):
        ops.fp8_per_token_cast(torch.empty(4, 68, dtype=torch.bfloat16, device="cuda")[:, :64])


@pytest.mark.gpu
def test_group_cast_cuda_graph_and_compile():
    x = rand(128, 7168, torch.bfloat16, "cuda")
    q_ref, s_ref = C.fp8_group_cast_ref(x.cpu(), 128, "fp32")
    s_stream = torch.cuda.Stream()
    s_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s_stream):
        ops.fp8_per_token_cast(x)
    torch.cuda.current_stream().wait_stream(s_stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        q, s = ops.fp8_per_token_cast(x)
    x.copy_(rand(128, 7168, torch.bfloat16, "cuda"))
    g.replay()
    q_ref, s_ref = C.fp8_group_cast_ref(x.cpu(), 128, "fp32")
    assert_bytes_equal(q, q_ref, "graph q")
    assert_bytes_equal(s, s_ref, "graph s")
    f = torch.compile(lambda t: ops.mxfp8_cast(t, packed=True), fullgraph=True)
    q2, s2 = f(x)
    qr2, sr2 = C.fp8_group_cast_ref(x.cpu(), 32, "ue8m0_packed")
    assert_bytes_equal(q2, qr2, "compiled q")
    assert_bytes_equal(s2, sr2, "compiled s")


@pytest.mark.sanitize
@pytest.mark.parametrize("fmt", ["fp32", "ue8m0", "ue8m0_packed"])
def test_group_cast_sanitize(fmt):
    group = 32 if fmt == "ue8m0_packed" else 128
    for M, K in [(3, 136), (33, 1032)]:
        x = rand(M, K, torch.bfloat16, "cuda")
        q, s = torch.ops.deepfuse.fp8_group_cast(x, group, fmt)
        torch.cuda.synchronize()
        qr, _ = C.fp8_group_cast_ref(x.cpu(), group, fmt)
        assert_bytes_equal(q, qr, "q")
