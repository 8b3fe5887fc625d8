"""Where the non-kernel time of an eager prefill step goes (bench_e2e's prefill half).

Builds bench_e2e's random V4-Flash-width model and engine, seeds the cached prefix, warms up,
then for one prefill step of `--budget` new tokens:
  1. wall time vs the union of device activity (kernels, copies, memsets) -> device idle time;
  2. device idle time attributed to the host Python frame running during it (kineto trace with
     Python stacks, sampled every 2 us inside each idle gap; innermost deepfuse frame + its caller);
  3. host->device synchronisations of another step (torch.cuda.set_sync_debug_mode), by stack.
Prints tables; writes prefill_gaps.json (and the trace with --trace).

    python tools/probes/prefill_gaps.py --budget 8192 --out /tmp/gaps
    python tools/probes/prefill_gaps.py --small --device cpu      # plumbing check on the CPU
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import time
import traceback
import warnings
from pathlib import Path

import torch

from microbench import bench_e2e as E


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _frame(name: str) -> bool:
    return "deepfuse" in name or "microbench" in name


def analyse(trace: dict, step_name: str = "gaps.step") -> dict:
    ev = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    step = [e for e in ev if e.get("name") == step_name]
    if not step:
        raise RuntimeError("prefill_gaps: the step range is missing from the trace")
    t0, t1 = step[0]["ts"], step[0]["ts"] + step[0]["dur"]
    dev_cats = {"kernel", "gpu_memcpy", "gpu_memset"}
    busy = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("cat") in dev_cats and t0 <= e["ts"] <= t1)
    merged = []
    for a, b in busy:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    busy_us = sum(b - a for a, b in merged)
    gaps, prev = [], t0
    for a, b in merged:
        if a > prev:
            gaps.append((prev, a))
        prev = max(prev, b)
    if t1 > prev:
        gaps.append((prev, t1))
    # python frames on the main thread: sampled innermost deepfuse frame during the gaps
    tid = step[0].get("tid")
    py = [e for e in ev if e.get("cat") == "python_function" and e.get("tid") == tid and t0 - 1 <= e["ts"] <= t1]
    py.sort(key=lambda e: (e["ts"], -e["dur"]))
    by_frame: dict = collections.Counter()
    by_pair: dict = collections.Counter()
    runtime = [e for e in ev if e.get("cat") == "cuda_runtime" and t0 <= e["ts"] <= t1]
    sync_rt = collections.Counter()
    for e in runtime:
        n = e["name"]
        if "Synchronize" in n or ("Memcpy" in n and "Async" not in n) or n == "cudaMemcpyAsync":
            sync_rt[n] += e["dur"]
    # samples in the gaps, in time order; the frames of one thread nest, so a stack sweep is exact
    dt = max(2.0, sum(b - a for a, b in gaps) / 200000)
    stack: list = []
    j = 0
    for a, b in gaps:
        t = a + dt / 2
        while t < b:
            while j < len(py) and py[j]["ts"] <= t:
                while stack and stack[-1]["ts"] + stack[-1]["dur"] < py[j]["ts"]:
                    stack.pop()
                stack.append(py[j])
                j += 1
            while stack and stack[-1]["ts"] + stack[-1]["dur"] < t:
                stack.pop()
            own = [e["name"] for e in stack if _frame(e["name"])][-2:]
            inner = own[-1] if own else (stack[-1]["name"] if stack else "<no python frame>")
            caller = own[-2] if len(own) > 1 else ""
            by_frame[inner] += dt
            by_pair[(caller, inner)] += dt
            t += dt
    hist = collections.Counter()
    for a, b in gaps:
        d = b - a
        hist["<10us" if d < 10 else "10-100us" if d < 100 else "0.1-1ms" if d < 1000 else ">=1ms"] += d
    return {"wall_ms": (t1 - t0) / 1e3, "device_busy_ms": busy_us / 1e3, "idle_ms": (t1 - t0 - busy_us) / 1e3,
            "gaps": len(gaps), "idle_by_gap_size_ms": {k: v / 1e3 for k, v in hist.items()},
            "idle_by_frame_ms": [(k, v / 1e3) for k, v in by_frame.most_common(40)],
            "idle_by_caller_frame_ms": [(f"{i} <- {c}" if c else i, v / 1e3) for (c, i), v in by_pair.most_common(40)],
            "sync_runtime_ms": {k: v / 1e3 for k, v in sync_rt.items()},
            "launches": sum(1 for e in runtime if "Launch" in e["name"])}


def sync_stacks(eng, dev) -> list:
    """Stacks of the host syncs of one step (CUDA only)."""
    if dev.type != "cuda":
        return []
    seen = collections.Counter()
    old = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        st = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1]
              if _frame(f.filename)]
        seen[" <- ".join(reversed(st[-4:]))] += 1

    warnings.showwarning = show
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            eng.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = old
    return seen.most_common(30)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=int, default=8192)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--new", type=int, default=4096)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--experts", default="fp8")
    ap.add_argument("--layers", default="swa,csa,hca,csa")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--trace", action="store_true", help="also write the (large) trace")
    ap.add_argument("--out", default="prefill_gaps")
    a = ap.parse_args(argv)
    if a.small:
        a.context, a.new, a.budget = 320, 64, 128
    from torch.profiler import ProfilerActivity, profile, record_function

    from deepfuse.engine import SamplingParams
    from deepfuse.models import random as rnd

    dev = torch.device(a.device)
    cfg = rnd.flash_config([E.KINDS[k] for k in a.layers.split(",")], **(E.SMALL if a.small else {}))
    model = rnd.build(cfg, device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32, quant="fp8",
                      expert_quant=a.experts)
    ns = argparse.Namespace(context=a.context, new=a.new, acc=3.25)
    per_step = max(1, a.budget // a.new)
    eng = E._engine(model, ns, a.k, 2 * per_step + 2, a.budget)
    g = torch.Generator(device=dev).manual_seed(0)
    gc_ = torch.Generator().manual_seed(0)
    prefix = E._rand_tokens(cfg.vocab_size, a.context - a.new, gc_)
    E.seed_prefix(eng, prefix, [a.context - a.new], g)
    n = 0

    def add(k):
        nonlocal n
        for _ in range(k):
            eng.add_request(f"g{n}", prefix + E._rand_tokens(cfg.vocab_size, a.new, gc_),
                            SamplingParams(max_tokens=2 if a.k else 1, ignore_eos=True))
            n += 1

    eng.scheduler.max_num_batched_tokens = a.budget
    add(2 * per_step)
    while eng.has_unfinished():
        eng.step()
    add(4 * per_step)
    walls = []
    for _ in range(2):
        _sync(dev)
        t = time.perf_counter()
        eng.step()
        _sync(dev)
        walls.append((time.perf_counter() - t) * 1e3)
    syncs = sync_stacks(eng, dev)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with profile(activities=acts, with_stack=True) as prof:
        with record_function("gaps.step"):
            eng.step()
            _sync(dev)
    path = out / "trace.json"
    prof.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    if a.trace:
        with gzip.open(out / "trace.json.gz", "wt") as f:
            json.dump(trace, f)
    path.unlink()
    res = analyse(trace)
    res.update({"budget": a.budget, "context": a.context, "new": a.new, "k": a.k, "experts": a.experts,
                "unprofiled_step_wall_ms": walls, "sync_stacks": syncs,
                "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})
    (out / "prefill_gaps.json").write_text(json.dumps(res, indent=1))
    print(f"# {res['gpu']} {res['date']} budget {a.budget} k {a.k} experts {a.experts}")
    print(f"step wall unprofiled {', '.join(f'{w:.2f}' for w in walls)} ms; profiled {res['wall_ms']:.2f} ms, "
          f"device busy {res['device_busy_ms']:.2f} ms, idle {res['idle_ms']:.2f} ms in {res['gaps']} gaps, "
          f"{res['launches']} launches")
    print("idle by gap size (ms):", {k: round(v, 2) for k, v in res["idle_by_gap_size_ms"].items()})
    print("sync runtime calls (ms):", {k: round(v, 2) for k, v in res["sync_runtime_ms"].items()})
    print("device idle by innermost deepfuse frame (ms):")
    for k, v in res["idle_by_frame_ms"][:25]:
        print(f"  {v:8.2f}  {k}")
    print("device idle by frame <- its caller (ms):")
    for k, v in res["idle_by_caller_frame_ms"][:25]:
        print(f"  {v:8.2f}  {k}")
    print("host syncs of one step (count, stack innermost first):")
    for k, c in syncs:
        print(f"  {c:4d}  {k}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
