"""CUDA graphs of the decode and verify steps.

A step whose requests all run the same number of tokens T (decode: T = 1, one logits row
each; verify: T = k + 1, T logits rows each) replays a graph captured for the smallest batch
bucket >= its request count. The graph holds the whole device side of the step: the step
context's expansions (context.device_context) from one static index buffer, and the model's
flat forward; per step the host fills the buffer (one copy, stream-ordered, so it may be
issued while the previous step still runs) and replays. Padding (context.Padding): pad
requests have request slot -1 (they store nothing and read nothing: no window rows), pad
blocks have no valid source, entry tables have the static width of the block tables
(ceil(max_model_len / r) entries rounded up to pages: the most one request can have), so
one graph per (bucket, T) serves every context length. Padded rows' logits are dropped.

Memory: all graphs share one pool, captured largest bucket first; what a graph keeps
between replays is its static buffer, its context's expansions (entry tables [bucket,
width] int64 per schedule, window indices [bucket * T, W]) and its logits [bucket * T,
vocab] fp32; buffer_bytes() counts them, pool_bytes is the measured total (the capture's
growth of torch's reserved memory: kept tensors plus the pool's free blocks).

Speculation (mtp=True): per (bucket, T) a second graph holds the MTP layer's
teacher-forced pass on the same captured context and the target's output streams (static
inputs: the next ids [bucket * T] and the row per request whose logits are drafted from
[bucket]); per bucket a chain graph holds one chained draft step (a token per request at
device positions: context.decode_context from static ids / positions / slots / streams;
pad requests have slot -1). So a speculative step is the target replay, the sampling
pass, the MTP replay and k - 1 chain replays, each with its draft sampling. A step of
greedy requests only (no logprobs or constraints) replays ONE graph
per (bucket, T) instead: target, acceptance, MTP pass and chained argmax drafts (_fused).

DSpark (V4.1; `features` set to the engine's DSparkRunner): the target graphs also compute the
draft stages' context rows of all their rows (kept as _Graph.feats); the drafts replay DSpark's
own graphs (engine/dspark_runner.py); mtp is off.

On the CPU (no graphs) the same padded static steps run eagerly: tests of the padding.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Optional

import numpy as np
import torch

from .context import Padding, StepContext, decode_context, device_context, host_context, upload, verify_arrays

_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256)


@dataclass
class _Graph:
    pad: Padding
    buf: torch.Tensor                 # static int64 index buffer (the uploaded host arrays)
    hc: object                        # the padded HostContext of the capture (its shapes)
    d: list                           # views of buf, one per host array
    ctx: StepContext                  # the captured context (its tensors are views of buf and graph memory)
    graph: Optional["torch.cuda.CUDAGraph"]
    out: object                       # logits [R, V] or (logits, streams [N, hc, d]), graph memory
    mtp: Optional[tuple] = None       # (graph or None, next ids [bucket * T], rows [bucket], (logits, streams) or None)
    fused: Optional[tuple] = None     # greedy speculative step in one graph: (graph or None, draft slots [bucket], outputs)
    last: Optional[tuple] = None      # CPU: (padded context, outputs) of the last run (the MTP pass reads them)
    extra: dict = None                # the model's static step inputs (model.step_buffers: V4.1's Engram history)
    feats: Optional[torch.Tensor] = None  # DSpark: the context rows of the step's rows (features.forward_with_rows)


@dataclass
class _Chain:
    """One chained draft step of `bucket` requests (static buffers; graph memory outputs)."""

    ids: torch.Tensor
    pos: torch.Tensor
    slots: torch.Tensor
    x: torch.Tensor
    graph: Optional["torch.cuda.CUDAGraph"]
    out: Optional[tuple]


def _tensors(x):
    """The tensors in x (nested tuples, lists, dicts and dataclasses)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)
    elif is_dataclass(x) and not isinstance(x, type):
        for f in fields(x):
            if f.name != "graph":
                yield from _tensors(getattr(x, f.name))


class GraphRunner:
    def __init__(self, model, cache, *, max_reqs: int, tokens: tuple[int, ...] = (1,), return_streams: bool = False,
                 buckets: Optional[tuple[int, ...]] = None, mtp: bool = False, draft_head=None):
        self.model, self.cache = model, cache
        self.draft_kw = {} if draft_head is None else {"head": draft_head}  # the MTP passes' lm head
        self.device = model.device
        self.capture = self.device.type == "cuda"
        self.mtp_graphs = mtp
        self.k = max(tokens) - 1 if mtp else 0
        self.return_streams = return_streams or mtp
        self.chains: dict[int, _Chain] = {}
        b = [x for x in (buckets or _BUCKETS) if x <= max_reqs]
        if not b or b[-1] < max_reqs:
            b.append(max_reqs)
        self.buckets = tuple(b)
        self.tokens = tuple(tokens)
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.pool = None
        self.capture_s = 0.0
        self.pool_bytes = 0  # reserved memory the capture added (CUDA)
        self.features = None  # DSpark drafting (engine/dspark_runner.py): steps also compute its context rows

    # ------------------------------------------------------------------ shapes
    def key(self, counts: np.ndarray, num_logits: np.ndarray) -> Optional[tuple[int, int]]:
        """(bucket, T) of a step that a graph serves, else None."""
        B = len(counts)
        if B == 0 or B > self.buckets[-1]:
            return None
        T = int(counts[0])
        if T not in self.tokens or (counts != T).any() or (num_logits != (1 if T == 1 else T)).any():
            return None
        return next(b for b in self.buckets if b >= B), T

    def _padding(self, bucket: int, T: int) -> Padding:
        geom = self.cache.geometry
        blocks = tuple(bucket * (-(-T // r) + 1) for r, _ in geom.schedules)
        entries = tuple(self.cache.block_tables[r].shape[1] * geom.page_size for r, _ in geom.schedules)
        return Padding(bucket, T, 1 if T == 1 else T, blocks, entries)

    # ------------------------------------------------------------------ capture
    def _views(self, buf: torch.Tensor, hc) -> list[torch.Tensor]:
        out, o = [], 0
        for a in hc.arrays:
            out.append(buf[o:o + a.size].view(a.shape))
            o += a.size
        return out

    def _build(self, key: tuple[int, int]) -> _Graph:
        bucket, T = key
        pad = self._padding(bucket, T)
        geom = self.cache.geometry
        e = np.zeros(0, np.int64)
        hc = host_context(e, e, e, e, e, geom, self.cache.host_block_tables, pad=pad)  # all pad requests
        host = torch.from_numpy(np.concatenate([a.reshape(-1) for a in hc.arrays]).astype(np.int64))
        buf = host.to(self.device)
        d = self._views(buf, hc)
        extra = self.model.step_buffers(bucket, self.device) if hasattr(self.model, "step_buffers") else {}

        def fwd(c):
            for name, t in extra.items():  # static inputs the engine fills before each replay
                setattr(c, name, t)
            return self._forward(c)[0]

        if not self.capture:
            ctx = device_context(hc, d, geom, self.cache.block_tables, self.device)
            for name, t in extra.items():
                setattr(ctx, name, t)
            return _Graph(pad, buf, hc, d, ctx, None, None, extra=extra)
        t0 = time.perf_counter()
        torch.cuda.synchronize(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), torch.no_grad():  # warm-up: lazy state (workspaces, handles) outside the graph
            fwd(device_context(hc, d, geom, self.cache.block_tables, self.device))
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        g = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(g, pool=self.pool), torch.no_grad():
            ctx = device_context(hc, d, geom, self.cache.block_tables, self.device)
            for name, t in extra.items():
                setattr(ctx, name, t)
            out, feats = self._forward(ctx)
        torch.cuda.synchronize(self.device)
        gr = _Graph(pad, buf, hc, d, ctx, g, out, extra=extra, feats=feats)
        if self.mtp_graphs:
            nxt = torch.zeros(bucket * T, dtype=torch.int64, device=self.device)
            rows = torch.zeros(bucket, dtype=torch.int64, device=self.device)
            mtp = lambda: self.model.mtp_forward_step(replace(ctx, logits_indices=rows), self.cache, out[1], nxt,  # noqa: E731
                                                       rows_only=True, **self.draft_kw)
            gr.mtp = (self._capture(mtp), nxt, rows, self._outs)
            st = self._fused_inputs(bucket)
            gr.fused = (self._capture(lambda: self._fused(hc, d, *st[:4])), st, self._outs)
        self.capture_s += time.perf_counter() - t0
        return gr

    def _forward(self, c: StepContext):
        """The model's step forward -> (its outputs, DSpark's context rows or None)."""
        if self.features is not None:
            return self.features.forward_with_rows(c, self.cache, self.return_streams)
        return self.model.forward_step(c, self.cache, return_streams=self.return_streams), None

    def _capture(self, fn) -> "torch.cuda.CUDAGraph":
        """Capture fn() (warmed up on a side stream first) into a graph of the shared pool;
        its outputs go to self._outs."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), torch.no_grad():
            fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool), torch.no_grad():
            self._outs = fn()
        torch.cuda.synchronize(self.device)
        return g

    def capture_all(self) -> float:
        """Capture every (bucket, T), largest first (smaller ones reuse its memory) -> seconds;
        pool_bytes: the memory it took."""
        r0 = self._reserved()
        for T in self.tokens:
            for b in reversed(self.buckets):
                if (b, T) not in self.graphs:
                    self.graphs[(b, T)] = self._build((b, T))
        if self.mtp_graphs:
            for b in reversed(self.buckets):
                if b not in self.chains:
                    self.chains[b] = self._build_chain(b)
        if self.capture:
            self.pool_bytes += max(0, self._reserved() - r0)
        return self.capture_s

    def _reserved(self) -> int:
        if not self.capture:
            return 0
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved(self.device)

    def buffer_bytes(self) -> dict[tuple[int, int], int]:
        """(bucket, T) -> bytes of the tensors its graph keeps (static buffer, context, outputs)."""
        out = {}
        for key, g in self.graphs.items():
            seen, n = set(), 0
            for t in _tensors((g.buf, g.ctx, g.out, g.mtp, g.fused)):
                p = t.untyped_storage().data_ptr()
                if p not in seen:
                    seen.add(p)
                    n += t.untyped_storage().nbytes()
            out[key] = n
        return out

    # ------------------------------------------------------------------ replay
    def prepare(self, key, ids, starts, counts, slots, num_logits) -> StepContext:
        """Fill the graph's static buffer for this step -> the step context the engine sees
        (its host arrays are the real, unpadded ones; ctx.graph set)."""
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = self._build(key)
        hc = host_context(ids, starts, counts, slots, num_logits, self.cache.geometry, self.cache.host_block_tables,
                          pad=g.pad)
        upload(hc.arrays, self.device, out=g.buf)  # pinned staging, stream-ordered after the step in flight
        ctx = copy.copy(g.ctx)  # dataclasses.replace without its __init__ (no __post_init__)
        ctx.num_tokens, ctx.num_reqs, ctx.graph = int(counts.sum()), len(counts), g
        ctx.starts, ctx.counts, ctx.logits_req, ctx.num_logits = hc.starts, hc.counts, hc.logits_req, hc.num_logits
        return ctx

    def prepare_early(self, key, ids: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor) -> StepContext:
        """prepare for a uniform verify step whose starts live on the device (ids [B * T],
        starts / slots [B]): the graph's static buffer is written on the device
        (context.verify_arrays: the same layout host_context fills)."""
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = self._build(key)
        n, T = g.pad.reqs, g.pad.tokens
        B = starts.shape[0]
        if B < n:
            ids = torch.cat([ids, ids.new_zeros((n - B) * T)])
            starts = torch.cat([starts, starts.new_zeros(n - B)])
            slots = torch.cat([slots, slots.new_full((n - B,), -1)])
        arrays = verify_arrays(ids, starts, slots, T, self.cache.geometry, self.cache.block_tables, g.pad.blocks)
        sizes = [a.numel() for a in arrays]
        if sizes != [a.size for a in g.hc.arrays]:
            raise ValueError(f"deepfuse: early verify step arrays {sizes} do not match the graph's {key} buffer")
        g.buf[:sum(sizes)].copy_(torch.cat([a.reshape(-1) for a in arrays]))
        ctx = copy.copy(g.ctx)
        ctx.num_tokens, ctx.num_reqs, ctx.graph = B * T, B, g
        nl = np.full(B, T, np.int64)
        ctx.starts, ctx.counts = np.zeros(B, np.int64), nl
        ctx.logits_req, ctx.num_logits = np.repeat(np.arange(B, dtype=np.int64), T), nl
        return ctx

    def run(self, ctx: StepContext):
        """Replay (or, on the CPU, run the padded step) -> logits [R, V] (and streams [N, hc, d])."""
        g = ctx.graph
        if g.graph is not None:
            g.graph.replay()
            out = g.out
        else:  # the padded step, eagerly: its context expanded from the filled buffer
            c = device_context(g.hc, g.d, self.cache.geometry, self.cache.block_tables, self.device)
            for name, t in (g.extra or {}).items():
                setattr(c, name, t)
            with torch.no_grad():
                out, g.feats = self._forward(c)
            g.last = (c, out)
        R, N = len(ctx.logits_req), ctx.num_tokens
        if self.return_streams:
            return out[0][:R], out[1][:N]
        return out[:R]

    def mtp(self, ctx: StepContext, nxt: torch.Tensor, rows: torch.Tensor):
        """The MTP layer's teacher-forced pass of the step just run (ctx: its context):
        nxt [N] the next ids, rows [B] the flat row of each request's drafting row ->
        (logits [B, V], streams [B, hc, d] of those rows)."""
        g = ctx.graph
        N, B = ctx.num_tokens, ctx.num_reqs
        if g.mtp is None:
            g.mtp = (None, torch.zeros(g.pad.reqs * g.pad.tokens, dtype=torch.int64, device=self.device),
                     torch.zeros(g.pad.reqs, dtype=torch.int64, device=self.device), None)
        graph, g_nxt, g_rows, outs = g.mtp
        g_nxt[:N].copy_(nxt)
        g_rows[:B].copy_(rows)
        if graph is not None:
            graph.replay()
        else:
            c, out = g.last
            with torch.no_grad():
                outs = self.model.mtp_forward_step(replace(c, logits_indices=g_rows), self.cache, out[1], g_nxt,
                                                   rows_only=True, **self.draft_kw)
        return outs[0][:B], outs[1][:B]

    # ------------------------------------------------------------------ the greedy speculative step, fused
    def _fused_inputs(self, bucket: int) -> tuple:
        """Static inputs of a fused step: draft slots [bucket] (-1: no drafts), simulated
        accepted lengths [bucket], drafts each request verifies [bucket] and the simulation's
        switch [1] (the spec_simulate_acc_len knob), views of one buffer [3 * bucket + 1]
        (the last item)."""
        buf = torch.zeros(3 * bucket + 1, dtype=torch.int64, device=self.device)  # one upload fills all four
        buf[:bucket] = -1
        return buf[:bucket], buf[bucket:2 * bucket], buf[2 * bucket:3 * bucket], buf[3 * bucket:], buf

    def _fused(self, hc, d: list, slots: torch.Tensor, sim: torch.Tensor, kv: torch.Tensor, use_sim: torch.Tensor):
        """The whole step of greedy requests from the static buffer: context, target forward,
        acceptance (the longest prefix of drafts equal to the argmax), the emitted tokens, the
        MTP pass on them and the k - 1 chained drafts (argmax), all static shapes ->
        (tokens [bucket, k + 1], emitted [bucket], accepted [bucket], drafts [bucket, k], flat):
        the first four are views of flat (one buffer: one copy takes them all).
        The same arithmetic as ModelRunner.finish / _draft for such a step."""
        m, cache, geom = self.model, self.cache, self.cache.geometry
        ctx = device_context(hc, d, geom, cache.block_tables, self.device)
        logits, streams = m.forward_step(ctx, cache, return_streams=True)
        Bk, T = hc.B, hc.N // hc.B
        target = logits.argmax(-1).view(Bk, T)
        ids = ctx.input_ids.view(Bk, T)
        if T > 1:
            dr = torch.cat([ids[:, 1:], ids[:, :1]], 1)  # row j verifies the input after it (the last: none)
            acc = torch.minimum((dr[:, :T - 1] == target[:, :T - 1]).long().cumprod(1).sum(1), kv)
            a = torch.where(use_sim > 0, torch.minimum(sim, kv), acc)
            tokens = torch.where(torch.arange(T, device=self.device)[None, :] < a[:, None], dr, target)
        else:
            acc = a = torch.zeros(Bk, dtype=torch.int64, device=self.device)
            tokens = target
        row_a = torch.arange(Bk, device=self.device) * T + a
        base = ctx.positions.view(Bk, T)[:, 0] + a
        lg, x = m.mtp_forward_step(replace(ctx, logits_indices=row_a), cache, streams, tokens.reshape(-1),
                                   rows_only=True, **self.draft_kw)
        drafts = [lg.argmax(-1)]
        for j in range(1, self.k):
            lg, x = self._chain_fn(drafts[-1], base + j, slots, x)
            drafts.append(lg.argmax(-1))
        out = torch.zeros(Bk, self.k + 1, dtype=torch.int64, device=self.device)
        out[:, :T] = tokens
        flat = torch.cat([out.reshape(-1), a + 1, acc, torch.stack(drafts, 1).reshape(-1)])
        return self._unpack(flat, Bk)

    def _unpack(self, flat: torch.Tensor, n: int) -> tuple:
        """flat [n * (2k + 3)] -> (tokens [n, k + 1], emitted [n], accepted [n], drafts [n, k], flat)."""
        K = self.k + 1
        o = n * K
        return flat[:o].view(n, K), flat[o:o + n], flat[o + n:o + 2 * n], flat[o + 2 * n:].view(n, self.k), flat

    def fused_ok(self, ctx: StepContext) -> bool:
        return self.mtp_graphs and ctx.graph is not None

    def fused(self, ctx: StepContext, draft_slots: np.ndarray, sim: Optional[np.ndarray] = None,
              verified: Optional[torch.Tensor] = None):
        """Run the fused greedy step whose buffer prepare filled (draft_slots [B] host, -1: no
        drafts; sim [B] host: simulated accepted lengths, or None; verified [B] device: the
        drafts each request verifies, None: all T - 1) -> (tokens, emitted, accepted (real),
        drafts, flat), first B rows of one copy (flat: the four's storage; the graph's outputs
        are rewritten by its next replay)."""
        g = ctx.graph
        B, n = ctx.num_reqs, g.pad.reqs
        if g.fused is None:
            g.fused = (None, self._fused_inputs(n), None)
        graph, (slots, g_sim, g_kv, use_sim, buf), outs = g.fused
        host = np.zeros(3 * n + 1, np.int64)  # the static inputs' storage: slots, sim, verified, switch
        host[:n] = -1
        host[:B] = draft_slots
        host[2 * n:3 * n] = g.pad.tokens - 1
        if sim is not None:
            host[n:n + B] = sim
            host[3 * n] = 1
        src = torch.from_numpy(host)
        buf.copy_(src.pin_memory() if buf.is_cuda else src, non_blocking=True)  # pinned: no wait on the stream
        if verified is not None:
            g_kv[:B].copy_(verified)
        if graph is not None:
            graph.replay()
        else:
            with torch.no_grad():
                outs = self._fused(g.hc, g.d, slots, g_sim, g_kv, use_sim)
        t, e, a, d, flat = self._unpack(outs[4].clone(), n)
        return t[:B], e[:B], a[:B], d[:B], flat

    # ------------------------------------------------------------------ chained draft steps
    def chain_ok(self, B: int) -> bool:
        return self.mtp_graphs and 0 < B <= self.buckets[-1]

    def _build_chain(self, bucket: int) -> _Chain:
        m, dev = self.model, self.device
        c = _Chain(torch.zeros(bucket, dtype=torch.int64, device=dev), torch.zeros(bucket, dtype=torch.int64, device=dev),
                   torch.full((bucket,), -1, dtype=torch.int64, device=dev),
                   torch.zeros(bucket, m.cfg.hc_mult, m.cfg.hidden_size, dtype=m.dtype, device=dev), None, None)
        if self.capture:
            t0 = time.perf_counter()
            c.graph = self._capture(lambda: self._chain_step(c))
            c.out = self._outs
            self.capture_s += time.perf_counter() - t0
        return c

    def _chain_step(self, c: _Chain):
        return self._chain_fn(c.ids, c.pos, c.slots, c.x)

    def _chain_fn(self, ids, pos, slots, x):
        cache = self.cache
        entries = tuple(cache.block_tables[r].shape[1] * cache.page_size for r, _ in cache.geometry.schedules)
        cctx = decode_context(ids, pos, slots, cache.geometry, cache.block_tables, entries)
        return self.model.mtp_forward_step(cctx, cache, x, ids, **self.draft_kw)

    def chain(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, x: torch.Tensor):
        """One chained draft step of B requests in the smallest bucket >= B -> (logits [B, V],
        streams [B, hc, d])."""
        B = ids.shape[0]
        bucket = next(b for b in self.buckets if b >= B)
        c = self.chains.get(bucket)
        if c is None:
            c = self.chains[bucket] = self._build_chain(bucket)
        c.ids[:B].copy_(ids)
        c.pos[:B].copy_(pos)
        c.slots[:B].copy_(slots)
        c.slots[B:].fill_(-1)
        c.x[:B].copy_(x)
        if c.graph is not None:
            c.graph.replay()
            out = c.out
        else:
            with torch.no_grad():
                out = self._chain_step(c)
        return out[0][:B], out[1][:B]
