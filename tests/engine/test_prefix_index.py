"""PrefixCache's index on its own (a stub cache): longest-prefix lookup, the per-request hash
memo, hash collisions and eviction. The engine-level behaviour is in test_prefix_cache.py."""
import random
from types import SimpleNamespace

import pytest

from deepfuse.engine.prefix_cache import PrefixCache


class StubCache:
    def __init__(self):
        self.pools, self.dropped, self.evict = {}, [], None

    def snapshot(self, rc, n):
        return SimpleNamespace(tokens=n, pages={})

    def drop_snapshot(self, snap):
        self.dropped.append(snap.tokens)


def brute(entries, tokens, limit):
    ok = [e for e in entries if len(e) <= limit and tokens[:len(e)] == e]
    return max(map(len, ok)) if ok else None


class Colliding(PrefixCache):
    def _hashes(self, tokens, n, memo=None, stable=0):
        return [7] * (n // self.block)  # every block collides


@pytest.mark.parametrize("cls", [PrefixCache, Colliding])
def test_lookup_is_the_longest_saved_prefix(cls):
    rng = random.Random(0)
    pc = cls(StubCache(), block=8)
    base = [rng.randrange(50) for _ in range(200)]
    saved = []
    for n in (8, 13, 40, 41, 64, 100, 150):
        pc.insert(None, base, n)
        saved.append(base[:n])
    other = base[:30] + [rng.randrange(50) for _ in range(90)]  # diverges inside the 40-token entry
    pc.insert(None, other, 77)
    saved.append(other[:77])
    pc.insert(None, base, 40)  # the same tokens again: no second entry
    assert len(pc._entries) == len(saved)
    for _ in range(300):
        src = rng.choice([base, other])
        cut = rng.randrange(0, 201)
        tokens = src[:cut] + [rng.randrange(50) for _ in range(rng.randrange(0, 20))]
        limit = rng.randrange(0, len(tokens) + 1)
        hit = pc.lookup(tokens, limit)
        want = brute(saved, tokens, limit)
        assert (hit.snap.tokens if hit else None) == want, (cut, limit)


def test_memo_matches_fresh_hashes_and_stays_inside_the_stable_part():
    rng = random.Random(1)
    pc = PrefixCache(StubCache(), block=4)
    prompt = [rng.randrange(9) for _ in range(50)]
    memo = []
    fresh = pc._hashes(prompt, 50)
    assert pc._hashes(prompt, 30, memo, stable=50) == fresh[:7]
    assert memo == fresh[:7]
    assert pc._hashes(prompt, 50, memo, stable=50) == fresh and memo == fresh
    # tokens after the stable part may change (rolled-back outputs): never memoised
    memo2 = []
    toks = prompt[:21] + [1, 2, 3, 4, 5, 6, 7]
    pc._hashes(toks, 28, memo2, stable=21)
    assert memo2 == fresh[:5]  # blocks 1..5 end at 20 <= 21; block 6 ends at 24 > 21
    toks2 = prompt[:21] + [9, 9, 9, 9, 9, 9, 9]
    assert pc._hashes(toks2, 28, memo2, stable=21) == pc._hashes(toks2, 28)
    # lookups and inserts with a memo find what fresh ones find
    pc.insert(None, prompt, 37, memo, 50)
    assert pc.lookup(prompt + [3], 51).snap.tokens == 37
    assert pc.lookup(prompt + [3], 51, [], 50).snap.tokens == 37
    assert pc.lookup(prompt[:36] + [99] * 20, 56, [], 36) is None


def test_eviction_empties_the_index():
    cache = StubCache()
    pc = PrefixCache(cache, block=4)
    toks = list(range(40))
    for n in (4, 9, 23, 40):
        pc.insert(None, toks, n)
    assert len(pc._index) == 4
    while pc.evict_one():
        pass
    assert cache.dropped == [4, 9, 23, 40] and not pc._index and not pc._entries
    assert pc.lookup(toks, 40) is None
