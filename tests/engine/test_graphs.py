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

from test_engine import prompts_for

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
    print(f"tiny bf16, k={k}: {len(g.graphs)} graphs captured in {g.capture_s:.2f} s")
    assert out == ref
