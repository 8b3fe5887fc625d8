"""Speculative decoding with the MTP layer (CPU, fp32, lossless caches)."""
import numpy as np
import pytest
import torch

from deepfuse import models
from deepfuse.engine import LLM, SamplingParams
from deepfuse.engine.sampler import Sampler, SamplingBatch, derive_seed
from deepfuse.engine.speculative import DRAFT, SpecDecoder, accept_drafts

from engine_util import chi2_ok, run_chunks
from test_engine import assert_cache_empty, full_greedy_agrees, prompts_for

LENS = [1, 5, 17, 40, 130, 260, 3, 99]


@pytest.fixture(scope="module")
def tiny():
    return models.tiny.load()


@pytest.fixture(scope="module")
def reference(tiny):
    """Greedy continuations without speculation."""
    prompts = prompts_for(LENS, tiny.cfg.vocab_size)
    mts = [1 + (7 * i) % 19 for i in range(len(prompts))]
    outs = LLM(tiny, max_total_tokens=3000).generate(prompts, [SamplingParams(max_tokens=m, ignore_eos=True)
                                                               for m in mts])
    return prompts, mts, [o.token_ids for o in outs]


def run_spec(tiny, prompts, mts, k, force=None, **kw):
    llm = LLM(tiny, max_num_seqs=4, max_num_batched_tokens=37, num_speculative_tokens=k,
              **{"max_total_tokens": 900, **kw})
    if force is not None:
        llm.engine.spec.force_drafts = force
    outs = llm.generate(prompts, [SamplingParams(max_tokens=m, ignore_eos=True) for m in mts])
    return llm, [o.token_ids for o in outs]


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_with_mtp_drafts_equals_greedy(tiny, reference, k):
    prompts, mts, ref = reference
    llm, got = run_spec(tiny, prompts, mts, k, max_total_tokens=600)  # small: requests queue / preempt
    assert got == ref
    for p, t in zip(prompts, got):
        assert full_greedy_agrees(tiny, p, t)
    st = llm.engine.stats()["spec"]
    assert st["num_speculative_tokens"] == k and st["verify_steps"] > 0
    assert_cache_empty(llm.engine)


def forced(ref_by_prompt, V, wrong_at=None):
    """force_drafts hook: the true greedy continuation, optionally wrong at one position."""
    def f(req, proposed):
        gen = len(req.output_token_ids)
        true = ref_by_prompt[tuple(req.prompt_token_ids)][gen:gen + len(proposed)]
        true = true + proposed[len(true):]
        if wrong_at == "all":
            return [(t + 1) % V for t in true]
        if wrong_at is not None and wrong_at < len(true):
            true = list(true)
            true[wrong_at] = (true[wrong_at] + 1) % V
        return true
    return f


@pytest.mark.parametrize("k,wrong", [(3, None), (3, "all"), (3, 0), (3, 1), (4, 2), (1, None), (2, 1)])
def test_forced_drafts_every_accept_length(tiny, reference, k, wrong):
    prompts, mts, ref = reference
    by_prompt = {tuple(p): r for p, r in zip(prompts, ref)}
    llm, got = run_spec(tiny, prompts, mts, k, force=forced(by_prompt, tiny.cfg.vocab_size, wrong))
    assert got == ref
    acc = llm.engine.stats()["spec"]["acceptance_per_position"]
    for j, a in enumerate(acc):
        if a is None:
            continue
        if wrong is None:
            assert a == 1.0
        elif wrong == "all":
            assert a == 0.0
        else:
            assert a == (1.0 if j < wrong else 0.0), (j, acc)
    st = llm.engine.stats()["spec"]
    if wrong is None:
        assert st["mean_accepted_length"] > 1.5


def assert_live_state_is_plain(model, got: dict, n: int, prompt, max_tokens: int = 40) -> None:
    """`got` (live_state after n positions) equals the same rows of a plain greedy run of
    `prompt` on `model` stopped at n (fp32 batching noise ~3e-6)."""
    plain = LLM(model, max_total_tokens=2000).engine
    plain.add_request("x", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    plain.step()
    while plain.scheduler.running[0].num_computed < n:
        plain.step()
    want, n2 = live_state(plain, "x")
    assert n2 == n and got.keys() == want.keys()
    for key in want:
        assert got[key].shape == want[key].shape, key
        torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-5, msg=key)


def live_state(eng, rid: str) -> dict:
    """The rows of a request's cache that later steps can read, by position / entry."""
    req = next(r for r in eng.scheduler.running if r.request_id == rid)
    c, n, s = eng.cache, req.num_computed, req.cache.slot
    g = c.geometry
    L = len(eng.model.layers)
    out = {"ring": c.ring[:L, s, [p % g.ring_rows for p in range(max(0, n - g.window + 1), n)]].clone()}
    for (r, overlap) in g.schedules:
        ps = c.page_size
        e = np.arange(n // r)
        slots = torch.from_numpy(c.host_block_tables[r][s, e // ps] * ps + e % ps)
        out[f"comp{r}"] = c.comp[r].flatten(1, 2)[:, slots].clone()
        if overlap:
            out["index"] = c.index.flatten(1, 2)[:, slots].clone()
        R = 2 * r if overlap else r
        Rs = R + g.state_extra
        rows = [s * Rs + p % Rs for p in range(max(0, n - R + 1), n)]
        for name in ("attn", "index"):
            if (r, name) in c.states:
                kv, sc = c.states[(r, name)]
                out[f"state{r}{name}"] = torch.cat([kv[:, rows], sc[:, rows]], -1).clone()
    return out, n


@pytest.mark.parametrize("graphs,overlap", [(False, False), (True, True)], ids=["plain", "graphs+overlap"])
def test_rejected_drafts_leave_no_trace(tiny, graphs, overlap):
    """After verify steps with rejections, every live cache row equals that of a run that
    decoded only the accepted tokens (also with padded graph steps and overlap, whose
    step in flight is settled first)."""
    p = prompts_for([150], tiny.cfg.vocab_size, seed=21)[0]
    ref = LLM(tiny, max_total_tokens=2000).generate([p], SamplingParams(max_tokens=40, ignore_eos=True))[0].token_ids
    V = tiny.cfg.vocab_size

    def hook(req, proposed):  # right, right, wrong, ...: two accepted, the rest rejected
        gen = len(req.output_token_ids)
        true = (ref[gen:gen + len(proposed)] + proposed)[:len(proposed)]
        return [t if j < 2 else (t + 1) % V for j, t in enumerate(true)]

    spec = LLM(tiny, max_total_tokens=2000, num_speculative_tokens=4, cuda_graphs=graphs, overlap=overlap).engine
    spec.spec.force_drafts = hook
    spec.add_request("x", p, SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(8):
        spec.step()
    if spec._inflight is not None:
        f, spec._inflight = spec._inflight, None
        spec._settle(f)
    if graphs:
        assert any(T == 5 for _, T in spec.runner.graphs.graphs) and spec.runner.graphs.chains
    got, n = live_state(spec, "x")
    assert n > len(p) + 10 and spec.stats()["spec"]["acceptance_per_position"][2] == 0.0
    assert_live_state_is_plain(tiny, got, n, p)


def test_mtp_flat_step_matches_full_mtp_forward(tiny):
    from deepfuse.engine.cache import CacheManager
    from deepfuse.engine.context import build_context

    T = 150
    g = torch.Generator().manual_seed(9)
    x = torch.randint(0, tiny.cfg.vocab_size, (2, T + 1), generator=g)
    with torch.no_grad():
        _, streams = tiny(x[:, :T], return_streams=True)
        full, _ = tiny.mtp_forward(streams, x[:, 1:T + 1])
    cache = CacheManager(tiny.cfg, model_dtype=torch.float32, device="cpu", max_num_seqs=2,
                         max_num_batched_tokens=2 * T, max_total_tokens=2 * T + 64, max_model_len=T + 64,
                         page_size=16, num_mtp_layers=1)
    rcs = [cache.admit() for _ in range(2)]
    outs = []
    for a, b in zip([0, 40, 41, 100], [40, 41, 100, T]):
        for rc in rcs:
            cache.grow(rc, b)
        cache.flush()
        n = b - a
        ctx = build_context(x[:, a:b].reshape(-1).numpy(), np.full(2, a), np.full(2, n), np.array([0, 1]),
                            np.full(2, n), cache.geometry, cache.block_tables, "cpu", cache.host_block_tables)
        with torch.no_grad():
            _, xs = tiny.forward_step(ctx, cache, return_streams=True)
            mctx = build_context(x[:, a + 1:b + 1].reshape(-1).numpy(), np.full(2, a), np.full(2, n), np.array([0, 1]),
                                 np.full(2, n), cache.geometry, cache.block_tables, "cpu", cache.host_block_tables)
            lg, _ = tiny.mtp_forward_step(mctx, cache, xs, mctx.input_ids)
        outs.append(lg.view(2, n, -1))
    got = torch.cat(outs, 1)
    err = ((got - full).norm() / full.norm()).item()
    assert err < 1e-5, err
    # the main model through the same chunks still matches its full forward
    assert run_chunks(tiny, x[:, :T], [0, 40, 41, 100, T]).shape == (2, T, tiny.cfg.vocab_size)


def test_mtp_rows_only_pass_writes_every_row(tiny):
    """mtp_forward_step(rows_only=True) (the drafts' teacher-forced pass: the FFN half at the
    logits rows only): the logits and streams of those rows equal the full pass's, and the
    cache rows it writes serve a later full chunk exactly as the full pass's do."""
    from deepfuse.engine.cache import CacheManager
    from deepfuse.engine.context import build_context

    T = 150
    g = torch.Generator().manual_seed(11)
    x = torch.randint(0, tiny.cfg.vocab_size, (2, T + 1), generator=g)
    caches = [CacheManager(tiny.cfg, model_dtype=torch.float32, device="cpu", max_num_seqs=2,
                           max_num_batched_tokens=2 * T, max_total_tokens=2 * T + 64, max_model_len=T + 64,
                           page_size=16, num_mtp_layers=1) for _ in range(2)]
    for cache in caches:
        for rc in [cache.admit() for _ in range(2)]:
            cache.grow(rc, T)
        cache.flush()
    for a, b in zip([0, 60, 100], [60, 100, T]):
        n = b - a
        outs = []
        for only, cache in zip((False, True), caches):
            def ctx_of(ids, nl):
                return build_context(ids.reshape(-1).numpy(), np.full(2, a), np.full(2, n), np.array([0, 1]),
                                     np.full(2, nl), cache.geometry, cache.block_tables, "cpu", cache.host_block_tables)
            with torch.no_grad():
                _, xs = tiny.forward_step(ctx_of(x[:, a:b], n), cache, return_streams=True)
                mctx = ctx_of(x[:, a + 1:b + 1], n)
                if b < T:  # drafting rows: the last of request 0, two of request 1
                    mctx.logits_indices = torch.tensor([n - 1, n + 3, 2 * n - 1])
                    lg, ys = tiny.mtp_forward_step(mctx, cache, xs, mctx.input_ids, rows_only=only)
                    outs.append((lg, ys if only else ys[mctx.logits_indices]))
                else:  # a full chunk on the rows each pass wrote
                    outs.append(tiny.mtp_forward_step(mctx, cache, xs, mctx.input_ids))
        assert outs[1][1].shape[0] == outs[0][1].shape[0]
        for u, v in zip(outs[0], outs[1]):
            assert torch.allclose(u, v, rtol=1e-5, atol=1e-5), (a, b)



@pytest.mark.parametrize("case", ["plain", "topk", "topp", "close_q", "bad_q"])
def test_rejection_sampling_emits_the_target_distribution(case):
    """Many independent requests (seeds) verify k = 2 drafts drawn from q against fixed target
    rows p: the first emitted token must follow p_0; given that the first draft was kept,
    the second must follow p_1."""
    V, N, k = 10, 20000, 2
    g = torch.Generator().manual_seed(3)
    tl = torch.randn(k + 1, V, generator=g) * 1.5
    ql = {"close_q": tl[:k] + 0.3 * torch.randn(k, V, generator=g), "bad_q": -tl[:k]}.get(
        case, torch.randn(k, V, generator=g))
    kw = {"topk": dict(top_k=4), "topp": dict(top_p=0.7)}.get(case, {})
    temp = 0.8
    s = Sampler()
    seeds = [1000 + i for i in range(N)]

    def batch(rows, pos, seed_list):
        return SamplingBatch.from_lists([temp] * rows, [kw.get("top_k", 0)] * rows, [kw.get("top_p", 1.0)] * rows,
                                        [0.0] * rows, seed_list, pos)

    # drafts d_1, d_2 ~ q (the draft stream), per request
    logq = s.log_probs(ql.repeat(N, 1), batch(N * k, [7, 8] * N, [derive_seed(x, DRAFT) for x in seeds for _ in range(k)]))
    d = s.sample_log_probs(logq, torch.tensor([derive_seed(x, DRAFT) for x in seeds for _ in range(k)]),
                           torch.tensor([7, 8] * N))
    logp = s.log_probs(tl.repeat(N, 1), batch(N * (k + 1), [7, 8, 9] * N, [x for x in seeds for _ in range(k + 1)]))
    # rows: for each request k verify rows (the drafts) + one bonus row
    vrows = torch.tensor([i * (k + 1) + j for i in range(N) for j in range(k)])
    acc, res = accept_drafts(s, logp[vrows], logq, d, [x for x in seeds for _ in range(k)], torch.tensor([7, 8] * N))
    acc, res, d = acc.view(N, k), res.view(N, k), d.view(N, k)
    p0 = logp[0].exp().numpy()
    p1 = logp[1].exp().numpy()
    first = torch.where(acc[:, 0], d[:, 0], res[:, 0]).numpy()
    ok, info = chi2_ok(np.bincount(first, minlength=V), p0, N)
    assert ok, info
    kept = acc[:, 0]
    second = torch.where(acc[:, 1], d[:, 1], res[:, 1])[kept].numpy()
    ok, info = chi2_ok(np.bincount(second, minlength=V), p1, len(second))
    assert ok, info
    if case == "bad_q":
        assert kept.float().mean() < 0.5
    if case == "close_q":
        assert kept.float().mean() > 0.5


def test_sampled_speculation_is_seeded_and_batch_independent(tiny):
    prompts = prompts_for([7, 90, 200], tiny.cfg.vocab_size, seed=13)
    sp = [SamplingParams(max_tokens=9, temperature=1.0, top_k=30, seed=50 + i, ignore_eos=True) for i in range(3)]
    a = LLM(tiny, max_total_tokens=2000, num_speculative_tokens=2).generate(prompts, sp)
    b = LLM(tiny, max_total_tokens=2000, num_speculative_tokens=2, max_num_batched_tokens=29).generate(prompts, sp)
    c = LLM(tiny, max_total_tokens=2000, num_speculative_tokens=2).generate([prompts[1]], sp[1])
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert c[0].token_ids == a[1].token_ids
    assert all(len(o.token_ids) == 9 for o in a)


def test_simulated_acceptance_and_validation(tiny):
    prompts = prompts_for([20, 60], tiny.cfg.vocab_size, seed=14)
    llm = LLM(tiny, max_total_tokens=2000, num_speculative_tokens=3, spec_simulate_acc_len=3.0)
    outs = llm.generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True))
    assert all(len(o.token_ids) == 30 for o in outs)
    st = llm.engine.stats()["spec"]
    assert 2.5 <= st["mean_accepted_length"] <= 3.0
    sim = SpecDecoder(tiny, 3, simulate_acc_len=3.25)  # a fraction: its mean over any run of draws, B = 1 too
    one = [int(sim.simulated_lengths(np.array([3]))[0]) for _ in range(8)]
    assert sorted(set(one)) == [2, 3] and sum(one) == 18
    assert sim.simulated_lengths(np.array([3, 0, 1, 3, 3, 3])).tolist() == [2, 0, 1, 2, 3, 2]  # capped: 1
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(tiny, num_speculative_tokens=-1)
    with pytest.raises(ValueError, match="spec_simulate_acc_len"):
        LLM(tiny, num_speculative_tokens=2, spec_simulate_acc_len=4.0)
    assert_cache_empty(llm.engine)


def test_fp8_draft_head_keeps_outputs_exact(tiny, reference):
    """spec_draft_head="fp8" (on the CPU the FP8 values through a dense head): the
    MTP drafts come from an FP8 copy of the lm head on every path (eager, padded graph
    steps, overlap with early steps), greedy outputs equal those without speculation, seeded
    outputs equal the plain loop's with the same drafts (q = the FP8 head's distribution)."""
    from deepfuse.engine.speculative import make_draft_head

    prompts, mts, ref = reference
    head = make_draft_head(tiny, "fp8")
    assert make_draft_head(tiny, "fp8") is head  # made once per model and weights
    w = head.weight  # on the CPU: the FP8 copy dequantised (the reference's arithmetic)
    assert not torch.equal(w, tiny.head.weight) and torch.allclose(w, tiny.head.weight, rtol=0.07, atol=1e-3)
    assert make_draft_head(tiny, None) is None and make_draft_head(tiny, "model") is None  # the default: the model's
    calls = []
    hook = head.register_forward_hook(lambda *a: calls.append(1))
    try:
        llm, got = run_spec(tiny, prompts[:5], mts[:5], 3, spec_draft_head="fp8")
        assert got == ref[:5] and calls
        assert llm.engine.stats()["spec"]["draft_head"] == "fp8"
        sp = [SamplingParams(max_tokens=14, temperature=0.9, top_k=40, seed=3 + i, ignore_eos=True) for i in range(3)]
        kw = dict(max_total_tokens=2000, num_speculative_tokens=3, spec_draft_head="fp8")
        plain = [o.token_ids for o in LLM(tiny, **kw).generate(prompts[1:4], sp)]
        for graphs, overlap in ((True, False), (True, True)):
            n = len(calls)
            llm = LLM(tiny, **kw, cuda_graphs=graphs, overlap=overlap)
            if graphs:
                llm.engine.runner.graphs.buckets = (2, 4)
            assert [o.token_ids for o in llm.generate(prompts[1:4], sp)] == plain, (graphs, overlap)
            assert len(calls) > n and (not overlap or llm.engine.runner.early_steps > 0)
    finally:
        hook.remove()
    with pytest.raises(ValueError, match="spec_draft_head"):
        LLM(tiny, num_speculative_tokens=2, spec_draft_head="fp4")
