"""Quantised V4 checkpoints: FP8 e4m3 block-scaled linears (UE8M0 or fp32 scales) and MXFP4
routed experts, in the released checkpoints' layout. The weight formats are checked against
transformers' own dequantiser (Fp8Dequantize), and whole tiny checkpoints against the oracle
run on a copy dequantised by that dequantiser."""
import warnings

import pytest
import torch

from v4_oracle import ids, load_ours, rel_err, write_checkpoint, one_thread  # noqa: F401

from deepfuse import ops
from deepfuse.models import tiny
from deepfuse.ops.linear import dequant_weight

pytest.importorskip("transformers")

E8M0 = torch.float8_e8m0fnu


def hf_dequant(q, s):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=torch.float32)


@pytest.mark.parametrize("scale_fmt", ["ue8m0", "fp32"])
def test_fp8_block_format_matches_transformers(scale_fmt):
    w = torch.randn(256, 384) * torch.exp2(torch.randint(-6, 6, (256, 1)).float())
    q, s = ops.fp8_block_cast(w, (128, 128), scale_fmt=scale_fmt)
    ref = hf_dequant(q, s.view(E8M0) if scale_fmt == "ue8m0" else s)
    ours = dequant_weight(q, s, "fp8")
    assert torch.equal(ours, ref)
    assert rel_err(ours, w) < 0.05


def test_mxfp4_format_matches_transformers():
    w = torch.randn(96, 256) * torch.exp2(torch.randint(-6, 6, (96, 8)).float()).repeat_interleave(32, 1)
    q, s = ops.mxfp4_cast(w)
    assert q.dtype == torch.uint8 and q.shape == (96, 128) and s.shape == (96, 8)
    ref = hf_dequant(q.view(torch.float4_e2m1fn_x2), s.view(E8M0))
    ours = ops.mxfp4_dequant(q, s)
    assert torch.equal(ours, ref)
    # e2m1 keeps 1 mantissa bit: relative error <= 1/4 per element above the group's smallest step
    step = torch.exp2(s.float() - 127).repeat_interleave(32, 1) * 0.5
    assert bool(((ours - w).abs() <= torch.maximum(w.abs() / 4, step) * (1 + 1e-6)).all())


def test_mxfp4_nibble_order_low_is_even_column():
    # codes 2 (=1.0) in the low nibble and 7 (=6.0) in the high nibble of every byte
    q = torch.full((1, 16), 0x72, dtype=torch.uint8)
    s = torch.full((1, 1), 127, dtype=torch.uint8)  # 2^0
    v = ops.mxfp4_dequant(q, s)
    assert v[0, 0::2].eq(1.0).all() and v[0, 1::2].eq(6.0).all()


def _dense_copy(src, dst):
    """The checkpoint with every (weight, scale) pair dequantised by transformers' code."""
    from safetensors import safe_open

    ts = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            ts.update({k: h.get_tensor(k) for k in h.keys()})
    out = {}
    for k, t in ts.items():
        if k.endswith(".scale"):
            continue
        sk = k[: -len(".weight")] + ".scale"
        out[k] = hf_dequant(t, ts[sk]) if sk in ts else t
    import json

    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config", None)
    cfg.pop("expert_dtype", None)
    return write_checkpoint(dst, out, cfg)


@pytest.mark.parametrize("quant", ["fp8", "mxfp4"])
@torch.no_grad()
def test_quantised_checkpoint_matches_oracle(tmp_path, quant):
    from transformers import DeepseekV4ForCausalLM

    qpath = tiny.write(tmp_path / quant, quant=quant)
    ours = load_ours(qpath, dtype=torch.float32)
    attn, experts = ours.layers[1].attn, ours.layers[1].ffn.experts
    assert attn.wq_a.fmt == "fp8" and attn.wq_a.weight.dtype == torch.float8_e4m3fn
    assert attn.wq_a.scale.dtype == torch.uint8  # UE8M0 exponent bytes
    assert attn.compressor.wkv.fmt == "dense"  # shipped in bf16
    assert experts.fmt == quant
    if quant == "mxfp4":
        assert experts.w1.dtype == torch.uint8 and experts.w1.shape == (8, 32, 32) and experts.s1.shape == (8, 32, 2)
    dpath = _dense_copy(qpath, tmp_path / f"{quant}-dense")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_model = DeepseekV4ForCausalLM.from_pretrained(dpath, dtype=torch.float32).eval()
    x = ids(2, 200, ours.cfg.vocab_size, seed=7)
    out = ours(x)
    err = rel_err(out, ref_model(x).logits)
    print(f"{quant} checkpoint vs oracle on the dequantised copy: rel err {err:.2e}")
    assert err <= 1e-4
    # dequantize=True folds the scales at load time: same logits, dense weights
    dq = load_ours(qpath, dtype=torch.float32, dequantize=True)
    assert dq.layers[1].attn.wq_a.fmt == "dense" and dq.layers[1].ffn.experts.fmt == "dense"
    assert rel_err(dq(x), out) <= 1e-5
    # MTP runs on the quantised weights too
    logits, streams = ours(x, return_streams=True)
    mtp, _ = ours.mtp_forward(streams[:, :-1], x[:, 1:])
    assert mtp.shape == (2, 199, ours.cfg.vocab_size) and torch.isfinite(mtp).all()


@torch.no_grad()
def test_hf_style_scale_names_and_fp32_scales(tmp_path):
    """<linear>.weight_scale_inv with fp32 scales (DeepSeek V3-style) loads the same."""
    from safetensors import safe_open

    qpath = tiny.write(tmp_path / "q", quant="fp8")
    ts = {}
    for f in sorted(qpath.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            ts.update({k: h.get_tensor(k) for k in h.keys()})
    renamed = {}
    for k, t in ts.items():
        if k.endswith(".scale"):
            renamed[k[: -len(".scale")] + ".weight_scale_inv"] = torch.exp2(t.view(torch.uint8).float() - 127)
        else:
            renamed["model." + k] = t
    import json

    p2 = write_checkpoint(tmp_path / "hf", renamed, json.loads((qpath / "config.json").read_text()), shards=3)
    a, b = load_ours(qpath, dtype=torch.float32), load_ours(p2, dtype=torch.float32)
    assert b.layers[0].attn.wq_a.scale.dtype == torch.float32
    x = ids(1, 64, a.cfg.vocab_size)
    assert rel_err(b(x), a(x)) <= 1e-6
