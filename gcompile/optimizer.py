"""The optimizer step of one rank as one graph, as if it were alone in its dp group (dp = 1).

    step(*inputs) -> (grad_norm, found_inf)     inputs named by OptimizerGraph.inputs

The graph reads the flat fp32 gradient accumulator (and zeroes it for the next
step), sums tied-weight copies across stages, computes the norm over every
parameter once, clips, runs AdamW on the fp32 main weights, and (with separate
main weights) writes the result back into the model's weights. With fp16 loss
scaling it first unscales; a non-finite gradient on any rank makes every rank
skip the step (found_inf = 1) and adjusts the scale, all on device. Everything
is elementwise over flat buffers, steered by per-element flags (gcompile.flat),
so it compiles to a few kernels whatever the model.

Data parallelism is not here: dp strategies are rank passes that rewrite this
graph (passes/data_parallel.py, passes/sharded_optimizer.py). The places they
act on carry a mark, node.meta["custom"][MARK], so that they find them by name:

    GRAD        aten.alias of the gradient, complete on this rank (tied copies summed), read by
                the unscaling, the norm and the update: where a dp reduction goes
    NORM_SQ     this rank's sum of squared gradients, before any cross-rank sum
    FOUND_INF   fp16: this rank's overflow flag, before any cross-rank max
    WRITE_BACK  params.copy_(main), with separate main weights: where the weights go back to the model
"""

import functools
import math

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx

from gcompile import collectives
from gcompile.flat import COPIES_SHIFT, DECAY, FlatLayout
from gcompile.rank_program import GradReduction, LossScaling, OptimizerGraph, StepSettings
from gcompile.torch_api import FakeTensorMode

MARK = "optimizer"
GRAD, NORM_SQ, FOUND_INF, WRITE_BACK = "grad", "norm_sq", "found_inf", "write_back"


def marked(gm: fx.GraphModule, mark: str) -> fx.Node | None:
    """The node carrying `mark`, or None where the graph has no such place (e.g. no loss scaling)."""
    nodes = [n for n in gm.graph.nodes if n.meta.get("custom", {}).get(MARK) == mark]
    if len(nodes) > 1:
        raise ValueError(f"optimizer graph: {len(nodes)} nodes marked {mark!r} ({', '.join(n.name for n in nodes)})")
    return nodes[0] if nodes else None


def tied_reductions(layout: FlatLayout) -> tuple[GradReduction, ...]:
    """One reduction per parameter this rank holds a copy of, in name order so that the ranks of
    a group issue theirs alike (their buffers order parameters differently)."""
    tied = sorted((p.name, GradReduction(p.tied_group, o, o + math.prod(s)))
                  for p, s, o in zip(layout.params, layout.shapes, layout.offsets) if p.tied_group)
    return tuple(r for _, r in tied)


@functools.lru_cache(maxsize=32)
def build_optimizer_graph(layout: FlatLayout, settings: StepSettings, norm_group: str | None,
                          device: str = "cpu") -> OptimizerGraph:
    """Traced once per distinct (layout, settings, norm_group, device): the ranks of a world share it.
    `norm_group`: the group whose ranks together hold every gradient once; None alone. `device`: where
    the step runs; Inductor writes kernels for the device of the traced inputs (CPU C++ handed CUDA
    pointers crashes the process)."""
    s, separate_main, scaling = settings.adamw, settings.separate_main, settings.loss_scaling
    inputs = ("params", "grads") + (("main",) if separate_main else ()) + (
        "exp_avg", "exp_avg_sq", "flags", "lr", "step") + (
        ("loss_scale", "growth_tracker", "hysteresis_left") if scaling else ())

    def step_fn(*args):
        x = dict(zip(inputs, args))
        grad = x["grads"].clone()
        x["grads"].zero_()  # ready for the next step's accumulation
        for r in settings.reductions:
            grad[r.start:r.end].copy_(collectives.all_reduce(grad[r.start:r.end], r.group))
        with fx_traceback.annotate({MARK: GRAD}):
            grad = torch.ops.aten.alias.default(grad)
        found_inf = torch.zeros(())
        if scaling:
            grad = grad / x["loss_scale"]
            not_finite = (~torch.isfinite(grad)).any()
            with fx_traceback.annotate({MARK: FOUND_INF}):
                found_inf = not_finite.float()
            if norm_group is not None:
                found_inf = collectives.all_reduce(found_inf, norm_group, op="max")  # every rank skips together
            grad = torch.where(found_inf > 0, 0.0, grad)
            _update_loss_scale(x, found_inf, scaling)
        flags = x["flags"]
        copies = (flags >> COPIES_SHIFT).float()  # each element once over the norm's group
        weight = torch.where(copies == 0, 0.0, 1.0 / copies)
        weighted = grad * grad * weight
        with fx_traceback.annotate({MARK: NORM_SQ}):
            norm_sq = weighted.sum()
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
            with fx_traceback.annotate({MARK: WRITE_BACK}):
                x["params"].copy_(main)
        return grad_norm, found_inf

    with FakeTensorMode(), torch.device(device):
        example = {
            "params": torch.empty(layout.numel, dtype=settings.param_dtype),
            "grads": torch.empty(layout.numel),
            "main": torch.empty(layout.numel),
            "exp_avg": torch.empty(layout.numel),
            "exp_avg_sq": torch.empty(layout.numel),
            "flags": torch.empty(layout.numel, dtype=torch.uint8),
            "lr": torch.empty(()),
            "step": torch.empty(()),
            "loss_scale": torch.empty(()),
            "growth_tracker": torch.empty(()),
            "hysteresis_left": torch.empty(()),
        }
        with fx_traceback.preserve_node_meta():  # keeps the marks
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
