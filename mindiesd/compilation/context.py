"""What the backend knows about one Dynamo graph before compiling it: computed once, read by every stage."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, FrozenSet, Mapping, Optional, Sequence, Tuple

import torch
from torch.fx import GraphModule
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .storage import cache as graph_cache
from .runtime import kernel_choice
from .config import CompilationConfig
from .pass_manager import skip_reason
from .storage.symbolic_sizes import SymbolicSizes

__all__ = ["GraphContext"]


@dataclass(frozen=True)
class GraphContext:
    """One graph's inputs, device, mode, families and cache place."""

    #: How many inputs Dynamo passes (aot keeps them all unless it rewrites the calling convention).
    n_inputs: int
    #: How many inputs aot's graph has when it keeps them all: a tensor-subclass input (a quantized weight) is
    #: passed as its inner tensors.
    n_aten_inputs: int
    #: Indices of the inputs that are parameters or buffers (Dynamo marks them as static inputs).
    weights: Tuple[int, ...]
    #: Indices of the LoRA adapter weights among them (see :func:`_adapter_inputs`).
    adapters: FrozenSet[int]
    #: The device of the first tensor input (None: no tensor input).
    device: Optional[torch.device]
    #: Whether aot builds a training graph (gradients on and an input that requires them).
    training: bool
    #: ``enable_freezing`` of the settings.
    freezing_enabled: bool
    #: Enabled families that run on this device, in run order.
    families: Tuple[str, ...]
    #: Enabled families left unfused on this device, and why.
    skipped: Mapping[str, str]
    #: Families counted as faster than eager on this device (``MindieSDBackend(force_fast=...)``, and the measured
    #: families where sites are measured).
    force: FrozenSet[str]
    #: Whether each fused op site is measured on the device and runs the fastest candidate (``kernel_choice``).
    measuring: bool
    #: The persistent cache and this graph's key in it; None with :attr:`uncached` saying why.
    cache: Optional[graph_cache.GraphCache]
    key: Optional[str]
    #: The record's cache state when there is no key: ``off`` or ``not cached: <why>``.
    uncached: str
    #: The inputs' symbolic sizes (None: all static), taken before the compile adds guards on them.
    sizes: Optional[SymbolicSizes] = None

    @classmethod
    def build(cls, gm: GraphModule, example_inputs: Sequence[Any], config: CompilationConfig,
              force: FrozenSet[str] = frozenset(), cached: bool = True) -> "GraphContext":
        """The context of ``gm`` with these inputs under ``config``; ``cached=False`` leaves the cache out."""
        weights = tuple(i for i, t in enumerate(example_inputs) if is_weight(t))
        device = _device_of(example_inputs)
        device_type = device.type if device is not None else None
        enabled = config.fusion_patterns.enabled_families() if config.fuse else ()
        measuring = config.fuse and kernel_choice.measuring(config.kernel_choice, device_type, config.capture)
        if measuring:  # fused even where declared slower: each site is measured and keeps the op only if it wins
            force = frozenset(force) | {f for f in kernel_choice.measured_families()
                                        if skip_reason(f, device_type, set(force) | {f}) is None}
        skipped = {f: why for f in enabled if (why := skip_reason(f, device_type, force)) is not None}
        training = torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs)
        folder = config.cache_dir if cached else None
        why_not = _why_not_cached(example_inputs, training) if folder else None
        key, cache = None, None
        sizes = SymbolicSizes.of(gm, example_inputs)
        if folder and why_not is None:
            settings = graph_cache.settings_for_key(config.to_dict())
            key = graph_cache.graph_key(gm, example_inputs, weights, settings, device, skipped, sizes)
            cache = graph_cache.GraphCache(graph_cache.CacheFolder.of(config))
        return cls(
            n_inputs=len(example_inputs), n_aten_inputs=sum(map(_plain_tensors, example_inputs)), weights=weights,
            adapters=_adapter_inputs(gm), device=device,
            training=training, freezing_enabled=config.enable_freezing,
            families=tuple(f for f in enabled if f not in skipped), skipped=MappingProxyType(skipped),
            force=frozenset(force), measuring=measuring, cache=cache, key=key,
            uncached=f"not cached: {why_not}" if why_not else "off" if not folder else "", sizes=sizes,
        )

    @property
    def device_type(self) -> Optional[str]:
        return self.device.type if self.device is not None else None

    @property
    def rewritable_weights(self) -> Tuple[int, ...]:
        """The weights a freeze-stage rewrite may fold into a new tensor: all but the LoRA adapters."""
        return tuple(i for i in self.weights if i not in self.adapters)

    def why_not_frozen(self, aten_inputs: int) -> Optional[str]:
        """Why the aten graph (with ``aten_inputs`` inputs) is not frozen, or None when it is."""
        if not self.freezing_enabled:
            return "needs enable_freezing"
        if self.training or aten_inputs != self.n_aten_inputs:
            return "no freezing for this graph (training or input mutation)"
        return None


def _device_of(example_inputs: Sequence[Any]) -> Optional[torch.device]:
    for t in example_inputs:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            return t.device
    return None


def _plain_tensors(value: Any) -> int:
    """How many inputs of aot's graph ``value`` becomes: the inner tensors of a tensor subclass, else one."""
    if not is_traceable_wrapper_subclass(value):
        return 1
    names, _ = value.__tensor_flatten__()
    return sum(_plain_tensors(getattr(value, name)) for name in names)


def is_weight(t: Any) -> bool:
    """Parameters and buffers: Dynamo marks them as static inputs."""
    return isinstance(t, torch.nn.Parameter) or getattr(t, "_dynamo_static_input_type", None) is not None


def _adapter_inputs(gm: GraphModule) -> FrozenSet[int]:
    """Indices of the inputs that are LoRA adapter weights (PEFT's ``lora_A`` / ``lora_B`` / ...; diffusers'
    LoRA layers are PEFT's). A hot-swap writes them in place through ``.data``, which no version counter sees, so
    the freeze-stage rewrites never fold them into a new tensor: they stay read where they are."""
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    return frozenset(i for i, name in enumerate(names) if "lora_" in name.lower())


def _why_not_cached(example_inputs: Sequence[Any], training: bool) -> Optional[str]:
    reason = graph_cache.uncacheable_inputs(example_inputs)
    if reason is None and training:
        reason = "training graph"
    return reason
