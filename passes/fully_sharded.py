"""Fully sharded data parallel (ZeRO-3 / FSDP, strategy optim_grads_params) as a rewrite of the forward program.

Each dp rank keeps 1/dp of every parameter; a layer's weights exist whole only
while the layer runs. Autograd does the rest: the backward of a gather is a
reduce-scatter (gcompile.fsdp_ops), so the lowered backward returns each
parameter's gradient shard already averaged over dp, and the optimizer step
updates shards as it would whole parameters (no dp pass runs after lowering).

Requires: the forward Program after tensor/sequence parallel and the pipeline split:
          parameters as the leading placeholders of each stage.
Ensures:  every parameter placeholder holds this dp rank's 1/dp of the rank's (tp-local)
          parameter, cut on dim 0 after zero-padding it to a multiple of dp
          (Param.shards gains Shard("dp", 0), so init, checkpoints and export place it);
          under HSDP (--data-parallel-shard-size n) 1/n, Shard("dp_shard", 0), and the
          gradient shards are also all-reduced over the dp/n "dp_replicate" ranks (under
          context parallel, over the "cp" ranks, which hold the same shards);
          per unit, one all-gather over "dp" of the unit's shards, flattened end to end,
          rebuilds its parameters right before the unit's first use, and is issued when
          the previous unit starts (prefetch: it overlaps that unit's compute);
          Stage.recompute_from_params = --fsdp-reshard-after-forward: lowering then has
          backward gather again (each one unit ahead too) instead of keeping the gathered
          weights from forward.
          A unit is the parameters of one numbered layer (the name up to its first
          numeric part: `h.3`, `layers.3`), or a run of unnumbered ones in order of use
          (the embeddings; the final norm and head).
          Expert-parallel weights (cut over "ep") are sharded over the "edp" ranks that hold
          the same experts instead (Shard("edp", 0)), in units of their own gathered over
          "edp"; their gradients hold their ep group's tokens, so the reduce-scatter's sum is
          divided by dp x cp, as the dense ones'. Where no other rank holds them (edp = 1)
          they stay whole, their gradient divided by dp x cp (mean_gradient).

Rewrite (one unit of two parameters, shards w (a/dp, b) and v (c/dp,), S = (a*b + c)/dp):
    before: ... linear(x, W) ... add(y, V) ...
    after:  g = start_gather_params(cat([view(w, -1), view(v, -1)]), dp)   # before the previous unit
            rows = view(wait_params(g), [dp, S])                          # before this unit
            W = reshape(rows[:, :a*b/dp], [a, b]);  V = reshape(rows[:, a*b/dp:], [c])
            ... linear(x, W) ... add(y, V) ...
"""

import math

import torch
import torch.fx as fx

from gcompile.axes import REPLICAS
from gcompile.fsdp_ops import mean_gradient, start_gather_params, wait_params
from gcompile.layout import Param, Shard
from gcompile.pass_manager import PassContext, register_pass
from gcompile.program import Program, Stage
from passes.rewrite import fake_like

NAME = "fully_sharded"
aten = torch.ops.aten


@register_pass(NAME)
def fully_sharded_pass(program: Program, ctx: PassContext) -> Program:
    axis = "dp_shard" if ctx.coords.size("dp_shard") > 1 else "dp"  # HSDP: dp_shard groups, replicated across
    if ctx.coords.size("dp") == 1:
        return program
    replicas = "dp_replicate" if ctx.coords.size("dp_replicate") > 1 else "cp"  # config: not both
    program = program.clone()
    for stage in program.stages:
        _shard_stage(stage, axis, replicas, ctx)
        stage.recompute_from_params = ctx.config.parallel.fsdp_reshard_after_forward
    return program


def _shard_stage(stage: Stage, axis: str, replica_axis: str, ctx: PassContext) -> None:
    replicas, sizes = ctx.coords.size(replica_axis), ctx.coords.axis_sizes
    data_ranks = ctx.coords.size("dp") * ctx.coords.size("cp")
    graph = stage.graph.graph
    nodes = stage.placeholders()[:len(stage.params)]
    position = {node: i for i, node in enumerate(graph.nodes)}
    first_use = {k: min(node.users, key=position.__getitem__) for k, node in enumerate(nodes) if node.users}
    local, axes = {}, {}  # k -> (local shape before the cut, padded dim 0); k -> the axis that shards it
    for k, param in enumerate(stage.params):
        axes[k] = _expert_axis(param) or axis
        n = ctx.coords.size(axes[k])
        if n == 1:  # experts no other rank holds: whole, their gradient the mean over the data ranks
            if k in first_use:
                with graph.inserting_before(first_use.pop(k)):
                    mean = graph.call_function(mean_gradient, (nodes[k], data_ranks))
                nodes[k].replace_all_uses_with(mean, delete_user_cb=lambda user, mean=mean: user is not mean)
            continue
        shape = param.local_shape(sizes)
        if not shape:
            raise ValueError(f"fully_sharded: parameter {param.name} is a scalar; it has no dim 0 to shard over dp")
        padded = -(-shape[0] // n) * n
        local[k] = (shape, padded)
        stage.params[k] = param.with_shard(Shard(axes[k], 0, padded_size=padded if padded != shape[0] else None))
        nodes[k].meta["val"] = fake_like(nodes[k], stage.params[k].local_shape(sizes))
    units = _units(sorted(first_use, key=lambda k: position[first_use[k]]), stage, axes)
    starts = [first_use[unit[0]] for unit in units]  # each unit's first use, in graph order
    for j, unit in enumerate(units):
        unit_axis = axes[unit[0]]
        dp = ctx.coords.size(unit_axis)
        gather = (dp, unit_axis, replica_axis, replicas) if unit_axis == axis else (dp, unit_axis, replica_axis, 1,
                                                                                    data_ranks)
        with graph.inserting_before(starts[max(j - 1, 0)]):  # one unit ahead
            flat = [graph.call_function(aten.view.default, (nodes[k], [-1])) for k in unit]
            shards = flat[0] if len(flat) == 1 else graph.call_function(aten.cat.default, (flat,))
            started = graph.call_function(start_gather_params, (shards, *gather))
        numels = [math.prod(local[k][0][1:]) * local[k][1] // dp for k in unit]
        with graph.inserting_before(starts[j]):
            rows = graph.call_function(aten.view.default,
                                       (graph.call_function(wait_params, (started,)), [dp, sum(numels)]))
            at = 0
            for k, view, n in zip(unit, flat, numels):
                shape, padded = local[k]
                whole = graph.call_function(aten.reshape.default, (
                    graph.call_function(aten.slice.Tensor, (rows, 1, at, at + n)), [padded, *shape[1:]]))
                if padded != shape[0]:
                    whole = graph.call_function(aten.slice.Tensor, (whole, 0, 0, shape[0]))
                nodes[k].replace_all_uses_with(whole, delete_user_cb=lambda user, view=view: user is not view)
                at += n


def _expert_axis(param: Param) -> str | None:
    """The axis that shards an expert-parallel weight (edp), None for any other parameter."""
    return next((REPLICAS[s.axis] for s in param.shards if s.axis in REPLICAS), None)


def _units(order: list[int], stage: Stage, axes: dict[int, str]) -> list[list[int]]:
    """Parameter indices in order of first use, cut where the layer or the sharding axis changes (see the
    module docstring)."""
    units, key = [], object()
    for k in order:
        unit = (_layer(stage.params[k].name), axes[k])
        if unit != key or not units:
            units.append([])
            key = unit
        units[-1].append(k)
    return units


def _layer(name: str) -> str | None:
    """`transformer.h.3.attn.c_attn.weight` -> `transformer.h.3`; None for a name without a number."""
    parts = name.split(".")
    numbered = [i for i, part in enumerate(parts) if part.isdigit()]
    return ".".join(parts[:numbered[0] + 1]) if numbered else None
