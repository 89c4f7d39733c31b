"""Differentiable tensor-parallel ops: what the tensor/sequence-parallel passes call from a graph.

Each collective is a `torch.autograd.Function` whose forward and backward call
the functional collectives of `gcompile.collectives`, so that autograd of the
rewritten forward puts the backward collective into the backward graph by
construction (Megatron's f / g conjugate pairs). The module-level wrappers exist
because FX code generation cannot name `Fn.apply`; a graph node calls them.

    copy_to_tp                  identity      / all-reduce      (Megatron f; also: a replicated value
                                                                 used on local tokens only)
    reduce_from_tp              all-reduce    / identity        (Megatron g)
    gather_from_sequence        all-gather    / reduce-scatter  (into a column-parallel block, SP)
    gather                      the same over any group         (context parallel's K and V over "cp")
    reduce_scatter_to_sequence  reduce-scatter / all-gather     (out of a row-parallel block, SP)
    scatter_to_sequence         local chunk   / all-gather      (a replicated (.., T, ..) value meets
                                                                 a sequence-sharded one, SP)
    scatter_to_tp               the same                        (a replicated value per head meets the
                                                                 cut heads; not a sequence, which
                                                                 context parallel cuts further)

All but `gather` act over the process group registered as "tp". Per-rank numbers (the
rank's index, hence its vocab rows) come in as a 0-d int64 tensor, `tp_rank`, so
that every tp rank runs the same graph text.
"""

import torch
import torch.nn.functional as F

from gcompile import collectives

GROUP = "tp"


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return collectives.all_reduce(grad, GROUP)


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return collectives.all_reduce(x, GROUP)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Gather(torch.autograd.Function):
    """All-gather along `dim` over `group` / reduce-scatter (sequence parallel's, and context parallel's K, V)."""

    @staticmethod
    def forward(ctx, x, dim, n, group):
        ctx.dim, ctx.n, ctx.group = dim, n, group
        return collectives.all_gather(x, group, n, dim)

    @staticmethod
    def backward(ctx, grad):
        return collectives.reduce_scatter(grad, ctx.group, ctx.n, ctx.dim), None, None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, tp):
        ctx.dim, ctx.tp = dim, tp
        return collectives.reduce_scatter(x, GROUP, tp, ctx.dim)

    @staticmethod
    def backward(ctx, grad):
        return collectives.all_gather(grad, GROUP, ctx.tp, ctx.dim), None, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, tp, tp_rank):
        ctx.dim, ctx.tp = dim, tp
        n = x.shape[dim] // tp
        return x.index_select(dim, tp_rank * n + torch.arange(n, device=x.device))

    @staticmethod
    def backward(ctx, grad):
        return collectives.all_gather(grad, GROUP, ctx.tp, ctx.dim), None, None, None


def copy_to_tp(x: torch.Tensor) -> torch.Tensor:
    return _CopyToTP.apply(x)


def reduce_from_tp(x: torch.Tensor) -> torch.Tensor:
    return _ReduceFromTP.apply(x)


def mean_over_sequence(x: torch.Tensor, tp: int) -> torch.Tensor:
    """The mean over every tp rank's tokens, from each one's mean over its own (as many on each): the sum over
    tp, whose backward passes each rank its gradient whole (reduce_from_tp), over tp."""
    return reduce_from_tp(x) / tp


def gather_from_sequence(x: torch.Tensor, dim: int, tp: int) -> torch.Tensor:
    return _Gather.apply(x, dim, tp, GROUP)


def gather(x: torch.Tensor, dim: int, n: int, group: str) -> torch.Tensor:
    """Every rank's `x` of `group` (n ranks), joined along `dim` in rank order; gradients reduce-scattered back."""
    return _Gather.apply(x, dim, n, group)


def reduce_scatter_to_sequence(x: torch.Tensor, dim: int, tp: int) -> torch.Tensor:
    return _ReduceScatterToSequence.apply(x, dim, tp)


def scatter_to_sequence(x: torch.Tensor, dim: int, tp: int, tp_rank: torch.Tensor) -> torch.Tensor:
    return _ScatterToTP.apply(x, dim, tp, tp_rank)


def scatter_to_tp(x: torch.Tensor, dim: int, tp: int, tp_rank: torch.Tensor) -> torch.Tensor:
    return _ScatterToTP.apply(x, dim, tp, tp_rank)


def vocab_parallel_embedding(weight: torch.Tensor, idx: torch.Tensor, tp_rank: torch.Tensor) -> torch.Tensor:
    """This rank's part of the embedding: ids outside its rows give zeros (summed over tp afterwards)."""
    rows = weight.shape[0]  # V_padded/tp
    local = idx - tp_rank * rows
    outside = (local < 0) | (local >= rows)
    out = F.embedding(local.masked_fill(outside, 0), weight)  # (B, T, C)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, tp_rank: torch.Tensor,
                                 vocab_size: int, ignore_index: int) -> torch.Tensor:
    """Mean cross-entropy of logits sharded over the vocab, without gathering them (Megatron's).

    `logits` is (N, V_padded/tp); columns at or past `vocab_size` are padding and
    take no part. Three all-reduces of (N,) each: the max, the sum of exponentials,
    the target's logit.
    """
    rows = logits.shape[1]
    start = tp_rank * rows
    padding = start + torch.arange(rows, device=logits.device) >= vocab_size  # (V/tp,)
    logits = logits.masked_fill(padding, float("-inf"))
    # The loss does not depend on the shift, so the max carries no gradient.
    logits_max = collectives.all_reduce(logits.detach().amax(dim=1), GROUP, op="max")  # (N,)
    shifted = logits - logits_max.unsqueeze(1)
    sum_exp = reduce_from_tp(shifted.exp().sum(dim=1))  # (N,)
    local = targets - start
    outside = (local < 0) | (local >= rows)
    target_logit = shifted.gather(1, local.masked_fill(outside, 0).unsqueeze(1)).squeeze(1)
    target_logit = reduce_from_tp(target_logit.masked_fill(outside, 0.0))  # (N,)
    valid = targets != ignore_index
    return (sum_exp.log() - target_logit).masked_fill(~valid, 0.0).sum() / valid.sum()
