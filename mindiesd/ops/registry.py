"""The fused ops' declaration type and their registration with the PyTorch dispatcher, derived from it.

An op module declares its :class:`OpDef` once (name, schema, layout rule, checks, reference, output dtype)
with :func:`declare`, which defines ``torch.ops.mindiesd.<name>`` with the reference under
``CompositeExplicitAutograd`` (any device) and, for tracing, the fake derived from the output dtype and the
layout rule. Kernel modules register themselves with
the op object (:func:`kernel`), saying per device whether the kernel is faster than eager's op sequence; each
registered kernel runs behind ``layout.conform``, which gives its contiguous output the op's layout.

The ops are defined with ``torch.library.Library`` (lower per-call overhead than ``custom_op``) and have no
autograd kernel: the public functions run the reference when a gradient is needed. Registration happens once
per process; ``importlib.reload`` keeps the module's tables and library handle.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from . import layout

__all__ = ["OpDef", "DeviceKernel", "OPS", "SCHEMAS", "DEVICE_KERNELS", "DISPATCH_KEYS", "declare", "declare_kernel",
           "kernel", "register_device_kernel", "register_device_kernels", "public_function"]

NAMESPACE = "mindiesd"

#: Device type -> the dispatch key its kernels are registered under.
DISPATCH_KEYS: dict[str, str] = {"cpu": "CPU", "cuda": "CUDA", "npu": "PrivateUse1"}


@dataclass(frozen=True)
class DeviceKernel:
    """What mindiesd declares for an op on one device: its kernels and whether they beat eager's op sequence.

    ``fns`` holds the declared callables (a compiled kernel beside the composition it falls back to); empty
    for a kernel of an optional runtime that is not loaded.
    """

    fast: bool = True
    note: str = ""
    fns: tuple = ()

    def declares(self, registered: Callable) -> bool:
        """Whether ``registered`` is one of the declared kernels (not one a user registered in their place)."""
        return any(registered is fn or getattr(registered, "__wrapped__", None) is fn for fn in self.fns)


@dataclass(eq=False)
class OpDef:
    """One fused op, declared once by its module: everything the dispatcher, the tracer and the layout need."""

    #: ``name(arguments) -> Tensor``; the op's name is the schema's.
    schema: str
    #: The output layout rule (``layout.LAYOUTS``).
    layout: str
    #: The definition of correct (differentiable aten composition).
    reference: Callable[..., torch.Tensor]
    #: The input checks shared by every implementation (the same errors everywhere).
    checks: Callable
    #: The output layout rule's facts (see ``_layout``): arguments that broadcast against x and move with it
    #: when the adapter permutes x; how many leading arguments the kernels take (None: all, the adapter applies
    #: the layout flags); whether the op works along the last dimension, which must stay innermost; how many
    #: leading arguments the rule reads.
    table_args: tuple = ()
    kernel_arity: int | None = None
    rows: bool = True
    layout_args: int = 1
    #: The device kernels return the rule's layout themselves (x's channels-last, say): the adapter calls them on
    #: the inputs as they are and copies only a result of other strides (the kernels that return row-major).
    own_layout: bool = False
    #: The output dtype for the op's arguments; by default the first value the checks return when called with
    #: the arguments of their parameters' names. With the layout rule it makes the fake.
    output_dtype: Callable[..., torch.dtype] | None = None
    #: Device type -> the kernels declared there (filled by :func:`kernel` as kernel modules load).
    kernels: dict[str, DeviceKernel] = field(default_factory=dict)
    #: The op's name, from its schema.
    name: str = field(init=False)

    def __post_init__(self) -> None:
        self.name = self.schema.partition("(")[0]
        if self.layout not in layout.LAYOUTS:
            raise ValueError(f"op {self.name!r}: layout must be one of {layout.LAYOUTS}, got {self.layout!r}")
        if self.output_dtype is None:
            self.output_dtype = _first_checked(self.reference, self.checks)

    def fake(self, *args, **kwargs) -> torch.Tensor:
        """An uninitialised output with the op's shape, dtype and layout, for fake and meta tensors."""
        args = (*args, *kwargs.values())
        return layout.empty_output(self.name, args[:self.layout_args], self.output_dtype(*args))

    @property
    def overload(self):
        """``torch.ops.mindiesd.<name>.default``."""
        return getattr(getattr(torch.ops, NAMESPACE), self.name).default


def _first_checked(reference: Callable, checks: Callable) -> Callable[..., torch.dtype]:
    """The first value ``checks`` return, called with the op arguments named like their parameters."""
    signature = inspect.signature(reference)
    names = list(inspect.signature(checks).parameters)

    def output_dtype(*args, **kwargs) -> torch.dtype:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return checks(*(bound.arguments[name] for name in names))[0]

    return output_dtype


#: Op name -> declaration, in declaration order; the schemas and registered device kernels.
OPS: dict[str, OpDef] = globals().get("OPS", {})
SCHEMAS: dict[str, str] = globals().get("SCHEMAS", {})
DEVICE_KERNELS: dict[str, dict[str, Callable[..., torch.Tensor]]] = globals().get("DEVICE_KERNELS", {})
#: (op name, dispatch key) -> a one-element list holding the callable the dispatcher's kernel there calls. The
#: dispatcher gets one kernel per op and key, once: registering another kernel replaces what it calls, since
#: some torch versions (2.11) refuse a second Python kernel for the same op and key.
_SLOTS: dict[tuple[str, str], list] = globals().get("_SLOTS", {})


def _library() -> torch.library.Library:
    try:
        return torch.library.Library(NAMESPACE, "DEF")
    except RuntimeError:  # another copy of this module defined the namespace: its ops stay registered
        return torch.library.Library(NAMESPACE, "FRAGMENT")


if "LIBRARY" not in globals():
    LIBRARY = _library()


def declare(op: OpDef) -> OpDef:
    """Define ``op`` with the dispatcher (once per process) and record it; returns the declaration in force."""
    known = OPS.get(op.name)
    if known is not None:
        return known
    OPS[op.name], SCHEMAS[op.name] = op, op.schema
    layout.declare(op.name, op.layout, op.table_args, op.kernel_arity, op.rows, op.checks, op.own_layout)
    if not hasattr(getattr(torch.ops, NAMESPACE), op.name):
        LIBRARY.define(op.schema)
        LIBRARY.impl(op.name, op.reference, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{op.name}", op.fake, lib=LIBRARY)
    return op


def _dispatch_key(device_type: str) -> str:
    try:
        return DISPATCH_KEYS[device_type]
    except KeyError:
        raise ValueError(
            f"mindiesd.ops: no dispatch key known for device type {device_type!r}; known: {sorted(DISPATCH_KEYS)}"
        ) from None


def register_device_kernel(name: str, device_type: str, kernel: Callable[..., torch.Tensor]) -> None:
    """Register ``kernel`` as the implementation of op ``name`` on ``device_type``.

    The kernel takes the schema arguments positionally and returns a contiguous tensor; the registered op
    gives it the rule's layout (``mindiesd.ops.layout``).
    """
    if name not in SCHEMAS:
        raise ValueError(f"mindiesd.ops: unknown operator {name!r}; known: {sorted(SCHEMAS)}")
    key = _dispatch_key(device_type)
    conformed = layout.conform(name, kernel)
    slot = _SLOTS.get((name, key))
    if slot is not None:
        slot[0] = conformed
    else:
        slot = [conformed]

        def dispatched(*args, **kwargs):
            return slot[0](*args, **kwargs)

        dispatched.__name__ = dispatched.__qualname__ = f"{name}_{key}"
        # allow_override: a fresh import of this module (its slots gone) replaces the kernel an earlier copy
        # registered; torch 2.13 allows that by default, 2.11 only when asked
        LIBRARY.impl(name, dispatched, key, allow_override=True)
        _SLOTS[(name, key)] = slot
    DEVICE_KERNELS.setdefault(device_type, {})[name] = kernel


def register_device_kernels(device_type: str, kernels: Mapping[str, Callable[..., torch.Tensor]]) -> None:
    """Register every kernel of ``kernels`` for ``device_type``; ones already registered are left alone."""
    registered = DEVICE_KERNELS.get(device_type, {})
    for name, fn in kernels.items():
        if registered.get(name) is not fn:
            register_device_kernel(name, device_type, fn)


def declare_kernel(op: OpDef, device_type: str, fn: Callable | None = None, *, fast: bool = True,
                   note: str = "") -> None:
    """Declare that ``op`` has a kernel on ``device_type`` (``fn``; None for one of a runtime not loaded)."""
    known = op.kernels.get(device_type)
    fns = known.fns if known is not None else ()
    if fn is not None and fn not in fns:
        fns = (*fns, fn)
    op.kernels[device_type] = DeviceKernel(fast=fast, note=note, fns=fns)


def kernel(op: OpDef, device_type: str, *, fast: bool = True, note: str = "",
           into: dict | None = None, register: bool = True) -> Callable:
    """Decorator: declare the function as ``op``'s kernel on ``device_type``, add it to ``into`` (the kernel
    module's table) and, with ``register``, make it the op's kernel there unless one is registered already."""

    def decorate(fn: Callable) -> Callable:
        declare_kernel(op, device_type, fn, fast=fast, note=note)
        if into is not None:
            into[op.name] = fn
        if register and op.name not in DEVICE_KERNELS.get(device_type, {}):
            register_device_kernel(op.name, device_type, fn)
        return fn

    return decorate


def public_function(op: OpDef, doc: str) -> Callable[..., torch.Tensor]:
    """The plain function users call: the op, or the reference when autograd needs a gradient (the op's kernels
    are not differentiable). It has the reference's signature and defaults."""
    reference, overload = op.reference, op.overload
    signature = inspect.signature(reference)
    defaults = tuple(parameter.default for parameter in signature.parameters.values())
    required = sum(default is inspect.Parameter.empty for default in defaults)

    def call(*args, **kwargs):
        if torch.is_grad_enabled() and any(
            isinstance(value, torch.Tensor) and value.requires_grad for value in (*args, *kwargs.values())
        ):
            return reference(*args, **kwargs)
        if kwargs or not required <= len(args) <= len(defaults):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            args = bound.args
        else:
            args = (*args, *defaults[len(args):])
        return overload(*args)

    call.__name__ = call.__qualname__ = op.name
    call.__module__ = "mindiesd.ops"
    call.__doc__ = doc
    call.__signature__ = signature
    return call
