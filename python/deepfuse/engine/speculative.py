"""Speculative decoding with V4's MTP layer: chain drafting, verification, exact acceptance.

Per decoding request and step, the target verifies its last token plus k_r <= k drafts in
one forward (rows j = 0..k_r at positions n-1+j, row j predicting position n+j). Acceptance
(Leviathan et al.): draft d_j+1 ~ q_j is kept with probability min(1, p_j(d) / q_j(d));
at the first rejection the token is drawn from normalise(max(p_j - q_j, 0)); if all are
kept, a bonus token is drawn from p_k. p and q are the distributions the sampler would draw
from (temperature, top-k, top-p, min-p applied to target and draft alike; greedy rows are
one-hot at the argmax, so greedy acceptance is "the longest prefix equal to the target's
argmax, plus the target's token"). Noise: the sampler's counter-based streams, keyed by the
request's seed and the token's position (drafts, acceptance uniforms and residual draws on
derived seeds), so outputs do not depend on batch neighbours.

Drafting: after the target step the MTP layer runs teacher-forced over the positions the
target accepted (main streams X_t and token t + 1), which keeps its caches in step with the
target's; its last row gives d_1; then it is chained on its own output streams for d_2..d_k
(SGLang's V4 MTP chain, top-k 1). Rejected positions leave no live trace: the window ring
has W + k - 1 rows and the compressor-state rings R + k - 1 (a rejected row can only
overwrite a row no later step reads), compressed rows of rejected positions are rewritten
before any query sees them, and the MTP layer recomputes from the first unaccepted position.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from .context import build_context
from .request import Request
from .sampler import SamplingBatch, derive_seed, uniform

DRAFT, ACCEPT, RESIDUAL = 1, 2, 3  # noise streams (0 is the sampler's own)


@dataclass
class Emission:
    """What one scheduled chunk produced: tokens to append and how many chunk rows stay."""

    tokens: list[int]
    computed: int
    logprobs: Optional[list[float]] = None
    top_logprobs: Optional[list[dict]] = None


@dataclass
class SpecStats:
    k: int
    verify_rows: int = 0                             # requests verified (one per request and step)
    proposed: list = field(default_factory=list)     # drafts proposed at position j
    accepted: list = field(default_factory=list)     # ... and accepted
    emitted: int = 0                                 # tokens emitted by verify steps

    def __post_init__(self):
        self.proposed = [0] * self.k
        self.accepted = [0] * self.k

    def as_dict(self) -> dict:
        acc = [a / p if p else None for a, p in zip(self.accepted, self.proposed)]
        return {"num_speculative_tokens": self.k, "verify_steps": self.verify_rows,
                "acceptance_per_position": acc,
                "mean_accepted_length": self.emitted / self.verify_rows if self.verify_rows else None}


def accept_drafts(sampler, logp: torch.Tensor, logq: torch.Tensor, drafts: torch.Tensor, seeds: list[int],
                  position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The acceptance test per verify row: logp / logq [R, V] (fp64 target / draft
    log-probs), drafts [R] (the draft each row verifies), seeds (the rows' request seeds),
    position [R] (the draft's position) -> (accepted [R] bool: u < min(1, p(d) / q(d)),
    replacement [R]: a draw from normalise(max(p - q, 0)))."""
    dev = logp.device
    p_d = logp.gather(1, drafts[:, None])[:, 0]
    q_d = logq.gather(1, drafts[:, None])[:, 0]
    ratio = torch.exp(torch.clamp(p_d - q_d, max=0.0))
    useeds = torch.tensor([derive_seed(s, ACCEPT) for s in seeds], dtype=torch.int64, device=dev)
    acc = uniform(useeds, position) < ratio
    resid = torch.log(torch.clamp(logp.exp() - logq.exp(), min=0.0))
    rseeds = torch.tensor([derive_seed(s, RESIDUAL) for s in seeds], dtype=torch.int64, device=dev)
    return acc, sampler.sample_log_probs(resid, rseeds, position)


def _batch(reqs: list[Request], positions: list[int], seeds: list[int], device) -> SamplingBatch:
    ps = [r.params for r in reqs]
    return SamplingBatch.from_lists([p.temperature for p in ps], [p.top_k for p in ps], [p.top_p for p in ps],
                                    [p.min_p for p in ps], seeds, positions, device=device)


class SpecDecoder:
    def __init__(self, model, cache, runner, k: int, *, simulate_acc_len: Optional[float] = None):
        if not len(model.mtp):
            raise ValueError("deepfuse: num_speculative_tokens > 0 needs a model with an MTP layer")
        self.model, self.cache, self.runner, self.k = model, cache, runner, k
        self.sampler = runner.sampler
        self.device = model.device
        self.stats = SpecStats(k)
        self.simulate_acc_len = simulate_acc_len
        self._sim = random.Random(0)
        # test hook: (request, proposed drafts) -> drafts to verify instead (greedy requests)
        self.force_drafts: Optional[Callable[[Request, list[int]], list[int]]] = None

    # ------------------------------------------------------------------ verification
    def verify(self, chunks, ctx, logits: torch.Tensor) -> list[Optional[Emission]]:
        """-> per chunk: its Emission (None for prefill chunks that sample nothing)."""
        R = logits.shape[0]
        out: list[Optional[Emission]] = [None] * len(chunks)
        if R == 0:
            for i, c in enumerate(chunks):
                out[i] = Emission([], c.count)
            return out
        rows_req = ctx.logits_req
        reqs = [chunks[i].req for i in rows_req]
        # row -> (chunk, j): j = index of the row within its chunk's logits rows
        first = np.zeros(len(chunks), np.int64)
        np.cumsum(ctx.num_logits[:-1], out=first[1:])
        j_of = np.arange(R) - first[rows_req]
        pos = [chunks[i].start + chunks[i].count - int(ctx.num_logits[i]) + int(j) + 1 for i, j in zip(rows_req, j_of)]
        seeds = [r.seed for r in reqs]
        batch = _batch(reqs, pos, seeds, self.device)
        drafts = np.full(R, -1, np.int64)                                      # d verified by each row
        for i, c in enumerate(chunks):
            if c.req.drafts and ctx.num_logits[i] == c.count and c.count > 1:
                drafts[first[i]:first[i] + c.count - 1] = c.req.drafts[:c.count - 1]
        ver = drafts >= 0
        acc = res = None
        if batch.all_greedy:  # one-hot p and q: keep d iff it is the argmax, else take the argmax
            target = logits.argmax(-1)
            if ver.any():
                d_t = torch.from_numpy(drafts).to(self.device)
                acc, res = d_t == target, target
        else:
            logp = self.sampler.log_probs(logits, batch)                       # [R, V] target p
            target = self.sampler.sample_log_probs(logp, batch.seed, batch.position)
            if ver.any():
                d_t = torch.from_numpy(np.where(ver, drafts, 0)).to(self.device)
                logq = torch.full_like(logp, float("-inf")).scatter_(1, d_t[:, None], 0.0)  # greedy: one-hot
                for i, c in enumerate(chunks):
                    lq = c.req.draft_logq
                    if lq is not None and ctx.num_logits[i] == c.count and c.count > 1:
                        logq[first[i]:first[i] + c.count - 1] = lq[:c.count - 1].double()
                acc, res = accept_drafts(self.sampler, logp, logq, d_t, seeds, batch.position)
        target = target.tolist()
        acc = acc.tolist() if acc is not None else None
        res = res.tolist() if res is not None else None
        want_lp = any(r.params.logprobs is not None for r in reqs)
        for i, c in enumerate(chunks):
            nl = int(ctx.num_logits[i])
            if nl == 0:
                out[i] = Emission([], c.count)
                continue
            f = int(first[i])
            if nl == 1:
                out[i] = Emission([target[f]], c.count)
                continue
            kr = nl - 1
            if self.simulate_acc_len is not None:
                x = self.simulate_acc_len - 1
                a = min(kr, int(x) + (self._sim.random() < x - int(x)))
            else:
                a = 0
                while a < kr and acc[f + a]:
                    a += 1
            toks = c.req.drafts[:a] + [res[f + a] if a < kr and self.simulate_acc_len is None else target[f + a]]
            st = self.stats
            st.verify_rows += 1
            st.emitted += len(toks)
            for j in range(kr):
                st.proposed[j] += 1
                st.accepted[j] += j < a
            out[i] = Emission(toks, a + 1)
        if want_lp:
            self._logprobs(chunks, out, first, logits)
        return out

    def _logprobs(self, chunks, out, first, logits: torch.Tensor) -> None:
        """Raw-model logprobs of the emitted tokens (row f + t emits token t of a chunk)."""
        lp = torch.log_softmax(logits.float(), dim=-1)
        n = max((c.req.params.logprobs or 0) for c in chunks)
        top_v, top_i = (torch.topk(lp, n, dim=-1) if n else (None, None))
        rows, toks = [], []
        for i, e in enumerate(out):
            if e is None or not e.tokens or chunks[i].req.params.logprobs is None:
                continue
            for t, tok in enumerate(e.tokens):
                rows.append(int(first[i]) + t)
                toks.append(tok)
        if not rows:
            return
        r_t = torch.tensor(rows, device=lp.device)
        vals = lp[r_t, torch.tensor(toks, device=lp.device)].tolist()
        tv = top_v[r_t].tolist() if n else None
        ti = top_i[r_t].tolist() if n else None
        k = 0
        for i, e in enumerate(out):
            if e is None or not e.tokens or chunks[i].req.params.logprobs is None:
                continue
            m = len(e.tokens)
            nl = chunks[i].req.params.logprobs
            e.logprobs = vals[k:k + m]
            if nl:
                e.top_logprobs = [dict(zip(ti[k + t][:nl], tv[k + t][:nl])) for t in range(m)]
            k += m

    # ------------------------------------------------------------------ drafting
    def _ctx(self, ids, starts, counts, slots, nlog):
        c = self.cache
        a = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
        return build_context(a(ids), a(starts), a(counts), a(slots), a(nlog), c.geometry, c.block_tables,
                             self.device, c.host_block_tables)

    @torch.no_grad()
    def propose(self, chunks, emissions: list[Optional[Emission]], streams: torch.Tensor, ctx,
                budget_ok: Callable[[Request, int], int]) -> None:
        """Run the MTP layer over every surviving request's accepted rows of this step and
        draft up to k tokens for the requests now decoding. budget_ok(req, k_r) -> the number
        of drafts the cache can hold for req (it reserves them)."""
        cu = np.zeros(len(chunks) + 1, np.int64)
        np.cumsum(ctx.counts, out=cu[1:])
        items, ids, starts, counts, slots, nlog, rows, kr = [], [], [], [], [], [], [], []
        for i, (c, e) in enumerate(zip(chunks, emissions)):
            req = c.req
            req.drafts, req.draft_logq = [], None
            if req.cache is None or e is None or e.computed == 0:  # aborted in this step
                continue
            # rows whose next token is known: fewer than computed when the request ends in this step
            # with a stop token before its last accepted draft, or with its prefill (max_tokens 0)
            n = min(e.computed, req.num_tokens - 1 - c.start)
            if n < e.computed:
                req.num_computed = c.start + n  # its prefix snapshot: as far as the MTP layer got
            if n <= 0:
                continue
            items.append(req)
            ids.extend(req.tokens(c.start + 1, c.start + n + 1))
            starts.append(c.start)
            counts.append(n)
            slots.append(req.cache.slot)
            rows.extend(range(int(cu[i]), int(cu[i]) + n))
            want = 0
            if req.num_computed == req.num_tokens - 1 and req.constraint is None and req.finish_reason is None:
                left = req.params.max_tokens - len(req.output_token_ids)
                want = budget_ok(req, min(self.k, left - 1))
            kr.append(want)
            nlog.append(1 if want else 0)
        if not items:
            return
        mctx = self._ctx(ids, starts, counts, slots, nlog)
        x = streams[torch.tensor(rows, device=self.device)]
        logits, y = self.model.mtp_forward_step(mctx, self.cache, x, mctx.input_ids)
        live = [j for j, w in enumerate(kr) if w]
        if not live:
            return
        reqs = [items[j] for j in live]
        last = y[mctx.logits_indices]                     # [R, hc, d] chain input streams
        pos = [r.num_tokens for r in reqs]                # position of d_1
        drafts: list[list[int]] = [[] for _ in reqs]
        logqs: list[list[torch.Tensor]] = [[] for _ in reqs]
        act = list(range(len(reqs)))                      # rows still drafting
        for j in range(self.k):
            sub = [reqs[a] for a in act]
            b = _batch(sub, [pos[a] + j for a in act], [derive_seed(r.seed, DRAFT) for r in sub], self.device)
            if b.all_greedy:
                lq, d = None, logits.argmax(-1).tolist()
            else:
                lq = self.sampler.log_probs(logits, b)
                d = self.sampler.sample_log_probs(lq, b.seed, b.position).tolist()
            for t, a in enumerate(act):
                drafts[a].append(d[t])
                if lq is not None and reqs[a].params.temperature > 0:
                    logqs[a].append(lq[t].float())
            nxt = [t for t, a in enumerate(act) if len(drafts[a]) < kr[live[a]]]
            if not nxt or j == self.k - 1:
                break
            act = [act[t] for t in nxt]
            sub = [reqs[a] for a in act]
            cctx = self._ctx([drafts[a][-1] for a in act], [pos[a] + j - 1 for a in act], [1] * len(act),
                             [r.cache.slot for r in sub], [1] * len(act))
            logits, y = self.model.mtp_forward_step(cctx, self.cache, last[torch.tensor(nxt, device=self.device)],
                                                    cctx.input_ids)
            last = y
        for a, req in enumerate(reqs):
            ds = drafts[a][:kr[live[a]]]
            if self.force_drafts is not None:
                ds = list(self.force_drafts(req, ds))
            req.drafts = ds
            req.draft_logq = torch.stack(logqs[a][:len(ds)]) if logqs[a] and req.params.temperature > 0 else None
