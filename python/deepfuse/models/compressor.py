"""KV compressor: one compressed row per `ratio` positions (4 for CSA, 128 for HCA).

Block i covers positions [i r, (i+1) r). Its row is, per dimension, the softmax(gate + ape)
weighted sum of the projected rows wkv x of the block; with overlap (CSA), the projections
are 2D wide: block i pools the second halves of its own r rows together with the first
halves of block i-1's r rows (2r rows; block 0 has only its own). Then RMSNorm (fp32
weight) and compress RoPE at position i r. Official names: wkv, wgate, ape, norm.

DeepSeek's reference runs the projections and pooling in fp32 (fp32 wkv / wgate); the
transformers oracle, which we follow, runs them in the model dtype with an fp32 softmax
(identical in fp32).

forward() compresses a whole sequence from position 0 (the full forward); step() does one
engine step over a flat batch: it pools the blocks the step completes from the request's
state ring (positions before the step) and this step's projections, normalises, rotates and
stores the new rows in the cache (one ops.compress_store) and keeps each request's last R
projections in its state ring (ops.state_store; plan: engine/context.py).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from deepfuse import ops

from .config import V4Config
from .linear import Linear, add_slot
from .norm import RMSNorm
from .rope import RopeTable


class Compressor(nn.Module):
    def __init__(self, cfg: V4Config, ratio: int, head_dim: int, overlap: bool):
        super().__init__()
        self.ratio, self.head_dim, self.overlap = ratio, head_dim, overlap
        coff = 2 if overlap else 1
        self.wkv = Linear(cfg.hidden_size, coff * head_dim)
        self.wgate = Linear(cfg.hidden_size, coff * head_dim)
        add_slot(self, "ape", (ratio, coff * head_dim), "fp32")
        self.norm = RMSNorm(head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: RopeTable) -> torch.Tensor:
        """x [B, T, d] at positions 0.. -> the rows of its complete blocks [B, T // r, D]."""
        B, T, _ = x.shape
        r, D = self.ratio, self.head_dim
        nb = T // r
        if nb == 0:
            return x.new_zeros(B, 0, D)
        used = nb * r
        ck = self.wkv(x[:, :used]).unflatten(1, (nb, r))
        cs = self.wgate(x[:, :used]).unflatten(1, (nb, r)) + self.ape  # fp32
        if self.overlap:
            big_kv = ck.new_zeros(B, nb, 2 * r, D)
            big_s = cs.new_full((B, nb, 2 * r, D), float("-inf"))
            big_kv[:, :, r:] = ck[..., D:]
            big_s[:, :, r:] = cs[..., D:]
            big_kv[:, 1:, :r] = ck[:, :-1, :, :D]
            big_s[:, 1:, :r] = cs[:, :-1, :, :D]
            pooled = ops.compress_pool(big_kv, big_s)
        else:
            pooled = ops.compress_pool(ck, cs)
        cos, sin = rope(torch.arange(nb, device=x.device) * r)
        return ops.rope(self.norm(pooled), cos.expand(B, -1, -1), sin.expand(B, -1, -1))

    def step(self, x: torch.Tensor, plan, cache, name: str, rope: RopeTable) -> None:
        """x [N, d] of a flat step; plan: its CompressPlan; cache: the layer's LayerCacheView,
        whose state `name` ("attn" / "index") is used and whose rows of that name are written."""
        kv, score = self.wkv(x), self.wgate(x)
        skv, ssc = cache.states[name]
        if plan.num_blocks:
            cos, sin = rope(plan.blk_pos)
            ops.compress_store(kv, score, skv, ssc, self.ape, plan, self.norm.weight, self.norm.eps, cos, sin,
                               cache.target(name))
        ops.state_store(kv, score, skv, ssc, plan.state_slots)
