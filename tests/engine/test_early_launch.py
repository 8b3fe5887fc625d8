"""Speculative steps launched before the previous step is read back (Engine._step_spec_overlap's
early path: the verify context built on the device from the previous step's acceptance,
the previous step committed while the next one runs). Every run must emit, per request,
the tokens, logprobs and finish reasons of the plain loop (no overlap, no graphs) with the
same k, and the early path must actually have run (ModelRunner.early_steps)."""
import numpy as np
import pytest
import torch

from deepfuse import models
from deepfuse.engine import LLM, SamplingParams
from deepfuse.engine.context import Padding, host_context, verify_arrays

from test_engine import assert_cache_empty, prompts_for
from test_speculative import assert_live_state_is_plain, live_state


_REFS: dict = {}


@pytest.fixture(scope="module")
def tiny():
    return models.tiny.load()


def _drive(model, k, *, overlap, graphs, temperature, stop=None, late=None, abort=None, **kw):
    """Run a fixed set of requests (one joins at step 3 when late is given; abort: (step,
    request id) to abort) -> ({id: (tokens, logprobs, finish reason)}, engine)."""
    prompts = prompts_for([1, 17, 130, 5, 40], model.cfg.vocab_size, seed=31)
    mts = [1, 2, k + 1, 17, 9]
    llm = LLM(model, **{"max_num_seqs": 6, "max_total_tokens": 2000, "max_model_len": 168, **kw},
              cuda_graphs=graphs, overlap=overlap, num_speculative_tokens=k)
    eng = llm.engine
    if graphs:
        eng.runner.graphs.buckets = (2, 4, 6)  # most steps carry pad requests

    def params(i, mt):
        return SamplingParams(max_tokens=mt, ignore_eos=True, temperature=temperature, top_k=40, seed=7 + i,
                              logprobs=2 if i == 4 else None, stop_token_ids=(stop or {}).get(f"r{i}", ()))

    for i, (p, mt) in enumerate(zip(prompts, mts)):
        eng.add_request(f"r{i}", p, params(i, mt))
    eng.add_request("long", prompts[2][:128], params(9, 40))  # runs into max_model_len (168)
    got, steps = {}, 0
    while eng.has_unfinished():
        if late is not None and steps == 3:
            eng.add_request("late", late, params(11, 17))
        if abort is not None and steps == abort[0]:
            eng.abort(abort[1])
        for o in eng.step():
            t, lp, _ = got.setdefault(o.request_id, ([], [], None))
            t += o.token_ids
            lp += [round(x, 4) for x in o.logprobs or []]
            if o.finished:
                got[o.request_id] = (t, lp, o.finish_reason)
        steps += 1
        assert steps < 500
    assert_cache_empty(eng)
    return got, eng


@pytest.mark.parametrize("k,temperature,graphs", [(1, 0.0, True), (1, 0.9, False), (2, 0.0, False), (2, 0.9, True),
                                                  (3, 0.0, True), (3, 0.9, True), (3, 0.0, False)],
                         ids=["k1-greedy-graphs", "k1-seeded-eager", "k2-greedy-eager", "k2-seeded-graphs",
                              "k3-greedy-graphs", "k3-seeded-graphs", "k3-greedy-eager"])
def test_early_steps_match_the_plain_loop(tiny, k, temperature, graphs):
    """Requests of mixed lengths ending at max_tokens (1, 2, k + 1, ...), at max_model_len
    and at a stop token while the others go on, one joining later (its prefill falls back
    to the read-back-first path), logprobs on one request."""
    key = (k, temperature)
    if key not in _REFS:  # the plain loop's outputs (shared by the graphs / eager cases)
        ref0, _ = _drive(tiny, k, overlap=False, graphs=False, temperature=temperature)
        stop = {"r3": [ref0["r3"][0][6]]}  # r3 stops at its 7th token (or earlier if it repeats)
        late = prompts_for([11], tiny.cfg.vocab_size, seed=5)[0]
        _REFS[key] = (_drive(tiny, k, overlap=False, graphs=False, temperature=temperature, stop=stop, late=late)[0],
                      stop, late)
    ref, stop, late = _REFS[key]
    assert ref["r3"][2] == "stop" and ref["long"][2] == "length" and len(ref["long"][0]) == 40
    got, eng = _drive(tiny, k, overlap=True, graphs=graphs, temperature=temperature, stop=stop, late=late)
    assert got == ref
    assert eng.runner.early_steps > 0 and eng.stats()["early_steps"] == eng.runner.early_steps
    if graphs and temperature == 0.0:
        assert eng.runner.fused_steps > 0  # early steps through the fused greedy graph


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_early_steps_with_preemption(tiny, graphs):
    """More requests than max_num_seqs and a cache too small for the running ones:
    preemptions (in read-back-first steps) and early steps (also while requests wait for a
    free seat) in the same run, the same tokens as the plain loop. Greedy: a sampled
    request's tokens depend on the drafts it verifies, which depend on when it was
    preempted (the early path reserves up to 2k tokens more per request, so preemptions
    come at other steps than in the plain loop)."""
    prompts = prompts_for([50, 45, 40, 55, 30, 20], tiny.cfg.vocab_size, seed=8)
    sp = [SamplingParams(max_tokens=36 + i, ignore_eos=True) for i in range(len(prompts))]
    kw = dict(max_num_seqs=4, max_num_batched_tokens=64, max_total_tokens=230, num_speculative_tokens=3)
    ref = [o.token_ids for o in LLM(tiny, **kw).generate(prompts, sp)]
    llm = LLM(tiny, **kw, overlap=True, cuda_graphs=graphs)
    if graphs:
        llm.engine.runner.graphs.buckets = (2, 4, 6)
    got = [o.token_ids for o in llm.generate(prompts, sp)]
    eng = llm.engine
    assert got == ref
    assert eng.scheduler.num_preemptions > 0 and eng.runner.early_steps > 0
    assert_cache_empty(eng)


def test_abort_while_an_early_step_runs(tiny):
    """An aborted request's rows of the step in flight are dropped; the others emit what
    they emit without the abort."""
    ref, _ = _drive(tiny, 2, overlap=False, graphs=False, temperature=0.0)
    got, eng = _drive(tiny, 2, overlap=True, graphs=True, temperature=0.0, abort=(4, "r3"))
    assert eng.runner.early_steps > 0
    for rid, v in ref.items():
        if rid != "r3":
            assert got[rid] == v, rid
    assert got["r3"][0] == ref["r3"][0][:len(got["r3"][0])]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_early_rejected_drafts_leave_no_trace(tiny, graphs):
    """Early steps with the MTP layer's real drafts (the tiny model rejects many): every
    live cache row equals that of a plain run that decoded only the accepted tokens."""
    p = prompts_for([150], tiny.cfg.vocab_size, seed=21)[0]
    spec = LLM(tiny, max_total_tokens=2000, num_speculative_tokens=3, cuda_graphs=graphs, overlap=True).engine
    spec.add_request("x", p, SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(9):
        spec.step()
    f, spec._inflight = spec._inflight, None
    spec._settle(f)
    assert spec.runner.early_steps >= 5
    acc = spec.stats()["spec"]["acceptance_per_position"]
    assert any(a is not None and a < 1 for a in acc), acc
    got, n = live_state(spec, "x")
    assert_live_state_is_plain(tiny, got, n, p)


@pytest.mark.parametrize("T", [2, 4, 5])
def test_verify_arrays_equal_host_context(tiny, T):
    """The device-built arrays of a uniform verify step equal host_context's for the same
    step (padded to a graph's shapes): per token and per request exactly, per compressed
    block as the same set of valid blocks (their order differs), the rest pad blocks."""
    llm = LLM(tiny, max_num_seqs=5, max_total_tokens=3000)
    c = llm.engine.cache
    geom = c.geometry
    g = torch.Generator().manual_seed(T)
    starts = np.array([0, 3, 127, 200, 255], np.int64)[:4]
    rcs = [c.admit() for _ in starts]
    for rc, s in zip(rcs, starts):
        c.grow(rc, int(s) + T)
    c.flush()
    slots = np.array([rc.slot for rc in rcs], np.int64)
    ids = torch.randint(0, 100, (len(starts) * T,), generator=g).numpy()
    n = 6
    pad = Padding(n, T, T, tuple(n * (-(-T // r) + 1) for r, _ in geom.schedules),
                  tuple(c.block_tables[r].shape[1] * c.page_size for r, _ in geom.schedules))
    hc = host_context(ids, starts, np.full(4, T), slots, np.full(4, T), geom, c.host_block_tables, pad=pad)
    dev = verify_arrays(torch.from_numpy(np.concatenate([ids, np.zeros((n - 4) * T, np.int64)])),
                        torch.from_numpy(np.concatenate([starts, np.zeros(n - 4, np.int64)])),
                        torch.from_numpy(np.concatenate([slots, np.full(n - 4, -1, np.int64)])), T, geom,
                        c.block_tables, pad.blocks)
    assert [a.shape for a in dev] == [torch.Size(a.shape) for a in hc.arrays]
    for j in range(8):
        assert (dev[j].numpy() == hc.arrays[j]).all(), j
    for r, overlap, R, cmax, nb, k in hc.plan_host:
        for j in (0, 1, 2):  # n_vis, state slots, entries
            assert (dev[k + j].numpy() == hc.arrays[k + j]).all(), (r, j)
        L = 2 * r if overlap else r
        blocks = [np.stack([a.numpy() if isinstance(a, torch.Tensor) else a for a in src[k + 3:k + 9]], 1)
                  for src in (dev, hc.arrays)]
        valid = [b[b[:, 2] > -L] for b in blocks]
        assert len(valid[1]) > 0 or r > 4 * T
        assert sorted(map(tuple, valid[0])) == sorted(map(tuple, valid[1])), r
        for b in blocks:
            pads = b[b[:, 2] <= -L]
            assert (pads[:, 1] == -1).all()


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 3])
def test_cuda_early_steps_emit_what_the_plain_loop_emits(k):
    """On the GPU: early steps through captured graphs (the verify buffer written on the
    device, then the fused replay) emit the plain loop's greedy tokens. fp32 with its lossless
    cache, as the other GPU equivalence tests (test_engine_gpu.py): the two loops run a
    position in steps of different shapes (an early step runs k + 1 rows for every request
    of the step before, in its bucket; the plain loop's step near max_tokens is not uniform
    and runs eagerly), and in bf16 with the FP8 cache the tiny random model's near-ties flip
    with the shape (docs/notes/runner.md, "Early steps on the GPU: bf16 near-ties")."""
    m = models.tiny.load(device="cuda", dtype=torch.float32)
    prompts = prompts_for([1, 5, 17, 40, 130, 3], m.cfg.vocab_size)
    sp = [SamplingParams(max_tokens=12 + (5 * i) % 13, ignore_eos=True) for i in range(len(prompts))]
    kw = dict(max_num_seqs=8, max_total_tokens=3000, num_speculative_tokens=k)
    ref = [o.token_ids for o in LLM(m, **kw, cuda_graphs=True, overlap=False).generate(prompts, sp)]
    llm = LLM(m, **kw, cuda_graphs=True, overlap=True)
    got = [o.token_ids for o in llm.generate(prompts, sp)]
    eng = llm.engine
    print(f"tiny fp32 k={k}: {eng.runner.early_steps} early steps of {eng.num_steps}, {eng.runner.fused_steps} fused")
    assert eng.runner.early_steps > 0 and eng.runner.fused_steps > 0
    assert got == ref


def test_early_launch_and_read_back_failures(tiny, monkeypatch):
    """An early launch that raises runs the step after the read-back instead (same tokens);
    a read-back that fails while an early step runs ends the requests with rows in it with
    the error, drops the early step, and the engine goes on."""
    prompts = prompts_for([9, 30], tiny.cfg.vocab_size, seed=4)
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    ref = [o.token_ids for o in LLM(tiny, max_total_tokens=800, num_speculative_tokens=2).generate(prompts, sp)]
    llm = LLM(tiny, max_total_tokens=800, num_speculative_tokens=2, overlap=True)
    eng = llm.engine
    orig, calls = eng.runner.early_batch, []

    def early_batch(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("no early step")
        return orig(*a, **kw)
    monkeypatch.setattr(eng.runner, "early_batch", early_batch)
    assert [o.token_ids for o in llm.generate(prompts, sp)] == ref
    assert len(calls) > 2 and eng.runner.early_steps == len(calls) - 1
    assert_cache_empty(eng)

    settle, n = eng._settle, []

    def failing(f):
        n.append(f.res.batch.early is not None)
        if sum(n) == 2:  # the read-back of an early step, while the next early step runs
            raise RuntimeError("lost the step")
        return settle(f)
    monkeypatch.setattr(eng, "_settle", failing)
    for i, p in enumerate(prompts):
        eng.add_request(f"x{i}", p, sp)
    got = {}
    for _ in range(100):
        for o in eng.step():
            got.setdefault(o.request_id, []).append(o)
        if not eng.has_unfinished():
            break
    assert all(got[f"x{i}"][-1].finish_reason == "error" and "lost the step" in got[f"x{i}"][-1].error
               for i in range(2))
    assert_cache_empty(eng)
    late = LLM(tiny, max_total_tokens=800).generate([prompts[0]], sp)[0].token_ids
    monkeypatch.setattr(eng, "_settle", settle)
    eng.add_request("after", prompts[0], sp)
    toks = []
    while eng.has_unfinished():
        for o in eng.step():
            toks += o.token_ids
    assert toks == late
