"""Weight block cast to FP8 e4m3 with one scale per 128 x 128 block (TileLang).

w [N, K] bf16/fp32 (row-major, contiguous, K % 8 == 0; N and K dynamic, edge blocks
partial) -> q e4m3 [N, K] and scales [ceil(N/128), ceil(K/128)], fp32 or UE8M0 bytes.
Bit-identical to deepfuse.ops.cast.fp8_block_cast_ref (see its module docstring).

One CTA of 256 threads per 128 x 128 block; 8 threads cover a row's 128 values with 16-byte
loads (2 per row for bf16, 4 for fp32, coalesced per warp) and each thread handles 4 rows
32 apart. A thread issues all its loads before any math and keeps the raw words in
registers; the block amax is reduced with warp shuffles plus shared memory, then the same
registers are scaled, converted and stored (8 or 4 e4m3 bytes per store).

Exactness:
- amax: max|x| ignores NaN (fmaxf). If it is inf, the block recomputes the amax over
  finite values only (block-uniform slow path, taken only by blocks holding an inf).
- fp32 scale s = max(amax / 448, 2^-126); q = e4m3(x * r), r = 1 / s (IEEE, once per block).
- UE8M0: e = the smallest power of two with amax / 2^e <= 448, computed from the bits of
  amax (normal amax = 1.f * 2^E: e = E - 8 + (f > 0.75); zero or subnormal: -127), clamped
  to [-127, 127]; q = e4m3(x * 2^-e), 2^-e built from bits (exact; e <= 120 for finite amax).
- e4m3 conversion: cvt.rn.satfinite (round to nearest even, |y| > 448 -> +-448, inf ->
  +-448, NaN -> NaN), which equals the reference's clamp to +-448 followed by the cast.

The kernel waits on the programmatic (PDL) grid dependency before reading w, since the
generated launcher allows programmatic stream serialization.
"""
import tilelang.language as T

BLOCK = 128
THREADS = 256
E4M3_MAX = 448.0
FP32_TINY = 2.0**-126


def _vals(w, in_dtype: str) -> list:
    """Bits of the fp32 values held in one 32-bit word of raw input: two bf16 (low half
    first) or one fp32. The bf16 halves are placed with byte permutes; see _abs_vals."""
    if in_dtype == "bfloat16":
        return [T.call_extern("uint32", "__byte_perm", w, T.uint32(0), T.uint32(0x1044)),
                T.call_extern("uint32", "__byte_perm", w, T.uint32(0), T.uint32(0x3244))]
    return [w]


def _abs_vals(w, in_dtype: str) -> list:
    """Bits of |value| for the values of one word (shifts and masks). Deliberately not
    written like _vals: nvcc would otherwise keep shared subexpressions of the amax pass
    live until the store pass, doubling the registers that hold the tile."""
    if in_dtype == "bfloat16":
        return [(w << T.uint32(16)) & T.uint32(0x7FFFFFFF), w & T.uint32(0x7FFF0000)]
    return [w & T.uint32(0x7FFFFFFF)]


def _f32(bits):
    return T.reinterpret(bits, "float32")


def _block_cast(in_dtype: str, scale_fmt: str):
    assert in_dtype in ("bfloat16", "float32") and scale_fmt in ("fp32", "ue8m0")
    N = T.dynamic("N")
    K = T.dynamic("K")
    per_word = 2 if in_dtype == "bfloat16" else 1  # values per 32-bit word
    vec = 4 * per_word  # values per 16-byte load
    lanes = 8  # threads per row: a warp covers 4 rows, 8 x 16 contiguous bytes each
    rows = THREADS // lanes  # rows per pass
    passes = BLOCK // rows  # row offsets per thread
    chunks = BLOCK // (lanes * vec)  # 16-byte loads per thread and row
    warps = THREADS // 32
    s_dtype = "float32" if scale_fmt == "fp32" else "uint8"
    ue8m0 = scale_fmt == "ue8m0"
    # 64 raw words per thread: 32 (bf16) or 64 (fp32) data registers
    min_blocks = 4 if in_dtype == "bfloat16" else 2

    @T.prim_func
    def block_cast(
        W: T.Tensor((N, K), in_dtype),
        Q: T.Tensor((N, K), "float8_e4m3fn"),
        S: T.Tensor((T.ceildiv(N, BLOCK), T.ceildiv(K, BLOCK)), s_dtype),
    ):
        with T.Kernel(T.ceildiv(K, BLOCK), T.ceildiv(N, BLOCK), threads=THREADS) as (bx, by):
            T.annotate_min_blocks_per_sm(min_blocks)
            T.assume(K % 8 == 0)
            tx = T.get_thread_binding()
            xw = T.alloc_local((passes, chunks, 4), "uint32")  # raw 16-byte loads, as words
            y = T.alloc_local((vec,), "float32")  # one chunk of scaled values
            red = T.alloc_shared((2, warps), "float32")
            amax = T.alloc_var("float32", init=0.0)
            bmax = T.alloc_var("float32", init=0.0)
            row0 = by * BLOCK + tx // lanes
            col0 = bx * BLOCK + (tx % lanes) * vec
            T.pdl_sync()
            for p in T.unroll(passes):  # all loads first; out-of-range chunks read as 0
                for c in T.unroll(chunks):
                    xw[p, c, 0:4] = T.ldg128(W[row0 + p * rows, col0 + c * lanes * vec],
                                             pred=row0 + p * rows < N and col0 + c * lanes * vec < K)
            # max |x|: fmaxf drops NaN; an inf is dealt with below
            for p in T.unroll(passes):
                for c in T.unroll(chunks):
                    for j in T.unroll(4):
                        for a in _abs_vals(xw[p, c, j], in_dtype):
                            amax = T.max(amax, _f32(a))
            amax = T.warp_reduce_max(amax)
            if tx % 32 == 0:
                red[0, tx // 32] = amax
            T.sync_threads()
            bmax = red[0, 0]
            for w in T.unroll(1, warps):
                bmax = T.max(bmax, red[0, w])
            has_inf = T.isinf(bmax)
            if has_inf:  # block-uniform: amax over finite values only
                amax = 0.0
                for p in T.unroll(passes):
                    for c in T.unroll(chunks):
                        for j in T.unroll(4):
                            for a in _abs_vals(xw[p, c, j], in_dtype):
                                amax = T.max(amax, T.if_then_else(a < T.uint32(0x7F800000), _f32(a), T.float32(0.0)))
                amax = T.warp_reduce_max(amax)
                if tx % 32 == 0:
                    red[1, tx // 32] = amax
                T.sync_threads()
                bmax = red[1, 0]
                for w in T.unroll(1, warps):
                    bmax = T.max(bmax, red[1, w])
            if ue8m0:
                bits = T.reinterpret(bmax, "uint32")
                e_raw = T.cast(bits >> T.uint32(23), "int32") - 135 + T.cast(
                    (bits & T.uint32(0x7FFFFF)) > T.uint32(0x600000), "int32")
                e = T.alloc_var("int32", init=T.if_then_else(bits < T.uint32(0x800000), -127, T.min(T.max(e_raw, -127), 127)))
                mult = T.alloc_var("float32", init=_f32(T.cast(127 - e, "uint32") << T.uint32(23)))  # 2^-e, e <= 126
                for p in T.unroll(passes):
                    for c in T.unroll(chunks):
                        if row0 + p * rows < N and col0 + c * lanes * vec < K:
                            for j in T.unroll(4):
                                for k, b in enumerate(_vals(xw[p, c, j], in_dtype)):
                                    y[j * per_word + k] = _f32(b) * mult
                            for v in T.vectorized(vec):
                                Q[row0 + p * rows, col0 + c * lanes * vec + v] = T.cast(y[v], "float8_e4m3fn")
                if tx == 0:
                    S[by, bx] = T.cast(e + 127, "uint8")
            else:
                s = T.max(bmax / T.float32(E4M3_MAX), T.float32(FP32_TINY))
                r = T.alloc_var("float32", init=T.float32(1.0) / s)  # IEEE reciprocal, as the reference
                for p in T.unroll(passes):
                    for c in T.unroll(chunks):
                        if row0 + p * rows < N and col0 + c * lanes * vec < K:
                            for j in T.unroll(4):
                                for k, b in enumerate(_vals(xw[p, c, j], in_dtype)):
                                    y[j * per_word + k] = _f32(b) * r
                            for v in T.vectorized(vec):
                                Q[row0 + p * rows, col0 + c * lanes * vec + v] = T.cast(y[v], "float8_e4m3fn")
                if tx == 0:
                    S[by, bx] = s

    return block_cast


fp8_block_cast_bf16_fp32 = _block_cast("bfloat16", "fp32")
fp8_block_cast_bf16_ue8m0 = _block_cast("bfloat16", "ue8m0")
fp8_block_cast_fp32_fp32 = _block_cast("float32", "fp32")
fp8_block_cast_fp32_ue8m0 = _block_cast("float32", "ue8m0")

__all__ = [
    "fp8_block_cast_bf16_fp32",
    "fp8_block_cast_bf16_ue8m0",
    "fp8_block_cast_fp32_fp32",
    "fp8_block_cast_fp32_ue8m0",
]
