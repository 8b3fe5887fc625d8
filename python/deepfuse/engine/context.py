"""The step context: what one forward step over a flat token batch needs, computed once.

A step runs N tokens laid out request after request (request b owns flat rows
cu_seqlens[b] .. cu_seqlens[b+1]-1, positions start[b] .. end[b]-1). The host side works on
per-request arrays ([B], numpy); per-token and per-block index tensors are expanded on the
device from them (no per-token Python loop, no host sync). Every layer of the step reuses
the same context: the window plan for the attention's window rows, and one CompressPlan per
compression schedule (ratio, overlap) for the compressors, the indexer and the compressed
attention rows.

Slot conventions (deepfuse.kv_format): slot = page * page_size + row, -1 = none. Window rows
live in the ring pages: request slot s holds position p at slot s * Wp + p % Wr; rows of the
step itself are first written to scratch pages (slot scratch_base + flat row) so that every
query reads its own window, even inside a prefill chunk longer than the ring, and only then
the last Wr rows of each request go to the ring. Compressor state: per request slot a ring of
R = 2r (overlapping) or r rows of un-pooled projections, row s * R + p % R.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch


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
    logits_indices: torch.Tensor  # [R] int64 flat rows whose next-token logits are sampled
    window: WindowPlan
    plans: dict[tuple[int, bool], CompressPlan]
    # host copies
    starts: np.ndarray            # [B] first position of each request's chunk
    counts: np.ndarray            # [B] tokens of each request in the step
    sample_reqs: np.ndarray       # [R] request index (0..B-1) of each sampled row
    _rope: dict = field(default_factory=dict)

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


def _expand(counts: np.ndarray, device) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (owner [sum counts] int64, rank within owner [sum counts] int64) on the device."""
    n = int(counts.sum())
    c = torch.from_numpy(counts.astype(np.int64)).to(device)
    owner = torch.repeat_interleave(torch.arange(len(counts), device=device), c, output_size=n)
    offs = torch.from_numpy(np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)).to(device)
    rank = torch.arange(n, device=device) - offs[owner]
    return owner, rank


def build_context(input_ids: np.ndarray, starts: np.ndarray, counts: np.ndarray, slots: np.ndarray,
                  sample: np.ndarray, geom: CacheGeometry, block_tables: dict[int, torch.Tensor],
                  device) -> StepContext:
    """input_ids [N] (the step's tokens, request after request), per request: starts, counts,
    slots (request slots), sample (bool: sample the token after its last row);
    block_tables[ratio]: the device block table [num_slots, max_pages] of that ratio."""
    B = len(counts)
    N = int(counts.sum())
    ends = starts + counts
    cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    dev = torch.device(device)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(dev)  # noqa: E731
    ids = t(input_ids)
    start_d, slot_d, cu_d = t(starts), t(slots), t(cu[:-1])
    token_req, rank = _expand(counts, dev)
    positions = start_d[token_req] + rank
    tok_start = start_d[token_req]
    tok_slot = slot_d[token_req]
    tok_end = t(ends)[token_req]
    sample_reqs = np.nonzero(sample)[0]
    logits_indices = t(cu[1:][sample_reqs] - 1)

    # window: keys p - W + 1 .. p; before the chunk start from the ring, else from scratch
    W, Wr, Wp = geom.window, geom.ring_rows, geom.ring_page_rows
    kpos = positions[:, None] - (W - 1) + torch.arange(W, device=dev)[None, :]
    in_ring = kpos < tok_start[:, None]
    ring_slot = tok_slot[:, None] * Wp + kpos.remainder(Wr)
    flat = (torch.arange(N, device=dev) - positions)[:, None] + kpos  # flat row of a fresh key
    win_idx = torch.where(in_ring, ring_slot, geom.scratch_base + flat)
    win_idx = torch.where(kpos >= 0, win_idx, torch.full_like(win_idx, -1))
    scratch = geom.scratch_base + torch.arange(N, device=dev)
    keep = positions >= tok_end - Wr
    ring_slots = torch.where(keep, tok_slot * Wp + positions.remainder(Wr), torch.full_like(positions, -1))
    window = WindowPlan(win_idx, scratch, ring_slots)

    plans = {}
    ps = geom.page_size
    for r, overlap in geom.schedules:
        R = 2 * r if overlap else r
        L = 2 * r if overlap else r
        n_vis = torch.div(positions + 1, r, rounding_mode="floor").to(torch.int32)
        n_ent = ends // r
        cmax = int(n_ent.max()) if B else 0
        bt = block_tables[r]
        e = torch.arange(cmax, device=dev)
        pages = bt[slot_d][:, torch.div(e, ps, rounding_mode="floor")] if cmax else bt.new_zeros(B, 0)
        entry_slots = torch.where(e[None, :] < t(n_ent)[:, None], pages * ps + e.remainder(ps), -1)
        first = starts // r
        nblk = n_ent - first
        nb = int(nblk.sum())
        if nb:
            breq, brank = _expand(nblk, dev)
            bidx = t(first)[breq] + brank
            bslot = bt[slot_d[breq], torch.div(bidx, ps, rounding_mode="floor")] * ps + bidx.remainder(ps)
            pos0 = bidx * r - (r if overlap else 0)
            spos = pos0[:, None] + torch.arange(L, device=dev)[None, :]
            bstart = start_d[breq][:, None]
            is_fresh = spos >= bstart
            src_fresh = (cu_d[breq][:, None] + spos - bstart).clamp(0, max(N - 1, 0))
            src_state = slot_d[breq][:, None] * R + spos.remainder(R)
            plan_blk = (bidx * r, bslot, src_fresh, src_state, is_fresh, spos >= 0, spos.remainder(r))
        else:
            z = torch.zeros(0, dtype=torch.int64, device=dev)
            z2 = z.view(0, L)
            plan_blk = (z, z, z2, z2, z2.bool(), z2.bool(), z2)
        keep_s = positions >= tok_end - R
        state_slots = torch.where(keep_s, tok_slot * R + positions.remainder(R), torch.full_like(positions, -1))
        plans[(r, overlap)] = CompressPlan(r, overlap, R, ps, n_vis, cmax, entry_slots, nb, *plan_blk, state_slots)

    return StepContext(N, B, ids, positions, token_req, slot_d, logits_indices, window, plans,
                       starts, counts, sample_reqs)
