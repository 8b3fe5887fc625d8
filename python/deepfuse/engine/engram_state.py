"""The Engram n-gram history of a step's requests (DeepSeek V4.1, models/v41.py).

A token's Engram rows hash it with the max_ngram - 1 tokens before it, so a chunk that
starts at position p > 0 (chunked prefill, a decode or verify step, a prefix-cache hit, a
recompute after preemption) needs the compressed ids at p - M + 1 .. p - 1. They are read
from the request's own committed tokens (Request.tokens), not kept as separate state: the
history is then right by construction through chunked prefill, preemption, prefix caching
and speculation (drafts are never committed tokens; a verify chunk starts at the request's
last committed token). With the overlapped step a request's newest token may still be on
the device; it is the chunk's first input, never part of the history before it.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

NONE = -1  # no token at that position (before the sequence)


def engram_history(chunks: Sequence, token_map: np.ndarray, max_ngram: int) -> np.ndarray:
    """[B, M - 1] int64 compressed ids of the tokens before each chunk's start (chunks:
    ScheduledChunk-like objects with .req (a Request) and .start), NONE before position 0."""
    H = max_ngram - 1
    out = np.full((len(chunks), H), NONE, dtype=np.int64)
    for b, ch in enumerate(chunks):
        a = max(0, ch.start - H)
        toks = np.asarray(ch.req.tokens(a, ch.start), dtype=np.int64)
        if (toks < 0).any():  # a token still on the device (overlap) is always a chunk's first input
            raise ValueError(f"deepfuse: engram_history: request {ch.req.request_id} has an unsettled token before "
                             f"position {ch.start}")
        if len(toks):
            out[b, H - len(toks):] = token_map[toks]
    return out


class EngramPrefetch:
    """A step's Engram rows of every table gathered on a side stream into preallocated device
    buffers as soon as the step's row ids are known, so the gather (over PCIe for tables in
    page-locked host memory) overlaps the layers before the first Engram layer.

    tables: (weight [R_l, D_l] e4m3, scale [R_l, D_l / 32]) per Engram layer, in device or
    page-locked host memory; max_tokens: the most rows of a step; cols: C; dtype: the rows'
    dtype. start(hashes [N, L, C]) on the step's stream; rows(l) makes the current stream wait
    for table l's rows and returns them [N, C, D_l] (a view of the buffer: valid until the next
    start). Ordering: the side stream waits for the current stream before it writes (the ids
    are ready, the previous step's readers of the buffers are done); the ids tensor is kept
    from reuse until the side stream has read it (record_stream). Under CUDA graph capture
    start() gathers on the capturing stream itself (no fork).
    """

    def __init__(self, tables, max_tokens: int, cols: int, dtype: torch.dtype, device):
        from deepfuse.ops import engram as E

        self._E = E
        device = torch.device(device)
        if device.index is None:
            device = torch.device(device.type, torch.cuda.current_device())
        self.device = device
        self.tables = list(tables)
        self.bufs = [torch.empty(max_tokens, cols, w.shape[1], dtype=dtype, device=self.device) for w, _ in self.tables]
        self.stream = torch.cuda.Stream(self.device)
        self.ready = [torch.cuda.Event() for _ in self.tables]
        self.max_tokens, self.cols = max_tokens, cols
        self.hashes: Optional[torch.Tensor] = None
        self.n = 0

    def start(self, hashes: torch.Tensor) -> None:
        N, L, C = hashes.shape
        if L != len(self.tables) or C != self.cols or N > self.max_tokens or hashes.device != self.device:
            raise ValueError(f"deepfuse: EngramPrefetch.start: hashes must be [<= {self.max_tokens}, "
                             f"{len(self.tables)}, {self.cols}] on {self.device}, got {list(hashes.shape)} on "
                             f"{hashes.device}")
        main = torch.cuda.current_stream(self.device)
        capturing = torch.cuda.is_current_stream_capturing()
        side = main if capturing else self.stream
        if not capturing:
            side.wait_stream(main)
        with torch.cuda.stream(side):
            for l, (w, s) in enumerate(self.tables):
                self._E.lookup_into(self.bufs[l][:N], w, s, hashes[:, l])
                self.ready[l].record(side)
        if not capturing:
            hashes.record_stream(side)
        self.hashes, self.n = hashes, N

    def rows(self, layer: int) -> torch.Tensor:
        torch.cuda.current_stream(self.device).wait_event(self.ready[layer])
        return self.bufs[layer][: self.n]

    def serves(self, layer: int, ids: torch.Tensor) -> bool:
        """Whether ids is the started step's column block of table `layer` (hashes[:, layer])."""
        h = self.hashes
        if h is None:
            return False
        v = h[:, layer]
        return ids.data_ptr() == v.data_ptr() and ids.shape == v.shape and ids.stride() == v.stride()


def attach_prefetch(model, max_tokens: int, dtype: Optional[torch.dtype] = None,
                    device=None) -> Optional[EngramPrefetch]:
    """Prefetch a V4.1 model's Engram rows in its engine steps (models/v41.py forward_step):
    the hasher's step_hashes starts the gather of every table, each Engram table's lookup of
    those ids returns the prefetched rows (other ids, e.g. cut by a replay, gather as before).
    Instance attributes only (model code unchanged); returns the EngramPrefetch, None for a
    model without Engram or off the GPU. device: the GPU of the steps (default: the tables'
    if they are on one, else model.device, else the first CUDA parameter's or buffer's). Once per model: a prefetch
    already attached for at least max_tokens rows of the same dtype and device is returned as
    it is, another one is detached first (engines built again on the same model)."""
    hasher = getattr(model, "engram_hasher", None)
    tables = model.engram_tables() if hasher is not None else []
    if not tables or tables[0].weight.device.type == "meta":
        return None
    dev = device if device is not None else tables[0].weight.device
    if torch.device(dev).type != "cuda":  # host tables: the model's GPU (its weights are buffers, not parameters)
        md = getattr(model, "device", None)
        dev = md if md is not None and torch.device(md).type == "cuda" else next(
            (t.device for t in (*model.parameters(), *model.buffers()) if t.device.type == "cuda"), None)
    if dev is None:
        return None
    dtype = dtype or getattr(model, "dtype", torch.float32)
    old = getattr(model, "_engram_prefetch", None)
    if old is not None:
        want = torch.device(dev)
        if want.index is None:
            want = torch.device(want.type, torch.cuda.current_device())
        if old.max_tokens >= max_tokens and old.bufs[0].dtype == dtype and old.device == want:
            return old
        detach_prefetch(model)
    pf = EngramPrefetch([(t.weight, t.scale) for t in tables], max_tokens, model.cfg.engram_cols, dtype, dev)
    step_hashes = type(hasher).step_hashes

    def hashes_and_start(*args, **kwargs):
        h = step_hashes(hasher, *args, **kwargs)
        if h.shape[0] <= pf.max_tokens:
            pf.start(h)
        return h

    hasher.step_hashes = hashes_and_start
    for l, t in enumerate(tables):
        lookup = type(t).forward

        def fwd(ids, out_dtype, _l=l, _t=t, _lookup=lookup):
            if out_dtype == pf.bufs[_l].dtype and pf.serves(_l, ids):
                return pf.rows(_l)
            return _lookup(_t, ids, out_dtype)

        t.forward = fwd
    model._engram_prefetch = pf
    return pf


def detach_prefetch(model) -> None:
    """Undo attach_prefetch (the hasher's and the tables' own methods again)."""
    if getattr(model, "_engram_prefetch", None) is None:
        return
    model.engram_hasher.__dict__.pop("step_hashes", None)
    for t in model.engram_tables():
        t.__dict__.pop("forward", None)
    model._engram_prefetch = None


def engine_prefetch(model, max_tokens: int) -> Optional[EngramPrefetch]:
    """The engine's Engram prefetch (Engine.__init__, before the memory plan so that its
    buffers count as weights): attach_prefetch(model, max_tokens) for a V4.1 model on CUDA
    whose Engram tables sit in host memory (engram_placement "host": every step's rows cross
    PCIe; the side stream overlaps them with the layers before the first Engram layer);
    None otherwise (tables in HBM, the CPU, no Engram) or when `model.engram_prefetch` is
    False (the switch; bench_e2e's --no-engram-prefetch)."""
    if getattr(model, "engram_prefetch", True) is False or getattr(model, "engram_hasher", None) is None:
        return None
    tables = model.engram_tables()
    dev = getattr(model, "device", None)
    if not tables or dev is None or torch.device(dev).type != "cuda" or tables[0].weight.device.type != "cpu":
        return None
    return attach_prefetch(model, max(1, int(max_tokens)), device=dev)
