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


def test_e2e_v41_small(tmp_path, one_thread):
    """--v41 --small: the V4.1 engine on a V4.1-Flash-layout random model at tiny widths (the GPU
    run's code path: FP8 128-block linears, MXFP4 experts, FP8 caches, Engram tables in host
    memory, the bounded-replay planner swapped on the same engine, DSpark decode)."""
    from microbench import bench_e2e

    rc = bench_e2e.main(["--v41", "--small", "--out", str(tmp_path), "--no-plots", "--device", "cpu"])
    d = json.loads((tmp_path / "e2e_v41.json").read_text())
    meta = d["context"]
    assert rc == 0 and meta["errors"] == {}, meta["errors"]
    assert meta["ratios"] == [0, 0, 2, 1, 1, 1, 1, 1] and meta["kv_sources"] == [2, 3]
    assert meta["replay_first_layer"] == 4 and meta["late_layers"] == 4
    assert meta["engram_placement"] == "host" and meta["engram_table_device"] == ["cpu", "cpu"]
    assert meta["experts"] == "mxfp4" and meta["kv_dtype"] == "fp8"
    ex, rp = d["prefill"]
    assert (ex["mode"], rp["mode"]) == ("exact", "replay") and rp["replay_window"] == 12
    assert ex["skipped_tokens"] == 0 and rp["skipped_tokens"] == rp["requests"] * (rp["prompt"] - 12)
    assert rp["replay_steps"] >= 1 and 0 <= rp["first_token_agree"] <= 1
    for r in (ex, rp):
        assert _finite_pos(r["new_tok_s"]) and _finite_pos(r["step_ms"])
    assert _finite_pos(rp["speedup"])
    modes = {r["mode"]: r for r in d["decode"]}
    assert set(modes) == {"spec", "plain"}
    assert modes["plain"]["tokens_per_step"] == 1 and modes["spec"]["k"] == 3
    assert 1 <= modes["spec"]["tokens_per_step"] <= 4
    for r in d["decode"]:
        assert _finite_pos(r["step_ms"]) and _finite_pos(r["tok_s_total"])


def test_e2e_v41_flags():
    from microbench import bench_e2e

    a = bench_e2e.parse(["--v41", "--engine-arg", "dspark_threshold=0.0", "--spec-arg", "spec_method=dspark"])
    assert a.experts == "mxfp4" and a.ratios == [0, 0, 2, 1, 1, 1, 1, 1] and a.replay == 128
    assert a.engine_args == {"dspark_threshold": 0.0} and a.spec_args == {"spec_method": "dspark"}
    assert bench_e2e.parse(["--small"]).experts == "fp8"
    for bad in (["--v41", "--engine-arg", "novalue"], ["--v41", "--v41-ratios", "a,b"],
                ["--v41", "--prompt", "9000", "--budgets", "8192"], ["--v41", "--replay", "-1"]):
        with pytest.raises(SystemExit):
            bench_e2e.parse(bad)


def test_v41_flash_config():
    """The Flash layout rules of models.v41.flash_config on the released layout reproduce the
    released sources."""
    from deepfuse.models import v41

    ratios = [0, 0] + [2] * 6 + [2] * 6 + [2] * 6 + [1] * 20
    c = v41.flash_config(ratios, draft_layers=3)
    assert c.hidden_size == 5120 and c.n_routed_experts == 384 and c.sliding_window == 128
    assert list(c.kv_source_layers) == [2, 20]  # runs of one ratio (the release splits ratio 2 at 8, 14)
    assert list(c.index_source_layers) == [2, 20, 24, 28, 32, 36] and c.candidate_source_layer == 20
    assert list(c.engram_layer_ids) == [1, 2] and v41.replay_first_layer(c) == 21
    assert c.dspark_target_layer_ids == [37, 38, 39]
