"""Dense FP8 linears at large M: the MoE prefill kernel's dense mode (ops/linear_prefill.py) against
cuBLASLt (`torch._scaled_mm` with DeepSeek's block scales, the path quant_linear takes at M > 64 without
it) and, for wo_a (block-diagonal), the grouped kernel.

python -m microbench.bench_linear_prefill --out DIR [--proj wq_b ..] [--M 512 4096 ..] [--bn]

Per (projection, M): ours (bf16 in, the activation cast included), the cast alone, TFLOP/s and the
fraction of the FP8 peak (measured in the run: a 8192^3 e4m3 `_scaled_mm` with unit scales), cuBLASLt
(cast included), x_cublas (> 1: ours faster); --bn also times 128 x 128 and 128 x 256 tiles forced,
--mc 128 x 256 tiles in 2-CTA clusters (the weight tile multicast to two m-tiles), --epi4 the bf16 epilogue
with 4-byte stores (DEEPFUSE_LINEAR_PREFILL_EPI16=0; x_epi4 > 1: the default 16-byte stores faster).
"""
from __future__ import annotations

import os

import torch

from deepfuse import _ext, ops
from deepfuse.ops import linear as L
from deepfuse.ops import linear_prefill as LP
from microbench import harness as H

SHAPES = {  # name: (N, K, G); G > 1: block-diagonal (grouped_linear), N = R per group, K = Kg
    "wq_b": (32768, 1024, 1), "wo_b": (4096, 8192, 1), "shared_w1": (2048, 4096, 1), "wkv": (512, 4096, 1),
    "wq_a": (1024, 4096, 1), "shared_w2": (4096, 2048, 1), "wo_a": (1024, 4096, 8),
}


def fp8_peak_tflops() -> float:
    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    t = H.time_fn(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), flush=False, reps=20)
    return 2 * n ** 3 / t.s / 1e12


def main(argv=None):
    def extra(ap):
        ap.add_argument("--proj", nargs="*", default=["wq_b", "wo_b", "shared_w1", "wkv", "wo_a"], choices=list(SHAPES))
        ap.add_argument("--M", nargs="*", type=int, default=[128, 512, 4096, 16384])
        ap.add_argument("--bn", action="store_true", help="also time 128 x 128 and 128 x 256 tiles forced")
        ap.add_argument("--mc", action="store_true", help="also time 128 x 256 tiles in 2-CTA clusters, forced")
        ap.add_argument("--epi4", action="store_true", help="also time the 4-byte-store bf16 epilogue")

    args, ctx = H.start(argv, extra=extra)
    peak = fp8_peak_tflops()
    print(f"FP8 peak (8192^3 scaled_mm, unit scales): {peak:.0f} TFLOP/s", flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name in args.proj:
        N, K, G = SHAPES[name]
        wf = torch.randn(G * N, K, device="cuda", generator=g) * K ** -0.5
        w, s = ops.fp8_block_cast(wf, (128, 128), scale_fmt="ue8m0")
        del wf
        for M in args.M:
            x = torch.randn(M, G, K, device="cuda", generator=g).to(torch.bfloat16)
            x = x.view(M, K) if G == 1 else x
            out = torch.empty(M, G * N, dtype=torch.bfloat16, device="cuda").view(*x.shape[:-1], N)
            flops = 2 * M * G * N * K
            t = H.time_fn(lambda: LP.run(x, w, s, out))
            r = dict(proj=name, M=M, N=N, K=K, G=G, us=t.median_us, TFLOPs=flops / t.s / 1e12,
                     of_peak=flops / t.s / 1e12 / peak)
            r["cast_us"] = H.time_fn(lambda: ops.fp8_per_token_cast(x.view(-1, K), 128)).median_us
            if G == 1:
                tc = H.time_fn(lambda: L._scaled_mm_fp8(x, w, s, torch.bfloat16))
                r["cublas_us"], r["x_cublas"] = tc.median_us, tc.median_us / t.median_us
            else:  # the grouped kernel (what grouped_linear runs without this path)
                C = _ext.ext(x.device)
                work = torch.empty(C.fp8_linear_workspace_bytes(x=x, w=w, w_scale=s), dtype=torch.uint8, device="cuda")
                tg = H.time_fn(lambda: C.fp8_linear(x=x, w=w, w_scale=s, out=out, workspace=work, stream_max_m=0,
                                                     stream_max_splits=1))
                r["grouped_us"], r["x_grouped"] = tg.median_us, tg.median_us / t.median_us
            for key, bn, cl, on in (("bn128_us", 128, 0, args.bn), ("bn256_us", 256, 0, args.bn), ("mc_us", 256, 1, args.mc)):
                if on:
                    r[key] = H.time_fn(lambda: LP.run(x, w, s, out, bn, cl)).median_us
            if args.epi4:  # the 4-byte-store epilogue, same tiles as the default
                os.environ["DEEPFUSE_LINEAR_PREFILL_EPI16"] = "0"
                try:
                    r["epi4_us"] = H.time_fn(lambda: LP.run(x, w, s, out)).median_us
                finally:
                    del os.environ["DEEPFUSE_LINEAR_PREFILL_EPI16"]
                r["x_epi4"] = r["epi4_us"] / r["us"]
            rows.append(r)
            H.print_table([r], COLS)
            del x, out
        del w, s
        torch.cuda.empty_cache()
    print()
    H.print_table(rows, COLS)
    H.save(args.out, "linear_prefill", ctx, rows)


COLS = [("proj", "{}"), ("M", "{}"), ("N", "{}"), ("K", "{}"), ("G", "{}"), ("us", "{:.1f}"), ("TFLOPs", "{:.0f}"),
        ("of_peak", "{:.2f}"), ("cast_us", "{:.1f}"), ("cublas_us", "{:.1f}"), ("x_cublas", "{:.2f}"),
        ("grouped_us", "{:.1f}"), ("x_grouped", "{:.2f}"), ("bn128_us", "{:.1f}"), ("bn256_us", "{:.1f}"),
        ("mc_us", "{:.1f}"), ("epi4_us", "{:.1f}"), ("x_epi4", "{:.2f}")]

if __name__ == "__main__":
    main()
