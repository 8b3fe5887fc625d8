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
R = 2r (overlapping) or r rows of un-pooled projections (plus draft tokens - 1 under
speculation, so that rejected drafts never overwrite a live row), row s * R + p % R.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from deepfuse.step import CacheGeometry, CompressPlan, StepContext, WindowPlan  # re-exported


class _Upload:
    """Packs the step's host index arrays into one buffer and copies it to the device once
    (pinned staging buffer on CUDA, so the copy is asynchronous)."""

    def __init__(self):
        self._pinned: dict[torch.device, torch.Tensor] = {}
        self._done: dict[torch.device, torch.cuda.Event] = {}

    def __call__(self, arrays: list[np.ndarray], device: torch.device,
                 out: Optional[torch.Tensor] = None) -> Optional[list[torch.Tensor]]:
        """-> views of the device copy, one per array; out: a device buffer to copy into (a
        captured graph's static buffer) instead of a new tensor (-> None: its views exist)."""
        sizes = [a.size for a in arrays]
        total = sum(sizes)
        flat = [a.reshape(-1) for a in arrays]
        if out is not None:
            out = out[:total]
        if device.type == "cuda":
            buf = self._pinned.get(device)
            if buf is None or buf.numel() < total:
                buf = self._pinned[device] = torch.empty(max(total, 1 << 16) * 2, dtype=torch.int64,
                                                         pin_memory=True)
            ev = self._done.get(device)
            if ev is not None:
                ev.synchronize()  # the previous step's copy has left the staging buffer
            staged = buf[:total]
            np.concatenate(flat, out=staged.numpy(), casting="unsafe")  # packed straight into the staging buffer
            dev = staged.to(device, non_blocking=True) if out is None else out.copy_(staged, non_blocking=True)
            ev = self._done[device] = torch.cuda.Event()
            ev.record()
        else:
            host = torch.from_numpy(np.concatenate(flat).astype(np.int64, copy=False))
            dev = host if out is None else out.copy_(host)
        if out is not None:
            return None
        out, o = [], 0
        for a, n in zip(arrays, sizes):
            out.append(dev[o:o + n].view(a.shape))
            o += n
        return out


upload = _Upload()
_aranges: dict[tuple, torch.Tensor] = {}


def _full(n: int, value: int, device: torch.device) -> torch.Tensor:
    """A cached constant int64 tensor [n] (never written)."""
    t = _aranges.get((n, value, device))
    if t is None:
        t = _aranges[(n, value, device)] = torch.full((n,), value, dtype=torch.int64, device=device)
    return t


def _arange(n: int, device: torch.device) -> torch.Tensor:
    t = _aranges.get((n, device))
    if t is None:
        t = _aranges[(n, device)] = torch.arange(n, device=device)
    return t


@dataclass(frozen=True)
class Padding:
    """Static shapes of a captured step (engine/graph_runner.py): requests are padded to
    `reqs` (pad requests: request slot -1, `tokens` tokens from position 0, nothing stored,
    no window or compressed rows read), each schedule's new blocks to `blocks[i]` (pad
    blocks: no valid source, slot -1) and its entry tables to `entries[i]` columns."""

    reqs: int
    tokens: int                   # tokens of every request (pads too)
    logits: int                   # logits rows of every request (1, or `tokens` for verify)
    blocks: tuple[int, ...]
    entries: tuple[int, ...]


@dataclass
class HostContext:
    """The host half of a step context: the per-request / per-token / per-block index arrays
    (uploaded to the device in one transfer) and the shapes the device half expands them to."""

    arrays: list
    N: int
    B: int
    plan_host: list               # per schedule: (r, overlap, R, entries, blocks, first array)
    starts: np.ndarray
    counts: np.ndarray
    logits_req: np.ndarray
    num_logits: np.ndarray


def _pad(x: np.ndarray, n: int, value) -> np.ndarray:
    if n <= len(x):
        return x
    y = np.empty(n, x.dtype)
    y[:len(x)] = x
    y[len(x):] = value
    return y


def host_context(input_ids: np.ndarray, starts: np.ndarray, counts: np.ndarray, slots: np.ndarray,
                 num_logits: np.ndarray, geom: CacheGeometry, host_block_tables: dict[int, np.ndarray],
                 pad: Optional[Padding] = None) -> HostContext:
    """The host arrays of a step (see build_context); pad: static shapes for a captured graph."""
    num_logits = np.asarray(num_logits, dtype=np.int64)
    real = (starts, counts, np.repeat(np.arange(len(counts), dtype=np.int64), num_logits), num_logits)
    if pad is not None:
        n = pad.reqs
        input_ids = _pad(np.asarray(input_ids, np.int64), n * pad.tokens, 0)
        starts, counts = _pad(starts, n, 0), _pad(counts, n, pad.tokens)
        slots, num_logits = _pad(slots, n, -1), _pad(num_logits, n, pad.logits)
    B = len(counts)
    live = slots >= 0
    ends = starts + counts
    cu = np.zeros(B + 1, np.int64)
    np.cumsum(counts, out=cu[1:])
    N = int(cu[-1])
    token_req = np.repeat(np.arange(B, dtype=np.int64), counts)
    positions = np.arange(N, dtype=np.int64) + (starts - cu[:-1])[token_req]
    tok_slot, tok_end = slots[token_req], ends[token_req]
    logits_req = np.repeat(np.arange(B, dtype=np.int64), num_logits)
    R = len(logits_req)
    loff = np.zeros(B, np.int64)
    np.cumsum(num_logits[:-1], out=loff[1:])
    logits_indices = (cu[1:] - num_logits)[logits_req] + np.arange(R, dtype=np.int64) - loff[logits_req]
    Wr, Wp = geom.ring_rows, geom.ring_page_rows
    ring_slots = np.where((positions >= tok_end - Wr) & (tok_slot >= 0), tok_slot * Wp + positions % Wr, -1)
    arrays = [input_ids, positions, token_req, slots, logits_indices, starts[token_req], tok_slot, ring_slots]
    ps = geom.page_size
    plan_host = []
    for i, (r, overlap) in enumerate(geom.schedules):
        Rs = (2 * r if overlap else r) + geom.state_extra
        n_ent = np.where(live, ends // r, 0)
        first = np.where(live, starts // r, 0)
        nblk = n_ent - first
        breq = np.repeat(np.arange(B, dtype=np.int64), nblk)
        nb = len(breq)
        boff = np.zeros(B, np.int64)
        np.cumsum(nblk[:-1], out=boff[1:])
        bidx = first[breq] + np.arange(nb, dtype=np.int64) - boff[breq]
        bslot = host_block_tables[r][slots[breq], bidx // ps] * ps + bidx % ps
        L = 2 * r if overlap else r
        pos0 = bidx * r - (r if overlap else 0)
        bstart, bcu, bsl, bpos = starts[breq], cu[:-1][breq], slots[breq], bidx * r
        cmax = int(n_ent.max()) if B else 0
        if pad is not None:
            if nb > pad.blocks[i] or cmax > pad.entries[i]:
                raise ValueError("deepfuse: step exceeds its graph's padding")
            m = pad.blocks[i]
            bpos, bslot, pos0 = _pad(bpos, m, 0), _pad(bslot, m, -1), _pad(pos0, m, -L)
            bstart, bcu, bsl = _pad(bstart, m, 0), _pad(bcu, m, 0), _pad(bsl, m, 0)
            nb, cmax = m, pad.entries[i]
        state_slots = np.where((positions >= tok_end - Rs) & (tok_slot >= 0), tok_slot * Rs + positions % Rs, -1)
        n_vis = (positions + 1) // r
        k = len(arrays)
        arrays += [n_vis, state_slots, n_ent, bpos, bslot, pos0, bstart, bcu, bsl]
        plan_host.append((r, overlap, Rs, cmax, nb, k))
    return HostContext(arrays, N, B, plan_host, *real)


def device_context(hc: HostContext, d: list[torch.Tensor], geom: CacheGeometry, block_tables: dict[int, torch.Tensor],
                   dev: torch.device) -> StepContext:
    """The device half: expands the uploaded arrays d (hc.arrays on the device) into the
    step's index tensors. No host sync: it runs inside a captured graph too."""
    N, B = hc.N, hc.B
    W, Wr, Wp = geom.window, geom.ring_rows, geom.ring_page_rows
    ps = geom.page_size
    ids, pos_d, token_req_d, slot_d, logits_d, tok_start_d, tok_slot_d, ring_d = d[:8]

    ar_w = _arange(W, dev)
    kpos = pos_d[:, None] - (W - 1) + ar_w[None, :]
    ring_slot = tok_slot_d[:, None] * Wp + kpos.remainder(Wr)
    fresh = geom.scratch_base + (_arange(N, dev) - pos_d)[:, None] + kpos
    pad = tok_slot_d < 0  # pad requests of a captured step: no scratch rows either
    win_idx = torch.where(kpos < tok_start_d[:, None], ring_slot, fresh).masked_fill_((kpos < 0) | pad[:, None], -1)
    window = WindowPlan(win_idx, torch.where(pad, -1, geom.scratch_base + _arange(N, dev)), ring_d)

    plans = {}
    for r, overlap, R, cmax, nb, k in hc.plan_host:
        n_vis, state_slots, n_ent, blk_pos, blk_slot, pos0, bstart, bcu, bslot_req = d[k:k + 9]
        bt = block_tables[r]
        if cmax:
            npg = -(-cmax // ps)  # pages of the widest request (<= the block table's width: max_model_len)
            if npg > bt.shape[1]:
                raise ValueError(f"deepfuse: step has {cmax} compressed entries at ratio {r}, more than the block "
                                 f"tables hold ({bt.shape[1]} pages of {ps})")
            rows = bt[slot_d.clamp(min=0), :npg]
            entry_slots = (rows[:, :, None] * ps + _arange(ps, dev)).view(B, npg * ps)
            if npg * ps != cmax:
                entry_slots = entry_slots[:, :cmax].contiguous()
            entry_slots.masked_fill_(_arange(cmax, dev)[None, :] >= n_ent[:, None], -1)
        else:
            entry_slots = bt.new_zeros(B, 0)
        L = 2 * r if overlap else r
        spos = pos0[:, None] + _arange(L, dev)[None, :]
        is_fresh = spos >= bstart[:, None]
        src_fresh = (bcu[:, None] + spos - bstart[:, None]).clamp_(0, max(N - 1, 0))
        src_state = (bslot_req[:, None] * R + spos.remainder(R)).clamp_(min=0)
        plans[(r, overlap)] = CompressPlan(r, overlap, R, ps, n_vis.to(torch.int32), cmax, entry_slots, nb, blk_pos,
                                           blk_slot, src_fresh, src_state, is_fresh, spos >= 0, spos.remainder(r),
                                           state_slots)

    return StepContext(N, len(hc.counts), ids, pos_d, token_req_d, slot_d, logits_d, window, plans, hc.starts,
                       hc.counts, hc.logits_req, hc.num_logits)


def build_context(input_ids: np.ndarray, starts: np.ndarray, counts: np.ndarray, slots: np.ndarray,
                  num_logits: np.ndarray, geom: CacheGeometry, block_tables: dict[int, torch.Tensor],
                  device, host_block_tables: dict[int, np.ndarray]) -> StepContext:
    """input_ids [N] (the step's tokens, request after request), per request: starts, counts,
    slots (request slots), num_logits (how many of its last rows get logits: 0, 1, or all of
    a verify chunk);
    block_tables[ratio]: the device block table [num_slots, max_pages] of that ratio and
    host_block_tables[ratio] its host copy. Per-token arrays are computed here with numpy
    and copied to the device in one transfer; the [N, W] / [B, C] / [blocks, L] index
    expansions run on the device."""
    dev = torch.device(device)
    hc = host_context(input_ids, starts, counts, slots, num_logits, geom, host_block_tables)
    return device_context(hc, upload(hc.arrays, dev), geom, block_tables, dev)


def decode_context(input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, geom: CacheGeometry,
                   block_tables: dict[int, torch.Tensor], entries: tuple[int, ...]) -> StepContext:
    """The context of a step of one token per request whose positions live on the device
    (the chained MTP draft steps: each request's position depends on how many drafts the
    step before accepted). input_ids / positions / slots [B] int64 device tensors (slot -1:
    the row stores and reads nothing); entries: each schedule's static entry-table width.
    Every request owns one potential compressed block (it completes when (p + 1) % r == 0);
    the others are pad blocks (slot -1, no valid source). Static shapes, no host sync: it
    runs inside a captured graph."""
    B = input_ids.shape[0]
    dev = input_ids.device
    live = slots >= 0
    rows = _arange(B, dev)
    Wr, Wp = geom.ring_rows, geom.ring_page_rows
    ring = torch.where(live, slots * Wp + positions.remainder(Wr), -1)
    d = [input_ids, positions, rows, slots, rows, positions, slots, ring]
    plan_host = []
    ps = geom.page_size
    for (r, overlap), cmax in zip(geom.schedules, entries):
        Rs = (2 * r if overlap else r) + geom.state_extra
        L = 2 * r if overlap else r
        n_vis = (positions + 1) // r
        state_slots = torch.where(live, slots * Rs + positions.remainder(Rs), -1)
        n_ent = torch.where(live, n_vis, 0)
        done = live & ((positions + 1).remainder(r) == 0)
        bidx = positions // r
        bt = block_tables[r]
        page = bt[slots.clamp(min=0), (bidx // ps).clamp(0, bt.shape[1] - 1)]
        bslot = torch.where(done, page * ps + bidx.remainder(ps), -1)
        pos0 = torch.where(done, bidx * r - (r if overlap else 0), -L)
        bpos = torch.where(done, bidx * r, 0)
        k = len(d)
        d += [n_vis, state_slots, n_ent, bpos, bslot, pos0, positions, rows, slots.clamp(min=0)]
        plan_host.append((r, overlap, Rs, cmax, B, k))
    ones = np.ones(B, np.int64)
    hc = HostContext([], B, B, plan_host, np.zeros(B, np.int64), ones, np.arange(B, dtype=np.int64), ones)
    return device_context(hc, d, geom, block_tables, dev)


def verify_arrays(input_ids: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor, T: int, geom: CacheGeometry,
                  block_tables: dict[int, torch.Tensor], blocks: Optional[tuple[int, ...]] = None) -> list[torch.Tensor]:
    """host_context's arrays of a uniform step (T tokens and T logits rows per request)
    computed on the device from device starts: what a speculative step launched before the
    previous step's acceptance is read back needs (its positions depend on that
    acceptance). input_ids [B * T], starts / slots [B] int64 device tensors (slot -1: a pad
    request, start 0). Each request owns ceil(T / r) potential compressed blocks per
    schedule (those past its last complete block are pad blocks: slot -1, no valid source);
    blocks: pad each schedule's block arrays to that many (a graph's Padding.blocks). Same
    layout and values as host_context(pad=...) for the same step: the arrays fill a
    graph's static buffer. Static shapes, no host sync."""
    B = starts.shape[0]
    dev = starts.device
    N = B * T
    live = slots >= 0
    token_req = _arange(N, dev) // T
    positions = (starts[:, None] + _arange(T, dev)[None, :]).reshape(-1)
    tok_slot, tok_start = slots[token_req], starts[token_req]
    tok_end = tok_start + T
    Wr, Wp = geom.ring_rows, geom.ring_page_rows
    ring = torch.where((positions >= tok_end - Wr) & (tok_slot >= 0), tok_slot * Wp + positions.remainder(Wr), -1)
    out = [input_ids, positions, token_req, slots, _arange(N, dev), tok_start, tok_slot, ring]
    ps = geom.page_size
    cu = _arange(B, dev) * T
    for i, (r, overlap) in enumerate(geom.schedules):
        Rs = (2 * r if overlap else r) + geom.state_extra
        L = 2 * r if overlap else r
        n_ent = torch.where(live, (starts + T) // r, 0)
        bidx = torch.where(live, starts // r, 0)[:, None] + _arange(-(-T // r), dev)[None, :]  # [B, m]
        ok = bidx < n_ent[:, None]
        bt = block_tables[r]
        page = bt[slots.clamp(min=0)[:, None], (bidx // ps).clamp(0, bt.shape[1] - 1)]
        cols = [torch.where(ok, bidx * r, 0), torch.where(ok, page * ps + bidx.remainder(ps), -1),
                torch.where(ok, bidx * r - (r if overlap else 0), -L), torch.where(ok, starts[:, None], 0),
                torch.where(ok, cu[:, None], 0), torch.where(ok, slots[:, None], 0)]
        cols = [c.reshape(-1) for c in cols]
        if blocks is not None and blocks[i] > len(cols[0]):
            cols = [torch.cat([c, _full(blocks[i] - len(c), v, dev)]) for c, v in zip(cols, (0, -1, -L, 0, 0, 0))]
        state = torch.where((positions >= tok_end - Rs) & (tok_slot >= 0), tok_slot * Rs + positions.remainder(Rs), -1)
        out += [(positions + 1) // r, state, n_ent, *cols]
    return out


def verify_context(input_ids: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor, T: int, geom: CacheGeometry,
                   block_tables: dict[int, torch.Tensor], entries: tuple[int, ...]) -> StepContext:
    """The context of a uniform verify step whose starts live on the device (verify_arrays;
    entries: each schedule's static entry-table width). No host sync."""
    B = starts.shape[0]
    d = verify_arrays(input_ids, starts, slots, T, geom, block_tables)
    plan_host, k = [], 8
    for (r, overlap), cmax in zip(geom.schedules, entries):
        plan_host.append((r, overlap, (2 * r if overlap else r) + geom.state_extra, cmax, B * -(-T // r), k))
        k += 9
    nl = np.full(B, T, np.int64)
    hc = HostContext([], B * T, B, plan_host, np.zeros(B, np.int64), nl, np.repeat(np.arange(B, dtype=np.int64), T), nl)
    return device_context(hc, d, geom, block_tables, starts.device)
