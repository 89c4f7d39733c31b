"""The optimizer step as one graph: gradient reduction, global norm, clipping, AdamW, weight sync.

    step(*inputs) -> (grad_norm, found_inf)     inputs named by OptimizerGraph.inputs

The graph reads the flat fp32 gradient accumulator (and zeroes it for the next
step), sums tied-weight copies across stages, hands the gradient to a GradSync
(how data parallelism reduces it: nothing, bucketed all-reduce, or bucketed
reduce-scatter onto this rank's shard), computes the norm over every parameter
once, clips, runs AdamW on the fp32 main weights, and writes the result back
into the model's weights (through the GradSync: a copy, or an all-gather of the
shards). With fp16 loss scaling it first unscales; a non-finite gradient on
any rank makes every rank skip the step (found_inf = 1) and adjusts the scale,
all on device. Everything is elementwise over flat buffers, steered by per-element
flags (gcompile.flat), so it compiles to a few kernels whatever the model.
"""

import functools
import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from gcompile import collectives
from gcompile.flat import DECAY, NORM_NONE, NORM_REPLICATED, FlatLayout


@dataclass(frozen=True)
class GradReduction:
    """Sum the gradient buffer's [start, end) over a process group before the norm and the update
    (e.g. the two copies of a tied embedding on the first and last pipeline stage)."""

    group: str
    start: int
    end: int


class GradSync(Protocol):
    """How a dp strategy moves gradients to the optimizer and weights back to the model."""

    sharded: bool
    """The optimizer updates only this rank's shard (its main weights and states are shard-sized)."""
    extra_inputs: tuple[str, ...]
    """TrainState buffers `reduce` also reads (e.g. gradients already reduced during backward)."""

    def reduce(self, grad: torch.Tensor, layout: FlatLayout, *extra: torch.Tensor) -> torch.Tensor:
        """The full flat gradient of this rank -> the dp-averaged gradient it updates (full or shard)."""

    def gather(self, main: torch.Tensor, layout: FlatLayout) -> torch.Tensor:
        """Updated main weights (full or shard) -> the full flat weights."""


@dataclass(frozen=True)
class LocalGrads:
    """dp = 1: the gradient is already complete."""

    sharded = False
    extra_inputs = ()

    def reduce(self, grad, layout):
        return grad

    def gather(self, main, layout):
        return main


def tied_reductions(layout: FlatLayout) -> tuple[GradReduction, ...]:
    """One reduction per parameter this rank holds a copy of, in name order so that the ranks of
    a group issue theirs alike (their buffers order parameters differently)."""
    tied = sorted((p.name, GradReduction(p.tied_group, o, o + math.prod(s)))
                  for p, s, o in zip(layout.params, layout.shapes, layout.offsets) if p.tied_group)
    return tuple(r for _, r in tied)


@dataclass(frozen=True)
class AdamWSettings:
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    clip_grad: float
    """0 = no clipping."""


@dataclass(frozen=True)
class LossScaling:
    """fp16 dynamic loss scaling in Megatron's meaning (DynamicGradScaler)."""

    initial: float
    min_scale: float
    window: int
    """Steps without overflow after which the scale doubles."""
    hysteresis: int
    """Overflows tolerated (since the last growth) before the scale halves."""


@dataclass(frozen=True)
class StepSettings:
    adamw: AdamWSettings
    tp: int
    norm_group: str | None
    """The group whose ranks together hold every gradient once (tp x pp, plus dp when sharded); None alone."""
    reductions: tuple[GradReduction, ...] = ()
    separate_main: bool = False
    """fp32 main weights apart from the model's weights (low precision or sharded); else updated in place."""
    param_dtype: torch.dtype = torch.float32
    loss_scaling: LossScaling | None = None


@dataclass
class OptimizerGraph:
    graph: fx.GraphModule
    inputs: tuple[str, ...]
    """TrainState field per graph input, in order."""


@functools.lru_cache(maxsize=32)
def build_optimizer_graph(layout: FlatLayout, settings: StepSettings, grad_sync: GradSync) -> OptimizerGraph:
    """Traced once per distinct (layout, settings, grad_sync): the ranks of a world share it."""
    s, tp, norm_group, separate_main = settings.adamw, settings.tp, settings.norm_group, settings.separate_main
    scaling = settings.loss_scaling
    inputs = ("params", "grads") + (("main",) if separate_main else ()) + (
        "exp_avg", "exp_avg_sq", "flags", "lr", "step") + (
        ("loss_scale", "growth_tracker", "hysteresis_left") if scaling else ()) + grad_sync.extra_inputs

    def step_fn(*args):
        x = dict(zip(inputs, args))
        grad = x["grads"].clone()
        x["grads"].zero_()  # ready for the next step's accumulation
        for r in settings.reductions:
            grad[r.start:r.end].copy_(collectives.all_reduce(grad[r.start:r.end], r.group))
        grad = grad_sync.reduce(grad, layout, *(x[name] for name in grad_sync.extra_inputs))
        found_inf = torch.zeros(())
        if scaling:
            grad = grad / x["loss_scale"]
            found_inf = (~torch.isfinite(grad)).any().float()
            if norm_group is not None:
                found_inf = collectives.all_reduce(found_inf, norm_group, op="max")  # every rank skips together
            grad = torch.where(found_inf > 0, 0.0, grad)
            _update_loss_scale(x, found_inf, scaling)
        flags = x["flags"]
        weight = torch.where((flags & NORM_NONE) != 0, 0.0, torch.where((flags & NORM_REPLICATED) != 0, 1.0 / tp, 1.0))
        norm_sq = (grad * grad * weight).sum()
        if norm_group is not None:
            norm_sq = collectives.all_reduce(norm_sq, norm_group)
        grad_norm = norm_sq.sqrt()
        if s.clip_grad > 0:
            grad = grad * torch.clamp(s.clip_grad / (grad_norm + 1e-6), max=1.0)
        main, lr, step = x.get("main", x["params"]), x["lr"], x["step"]
        keep = 1.0 - found_inf  # 0 on a skipped step: nothing below moves
        decay = ((flags & DECAY) != 0).to(main.dtype)
        step.add_(keep)
        main.mul_(1 - lr * s.weight_decay * decay * keep)
        x["exp_avg"].lerp_(grad, (1 - s.beta1) * keep)
        x["exp_avg_sq"].mul_(1 - (1 - s.beta2) * keep).addcmul_(grad, grad, value=1 - s.beta2)
        bias_correction1 = 1 - torch.pow(s.beta1, step)
        bias_correction2 = 1 - torch.pow(s.beta2, step)
        denom = (x["exp_avg_sq"].sqrt() / bias_correction2.sqrt()).add_(s.eps)
        update = x["exp_avg"] / denom * (lr / bias_correction1)
        main.sub_(torch.where(found_inf > 0, 0.0, update) if scaling else update)
        if separate_main:
            x["params"].copy_(grad_sync.gather(main, layout))
        return grad_norm, found_inf

    state_numel = layout.shard_numel if grad_sync.sharded else layout.numel
    with FakeTensorMode():
        example = {
            "params": torch.empty(layout.numel, dtype=settings.param_dtype),
            "grads": torch.empty(layout.numel),
            "main": torch.empty(state_numel),
            "exp_avg": torch.empty(state_numel),
            "exp_avg_sq": torch.empty(state_numel),
            "flags": torch.empty(state_numel, dtype=torch.uint8),
            "lr": torch.empty(()),
            "step": torch.empty(()),
            "loss_scale": torch.empty(()),
            "growth_tracker": torch.empty(()),
            "hysteresis_left": torch.empty(()),
            "reduced_grads": torch.empty(state_numel),
        }
        graph = make_fx(step_fn, tracing_mode="fake")(*(example[n] for n in inputs))
    return OptimizerGraph(graph=graph, inputs=inputs)


def _update_loss_scale(x: dict, found_inf: torch.Tensor, scaling: LossScaling) -> None:
    """Megatron's DynamicGradScaler.update, on 0-d tensors (no host sync)."""
    scale, growth, hysteresis = x["loss_scale"], x["growth_tracker"], x["hysteresis_left"]
    overflow = found_inf > 0
    hysteresis_after = torch.where(overflow, hysteresis - 1, hysteresis)
    backoff = overflow & (hysteresis_after <= 0)
    growth_after = torch.where(overflow, 0.0, growth + 1)
    grow = growth_after >= scaling.window
    new_scale = torch.where(backoff, torch.clamp(scale * 0.5, min=scaling.min_scale),
                            torch.where(grow, scale * 2.0, scale))
    hysteresis.copy_(torch.where(grow, float(scaling.hysteresis), hysteresis_after))
    growth.copy_(torch.where(grow, 0.0, growth_after))
    scale.copy_(new_scale)
