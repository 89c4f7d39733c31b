"""Differentiable parameter gathers for fully sharded data parallel (gcompile passes/fully_sharded.py).

A unit's parameter shards go out as one all-gather over the group that shards
them ("dp", or "dp_shard" under HSDP) and come back as the whole parameters;
autograd of the gather is a reduce-scatter of their gradients (then, under HSDP,
an all-reduce over the "dp_replicate" ranks that hold the same shard), divided by
the dp ranks summed over, so each rank's backward returns its averaged gradient
shard. Start and wait are two ops so that a pass can issue a unit's gather one
unit ahead of its use (the wait passes gradients through unchanged).

    start_gather_params(shard, n, group, replicas)  all-gather, not waited  / reduce-scatter (+ all-reduce) / dp
    wait_params(gathered)                           wait                    / identity
"""

import torch

from gcompile import collectives

REPLICAS = "dp_replicate"


class _StartGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, n, group, replicas):
        ctx.n, ctx.group, ctx.replicas = n, group, replicas
        return collectives.start_all_gather(shard, group, n)

    @staticmethod
    def backward(ctx, grad):
        summed = collectives.reduce_scatter(grad, ctx.group, ctx.n)
        if ctx.replicas > 1:
            summed = collectives.all_reduce(summed, REPLICAS)
        return summed / (ctx.n * ctx.replicas), None, None, None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gathered):
        return collectives.wait(gathered)

    @staticmethod
    def backward(ctx, grad):
        return grad


def start_gather_params(shard: torch.Tensor, n: int, group: str, replicas: int) -> torch.Tensor:
    """`shard` from each of the `n` ranks of `group`, end to end; `replicas`: the dp_replicate ranks (HSDP)."""
    return _StartGather.apply(shard, n, group, replicas)


def wait_params(gathered: torch.Tensor) -> torch.Tensor:
    return _Wait.apply(gathered)
