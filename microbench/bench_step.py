"""The V4 decode step against its memory floor (issue 16's step benchmark).

    python -m microbench.bench_step [--layers swa,csa,hca,csa] [--experts fp8|mxfp4]
                                    [--batches 1 8 32 64 128] [--contexts 4096 65536] [--out DIR]

A random V4-Flash-width model (models.random, built on the GPU) runs decode steps through
the engine (FP8 caches) with B requests at a given context. The caches are filled with
random rows instead of a prefill (the step reads them the same way). Reported per cell:
step time, the memory floor (bytes one step must read: all non-expert weights, the routed
experts the batch is expected to touch, the KV rows its attention reads; over the copy
bandwidth measured in the run), time / floor, and the largest ops of one step by CUDA time
(torch profiler). --small runs tiny widths (a smoke test; also on the CPU).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import time
from pathlib import Path

import torch

KINDS = {"swa": "sliding_attention", "csa": "compressed_sparse_attention", "hca": "heavily_compressed_attention"}


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed_step(eng, dev) -> float:
    """Wall seconds of one engine step, the device synchronised before and after."""
    _sync(dev)
    t = time.perf_counter()
    eng.step()
    _sync(dev)
    return time.perf_counter() - t


def fill_caches(cache, g) -> None:
    """Random KV rows (and indexer keys) in every page and ring row of the cache."""
    from deepfuse import kv_format as F
    from deepfuse import ops

    dev = cache.device

    def rows(n, d):
        return torch.randn(n, d, generator=g, device=dev).to(torch.bfloat16)

    def kv(t, ps):
        L, P = t.shape[0], t.shape[1]
        for l in range(L):
            for p0 in range(0, P, 1024):
                p1 = min(P, p0 + 1024)
                slots = torch.arange(p0 * ps, p1 * ps, device=dev)
                if cache.fp8:
                    ops.kv_store(F.KVPages(F.KVFormat(ps, "fp8"), t[l:l + 1]), slots, rows(len(slots), F.KV_DIM))
                else:
                    t[l].view(-1, t.shape[-1])[slots] = rows(len(slots), t.shape[-1]).to(t.dtype)

    kv(cache.ring, cache.geometry.ring_page_rows)
    for r, t in cache.comp.items():
        kv(t, cache.page_size)
    if cache.index is not None:
        t, ps = cache.index, cache.page_size
        for l in range(t.shape[0]):
            slots = torch.arange(t.shape[1] * ps, device=dev)
            k = rows(len(slots), cache.cfg.index_head_dim)
            if cache.fp8:
                ops.indexer_key_store(F.IndexerKeyPages(F.IndexerKeyFormat(ps, "fp8"), t[l:l + 1]), slots, k)
            else:
                t[l].view(-1, t.shape[-1])[slots] = k.to(t.dtype)


def start_requests(eng, B: int, context: int, g) -> None:
    """B running requests that have computed context - 1 tokens (their caches hold random rows)."""
    from deepfuse.engine import SamplingParams
    from deepfuse.engine.request import Status

    V = eng.vocab_size
    for i in range(B):
        eng.add_request(f"s{i}", torch.randint(0, V, (context,), generator=g, device="cpu").tolist(),
                        SamplingParams(max_tokens=400, ignore_eos=True))
    sch, cache = eng.scheduler, eng.cache
    while sch.waiting:
        req = sch.waiting.popleft()
        req.cache = cache.admit()
        req.status = Status.RUNNING
        cache.grow(req.cache, context)
        req.num_computed = context - 1
        sch.running.append(req)
    cache.flush()


def floor_bytes(model, B: int, context: int) -> float:
    """Bytes one decode step must read: every non-expert weight once, the expected distinct
    routed experts of B tokens (top-k of E, uniform), and the FP8 KV rows attention reads."""
    cfg = model.cfg
    expert, other = 0, 0
    for name, t in model.named_buffers():
        n = t.numel() * t.element_size()
        if ".experts." in name:
            expert += n
        elif not name.startswith("mtp.") and "embed" not in name:
            other += n
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    frac = 1 - (1 - k / E) ** B
    kv = 0
    for t in cfg.layer_types:
        r = cfg.compress_ratio(t)
        rows = min(context, cfg.sliding_window)
        if t == KINDS["csa"]:
            rows += min(context // r, cfg.index_topk) + (context // r) * 132 / 584  # selected rows + indexer keys
        elif t == KINDS["hca"]:
            rows += context // r
        kv += rows * 584
    # (hash-routed layers touch up to B * k experts as well: counted alike)
    return other + expert * frac + B * kv


def replay_ms(graph, reps: int = 10) -> float:
    """Median time of one replay of a captured step (it repeats the step last written to its
    buffers: the same rows rewritten, same reads)."""
    from microbench.harness import replay_times_ms

    return statistics.median(replay_times_ms(graph, reps))


def step_profile(eng, dev, top: int = 12) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        eng.step()
        _sync(dev)
    key = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    rows = []
    avgs = prof.key_averages()
    for e in sorted(avgs, key=lambda e: getattr(e, key, 0), reverse=True)[:top]:
        rows.append({"op": e.key, "ms": getattr(e, key, 0) / 1e3, "calls": e.count})
    if dev.type == "cuda":  # kernels only have self device time: their sum is the step's device busy time
        rows.insert(0, {"op": "(all kernels)", "ms": sum(getattr(e, key, 0) for e in avgs) / 1e3, "calls": 0})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--layers", default="swa,csa,hca,csa")
    ap.add_argument("--experts", default="fp8", choices=["fp8", "mxfp4"])
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8, 32, 64, 128])
    ap.add_argument("--contexts", type=int, nargs="*", default=[4096, 65536])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="tiny widths: a smoke test")
    ap.add_argument("--no-graphs", action="store_true", help="eager decode steps (no CUDA graphs)")
    ap.add_argument("--spec", type=int, default=0, help="MTP drafts per step (speculative decoding)")
    ap.add_argument("--acc", type=float, default=None, help="simulated mean accepted length (with --spec)")
    ap.add_argument("--overlap", action="store_true",
                    help="also run unsynchronised overlapped steps: wall ms per step, tokens/s per request, how "
                         "many speculative steps launched before the previous one was read back (early_steps), "
                         "the GPU idle fraction between steps (CUDA)")
    ap.add_argument("--draft-head", nargs="*", default=[None], choices=["fp8", "model"],
                    help="with --spec: the MTP drafts' lm head (EngineConfig.spec_draft_head; default: the model's); "
                         "several: one row per head, same model")
    ap.add_argument("--with-plain", action="store_true",
                    help="with --spec: also run each cell without speculation (same model and session: the "
                         "ratio's base)")
    ap.add_argument("--reference", action="store_true",
                    help="every model-graph op through its torch reference (the eager baseline)")
    a = ap.parse_args(argv)
    if a.reference:
        from deepfuse import _ext

        _ext.set_kernels_enabled(False)
    from deepfuse.engine import LLM
    from deepfuse.models import random as rnd

    dev = torch.device(a.device)
    kinds = [KINDS[k] for k in a.layers.split(",")]
    small = dict(hidden_size=64, num_attention_heads=4, n_routed_experts=8, moe_intermediate_size=64, q_lora_rank=64,
                 o_groups=2, o_lora_rank=64, vocab_size=1000, index_n_heads=4, index_topk=8) if a.small else {}
    cfg = rnd.flash_config(kinds, **small)
    t0 = time.perf_counter()
    model = rnd.build(cfg, device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32,
                      quant="fp8", expert_quant=a.experts)
    print(f"# model {a.layers} {a.experts} experts built in {time.perf_counter() - t0:.1f} s")
    copy = None
    if dev.type == "cuda":
        from microbench.harness import copy_bandwidth

        copy = copy_bandwidth()
    rows = []
    g = torch.Generator(device=dev).manual_seed(0)
    gc = torch.Generator().manual_seed(0)
    variants = ([(0, None)] if a.spec and a.with_plain else []) + [(a.spec, h if a.spec else None)
                                                                  for h in (a.draft_head if a.spec else [None])]
    cells = [(ctx, B, k, h) for ctx in a.contexts for B in a.batches for k, h in variants]
    for ctx, B, spec, head in cells:
        llm = LLM(model, kv_dtype="fp8", max_num_seqs=B, max_num_batched_tokens=max(256, B * 4),
                  max_total_tokens=B * (ctx + 512), max_model_len=ctx + 512, overlap=False,
                  cuda_graphs=not (a.no_graphs or a.reference), num_speculative_tokens=spec,
                  spec_simulate_acc_len=a.acc if spec else None, spec_draft_head=head)
        eng = llm.engine
        fill_caches(eng.cache, g)
        start_requests(eng, B, ctx, gc)
        eng.step()  # warm-up (with --spec: the first drafts)
        eng.step()
        spec0 = eng.stats()["spec"] if spec else None
        step = statistics.median(timed_step(eng, dev) for _ in range(a.steps))
        fl = floor_bytes(model, B, ctx)
        row = {"B": B, "context": ctx, "spec": spec, "step_ms": step * 1e3, "floor_MB": fl / 1e6,
               "graph_capture_s": eng.graph_capture_s, "fused_steps": eng.runner.fused_steps}
        if spec and eng.runner.graphs is not None:  # the speculative step's graphs against a plain decode
            gr = eng.runner.graphs
            bucket = next(b for b in gr.buckets if b >= B)
            for T, name in ((1, "decode_replay_ms"), (spec + 1, "verify_replay_ms")):
                g_ = gr.graphs.get((bucket, T))
                if g_ is not None and g_.graph is not None:
                    row[name] = replay_ms(g_.graph)
                    if T > 1 and g_.mtp is not None and g_.mtp[0] is not None:
                        row["mtp_replay_ms"] = replay_ms(g_.mtp[0])  # the teacher-forced MTP pass
                    if T > 1 and g_.fused is not None and g_.fused[0] is not None:
                        row["fused_replay_ms"] = replay_ms(g_.fused[0])  # the whole greedy speculative step
            ch = gr.chains.get(bucket)
            if ch is not None and ch.graph is not None:
                row["chain_replay_ms"] = replay_ms(ch.graph)      # one chained draft step
            if "decode_replay_ms" in row and "verify_replay_ms" in row:
                row["verify_x_decode"] = row["verify_replay_ms"] / row["decode_replay_ms"]
                if "mtp_replay_ms" in row and "chain_replay_ms" in row:
                    # drafts + verify in replays only (goal <= 1.6x at B <= 8); step_x_decode: measured step
                    row["spec_replays_x_decode"] = (row["verify_replay_ms"] + row["mtp_replay_ms"] + (spec - 1)
                                                    * row["chain_replay_ms"]) / row["decode_replay_ms"]
                    row["step_x_decode"] = step * 1e3 / row["decode_replay_ms"]
                if "fused_replay_ms" in row:  # the goal's figure: a speculative step <= 1.6x a decode step
                    row["fused_x_decode"] = row["fused_replay_ms"] / row["decode_replay_ms"]
        if spec:  # tokens each request emits per step, over the timed steps
            st = eng.stats()["spec"]
            row["draft_head"] = st["draft_head"]
            rows_v = st["verify_steps"] - spec0["verify_steps"]
            row["tokens_per_step"] = ((st["mean_accepted_length"] or 0) * st["verify_steps"]
                                      - (spec0["mean_accepted_length"] or 0) * spec0["verify_steps"]) / max(rows_v, 1)
            row["tok_s_per_req"] = row["tokens_per_step"] / step
        if copy:
            row["floor_ms"] = fl / copy * 1e3
            row["x_floor"] = step / (fl / copy)
        if a.overlap:  # the overlapped loop: wall time per step, tokens/s, GPU idle between steps
            cuda = dev.type == "cuda"
            eng.overlap, eng.gpu_events = True, [] if cuda else None
            eng.step()  # the first overlapped step (nothing in flight yet)
            spec1, e0, n = eng.stats().get("spec"), eng.runner.early_steps, 2 * a.steps
            _sync(dev)
            t = time.perf_counter()
            for _ in range(n):
                eng.step()
            _sync(dev)
            ov = (time.perf_counter() - t) / n
            row["overlap_step_ms"] = ov * 1e3
            row["early_steps"] = eng.runner.early_steps - e0  # steps launched before the previous read-back
            tps = 1.0
            if spec:
                st = eng.stats()["spec"]
                rv = st["verify_steps"] - spec1["verify_steps"]
                tps = ((st["mean_accepted_length"] or 0) * st["verify_steps"]
                       - (spec1["mean_accepted_length"] or 0) * spec1["verify_steps"]) / max(rv, 1)
            row["overlap_tok_s_per_req"] = tps / ov
            if cuda:
                ev = eng.gpu_events
                gaps = [max(0.0, x[1].elapsed_time(y[0])) for x, y in zip(ev, ev[1:])]
                busy = [s_.elapsed_time(e_) for s_, e_ in ev[1:]]
                row["gpu_idle_frac"] = sum(gaps) / max(sum(gaps) + sum(busy), 1e-9)
            eng.gpu_events = None
            while eng._inflight is not None:  # settle the step in flight: the profile below runs the plain loop
                eng.overlap = False
                eng.step()
        row["top_ops"] = step_profile(eng, dev)
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if k != "top_ops"})
        print("   largest:", ", ".join(f"{r['op']} {r['ms']:.2f} ms" for r in row["top_ops"][:5]))
        rows.append(row)
        del llm, eng
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": os.environ.get("DEEPFUSE_COMMIT", "unknown"), "layers": a.layers, "experts": a.experts,
            "copy_tbps": copy / 1e12 if copy else None}
    meta["path"] = "reference" if a.reference else "kernels"
    meta["graphs"] = not (a.no_graphs or a.reference)
    meta["spec"], meta["acc"], meta["overlap"] = a.spec, a.acc, a.overlap
    meta["draft_heads"], meta["with_plain"] = a.draft_head, a.with_plain
    name = "step_reference" if a.reference else "step_eager" if a.no_graphs else "step"
    if a.spec:
        name += f"_spec{a.spec}_acc{a.acc}"
    (out / f"{name}.json").write_text(json.dumps({"kernel": "step", "context": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
