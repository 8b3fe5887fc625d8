"""FP8 e4m3 casts with per-group scales: per-token (1 x group), MXFP8 (1 x 32), and weight
blocks (bn x bk), plus their dequantisations.

Semantics (the references below define them; the CUDA kernels match them bit for bit):
- scale_fmt "fp32": s = max(amax / 448, 2^-126) in fp32; q = e4m3(clamp(x * r, +-448)) with
  r = 1 / s rounded to fp32 (a multiply per value, as FP8 GEMM libraries do, not a division).
- scale_fmt "ue8m0": s = 2^e, the smallest power of two with amax / s <= 448, e clamped to
  [-127, 127] and stored as the byte e + 127; q = e4m3(clamp(x * 2^-e, +-448)).
- amax is taken over the finite values of the group: +-inf saturate to +-448 * s, NaN stays
  NaN (e4m3 0x7f/0xff), and neither changes the scale of its group.
- All-zero groups get the smallest scale (2^-126 fp32, 2^-127 ue8m0) and zero codes.
- K (and N for blocks) need not be a multiple of the group: the last group is partial and its
  scale covers just its values. Activation rows need K % 8 == 0 (16-byte rows).
- e4m3 rounding is round-to-nearest-even.
"""
from __future__ import annotations

import torch

from deepfuse import _ext
from deepfuse.ops._registry import op
from deepfuse.ops._checks import check_aligned, check_choice, check_int, check_tensor

E4M3_MAX = 448.0
FP32_TINY = torch.finfo(torch.float32).tiny  # 2^-126
_FP8 = torch.float8_e4m3fn


# ----------------------------------------------------------------------------- references
def ue8m0_exponent(amax: torch.Tensor) -> torch.Tensor:
    """Smallest e with amax / 2^e <= 448, clamped to [-127, 127]; amax/448 == 0 gives -127 (int32)."""
    amax = amax.float()
    v = amax / E4M3_MAX
    m, e = torch.frexp(v)
    e = torch.where(m == 0.5, e - 1, e)
    e = torch.where(amax > E4M3_MAX * torch.exp2(e.float()), e + 1, e)
    e = torch.where(v == 0, torch.full_like(e, -127), e)  # zero, or amax/448 underflowed
    return e.clamp(-127, 127).to(torch.int32)


def _group_amax(xf: torch.Tensor, group: int) -> torch.Tensor:
    """[M, K] fp32 -> [M, ceil(K/group)] max |x| over finite values (partial last group)."""
    M, K = xf.shape
    G = -(-K // group)
    a = torch.where(torch.isfinite(xf), xf.abs(), torch.zeros_like(xf))
    a = torch.nn.functional.pad(a, (0, G * group - K))
    return a.view(M, G, group).amax(dim=-1)


def _scale_codes(amax: torch.Tensor, scale_fmt: str):
    """-> (stored scale tensor, fp32 multiplier-or-divisor info) for the references."""
    if scale_fmt == "fp32":
        s = torch.clamp(amax / E4M3_MAX, min=FP32_TINY)
        return s, s
    e = ue8m0_exponent(amax)
    return (e + 127).to(torch.uint8), e


def _quantise(xf: torch.Tensor, info: torch.Tensor, scale_fmt: str) -> torch.Tensor:
    if scale_fmt == "fp32":
        y = xf * (1.0 / info)
    else:
        y = xf * torch.exp2(-info.float())
    return y.clamp(-E4M3_MAX, E4M3_MAX).to(_FP8)


def _expand(s: torch.Tensor, group: int, K: int) -> torch.Tensor:
    return s.repeat_interleave(group, dim=-1)[..., :K]


def fp8_group_cast_ref(x: torch.Tensor, group: int, scale_fmt: str):
    """Reference of the per-row group cast. scale_fmt: fp32 | ue8m0 | ue8m0_packed."""
    xf = x.float()
    M, K = xf.shape
    amax = _group_amax(xf, group)
    stored, info = _scale_codes(amax, "fp32" if scale_fmt == "fp32" else "ue8m0")
    q = _quantise(xf, _expand(info, group, K), scale_fmt)
    if scale_fmt == "ue8m0_packed":
        stored = pack_ue8m0(stored)
    return q, stored


def pack_ue8m0(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [M, G] -> int32 [M, ceil(G/4)], MN-major (strides (1, ceil(M/4)*4)).

    Byte j of word (m, w) holds group 4w + j (little endian); pad bytes and pad rows are 0.
    This is the layout Hopper/Blackwell FP8 GEMMs read with TMA (DeepGEMM's packed UE8M0)."""
    M, G = codes.shape
    W, ld = -(-G // 4), -(-M // 4) * 4
    buf = torch.zeros(W, ld, 4, dtype=torch.uint8, device=codes.device)
    padded = torch.nn.functional.pad(codes, (0, W * 4 - G)).view(M, W, 4)
    buf[:, :M, :] = padded.transpose(0, 1)
    return buf.view(torch.int32).view(W, ld)[:, :M].t()


def unpack_ue8m0(packed: torch.Tensor, groups: int) -> torch.Tensor:
    """Inverse of pack_ue8m0: int32 [M, W] (any strides) -> uint8 [M, groups]."""
    M, W = packed.shape
    b = packed.contiguous().view(torch.uint8).view(M, W * 4)
    return b[:, :groups].contiguous()


def fp8_block_cast_ref(w: torch.Tensor, block_n: int, block_k: int, scale_fmt: str):
    """Reference of the weight block cast: one scale per (block_n x block_k) tile."""
    wf = w.float()
    N, K = wf.shape
    Gn, Gk = -(-N // block_n), -(-K // block_k)
    a = torch.where(torch.isfinite(wf), wf.abs(), torch.zeros_like(wf))
    a = torch.nn.functional.pad(a, (0, Gk * block_k - K, 0, Gn * block_n - N))
    amax = a.view(Gn, block_n, Gk, block_k).amax(dim=(1, 3))
    stored, info = _scale_codes(amax, scale_fmt)
    full = info.repeat_interleave(block_n, 0)[:N].repeat_interleave(block_k, 1)[:, :K]
    return _quantise(wf, full, scale_fmt), stored


# ----------------------------------------------------------------------------- custom ops
def _group_cast_outputs(x: torch.Tensor, group: int, scale_fmt: str):
    M, K = x.shape
    G = -(-K // group)
    q = torch.empty(M, K, dtype=_FP8, device=x.device)
    if scale_fmt == "fp32":
        s = torch.empty(M, G, dtype=torch.float32, device=x.device)
    elif scale_fmt == "ue8m0":
        s = torch.empty(M, G, dtype=torch.uint8, device=x.device)
    else:
        W, ld = -(-G // 4), -(-M // 4) * 4
        # CUDA writes pads itself; the CPU reference returns its own tensor.
        s = torch.empty(W, ld, dtype=torch.int32, device=x.device)[:, :M].t()
    return q, s


@op("fp8_group_cast", "(Tensor x, int group, str scale_fmt) -> (Tensor, Tensor)")
def _fp8_group_cast(x: torch.Tensor, group: int, scale_fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    return fp8_group_cast_ref(x, group, scale_fmt)


def _check_rows_cuda(op: str, x: torch.Tensor) -> None:
    # Pointer checks live in the CUDA path: it always sees real tensors (eager or compiled).
    check_aligned(op, "x", x)
    if x.shape[0] > 1 and (x.stride(0) * x.element_size()) % 16 != 0:
        raise ValueError(f"deepfuse: {op}: x row stride ({x.stride(0)} elements) must be a multiple of 16 bytes")


@_fp8_group_cast.register_kernel("cuda")
def _(x, group, scale_fmt):
    _check_rows_cuda("fp8_group_cast", x)
    q, s = _group_cast_outputs(x, group, scale_fmt)
    M, K = x.shape
    if M > 0:
        _ext.ext(x.device).fp8_group_cast(x=x, q=q, scale=s, scale_fmt=scale_fmt, group=group)
    return q, s


@_fp8_group_cast.register_fake
def _(x, group, scale_fmt):
    return _group_cast_outputs(x, group, scale_fmt)


@op("fp8_block_cast", "(Tensor w, int block_n, int block_k, str scale_fmt) -> (Tensor, Tensor)")
def _fp8_block_cast(w: torch.Tensor, block_n: int, block_k: int, scale_fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    return fp8_block_cast_ref(w, block_n, block_k, scale_fmt)


def _block_cast_outputs(w: torch.Tensor, block_n: int, block_k: int, scale_fmt: str):
    N, K = w.shape
    shape = (-(-N // block_n), -(-K // block_k))
    dt = torch.float32 if scale_fmt == "fp32" else torch.uint8
    return torch.empty(N, K, dtype=_FP8, device=w.device), torch.empty(shape, dtype=dt, device=w.device)


@_fp8_block_cast.register_kernel("cuda")
def _(w, block_n, block_k, scale_fmt):
    check_aligned("fp8_block_cast", "w", w)
    q, s = _block_cast_outputs(w, block_n, block_k, scale_fmt)
    N, K = w.shape
    if N > 0 and K > 0:
        _ext.ext(w.device).fp8_block_cast(w=w, q=q, scale=s, scale_fmt=scale_fmt)
    return q, s


@_fp8_block_cast.register_fake
def _(w, block_n, block_k, scale_fmt):
    return _block_cast_outputs(w, block_n, block_k, scale_fmt)


# ----------------------------------------------------------------------------- public API
def _check_rows(op: str, x: torch.Tensor) -> None:
    check_tensor(op, "x", x, dtypes=(torch.bfloat16, torch.float32), ndim=2, last_dim_contiguous=True)
    K = x.shape[1]
    if K % 8 != 0:
        raise ValueError(f"deepfuse: {op}: x.shape[1] (K = {K}) must be a multiple of 8 (16-byte rows)")


def fp8_per_token_cast(x: torch.Tensor, group: int = 128, *, scale_fmt: str = "fp32"):
    """bf16/fp32 [M, K] -> (e4m3 [M, K], scales [M, ceil(K/group)]).

    scale_fmt "fp32" gives float scales (amax/448); "ue8m0" gives uint8 exponent bytes
    (value 2^(b-127)). group in {32, 64, 128}; see the module docstring for the rules."""
    op = "fp8_per_token_cast"
    _check_rows(op, x)
    check_int(op, "group", group, choices={32, 64, 128})
    check_choice(op, "scale_fmt", scale_fmt, ("fp32", "ue8m0"))
    return torch.ops.deepfuse.fp8_group_cast(x, group, scale_fmt)


def mxfp8_cast(x: torch.Tensor, *, packed: bool = False):
    """bf16/fp32 [M, K] -> (e4m3 [M, K], UE8M0 scales, one per 32 values).

    packed=False: uint8 [M, ceil(K/32)]. packed=True: int32 [M, ceil(K/128)] with strides
    (1, ceil(M/4)*4): four scale bytes per word, MN-major, as FP8 GEMMs consume them."""
    op = "mxfp8_cast"
    _check_rows(op, x)
    return torch.ops.deepfuse.fp8_group_cast(x, 32, "ue8m0_packed" if packed else "ue8m0")


def fp8_block_cast(w: torch.Tensor, block: tuple[int, int] = (128, 128), *, scale_fmt: str = "fp32"):
    """bf16/fp32 weights [N, K] -> (e4m3 [N, K], scales [ceil(N/bn), ceil(K/bk)]).

    block must be (128, 128) on the GPU (the kernel's tile); the reference takes any block."""
    op = "fp8_block_cast"
    check_tensor(op, "w", w, dtypes=(torch.bfloat16, torch.float32), ndim=2, contiguous=True)
    if not (isinstance(block, (tuple, list)) and len(block) == 2):
        raise ValueError(f"deepfuse: {op}: block must be a pair (block_n, block_k), got {block!r}")
    bn, bk = int(block[0]), int(block[1])
    check_int(op, "block[0]", bn, lo=1)
    check_int(op, "block[1]", bk, lo=1)
    check_choice(op, "scale_fmt", scale_fmt, ("fp32", "ue8m0"))
    if w.is_cuda:
        if (bn, bk) != (128, 128):
            raise ValueError(f"deepfuse: {op}: block must be (128, 128) for CUDA tensors, got {(bn, bk)}")
        if w.shape[1] % 8 != 0:
            raise ValueError(f"deepfuse: {op}: w.shape[1] (K = {w.shape[1]}) must be a multiple of 8 on CUDA")
    return torch.ops.deepfuse.fp8_block_cast(w, bn, bk, scale_fmt)


def _scale_values(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype == torch.float32:
        return scale
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.float() - 127.0)
    raise TypeError(f"deepfuse: scale has dtype {scale.dtype}; expected float32 or uint8 (UE8M0)")


def fp8_per_token_dequant(q: torch.Tensor, scale: torch.Tensor, group: int = 128, dtype=torch.bfloat16):
    """Inverse of fp8_per_token_cast (any device): q * scale, broadcast over each group."""
    op = "fp8_per_token_dequant"
    check_tensor(op, "q", q, dtypes=(_FP8,), ndim=2)
    M, K = q.shape
    check_tensor(op, "scale", scale, dtypes=(torch.float32, torch.uint8), shape=(M, -(-K // group)))
    return (q.float() * _expand(_scale_values(scale), group, K)).to(dtype)


def mxfp8_dequant(q: torch.Tensor, scale: torch.Tensor, dtype=torch.bfloat16):
    """Inverse of mxfp8_cast; scale may be the uint8 or the packed int32 form."""
    op = "mxfp8_dequant"
    check_tensor(op, "q", q, dtypes=(_FP8,), ndim=2)
    M, K = q.shape
    G = -(-K // 32)
    if scale.dtype == torch.int32:
        check_tensor(op, "scale", scale, shape=(M, -(-G // 4)))
        scale = unpack_ue8m0(scale, G)
    check_tensor(op, "scale", scale, dtypes=(torch.uint8,), shape=(M, G))
    return (q.float() * _expand(_scale_values(scale), 32, K)).to(dtype)


def fp8_block_dequant(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128), dtype=torch.bfloat16):
    """Inverse of fp8_block_cast."""
    op = "fp8_block_dequant"
    check_tensor(op, "q", q, dtypes=(_FP8,), ndim=2)
    N, K = q.shape
    bn, bk = block
    check_tensor(op, "scale", scale, dtypes=(torch.float32, torch.uint8), shape=(-(-N // bn), -(-K // bk)))
    s = _scale_values(scale).repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]
    return (q.float() * s).to(dtype)
