"""Markdown tables from microbenchmark JSON files (one section per kernel, with GPU, date,
commit and the copy ceiling of that run).

    python tools/build/results_md.py RESULTS_DIR [--skip KEY ...] > section.md
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

SKIP = {"p10_us", "p90_us", "MB", "series"}


def fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def section(path: Path, skip: set[str]) -> str:
    d = json.loads(path.read_text())
    c = d["context"]
    rows = d["rows"]
    keys = [k for k in rows[0] if k not in skip] if rows else []
    for r in rows[1:]:
        keys += [k for k in r if k not in keys and k not in skip]
    out = [f"### {d['kernel']}", "",
           f"{c['gpu']}, {c['date']}, commit {c['commit']}, torch {c['torch']}, "
           f"copy ceiling {c['copy_tbps']:.2f} TB/s (measured in the same run)", "",
           "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    out += ["| " + " | ".join(fmt(r.get(k)) for k in keys) + " |" for r in rows]
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--skip", nargs="*", default=[])
    a = ap.parse_args()
    for p in sorted(Path(a.dir).glob("*.json")):
        print(section(p, SKIP | set(a.skip)))


if __name__ == "__main__":
    main()
