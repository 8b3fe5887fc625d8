"""The DeepSeek V4 causal LM graph: embed -> mHC streams -> blocks -> hc head -> norm -> head.

Module and tensor names follow the official checkpoint naming (embed, layers.<i>.attn.wq_a,
..., norm, head, hc_head_fn, mtp.<i>....), so the loader maps keys one to one. Build with
models.load(); construction alone leaves every tensor on the meta device.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from deepfuse.step import StepContext

from . import mhc
from .references import scoped
from .block import Block
from .config import V4Config
from .linear import Linear, add_slot
from .mtp import MTPLayer
from .norm import RMSNorm
from .rope import RopeTable


class Embedding(nn.Module):
    def __init__(self, vocab: int, dim: int):
        super().__init__()
        add_slot(self, "weight", (vocab, dim), "act")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class ModelBase(nn.Module):
    """What the V4 and V4.1 models share: the validated config, the RoPE tables (main and
    compress), the activation dtype, the device and the check of input ids."""

    def __init__(self, cfg: V4Config):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.ropes = {"main": RopeTable(cfg.rope_main, cfg.rope_head_dim),
                      "compress": RopeTable(cfg.rope_compress, cfg.rope_head_dim)}
        self.dtype = torch.float32  # activation dtype, set by the loader

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def _check_ids(self, input_ids: torch.Tensor, ndim: int = 2) -> None:
        shape = "[B, T]" if ndim == 2 else "[N]"
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != ndim or input_ids.dtype not in (
                torch.int64, torch.int32):
            raise ValueError(f"deepfuse: input_ids must be an int64/int32 tensor of shape {shape}")
        if input_ids.device != self.device:
            raise ValueError(f"deepfuse: input_ids is on {input_ids.device}, the model on {self.device}")


class V4Model(ModelBase):
    def __init__(self, cfg: V4Config):
        super().__init__(cfg)
        d = cfg.hidden_size
        self.embed = Embedding(cfg.vocab_size, d)
        self.layers = nn.ModuleList(
            Block(cfg, cfg.layer_types[i], cfg.is_hash_layer(i)) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.head = Linear(d, cfg.vocab_size)
        mhc.add_head_slots(self, cfg)
        self.mtp = nn.ModuleList(MTPLayer(cfg, t) for t in cfg.mtp_layer_types)
        self.allow_reference = None  # ops run as torch references on CUDA knowingly (models/references.py)

    @scoped(full=True)
    def forward(self, input_ids: torch.Tensor, *, return_streams: bool = False):
        """Full forward of sequences from position 0: input_ids [B, T] -> logits [B, T, vocab]
        (fp32). return_streams=True also returns the final mHC streams [B, T, hc, d] (the MTP
        layer's input). Incremental decoding runs on the engine (forward_step)."""
        self._check_ids(input_ids)
        B, T = input_ids.shape
        positions = torch.arange(T, device=input_ids.device)
        x = mhc.expand(self.embed(input_ids).to(self.dtype), self.cfg)
        for layer in self.layers:
            x = layer(x, positions, self.ropes, input_ids)
        logits = self.head(self.norm(mhc.head(self, x, self.cfg))).float()
        return (logits, x) if return_streams else logits

    @scoped(full=False, cache_arg=1)
    def forward_step(self, ctx: StepContext, cache, *, return_streams: bool = False):
        """One engine step over the flat batch of `ctx` (deepfuse.step.StepContext)
        with the engine's cache (CacheManager): -> logits [R, vocab] (fp32) of the rows
        ctx.logits_indices (and the final streams [N, hc, d], the MTP layer's input). Writes
        every layer's cache state for the step's tokens."""
        ids = ctx.input_ids
        x = mhc.expand(self.embed(ids).to(self.dtype), self.cfg)[None]  # [1, N, hc, d]
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx.positions, self.ropes, ids[None], ctx, cache.layer(i))
        h = x[0, ctx.logits_indices]
        logits = self.head(self.norm(mhc.head(self, h, self.cfg))).float()
        return (logits, x[0]) if return_streams else logits

    @scoped(full=False, cache_arg=1)
    def mtp_forward_step(self, ctx: StepContext, cache, streams: torch.Tensor, next_ids: torch.Tensor, layer: int = 0,
                         head=None, rows_only: bool = False):
        """One flat engine step of MTP layer `layer` (its cache is cache.layer(num layers +
        layer)): streams [N, hc, d] at the ctx's positions (the main model's final streams,
        or this layer's own output streams when drafting a chain) and next_ids [N], the token
        after each position -> (logits [R, vocab] fp32 at ctx.logits_indices, the layer's
        output streams [N, hc, d]). head: the lm head for these logits (default the model's;
        the engine's draft steps may pass a cheaper copy, engine/speculative.py). rows_only:
        the layer's FFN half only at ctx.logits_indices (every row's attention writes its
        cache) and the streams of those rows [R, hc, d]: what the draft steps read."""
        mtp = self.mtp[layer]
        emb = self.embed(next_ids).to(self.dtype)
        x = (mtp.e_proj(mtp.enorm(emb)).unsqueeze(-2) + mtp.h_proj(mtp.hnorm(streams)))[None]
        x = Block.forward(mtp, x, ctx.positions, self.ropes, next_ids[None], ctx, cache.layer(len(self.layers) + layer),
                          rows=ctx.logits_indices if rows_only else None)
        h = x[0] if rows_only else x[0, ctx.logits_indices]
        return (self.head if head is None else head)(mtp.norm(mhc.head(mtp, h, self.cfg))).float(), x[0]

    @scoped(full=True)
    def mtp_forward(self, streams: torch.Tensor, next_ids: torch.Tensor, layer: int = 0):
        """MTP layer `layer` over whole sequences: streams [B, T, hc, d] at positions 0.. and
        the ids of the tokens that follow them [B, T] -> (logits [B, T, vocab] fp32 for the
        tokens after those, the layer's output streams, for chaining further MTP layers)."""
        if not len(self.mtp):
            raise ValueError("deepfuse: this checkpoint has no MTP layer (num_nextn_predict_layers = 0)")
        self._check_ids(next_ids)
        B, T = next_ids.shape
        positions = torch.arange(T, device=next_ids.device)
        emb = self.embed(next_ids).to(self.dtype)
        h, out = self.mtp[layer].step(streams, emb, next_ids, positions, self.ropes)
        return self.head(h).float(), out
