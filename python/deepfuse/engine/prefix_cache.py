"""Prefix caching: requests that share a prefix with an earlier one start after it.

An entry is a saved request state at n computed tokens (CacheManager.snapshot): references
on the pages of its compressed rows and indexer keys (entries < n / r: shared, not copied;
the partial last page is copied on a hit, since the new request appends to it), a copy of
its window rows (the last W positions) and of its compressor states. A hit restores that
state into the new request's ring and state rings and prefills only the rest. Entries are
taken when a request finishes and, for long prompts, every `checkpoint` tokens of its
prefill (so later requests diverging inside a long prompt still hit a recent point); a
later request may start from any entry whose tokens are a prefix of its own.

Why no "replay the last W tokens" path: a window row of a layer depends on the hidden
state at its position, which depends on the windows of the layers below; with W rows of
state missing, replaying W tokens reproduces them only approximately, and outputs would
no longer equal the uncached run token for token. Restoring from the deepest saved point
and prefilling from there is the exact, bounded form (bounded by `checkpoint`).

Lookup: an entry of n tokens is indexed by the chained hash of its first (n // block) * block
tokens only (an entry can be a prefix of a request only if the request's chain agrees there),
so finding the longest usable entry costs O(prompt length / block) dictionary probes plus one
token comparison per candidate (hash collisions cost comparisons, never a wrong hit). A
request's prompt never changes, so the chain over its prompt blocks is computed once and kept
on the request (`memo`); long prompts then pay their hashing once, not at every lookup and
checkpoint. Eviction: least recently used first, when the saved slots or the page pools run
short; a running request never loses pages (it holds its own refs).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

from .cache import CacheManager, ReqCache, Snapshot


@dataclass
class Entry:
    key: int
    tokens: list
    snap: Snapshot
    hkey: int = 0  # the chained hash its index slot is under


class PrefixCache:
    def __init__(self, cache: CacheManager, *, block: int = 64, checkpoint: int = 2048):
        self.cache, self.block, self.checkpoint = cache, block, checkpoint
        self._entries: "OrderedDict[int, Entry]" = OrderedDict()  # LRU order: oldest first
        self._index: dict[int, set[int]] = {}
        self._next = 0
        self._busy: Optional[int] = None
        self.hit_tokens = 0
        self.prompt_tokens = 0
        self.num_hits = 0
        cache.evict = self.evict_one

    def _hashes(self, tokens, n: int, memo: Optional[list] = None, stable: int = 0) -> list[int]:
        """Chained hashes of tokens' first k * block tokens, k = 1 .. n // block. memo: the chain
        over the first len(memo) blocks of the same tokens, computed before; extended here with
        the blocks that lie inside tokens[:stable] (the part of tokens that never changes)."""
        b, nb = self.block, n // self.block
        out = memo[:nb] if memo else []
        h = out[-1] if out else 0
        for k in range(len(out) + 1, nb + 1):
            h = hash((h, tuple(tokens[(k - 1) * b:k * b])))
            out.append(h)
            if memo is not None and k == len(memo) + 1 and k * b <= stable:
                memo.append(h)
        return out

    def lookup(self, tokens: list[int], limit: int, memo: Optional[list] = None, stable: int = 0) -> Optional[Entry]:
        """The longest entry whose tokens are a prefix of tokens, with at most `limit` tokens.
        memo / stable: see _hashes."""
        hs = self._hashes(tokens, min(limit, len(tokens)), memo, stable)
        for k in range(len(hs), 0, -1):  # entries under k hold k * block .. (k + 1) * block - 1 tokens
            best = None
            for key in self._index.get(hs[k - 1], ()):
                e = self._entries[key]
                n = e.snap.tokens
                if n <= limit and (best is None or n > best.snap.tokens) and tokens[:n] == e.tokens:
                    best = e
            if best is not None:
                return best
        return None

    def restore(self, rc: ReqCache, e: Entry) -> int:
        self._entries.move_to_end(e.key)
        self._busy = e.key
        try:
            self.cache.restore(rc, e.snap)
        finally:
            self._busy = None
        self.num_hits += 1
        self.hit_tokens += e.snap.tokens
        return e.snap.tokens

    def insert(self, rc: ReqCache, tokens: list[int], n: int, memo: Optional[list] = None, stable: int = 0) -> None:
        """Save the state of a request with n computed tokens (tokens[:n] known). memo / stable:
        see _hashes."""
        if n < self.block:
            return
        key_tokens = tokens[:n]
        hk = self._hashes(tokens, n, memo, stable)[-1]
        for key in self._index.get(hk, ()):
            if self._entries[key].tokens == key_tokens:
                self._entries.move_to_end(key)
                return
        snap = self.cache.snapshot(rc, n)
        while snap is None and self.evict_one():
            snap = self.cache.snapshot(rc, n)
        if snap is None:
            return
        e = Entry(self._next, key_tokens, snap, hk)
        self._next += 1
        self._entries[e.key] = e
        self._index.setdefault(hk, set()).add(e.key)

    def evict_one(self) -> bool:
        """Drop the least recently used entry; False if there is none to drop."""
        for key in self._entries:
            if key != self._busy:
                e = self._entries.pop(key)
                ks = self._index[e.hkey]
                ks.discard(key)
                if not ks:
                    del self._index[e.hkey]
                self.cache.drop_snapshot(e.snap)
                return True
        return False

    def clear(self) -> None:
        while self.evict_one():
            pass

    def stats(self) -> dict:
        pages: dict[int, set] = {r: set() for r in self.cache.pools}
        for e in self._entries.values():
            for r, ps in e.snap.pages.items():
                pages[r].update(ps)
        return {"entries": len(self._entries), "hits": self.num_hits, "hit_tokens": self.hit_tokens,
                "prompt_tokens": self.prompt_tokens,
                "hit_rate": self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
                "pages_held": {r: len(v) for r, v in pages.items()}}
