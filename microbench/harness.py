"""Shared timing harness for the microbenchmarks.

Timing: CUDA events around each call, L2 flushed before each call (a 256 MiB memset) and
a GPU sleep queued before the start event so host overhead stays outside the span; a
warm-up, then the median (and p10/p90) of many calls. `time_eager` gives the host-side
cost per eager call (Python + launch) for small shapes. `time_graph` also times calls
captured in one CUDA graph (launch gaps amortised, L2 not flushed) for small shapes.
Ceiling: a large device-to-device copy measured in the same run (bytes read + written).
Results: JSON with GPU name, date, commit and software versions; a PNG plot per kernel.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import statistics
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch


def _commit() -> str:
    env = os.environ.get("DEEPFUSE_COMMIT")
    if env:
        return env
    try:
        root = Path(__file__).resolve().parent.parent
        return subprocess.check_output(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
                                       stderr=subprocess.DEVNULL, text=True).strip()
    except Exception:
        return "unknown"


_FLUSH: torch.Tensor | None = None
_SLEEP_CYCLES = 400_000  # ~200 us at 2 GHz


def flush_l2() -> None:
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    _FLUSH.zero_()


@dataclass
class Timing:
    median_us: float
    p10_us: float
    p90_us: float

    @property
    def s(self) -> float:
        return self.median_us * 1e-6


def time_fn(fn: Callable[[], object], *, warmup: int = 5, reps: int = 30, flush: bool = True) -> Timing:
    """Median time of fn() with events; L2 flushed before every call (outside the timed span)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        if flush:
            flush_l2()
        # Keep the GPU busy while the host enqueues fn(): the span is GPU time, not Python.
        torch.cuda._sleep(_SLEEP_CYCLES)
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    ts = sorted(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))
    return Timing(statistics.median(ts), ts[len(ts) // 10], ts[(len(ts) * 9) // 10])


def time_eager(fn: Callable[[], object], *, calls: int = 200) -> float:
    """Host wall time per call of back-to-back eager calls (launch + Python overhead), in us."""
    import time

    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


def replay_times_ms(graph, reps: int) -> list[float]:
    """CUDA-event time of each of `reps` replays of a captured graph, in ms."""
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return ts


def time_graph(fn: Callable[[], object], *, calls: int = 20, reps: int = 20) -> Timing:
    """Per-call time of `calls` back-to-back fn() captured in one CUDA graph (L2 warm)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    ts = sorted(t * 1e3 / calls for t in replay_times_ms(g, reps))
    return Timing(statistics.median(ts), ts[len(ts) // 10], ts[(len(ts) * 9) // 10])


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + written) for an nbytes buffer."""
    n = max(nbytes // 2, 1 << 12)
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), warmup=3, reps=20, flush=nbytes < (1 << 30))
    return 2 * n / t.s


@dataclass
class Context:
    gpu: str
    date: str
    commit: str
    torch: str
    cuda: str
    sm_count: int
    copy_tbps: float  # large-copy ceiling measured in this run
    extra: dict = field(default_factory=dict)

    @staticmethod
    def create() -> "Context":
        p = torch.cuda.get_device_properties(0)
        return Context(
            gpu=p.name,
            date=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            commit=_commit(),
            torch=torch.__version__,
            cuda=str(torch.version.cuda),
            sm_count=p.multi_processor_count,
            copy_tbps=copy_bandwidth() / 1e12,
        )

    def header(self) -> str:
        return (f"# {self.gpu} | {self.date} | commit {self.commit} | torch {self.torch} | "
                f"copy ceiling {self.copy_tbps:.2f} TB/s")


def start(argv=None, extra: Callable | None = None):
    """Common command line (--out DIR, --quick, plus `extra(parser)`), then the run's Context
    (measures the copy ceiling) with its header printed. -> (args, ctx)"""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    if extra is not None:
        extra(ap)
    args = ap.parse_args(argv)
    ctx = Context.create()
    print(ctx.header())
    return args, ctx


def print_table(rows: list[dict], columns: list[tuple[str, str]]) -> None:
    """columns: (key, format) pairs, e.g. ("us", "{:.1f}")."""
    heads = [k for k, _ in columns]
    cells = [[(f.format(r[k]) if r.get(k) is not None else "-") for k, f in columns] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(heads)]
    print("  ".join(h.rjust(w) for h, w in zip(heads, widths)))
    for c in cells:
        print("  ".join(x.rjust(w) for x, w in zip(c, widths)))


def save(out_dir: str | os.PathLike, name: str, ctx: Context, rows: list[dict]) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps({"kernel": name, "context": asdict(ctx), "rows": rows}, indent=1))
    return path


def plot(out_dir: str | os.PathLike, name: str, ctx: Context, rows: list[dict], *, x: str,
         ys: list[str], ylabel: str, group: str | None = None, logx: bool = True,
         hline: float | None = None, hline_label: str = "") -> Path | None:
    """One PNG: ys against x, one line per (y, group value)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    groups = sorted({r.get(group) for r in rows}, key=str) if group else [None]
    for y in ys:
        for gv in groups:
            pts = [(r[x], r[y]) for r in rows if (group is None or r.get(group) == gv) and r.get(y) is not None]
            if pts:
                xs, vs = zip(*pts)
                ax.plot(xs, vs, marker="o", label=f"{y}" + (f" {group}={gv}" if group else ""))
    if hline is not None:
        ax.axhline(hline, color="k", ls="--", lw=1, label=hline_label)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(x)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{name}\n{ctx.gpu}, {ctx.date}, {ctx.commit}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(out_dir) / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
