"""DSpark drafting in the engine (DeepSeek V4.1; models/dspark.py, docs/notes/v41.md).

Per step, after the target's forward and the verification (ModelRunner.finish), DSparkRunner.draft:
1. writes the context rows of every position the step commits into the request's rings
   (engine/dspark_rings.py: held by V41CacheManager): the target features are the streams
   entering the DSpark target layers, recorded during the forward (capture(); the launch
   hook), so a prefill chunk writes all its positions and a verify chunk the anchor plus its
   accepted drafts (the bonus token is the next anchor; it gets its row when the target runs it);
2. for every chunk that drafts (a draft slot), proposes k drafts from the anchor (the token
   the step emitted last, at position num_computed) over its ring in one forward of the draft
   stages; draft j is drawn with the engine's sampler from the Markov-biased logits (greedy:
   argmax; sampled: the request's temperature and filters on its DRAFT noise stream at the
   draft's position), so its q is exact for Sampler.verify;
3. per request L = verify_lengths(confidence, threshold): the engine verifies [anchor,
   d_1..d_L] next step (Engine._hand_drafts caps the drafts it hands out at the read-back
   "verify_len"; ragged L is ragged chunk counts in the flat batch). The decision to verify
   draft j depends on the anchor and d_1..d_{j-1} only (the confidence of draft j reads the
   Markov embedding of the token before it), so acceptance stays exact.

CUDA graphs (EngineConfig.cuda_graphs; GraphRunner built with features=this runner): a uniform
decode / verify step's target graph also computes the context rows of all its (padded) rows
from the target features captured inside it (forward_with_rows; GraphRunner keeps them as
_Graph.feats), and the drafting itself replays a graph per request bucket (_DraftGraph: ring
gather, the draft stages' block forward, the greedy Markov head, the confidences and the
verification lengths; static inputs anchor / position / slot). Eager target steps (prefill
chunks, ragged verification lengths) compute their context rows eagerly and draft through the
same graphs. Sampled requests: the graph's block forward (hid, base logits) is used and the
Markov head draws with the engine's sampler outside it (as the MTP chain samples between its
graph replays). On the CPU the padded static steps run eagerly (tests of the padding).
Overlap: the overlapped loop runs DSpark steps on its plain path (the accepted tokens and
verification lengths are read back before the next step is scheduled; early verify launches
need device-side lengths and stay off, as for every V4.1 model). Method choice:
EngineConfig.spec_method None picks DSpark when the model has a DSpark head, else the MTP chain
(V4); V4.1 has no MTP layer.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import replace
from typing import Optional

import numpy as np
import torch

from deepfuse.models.dspark import DSparkDraft, DSparkDrafter, capture_target_inputs, verify_lengths

from .sampler import DRAFT, derive_seeds, to_device

log = logging.getLogger("deepfuse.engine")
METHODS = ("dspark", "mtp")


def has_dspark_head(model) -> bool:
    cfg = model.cfg
    if not getattr(cfg, "dspark_block_size", 0):
        return False
    try:
        DSparkDrafter(model)
    except ValueError:
        return False
    return True


def spec_method(model, config) -> Optional[str]:
    """The drafting method of config on model: None (no speculation), "dspark" or "mtp";
    ValueError naming the field when the model cannot run it."""
    m = config.spec_method
    if m is not None and m not in METHODS:
        raise ValueError(f"deepfuse: spec_method must be None, 'dspark' or 'mtp', got {m!r}")
    t = config.dspark_threshold
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t <= 1.0:
        raise ValueError(f"deepfuse: dspark_threshold must be a number in [0, 1], got {t!r}")
    k = config.num_speculative_tokens
    if not k:
        return None
    v41 = hasattr(model.cfg, "kv_source_layers")
    head = has_dspark_head(model)
    if m is None:
        m = "dspark" if head else "mtp"
    if m == "dspark" and not head:
        raise ValueError("deepfuse: spec_method 'dspark' needs a model with a DSpark head (dspark_block_size, "
                         "dspark_target_layer_ids, dspark_markov_rank and draft stages)")
    if m == "mtp" and v41:
        raise ValueError("deepfuse: num_speculative_tokens > 0 on a V4.1 model needs its DSpark head "
                         f"(spec_method {config.spec_method!r}): V4.1 has no MTP layer"
                         + ("" if head else "; this checkpoint has no DSpark head either"))
    if m == "dspark":
        S = model.cfg.dspark_block_size
        if k > S:
            raise ValueError(f"deepfuse: num_speculative_tokens must be <= dspark_block_size ({S}) with DSpark, "
                             f"got {k}")
        if config.swa_replay_window:
            raise ValueError("deepfuse: swa_replay_window with DSpark speculation is not supported (the DSpark "
                             "target layers would see only the replayed rows)")
    return m


def dspark_config(model, config):
    """config for an engine on model (DSpark runs with CUDA graphs and overlap as asked: unchanged)."""
    spec_method(model, config)  # (validation)
    return config


def make_dspark(model, config, cache, graphs=None) -> Optional["DSparkRunner"]:
    """The DSpark drafter of an engine (ModelRunner.dspark), or None (no speculation, or MTP).
    graphs: the engine's GraphRunner (its target graphs then compute the context rows; the
    drafts replay DSpark's own graphs)."""
    if spec_method(model, config) != "dspark":
        return None
    return DSparkRunner(model, cache, config.num_speculative_tokens, float(config.dspark_threshold), graphs)


@dataclasses.dataclass
class _DraftGraph:
    """The drafting of `bucket` requests (static inputs; graph memory outputs)."""

    anchor: torch.Tensor               # [bucket] int64
    pos: torch.Tensor                  # [bucket] int64 (anchor positions)
    slots: torch.Tensor                # [bucket] int64 ring slots (pad: 0; its outputs are dropped)
    graph: Optional["torch.cuda.CUDAGraph"]
    out: Optional[tuple] = None        # (hid, base, tokens, confidence, verify lengths)


class DSparkRunner:
    def __init__(self, model, cache, k: int, threshold: float, graphs=None):
        if getattr(cache, "dspark", None) is None:
            raise ValueError("deepfuse: DSpark drafting needs a cache with DSpark context rings (V41CacheManager "
                             "with num_draft_tokens > 0)")
        self.model, self.rings = model, cache.dspark
        self.drafter = DSparkDrafter(model)
        self.k, self.threshold = k, threshold
        self.window = self.rings.window
        self.captured: Optional[dict] = None
        self.graphs = graphs
        self.draft_graphs: dict[int, _DraftGraph] = {}
        self.graph_steps = 0  # drafting steps that replayed a draft graph
        if graphs is not None:
            graphs.features = self  # the target graphs compute the context rows (forward_with_rows)

    # ------------------------------------------------------------------ the target graphs' features
    def forward_with_rows(self, ctx, cache, return_streams: bool):
        """The target's step forward (GraphRunner: under capture, or the CPU's padded step) ->
        (its outputs, the context rows [stages, N, head_dim] of all its rows)."""
        with capture_target_inputs(self.model) as cap:
            out = self.model.forward_step(ctx, cache, return_streams=return_streams)
        mh = self.drafter.main_hidden({i: cap[i][0] for i in self.drafter.target_layers})
        rows = self.drafter.context_rows(mh[None], ctx.positions[None])
        return out, torch.stack([r[0] for r in rows])

    # ------------------------------------------------------------------ the draft graphs
    def _draft_fn(self, g: _DraftGraph):
        rows, pos = self.rings.gather(g.slots)
        hid, base = self.drafter.block(g.anchor, g.pos, rows, pos, self.k)
        d = self.drafter.head(hid, base, g.anchor, self.k, keep_logits=False)
        return hid, base, d.tokens, d.confidence, verify_lengths(d.confidence, self.threshold, max_len=self.k)

    def _build(self, bucket: int) -> _DraftGraph:
        dev = self.rings.rows.device
        z = lambda: torch.zeros(bucket, dtype=torch.int64, device=dev)  # noqa: E731
        g = _DraftGraph(z(), z(), z(), None)
        if self.graphs is not None and self.graphs.capture:
            t0 = time.perf_counter()
            if self.graphs.pool is None:
                self.graphs.pool = torch.cuda.graph_pool_handle()
            try:
                with self.drafter._scope():
                    g.graph = self.graphs._capture(lambda: self._draft_fn(g))
                g.out = self.graphs._outs
            except Exception:  # the same static step then runs eagerly (logged: a missing kernel / sync)
                log.exception("deepfuse: DSpark: capturing the draft graph of bucket %d failed; it runs eagerly",
                              bucket)
                g.graph, g.out = None, None
            self.graphs.capture_s += time.perf_counter() - t0
        return g

    def capture_all(self) -> None:
        """Capture the draft graph of every request bucket (largest first), as GraphRunner.capture_all."""
        if self.graphs is None:
            return
        for b in reversed(self.graphs.buckets):
            if b not in self.draft_graphs:
                self.draft_graphs[b] = self._build(b)

    def _propose_graph(self, anchor, apos, slots):
        """propose for B requests through the draft graph of the smallest bucket >= B ->
        (hid, base, greedy tokens, confidence, verify lengths), first B rows."""
        B = anchor.shape[0]
        bucket = next(b for b in self.graphs.buckets if b >= B)
        g = self.draft_graphs.get(bucket)
        if g is None:
            g = self.draft_graphs[bucket] = self._build(bucket)
        g.anchor[:B].copy_(anchor)
        g.pos[:B].copy_(apos)
        g.slots[:B].copy_(slots)
        g.slots[B:].zero_()
        if g.graph is not None:
            g.graph.replay()
            out = g.out
        else:
            with torch.no_grad(), self.drafter._scope():
                out = self._draft_fn(g)
        self.graph_steps += 1
        return tuple(t[:B] for t in out)

    @contextlib.contextmanager
    def capture(self):
        """Around the target's forward: records the streams entering the DSpark target layers."""
        self.captured = None
        with capture_target_inputs(self.model) as cap:
            yield
        self.captured = cap

    @torch.no_grad()
    def draft(self, runner, L, res, a: torch.Tensor, u, sb) -> None:
        """ModelRunner.finish's drafting under DSpark (module doc): the step's committed context
        rows, then res.drafts [B, k], res.draft_logq [B, k, V] (sampled requests) and the
        read-back "verify_len" [B] (0 for chunks that do not draft)."""
        b, ctx, dev = L.batch, L.ctx, runner.device
        feats = getattr(ctx.graph, "feats", None) if ctx.graph is not None else None
        if self.captured is None and feats is None:
            raise RuntimeError("deepfuse: DSpark: the step's target features were not captured")
        cap, self.captured = self.captured, None
        B, W, k = len(b.chunks), self.window, self.k
        counts, verified = b.counts.astype(np.int64), b.verified.astype(np.int64)
        cu = np.zeros(B + 1, np.int64)
        np.cumsum(counts, out=cu[1:])
        # the last W committed rows of a chunk lie in its rows j >= count - verified - W
        lo = np.maximum(counts - verified - W, 0)
        m = counts - lo
        chunk = np.repeat(np.arange(B, dtype=np.int64), m)
        j = np.arange(int(m.sum()), dtype=np.int64) - np.repeat(np.cumsum(m) - m, m) + lo[chunk]
        ds = b.draft_slots >= 0
        di = np.nonzero(ds)[0]
        up = to_device(np.concatenate([cu[chunk] + j, chunk, j, counts - verified, b.slots.astype(np.int64),
                                       b.starts.astype(np.int64), di]), torch.int64, dev)
        M = len(chunk)
        rows, ch, jj = up[:M], up[M:2 * M], up[2 * M:3 * M]
        base, slots, starts = (up[3 * M + i * B:3 * M + (i + 1) * B] for i in range(3))
        di_t = up[3 * M + 3 * B:]
        clen = base + a                                        # rows each chunk commits
        keep = (jj < clen[ch]) & (jj >= clen[ch] - W)
        if M:
            pos = ctx.positions[rows]
            if feats is not None:  # computed by the target's graph for all its rows
                ctx_rows = list(feats[:, rows])
            else:
                mh = self.drafter.main_hidden({i: cap[i][0, rows] for i in self.drafter.target_layers})
                ctx_rows = [r[0] for r in self.drafter.context_rows(mh[None], pos[None])]
            self.rings.write(ctx_rows, pos, slots[ch], keep)
        if not len(di):
            return
        ad = a[di_t]
        anchor = res.tokens[di_t, ad]
        apos = starts[di_t] + clen[di_t]                       # = num_computed after the commit
        sample = None
        if sb is not None and not sb.all_greedy:
            idx = u["first_row"][di_t]
            dsb = replace(sb, temperature=sb.temperature[idx], top_k=sb.top_k[idx], top_p=sb.top_p[idx],
                          min_p=sb.min_p[idx], seed=derive_seeds(sb.seed[idx], DRAFT), position=apos)

            def sample(i, logits):  # draft i + 1 sits at position apos + 1 + i
                bt = replace(dsb, position=apos + 1 + i)
                lq = runner.sampler.log_probs(logits, bt)
                return runner.sampler.sample_log_probs(lq, bt.seed, bt.position), lq.float()

        if self.graphs is not None:  # the draft graph (greedy head inside; sampled: the head here)
            hid, blog, toks, conf, n = self._propose_graph(anchor, apos, slots[di_t])
            if sample is None:
                out = DSparkDraft(toks, None, conf)
            else:
                with self.drafter._scope():
                    out = self.drafter.head(hid, blog, anchor, k, sample=sample, keep_logits=False)
                n = verify_lengths(out.confidence, self.threshold, max_len=k)
        else:
            ring_rows, ring_pos = self.rings.gather(slots[di_t])
            out = self.drafter.propose(anchor, apos, ring_rows, ring_pos, k=k, sample=sample)
            n = verify_lengths(out.confidence, self.threshold, max_len=k)
        drafts = torch.zeros(B, k, dtype=torch.int64, device=dev)
        drafts[di_t] = out.tokens
        vlen = torch.zeros(B, dtype=torch.int64, device=dev)
        vlen[di_t] = n
        res.drafts = drafts
        if out.logq is not None:
            lq = torch.zeros(B, k, out.logq.shape[-1], dtype=torch.float32, device=dev)
            lq[di_t] = out.logq
            res.draft_logq = lq
        runner._copy_out(res, [("verify_len", vlen)])

