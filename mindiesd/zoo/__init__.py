"""The model registry: small diffusers transformers with random weights, shared by the tests and the bench.

Each entry builds a real diffusers transformer class from a shrunken config, so the FX graphs contain the same
RMSNorm / RoPE / adaLN / GELU / mul+add structure as the full-size models while running in milliseconds on a
CPU. Nothing is downloaded: weights are random and seeded.

Besides how to build it, an entry holds what the backend should make of the model: the fused ops per family one
forward contains (``expected``, derived from the model's modules and the forward of its blocks), its known gaps
(families that fall short, with the unfused form named) and whether Dynamo breaks its graph.

Groups: ``core`` (Flux, SD3, Wan; tiny and mid, batch 1) and ``dits`` (QwenImage, HunyuanVideo, CogVideoX,
LTXVideo, Sana, Lumina2, PixArt, HiDream dense and MoE, CogView4, AuraFlow, Chroma, SkyReelsV2, Flux2, OmniGen,
PRX, AnyFlow; tiny, batch 2).

    from mindiesd import zoo
    case = zoo.build("flux", "tiny", dtype=torch.bfloat16, device="cuda")
    case.model(**case.inputs)          # a tuple: inputs hold return_dict=False
    case.expected()                    # {"rms_norm": 0, "rope": 0, "norm_rope": 12, "adalayernorm": 13, ...}
"""

from __future__ import annotations

import contextlib
import copy
import logging
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from . import _core, _dits
from ._base import GROUPS, Entry, Spec

__all__ = [
    "Case", "Entry", "Spec", "GROUPS", "REGISTRY", "MODELS", "SIZES", "ModelUnavailableError",
    "build", "entry", "names", "available", "config_for", "expected_counts", "gaps", "repeated_blocks",
    "other_resolution",
]

#: name -> entry, in registration order (core first).
REGISTRY: Dict[str, Entry] = {e.name: e for e in (*_core.ENTRIES, *_dits.ENTRIES)}
#: Every registered model name (the bench's ``--model`` choices).
MODELS: Tuple[str, ...] = tuple(REGISTRY)
SIZES = ("tiny", "mid", "deep", "host", "host-deep", "wide")  # the last four: Flux only

_DIFFUSERS_HINT = (
    "the model zoo needs the optional 'diffusers' dependency; "
    "install it with: pip install 'mindiesd[diffusers]'"
)


class ModelUnavailableError(ImportError):
    """The installed diffusers lacks the class a registry entry builds."""


@dataclass
class Case:
    """A ready-to-run model plus the keyword inputs for ``model(**inputs)``."""

    name: str
    size: str
    model: nn.Module
    inputs: Dict[str, Any] = field(default_factory=dict)

    @property
    def entry(self) -> Entry:
        return REGISTRY[self.name]

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def latent_shape(self) -> torch.Size:
        """Shape of the latent input (of the first output too, for models whose output has the input's channels)."""
        return self.inputs["hidden_states"].shape

    def expected(self) -> Dict[str, int]:
        """The fused ops per family one forward of this model contains (derived from its structure)."""
        return self.entry.expected(self.model)


def entry(name: str) -> Entry:
    """The registry entry ``name`` (ValueError listing the registered names otherwise)."""
    if name not in REGISTRY:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(MODELS)}")
    return REGISTRY[name]


def names(group: Optional[str] = None, size: Optional[str] = None) -> Tuple[str, ...]:
    """Registered names, optionally of one group and only those that have ``size``."""
    if group is not None and group not in GROUPS:
        raise ValueError(f"unknown group {group!r}; choose one of: {', '.join(GROUPS)}")
    return tuple(n for n, e in REGISTRY.items()
                 if (group is None or e.group == group) and (size is None or size in e.sizes))


def gaps(name: str) -> Dict[str, str]:
    """Family -> the unfused form behind a known shortfall of ``name``'s count."""
    return dict(entry(name).gaps)


def expected_counts(case: Case) -> Dict[str, int]:
    """``case.expected()``: the fused ops per family one forward of the case's model contains."""
    return case.expected()


def repeated_blocks(model: nn.Module) -> Tuple[str, ...]:
    """The block classes regional compilation compiles: the ``_repeated_blocks`` the diffusers class declares,
    else (SD3, CogVideoX, CogView4, ... declare none in diffusers 0.42) the ``...Block`` classes that make up a
    ``ModuleList`` of two or more blocks of one class. Set ``model._repeated_blocks`` to this before ``compile_repeated_blocks``.
    """
    declared = tuple(getattr(model, "_repeated_blocks", None) or ())
    if declared:
        return declared
    found = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2:
            classes = {type(child).__name__ for child in module}
            if len(classes) == 1 and (cls := classes.pop()).endswith("Block") and cls not in found:
                found.append(cls)
    return tuple(found)


def config_for(name: str, size: str = "tiny") -> Dict[str, Any]:
    """The diffusers constructor kwargs used for ``name`` at ``size``."""
    _check(name, size)
    return copy.deepcopy(REGISTRY[name].sizes[size].config)


def _check(name: str, size: str) -> None:
    e = entry(name)
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of: {', '.join(SIZES)}")
    if size not in e.sizes:
        raise ValueError(f"model {name!r} has no size {size!r}; its sizes: {', '.join(e.sizes)}")


def _import_diffusers():
    try:
        import diffusers
    except ImportError as exc:
        raise ImportError(_DIFFUSERS_HINT) from exc
    return diffusers


def available(name: str) -> bool:
    """Whether diffusers is installed and has the class entry ``name`` builds."""
    try:
        diffusers = _import_diffusers()
    except ImportError:
        return False
    return hasattr(diffusers, entry(name).cls)


class _DropFp32CastWarning(logging.Filter):
    """Drops diffusers' "modules that should be kept in float32" notice.

    It fires on every ``ModelMixin.to(dtype)``; the zoo casts on purpose, so the
    notice is expected noise.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "should be kept in float32" not in record.getMessage()


@contextlib.contextmanager
def _quiet_fp32_cast_warning():
    logger = logging.getLogger("diffusers.models.modeling_utils")
    dropper = _DropFp32CastWarning()
    logger.addFilter(dropper)
    try:
        yield
    finally:
        logger.removeFilter(dropper)


def _move(value: Any, device) -> Any:
    """Tensors inside tuples and lists (e.g. precomputed RoPE tables) go to ``device`` and keep their dtype."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_move(v, device) for v in value)
    return value


def _cast_inputs(inputs: Dict[str, Any], dtype: torch.dtype, device) -> Dict[str, Any]:
    """Move tensors to ``device``; floating tensors passed directly also take the model dtype."""
    out = {}
    for key, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            value = value.to(device=device, dtype=dtype)
        else:
            value = _move(value, device)
        out[key] = value
    return out


def build(
    name: str,
    size: str = "tiny",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: str | torch.device = "cpu",
    shapes: Dict[str, Any] | None = None,
) -> Case:
    """Build registry model ``name`` at ``size`` with seeded random weights and inputs.

    The module is in eval mode on ``device``/``dtype``; ``inputs`` holds keyword
    tensors plus ``return_dict=False`` so ``model(**inputs)`` returns a tuple.
    ``shapes`` replaces some of the size's input shapes (its keys: ``zoo.entry(name).sizes[size].shapes``), for
    another resolution of the same model (:func:`other_resolution`).
    Raises :class:`ModelUnavailableError` where the installed diffusers lacks the class.
    """
    _check(name, size)
    diffusers = _import_diffusers()
    e = REGISTRY[name]
    if not hasattr(diffusers, e.cls):
        raise ModelUnavailableError(f"diffusers {diffusers.__version__} has no {e.cls} (zoo model {name!r})")
    spec = e.sizes[size]
    unknown = sorted(set(shapes or {}) - set(spec.shapes))
    if unknown:
        raise ValueError(f"zoo model {name!r} at {size!r} has no input shape {', '.join(map(repr, unknown))} "
                         f"(its shapes: {', '.join(sorted(spec.shapes))})")
    spec = Spec(config=copy.deepcopy(spec.config), shapes={**spec.shapes, **(shapes or {})})
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model, inputs = e.factory(diffusers, spec, gen)
    with _quiet_fp32_cast_warning():
        model = model.to(device=device, dtype=dtype)
    model.eval()
    inputs = _cast_inputs(inputs, dtype, device)
    inputs["return_dict"] = False
    return Case(name=name, size=size, model=model, inputs=inputs)


def other_resolution(name: str, size: str = "tiny", step: int = 1) -> Dict[str, Any]:
    """Shapes of another resolution of ``name`` at ``size`` (for :func:`build`'s ``shapes``): its first spatial
    shape (the first that is not the batch) with ``2 * step`` more in its last dimension: Flux's 4 x 4 grid becomes
    4 x 6, SD3's 32-pixel sample 34. ``step`` 0 gives the size's own shapes."""
    _check(name, size)
    shapes = REGISTRY[name].sizes[size].shapes
    key = next(k for k in shapes if k != "batch")
    value = shapes[key]
    grown = (*value[:-1], value[-1] + 2 * step) if isinstance(value, tuple) else value + 2 * step
    return {key: grown}
