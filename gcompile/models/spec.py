"""What the compiler and the tools know about a model: everything model-specific, as data.

The compiler never matches a parameter name or a module class; it asks the spec.
A spec lives beside its model (gcompile/models/gpt2.py holds GPT-2's) and is
registered by name in gcompile/models/__init__.py.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn


@dataclass(frozen=True)
class Input:
    """One user input of the model's forward, for one microbatch."""

    role: str
    """Its name in forward and in the compiled graphs: "idx" (token ids) or "targets" (labels)."""
    shape: tuple[int, ...]
    """(micro_batch_size, seq_length) for token ids and labels."""
    dtype: torch.dtype
    """torch.long for token ids and labels."""


@dataclass(frozen=True)
class ModelSpec:
    """One model's facts; the compiler and the tools read these instead of the model's names."""

    name: str
    """Registry name, as in gcompile.models.MODELS: "gpt2"."""
    config: type
    """The frozen dataclass of the model's `[model]` section; its fields are the model's CLI flags."""
    module: Callable[[Any], nn.Module]
    """The module from its config, in the mode capture traces (dropout active only when it is on)."""
    init_value: Callable[[str, tuple[int, ...], Any, int], torch.Tensor]
    """(name, full shape, config, seed) -> the parameter's initial value, a pure function of (seed, name)."""
    example_batch: Callable[[int, int], tuple[Input, ...]]
    """(micro_batch_size, seq_length) -> forward's inputs in order; forward returns the loss."""
    tp_plan: tuple[str, ...]
    """Default tensor-parallel plan (gcompile.tp_plan entries) when `[parallel] tp_plan` is empty."""
    tp_errors: Callable[[nn.Module, str, str, int], list[str]]
    """(module built on meta, Linear name, "column" or "row", tp) -> why it cannot be cut so, in the config's words."""
    config_errors: Callable[[Any], list[str]]
    """config -> why the model cannot be built with it (sizes that do not divide), each naming its fields."""
    decays: Callable[[str, tuple[int, ...]], bool]
    """(name, full shape) -> whether AdamW decays the parameter; capture stores it on each `Param`."""
    context_length: Callable[[Any], int]
    """Longest sequence the model accepts; sampling keeps this many last tokens."""
    flops: Callable[[Any, int, int], float]
    """(config, global batch, seq length) -> FLOPs of one training step, for the throughput log."""

    def build(self, config, seed: int, device="cpu", dtype=torch.float32) -> nn.Module:
        """The eager single-device model on its initial weights (`init_value` of every parameter).

        Built on meta first so that no throwaway initialisation runs; `to_empty` unties parameters
        that modules share (a tied embedding and head), so they are tied again, as the module tied them.
        """
        with torch.device("meta"):
            model = self.module(config)
        first = {}
        aliases = [(name, first.setdefault(id(p), name))
                   for name, p in model.named_parameters(remove_duplicate=False)]
        model.to_empty(device=device)
        for name, owner_name in aliases:
            if name != owner_name:
                owner, _, attr = name.rpartition(".")
                setattr(model.get_submodule(owner), attr, model.get_parameter(owner_name))
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(self.init_value(name, tuple(p.shape), config, seed))
        return model.to(dtype)
