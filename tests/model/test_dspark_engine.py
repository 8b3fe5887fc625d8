"""DSpark drafting in the engine on the tiny V4.1 model (engine/dspark_runner.py; CPU, fp32).

- Greedy requests with DSpark drafts equal their full-forward greedy continuations (k 1-3,
  confidence thresholds 0 / 0.5 / 1, ragged verification lengths, chunked prefill, a small
  cache that preempts, prefix caching); every cache is empty afterwards.
- A drafter whose Markov head encodes the target's greedy bigrams gets drafts accepted
  (acceptance per position > 0) and still equals greedy.
- Forced drafts (right / wrong at a position): acceptance per position exactly as forced.
- After verify steps with rejections, the DSpark context rings hold exactly the committed
  positions' rows (equal to those of the full forward's target features) and the target's
  live cache rows equal those of a run without speculation.
- Seeded sampling with DSpark drafts (top-k 3: a 3-token support) emits the target's
  distribution: chi-square on the first two sampled tokens over 300 seeds.
- A request restored from a saved prefix holds the snapshot's ring rows.
- Method selection and validation: DSpark by default on V4.1, MTP on V4, errors naming the
  field.
- CUDA graphs (the CPU's padded static steps) and the overlapped loop: greedy with DSpark still
  equals the full forward's greedy; uniform steps run the target graph (its context rows) and
  every drafting step the draft graphs; sampled requests draw outside the draft graph.
"""
import logging

import numpy as np
import pytest
import torch

from deepfuse.engine import LLM, SamplingParams
from deepfuse.models import tiny
from deepfuse.models.dspark import DSparkDrafter, capture_target_inputs
from engine_util import chi2_ok


@pytest.fixture(scope="module")
def model():
    return tiny.load("v4.1")


def _prompts(lens, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 129280, (n,), generator=g).tolist() for n in lens]


def _greedy_ok(model, prompt, toks) -> bool:
    """toks is the full forward's greedy continuation of prompt (one forward)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + toks]))[0, len(prompt) - 1:-1]
    return logits.argmax(-1).tolist() == toks


def _greedy(model, prompt, n):
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]


def _empty(eng):
    c = eng.cache
    assert c.used_tokens == 0 and c.free_slots == c.num_slots and not eng.has_unfinished()


PROMPT_LENS, MAX_TOKENS = [3, 9, 16, 27], [9, 5, 12, 7]


@pytest.mark.parametrize("k,th,kw", [
    (1, 0.0, {}),
    (2, 0.5, dict(max_num_batched_tokens=7)),
    (3, 0.0, dict(max_total_tokens=56, max_num_seqs=3)),
    (3, 1.0, {}),
    (2, 0.0, dict(enable_prefix_caching=True)),
], ids=["k1-th0", "k2-th0.5-chunked", "k3-th0-small-cache", "k3-th1", "k2-th0-prefix"])
def test_greedy_equals_full_forward(model, k, th, kw):
    prompts = _prompts(PROMPT_LENS)
    llm = LLM(model, num_speculative_tokens=k, dspark_threshold=th, max_model_len=96, **kw)
    eng = llm.engine
    assert eng.runner.dspark is not None and eng.cache.dspark is not None and not eng.overlap
    outs = llm.generate(prompts, [SamplingParams(max_tokens=m, ignore_eos=True) for m in MAX_TOKENS])
    for p, m, o in zip(prompts, MAX_TOKENS, outs):
        assert len(o.token_ids) == m and _greedy_ok(model, p, o.token_ids), (k, th, kw, len(p))
    st = eng.stats()["spec"]
    if th == 1.0:
        assert st["verify_steps"] == 0  # no draft is confident enough: plain decode steps
    elif th == 0.0:
        assert st["verify_steps"] > 0 and all(x is not None for x in st["acceptance_per_position"])
    if "max_total_tokens" in kw:
        assert eng.stats()["num_preemptions"] > 0
    _empty(eng)
    if kw.get("enable_prefix_caching"):  # again, from saved prefixes (their rings restored)
        again = llm.generate(prompts, [SamplingParams(max_tokens=m, ignore_eos=True) for m in MAX_TOKENS])
        assert [o.token_ids for o in again] == [o.token_ids for o in outs]


@pytest.mark.parametrize("k,th,kw", [
    (2, 0.0, dict(cuda_graphs=True)),
    (3, 0.5, dict(cuda_graphs=True, max_num_batched_tokens=7)),
    (2, 0.0, dict(overlap=True)),
    (3, 0.0, dict(cuda_graphs=True, overlap=True, enable_prefix_caching=True)),
    (2, 0.0, dict(cuda_graphs=True, overlap=True, max_total_tokens=56, max_num_seqs=3)),
], ids=["k2-graphs", "k3-th0.5-graphs-chunked", "k2-overlap", "k3-graphs-overlap-prefix", "k2-graphs-overlap-small"])
def test_greedy_equals_full_forward_graphs_overlap(model, k, th, kw):
    """DSpark under CUDA graphs (here the CPU's padded static steps: the same code path without
    capture) and the overlapped loop: greedy outputs equal the full forward's greedy; uniform
    decode / verify steps run the target graph (which computes the context rows) and the drafts
    come from the draft graphs, never from the eager propose."""
    prompts = _prompts(PROMPT_LENS)
    llm = LLM(model, num_speculative_tokens=k, dspark_threshold=th, max_model_len=96, **kw)
    eng = llm.engine
    ds = eng.runner.dspark
    assert eng.overlap == kw.get("overlap", False)
    graphs = kw.get("cuda_graphs", False)
    assert (eng.runner.graphs is not None) == graphs and (ds.graphs is not None) == graphs
    eager = []
    orig = ds.drafter.propose
    ds.drafter.propose = lambda *a, **kw_: eager.append(1) or orig(*a, **kw_)
    used = []
    run = eng.runner.graphs.run if graphs else None
    if graphs:
        eng.runner.graphs.run = lambda ctx: used.append(ctx.graph.pad.tokens) or run(ctx)
    outs = llm.generate(prompts, [SamplingParams(max_tokens=m, ignore_eos=True) for m in MAX_TOKENS])
    for p, m, o in zip(prompts, MAX_TOKENS, outs):
        assert len(o.token_ids) == m and _greedy_ok(model, p, o.token_ids), (k, th, kw, len(p))
    st = eng.stats()["spec"]
    if th == 0.0:
        assert st["verify_steps"] > 0
    if graphs:
        assert not eager and ds.graph_steps > 0
        assert 1 in used and (th > 0 or k + 1 in used)  # decode and verify steps replayed target graphs
    else:
        assert eager and ds.graph_steps == 0
    _empty(eng)
    if kw.get("enable_prefix_caching"):
        again = llm.generate(prompts, [SamplingParams(max_tokens=m, ignore_eos=True) for m in MAX_TOKENS])
        assert [o.token_ids for o in again] == [o.token_ids for o in outs]


def test_sampled_drafts_under_graphs(model):
    """Sampled requests under graphs: the draft graph's block forward, the Markov head drawn
    with the engine's sampler outside it; seeded outputs equal the eager engine's exactly (the
    same drafts, the same q, the same acceptance draws)."""
    prompts = _prompts([5, 11])
    ps = [SamplingParams(max_tokens=8, temperature=1.3, top_k=3, seed=7 + i, ignore_eos=True) for i in range(2)]
    a = LLM(model, num_speculative_tokens=2, dspark_threshold=0.0, max_model_len=64).generate(prompts, ps)
    llm = LLM(model, num_speculative_tokens=2, dspark_threshold=0.0, max_model_len=64, cuda_graphs=True)
    b = llm.generate(prompts, ps)
    assert llm.engine.runner.dspark.graph_steps > 0
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def _ring_matches_full_forward(model, eng, req):
    """The request's DSpark ring holds exactly positions n - W .. n - 1 (n = num_computed),
    each row the context row of the full forward's target features at that position."""
    n, W = req.num_computed, model.cfg.sliding_window
    d = DSparkDrafter(model)
    rows, pos = eng.cache.dspark.gather(torch.tensor([req.cache.slot]))
    assert sorted(pos[0].tolist()) == list(range(n - W, n))
    seq = (req.prompt_token_ids + req.output_token_ids)[:n]
    with torch.no_grad(), capture_target_inputs(model) as cap:
        model(torch.tensor([seq]))
        want = d.context_rows(d.main_hidden(cap), torch.arange(n)[None])
    for s in range(len(rows)):
        torch.testing.assert_close(rows[s][0], want[s][0, pos[0]], rtol=1e-4, atol=1e-4)


def test_prefix_hit_restores_the_context_ring(model):
    """A request restored from a saved prefix at 70 tokens that prefills 3 more holds ring rows
    of positions 65..69 from the snapshot: they equal the full forward's."""
    a = _prompts([70], seed=5)[0]
    eng = LLM(model, num_speculative_tokens=2, dspark_threshold=0.0, max_model_len=96,
              enable_prefix_caching=True).engine
    eng.add_request("a", a, SamplingParams(max_tokens=3, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    b = a + [11, 12, 13]
    eng.add_request("b", b, SamplingParams(max_tokens=6, ignore_eos=True))
    eng.step()
    assert eng.stats()["prefix_cache"]["hit_tokens"] == 70
    req = eng.scheduler.running[0]
    assert req.num_computed == len(b)
    _ring_matches_full_forward(model, eng, req)
    while eng.has_unfinished():
        eng.step()
    assert _greedy_ok(model, b, req.output_token_ids) and len(req.output_token_ids) == 6


def _bigram_head(model, prompt, cont):
    """Markov head weights that map each token of prompt[-1:] + cont to its successor (first
    occurrences, as many as the rank holds) -> (embed, head) to install."""
    chain = [prompt[-1]] + cont
    nxt = {}
    for p, q in zip(chain, chain[1:]):
        nxt.setdefault(p, q)
    mk = model.mtp[-1].markov_head
    emb, head = torch.zeros_like(mk.embed.weight), torch.zeros_like(mk.head.weight)
    for j, (p, q) in enumerate(list(nxt.items())[:model.cfg.dspark_markov_rank]):
        emb[p, j] = 1.0
        head[q, j] = 1e4
    return emb, head


class _Swap:
    def __init__(self, model, emb, head):
        self.mk, self.new = model.mtp[-1].markov_head, (emb, head)

    def __enter__(self):
        self.old = self.mk.embed.weight, self.mk.head.weight
        self.mk.embed.weight, self.mk.head.weight = self.new

    def __exit__(self, *a):
        self.mk.embed.weight, self.mk.head.weight = self.old


def test_bigram_drafter_is_accepted(model):
    prompt = _prompts([6], seed=9)[0]
    want = _greedy(model, prompt, 12)
    with _Swap(model, *_bigram_head(model, prompt, want)):
        llm = LLM(model, num_speculative_tokens=3, dspark_threshold=0.0, max_model_len=64)
        got = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    assert got == want
    st = llm.engine.stats()["spec"]
    assert st["acceptance_per_position"][0] > 0 and st["mean_accepted_length"] > 1.0
    assert llm.engine.num_steps < 12


def _forced(ref, V, wrong_at):
    def f(req, proposed):
        gen = len(req.output_token_ids)
        true = (ref[gen:gen + len(proposed)] + proposed)[:len(proposed)]
        return [(t + 1) % V if wrong_at == "all" or j == wrong_at else t for j, t in enumerate(true)]
    return f


@pytest.mark.parametrize("wrong", [None, 0, 1, "all"])
def test_forced_drafts_acceptance(model, wrong):
    prompt = _prompts([7], seed=4)[0]
    ref = _greedy(model, prompt, 10)
    llm = LLM(model, num_speculative_tokens=3, dspark_threshold=0.0, max_model_len=64)
    llm.engine.spec.force_drafts = _forced(ref, model.cfg.vocab_size, wrong)
    got = llm.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))[0].token_ids
    assert got == ref
    acc = llm.engine.stats()["spec"]["acceptance_per_position"]
    for j, a in enumerate(acc):
        if a is not None:
            want = 1.0 if wrong is None else 0.0 if wrong == "all" else float(j < wrong)
            assert a == want, (wrong, acc)


def _live(eng, req):
    """The target cache rows later steps can read (window rows, kv sources' compressed rows,
    keys and open compressor groups) of a running request."""
    c, n, s = eng.cache, req.num_computed, req.cache.slot
    g, ps = c.geometry, c.page_size
    out = {"ring": c.ring[:, s, [p % g.ring_rows for p in range(max(0, n - g.window + 1), n)]].clone()}
    for r in c.pools:
        e = np.arange(n // r)
        slots = torch.from_numpy(c.host_block_tables[r][s, e // ps] * ps + e % ps)
        out[f"comp{r}"] = c.comp[r].flatten(1, 2)[:, slots].clone()
        out[f"keys{r}"] = c.keys[r].flatten(1, 2)[:, slots].clone()
        Rs, R0 = c.state_rows[r]
        rows = [s * Rs + p % Rs for p in range(max(0, n - R0 + 1), n) if R0 > 1]
        kv, sc = c.states[(r, "attn")]
        out[f"state{r}"] = torch.cat([kv[:, rows], sc[:, rows]], -1).clone()
    return out


def test_rejected_drafts_leave_no_live_rows(model):
    prompt = _prompts([19], seed=21)[0]
    ref = _greedy(model, prompt, 20)
    V = model.cfg.vocab_size

    def hook(req, proposed):  # right, right, wrong: two accepted, the rest rejected
        gen = len(req.output_token_ids)
        true = (ref[gen:gen + len(proposed)] + proposed)[:len(proposed)]
        return [t if j < 2 else (t + 1) % V for j, t in enumerate(true)]

    spec = LLM(model, num_speculative_tokens=4, dspark_threshold=0.0, max_model_len=64).engine
    spec.spec.force_drafts = hook
    spec.add_request("x", prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    for _ in range(5):
        spec.step()
    req = spec.scheduler.running[0]
    n = req.num_computed
    assert n > len(prompt) + 8 and spec.stats()["spec"]["acceptance_per_position"][2] == 0.0
    assert req.output_token_ids == ref[:len(req.output_token_ids)]
    # the DSpark rings: exactly the last W committed positions, rows of the full forward's features
    _ring_matches_full_forward(model, spec, req)
    # the target's live cache rows: as a run that decoded the accepted tokens only
    plain = LLM(model, max_model_len=64).engine
    plain.add_request("x", prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    while not plain.scheduler.running or plain.scheduler.running[0].num_computed < n:
        plain.step()
    preq = plain.scheduler.running[0]
    assert preq.num_computed == n
    got, exp = _live(spec, req), _live(plain, preq)
    assert got.keys() == exp.keys()
    for key in exp:
        torch.testing.assert_close(got[key], exp[key], rtol=1e-4, atol=1e-5, msg=key)


def _target_probs(model, seq, top_k, temp):
    with torch.no_grad():
        z = model(torch.tensor([seq]))[0, -1].double() / temp
    keep = torch.topk(z, top_k).indices
    p = torch.zeros_like(z)
    p[keep] = torch.softmax(z[keep], 0)
    return p


def test_seeded_sampling_follows_the_target(model):
    """Many seeds, one prompt, top-k 3 at temperature 1.5; the drafter proposes the greedy
    bigrams (often accepted, often not): the first token (sampled after the prefill) and the
    second (verified against the draft; exact acceptance with DSpark's q) follow the target's
    distributions; sampling is reproducible per seed."""
    prompt = _prompts([5], seed=3)[0]
    K, T, N = 3, 1.5, 300
    p0 = _target_probs(model, prompt, K, T)
    firsts = torch.nonzero(p0).flatten().tolist()
    p1 = {t: _target_probs(model, prompt + [t], K, T) for t in firsts}
    cont = [int(p0.argmax())] + [int(p1[int(p0.argmax())].argmax())]
    with _Swap(model, *_bigram_head(model, prompt, cont)):
        llm = LLM(model, num_speculative_tokens=2, dspark_threshold=0.0, max_model_len=32, max_num_seqs=100)
        # 3 tokens: the second is a verified draft (drafts stop one short of max_tokens)
        sp = [SamplingParams(max_tokens=3, temperature=T, top_k=K, seed=1000 + i, ignore_eos=True) for i in range(N)]
        outs = [o.token_ids for o in llm.generate([prompt] * N, sp)]
        again = [o.token_ids for o in LLM(model, num_speculative_tokens=2, dspark_threshold=0.0, max_model_len=32,
                                          max_num_seqs=7).generate([prompt] * 20, sp[:20])]
    assert again == outs[:20]
    st = llm.engine.stats()["spec"]
    assert 0.0 < st["acceptance_per_position"][0] < 1.0, st
    V = model.cfg.vocab_size
    ok, info = chi2_ok(np.bincount([o[0] for o in outs], minlength=V), p0.numpy(), N)
    assert ok, info
    # second token: pooled over the first, expected sum_t p0(t) p1(. | t)
    p_second = sum(p0[t] * p1[t] for t in firsts).numpy()
    ok, info = chi2_ok(np.bincount([o[1] for o in outs], minlength=V), p_second, N)
    assert ok, info


def test_method_selection_and_validation(model, caplog):
    # V4.1 without speculation: no DSpark runner, no rings
    eng = LLM(model, max_model_len=32).engine
    assert eng.runner.dspark is None and eng.cache.dspark is None
    with pytest.raises(ValueError, match="spec_method"):
        LLM(model, num_speculative_tokens=2, spec_method="mtp")
    with pytest.raises(ValueError, match="spec_method"):
        LLM(model, num_speculative_tokens=2, spec_method="eagle")
    with pytest.raises(ValueError, match="dspark_threshold"):
        LLM(model, num_speculative_tokens=2, dspark_threshold=1.5)
    with pytest.raises(ValueError, match="num_speculative_tokens must be <= dspark_block_size"):
        LLM(model, num_speculative_tokens=model.cfg.dspark_block_size + 1)
    with pytest.raises(ValueError, match="swa_replay_window"):
        LLM(model, num_speculative_tokens=2, swa_replay_window=8)
    with caplog.at_level(logging.WARNING, logger="deepfuse.engine"):
        llm = LLM(model, num_speculative_tokens=2, overlap=True, cuda_graphs=True, max_model_len=32)
    assert "turned off" not in caplog.text  # DSpark runs with graphs and overlap as asked
    assert llm.engine.overlap and llm.engine.runner.graphs is not None
    assert llm.engine.runner.graphs.features is llm.engine.runner.dspark and not llm.engine.runner.graphs.mtp_graphs
    p = _prompts([4])[0]
    assert _greedy_ok(model, p, llm.generate([p], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids)


def test_v4_keeps_the_mtp_chain():
    v4 = tiny.load()
    llm = LLM(v4, num_speculative_tokens=2, max_total_tokens=600)
    assert llm.engine.runner.dspark is None
    p = _prompts([9])[0]
    out = llm.generate([p], SamplingParams(max_tokens=5, ignore_eos=True))[0].token_ids
    assert _greedy_ok(v4, p, out) and llm.engine.stats()["spec"]["verify_steps"] > 0
    with pytest.raises(ValueError, match="spec_method 'dspark' needs a model with a DSpark head"):
        LLM(v4, num_speculative_tokens=2, spec_method="dspark")
