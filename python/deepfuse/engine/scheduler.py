"""Continuous batching: which tokens of which requests the next step runs.

Requests join and leave at step boundaries. Each step: running requests in decode (one
pending token) first, oldest first; then running requests that are still prefilling; then
waiting requests while max_num_seqs and the cache allow. Prefill
is chunked to the token budget max_num_batched_tokens (chunks end anywhere, not on page or
compression-block boundaries). Short prefills (at most half the budget) do not wait for
long ones: a long prefill chunk leaves min(half the budget left, what the short prefills
after it need) to them, and short waiting requests are admitted before long waiting ones;
budget they do not take goes back to the capped chunks, in order. So a short request that
arrives during a long prefill runs its prefill in the next step, while long prompts sharing
a prefix still prefill one after the other (the later one can hit the first one's saved
prefix state). A running request that cannot grow preempts the newest
running request not yet in the step (possibly itself): its cache is freed and it goes back
to the front of the queue, to be recomputed (prompt + tokens generated so far). Work per
step is O(running requests).
"""
from __future__ import annotations

from collections import deque
from itertools import islice
import bisect

from .cache import CacheManager
from .request import Request, Status


class ScheduledChunk:
    __slots__ = ("req", "start", "count")

    def __init__(self, req: Request, start: int, count: int):
        self.req, self.start, self.count = req, start, count  # tokens start .. start + count - 1

    @property
    def samples(self) -> bool:
        """The chunk ends at the request's last token: the next one is sampled."""
        return self.start + self.count == self.req.num_tokens


class Scheduler:
    def __init__(self, cache: CacheManager, max_num_seqs: int, max_num_batched_tokens: int, prefix=None):
        self.cache = cache
        self.prefix = prefix  # PrefixCache or None
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # by arrival (oldest first)
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, req: Request) -> None:
        """Drop a request wherever it is, freeing its cache (finish / abort)."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
            self._free(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = Status.FINISHED

    def _free(self, req: Request) -> None:
        req.drafts, req.draft_logq, req.draft_src = [], None, None
        if req.cache is not None:
            self.cache.release(req.cache)
            req.cache = None
        req.num_computed = 0

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._free(req)
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _make_room(self, req: Request, tokens: int, scheduled: set) -> bool:
        """Free cache until `req` can hold `tokens` tokens; False if req itself was preempted."""
        while self.cache.free_tokens < tokens - req.cache.tokens:
            cands = [r for r in reversed(self.running) if id(r) not in scheduled]  # newest first; req is one
            victim = next((r for r in cands if not r.final_pending), cands[0])  # ending ones free memory soon
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _short_needs(self, snapshot: list[Request], short: int) -> dict:
        """{id(running prefill): the short prefills (<= short tokens) after it in this step's
        order (running ones, then waiting ones that could be admitted), capped at short}."""
        room = min(self.max_num_seqs - len(self.running), self.cache.free_slots)
        acc = 0
        for r in islice(self.waiting, max(room, 0)):
            if acc >= short:
                break
            if not r.final_pending and r.num_tokens <= short:
                acc += r.num_tokens
        acc = min(acc, short)
        after = {}
        for req in reversed(snapshot):
            left = req.num_tokens - req.num_computed
            if left > 1 and req.status is Status.RUNNING and not req.final_pending:
                after[id(req)] = acc
                if left <= short:
                    acc = min(short, acc + left)
        return after

    def _admit(self, req: Request, budget: int):
        """Admit waiting request req with at most budget tokens -> its chunk, or None if the
        cache cannot take it now (req stays where it is)."""
        cache = self.cache
        hit = None
        if self.prefix is not None and not req.wants_prompt_rows:  # prompt logprobs need every row
            known = req.num_tokens - (1 if req.pending is not None else 0)
            hit = self.prefix.lookup(req.tokens(0, known), req.num_tokens - 1, req.prefix_hashes,
                                     len(req.prompt_token_ids))
        start = hit.snap.tokens if hit is not None else 0
        n = min(req.num_tokens - start, budget, cache.free_tokens - len(self.running) - start)
        if n <= 0:
            return None
        self.waiting.remove(req)
        req.cache = cache.admit()
        req.status = Status.RUNNING
        if self.prefix is not None and not req.counted:
            req.counted = True
            self.prefix.prompt_tokens += len(req.prompt_token_ids)
        if hit is not None:
            self.prefix.restore(req.cache, hit)
        req.num_computed = start
        req.last_checkpoint = start
        bisect.insort(self.running, req, key=lambda r: r.arrival)
        cache.grow(req.cache, start + n)
        return ScheduledChunk(req, start, n)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        short = budget // 2  # a prefill of at most this many tokens is short: it need not wait for long ones
        out: list[ScheduledChunk] = []
        scheduled: set = set()
        capped: list[ScheduledChunk] = []
        cache = self.cache
        # running requests: decode first, then prefill continuations, each oldest first; a
        # long continuation leaves budget to the short prefills after it
        snapshot = list(self.running)
        after = self._short_needs(snapshot, short)
        for want_decode in (True, False):
            for req in snapshot:
                if budget == 0:
                    break
                left = req.num_tokens - req.num_computed
                if (left == 1) != want_decode or left < 1 or req.status is not Status.RUNNING or req.final_pending:
                    continue  # other pass, preempted by an older request of this step, or ending
                share = budget if want_decode or left <= short else budget - min(budget // 2, after.get(id(req), 0))
                n = left if left < share else share
                if left == 1 and req.drafts:  # verify the drafts too, as far as the budget allows
                    n = min(1 + len(req.drafts), budget)
                    if n - 1 < len(req.drafts):
                        del req.drafts[n - 1:]
                        if req.draft_logq is not None:
                            req.draft_logq = req.draft_logq[:n - 1]
                end = req.num_computed + n
                if cache.max_total_tokens - cache.used_tokens < end - req.cache.tokens:
                    free = cache.max_total_tokens - cache.used_tokens
                    if n > 1 and free > 0 and left > 1:
                        n = free  # a smaller prefill chunk instead of a preemption
                        end = req.num_computed + n
                    elif not self._make_room(req, end, scheduled):
                        continue
                cache.grow(req.cache, end)
                out.append(ScheduledChunk(req, req.num_computed, n))
                if n < left and n == share:
                    capped.append(out[-1])
                scheduled.add(id(req))
                budget -= n
        # waiting requests, leaving a token per running request for its next step (admitting
        # into the last free tokens would preempt at once): short ones first (first come first
        # served among them), then the others first come first served
        for lane in ("short", "fcfs"):
            k = 0
            scan = min(len(self.waiting), self.max_num_seqs) if lane == "short" else len(self.waiting)
            while k < scan and budget > 0 and len(self.running) < self.max_num_seqs and cache.free_slots:
                req = self.waiting[k]
                if req.final_pending:
                    if lane == "fcfs":
                        break  # its last token is being read back: it ends, it does not run again
                    k += 1
                    continue
                if lane == "short" and req.num_tokens > short:
                    k += 1
                    continue
                c = self._admit(req, budget)
                if c is None:
                    break
                scan -= 1
                out.append(c)
                scheduled.add(id(req))
                budget -= c.count
        # budget that later prefills did not take goes back to the capped chunks, in order
        for c in capped:
            if budget == 0:
                break
            req = c.req
            if req.status is not Status.RUNNING:
                continue  # preempted after its chunk was scheduled
            extra = min(req.num_tokens - c.start - c.count, budget, cache.free_tokens - len(self.running))
            if extra > 0:
                c.count += extra
                cache.grow(req.cache, c.start + c.count)
                budget -= extra
        cache.flush()
        return out
