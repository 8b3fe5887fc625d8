"""csrc/norm's row kernel, shared by ops.norm and ops.rope: its input limits and its launcher."""
from __future__ import annotations

from typing import Optional

import torch

from deepfuse import _ext
from deepfuse.ops._fallback import kernels_off_reason
from deepfuse.ops.kvcache import RowTarget

ROW_MAX = 16384  # D > 4096: one block per row (csrc/norm/norm_rope.cu), no cache store


def rows_gap(D: int, dtype: torch.dtype) -> Optional[str]:
    """Why the row kernel cannot serve rows x [..., D] of `dtype` (None: it can)."""
    if dtype != torch.bfloat16:
        return f"x has dtype {str(dtype)[6:]} (the row kernel takes bfloat16)"
    if D % 8 or not 0 < D <= ROW_MAX:
        return f"x rows are {D} wide (the row kernel takes D % 8 == 0, D <= {ROW_MAX})"
    return None


def rows_kernel_gap(x: torch.Tensor) -> Optional[str]:
    """Why the row kernel cannot serve x (None: it can; side inputs are read as contiguous fp32)."""
    return kernels_off_reason() or rows_gap(x.shape[-1] if x.dim() else 0, x.dtype)


def _f32(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.float().contiguous()


def launch_rows(x: torch.Tensor, y: Optional[torch.Tensor], *, norm: bool, weight=None, eps: float = 1e-6,
                cos=None, sin=None, inverse: bool = False, target: Optional[RowTarget] = None, slots=None) -> None:
    """Run csrc/norm's row kernel over x [*L, D] or [*L, H, D] (contiguous bf16; cos/sin [*L, half])."""
    if x.numel() == 0:
        return
    _ext.ext(x.device).norm_rope(x=x, y=y, norm=norm, weight=weight, eps=float(eps), cos=cos, sin=sin,
                                 inverse=inverse, store=target.kind if target is not None else "none",
                                 pages=target.pages if target is not None else None, slots=slots)
