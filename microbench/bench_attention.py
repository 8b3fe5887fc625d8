"""V4 sparse attention over paged FP8 KV (ops.sparse_attention_paged): time, TFLOP/s, the
fraction of the bf16 MMA peak measured in this run, FP8 KV bytes read per second, the
speedup over the eager PyTorch gather + softmax (the op's reference, run on the GPU), and the
MXFP8 + inverse-RoPE epilogue's cost.

python -m microbench.bench_attention --out DIR [--quick] [--wg]

--wg: the kernel comparison instead (plan group_rows 1, which the wgmma kernel serves): each cell
timed with the mma.sync kernel (DEEPFUSE_SPARSE_DECODE=0) and the warp-specialised wgmma kernel
(=1), bf16 out; the wgmma kernel also with MXFP8 + inverse RoPE and inside a CUDA graph.

Grid (issue 14):
- decode CSA: B in {1, 16, 64, 128, 256} requests x 2 query rows (one draft), H 64 / 128,
  128 window rows (256-row ring region per request, 64-row pages) + 512 selected rows (of a
  4096-row compressed region per request, 64-row pages). The two rows of a request share
  their lists position by position except the window's newest / oldest row ("shared");
  extra cells: G = 1 (no sharing) and independent selected lists ("indep").
- decode HCA: window + all visible compressed rows (context / 128: 512 at 64K, 8192 at 1M),
  B in {1, 64}.
- prefill: T in {4096, 16384} rows of one request, each its own 128-row window and its own
  512 selected rows (G = 1: the decode kernel over many rows).
FLOPs: 2 x 2 x 512 per (query row, head, valid key). KV bytes: 584 per key row fetched
(a group's shared keys count once). `peak_frac` = TFLOP/s / the same run's torch bf16
matmul 8192^3. `eager_us`: the op's pure-torch reference on the GPU. `mx_us`: MXFP8 output
with the inverse RoPE fused; `mx_cost` = mx_us / us - 1; `unfused_us`: bf16 output, then
ops.rope(inverse) and ops.mxfp8_cast as separate passes. `graph_us`: per call inside a CUDA
graph (L2 warm), small shapes. Targets: `target` fraction of the peak (0.55 at H = 128,
0.45 at H = 64 for B >= 64 decode; 0.60 prefill).
"""
from __future__ import annotations

import argparse
import math
import os

import torch

from deepfuse import ops
from deepfuse import kv_format as F
from deepfuse.ops import attention as A
from microbench import harness as H


def bf16_peak_tflops() -> float:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t = H.time_fn(lambda: a @ b, warmup=3, reps=10, flush=False)
    return 2 * n**3 / t.s / 1e12


def fill_cache(P, ps, gen_seed):
    """FP8 pages [P, ps * 584] with every row written by kv_store (random rows)."""
    pages = F.alloc_kv_pages(1, P, ps, "fp8", device="cuda")
    n = P * ps
    g = torch.Generator(device="cuda").manual_seed(gen_seed)
    step = 1 << 18
    for s0 in range(0, n, step):
        s1 = min(n, s0 + step)
        rows = torch.randn(s1 - s0, 512, device="cuda", generator=g).to(torch.bfloat16)
        ops.kv_store(pages, torch.arange(s0, s1, device="cuda"), rows)
    return pages.data[0]


def decode_case(B, Hh, kind, ctx_rows, sel, G=2, indep=False, plan_G=None, seed=0):
    """-> dict of call args for B requests x G rows."""
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(seed)
    T = B * G
    WR, ps_w = 256, 64
    win = fill_cache(B * WR // ps_w, ps_w, seed + 1)
    ps_x = 64
    xr = max(ctx_rows, 64)
    ext = fill_cache(-(-B * xr // ps_x), ps_x, seed + 2)
    # window: the request's ring of W = 128 + G - 1 rows in ring order: position k of every row
    # names ring slot k; row r sees slots r .. r + 127 (-1 elsewhere), so the G rows share
    # every slot position by position (one fetch per key for the group)
    base_w = torch.arange(B, device=dev).repeat_interleave(G) * WR
    r = torch.arange(G, device=dev).repeat(B)
    W = 128 + G - 1
    k = torch.arange(W, device=dev)
    vis = (k[None, :] >= r[:, None]) & (k[None, :] < r[:, None] + 128)
    win_idx = torch.where(vis, base_w[:, None] + k[None, :], torch.full_like(vis, -1, dtype=torch.long)).int()
    if kind == "csa":
        sel_rows = torch.randint(0, xr, (B, sel), device=dev, generator=g)
        ext_idx = sel_rows.repeat_interleave(G, 0)
        if indep:
            ext_idx = torch.randint(0, xr, (T, sel), device=dev, generator=g)
    else:  # hca: every visible compressed row
        ext_idx = torch.arange(xr, device=dev)[None, :].expand(T, xr)
    ext_idx = (ext_idx + torch.arange(B, device=dev).repeat_interleave(G)[:, None] * xr).int().contiguous()
    q = (torch.randn(T, Hh, 512, device=dev, generator=g)).to(torch.bfloat16)
    return dict(q=q, kv=win, ps=ps_w, idx=win_idx.contiguous(), ext=ext, eps=ps_x, eidx=ext_idx,
                G=G if plan_G is None else plan_G)


def prefill_case(T, Hh, sel=512, seed=0):
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(seed)
    ps = 64
    win = fill_cache(-(-T // ps), ps, seed + 1)
    nc = max(64, T // 4)
    ext = fill_cache(-(-nc // ps), ps, seed + 2)
    t = torch.arange(T, device=dev)
    win_idx = (t[:, None] - torch.arange(127, -1, -1, device=dev)[None, :])
    win_idx = torch.where(win_idx >= 0, win_idx, torch.full_like(win_idx, -1)).int().contiguous()
    ext_idx = torch.randint(0, nc, (T, sel), device=dev, generator=g).int()
    ext_len = torch.clamp(t // 4 + 1, max=sel).int()
    q = torch.randn(T, Hh, 512, device=dev, generator=g).to(torch.bfloat16)
    return dict(q=q, kv=win, ps=ps, idx=win_idx, ext=ext, eps=ps, eidx=ext_idx, elen=ext_len, G=1)


def valid_keys(c):
    n = (c["idx"] >= 0).sum(1)
    e = c["eidx"]
    ok = e >= 0
    if c.get("elen") is not None:
        ok &= torch.arange(e.shape[1], device=e.device)[None, :] < c["elen"][:, None]
    return int((n + ok.sum(1)).sum())


def fetched_rows(c):
    """Key rows a group fetches: per position, the distinct valid slots among its G rows."""
    G = c["G"]
    tot = 0
    for idx, ln in ((c["idx"], None), (c["eidx"], c.get("elen"))):
        x = idx.long()
        ok = x >= 0
        if ln is not None:
            ok &= torch.arange(x.shape[1], device=x.device)[None, :] < ln[:, None]
        x = torch.where(ok, x, torch.full_like(x, -1))
        T = x.shape[0]
        pad = (-T) % G
        if pad:
            x = torch.cat([x, x.new_full((pad, x.shape[1]), -1)])
        x = x.view(-1, G, x.shape[1])
        s = x.sort(1).values
        distinct = (s[:, :1] >= 0).sum() + ((s[:, 1:] != s[:, :-1]) & (s[:, 1:] >= 0)).sum()
        tot += int(distinct)
    return tot


def call(c, out_format="bf16", inv=None, plan=None):
    return ops.sparse_attention_paged(c["q"], c["kv"], c["ps"], c["idx"], c["sink"], c["scale"],
                                      extra_kv=c["ext"], extra_page_size=c["eps"], extra_indices=c["eidx"],
                                      extra_lengths=c.get("elen"), inv_rope=inv, out_format=out_format, plan=plan)


def eager(c):
    return A.sparse_attention_paged_ref(c["q"], c["kv"], c["ps"], c["idx"], c["sink"], c["scale"], None, c["ext"],
                                        c["eps"], c["eidx"], c.get("elen"), None, None, "bf16")


def grid(quick):
    cells = []
    Bs = (1, 64, 256) if quick else (1, 16, 64, 128, 256)
    for Hh in (64, 128):
        for B in Bs:
            cells.append(("decode_csa", Hh, B, dict(kind="csa", ctx_rows=4096, sel=512)))
        for B in ((64,) if quick else (64, 128)):
            cells.append(("csa_G1", Hh, B, dict(kind="csa", ctx_rows=4096, sel=512, plan_G=1)))
            cells.append(("csa_indep", Hh, B, dict(kind="csa", ctx_rows=4096, sel=512, indep=True)))
        for ctx in (65536, 1 << 20):
            for B in ((64,) if quick else (1, 64)):
                cells.append((f"decode_hca_{ctx // 1024}K", Hh, B, dict(kind="hca", ctx_rows=ctx // 128, sel=0)))
        for T in ((4096,) if quick else (4096, 16384)):
            cells.append(("prefill", Hh, T, None))
    return cells


def wg_grid(quick):
    cells = []
    for Hh in (64, 128):
        BG = ([(1, 2), (64, 1), (64, 2), (64, 4)] if quick else
              [(B, G) for B in (1, 16, 64, 128, 256) for G in (1, 2, 4)])
        for B, G in BG:
            cells.append(("decode_csa", Hh, B, G, dict(kind="csa", ctx_rows=4096, sel=512, indep=True)))
        for ctx in ((65536,) if quick else (65536, 1 << 20)):
            cells.append((f"decode_hca_{ctx // 1024}K", Hh, 64, 2, dict(kind="hca", ctx_rows=ctx // 128, sel=0)))
        cells.append(("prefill", Hh, 4096, 1, None))
    return cells


def main_wg(a, ctx, peak):
    """mma.sync vs wgmma kernel on the same inputs, plan group_rows 1 (s_q rows per request
    are independent rows: the window rows of a request's s_q queries are shared positions, the
    selected lists are independent)."""
    rows = []
    for suite, Hh, n, G, kw in wg_grid(a.quick):
        c = prefill_case(n, Hh) if kw is None else decode_case(n, Hh, G=G, plan_G=1, **kw)
        T = c["q"].shape[0]
        g = torch.Generator(device="cuda").manual_seed(n)
        c["sink"] = torch.randn(Hh, device="cuda", generator=g)
        c["scale"] = 1.0 / math.sqrt(512)
        K = c["idx"].shape[1] + c["eidx"].shape[1]
        plan = A.sparse_attention_plan(T, Hh, K)
        flops = 4 * 512 * Hh * valid_keys(c)
        r = dict(suite=suite, H=Hh, B_or_T=n, s_q=G if kw is not None else None, T=T, K=K, splits=plan.num_splits)
        for name, v in (("mma", "0"), ("wg", "1")):
            os.environ["DEEPFUSE_SPARSE_DECODE"] = v
            t = H.time_fn(lambda: call(c, plan=plan), reps=20)
            r[f"{name}_us"] = t.median_us
            r[f"{name}_frac"] = flops / t.s / 1e12 / peak
        ang = torch.rand(T, 32, device="cuda") * 6.28
        inv = (torch.cos(ang), torch.sin(ang))
        tm = H.time_fn(lambda: call(c, "mxfp8", inv, plan=plan), reps=20)
        r["wg_TFLOPs"] = flops / (r["wg_us"] * 1e-6) / 1e12
        r["wg_mx_cost"] = tm.median_us / r["wg_us"] - 1
        tg = H.time_graph(lambda: call(c, plan=plan)) if T * Hh <= 64 * 128 * 2 else None
        r["wg_graph_us"] = tg.median_us if tg else None
        r["speedup"] = r["mma_us"] / r["wg_us"]
        r["series"] = f"{suite} H={Hh}"
        os.environ.pop("DEEPFUSE_SPARSE_DECODE", None)
        rows.append(r)
        print(f"{suite:16s} H={Hh:<3d} n={n:<5d} s_q={r['s_q']} splits={plan.num_splits:<3d} mma {r['mma_us']:9.1f} us "
              f"({r['mma_frac']:5.1%})  wgmma {r['wg_us']:9.1f} us ({r['wg_frac']:5.1%}, {r['wg_TFLOPs']:.0f} TFLOP/s)"
              f"  x{r['speedup']:.2f}  graph {r['wg_graph_us'] or float('nan'):7.1f} us  mxfp8 {r['wg_mx_cost']:+.1%}",
              flush=True)
        del c
        torch.cuda.empty_cache()
    H.print_table(rows, [("suite", "{}"), ("H", "{}"), ("B_or_T", "{}"), ("s_q", "{}"), ("splits", "{}"),
                         ("mma_us", "{:.1f}"), ("wg_us", "{:.1f}"), ("speedup", "{:.2f}"), ("wg_TFLOPs", "{:.0f}"),
                         ("wg_frac", "{:.3f}"), ("wg_graph_us", "{:.1f}"), ("wg_mx_cost", "{:+.3f}")])
    path = H.save(a.out, "attention_wg", ctx, rows)
    print("saved", path)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-eager", action="store_true")
    ap.add_argument("--wg", action="store_true", help="mma.sync vs wgmma kernel comparison (see the module doc)")
    a = ap.parse_args(argv)
    ctx = H.Context.create()
    peak = bf16_peak_tflops()
    ctx.extra["bf16_peak_tflops"] = peak
    print(ctx.header() + f" | bf16 matmul 8192^3 {peak:.0f} TFLOP/s")
    if a.wg:
        return main_wg(a, ctx, peak)
    rows = []
    for suite, Hh, n, kw in grid(a.quick):
        if kw is None:
            c = prefill_case(n, Hh)
            T = n
        else:
            c = decode_case(n, Hh, **kw)
            T = c["q"].shape[0]
        g = torch.Generator(device="cuda").manual_seed(n)
        c["sink"] = torch.randn(Hh, device="cuda", generator=g)
        c["scale"] = 1.0 / math.sqrt(512)
        K = c["idx"].shape[1] + c["eidx"].shape[1]
        plan = A.sparse_attention_plan(T, Hh, K, rows_per_request=c["G"], share=True)
        nk = valid_keys(c)
        nf = fetched_rows(c)
        flops = 4 * 512 * Hh * nk
        t = H.time_fn(lambda: call(c, plan=plan))
        ang = torch.rand(T, 32, device="cuda") * 6.28
        inv = (torch.cos(ang), torch.sin(ang))
        tm = H.time_fn(lambda: call(c, "mxfp8", inv, plan=plan))

        def unfused():
            o, _ = call(c, plan=plan)
            o = ops.rope(o, inv[0], inv[1], inverse=True)
            return ops.mxfp8_cast(o.view(T, Hh * 512))

        tu = H.time_fn(unfused, reps=10)
        tg = H.time_graph(lambda: call(c, plan=plan)) if T * Hh <= 64 * 128 * 2 else None
        te, te_rows = None, T
        if not a.no_eager:
            # the fp32 eager path is slow: prefill is timed on its first 1024 rows, scaled by T / 1024
            cc = c if kw is not None else {**c, "q": c["q"][:1024], "idx": c["idx"][:1024],
                                           "eidx": c["eidx"][:1024], "elen": c["elen"][:1024]}
            te_rows = cc["q"].shape[0]
            te = H.time_fn(lambda: eager(cc), warmup=1, reps=3)
            te = H.Timing(te.median_us * T / te_rows, te.p10_us * T / te_rows, te.p90_us * T / te_rows)
        tf = flops / t.s / 1e12
        frac = tf / peak
        target = 0.60 if suite == "prefill" else ((0.55 if Hh == 128 else 0.45) if n >= 64 and "G1" not in suite
                                                  and "indep" not in suite else None)
        r = dict(suite=suite, H=Hh, B_or_T=n, T=T, K=K, G=c["G"], splits=plan.num_splits, us=t.median_us,
                 p10_us=t.p10_us, p90_us=t.p90_us, graph_us=tg.median_us if tg else None, TFLOPs=tf, peak_frac=frac,
                 target=target, ok=(("yes" if frac >= target else "NO") if target else None),
                 kv_GBps=nf * 584 / t.s / 1e9, keys_per_row=nk / T, fetched_rows=nf,
                 eager_us=te.median_us if te else None, eager_rows_timed=te_rows, speedup=(te.median_us / t.median_us) if te else None,
                 mx_us=tm.median_us, mx_cost=tm.median_us / t.median_us - 1, unfused_us=tu.median_us,
                 series=f"{suite} H={Hh}")
        rows.append(r)
        print(f"{suite:16s} H={Hh:<3d} {('T' if kw is None else 'B')}={n:<6d} splits={plan.num_splits:<3d} "
              f"{t.median_us:9.1f} us  {tf:6.1f} TFLOP/s ({frac:5.1%})  KV {r['kv_GBps']:7.1f} GB/s  "
              f"graph {r['graph_us'] or float('nan'):7.1f} us  x{r['speedup'] or float('nan'):6.1f} eager  "
              f"mxfp8 {r['mx_cost']:+6.1%} (unfused {tu.median_us:8.1f} us)", flush=True)
        del c
        torch.cuda.empty_cache()
    H.print_table(rows, [("suite", "{}"), ("H", "{}"), ("B_or_T", "{}"), ("splits", "{}"), ("us", "{:.1f}"),
                         ("graph_us", "{:.1f}"), ("TFLOPs", "{:.1f}"), ("peak_frac", "{:.3f}"), ("target", "{}"),
                         ("ok", "{}"), ("kv_GBps", "{:.0f}"), ("speedup", "{:.1f}"), ("mx_cost", "{:+.3f}"),
                         ("unfused_us", "{:.1f}")])
    path = H.save(a.out, "attention", ctx, rows)
    H.plot(a.out, "attention", ctx, rows, x="B_or_T", ys=["peak_frac"], ylabel="fraction of bf16 peak",
           group="series")
    print("saved", path)


if __name__ == "__main__":
    main()
