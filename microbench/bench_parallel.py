"""Tensor / expert parallel V4 (issue 20): decode step time against one GPU, and the
per-layer combine (all-reduce of [B, d]) against the collective bandwidth.

    python -m microbench.bench_parallel --model /path/to/ckpt --tp 2 [--batches 1 16 64]
                                        [--context 512] [--steps 20] [--out DIR]
    python -m microbench.bench_parallel --collectives --tp 2 [--dim 4096]

Engine: for tp in (1, N) (1 is skipped with --skip-single, e.g. when the model does not fit
one GPU), B requests of `context` tokens are prefilled, then `steps` decode steps timed
(wall time of Engine.step(): schedule, broadcast, forward with the collectives, sampler):
step_ms and tokens/s = B / step time. Collectives: N processes time all_reduce of [B, d]
bf16 (what each layer does twice per step) and all_to_all_single of [B * k, d] (what an
expert-parallel dispatch with data-parallel attention would move), with the bus bandwidth
(all-reduce: 2 (N-1) / N bytes / time). On the CPU (gloo) it runs too, for a smoke test.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch


def bench_engine(model: str, device: str, tp: int, batches, context: int, steps: int, **kw) -> list[dict]:
    from deepfuse.engine import LLM, SamplingParams

    out = []
    with LLM(model, device=device, tensor_parallel_size=tp, max_num_seqs=max(batches),
             max_total_tokens=max(batches) * (context + steps + 64), **kw) as llm:
        eng = llm.engine
        V = llm.model.cfg.vocab_size
        for B in batches:
            g = torch.Generator().manual_seed(B)
            for i in range(B):
                eng.add_request(f"b{B}-{i}", torch.randint(0, V, (context,), generator=g).tolist(),
                                SamplingParams(max_tokens=steps + 8, ignore_eos=True))
            while eng.scheduler.waiting or any(r.num_tokens - r.num_computed > 1 for r in eng.scheduler.running):
                eng.step()
            for _ in range(3):
                eng.step()
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                eng.step()
                times.append(time.perf_counter() - t0)
            for i in range(B):
                eng.abort(f"b{B}-{i}")
            eng.step()
            ms = statistics.median(times) * 1e3
            out.append({"tp": tp, "B": B, "context": context, "step_ms": ms, "tokens_per_s": B / ms * 1e3})
            print(json.dumps(out[-1]), flush=True)
    return out


def _collectives(rank: int, world: int, port: int, device: str, dim: int, batches, k: int, q) -> None:
    import torch.distributed as dist

    from deepfuse.engine.distributed import backend_for, set_env

    set_env()
    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(backend_for(dev), init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    rows = []
    try:
        for B in batches:
            for name in ("all_reduce", "all_to_all"):
                n = B if name == "all_reduce" else -(-B * k // world) * world
                x = torch.randn(n, dim, device=dev).to(dt)
                y = torch.empty_like(x)

                def op():
                    if name == "all_reduce":
                        dist.all_reduce(x)
                    else:
                        dist.all_to_all_single(y, x)

                for _ in range(5):
                    op()
                times = []
                for _ in range(50):
                    if dev.type == "cuda":
                        torch.cuda.synchronize(dev)
                    dist.barrier()
                    t0 = time.perf_counter()
                    op()
                    if dev.type == "cuda":
                        torch.cuda.synchronize(dev)
                    times.append(time.perf_counter() - t0)
                us = statistics.median(times) * 1e6
                nbytes = x.numel() * x.element_size()
                factor = 2 * (world - 1) / world if name == "all_reduce" else (world - 1) / world
                rows.append({"op": name, "tp": world, "B": B, "rows": n, "dim": dim, "us": us,
                             "bus_GBps": nbytes * factor / us / 1e3})
        if rank == 0:
            q.put(rows)
    finally:
        dist.destroy_process_group()


def bench_collectives(tp: int, device: str, dim: int, batches, k: int) -> list[dict]:
    import torch.multiprocessing as mp

    from deepfuse.engine.distributed import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    mp.start_processes(_collectives, args=(tp, free_port(), device, dim, batches, k, q), nprocs=tp, join=True,
                       start_method="spawn")
    rows = q.get(timeout=60)
    for r in rows:
        print(json.dumps(r), flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m microbench.bench_parallel")
    p.add_argument("--model", default="tiny")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--no-expert-parallel", action="store_true")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--skip-single", action="store_true")
    p.add_argument("--collectives", action="store_true")
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--topk", type=int, default=6)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"})
    if a.collectives:
        rows = bench_collectives(a.tp, a.device, a.dim, a.batches, a.topk)
    else:
        rows = []
        for tp in ([a.tp] if a.skip_single else [1, a.tp]):
            kw = {} if tp == 1 else {"expert_parallel": not a.no_expert_parallel}
            rows += bench_engine(a.model, a.device, tp, a.batches, a.context, a.steps, **kw)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        name = "parallel_collectives.json" if a.collectives else "parallel_engine.json"
        with open(Path(a.out) / name, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
