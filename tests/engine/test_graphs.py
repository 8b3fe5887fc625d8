"""CUDA-graph steps (engine/graph_runner.py): decode and verify steps run padded static
contexts (on the CPU eagerly, on CUDA as replayed graphs) and must emit exactly what the
unpadded eager steps emit: mixed prompt lengths and stop lengths, so batches shrink and
requests are padded to their bucket; with and without speculation, sampled and greedy."""
import numpy as np
import pytest
import torch

from deepfuse import models
from deepfuse.engine import LLM, SamplingParams
from deepfuse.engine.context import Padding, host_context

from test_engine import assert_cache_empty, prompts_for

LENS = [1, 5, 17, 40, 130, 3]


@pytest.fixture(scope="module")
def tiny():
    return models.tiny.load()


def _params(n, temperature=0.0, base=1):
    return [SamplingParams(max_tokens=base + (5 * i) % 13, ignore_eos=True, temperature=temperature, top_k=20,
                           seed=i) for i in range(n)]


def _run(model, graphs, prompts, params, **kw):
    llm = LLM(model, max_num_seqs=8, max_total_tokens=3000, cuda_graphs=graphs, **kw)
    if graphs:
        llm.engine.runner.graphs.buckets = (1, 2, 4, 8)  # small buckets: most steps carry pad requests
    outs = llm.generate(prompts, params)
    return llm, [o.token_ids for o in outs]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_padded_graph_steps_emit_what_eager_steps_emit(tiny, temperature):
    prompts = prompts_for(LENS, tiny.cfg.vocab_size)
    ps = _params(len(prompts), temperature)
    _, ref = _run(tiny, False, prompts, ps)
    llm, out = _run(tiny, True, prompts, ps)
    assert out == ref
    used = llm.engine.runner.graphs.graphs
    assert (4, 1) in used and (8, 1) in used  # decode steps of 3..4 and 5..7 requests went through padding


@pytest.mark.parametrize("k", [1, 3])
def test_padded_verify_steps_emit_what_eager_steps_emit(tiny, k):
    prompts = prompts_for(LENS, tiny.cfg.vocab_size)
    ps = _params(len(prompts), base=12)
    _, ref = _run(tiny, False, prompts, ps, num_speculative_tokens=k)
    llm, out = _run(tiny, True, prompts, ps, num_speculative_tokens=k)
    assert out == ref
    assert any(T == k + 1 for _, T in llm.engine.runner.graphs.graphs)
    assert llm.engine.runner.fused_steps > 0  # greedy: target, acceptance and drafts in one (padded) graph


def test_padding_writes_nowhere(tiny):
    """Pad requests get slot -1 everywhere: ring rows, state rows and block slots."""
    llm = LLM(tiny, max_num_seqs=4, max_total_tokens=600)
    geom = llm.engine.cache.geometry
    pad = Padding(4, 3, 3, tuple(8 for _ in geom.schedules), tuple(64 for _ in geom.schedules))
    e = np.zeros(0, np.int64)
    hc = host_context(e, e, e, e, e, geom, llm.engine.cache.host_block_tables, pad=pad)
    ring = hc.arrays[7]
    assert hc.N == 12 and (ring == -1).all()
    for r, overlap, R, cmax, nb, k in hc.plan_host:
        n_vis, state_slots, n_ent, bpos, bslot = hc.arrays[k:k + 5]
        assert nb == 8 and cmax == 64 and (state_slots == -1).all() and (n_ent == 0).all() and (bslot == -1).all()
        assert (hc.arrays[k + 5] + (2 * r if overlap else r) <= 0).all()  # pad blocks: no valid source


def test_step_beyond_its_padding_is_refused(tiny):
    llm = LLM(tiny, max_num_seqs=4, max_total_tokens=600)
    geom = llm.engine.cache.geometry
    pad = Padding(1, 1, 1, tuple(0 for _ in geom.schedules), tuple(0 for _ in geom.schedules))
    one = np.array([0], np.int64)
    with pytest.raises(ValueError, match="padding"):
        host_context(one, np.array([3]), np.array([1]), one, np.array([1]), geom,
                     llm.engine.cache.host_block_tables, pad=pad)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [0, 2])
def test_cuda_graphs_emit_what_eager_steps_emit(k):
    m = models.tiny.load(device="cuda", dtype=torch.bfloat16)
    prompts = prompts_for(LENS, m.cfg.vocab_size)
    ps = _params(len(prompts))
    kw = dict(num_speculative_tokens=k) if k else {}
    _, ref = _run(m, False, prompts, ps, **kw)
    llm, out = _run(m, True, prompts, ps, **kw)
    g = llm.engine.runner.graphs
    assert g.capture and all(x.graph is not None for x in g.graphs.values())
    if k:  # the speculative step's MTP pass per (bucket, T) and its chained draft step per bucket
        assert all(x.mtp is not None and x.mtp[0] is not None for x in g.graphs.values())
        assert set(g.chains) == set(g.buckets) and all(c.graph is not None for c in g.chains.values())
    print(f"tiny bf16, k={k}: {len(g.graphs)} graphs (+ {len(g.chains)} chain graphs) captured in {g.capture_s:.2f} s")
    assert out == ref


class NoThirds:
    """A token constraint that forbids ids = 1 (mod 3) and never ends (so a constrained
    request's tokens differ from its free ones and the masks matter)."""

    def __init__(self):
        self.accepted = []

    def fill_next_token_bitmask(self, mask, row):
        V = mask.shape[1] * 32
        allowed = torch.ones(V, dtype=torch.bool)
        allowed[1::3] = False
        bits = allowed.view(-1, 32).to(torch.int64) << torch.arange(32)
        mask[row] = bits.sum(1).to(torch.int64).sub(torch.where(bits.sum(1) >= 2 ** 31, 2 ** 32, 0)).to(torch.int32)

    def accept_token(self, tok):
        self.accepted.append(tok)
        return tok % 3 != 1

    def is_terminated(self):
        return False


def _matrix_run(model, k, graphs, overlap, constrained, temperature):
    prompts = prompts_for([1, 17, 130, 5], model.cfg.vocab_size, seed=23)
    llm = LLM(model, max_num_seqs=3, max_num_batched_tokens=37, max_total_tokens=1500, cuda_graphs=graphs,
              overlap=overlap, num_speculative_tokens=k)
    eng = llm.engine
    if graphs:
        eng.runner.graphs.buckets = (2, 3)  # one request runs padded to two
    cons = {}
    for i, p in enumerate(prompts):
        c = NoThirds() if constrained and i % 2 else None
        cons[f"r{i}"] = c
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=3 + (5 * i) % 7, ignore_eos=True, temperature=temperature,
                                                   top_k=30, seed=100 + i, logprobs=1 if i == 2 else None),
                        constraint=c)
    got = {}
    steps = 0
    while eng.has_unfinished():
        for o in eng.step():
            t, lp, _ = got.setdefault(o.request_id, ([], [], None))
            t += o.token_ids
            lp += [round(x, 4) for x in o.logprobs or []]
            if o.finished:
                got[o.request_id] = (t, lp, o.finish_reason)
        steps += 1
        assert steps < 500
    for rid, c in cons.items():
        if c is not None:
            assert got[rid][0] == c.accepted and all(t % 3 != 1 for t in c.accepted)
    if k and not constrained:
        assert eng.stats()["spec"]["verify_steps"] > 0
        if overlap:  # verify steps launched before the previous step was read back
            assert eng.runner.early_steps > 0
    assert_cache_empty(eng)
    return got


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "seeded"])
@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_graphs_overlap_speculation_constraints_match_the_plain_loop(tiny, k, temperature):
    """Every combination of padded graph steps, overlap and token constraints emits, per
    request, the tokens, logprobs and finish reasons of the plain loop (no graphs, no
    overlap) with the same k; greedy requests also those of k = 0 (acceptance is exact)."""
    for constrained in (False, True):
        ref = _matrix_run(tiny, k, False, False, constrained, temperature)
        if temperature == 0.0 and k:
            assert ref == _matrix_run(tiny, 0, False, False, constrained, temperature)
        for graphs, overlap in ((True, False), (False, True), (True, True)):
            assert _matrix_run(tiny, k, graphs, overlap, constrained, temperature) == ref, (graphs, overlap,
                                                                                           constrained)


def test_fused_step_with_simulated_acceptance(tiny):
    """The benchmark knob through the fused greedy step: the same tokens and the same
    (real and simulated) acceptance statistics as the unfused eager steps."""
    prompts = prompts_for([20, 60, 7], tiny.cfg.vocab_size, seed=14)
    sp = [SamplingParams(max_tokens=14, ignore_eos=True)] * len(prompts)
    a, ta = _run(tiny, False, prompts, sp, num_speculative_tokens=3, spec_simulate_acc_len=2.5)
    b, tb = _run(tiny, True, prompts, sp, num_speculative_tokens=3, spec_simulate_acc_len=2.5)
    assert ta == tb and b.engine.runner.fused_steps > 0
    sa, sb = a.engine.stats()["spec"], b.engine.stats()["spec"]
    assert sa == sb and sa["simulated"] and sa["mean_accepted_length"] > 2
