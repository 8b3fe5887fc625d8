"""Per-request decode state of the V4 graph, behind a small interface.

A forward step consumes T new tokens at positions p0 .. p0+T-1 (the same for every row of
the batch). Per attention layer it needs:
- the sliding window: kv rows (after kv_norm and RoPE) of the latest positions before p0
  (at least W - 1 of them once available), in position order;
- the compressed rows emitted so far: "attn" ([C, head_dim], after norm and RoPE) and, on
  CSA layers, "index" ([C, index_head_dim], the lightning indexer's keys);
- each compressor's state (CompressorState): the un-pooled projections of the current,
  incomplete block and, for the overlapping 4:1 compressor, the half of the last complete
  block that the next block reads.

LayerCache is the protocol the model talks to. DenseLayerCache stores plain tensors; the
engine can back the same protocol with the paged FP8 caches (a window ring per request,
paged compressed rows and indexer keys) without touching the model.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol, runtime_checkable

import torch


@dataclass
class CompressorState:
    """Carried between steps for one compressor ("attn" or "index") of one layer.

    kv, score: [B, n, coff * D] projections (wkv x, wgate x) of the n < ratio positions of
      the current, incomplete block (score without the positional bias ape).
    prev_kv, prev_score: [B, ratio, D] the first halves (kv, gate + ape) of the last complete
      block, read by the next block of an overlapping (ratio 4) compressor; None before the
      first complete block and for non-overlapping compressors.
    """

    kv: torch.Tensor
    score: torch.Tensor
    prev_kv: Optional[torch.Tensor] = None
    prev_score: Optional[torch.Tensor] = None


@runtime_checkable
class LayerCache(Protocol):
    def window(self) -> Optional[torch.Tensor]:
        """[B, n, D] window kv rows of the n latest positions before this step (None if empty)."""

    def append_window(self, kv: torch.Tensor) -> None:
        """Append this step's window rows [B, T, D] (the oldest may be dropped beyond W)."""

    def compressed(self, name: str) -> Optional[torch.Tensor]:
        """[B, C, D] all compressed rows of `name` ("attn" / "index") so far (None if none)."""

    def append_compressed(self, name: str, rows: torch.Tensor) -> None:
        """Append newly emitted compressed rows [B, c, D]."""

    def compressor_state(self, name: str) -> Optional[CompressorState]: ...

    def set_compressor_state(self, name: str, state: CompressorState) -> None: ...


class DenseLayerCache:
    """LayerCache on plain tensors: a window of the last `window` rows, growing compressed rows."""

    def __init__(self, window: int):
        self.window_size = window
        self._window: Optional[torch.Tensor] = None
        self._compressed: dict[str, torch.Tensor] = {}
        self._states: dict[str, CompressorState] = {}

    def window(self):
        return self._window

    def append_window(self, kv):
        w = kv if self._window is None else torch.cat([self._window, kv], dim=1)
        self._window = w[:, -self.window_size:]

    def compressed(self, name):
        return self._compressed.get(name)

    def append_compressed(self, name, rows):
        old = self._compressed.get(name)
        self._compressed[name] = rows if old is None else torch.cat([old, rows], dim=1)

    def compressor_state(self, name):
        return self._states.get(name)

    def set_compressor_state(self, name, state):
        self._states[name] = state


@dataclass
class ModelCache:
    """Decode state of one batch of requests that advance together.

    length: positions consumed by the main layers; mtp_lengths[i]: by MTP layer i (which at
    position t reads the main model's streams at t and token t + 1)."""

    batch_size: int
    layers: list = field(default_factory=list)
    mtp: list = field(default_factory=list)
    length: int = 0
    mtp_lengths: list = field(default_factory=list)

    @classmethod
    def dense(cls, batch_size: int, num_layers: int, num_mtp: int, window: int) -> "ModelCache":
        return cls(batch_size, [DenseLayerCache(window) for _ in range(num_layers)],
                   [DenseLayerCache(window) for _ in range(num_mtp)], 0, [0] * num_mtp)
