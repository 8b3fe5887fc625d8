"""LLM("tiny-v4.1"): the engine runs the tiny V4.1 model (V41CacheManager, the V4.1 step,
the Engram history per chunk) token for token as its full forward: batched requests, chunked
prefill, prefix caching, a small cache, the overlapped loop, logprobs."""
import math

import pytest
import torch

from deepfuse.engine import LLM
from deepfuse.engine.request import SamplingParams
from deepfuse.engine.v41_cache import V41CacheManager


_REF: dict = {}


def _greedy_full(model, prompt, n):
    key = (tuple(prompt), n)
    if key in _REF:
        return _REF[key]
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    _REF[key] = seq[len(prompt):]  # every LLM here loads the same tiny weights
    return _REF[key]


@pytest.mark.parametrize("kw", [dict(), dict(max_num_batched_tokens=7), dict(enable_prefix_caching=True),
                                dict(max_total_tokens=48, max_num_seqs=3),
                                dict(overlap=True, max_num_batched_tokens=9, enable_prefix_caching=True)])
def test_llm_tiny_v41_equals_full_forward(kw):
    llm = LLM("tiny-v4.1", max_model_len=128, **kw)
    assert isinstance(llm.engine.cache, V41CacheManager)
    assert llm.engine.overlap == kw.get("overlap", False)
    g = torch.Generator().manual_seed(1)
    base = torch.randint(0, 129280, (14,), generator=g).tolist()
    prompts = [base[:3], base + [5, 6], base[:11], torch.randint(0, 129280, (20,), generator=g).tolist()]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, logprobs=2))
    for p, o in zip(prompts, outs):
        assert o.token_ids == _greedy_full(llm.model, p, 6), (kw, len(p))
        full = torch.log_softmax(llm.model(torch.tensor([p + o.token_ids]))[0], -1)
        for i, (t, lp) in enumerate(zip(o.token_ids, o.logprobs)):
            assert math.isclose(lp, float(full[len(p) - 1 + i, t]), rel_tol=1e-3, abs_tol=1e-3)
    if kw.get("enable_prefix_caching"):  # the same prompts again: served from saved prefixes
        again = llm.generate(prompts, SamplingParams(max_tokens=6))
        assert [o.token_ids for o in again] == [o.token_ids for o in outs]


def test_memory_profiling_step_runs():
    """engine/memory.py's largest step (the CUDA memory plan's probe) runs a V4.1 model."""
    from deepfuse.engine.memory import largest_step
    from deepfuse.models import tiny

    m = tiny.load("v4.1")
    c = V41CacheManager(m.cfg, model_dtype=m.dtype, device="cpu", max_num_seqs=4, max_num_batched_tokens=64,
                        max_total_tokens=1024, max_model_len=256, page_size=16)
    assert largest_step(m, c, max_num_batched_tokens=64, max_num_seqs=4, max_len=256).shape == (4,)


def test_default_total_tokens_count_v41_cache_bytes(monkeypatch):
    """The memory plan's default path (no measurement: tensor parallel ranks; CUDA with
    measure=False) sizes a V4.1 cache with V41CacheManager.bytes_per_token (kv sources only),
    not with V4's layer-type count."""
    from types import SimpleNamespace

    from deepfuse.engine.cache import CacheManager
    from deepfuse.engine.memory import cache_class, plan_memory
    from deepfuse.models import tiny
    from deepfuse.models.v41_config import V41Config

    cfg = V41Config.from_dict(tiny.CONFIG_V41)
    assert cache_class(cfg) is V41CacheManager and cache_class(tiny.load().cfg) is CacheManager
    v41 = V41CacheManager.bytes_per_token(cfg, "fp8", torch.bfloat16)
    v4 = CacheManager.bytes_per_token(cfg, "fp8", torch.bfloat16)
    assert v41 == pytest.approx(2 * 716 / 2 + 716) and v4 != v41  # sources 2 (ratio 2), 4 (2), 5 (1)
    free = 10 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (free, 2 * free))
    model = SimpleNamespace(cfg=cfg, dtype=torch.bfloat16, device=torch.device("cuda"))
    conf = SimpleNamespace(max_total_tokens=None, max_num_seqs=1 << 20)
    plan = plan_memory(model, conf, "fp8", 1 << 20, None, None, measure=False)
    assert plan.source == "default" and plan.max_total_tokens == int(0.5 * free / v41)


def test_engram_prefetch_only_for_host_tables_on_cuda():
    """engine_prefetch (called by Engine.__init__) attaches nothing on the CPU, for HBM tables
    or V4 models; the GPU side: tests/ops/test_engram_gpu.py test_engine_prefetch_*."""
    from deepfuse.engine.engram_state import engine_prefetch
    from deepfuse.models import tiny

    m = tiny.load("v4.1")
    assert engine_prefetch(m, 64) is None and engine_prefetch(tiny.load(), 64) is None
    llm = LLM(m, max_model_len=64)
    assert getattr(llm.engine, "engram_prefetch", None) is None and getattr(m, "_engram_prefetch", None) is None


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["device", "host"])
def test_cuda_graph_decode_equals_full_forward(placement):
    """V4.1 decode steps replay CUDA graphs (the Engram history in the graph's static buffer,
    models/v41.py step_buffers; chunk starts computed on the device): greedy outputs of
    batched requests (chunked prefill, prefix caching, overlap) equal the full forward's on
    the same CUDA model (fp32: references where the kernels take bf16 only); host tables run
    the prefetch inside the captured steps."""
    import dataclasses

    from deepfuse.models import tiny
    from deepfuse.models.v41_config import V41Config
    from deepfuse.models.v41_random import random_model

    cfg = dataclasses.replace(V41Config.from_dict(tiny.CONFIG_V41), engram_placement=placement).validate()
    model = random_model(cfg, device="cuda", dtype=torch.float32, quant=None, expert_quant=None, seed=5)
    g = torch.Generator().manual_seed(2)
    base = torch.randint(0, cfg.vocab_size, (14,), generator=g).tolist()
    prompts = [base[:3], base + [5, 6], base[:11], torch.randint(0, cfg.vocab_size, (20,), generator=g).tolist()]
    for kw in (dict(), dict(max_num_batched_tokens=7, enable_prefix_caching=True, overlap=True)):
        llm = LLM(model, max_model_len=64, cuda_graphs=True, **kw)
        graphs = llm.engine.runner.graphs
        assert graphs is not None and graphs.capture and graphs.graphs, "V4.1 steps run eager"
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
        with torch.no_grad():
            for p, o in zip(prompts, outs):
                seq = torch.tensor([p + o.token_ids], device="cuda")
                want = model(seq)[0, len(p) - 1:-1].argmax(-1).tolist()
                assert o.token_ids == want, (kw, len(p))


@pytest.mark.gpu
def test_cuda_dspark_graphs_equal_full_forward():
    """DSpark under CUDA graphs and overlap on the GPU: the target graphs compute the context rows,
    the drafts replay the draft graphs (the eager propose never runs), greedy outputs equal the
    full forward's on the same CUDA model (fp32); threshold 0 (every verify step uniform) and 0.5
    (ragged verification lengths: eager target steps, graphed drafts)."""
    import dataclasses

    from deepfuse.models import tiny
    from deepfuse.models.v41_config import V41Config
    from deepfuse.models.v41_random import random_model

    cfg = dataclasses.replace(V41Config.from_dict(tiny.CONFIG_V41), engram_placement="host").validate()
    model = random_model(cfg, device="cuda", dtype=torch.float32, quant=None, expert_quant=None, seed=5)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (3, 9, 16, 27)]
    for th, kw in ((0.0, dict(overlap=True)), (0.5, dict(max_num_batched_tokens=7, enable_prefix_caching=True))):
        llm = LLM(model, max_model_len=96, max_num_seqs=8, cuda_graphs=True, num_speculative_tokens=3,
                  dspark_threshold=th, **kw)
        ds = llm.engine.runner.dspark
        assert ds.graphs is not None and ds.draft_graphs and all(d.graph is not None for d in ds.draft_graphs.values())
        calls = []
        orig = ds.drafter.propose
        ds.drafter.propose = lambda *a, **k: calls.append(1) or orig(*a, **k)
        outs = llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
        assert not calls and ds.graph_steps > 0
        if th == 0.0:
            assert llm.engine.stats()["spec"]["verify_steps"] > 0
        with torch.no_grad():
            for p, o in zip(prompts, outs):
                seq = torch.tensor([p + o.token_ids], device="cuda")
                want = model(seq)[0, len(p) - 1:-1].argmax(-1).tolist()
                assert o.token_ids == want, (th, kw, len(p))
