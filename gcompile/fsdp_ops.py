"""Differentiable parameter gathers for fully sharded data parallel (gcompile passes/fully_sharded.py).

A unit's parameter shards go out as one all-gather over the group that shards
them ("dp", or "dp_shard" under HSDP) and come back as the whole parameters;
autograd of the gather is a reduce-scatter of their gradients (then an all-reduce
over the ranks that hold the same shard: "dp_replicate" under HSDP, "cp" under
context parallel), divided by the ranks whose tokens it sums (`mean_over`: by default
the ranks summed over; dp x cp for expert-parallel weights, whose gradients hold their
ep group's tokens already), so each rank's backward returns its averaged gradient shard. Start and wait are two ops so that a pass can issue a unit's gather one
unit ahead of its use (the wait passes gradients through unchanged).

    start_gather_params(shard, n, group, replica_group, replicas, mean_over)
                                    all-gather, not waited  / reduce-scatter (+ all-reduce) / mean_over
    wait_params(gathered)                           wait                    / identity
    mean_gradient(weight, ranks)                    identity                / divided by ranks
                                    (expert weights no rank shares: the gather's division alone)
"""

import torch

from gcompile import collectives

class _StartGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, n, group, replica_group, replicas, mean_over):
        ctx.n, ctx.group, ctx.replica_group, ctx.replicas, ctx.mean_over = n, group, replica_group, replicas, mean_over
        return collectives.start_all_gather(shard, group, n)

    @staticmethod
    def backward(ctx, grad):
        summed = collectives.reduce_scatter(grad.float(), ctx.group, ctx.n)  # fp16's sum over dp overflowed
        if ctx.replicas > 1:
            summed = collectives.all_reduce(summed, ctx.replica_group)
        return summed / ctx.mean_over, None, None, None, None, None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gathered):
        return collectives.wait(gathered)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _MeanGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, ranks):
        ctx.ranks = ranks
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        return grad / ctx.ranks, None


def start_gather_params(shard: torch.Tensor, n: int, group: str, replica_group: str, replicas: int,
                        mean_over: int | None = None) -> torch.Tensor:
    """`shard` from each of the `n` ranks of `group`, end to end; `replicas`: the ranks of `replica_group` that
    hold the same shard (and see other tokens); `mean_over`: what the summed gradient is divided by
    (None: n * replicas)."""
    return _StartGather.apply(shard, n, group, replica_group, replicas, mean_over or n * replicas)


def mean_gradient(weight: torch.Tensor, ranks: int) -> torch.Tensor:
    """`weight`, whose gradient is divided by `ranks` (the mean over the ranks whose tokens it sums)."""
    return _MeanGradient.apply(weight, ranks)


def wait_params(gathered: torch.Tensor) -> torch.Tensor:
    return _Wait.apply(gathered)
