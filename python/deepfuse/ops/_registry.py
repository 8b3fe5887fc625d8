"""Registers deepfuse ops with the PyTorch dispatcher.

`@op(name, schema)` defines `deepfuse::name`, takes the decorated function (the pure-torch
reference) as the implementation for every device without a kernel of its own (the CPU), and returns an object with `register_kernel("cuda")`
and `register_fake` decorators that is callable like the op, as torch.library.custom_op's.
Without a schema it is inferred from the type annotations (mutated args: `mutates_args`).
Registering through torch.library.Library directly costs a few microseconds less per call
than custom_op (which wraps every call in Python).
Mutated arguments are written `Tensor(a!) name` in the schema.
A CUDA registration that cannot serve a call runs the reference only through the policy of
ops._fallback (need_reference): no silent torch reference on CUDA.
"""
from __future__ import annotations

from typing import Callable

import torch

LIB = torch.library.Library("deepfuse", "DEF")


class Op:
    def __init__(self, name: str, schema: str | None, cpu: Callable, mutates_args=()):
        if schema is None:
            schema = torch.library.infer_schema(cpu, mutates_args=mutates_args)
        LIB.define(name + schema)
        # The reference serves every device (as custom_op's default); a device kernel
        # registered with register_kernel takes precedence on its device.
        LIB.impl(name, cpu, "CompositeExplicitAutograd")
        self.name = name
        self.qualname = f"deepfuse::{name}"
        self.reference = cpu
        self.kernels: dict[str, Callable] = {}  # device -> its registered kernel function
        self._packet = None

    def __call__(self, *args, **kwargs):
        if self._packet is None:
            self._packet = getattr(torch.ops.deepfuse, self.name)
        return self._packet(*args, **kwargs)

    def register_kernel(self, device: str):
        key = {"cuda": "CUDA", "cpu": "CPU"}[device]

        def deco(fn: Callable) -> Callable:
            LIB.impl(self.name, fn, key)
            self.kernels[device] = fn
            return fn

        return deco

    def register_fake(self, fn: Callable) -> Callable:
        torch.library.register_fake(self.qualname, fn, lib=LIB)
        return fn


def op(name: str, schema: str | None = None, *, mutates_args=()) -> Callable[[Callable], Op]:
    """Decorator: define deepfuse::<name><schema> with the function as its CPU path."""

    def deco(fn: Callable) -> Op:
        return Op(name, schema, fn, mutates_args)

    return deco
