"""One model over several GPUs of a node (or several CPU processes): one process per rank.

    llm = LLM("/path/to/DeepSeek-V4-Flash", device="cuda", tensor_parallel_size=4)  # expert_parallel=True
    llm.generate(...); llm.shutdown()

Rank 0 is the calling process: it owns the engine (scheduler, sampler, requests). Ranks
1..N-1 are child processes (`python -m deepfuse.engine._rank`) that hold the same CacheManager and follow: every step rank 0
broadcasts the step's host arrays (token ids, per-request starts / counts / slots / logits
rows, and the block-table entries written since the last step, so that every rank's cache
holds the same pages) over a gloo group on the CPU; each rank builds the same StepContext
and runs the same forward_step, whose collectives (models/parallel.py: all-reduces after
attention and MoE, the vocab-parallel embedding and head) run on the default group:
NCCL on GPUs (rank r on cuda:r), gloo on the CPU. Rank 0 samples from the gathered logits.

The broadcast lives in the runner (ModelRunner.peers: Leader here, Follower on the other
ranks): rank 0's prepare sends the arrays, every other rank runs ModelRunner.follow_step
on them. Speculative decoding: sampling, acceptance and drafting decisions stay on rank 0;
the MTP layer's inputs that only rank 0 knows (the emitted tokens, each chained draft) are
broadcast on the model group, and every rank runs the same MTP forwards. Each rank reads
only its part of the checkpoint (models.load(..., parallel=...)).
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import datetime
import os
import pickle
import socket
import subprocess
import sys
import time
import weakref
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from .cache import CacheManager, default_total_tokens
from .engine import Engine, EngineConfig
from .model_runner import host_arrays

# the lent multi-GPU machines require NVLink multicast off; set wherever ranks start
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
STOP, STEP = 0, 1
_MAX_ARRAYS = 8


log = logging.getLogger("deepfuse.engine.distributed")

def set_env() -> None:
    os.environ.update(ENV)


def backend_for(device) -> str:
    """The model collectives' backend: NCCL for CUDA devices, gloo for the CPU."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def rank_device(device, rank: int) -> torch.device:
    d = torch.device(device)
    return torch.device("cuda", rank) if d.type == "cuda" else torch.device("cpu")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- the step broadcast
class StepChannel:
    """Rank 0 -> every rank: a command and up to 8 int64 host arrays, over a gloo group (two
    broadcasts: a fixed header with the sizes, then the arrays packed in one buffer)."""

    def __init__(self, group):
        self.group = group

    def send(self, cmd: int, arrays=()) -> None:
        arrays = [np.asarray(a, dtype=np.int64).reshape(-1) for a in arrays]
        if len(arrays) > _MAX_ARRAYS:
            raise ValueError(f"deepfuse: StepChannel carries at most {_MAX_ARRAYS} arrays")
        header = torch.zeros(2 + _MAX_ARRAYS, dtype=torch.int64)
        header[0], header[1] = cmd, len(arrays)
        for i, a in enumerate(arrays):
            header[2 + i] = a.size
        dist.broadcast(header, 0, group=self.group)
        if sum(a.size for a in arrays):
            dist.broadcast(torch.from_numpy(np.concatenate(arrays)), 0, group=self.group)

    def recv(self) -> tuple[int, list[np.ndarray]]:
        header = torch.empty(2 + _MAX_ARRAYS, dtype=torch.int64)
        dist.broadcast(header, 0, group=self.group)
        cmd, n = int(header[0]), int(header[1])
        sizes = header[2:2 + n].tolist()
        buf = torch.empty(sum(sizes), dtype=torch.int64)
        if buf.numel():
            dist.broadcast(buf, 0, group=self.group)
        flat, out, o = buf.numpy(), [], 0
        for k in sizes:
            out.append(flat[o:o + k])
            o += k
        return cmd, out


def step_arrays(chunks) -> tuple[np.ndarray, ...]:
    """(ids, starts, counts, slots, num_logits): the host arrays the step context is built
    from (ModelRunner.prepare's own; tensor parallel runs without overlap, so no row of them
    waits for a token still on the device)."""
    return host_arrays(chunks)[:5]


def apply_table_updates(cache: CacheManager, updates: np.ndarray) -> None:
    """Write rank 0's block-table entries (ratio, slot, column, page) into this rank's cache."""
    a = np.asarray(updates, dtype=np.int64).reshape(-1, 4)
    if not len(a):
        return
    for r, table in cache.host_block_tables.items():
        m = a[a[:, 0] == r]
        table[m[:, 1], m[:, 2]] = m[:, 3]
    cache._pending.extend(map(tuple, a.tolist()))
    cache.flush()


class Leader:
    """Rank 0's side of the step broadcast (ModelRunner's `peers`): each step's host arrays
    with the block-table entries written since the last step (the cache's journal) over the
    channel, and the device tensors only rank 0 computes (the MTP layer's inputs) on the
    model group."""

    def __init__(self, channel: StepChannel, group):
        self.channel, self.group, self.cache = channel, group, None

    def attach(self, cache: CacheManager) -> None:
        """The cache whose block-table entries the other ranks must write too."""
        self.cache = cache
        cache.journal = []

    def send_step(self, b) -> None:
        upd = np.asarray(self.cache.journal, dtype=np.int64).reshape(-1)
        self.cache.journal.clear()
        self.channel.send(STEP, [b.ids, b.starts, b.counts, b.slots, b.num_logits, b.draft_slots, upd])

    def share(self, t: torch.Tensor) -> torch.Tensor:
        dist.broadcast(t, 0, group=self.group)
        return t


class Follower:
    """A rank > 0's `peers`: receives what Leader.share sends."""

    def __init__(self, group):
        self.group = group

    def share(self, t: torch.Tensor) -> torch.Tensor:
        dist.broadcast(t, 0, group=self.group)
        return t


@torch.no_grad()
def follow(engine: Engine, channel: StepChannel) -> int:
    """A rank > 0: run rank 0's steps until it says stop -> the number of steps run."""
    runner = engine.runner
    runner.peers = Follower(engine.model.parallel.group)
    n = 0
    while True:
        cmd, arrays = channel.recv()
        if cmd == STOP:
            return n
        if cmd != STEP:
            raise RuntimeError(f"deepfuse: unknown step command {cmd}")
        apply_table_updates(engine.cache, arrays[6])
        runner.follow_step(arrays)
        n += 1


def agree_config(model, config: EngineConfig, group) -> EngineConfig:
    """The same cache on every rank: max_total_tokens = the smallest any rank would pick."""
    cfg = model.cfg
    max_len = config.max_model_len or cfg.max_position_embeddings
    total = config.max_total_tokens or default_total_tokens(cfg, config.kv_dtype, model.dtype, model.device,
                                                            config.max_num_seqs, max_len)
    t = torch.tensor([total], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return dataclasses.replace(config, max_total_tokens=int(t))


# ----------------------------------------------------------------------------- processes
def init_rank(rank: int, world: int, port: int, device, timeout_s: float, join_timeout_s: float = 300.0):
    """Join the process group (the model collectives' default group) -> the StepChannel."""
    set_env()
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    # the rendezvous (a TCP store on rank 0's host) waits for the ranks to start (imports,
    # CUDA init) longer than a collective may take
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=join_timeout_s))
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=world, timeout=timeout)
    # the followers wait on the channel for as long as rank 0 is idle (a server between
    # requests): no timeout there; a vanished rank 0 ends them through _watch_parent
    return StepChannel(dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365)))


def load_rank(path: str, device, dtype, pc):
    from deepfuse import models

    return models.load(path, device=device, dtype=dtype, parallel=pc)


def _worker(rank: int, world: int, port: int, path: str, device: str, dtype, config: EngineConfig,
            expert_parallel: bool, timeout_s: float, threads: Optional[int]) -> None:
    from deepfuse.models.parallel import ParallelConfig

    set_env()
    _watch_parent()
    if threads:
        torch.set_num_threads(threads)
    dev = rank_device(device, rank)
    channel = init_rank(rank, world, port, dev, timeout_s)
    try:
        model = load_rank(path, dev, dtype, ParallelConfig(world, rank, expert_parallel))
        engine = Engine(model, dataclasses.replace(agree_config(model, config, channel.group), overlap=False,
                                                   enable_prefix_caching=False))
        follow(engine, channel)
    finally:
        dist.destroy_process_group()


def _watch_parent(period_s: float = 1.0) -> None:
    """End this rank when rank 0's process is gone (killed without shutdown()): a follower
    would otherwise wait on the channel (no timeout) for ever."""
    import threading

    parent = os.getppid()

    def watch():
        while True:
            time.sleep(period_s)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="deepfuse-parent-watch", daemon=True).start()


class RankGroup:
    """Rank 0's handle on the follower processes (LLM.shutdown() ends them)."""

    def __init__(self, procs, channel: StepChannel):
        self.procs, self.channel, self.closed = procs, channel, False

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self.alive():
                self.channel.send(STOP)
        finally:
            _end(self.procs, timeout_s)
            if dist.is_initialized():
                dist.destroy_process_group()


def _end(procs, timeout_s: float) -> None:
    for p in procs:
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            p.terminate()
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _spawn(args: tuple) -> subprocess.Popen:
    """A follower rank: `python -m deepfuse.engine._rank` reading its arguments (pickled) from
    stdin (a fresh interpreter: no __main__ guard needed in the caller's script)."""
    p = subprocess.Popen([sys.executable, "-m", "deepfuse.engine._rank"], stdin=subprocess.PIPE,
                         env={**os.environ, **ENV})
    p.stdin.write(pickle.dumps(args))
    p.stdin.close()
    return p


def launch(model, device, dtype, config: EngineConfig, tensor_parallel_size: int, expert_parallel: bool = True,
           timeout_s: float = 600.0, threads: Optional[int] = None):
    """Start ranks 1..N-1, join as rank 0 -> (rank 0's model part, its DistEngine, RankGroup).
    model: a checkpoint directory or "tiny" (every rank loads its own part). threads: torch
    CPU threads per follower (default: the cores / N)."""
    from deepfuse import models
    from deepfuse.models.parallel import ParallelConfig, check

    N = tensor_parallel_size
    if isinstance(N, bool) or not isinstance(N, int) or N < 1:
        raise ValueError(f"deepfuse: tensor_parallel_size must be an int >= 1, got {N!r}")
    if not isinstance(model, (str, Path)):
        raise ValueError("deepfuse: tensor_parallel_size > 1 needs a checkpoint directory or 'tiny' (each rank "
                         f"loads its own part), got a {type(model).__name__}")
    device = torch.device(device or "cpu")
    if device.type == "cuda" and torch.cuda.device_count() < N:
        raise ValueError(f"deepfuse: tensor_parallel_size {N} needs {N} GPUs, this node has "
                         f"{torch.cuda.device_count()}")
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    path = str(models.tiny.path() if model == "tiny" else Path(model))
    check(models.V4Config.from_json(path), ParallelConfig(N, 0, expert_parallel))
    set_env()
    port = free_port()
    threads = threads or max(1, (os.cpu_count() or 1) // N)
    procs = [_spawn((r, N, port, path, device.type, dtype, config, expert_parallel, timeout_s, threads))
             for r in range(1, N)]
    group = None
    try:
        dev = rank_device(device, 0)
        channel = init_rank(0, N, port, dev, timeout_s)
        group = RankGroup(procs, channel)
        rank_model = load_rank(path, dev, dtype, ParallelConfig(N, 0, expert_parallel))
        cfg = agree_config(rank_model, config, channel.group)
        if cfg.overlap or cfg.enable_prefix_caching:
            log.warning("deepfuse: tensor parallel runs without overlap and prefix caching for now")
        engine = Engine(rank_model, cfg, peers=Leader(channel, rank_model.parallel.group))
    except BaseException:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        _end(procs, 5)
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    ref = weakref.ref(group)
    atexit.register(lambda: ref() is not None and ref().shutdown())
    return rank_model, engine, group


__all__ = ["launch", "Leader", "StepChannel", "follow", "step_arrays", "backend_for", "ENV", "set_env"]
