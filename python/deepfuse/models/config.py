"""Typed DeepSeek V4 configuration, read from a checkpoint's config.json.

Accepts both the transformers (>= 5.23) keys (layer_types, compress_rates, mlp_layer_types,
rope_parameters {main, compress}) and the legacy / official ones (compress_ratios with one
trailing entry per MTP layer, compress_rate_csa / _hca, num_hash_layers, qk_rope_head_dim,
rope_scaling, scoring_func, ...).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

import torch

SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SWA, CSA, HCA)
MLP_TYPES = ("hash_moe", "moe")
SCORE_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class RopeParams:
    """RoPE of one kind ("main" for sliding-window layers, "compress" for CSA/HCA layers)."""

    theta: float
    yarn_factor: Optional[float] = None  # None: plain RoPE
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0  # multiplies cos/sin; V4 uses 1 (no YaRN mscale)

    def inv_freq(self, dim: int) -> torch.Tensor:
        """[dim/2] fp32 inverse frequencies, computed as transformers does (bit-identical)."""
        base = self.theta
        pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
        if self.yarn_factor is None:
            return 1.0 / pos_freqs
        factor, orig = self.yarn_factor, self.original_max_position_embeddings

        def corr_dim(rot):
            return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

        low = max(math.floor(corr_dim(self.beta_fast)), 0)
        high = min(math.ceil(corr_dim(self.beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extra = 1 - ramp  # weight of the unscaled (extrapolated) frequency
        return (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra


@dataclass
class V4Config:
    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    layer_types: list[str] = field(default_factory=list)
    compress_rates: dict[str, int] = field(default_factory=lambda: {CSA: 4, HCA: 128})
    mlp_layer_types: list[str] = field(default_factory=list)
    # MoE
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2048
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    # lightning indexer
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    # mHC
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    # RoPE
    rope_main: RopeParams = field(default_factory=lambda: RopeParams(10000.0))
    rope_compress: RopeParams = field(default_factory=lambda: RopeParams(
        160000.0, 16.0, 65536, 32.0, 1.0, 1.0))
    # MTP
    num_nextn_predict_layers: int = 1
    mtp_layer_types: list[str] = field(default_factory=list)
    # misc
    max_position_embeddings: int = 1048576
    bos_token_id: Optional[int] = 0
    eos_token_id: Any = 1
    tie_word_embeddings: bool = False
    quantization_config: Optional[dict] = None

    # ------------------------------------------------------------------ derived
    def compress_ratio(self, layer_type: str) -> int:
        return 0 if layer_type == SWA else int(self.compress_rates[layer_type])

    @property
    def compress_ratios(self) -> list[int]:
        return [self.compress_ratio(t) for t in self.layer_types]

    def is_hash_layer(self, i: int) -> bool:
        return i < len(self.mlp_layer_types) and self.mlp_layer_types[i] == "hash_moe"

    @property
    def num_hash_layers(self) -> int:
        return sum(t == "hash_moe" for t in self.mlp_layer_types)

    # ------------------------------------------------------------------ validation
    def validate(self) -> "V4Config":
        def need(cond, msg):
            if not cond:
                raise ConfigError(f"deepfuse: V4 config: {msg}")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                     "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "n_routed_experts",
                     "num_experts_per_tok", "moe_intermediate_size", "index_n_heads", "index_head_dim",
                     "index_topk", "hc_mult", "hc_sinkhorn_iters"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, f"{name} must be a positive int, got {v!r}")
        need(self.n_shared_experts >= 0, f"n_shared_experts must be >= 0, got {self.n_shared_experts}")
        need(self.num_nextn_predict_layers >= 0, "num_nextn_predict_layers must be >= 0")
        need(0 < self.rope_head_dim <= self.head_dim and self.rope_head_dim % 2 == 0,
             f"rope_head_dim ({self.rope_head_dim}) must be even and in (0, head_dim = {self.head_dim}]")
        need(self.index_head_dim >= self.rope_head_dim,
             f"index_head_dim ({self.index_head_dim}) must be >= rope_head_dim ({self.rope_head_dim})")
        need(self.num_attention_heads % self.o_groups == 0,
             f"num_attention_heads ({self.num_attention_heads}) must be a multiple of o_groups ({self.o_groups})")
        need(self.num_experts_per_tok <= self.n_routed_experts,
             f"num_experts_per_tok ({self.num_experts_per_tok}) > n_routed_experts ({self.n_routed_experts})")
        need(self.scoring_func in SCORE_FUNCS, f"scoring_func must be one of {SCORE_FUNCS}, got {self.scoring_func!r}")
        for t, r in self.compress_rates.items():
            need(isinstance(r, int) and r > 0, f"compress rate of {t} must be a positive int, got {r!r}")
        need(CSA in self.compress_rates and HCA in self.compress_rates,
             f"compress_rates needs {CSA!r} and {HCA!r}, got {self.compress_rates}")
        for name, types, allowed, n in (("layer_types", self.layer_types, LAYER_TYPES, self.num_hidden_layers),
                                        ("mlp_layer_types", self.mlp_layer_types, MLP_TYPES, self.num_hidden_layers),
                                        ("mtp_layer_types", self.mtp_layer_types, LAYER_TYPES,
                                         self.num_nextn_predict_layers)):
            need(len(types) == n, f"{name} has {len(types)} entries, expected {n}")
            bad = [t for t in types if t not in allowed]
            need(not bad, f"{name} entries must be in {allowed}, got {bad}")
        return self

    # ------------------------------------------------------------------ I/O
    @classmethod
    def from_dict(cls, d: dict) -> "V4Config":
        d = dict(d)
        mt = d.get("model_type")
        if mt is not None and mt != "deepseek_v4":
            raise ConfigError(f"deepfuse: config.json has model_type {mt!r}; expected 'deepseek_v4'")
        c = cls()
        simple = {f.name for f in fields(cls)} - {"layer_types", "compress_rates", "mlp_layer_types",
                                                  "rope_main", "rope_compress", "mtp_layer_types", "rope_head_dim"}
        aliases = {"n_routed_experts": ("num_local_experts",), "routed_scaling_factor": ("route_scale",),
                   "sliding_window": ("window_size",), "rms_norm_eps": ("norm_eps",)}
        for name in simple:
            for key in (name,) + aliases.get(name, ()):
                if key in d and d[key] is not None:
                    setattr(c, name, d[key])
                    break
        n = c.num_hidden_layers
        # compression schedule
        rates = dict(d.get("compress_rates") or {CSA: 4, HCA: 128})
        if d.get("compress_rate_csa") is not None:
            rates[CSA] = int(d["compress_rate_csa"])
        if d.get("compress_rate_hca") is not None:
            rates[HCA] = int(d["compress_rate_hca"])
        c.compress_rates = rates
        ratio_to_type = {0: SWA, rates[CSA]: CSA, rates[HCA]: HCA}
        legacy = d.get("compress_ratios")
        legacy_types = None
        if legacy is not None:
            bad = [r for r in legacy if r not in ratio_to_type]
            if bad:
                raise ConfigError(f"deepfuse: V4 config: compress_ratios has unsupported ratios {bad} "
                                  f"(known: {sorted(ratio_to_type)})")
            legacy_types = [ratio_to_type[r] for r in legacy]
        if d.get("layer_types") is not None:
            c.layer_types = list(d["layer_types"])[:n]
        elif legacy_types is not None:
            if len(legacy_types) < n:
                raise ConfigError(f"deepfuse: V4 config: compress_ratios has {len(legacy_types)} entries for "
                                  f"{n} layers")
            c.layer_types = legacy_types[:n]
        else:  # transformers' default: two HCA layers, then CSA/HCA interleaved
            c.layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        # MTP layers: the official schedule appends their ratios (0 = sliding window)
        n_mtp = c.num_nextn_predict_layers
        tail = legacy_types[n:] if legacy_types is not None else []
        c.mtp_layer_types = [tail[i] if i < len(tail) else SWA for i in range(n_mtp)]
        # MoE schedule
        if d.get("mlp_layer_types") is not None:
            c.mlp_layer_types = list(d["mlp_layer_types"])[:n]
        else:
            nh = d.get("num_hash_layers")
            nh = 3 if nh is None else int(nh)
            c.mlp_layer_types = ["hash_moe"] * min(n, nh) + ["moe"] * max(0, n - nh)
        # RoPE
        rp = d.get("rope_parameters") or {}
        main_d = rp.get("main") if isinstance(rp.get("main"), dict) else None
        comp_d = rp.get("compress") if isinstance(rp.get("compress"), dict) else None
        partial = d.get("partial_rotary_factor")
        if d.get("qk_rope_head_dim") is not None:
            c.rope_head_dim = int(d["qk_rope_head_dim"])
        elif partial is not None:
            c.rope_head_dim = int(c.head_dim * partial)
        elif main_d is not None and main_d.get("partial_rotary_factor") is not None:
            c.rope_head_dim = int(c.head_dim * main_d["partial_rotary_factor"])
        else:
            c.rope_head_dim = min(64, c.head_dim)
        rope_theta = float(d.get("rope_theta") or 10000.0)
        compress_theta = float(d.get("compress_rope_theta") or 160000.0)
        if main_d is None or comp_d is None:
            flat = {k: v for k, v in rp.items() if k not in ("main", "compress")} if rp else {}
            if not flat and isinstance(d.get("rope_scaling"), dict):
                flat = dict(d["rope_scaling"])
            main_d = {"rope_type": "default", "rope_theta": rope_theta}
            comp_d = {**flat, "rope_theta": compress_theta}
            comp_d.setdefault("rope_type", flat.get("type", "default"))
        c.rope_main = _rope_params(main_d, rope_theta, "main")
        c.rope_compress = _rope_params(comp_d, compress_theta, "compress")
        return c.validate()

    @classmethod
    def from_json(cls, path) -> "V4Config":
        """cls.from_dict of a config.json file (or of the config.json in a folder)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"deepfuse: no config.json at {path}")
        with open(path) as f:
            return cls.from_dict(json.load(f))


def _rope_params(p: dict, default_theta: float, kind: str) -> RopeParams:
    rtype = p.get("rope_type", p.get("type", "default")) or "default"
    theta = float(p.get("rope_theta", default_theta))
    if rtype == "default":
        return RopeParams(theta)
    if rtype != "yarn":
        raise ConfigError(f"deepfuse: V4 config: {kind} RoPE type {rtype!r} is not supported (default or yarn)")
    af = p.get("attention_factor")
    return RopeParams(
        theta,
        float(p["factor"]),
        int(p["original_max_position_embeddings"]),
        float(p.get("beta_fast") or 32),
        float(p.get("beta_slow") or 1),
        # V4 does not scale cos/sin by the YaRN mscale (transformers forces 1.0 as well)
        1.0 if af is None else float(af),
    )
