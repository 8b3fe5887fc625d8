"""Multi-token prediction layer (DeepSeek's reference MTPBlock; the transformers oracle does
not instantiate it, so it has no oracle comparison).

At position t it reads the main model's final streams X_t and the embedding of token t + 1:
    x = e_proj(enorm(embed(t + 1))) (broadcast over the streams) + h_proj(hnorm(X_t))
then a full block (sliding window on the released checkpoints), its own hc head and norm,
and the shared lm head: logits for token t + 2. Official names: mtp.<i>.{e_proj, h_proj,
enorm, hnorm, norm, hc_head_*} plus the block's names.
"""
from __future__ import annotations

import torch

from . import mhc
from .block import Block
from .config import V4Config
from .linear import Linear
from .norm import RMSNorm
from .rope import RopeTable


class MTPLayer(Block):
    def __init__(self, cfg: V4Config, layer_type: str):
        super().__init__(cfg, layer_type, is_hash=False)
        d = cfg.hidden_size
        self.e_proj, self.h_proj = Linear(d, d), Linear(d, d)
        self.enorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        mhc.add_head_slots(self, cfg)

    def step(self, streams: torch.Tensor, emb_next: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
             ropes: dict[str, RopeTable]) -> tuple[torch.Tensor, torch.Tensor]:
        """Full forward from position 0 -> (normed hidden [B, T, d] for the shared head, this
        layer's output streams)."""
        x = self.e_proj(self.enorm(emb_next)).unsqueeze(-2) + self.h_proj(self.hnorm(streams))
        x = Block.forward(self, x, positions, ropes, next_ids)
        return self.norm(mhc.head(self, x, self.cfg)), x
