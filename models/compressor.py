"""KV compressor: one compressed row per `ratio` positions (4 for CSA, 128 for HCA).

Block i covers positions [i r, (i+1) r). Its row is, per dimension, the softmax(gate + ape)
weighted sum of the projected rows wkv x of the block; with overlap (CSA), the projections
are 2D wide: block i pools the second halves of its own r rows together with the first
halves of block i-1's r rows (2r rows; block 0 has only its own). Then RMSNorm (fp32
weight) and compress RoPE at position i r. Official names: wkv, wgate, ape, norm.

DeepSeek's reference runs the projections and pooling in fp32 (fp32 wkv / wgate); the
transformers oracle, which we follow, runs them in the model dtype with an fp32 softmax
(identical in fp32).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from deepfuse import ops

from .cache import CompressorState, LayerCache
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

    def cached(self, x: torch.Tensor, p0: int, cache: Optional[LayerCache], name: str,
               rope: RopeTable) -> Optional[torch.Tensor]:
        """Compresses x against the cache's state of `name`, appends the new rows there and
        -> every compressed row so far [B, C, D] (None if none); without a cache: the new rows."""
        state = cache.compressor_state(name) if cache is not None else None
        new, state = self(x, p0, state, rope)
        if cache is None:
            return new
        cache.set_compressor_state(name, state)
        if new.shape[1]:
            cache.append_compressed(name, new)
        return cache.compressed(name)

    def forward(self, x: torch.Tensor, p0: int, state: Optional[CompressorState], rope: RopeTable):
        """x [B, T, d] at positions p0.. -> (new rows [B, nb, D], new state).

        state None means a fresh sequence (p0 must then be a block start)."""
        B, _, _ = x.shape
        r, D = self.ratio, self.head_dim
        kv, score = self.wkv(x), self.wgate(x)
        prev_kv = prev_score = None
        if state is not None:
            kv = torch.cat([state.kv, kv], dim=1)
            score = torch.cat([state.score, score], dim=1)
            prev_kv, prev_score = state.prev_kv, state.prev_score
        start = p0 - (state.kv.shape[1] if state is not None else 0)
        if start % r:
            raise RuntimeError(f"deepfuse: compressor state starts at position {start}, not a block start")
        nb = kv.shape[1] // r
        used = nb * r
        rest = (kv[:, used:], score[:, used:])
        if nb == 0:
            return kv.new_zeros(B, 0, D), CompressorState(*rest, prev_kv, prev_score)
        ck = kv[:, :used].unflatten(1, (nb, r))
        cs = score[:, :used].unflatten(1, (nb, r)) + self.ape  # fp32
        if self.overlap:
            big_kv = ck.new_zeros(B, nb, 2 * r, D)
            big_s = cs.new_full((B, nb, 2 * r, D), float("-inf"))
            big_kv[:, :, r:] = ck[..., D:]
            big_s[:, :, r:] = cs[..., D:]
            big_kv[:, 1:, :r] = ck[:, :-1, :, :D]
            big_s[:, 1:, :r] = cs[:, :-1, :, :D]
            if prev_kv is not None:
                big_kv[:, 0, :r] = prev_kv
                big_s[:, 0, :r] = prev_score
            prev_kv, prev_score = ck[:, -1, :, :D], cs[:, -1, :, :D]
            pooled = ops.compress_pool(big_kv, big_s)
        else:
            pooled = ops.compress_pool(ck, cs)
        rows = self.norm(pooled)
        pos = start + torch.arange(nb, device=x.device) * r
        cos, sin = rope(pos)
        rows = ops.rope(rows, cos.expand(B, -1, -1), sin.expand(B, -1, -1))
        return rows, CompressorState(*rest, prev_kv, prev_score)
