"""Continuous batching: which tokens of which requests the next step runs.

Requests join and leave at step boundaries. Each step: running requests in decode (one
pending token) first, oldest first; then running requests that are still prefilling; then
waiting requests, first come first served, while max_num_seqs and the cache allow. Prefill
is chunked to the token budget max_num_batched_tokens (chunks end anywhere, not on page or
compression-block boundaries). A running request that cannot grow preempts the newest
running request not yet in the step (possibly itself): its cache is freed and it goes back
to the front of the queue, to be recomputed (prompt + tokens generated so far). Work per
step is O(running requests).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .cache import CacheManager
from .request import Request, Status


@dataclass
class ScheduledChunk:
    req: Request
    start: int   # first position of the chunk
    count: int   # tokens

    @property
    def samples(self) -> bool:
        """The chunk ends at the request's last token: the next one is sampled."""
        return self.start + self.count == self.req.num_tokens


class Scheduler:
    def __init__(self, cache: CacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order (oldest first)
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
            victims = [r for r in self.running if id(r) not in scheduled]
            victim = max(victims, key=lambda r: r.arrival)  # req is among them
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        out: list[ScheduledChunk] = []
        scheduled: set = set()
        # running requests: decode first, then prefill continuations, each oldest first
        by_age = sorted(self.running, key=lambda r: r.arrival)
        decode = [r for r in by_age if r.num_tokens - r.num_computed == 1]
        prefill = [r for r in by_age if r.num_tokens - r.num_computed > 1]
        for req in decode + prefill:
            if budget == 0:
                break
            if req.status is not Status.RUNNING:  # preempted by an older request of this step
                continue
            n = min(req.num_tokens - req.num_computed, budget)
            free = self.cache.free_tokens
            if n > 1 and 0 < free < n:
                n = free  # a smaller prefill chunk instead of a preemption
            if not self._make_room(req, req.num_computed + n, scheduled):
                continue
            self.cache.grow(req.cache, req.num_computed + n)
            out.append(ScheduledChunk(req, req.num_computed, n))
            scheduled.add(id(req))
            budget -= n
        # waiting requests, first come first served, leaving a token per running request
        # for its next step (admitting into the last free tokens would preempt at once)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and self.cache.free_slots:
            req = self.waiting[0]
            n = min(req.num_tokens, budget, self.cache.free_tokens - len(self.running))
            if n <= 0:
                break
            self.waiting.popleft()
            req.cache = self.cache.admit()
            req.status = Status.RUNNING
            req.num_computed = 0
            self.running.append(req)
            self.cache.grow(req.cache, n)
            out.append(ScheduledChunk(req, 0, n))
            scheduled.add(id(req))
            budget -= n
        self.cache.flush()
        return out
