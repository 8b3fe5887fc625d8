"""The typed C++ boundary: every launcher in deepfuse._C takes tensors (no raw pointers, no
streams, no positional tuples) and checks dtype, shape and device itself, behind the Python op
contracts. Each family's own test file checks its launchers' errors; this file checks the
boundary as a whole and the cast family."""
import re

import pytest
import torch

from deepfuse import _ext

pytestmark = pytest.mark.skipif(not _ext.has_cuda_kernels(), reason="needs the compiled extension")

FP8 = torch.float8_e4m3fn


def _launchers():
    C = _ext._C
    return {n: getattr(C, n) for n in dir(C) if not n.startswith("_") and callable(getattr(C, n))}


def test_no_launcher_takes_raw_pointers():
    """A launcher's signature names tensors; its stream and device come from its tensors."""
    bad = {}
    for name, fn in _launchers().items():
        sig = (fn.__doc__ or "").split("\n")[0]
        params = re.findall(r"(\w+): ([\w.| ]+?)(?:,|\)| =)", sig)
        why = [p for p, t in params if p == "stream" or "tuple" in t]
        # plans take the device they plan for; launchers run on their tensors' device
        why += [p for p, t in params if p == "device" and not name.endswith(("_plan", "num_sms"))]
        if why:
            bad[name] = why
    assert not bad, f"launchers with raw handles or positional tuples: {bad}"


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float16, FP8, torch.float8_e8m0fnu,
                                torch.uint8, torch.int8, torch.int32, torch.int64, torch.bool])
def test_tensor_arg_reads_dtype_shape_strides(dt):
    t = torch.zeros(6, 10, dtype=torch.float32).to(dt)[1:5, ::2]
    got = _ext._C.tensor_arg(t)
    assert got == f"{str(dt).removeprefix('torch.')}[4, 5] on cpu"
    assert _ext._C.tensor_arg(None) == "None"
    assert _ext._C.tensor_arg(torch.nn.Parameter(torch.zeros(3), requires_grad=False)) == "float32[3] on cpu"
    with pytest.raises(TypeError):
        _ext._C.tensor_arg(3)


def _cast_args(M=8, K=256, group=128, x_dtype=torch.bfloat16, q_dtype=FP8, s_dtype=torch.float32, device="cpu"):
    G = -(-K // group)
    return dict(x=torch.randn(M, K, device=device).to(x_dtype), q=torch.empty(M, K, dtype=q_dtype, device=device),
                scale=torch.empty(M, G, dtype=s_dtype, device=device), scale_fmt="fp32", group=group)


@pytest.mark.parametrize("change, match", [
    (dict(x_dtype=torch.float16), r"fp8_group_cast: argument 'x' must be bfloat16 or float32 \(got float16\[8, 256\]"),
    (dict(q_dtype=torch.uint8), r"argument 'q' must be float8_e4m3fn"),
    (dict(s_dtype=torch.uint8), r"argument 'scale' must be float32"),
    (dict(), r"argument 'x' must be a CUDA tensor"),
])
def test_cast_launcher_rejects_dtype_and_device(change, match):
    with pytest.raises(ValueError, match=match):
        _ext._C.fp8_group_cast(**_cast_args(**change))


def test_cast_launcher_rejects_shapes():
    a = _cast_args()
    a["q"] = a["q"][:, :128]
    with pytest.raises(ValueError, match=r"argument 'q' must have shape \[8, 256\]"):
        _ext._C.fp8_group_cast(**a)
    a = _cast_args()
    a["x"] = a["x"].t()
    with pytest.raises(ValueError, match="argument 'x' must have stride 1 in its last dim"):
        _ext._C.fp8_group_cast(**a)
    with pytest.raises(ValueError, match="argument 'group' must be 32, 64 or 128"):
        _ext._C.fp8_group_cast(**_cast_args(group=16))
    with pytest.raises(ValueError, match="argument 'scale_fmt' must be"):
        _ext._C.fp8_group_cast(**{**_cast_args(), "scale_fmt": "e8m0"})
    w = torch.randn(130, 256)
    with pytest.raises(ValueError, match=r"fp8_block_cast: argument 'scale' must have shape \[2, 2\]"):
        _ext._C.fp8_block_cast(w=w, q=torch.empty(130, 256, dtype=FP8), scale=torch.empty(1, 2), scale_fmt="fp32")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cast_launcher_rejects_mixed_devices():
    a = _cast_args(device="cuda")
    a["scale"] = a["scale"].cpu()
    with pytest.raises(ValueError, match="argument 'scale' must be a CUDA tensor"):
        _ext._C.fp8_group_cast(**a)
    a = _cast_args(device="cuda")
    _ext._C.fp8_group_cast(**a)  # the same arguments on one device launch
    torch.cuda.synchronize()


class _NoExchangeAPI(torch.Tensor):
    """A tensor type without the DLPack C exchange API (as on torch < 2.10)."""
    __dlpack_c_exchange_api__ = None


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, FP8, torch.int64, torch.bool])
def test_tensor_arg_without_exchange_api(dt):
    """Frameworks without the exchange API: the launcher reads the tensor's attributes instead."""
    t = torch.zeros(6, 10, dtype=torch.float32).to(dt)[1:5, ::2].as_subclass(_NoExchangeAPI)
    assert _ext._C.tensor_arg(t) == f"{str(dt).removeprefix('torch.')}[4, 5] on cpu"
    x = torch.randn(8, 256).half().as_subclass(_NoExchangeAPI)
    with pytest.raises(ValueError, match=r"argument 'x' must be bfloat16 or float32 \(got float16\[8, 256\] on cpu"):
        _ext._C.fp8_group_cast(**{**_cast_args(), "x": x})


def test_extension_does_not_link_libtorch():
    """One wheel serves any torch version: _C needs no libtorch / libc10 symbols."""
    import deepfuse._C as C
    data = open(C.__file__, "rb").read()
    for lib in (b"libtorch", b"libc10", b"libtorch_python"):
        assert lib + b".so" not in data, f"_C links {lib.decode()}"
