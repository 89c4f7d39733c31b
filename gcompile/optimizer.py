"""AdamW over flat buffers, traced into a graph of its own.

A rank's parameters live in one flat buffer (the model's parameters are views
into it), and so do their gradients and AdamW states. Decayed parameters come
first, then the rest grouped by how they count in the gradient norm, so that
every mask in the update is a comparison of the element index with a few
region boundaries: the whole step is a handful of elementwise kernels and one
reduction, whatever the number of parameters.

    step(param, grad, exp_avg, exp_avg_sq, lr, step, offset) -> (grad_norm,)

mutates its first five arguments in place (grad is zeroed for the next
accumulation). `offset` is the buffer index of element 0 of the tensors passed
in (the shard start under a sharded optimizer), so the masks stay right for any
shard while the graph text stays the same on every rank.
"""

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from gcompile import collectives
from gcompile.layout import Param


@dataclass(frozen=True)
class Region:
    start: int
    end: int
    decay: bool
    norm_weight: float
    """Contribution of each element's squared gradient to the global norm: 1, 1/tp for
    parameters every tp rank holds a copy of, 0 for the second copy of a tied weight."""


@dataclass(frozen=True)
class FlatLayout:
    """Where each of a rank's parameters lives in its flat buffers."""

    params: tuple[Param, ...]
    shapes: tuple[tuple[int, ...], ...]
    """Local (per-rank) shapes, in buffer order."""
    offsets: tuple[int, ...]
    numel: int
    """Buffer length, padded to the requested multiple."""
    regions: tuple[Region, ...]

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each parameter as a view of `flat`, by name."""
        return {p.name: flat[o:o + _numel(s)].view(s) for p, s, o in zip(self.params, self.shapes, self.offsets)}


def decays(param: Param) -> bool:
    """Weight decay on matmul weights only: not on biases, LayerNorm, or the embeddings."""
    return len(param.full_shape) == 2 and "wte" not in param.name and "wpe" not in param.name


def norm_weight(param: Param, tp: int) -> float:
    if param.tied_copy:
        return 0.0
    return 1.0 if param.sharded_over("tp") else 1.0 / tp


def flat_layout(params: list[Param], shapes: list[tuple[int, ...]], tp: int, pad_multiple: int = 1) -> FlatLayout:
    keyed = sorted(zip(params, shapes), key=lambda ps: (not decays(ps[0]), -norm_weight(ps[0], tp)))
    offsets, regions, start = [], [], 0
    for param, shape in keyed:
        key = (decays(param), norm_weight(param, tp))
        if not regions or (regions[-1].decay, regions[-1].norm_weight) != key:
            regions.append(Region(start, start, *key))
        offsets.append(start)
        start += _numel(shape)
        regions[-1] = Region(regions[-1].start, start, *key)
    numel = -(-start // pad_multiple) * pad_multiple
    return FlatLayout(params=tuple(p for p, _ in keyed), shapes=tuple(s for _, s in keyed),
                      offsets=tuple(offsets), numel=numel, regions=tuple(regions))


@dataclass(frozen=True)
class GradReduction:
    """Sum the gradient buffer's [start, end) over a process group before the norm and the update
    (e.g. the two copies of a tied embedding on the first and last pipeline stage)."""

    group: str
    start: int
    end: int


def tied_reductions(layout: FlatLayout) -> tuple[GradReduction, ...]:
    """One reduction per parameter this rank holds a copy of, in name order so that the ranks of
    a group issue theirs alike (their buffers order parameters differently)."""
    tied = sorted((p.name, GradReduction(p.tied_group, o, o + _numel(s)))
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


def build_optimizer_graph(layout: FlatLayout, settings: AdamWSettings, shard_numel: int,
                          norm_group: str | None, reductions: tuple[GradReduction, ...] = ()) -> fx.GraphModule:
    """Trace the AdamW step for tensors of `shard_numel` elements (the whole buffer when unsharded).

    `norm_group` names the process group whose ranks together hold every gradient
    once (tp x pp, plus dp when sharded); None on a single rank.
    """
    regions, s = layout.regions, settings

    def step_fn(param, grad_acc, exp_avg, exp_avg_sq, lr, step, offset):
        grad = grad_acc.clone()
        grad_acc.zero_()  # ready for the next step's accumulation
        for r in reductions:
            grad[r.start:r.end].copy_(collectives.all_reduce(grad[r.start:r.end], r.group))
        index = torch.arange(grad.numel(), device=grad.device) + offset  # buffer index of each element
        weight = torch.zeros_like(grad)
        decay = torch.zeros_like(grad)
        for r in regions:
            inside = (index >= r.start) & (index < r.end)
            weight = torch.where(inside, r.norm_weight, weight)
            if r.decay:
                decay = torch.where(inside, 1.0, decay)
        norm_sq = (grad * grad * weight).sum()
        if norm_group is not None:
            norm_sq = collectives.all_reduce(norm_sq, norm_group)
        grad_norm = norm_sq.sqrt()
        if s.clip_grad > 0:
            grad = grad * torch.clamp(s.clip_grad / (grad_norm + 1e-6), max=1.0)
        step.add_(1)
        param.mul_(1 - lr * s.weight_decay * decay)
        exp_avg.lerp_(grad, 1 - s.beta1)
        exp_avg_sq.mul_(s.beta2).addcmul_(grad, grad, value=1 - s.beta2)
        bias_correction1 = 1 - torch.pow(s.beta1, step)
        bias_correction2 = 1 - torch.pow(s.beta2, step)
        denom = (exp_avg_sq.sqrt() / bias_correction2.sqrt()).add_(s.eps)
        param.sub_(exp_avg / denom * (lr / bias_correction1))
        return (grad_norm,)

    with FakeTensorMode() as mode:
        flat = [torch.empty(shard_numel) for _ in range(4)]
        scalars = [torch.empty(()), torch.empty(()), torch.empty((), dtype=torch.long)]
    graph = make_fx(step_fn, tracing_mode="fake")(*flat, *scalars)
    del mode
    return graph


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
