"""The tensor-parallel sharding plan: which module is cut how, as data.

A plan is a list of `pattern=placement` entries (`[parallel] tp_plan`, flag
`--tp-plan`; empty = the model spec's default plan). A pattern is an `fnmatch` glob
over module names (`*.mlp.c_fc`); the first entry that matches a module decides its
placement, and a module no entry matches is replicated:

    column     Linear: output features cut over tp (a fused QKV weight is cut per
               head, q, k and v alike); its input is copied to every tp rank
    row        Linear: input features cut; the partial outputs are summed over tp
    vocab      Embedding, or the output head's Linear: rows (the vocabulary) cut, padded
               to a multiple of make_vocab_size_divisible_by * tp; the head becomes a
               column-parallel linear whose loss is a vocab-parallel cross-entropy
    replicate  every tp rank holds the whole module (to carve out an exception)

Here the plan is checked against the model's modules (built on meta) before any
rank starts, the sizes a cut needs by the model's own rule (`ModelSpec.tp_errors`);
the tensor_parallel pass checks it against the captured graph.
"""

import fnmatch
import functools
from dataclasses import dataclass

import torch
import torch.nn as nn

from gcompile.models.spec import ModelSpec
from gcompile.user_code import failure_line

PLACEMENTS = ("column", "row", "vocab", "replicate")


@dataclass(frozen=True)
class Plan:
    entries: tuple[tuple[str, str], ...]
    """(pattern, placement), in order; the first match wins."""

    def placement(self, module: str) -> str:
        return next((p for pattern, p in self.entries if fnmatch.fnmatchcase(module, pattern)), "replicate")


def parse_plan(entries: tuple[str, ...]) -> Plan:
    """The plan from its config entries; raises ValueError on a malformed entry."""
    parsed = []
    for entry in entries:
        pattern, sep, placement = entry.partition("=")
        if not sep or not pattern.strip():
            raise ValueError(f"tp_plan entry {entry!r} must be pattern=placement")
        if placement.strip() not in PLACEMENTS:
            raise ValueError(f"tp_plan entry {entry!r}: placement must be one of {', '.join(PLACEMENTS)}")
        parsed.append((pattern.strip(), placement.strip()))
    return Plan(tuple(parsed))


def module_of(param_name: str) -> str:
    """h.0.mlp.c_fc.weight -> h.0.mlp.c_fc."""
    return param_name.rpartition(".")[0]


@functools.lru_cache(maxsize=64)
def plan_errors(spec: ModelSpec, config, entries: tuple[str, ...], tp: int, written: bool = True) -> tuple[str, ...]:
    """Every reason this plan cannot shard the model of `spec` and `config` over tp ranks. An entry that
    matches no module is one when the user wrote the plan (a typo); a model's default plan may name modules
    a config lacks (GPT-2's MLP entries under MoE), and at tp 1, which cuts nothing, it is not checked (HF
    GPT-2's plan names its Conv1D modules, which tp cannot cut). Kept per arguments: building the model, even
    on meta, was 6% of planning 1024 ranks, which validates thousands of layouts of one model."""
    try:
        plan = parse_plan(entries)
    except ValueError as e:
        return (str(e),)
    try:
        with torch.device("meta"):
            model = spec.module(config)
    except Exception as e:  # a user's model that fails to build
        return (f"model {spec.name} could not be built: {failure_line(e)}",)
    if not isinstance(model, nn.Module):  # a user's model function that returns something else
        return (f"model {spec.name}: its module(config) returned a {type(model).__name__}, not a torch.nn.Module; "
                f"return the model",)
    if tp == 1 and not written:
        return ()
    modules = dict(model.named_modules())
    owners = list(dict.fromkeys(module_of(name) for name, _ in model.named_parameters()))  # a tied name once
    every = {module_of(name) for name, _ in model.named_parameters(remove_duplicate=False)}  # tied aliases too
    errors = [f"tp_plan entry '{pattern}={placement}' matches no module; modules with parameters: "
              f"{', '.join(owners[:6])}, ..." for pattern, placement in plan.entries
              if written and not any(fnmatch.fnmatchcase(name, pattern) for name in every)]
    for name in owners:
        placement, module = plan.placement(name), modules[name]
        if placement in ("column", "row") and not isinstance(module, nn.Linear) and not _holds_a_matrix(module):
            errors.append(f"tp_plan: {name} is {type(module).__name__}, but {placement} applies to Linear (or a "
                          f"module with a 2-D weight that forward uses as a linear's, HF's Conv1D)")
        elif placement == "vocab" and not isinstance(module, (nn.Embedding, nn.Linear)):
            errors.append(f"tp_plan: {name} is {type(module).__name__}, but vocab applies to an Embedding "
                          f"or the output head's Linear")
        elif placement in ("column", "row") and isinstance(module, nn.Linear):  # the pass checks the others'
            errors += spec.tp_errors(model, name, placement, tp)
    if tp > 1 and not errors and all(plan.placement(name) == "replicate" for name in owners):
        errors.append(f"tp={tp}, but the tp plan of {spec.name} cuts none of its parameters: each tp rank would "
                      f"compute the whole model; give --tp-plan (e.g. \"blocks.*.up=column,blocks.*.down=row\") "
                      f"or --tp 1")
    return tuple(dict.fromkeys(errors))


def _holds_a_matrix(module: nn.Module) -> bool:
    """Whether `module`, not an Embedding, has a 2-D `weight` that the tensor-parallel pass may find used as a
    linear's (HF's Conv1D, whose weight is (in, out)); it refuses any other use, naming it."""
    weight = getattr(module, "weight", None)
    return not isinstance(module, nn.Embedding) and isinstance(weight, nn.Parameter) and weight.dim() == 2


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's padding: the next multiple of divisible_by * tp."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple
