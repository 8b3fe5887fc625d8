"""Linear layers with quantised weights, as the released V4 checkpoints store them.

Weight formats (fmt):
- "fp8":   w float8_e4m3fn [N, K]; scale [ceil(N/128), ceil(K/128)], fp32 or uint8 UE8M0
           (value 2^(b - 127)); W = w * scale of its 128 x 128 block.
- "mxfp4": w uint8 [N, K/2], two e2m1 codes per byte, the low nibble holding the even
           column; scale uint8 UE8M0 [N, K/32] (or fp32); W = e2m1(w) * scale of its 1 x 32 group.
Semantics (the references define them): y = x @ W^T in fp32 with the weight dequantised
exactly, cast to x.dtype. Activations are not quantised (the transformers oracle does the
same when it dequantises; DeepSeek's reference quantises activations to FP8 per 128).
"""
from __future__ import annotations

from typing import Optional

import torch

from deepfuse.ops._checks import check_choice, check_tensor
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


# ----------------------------------------------------------------------------- references
def quant_linear_ref(x, w, scale, fmt: str):
    return torch.nn.functional.linear(x.float(), dequant_weight(w, scale, fmt)).to(x.dtype)


def grouped_linear_ref(x, w, scale, fmt: str):
    G, Kg = x.shape[-2], x.shape[-1]
    wd = dequant_weight(w, scale, fmt).view(G, -1, Kg)
    return torch.einsum("...gk,grk->...gr", x.float(), wd).to(x.dtype).contiguous()


# no kernel yet for the two ops below: the op's body (the reference) also serves CUDA tensors.
@op("quant_linear")
def _quant_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    return quant_linear_ref(x, w, scale, fmt)


@_quant_linear.register_fake
def _(x, w, scale, fmt):
    return x.new_empty(*x.shape[:-1], w.shape[0])


@op("grouped_linear")
def _grouped_linear(x: torch.Tensor, w: torch.Tensor, scale: Optional[torch.Tensor], fmt: str) -> torch.Tensor:
    return grouped_linear_ref(x, w, scale, fmt)


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
