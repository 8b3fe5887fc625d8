"""Host time of one engine decode step on the CPU (the tiny model, padded graph steps run
eagerly, overlap on): the step's wall time minus the time inside the model's compute (the
fused step, the target / MTP / chain forwards and the padded context expansion, which a
graph replay does on the GPU, and every argmax: the sampler's greedy draw is a kernel there).
Prints mean host ms per step and cProfile's top functions (of the host work only: the
profiler is off inside the compute).

    PYTHONPATH=python:tests .venv/bin/python tools/probes/host_step_profile.py --batches 1 8 --spec 0 3
"""
from __future__ import annotations

import argparse
import cProfile
import functools
import pstats
import time

import numpy as np
import torch

from deepfuse import models
from deepfuse.engine import LLM, SamplingParams
from deepfuse.engine import context as ctx_mod
from deepfuse.engine import graph_runner as gr_mod

_compute = {"s": 0.0, "depth": 0, "prof": None}


def _timed(fn):
    @functools.wraps(fn)
    def w(*a, **kw):
        prof = _compute["prof"] if _compute["depth"] == 0 else None
        if prof is not None:  # the profile shows host work only
            prof.disable()
        _compute["depth"] += 1
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            _compute["depth"] -= 1
            if _compute["depth"] == 0:
                _compute["s"] += time.perf_counter() - t0
            if prof is not None:
                prof.enable()
    return w


def _instrument(model):
    """Count the model's compute (what a replay runs on the GPU) as device time."""
    model.forward_step = _timed(model.forward_step)
    model.mtp_forward_step = _timed(model.mtp_forward_step)
    gr_mod.GraphRunner._fused = _timed(gr_mod.GraphRunner._fused)
    gr_mod.GraphRunner._chain_fn = _timed(gr_mod.GraphRunner._chain_fn)
    gr_mod.device_context = _timed(ctx_mod.device_context)
    torch.Tensor.argmax = _timed(torch.Tensor.argmax)  # the sampler's greedy draw: a kernel on the GPU


def run(model, B: int, k: int, steps: int, acc: float, profile: bool, top: int):
    kw = dict(num_speculative_tokens=k) if k else {}
    if k and acc:
        kw["spec_simulate_acc_len"] = acc
    llm = LLM(model, max_num_seqs=max(B, 1), max_total_tokens=B * 4096 + 512, cuda_graphs=True, overlap=True, **kw)
    eng = llm.engine
    eng.runner.graphs.buckets = tuple(b for b in (1, 2, 4, 8, 16, 32) if b >= B)[:1] or (B,)
    rng = np.random.default_rng(0)
    for i in range(B):
        eng.add_request(f"r{i}", rng.integers(1, model.cfg.vocab_size, 16).tolist(),
                        SamplingParams(max_tokens=4 * (steps + 20) * (k + 1), ignore_eos=True, temperature=0.0))
    for _ in range(10):  # prefill and the first decode steps (buffers built)
        eng.step()
    _compute["s"] = 0.0
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    _compute["prof"] = prof
    if prof:
        prof.enable()
    for _ in range(steps):
        eng.step()
    if prof:
        prof.disable()
    _compute["prof"] = None
    wall = time.perf_counter() - t0
    host = (wall - _compute["s"]) / steps * 1e3
    print(f"B={B} k={k}: step {wall / steps * 1e3:.3f} ms, compute {_compute['s'] / steps * 1e3:.3f} ms, "
          f"host {host:.3f} ms/step (fused steps {eng.runner.fused_steps}){' [profiled]' if prof else ''}")
    if prof:
        st = pstats.Stats(prof)
        st.sort_stats("tottime").print_stats(top)
        st.sort_stats("cumulative").print_stats(top)
    return host


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--spec", type=int, nargs="+", default=[0, 3])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--acc", type=float, default=3.25, help="simulated acceptance length (k > 0; 0: real drafts)")
    p.add_argument("--profile", action="store_true", help="cProfile one more run of each case")
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args()
    torch.set_num_threads(1)
    model = models.tiny.load()
    _instrument(model)
    for k in a.spec:
        for B in a.batches:
            with torch.no_grad():
                run(model, B, k, a.steps, min(a.acc, k + 1), False, a.top)
                if a.profile:
                    run(model, B, k, a.steps, min(a.acc, k + 1), True, a.top)


if __name__ == "__main__":
    main()
