"""Dense FP8 linears at large M through the MoE prefill kernel (csrc/moe/moe_prefill.cu, dense mode).

`quant_linear` / `grouped_linear` with fp8 weights at M >= ops.linear.PREFILL_MIN_M call `run` here
(one dispatch branch in ops/linear.py). The kernel is the experts' prefill GEMM with one group and no
routing: x cast to e4m3 per token per 128 (fp8_per_token_cast's math, bit-identical) into a workspace,
then persistent 128 x 256 (or 128 x 128) tiles: a TMA producer warp feeding a 4-stage (6 at 128)
mbarrier ring, two consumer warpgroups of m64n128k32 wgmmas, each 128-K chunk promoted in fp32 with
(row scale x weight block scale); the output in x's dtype (bf16: 16-byte stores after a transpose within each
quad; DEEPFUSE_LINEAR_PREFILL_EPI16=0: 4-byte stores). Optionally 2-CTA clusters of two m-tiles sharing each
weight tile (each CTA loads half of it, multicast to both). Grouped (block-diagonal, V4's wo_a):
x [M, G, Kg] through weight rows g R .. (g + 1) R, tiles over (group, m, n).
Shapes it takes (`gap` returns why not, else None): fp8 weights, bf16 / fp32 x, K % 16 == 0 and
K <= 8192 per group, even N; grouped also Kg and R multiples of 128.
"""
from __future__ import annotations

from typing import Optional

import torch

from deepfuse import _ext


def gap(x_dtype: torch.dtype, M: int, G: int, Kg: int, R: int, w: torch.Tensor, scale) -> Optional[str]:
    """Why the dense prefill kernel cannot serve x [M, (G,) Kg] times w (None: it can)."""
    if w.dtype != torch.float8_e4m3fn:
        return "w is not fp8"
    if not _ext.has_kernel("fp8_linear_prefill", w.device):
        return f"no fp8_linear_prefill kernel for {w.device} (sm_90a only)"
    if x_dtype not in (torch.bfloat16, torch.float32):
        return "x is not bf16 / fp32"
    if Kg % 16 or Kg > 8192 or R % 2:
        return "K % 16, K <= 8192 and even N needed"
    if G > 1 and (Kg % 128 or R % 128):
        return "grouped needs Kg and R multiples of 128"
    if scale is None or scale.dtype not in (torch.float32, torch.uint8) or not scale.is_contiguous():
        return "contiguous fp32 / UE8M0 block scales needed"
    return None


# Dense shapes left to cuBLASLt: dense K <= SHORT_K from M = SHORT_K_MAX_M on. None since the 16-byte-store
# epilogue (H200 18:02 UTC: wq_b 32768 x 1024 at M = 4096 288.7 us vs cuBLASLt 348.7; with 4-byte stores it was
# 0.92-0.95x cuBLASLt at M >= 4096, hence this knob: SHORT_K_MAX_M = 2048 restores that policy).
SHORT_K, SHORT_K_MAX_M = 1024, 1 << 62


def preferred(M: int, G: int, Kg: int) -> bool:
    """Whether quant_linear / grouped_linear should take this kernel (else cuBLASLt / the grouped kernel)."""
    return G > 1 or Kg > SHORT_K or M < SHORT_K_MAX_M


def run(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, bn: int = 0,
        cluster: int = -1) -> torch.Tensor:
    """x [M, K] -> out [M, N] or x [M, G, Kg] -> out [M, G, R] (contiguous, out of x's dtype).
    bn: 128 / 256 forces the tile width (0: by the tile count); cluster: 1 / 0 forces 2-CTA clusters
    sharing each 256-row weight tile (multicast) on / off (-1: the kernel's default)."""
    C = _ext.ext(x.device)
    K = x.shape[-1] * (x.shape[1] if x.dim() == 3 else 1)
    work = torch.empty(C.fp8_linear_prefill_workspace_bytes(M=x.shape[0], K=K), dtype=torch.uint8, device=x.device)
    C.fp8_linear_prefill(x=x, w=w, w_scale=scale, out=out, workspace=work, bn=bn, cluster=cluster)
    return out
