"""Checkpoint loading: key spellings, config parsing (legacy and transformers keys) and clear
errors for bad checkpoints."""
import json
import warnings

import pytest
import torch

from v4_oracle import ids, load_ours, write_checkpoint, one_thread  # noqa: F401

from deepfuse import models
from deepfuse.models import CheckpointError, ConfigError, V4Config, tiny


@pytest.fixture(scope="module")
def good():
    return tiny.tensors(tiny.CONFIG, dtype=torch.float32)


def write(tmp_path, tensors, config=None, name="ckpt", shards=1):
    return write_checkpoint(tmp_path / name, tensors, dict(tiny.CONFIG if config is None else config), shards)


def test_prefix_and_transformers_spellings_load_identically(tmp_path, good):
    hf = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
          "hc_head_fn": "model.hc_head.hc_fn", "hc_head_base": "model.hc_head.hc_base",
          "hc_head_scale": "model.hc_head.hc_scale"}
    renamed = {}
    for k, t in good.items():
        k2 = hf.get(k, "model." + k)
        k2 = k2.replace("attn.kv_norm.weight", "attn.norm.weight")  # save_pretrained's spelling
        renamed[k2] = t
    a = load_ours(write(tmp_path, good, shards=2), dtype=torch.float32)
    b = load_ours(write(tmp_path, renamed, name="hf"), dtype=torch.float32)
    x = ids(1, 150, a.cfg.vocab_size)
    assert torch.equal(a(x), b(x))


def test_missing_tensor_is_named(tmp_path, good):
    bad = dict(good)
    del bad["layers.1.attn.indexer.wq_b.weight"]
    del bad["layers.2.ffn.experts.5.w3.weight"]
    with pytest.raises(CheckpointError, match=r"lacks 2 tensors.*layers\.1\.attn\.indexer\.wq_b\.weight.*"
                                              r"layers\.2\.ffn\.experts\.5\.w3\.weight"):
        load_ours(write(tmp_path, bad), dtype=torch.float32)


def test_misshapen_tensor_is_named(tmp_path, good):
    bad = dict(good)
    bad["layers.0.attn.wkv.weight"] = bad["layers.0.attn.wkv.weight"][:, :-1].contiguous()
    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.wkv\.weight.*shape \[512, 63\]; expected \[512, 64\]"):
        load_ours(write(tmp_path, bad), dtype=torch.float32)
    bad = dict(good)
    bad["layers.3.hc_ffn_fn"] = torch.zeros(3, 3)
    with pytest.raises(CheckpointError, match=r"layers\.3\.hc_ffn_fn.*expected \[24, 256\]"):
        load_ours(write(tmp_path, bad, name="b2"), dtype=torch.float32)


def test_fp8_weight_without_or_with_wrong_scale(tmp_path, good):
    bad = dict(good)
    w = bad["layers.0.attn.wq_a.weight"]
    bad["layers.0.attn.wq_a.weight"] = w.to(torch.float8_e4m3fn)
    with pytest.raises(CheckpointError, match=r"fp8 weight 'layers\.0\.attn\.wq_a\.weight'.*no scale tensor "
                                              r"'layers\.0\.attn\.wq_a\.scale'"):
        load_ours(write(tmp_path, bad), dtype=torch.float32)
    bad["layers.0.attn.wq_a.scale"] = torch.ones(2, 2)
    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.wq_a\.scale.*shape \[2, 2\]; expected \[1, 1\]"):
        load_ours(write(tmp_path, bad, name="b2"), dtype=torch.float32)
    bad["layers.0.attn.wq_a.weight"] = w.to(torch.int32)
    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.wq_a\.weight.*dtype torch\.int32"):
        load_ours(write(tmp_path, bad, name="b3"), dtype=torch.float32)


def test_bad_tid2eid(tmp_path, good):
    bad = dict(good)
    bad["layers.0.ffn.gate.tid2eid"] = torch.full_like(bad["layers.0.ffn.gate.tid2eid"], 8)
    with pytest.raises(CheckpointError, match=r"layers\.0\.ffn\.gate\.tid2eid.*outside \[0, 8\)"):
        load_ours(write(tmp_path, bad), dtype=torch.float32)
    bad["layers.0.ffn.gate.tid2eid"] = bad["layers.0.ffn.gate.tid2eid"].float()
    with pytest.raises(CheckpointError, match=r"tid2eid.*dtype"):
        load_ours(write(tmp_path, bad, name="b2"), dtype=torch.float32)


def test_duplicate_spellings_are_rejected(tmp_path, good):
    bad = dict(good)
    bad["model.embed_tokens.weight"] = bad["embed.weight"].clone()
    with pytest.raises(CheckpointError, match=r"'embed\.weight' appears twice"):
        load_ours(write(tmp_path, bad), dtype=torch.float32)


def test_unused_tensors_warn(tmp_path, good):
    extra = dict(good)
    extra["layers.0.attn.something_new"] = torch.zeros(3)
    with pytest.warns(UserWarning, match=r"1 checkpoint tensors are not used.*something_new"):
        models.load(write(tmp_path, extra), dtype=torch.float32)


def test_missing_files_and_bad_config(tmp_path, good):
    with pytest.raises(FileNotFoundError):
        models.load(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(tiny.CONFIG))
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        models.load(tmp_path / "empty")
    with pytest.raises(ConfigError, match="model_type 'llama'"):
        V4Config.from_dict(dict(tiny.CONFIG, model_type="llama"))
    with pytest.raises(ConfigError, match=r"o_groups"):
        V4Config.from_dict(dict(tiny.CONFIG, o_groups=3))
    with pytest.raises(ConfigError, match=r"compress_ratios has unsupported ratios \[16\]"):
        V4Config.from_dict(dict(tiny.CONFIG, compress_ratios=[0, 16, 4, 4, 0]))
    with pytest.raises(ConfigError, match=r"RoPE type 'longrope'"):
        V4Config.from_dict(dict(tiny.CONFIG, rope_scaling={"type": "longrope"}))
    with pytest.raises(ValueError, match="dtype"):
        models.load(write(tmp_path, good), dtype=torch.int8)


def test_config_official_flash_layout():
    """The official V4-Flash config.json layout: one compress_ratios entry per layer plus the
    MTP layer's, legacy num_hash_layers / qk_rope_head_dim / rope_scaling."""
    d = {"model_type": "deepseek_v4", "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 43,
         "num_attention_heads": 64, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024,
         "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128, "n_routed_experts": 256,
         "num_experts_per_tok": 6, "moe_intermediate_size": 2048, "n_shared_experts": 1,
         "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
         "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "hc_mult": 4, "hc_sinkhorn_iters": 20,
         "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "num_hash_layers": 3, "num_nextn_predict_layers": 1,
         "compress_ratios": [0, 0] + [4, 128] * 20 + [4] + [0], "rope_theta": 10000,
         "compress_rope_theta": 160000,
         "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                          "beta_fast": 32, "beta_slow": 1},
         "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                 "weight_block_size": [128, 128]}}
    c = V4Config.from_dict(d)
    assert c.compress_ratios == [0, 0] + [4, 128] * 20 + [4]
    assert c.mtp_layer_types == ["sliding_attention"]
    assert c.num_hash_layers == 3 and c.is_hash_layer(2) and not c.is_hash_layer(3)
    assert c.rope_head_dim == 64 and c.rope_main.yarn_factor is None and c.rope_main.theta == 10000
    assert (c.rope_compress.theta, c.rope_compress.yarn_factor, c.rope_compress.original_max_position_embeddings,
            c.rope_compress.attention_factor) == (160000, 16, 65536, 1.0)
    m = models.V4Model(c)  # meta tensors: no memory
    assert sum(1 for _ in m.layers) == 43 and len(m.mtp) == 1
    assert m.layers[2].attn.indexer is not None and m.layers[3].attn.indexer is None


def test_config_transformers_keys_match_legacy_keys():
    """transformers' save_pretrained writes layer_types / mlp_layer_types / nested
    rope_parameters; they parse to the same config as the legacy keys."""
    pytest.importorskip("transformers")
    from transformers import DeepseekV4Config

    legacy = dict(tiny.CONFIG)
    kw = {k: v for k, v in legacy.items() if k not in ("model_type", "architectures")}
    kw["compress_ratios"] = kw["compress_ratios"][:4]
    hf = DeepseekV4Config(**kw).to_dict()
    assert "layer_types" in hf and "compress_ratios" not in hf
    a, b = V4Config.from_dict(legacy), V4Config.from_dict(hf)
    for f in ("layer_types", "mlp_layer_types", "rope_head_dim", "rope_main", "rope_compress", "compress_rates"):
        assert getattr(a, f) == getattr(b, f), f
    # the transformers config has no MTP schedule: MTP layers default to sliding window
    assert b.mtp_layer_types == ["sliding_attention"]


def test_yarn_inv_freq_is_bit_identical_to_transformers():
    pytest.importorskip("transformers")
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    kw = {k: v for k, v in tiny.CONFIG.items() if k not in ("model_type", "architectures")}
    kw["compress_ratios"] = kw["compress_ratios"][:4]
    hf = DeepseekV4Config(**kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rot = DeepseekV4RotaryEmbedding(hf)
    c = V4Config.from_dict(tiny.CONFIG)
    assert torch.equal(c.rope_main.inv_freq(c.rope_head_dim), rot.main_inv_freq)
    assert torch.equal(c.rope_compress.inv_freq(c.rope_head_dim), rot.compress_inv_freq)
    assert rot.compress_attention_scaling == c.rope_compress.attention_factor == 1.0
