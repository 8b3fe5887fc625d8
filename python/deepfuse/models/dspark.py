"""DSpark drafting for the V4.1 graph (models/v41.py's draft stages mtp.<i>); docs/notes/v41.md.

DSpark (DeepSeek-V4.1 release, inference/model.py: DSparkAttention, DSparkBlock.forward_embed /
forward_head; vLLM deepseek_v41/nvidia/dspark.py; SGLang's DSpark worker) drafts a whole block
in one forward of the draft stages:

- Target features: for each of dspark_target_layer_ids, the streams ENTERING that target layer
  averaged over the hc streams; concatenated -> main_hidden [*, len(targets) * d]. Stage 0 maps
  them to main_x = main_norm(main_proj(main_hidden)).
- Context: every stage keeps a sliding window of context rows kv_norm(wkv(main_x)) with RoPE at
  the position of the target token they came from (its own wkv, the same main_x).
- Block: ids [anchor, noise, ..., noise] (dspark_block_size of them; the anchor is the newest
  token, not yet run by the target, at position a) at positions a .. a + S - 1, embedded with
  the target's embedding, copied to the hc streams; each stage is a V4.1 block (shifted
  mHC pre-mix, the first stage collapsing with the one-hot pre) whose attention lets every
  block query read the context rows at positions [a - window, a) plus ALL S block rows
  (non-causal); q without a per-head norm as in V4.1's attention.
- Head: the streams collapse with the last stage's FFN pre-mix (no hc head), base logits
  head(norm(h)) with the target's head. Left to right, draft i (1-based) is drawn from
  base[i - 1] + markov_head.head(markov_head.embed(previous token)) (the previous token of
  draft 1 is the anchor); greedy: argmax. Confidence of draft i:
  sigmoid(confidence_head.proj([h[i - 1], markov embedding of its previous token])), fp32.
- Verification length per request (SGLang's rule): the number of leading drafts whose
  confidence is >= threshold (mode "prefix"), or whose running product of confidences is
  (mode "survival": the estimated probability that the whole prefix survives), clamped to
  [min_len, max_len]. The target verifies the anchor plus that many drafts; acceptance stays
  exact (the longest matching prefix plus the target's bonus token).
"""
from __future__ import annotations

import contextlib
from typing import Callable, NamedTuple, Optional

import torch

from deepfuse import ops

from . import mhc
from .v41 import V41Model, first_pre, hc_collapse, hc_mixes


class DSparkDraft(NamedTuple):
    tokens: torch.Tensor       # [B, k] int64: drafts 1..k (draft 1 follows the anchor)
    logits: torch.Tensor       # [B, k, vocab] fp32: the Markov-biased logits each draft was drawn from
    confidence: torch.Tensor   # [B, k] fp32 in (0, 1): the confidence head's estimate that draft i survives
    logq: Optional[torch.Tensor] = None  # [B, k, vocab]: what propose's `sample` returned as each draw's log-probs


@contextlib.contextmanager
def capture_target_inputs(model: V41Model):
    """Within the scope, every full forward (model(ids)) and engine step (model.forward_step)
    records the streams entering each DSpark target layer: yields a dict layer -> streams
    ([B, T, n, d] from forward, [1, N, n, d] from forward_step), overwritten by each call."""
    store: dict = {}
    handles = []
    for i in model.cfg.dspark_target_layer_ids:
        layer = model.layers[i]

        def pre_hook(_mod, args, i=i):
            store[i] = args[0]

        def step(x, *rest, _i=i, _step=layer.step):
            store[_i] = x
            return _step(x, *rest)

        handles.append(layer.register_forward_pre_hook(pre_hook))
        layer.step = step
    try:
        yield store
    finally:
        for h in handles:
            h.remove()
        for i in model.cfg.dspark_target_layer_ids:
            model.layers[i].__dict__.pop("step", None)


class DSparkDrafter:
    """Block drafts from a V4.1 model's DSpark stages (module doc). Stateless: the caller keeps
    each request's context (the target features of its last `window` committed positions, or
    the per-stage rows of context_rows) and passes it to propose."""

    def __init__(self, model: V41Model):
        cfg = model.cfg
        missing = [name for name, ok in (
            ("num_nextn_predict_layers", cfg.num_nextn_predict_layers > 0 and len(model.mtp) > 0),
            ("dspark_block_size", cfg.dspark_block_size > 0),
            ("dspark_target_layer_ids", len(cfg.dspark_target_layer_ids) > 0),
            ("dspark_markov_rank", cfg.dspark_markov_rank > 0)) if not ok]
        if missing:
            raise ValueError(f"deepfuse: DSparkDrafter: the model has no DSpark head ({', '.join(missing)} unset)")
        self.model, self.cfg, self.stages = model, cfg, list(model.mtp)
        self.block_size = cfg.dspark_block_size
        self.window = cfg.sliding_window
        self.target_layers = list(cfg.dspark_target_layer_ids)

    # ------------------------------------------------------------------ target features
    def main_hidden(self, captured: dict) -> torch.Tensor:
        """Streams entering the target layers (capture_target_inputs) -> main_hidden
        [..., len(targets) * d] (the mean over the hc streams, concatenated in target order)."""
        missing = [i for i in self.target_layers if i not in captured]
        if missing:
            raise ValueError(f"deepfuse: DSparkDrafter.main_hidden: captured lacks target layers {missing}")
        return torch.cat([captured[i].mean(-2) for i in self.target_layers], dim=-1)

    def context_rows(self, main_hidden: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        """main_hidden [B, C, len(targets) * d] of the target tokens at positions [B, C] ->
        per stage the context rows [B, C, head_dim] (normed, RoPE at their positions)."""
        m = self.model
        width = len(self.target_layers) * self.cfg.hidden_size
        if main_hidden.dim() != 3 or main_hidden.shape[-1] != width:
            raise ValueError(f"deepfuse: DSparkDrafter: main_hidden must be [B, C, {width}], got "
                             f"{list(main_hidden.shape)}")
        if positions.shape != main_hidden.shape[:2]:
            raise ValueError(f"deepfuse: DSparkDrafter: positions must be {list(main_hidden.shape[:2])}, got "
                             f"{list(positions.shape)}")
        s0 = self.stages[0]
        with self._scope():
            main_x = s0.main_norm(s0.main_proj(main_hidden.to(m.dtype)))
            cos, sin = m.ropes["main"](positions.clamp_min(0))
            return [ops.norm_rope(st.attn.wkv(main_x), st.attn.kv_norm.weight, st.attn.kv_norm.eps, cos, sin)
                    for st in self.stages]

    # ------------------------------------------------------------------ drafting
    def propose(self, anchor: torch.Tensor, anchor_pos: torch.Tensor, rows: list[torch.Tensor],
                row_pos: torch.Tensor, k: Optional[int] = None, temperature: float = 0.0,
                generator: Optional[torch.Generator] = None, sample: Optional[Callable] = None) -> DSparkDraft:
        """One draft forward: anchor [B] (the newest token, at anchor_pos [B]), the context rows
        of context_rows (per stage [B, C, head_dim]) at row_pos [B, C] (-1: no row; rows
        outside [anchor_pos - window, anchor_pos) are not read) -> k <= dspark_block_size
        drafts (default all). temperature 0: greedy; else Gumbel-max draws from the biased
        logits / temperature (generator). sample(i, logits [B, vocab] fp32) -> (tokens [B],
        log-probs [B, vocab] or None), if given, draws draft i + 1 instead (the engine's sampler:
        the request's temperature and filters, its noise stream); temperature is then unused."""
        m, cfg = self.model, self.cfg
        S = self.block_size
        k = S if k is None else k
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= S:
            raise ValueError(f"deepfuse: DSparkDrafter.propose: k must be an int in [1, {S}], got {k!r}")
        if anchor.dim() != 1 or anchor_pos.shape != anchor.shape:
            raise ValueError(f"deepfuse: DSparkDrafter.propose: anchor and anchor_pos must be [B], got "
                             f"{list(anchor.shape)} and {list(anchor_pos.shape)}")
        if len(rows) != len(self.stages):
            raise ValueError(f"deepfuse: DSparkDrafter.propose: rows must hold {len(self.stages)} stages, got "
                             f"{len(rows)}")
        B = anchor.shape[0]
        if row_pos.dim() != 2 or row_pos.shape[0] != B or any(r.shape[:2] != row_pos.shape for r in rows):
            raise ValueError(f"deepfuse: DSparkDrafter.propose: row_pos must be [{B}, C] matching every stage's "
                             f"rows, got {list(row_pos.shape)}")
        if not temperature >= 0:
            raise ValueError(f"deepfuse: DSparkDrafter.propose: temperature must be >= 0, got {temperature!r}")
        m._check_ids(anchor[:, None])
        with self._scope():
            return self._propose(anchor, anchor_pos, rows, row_pos, k, temperature, generator, sample)

    def _propose(self, anchor, anchor_pos, rows, row_pos, k, temperature, generator, sample) -> DSparkDraft:
        hid, base = self.block(anchor, anchor_pos, rows, row_pos, k)
        return self.head(hid, base, anchor, k, temperature, generator, sample)

    def block(self, anchor: torch.Tensor, anchor_pos: torch.Tensor, rows: list[torch.Tensor], row_pos: torch.Tensor,
              k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft stages' forward of propose (no validation, no host read: a CUDA graph may
        capture it) -> (hid [B, k, d]: the collapsed streams of block rows 0..k-1 before the
        norm, base [B, k, vocab] fp32: head(norm(hid)))."""
        m, cfg = self.model, self.cfg
        S, B = self.block_size, anchor.shape[0]
        dev = anchor.device
        C = row_pos.shape[1]
        a = anchor_pos.to(dev, torch.int64)[:, None]
        rp = row_pos.to(dev, torch.int64)
        visible = (rp >= 0) & (rp < a) & (rp >= a - self.window)
        ctx_idx = torch.where(visible, torch.arange(C, device=dev).expand(B, C), torch.full_like(rp, -1))
        blk_idx = (C + torch.arange(S, device=dev)).expand(B, S)
        idx = torch.cat([ctx_idx, blk_idx], dim=1)[:, None, :].expand(B, S, C + S).contiguous()

        ids = torch.full((B, S), cfg.dspark_noise_token_id, dtype=torch.int64, device=dev)
        ids[:, 0] = anchor
        cos, sin = m.ropes["main"](a + torch.arange(S, device=dev))
        x = mhc.expand(m.embed(ids).to(m.dtype), cfg)
        pre = first_pre(x)
        for st, ctx in zip(self.stages, rows):
            attn_pre, post, comb = hc_mixes(x, st.hc_attn_fn, st.hc_attn_scale, st.hc_attn_base, cfg)
            h = self._attend(st.attn, st.attn_norm(hc_collapse(x, pre)), cos, sin, ctx, idx)
            x = ops.hc_post(h, x, post, comb)
            pre, post, comb = hc_mixes(x, st.hc_ffn_fn, st.hc_ffn_scale, st.hc_ffn_base, cfg)
            h = st.ffn(st.ffn_norm(hc_collapse(x, attn_pre)), None)
            x = ops.hc_post(h, x, post, comb)

        last = self.stages[-1]
        hid = hc_collapse(x, pre)[:, :k]                                   # [B, k, d], before the norm
        return hid, m.head(last.norm(hid)).float()

    def head(self, hid: torch.Tensor, base: torch.Tensor, anchor: torch.Tensor, k: int, temperature: float = 0.0,
             generator: Optional[torch.Generator] = None, sample: Optional[Callable] = None,
             keep_logits: bool = True) -> DSparkDraft:
        """The Markov head's left-to-right draws and the confidences of propose from block's
        (hid, base) (greedy without sample and temperature: no host read, capturable);
        keep_logits False: DSparkDraft.logits is None."""
        last = self.stages[-1]
        markov = last.markov_head
        prev = anchor.to(torch.int64)
        toks, logits, embs, logqs = [], [], [], []
        for i in range(k):
            e = markov.embed(prev)
            li = base[:, i] + markov.head(e).float()
            if sample is not None:
                prev, lq = sample(i, li)
                logqs.append(lq)
            elif temperature == 0:
                prev = li.argmax(-1)
            else:
                p = torch.softmax(li / temperature, dim=-1)
                noise = torch.empty_like(p).exponential_(1, generator=generator)
                prev = (p / noise).argmax(-1)
            toks.append(prev)
            if keep_logits:
                logits.append(li)
            embs.append(e)
        feats = torch.cat([hid, torch.stack(embs, 1).to(hid.dtype)], dim=-1).float()
        conf = torch.sigmoid(torch.nn.functional.linear(feats, last.confidence_head.proj.dense_weight(torch.float32)))
        logq = torch.stack(logqs, 1) if logqs and logqs[0] is not None else None
        return DSparkDraft(torch.stack(toks, 1), torch.stack(logits, 1) if keep_logits else None, conf.squeeze(-1),
                           logq)

    def draft(self, anchor: torch.Tensor, anchor_pos: torch.Tensor, main_hidden: torch.Tensor,
              positions: torch.Tensor, **kw) -> DSparkDraft:
        """context_rows + propose in one call (main_hidden [B, C, len(targets) * d] at positions [B, C])."""
        return self.propose(anchor, anchor_pos, self.context_rows(main_hidden, positions), positions, **kw)

    def _scope(self):
        """On CUDA, the references the model allows (V41Model: all ops, models/references.py)."""
        if self.model.device.type == "cuda" and getattr(self.model, "allow_reference", False):
            return ops.allow_reference()
        return contextlib.nullcontext()

    @staticmethod
    def _attend(attn, x, cos, sin, ctx, idx):
        """The draft stage's attention: x [B, S, d] (attn_norm-ed) over the context rows ctx
        [B, C, D] and the block's own rows, indices idx [B, S, C + S] -> [B, S, d]."""
        qr = attn.q_norm(attn.wq_a(x))
        q = ops.rope(attn.wq_b(qr).unflatten(-1, (attn.n_heads, attn.head_dim)), cos, sin)
        kv = ops.norm_rope(attn.wkv(x), attn.kv_norm.weight, attn.kv_norm.eps, cos, sin)
        o = ops.sparse_attention(q, torch.cat([ctx.to(kv.dtype), kv], dim=1), idx, attn.attn_sink,
                                 attn.head_dim ** -0.5)
        return attn._out(ops.rope(o, cos, sin, inverse=True))


def verify_lengths(confidence: torch.Tensor, threshold: float, min_len: int = 0, max_len: Optional[int] = None,
                   mode: str = "prefix") -> torch.Tensor:
    """Per request, how many drafts to verify: confidence [B, k] (DSparkDraft.confidence) ->
    [B] int64 in [min_len, max_len] (max_len default k). mode "prefix": the leading drafts whose
    confidence is >= threshold; "survival": the leading drafts whose running product of
    confidences is >= threshold."""
    if confidence.dim() != 2:
        raise ValueError(f"deepfuse: verify_lengths: confidence must be [B, k], got {list(confidence.shape)}")
    k = confidence.shape[1]
    max_len = k if max_len is None else max_len
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"deepfuse: verify_lengths: threshold must be in [0, 1], got {threshold!r}")
    if not 0 <= min_len <= max_len <= k:
        raise ValueError(f"deepfuse: verify_lengths: need 0 <= min_len <= max_len <= {k}, got min_len={min_len}, "
                         f"max_len={max_len}")
    if mode == "prefix":
        score = confidence.float()
    elif mode == "survival":
        score = confidence.float().cumprod(dim=1)
    else:
        raise ValueError(f"deepfuse: verify_lengths: mode must be 'prefix' or 'survival', got {mode!r}")
    n = (score >= threshold).to(torch.int64).cumprod(dim=1).sum(dim=1)
    return n.clamp(min_len, max_len)
