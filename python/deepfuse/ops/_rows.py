"""csrc/norm's row kernel, shared by ops.norm and ops.rope: its input limits and its launcher."""
from __future__ import annotations

from typing import Optional

import torch

from deepfuse import _ext
from deepfuse.ops._fallback import kernels_off_reason
from deepfuse.ops.kvcache import RowTarget

ROW_MAX = 4096


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
    D = x.shape[-1]
    rows = x.numel() // D
    if rows == 0:
        return
    H = 1 if cos is None or x.dim() == cos.dim() else x.shape[-2]
    store = target.launch_args() if target is not None else (0, 0, 0, 0, 0)
    _ext.ext(x.device).norm_rope(
        x.data_ptr(), D, rows, H, D, y.data_ptr() if y is not None else 0, norm,
        weight.data_ptr() if weight is not None else 0, float(eps),
        cos.data_ptr() if cos is not None else 0, sin.data_ptr() if sin is not None else 0,
        cos.shape[-1] if cos is not None else 0, inverse, *store, slots.data_ptr() if slots is not None else 0,
        _ext.stream(x.device))
