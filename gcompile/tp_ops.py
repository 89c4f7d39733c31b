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
        return rank_part(x, dim, tp, tp_rank)

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


def rank_part(x: torch.Tensor, dim: int, tp: int, tp_rank: torch.Tensor) -> torch.Tensor:
    """This rank's equal part along `dim`, by plain indexing (its gradient: the rank's part, zeros elsewhere),
    where what gives `x` sums its gradient over tp anyway (sequence parallel's gather)."""
    n = x.shape[dim] // tp
    return x.index_select(dim, tp_rank * n + torch.arange(n, device=x.device))


def norm_over_tp(x: torch.Tensor, normalized: int, weight: torch.Tensor | None, bias: torch.Tensor | None,
                 eps: float | None, size: int, centred: bool) -> torch.Tensor:
    """LayerNorm (`centred`) or RMSNorm over the last `normalized` dims of `x`, one of them cut over tp (OLMo-2's
    q_norm over every head): each mean is the sum of every rank's part over the `size` entries one device
    normalises, its gradient summed over the ranks that read it; `weight` and `bias` are the rank's parts. In
    fp32, as torch's norms compute."""
    dims = tuple(range(-normalized, 0))
    eps = torch.finfo(x.dtype).eps if eps is None else eps

    def mean(t: torch.Tensor) -> torch.Tensor:
        return copy_to_tp(reduce_from_tp(t.sum(dims, keepdim=True))) / size
    y = x.float()
    if centred:
        y = y - mean(y)
    y = y * torch.rsqrt(mean(y * y) + eps)
    y = y if weight is None else y * weight
    return (y if bias is None else y + bias).to(x.dtype)


def vocab_parallel_embedding(weight: torch.Tensor, idx: torch.Tensor, tp_rank: torch.Tensor,
                             padding_idx: int = -1) -> torch.Tensor:
    """This rank's part of the embedding: ids outside its rows give zeros (summed over tp afterwards). The row
    of `padding_idx` (a global id; -1: none) gets no gradient, as `nn.Embedding(padding_idx=...)`'s."""
    rows = weight.shape[0]  # V_padded/tp
    local = idx - tp_rank * rows
    outside = (local < 0) | (local >= rows)
    out = F.embedding(local.masked_fill(outside, 0), weight)  # (B, T, C)
    if padding_idx >= 0:
        out = torch.where((idx == padding_idx).unsqueeze(-1), out.detach(), out)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, tp_rank: torch.Tensor,
                                 vocab_size: int, ignore_index: int, reduction: int = 1,
                                 smoothing: float = 0.0) -> torch.Tensor:
    """Cross-entropy of logits cut over the vocab (dim 1), without gathering them (Megatron's), as
    `F.cross_entropy`: `reduction` 0 none, 1 the mean over the counted targets, 2 the sum; `smoothing` spreads
    that share of each target over the `vocab_size` classes. Columns at or past `vocab_size` are padding and take
    no part. All-reduces of one number per target: the max, the sum of exponentials, the target's logit, and
    with smoothing the sum of the logits."""
    padding = _padding(logits, 1, tp_rank, vocab_size)
    shifted, log_sum, _ = _shifted(logits, 1, padding)
    per_target = log_sum.squeeze(1) - vocab_parallel_gather(shifted, 1, targets.unsqueeze(1), tp_rank).squeeze(1)
    if smoothing:
        mean_shifted = reduce_from_tp(shifted.masked_fill(padding, 0.0).sum(1)) / vocab_size
        per_target = (1 - smoothing) * per_target + smoothing * (log_sum.squeeze(1) - mean_shifted)
    return _reduced(per_target, targets, ignore_index, reduction)


def vocab_parallel_nll_loss(log_probs: torch.Tensor, targets: torch.Tensor, tp_rank: torch.Tensor, reduction: int,
                            ignore_index: int) -> torch.Tensor:
    """`F.nll_loss` of log-probabilities cut over the vocab (dim 1): each target's entry from the rank holding it."""
    per_target = -vocab_parallel_gather(log_probs, 1, targets.unsqueeze(1), tp_rank).squeeze(1)
    return _reduced(per_target, targets, ignore_index, reduction)


def vocab_parallel_logsumexp(logits: torch.Tensor, dim: int, keepdim: bool, tp_rank: torch.Tensor,
                             vocab_size: int) -> torch.Tensor:
    """log(sum(exp)) over a dim cut over tp (a z-loss over the vocab), the padding left out."""
    _, log_sum, top = _shifted(logits, dim, _padding(logits, dim, tp_rank, vocab_size))
    total = log_sum + top
    return total if keepdim else total.squeeze(dim)


def vocab_parallel_log_softmax(logits: torch.Tensor, dim: int, tp_rank: torch.Tensor, vocab_size: int,
                               dtype: torch.dtype | None = None) -> torch.Tensor:
    """log_softmax over a dim cut over tp, each rank's entries of it; the padding's are -inf (probability 0)."""
    logits = logits if dtype is None else logits.to(dtype)
    shifted, log_sum, _ = _shifted(logits, dim, _padding(logits, dim, tp_rank, vocab_size))
    return shifted - copy_to_tp(log_sum)  # each rank's entries give part of log_sum's gradient


def vocab_parallel_gather(x: torch.Tensor, dim: int, index: torch.Tensor, tp_rank: torch.Tensor) -> torch.Tensor:
    """`x.gather(dim, index)` of an `x` cut over tp along `dim`: each rank picks the entries in its rows, zeros
    elsewhere, summed over tp."""
    rows = x.shape[dim]
    local = index - tp_rank * rows
    outside = (local < 0) | (local >= rows)
    return reduce_from_tp(x.gather(dim, local.masked_fill(outside, 0)).masked_fill(outside, 0.0))


def _padding(x: torch.Tensor, dim: int, tp_rank: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Where along `dim` (cut over tp) this rank's entries are padding: at or past `vocab_size`, as a mask that
    broadcasts against `x`."""
    rows = x.shape[dim]
    shape = [rows if d == dim % x.dim() else 1 for d in range(x.dim())]
    return (tp_rank * rows + torch.arange(rows, device=x.device) >= vocab_size).view(shape)


def _shifted(logits: torch.Tensor, dim: int, padding: torch.Tensor):
    """(logits less their max over `dim`, the padding at -inf; the log of the sum of their exponentials; the max),
    the last two keeping `dim`. The result does not depend on the shift, so the max carries no gradient."""
    logits = logits.masked_fill(padding, float("-inf"))
    top = collectives.all_reduce(logits.detach().amax(dim=dim, keepdim=True), GROUP, op="max")
    shifted = logits - top
    return shifted, reduce_from_tp(shifted.exp().sum(dim=dim, keepdim=True)).log(), top


def _reduced(per_target: torch.Tensor, targets: torch.Tensor, ignore_index: int, reduction: int) -> torch.Tensor:
    """A loss per target as `reduction` says (0 none, 1 the mean over the targets not ignored, 2 the sum), the
    ignored ones 0."""
    valid = targets != ignore_index
    per_target = per_target.masked_fill(~valid, 0.0)
    return per_target if reduction == 0 else per_target.sum() / valid.sum() if reduction == 1 else per_target.sum()
