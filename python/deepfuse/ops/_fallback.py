"""No silent torch reference on CUDA: the policy every CUDA registration follows when its
kernel cannot serve a call.

A CUDA registration that cannot serve a call (a shape, dtype or layout outside its kernel, or
an op without a kernel) calls need_reference(op, reason) before it runs the torch reference:

- the caller allowed the reference (allow_reference(), a context manager and decorator,
  optionally limited to some ops; models allow the ops they run knowingly, see
  deepfuse.models.references): the call runs it, warns once per op (ReferenceWarning) and is
  counted (reference_calls(), which Engine.stats() reports as "reference_calls");
- the CUDA kernels are switched off (deepfuse._ext.set_kernels_enabled(False): tests and the
  eager baseline of the benchmarks) or activation quantisation is off
  (ops.set_activation_quant(False): oracle comparisons): explicit global choices; the call
  runs the reference and is counted, without a warning;
- otherwise it raises NoKernelError (a ValueError) naming the op and the argument at fault.

Counts are per process and per op name; they count calls into the ops (a CUDA graph replay
re-runs what its capture recorded without calling the ops again, so only the capture counts).
Allowed scopes are per thread. CPU tensors always run the references (they are the CPU path).
"""
from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Iterable, Optional

from deepfuse import _ext


class NoKernelError(ValueError):
    """A CUDA call that no kernel serves, made without allowing the torch reference."""


class ReferenceWarning(UserWarning):
    """An op ran its torch reference on CUDA tensors (allowed by the caller)."""


_ALL = "*"
_local = threading.local()
_lock = threading.Lock()
_counts: dict[str, int] = {}
_warned: set[str] = set()


def _scopes() -> list:
    s = getattr(_local, "scopes", None)
    if s is None:
        s = _local.scopes = []
    return s


class allow_reference(contextlib.ContextDecorator):
    """Allow CUDA calls that no kernel serves to run their torch references (warned once per
    op, counted): `with deepfuse.ops.allow_reference():` (every op) or
    `allow_reference("rms_norm", "sparse_attention_paged")` (those ops only); also a
    decorator. Scopes nest and are per thread."""

    def __init__(self, *ops: str):
        for o in ops:
            if not isinstance(o, str):
                raise TypeError(f"deepfuse: allow_reference: op names must be str, got {type(o).__name__}")
        self.ops = frozenset(ops) if ops else frozenset((_ALL,))

    def __enter__(self):
        _scopes().append(self.ops)
        return self

    def __exit__(self, *exc):
        _scopes().pop()
        return False


def reference_allowed(op: str) -> bool:
    """Whether the current thread's scopes allow `op` to run its reference on CUDA."""
    return any(_ALL in s or op in s for s in _scopes())


def kernels_switched_off() -> bool:
    """set_kernels_enabled(False) on an install that has the kernels."""
    return _ext._C is not None and not _ext.has_cuda_kernels()


def _count(op: str) -> None:
    with _lock:
        _counts[op] = _counts.get(op, 0) + 1


def need_reference(op: str, reason: str, *, explicit: bool = False) -> None:
    """The CUDA path of `op` cannot serve this call (`reason` names the argument at fault):
    return if the reference may run (counted; warned once per op when allowed by a scope),
    else raise NoKernelError. explicit=True: a global switch of the caller's (e.g. activation
    quantisation off) chose the reference."""
    if explicit or kernels_switched_off():
        _count(op)
        return
    if not reference_allowed(op):
        raise NoKernelError(f"deepfuse: {op}: {reason}: no CUDA kernel for this; wrap the call in "
                            f"deepfuse.ops.allow_reference() to run the torch reference")
    _count(op)
    with _lock:
        first = op not in _warned
        _warned.add(op)
    if first:
        warnings.warn(f"deepfuse: {op} runs its torch reference on CUDA ({reason}); allowed (allow_reference: the "
                      f"caller's or the model's choice), counted in deepfuse.ops.reference_calls()", ReferenceWarning, stacklevel=3)


def reference_calls() -> dict[str, int]:
    """{op name: calls that ran the torch reference on CUDA} since start-up or the last reset."""
    with _lock:
        return dict(_counts)


def reset_reference_calls(ops: Optional[Iterable[str]] = None) -> None:
    """Zero the counts (of `ops`, default all) and re-arm their once-per-op warnings."""
    with _lock:
        names = list(_counts.keys() | _warned) if ops is None else list(ops)
        for o in names:
            _counts.pop(o, None)
            _warned.discard(o)


def kernels_off_reason() -> Optional[str]:
    """A reason when this process runs no CUDA kernels (switched off, or not in this install)."""
    if _ext.has_cuda_kernels():
        return None
    return "the CUDA kernels are switched off" if _ext._C is not None else "this install has no compiled CUDA kernels"
