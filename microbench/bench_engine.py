"""Engine overhead: host time per decode step in scheduling + step-context building, and the
engine's decode step against a bare forward of the model at the same batch.

    python -m microbench.bench_engine [--out DIR] [--batches 1 64 256] [--context 512]
                                      [--model tiny] [--device cuda|cpu] [--kv-dtype auto]

B requests with `context`-token prompts are prefilled, then decode steps are timed:
- prep_ms: host time of Scheduler.schedule() + ModelRunner.prepare() (the step context),
  the figure the engine must keep small (goal: <= 0.3 ms at B = 256);
- step_ms: one whole engine step (schedule, context, forward, sampler, token read-back,
  bookkeeping), wall time;
- forward_ms: model.forward_step on a prepared context alone (synchronised), the bare
  forward at the same batch; overhead = step_ms / forward_ms.
Runs on the GPU when there is one (the tiny model there mostly measures launch overhead).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import time
from pathlib import Path

import torch


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def gpu_idle(eng) -> tuple[float, float]:
    """-> (median GPU idle time between consecutive steps' GPU work, median busy time), ms."""
    torch.cuda.synchronize()
    ev = eng.gpu_events
    gaps = [max(0.0, a[1].elapsed_time(b[0])) for a, b in zip(ev, ev[1:])]
    busy = [s.elapsed_time(e) for s, e in ev]
    return statistics.median(gaps), statistics.median(busy)


def bench(llm, B: int, context: int, steps: int) -> dict:
    from deepfuse.engine import SamplingParams

    eng = llm.engine
    dev = llm.model.device
    V = llm.model.cfg.vocab_size
    g = torch.Generator().manual_seed(B)
    for i in range(B):
        eng.add_request(f"b{B}-{i}", torch.randint(0, V, (context,), generator=g).tolist(),
                        SamplingParams(max_tokens=1000, ignore_eos=True))
    for _ in range(10 * B + 100):  # prefill (and the first tokens)
        if not eng.scheduler.waiting and all(r.num_tokens - r.num_computed == 1 for r in eng.scheduler.running):
            break
        for o in eng.step():
            if o.finished:
                print(f"  note: {o.request_id} finished during prefill ({o.finish_reason})")
    if len(eng.scheduler.running) != B:
        raise RuntimeError(f"{len(eng.scheduler.running)} running after prefill, expected {B}: {eng.stats()}")
    cuda = dev.type == "cuda"
    if cuda:
        eng.gpu_events = []
    prep, sched, step = [], [], []
    for _ in range(steps):
        _sync(dev)
        t0 = time.perf_counter()
        eng.step()
        step.append(time.perf_counter() - t0)
        prep.append(eng.prepare_times[-1])
        sched.append(eng.prepare_times[-1] - eng.runner.last_prepare_s)
    idle_ms = busy_ms = None
    if cuda:
        idle_ms, busy_ms = gpu_idle(eng)
        eng.gpu_events = None
    # the bare forward on the context of one more decode step
    if eng._inflight is not None:  # settle the overlapped step in flight
        eng._settle(eng._inflight)
        eng._inflight = None
    chunks = eng.scheduler.schedule()
    ctx = eng.runner.prepare(chunks)
    assert ctx.num_tokens == B, (ctx.num_tokens, B)
    fwd = []
    with torch.no_grad():
        for _ in range(max(3, steps // 2)):
            _sync(dev)
            t0 = time.perf_counter()
            eng.model.forward_step(ctx, eng.cache)
            _sync(dev)
            fwd.append(time.perf_counter() - t0)
    for c in chunks:  # hand the scheduled step back: release everything
        c.req.num_computed = c.start
    for rid in list(eng._reqs):
        eng.abort(rid)
    eng.step()
    med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    return {"B": B, "context": context, "sched_ms": med(sched), "prep_ms": med(prep), "prep_p90_ms": sorted(prep)[int(0.9 * len(prep))] * 1e3,
            "step_ms": med(step), "forward_ms": med(fwd), "overhead": med(step) / med(fwd),
            "gpu_idle_ms": idle_ms, "gpu_busy_ms": busy_ms, "overlap": eng.overlap}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 64, 256])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--model", default="tiny", help="tiny, a checkpoint directory, or flash[:swa,csa,...] (random)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--kv-dtype", default="auto")
    ap.add_argument("--overlap", choices=["on", "off", "both"], default="both")
    a = ap.parse_args(argv)
    from deepfuse.engine import LLM

    if a.quick:
        a.steps = min(a.steps, 8)
    dev = torch.device(a.device)
    B_max = max(a.batches)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"# engine overhead | {name} | model {a.model} | kv {a.kv_dtype} | context {a.context}")
    rows = []
    model = a.model
    if model.startswith("flash"):  # a random V4-Flash-width model built on the device: flash[:swa,csa,...]
        from deepfuse.models import random as rnd
        from microbench.bench_step import KINDS

        layers = model.split(":", 1)[1] if ":" in model else "swa,csa,hca,csa"
        model = rnd.build(rnd.flash_config([KINDS[k] for k in layers.split(",")]), device=dev,
                          dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32, quant="fp8",
                          expert_quant="fp8")
    for ov in ([False, True] if a.overlap == "both" else [a.overlap == "on"]):
        llm = LLM(model, device=dev if isinstance(model, str) else None, kv_dtype=a.kv_dtype, max_num_seqs=B_max, overlap=ov,
                  max_num_batched_tokens=max(2048, a.context * 4), max_total_tokens=B_max * (a.context + 1100))
        rows += [bench(llm, B, a.context, a.steps) for B in a.batches]
        del llm
    heads = ["overlap", "B", "context", "sched_ms", "prep_ms", "prep_p90_ms", "step_ms", "forward_ms", "overhead", "gpu_idle_ms", "gpu_busy_ms"]
    print("  ".join(f"{h:>11}" for h in heads))
    for r in rows:
        print("  ".join(f"{r[h]:>11.3f}" if isinstance(r[h], float) else f"{str(r[h]):>11}" for h in heads))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    import os
    meta = {"device": name, "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": os.environ.get("DEEPFUSE_COMMIT", "unknown"), "torch": torch.__version__, "model": a.model,
            "kv_dtype": a.kv_dtype}
    (out / "engine.json").write_text(json.dumps({"kernel": "engine", "context": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
