"""The main job: the engine on the bundled tiny DeepSeek V4 model (or a checkpoint).

    python -m deepfuse [--model DIR] [--device cuda|cpu] [--num-requests 16] [--max-prompt 300]
                       [--max-tokens 32] [--kv-dtype auto|fp8|bf16] [engine options]

A set of requests of mixed prompt lengths and output lengths arrives together and runs
under continuous batching (chunked prefill, preemption when the cache is full). Prints
throughput, time to first token, per-step time, the host time spent scheduling and building
step contexts, cache use and preemptions, then checks every request against one full
forward of the model over its sequence (each generated token must be the full forward's
greedy choice). Uses the GPU when there is one.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def int_in(lo: int, hi: int = None, what: str = None):
    """An argparse type: an int in [lo, hi]."""
    what = what or (f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]")

    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"expected {what}, got {v}")
        return v
    parse.__name__ = "int"
    return parse


positive_int = int_in(1, what="a positive integer")


def page_size_arg(s: str) -> int:
    """Cache page rows: a positive multiple of kv_format.PAGE_ALIGN_ROWS (what the caches take)."""
    from deepfuse.kv_format import PAGE_ALIGN_ROWS as A

    v = int_in(A, what=f"a positive multiple of {A}")(s)
    if v % A:
        raise argparse.ArgumentTypeError(f"expected a positive multiple of {A}, got {v}")
    return v


def device_arg(s: str) -> str:
    """cpu, cuda or cuda:N, N an existing GPU."""
    try:
        d = torch.device(s)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {s!r}") from None
    if d.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {s!r}")
    if d.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise argparse.ArgumentTypeError(f"{s!r}: no CUDA device is available (torch {torch.__version__}, "
                                             f"CUDA build: {torch.version.cuda})")
        if d.index is not None and d.index >= n:
            raise argparse.ArgumentTypeError(f"{s!r}: there are {n} CUDA devices")
    return s


def model_arg(s: str) -> str:
    """'tiny', 'tiny-v4.1', 'random-flash[:kinds]' or a checkpoint directory with config.json."""
    import os

    if s in ("tiny", "tiny-v4.1") or s == "random-flash" or s.startswith("random-flash:"):
        return s
    if not os.path.isdir(s):
        raise argparse.ArgumentTypeError(f"{s!r} is neither 'tiny', 'tiny-v4.1', 'random-flash[:layers]' nor a "
                                         "checkpoint directory")
    if not os.path.isfile(os.path.join(s, "config.json")):
        raise argparse.ArgumentTypeError(f"{s!r} has no config.json (not a checkpoint directory)")
    return s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deepfuse", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", type=model_arg,
                    help="checkpoint directory, or 'tiny' (the bundled random V4)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", type=device_arg,
                    help="cpu, cuda or cuda:N (default: cuda when there is one)")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                    help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--kv-dtype", default=None, choices=["auto", "fp8", "bf16"],
                    help="cache format: auto = the model dtype (lossless), fp8 = the 584-byte serving rows "
                    "(default: fp8 on cuda for bf16 models, else auto)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                    help="cuda: fraction of the GPU's total memory the engine may use, weights included (default 0.9)")
    ap.add_argument("--num-requests", type=positive_int, default=16)
    ap.add_argument("--min-prompt", type=positive_int, default=1)
    ap.add_argument("--max-prompt", type=positive_int, default=300)
    ap.add_argument("--max-tokens", type=positive_int, default=32, help="most tokens generated per request")
    ap.add_argument("--max-num-seqs", type=positive_int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=positive_int, default=512)
    ap.add_argument("--max-total-tokens", type=positive_int, default=None,
                    help="context tokens the caches hold (default: the memory plan on cuda, 128K on cpu)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.min_prompt > a.max_prompt:
        ap.error(f"--min-prompt ({a.min_prompt}) exceeds --max-prompt ({a.max_prompt})")
    if a.max_total_tokens is not None and a.max_total_tokens < a.max_prompt + a.max_tokens:
        ap.error(f"--max-total-tokens ({a.max_total_tokens}) must hold one request: >= --max-prompt + "
                 f"--max-tokens ({a.max_prompt + a.max_tokens})")

    import deepfuse
    from deepfuse.engine import LLM, SamplingParams

    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    print(f"deepfuse {deepfuse.__version__} | device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
          + f" | CUDA kernels: {deepfuse.has_cuda_kernels()} {deepfuse.built_archs()} | dtype {str(dtype)[6:]}"
          + f" | kv {a.kv_dtype or 'default'}")
    try:
        llm = LLM(a.model, device=device, dtype=dtype, kv_dtype=a.kv_dtype, max_num_seqs=a.max_num_seqs,
                  max_num_batched_tokens=a.max_num_batched_tokens, max_total_tokens=a.max_total_tokens,
                  gpu_memory_utilization=a.gpu_memory_utilization)
    except (ValueError, FileNotFoundError) as e:
        ap.error(str(e))
    model, eng = llm.model, llm.engine
    if a.max_prompt + a.max_tokens > eng.max_model_len:
        ap.error(f"--max-prompt ({a.max_prompt}) + --max-tokens ({a.max_tokens}) exceeds the model's context "
                 f"(max_model_len {eng.max_model_len})")
    cfg = model.cfg
    print(f"model {a.model}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size} | "
          f"cache {eng.cache.max_total_tokens} tokens, {eng.cache.nbytes() / 2**20:.1f} MiB")
    print(eng.memory_plan.summary())

    g = torch.Generator().manual_seed(a.seed)
    n = a.num_requests
    lens = torch.randint(a.min_prompt, a.max_prompt + 1, (n,), generator=g).tolist()
    outs_n = torch.randint(1, a.max_tokens + 1, (n,), generator=g).tolist()
    prompts = [torch.randint(0, cfg.vocab_size, (L,), generator=g).tolist() for L in lens]
    params = [SamplingParams(max_tokens=k, ignore_eos=True) for k in outs_n]

    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - t0
    reqs_done = sum(len(o.token_ids) for o in outs)
    st = eng.stats()
    steps = eng.step_times
    prep = eng.prepare_times
    print(f"{n} requests, prompts {min(lens)}-{max(lens)} tokens ({sum(lens)} in all), "
          f"{reqs_done} tokens generated in {wall:.2f} s over {len(steps)} steps")
    print(f"throughput: {reqs_done / wall:.1f} output tok/s, {(reqs_done + sum(lens)) / wall:.1f} tok/s in all")
    ttft = [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outs]
    print(f"time to first token: mean {statistics.mean(ttft) * 1e3:.1f} ms, max {max(ttft) * 1e3:.1f} ms")
    print(f"step time: mean {statistics.mean(steps) * 1e3:.2f} ms, median {statistics.median(steps) * 1e3:.2f} ms | "
          f"host scheduling + context: median {statistics.median(prep) * 1e3:.3f} ms per step")
    print(f"cache: peak {st['peak_used_tokens']} of {st['max_total_tokens']} tokens | "
          f"preemptions {st['num_preemptions']}")
    print("request 0 continuation:", outs[0].token_ids)

    # every generated token must be the full forward's greedy choice given its prefix
    agree = total = 0
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            seq = torch.tensor([p + o.token_ids], device=device)
            ref = model(seq)[0, len(p) - 1:-1].argmax(-1).cpu().tolist()
            agree += sum(x == y for x, y in zip(ref, o.token_ids))
            total += len(o.token_ids)
    frac = agree / max(total, 1)
    print(f"full-forward greedy agreement with the engine: {frac:.1%} ({agree}/{total})")
    need = 1.0 if dtype == torch.float32 and eng.kv_dtype == "auto" else 0.7
    return 0 if frac >= need else 1


if __name__ == "__main__":
    sys.exit(main())
