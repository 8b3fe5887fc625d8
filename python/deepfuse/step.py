"""The step types the model consumes, built by the engine (deepfuse.engine.context,
deepfuse.engine.cache) and read by the model's layers: the step context with its window and
compression plans, the cache geometry it is built for, and one layer's view of the cache.
Imports only ops and kv_format, so that models and engine both import it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from deepfuse import ops
from deepfuse.ops.kvcache import store_rows


@dataclass
class WindowPlan:
    win_idx: torch.Tensor        # [N, W] int64 ring/scratch slots of each query's window (-1 before position 0)
    scratch_slots: torch.Tensor  # [N] int64 where this step's rows are written before attention
    ring_slots: torch.Tensor     # [N] int64 ring slot of the rows kept after the step (-1: overwritten later)


@dataclass
class CompressPlan:
    """One compression schedule (ratio r, overlap) for the step."""

    ratio: int
    overlap: bool
    state_rows: int              # R: state-ring rows per request slot
    page_size: int
    n_vis: torch.Tensor          # [N] int32 entries visible to each token: (p + 1) // r
    max_entries: int             # host: the most entries any request of the step has after it
    entry_slots: torch.Tensor    # [B, max_entries] int64 cache slot of entry e of request b (-1 beyond)
    num_blocks: int              # host: blocks completed in this step (new compressed rows)
    blk_pos: torch.Tensor        # [nb] int64 position of each new row (block start i * r: its RoPE)
    blk_slot: torch.Tensor       # [nb] int64 cache slot of each new row
    src_fresh: torch.Tensor      # [nb, L] int64 flat row of each pooled source position (clamped)
    src_state: torch.Tensor      # [nb, L] int64 state-ring row of it (clamped)
    src_is_fresh: torch.Tensor   # [nb, L] bool: the position is computed in this step
    src_valid: torch.Tensor      # [nb, L] bool: position >= 0
    src_ape: torch.Tensor        # [nb, L] int64 position % r (the positional bias row)
    state_slots: torch.Tensor    # [N] int64 state-ring row each token's projections go to (-1: not kept)


@dataclass
class StepContext:
    num_tokens: int
    num_reqs: int
    input_ids: torch.Tensor       # [N] int64
    positions: torch.Tensor       # [N] int64
    token_req: torch.Tensor       # [N] int64 index (0..B-1) of each token's request in the step
    req_slots: torch.Tensor       # [B] int64 request (ring / state) slots
    logits_indices: torch.Tensor  # [R] int64 flat rows whose next-token logits are computed
    window: WindowPlan
    plans: dict[tuple[int, bool], CompressPlan]
    # host copies
    starts: np.ndarray            # [B] first position of each request's chunk
    counts: np.ndarray            # [B] tokens of each request in the step
    logits_req: np.ndarray        # [R] request index (0..B-1) of each logits row
    num_logits: np.ndarray        # [B] logits rows of each request (its last rows)
    _rope: dict = field(default_factory=dict)
    graph: Optional[object] = None  # the captured graph that runs this step (engine/graph_runner.py)

    def rope(self, kind: str, table) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token (cos, sin) of RoPE `kind`, computed once per step."""
        cs = self._rope.get(kind)
        if cs is None:
            cs = self._rope[kind] = table(self.positions)
        return cs


@dataclass(frozen=True)
class CacheGeometry:
    """What the context builder needs to know of the cache layout."""

    window: int                   # W: the sliding window (keys of position p: p - W + 1 .. p)
    ring_rows: int                # Wr >= W: ring rows per request slot
    ring_page_rows: int           # Wp = round_up(Wr, 16): the ring's page size
    scratch_base: int             # first scratch slot (after every request slot's ring page)
    schedules: tuple[tuple[int, bool], ...]  # (ratio, overlap) of the model's compressors
    page_size: int                # rows per compressed page
    state_extra: int = 0          # extra compressor-state ring rows (draft tokens - 1)


@dataclass
class LayerCacheView:
    """One layer's part of the cache, as the model's layers use it."""

    fp8: bool
    ring: torch.Tensor                      # [P, Wp * 584] uint8 or [P, Wp, D]
    ring_page_size: int
    comp: Optional[torch.Tensor] = None     # compressed rows [P, ps * 584] / [P, ps, D]
    index: Optional[torch.Tensor] = None    # indexer keys [P, ps * 132] / [P, ps, Di]
    page_size: int = 0
    states: dict = field(default_factory=dict)  # name -> (kv [S * R + 1, w], score [S * R + 1, w])

    def window_target(self) -> ops.RowTarget:
        return ops.RowTarget(self.ring, "kv_fp8" if self.fp8 else "dense", self.ring_page_size)

    def target(self, name: str) -> ops.RowTarget:
        """The pages the compressor `name` ("attn" / "index") stores its rows in."""
        if name == "attn":
            return ops.RowTarget(self.comp, "kv_fp8" if self.fp8 else "dense", self.page_size)
        return ops.RowTarget(self.index, "idx_fp8" if self.fp8 else "dense", self.page_size)

    def store_window(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        store_rows(self.window_target(), rows, slots)
