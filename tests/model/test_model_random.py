"""models.random: V4 models built straight on the device (benchmark models), here small."""
import pytest
import torch

from deepfuse.engine import LLM, SamplingParams
from deepfuse.models import random as rnd

SMALL = dict(hidden_size=64, num_attention_heads=4, n_routed_experts=8, moe_intermediate_size=64,
             q_lora_rank=64, o_groups=2, o_lora_rank=64, vocab_size=1000, index_n_heads=4, index_topk=8,
             sliding_window=16)


@pytest.mark.parametrize("experts", ["fp8", "mxfp4", None])
def test_random_model_builds_and_decodes(experts):
    cfg = rnd.flash_config(**SMALL)
    assert cfg.head_dim == 512 and cfg.layer_types[2] == "heavily_compressed_attention"
    m = rnd.build(cfg, device="cpu", dtype=torch.float32, quant="fp8" if experts else None, expert_quant=experts)
    assert m.layers[1].attn.wq_a.fmt == ("fp8" if experts else "dense")
    assert m.layers[1].attn.compressor.wkv.fmt == "dense"
    assert m.layers[1].ffn.experts.fmt == (experts or "dense")
    x = torch.randint(0, 1000, (1, 140))
    with torch.no_grad():
        out = m(x)
    assert torch.isfinite(out).all() and out.std() > 0
    o = LLM(m, max_total_tokens=600, kv_dtype="fp8").generate([x[0].tolist()], SamplingParams(max_tokens=3))[0]
    assert len(o.token_ids) >= 1


def test_flash_widths():
    cfg = rnd.flash_config()
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.n_routed_experts, cfg.moe_intermediate_size) == (
        4096, 64, 256, 2048)
    assert rnd.flash_config(pro=True).hidden_size == 7168


def test_step_benchmark_smoke(tmp_path):
    """microbench.bench_step at tiny widths: it runs end to end and writes its JSON."""
    from microbench import bench_step

    assert bench_step.main(["--small", "--batches", "2", "--contexts", "200", "--steps", "1",
                            "--out", str(tmp_path)]) == 0
    import json
    rows = json.loads((tmp_path / "step.json").read_text())["rows"]
    assert rows[0]["B"] == 2 and rows[0]["step_ms"] > 0 and rows[0]["top_ops"]
