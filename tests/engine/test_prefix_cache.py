"""Prefix caching (CPU, fp32, lossless caches): outputs with the cache equal outputs without
it, token for token, and every reference returns."""
import pytest
import torch

from deepfuse import models
from deepfuse.engine import LLM, SamplingParams

from test_engine import assert_cache_empty


@pytest.fixture(scope="module")
def tiny():
    return models.tiny.load()


def rand(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 129280, (n,), generator=g).tolist()


def plain(tiny, prompts, sp):
    return [o.token_ids for o in LLM(tiny, max_total_tokens=6000).generate(prompts, sp)]


def assert_released(llm):
    """With the index emptied, every page and saved slot is free again."""
    eng = llm.engine
    eng.prefix.clear()
    assert_cache_empty(eng)
    assert len(eng.cache._saved_free) == eng.cache.num_saved
    assert all(p._refs.sum() == 0 for p in eng.cache.pools.values())


def test_shared_prefixes_of_many_lengths(tiny):
    """Prefixes ending inside a compression block, on CSA (4) and HCA (128) boundaries,
    shorter and longer than the window (16), and a prompt equal to a cached one."""
    base = rand(420, 1)
    prompts = [base[:300]]
    for n in (3, 15, 17, 64, 127, 128, 129, 131, 255, 256, 299, 300):
        prompts.append(base[:n] + rand(7 + n % 5, n))
    prompts.append(base[:300])
    prompts.append(base[:301])
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    ref = plain(tiny, prompts, sp)
    llm = LLM(tiny, max_total_tokens=6000, enable_prefix_caching=True, prefix_checkpoint=32,
              max_num_batched_tokens=61)
    got = [llm.generate([p], sp)[0].token_ids for p in prompts]
    assert got == ref
    st = llm.engine.stats()["prefix_cache"]
    print("prefix cache:", st)
    assert st["hits"] >= 8 and st["hit_rate"] > 0.3
    assert_released(llm)


def test_multi_turn_conversation(tiny):
    """Each turn resends the whole history (previous prompt + answer) plus a new message."""
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    cached = LLM(tiny, max_total_tokens=6000, enable_prefix_caching=True, max_num_batched_tokens=77)
    nocache = LLM(tiny, max_total_tokens=6000)
    hist = rand(90, 2)
    hits = []
    for turn in range(5):
        a = cached.generate([hist], sp)[0].token_ids
        b = nocache.generate([hist], sp)[0].token_ids
        assert a == b, turn
        hits.append(cached.engine.stats()["prefix_cache"]["hit_tokens"])
        hist = hist + a + rand(20 + 13 * turn, 10 + turn)
    # from the second turn on, every turn starts after the previous turn's whole history
    assert all(h2 - h1 >= 90 for h1, h2 in zip(hits, hits[1:]))
    assert_released(cached)


def test_concurrent_hits_on_one_entry_with_overlap_and_speculation(tiny):
    base = rand(200, 3)
    warm = [base[:180]]
    prompts = [base[:180] + rand(5 + i, 30 + i) for i in range(6)]
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    ref = plain(tiny, prompts, sp)
    for k, overlap in ((0, False), (0, True), (2, False)):
        llm = LLM(tiny, max_total_tokens=4000, enable_prefix_caching=True, num_speculative_tokens=k,
                  max_num_batched_tokens=64, overlap=overlap)
        llm.generate(warm, sp)
        got = [o.token_ids for o in llm.generate(prompts, sp)]  # all submitted together
        assert got == ref, k
        assert llm.engine.stats()["prefix_cache"]["hits"] >= 6
        assert_released(llm)


def test_eviction_under_a_small_cache_with_preemption(tiny):
    """Few saved slots and a small page budget: entries are evicted (LRU) and requests
    preempted; outputs stay equal; running requests never lose pages."""
    bases = [rand(150, 40 + i) for i in range(4)]
    prompts = [b[:n] + rand(6, 50 + n) for b in bases for n in (70, 140)] + [bases[0][:140]]
    sp = [SamplingParams(max_tokens=12 + i % 7, ignore_eos=True) for i in range(len(prompts))]
    ref = plain(tiny, prompts, sp)
    llm = LLM(tiny, max_total_tokens=400, max_num_seqs=3, enable_prefix_caching=True, prefix_cache_entries=3,
              prefix_checkpoint=64, max_num_batched_tokens=45)
    got = [o.token_ids for o in llm.generate(prompts, sp)]
    assert got == ref
    st = llm.engine.stats()
    assert st["num_preemptions"] > 0 and st["prefix_cache"]["entries"] <= 3 and st["prefix_cache"]["hits"] > 0
    assert_released(llm)


def test_restore_paths_saved_window_and_checkpoint_replay(tiny):
    """A hit exactly at a saved state (the whole earlier prompt), and a divergence inside an
    earlier prompt: the request restores the deepest checkpoint before it and prefills the
    rest (the bounded replay)."""
    base = rand(260, 5)
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    prompts = [base[:250], base[:250] + rand(9, 6), base[:200] + rand(11, 7)]
    ref = plain(tiny, prompts, sp)
    llm = LLM(tiny, max_total_tokens=4000, enable_prefix_caching=True, prefix_checkpoint=64,
              max_num_batched_tokens=50)
    got = [llm.generate([p], sp)[0].token_ids for p in prompts]
    assert got == ref
    st = llm.engine.stats()["prefix_cache"]
    # hit 1: at 250 (the first prompt's end); hit 2: the checkpoint at 200 = 4 chunks of 50
    assert st["hits"] == 2 and st["hit_tokens"] == 250 + 200, st


@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
def test_snapshot_restore_copies_rows_exactly(tiny, kv_dtype):
    """The saved window, compressor states and the copied partial page are bit-exact copies;
    complete pages are shared (their reference count rises)."""
    llm = LLM(tiny, kv_dtype=kv_dtype, max_total_tokens=3000, enable_prefix_caching=True)
    eng = llm.engine
    p = rand(230, 8)
    eng.add_request("a", p + rand(3, 9), SamplingParams(max_tokens=3, ignore_eos=True))
    while eng.scheduler.running == [] or eng.scheduler.running[0].num_computed < 230:
        eng.step()
    c = eng.cache
    req = eng.scheduler.running[0]
    n = req.num_computed
    snap = c.snapshot(req.cache, n)
    rc = c.admit()
    c.restore(rc, snap)
    g = c.geometry
    for p_ in range(n - g.window, n):
        assert torch.equal(c.ring[:, rc.slot, p_ % g.ring_rows], c.ring[:, req.cache.slot, p_ % g.ring_rows])
    for r, (R, R0) in c.state_rows.items():
        for (rr, name), (kv, sc) in c.states.items():
            if rr == r:
                for p_ in range(n - R0 + 1, n):
                    assert torch.equal(kv[:, rc.slot * R + p_ % R], kv[:, req.cache.slot * R + p_ % R])
        full = (n // r) // c.page_size
        assert rc.pages[r][:full] == req.cache.pages[r][:full]
        assert all(c.pools[r].refcount(x) == 3 for x in rc.pages[r][:full])  # request, snapshot, rc
        if len(rc.pages[r]) > full:
            assert rc.pages[r][full] != req.cache.pages[r][full]
            assert torch.equal(c.comp[r][:, rc.pages[r][full]], c.comp[r][:, req.cache.pages[r][full]])
    c.release(rc)
    c.drop_snapshot(snap)
    while eng.has_unfinished():
        eng.step()
    assert_released(llm)
