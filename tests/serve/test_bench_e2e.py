"""microbench.bench_e2e at tiny widths on the CPU: it runs end to end through the engine and
writes its JSON (a smoke test of the benchmark, not of speed)."""
import json
import math

import pytest
import torch


def _finite_pos(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_e2e_small(tmp_path, one_thread):
    from microbench import bench_e2e

    assert bench_e2e.main(["--small", "--out", str(tmp_path), "--no-plots", "--device", "cpu"]) == 0
    d = json.loads((tmp_path / "e2e.json").read_text())
    meta = d["context"]
    for key in ("gpu", "date", "commit", "layers", "experts", "copy_tbps", "bf16_tflops", "fp8_tflops"):
        assert meta[key], key
    assert meta["kv_dtype"] == "fp8" and meta["k"] == 3 and meta["acc"] == 3.25
    assert [r["budget"] for r in d["prefill"]] == [64, 128]
    for r in d["prefill"]:
        for key in ("new_tok_s", "step_ms", "floor_ms", "x_floor", "tflop_fp8", "tflop_bf16",
                    "projection_full_new_tok_s"):
            assert _finite_pos(r[key]), (key, r[key])
        assert len(r["layers_ms"]) == 4 and all(_finite_pos(t) for t in r["layers_ms"])
        assert r["top_kernels"]
    assert r["mtp_ms"] > 0  # with k > 0 the MTP layer runs over the prefilled rows
    modes = {(r["mode"], r["B"]) for r in d["decode"]}
    assert modes == {("spec", 2), ("plain", 2)}
    for r in d["decode"]:
        for key in ("step_ms", "tok_s_per_req", "tok_s_total", "floor_ms", "x_floor", "projection_full_step_ms",
                    "projection_full_tpot_ms"):
            assert _finite_pos(r[key]), (key, r[key])
        assert len(r["layers_ms"]) == 4 and r["top_kernels"]
        if r["mode"] == "spec":
            assert 1 <= r["tokens_per_step"] <= 4 and r["mtp_ms"] > 0
        else:
            assert r["tokens_per_step"] == 1 and r["mtp_ms"] == 0
    proj = d["projection"]
    assert "PROJECTION" in proj["label"] and len(proj["decode"]) == 2
    assert {s["tpot_ms"] for s in proj["sglang_published"]} == {3.28, 8.99, 1.72}


def test_e2e_flags():
    from microbench import bench_e2e

    with pytest.raises(SystemExit):
        bench_e2e.parse(["--budgets", "5000"])  # not a multiple of --new
    with pytest.raises(SystemExit):
        bench_e2e.parse(["--modes", "fast"])
    with pytest.raises(SystemExit):
        bench_e2e.parse(["--k", "3", "--acc", "5"])
    a = bench_e2e.parse(["--k", "0"])
    assert a.modes == ["plain"]


def test_prefill_flops_count():
    """The FLOP count of the prefill floor: a dense 1-layer SWA model, hand-counted terms."""
    from deepfuse.models import random as rnd
    from microbench import bench_e2e

    cfg = rnd.flash_config(["sliding_attention"], **bench_e2e.SMALL)
    model = rnd.build(cfg, device="cpu", dtype=torch.float32, quant=None)
    new, ctx = 8, 200
    f = bench_e2e.prefill_flops(model, new, ctx, 1, False)
    assert f["fp8"] == 0  # every weight dense: nothing on the FP8 peak
    d, H, D, W = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window
    attn = 4 * H * D * W * new  # every query reads a full window at position >= W
    head = 2 * d * cfg.vocab_size
    f2 = bench_e2e.prefill_flops(model, 2 * new, ctx, 1, False)
    # linear terms scale with tokens, the head with requests: doubling the tokens doubles the rest
    assert f2["bf16"] - head == pytest.approx(2 * (f["bf16"] - head), rel=1e-9)
    assert f["bf16"] > attn + head
