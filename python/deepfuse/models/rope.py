"""RoPE angle tables: cos / sin for given positions (V4 has two kinds, main and compress)."""
from __future__ import annotations

import torch

from .config import RopeParams


class RopeTable:
    """cos/sin [N, R/2] fp32 for positions [N], as transformers computes them (pos * inv_freq)."""

    def __init__(self, params: RopeParams, rope_dim: int):
        self.params = params
        self.rope_dim = rope_dim
        self._inv_freq = params.inv_freq(rope_dim)
        self._by_device: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device) -> torch.Tensor:
        device = torch.device(device)
        t = self._by_device.get(device)
        if t is None:
            t = self._by_device[device] = self._inv_freq.to(device)
        return t

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq(positions.device)
        af = self.params.attention_factor
        return freqs.cos() * af, freqs.sin() * af
