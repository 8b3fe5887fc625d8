"""The model runner: one call per engine step.

ModelRunner.run(batch) -> StepResult owns the whole device side of a step: the step context
(built once: the target, the MTP layer's teacher-forced pass and the sampler all read it),
the target's forward (a replayed graph or eager), the prompt-logprob rows, the token
constraints' masks, one batched sampling / verification pass, and under speculation the
MTP layer's pass and its k - 1 chained draft steps. It returns device tensors (tokens
[B, k + 1] per chunk, how many each chunk emits, the next drafts) and starts their copies
to pinned host memory; StepResult.wait() reads them back. Nothing in a step waits for the
host, so the engine may read a step back after it has launched the next one (overlap).

Tensor parallelism (engine/distributed.py): `peers` broadcasts each step's host arrays in
prepare and, under speculation, the MTP layer's inputs that only rank 0 knows (the emitted
tokens, then each draft); the other ranks run follow_step with the same arrays, so every
rank runs the same forwards in the same order.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
import torch

from .cache import CacheManager
from .context import StepContext, build_context, decode_context, verify_context
from .engram_state import engram_history
from .sampler import DRAFT, Sampler, SamplingBatch, derive_seeds, to_device, top_logprobs
from .scheduler import ScheduledChunk
from .speculative import SpecDecoder


def apply_constraints(logits: torch.Tensor, reqs) -> torch.Tensor:
    """Mask the logits of tokens that the rows' constraints forbid (bitmask: bit v % 32 of
    word v // 32, 1 = allowed; xgrammar's layout). A constraint that raises sets its
    request's error (the engine ends that request) and leaves its row unmasked; rows of
    requests that ended already (overlap) stay unmasked."""
    R, V = logits.shape
    mask = torch.full((R, -(-V // 32)), -1, dtype=torch.int32)
    for row, r in enumerate(reqs):
        if r.constraint is not None and r.error is None and r.finish_reason is None:
            try:
                r.constraint.fill_next_token_bitmask(mask, row)
            except Exception as e:
                r.error = f"constraint failed: {type(e).__name__}: {e}"
                mask[row] = -1
    vocab = torch.arange(V, device=logits.device)
    words = to_device(mask, torch.int32, logits.device)[:, vocab // 32]
    allowed = ((words >> (vocab % 32).to(torch.int32)) & 1).bool()
    return logits.masked_fill(~allowed, float("-inf"))


def logits_rows(c: ScheduledChunk) -> tuple[int, int]:
    """(rows of chunk c that get logits: its last ones, of them the rows that are sampled or
    verified). The extra rows are prompt rows whose logprobs the request asked for."""
    req, a, n = c.req, c.start, c.count
    if req.drafts and a + 1 == req.num_tokens:
        return n, n
    sampled = 1 if a + n == req.num_tokens and req.params.max_tokens > 0 else 0
    if req.wants_prompt_rows and a < len(req.prompt_token_ids) - 1:
        return n, sampled
    return sampled, sampled


def host_arrays(chunks: list[ScheduledChunk]):
    """The step's host arrays (ids, starts, counts, slots, num_logits as int64 numpy) and
    the rows whose token is still on the device: [(flat row, source, index)], source None =
    the sampled tokens of the step in flight (req.pending), else a drafts tensor [B', k] of
    an earlier step (req.draft_src) read at the flat index; their ids are 0 here."""
    starts, counts, slots, nlog, ids = [], [], [], [], []
    patch = []
    for c in chunks:
        req, a, n = c.req, c.start, c.count
        starts.append(a)
        counts.append(n)
        slots.append(req.cache.slot)
        nlog.append(logits_rows(c)[0])
        if req.drafts and a + 1 == req.num_tokens:  # verify: the last token, then the drafts
            ids.append(req.token(a))
            if req.draft_src is not None:
                src, i = req.draft_src
                k = src.shape[1]
                patch += [(len(ids) + j, src, i * k + j) for j in range(len(req.drafts))]
                ids.extend([0] * len(req.drafts))
            else:
                ids.extend(req.drafts)
            continue
        if n == 1:
            ids.append(req.token(a))
        else:
            ids.extend(req.tokens(a, a + n))
        if req.pending is not None and a + n == req.num_tokens:
            patch.append((len(ids) - 1, None, req.pending[1]))
            ids[-1] = 0
    i64 = np.int64
    return (*(np.array(x, dtype=i64) for x in (ids, starts, counts, slots, nlog)), patch)


@dataclass
class StepBatch:
    """What the engine hands the runner for one step (built by ModelRunner.batch)."""

    chunks: list
    ids: np.ndarray               # [N] the step's tokens (0 where patch fills them in on the device)
    starts: np.ndarray            # [B]
    counts: np.ndarray            # [B]
    slots: np.ndarray             # [B] request slots
    num_logits: np.ndarray        # [B] logits rows (prompt-logprob rows included)
    patch: list                   # (flat row, source, index): see host_arrays
    verified: np.ndarray          # [B] drafts each chunk verifies
    draft_slots: np.ndarray       # [B] slot of the chunks that draft after this step, -1 for the others
    next_rows: np.ndarray         # last rows of chunks that sample nothing ...
    next_ids: np.ndarray          # ... and the token after each (the MTP layer's input; 0 if none)
    early: Optional["EarlyStep"] = None  # launched before the previous step's acceptance was read back


@dataclass
class EarlyStep:
    """The device side of a verify step launched before the previous step (prev) was read
    back: every chunk runs T = k + 1 tokens (its last token, then the k drafts prev made) at
    positions that depend on prev's acceptance, so its starts, input ids and verified
    draft counts are device tensors (ModelRunner.early_batch). The host arrays of its
    StepBatch (starts, counts, verified) are bound once prev is committed (Engine)."""

    prev: Optional["StepResult"]  # (dropped once the step is launched)
    starts: torch.Tensor          # [B] first position of each chunk
    verified: torch.Tensor        # [B] drafts each chunk verifies (<= k: max_tokens, max_model_len)
    ids: torch.Tensor             # [B * T] the step's input ids
    slots: torch.Tensor           # [B] request slots
    src: torch.Tensor             # [B] each chunk's row in prev


@dataclass
class StepResult:
    """One step's outcome on the device (B chunks, K = k + 1)."""

    batch: StepBatch
    ctx: StepContext
    tokens: torch.Tensor                        # [B, K] int64: chunk b emits tokens[b, :num_emitted[b]]
    num_emitted: torch.Tensor                   # [B] int64 (0: the chunk samples nothing)
    accepted: Optional[torch.Tensor] = None     # [B] drafts the target accepted (real, also when simulating)
    logprobs: Optional[torch.Tensor] = None     # [B, K] fp32 raw-model logprob of each emitted token
    top_ids: Optional[torch.Tensor] = None      # [B, K, n]
    top_logprobs: Optional[torch.Tensor] = None
    drafts: Optional[torch.Tensor] = None       # [B, k] the next drafts (rows of draft_slots >= 0)
    draft_logq: Optional[torch.Tensor] = None   # [B, k, V] fp32 their draft log-probs (sampled requests)
    host: Optional[list] = None                 # pinned host copies of the tensors above (tokens first)
    event: Optional[object] = None              # CUDA event after those copies
    fetched: Optional[dict] = None

    def wait(self) -> dict:
        """Read the step back -> {name: nested lists} (tokens, num_emitted, accepted, logprobs,
        top_ids, top_logprobs; drafts when they were copied)."""
        if self.fetched is None:
            if self.event is not None:
                self.event.synchronize()
            self.fetched = {name: t.tolist() for name, t in self.host}
        return self.fetched


class _Uploads:
    """Named int64 host arrays uploaded to the device in one copy (None: left out)."""

    def __init__(self, **arrays):
        self.arrays = {k: np.asarray(v).astype(np.int64, copy=False) for k, v in arrays.items() if v is not None}
        self.views: dict[str, torch.Tensor] = {}

    def to(self, device) -> "_Uploads":
        flat = np.concatenate([a.reshape(-1) for a in self.arrays.values()]) if self.arrays else np.zeros(0, np.int64)
        t, o = to_device(flat, torch.int64, device), 0
        for k, a in self.arrays.items():
            self.views[k] = t[o:o + a.size].view(a.shape)
            o += a.size
        return self

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.views[name]


@dataclass
class _Launched:
    batch: StepBatch
    ctx: StepContext
    logits: Optional[torch.Tensor]
    streams: Optional[torch.Tensor]
    fused: bool = False


class ModelRunner:
    def __init__(self, model, cache: CacheManager, graphs=None, *, spec: Optional[SpecDecoder] = None, peers=None,
                 draft_head=None):
        self.model, self.cache = model, cache
        self.draft_kw = {} if draft_head is None else {"head": draft_head}  # the MTP passes' lm head (drafts only)
        self.device = model.device
        self.sampler = Sampler()
        self.graphs = graphs  # GraphRunner: uniform steps (and their MTP passes) replay captured graphs
        self.spec = spec
        self.k = spec.k if spec is not None else 0
        self.peers = peers    # tensor parallel: rank 0's side of the step broadcast (engine/distributed.py)
        if peers is not None:
            peers.attach(cache)
        self.last_prepare_s = 0.0  # host time of the last step's context building
        self.captured: Optional[list] = None  # set to [] to keep (request ids, logits) of every step (tests)
        self.fused_steps = 0  # steps run as one fused greedy speculative graph (GraphRunner.fused)
        self.replay = None  # V4.1 decoder-side bounded replay (engine/replay.py; set by the engine)
        self.encoder_replay = None  # V4.1 encoder-side replay on windowless prefix hits (engine/replay.py)
        self.dspark = None  # DSpark drafting instead of the MTP chain (engine/dspark_runner.py; set by the engine)
        self.early_steps = 0  # verify steps launched before the previous step's acceptance was read back
        # early steps need the context from device starts: not with tensor parallel peers (the host
        # arrays are broadcast) nor for models whose step reads host starts (V4.1) or n-gram history
        self.early_capable = (self.k > 0 and peers is None and not hasattr(model.cfg, "kv_source_layers")
                              and getattr(model, "engram_hasher", None) is None)

    # ------------------------------------------------------------------ the step's inputs
    def batch(self, chunks: list[ScheduledChunk], draft_slots: Optional[np.ndarray] = None) -> StepBatch:
        ids, starts, counts, slots, nlog, patch = host_arrays(chunks)
        B = len(chunks)
        verified = np.array([len(c.req.drafts) if c.req.drafts and c.start + 1 == c.req.num_tokens else 0
                             for c in chunks], np.int64)
        next_rows, next_ids = [], []
        if self.k:
            end = np.cumsum(counts) - 1
            for i, c in enumerate(chunks):
                e, req = c.start + c.count, c.req
                if logits_rows(c)[1] == 0:
                    next_rows.append(end[i])
                    next_ids.append(req.token(e) if e < req.num_tokens else 0)
        ds = np.full(B, -1, np.int64) if draft_slots is None else np.asarray(draft_slots, np.int64)
        return StepBatch(chunks, ids, starts, counts, slots, nlog, patch, verified, ds,
                         np.array(next_rows, np.int64), np.array(next_ids, np.int64))

    def early_batch(self, chunks: list[ScheduledChunk], prev: StepResult, src: np.ndarray, out_len: np.ndarray,
                    num_tokens: np.ndarray, max_tokens: np.ndarray, max_model_len: int) -> StepBatch:
        """The batch of a verify step launched before prev (the step in flight) is read back:
        chunk i continues chunk src[i] of prev (which sampled and drafted); out_len,
        num_tokens: its request's generated / total tokens before prev's commit. On the
        device: a = prev's accepted drafts, the start = prev's start + count - verified + a
        (the bonus token's position), ids = [prev's bonus token, prev's k drafts], verified =
        min(k, max_tokens - generated - 1, max_model_len - tokens - 1) after prev's commit
        (what Engine._hand_drafts hands out: the plain loop's count)."""
        B, k = len(chunks), self.k
        pb, dev = prev.batch, self.device
        slots = np.array([c.req.cache.slot for c in chunks], np.int64)
        lim = np.minimum(max_tokens - out_len, max_model_len - num_tokens) - 2
        u = _Uploads(src=src, base=(pb.starts + pb.counts - pb.verified)[src], lim=lim, slots=slots).to(dev)
        s = u["src"]
        a = prev.num_emitted[s] - 1
        ids = torch.cat([prev.tokens[s, a][:, None], prev.drafts[s]], 1).reshape(-1)
        ver = torch.minimum(u["lim"] - a, torch.full_like(a, k)).clamp_(min=0)
        T = k + 1
        z = np.zeros(B, np.int64)
        return StepBatch(chunks, np.zeros(B * T, np.int64), z, np.full(B, T, np.int64), slots, np.full(B, T, np.int64),
                         [], z.copy(), slots.copy(), np.zeros(0, np.int64), np.zeros(0, np.int64),
                         EarlyStep(prev, u["base"] + a, ver, ids, u["slots"], s))

    def prepare(self, batch, prev: Optional[StepResult] = None) -> StepContext:
        """The step context (batch: a StepBatch or the scheduled chunks). prev: the step in
        flight, whose sampled tokens fill the rows of requests whose last token is still on
        the device."""
        if not isinstance(batch, StepBatch):
            batch = self.batch(batch)
        t0 = time.perf_counter()
        b = batch
        if self.peers is not None:
            self.peers.send_step(b)
        key = self.graphs.key(b.counts, b.num_logits) if self.graphs is not None else None
        if b.early is not None:  # the context from device starts
            e, T = b.early, self.k + 1
            if key is not None:
                ctx = self.graphs.prepare_early(key, e.ids, e.starts, e.slots)
            else:
                c = self.cache
                entries = tuple(c.block_tables[r].shape[1] * c.page_size for r, _ in c.geometry.schedules)
                ctx = verify_context(e.ids, e.starts, e.slots, T, c.geometry, c.block_tables, entries)
            self.early_steps += 1
        elif key is not None:
            ctx = self.graphs.prepare(key, b.ids, b.starts, b.counts, b.slots, b.num_logits)
        else:
            ctx = build_context(b.ids, b.starts, b.counts, b.slots, b.num_logits, self.cache.geometry,
                                self.cache.block_tables, self.device, self.cache.host_block_tables)
        hasher = getattr(self.model, "engram_hasher", None)
        if hasher is not None:  # V4.1 Engram: the n-gram history before each chunk
            hist = to_device(engram_history(b.chunks, hasher.token_map.numpy(), hasher.max_ngram), torch.int64,
                             self.device)
            if ctx.graph is not None:  # a captured step reads its static buffer (model.step_buffers)
                ctx.engram_history[:hist.shape[0]].copy_(hist)
            else:
                ctx.engram_history = hist
        if b.patch:
            groups: dict = {}
            for row, src, i in b.patch:
                g = groups.setdefault(id(src), (src, [], []))
                g[1].append(row)
                g[2].append(i)
            for src, rows, idx in groups.values():
                src = prev.tokens[:, 0] if src is None else src.reshape(-1)
                ri = to_device(rows + idx, torch.int64, self.device)  # one upload: rows, then indices
                ctx.input_ids[ri[:len(rows)]] = src[ri[len(rows):]]
        if self.replay is not None:  # V4.1 bounded replay: the late layers' rows and context (approximate)
            self.replay.attach(ctx, b.chunks)
        self.last_prepare_s = time.perf_counter() - t0
        return ctx

    # ------------------------------------------------------------------ one step
    def run(self, batch: StepBatch, prev: Optional[StepResult] = None) -> StepResult:
        """The whole step -> its StepResult (device tensors, copies to the host under way)."""
        res = self.finish(self.launch(batch, prev))
        if batch.early is not None:
            batch.early.prev = None  # read: keeping it would chain every early step to the one before
        return res

    @torch.no_grad()
    def launch(self, batch: StepBatch, prev: Optional[StepResult] = None) -> _Launched:
        """The first half of run: context and the target's forward (no host input after it
        but the constraints' masks, which finish applies)."""
        if self.encoder_replay is not None:  # windowless prefix hits: rebuild their windows first
            self.encoder_replay.run(self, batch)
        ctx = self.prepare(batch, prev)
        if self._fusable(batch, ctx):  # one replay does the whole step (finish)
            return _Launched(batch, ctx, None, None, fused=True)
        cap = self.dspark is not None and ctx.graph is None  # (graph steps: the graph computes DSpark's rows)
        with self.dspark.capture() if cap else contextlib.nullcontext():
            out = self.forward(batch.chunks, ctx, return_streams=self.k > 0)
        logits, streams = out if self.k else (out, None)
        return _Launched(batch, ctx, logits, streams)

    def _fusable(self, b: StepBatch, ctx: StepContext) -> bool:
        """A uniform graph step of greedy requests that want no logprobs and no constraints:
        GraphRunner.fused runs it whole."""
        if not self.k or self.peers is not None:
            return False
        if self.graphs is None or not self.graphs.fused_ok(ctx):
            return False
        return all(c.req.params.greedy and c.req.params.logprobs is None and c.req.constraint is None
                   and not c.req.wants_prompt_rows for c in b.chunks)

    @torch.no_grad()
    def forward(self, chunks: list[ScheduledChunk], ctx: StepContext, *, return_streams: bool = False):
        """The model's flat forward -> logits [R, V] of the sampled rows (prompt-logprob rows
        are consumed here), and the final streams [N, hc, d] if asked."""
        if ctx.graph is not None:
            out = self.graphs.run(ctx)
            if not return_streams and self.graphs.return_streams:
                out = out[0]
        else:
            out = self.model.forward_step(ctx, self.cache, return_streams=return_streams)
        logits = out[0] if return_streams else out
        if any(r.wants_prompt_rows for r in (c.req for c in chunks)):
            logits = self._prompt_logprobs(chunks, ctx, logits)
        if logits.shape[0] and self.captured is not None:
            self.captured.append(([chunks[i].req.request_id for i in ctx.logits_req], logits.cpu()))
        return (logits, out[1]) if return_streams else logits

    def sampling_batch(self, reqs, positions, *, logprobs: bool = True) -> SamplingBatch:
        ps = [r.params for r in reqs]
        return SamplingBatch.from_lists(
            [p.temperature for p in ps], [p.top_k for p in ps], [p.top_p for p in ps], [p.min_p for p in ps],
            [r.seed for r in reqs], positions, num_logprobs=max((p.logprobs or 0 for p in ps), default=0) if logprobs else 0,
            want_logprobs=logprobs and any(p.logprobs is not None for p in ps), device=self.device)

    @torch.no_grad()
    def finish(self, L: _Launched) -> StepResult:
        """The second half of run: masks, one sampling / verification pass, the drafts."""
        b, ctx, logits = L.batch, L.ctx, L.logits
        chunks, dev = b.chunks, self.device
        B, K = len(chunks), self.k + 1
        E = b.early
        if L.fused:
            self.fused_steps += 1
            sim = self.spec.simulated_lengths(b.verified if E is None else np.full(B, self.k, np.int64))
            tokens, emitted, accepted, drafts, flat = self.graphs.fused(ctx, b.draft_slots, sim,
                                                                        None if E is None else E.verified)
            res = StepResult(b, ctx, tokens, emitted, accepted, drafts=drafts)
            self._copy_out(res, [("flat", flat)])  # one copy; the host views follow the device ones
            h = res.host.pop()[1]
            res.host += [(n, h[t.storage_offset():t.storage_offset() + t.numel()].view(t.shape))
                         for n, t in (("tokens", tokens), ("num_emitted", emitted), ("accepted", accepted))]
            if self.spec.force_drafts is not None:
                self._copy_out(res, [("drafts", drafts)])
            return res
        nl = np.asarray(ctx.num_logits, np.int64)
        first = np.zeros(B, np.int64)
        np.cumsum(nl[:-1], out=first[1:])
        jj = np.arange(K)
        R = logits.shape[0]
        j_row = np.arange(R) - first[ctx.logits_req]
        ver = j_row < b.verified[ctx.logits_req]
        sim = self.spec.simulated_lengths(b.verified if E is None else np.full(B, self.k, np.int64)) if self.k else None
        live = nl > 0
        # every small index array of the step in one upload
        u = _Uploads(rows_of=np.where(jj[None, :] < nl[:, None], first[:, None] + jj[None, :], 0),
                     emit=live, ver=ver, kv=b.verified, sim=sim, next_rows=b.next_rows, next_ids=b.next_ids,
                     rowbk=ctx.logits_req * K + j_row, a_first=np.where(live, first, 0), nl1=np.maximum(nl - 1, 0),
                     live=live, base=b.starts + b.counts - np.maximum(nl, 1), draft_slots=b.draft_slots,
                     first_row=np.minimum(first, max(R - 1, 0)),
                     **({} if E is None else dict(lreq=ctx.logits_req, jrow=j_row))).to(dev)
        if E is not None:  # verified counts and starts on the device
            u.views["kv"], u.views["base"] = E.verified, E.starts
            u.views["ver"] = u["jrow"] < E.verified[u["lreq"]]
            if sim is not None:
                u.views["sim"] = torch.minimum(u["sim"], E.verified)
        res = StepResult(b, ctx, torch.zeros(B, K, dtype=torch.int64, device=dev),
                         torch.zeros(B, dtype=torch.int64, device=dev))
        a = torch.zeros(B, dtype=torch.int64, device=dev)
        sb = None
        if R:
            reqs = [chunks[i].req for i in ctx.logits_req]
            if any(r.constraint is not None for r in reqs):
                logits = apply_constraints(logits, reqs)
            pos = (b.starts + b.counts - nl)[ctx.logits_req] + j_row + 1
            sb = self.sampling_batch(reqs, pos.tolist(), logprobs=False)
            if E is not None:
                sb = replace(sb, position=E.starts[u["lreq"]] + u["jrow"] + 1)
            rq = u["rows_of"]
            if self.k:
                d = ctx.input_ids[(ctx.logits_indices[:R] + 1).clamp(max=ctx.num_tokens - 1)]
                if E is not None:
                    logq = self._early_logq(E, chunks, R, d)
                else:
                    logq = SpecDecoder.draft_logq(chunks, nl, b.verified, R, d) if ver.any() else None
                target, acc, final = self.sampler.verify(logits, sb, d, u["ver"].bool(), logq)
                acc_m = acc[rq] & (torch.arange(K, device=dev)[None, :] < u["kv"][:, None])
                res.accepted = acc_m.long().cumprod(1).sum(1)
                a = res.accepted if sim is None else u["sim"]
                fin = (final if sim is None else target)[rq]
                res.tokens = torch.where(torch.arange(K, device=dev)[None, :] < a[:, None], d[rq], fin)
                res.num_emitted = (a + 1) * u["emit"]
            else:
                res.tokens = self.sampler(logits, sb).tokens[rq]
                res.num_emitted = u["emit"]
            want = [r.params.logprobs for r in reqs if r.params.logprobs is not None]
            if want:
                lp = torch.log_softmax(logits.float(), dim=-1)
                res.logprobs = lp[rq.reshape(-1), res.tokens.reshape(-1)].view(B, K)
                if max(want):
                    v, i = top_logprobs(lp, max(want))
                    res.top_logprobs, res.top_ids = v[rq], i[rq]
        host = [("tokens", res.tokens), ("num_emitted", res.num_emitted)]
        host += [(n, getattr(res, n)) for n in ("accepted", "logprobs", "top_ids", "top_logprobs")
                 if getattr(res, n) is not None]
        self._copy_out(res, host)
        if self.k:
            try:
                if self.dspark is not None:
                    self.dspark.draft(self, L, res, a, u, sb)
                else:
                    self._draft(L, res, a, u, sb)
            except Exception as e:
                raise RuntimeError(f"drafting failed: {type(e).__name__}: {e}") from e
            if res.drafts is not None and (self.spec.force_drafts is not None or self.peers is not None):
                self._copy_out(res, [("drafts", res.drafts)])
        return res

    def _early_logq(self, E: EarlyStep, chunks, R: int, d: torch.Tensor) -> Optional[torch.Tensor]:
        """SpecDecoder.draft_logq for an early step: the sampled requests' rows from the
        previous step's draft log-probs on the device (greedy drafts: one-hot)."""
        lq, k = E.prev.draft_logq, self.k
        sampled = [i for i, c in enumerate(chunks) if not c.req.params.greedy]
        if lq is None or not sampled:
            return None
        V = lq.shape[-1]
        logq = torch.full((R, V), float("-inf"), dtype=torch.float64, device=d.device)
        logq.scatter_(1, d[:, None], 0.0)
        T = k + 1
        rows = np.array([i * T + j for i in sampled for j in range(k)], np.int64)
        idx = to_device(np.concatenate([rows, np.array(sampled, np.int64)]), torch.int64, d.device)
        logq[idx[:len(rows)]] = lq[E.src[idx[len(rows):]]].reshape(-1, V).double()
        return logq

    def _copy_out(self, res: StepResult, tensors: list) -> None:
        """Start the host copies of tensors (added to res.host; res.event follows them all)."""
        if self.device.type == "cuda":
            tensors = [(n, torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True))
                       for n, t in tensors]
            res.event = torch.cuda.Event()
            res.event.record()
        res.host = (res.host or []) + list(tensors)

    # ------------------------------------------------------------------ drafting
    def _draft(self, L: _Launched, res: StepResult, a: torch.Tensor, u: "_Uploads",
               sb: Optional[SamplingBatch]) -> None:
        """The MTP layer over the step's rows (teacher-forced on the emitted tokens), then its
        chain: res.drafts [B, k] for the chunks with a draft slot. Draft sampling uses the
        target's parameters (sb) of each chunk's first row, on the DRAFT seed stream."""
        b, ctx = L.batch, L.ctx
        N = ctx.num_tokens
        ids = ctx.input_ids[:N]
        nxt = torch.cat([ids[1:], ids.new_zeros(1)])
        if len(b.next_rows):
            nxt[u["next_rows"]] = u["next_ids"]
        R = len(ctx.logits_req)
        if R:
            li = ctx.logits_indices[:R]
            nxt[li] = res.tokens.reshape(-1)[u["rowbk"]]
            row_a = torch.where(u["live"].bool(), li[(u["a_first"] + torch.minimum(a, u["nl1"])).clamp(max=R - 1)], 0)
        else:
            row_a = torch.zeros_like(a)
        base = u["base"] + a  # position of each chunk's drafting row
        if self.peers is not None:
            self.peers.share(torch.cat([nxt, row_a, base]))
        logits, y = self._mtp(ctx, L.streams, nxt, row_a)
        if not (b.draft_slots >= 0).any():
            return
        idx = u["first_row"]
        dsb = replace(sb, temperature=sb.temperature[idx], top_k=sb.top_k[idx], top_p=sb.top_p[idx],
                      min_p=sb.min_p[idx], seed=derive_seeds(sb.seed[idx], DRAFT), position=base)
        drafts, logqs = [], []
        x = y
        for j in range(self.k):
            d, lq = self._draft_tokens(logits, dsb, base + 2 + j)
            drafts.append(d)
            logqs.append(lq)
            if j == self.k - 1:
                break
            if self.peers is not None:
                self.peers.share(d)
            logits, x = self._chain(d, base + 1 + j, u["draft_slots"], x)
        res.drafts = torch.stack(drafts, 1)
        if logqs[0] is not None:
            res.draft_logq = torch.stack(logqs, 1)

    def _draft_tokens(self, logits: torch.Tensor, dsb: SamplingBatch, pos: torch.Tensor):
        if dsb.all_greedy:
            return logits.argmax(-1), None
        bt = replace(dsb, position=pos)
        lq = self.sampler.log_probs(logits, bt)
        return self.sampler.sample_log_probs(lq, bt.seed, bt.position), lq.float()

    def _mtp(self, ctx: StepContext, streams: torch.Tensor, nxt: torch.Tensor, rows: torch.Tensor):
        """The MTP layer's teacher-forced pass on the step's context -> (logits [B, V] at
        `rows`, its output streams [B, hc, d] there; its FFN half runs at those rows only)."""
        if ctx.graph is not None:
            return self.graphs.mtp(ctx, nxt, rows)
        return self.model.mtp_forward_step(replace(ctx, logits_indices=rows), self.cache, streams, nxt, rows_only=True,
                                           **self.draft_kw)

    def _chain(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, streams: torch.Tensor):
        """One chained draft step (a token per request at device positions) -> (logits [B, V],
        output streams [B, hc, d])."""
        if self.graphs is not None and self.graphs.chain_ok(len(ids)):
            return self.graphs.chain(ids, pos, slots, streams)
        c = self.cache
        entries = tuple(c.block_tables[r].shape[1] * c.page_size for r, _ in c.geometry.schedules)
        cctx = decode_context(ids, pos, slots, c.geometry, c.block_tables, entries)
        return self.model.mtp_forward_step(cctx, c, streams, ids, **self.draft_kw)

    # ------------------------------------------------------------------ tensor parallel followers
    @torch.no_grad()
    def follow_step(self, arrays: list[np.ndarray]) -> None:
        """A rank > 0: the forwards of rank 0's step (arrays: ids, starts, counts, slots,
        num_logits, draft_slots; the block-table entries are written already)."""
        ids, starts, counts, slots, nlog, dslots = arrays[:6]
        c, dev = self.cache, self.device
        ctx = build_context(ids, starts, counts, slots, nlog, c.geometry, c.block_tables, dev, c.host_block_tables)
        out = self.model.forward_step(ctx, c, return_streams=self.k > 0)
        if not self.k:
            return
        N, B = len(ids), len(starts)
        pack = self.peers.share(torch.empty(N + 2 * B, dtype=torch.int64, device=dev))
        nxt, row_a, base = pack[:N], pack[N:N + B], pack[N + B:]
        _, y = self.model.mtp_forward_step(replace(ctx, logits_indices=row_a), c, out[1], nxt, rows_only=True)
        if not (dslots >= 0).any():
            return
        s = to_device(dslots, torch.int64, dev)
        x = y
        for j in range(self.k - 1):
            d = self.peers.share(torch.empty(B, dtype=torch.int64, device=dev))
            _, x = self._chain(d, base + 1 + j, s, x)

    # ------------------------------------------------------------------ prompt logprobs
    def _prompt_logprobs(self, chunks: list[ScheduledChunk], ctx: StepContext, logits: torch.Tensor) -> torch.Tensor:
        """Store the prompt logprobs of the prompt rows (row of position p: token p + 1) in
        their requests, then drop those rows: -> the sampled rows' logits, with ctx's logits
        rows (logits_req, num_logits, logits_indices) set to those rows only."""
        first = 0
        keep, src, tgt, owners = [], [], [], []
        std = np.zeros(len(chunks), np.int64)
        for i, c in enumerate(chunks):
            total, std[i] = logits_rows(c)
            req = c.req
            if total > std[i]:
                P = len(req.prompt_token_ids)
                m = min(c.start + c.count, P - 1) - c.start  # rows whose next token is a prompt token
                src.extend(range(first, first + m))
                tgt.extend(req.prompt_token_ids[c.start + 1:c.start + 1 + m])
                owners.append((req, c.start + 1, m))
                if c.start + c.count >= P - 1:
                    req.prompt_done = True
            keep.extend(range(first + total - int(std[i]), first + total))
            first += total
        if src:
            rows = to_device(src, torch.int64, logits.device)
            lp = torch.log_softmax(logits[rows].float(), dim=-1)
            vals = lp.gather(1, to_device(tgt, torch.int64, logits.device)[:, None])[:, 0].tolist()
            n = max(req.params.prompt_logprobs for req, _, _ in owners)
            if n:
                tv, ti = (x.tolist() for x in torch.topk(lp, min(n, lp.shape[1]), dim=-1))
            o = 0
            for req, p0, m in owners:
                req.prompt_lps[p0:p0 + m] = vals[o:o + m]
                k = req.params.prompt_logprobs
                if k:
                    req.prompt_tops[p0:p0 + m] = [dict(zip(ti[o + j][:k], tv[o + j][:k])) for j in range(m)]
                o += m
        idx = to_device(keep, torch.int64, logits.device)
        ctx.logits_indices = ctx.logits_indices[idx]
        ctx.num_logits = std
        ctx.logits_req = np.repeat(np.arange(len(chunks), dtype=np.int64), std)
        return logits[idx]
