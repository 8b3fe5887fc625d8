"""Tail latency of deepfuse.ops.topk over fresh inputs (GPU): per shape, `draws` fresh
randn inputs, one untimed and one timed call each; the GPU is kept busy
(torch.cuda._sleep) while the host enqueues, so the event pair times the kernel alone.
Prints the median, p99, max and the calls slower than 2x the median (topk.cu's rare
fallback re-streams a row; docs/notes/topk-perf.md).
  PYTHONPATH=/tmp/dfsite python3 tools/probes/topk_tail.py [--draws 3000] [--shape bf16,16,131072,1024 ...]
"""
import argparse

import torch

import deepfuse.ops as ops

DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT = ["bf16,16,131072,1024", "bf16,16,32768,2048", "bf16,1,131072,512", "fp32,16,129280,50", "bf16,16,8192,512"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draws", type=int, default=1000)
    ap.add_argument("--shape", action="append", help="dtype,B,N,k (repeatable)")
    ap.add_argument("--margin", type=float, help="threshold margin z (default: the plan's)")
    a = ap.parse_args()
    if a.margin is None:
        def call(x, k):
            ops.topk(x, k)
    else:  # the launcher with the margin (the op has none)
        from deepfuse import _ext

        def call(x, k):
            idx = torch.empty(x.shape[0], k, dtype=torch.int32, device=x.device)
            _ext.ext(x.device).topk(x=x, k=k, indices=idx, sorted=False, margin=a.margin)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):  # first uses of _sleep and the events, outside the timed calls
        torch.cuda._sleep(1000)
        e0.record()
        e1.record()
        e1.synchronize()
    for spec in a.shape or DEFAULT:
        dt, B, N, k = spec.split(",")
        dtype, B, N, k = DT[dt], int(B), int(N), int(k)
        g = torch.Generator(device="cuda").manual_seed(7)
        ts = []
        for _ in range(a.draws):
            x = torch.randn(B, N, generator=g, device="cuda").to(dtype)
            call(x, k)
            torch.cuda._sleep(300000)
            e0.record()
            call(x, k)
            e1.record()
            e1.synchronize()
            ts.append(e0.elapsed_time(e1) * 1000)
        s = sorted(ts)
        med = s[len(s) // 2]
        slow = [(i, round(t, 1)) for i, t in enumerate(ts) if t > 2 * med]  # (draw, us)
        print(f"{spec}: {a.draws} draws, median {med:.1f} us, p99 {s[int(0.99 * len(s))]:.1f}, max {s[-1]:.1f}; "
              f"> 2x median: {len(slow)} (draw, us) {slow[:10]}", flush=True)


if __name__ == "__main__":
    main()
