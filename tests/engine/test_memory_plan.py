"""The engine's start-up memory plan (engine/memory.py) and the GPU defaults: the planner's
arithmetic on given numbers, the orchestration with a fake CUDA memory source, the cache
layout's bytes, the kv_dtype defaults per device, graph entry tables bounded by
max_model_len; on the GPU, random-flash with every default starts, plans and generates."""
import gc
import math

import numpy as np
import pytest
import torch

from deepfuse import models
from deepfuse.engine import LLM, EngineConfig, SamplingParams
from deepfuse.engine import memory as M
from deepfuse.engine.cache import CacheManager, default_total_tokens
from deepfuse.engine.context import build_context

GiB = 1 << 30


@pytest.fixture(scope="module")
def tiny():
    return models.tiny.load()


# ----------------------------------------------------------------------------- arithmetic
def linear(fixed, per_token):
    return lambda t: fixed + per_token * t


def test_budget_and_fit():
    assert M.cache_budget(100, 0.9, 30, 5, 2, 1, 2) == 90 - 40
    f = linear(1000, 10)
    assert M.fit_tokens(1000 + 10 * 77 + 9, f, 1 << 31) == 77
    assert M.fit_tokens(999, f, 100) == 0           # not even one token
    assert M.fit_tokens(10 ** 9, f, 100) == 100     # capped
    steps = lambda t: 64 * math.ceil(t / 64)         # noqa: E731  (pages: a step function)
    assert M.fit_tokens(64 * 3, steps, 1000) == 192 and M.fit_tokens(64 * 3 - 1, steps, 1000) == 128


def test_size_caches_planned_and_capped_by_model_len():
    m = M.Measured(total=100 * GiB, weights=30 * GiB, activations=4 * GiB, graphs=1 * GiB, non_torch=1 * GiB)
    per = 1000  # bytes per token
    tokens, L, budget, margin, notes = M.size_caches(m, 0.9, linear(GiB, per), max_len=1 << 20, max_num_seqs=256,
                                                     min_tokens=8192)
    assert margin == M.default_margin(100 * GiB) and budget == 90 * GiB - 36 * GiB - margin
    assert tokens == (budget - GiB) // per and L == 1 << 20 and not notes
    # a small budget: max_model_len becomes what the caches hold
    tokens, L, *_ = M.size_caches(m, 0.37, linear(0, per), max_len=1 << 30, max_num_seqs=256, min_tokens=1)
    assert L == tokens < 1 << 30
    # never more than max_num_seqs full-length requests
    tokens, L, *_ = M.size_caches(m, 0.9, linear(0, 1), max_len=1000, max_num_seqs=4, min_tokens=1)
    assert (tokens, L) == (4000, 1000)


def test_size_caches_errors_clearly():
    m = M.Measured(total=100 * GiB, weights=80 * GiB, activations=4 * GiB, graphs=1 * GiB, non_torch=1 * GiB,
                   free=18 * GiB)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):  # the budget is negative
        M.size_caches(m, 0.8, linear(0, 1000), max_len=4096, max_num_seqs=8, min_tokens=4096)
    # explicit: beyond the free memory -> an error naming max_total_tokens and what fits
    with pytest.raises(ValueError, match=r"max_total_tokens=20000000 needs .*at most \d+ tokens fit"):
        M.size_caches(m, 0.9, linear(0, 1000), max_len=4096, max_num_seqs=8, min_tokens=1, explicit=20_000_000)
    # explicit within free memory but over the utilization budget: taken, with a note
    tokens, L, budget, _, notes = M.size_caches(m, 0.9, linear(0, 1000), max_len=4096, max_num_seqs=8, min_tokens=1,
                                                explicit=5_000_000)
    assert tokens == 5_000_000 and L == 4096 and budget < 5e9 and "over the gpu_memory_utilization" in notes[0]


def test_cache_layout_bytes_match_allocations(tiny):
    for kw in (dict(), dict(num_saved_prefixes=4), dict(num_draft_tokens=3, num_mtp_layers=1)):
        base = CacheManager(tiny.cfg, model_dtype=torch.float32, device="cpu", max_num_seqs=4, max_total_tokens=100,
                            max_model_len=3000, page_size=16, **kw).layout()
        for T in (1, 63, 64, 65, 1000, 2999, 40000):
            c = CacheManager(tiny.cfg, model_dtype=torch.float32, device="cpu", max_num_seqs=4, max_total_tokens=T,
                             max_model_len=3000, page_size=16, **kw)
            assert base.bytes(T) == c.device_bytes(), (kw, T)


def test_plan_with_a_fake_cuda_memory_source(tiny, monkeypatch):
    """plan_memory's orchestration: probes on minimal caches, then the caches from what is left."""
    calls = {}

    class FakeModel:
        cfg, dtype, device = tiny.cfg, torch.bfloat16, torch.device("cuda")

    def make_cache(total, max_len):
        calls.setdefault("cache", []).append((total, max_len))
        return CacheManager(tiny.cfg, model_dtype=torch.float32, device="cpu", kv_dtype="fp8", max_num_seqs=8,
                            max_total_tokens=total, max_model_len=max_len, page_size=64)

    class FakeGraphs:
        pool_bytes = 0

        def capture_all(self):
            self.pool_bytes = 2 * GiB

    L = 1 << 20
    monkeypatch.setattr(M, "_settle", lambda dev: GiB)  # torch's reserved memory once probes are freed
    monkeypatch.setattr(M, "profile_step",
                        lambda model, cache, **kw: calls.setdefault("profile", (cache, kw)) and GiB // 4)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (2 * GiB, 4 * GiB))
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=512, gpu_memory_utilization=0.75).validate()
    msg = (r"not enough device memory for the caches: gpu_memory_utilization 0.75 x 4.00 GiB less weights 1.00, "
           r"activations 0.25, graphs 2.00, non-torch 1.00 and margin 0.50 GiB leaves -1.75 GiB")
    with pytest.raises(ValueError, match=msg):
        M.plan_memory(FakeModel(), cfg, "fp8", L, make_cache, lambda cache: FakeGraphs(), measure=True)
    cache, kw = calls["profile"]
    assert calls["cache"] == [(512, L)]      # minimal caches, entry tables at the full model length
    assert kw == dict(max_num_batched_tokens=512, max_num_seqs=8, max_len=L, tokens_per_req=1)
    monkeypatch.setattr(FakeGraphs, "capture_all", lambda self: setattr(self, "pool_bytes", GiB // 8))
    plan = M.plan_memory(FakeModel(), cfg, "fp8", L, make_cache, lambda cache: FakeGraphs(), measure=True)
    assert plan.measured and plan.source == "planned" and plan.kv_dtype == "fp8"
    assert (plan.weights, plan.activations, plan.graphs, plan.non_torch) == (GiB, GiB // 4, GiB // 8, GiB)
    assert plan.cache_budget == 3 * GiB - GiB // 4 - GiB // 8 - 2 * GiB - plan.margin
    layout = calls["profile"][0].layout()
    assert layout.bytes(plan.max_total_tokens) <= plan.cache_budget < layout.bytes(plan.max_total_tokens + 64)
    # the caches hold fewer tokens than the model's length: max_model_len is what they hold, and the plan says so
    assert plan.max_model_len == plan.max_total_tokens < L and "what the caches hold" in plan.summary()
    d = plan.as_dict()
    assert d["cache_budget_gib"] == round(plan.cache_budget / GiB, 3) and "memory plan" in plan.summary()
    # an explicit max_total_tokens is checked (free 100 GiB less the rest) and sizes the probes' model length
    calls.clear()
    big = EngineConfig(max_num_seqs=8, max_num_batched_tokens=512, max_total_tokens=10 ** 12).validate()
    with pytest.raises(ValueError, match="max_total_tokens=1000000000000 needs"):
        M.plan_memory(FakeModel(), big, "fp8", 65536, make_cache, None, measure=True)
    small = EngineConfig(max_num_seqs=8, max_num_batched_tokens=512, max_total_tokens=3000).validate()
    plan = M.plan_memory(FakeModel(), small, "fp8", 65536, make_cache, None, measure=True)
    assert calls["cache"][-1] == (512, 3000) and (plan.max_total_tokens, plan.max_model_len) == (3000, 3000)
    assert plan.source == "explicit" and plan.graphs == 0


# ----------------------------------------------------------------------------- defaults
def test_kv_dtype_defaults_per_device(tiny):
    cfg = tiny.cfg
    assert M.resolve_kv_dtype(None, cfg, "cpu", torch.bfloat16) == "auto"
    assert M.resolve_kv_dtype(None, cfg, "cpu", torch.float32) == "auto"
    assert M.resolve_kv_dtype(None, cfg, "cuda", torch.bfloat16) == "fp8"
    assert M.resolve_kv_dtype(None, cfg, "cuda:1", torch.float32) == "auto"   # the oracle path stays lossless
    assert M.resolve_kv_dtype("bf16", cfg, "cuda", torch.bfloat16) == "bf16"  # an explicit choice wins
    other = models.V4Config.from_dict(models.tiny.CONFIG)
    other.head_dim = 32
    assert M.resolve_kv_dtype(None, other, "cuda", torch.bfloat16) == "auto"  # rows the fp8 format cannot hold
    assert EngineConfig().kv_dtype is None and EngineConfig().gpu_memory_utilization == 0.9
    llm = LLM(tiny, max_total_tokens=500)
    assert llm.engine.kv_dtype == "auto" and llm.engine.cache.kv_dtype == "auto"
    st = llm.engine.stats()
    assert st["kv_dtype"] == "auto" and st["memory_plan"]["max_total_tokens"] == 500
    assert st["memory_plan"]["cache"] == llm.engine.cache.device_bytes() and st["max_model_len"] == 500
    assert default_total_tokens(cfg, None, torch.float32, "cpu", 4, 1000) == 4000
    assert default_total_tokens(cfg, None, torch.float32, "cpu", 256, 65536) == 1 << 17


@pytest.mark.parametrize("bad", [dict(kv_dtype="fp4"), dict(gpu_memory_utilization=0), dict(gpu_memory_utilization=1.5),
                                 dict(gpu_memory_utilization=True), dict(gpu_memory_utilization="0.9")])
def test_config_validation(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        EngineConfig(**bad).validate()


# ----------------------------------------------------------------------------- entry tables
def test_graph_entry_tables_bounded_by_max_model_len(tiny):
    """Entry tables of a graph are ceil(max_model_len / r) entries wide (rounded to pages),
    not max_total_tokens: a large budget with a short model length keeps graphs small."""
    llm = LLM(tiny, max_num_seqs=8, max_total_tokens=200_000, max_model_len=1000, cuda_graphs=True)
    eng = llm.engine
    g, ps = eng.runner.graphs, eng.cache.page_size
    want = tuple(-(-(1000 // r) // ps) * ps for r, _ in eng.cache.geometry.schedules)
    assert all(w <= 1000 // r + ps for w, (r, _) in zip(want, eng.cache.geometry.schedules))
    for b in g.buckets:
        assert g._padding(b, 1).entries == want
    outs = llm.generate([[3] * 40, [5] * 7], SamplingParams(max_tokens=3, ignore_eos=True))
    assert all(len(o.token_ids) == 3 for o in outs)
    for (b, T), gr in g.graphs.items():
        for (r, ov), plan in gr.ctx.plans.items():
            assert plan.entry_slots.shape == (b, want[eng.cache.geometry.schedules.index((r, ov))])
    kept = g.buffer_bytes()
    assert kept and all(n > 0 for n in kept.values())
    # without max_model_len the model's (65536) bounds them, and the budget bounds max_model_len
    llm = LLM(tiny, max_num_seqs=2, max_total_tokens=3000, cuda_graphs=True)
    assert llm.engine.max_model_len == 3000
    r = llm.engine.cache.geometry.schedules[0][0]
    assert llm.engine.runner.graphs._padding(2, 1).entries[0] == -(-(3000 // r) // ps) * ps


def test_entry_slots_expansion(tiny):
    """The entry tables a context expands: slot = block_table[page] * page_size + row for
    entries below each request's count, -1 beyond (eager widths and a step at the limit)."""
    cache = CacheManager(tiny.cfg, model_dtype=torch.float32, device="cpu", max_num_seqs=3, max_total_tokens=4000,
                         max_model_len=2000, page_size=16)
    rng = np.random.default_rng(0)
    for r in cache.block_tables:
        t = rng.integers(0, 50, size=cache.host_block_tables[r].shape)
        cache.host_block_tables[r][:] = t
        cache.block_tables[r].copy_(torch.from_numpy(t))
    for starts, counts in (([0, 100, 1990], [5, 1, 10]), ([30, 0, 7], [1, 1, 1])):
        starts, counts = np.array(starts), np.array(counts)
        ids = np.zeros(counts.sum(), np.int64)
        ctx = build_context(ids, starts, counts, np.array([2, 0, 1]), np.ones(3, np.int64), cache.geometry,
                            cache.block_tables, "cpu", cache.host_block_tables)
        for (r, _), plan in ctx.plans.items():
            n = (starts + counts) // r
            assert plan.entry_slots.shape == (3, n.max())
            bt = cache.host_block_tables[r]
            for b, s in enumerate([2, 0, 1]):
                e = np.arange(n.max())
                want = np.where(e < n[b], bt[s, np.minimum(e // 16, bt.shape[1] - 1)] * 16 + e % 16, -1)
                assert (plan.entry_slots[b].numpy() == want).all()


def test_largest_step_runs_on_minimal_caches(tiny):
    """The profiling step (deepest context, max_num_seqs requests, every row sampled) on a
    probe cache whose block tables all point at page 0."""
    llm = LLM(tiny, max_num_seqs=6, max_total_tokens=600, max_model_len=4000, max_num_batched_tokens=48)
    probe = llm.engine._new_cache(48, 4000)
    for k in (0, 2):
        toks = M.largest_step(tiny, probe, max_num_batched_tokens=48, max_num_seqs=6, max_len=4000,
                              tokens_per_req=k + 1)
        assert toks.shape == (1 + 5 * (k + 1),) and int(toks.max()) < tiny.cfg.vocab_size


# ----------------------------------------------------------------------------- GPU
def _flash_defaults(layers="swa,csa", **kw):
    return LLM(f"random-flash:{layers}", device="cuda", **kw)


@pytest.mark.gpu
def test_gpu_random_flash_defaults_start_plan_and_generate():
    llm = _flash_defaults()
    eng = llm.engine
    plan = eng.memory_plan
    print("\n" + plan.summary())
    print("graph buffers (bucket, T) -> MiB:", {k: round(v / 2 ** 20, 1) for k, v in
                                                 sorted(eng.runner.graphs.buffer_bytes().items())})
    assert eng.kv_dtype == "fp8" and plan.measured and plan.source == "planned"
    assert plan.max_model_len == min(eng.model.cfg.max_position_embeddings, plan.max_total_tokens)
    assert plan.cache <= plan.cache_budget and plan.activations > 0 and plan.graphs > 0
    assert plan.graphs_actual is not None and plan.graphs_actual <= plan.graphs + 256 * 2 ** 20
    free, total = torch.cuda.mem_get_info()
    assert total - free <= plan.total * plan.utilization  # within its share (nothing else on the GPU)
    refs0 = dict(eng.stats().get("reference_calls", {}))
    print("reference calls at start-up:", refs0)
    outs = llm.generate([[5] * 300, list(range(1000, 1017))], SamplingParams(max_tokens=16, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [16, 16]
    st = eng.stats()
    assert st["memory_plan"]["max_total_tokens"] == eng.cache.max_total_tokens and st["kv_dtype"] == "fp8"
    assert st.get("reference_calls", {}) == refs0, st.get("reference_calls")  # serving steps run kernels only
    free, total = torch.cuda.mem_get_info()
    assert total - free <= plan.total * plan.utilization
    model, cls = llm.model, type(eng)
    del llm, eng
    gc.collect()
    torch.cuda.empty_cache()
    # an explicit budget that cannot fit: a clear error
    with pytest.raises(ValueError, match="max_total_tokens=.* needs"):
        cls(model, EngineConfig(max_total_tokens=1 << 40, max_num_batched_tokens=256).validate())
    del model
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.gpu
def test_gpu_server_starts_with_defaults():
    from fastapi.testclient import TestClient

    from deepfuse.serve import build

    gc.collect()
    app, st = build("random-flash:swa,csa", device="cuda")
    try:
        eng = st.engine_loop.engine
        assert eng.kv_dtype == "fp8" and eng.memory_plan.measured and st.max_model_len == eng.max_model_len
        with TestClient(app) as c:
            r = c.post("/v1/completions", json={"model": st.model_name, "prompt": "Hello there", "max_tokens": 8,
                                                "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 8
    finally:
        st.engine_loop.shutdown()
