"""Runs every microbenchmark: python -m microbench.run --out DIR [--only NAME ...]."""
from __future__ import annotations

import argparse
import importlib
import sys
import traceback

BENCHES = [
    "bench_cast",
    "bench_block_cast",
    "bench_topk",
    "bench_kvcache",
    "bench_attention",
    "bench_moe",
    "bench_linear",
    "bench_engram",
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    a = ap.parse_args(argv)
    failed = []
    for name in BENCHES:
        if a.only and name not in a.only and name.removeprefix("bench_") not in a.only:
            continue
        print(f"\n==== {name}", flush=True)
        try:
            mod = importlib.import_module(f"microbench.{name}")
            mod.main(["--out", a.out] + (["--quick"] if a.quick else []))
        except Exception:
            traceback.print_exc()
            failed.append(name)
    if failed:
        print("FAILED:", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
