"""The types of the model registry, and the helpers its expected counts are derived with."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Tuple

import torch
from torch import nn

#: The registry's groups: ``core`` (Flux, SD3, Wan: tiny and mid sizes, batch 1, each compiles to one graph) and
#: ``dits`` (the wider suite of diffusers DiTs: tiny, batch 2, so that per-sample modulation really broadcasts).
GROUPS = ("core", "dits")


@dataclass(frozen=True)
class Spec:
    """Config and input geometry of one registry entry at one size."""

    config: Dict[str, Any]
    shapes: Dict[str, Any] = field(default_factory=dict)


#: ``factory(diffusers, spec, generator) -> (model, keyword inputs)``; weights come from the global RNG (seeded by
#: :func:`mindiesd.zoo.build`), random inputs from ``generator``.
Factory = Callable[[Any, Spec, torch.Generator], Tuple[nn.Module, Dict[str, Any]]]


@dataclass(frozen=True)
class Entry:
    """One registered model: how to build it, and what the backend should make of it.

    ``expected(model)`` gives the fused ops per family that one forward of ``model`` contains, derived from the
    model's modules and the forward code of its blocks (documented in each function), not copied from a run.
    ``gaps`` maps a family to the unfused form behind a known shortfall of its count (the tests mark those cases
    ``xfail(strict=True)``, so the day a gap is closed they say so).
    """

    name: str
    cls: str  # the diffusers class
    group: str
    sizes: Mapping[str, Spec]
    factory: Factory
    expected: Callable[[nn.Module], Dict[str, int]]
    gaps: Mapping[str, str] = field(default_factory=dict)
    #: The dtypes the test suite checks the model in (a choice of the suite, to save time; any dtype builds).
    checked_dtypes: Tuple[str, ...] = ("fp32", "bf16")
    #: Why Dynamo breaks the model's graph ("" where it traces each forward whole, as ``fullgraph=True`` needs).
    graph_breaks: str = ""

    def __post_init__(self) -> None:
        if self.group not in GROUPS:
            raise ValueError(f"model {self.name!r}: group must be one of {GROUPS}, got {self.group!r}")


# -- what the expected counts are derived from -------------------------------------------------------------------


def modules_named(model: nn.Module, *names: str) -> list:
    """The submodules of ``model`` whose class is one of ``names``."""
    return [m for m in model.modules() if type(m).__name__ in names]


def rms_norms(model: nn.Module) -> int:
    """RMSNorm modules (``torch.nn.RMSNorm`` and diffusers' ``RMSNorm``)."""
    from diffusers.models.normalization import RMSNorm

    return sum(isinstance(m, (torch.nn.RMSNorm, RMSNorm)) for m in model.modules())


def tanh_gelus(model: nn.Module) -> int:
    """tanh-approximated GELU modules (``torch.nn.GELU`` and diffusers' ``GELU``)."""
    from diffusers.models.activations import GELU

    return sum(isinstance(m, (torch.nn.GELU, GELU)) and m.approximate == "tanh" for m in model.modules())


def grid_ids(rows: int, cols: int, axes: int) -> torch.Tensor:
    """Position ids of an image laid out as in the Flux pipelines: axis 0 zero, axes 1 and 2 (row, col)."""
    ids = torch.zeros(rows, cols, axes)
    ids[..., 1] = torch.arange(rows)[:, None]
    ids[..., 2] = torch.arange(cols)[None, :]
    return ids.reshape(rows * cols, axes)
