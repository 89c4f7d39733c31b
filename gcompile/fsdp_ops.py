"""Differentiable parameter gathers for fully sharded data parallel (gcompile passes/fully_sharded.py).

A unit's parameter shards go out as one all-gather over "dp" and come back as
the whole parameters; autograd of the gather is a reduce-scatter of their
gradients, divided by dp, so each rank's backward returns its averaged gradient
shard. Start and wait are two ops so that a pass can issue a unit's gather one
unit ahead of its use (the wait passes gradients through unchanged).

    start_gather_params(shard, dp)  all-gather, not waited  / reduce-scatter, waited, / dp
    wait_params(gathered)           wait                    / identity
"""

import torch

from gcompile import collectives

GROUP = "dp"


class _StartGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, dp):
        ctx.dp = dp
        return collectives.start_all_gather(shard, GROUP, dp)

    @staticmethod
    def backward(ctx, grad):
        return collectives.reduce_scatter(grad, GROUP, ctx.dp) / ctx.dp, None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gathered):
        return collectives.wait(gathered)

    @staticmethod
    def backward(ctx, grad):
        return grad


def start_gather_params(shard: torch.Tensor, dp: int) -> torch.Tensor:
    return _StartGather.apply(shard, dp)


def wait_params(gathered: torch.Tensor) -> torch.Tensor:
    return _Wait.apply(gathered)
