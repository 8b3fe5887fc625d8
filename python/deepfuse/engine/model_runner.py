"""Runs one scheduled step: the step context, the model's flat forward, the sampler."""
from __future__ import annotations

import time
from itertools import chain
from typing import Optional

import numpy as np
import torch

from .cache import CacheManager
from .context import StepContext, build_context
from .sampler import Sampler, SamplerOutput, SamplingBatch, to_device
from .scheduler import ScheduledChunk


def apply_constraints(logits: torch.Tensor, reqs) -> torch.Tensor:
    """Mask the logits of tokens that the rows' constraints forbid (bitmask: bit v % 32 of
    word v // 32, 1 = allowed; xgrammar's layout). A constraint that raises sets its
    request's error (the engine ends that request) and leaves its row unmasked."""
    R, V = logits.shape
    mask = torch.full((R, -(-V // 32)), -1, dtype=torch.int32)
    for row, r in enumerate(reqs):
        if r.constraint is not None and r.error is None:
            try:
                r.constraint.fill_next_token_bitmask(mask, row)
            except Exception as e:
                r.error = f"constraint failed: {type(e).__name__}: {e}"
                mask[row] = -1
    vocab = torch.arange(V, device=logits.device)
    words = mask.to(logits.device)[:, vocab // 32]
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
    """The step's host arrays (ids, starts, counts, slots, num_logits as int64 numpy) and the
    rows whose token is still on the device (patch_rows, and its row in the in-flight step's
    tokens, patch_src; their ids are 0 here)."""
    starts, counts, slots, nlog, ids = [], [], [], [], []
    patch_rows, patch_src = [], []
    for c in chunks:
        req, a, n = c.req, c.start, c.count
        starts.append(a)
        counts.append(n)
        slots.append(req.cache.slot)
        nlog.append(logits_rows(c)[0])
        if req.drafts and a + 1 == req.num_tokens:  # verify: the last token, then the drafts
            ids.append(req.token(a))
            ids.extend(req.drafts)
            continue
        if n == 1:
            ids.append(req.token(a))
        else:
            ids.extend(req.tokens(a, a + n))
        if req.pending is not None and a + n == req.num_tokens:
            patch_rows.append(len(ids) - 1)
            patch_src.append(req.pending[1])
            ids[-1] = 0
    i64 = np.int64
    return (*(np.array(x, dtype=i64) for x in (ids, starts, counts, slots, nlog)), patch_rows, patch_src)


class ModelRunner:
    def __init__(self, model, cache: CacheManager, graphs=None):
        self.model, self.cache = model, cache
        self.device = model.device
        self.sampler = Sampler()
        self.graphs = graphs  # GraphRunner: decode / verify steps replay captured graphs
        self.last_prepare_s = 0.0  # host time of the last step's context building
        self.captured: Optional[list] = None  # set to [] to keep (request ids, logits) of every step (tests)

    def prepare(self, chunks: list[ScheduledChunk], pending_tokens: Optional[torch.Tensor] = None) -> StepContext:
        """The step context of chunks. pending_tokens: the in-flight step's sampled tokens on
        the device; a request's last token that is still there (req.pending) is taken from it."""
        t0 = time.perf_counter()
        ids, starts, counts, slots, nlog, patch_rows, patch_src = host_arrays(chunks)
        key = self.graphs.key(counts, nlog) if self.graphs is not None else None
        if key is not None:
            ctx = self.graphs.prepare(key, ids, starts, counts, slots, nlog)
        else:
            ctx = build_context(ids, starts, counts, slots, nlog, self.cache.geometry, self.cache.block_tables,
                                self.device, self.cache.host_block_tables)
        if patch_rows:
            rows = to_device(patch_rows, torch.int64, self.device)
            ctx.input_ids[rows] = pending_tokens[to_device(patch_src, torch.int64, self.device)]
        self.last_prepare_s = time.perf_counter() - t0
        return ctx

    def sampling_batch(self, chunks: list[ScheduledChunk], ctx: StepContext) -> SamplingBatch:
        reqs = [chunks[i].req for i in ctx.logits_req]
        ps = [r.params for r in reqs]
        nlp = max((p.logprobs or 0 for p in ps), default=0)
        return SamplingBatch.from_lists(
            [p.temperature for p in ps], [p.top_k for p in ps], [p.top_p for p in ps], [p.min_p for p in ps],
            [r.seed for r in reqs], [r.num_tokens for r in reqs], num_logprobs=nlp,
            want_logprobs=any(p.logprobs is not None for p in ps), device=self.device)

    @torch.no_grad()
    def forward(self, chunks: list[ScheduledChunk], ctx: StepContext, *, return_streams: bool = False):
        """The model's flat forward -> logits [R, V] (constraint masks applied), and the final
        streams [N, hc, d] if asked."""
        if ctx.graph is not None:
            out = self.graphs.run(ctx)
            if not return_streams and self.graphs.return_streams:
                out = out[0]
        else:
            out = self.model.forward_step(ctx, self.cache, return_streams=return_streams)
        logits = out[0] if return_streams else out
        if any(r.wants_prompt_rows for r in (c.req for c in chunks)):
            logits = self._prompt_logprobs(chunks, ctx, logits)
        if logits.shape[0]:
            reqs = [chunks[i].req for i in ctx.logits_req]
            if any(r.constraint is not None for r in reqs):
                logits = apply_constraints(logits, reqs)
            if self.captured is not None:
                self.captured.append(([r.request_id for r in reqs], logits.cpu()))
        return (logits, out[1]) if return_streams else logits

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
