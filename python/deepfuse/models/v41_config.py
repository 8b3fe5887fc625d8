"""Typed DeepSeek V4.1 configuration, read from a checkpoint's config.json.

Accepts the released transformers-style file (model_type "deepseek_v41", the text model
under text_config, quantization_config at the top) and the flat reference file
(inference/config.json: dim, n_layers, kv_source_layers, norm_eps, ...). What V4.1 adds to
V4 (docs/notes/v41.md has the sources):
- compress_ratios per layer (0 = sliding window only, 1 = one compressed row per token,
  2 = one per two tokens; one trailing entry per draft layer). Only kv_source_layer_ids
  compress (no overlap, no positional bias) and produce indexer keys; every compressed layer
  reads the compressed rows of the nearest kv source at or before it.
- index_source_layer_ids run an indexer; every compressed layer reuses the selection of the
  nearest index source at or before it. candidate_source_layer_id additionally keeps the
  best candidate_topk_blocks blocks of candidate_block_size compressed rows, to which the
  later index sources restrict their own selection.
- Engram at engram_layer_ids; no hash-routed MoE layers; no learned hc head (the last
  FFN's pre-mix collapses the streams).
- DSpark draft layers (num_nextn_predict_layers of them, sliding window, their own expert
  bank of dspark_n_routed_experts / dspark_num_experts_per_tok).

V41Config subclasses V4Config so the shared modules (MoE, mHC slots, RoPE tables) read it;
the V4 layer_types it must carry map ratio 2 -> CSA and ratio 1 -> HCA with compress_rates
{CSA: 2, HCA: 1}: a bookkeeping alias only; `ratios` is what the V4.1 graph reads.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from .config import CSA, HCA, SWA, ConfigError, RopeParams, V4Config, _rope_params


@dataclass
class V41Config(V4Config):
    ratios: list[int] = field(default_factory=list)
    mtp_ratios: list[int] = field(default_factory=list)
    kv_source_layers: list[int] = field(default_factory=list)
    index_source_layers: list[int] = field(default_factory=list)
    candidate_source_layer: int = -1
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    # Engram
    engram_layer_ids: list[int] = field(default_factory=list)
    engram_num_embeddings: list[int] = field(default_factory=list)
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 0
    engram_n_heads: int = 0
    engram_head_dim: int = 0
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 0
    # DSpark draft layers
    dspark_block_size: int = 0
    dspark_noise_token_id: int = 0
    dspark_target_layer_ids: list[int] = field(default_factory=list)
    dspark_markov_rank: int = 0
    dspark_n_routed_experts: int = 0
    dspark_num_experts_per_tok: int = 0
    norm_topk_prob: bool = True
    weight_block_size: int = 32
    # serving choice, not in config.json: where the Engram tables live ("device" or "host":
    # host memory, page-locked when CUDA is present)
    engram_placement: str = "device"

    # ------------------------------------------------------------------ derived
    def kv_source_for(self, i: int) -> Optional[int]:
        """The kv source whose compressed rows (and indexer keys) layer i reads."""
        if i >= len(self.ratios) or not self.ratios[i]:
            return None
        s = [j for j in self.kv_source_layers if j <= i]
        return max(s) if s else None

    def index_source_for(self, i: int) -> Optional[int]:
        """The index source whose selection layer i uses."""
        if i >= len(self.ratios) or not self.ratios[i]:
            return None
        s = [j for j in self.index_source_layers if j <= i]
        return max(s) if s else None

    def uses_candidates(self, i: int) -> bool:
        return 0 <= self.candidate_source_layer < i and i in self.index_source_layers

    @property
    def engram_cols(self) -> int:
        """Hashed rows per token per Engram layer: (max n-gram - 1) * heads."""
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    def draft_moe(self) -> "V41Config":
        """The config the draft layers' MoE reads (their own expert bank)."""
        return dataclasses.replace(self, n_routed_experts=self.dspark_n_routed_experts or self.n_routed_experts,
                                   num_experts_per_tok=self.dspark_num_experts_per_tok or self.num_experts_per_tok)

    # ------------------------------------------------------------------ validation
    def validate(self) -> "V41Config":
        super().validate()

        def need(cond, msg):
            if not cond:
                raise ConfigError(f"deepfuse: V4.1 config: {msg}")

        n = self.num_hidden_layers
        need(len(self.ratios) == n, f"compress_ratios has {len(self.ratios)} backbone entries, expected {n}")
        need(all(isinstance(r, int) and r >= 0 for r in self.ratios),
             f"compress_ratios must be ints >= 0: {self.ratios}")
        need(all(r == 0 for r in self.mtp_ratios), f"draft layers must be sliding-window (ratio 0): {self.mtp_ratios}")
        # layer references: each entry an int naming a compressed backbone layer, in increasing order
        for fname, ids in (("kv_source_layer_ids", self.kv_source_layers),
                           ("index_source_layer_ids", self.index_source_layers)):
            need(isinstance(ids, (list, tuple)), f"{fname} must be a list of layer ids, got {ids!r}")
            for j in ids:
                need(isinstance(j, int) and not isinstance(j, bool) and 0 <= j < n,
                     f"{fname} entry {j!r} is not a backbone layer id in [0, {n})")
                need(self.ratios[j] > 0, f"{fname} entry {j} names layer {j}, which has compress_ratios[{j}] = 0 "
                                         "(a sliding-window layer has no compressed KV)")
            need(list(ids) == sorted(set(ids)), f"{fname} must be increasing without repeats, got {list(ids)}")
        c = self.candidate_source_layer
        need(isinstance(c, int) and not isinstance(c, bool) and -1 <= c < n,
             f"candidate_source_layer_id {c!r} is not -1 (none) or a backbone layer id in [0, {n})")
        need(set(self.kv_source_layers) <= set(self.index_source_layers),
             f"every kv source must be an index source (it produces the indexer keys): kv_source_layer_ids "
             f"{self.kv_source_layers} vs index_source_layer_ids {self.index_source_layers}")
        for i, r in enumerate(self.ratios):
            if not r:
                continue
            kv, ix = self.kv_source_for(i), self.index_source_for(i)
            need(kv is not None, f"layer {i} (ratio {r}) has no kv source at or before it (kv_source_layer_ids "
                                 f"{list(self.kv_source_layers)})")
            need(self.ratios[kv] == r, f"layer {i} (ratio {r}) reads kv source layer {kv} of ratio {self.ratios[kv]} "
                                       f"(kv_source_layer_ids {list(self.kv_source_layers)})")
            need(ix is not None, f"layer {i} (ratio {r}) has no index source at or before it (index_source_layer_ids "
                                 f"{list(self.index_source_layers)})")
            need(self.kv_source_for(ix) == kv,
                 f"layer {i}: its index source {ix} (index_source_layer_ids) must read the same kv source ({kv}; "
                 f"kv_source_layer_ids)")
        if self.candidate_source_layer >= 0:
            need(self.candidate_source_layer in self.index_source_layers,
                 f"candidate_source_layer_id {self.candidate_source_layer} must be an index source "
                 f"(index_source_layer_ids {list(self.index_source_layers)})")
            need(self.candidate_topk_blocks > 0 and self.candidate_block_size > 0,
                 "candidate_topk_blocks and candidate_block_size must be > 0")
        L = len(self.engram_layer_ids)
        need(len(self.engram_num_embeddings) == L,
             f"engram_num_embeddings has {len(self.engram_num_embeddings)} entries for {L} Engram layers")
        if L:
            need(all(0 <= i < n for i in self.engram_layer_ids),
                 f"engram_layer_ids out of range: {self.engram_layer_ids}")
            need(self.engram_max_ngram_size >= 2 and self.engram_n_heads > 0,
                 "engram_max_ngram_size must be >= 2 and engram_n_heads > 0")
            need(self.engram_head_dim > 0 and self.engram_head_dim % 32 == 0,
                 f"engram_head_dim must be a positive multiple of 32, got {self.engram_head_dim}")
            need(self.engram_compressed_vocab_size > 0, "engram_compressed_vocab_size must be > 0")
        need(self.engram_placement in ("device", "host"),
             f"engram_placement must be 'device' or 'host', got {self.engram_placement!r}")
        need(all(0 <= i < n for i in self.dspark_target_layer_ids),
             f"dspark_target_layer_ids out of range [0, {n}): {self.dspark_target_layer_ids}")
        return self

    # ------------------------------------------------------------------ I/O
    @classmethod
    def from_dict(cls, d: dict) -> "V41Config":
        top = dict(d)
        text = dict(top.get("text_config") or top)
        mt = top.get("model_type")
        if mt is not None and mt != "deepseek_v41":
            raise ConfigError(f"deepfuse: config.json has model_type {mt!r}; expected 'deepseek_v41'")

        def get(*keys, default=None):
            for k in keys:
                for src in (text, top):
                    if src.get(k) is not None:
                        return src[k]
            return default

        c = cls()
        simple = {
            "vocab_size": ("vocab_size",), "hidden_size": ("hidden_size", "dim"),
            "num_hidden_layers": ("num_hidden_layers", "n_layers"),
            "num_attention_heads": ("num_attention_heads", "n_heads"), "head_dim": ("head_dim",),
            "rope_head_dim": ("qk_rope_head_dim", "rope_head_dim"), "q_lora_rank": ("q_lora_rank",),
            "o_groups": ("o_groups",), "o_lora_rank": ("o_lora_rank",),
            "sliding_window": ("sliding_window", "window_size"),
            "n_routed_experts": ("n_routed_experts",),
            "num_experts_per_tok": ("num_experts_per_tok", "n_activated_experts"),
            "moe_intermediate_size": ("moe_intermediate_size", "moe_inter_dim"),
            "n_shared_experts": ("n_shared_experts",), "scoring_func": ("scoring_func", "score_func"),
            "routed_scaling_factor": ("routed_scaling_factor", "route_scale"), "swiglu_limit": ("swiglu_limit",),
            "index_n_heads": ("index_n_heads",), "index_head_dim": ("index_head_dim",), "index_topk": ("index_topk",),
            "hc_mult": ("hc_mult",), "hc_sinkhorn_iters": ("hc_sinkhorn_iters",), "hc_eps": ("hc_eps",),
            "rms_norm_eps": ("rms_norm_eps", "norm_eps"),
            "num_nextn_predict_layers": ("num_nextn_predict_layers", "n_mtp_layers"),
            "max_position_embeddings": ("max_position_embeddings", "max_seq_len"),
            "bos_token_id": ("bos_token_id",), "eos_token_id": ("eos_token_id",),
            "tie_word_embeddings": ("tie_word_embeddings",), "quantization_config": ("quantization_config",),
            "kv_source_layers": ("kv_source_layer_ids", "kv_source_layers"),
            "index_source_layers": ("index_source_layer_ids", "index_source_layers"),
            "candidate_source_layer": ("candidate_source_layer_id", "candidate_source_layer"),
            "candidate_topk_blocks": ("candidate_topk_blocks",), "candidate_block_size": ("candidate_block_size",),
            "engram_layer_ids": ("engram_layer_ids",), "engram_num_embeddings": ("engram_num_embeddings",),
            "engram_max_ngram_size": ("engram_max_ngram_size",), "engram_vocab_size": ("engram_vocab_size",),
            "engram_n_heads": ("engram_n_heads",), "engram_head_dim": ("engram_head_dim",),
            "engram_pad_token_id": ("engram_pad_token_id", "engram_pad_id"),
            "engram_compressed_vocab_size": ("engram_compressed_vocab_size",),
            "dspark_block_size": ("dspark_block_size",), "dspark_noise_token_id": ("dspark_noise_token_id",),
            "dspark_target_layer_ids": ("dspark_target_layer_ids",), "dspark_markov_rank": ("dspark_markov_rank",),
            "dspark_n_routed_experts": ("dspark_n_routed_experts",),
            "dspark_num_experts_per_tok": ("dspark_num_experts_per_tok", "dspark_n_activated_experts"),
            "norm_topk_prob": ("norm_topk_prob",),
        }
        for name, keys in simple.items():
            v = get(*keys)
            if v is not None:
                setattr(c, name, list(v) if isinstance(v, (list, tuple)) else v)
        if c.num_hidden_layers is None:
            raise ConfigError("deepfuse: V4.1 config: num_hidden_layers is missing")
        n, n_mtp = c.num_hidden_layers, c.num_nextn_predict_layers
        ratios = get("compress_ratios")
        if ratios is None:
            raise ConfigError("deepfuse: V4.1 config: compress_ratios is missing")
        ratios = [int(r) for r in ratios]
        if len(ratios) < n:
            raise ConfigError(f"deepfuse: V4.1 config: compress_ratios has {len(ratios)} entries for {n} layers")
        c.ratios = ratios[:n]
        c.mtp_ratios = [ratios[n + i] if n + i < len(ratios) else 0 for i in range(n_mtp)]
        # V4 bookkeeping (see module doc)
        c.compress_rates = {CSA: 2, HCA: 1}
        alias = {0: SWA, 1: HCA, 2: CSA}
        c.layer_types = [alias.get(r, CSA) for r in c.ratios]
        c.mtp_layer_types = [SWA] * n_mtp
        if get("num_hash_layers", default=0):
            raise ConfigError("deepfuse: V4.1 config: num_hash_layers must be 0 (V4.1 has no hash-routed MoE)")
        c.mlp_layer_types = ["moe"] * n
        quant = c.quantization_config or {}
        block = quant.get("weight_block_size") if isinstance(quant, dict) else None
        c.weight_block_size = int(block[0]) if block else 32
        # RoPE: plain for sliding-window layers, YaRN at compress_rope_theta for compressed ones
        rope_theta = float(get("rope_theta", default=10000.0))
        compress_theta = float(get("compress_rope_theta", default=160000.0))
        scaling = get("rope_scaling", "rope_parameters")
        if not isinstance(scaling, dict) and get("rope_factor") is not None:
            scaling = {"rope_type": "yarn", "factor": get("rope_factor"),
                       "original_max_position_embeddings": get("original_seq_len"),
                       "beta_fast": get("beta_fast"), "beta_slow": get("beta_slow")}
        c.rope_main = RopeParams(rope_theta)
        c.rope_compress = _rope_params({**(scaling or {}), "rope_theta": compress_theta}, compress_theta, "compress")
        return c.validate()


def is_v41(d: dict) -> bool:
    """Whether a config.json dict describes a V4.1 model."""
    return d.get("model_type") == "deepseek_v41" or "kv_source_layer_ids" in (d.get("text_config") or d) \
        or "kv_source_layers" in d
