"""Decoder-side SWA bounded replay in the engine (DeepSeek V4.1; APPROXIMATE by design, off by
default: EngineConfig.swa_replay_window = 0). docs/notes/v41.md "Bounded replay in the engine".

The layers after the last kv source (models.v41.replay_first_layer: 21-39 of V4.1-Flash) own
window KV only. With window K > 0 a request of prompt length P runs them only on positions
>= its floor f = max(0, P - K): prefill tokens below f stop at the cut (their early layers,
compressed rows and indexer keys are computed as always), and the late layers' window
attention reads no row below f (a late layer never wrote one there). Decode and verify
tokens run every layer (K >= the sliding window, so their windows never reach below f).
The per-request floor does not depend on how the prompt is chunked, so the engine equals
`V41Model.forward(prompt + generated, replay_window=K + generated)` for any chunking:
prefill chunks before, across and after f. Requests that want prompt logprobs run exactly
(floor 0: every prompt row gets logits). A replayed request's prefix snapshots are saved only
where their late window rows are all written (snapshot_ok: the end of the prefill, never a
mid-prefill checkpoint below f + window); a prefix hit at n <= f reads nothing below f, one
at n > f reads the snapshot's rows in [f, n), which are written.

The engine's hook (ModelRunner.prepare) calls attach(ctx, chunks) on each eager step's
context; when some request of the step has a token below its floor or a window reaching
below it, ctx.replay = StepReplay(layer, rows, narrowed context), which
V41Model.forward_step applies at the cut. Captured graphs never replay (V4.1 runs eager).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
import torch

from deepfuse.models.v41 import replay_first_layer
from deepfuse.step import StepContext, WindowPlan

from .sampler import to_device


@dataclass
class StepReplay:
    """What V41Model.forward_step reads at the cut (ctx.replay)."""

    layer: int                    # first layer that runs on the kept rows only
    rows: torch.Tensor            # [Nk] int64 flat rows of the step that the late layers run
    ctx: StepContext              # the step context of those rows (logits_indices into them)
    floors: np.ndarray            # [B] host: each request's floor (0: exact)


class ReplayPlanner:
    """Per step: which rows the late layers run and their narrowed context."""

    def __init__(self, cfg, window: int):
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(f"deepfuse: swa_replay_window must be an int >= 0 (0 = off), got {window!r}")
        if not hasattr(cfg, "kv_source_layers"):
            raise ValueError("deepfuse: swa_replay_window needs a DeepSeek V4.1 model (layers after the last kv "
                             "source); this model is not one")
        if window < cfg.sliding_window:
            raise ValueError(f"deepfuse: swa_replay_window ({window}) must be 0 or >= the sliding window "
                             f"({cfg.sliding_window}): decode tokens read the last window rows of the late layers")
        self.K = window
        self.W = cfg.sliding_window
        self.layer = replay_first_layer(cfg)
        self.steps = 0            # steps that replayed
        self.skipped_tokens = 0   # prefill tokens that stopped at the cut

    def floor(self, req) -> int:
        """The first position req's late layers run (0: the request runs exactly)."""
        if req.wants_prompt_rows:
            return 0
        return max(0, len(req.prompt_token_ids) - self.K)

    def snapshot_ok(self, req, n: int) -> bool:
        """Whether req's state at n tokens may go into the prefix cache: every late-layer window
        row it holds (positions n - W .. n - 1) was written."""
        f = self.floor(req)
        return f == 0 or n - self.W >= f

    def attach(self, ctx, chunks) -> None:
        """Set ctx.replay (None when no request of the step needs it)."""
        ctx.replay = None
        if getattr(ctx, "graph", None) is not None:
            return
        B = len(chunks)
        starts = np.asarray(ctx.starts[:B], np.int64)
        counts = np.asarray(ctx.counts[:B], np.int64)
        nl = np.asarray(ctx.num_logits[:B], np.int64)
        floors = np.fromiter((self.floor(c.req) for c in chunks), np.int64, B)
        if not ((floors > 0) & (starts < floors + self.W - 1)).any():
            return
        cu = np.zeros(B + 1, np.int64)
        np.cumsum(counts, out=cu[1:])
        N = int(cu[-1])
        token_req = np.repeat(np.arange(B, dtype=np.int64), counts)
        positions = np.arange(N, dtype=np.int64) + (starts - cu[:-1])[token_req]
        keep = positions >= floors[token_req]
        bad = (nl > 0) & (starts + counts - nl < floors)
        if bad.any():
            b = int(np.argmax(bad))
            raise RuntimeError(f"deepfuse: replay: request {chunks[b].req.request_id} wants logits below its replay "
                               f"floor {floors[b]}")
        rows = np.flatnonzero(keep)
        kc = np.bincount(token_req[rows], minlength=B).astype(np.int64)
        kcu = np.zeros(B + 1, np.int64)
        np.cumsum(kc, out=kcu[1:])
        lreq = np.repeat(np.arange(B, dtype=np.int64), nl)
        loff = np.zeros(B, np.int64)
        np.cumsum(nl[:-1], out=loff[1:])
        li = (kcu[1:] - nl)[lreq] + np.arange(len(lreq), dtype=np.int64) - loff[lreq]
        d = to_device(np.concatenate([rows, floors[token_req[rows]], li]), torch.int64, ctx.input_ids.device)
        n = len(rows)
        rows_d, floor_d, li_d = d[:n], d[n:2 * n], d[2 * n:]
        pos = ctx.positions[rows_d]
        win = ctx.window
        W = win.win_idx.shape[1]
        kpos = pos[:, None] - (W - 1) + torch.arange(W, device=pos.device)[None, :]
        window = WindowPlan(win.win_idx[rows_d].masked_fill(kpos < floor_d[:, None], -1),
                            win.scratch_slots[rows_d], win.ring_slots[rows_d])
        # late layers own no compressor: only the per-token visibility and state rows narrow
        plans = {key: replace(p, n_vis=p.n_vis[rows_d], state_slots=p.state_slots[rows_d], num_blocks=0)
                 for key, p in ctx.plans.items()}
        new_starts = np.where(kc > 0, np.maximum(starts, floors), starts + counts)
        narrowed = StepContext(n, ctx.num_reqs, ctx.input_ids[rows_d], pos, ctx.token_req[rows_d], ctx.req_slots,
                               li_d, window, plans, new_starts, kc, ctx.logits_req, ctx.num_logits)
        hist = getattr(ctx, "engram_history", None)
        if hist is not None:
            narrowed.engram_history = hist
        ctx.replay = StepReplay(self.layer, rows_d, narrowed, floors)
        self.steps += 1
        self.skipped_tokens += N - n


def make_replay(model, config) -> Optional[ReplayPlanner]:
    """The engine's planner: None when EngineConfig.swa_replay_window is 0 (off)."""
    K = getattr(config, "swa_replay_window", 0)
    if isinstance(K, int) and not isinstance(K, bool) and K == 0:
        return None
    if getattr(config, "num_speculative_tokens", 0):
        # DSpark reads the target layers' features by full-step rows; under replay the late
        # targets (37-39 of Flash) hold the kept rows only (engine/dspark_runner.py would map them)
        raise ValueError("deepfuse: swa_replay_window with num_speculative_tokens > 0 is not supported yet (DSpark "
                         "reads late-layer features of every row of a step)")
    return ReplayPlanner(model.cfg, K)


class EncoderReplay:
    """Encoder-side SWA bounded replay in the engine (APPROXIMATE; EngineConfig.swa_encoder_replay =
    Ke > 0; off by default). With it the prefix cache keeps no window rows (V41CacheManager with
    prefix_windows=False: the saved-window pages are not allocated, snapshots copy none), and a
    request restored from an entry of n tokens marks its ReqCache (replay_from = n). Before the
    step that runs the request's first chunk (ModelRunner.launch), run() re-runs its tokens
    [n - min(Ke, n), n) in a step of their own (no logits; encoder_replay_context: every layer,
    windows read nothing below the replayed start, no compressor runs), which rewrites the window
    rows the entry did not keep; the entry's compressed rows, indexer keys and open compressor
    groups are used as cached. Ke >= the all-layer dependency halo ((window - 1) * layers) would be
    exact; below it the windows of the first replayed rows are short, so outputs differ
    (docs/notes/v41.md "Encoder side in the engine" has the measured deviation)."""

    def __init__(self, model, config):
        Ke = config.swa_encoder_replay
        if isinstance(Ke, bool) or not isinstance(Ke, int) or Ke < 0:
            raise ValueError(f"deepfuse: swa_encoder_replay must be an int >= 0 (0 = off), got {Ke!r}")
        cfg = model.cfg
        if not hasattr(cfg, "kv_source_layers"):
            raise ValueError("deepfuse: swa_encoder_replay needs a DeepSeek V4.1 model; this model is not one")
        if Ke < cfg.sliding_window:
            raise ValueError(f"deepfuse: swa_encoder_replay ({Ke}) must be 0 or >= the sliding window "
                             f"({cfg.sliding_window}): the replay rebuilds the last window rows of every layer")
        if Ke > config.max_num_batched_tokens:
            raise ValueError(f"deepfuse: swa_encoder_replay ({Ke}) must be <= max_num_batched_tokens "
                             f"({config.max_num_batched_tokens}): a replay runs in one step")
        if not config.enable_prefix_caching:
            raise ValueError("deepfuse: swa_encoder_replay needs enable_prefix_caching (it replays on prefix hits)")
        if config.swa_replay_window:
            raise ValueError("deepfuse: swa_encoder_replay together with swa_replay_window is not supported")
        self.K, self.budget = Ke, config.max_num_batched_tokens
        self.steps = 0            # replay steps run
        self.replays = 0          # prefix hits replayed
        self.replayed_tokens = 0  # tokens the replays re-ran

    def run(self, runner, batch) -> None:
        """Run the replay steps of the batch's requests restored from a windowless prefix entry
        (before the batch's own forward; same stream)."""
        from .scheduler import ScheduledChunk  # (scheduler imports nothing of this module)
        todo = []
        for c in batch.chunks:
            rc = c.req.cache
            n = getattr(rc, "replay_from", None)
            if n is None:
                continue
            rc.replay_from = None
            if c.start != n:  # (not the hit's first chunk: nothing to rebuild any more)
                continue
            k = min(self.K, n)
            todo.append(ScheduledChunk(c.req, n - k, k))
        while todo:
            group, total = [], 0
            while todo and total + todo[0].count <= self.budget:
                total += todo[0].count
                group.append(todo.pop(0))
            self._step(runner, group)

    @torch.no_grad()
    def _step(self, runner, chunks) -> None:
        from .context import build_context
        from .engram_state import engram_history
        cache, dev, model = runner.cache, runner.device, runner.model
        ids = np.concatenate([np.asarray(c.req.tokens(c.start, c.start + c.count), np.int64) for c in chunks])
        B = len(chunks)
        ctx = build_context(ids, np.array([c.start for c in chunks], np.int64),
                            np.array([c.count for c in chunks], np.int64),
                            np.array([c.req.cache.slot for c in chunks], np.int64), np.zeros(B, np.int64),
                            cache.geometry, cache.block_tables, dev, cache.host_block_tables)
        hasher = getattr(model, "engram_hasher", None)
        if hasher is not None:
            ctx.engram_history = to_device(engram_history(chunks, hasher.token_map.numpy(), hasher.max_ngram),
                                           torch.int64, dev)
        encoder_replay_context(ctx)
        model.forward_step(ctx, cache)
        self.steps += 1
        self.replays += B
        self.replayed_tokens += len(ids)


def make_encoder_replay(model, config) -> Optional[EncoderReplay]:
    """The engine's encoder-side replay: None when EngineConfig.swa_encoder_replay is 0 (off)."""
    K = getattr(config, "swa_encoder_replay", 0)
    if isinstance(K, int) and not isinstance(K, bool) and K == 0:
        return None
    return EncoderReplay(model, config)


def encoder_replay_context(ctx) -> None:
    """Encoder-side SWA bounded replay (APPROXIMATE; SGLang encoder_swa_replay, vLLM PR 56227):
    turn a step context whose chunks re-run the last Ke tokens before a prefix hit of n tokens
    (chunk [n - Ke, n), num_logits 0) into the replay step that rebuilds the window rows the hit
    did not keep: every layer runs, no window reads a row before its chunk's start (the ring
    holds nothing valid there), and no compressor runs (ctx.compress = False: the hit's
    compressed rows, indexer keys and open-group states stay as cached). In place."""
    win = ctx.window
    W = win.win_idx.shape[1]
    start = torch.as_tensor(np.repeat(np.asarray(ctx.starts, np.int64), ctx.counts), device=ctx.positions.device)
    kpos = ctx.positions[:, None] - (W - 1) + torch.arange(W, device=ctx.positions.device)[None, :]
    ctx.window = WindowPlan(win.win_idx.masked_fill(kpos < start[:, None], -1), win.scratch_slots, win.ring_slots)
    ctx.compress = False
