"""Linear layers with quantised weights, as the released V4 checkpoints store them.

Weight formats (fmt):
- "fp8":   w float8_e4m3fn [N, K]; scale [ceil(N/128), ceil(K/128)], fp32 or uint8 UE8M0
           (value 2^(b - 127)); W = w * scale of its 128 x 128 block.
- "mxfp4": w uint8 [N, K/2], two e2m1 codes per byte, the low nibble holding the even
           column; scale uint8 UE8M0 [N, K/32] (or fp32); W = e2m1(w) * scale of its 1 x 32 group.
Semantics (the references define them): y = x @ W^T in fp32 with the weight dequantised
exactly, cast to x.dtype. Activations are not quantised (the transformers oracle does the
same when it dequantises; DeepSeek's reference quantises activations to FP8 per 128).

CUDA (quant_linear and grouped_linear with fp8 / mxfp4 weights): the kernels quantise activations to FP8 e4m3 per token per 128 (fp32 scales), as
DeepSeek's reference does, and run FP8 MMAs: dense fp8 M <= 64 runs the persistent kernel
(csrc/gemm/persist_linear.cu; PERSIST_FP8); otherwise dense M <= STREAM_MAX_M (64) runs the one-launch
weight-streaming kernel (csrc/gemm/stream_linear.cu: TMA weight ring, the activation cast fused,
K splits reduced across a thread-block cluster, two consumer warpgroups per CTA where it holds one
CTA per SM: STREAM_WGS) where its plan needs <= STREAM_MAX_SPLITS K splits (default 1: wide N such
as wq_b) and, for fp8, M >= STREAM_MIN_M_FP8; grouped (block-diagonal) weights and the other shapes
stream through the grouped GEMM kernel (csrc/gemm); larger M (fp8 weights,
K % 128 == 0) goes to cuBLASLt through torch._scaled_mm with DeepSeek's block scales, mxfp4
always to our kernel.
`set_activation_quant(False)` (or DEEPFUSE_ACT_QUANT=0) makes quant_linear, grouped_linear and
moe_experts run their references on the GPU too (exact dequantised weights, no activation
rounding), for oracle comparisons: an explicit choice, counted in ops.reference_calls(). Other
inputs no kernel serves (e.g. dense grouped_linear weights) run the references on CUDA only
where allowed (ops._fallback), else raise.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from deepfuse import _ext

from deepfuse.ops._checks import check_choice, check_tensor
from deepfuse.ops._fallback import kernels_off_reason, need_reference
from deepfuse.ops._registry import op
from deepfuse.ops.cast import _scale_values, fp8_block_dequant

FP8_BLOCK = 128
MXFP4_GROUP = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_FMTS = ("fp8", "mxfp4")


# ----------------------------------------------------------------------------- MXFP4 helpers
def mxfp4_dequant(w: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """uint8 [N, K/2] packed e2m1 + scales [N, K/32] -> dequantised [N, K]."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=w.device)
    b = w.view(torch.uint8)
    vals = torch.stack((lut[(b & 0xF).long()], lut[(b >> 4).long()]), dim=-1).flatten(-2)
    s = _scale_values(scale).repeat_interleave(MXFP4_GROUP, dim=-1)[..., : vals.shape[-1]]
    return (vals * s).to(dtype)


def mxfp4_cast(w: torch.Tensor):
    """fp32/bf16 [N, K] (K % 32 == 0) -> (uint8 packed e2m1 [N, K/2], uint8 UE8M0 [N, K/32]).

    Scale: the smallest power of two with amax / s <= 6; codes round to the nearest e2m1
    value (ties to the smaller magnitude). Used to build quantised test checkpoints."""
    check_tensor("mxfp4_cast", "w", w, dtypes=_FLOATS, ndim=2)
    N, K = w.shape
    if K % MXFP4_GROUP:
        raise ValueError(f"deepfuse: mxfp4_cast: w.shape[1] (K = {K}) must be a multiple of {MXFP4_GROUP}")
    g = w.float().view(N, K // MXFP4_GROUP, MXFP4_GROUP)
    amax = g.abs().amax(-1)
    e = torch.ceil(torch.log2(torch.clamp(amax / 6.0, min=2.0**-127))).clamp(-127, 127)
    y = g / torch.exp2(e).unsqueeze(-1)
    mags = torch.tensor(E2M1_VALUES[:8], device=w.device)
    code = (y.abs().unsqueeze(-1) - mags).abs().argmin(-1)
    code = code + 8 * (y < 0).long()
    code = code.view(N, K).to(torch.uint8)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed.contiguous(), (e + 127).to(torch.uint8)


def dequant_weight(w: torch.Tensor, scale: Optional[torch.Tensor], fmt: str, dtype=torch.float32) -> torch.Tensor:
    if fmt == "fp8":
        return fp8_block_dequant(w, scale, (FP8_BLOCK, FP8_BLOCK), dtype=dtype)
    if fmt == "mxfp4":
        return mxfp4_dequant(w, scale, dtype)
    return w.to(dtype)


_ACT_QUANT = [os.environ.get("DEEPFUSE_ACT_QUANT", "1") != "0"]


def set_activation_quant(enabled: bool) -> None:
    """FP8 activation quantisation in the GPU kernels (on by default); off: references."""
    _ACT_QUANT[0] = bool(enabled)


def activation_quant() -> bool:
    return _ACT_QUANT[0]


# ----------------------------------------------------------------------------- references
def quant_linear_ref(x, w, scale, fmt: str):
    return torch.nn.functional.linear(x.float(), dequant_weight(w, scale, fmt)).to(x.dtype)


def grouped_linear_ref(x, w, scale, fmt: str):
    G, Kg = x.shape[-2], x.shape[-1]
    wd = dequant_weight(w, scale, fmt).view(G, -1, Kg)
    return torch.einsum("...gk,grk->...gr", x.float(), wd).to(x.dtype).contiguous()


@op("quant_linear")
def _quant_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    return quant_linear_ref(x, w, scale, fmt)


SMALL_M = 64  # rows up to which our weight-streaming kernels beat cuBLASLt (anchors-v4.md)
STREAM_MAX_M = 64  # dense rows up to which the one-launch streaming kernel runs (0: the grouped kernel)
STREAM_FMTS = ("fp8", "mxfp4")  # weight formats it runs for
# fp8 below this many rows: the cast + grouped kernel (measured faster there: wq_b M = 1 / 16 20.8 / 21.3 us
# against 22.5 / 23.0 us streaming, H200 2026-12-03 18:03; docs/notes/moe.md "Dense linears, session 4").
STREAM_MIN_M_FP8 = 17
# Shapes whose streaming plan needs at most this many K splits (cluster size: 1, 2, 4, 8) run it,
# the others the grouped kernel. 1: measured faster or equal only without K splits (H200,
# docs/notes/moe.md "Dense linears at small M"); 8 serves every dense shape it fits.
STREAM_MAX_SPLITS = 1
# Consumer warpgroups per streaming CTA: 2 gives the plans of one CTA per SM (M > 16 with >= 2
# weight tiles per CTA) two independent chunk chains; 1: one warpgroup walks all of them.
STREAM_WGS = 2
# The streaming plan's occupancy choice: 0 the most CTAs per SM that fit, 1 the most ring stages
# resident on the GPU (CTAs that run x ring depth).
STREAM_POLICY = 0
# Block-diagonal weights (grouped_linear, e.g. wo_a; rows per group % 64 == 0) at M <= STREAM_MAX_M
# through the streaming kernel too (False: the cast + grouped kernel).
STREAM_GROUPED = False
# Dense fp8 M <= 64 through the persistent kernel (csrc/gemm/persist_linear.cu: one CTA per SM, a TMA
# producer warp, two math warpgroups, 128-row weight tiles, split-K partials reduced in split order)
# where it serves the shape; False: the streaming / grouped kernels as above. On: H200 2026-12-03 21:36
# (docs/notes/gemm.md) 1.0x (wq_b M <= 16) to 2.4x (wo_b M = 64) the previous paths.
PERSIST_FP8 = True
# Dense mxfp4 M <= 32 through the same structure (e2m1 decoded to e4m3 by a decode warpgroup into a
# second shared-memory ring, weights on wgmma's M side, per-32 group promotion); False: as above.
# Off: measured slower than the streaming kernel (wq_b M = 1: 29.7 against 26.5 us; docs/notes/gemm.md).
PERSIST_MX = False
PERSIST_SPLITS = 0  # its K splits: 0 the plan's choice (fewest chunks per SM), else at most this many


def linear_gap(x_dtype: torch.dtype, K: int, w: torch.Tensor, scale: Optional[torch.Tensor], fmt: str) -> Optional[str]:
    """Why the FP8 linear kernels cannot serve x [*, K] of x_dtype times w (None: they can)."""
    if fmt not in _FMTS:
        return f"w is {fmt} (the kernels take fp8 or mxfp4 weights)"
    if x_dtype not in (torch.bfloat16, torch.float32):
        return f"x has dtype {str(x_dtype)[6:]} (the kernels take bfloat16 or float32)"
    if K % 32 or K > 16384:
        return f"x rows are K = {K} wide (the kernels take K % 32 == 0, K <= 16384)"
    if not w.is_contiguous() or scale is None or not scale.is_contiguous():
        return "w and its scale must be contiguous for the kernels"
    if fmt == "mxfp4" and (K % 128 or scale.dtype != torch.uint8):
        return f"mxfp4 w needs K % 128 == 0 and uint8 scales for the kernels, got K = {K}, {str(scale.dtype)[6:]}"
    return None


def _linear_reference(op_name: str, why: Optional[str]) -> bool:
    """Whether the call runs its reference (the policy of ops._fallback applied; raises if not allowed)."""
    if not activation_quant():
        need_reference(op_name, "activation quantisation is off (set_activation_quant)", explicit=True)
        return True
    if why is None:
        return False
    need_reference(op_name, why)
    return True


# prefill (h29p): fp8 linears at M >= PREFILL_MIN_M run the dense mode of the MoE prefill kernel where it
# measured faster (ops/linear_prefill.py, docs/notes/moe.md); 0: off (cuBLASLt / the grouped kernel as before).
PREFILL_MIN_M = 65


def _prefill(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> bool:  # prefill (h29p)
    from deepfuse.ops import linear_prefill

    M, G, Kg = x.shape[0], x.shape[1] if x.dim() == 3 else 1, x.shape[-1]
    if linear_prefill.gap(x.dtype, M, G, Kg, w.shape[0] // G, w, scale) is not None or \
            not linear_prefill.preferred(M, G, Kg):
        return False
    linear_prefill.run(x, w, scale, out)
    return True


def _scaled_mm_fp8(x2: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, out_dtype) -> torch.Tensor:
    """cuBLASLt with DeepSeek block scales: 1 x 128 activation scales (outer-dim-major) and the
    128 x 128 weight scales repeated over their rows as [K/128, N]."""
    from deepfuse.ops.cast import fp8_per_token_cast

    N = w.shape[0]
    q, s = fp8_per_token_cast(x2, 128)
    sa = s.t().contiguous().t()
    sb = _scale_values(scale).repeat_interleave(FP8_BLOCK, 0)[:N].t().contiguous()
    return torch._scaled_mm(q, w.t(), sa, sb, out_dtype=out_dtype)


def _fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """Our kernel: x [M, K] -> out [M, N], or x [M, G, Kg] -> out [M, G, R] (block-diagonal w)."""
    C = _ext.ext(x.device)
    fmt = "fp8" if w.dtype == torch.float8_e4m3fn else "mxfp4"
    persist = (PERSIST_FP8 if fmt == "fp8" else PERSIST_MX) and x.dim() == 2
    work = torch.empty(C.fp8_linear_workspace_bytes(x=x, w=w, w_scale=scale, persist=persist,
                                                    persist_splits=PERSIST_SPLITS), dtype=torch.uint8, device=x.device)
    stream = fmt in STREAM_FMTS and not (fmt == "fp8" and x.shape[0] < STREAM_MIN_M_FP8)
    C.fp8_linear(x=x, w=w, w_scale=scale, out=out, workspace=work,
                 stream_max_m=STREAM_MAX_M if stream else 0, stream_max_splits=STREAM_MAX_SPLITS,
                 stream_wgs=STREAM_WGS, stream_policy=STREAM_POLICY, stream_grouped=STREAM_GROUPED, persist=persist,
                 persist_splits=PERSIST_SPLITS)


@_quant_linear.register_kernel("cuda")
def _(x, w, scale, fmt):
    if _linear_reference("quant_linear", kernels_off_reason() or linear_gap(x.dtype, x.shape[-1], w, scale, fmt)):
        return quant_linear_ref(x, w, scale, fmt)
    K, N = x.shape[-1], w.shape[0]
    x2 = x.reshape(-1, K).contiguous()
    M = x2.shape[0]
    if PREFILL_MIN_M and M >= PREFILL_MIN_M and fmt == "fp8":  # prefill (h29p)
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
        if _prefill(x2, w, scale, out):
            return out.view(*x.shape[:-1], N)
    if fmt == "fp8" and M > SMALL_M and K % 128 == 0 and x.dtype == torch.bfloat16:
        try:
            return _scaled_mm_fp8(x2, w, scale, x.dtype).view(*x.shape[:-1], N)
        except RuntimeError:  # a cuBLASLt without block scales: our kernel below
            pass
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        _fp8_linear(x2, w, scale, out)
    return out.view(*x.shape[:-1], N)


@_quant_linear.register_fake
def _(x, w, scale, fmt):
    return x.new_empty(*x.shape[:-1], w.shape[0])


def grouped_gap(x_dtype: torch.dtype, Kg: int, R: int, w: torch.Tensor, scale: Optional[torch.Tensor],
                fmt: str) -> Optional[str]:
    """Why the grouped kernel cannot serve x [*, G, Kg] times w [G * R, Kg] (None: it can)."""
    if fmt == "dense":
        return "w is dense (the grouped kernel takes fp8 or mxfp4 weights)"
    if fmt == "fp8" and R % FP8_BLOCK:
        return f"w has R = {R} rows per group (the fp8 grouped kernel takes multiples of {FP8_BLOCK})"
    return linear_gap(x_dtype, Kg, w, scale, fmt)


@op("grouped_linear")
def _grouped_linear(x: torch.Tensor, w: torch.Tensor, scale: Optional[torch.Tensor], fmt: str) -> torch.Tensor:
    return grouped_linear_ref(x, w, scale, fmt)


@_grouped_linear.register_kernel("cuda")
def _(x, w, scale, fmt):
    G, Kg = x.shape[-2], x.shape[-1]
    R = w.shape[0] // G
    if _linear_reference("grouped_linear", kernels_off_reason() or grouped_gap(x.dtype, Kg, R, w, scale, fmt)):
        return grouped_linear_ref(x, w, scale, fmt)
    x3 = x.reshape(-1, G, Kg).contiguous()
    M = x3.shape[0]
    out = torch.empty(*x.shape[:-1], R, dtype=x.dtype, device=x.device)
    if PREFILL_MIN_M and M >= PREFILL_MIN_M and fmt == "fp8":  # prefill (h29p)
        if _prefill(x3, w, scale, out.view(M, G, R)):
            return out
    if M:
        _fp8_linear(x3, w, scale, out.view(M, G, R))
    return out


@_grouped_linear.register_fake
def _(x, w, scale, fmt):
    return x.new_empty(*x.shape[:-1], w.shape[0] // x.shape[-2])


# ----------------------------------------------------------------------------- public API
def check_weight(op: str, w: torch.Tensor, scale: Optional[torch.Tensor], fmt: str, N: int, K: int, name: str = "w"):
    """Validate a weight of logical shape [N, K] stored in `fmt` ("dense", "fp8", "mxfp4")."""
    if fmt == "dense":
        check_tensor(op, name, w, dtypes=_FLOATS, shape=(N, K))
        return
    check_choice(op, "fmt", fmt, _FMTS)
    if scale is None:
        raise ValueError(f"deepfuse: {op}: {fmt} weight {name} needs a scale tensor")
    if fmt == "fp8":
        check_tensor(op, name, w, dtypes=(torch.float8_e4m3fn,), shape=(N, K))
        grid = (-(-N // FP8_BLOCK), -(-K // FP8_BLOCK))
    else:
        if K % MXFP4_GROUP:
            raise ValueError(f"deepfuse: {op}: mxfp4 weight {name} needs K % 32 == 0, got K = {K}")
        check_tensor(op, name, w, dtypes=(torch.uint8,), shape=(N, K // 2))
        grid = (N, K // MXFP4_GROUP)
    check_tensor(op, f"{name} scale", scale, dtypes=(torch.float32, torch.uint8), shape=grid, device=w.device)


def quant_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """y = x @ W^T for x [*, K] and a quantised weight W [N, K] (fmt "fp8" or "mxfp4")."""
    op = "quant_linear"
    check_tensor(op, "x", x, dtypes=_FLOATS)
    check_choice(op, "fmt", fmt, _FMTS)
    N = w.shape[0]
    check_weight(op, w, scale, fmt, N, x.shape[-1])
    if w.device != x.device:
        raise ValueError(f"deepfuse: {op}: w is on {w.device}, x on {x.device}")
    return torch.ops.deepfuse.quant_linear(x, w, scale, fmt)


# ----------------------------------------------------------------------------- MXFP8 activations
# grouped_linear on an MXFP8 x (e4m3 + UE8M0 scales per 32 values: the attention op's
# out_format="mxfp8"), as wo_a reads it. Semantics: x dequantised exactly (mxfp8_dequant), then
# grouped_linear's (the kernel keeps x's e4m3 values and promotes each k32 group with its scale:
# no activation rounding beyond x's own), bf16 out.
STREAM_MX_MAX_SPLITS = 8  # K splits (cluster size) the streaming kernel may take for MXFP8 x


def _mx_dequant(xq: torch.Tensor, xs: torch.Tensor, dtype) -> torch.Tensor:
    from deepfuse.ops.cast import mxfp8_dequant

    Kg = xq.shape[-1]
    return mxfp8_dequant(xq.reshape(-1, Kg), xs.reshape(-1, Kg // 32), dtype=dtype).view(xq.shape)


def grouped_linear_mx_ref(xq, xs, w, scale, fmt: str):
    return grouped_linear_ref(_mx_dequant(xq, xs, torch.float32), w, scale, fmt).to(torch.bfloat16)


@op("grouped_linear_mx")
def _grouped_linear_mx(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                       fmt: str) -> torch.Tensor:
    return grouped_linear_mx_ref(xq, xs, w, scale, fmt)


_MX_NOT_SERVED = "served by the streaming kernel only"


@_grouped_linear_mx.register_kernel("cuda")
def _(xq, xs, w, scale, fmt):
    G, Kg = xq.shape[-2], xq.shape[-1]
    R = w.shape[0] // G
    why = kernels_off_reason() or grouped_gap(torch.bfloat16, Kg, R, w, scale, fmt)
    if _linear_reference("grouped_linear_mx", why):
        return grouped_linear_mx_ref(xq, xs, w, scale, fmt)
    x3, s3 = xq.reshape(-1, G, Kg).contiguous(), xs.reshape(-1, G, Kg // 32).contiguous()
    M = x3.shape[0]
    out = torch.empty(*xq.shape[:-1], R, dtype=torch.bfloat16, device=xq.device)
    if M == 0:
        return out
    if M <= STREAM_MAX_M and fmt in STREAM_FMTS and R % 64 == 0:
        try:
            _ext.ext(xq.device).fp8_linear(
                x=x3, x_scale=s3, w=w, w_scale=scale, out=out.view(M, G, R),
                workspace=torch.empty(0, dtype=torch.uint8, device=xq.device), stream_max_m=STREAM_MAX_M,
                stream_max_splits=STREAM_MX_MAX_SPLITS, stream_wgs=STREAM_WGS, stream_policy=STREAM_POLICY,
                stream_grouped=True)
            return out
        except ValueError as e:  # a shape the streaming kernel's plan does not take
            if _MX_NOT_SERVED not in str(e):
                raise
    return torch.ops.deepfuse.grouped_linear(_mx_dequant(xq, xs, torch.bfloat16), w, scale, fmt)


@_grouped_linear_mx.register_fake
def _(xq, xs, w, scale, fmt):
    return xq.new_empty(*xq.shape[:-1], w.shape[0] // xq.shape[-2], dtype=torch.bfloat16)


def grouped_linear_mx(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, fmt: str):
    """grouped_linear of an MXFP8 x: xq e4m3 [*, G, Kg], xs uint8 UE8M0 [*, G, Kg / 32] (one scale per
    32 values; Kg % 32 == 0), w [G * R, Kg] fp8 / mxfp4 -> bf16 [*, G, R]."""
    op = "grouped_linear_mx"
    check_tensor(op, "xq", xq, dtypes=(torch.float8_e4m3fn,))
    if xq.dim() < 2:
        raise ValueError(f"deepfuse: {op}: xq must be [*, G, Kg], got {list(xq.shape)}")
    G, Kg = xq.shape[-2], xq.shape[-1]
    if Kg % 32:
        raise ValueError(f"deepfuse: {op}: xq rows need Kg % 32 == 0, got Kg = {Kg}")
    check_tensor(op, "xs", xs, dtypes=(torch.uint8,), shape=(*xq.shape[:-1], Kg // 32), device=xq.device)
    if w.shape[0] % G:
        raise ValueError(f"deepfuse: {op}: w.shape[0] = {w.shape[0]} is not a multiple of the {G} groups")
    check_choice(op, "fmt", fmt, _FMTS)
    check_weight(op, w, scale, fmt, w.shape[0], Kg)
    if w.device != xq.device:
        raise ValueError(f"deepfuse: {op}: w is on {w.device}, xq on {xq.device}")
    return torch.ops.deepfuse.grouped_linear_mx(xq, xs, w, scale, fmt)


def grouped_linear(x: torch.Tensor, w: torch.Tensor, scale: Optional[torch.Tensor] = None, fmt: str = "dense"):
    """Block-diagonal projection: x [*, G, Kg], w [G * R, Kg] (group g owns rows g*R..) -> [*, G, R]."""
    op = "grouped_linear"
    check_tensor(op, "x", x, dtypes=_FLOATS)
    if x.dim() < 2:
        raise ValueError(f"deepfuse: {op}: x must be [*, G, Kg], got {list(x.shape)}")
    G, Kg = x.shape[-2], x.shape[-1]
    if w.shape[0] % G:
        raise ValueError(f"deepfuse: {op}: w.shape[0] = {w.shape[0]} is not a multiple of the {G} groups")
    check_choice(op, "fmt", fmt, ("dense",) + _FMTS)
    check_weight(op, w, scale, fmt, w.shape[0], Kg)
    return torch.ops.deepfuse.grouped_linear(x, w, scale if fmt != "dense" else None, fmt)
