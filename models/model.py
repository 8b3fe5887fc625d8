"""The DeepSeek V4 causal LM graph: embed -> mHC streams -> blocks -> hc head -> norm -> head.

Module and tensor names follow the official checkpoint naming (embed, layers.<i>.attn.wq_a,
..., norm, head, hc_head_fn, mtp.<i>....), so the loader maps keys one to one. Build with
models.load(); construction alone leaves every tensor on the meta device.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import mhc
from .block import Block
from .cache import ModelCache
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


class V4Model(nn.Module):
    def __init__(self, cfg: V4Config):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        d = cfg.hidden_size
        self.embed = Embedding(cfg.vocab_size, d)
        self.layers = nn.ModuleList(
            Block(cfg, cfg.layer_types[i], cfg.is_hash_layer(i)) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.head = Linear(d, cfg.vocab_size)
        mhc.add_head_slots(self, cfg)
        self.mtp = nn.ModuleList(MTPLayer(cfg, t) for t in cfg.mtp_layer_types)
        self.ropes = {"main": RopeTable(cfg.rope_main, cfg.rope_head_dim),
                      "compress": RopeTable(cfg.rope_compress, cfg.rope_head_dim)}
        self.dtype = torch.float32  # activation dtype, set by the loader

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def new_cache(self, batch_size: int) -> ModelCache:
        """Empty per-request decode state (plain tensors) for `batch_size` requests."""
        return ModelCache.dense(batch_size, len(self.layers), len(self.mtp), self.cfg.sliding_window)

    def _check_ids(self, input_ids: torch.Tensor, cache: Optional[ModelCache]) -> None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (
                torch.int64, torch.int32):
            raise ValueError("deepfuse: input_ids must be an int64/int32 tensor of shape [B, T]")
        if input_ids.device != self.device:
            raise ValueError(f"deepfuse: input_ids is on {input_ids.device}, the model on {self.device}")
        if cache is not None and input_ids.shape[0] != cache.batch_size:
            raise ValueError(f"deepfuse: input_ids has batch {input_ids.shape[0]}, the cache {cache.batch_size}")

    def forward(self, input_ids: torch.Tensor, cache: Optional[ModelCache] = None, *,
                return_streams: bool = False):
        """input_ids [B, T] -> logits [B, T, vocab] (fp32).

        Without a cache: one full forward from position 0. With a cache: the T tokens
        continue the cached sequences (prefill, chunked prefill or decode) and the cache
        advances. return_streams=True also returns the final mHC streams [B, T, hc, d]
        (the MTP layer's input)."""
        self._check_ids(input_ids, cache)
        B, T = input_ids.shape
        p0 = cache.length if cache is not None else 0
        positions = torch.arange(p0, p0 + T, device=input_ids.device)
        x = mhc.expand(self.embed(input_ids).to(self.dtype), self.cfg)
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, p0, self.ropes, input_ids, cache.layers[i] if cache is not None else None)
        if cache is not None:
            cache.length += T
        logits = self.head(self.norm(mhc.head(self, x, self.cfg))).float()
        return (logits, x) if return_streams else logits

    def mtp_forward(self, streams: torch.Tensor, next_ids: torch.Tensor, cache: Optional[ModelCache] = None,
                    layer: int = 0):
        """MTP layer `layer`: streams [B, T, hc, d] at positions p0.. and the ids of the tokens
        that follow them [B, T] -> (logits [B, T, vocab] fp32 for the tokens after those,
        the layer's output streams, for chaining further MTP layers)."""
        if not len(self.mtp):
            raise ValueError("deepfuse: this checkpoint has no MTP layer (num_nextn_predict_layers = 0)")
        self._check_ids(next_ids, cache)
        mtp = self.mtp[layer]
        B, T = next_ids.shape
        p0 = cache.mtp_lengths[layer] if cache is not None else 0
        positions = torch.arange(p0, p0 + T, device=next_ids.device)
        emb = self.embed(next_ids).to(self.dtype)
        h, out = mtp.step(streams, emb, next_ids, positions, p0, self.ropes,
                          cache.mtp[layer] if cache is not None else None)
        if cache is not None:
            cache.mtp_lengths[layer] += T
        return self.head(h).float(), out

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, *, eos_token_id: Optional[int] = None):
        """Greedy decoding with a cache: prefill, then one token per step -> [B, T + new]."""
        cache = self.new_cache(input_ids.shape[0])
        out = input_ids
        logits = self(input_ids, cache)
        for _ in range(max_new_tokens):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            out = torch.cat([out, nxt], dim=1)
            if eos_token_id is not None and bool((nxt == eos_token_id).all()):
                break
            if out.shape[1] - input_ids.shape[1] == max_new_tokens:
                break
            logits = self(nxt, cache)
        return out
