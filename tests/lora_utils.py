"""A seeded PEFT-format LoRA for the tests that load and hot-swap adapters."""

from __future__ import annotations

import torch

TARGETS = (".to_q", ".to_k", ".to_v")  # the attention projections (Flux: attn; Wan: attn1, attn2)
RANK = 4


def lora_state_dict(model, seed):
    """A PEFT-format LoRA of rank RANK on every attention's q/k/v projection, seeded."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, module in model.named_modules():
        if name.endswith(TARGETS) and isinstance(module, torch.nn.Linear):
            state[f"{name}.lora_A.weight"] = torch.randn(RANK, module.in_features, generator=gen) * 0.05
            state[f"{name}.lora_B.weight"] = torch.randn(module.out_features, RANK, generator=gen) * 0.05
    assert state, "no attention projection found"
    return state
