"""Row-wise top-k: time, input bandwidth vs the copy ceiling, speedup over torch.topk.

python -m microbench.bench_topk --out DIR [--quick] [--kind randn|relu]

Grid (issue 3): indexer shapes (bf16, k 512/1024/2048, B 1..512, N 8K/32K/128K), sampling
(fp32 [B, 129280], k 50/512) and the fp32 indexer-score shapes of the ceilings doc.
Columns: us (unsorted, values + indices), idx_us (return_values=False), sorted_us, the
same-run torch.topk times (sorted=False, and sorted=True for sorted_us), input bandwidth
(bytes of x read once / time) and its fraction of the copy ceiling (read + written bytes
per second of a large device copy, measured in this run). `target` is the issue's speedup
goal for the cell and `ok` whether the speedup meets it; `target_us` the time that goal
asks for (torch_us / target); `bw_aim` (B >= 64) whether the input bandwidth reaches the
issue's aim of 50% of the copy ceiling. `copy_us`: a copy of x's bytes (read + written,
timed the same way), `x_copy` = us / copy_us. Small shapes are launch and latency bound:
there the copy (one launch, one pass) is a floor for any kernel that reads x, and a top-k
also waits for its whole row before it decides. Large shapes are bandwidth bound: the copy
moves twice the bytes a top-k reads, so a top-k can take less (x_copy < 1).
--kind relu: relu(randn), half the scores exactly 0 (an indexer with few heads): ties at
the K-th value, which the kernel resolves by index (the lower index wins).
"""
from __future__ import annotations

import argparse
import importlib

import torch

from deepfuse import ops
from microbench import harness as H

T = importlib.import_module("deepfuse.ops.topk")


def grid(quick: bool):
    cells = []
    Bs = (1, 64, 512) if quick else (1, 16, 64, 128, 512)
    Ns = (8192, 131072) if quick else (8192, 32768, 131072)
    ks = (512, 2048) if quick else (512, 1024, 2048)
    for N in Ns:
        for k in ks:
            for B in Bs:
                cells.append(("indexer", torch.bfloat16, B, N, k, 10.0 if B >= 16 else 5.0))
    for k in (50, 512):
        for B in ((16, 256) if quick else (1, 16, 64, 256)):
            cells.append(("sampling", torch.float32, B, 129280, k, 5.0 if B >= 16 else None))
    if not quick:
        for B, N, k in ((1, 32768, 512), (64, 32768, 512), (128, 32768, 512), (64, 262144, 1024),
                        (4096, 8192, 512)):
            cells.append(("indexer_fp32", torch.float32, B, N, k, None))
    return cells


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--kind", choices=("randn", "relu"), default="randn")
    a = ap.parse_args(argv)
    ctx = H.Context.create()
    print(ctx.header())
    copy_bps = ctx.copy_tbps * 1e12
    rows = []
    for suite, dtype, B, N, k, target in grid(a.quick):
        x = torch.randn(B, N, device="cuda", dtype=dtype)
        if a.kind == "relu":
            x = torch.relu(x)
        idx = torch.empty(B, k, dtype=torch.int32, device="cuda")
        fn = lambda: ops.topk(x, k)  # noqa: E731
        t = H.time_fn(fn)
        ti = H.time_fn(lambda: ops.topk(x, k, return_values=False, out=idx))
        ts = H.time_fn(lambda: ops.topk(x, k, sorted=True))
        tg = H.time_graph(lambda: ops.topk(x, k, return_values=False, out=idx)) if B * N <= (1 << 22) else None
        tb = H.time_fn(lambda: torch.topk(x, k, dim=1, sorted=False), reps=10)
        tbs = H.time_fn(lambda: torch.topk(x, k, dim=1, sorted=True), reps=10)
        xc = torch.empty_like(x)
        tc = H.time_fn(lambda: xc.copy_(x))
        del xc
        nbytes = B * N * x.element_size()
        bw = nbytes / t.s
        g, nt, smem, kern = T.launch_plan(dtype, B, N, k)
        speed = tb.median_us / t.median_us
        frac = bw / copy_bps
        ok = None if target is None else speed >= target
        bw_aim = None if B < 64 else frac >= 0.5
        rows.append(dict(suite=suite, dtype=str(dtype).removeprefix("torch."), B=B, N=N, k=k,
                         plan=f"{'R' if kern else 'G'}{g}x{nt}", us=t.median_us, p10_us=t.p10_us, p90_us=t.p90_us,
                         idx_us=ti.median_us, sorted_us=ts.median_us, graph_us=tg.median_us if tg else None,
                         GBps=bw / 1e9, frac_copy=frac, torch_us=tb.median_us, speedup=speed,
                         torch_sorted_us=tbs.median_us, speedup_sorted=tbs.median_us / ts.median_us,
                         target=target, target_us=tb.median_us / target if target else None,
                         ok=("yes" if ok else "NO") if ok is not None else None,
                         copy_us=tc.median_us, x_copy=t.median_us / tc.median_us,
                         bw_aim=("yes" if bw_aim else "NO") if bw_aim is not None else None,
                         series=f"{suite} N={N} k={k}"))
        r = rows[-1]
        print(f"{suite:12s} {r['dtype']:8s} B={B:<5d} N={N:<7d} k={k:<5d} {r['plan']:4s} {t.median_us:8.1f} us "
              f"{frac:6.1%} copy  torch {tb.median_us:8.1f} us  {speed:6.1f}x  sorted {ts.median_us:8.1f} us "
              f"({r['speedup_sorted']:.1f}x)  {r['ok'] or ''}", flush=True)
        del x
    print()
    H.print_table(rows, [("suite", "{}"), ("dtype", "{}"), ("B", "{}"), ("N", "{}"), ("k", "{}"), ("plan", "{}"),
                         ("us", "{:.1f}"), ("idx_us", "{:.1f}"), ("graph_us", "{:.1f}"), ("sorted_us", "{:.1f}"),
                         ("GBps", "{:.0f}"), ("frac_copy", "{:.0%}"), ("torch_us", "{:.1f}"),
                         ("speedup", "{:.1f}x"), ("speedup_sorted", "{:.1f}x"), ("target", "{:.0f}x"),
                         ("target_us", "{:.1f}"), ("ok", "{}"), ("copy_us", "{:.1f}"), ("x_copy", "{:.1f}"),
                         ("bw_aim", "{}")])
    missed = [r for r in rows if r["ok"] == "NO"]
    print(f"speed targets met in {sum(r['ok'] == 'yes' for r in rows)} of {sum(r['ok'] is not None for r in rows)} cells"
          + ("; missed: " + ", ".join(f"{r['suite']} B={r['B']} N={r['N']} k={r['k']}" for r in missed) if missed else ""))
    print(f"bandwidth aim (>= 50% of copy, B >= 64) met in {sum(r['bw_aim'] == 'yes' for r in rows)} of "
          f"{sum(r['bw_aim'] is not None for r in rows)} cells")
    H.save(a.out, "topk", ctx, rows)
    idx_rows = [r for r in rows if r["suite"] == "indexer"]
    H.plot(a.out, "topk_speedup", ctx, rows, x="B", ys=["speedup"], ylabel="speedup over torch.topk (same run)",
           group="series", hline=10.0, hline_label="10x target (indexer, B >= 16)")
    H.plot(a.out, "topk_bandwidth", ctx, idx_rows + [r for r in rows if r["suite"] == "sampling"], x="B",
           ys=["frac_copy"], ylabel="input bytes / time, fraction of the copy ceiling", group="series",
           hline=0.5, hline_label="50% target (B >= 64)")


if __name__ == "__main__":
    main()
