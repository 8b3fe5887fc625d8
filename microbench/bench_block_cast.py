"""FP8 weight block cast (TileLang kernel): bandwidth vs the copy ceiling and vs PyTorch.

python -m microbench.bench_block_cast --out DIR [--quick]

Baseline: the same computation in PyTorch on the GPU (deepfuse.ops.cast.fp8_block_cast_ref).
`match` says whether the kernel's bytes equal that baseline's (NaN-free random inputs).
"""
from __future__ import annotations


import torch

from deepfuse import ops
from deepfuse.ops import cast as C
from microbench import harness as H

SHAPES = [(64, 7168), (512, 7168), (2048, 7168), (7168, 2048), (4096, 7168), (7000, 7000),
          (7168, 7168), (16384, 7168)]
QUICK = [(64, 7168), (2048, 7168), (7168, 7168), (16384, 7168)]


def main(argv=None):
    a, ctx = H.start(argv)
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for fmt in ("fp32", "ue8m0"):
            for N, K in QUICK if a.quick else SHAPES:
                w = torch.randn(N, K, device="cuda", dtype=dtype)
                gn, gk = -(-N // 128), -(-K // 128)
                nbytes = N * K * (w.element_size() + 1) + gn * gk * (4 if fmt == "fp32" else 1)
                fn = lambda: ops.fp8_block_cast(w, scale_fmt=fmt)  # noqa: E731
                ref = lambda: C.fp8_block_cast_ref(w, 128, 128, fmt)  # noqa: E731
                q, s = fn()
                qr, sr = ref()
                match = bool(torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr))
                del q, s, qr, sr
                t = H.time_fn(fn)
                tg = H.time_graph(fn) if N * K <= 2048 * 7168 else None
                tb = H.time_fn(ref, reps=10)
                bw = nbytes / t.s
                rows.append(dict(kernel=f"block_cast_{fmt}", dtype=str(dtype).removeprefix("torch."), N=N, K=K,
                                 us=t.median_us, p10_us=t.p10_us, p90_us=t.p90_us,
                                 graph_us=tg.median_us if tg else None, MB=nbytes / 1e6,
                                 tbps=bw / 1e12, frac_copy=bw / (ctx.copy_tbps * 1e12),
                                 torch_us=tb.median_us, speedup=tb.median_us / t.median_us, match=match))
                del w
                torch.cuda.empty_cache()
    H.print_table(rows, [("kernel", "{}"), ("dtype", "{}"), ("N", "{}"), ("K", "{}"), ("us", "{:.1f}"),
                         ("graph_us", "{:.1f}"), ("MB", "{:.0f}"), ("tbps", "{:.2f}"), ("frac_copy", "{:.0%}"),
                         ("torch_us", "{:.1f}"), ("speedup", "{:.1f}x"), ("match", "{}")])
    H.save(a.out, "block_cast", ctx, rows)
    for r in rows:
        r["series"] = f"{r['kernel']} {r['dtype']}"
        r["elements"] = r["N"] * r["K"]
    H.plot(a.out, "block_cast", ctx, rows, x="elements", ys=["tbps"],
           ylabel="TB/s (bytes read + written)", group="series", hline=ctx.copy_tbps,
           hline_label="copy ceiling")
    bad = [r for r in rows if not r["match"]]
    if bad:
        print(f"WARNING: {len(bad)} cases differ from the PyTorch baseline's bytes")


if __name__ == "__main__":
    main()
