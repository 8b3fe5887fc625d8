"""FP8 / MXFP8 activation casts: bandwidth vs the copy ceiling and vs the PyTorch version.

python -m microbench.bench_cast --out DIR [--quick]
"""
from __future__ import annotations


import torch

from deepfuse import ops
from deepfuse.ops import cast as C
from microbench import harness as H

VARIANTS = {
    # name: (callable on x, PyTorch baseline on x, scale bytes per group)
    "per_token_fp32_g128": (lambda x: ops.fp8_per_token_cast(x, 128), lambda x: C.fp8_group_cast_ref(x, 128, "fp32"), 128, 4),
    "per_token_ue8m0_g128": (lambda x: ops.fp8_per_token_cast(x, 128, scale_fmt="ue8m0"), lambda x: C.fp8_group_cast_ref(x, 128, "ue8m0"), 128, 1),
    "mxfp8_packed": (lambda x: ops.mxfp8_cast(x, packed=True), lambda x: C.fp8_group_cast_ref(x, 32, "ue8m0_packed"), 32, 1),
}


def main(argv=None):
    a, ctx = H.start(argv)
    Ms = [64, 1024, 16384] if a.quick else [64, 256, 1024, 4096, 8192, 16384]
    K = 7168
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for name, (fn, ref, group, sbytes) in VARIANTS.items():
            for M in Ms:
                x = torch.randn(M, K, device="cuda", dtype=dtype)
                nbytes = M * K * (x.element_size() + 1) + M * (-(-K // group)) * sbytes
                t = H.time_fn(lambda: fn(x))
                tg = H.time_graph(lambda: fn(x)) if M <= 1024 else None
                te = H.time_eager(lambda: fn(x)) if M <= 1024 else None
                tb = H.time_fn(lambda: ref(x), reps=10)
                bw = nbytes / t.s
                rows.append(dict(kernel=name, dtype=str(dtype).removeprefix("torch."), M=M, K=K,
                                 us=t.median_us, p10_us=t.p10_us, p90_us=t.p90_us,
                                 graph_us=tg.median_us if tg else None, eager_us=te, MB=nbytes / 1e6,
                                 tbps=bw / 1e12, frac_copy=bw / (ctx.copy_tbps * 1e12),
                                 torch_us=tb.median_us, speedup=tb.median_us / t.median_us))
                del x
    # Same-size copies (bytes read + written as the cast): the ceiling at each size, where
    # launch latency and the number of bytes in flight dominate small shapes.
    copy_cache = {}
    for r in rows:
        key = round(r["MB"], 3)
        if key not in copy_cache:
            n = max(int(r["MB"] * 1e6) // 2, 16)
            src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
            dst = torch.empty_like(src)
            copy_cache[key] = H.time_fn(lambda: dst.copy_(src)).median_us
        r["copy_same_size_us"] = copy_cache[key]
        r["frac_same_size_copy"] = copy_cache[key] / r["us"]
        r["copy_same_size_tbps"] = r["MB"] * 1e6 / (copy_cache[key] * 1e-6) / 1e12
    H.print_table(rows, [("kernel", "{}"), ("dtype", "{}"), ("M", "{}"), ("K", "{}"), ("us", "{:.1f}"),
                         ("graph_us", "{:.1f}"), ("eager_us", "{:.1f}"), ("tbps", "{:.2f}"), ("frac_copy", "{:.0%}"),
                         ("torch_us", "{:.1f}"), ("speedup", "{:.1f}x"), ("copy_same_size_us", "{:.1f}"),
                         ("frac_same_size_copy", "{:.0%}")])
    H.save(a.out, "cast", ctx, rows)
    bf = [dict(r, series=f"{r['kernel']}") for r in rows if r["dtype"] == "bfloat16"]
    bf += [dict(r, series="same-size copy", tbps=r["copy_same_size_tbps"]) for r in rows
           if r["dtype"] == "bfloat16" and r["kernel"] == "per_token_fp32_g128"]
    H.plot(a.out, "cast", ctx, bf, x="M", ys=["tbps"], ylabel="TB/s (bytes read + written), bf16 in, K=7168",
           group="series", hline=ctx.copy_tbps, hline_label="copy ceiling")


if __name__ == "__main__":
    main()
