"""The extension loader: clear errors when the compiled kernels cannot serve."""
import pytest
import torch

import deepfuse
from deepfuse import _ext


def test_missing_extension_error(monkeypatch):
    monkeypatch.setattr(_ext, "_C", None)
    monkeypatch.setattr(_ext, "_IMPORT_ERROR", ImportError("no _C"))
    assert not _ext.has_cuda_kernels() and _ext.built_archs() == []
    with pytest.raises(RuntimeError, match="CUDA kernels are not part of this install"):
        _ext.ext(torch.device("cuda", 0))


def test_wrong_arch_error(monkeypatch):
    if not deepfuse.has_cuda_kernels():
        pytest.skip("built without CUDA kernels")
    assert deepfuse.built_archs(), "a CUDA build must report its archs"
    _ext._check_device.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "Old GPU")
    with pytest.raises(RuntimeError, match="sm_75"):
        _ext._check_device(0)
    _ext._check_device.cache_clear()


def test_every_op_runs_on_cuda_tensors():
    # Each deepfuse op needs a CUDA kernel or the reference registered for all devices;
    # a CPU-only registration would fail on the GPU with "Could not run ... CUDA backend".
    import deepfuse.ops  # noqa: F401  (registers the ops)

    quals = sorted({n.split(".")[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith("deepfuse::")})
    assert len(quals) >= 10, quals
    for qual in quals:
        has = any(torch._C._dispatch_has_kernel_for_dispatch_key(qual, k)
                  for k in ("CUDA", "CompositeExplicitAutograd", "CompositeImplicitAutograd"))
        assert has, f"{qual} has no kernel that serves CUDA tensors"


class _FakeC:
    """A stand-in _C built for 90a and 100a: launchers record their calls."""

    def __init__(self):
        self.calls = []

    def built_archs(self):
        return ["90a", "100a"]

    def __getattr__(self, name):
        return lambda *a, **kw: self.calls.append((name, kw.get("device")))


@pytest.fixture
def fake_device(monkeypatch):
    """ext() over _FakeC on a mocked cuda:0 whose capability the test sets."""
    fake = _FakeC()
    cap = {"cc": (9, 0)}
    monkeypatch.setattr(_ext, "_C", fake)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: cap["cc"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "mocked GPU")

    def on(cc):
        cap["cc"] = cc
        _ext._check_device.cache_clear()
        _ext._on_device.cache_clear()
        return _ext.ext(torch.device("cuda", 0))

    yield fake, on
    _ext._check_device.cache_clear()
    _ext._on_device.cache_clear()


LAUNCHERS = ("fp8_group_cast", "fp8_block_cast", "topk", "kv_store", "indexer_key_store", "kv_window_copy",
             "sparse_attention_paged", "moe_route", "moe_experts", "fp8_linear", "hc_mix", "hc_post", "norm_rope",
             "compress_store", "state_store", "indexer_logits_paged", "engram_hash", "engram_lookup", "engram_embed",
             "engram_gate", "fp8_linear_prefill", "moe_gate_experts")


def test_sm100_op_table(fake_device):
    fake, on = fake_device
    hopper = on((9, 0))
    assert hopper.index == 0
    for name in LAUNCHERS:  # typed launchers: no device bound, their tensors' device runs them
        getattr(hopper, name)()
        assert _ext.has_kernel(name, torch.device("cuda", 0)), name
    assert fake.calls == [(n, None) for n in LAUNCHERS]

    fake.calls.clear()
    blackwell = on((10, 0))
    wgmma_only = {"fp8_linear", "moe_experts", "fp8_linear_prefill"}
    assert set(_ext._KERNEL_ARCHS) == wgmma_only
    for name in LAUNCHERS:
        assert _ext.has_kernel(name, torch.device("cuda", 0)) == (name not in wgmma_only), name
        if name in wgmma_only:
            with pytest.raises(NotImplementedError, match=f"^deepfuse: no sm_100 kernel for {name} yet"):
                getattr(blackwell, name)
        else:
            getattr(blackwell, name)()
    assert sorted(n for n, _ in fake.calls) == sorted(set(LAUNCHERS) - wgmma_only)
    # host-only helpers (workspace sizes, fits) are arch-independent
    blackwell.moe_workspace_bytes(T=1, d=128, inter=128, E=8, k=2)

    with pytest.raises(RuntimeError, match="sm_120"):  # not built at all: the install's error
        on((12, 0))
    assert not _ext.has_kernel("topk", torch.device("cuda", 0))


def test_launcher_list_is_complete():
    """LAUNCHERS above names every _C function that takes tensors (csrc/*/api.cpp)."""
    if not _ext.has_cuda_kernels():
        pytest.skip("needs the compiled extension")
    C = _ext._C
    takes_tensors = {n for n in dir(C) if not n.startswith("_") and "torch.Tensor" in (getattr(C, n).__doc__ or "")
                     and n != "tensor_arg"}
    assert takes_tensors - {"fp8_linear_workspace_bytes"} == set(LAUNCHERS)


def test_arch_table_matches_csrc():
    # _KERNEL_ARCHS lists exactly the launchers whose C++ refuses devices other than sm_90a.
    import re
    from pathlib import Path

    csrc = Path(__file__).resolve().parents[2] / "csrc"
    if not csrc.is_dir():
        pytest.skip("no source tree")
    guarded = {m for f in csrc.rglob("*.cu") for m in re.findall(r'require_sm90a\("(\w+)"\)', f.read_text())}
    assert guarded == {n for n, a in _ext._KERNEL_ARCHS.items() if a == ("90a",)}
