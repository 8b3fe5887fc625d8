"""The V4.1 engine step (V41Model.forward_step on engine/v41_cache.py's pages, the engine's
step contexts and engram_state's history) equals the full forward token for token: several
requests batched together, chunked prefill of random chunk sizes, greedy decode; every
sampled row's logits equal the full forward's at that position."""
import random

import numpy as np
import pytest
import torch

from deepfuse.engine.context import build_context
from deepfuse.engine.engram_state import engram_history
from deepfuse.engine.request import Request, SamplingParams
from deepfuse.engine.scheduler import ScheduledChunk
from deepfuse.engine.v41_cache import V41CacheManager
from deepfuse.models import tiny


@pytest.fixture(scope="module")
def model():
    return tiny.load("v4.1")


def generate(model, prompts, new_tokens, chunk, seed, kv_dtype="auto"):
    """Greedy generation through engine steps -> (sequences, [(request, position, logits row)])."""
    r = random.Random(seed)
    cfg = model.cfg
    cache = V41CacheManager(cfg, model_dtype=model.dtype, device="cpu", kv_dtype=kv_dtype, max_num_seqs=4,
                            max_num_batched_tokens=512, max_total_tokens=4096, max_model_len=256, page_size=16)
    reqs = [Request(str(i), list(p), SamplingParams(), 0, i) for i, p in enumerate(prompts)]
    rcs = [cache.admit() for _ in reqs]
    rows = []
    tm = model.engram_hasher.token_map.numpy()
    while any(len(q.output_token_ids) < new_tokens for q in reqs):
        chunks, live = [], []
        for q, rc in zip(reqs, rcs):
            if len(q.output_token_ids) >= new_tokens:
                continue
            left = q.num_tokens - q.num_computed
            n = min(left, r.randint(1, chunk))
            chunks.append(ScheduledChunk(q, q.num_computed, n))
            live.append(rc)
            cache.grow(rc, q.num_computed + n)
        cache.flush()
        ids = np.concatenate([np.asarray(c.req.tokens(c.start, c.start + c.count), np.int64) for c in chunks])
        starts = np.asarray([c.start for c in chunks], np.int64)
        counts = np.asarray([c.count for c in chunks], np.int64)
        slots = np.asarray([rc.slot for rc in live], np.int64)
        num_logits = np.asarray([1 if c.samples else 0 for c in chunks], np.int64)
        ctx = build_context(ids, starts, counts, slots, num_logits, cache.geometry, cache.block_tables, "cpu",
                            cache.host_block_tables)
        ctx.engram_history = torch.from_numpy(engram_history(chunks, tm, cfg.engram_max_ngram_size))
        logits = model.forward_step(ctx, cache)
        k = 0
        for c in chunks:
            c.req.num_computed += c.count
            if c.samples:
                rows.append((c.req, c.start + c.count - 1, logits[k]))
                c.req.append_token(int(logits[k].argmax()))
                k += 1
    return [q.tokens(0, q.num_tokens) for q in reqs], rows, reqs


def one_step(model, cache, req, rc, start, n):
    """Tokens start .. start + n of req (cache rc) as a one-chunk engine step -> its last row's logits."""
    ch = ScheduledChunk(req, start, n)
    cache.grow(rc, start + n)
    cache.flush()
    ctx = build_context(np.asarray(req.tokens(start, start + n), np.int64), np.array([start]), np.array([n]),
                        np.array([rc.slot]), np.array([1]), cache.geometry, cache.block_tables, "cpu",
                        cache.host_block_tables)
    tm = model.engram_hasher.token_map.numpy()
    ctx.engram_history = torch.from_numpy(engram_history([ch], tm, model.cfg.engram_max_ngram_size))
    return model.forward_step(ctx, cache)[0]


@pytest.mark.parametrize("seed,chunk", [(0, 1), (1, 5), (2, 40)])
def test_step_equals_full_forward(model, seed, chunk):
    g = torch.Generator().manual_seed(seed)
    lens = [3, 17, 26][: 2 + seed % 2]
    prompts = [torch.randint(0, 129280, (n,), generator=g).tolist() for n in lens]
    seqs, rows, reqs = generate(model, prompts, 8, chunk, seed)
    for q, seq in zip(reqs, seqs):
        full = model(torch.tensor([seq]))[0]
        # greedy: every generated token is the full forward's argmax at the position before it
        P = len(q.prompt_token_ids)
        assert full[P - 1:len(seq) - 1].argmax(-1).tolist() == seq[P:]
        for req, pos, lg in rows:
            if req is q:
                torch.testing.assert_close(lg, full[pos], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_lossy_cache_formats_run(model, kv_dtype):
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 129280, (n,), generator=g).tolist() for n in (5, 19)]
    seqs, rows, reqs = generate(model, prompts, 6, 7, 9, kv_dtype=kv_dtype)
    assert all(torch.isfinite(lg).all() for _, _, lg in rows)
    if kv_dtype == "fp8":
        # FP8 rows flip near-tied expert choices of this random model from layer 0 on (V4's
        # tiny hash-routes its first layers): only that it runs is checked here
        return
    # the first sampled row of each request: its prompt read back through the bf16 cache
    for q in reqs:
        lg = next(lg for req, _, lg in rows if req is q)
        full = model(torch.tensor([q.tokens(0, len(q.prompt_token_ids))]))[0, -1]
        err = (lg - full).abs().max() / full.abs().max()
        assert err < 0.1, (kv_dtype, float(err))


def test_recompute_after_preemption(model):
    """A request whose cache is released mid-generation and recomputed from position 0 in a
    new slot (the engine's preemption) continues exactly as the whole sequence."""
    g = torch.Generator().manual_seed(11)
    cfg = model.cfg
    seq = torch.randint(0, 129280, (23,), generator=g).tolist()
    cache = V41CacheManager(cfg, model_dtype=model.dtype, device="cpu", max_num_seqs=3, max_num_batched_tokens=512,
                            max_total_tokens=4096, max_model_len=256, page_size=16)
    full = model(torch.tensor([seq]))[0]

    req = Request("a", seq, SamplingParams(), 0, 0)
    other = cache.admit()  # a neighbour holding slot and pages, so the recompute lands elsewhere
    cache.grow(other, 40)
    rc = cache.admit()
    for a, b in ((0, 9), (9, 17)):
        torch.testing.assert_close(one_step(model, cache, req, rc, a, b - a), full[b - 1], rtol=1e-4, atol=1e-4)
    cache.release(rc)
    rc2 = cache.admit()
    for a, b in ((0, 13), (13, 20), (20, 21), (21, 23)):
        torch.testing.assert_close(one_step(model, cache, req, rc2, a, b - a), full[b - 1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n", [8, 13, 17])
def test_prefix_snapshot_restore(model, n):
    """A request restored from another's snapshot at n tokens (the prefix cache) continues as
    its whole sequence: window rows, open compressor groups, shared pages of rows and keys
    (the partial page copied) and the Engram history from its own tokens."""
    g = torch.Generator().manual_seed(n)
    cfg = model.cfg
    a = torch.randint(0, 129280, (22,), generator=g).tolist()
    b = a[:n] + torch.randint(0, 129280, (9,), generator=g).tolist()
    cache = V41CacheManager(cfg, model_dtype=model.dtype, device="cpu", max_num_seqs=3, max_num_batched_tokens=512,
                            max_total_tokens=4096, max_model_len=256, page_size=16, num_saved_prefixes=2)

    ra = Request("a", a, SamplingParams(), 0, 0)
    rca = cache.admit()
    one_step(model, cache, ra, rca, 0, 5)
    one_step(model, cache, ra, rca, 5, n - 5)
    snap = cache.snapshot(rca, n)
    one_step(model, cache, ra, rca, n, len(a) - n)  # a goes on writing its own pages past the prefix
    cache.release(rca)
    rb = Request("b", b, SamplingParams(), 0, 1)
    rcb = cache.admit()
    cache.restore(rcb, snap)
    full = model(torch.tensor([b]))[0]
    pos = n
    for cnt in (1, 3, len(b) - n - 4):
        torch.testing.assert_close(one_step(model, cache, rb, rcb, pos, cnt), full[pos + cnt - 1], rtol=1e-4, atol=1e-4)
        pos += cnt
    cache.drop_snapshot(snap)
