"""What the compiler and the tools know about a model: everything model-specific, as data.

The compiler never matches a parameter name or a module class; it asks the spec.
A spec lives beside its model (gcompile/models/gpt2.py holds GPT-2's) and is
registered by name in gcompile/models/__init__.py.
"""

import functools
import zlib
from collections.abc import Callable
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from gcompile.held import parameters_on_meta
from gcompile.program import BATCH_ROLES


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
    export_args: Callable[[Any], dict] = dataclasses.asdict
    """config -> the `model_args` of the single-device file `export` writes (what a reader's config class takes)."""

    def build(self, config, seed: int, device="cpu", dtype=torch.float32) -> nn.Module:
        """The eager single-device model on its initial weights (`init_value` of every parameter).

        Its parameters are built on meta so that no throwaway initialisation runs, its buffers as
        the module makes them (`to_empty` leaves them uninitialised: they are put back); `to_empty`
        unties parameters that modules share (a tied embedding and head), so they are tied again, as
        the module tied them.
        """
        with parameters_on_meta(), torch.device("cpu"):
            model = self.module(config)
        aliases, buffers = canonical_names(model), {name: b.clone() for name, b in model.named_buffers()}
        model.to_empty(device=device)
        for name, owner_name in aliases.items():
            if name != owner_name:
                owner, _, attr = name.rpartition(".")
                setattr(model.get_submodule(owner), attr, model.get_parameter(owner_name))
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(self.init_value(name, tuple(p.shape), config, seed))
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
        return model.to(dtype)


def canonical_names(model: nn.Module) -> dict[str, str]:
    """Every parameter name, tied aliases included -> the name the module's state dict uses first."""
    first = {}
    return {name: first.setdefault(id(p), name) for name, p in model.named_parameters(remove_duplicate=False)}


def head_errors(config) -> list[str]:
    """n_head and n_embd of an attention model: positive, and whole heads."""
    errors = [f"{name}={getattr(config, name)} must be at least 1" for name in ("n_head", "n_embd")
              if getattr(config, name) < 1]
    if not errors and config.n_embd % config.n_head:
        errors.append(f"n_embd={config.n_embd} is not divisible by n_head={config.n_head}")
    return errors


def default_init(name: str, shape: tuple[int, ...], config, seed: int) -> torch.Tensor:
    """N(0, 0.02) for matrices and embeddings, seeded by (seed, name); a 1-D `weight` (a norm's gain) at
    one, a bias at zero: GPT-2's rule, which suits most transformers."""
    if len(shape) == 1:
        return torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=generator) * 0.02


def named_by_default_init(name: str, shape: tuple[int, ...]) -> bool:
    """Whether GPT-2's rule (`default_init`) knows what the parameter is: a matrix or embedding, or by its name
    a norm's gain (`weight`) or a bias."""
    return len(shape) >= 2 or name.endswith(("weight", "bias"))


def own_init(module: Callable[[Any], nn.Module]) -> Callable[[str, tuple[int, ...], Any, int], torch.Tensor]:
    """`default_init` where it knows the parameter; any other (a gain or layer scale: `gains.0`, `alpha`), and
    every norm's, starts at the value `module` gives it, built once per process on the CPU with the run's seed.
    The rule would zero a 1-D gain of ones, and a model scaled by it never trains; it drew a 2-D norm weight
    (Cohere's QK-norm, one row per head) as a matrix, and set to one a norm weight that starts at zero (Gemma's,
    which scales by 1 + weight)."""

    def init_value(name: str, shape: tuple[int, ...], config, seed: int) -> torch.Tensor:
        own = _own_values(module, config, seed)
        return own[name].clone() if name in own else default_init(name, shape, config, seed)

    return init_value


@functools.lru_cache(maxsize=2)
def _own_values(module: Callable[[Any], nn.Module], config, seed: int) -> dict[str, torch.Tensor]:
    """The parameters `own_init` takes from `module(config)`, as it makes them with `seed`; the others are
    built on meta, so that no matrix is allocated for it."""
    with torch.random.fork_rng(devices=[]), torch.device("cpu"), parameters_on_meta(keep=_its_own):
        torch.manual_seed(seed)
        model = module(config)
    return {name: p.detach().float() for name, p in model.named_parameters() if not p.is_meta}


def _its_own(owner: nn.Module, name: str, param: nn.Parameter) -> bool:
    """Whether `own_init` keeps the module's value of `param`, `owner`'s parameter `name`: a norm's, or one
    GPT-2's rule does not know."""
    return is_norm(owner) or not named_by_default_init(name, tuple(param.shape))


def is_norm(module: nn.Module) -> bool:
    """torch's norms, and any module whose class is named like one (LlamaRMSNorm, CohereLayerNorm)."""
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase)) or \
        type(module).__name__.endswith("Norm")


def default_tp_errors(model: nn.Module, name: str, placement: str, tp: int) -> list[str]:
    """A column-parallel Linear needs its output features, a row-parallel one its input features, to divide."""
    linear = model.get_submodule(name)
    what, size = ("out_features", linear.out_features) if placement == "column" else ("in_features", linear.in_features)
    return [] if size % tp == 0 else [f"{name}.{what}={size} is not divisible by tp={tp}"]


def token_batch(micro_batch_size: int, seq_length: int) -> tuple[Input, ...]:
    """forward(idx, targets): token ids and next-token labels, (micro_batch_size, seq_length) each."""
    return tuple(Input(role, (micro_batch_size, seq_length), torch.long) for role in BATCH_ROLES)


def spec_with_defaults(name: str, config: type, module: Callable[[Any], nn.Module], **facts) -> ModelSpec:
    """A ModelSpec for your own model: `module(config)` returns an nn.Module whose forward(idx, targets)
    returns the mean loss (and the logits without targets). Every other fact has a default a keyword
    replaces: GPT-2's initialisation where it knows the parameter, the module's own value elsewhere
    (`own_init`), no tensor-parallel plan (give `tp_plan` to cut), decay on every 2-D parameter (embeddings
    too, which GPT-2's and Llama's `decays` exempt), the context length `config.block_size`, 6 FLOPs per
    parameter per token."""

    def flops(config_value, batch_size: int, seq_length: int) -> float:
        with torch.device("meta"):
            params = sum(p.numel() for p in module(config_value).parameters())
        return 6.0 * params * batch_size * seq_length

    defaults = dict(init_value=own_init(module), example_batch=token_batch, tp_plan=(), tp_errors=default_tp_errors,
                    config_errors=lambda config_value: [], decays=lambda _, shape: len(shape) >= 2,
                    context_length=lambda config_value: config_value.block_size, flops=flops)
    return ModelSpec(name=name, config=config, module=module, **dict(defaults, **facts))
