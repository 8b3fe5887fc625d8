"""Decoder-side SWA bounded replay in the engine (EngineConfig.swa_replay_window, engine/replay.py;
APPROXIMATE by design, off by default) equals the model-level definition exactly:

    the engine's j-th generated token of a prompt of length P (j = 0, 1, ...) and its logits
    == V41Model.forward(prompt + generated[:j], replay_window=K + j)[:, -1]

(the late layers run the positions >= P - K of every request, their windows read nothing
below P - K; decode tokens run every layer), for any chunked prefill: chunks before, across
and after P - K, several requests of different P in one step. Tokens equal, logits to 1e-4.
Requests that want prompt logprobs run exactly; replay off is the exact engine; a mid-prefill
checkpoint a replayed request cannot vouch for is not saved in the prefix cache."""
import math

import pytest
import torch

from deepfuse.engine import LLM
from deepfuse.engine.replay import ReplayPlanner, make_replay
from deepfuse.engine.request import SamplingParams

NEW = 4
_REF: dict = {}


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 129280, (n,), generator=g).tolist() for n in (5, 17, 29, 40)]


@torch.no_grad()
def _ref(model, prompt, n, K):
    """Greedy tokens and logits rows of the model-level replay (K None: exact)."""
    key = (tuple(prompt), n, K, str(model.device))
    if key not in _REF:
        seq, rows = list(prompt), []
        for j in range(n):
            ids = torch.tensor([seq], device=model.device)
            row = (model(ids, replay_window=K + j) if K else model(ids))[0, -1]
            rows.append(row)
            seq.append(int(row.argmax()))
        _REF[key] = (seq[len(prompt):], rows)
    return _REF[key]


def _check(llm, prompts, outs, K, tol=1e-4):
    by_prompt = {tuple(o.prompt_token_ids): o for o in outs}
    rows = {}
    for ids, logits in llm.engine.runner.captured:
        for rid, row in zip(ids, logits):
            rows.setdefault(rid, []).append(row)
    for p in prompts:
        o = by_prompt[tuple(p)]
        toks, ref_rows = _ref(llm.model, p, NEW, K)
        assert o.token_ids == toks, (len(p), K)
        got = rows[o.request_id]
        assert len(got) == NEW
        for j, (a, b) in enumerate(zip(got, ref_rows)):
            err = float((a - b.cpu()).abs().max())
            assert err <= tol, (len(p), K, j, err)


@pytest.mark.parametrize("K,budget", [(8, 7), (12, 5), (12, 64), (16, 11)])
def test_engine_replay_equals_model_replay(prompts, K, budget):
    llm = LLM("tiny-v4.1", max_model_len=128, swa_replay_window=K, max_num_batched_tokens=budget)
    rp = llm.engine.runner.replay
    assert isinstance(rp, ReplayPlanner) and rp.layer == 6
    llm.engine.runner.captured = []
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW))
    _check(llm, prompts, outs, K)
    assert rp.steps > 0 and rp.skipped_tokens == sum(max(0, len(p) - K) for p in prompts)
    # vs the exact model: below the dependency halo (window + (late layers - 1) * (window - 1) =
    # 15 here) the first sampled row differs (replay really ran); at or above it, it is exact
    exact = [_ref(llm.model, p, NEW, None)[1][0] for p in prompts if len(p) > K]
    approx = [_ref(llm.model, p, NEW, K)[1][0] for p in prompts if len(p) > K]
    errs = [float((a - b).abs().max()) for a, b in zip(exact, approx)]
    assert max(errs) > 1e-3 if K < 15 else max(errs) < 1e-4, errs


def test_replay_overlap_loop(prompts):
    """The overlapped loop (tokens patched on the device before the narrowing) gives the same."""
    llm = LLM("tiny-v4.1", max_model_len=128, swa_replay_window=8, max_num_batched_tokens=9, overlap=True)
    llm.engine.runner.captured = []
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW))
    _check(llm, prompts, outs, 8)


def test_replay_off_is_exact(prompts):
    llm = LLM("tiny-v4.1", max_model_len=128, max_num_batched_tokens=7)
    assert llm.engine.config.swa_replay_window == 0 and llm.engine.runner.replay is None
    llm.engine.runner.captured = []
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW))
    _check(llm, prompts, outs, None)


def test_prompt_logprobs_run_exactly(prompts):
    """A request that wants prompt logprobs runs every layer on every row (floor 0), batched
    with replayed ones."""
    K = 8
    llm = LLM("tiny-v4.1", max_model_len=128, swa_replay_window=K, max_num_batched_tokens=13)
    eng = llm.engine
    eng.add_request("lp", prompts[3], SamplingParams(max_tokens=NEW, prompt_logprobs=0, logprobs=0))
    eng.add_request("rp", prompts[2], SamplingParams(max_tokens=NEW))
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            d = done.setdefault(o.request_id, {"toks": [], "plp": None, "lps": []})
            d["toks"] += o.token_ids
            d["lps"] += o.logprobs or []
            if o.prompt_logprobs is not None:
                d["plp"] = o.prompt_logprobs
    p = prompts[3]
    toks, _ = _ref(llm.model, p, NEW, None)
    assert done["lp"]["toks"] == toks
    full = torch.log_softmax(llm.model(torch.tensor([p + toks]))[0], -1)
    plp = done["lp"]["plp"]
    assert plp[0] is None and len(plp) == len(p)
    for i in range(1, len(p)):
        assert math.isclose(plp[i], float(full[i - 1, p[i]]), rel_tol=1e-3, abs_tol=1e-3)
    for i, (t, lp) in enumerate(zip(toks, done["lp"]["lps"])):
        assert math.isclose(lp, float(full[len(p) - 1 + i, t]), rel_tol=1e-3, abs_tol=1e-3)
    assert done["rp"]["toks"] == _ref(llm.model, prompts[2], NEW, K)[0]


def test_prefix_cache_with_replay():
    """A mid-prefill checkpoint of a replayed request (late window rows below its floor never
    written) is not saved: a later request that would hit it (and read those rows) computes
    from 0 and equals the model-level replay. A request extending a finished one hits that
    one's final state below its own floor and equals the model-level replay too."""
    K = 12
    g = torch.Generator().manual_seed(9)
    A = torch.randint(0, 129280, (100,), generator=g).tolist()
    C = A[:66] + torch.randint(0, 129280, (6,), generator=g).tolist()  # floor 60 < 64: would read rows 60..63
    llm = LLM("tiny-v4.1", max_model_len=160, swa_replay_window=K, max_num_batched_tokens=16,
              enable_prefix_caching=True, prefix_checkpoint=64)
    eng = llm.engine
    a = llm.generate([A], SamplingParams(max_tokens=NEW))[0]
    assert a.token_ids == _ref(llm.model, A, NEW, K)[0]
    llm.engine.runner.captured = []
    c = llm.generate([C], SamplingParams(max_tokens=NEW))[0]
    _check(llm, [C], [c], K)
    # extension of A's finished sequence: hits A's final state (n = 103 <= its floor 121 - 12 = 109)
    hits0 = eng.prefix.stats()["hit_tokens"]
    D = A + a.token_ids + torch.randint(0, 129280, (17,), generator=g).tolist()
    llm.engine.runner.captured = []
    d = llm.generate([D], SamplingParams(max_tokens=NEW))[0]
    assert eng.prefix.stats()["hit_tokens"] - hits0 >= 64
    _check(llm, [D], [d], K)


def test_errors():
    from deepfuse.models import tiny

    m = tiny.load("v4.1")
    for bad in (-1, 2.5, True, 7):  # 7 < the sliding window 8
        with pytest.raises(ValueError, match="swa_replay_window"):
            LLM(m, max_model_len=64, swa_replay_window=bad)

    class C:
        swa_replay_window = 0
    assert make_replay(m, C()) is None
    C.swa_replay_window, C.num_speculative_tokens = 16, 3
    with pytest.raises(ValueError, match="swa_replay_window with num_speculative_tokens"):
        make_replay(m, C())
    v4 = tiny.load("v4")
    with pytest.raises(ValueError, match="swa_replay_window needs a DeepSeek V4.1 model"):
        LLM(v4, max_model_len=64, swa_replay_window=16)


@pytest.mark.gpu
def test_cuda_engine_replay_equals_model_replay(prompts):
    """On the GPU (fp32 tiny, the overlapped loop: CUDA's default; pinned uploads): the engine with
    replay gives the model-level replay's tokens, logits within 2e-3 (kernels vs references)."""
    from deepfuse.models import tiny

    m = tiny.load("v4.1", device="cuda", dtype=torch.float32)
    llm = LLM(m, max_model_len=128, swa_replay_window=8, max_num_batched_tokens=7)
    llm.engine.runner.captured = []
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW))
    assert llm.engine.runner.replay.steps > 0
    _check(llm, prompts, outs, 8, tol=2e-3)
