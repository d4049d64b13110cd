"""Quantized weights for the bench (``bench model --quant``): torchao's configs applied to a registry model.

The names are the ways a DiT is usually quantized for ``torch.compile``:

* ``int8-weight``: int8 weights, activations as they are (``Int8WeightOnlyConfig``);
* ``int8-dynamic``: int8 weights and int8 activations quantized per row at each call
  (``Int8DynamicActivationInt8WeightConfig``);
* ``float8-weight``: float8 (e4m3) weights (``Float8WeightOnlyConfig``).

Every ``nn.Linear`` is quantized in place, before eager and the compiled backends run, so all of them run the same
quantized model. torchao is imported only here, when ``--quant`` is given.
"""

from __future__ import annotations

from typing import Any, Callable, Dict

import torch

__all__ = ["QUANT_CONFIGS", "quantize"]


def _config(name: str) -> Callable[[], Any]:
    def make() -> Any:
        import torchao.quantization as quantization

        return getattr(quantization, name)()

    return make


#: ``--quant`` name -> the torchao config it applies.
QUANT_CONFIGS: Dict[str, Callable[[], Any]] = {
    "int8-weight": _config("Int8WeightOnlyConfig"),
    "int8-dynamic": _config("Int8DynamicActivationInt8WeightConfig"),
    "float8-weight": _config("Float8WeightOnlyConfig"),
}


def quantize(model: torch.nn.Module, name: str) -> torch.nn.Module:
    """Quantize every linear layer of ``model`` in place with the torchao config ``name``; returns ``model``.
    ImportError (saying how to install it) where torchao is missing; ValueError for an unknown name."""
    if name not in QUANT_CONFIGS:
        raise ValueError(f"unknown quantization {name!r}; known: {', '.join(QUANT_CONFIGS)}")
    try:
        from torchao.quantization import quantize_
    except ImportError as exc:
        raise ImportError(f"--quant {name} needs torchao (pip install torchao): {exc}") from exc
    quantize_(model, QUANT_CONFIGS[name]())
    return model
