"""The seeds' yardstick on one GPU: prefill at long context with a cached prefix, decode with
k MTP drafts (issue 26).

    python -m microbench.bench_e2e [--layers swa,csa,hca,csa] [--experts fp8|mxfp4] [--context 131072]
        [--new 4096] [--budgets 4096 8192 16384 32768 65536] [--batches 8 16 32 64 128 256]
        [--k 3] [--acc 3.25] [--modes spec,plain] [--skip-prefill] [--skip-decode] [--out DIR] [--small]

Model: the random V4-Flash-width model (models.random: FP8 linears, FP8 or MXFP4 experts, the
given layer kinds plus V4's sliding-window MTP layer), FP8 caches, run through the engine
(`LLM(...).engine.step()`), prefix caching on.

Cached prefix: one shared prompt prefix is put into the engine's prefix cache without being
prefilled: a request slot is admitted, its cache grown to the prefix length, every page it
got and its window ring filled with random FP8 rows (compressor states stay zero), then
`PrefixCache.insert` saves it (page references, window copy) and the slot is released.
Later requests that start with those tokens hit the entry through the scheduler's normal
lookup and share its pages, exactly as after a real prefill of the prefix.

- Prefill half: requests = the first C - new tokens of the shared prefix (cached) + `new`
  private tokens; chunked prefill at step budgets of `--budgets` new tokens; throughput =
  new tokens / s over the complete steps between 20% and 90% of the requests' prefills
  done (the seeds' rule); per-layer times and largest kernels from one profiled step; the
  compute floor = the step's matmul FLOPs over the bf16 and FP8 dense GEMM peaks measured
  in this run. With k > 0 the MTP layer runs over the prefilled rows too (as serving with
  MTP does): requests ask for 2 tokens, so each one decodes once after its prefill.
- Decode half: B requests at context C sharing a cached prefix of C - 64 tokens (64
  private tokens each, prefilled through the engine), then decode steps with k drafts at a
  simulated mean accepted length `--acc` ("spec") and without speculation ("plain"); step
  time, tokens/s per request and in total, the memory floor (bytes one step must read over
  the copy bandwidth measured in this run), per-layer kernel times and largest kernels of
  one profiled eager step (the kernels the graph replays).
- Projection (labelled as such): the measured step plus the per-layer kernel time of each
  layer kind times the layers V4-Flash has beyond this model (2 SWA, 21 CSA, 20 HCA), next
  to SGLang's published 4 x H200 TP4 figures.
JSON (GPU, date, commit) and PNG plots in --out. --small: tiny widths on the CPU (smoke test).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import math
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import numpy as np
import torch

from microbench.bench_step import KINDS, _sync, floor_bytes, timed_step
from microbench.harness import _commit

FLASH_LAYERS = {"sliding_attention": 2, "compressed_sparse_attention": 21, "heavily_compressed_attention": 20}
SGLANG_H200_TP4 = [  # SGLang cookbook / DSpark, V4-Flash, 4 x H200 TP4, ISL 8192 / OSL 1024, FP8 experts
    {"setup": "SGLang TP4 + MTP", "concurrency": 1, "tpot_ms": 3.28},
    {"setup": "SGLang TP4 + MTP", "concurrency": 16, "tpot_ms": 8.99},
    {"setup": "SGLang TP4 + DSpark", "concurrency": 1, "tpot_ms": 1.72},
]
DECODE_PRIVATE = 64  # private tokens per decode request after the shared prefix
SMALL = dict(hidden_size=64, num_attention_heads=4, n_routed_experts=8, moe_intermediate_size=64, q_lora_rank=64,
             o_groups=2, o_lora_rank=64, vocab_size=1000, index_n_heads=4, index_topk=8)


# ---------------------------------------------------------------------------- ceilings
def _time_s(fn, dev, reps: int) -> float:
    if dev.type == "cuda":
        from microbench.harness import time_fn

        return time_fn(fn, warmup=3, reps=reps, flush=False).s
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def measure_ceilings(dev, small: bool) -> dict:
    """Copy bandwidth (bytes read + written / s) and dense GEMM peaks (FLOP/s), this run."""
    if dev.type != "cuda":  # the CPU has no FP8 GEMM: one fp32 GEMM stands in for both peaks
        n = 256
        a, b = torch.randn(n, n), torch.randn(n, n)
        peak = 2 * n ** 3 / _time_s(lambda: a @ b, dev, 5)
        src = torch.empty(8 << 20, dtype=torch.uint8)
        dst = torch.empty_like(src)
        copy = 2 * src.numel() / _time_s(lambda: dst.copy_(src), dev, 5)
        return {"copy_Bps": copy, "bf16_flops": peak, "fp8_flops": peak, "peaks": "cpu: fp32 matmul 256^3 for both"}
    from microbench.harness import copy_bandwidth

    n = 2048 if small else 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    out = {"copy_Bps": copy_bandwidth(), "bf16_flops": 2 * n ** 3 / _time_s(lambda: a @ b, dev, 20),
           "peaks": f"torch.matmul bf16 and torch._scaled_mm e4m3 (per-tensor scales), {n}^3"}
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), device=dev)
    try:
        out["fp8_flops"] = 2 * n ** 3 / _time_s(
            lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16), dev, 20)
    except (RuntimeError, TypeError) as e:  # no FP8 GEMM on this GPU: the floor uses the bf16 peak
        out["fp8_flops"] = out["bf16_flops"]
        out["peaks"] += f"; fp8 unavailable ({type(e).__name__}), bf16 peak used for both"
    del a, b, a8, b8
    return out


# ---------------------------------------------------------------------------- floors
def prefill_flops(model, new: int, context: int, n_req: int, mtp: bool) -> dict:
    """Matmul FLOPs of a prefill step of n_req requests, each computing positions context - new
    .. context - 1: {"fp8": linears with FP8 / MXFP4 weights, routed experts, indexer scores;
    "bf16": dense linears, gate, mHC mixes, attention (QK and PV over the keys each query
    reads), the head on one row per request}. Compressor pooling, norms and routing omitted."""
    from deepfuse.models.linear import Linear
    from deepfuse.models.moe import Experts, Gate

    cfg = model.cfg
    N = new * n_req
    pos = np.arange(context - new, context, dtype=np.int64)
    W, H, D = cfg.sliding_window, cfg.num_attention_heads, cfg.head_dim
    fp8 = bf16 = 0.0

    def module_flops(mod):
        f8 = f16 = 0.0
        for name, m in mod.named_modules():
            if isinstance(m, Linear):
                f = 2.0 * N * m.in_features * m.out_features
                if m.fmt == "dense":
                    f16 += f
                else:
                    f8 += f
            elif isinstance(m, Experts):
                per = 2.0 * N * cfg.num_experts_per_tok * sum(math.prod(m.proj_shape(p)) for p in ("w1", "w3", "w2"))
                if m.fmt == "dense":
                    f16 += per
                else:
                    f8 += per
            elif isinstance(m, Gate):
                f16 += 2.0 * N * m.weight.numel()
            for bname, t in m.named_buffers(recurse=False):
                if bname.startswith("hc_") and bname.endswith("_fn"):
                    f16 += 2.0 * N * t.numel()
        return f8, f16

    def attn_flops(kind):
        f8 = f16 = 0.0
        win = np.minimum(pos + 1, W)
        r = cfg.compress_ratio(kind)
        vis = (pos + 1) // r if r else np.zeros_like(pos)
        if kind == KINDS["csa"]:
            keys = win + np.minimum(vis, cfg.index_topk)
            f8 += 2.0 * cfg.index_n_heads * cfg.index_head_dim * float(vis.sum()) * n_req
        else:
            keys = win + vis
        f16 += 4.0 * H * D * float(keys.sum()) * n_req
        return f8, f16

    for layer, kind in zip(model.layers, cfg.layer_types):
        a, b = module_flops(layer)
        c, d = attn_flops(kind)
        fp8, bf16 = fp8 + a + c, bf16 + b + d
    if mtp and len(model.mtp):
        a, b = module_flops(model.mtp[0])
        c, d = attn_flops(cfg.mtp_layer_types[0])
        fp8, bf16 = fp8 + a + c, bf16 + b + d
    bf16 += 2.0 * n_req * cfg.hidden_size * cfg.vocab_size
    return {"fp8": fp8, "bf16": bf16}


def decode_floor_bytes(model, B: int, context: int, k: int) -> float:
    """Bytes one decode step must read (bench_step.floor_bytes: non-expert weights once, the
    expected distinct experts of the step's tokens, the KV rows each request's attention
    reads); with k drafts the verify step has B * (k + 1) tokens but reads each request's KV
    once, and the MTP layer runs k times (its weights, its experts for B tokens, B windows)."""
    if not k:
        return floor_bytes(model, B, context)
    kv = floor_bytes(model, 1, context) - floor_bytes(model, 1, 0)
    base = floor_bytes(model, B * (k + 1), context) - B * k * kv
    cfg = model.cfg
    other = expert = 0
    for name, t in model.named_buffers():
        if name.startswith("mtp."):
            n = t.numel() * t.element_size()
            if ".experts." in name:
                expert += n
            else:
                other += n
    frac = 1 - (1 - cfg.num_experts_per_tok / cfg.n_routed_experts) ** B
    return base + k * (other + expert * frac + B * cfg.sliding_window * 584)


# ---------------------------------------------------------------------------- cached prefix
def fill_request(cache, rc, g) -> None:
    """Random rows in every page rc holds and in its window ring, every layer (MTP included)."""
    from deepfuse.ops.kvcache import store_rows

    dev, ps, cfg = cache.device, cache.page_size, cache.cfg
    Wp = cache.geometry.ring_page_rows

    def put(target, slots, dim):
        for s0 in range(0, len(slots), 1 << 16):
            s = slots[s0:s0 + (1 << 16)]
            store_rows(target, torch.randn(len(s), dim, generator=g, device=dev).to(torch.bfloat16), s)

    ring = rc.slot * Wp + torch.arange(Wp, device=dev)
    for i, r in enumerate(cache.layer_ratio):
        v = cache.layer(i)
        put(v.window_target(), ring, cfg.head_dim)
        if r and rc.pages[r]:
            pages = torch.tensor(rc.pages[r], device=dev)
            slots = (pages[:, None] * ps + torch.arange(ps, device=dev)).flatten()
            put(v.target("attn"), slots, cfg.head_dim)
            if v.index is not None:
                put(v.target("index"), slots, cfg.index_head_dim)


def seed_prefix(eng, tokens: list[int], lengths: list[int], g) -> float:
    """Saved prefix states of tokens[:n] for each n in lengths in eng's prefix cache, filled
    with random rows instead of a prefill (module doc). -> seconds taken."""
    dev = eng.model.device
    _sync(dev)
    t0 = time.perf_counter()
    cache = eng.cache
    rc = cache.admit()
    cache.grow(rc, max(lengths))
    cache.flush()
    fill_request(cache, rc, g)
    for n in lengths:
        eng.prefix.insert(rc, tokens, n)
    cache.release(rc)
    _sync(dev)
    for n in lengths:
        e = eng.prefix.lookup(tokens[:n] + [0], n)
        if e is None or e.snap.tokens != n:
            raise RuntimeError(f"deepfuse: bench_e2e: the prefix cache did not keep the seeded {n}-token prefix")
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------- profiling
def profiled_step(eng, top: int = 12) -> dict:
    """One eager step (graphs off for it) under the torch profiler, each main layer and each
    MTP-layer call in a named range -> {"layers_ms": [per main layer], "mtp_ms", "kernels_ms"
    (all device work), "top": largest kernels}. CUDA: kernel time; CPU: host time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    model, dev = eng.model, eng.model.device
    cuda = dev.type == "cuda"
    hooks, stack = [], []

    def pre(name):
        def f(*_):
            rf = record_function(name)
            rf.__enter__()
            stack.append(rf)
        return f

    def post(*_):
        stack.pop().__exit__(None, None, None)

    for i, layer in enumerate(model.layers):
        hooks.append(layer.register_forward_pre_hook(pre(f"e2e.layer{i}")))
        hooks.append(layer.register_forward_hook(post))
    mtp_step = model.mtp_forward_step

    def mtp_wrapped(*a, **kw):
        with record_function("e2e.mtp"):
            return mtp_step(*a, **kw)

    model.mtp_forward_step = mtp_wrapped
    graphs, eng.runner.graphs = eng.runner.graphs, None
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        with profile(activities=acts) as prof:
            eng.step()
            _sync(dev)
    finally:
        eng.runner.graphs = graphs
        del model.mtp_forward_step
        for h in hooks:
            h.remove()
    ranges: dict[str, float] = {}
    kernels: dict[str, list] = {}
    for e in prof.events():
        if e.name.startswith("e2e."):
            if e.device_type == DeviceType.CPU:
                us = e.device_time_total if cuda else e.cpu_time_total
                ranges[e.name] = ranges.get(e.name, 0.0) + us / 1e3
        elif cuda and e.device_type != DeviceType.CPU:
            k = kernels.setdefault(e.name, [0.0, 0])
            k[0] += e.time_range.elapsed_us() / 1e3
            k[1] += 1
    if not cuda:
        for a in prof.key_averages():
            if not a.key.startswith("e2e."):
                kernels[a.key] = [a.self_cpu_time_total / 1e3, a.count]
    tops = sorted(kernels.items(), key=lambda kv: kv[1][0], reverse=True)[:top]
    return {"layers_ms": [ranges.get(f"e2e.layer{i}", 0.0) for i in range(len(model.layers))],
            "mtp_ms": ranges.get("e2e.mtp", 0.0),
            "kernels_ms": sum(v[0] for v in kernels.values()),
            "top": [{"op": n, "ms": v[0], "calls": v[1]} for n, v in tops]}


def kind_times(model, layers_ms: list[float]) -> dict:
    """Mean per-layer time of each layer kind of the model."""
    out: dict[str, list] = {}
    for kind, t in zip(model.cfg.layer_types, layers_ms):
        out.setdefault(kind, []).append(t)
    return {k: statistics.mean(v) for k, v in out.items()}


def project(model, step_ms: float, layers_ms: list[float]) -> float:
    """PROJECTION: the measured step plus, per layer kind, V4-Flash's layers beyond this
    model's times this model's mean per-layer time of that kind (the mean of all its layers
    for a kind it lacks). Embedding, head, sampler and MTP stay as measured."""
    kt = kind_times(model, layers_ms)
    mean = statistics.mean(layers_ms) if layers_ms else 0.0
    have = {k: model.cfg.layer_types.count(k) for k in FLASH_LAYERS}
    return step_ms + sum((n - have[k]) * kt.get(k, mean) for k, n in FLASH_LAYERS.items())


# ---------------------------------------------------------------------------- halves
def _rand_tokens(V: int, n: int, g) -> list[int]:
    return torch.randint(0, V, (n,), generator=g).tolist()


def run_prefill(eng, prefix: list[int], a, ceil: dict, gc_) -> list[dict]:
    from deepfuse.engine import SamplingParams

    model, dev, sch = eng.model, eng.model.device, eng.scheduler
    V, C, new = model.cfg.vocab_size, a.context, a.new
    cached = C - new
    done: list[int] = []  # prefills completed per step (scheduler.schedule is wrapped to count)
    step_new: list[int] = []
    schedule = sch.schedule

    def counting_schedule():
        chunks = schedule()
        P = lambda c: len(c.req.prompt_token_ids)  # noqa: E731
        step_new.append(sum(max(0, min(c.start + c.count, P(c)) - c.start) for c in chunks))
        done.append(sum(1 for c in chunks if c.start < P(c) <= c.start + c.count))
        return chunks

    def add(tag: str, n: int) -> None:
        for i in range(n):
            eng.add_request(f"p{tag}_{i}", prefix[:cached] + _rand_tokens(V, new, gc_),
                            SamplingParams(max_tokens=2 if a.k else 1, ignore_eos=True))

    sch.max_num_batched_tokens = min(a.budgets)
    add("warmup", 2)  # first calls (allocator growth, lazy tables) stay out of the timed steps
    while eng.has_unfinished():
        eng.step()
    rows = []
    sch.schedule = counting_schedule
    try:
        for budget in a.budgets:
            per_step = max(1, budget // new)
            n_req = per_step * a.prefill_steps
            sch.max_num_batched_tokens = budget
            hits0 = eng.prefix.stats()["hit_tokens"]
            add(str(budget), n_req)
            done.clear()
            step_new.clear()
            times, prof_at, prof = [], max(1, a.prefill_steps // 2), None  # a step with prefill chunks
            while eng.has_unfinished():
                if len(times) == prof_at and prof is None:
                    prof = profiled_step(eng)
                    times.append(None)
                    continue
                times.append(timed_step(eng, dev))
            hit = eng.prefix.stats()["hit_tokens"] - hits0
            if hit != n_req * cached:
                raise RuntimeError(f"deepfuse: bench_e2e: {hit} prefix-cache hit tokens, expected {n_req} x {cached}: "
                                   f"the seeded prefix was not reused")
            cum = np.cumsum(done)
            i20 = int(np.argmax(cum >= 0.2 * n_req))
            i90 = int(np.argmax(cum >= 0.9 * n_req))
            win = [i for i in range(i20 + 1, i90 + 1) if times[i] is not None and step_new[i]]
            if not win:  # too few steps for the 20-90% window: every timed step with prefill tokens
                win = [i for i in range(len(times)) if times[i] is not None and step_new[i]]
            tok, sec = sum(step_new[i] for i in win), sum(times[i] for i in win)
            fl = prefill_flops(model, new, C, per_step, bool(a.k))
            floor_s = fl["fp8"] / ceil["fp8_flops"] + fl["bf16"] / ceil["bf16_flops"]
            step_ms = sec / len(win) * 1e3
            row = {"budget": budget, "requests": n_req, "steps_in_window": len(win), "new_tok_s": tok / sec,
                   "step_ms": step_ms, "layers_ms": prof["layers_ms"] if prof else None,
                   "mtp_ms": prof["mtp_ms"] if prof else None, "tflop_fp8": fl["fp8"] / 1e12,
                   "tflop_bf16": fl["bf16"] / 1e12, "floor_ms": floor_s * 1e3, "x_floor": step_ms / (floor_s * 1e3),
                   "top_kernels": prof["top"] if prof else []}
            if prof:
                full_ms = project(model, step_ms, prof["layers_ms"])
                row["projection_full_step_ms"] = full_ms
                row["projection_full_new_tok_s"] = per_step * new / (full_ms / 1e3)
            rows.append(row)
            print(f"prefill budget {budget:6d}: {row['new_tok_s']:9.0f} new tok/s, step {step_ms:8.2f} ms "
                  f"(floor {row['floor_ms']:.2f} ms, {row['x_floor']:.1f}x), {len(win)} steps in window")
            if prof:
                print("   per layer ms:", " ".join(f"{t:.2f}" for t in prof["layers_ms"]),
                      f"| mtp {prof['mtp_ms']:.2f}")
                print("   largest:", ", ".join(f"{r['op'][:60]} {r['ms']:.2f} ms" for r in prof["top"][:4]))
    finally:
        del sch.schedule
    return rows


def tokens_per_step(before: dict, after: dict) -> float:
    """Mean tokens emitted per verify step between two `Engine.stats()["spec"]` readings."""
    n = after["verify_steps"] - before["verify_steps"]
    emitted = ((after["mean_accepted_length"] or 0) * after["verify_steps"]
               - (before["mean_accepted_length"] or 0) * before["verify_steps"])
    return emitted / max(n, 1)


def run_decode(eng, prefix: list[int], a, ceil: dict, mode: str, gc_) -> list[dict]:
    from deepfuse.engine import SamplingParams

    model, dev, sch = eng.model, eng.model.device, eng.scheduler
    V, C = model.cfg.vocab_size, a.context
    k = a.k if mode == "spec" else 0
    shared = C - DECODE_PRIVATE
    rows = []
    for B in a.batches:
        hits0 = eng.prefix.stats()["hit_tokens"]
        ids = [f"{mode}{B}_{i}" for i in range(B)]
        max_tokens = (a.steps + 4) * (k + 1) + 8
        for rid in ids:
            eng.add_request(rid, prefix[:shared] + _rand_tokens(V, DECODE_PRIVATE, gc_),
                            SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        while sch.waiting or any(r.num_computed < len(r.prompt_token_ids) for r in sch.running):
            eng.step()
        hit = eng.prefix.stats()["hit_tokens"] - hits0
        if hit != B * shared:
            raise RuntimeError(f"deepfuse: bench_e2e: {hit} prefix-cache hit tokens, expected {B} x {shared}")
        eng.step()
        eng.step()  # warm-up
        spec0 = eng.stats()["spec"] if k else None
        step = statistics.median(timed_step(eng, dev) for _ in range(a.steps))
        tps = tokens_per_step(spec0, eng.stats()["spec"]) if k else 1.0
        prof = profiled_step(eng)
        for rid in ids:
            eng.abort(rid)
        eng.step()
        fl = decode_floor_bytes(model, B, C, k)
        full_ms = project(model, step * 1e3, prof["layers_ms"])
        row = {"mode": mode, "B": B, "k": k, "context": C, "step_ms": step * 1e3, "tokens_per_step": tps,
               "tok_s_per_req": tps / step, "tok_s_total": B * tps / step, "floor_MB": fl / 1e6,
               "floor_ms": fl / ceil["copy_Bps"] * 1e3, "x_floor": step / (fl / ceil["copy_Bps"]),
               "layers_ms": prof["layers_ms"], "mtp_ms": prof["mtp_ms"], "kernels_ms": prof["kernels_ms"],
               "projection_full_step_ms": full_ms, "projection_full_tpot_ms": full_ms / tps,
               "top_kernels": prof["top"]}
        rows.append(row)
        print(f"decode {mode:5s} B {B:4d}: step {row['step_ms']:8.2f} ms (floor {row['floor_ms']:.2f} ms, "
              f"{row['x_floor']:.1f}x), {tps:.2f} tok/step, {row['tok_s_per_req']:.1f} tok/s/req, "
              f"{row['tok_s_total']:.0f} tok/s")
        print("   per layer ms:", " ".join(f"{t:.2f}" for t in prof["layers_ms"]), f"| mtp {prof['mtp_ms']:.2f}",
              "| largest:", ", ".join(f"{r['op'][:50]} {r['ms']:.2f}" for r in prof["top"][:3]))
    return rows


def _engine(model, a, k: int, max_reqs: int, budget: int):
    from deepfuse.engine import LLM

    C = a.context
    total = max(max_reqs * (C + 512), (2 * budget // a.new + 2) * (C + 512))
    # a step saves at most two entries per running request (checkpoint, finish): with more saved
    # slots than that, LRU eviction never drops the shared prefix (each admission touches it)
    llm = LLM(model, kv_dtype="fp8", max_num_seqs=max_reqs, max_num_batched_tokens=budget, max_total_tokens=total,
              max_model_len=C + 512, enable_prefix_caching=True, prefix_cache_entries=2 * max_reqs + 8,
              num_speculative_tokens=k, spec_simulate_acc_len=a.acc if k else None, overlap=False)
    return llm.engine


def parse(argv=None):
    ap = argparse.ArgumentParser(prog="python -m microbench.bench_e2e")
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--layers", default="swa,csa,hca,csa")
    ap.add_argument("--experts", default=None, choices=["fp8", "mxfp4"], help="default: fp8 (V4), mxfp4 (--v41)")
    ap.add_argument("--context", type=int, default=131072, help="context C per request")
    ap.add_argument("--new", type=int, default=4096, help="new (uncached) tokens per prefill request")
    ap.add_argument("--budgets", type=int, nargs="*", default=[4096, 8192, 16384, 32768, 65536],
                    help="new tokens per prefill step (chunked prefill budget)")
    ap.add_argument("--prefill-steps", type=int, default=8, help="steps' worth of requests per budget")
    ap.add_argument("--batches", type=int, nargs="*", default=[8, 16, 32, 64, 128, 256])
    ap.add_argument("--k", type=int, default=3, help="MTP drafts per decode step (spec mode)")
    ap.add_argument("--acc", type=float, default=3.25, help="simulated mean accepted length (spec mode)")
    ap.add_argument("--modes", default="spec,plain",
                    help="decode modes: spec (k drafts), plain (none); with --v41 also spec-eager (cuda_graphs off)")
    ap.add_argument("--steps", type=int, default=6, help="timed decode steps per batch")
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="tiny widths, short context (a CPU smoke test)")
    v = ap.add_argument_group("DeepSeek V4.1 (--v41): the V4.1 engine on a V4.1-Flash-width random model")
    v.add_argument("--v41", action="store_true", help="run the V4.1 benchmark (module doc, 'V4.1') instead")
    v.add_argument("--v41-ratios", default="0,0,2,1,1,1,1,1",
                   help="per-layer compress ratios (models.v41.flash_config derives the sources)")
    v.add_argument("--prompt", type=int, default=4096, help="V4.1 prefill: prompt tokens per request (cold)")
    v.add_argument("--replay", type=int, default=128,
                   help="V4.1 prefill: swa_replay_window K of the replayed run (0: exact run only)")
    v.add_argument("--engram-vocab", type=int, default=100000,
                   help="V4.1 Engram buckets per head (rows per table ~24x this; the release: 16M -> 384M rows)")
    v.add_argument("--engram-placement", default="host", choices=["host", "device"])
    v.add_argument("--draft-layers", type=int, default=1, help="V4.1 DSpark stages in the random model")
    v.add_argument("--no-engram-prefetch", action="store_true",
                   help="V4.1: no side-stream prefetch of host Engram rows (engram_state.attach_prefetch)")
    v.add_argument("--decode-prompt", type=int, default=1024, help="V4.1 decode: prompt tokens per request")
    v.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="V4.1: an EngineConfig field for every engine (value parsed as JSON, else a string)")
    v.add_argument("--spec-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="V4.1: an EngineConfig field of the spec decode engine only (e.g. the DSpark "
                        "selection field); spec also sets num_speculative_tokens=--k, spec_simulate_acc_len=--acc")
    args = sys.argv[1:] if argv is None else argv
    if "--v41" in args:
        ap.set_defaults(budgets=[8192], prefill_steps=4, batches=[1, 16], steps=8)
        if "--small" in args:
            ap.set_defaults(prompt=32, budgets=[64], prefill_steps=1, batches=[2], steps=1, replay=12,
                            engram_vocab=61, decode_prompt=16, context=320, new=64)
    elif "--small" in args:
        ap.set_defaults(context=320, new=64, budgets=[64, 128], prefill_steps=2, batches=[2], steps=1)
    a = ap.parse_args(argv)
    a.engine_args, a.spec_args = _kv_args(ap, a.engine_arg, "--engine-arg"), _kv_args(ap, a.spec_arg, "--spec-arg")
    if a.v41:
        if a.experts is None:
            a.experts = "mxfp4"
        try:
            a.ratios = [int(x) for x in a.v41_ratios.split(",") if x]
        except ValueError:
            ap.error(f"--v41-ratios: comma-separated ints, got {a.v41_ratios!r}")
        if a.prompt < 1 or a.decode_prompt < 1 or a.replay < 0 or a.engram_vocab < 2 or a.draft_layers < 0:
            ap.error("--prompt, --decode-prompt >= 1, --replay >= 0, --engram-vocab >= 2, --draft-layers >= 0")
        if any(b < a.prompt for b in a.budgets):
            ap.error(f"--budgets must be >= --prompt ({a.prompt}) with --v41, got {a.budgets}")
    elif a.experts is None:
        a.experts = "fp8"
    modes = [m for m in a.modes.split(",") if m]
    allowed = ("spec", "plain", "spec-eager") if a.v41 else ("spec", "plain")  # spec-eager: V4.1, cuda_graphs off
    if any(m not in allowed for m in modes):
        ap.error(f"--modes: {' / '.join(allowed)}, got {a.modes!r}")
    a.modes = modes
    if not 0 <= a.k <= 8 or (a.k and not 1 <= a.acc <= a.k + 1):
        ap.error(f"--k must be in [0, 8] and --acc in [1, k + 1], got {a.k}, {a.acc}")
    if a.k == 0:
        a.modes = ["plain"]
    if not a.v41 and (a.new < 1 or a.context <= max(a.new, DECODE_PRIVATE)):
        ap.error(f"--context ({a.context}) must exceed --new ({a.new}) and {DECODE_PRIVATE}")
    if not a.v41 and any(b < a.new or b % a.new for b in a.budgets):
        ap.error(f"--budgets must be multiples of --new ({a.new}), got {a.budgets}")
    if a.prefill_steps < 1 or a.steps < 1 or any(b < 1 for b in a.batches):
        ap.error("--prefill-steps, --steps and --batches must be >= 1")
    return a


def _kv_args(ap, items: list, flag: str) -> dict:
    out = {}
    for it in items:
        k, sep, v = it.partition("=")
        if not sep or not k:
            ap.error(f"{flag}: KEY=VALUE, got {it!r}")
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def main(argv=None) -> int:
    a = parse(argv)
    if a.v41:
        return main_v41(a)
    from deepfuse.models import random as rnd

    t_start = time.perf_counter()
    dev = torch.device(a.device)
    cfg = rnd.flash_config([KINDS[k] for k in a.layers.split(",")], **(SMALL if a.small else {}))
    t0 = time.perf_counter()
    model = rnd.build(cfg, device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32, quant="fp8",
                      expert_quant=a.experts)
    print(f"# model {a.layers} + MTP, {a.experts} experts, built in {time.perf_counter() - t0:.1f} s")
    ceil = measure_ceilings(dev, a.small)
    meta = {"gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": _commit(),
            "torch": torch.__version__, "layers": a.layers, "experts": a.experts, "kv_dtype": "fp8",
            "context": a.context, "new": a.new, "k": a.k, "acc": a.acc, "small": a.small,
            "copy_tbps": ceil["copy_Bps"] / 1e12, "bf16_tflops": ceil["bf16_flops"] / 1e12,
            "fp8_tflops": ceil["fp8_flops"] / 1e12, "peaks": ceil["peaks"],
            "cached_prefix": "random FP8 rows written into the pages of one admitted slot, saved with "
                             "PrefixCache.insert (not prefilled); requests hit it through the scheduler",
            "decode_shared_prefix": a.context - DECODE_PRIVATE, "overlap": False}
    print(f"# {meta['gpu']} | {meta['date']} | commit {meta['commit']} | copy {meta['copy_tbps']:.2f} TB/s | "
          f"bf16 {meta['bf16_tflops']:.1f} TFLOP/s | fp8 {meta['fp8_tflops']:.1f} TFLOP/s")
    g = torch.Generator(device=dev).manual_seed(0)
    gc_ = torch.Generator().manual_seed(0)
    prefix = _rand_tokens(cfg.vocab_size, a.context - DECODE_PRIVATE, gc_)
    prefill, decode, capture, seed_s, refs = [], [], {}, [], {}
    max_b = max(a.batches) if not a.skip_decode else 1
    budget = max(a.budgets) if not a.skip_prefill else 8192
    pf_mode = "spec" if "spec" in a.modes else "plain"  # the prefill half runs with the MTP layer when k > 0
    for mode in [m for m in ("spec", "plain") if m in a.modes]:
        run_pf = not a.skip_prefill and mode == pf_mode
        if not run_pf and a.skip_decode:
            continue
        eng = _engine(model, a, a.k if mode == "spec" else 0, max(max_b, 2 * (budget // a.new) + 2),
                      max(budget if run_pf else 0, 8192))
        capture[mode] = eng.graph_capture_s
        # each half seeds its own prefix right before it runs (LRU: an entry unused during the
        # other half could have been evicted by that half's own entries)
        if run_pf:
            seed_s.append(seed_prefix(eng, prefix, [a.context - a.new], g))
            prefill = run_prefill(eng, prefix, a, ceil, gc_)
        if not a.skip_decode:
            seed_s.append(seed_prefix(eng, prefix, [a.context - DECODE_PRIVATE], g))
            decode += run_decode(eng, prefix, a, ceil, mode, gc_)
        refs[mode] = eng.stats().get("reference_calls")  # torch-reference op calls (none expected on CUDA)
        del eng
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    meta["graph_capture_s"], meta["seed_prefix_s"], meta["reference_calls"] = capture, seed_s, refs
    proj = {"label": "PROJECTION to V4-Flash (43 layers: 2 SWA, 21 CSA, 20 HCA) from this model's measured "
                     "per-layer kernel times; one H200 cannot hold the full model; not a measurement",
            "sglang_published": SGLANG_H200_TP4,
            "decode": [{"mode": r["mode"], "B": r["B"], "full_step_ms": r["projection_full_step_ms"],
                        "full_tpot_ms": r["projection_full_tpot_ms"]} for r in decode],
            "prefill": [{"budget": r["budget"], "full_new_tok_s": r.get("projection_full_new_tok_s")}
                        for r in prefill]}
    print(f"# {proj['label']}")
    for p in proj["decode"]:
        print(f"   decode {p['mode']:5s} B {p['B']:4d}: full step {p['full_step_ms']:.2f} ms, "
              f"TPOT {p['full_tpot_ms']:.2f} ms")
    for p in proj["prefill"]:
        if p["full_new_tok_s"]:
            print(f"   prefill budget {p['budget']:6d}: {p['full_new_tok_s']:.0f} new tok/s")
    print("   SGLang, V4-Flash, 4 x H200 TP4, ISL 8K (published): "
          + "; ".join(f"{s['setup']} c{s['concurrency']} TPOT {s['tpot_ms']} ms" for s in SGLANG_H200_TP4))
    meta["wall_s"] = time.perf_counter() - t_start
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "e2e.json"
    path.write_text(json.dumps({"bench": "e2e", "context": meta, "prefill": prefill, "decode": decode,
                                "projection": proj}, indent=1))
    plots = [] if a.no_plots else _plots(out, meta, prefill, decode)
    print(f"# wrote {path}" + "".join(f", {p}" for p in plots) + f" ({meta['wall_s']:.0f} s)")
    return 0


# ---------------------------------------------------------------------------- DeepSeek V4.1
SMALL_V41 = dict(vocab_size=1000, hidden_size=64, num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32, q_lora_rank=32, o_lora_rank=32, o_groups=2, index_n_heads=4, index_topk=8,
                 sliding_window=8, candidate_topk_blocks=4, candidate_block_size=2, engram_n_heads=2,
                 engram_head_dim=32, engram_max_ngram_size=3, dspark_markov_rank=8, dspark_n_routed_experts=4,
                 dspark_num_experts_per_tok=2)


def _v41_engine(model, a, *, budget: int, max_reqs: int, max_len: int, extra: Optional[dict] = None):
    from deepfuse.engine import LLM

    kw = dict(kv_dtype="fp8", max_num_seqs=max_reqs, max_num_batched_tokens=budget,
              max_total_tokens=max_reqs * (max_len + 64) + budget, max_model_len=max_len, overlap=False)
    kw.update(a.engine_args)
    kw.update(extra or {})
    return LLM(model, **kw).engine


def run_prefill_v41(eng, a) -> list[dict]:
    """Cold prefills of --prompt tokens (max_tokens 1), the chunked-prefill budget per step, the
    same prompts exact and with bounded replay (the planner swapped on the same engine)."""
    from deepfuse.engine import SamplingParams
    from deepfuse.engine.replay import make_replay

    model, dev, sch = eng.model, eng.model.device, eng.scheduler
    V, P = model.cfg.vocab_size, a.prompt
    rows = []
    for budget in a.budgets:
        sch.max_num_batched_tokens = budget
        n_req = max(1, budget // P) * a.prefill_steps
        g = torch.Generator().manual_seed(budget)
        prompts = [_rand_tokens(V, P, g) for _ in range(n_req + 1)]
        first: dict = {}
        for mode in ["exact"] + (["replay"] if a.replay else []):
            eng.runner.replay = make_replay(model, SimpleNamespace(swa_replay_window=a.replay if mode == "replay" else 0))
            eng.add_request(f"{mode}{budget}_warmup", prompts[-1], SamplingParams(max_tokens=1, ignore_eos=True))
            while eng.has_unfinished():  # first calls (allocator growth, lazy tables) stay out of the timing
                eng.step()
            if eng.runner.replay is not None:
                eng.runner.replay.steps = eng.runner.replay.skipped_tokens = 0
            for i, p in enumerate(prompts[:-1]):
                eng.add_request(f"{mode}{budget}_{i}", p, SamplingParams(max_tokens=1, ignore_eos=True))
            times, toks = [], {}
            while eng.has_unfinished():
                _sync(dev)
                t = time.perf_counter()
                outs = eng.step()
                _sync(dev)
                times.append(time.perf_counter() - t)
                for o in outs:
                    if o.token_ids:
                        toks[int(o.request_id.rsplit("_", 1)[1])] = o.token_ids[0]
            first[mode] = toks
            rp = eng.runner.replay
            sec = sum(times)
            row = {"mode": mode, "budget": budget, "prompt": P, "requests": n_req, "steps": len(times),
                   "step_ms": statistics.median(times) * 1e3, "new_tok_s": n_req * P / sec,
                   "replay_window": a.replay if mode == "replay" else 0,
                   "replay_steps": rp.steps if rp else 0, "skipped_tokens": rp.skipped_tokens if rp else 0}
            rows.append(row)
            print(f"v4.1 prefill {mode:6s} budget {budget:6d}: {row['new_tok_s']:9.0f} tok/s, step "
                  f"{row['step_ms']:8.2f} ms ({len(times)} steps), late-layer tokens skipped {row['skipped_tokens']}")
        eng.runner.replay = None
        if "replay" in first:
            ex, rp_ = rows[-2], rows[-1]
            rp_["speedup"] = rp_["new_tok_s"] / ex["new_tok_s"]
            agree = [first["exact"].get(i) == first["replay"].get(i) for i in range(n_req)]
            rp_["first_token_agree"] = sum(agree) / len(agree)
            print(f"   replay {a.replay}: {rp_['speedup']:.2f}x prefill; first sampled token equal to the exact run "
                  f"for {sum(agree)}/{len(agree)} prompts (APPROXIMATE; random weights)")
    return rows


def run_decode_v41(model, a, mode: str) -> list[dict]:
    """B requests of --decode-prompt tokens, then --steps timed decode steps: plain, or spec
    (num_speculative_tokens --k at simulated acceptance --acc, plus --spec-arg fields)."""
    from deepfuse.engine import SamplingParams

    dev = model.device
    k = a.k if mode.startswith("spec") else 0
    extra = dict(num_speculative_tokens=k, spec_simulate_acc_len=a.acc, **a.spec_args) if k else {}
    if mode == "spec-eager":  # the same spec engine with eager steps (DSpark drafts included)
        extra["cuda_graphs"] = False
    max_tokens = (a.steps + 4) * (k + 1) + 8
    max_len = a.decode_prompt + max_tokens + 8
    eng = _v41_engine(model, a, budget=max(max(a.budgets), a.decode_prompt), max_reqs=max(a.batches),
                      max_len=max_len, extra=extra)
    g = torch.Generator().manual_seed(7)
    rows = []
    for B in a.batches:
        ids = [f"{mode}{B}_{i}" for i in range(B)]
        for rid in ids:
            eng.add_request(rid, _rand_tokens(model.cfg.vocab_size, a.decode_prompt, g),
                            SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        sch = eng.scheduler
        while sch.waiting or any(r.num_computed < len(r.prompt_token_ids) for r in sch.running):
            eng.step()
        eng.step()
        eng.step()  # warm-up
        spec0 = eng.stats().get("spec")
        step = statistics.median(timed_step(eng, dev) for _ in range(a.steps))
        if len(sch.running) != B:  # a failing step ends its requests (Engine._isolate logs why)
            raise RuntimeError(f"{B - len(sch.running)} of {B} decode requests ended early (failed; see the log)")
        tps = tokens_per_step(spec0, eng.stats()["spec"]) if k else 1.0
        for rid in ids:
            eng.abort(rid)
        eng.step()
        ds = eng.runner.dspark
        row = {"mode": mode, "B": B, "k": k, "prompt": a.decode_prompt, "step_ms": step * 1e3,
               "tokens_per_step": tps, "tok_s_per_req": tps / step, "tok_s_total": B * tps / step,
               "spec_args": a.spec_args if k else {}, "cuda_graphs": eng.runner.graphs is not None,
               "overlap": eng.overlap, "dspark_graph_steps": ds.graph_steps if ds is not None else None,
               "dspark_graphs_captured": sum(g.graph is not None for g in ds.draft_graphs.values()) if ds else None}
        rows.append(row)
        print(f"v4.1 decode {mode:5s} B {B:4d}: step {row['step_ms']:8.2f} ms, {tps:.2f} tok/step, "
              f"{row['tok_s_per_req']:.1f} tok/s/req, {row['tok_s_total']:.0f} tok/s")
    refs = eng.stats().get("reference_calls")
    del eng
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rows, refs


def main_v41(a) -> int:
    """The V4.1 engine on a V4.1-Flash-width random model (models.v41.flash_config /
    random_model: FP8 128-block linears, --experts routed experts, Engram tables of --engram-vocab
    buckets per head in --engram-placement memory, FP8 caches, eager steps): prefill tok/s exact
    vs bounded replay (--replay), decode plain and spec. A part that raises is recorded as
    {"error": ...} and the rest still runs."""
    import dataclasses
    import traceback

    from deepfuse.models import v41, v41_random

    t_start = time.perf_counter()
    dev = torch.device(a.device)
    cfg = v41.flash_config(a.ratios, engram_vocab_size=a.engram_vocab, draft_layers=a.draft_layers,
                           **(SMALL_V41 if a.small else {}))
    cfg = dataclasses.replace(cfg, engram_placement=a.engram_placement).validate()
    t0 = time.perf_counter()
    model = v41_random.random_model(cfg, device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32,
                             quant="fp8", expert_quant=a.experts)
    tables = model.engram_tables()
    cut = v41.replay_first_layer(cfg)
    prefetch = None
    if a.no_engram_prefetch:  # the engines attach none either (engram_state.engine_prefetch)
        model.engram_prefetch = False
    elif a.engram_placement == "host":  # None off the GPU; the engines reuse it
        from deepfuse.engine.engram_state import attach_prefetch

        prefetch = attach_prefetch(model, max([*a.budgets, a.decode_prompt * max(a.batches)]))
    meta = {"gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": _commit(),
            "torch": torch.__version__, "model": "V4.1-Flash-width random" + (" (SMALL widths)" if a.small else ""),
            "ratios": cfg.ratios, "kv_sources": list(cfg.kv_source_layers), "index_sources":
            list(cfg.index_source_layers), "replay_first_layer": cut, "late_layers": cfg.num_hidden_layers - cut,
            "experts": a.experts, "linears": "fp8 128-block", "kv_dtype": "fp8", "draft_layers": a.draft_layers,
            "engram_rows": [t.rows for t in tables], "engram_placement": a.engram_placement,
            "engram_table_device": [str(t.weight.device) for t in tables],
            "engram_pinned": [bool(t.weight.is_pinned()) for t in tables if t.weight.device.type == "cpu"],
            "engram_table_bytes": sum(t.weight.numel() + t.scale.numel() for t in tables),
            "engram_prefetch": prefetch is not None,
            "build_s": time.perf_counter() - t0, "engine_args": a.engine_args, "small": a.small,
            "replay": "APPROXIMATE (decoder-side SWA bounded replay, engine/replay.py)"}
    print(f"# V4.1 random model {cfg.ratios} (+{a.draft_layers} DSpark), late layers {cut}.., Engram rows "
          f"{meta['engram_rows']} on {meta['engram_table_device']}, built in {meta['build_s']:.1f} s | "
          f"{meta['gpu']} | commit {meta['commit']}")
    prefill, decode, errors, refs = [], [], {}, {}
    if not a.skip_prefill:
        try:
            eng = _v41_engine(model, a, budget=max(a.budgets), max_reqs=max(1, max(a.budgets) // a.prompt) + 1,
                              max_len=a.prompt + 8)
            prefill = run_prefill_v41(eng, a)
            refs["prefill"] = eng.stats().get("reference_calls")
            del eng
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        except Exception as e:
            errors["prefill"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
    if not a.skip_decode:
        for mode in a.modes:
            try:
                rows, refs[mode] = run_decode_v41(model, a, mode)
                decode += rows
            except Exception as e:
                errors[mode] = f"{type(e).__name__}: {e}"
                print(f"v4.1 decode {mode}: FAILED {errors[mode]}")
                if not mode.startswith("spec"):
                    traceback.print_exc()
    meta["reference_calls"], meta["errors"] = refs, errors
    meta["engram_prefetch"] = getattr(model, "_engram_prefetch", None) is not None  # the engines' (engine_prefetch) too
    meta["wall_s"] = time.perf_counter() - t_start
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "e2e_v41.json"
    path.write_text(json.dumps({"bench": "e2e_v41", "context": meta, "prefill": prefill, "decode": decode}, indent=1))
    print(f"# wrote {path} ({meta['wall_s']:.0f} s)" + (f"; errors: {errors}" if errors else ""))
    return 0 if not errors or set(errors) <= {"spec", "spec-eager"} else 1


def _plots(out: Path, meta: dict, prefill: list, decode: list) -> list:
    from microbench.harness import plot

    ctx = SimpleNamespace(gpu=meta["gpu"], date=meta["date"], commit=meta["commit"])
    paths = []
    if prefill:
        paths.append(plot(out, "e2e_prefill", ctx, prefill, x="budget", ys=["new_tok_s"],
                          ylabel=f"new tokens / s (context {meta['context']})"))
    if decode:
        paths.append(plot(out, "e2e_decode", ctx, decode, x="B", ys=["step_ms"], group="mode",
                          ylabel=f"decode step ms (context {meta['context']}, k {meta['k']}, acc {meta['acc']})"))
    return [str(p) for p in paths if p is not None]


if __name__ == "__main__":
    raise SystemExit(main())
