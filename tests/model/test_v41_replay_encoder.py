"""Encoder-side SWA bounded replay (engine/replay.py encoder_replay_context; APPROXIMATE by
design): after a prefix hit of n tokens that kept the compressed rows, indexer keys and
compressor states but NO window rows, the step over [n - Ke, n) rebuilds every layer's window
(no window reads before the chunk's start, no compressor runs), then the request goes on.

Checked with engine steps on the tiny V4.1 model (window 8, 8 layers; every ring row of the
request is garbage before the replay step): the compressed rows are untouched by the replay
step; at Ke >= the all-layer dependency halo (window - 1) * layers = 56 the continuation equals
the exact run (the garbage is never read) to 1e-4; at Ke = window it differs (replay ran) and
stays within the measured bound (BOUND)."""
import numpy as np
import pytest
import torch

from deepfuse.engine.context import build_context
from deepfuse.engine.engram_state import engram_history
from deepfuse.engine.replay import encoder_replay_context
from deepfuse.engine.request import Request, SamplingParams
from deepfuse.engine.scheduler import ScheduledChunk
from deepfuse.engine.v41_cache import V41CacheManager
from deepfuse.models import tiny

NEW = 4
# measured: max |logit error| of the prompt's last row at Ke = 8 over the cases below 0.17 / 1.72 /
# 1.68 (random weights; near-tied expert choices flip); docs/notes/v41.md has the table
BOUND = 3.0


@pytest.fixture(scope="module")
def model():
    return tiny.load("v4.1")


@torch.no_grad()
def run(model, prompt, n=None, Ke=None, new=NEW):
    """Greedy tokens and logits rows of prompt + new tokens through engine steps; with n, Ke:
    the windows are dropped (garbage) after n tokens and rebuilt by the encoder-side replay."""
    cfg = model.cfg
    cache = V41CacheManager(cfg, model_dtype=model.dtype, device="cpu", max_num_seqs=2, max_num_batched_tokens=256,
                            max_total_tokens=1024, max_model_len=160, page_size=16)
    req = Request("0", list(prompt), SamplingParams(), 0, 0)
    rc = cache.admit()
    tm = model.engram_hasher.token_map.numpy()
    info = {}

    def step(start, count, nlog, encoder=False):
        ch = ScheduledChunk(req, start, count)
        cache.grow(rc, start + count)
        cache.flush()
        ctx = build_context(np.asarray(req.tokens(start, start + count), np.int64), np.array([start]),
                            np.array([count]), np.array([rc.slot]), np.array([nlog]), cache.geometry,
                            cache.block_tables, "cpu", cache.host_block_tables)
        ctx.engram_history = torch.from_numpy(engram_history([ch], tm, cfg.engram_max_ngram_size))
        if encoder:
            encoder_replay_context(ctx)
        return model.forward_step(ctx, cache)

    P = len(prompt)
    start = 0
    if n is not None:
        step(0, n, 0)
        ring = cache.ring[:, rc.slot]
        ring.copy_(torch.randn(ring.shape) * 50 if ring.is_floating_point() else
                   torch.randint(0, 256, ring.shape, dtype=ring.dtype))
        comp = {r: c.clone() for r, c in cache.comp.items()}
        states = {k: (a.clone(), b.clone()) for k, (a, b) in cache.states.items()}
        step(n - Ke, Ke, 0, encoder=True)
        info["comp_same"] = all(torch.equal(comp[r], c) for r, c in cache.comp.items())
        info["states_same"] = all(torch.equal(states[k][0], a) and torch.equal(states[k][1], b)
                                  for k, (a, b) in cache.states.items())
        start = n
    rows = [step(start, P - start, 1)[0]]
    req.num_computed = P
    for _ in range(new):
        req.append_token(int(rows[-1].argmax()))
        if len(rows) == new:
            break
        p = req.num_tokens - 1
        rows.append(step(p, 1, 1)[0])
    return req.output_token_ids, rows, info


CASES = [(40, 24), (60, 33), (70, 64)]  # (prompt length, hit length n)


@pytest.mark.parametrize("P,n", CASES)
def test_encoder_replay_at_halo_is_exact(model, P, n):
    g = torch.Generator().manual_seed(P)
    prompt = torch.randint(0, model.cfg.vocab_size, (P,), generator=g).tolist()
    toks, rows, _ = run(model, prompt)
    Ke = min(n, (model.cfg.sliding_window - 1) * model.cfg.num_hidden_layers)
    t2, r2, info = run(model, prompt, n, Ke)
    assert info["comp_same"] and info["states_same"]  # no compressor ran in the replay step
    assert t2 == toks
    for a, b in zip(rows, r2):
        assert float((a - b).abs().max()) <= 1e-4


@pytest.mark.parametrize("P,n", CASES)
def test_encoder_replay_window_is_bounded(model, P, n):
    g = torch.Generator().manual_seed(P)
    prompt = torch.randint(0, model.cfg.vocab_size, (P,), generator=g).tolist()
    _, rows, _ = run(model, prompt, new=1)
    Ke = model.cfg.sliding_window
    _, r2, info = run(model, prompt, n, Ke, new=1)
    assert info["comp_same"] and info["states_same"]
    err = float((rows[0] - r2[0]).abs().max())  # the prompt's last row (later rows follow other tokens)
    assert 1e-4 < err <= BOUND, err  # the window-only rebuild is approximate, and bounded


if __name__ == "__main__":  # the deviation table of docs/notes/v41.md
    torch.set_num_threads(1)
    m = tiny.load("v4.1")
    print("| Ke | P | n | first row max abs err | max over rows | argmax agree (rows) | greedy prefix agree |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for Ke in (8, 16, 32, 56):
        for P, n in CASES:
            errs, agree, pref, tot = [], 0, 0, 0
            for s in range(5):
                g = torch.Generator().manual_seed(100 * P + s)
                prompt = torch.randint(0, m.cfg.vocab_size, (P,), generator=g).tolist()
                t1, r1, _ = run(m, prompt, new=8)
                t2, r2, _ = run(m, prompt, n, min(Ke, n), new=8)
                errs.append([float((a - b).abs().max()) for a, b in zip(r1, r2)])
                agree += sum(int(a.argmax() == b.argmax()) for a, b in zip(r1, r2))
                tot += len(r1)
                pref += next((i for i, (x, y) in enumerate(zip(t1, t2)) if x != y), len(t1))
            print(f"| {Ke} | {P} | {n} | {max(e[0] for e in errs):.3g} | {max(max(e) for e in errs):.3g} | "
                  f"{agree}/{tot} | {pref}/{5 * 8} |")
