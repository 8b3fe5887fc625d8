"""Fused MoE (ops.moe_experts, ops.moe_route) at V4-Flash and V4-Pro shapes on the GPU.

python -m microbench.bench_moe --out DIR [--quick] [--profile] [--models flash pro] [--T 1 8 ..]
                                [--fmts fp8 mxfp4] [--no-baselines] [--graph] [--stream-max-t N]
                                [--prefill-min-t N] [--prefill-mxfp4-min-t N]

Per (model, weight format, T tokens): time of route + experts (`us`, the router's fp32 logits
GEMM included; at T <= 256 also with the router fused in: `fused_us`, ops.moe.moe_gate_experts), the touched expert weights (routed experts the routing hits + the shared
expert) read per second and as a fraction of the copy ceiling measured in this run
(`frac_copy`; `floor_us` = touched bytes / ceiling), TFLOP/s (6 I d per token-expert pair) and
the fraction of the FP8 dense peak measured in this run (torch._scaled_mm 8192^3), at T <=
ops.moe.STREAM_MAX_T the grouped kernels on the same inputs (`grouped_us`, `x_grouped` > 1: the
streaming decode path faster; likewise for fp8 at T >= ops.moe.PREFILL_MIN_T > 0 and mxfp4 at
T >= ops.moe.PREFILL_MXFP4_MIN_T > 0 the prefill kernels against the grouped kernels), with
--graph the step replayed in a CUDA graph, and the speedups over the pipelines a user would
write: torch._grouped_mm in bf16 and torch._scaled_grouped_mm in fp8 (rowwise scales), each with
argsort dispatch, clamped SwiGLU, index_add combine and the shared expert (V4-Flash only: bf16 Pro
weights are 50 GB).
Weights: random e4m3 / e2m1 codes with UE8M0 scales near 2^-7; routing: uniform top-6.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from deepfuse import ops
from deepfuse.ops import moe as M
from microbench import harness as H

MODELS = {"flash": dict(E=256, d=4096, I=2048, k=6), "pro": dict(E=384, d=7168, I=3072, k=6)}


def fp8_peak_tflops() -> float:
    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    t = H.time_fn(lambda: torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16), warmup=3, reps=10,
                  flush=False)
    return 2 * n**3 / t.s / 1e12


def random_experts(E, I, d, fmt, g):
    """{name: (w, scale)} with random codes (generated in slices to bound memory)."""
    out = {}
    for name, (N, K) in (("w1", (I, d)), ("w3", (I, d)), ("w2", (d, I))):
        if fmt == "fp8":
            w = torch.empty(E, N, K, dtype=torch.float8_e4m3fn, device="cuda")
            for e in range(0, E, 16):
                w[e:e + 16] = torch.randn(w[e:e + 16].shape, device="cuda", generator=g).to(torch.float8_e4m3fn)
            s = torch.randint(118, 122, (E, N // 128, K // 128), device="cuda", generator=g, dtype=torch.uint8)
        else:
            w = torch.randint(0, 256, (E, N, K // 2), device="cuda", generator=g, dtype=torch.uint8)
            s = torch.randint(118, 122, (E, N, K // 32), device="cuda", generator=g, dtype=torch.uint8)
        out[name] = (w, s)
    return out


def shared_expert(I, d, g):
    ws = []
    for N, K in ((I, d), (I, d), (d, I)):
        ws.append((torch.randn(N, K, device="cuda", generator=g).to(torch.float8_e4m3fn),
                   torch.randint(118, 122, (N // 128, K // 128), device="cuda", generator=g, dtype=torch.uint8)))
    return (ws[0][0], ws[1][0], ws[2][0], ws[0][1], ws[1][1], ws[2][1])


def expert_bytes(I, d, fmt) -> int:
    if fmt == "fp8":
        return 3 * I * d + 3 * (I // 128) * (d // 128)
    return 3 * I * d // 2 + 3 * I * d // 32


class Baseline:
    """The torch pipeline: argsort dispatch, grouped GEMMs, clamped SwiGLU, index_add combine."""

    def __init__(self, E, I, d, g, fp8: bool):
        self.E, self.I, self.fp8 = E, I, fp8
        w13 = torch.empty(E, 2 * I, d, dtype=torch.bfloat16, device="cuda")
        w2 = torch.empty(E, d, I, dtype=torch.bfloat16, device="cuda")
        for e in range(0, E, 16):
            w13[e:e + 16] = torch.randn(w13[e:e + 16].shape, device="cuda", generator=g) * d ** -0.5
            w2[e:e + 16] = torch.randn(w2[e:e + 16].shape, device="cuda", generator=g) * I ** -0.5
        self.sh = [torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16) * k ** -0.5
                   for n, k in ((2 * I, d), (d, I))]
        if fp8:
            self.w13, self.s13 = self._rowwise(w13)
            self.w2, self.s2 = self._rowwise(w2)
        else:
            self.w13, self.w2 = w13.transpose(1, 2), w2.transpose(1, 2)

    @staticmethod
    def _rowwise(w):  # [E, N, K] -> fp8 [E, K, N] column-major view + scales [E, N]
        s = w.float().abs().amax(-1).clamp(min=1e-12) / 448
        q = (w.float() / s[..., None]).to(torch.float8_e4m3fn)
        return q.transpose(1, 2), s

    def _gemm(self, x, w, s, offs):
        if not self.fp8:
            return torch._grouped_mm(x, w, offs=offs)
        xs = x.float().abs().amax(-1).clamp(min=1e-12) / 448
        xq = (x.float() / xs[:, None]).to(torch.float8_e4m3fn)
        return torch._scaled_grouped_mm(xq, w, xs, s, offs=offs, out_dtype=torch.bfloat16)

    def __call__(self, x, ids, w, limit=10.0):
        T, k = ids.shape
        flat = ids.reshape(-1)
        order = flat.argsort()
        tok = order // k
        counts = torch.zeros(self.E, dtype=torch.int32, device="cuda").index_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = counts.cumsum(0, dtype=torch.int32)
        xs = x[tok]
        gu = self._gemm(xs, self.w13, getattr(self, "s13", None), offs)
        h = M.swiglu_ref(gu[:, :self.I], gu[:, self.I:], limit)
        y = self._gemm(h, self.w2, getattr(self, "s2", None), offs)
        out = torch.zeros(T, x.shape[1], device="cuda", dtype=torch.float32)
        out.index_add_(0, tok, y.float() * w.reshape(-1)[order, None])
        gu_s = F.linear(x, self.sh[0])
        out += F.linear(M.swiglu_ref(gu_s[:, :self.I], gu_s[:, self.I:], limit), self.sh[1]).float()
        return out.to(x.dtype)


def run_model(name, fmts, Ts, ctx, peak, g, rows, profile, baselines=True, graph=False):
    p = MODELS[name]
    E, d, I, k = p["E"], p["d"], p["I"], p["k"]
    gate = torch.randn(E, d, device="cuda", generator=g) * d ** -0.5
    bias = torch.randn(E, device="cuda", generator=g) * 0.01
    sh = shared_expert(I, d, g)
    base = {}
    if name == "flash" and baselines:
        base = {"bf16": Baseline(E, I, d, g, False)}
        try:
            b8 = Baseline(E, I, d, g, True)
            x0 = torch.randn(16, d, device="cuda").to(torch.bfloat16)
            b8(x0, torch.randint(0, E, (16, k), device="cuda"), torch.rand(16, k, device="cuda"))
            base["fp8"] = b8
        except Exception as e:  # noqa: BLE001 (a torch build without it)
            print(f"  torch._scaled_grouped_mm baseline unavailable: {type(e).__name__}: {e}")
    for fmt in fmts:
        ex = random_experts(E, I, d, fmt, g)
        (w1, s1), (w3, s3), (w2, s2) = ex["w1"], ex["w3"], ex["w2"]
        for T in Ts:
            x = torch.randn(T, d, device="cuda", generator=g).to(torch.bfloat16)

            def step():
                wts, ids = ops.moe_route(F.linear(x.float(), gate), k, bias=bias, route_scale=1.5)
                return ops.moe_experts(x, ids, wts, w1, w3, w2, s1=s1, s3=s3, s2=s2, fmt=fmt, limit=10.0, shared=sh)

            reps = 30 if T <= 512 else 10
            t = H.time_fn(step, reps=reps)
            t_grouped = None
            if M.STREAM_MIN_T.get(fmt, 1) <= T <= M.STREAM_MAX_T:  # decode path vs grouped kernels, same inputs
                keep, M.STREAM_MAX_T = M.STREAM_MAX_T, 0
                try:
                    t_grouped = H.time_fn(step, reps=reps)
                finally:
                    M.STREAM_MAX_T = keep
            pmin = M.PREFILL_MIN_T if fmt == "fp8" else (M.PREFILL_MXFP4_MIN_T if M.PREFILL_MIN_T else 0)
            if T > 256 and 0 < pmin <= T:  # prefill path vs grouped kernels (PREFILL_MIN_T = 0: both formats off)
                keep, M.PREFILL_MIN_T = M.PREFILL_MIN_T, 0
                try:
                    t_grouped = H.time_fn(step, reps=reps)
                finally:
                    M.PREFILL_MIN_T = keep
            wts, ids = ops.moe_route(F.linear(x.float(), gate), k, bias=bias, route_scale=1.5)
            hit = int(torch.unique(ids).numel())
            touched = hit * expert_bytes(I, d, fmt) + expert_bytes(I, d, "fp8") + E * d * 4
            flops = 6 * I * d * T * (k + 1)
            r = dict(model=name, fmt=fmt, T=T, us=t.median_us, experts_hit=hit, touched_MB=touched / 1e6,
                     TBps=touched / t.s / 1e12, frac_copy=touched / t.s / 1e12 / ctx.copy_tbps,
                     floor_us=touched / (ctx.copy_tbps * 1e12) * 1e6, TFLOPs=flops / t.s / 1e12,
                     frac_fp8_peak=flops / t.s / 1e12 / peak)
            if t_grouped is not None:
                r["grouped_us"] = t_grouped.median_us
                r["x_grouped"] = t_grouped.median_us / t.median_us
            if graph and T <= 128:  # replayed in a CUDA graph: launch gaps and host work amortised, L2 warm
                r["graph_us"] = H.time_graph(step, calls=10, reps=10).median_us
            if T <= 256:  # the router fused in (ops.moe.moe_gate_experts at GATE_FUSED_MAX_T >= T), same inputs
                def fused():
                    return M.moe_gate_experts(x, gate, k, w1, w3, w2, bias=bias, route_scale=1.5, s1=s1, s3=s3,
                                              s2=s2, fmt=fmt, limit=10.0, shared=sh)[0]

                keep, M.GATE_FUSED_MAX_T = M.GATE_FUSED_MAX_T, 256
                try:
                    r["fused_us"] = H.time_fn(fused, reps=reps).median_us
                    r["x_fused"] = t.median_us / r["fused_us"]
                    if graph and T <= 128:
                        r["fused_graph_us"] = H.time_graph(fused, calls=10, reps=10).median_us
                finally:
                    M.GATE_FUSED_MAX_T = keep
            for bn, b in base.items():
                tb = H.time_fn(lambda: b(x, ids, wts), reps=reps)
                r[f"{bn}_us"] = tb.median_us
                r[f"x_{bn}"] = tb.median_us / t.median_us
            rows.append(r)
            H.print_table([r], COLS)
            if profile and T in (1, 64, 512, 4096):
                from torch.profiler import ProfilerActivity, profile as prof

                for smt in ((M.STREAM_MAX_T, 0) if M.STREAM_MIN_T.get(fmt, 1) <= T <= M.STREAM_MAX_T
                            else (M.STREAM_MAX_T,)):
                    keep, M.STREAM_MAX_T = M.STREAM_MAX_T, smt
                    try:
                        for _ in range(3):
                            step()
                        torch.cuda.synchronize()
                        with prof(activities=[ProfilerActivity.CUDA]) as pr:
                            for _ in range(5):
                                H.flush_l2()
                                step()
                            torch.cuda.synchronize()
                    finally:
                        M.STREAM_MAX_T = keep
                    print(f"## {name} {fmt} T={T} stream_max_t={smt} prefill_min_t={M.PREFILL_MIN_T} "
                          f"prefill_mxfp4_min_t={M.PREFILL_MXFP4_MIN_T}: per-kernel CUDA time over 5 calls "
                          "(L2 flushed)")
                    print(pr.key_averages().table(sort_by="cuda_time_total", row_limit=14))
        del ex
        torch.cuda.empty_cache()


COLS = [("model", "{}"), ("fmt", "{}"), ("T", "{}"), ("us", "{:.1f}"), ("floor_us", "{:.1f}"),
        ("touched_MB", "{:.0f}"), ("TBps", "{:.2f}"), ("frac_copy", "{:.2f}"), ("TFLOPs", "{:.0f}"),
        ("frac_fp8_peak", "{:.2f}"), ("grouped_us", "{:.1f}"), ("x_grouped", "{:.2f}"), ("graph_us", "{:.1f}"),
        ("fused_us", "{:.1f}"), ("x_fused", "{:.2f}"), ("fused_graph_us", "{:.1f}"), ("bf16_us", "{:.1f}"), ("x_bf16", "{:.1f}"), ("fp8_us", "{:.1f}"),
        ("x_fp8", "{:.1f}")]


def main(argv=None):
    def extra(ap):
        ap.add_argument("--profile", action="store_true", help="kernel times at T = 1 and 4096")
        ap.add_argument("--models", nargs="*", default=["flash", "pro"])
        ap.add_argument("--T", nargs="*", type=int, default=None, help="token counts (default: the grid)")
        ap.add_argument("--fmts", nargs="*", default=["fp8", "mxfp4"], choices=["fp8", "mxfp4"])
        ap.add_argument("--no-baselines", action="store_true", help="skip the torch pipelines")
        ap.add_argument("--graph", action="store_true", help="also time T <= 128 replayed in a CUDA graph")
        ap.add_argument("--stream-max-t", type=int, default=None,
                        help="ops.moe.STREAM_MAX_T for the run (the decode path's range; 0: grouped kernels)")
        ap.add_argument("--prefill-min-t", type=int, default=None,
                        help="ops.moe.PREFILL_MIN_T for the run (fp8 prefill kernels from this T; 0: grouped kernels)")
        ap.add_argument("--prefill-mxfp4-min-t", type=int, default=None,
                        help="ops.moe.PREFILL_MXFP4_MIN_T for the run (mxfp4 prefill kernels from this T; 0: grouped)")

    args, ctx = H.start(argv, extra=extra)
    if args.stream_max_t is not None:
        M.STREAM_MAX_T = args.stream_max_t
    ctx.extra["stream_max_t"] = M.STREAM_MAX_T
    if args.prefill_min_t is not None:
        M.PREFILL_MIN_T = args.prefill_min_t
    ctx.extra["prefill_min_t"] = M.PREFILL_MIN_T
    if args.prefill_mxfp4_min_t is not None:
        M.PREFILL_MXFP4_MIN_T = args.prefill_mxfp4_min_t
    ctx.extra["prefill_mxfp4_min_t"] = M.PREFILL_MXFP4_MIN_T
    peak = fp8_peak_tflops()
    ctx.extra["fp8_peak_tflops"] = peak
    print(f"# FP8 dense peak (torch._scaled_mm 8192^3): {peak:.0f} TFLOP/s")
    g = torch.Generator(device="cuda").manual_seed(0)
    rows: list[dict] = []
    grid = {"flash": [1, 8, 64, 4096] if args.quick else [1, 8, 32, 64, 128, 512, 4096, 16384],
            "pro": [1, 64, 4096] if args.quick else [1, 8, 64, 128, 4096, 16384]}
    for name in args.models:
        run_model(name, args.fmts, args.T or grid[name], ctx, peak, g, rows, args.profile, not args.no_baselines,
                  args.graph)
        torch.cuda.empty_cache()
    print()
    H.print_table(rows, COLS)
    H.save(args.out, "moe", ctx, rows)


if __name__ == "__main__":
    main()
