"""Randomised stress run of deepfuse.ops.topk on the GPU: keeps going after a failure and
prints every failing case (shape, input kind, lengths, plan, what broke, first bad row).

    python tests/ops/stress_topk.py [--seconds 60] [--seed 0] [--max-elems 20000000]

Exit status 1 if any case failed. Uses the checker of tests/ops/test_topk.py.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_topk as TT  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-elems", type=int, default=20_000_000)
    a = ap.parse_args(argv)
    rng = random.Random(a.seed)
    t0 = time.time()
    n = 0
    fails = []
    while time.time() - t0 < a.seconds:
        dtype = rng.choice(TT.DTYPES)
        N = rng.choice([rng.randint(1, 600), rng.randint(600, 20000), rng.randint(20000, 300000),
                        rng.choice([8192, 32768, 131072, 129280, 262144]), rng.randint(300000, 1_200_000),
                        8 * rng.randint(1, 2048)])  # aligned short rows: the short-row kernel
        B = rng.choice([1, 2, 3, rng.randint(1, 40), 64, 128, rng.randint(100, 600)])
        B = max(1, min(B, a.max_elems // max(N, 1)))
        k = rng.choice([1, 2, rng.randint(1, 64), 50, 512, 1024, 2048, 4096, rng.randint(1, 4096), min(4096, N),
                        min(4096, N + 1), max(1, min(4096, N - 1))])
        kind = rng.choice(TT.KINDS)
        kw = dict(kind=kind, use_lengths=rng.random() < 0.4, sorted_=rng.random() < 0.25,
                  return_values=rng.random() < 0.8, index_dtype=rng.choice([torch.int32, torch.int64]),
                  seed=rng.randint(0, 1 << 30))
        try:
            TT.run_case(dtype, B, N, k, **kw)
        except Exception as e:  # noqa: BLE001
            msg = str(e).splitlines()[0] if str(e) else traceback.format_exc(limit=2)
            fails.append(msg)
            print(f"FAIL #{len(fails)}: dtype={dtype} B={B} N={N} k={k} {kw}\n    {msg}", flush=True)
            if isinstance(e, RuntimeError) and "CUDA" in str(e):
                break  # a sticky CUDA error: later cases cannot run
        n += 1
    print(f"stress_topk: {n} cases in {time.time() - t0:.0f} s, {len(fails)} failed")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
