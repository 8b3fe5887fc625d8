"""FP8 / MXFP4 block-scaled linears (ops.quant_linear) at V4-Flash projection shapes.

python -m microbench.bench_linear --out DIR [--quick] [--proj wq_b ..] [--fmts fp8 mxfp4] [--M 1 8 ..]
                                   [--no-ref] [--stream-splits 1|2|4|8] [--stream-wgs 1|2] [--stream-min-m-fp8 N]

Per (projection, fmt, M): time of the op (activation cast included), weight bytes read per
second and the fraction of the copy ceiling measured in this run, TFLOP/s, and the ratios to
what a user would otherwise run: the reference (dequantise the weight, bf16 matmul; skipped by
--no-ref), cuBLASLt through torch._scaled_mm with DeepSeek's block scales (fp8 only), and, at
M <= 64, the previous path (cast + grouped GEMM kernel + split reduction: ops.linear's
STREAM_MAX_M = 0, PERSIST_FP8 = False) as x_prev (> 1: the default path is faster).
"""
from __future__ import annotations

import torch

from deepfuse import ops
from deepfuse.ops import linear as L
from microbench import harness as H

SHAPES = {  # name: (N, K)
    "wq_a": (1024, 4096), "wq_b": (32768, 1024), "wkv": (512, 4096), "wo_b": (4096, 8192),
    "shared_w1": (2048, 4096), "shared_w2": (4096, 2048),
}


def main(argv=None):
    def extra(ap):
        ap.add_argument("--proj", nargs="*", default=list(SHAPES), choices=list(SHAPES))
        ap.add_argument("--fmts", nargs="*", default=["fp8", "mxfp4"], choices=["fp8", "mxfp4"])
        ap.add_argument("--M", nargs="*", type=int, default=None, help="rows (default: the grid)")
        ap.add_argument("--no-ref", action="store_true", help="skip the reference (dequantise + matmul) timings")
        ap.add_argument("--stream-splits", type=int, choices=[1, 2, 4, 8], default=None,
                        help="ops.linear.STREAM_MAX_SPLITS for the run (8: every dense shape streams)")
        ap.add_argument("--stream-wgs", type=int, choices=[1, 2], default=None,
                        help="ops.linear.STREAM_WGS for the run (consumer warpgroups per streaming CTA)")
        ap.add_argument("--stream-min-m-fp8", type=int, default=None,
                        help="ops.linear.STREAM_MIN_M_FP8 for the run (1: fp8 streams from M = 1)")

    args, ctx = H.start(argv, extra=extra)
    if args.stream_splits is not None:
        L.STREAM_MAX_SPLITS = args.stream_splits
    if args.stream_wgs is not None:
        L.STREAM_WGS = args.stream_wgs
    if args.stream_min_m_fp8 is not None:
        L.STREAM_MIN_M_FP8 = args.stream_min_m_fp8
    g = torch.Generator(device="cuda").manual_seed(0)
    Ms = args.M or ([1, 8, 64, 256, 4096] if args.quick else [1, 8, 32, 64, 128, 256, 1024, 4096])
    rows = []
    for name in args.proj:
        N, K = SHAPES[name]
        wf = torch.randn(N, K, device="cuda", generator=g) * K ** -0.5
        for fmt in args.fmts:
            w, s = ops.fp8_block_cast(wf, (128, 128), scale_fmt="ue8m0") if fmt == "fp8" else ops.mxfp4_cast(wf)
            wbytes = w.numel() * w.element_size() + s.numel() * s.element_size()
            for M in Ms:
                x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
                t = H.time_fn(lambda: ops.quant_linear(x, w, s, fmt))
                r = dict(proj=name, N=N, K=K, fmt=fmt, M=M, us=t.median_us, TBps=wbytes / t.s / 1e12,
                         frac_copy=wbytes / t.s / 1e12 / ctx.copy_tbps, TFLOPs=2 * M * N * K / t.s / 1e12)
                if M <= L.SMALL_M and (L.STREAM_MAX_M > 0 or L.PERSIST_FP8):
                    keep = L.STREAM_MAX_M, L.PERSIST_FP8
                    L.STREAM_MAX_M, L.PERSIST_FP8 = 0, False
                    try:
                        tp = H.time_fn(lambda: ops.quant_linear(x, w, s, fmt))
                    finally:
                        L.STREAM_MAX_M, L.PERSIST_FP8 = keep
                    r["prev_us"], r["x_prev"] = tp.median_us, tp.median_us / t.median_us
                if not args.no_ref:
                    tr = H.time_fn(lambda: L.quant_linear_ref(x, w, s, fmt), reps=10)
                    r["ref_us"], r["x_ref"] = tr.median_us, tr.median_us / t.median_us
                if fmt == "fp8":
                    ts = H.time_fn(lambda: L._scaled_mm_fp8(x, w, s, torch.bfloat16))
                    r["scaled_mm_us"], r["x_scaled_mm"] = ts.median_us, ts.median_us / t.median_us
                rows.append(r)
                H.print_table([r], COLS)
    print()
    H.print_table(rows, COLS)
    H.save(args.out, "linear", ctx, rows)


COLS = [("proj", "{}"), ("N", "{}"), ("K", "{}"), ("fmt", "{}"), ("M", "{}"), ("us", "{:.1f}"), ("TBps", "{:.2f}"),
        ("frac_copy", "{:.2f}"), ("TFLOPs", "{:.0f}"), ("prev_us", "{:.1f}"), ("x_prev", "{:.2f}"),
        ("ref_us", "{:.1f}"), ("x_ref", "{:.1f}"), ("scaled_mm_us", "{:.1f}"), ("x_scaled_mm", "{:.2f}")]

if __name__ == "__main__":
    main()
