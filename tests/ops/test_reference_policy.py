"""No silent torch reference on CUDA (ops/_fallback.py): the policy, every CUDA registration's
use of it (exercised on CPU tensors through the registered CUDA functions), the models' own
choices (python/deepfuse/models/references.py), and on the GPU the ops and the engine step at V4-Flash widths."""
import importlib
import inspect
import threading
import warnings

import pytest
import torch

import deepfuse.ops as ops
from deepfuse import _ext
from deepfuse.ops import _fallback as FB
from deepfuse.ops._registry import Op

# (deepfuse.ops.rope / .topk are the functions: the modules by name)
MODULES = tuple(importlib.import_module(f"deepfuse.ops.{m}") for m in (
    "attention", "cast", "compressor", "indexer", "kvcache", "linear", "mhc", "moe", "norm", "rope", "topk"))
TORCH_ONLY = {"swiglu"}  # no CUDA kernel by design: its torch form runs on every device
NO_KERNEL = ("sparse_attention", "indexer_scores", "compress_pool")  # full-sequence forms


def all_ops() -> dict[str, Op]:
    return {v.name: v for m in MODULES for v in vars(m).values() if isinstance(v, Op)}


@pytest.fixture(autouse=True)
def clean_policy():
    prev = _ext.set_kernels_enabled(True)
    ops.reset_reference_calls()
    yield
    ops.reset_reference_calls()
    _ext.set_kernels_enabled(prev)


@pytest.fixture
def as_gpu_install(monkeypatch):
    """Decisions as on an install with its kernels (this machine may lack the extension)."""
    monkeypatch.setattr(_ext, "has_cuda_kernels", lambda: True)


# ----------------------------------------------------------------------------- the policy
def test_need_reference_raises_unless_allowed(as_gpu_install):
    with pytest.raises(ops.NoKernelError, match=r"deepfuse: rms_norm: x rows are 8192 wide.*allow_reference"):
        FB.need_reference("rms_norm", "x rows are 8192 wide")
    assert isinstance(ops.NoKernelError("x"), ValueError)
    assert ops.reference_calls() == {}


def test_allowed_reference_warns_once_per_op_and_counts(as_gpu_install):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with ops.allow_reference():
            for _ in range(3):
                FB.need_reference("rms_norm", "x rows are 8192 wide")
            FB.need_reference("rope", "x has dtype float32")
    got = [str(x.message) for x in w if issubclass(x.category, ops.ReferenceWarning)]
    assert len(got) == 2 and "rms_norm" in got[0] and "8192 wide" in got[0] and "rope" in got[1]
    assert ops.reference_calls() == {"rms_norm": 3, "rope": 1}
    ops.reset_reference_calls(["rope"])
    assert ops.reference_calls() == {"rms_norm": 3}
    with pytest.warns(ops.ReferenceWarning, match="rope"), ops.allow_reference("rope"):
        FB.need_reference("rope", "again")  # reset re-arms the op's warning


def test_allow_reference_filters_nests_decorates_and_is_per_thread(as_gpu_install):
    with ops.allow_reference("rope"):
        assert FB.reference_allowed("rope") and not FB.reference_allowed("rms_norm")
        with pytest.raises(ops.NoKernelError, match="rms_norm"):
            FB.need_reference("rms_norm", "why")
        with ops.allow_reference("rms_norm"):
            assert FB.reference_allowed("rms_norm") and FB.reference_allowed("rope")
        assert not FB.reference_allowed("rms_norm")
    assert not FB.reference_allowed("rope")

    @ops.allow_reference("hc_pre")
    def f():
        return FB.reference_allowed("hc_pre"), FB.reference_allowed("hc_post")

    assert f() == (True, False) and not FB.reference_allowed("hc_pre")
    seen = []
    with ops.allow_reference():
        t = threading.Thread(target=lambda: seen.append(FB.reference_allowed("rms_norm")))
        t.start()
        t.join()
    assert seen == [False]
    with pytest.raises(TypeError, match="op names"):
        ops.allow_reference(3)


def test_kernels_switched_off_and_explicit_choices_count_without_raising(monkeypatch):
    if _ext._C is None:
        monkeypatch.setattr(_ext, "_C", object())
    _ext.set_kernels_enabled(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FB.need_reference("rms_norm", "the CUDA kernels are switched off")
    _ext.set_kernels_enabled(True)
    monkeypatch.setattr(_ext, "has_cuda_kernels", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FB.need_reference("quant_linear", "activation quantisation is off", explicit=True)
    assert ops.reference_calls() == {"rms_norm": 1, "quant_linear": 1}


# ----------------------------------------------------------------------------- every registration
def test_every_op_has_a_cuda_path_and_references_go_through_the_policy():
    for name, o in all_ops().items():
        fn = o.kernels.get("cuda")
        if name in TORCH_ONLY:
            assert fn is None, f"{name} is documented as torch-only but has a CUDA registration"
            continue
        assert fn is not None, f"{name} has no CUDA registration: its reference would serve CUDA silently"
        src = inspect.getsource(fn)
        runs_ref = "_ref(" in src or ".reference(" in src
        assert not runs_ref or "need_reference(" in src or "_linear_reference(" in src, (
            f"{name}'s CUDA path runs a reference without ops._fallback.need_reference")


def _bf(*shape, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=device, dtype=torch.bfloat16)


def _f(*shape, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device)


def _i64(vals, device):
    return torch.tensor(vals, dtype=torch.int64, device=device)


def _fp8_weight(N, K, device):
    from deepfuse.ops.cast import fp8_block_cast_ref

    q, s = fp8_block_cast_ref(_f(N, K, seed=3) * 0.1, 128, 128, "ue8m0")
    return q.to(device), s.to(device)


# (op, raw schema args on a device, what the error names): each outside its CUDA kernel
CASES = {
    "rms_norm": (lambda d: (_bf(2, 16392, device=d), None, 1e-6), "x rows are 16392 wide"),
    "rope": (lambda d: (_f(3, 2, 64, device=d), _f(3, 16, device=d), _f(3, 16, device=d), False),
             "x has dtype float32"),
    "norm_rope": (lambda d: (_bf(3, 2, 4100, device=d), None, 1e-6, _f(3, 16, device=d), _f(3, 16, device=d)),
                  "x rows are 4100 wide"),
    "norm_rope_store": (lambda d: (_bf(3, 64, device=d), None, 1e-6, _f(3, 16, device=d), _f(3, 16, device=d),
                                   torch.zeros(3, 16, 64, device=d), "dense", 16, _i64([0, 5, -1], d)),
                        "target pages have dtype float32"),
    "sparse_attention_paged": (lambda d: (_bf(3, 4, 512, device=d), _bf(2, 16, 512, device=d, seed=1), 16,
                                          torch.tensor([[0, 1, -1], [2, 3, 4], [5, -1, -1]], device=d),
                                          _f(4, device=d), 0.05, None, None, 0, None, None, None, None, "bf16", 1, 0),
                               "q has 4 heads"),
    "indexer_logits_paged": (lambda d: (_bf(3, 64, 128, device=d), _f(3, 64, device=d), _bf(2, 16, 128, device=d),
                                        16, _i64([[0, 1, 17, -1]], d), _i64([0, 0, 0], d),
                                        torch.tensor([1, 3, 4], dtype=torch.int32, device=d), 0.1),
                             "pages hold bfloat16 keys"),
    "state_store": (lambda d: (_f(2, 16, device=d), _f(2, 16, device=d), torch.zeros(5, 16, device=d),
                               torch.zeros(5, 16, device=d), _i64([1, -1], d)), "kv has dtype float32"),
    "compress_store": (lambda d: (_f(5, 64, device=d), _f(5, 64, device=d, seed=1), _f(9, 64, device=d, seed=2),
                                  _f(9, 64, device=d, seed=3), _f(4, 64, device=d, seed=4) * 0.1,
                                  _i64([[0, 1, 2, 3], [4, 0, 1, 2]], d), _i64([[0, 1, 2, 3], [5, 6, 7, 8]], d),
                                  torch.tensor([[True] * 4, [True, False, False, True]], device=d),
                                  torch.tensor([[True] * 4, [True, True, False, True]], device=d),
                                  _i64([[0, 1, 2, 3]] * 2, d), False, torch.ones(64, device=d), 1e-6,
                                  _f(2, 16, device=d), _f(2, 16, device=d), torch.zeros(3, 16, 64, device=d),
                                  "dense", 16, _i64([3, 20], d)), "kv has dtype float32"),
    "hc_pre": (lambda d: (_bf(3, 2, 64, device=d), _f(8, 128, device=d) * 0.1, torch.ones(3, device=d),
                          torch.zeros(8, device=d), 1e-6, 1e-6, 20), "x has 2 streams"),
    "hc_post": (lambda d: (_f(3, 64, device=d), _bf(3, 4, 64, device=d), torch.ones(3, 4, device=d),
                           torch.full((3, 4, 4), 0.25, device=d)), "f has dtype float32"),
    "hc_head": (lambda d: (_bf(3, 4, 66, device=d), _f(4, 264, device=d) * 0.1, torch.ones(1, device=d),
                           torch.zeros(4, device=d), 1e-6, 1e-6), "x rows are 66 wide"),
    "moe_route": (lambda d: (_f(3, 2048, device=d), None, 2, 1.0, "sqrtsoftplus", None), "2048 experts"),
    "moe_experts": (lambda d: (_bf(3, 64, device=d), _i64([[0, 1], [1, 2], [2, 0]], d), _f(3, 2, device=d).abs(),
                               _bf(3, 32, 64, device=d, seed=1) * 0.1, _bf(3, 32, 64, device=d, seed=2) * 0.1,
                               _bf(3, 64, 32, device=d, seed=3) * 0.1, None, None, None, "dense", 10.0,
                               None, None, None, None, None, None), "the experts are dense"),
    "quant_linear": (lambda d: (_bf(3, 48, device=d), *_fp8_weight(64, 48, d), "fp8"), "K = 48"),
    "grouped_linear": (lambda d: (_bf(3, 2, 64, device=d), _bf(2 * 32, 64, device=d, seed=1), None, "dense"),
                       "w is dense"),
    "grouped_linear_mx": (lambda d: (_bf(3, 2, 64, device=d).to(torch.float8_e4m3fn),
                                     torch.full((3, 2, 2), 127, dtype=torch.uint8, device=d), *_fp8_weight(2 * 32, 64, d),
                                     "fp8"), "R = 32 rows per group"),
    "sparse_attention": (lambda d: (_bf(1, 3, 4, 64, device=d), _bf(1, 5, 64, device=d, seed=1),
                                    torch.tensor([[[0, 1], [2, -1], [3, 4]]], device=d), _f(4, device=d), 0.1),
                         "the full-sequence form"),
    "indexer_scores": (lambda d: (_bf(1, 3, 4, 32, device=d), _bf(1, 5, 32, device=d, seed=1), _f(1, 3, 4, device=d),
                                  0.1), "the full-sequence form"),
    "compress_pool": (lambda d: (_bf(2, 4, 32, device=d), _f(2, 4, 32, device=d).to(torch.bfloat16)),
                      "the full-sequence form"),
}


def _same(a, b):
    if isinstance(a, (tuple, list)):
        return all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def _clone(args):
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def _check_case(name, call, reference, device):
    build, why = CASES[name]
    args = build(device)
    with pytest.raises(ops.NoKernelError, match=f"deepfuse: {name}: .*{why}.*allow_reference"):
        call(*_clone(args))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with ops.allow_reference(name):
            a_args = _clone(args)
            out = call(*a_args)
            call(*_clone(args))
    got = [x for x in w if issubclass(x.category, ops.ReferenceWarning)]
    assert len(got) == 1 and name in str(got[0].message) and why in str(got[0].message)
    assert ops.reference_calls() == {name: 2}
    r_args = _clone(args)
    ref = reference(*r_args)
    assert _same(out, ref) and _same(a_args, r_args)  # same result, same mutated arguments


@pytest.mark.parametrize("name", sorted(CASES))
def test_cuda_path_decision_on_cpu_tensors(name, as_gpu_install):
    """The registered CUDA function of each op, fed CPU tensors its kernel cannot serve: it
    decides before touching the device (raise / allowed reference)."""
    o = all_ops()[name]
    _check_case(name, o.kernels["cuda"], o.reference, "cpu")


def test_cases_cover_every_op_with_a_reference_path():
    for name, o in all_ops().items():
        fn = o.kernels.get("cuda")
        if fn is not None and ("need_reference(" in inspect.getsource(fn) or "_linear_reference(" in inspect.getsource(fn)):
            assert name in CASES, f"{name}: its CUDA path can run the reference; add a case"


# ----------------------------------------------------------------------------- the models' choices
class _Cache:
    def __init__(self, fp8: bool, dtype=torch.bfloat16):
        self.fp8, self.dtype = fp8, dtype


def meta_model(cfg, experts="fp8"):
    """A V4Model on the meta device with the released checkpoints' weight formats."""
    from deepfuse.models.linear import Linear
    from deepfuse.models.model import V4Model
    from deepfuse.models.moe import Experts
    from deepfuse.models.tiny import _DENSE_ONLY

    M = torch.device("meta")
    m = V4Model(cfg)
    m.dtype = torch.bfloat16
    for name, mod in m.named_modules():
        if isinstance(mod, Linear) and not any(name.endswith(s) for s in _DENSE_ONLY):
            N, K = mod.out_features, mod.in_features
            mod.set_weight(torch.empty(N, K, dtype=torch.float8_e4m3fn, device=M),
                           torch.empty(-(-N // 128), -(-K // 128), dtype=torch.uint8, device=M), "fp8")
        elif isinstance(mod, Experts):
            ws, ss = {}, {}
            for p in ("w1", "w3", "w2"):
                N, K = mod.proj_shape(p)
                if experts == "fp8":
                    ws[p] = torch.empty(mod.num_experts, N, K, dtype=torch.float8_e4m3fn, device=M)
                    ss[p] = torch.empty(mod.num_experts, -(-N // 128), -(-K // 128), dtype=torch.uint8, device=M)
                else:
                    ws[p] = torch.empty(mod.num_experts, N, K, dtype=torch.bfloat16, device=M)
            mod.set_weights(ws, ss, experts)
    return m


def test_v4_flash_and_pro_choose_no_reference_on_fp8_caches():
    from deepfuse.models import random as rnd
    from deepfuse.models import references as R

    flash = meta_model(rnd.flash_config())
    assert R.kernel_gaps(flash, _Cache(True)) == ()
    assert R.kernel_gaps(flash, _Cache(False)) == ("indexer_logits_paged",)  # "auto" / "bf16": the user's choice
    assert R.reference_ops(flash, None, full=True) == tuple(sorted(R.FULL_FORWARD_OPS))
    pro = meta_model(rnd.flash_config(pro=True))
    assert R.kernel_gaps(pro, _Cache(True)) == ()  # 7168-wide rows: the row kernel takes <= 16384
    dense = meta_model(rnd.flash_config(), experts="dense")
    assert R.kernel_gaps(dense, _Cache(True)) == ("moe_experts",)
    flash.dtype = torch.float32
    flash.__dict__.pop("_reference_ops_memo", None)
    assert R.reference_ops(flash, _Cache(True)) == R.ALL


def test_tiny_model_choice_and_overrides():
    from deepfuse.models import references as R
    from deepfuse.models import tiny

    m = tiny.load(dtype=torch.bfloat16)
    want = ("grouped_linear", "indexer_logits_paged", "moe_experts", "sparse_attention_paged")
    assert R.kernel_gaps(m, _Cache(True)) == want  # 4 heads, 8 index heads, dense wo_a / experts
    assert R.reference_ops(m, _Cache(True), full=True) == tuple(sorted(set(want) | set(R.FULL_FORWARD_OPS)))
    m.allow_reference = False
    assert R.reference_ops(m, _Cache(True)) == ()
    m.allow_reference = True
    assert R.reference_ops(m, _Cache(True)) == R.ALL
    m.allow_reference = ("rms_norm",)
    assert R.reference_ops(m, _Cache(True)) == ("rms_norm",)


def test_model_entry_points_run_in_the_models_scope():
    from deepfuse.models.references import scoped

    class Fake:
        device = torch.device("cuda")  # the scope applies to CUDA models only
        allow_reference = ("rms_norm",)

        @scoped(full=False, cache_arg=1)
        def step(self, ctx, cache):
            return FB.reference_allowed("rms_norm"), FB.reference_allowed("rope")

    assert Fake().step(None, _Cache(True)) == (True, False)
    assert Fake().step(None, cache=_Cache(True)) == (True, False)
    assert not FB.reference_allowed("rms_norm")
    Fake.device = torch.device("cpu")
    assert Fake().step(None, _Cache(True)) == (False, False)


def test_engine_stats_report_reference_calls():
    from deepfuse import models
    from deepfuse.engine import LLM

    llm = LLM(models.tiny.load(), max_total_tokens=256, max_num_seqs=2)
    assert llm.engine.stats()["reference_calls"] == {}


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_gpu_op_raises_naming_the_argument_and_runs_when_allowed(name):
    o = all_ops()[name]
    _check_case(name, getattr(torch.ops.deepfuse, name), o.reference, "cuda")


@pytest.mark.gpu
def test_gpu_public_ops_raise_and_kernels_off_run_silently():
    x = _bf(4, 16392, device="cuda")
    with pytest.raises(ops.NoKernelError, match="rms_norm: x rows are 16392 wide"):
        ops.rms_norm(x)
    prev = _ext.set_kernels_enabled(False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            y = ops.rms_norm(_bf(4, 64, device="cuda"))
    finally:
        _ext.set_kernels_enabled(prev)
    assert y.shape == (4, 64) and ops.reference_calls() == {"rms_norm": 1}


@pytest.fixture(scope="module")
def flash():
    from deepfuse.models import random as rnd
    from deepfuse.models.config import CSA, HCA, SWA

    return rnd.build(rnd.flash_config([SWA, CSA, HCA]), device="cuda", dtype=torch.bfloat16, quant="fp8",
                     expert_quant="fp8")


def _serve(model, **kw):
    from deepfuse.engine import LLM, SamplingParams

    from engine_util import prompts_for

    prompts = prompts_for([300, 7, 150, 530], model.cfg.vocab_size, seed=3)
    with warnings.catch_warnings(record=True) as w:  # graph capture at start-up included
        warnings.simplefilter("always")
        llm = LLM(model, max_num_seqs=4, max_num_batched_tokens=512, max_total_tokens=8192, **kw)
        outs = llm.generate(prompts, [SamplingParams(max_tokens=6, ignore_eos=True)] * len(prompts))
    assert [len(o.token_ids) for o in outs] == [6] * len(prompts)
    stats = llm.engine.stats()
    del llm
    torch.cuda.empty_cache()
    return stats, [x for x in w if issubclass(x.category, ops.ReferenceWarning)]


@pytest.mark.gpu
@pytest.mark.parametrize("k", [0, 1])
def test_gpu_v4_flash_engine_defaults_run_no_reference(flash, k):
    """The engine's steps (chunked prefills over SWA / CSA / HCA layers, decode, CUDA graphs,
    MTP drafts with k = 1) at V4-Flash widths with the GPU defaults (FP8 caches): zero references."""
    stats, warned = _serve(flash, num_speculative_tokens=k)
    assert stats["kv_dtype"] == "fp8"
    assert stats["reference_calls"] == {} and not warned, (stats["reference_calls"], warned)


@pytest.mark.gpu
def test_gpu_v4_flash_bf16_cache_runs_the_indexer_reference_with_a_warning(flash):
    """kv_dtype="bf16" (a lossless format the user chose): the model allows the indexer's
    reference (no kernel reads dense key pages): warned once, counted in the engine's stats."""
    stats, warned = _serve(flash, kv_dtype="bf16")
    calls = stats["reference_calls"]
    assert set(calls) == {"indexer_logits_paged"} and calls["indexer_logits_paged"] > 0, calls
    assert len(warned) == 1 and "indexer_logits_paged" in str(warned[0].message)


@pytest.mark.gpu
@torch.no_grad()
def test_gpu_v4_flash_full_forward_runs_only_the_full_sequence_references(flash):
    from v4_oracle import ids

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ops.ReferenceWarning)
        flash(ids(2, 40, flash.cfg.vocab_size, seed=1).cuda())
    assert set(ops.reference_calls()) == set(NO_KERNEL), ops.reference_calls()


@pytest.mark.gpu
@torch.no_grad()
def test_gpu_strict_model_raises_naming_the_argument():
    """A model that allows nothing (allow_reference = False) and the tiny model's 4 heads: the
    step raises; the default (the model's own choice) runs it with a warning."""
    from engine_util import run_chunks
    from v4_oracle import ids

    from deepfuse.models import tiny

    m = tiny.load(device="cuda", dtype=torch.bfloat16)
    x = ids(1, 40, m.cfg.vocab_size, seed=2).cuda()
    with pytest.warns(ops.ReferenceWarning):
        run_chunks(m, x, [0, 40], kv_dtype="fp8")
    assert ops.reference_calls().get("sparse_attention_paged", 0) > 0
    m.allow_reference = False
    with pytest.raises(ops.NoKernelError, match="sparse_attention_paged: q has 4 heads"):
        run_chunks(m, x, [0, 40], kv_dtype="fp8")
