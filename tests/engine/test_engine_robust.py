"""One client can never hurt another (CPU, tiny model, fp32): every out-of-range request is
rejected with a ValueError naming its field; a request that fails inside a step ends with
finish_reason "error" while the others go on; prompt logprobs; max_tokens 0; fair chunked
prefill."""
import pytest
import torch

from deepfuse import models
from deepfuse.engine import LLM, RequestOutput, SamplingParams

from test_engine import assert_cache_empty, full_greedy_agrees, prompts_for


@pytest.fixture(scope="module")
def tiny():
    return models.tiny.load()


def run(eng, reqs, max_steps=3000):
    """Add (id, prompt, params[, constraint]) requests, step to the end -> {id: accumulated output}."""
    for r in reqs:
        eng.add_request(r[0], r[1], r[2], constraint=r[3] if len(r) > 3 else None)
    got: dict[str, RequestOutput] = {}
    steps = 0
    while eng.has_unfinished():
        for o in eng.step():
            a = got.setdefault(o.request_id, RequestOutput(o.request_id, o.prompt_token_ids, []))
            a.token_ids += o.token_ids
            if o.prompt_logprobs is not None:
                assert a.prompt_logprobs is None, "prompt logprobs delivered twice"
                a.prompt_logprobs, a.prompt_top_logprobs = o.prompt_logprobs, o.prompt_top_logprobs
            if o.finished:
                a.finished, a.finish_reason, a.error = True, o.finish_reason, o.error
        steps += 1
        assert steps < max_steps
    return got


# ----------------------------------------------------------------------------- validation
def test_sampling_params_ranges(tiny):
    llm = LLM(tiny, max_total_tokens=500, max_model_len=400)
    eng = llm.engine
    V = tiny.cfg.vocab_size
    bad = [
        (dict(top_k=2 ** 31), "top_k"), (dict(top_k=-1), "top_k"), (dict(top_k=1.5), "top_k"),
        (dict(top_p=0.0), "top_p"), (dict(top_p=float("nan")), "top_p"), (dict(top_p=float("inf")), "top_p"),
        (dict(min_p=1.5), "min_p"), (dict(min_p=float("nan")), "min_p"),
        (dict(temperature=float("inf")), "temperature"), (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=10 ** 400), "temperature"), (dict(temperature=-1e-40), "temperature"),
        (dict(temperature="1"), "temperature"),
        (dict(seed=2 ** 64), "seed"), (dict(seed=-1), "seed"), (dict(seed=1.0), "seed"),
        (dict(max_tokens=2 ** 64), "max_tokens"), (dict(max_tokens=-1), "max_tokens"),
        (dict(max_tokens=True), "max_tokens"),
        (dict(stop_token_ids="ab"), "stop_token_ids"), (dict(stop_token_ids=[1.0]), "stop_token_ids"),
        (dict(stop_token_ids=object()), "stop_token_ids"),
        (dict(logprobs=21), "logprobs"), (dict(prompt_logprobs=-1), "prompt_logprobs"),
        (dict(prompt_logprobs=True), "prompt_logprobs"), (dict(ignore_eos=1), "ignore_eos"),
        (dict(foo=1), "foo"),
    ]
    for kw, word in bad:
        with pytest.raises(ValueError, match=f"^deepfuse: .*{word}"):
            SamplingParams(**kw)
    assert SamplingParams(stop_token_ids=5).stop_token_ids == (5,)
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()
    SamplingParams(seed=2 ** 64 - 1, top_k=2 ** 31 - 1, max_tokens=0, top_p=5e-324, temperature=1e-40)
    for sp, word in [(SamplingParams(stop_token_ids=[-1]), "stop_token_ids"),
                     (SamplingParams(stop_token_ids=[V]), "stop_token_ids"),
                     (SamplingParams(max_tokens=2 ** 63 - 1), "max_model_len")]:
        with pytest.raises(ValueError, match=f"^deepfuse: .*{word}"):
            eng.add_request("x", [1, 2], sp)
    sp = SamplingParams()
    sp.top_k = 2 ** 40  # changed after construction: add_request validates again
    with pytest.raises(ValueError, match="top_k"):
        eng.add_request("x", [1, 2], sp)
    with pytest.raises(ValueError, match="foo.*options:.*max_num_seqs"):
        LLM(tiny, foo=1)
    assert not eng.has_unfinished()


def test_extreme_values_that_are_accepted(tiny):
    """top_p that rounds to 0 keeps the top token, temperature in the fp32-denormal range is
    greedy, top_k beyond the vocabulary is no filter: no step fails, no garbage is sampled."""
    p = prompts_for([30], tiny.cfg.vocab_size, seed=4)[0]
    llm = LLM(tiny, max_total_tokens=1000)
    greedy = llm.generate([p], SamplingParams(max_tokens=5, ignore_eos=True))[0].token_ids
    outs = llm.generate([p] * 4, [
        SamplingParams(max_tokens=5, ignore_eos=True, temperature=1.0, top_p=5e-324, seed=1),
        SamplingParams(max_tokens=5, ignore_eos=True, temperature=1e-40, seed=2),
        SamplingParams(max_tokens=5, ignore_eos=True, temperature=1e-6, top_k=3, seed=3),
        SamplingParams(max_tokens=5, ignore_eos=True, temperature=1.0, top_k=2 ** 31 - 1, seed=4)])
    assert [o.finish_reason for o in outs] == ["length"] * 4
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids == greedy
    nofilter = llm.generate([p], SamplingParams(max_tokens=5, ignore_eos=True, temperature=1.0, seed=4))[0]
    assert outs[3].token_ids == nofilter.token_ids
    assert_cache_empty(llm.engine)


# ----------------------------------------------------------------------------- failure isolation
class Raises:
    """A constraint that allows everything and raises in `where` at its `at`-th call."""

    def __init__(self, where, at):
        self.where, self.at, self.calls = where, at, 0

    def _tick(self, name):
        if name == self.where:
            self.calls += 1
            if self.calls == self.at:
                raise RuntimeError(f"boom in {name}")

    def fill_next_token_bitmask(self, mask, row):
        self._tick("fill")

    def accept_token(self, tok):
        self._tick("accept")
        return True

    def is_terminated(self):
        self._tick("term")
        return False


@pytest.mark.parametrize("k", [0, 2])
def test_raising_constraint_next_to_good_requests(tiny, k):
    prompts = prompts_for([20, 45, 9, 70, 33], tiny.cfg.vocab_size, seed=11)
    eng = LLM(tiny, max_num_seqs=4, max_num_batched_tokens=40, max_total_tokens=1000,
              num_speculative_tokens=k).engine
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    got = run(eng, [("good0", prompts[0], sp), ("fill", prompts[1], sp, Raises("fill", 3)),
                    ("good1", prompts[2], sp), ("accept", prompts[3], sp, Raises("accept", 2)),
                    ("term", prompts[4], sp, Raises("term", 1))])
    for rid in ("fill", "accept", "term"):
        assert got[rid].finish_reason == "error" and "boom" in got[rid].error, rid
    assert len(got["fill"].token_ids) == 2 and len(got["accept"].token_ids) == 2
    for rid, p in (("good0", prompts[0]), ("good1", prompts[2])):
        o = got[rid]
        assert o.finish_reason == "length" and o.error is None and len(o.token_ids) == 8
        assert full_greedy_agrees(tiny, p, o.token_ids)
    assert_cache_empty(eng)


POISON = 4242


def poison_forward(model, calls):
    """Make the model's step forward raise whenever the step holds the poison token."""
    orig = model.forward_step

    def forward_step(ctx, cache, **kw):
        calls.append(1)
        if bool((ctx.input_ids == POISON).any()):
            raise RuntimeError("poisoned row")
        return orig(ctx, cache, **kw)
    return forward_step


@pytest.mark.parametrize("mode", ["sync", "overlap", "spec"])
def test_forward_failure_of_one_request(tiny, monkeypatch, mode):
    """A forward that fails for one request's rows (prefill or decode) ends that request with
    the error; the others (in the same steps) give their full-forward greedy tokens."""
    V = tiny.cfg.vocab_size
    prompts = [[t if t != POISON else 1 for t in p] for p in prompts_for([30, 150, 12, 64, 5], V, seed=12)]
    bad_prefill = prompts[1][:70] + [POISON] + prompts[1][70:]
    kw = dict(overlap=mode == "overlap", num_speculative_tokens=2 if mode == "spec" else 0)
    llm = LLM(tiny, max_num_seqs=4, max_num_batched_tokens=37, max_total_tokens=700, **kw)
    eng = llm.engine
    calls = []
    monkeypatch.setattr(tiny, "forward_step", poison_forward(tiny, calls))
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    got = run(eng, [("a", prompts[0], sp), ("bad", bad_prefill, sp), ("b", prompts[2], sp),
                    ("c", prompts[3], SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, seed=3)),
                    ("d", prompts[4], sp)])
    assert got["bad"].finish_reason == "error" and "poisoned row" in got["bad"].error
    for rid, p in (("a", prompts[0]), ("b", prompts[2]), ("d", prompts[4])):
        assert got[rid].finish_reason == "length" and len(got[rid].token_ids) == 10, rid
        assert full_greedy_agrees(tiny, p, got[rid].token_ids), rid
    assert len(got["c"].token_ids) == 10
    assert_cache_empty(eng)
    # through LLM.generate: the failing request comes back with "error", the engine stays usable
    outs = llm.generate([prompts[0], [5, POISON, 7], prompts[2]], sp)
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert outs[0].token_ids == got["a"].token_ids and outs[2].token_ids == got["b"].token_ids
    monkeypatch.undo()
    assert llm.generate([prompts[3]], sp)[0].finish_reason == "length"
    assert_cache_empty(eng)


def test_drafting_failure_of_one_request(tiny, monkeypatch):
    """Under speculation the MTP layer raises for one request's rows: the step is isolated
    like any failing step (drafting is part of it): that request ends with the error, the
    others go on with their drafts."""
    V = tiny.cfg.vocab_size
    prompts = [[t if t != POISON else 1 for t in p] for p in prompts_for([30, 60, 12], V, seed=17)]
    prompts[1][40] = POISON
    llm = LLM(tiny, max_num_seqs=4, max_num_batched_tokens=37, max_total_tokens=700, num_speculative_tokens=2)
    orig = tiny.mtp_forward_step

    def mtp_forward_step(ctx, cache, streams, next_ids, layer=0, **kw):
        if bool((ctx.input_ids == POISON).any()):
            raise RuntimeError("poisoned draft")
        return orig(ctx, cache, streams, next_ids, layer, **kw)
    monkeypatch.setattr(tiny, "mtp_forward_step", mtp_forward_step)
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    got = run(llm.engine, [(f"r{i}", p, sp) for i, p in enumerate(prompts)])
    assert got["r1"].finish_reason == "error" and "drafting failed" in got["r1"].error
    for i in (0, 2):
        assert got[f"r{i}"].finish_reason == "length" and full_greedy_agrees(tiny, prompts[i], got[f"r{i}"].token_ids)
    assert llm.engine.spec.stats.verify_rows > 0
    assert_cache_empty(llm.engine)


def test_overlap_read_back_failure(tiny, monkeypatch):
    """Overlap: reading a step back fails; the requests with rows in it end with the error,
    the step launched after it is dropped (its other requests are recomputed), and the
    engine goes on."""
    V = tiny.cfg.vocab_size
    short_p, long_p, late_p = prompts_for([5, 300, 9], V, seed=19)
    eng = LLM(tiny, max_num_batched_tokens=32, max_total_tokens=1000, overlap=True).engine
    orig, calls = eng._settle, []

    def settle(f):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("lost the step")
        return orig(f)
    monkeypatch.setattr(eng, "_settle", settle)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    eng.add_request("short", short_p, sp)
    eng.add_request("long", long_p, sp)
    got: dict[str, RequestOutput] = {}
    for step in range(200):
        if step == 6:
            eng.add_request("late", late_p, sp)
        for o in eng.step():
            a = got.setdefault(o.request_id, RequestOutput(o.request_id, o.prompt_token_ids, []))
            a.token_ids += o.token_ids
            if o.finished:
                a.finish_reason, a.error = o.finish_reason, o.error
        if not eng.has_unfinished():
            break
    assert got["short"].finish_reason == "error" and "lost the step" in got["short"].error
    for rid, p in (("long", long_p), ("late", late_p)):
        assert got[rid].finish_reason == "length" and full_greedy_agrees(tiny, p, got[rid].token_ids), rid
    assert_cache_empty(eng)


def test_sampler_failure_of_one_row(tiny, monkeypatch):
    """The sampler raises for a batch that holds one request's seed: bisection finds it."""
    prompts = prompts_for([8, 40, 17, 3], tiny.cfg.vocab_size, seed=13)
    llm = LLM(tiny, max_num_batched_tokens=64, max_total_tokens=1000)
    sampler = llm.engine.runner.sampler
    orig = type(sampler).__call__

    def call(self, logits, batch):
        if bool((batch.seed == 666).any()):
            raise ValueError("value cannot be converted to type int32 without overflow")
        return orig(self, logits, batch)
    monkeypatch.setattr(type(sampler), "__call__", call)
    params = [SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0, seed=s) for s in (1, 666, 2, 3)]
    outs = llm.generate(prompts, params)
    assert [o.finish_reason for o in outs] == ["length", "error", "length", "length"]
    assert "int32" in outs[1].error and outs[1].token_ids == []
    monkeypatch.undo()
    ref = LLM(tiny, max_total_tokens=1000).generate(prompts, params)
    for i in (0, 2, 3):
        assert outs[i].token_ids == ref[i].token_ids
    assert_cache_empty(llm.engine)


def test_unattributable_failure_ends_the_step_requests(tiny, monkeypatch):
    """Every step fails, alone or together: all requests end with the error, none hangs."""
    llm = LLM(tiny, max_total_tokens=1000)

    def broken(ctx, cache, **kw):
        raise RuntimeError("device lost")
    monkeypatch.setattr(tiny, "forward_step", broken)
    outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=3))
    assert [(o.finish_reason, o.error) for o in outs] == [("error", "RuntimeError: device lost")] * 2
    monkeypatch.undo()
    assert_cache_empty(llm.engine)


# ----------------------------------------------------------------------------- prompt logprobs
def reference_prompt_logprobs(model, prompt, n):
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt]))[0].float(), dim=-1)
    vals = [None] + [lp[j - 1, prompt[j]].item() for j in range(1, len(prompt))]
    tv, ti = torch.topk(lp, n, dim=-1)
    tops = [None] + [dict(zip(ti[j - 1].tolist(), tv[j - 1].tolist())) for j in range(1, len(prompt))]
    return vals, tops


@pytest.mark.parametrize("overlap,prefix", [(False, False), (True, False), (False, True), (True, True)])
def test_prompt_logprobs_match_full_forward(tiny, overlap, prefix):
    V = tiny.cfg.vocab_size
    prompts = prompts_for([150, 1, 23, 40], V, seed=14)
    prompts[3] = prompts[0][:100] + prompts[3]  # shares a 100-token prefix with prompt 0
    llm = LLM(tiny, max_num_seqs=3, max_num_batched_tokens=29, max_total_tokens=800, overlap=overlap,
              enable_prefix_caching=prefix)
    eng = llm.engine
    warm = [("w0", prompts[0][:70], SamplingParams(max_tokens=2)), ("w3", prompts[3][:110], SamplingParams(max_tokens=2))]
    run(eng, warm)  # the prefix cache now holds these prompts' states
    hits = eng.prefix.num_hits if prefix else 0
    sp = [SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=3),
          SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=0),
          SamplingParams(max_tokens=5, ignore_eos=True),
          SamplingParams(max_tokens=0, prompt_logprobs=2)]
    got = run(eng, [(f"p{i}", p, s) for i, (p, s) in enumerate(zip(prompts, sp))])
    for i, p in enumerate(prompts):
        o = got[f"p{i}"]
        n = sp[i].prompt_logprobs
        if n is None:
            assert o.prompt_logprobs is None
        else:
            vals, tops = reference_prompt_logprobs(tiny, p, max(n, 1))
            assert len(o.prompt_logprobs) == len(p) and o.prompt_logprobs[0] is None
            assert o.prompt_logprobs[1:] == pytest.approx(vals[1:], abs=1e-4), i
            if n == 0:
                assert o.prompt_top_logprobs is None
            else:
                assert o.prompt_top_logprobs[0] is None
                for j in range(1, len(p)):
                    assert list(o.prompt_top_logprobs[j]) == list(tops[j]), (i, j)
                    assert list(o.prompt_top_logprobs[j].values()) == pytest.approx(list(tops[j].values()), abs=1e-4)
        if sp[i].max_tokens:
            assert o.finish_reason == "length" and full_greedy_agrees(tiny, p, o.token_ids)
    assert got["p3"].token_ids == [] and got["p3"].finish_reason == "length"
    if prefix:
        assert eng.prefix.num_hits == hits  # p0 and p3 would hit: requests with prompt logprobs skip the lookup
        run(eng, [("control", prompts[0][:90], SamplingParams(max_tokens=1))])
        assert eng.prefix.num_hits == hits + 1
        eng.prefix.clear()
    assert_cache_empty(eng)


def test_prompt_logprobs_with_speculation_and_preemption(tiny):
    V = tiny.cfg.vocab_size
    prompts = prompts_for([120, 90, 60, 33], V, seed=18)
    llm = LLM(tiny, max_num_seqs=4, max_num_batched_tokens=23, max_total_tokens=260, num_speculative_tokens=2)
    sp = [SamplingParams(max_tokens=20, ignore_eos=True, prompt_logprobs=i % 2) for i in range(len(prompts))]
    outs = llm.generate(prompts, sp)
    assert llm.engine.stats()["num_preemptions"] > 0
    for p, o, s in zip(prompts, outs, sp):
        vals, _ = reference_prompt_logprobs(tiny, p, 1)
        assert o.prompt_logprobs[1:] == pytest.approx(vals[1:], abs=1e-4)
        assert (o.prompt_top_logprobs is None) == (s.prompt_logprobs == 0)
        assert len(o.token_ids) == 20 and full_greedy_agrees(tiny, p, o.token_ids)
    assert_cache_empty(llm.engine)


def test_max_tokens_zero_through_llm(tiny):
    p = prompts_for([25], tiny.cfg.vocab_size, seed=15)[0]
    llm = LLM(tiny, max_total_tokens=200, max_model_len=25)
    o = llm.generate([p, p], [SamplingParams(max_tokens=0, prompt_logprobs=1), SamplingParams(max_tokens=0)])
    assert [(x.token_ids, x.finish_reason) for x in o] == [([], "length")] * 2
    vals, _ = reference_prompt_logprobs(tiny, p, 1)
    assert o[0].prompt_logprobs[1:] == pytest.approx(vals[1:], abs=1e-4) and o[1].prompt_logprobs is None
    assert_cache_empty(llm.engine)


# ----------------------------------------------------------------------------- fair prefill
@pytest.mark.parametrize("overlap", [False, True])
def test_short_request_is_not_stuck_behind_a_long_prefill(tiny, overlap):
    V = tiny.cfg.vocab_size
    long_p, short_p, dec_p = prompts_for([390, 8, 5], V, seed=16)
    eng = LLM(tiny, max_num_batched_tokens=32, max_total_tokens=2000, overlap=overlap).engine
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    eng.add_request("dec", dec_p, sp)
    got: dict[str, list] = {}
    first_step: dict[str, int] = {}
    decode_steps = []
    for step in range(200):
        if step == 2:
            eng.add_request("long", long_p, SamplingParams(max_tokens=3, ignore_eos=True))
        if step == 5:  # the long prefill (390 tokens, 32 a step) is under way
            eng.add_request("short", short_p, SamplingParams(max_tokens=3, ignore_eos=True))
        for o in eng.step():
            if o.token_ids:
                first_step.setdefault(o.request_id, step)
                if o.request_id == "dec":
                    decode_steps.append(step)
            got.setdefault(o.request_id, []).extend(o.token_ids)
        if not eng.has_unfinished():
            break
    lag = 1 if overlap else 0  # overlap reports a step's tokens one call later
    assert first_step["short"] <= 6 + lag, first_step
    assert first_step["long"] > first_step["short"]
    # the running request decodes in every step while the long prefill runs
    assert decode_steps[:30] == list(range(decode_steps[0], decode_steps[0] + 30))
    for rid, p in (("long", long_p), ("short", short_p), ("dec", dec_p)):
        assert full_greedy_agrees(tiny, p, got[rid]), rid
    assert_cache_empty(eng)
