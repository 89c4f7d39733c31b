"""Differentiable parameter gathers for fully sharded data parallel (gcompile passes/fully_sharded.py).

A unit's parameter shards go out as one all-gather over the group that shards
them ("dp", or "dp_shard" under HSDP) and come back as the whole parameters;
autograd of the gather is a reduce-scatter of their gradients (then an all-reduce
over the ranks that hold the same shard: "dp_replicate" under HSDP, "cp" under
context parallel), divided by the ranks summed over, so each rank's backward
returns its averaged gradient shard. Start and wait are two ops so that a pass can issue a unit's gather one
unit ahead of its use (the wait passes gradients through unchanged).

    start_gather_params(shard, n, group, replica_group, replicas)
                                    all-gather, not waited  / reduce-scatter (+ all-reduce) / (n * replicas)
    wait_params(gathered)                           wait                    / identity
"""

import torch

from gcompile import collectives

class _StartGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, n, group, replica_group, replicas):
        ctx.n, ctx.group, ctx.replica_group, ctx.replicas = n, group, replica_group, replicas
        return collectives.start_all_gather(shard, group, n)

    @staticmethod
    def backward(ctx, grad):
        summed = collectives.reduce_scatter(grad, ctx.group, ctx.n)
        if ctx.replicas > 1:
            summed = collectives.all_reduce(summed, ctx.replica_group)
        return summed / (ctx.n * ctx.replicas), None, None, None, None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gathered):
        return collectives.wait(gathered)

    @staticmethod
    def backward(ctx, grad):
        return grad


def start_gather_params(shard: torch.Tensor, n: int, group: str, replica_group: str, replicas: int) -> torch.Tensor:
    """`shard` from each of the `n` ranks of `group`, end to end; `replicas`: the ranks of `replica_group` that
    hold the same shard (and see other tokens)."""
    return _StartGather.apply(shard, n, group, replica_group, replicas)


def wait_params(gathered: torch.Tensor) -> torch.Tensor:
    return _Wait.apply(gathered)
