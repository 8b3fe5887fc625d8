"""The V4 layer's row kernels at V4-Flash shapes: rms_norm, the q path (norm_rope), the kv
path (norm + RoPE + FP8 + cache store), the compressor step, the paged indexer logits and
the top-k written as slots.

python -m microbench.bench_rows --out DIR [--quick] [--next-n 1,2,4]
python -m microbench.bench_rows --out DIR --indexer [--next-n 1,2,4] [--batches 1,8,...] [--contexts 8192,65536]
    [--idx-heads 64,32] [--q-modes exact,fp8] [--orders random,paged] [--env "A=1;A=0+B=2"] [--no-per-token] [--once]
python -m microbench.bench_rows --out DIR --indexer --prefill 1024,4096 [--contexts 32768] [--q-modes ...] [--env ...]

Per case: time, bytes moved per second and the fraction of the copy ceiling measured in this
run (bytes = what the op must read and write once), TFLOP/s for the indexer, and the ratio to
the torch references on the same GPU (kernels switched off: what a user would otherwise run;
for topk_slots, torch.topk and a gather).

Indexer cases: B requests of next_n consecutive query tokens each (decode with drafts), C keys
per request. --indexer runs only them, without the torch reference, each also launched one
token per CTA (entry_slots padded to N rows, so the kernel groups no tokens: the pre-grouping
kernel's work) -> per_token_us and x_per_token. Entries: random slots ("random") or the engine's
lists ("paged": each request's pages in random order, the rows of a page in order); --env runs
each case under each set of environment variables (';' between sets, '+' between variables: a
kernel's switches while one is being evaluated).
"""
from __future__ import annotations

import os
from types import SimpleNamespace

import torch

from deepfuse import _ext, ops
from deepfuse import kv_format as F
from deepfuse.ops.kvcache import RowTarget
from microbench import harness as H
from microbench.bench_moe import fp8_peak_tflops

DEV = "cuda"


def _bf(*shape, g, scale=1.0):
    return (torch.randn(*shape, generator=g, device=DEV) * scale).to(torch.bfloat16)


def _cs(n, g):
    a = torch.rand(n, 32, generator=g, device=DEV) * 6.3
    return a.cos().contiguous(), a.sin().contiguous()


def _ref_time(fn):
    prev = _ext.set_kernels_enabled(False)
    try:
        return H.time_fn(fn, warmup=2, reps=5)
    finally:
        _ext.set_kernels_enabled(prev)


def indexer_case(B, C, next_n, g, per_token=False, heads=64, q_fp8=False, order="random"):
    """(name, rows, bytes, flops, fn) of indexer_logits_paged for B requests of next_n tokens and
    C keys each (heads index heads; q_fp8: q rounded to e4m3); per_token: entry_slots padded to
    one row per token (no tokens grouped); order: "random" slots or "paged" (module doc)."""
    ps = 64
    P = B * C // ps + 1
    kp = torch.randint(0, 120, (P, ps * F.IDX_ROW_BYTES), dtype=torch.uint8, device=DEV)
    kp[:, ps * 128:].view(torch.float32)[:] = 0.01
    if order == "paged":
        npp = (C + ps - 1) // ps
        e = torch.arange(C, device=DEV)
        entry = torch.randperm(P, device=DEV)[: B * npp].view(B, npp)[:, e // ps] * ps + e % ps
    else:
        entry = torch.randperm(P * ps, device=DEV)[: B * C].view(B, C)
    N = B * next_n
    if per_token and N > B:
        entry = torch.cat([entry, entry.new_full((N - B, C), -1)])
    req = torch.arange(B, device=DEV).repeat_interleave(next_n)
    nv = torch.full((N,), C, dtype=torch.int32, device=DEV)
    q = _bf(N, heads, 128, g=g)
    wts = torch.randn(N, heads, device=DEV) * 0.125
    flops = 2 * N * C * heads * 128
    name = f"indexer logits C={C} next_n={next_n} H={heads}" + (" q_fp8" if q_fp8 else "") + f" {order}"
    return (name, B, B * C * (F.IDX_ROW_BYTES + 8) + N * C * 4, flops,
            lambda q=q, w=wts, kp=kp, e=entry, r=req, n=nv: ops.indexer_logits_paged(q, w, kp, ps, e, r, n, 0.088,
                                                                                     q_fp8=q_fp8))


def prefill_case(T, C, g, heads=64, q_fp8=False):
    """(name, rows, bytes, flops, fn) of indexer_logits_paged as a prefill step issues it: T query
    tokens of one request (the last T positions of a context whose compressed keys are C; ratio 4:
    token i sees C - (T - 1 - i) // 4 entries), the engine's page-ordered entries, page size 64.
    flops = 2 * 128 * heads per visible (token, entry)."""
    ps = 64
    npp = (C + ps - 1) // ps
    P = npp + 1
    kp = torch.randint(0, 120, (P, ps * F.IDX_ROW_BYTES), dtype=torch.uint8, device=DEV)
    kp[:, ps * 128:].view(torch.float32)[:] = 0.01
    e = torch.arange(C, device=DEV)
    entry = (torch.randperm(P, device=DEV)[:npp][e // ps] * ps + e % ps).view(1, C)
    req = torch.zeros(T, dtype=torch.int64, device=DEV)
    nv = (C - (T - 1 - torch.arange(T, device=DEV)) // 4).clamp(min=0).to(torch.int32)
    q = _bf(T, heads, 128, g=g)
    wts = torch.randn(T, heads, device=DEV) * 0.125
    flops = 2 * 128 * heads * int(nv.sum())
    name = f"indexer prefill T={T} C={C} H={heads}" + (" q_fp8" if q_fp8 else "")
    return (name, T, C * (F.IDX_ROW_BYTES + 8) + T * C * 4, flops,
            lambda q=q, w=wts, kp=kp, e=entry, r=req, n=nv: ops.indexer_logits_paged(q, w, kp, ps, e, r, n, 0.088,
                                                                                     q_fp8=q_fp8))


def prefill_rows(ctx, g, rows_list, contexts, heads=(64,), q_modes=(False,), envs=("",), peak=None, once=False):
    """The prefill cases (prefill_case) under each env set; TFLOP/s and the fraction of the FP8
    peak measured in this run."""
    out = []
    for hh in heads:
        for q_fp8 in q_modes:
            for C in contexts:
                for T in rows_list:
                    for env in envs:
                        saved = _set_env(env)
                        name, M, nbytes, flops, fn = prefill_case(T, C, g, heads=hh, q_fp8=q_fp8)
                        if env:
                            name += " " + env.replace("DEEPFUSE_INDEXER_", "")
                        if once:
                            fn()
                            torch.cuda.synchronize()
                        else:
                            t = H.time_fn(fn)
                            r = dict(case=name, rows=M, H=hh, q_fp8=q_fp8, env=env, C=C, T=T, us=t.median_us,
                                     TBps=nbytes / t.s / 1e12, frac_copy=nbytes / t.s / 1e12 / ctx.copy_tbps,
                                     TFLOPs=flops / t.s / 1e12)
                            if peak:
                                r["frac_fp8_peak"] = r["TFLOPs"] / peak
                            out.append(r)
                            H.print_table([r], PREFILL_COLS)
                        del fn
                        torch.cuda.empty_cache()
                        _restore_env(saved)
    return out


def _set_env(env):
    saved = {}
    for kv in (x for x in env.split("+") if x):
        k, v = kv.split("=", 1)
        saved[k] = os.environ.get(k)
        os.environ[k] = v
    return saved


def _restore_env(saved):
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def indexer_rows(ctx, g, next_n, batches, contexts, once=False, heads=(64,), q_modes=(False,), per_token=True,
                 orders=("random",), envs=("",)):
    rows = []
    grid = ((hh, q_fp8, order, env, C, nn, B) for hh in heads for q_fp8 in q_modes for order in orders for env in envs
            for C in contexts for nn in next_n for B in batches)
    for hh, q_fp8, order, env, C, nn, B in grid:
        saved = _set_env(env)
        name, M, nbytes, flops, fn = indexer_case(B, C, nn, g, heads=hh, q_fp8=q_fp8, order=order)
        if env:
            name += " " + env.replace("DEEPFUSE_INDEXER_", "")
        if once:  # one call per case, untimed (for a profiler)
            fn()
            torch.cuda.synchronize()
            _restore_env(saved)
            continue
        t = H.time_fn(fn)
        del fn
        r = dict(case=name, rows=M, H=hh, q_fp8=q_fp8, order=order, env=env, C=C, next_n=nn, B=B,
                 us=t.median_us, TBps=nbytes / t.s / 1e12, frac_copy=nbytes / t.s / 1e12 / ctx.copy_tbps,
                 TFLOPs=flops / t.s / 1e12)
        if per_token:
            tp = H.time_fn(indexer_case(B, C, nn, g, per_token=True, heads=hh, q_fp8=q_fp8,
                                        order=order)[4])
            r.update(per_token_us=tp.median_us, x_per_token=tp.median_us / t.median_us)
        rows.append(r)
        H.print_table([r], INDEXER_COLS)
        torch.cuda.empty_cache()
        _restore_env(saved)
    return rows


def cases(quick: bool, g, next_n=(1,)):
    out = []
    for M in ([1, 64] if quick else [1, 64, 1024]):
        x, w = _bf(M, 4096, g=g), torch.rand(4096, device=DEV) + 0.5
        out.append((f"rms_norm d=4096", M, 4 * M * 4096, 0, lambda x=x, w=w: ops.rms_norm(x, w, 1e-6)))
        q = _bf(M, 64, 512, g=g)
        c, s = _cs(M, g)
        out.append(("q norm_rope 64x512", M, 4 * M * 64 * 512, 0, lambda q=q, c=c, s=s: ops.norm_rope(q, None, 1e-6, c, s)))
        kv = _bf(M, 512, g=g)
        ps = 64
        pages = torch.zeros(M // ps + 2, ps * F.KV_ROW_BYTES, dtype=torch.uint8, device=DEV)
        slots = torch.randperm(pages.shape[0] * ps, device=DEV)[:M]
        t = RowTarget(pages, "kv_fp8", ps)
        out.append(("kv norm_rope_store fp8", M, M * (512 * 4 + F.KV_ROW_BYTES), 0,
                    lambda kv=kv, w=w[:512].contiguous(), c=c, s=s, t=t, sl=slots:
                    ops.norm_rope_store(kv, w, 1e-6, c, s, t, sl)))
    for nb in ([16] if quick else [16, 256]):
        r, D = 4, 512
        w2 = 2 * D
        N, S = 4 * nb, 8 * nb
        kvs, sc = _bf(N, w2, g=g), _bf(N, w2, g=g)
        skv, ssc = _bf(S, w2, g=g), _bf(S, w2, g=g)
        ape = torch.randn(r, w2, device=DEV)
        plan = SimpleNamespace(
            overlap=True, src_is_fresh=torch.rand(nb, 2 * r, device=DEV) < 0.5,
            src_valid=torch.ones(nb, 2 * r, dtype=torch.bool, device=DEV),
            src_fresh=torch.randint(0, N, (nb, 2 * r), device=DEV), src_state=torch.randint(0, S, (nb, 2 * r), device=DEV),
            src_ape=torch.randint(0, r, (nb, 2 * r), device=DEV), blk_slot=torch.randperm(nb * 2, device=DEV)[:nb])
        pages = torch.zeros(nb * 2 // 64 + 1, 64 * F.KV_ROW_BYTES, dtype=torch.uint8, device=DEV)
        c, s = _cs(nb, g)
        nw = torch.rand(D, device=DEV) + 0.5
        t = RowTarget(pages, "kv_fp8", 64)
        out.append(("CSA compress_store", nb, nb * (2 * r * D * (2 + 2 + 4) + F.KV_ROW_BYTES), 0,
                    lambda a=(kvs, sc, skv, ssc, ape, plan, nw, 1e-6, c, s, t): ops.compress_store(*a)))
    grid = [(1, 1024), (64, 1024), (1, 16384)] if quick else [(1, 1024), (64, 1024), (1, 16384), (64, 16384)]
    for B, C in grid:
        for nn in next_n:
            out.append(indexer_case(B, C, nn, g))
        nv = torch.full((B,), C, dtype=torch.int32, device=DEV)
        entry = torch.randperm(B * C, device=DEV).view(B, C)
        req = torch.arange(B, device=DEV)
        sc = torch.randn(B, C, device=DEV)
        out.append((f"topk_slots 512 of C={C}", B, B * C * 4, 0,
                    lambda sc=sc, n=nv, e=entry, r=req: ops.topk_slots(sc, 512, n, e, r),
                    lambda sc=sc, e=entry, r=req: e[r].gather(1, torch.topk(sc, 512, sorted=False).indices)))
    return out


def _ints(text):
    return [int(x) for x in text.split(",") if x]


def _extra(ap):
    ap.add_argument("--next-n", type=_ints, default=[1], help="query tokens per request of the indexer cases")
    ap.add_argument("--indexer", action="store_true", help="only the indexer cases (no torch reference)")
    ap.add_argument("--batches", type=_ints, default=[1, 8, 32, 64, 128], help="requests (--indexer)")
    ap.add_argument("--contexts", type=_ints, default=[8192, 65536], help="keys per request (--indexer)")
    ap.add_argument("--once", action="store_true", help="--indexer: one untimed call per case (for ncu)")
    ap.add_argument("--idx-heads", type=_ints, default=[64], help="index heads (--indexer): 64 (V4), 32 (V4.1)")
    ap.add_argument("--q-modes", default="exact", help="--indexer: comma list of exact (q kept: two e4m3 "
                    "terms), fp8 (q rounded to e4m3, DeepGEMM's contract)")
    ap.add_argument("--no-per-token", action="store_true", help="--indexer: skip the one-token-per-CTA launches")
    ap.add_argument("--orders", default="random", help="--indexer: comma list of random, paged (module doc)")
    ap.add_argument("--prefill", type=_ints, default=[], help="--indexer: prefill cases of these query rows "
                    "(one request, the last rows of a context of --contexts keys; prefill_case) instead of decode")
    ap.add_argument("--env", default="", help="--indexer: sets of environment variables to run each case under "
                    "(';' between sets, '+' between variables; empty: the environment as it is)")


def main(argv=None):
    args, ctx = H.start(argv, _extra)
    g = torch.Generator(device=DEV).manual_seed(0)
    if args.indexer and args.prefill:
        modes = [{"exact": False, "fp8": True}[m] for m in args.q_modes.split(",") if m]
        peak = None if args.once else fp8_peak_tflops()
        ctx.extra["fp8_peak_tflops"] = peak
        if peak:
            print(f"FP8 peak (torch._scaled_mm 8192^3, this run): {peak:.0f} TFLOP/s")
        rows = prefill_rows(ctx, g, args.prefill, args.contexts, args.idx_heads, modes,
                            args.env.split(";") if args.env else [""], peak, args.once)
        if args.once:
            return
        print()
        H.print_table(rows, PREFILL_COLS)
        H.save(args.out, "rows_indexer_prefill", ctx, rows)
        return
    if args.indexer:
        modes = [{"exact": False, "fp8": True}[m] for m in args.q_modes.split(",") if m]
        rows = indexer_rows(ctx, g, args.next_n, args.batches, args.contexts, args.once, args.idx_heads, modes,
                            not args.no_per_token, [o for o in args.orders.split(",") if o],
                            args.env.split(";") if args.env else [""])
        if args.once:
            return
        print()
        H.print_table(rows, INDEXER_COLS)
        H.save(args.out, "rows_indexer", ctx, rows)
        return
    rows = []
    for name, M, nbytes, flops, fn, *ref in cases(args.quick, g, args.next_n):
        t = H.time_fn(fn)
        r = dict(case=name, rows=M, us=t.median_us, TBps=nbytes / t.s / 1e12, frac_copy=nbytes / t.s / 1e12 / ctx.copy_tbps)
        if flops:
            r["TFLOPs"] = flops / t.s / 1e12
        tr = H.time_fn(ref[0], warmup=2, reps=10) if ref else _ref_time(fn)
        r["ref_us"], r["x_ref"] = tr.median_us, tr.median_us / t.median_us
        rows.append(r)
        H.print_table([r], COLS)
    print()
    H.print_table(rows, COLS)
    H.save(args.out, "rows", ctx, rows)


COLS = [("case", "{}"), ("rows", "{}"), ("us", "{:.1f}"), ("TBps", "{:.2f}"), ("frac_copy", "{:.2f}"),
        ("TFLOPs", "{:.0f}"), ("ref_us", "{:.1f}"), ("x_ref", "{:.1f}")]
PREFILL_COLS = [("case", "{}"), ("rows", "{}"), ("us", "{:.1f}"), ("TFLOPs", "{:.0f}"), ("frac_fp8_peak", "{:.2f}"),
                ("TBps", "{:.2f}")]
INDEXER_COLS = [("case", "{}"), ("rows", "{}"), ("us", "{:.1f}"), ("TBps", "{:.2f}"), ("frac_copy", "{:.2f}"),
                ("TFLOPs", "{:.0f}"), ("per_token_us", "{:.1f}"), ("x_per_token", "{:.2f}")]

if __name__ == "__main__":
    main()
