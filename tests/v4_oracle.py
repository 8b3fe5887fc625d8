"""Test helpers: tiny random DeepSeek V4 checkpoints written by the transformers oracle
(DeepseekV4ForCausalLM.save_pretrained) and comparison utilities."""
from __future__ import annotations

import json
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tiny models' ops are too small to gain from intra-op threads, and spinning threads
    slow them down badly on a busy machine: run these modules with one thread."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


YARN = {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1}

# Small shapes; index_n_heads = 8 keeps exact ties between ReLU index scores (all heads
# negative -> score 0) rare, so the top-k selection does not depend on tie breaking.
BASE = dict(vocab_size=96, hidden_size=32, moe_intermediate_size=16, num_attention_heads=4, head_dim=32,
            q_lora_rank=16, num_experts_per_tok=2, n_routed_experts=6, qk_rope_head_dim=8, o_groups=2,
            o_lora_rank=8, index_n_heads=8, index_head_dim=16, rope_scaling=YARN, eos_token_id=None,
            bos_token_id=None, pad_token_id=None)

# every layer type, hash + routed MoE, hc 2 and 4, windows and top-k well below the lengths
CONFIGS = {
    "hc2": dict(BASE, num_hidden_layers=3, compress_ratios=[0, 4, 128], num_hash_layers=1, sliding_window=8,
                index_topk=4, hc_mult=2),
    "hc4": dict(BASE, num_hidden_layers=4, compress_ratios=[128, 4, 0, 4], num_hash_layers=2, sliding_window=16,
                index_topk=6, hc_mult=4, num_attention_heads=8, o_groups=4, hc_sinkhorn_iters=7),
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def randomize(model, seed: int = 0) -> None:
    """Replace the oracle's (mostly zero / one) init by O(1) random values everywhere."""
    g = torch.Generator().manual_seed(seed)
    E = model.config.n_routed_experts
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in name:
                continue
            if name.endswith("tid2eid"):
                V, k = p.shape
                p.copy_(torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(V)]))
            elif p.dim() == 1 and ("norm" in name or name.endswith("scale")):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
            else:  # sinks, bases, biases, positional biases
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def oracle(name_or_kw, seed: int = 0):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    kw = CONFIGS[name_or_kw] if isinstance(name_or_kw, str) else name_or_kw
    torch.manual_seed(seed)
    m = DeepseekV4ForCausalLM(DeepseekV4Config(**kw)).eval()
    randomize(m, seed)
    return m


def oracle_checkpoint(tmp: Path, name: str, seed: int = 0):
    """(oracle model, directory it saved itself to)."""
    m = oracle(name, seed)
    path = Path(tmp) / f"oracle-{name}"
    m.save_pretrained(path)
    return m, path


def load_ours(path, **kw):
    from deepfuse import models

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*mtp.*")
        return models.load(path, **kw)


def ids(B: int, T: int, vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def write_checkpoint(path: Path, tensors: dict, config: dict, shards: int = 1) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    names = sorted(tensors)
    if shards == 1:
        save_file({k: tensors[k].contiguous() for k in names}, str(path / "model.safetensors"))
        return path
    per = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i * per:(i + 1) * per]
        save_file({k: tensors[k].contiguous() for k in part}, str(path / fname))
        weight_map.update(dict.fromkeys(part, fname))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def _canonical_topk(self, k, dim=-1, largest=True, sorted=True):
    v, i = torch.sort(self, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((v.narrow(dim, 0, k), i.narrow(dim, 0, k)))


@contextmanager
def canonical_ties():
    """Inside: transformers' V4 indexer picks, among equal scores, the lower entry index (as
    deepfuse.ops.topk does). Its Tensor.topk choice among ties depends on the tensor's shape:
    with few index heads many scores are exactly 0 (every head's ReLU is 0) and the oracle's
    full forward and generate() then select different entries."""
    old = torch.Tensor.topk
    torch.Tensor.topk = _canonical_topk
    try:
        yield
    finally:
        torch.Tensor.topk = old
