"""Context-parallel ops: what passes/context_parallel.py calls from a graph.

Megatron's load-balanced layout for causal attention: the sequence is cut into
2n chunks and cp rank i holds chunks i and 2n-1-i, in that order. Under a causal
mask an early chunk attends to few keys and a late one to many, so every rank
gets the same attention work.

    local_tokens(x, dim, n, cp_rank)   the rank's tokens of a whole (.., T, ..) value / gradient scattered back
    causal_mask(seq, n, cp_rank, dtype)  which gathered keys each of the rank's queries sees, by global position
    gathered_mask(mask, n, cp_rank)    a mask over the whole sequence as the rank's queries against the gathered keys
    attention(q, k, v, n, mask, ...)   K and V all-gathered over "cp" (backward: reduce-scatter, tp_ops.gather),
                                       the rank's queries against every key under the mask
    heads_attention(q, k, v, n, ...)   Ulysses': q, k, v exchanged over "cp" (all-to-all) from the rank's tokens of
                                       every head to every token of the rank's heads, attention over the whole
                                       sequence, the output exchanged back
    to_heads(x, seq, n) / to_tokens    those exchanges alone, around attention written by hand (q @ k^T ... @ v)

The rank's index comes in as a 0-d int64 tensor, `cp_rank`, so every cp rank
runs the same graph text.
"""

import torch
import torch.nn.functional as F

from gcompile import collectives, tp_ops

GROUP = "cp"


def positions(seq: int, n: int, cp_rank) -> torch.Tensor:
    """Global positions of the tokens rank `cp_rank` (an int or a 0-d tensor) holds, in its order. # (T/n,)"""
    chunk = seq // (2 * n)
    device = cp_rank.device if isinstance(cp_rank, torch.Tensor) else None
    base = torch.arange(chunk, device=device)
    return torch.cat([base + cp_rank * chunk, base + (2 * n - 1 - cp_rank) * chunk])


def local_tokens(x: torch.Tensor, dim: int, n: int, cp_rank: torch.Tensor) -> torch.Tensor:
    """The rank's tokens along `dim` of a value every rank has whole (the batch, a position table)."""
    return x.index_select(dim, positions(x.shape[dim], n, cp_rank))


def causal_mask(seq: int, n: int, cp_rank: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive causal mask of the rank's queries against the gathered keys (0 or -inf), (T/n, T): the
    gathered keys are not in sequence order, so it is built from each query's and key's global position.
    Made once and shared by every attention of a stage, so backward keeps one, not one per layer."""
    keys = _gathered(seq, n, cp_rank.device)  # (T,)
    allowed = positions(seq, n, cp_rank)[:, None] >= keys[None, :]  # (T/n, T)
    return torch.zeros(allowed.shape, dtype=dtype, device=cp_rank.device).masked_fill(~allowed, float("-inf"))


def gathered_mask(mask: torch.Tensor, n: int, cp_rank: torch.Tensor) -> torch.Tensor:
    """A mask over the whole sequence, (.., T, T) (a sliding window, a padding mask, ALiBi's bias), as `attention`
    reads it: its rows the rank's queries, its columns the keys in the order they are gathered. A dim of 1
    broadcasts and stays."""
    if mask.dim() >= 2 and mask.shape[-2] > 1:
        mask = mask.index_select(-2, positions(mask.shape[-2], n, cp_rank))
    if mask.shape[-1] > 1:
        mask = mask.index_select(-1, _gathered(mask.shape[-1], n, mask.device))
    return mask


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int, mask: torch.Tensor | None,
              dropout_p: float, scale: float | None, enable_gqa: bool) -> torch.Tensor:
    """Exact attention of the rank's queries (B, nh, T/n, hs) against every rank's keys and values; `mask`
    from `causal_mask` or `gathered_mask`, or None for attention that is not masked."""
    k, v = tp_ops.gather(k, 2, n, GROUP), tp_ops.gather(v, 2, n, GROUP)  # (B, nkv, T, hs), rank r's chunks r-th
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                          enable_gqa=enable_gqa)


def heads_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int, is_causal: bool, dropout_p: float,
                    scale: float | None, enable_gqa: bool, mask: torch.Tensor | None = None,
                    cp_rank: torch.Tensor | None = None) -> torch.Tensor:
    """Exact attention of the rank's tokens (B, heads, T/n, hs) as Ulysses computes it: an all-to-all each for q,
    k and v gives each rank 1/n of the heads over the whole sequence (`to_heads`), so the attention is one
    device's for those heads; a fourth returns the output to the rank's tokens (`to_tokens`). The heads (K and
    V's too) must divide by n. A `mask` over the whole sequence applies as it is, but for a heads dim, of which
    the rank's 1/n is read."""
    q, k, v = (to_heads(t, 2, n) for t in (q, k, v))
    if mask is not None and mask.dim() >= 3 and mask.shape[-3] > 1:
        mask = tp_ops.rank_part(mask, mask.dim() - 3, n, cp_rank)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                       scale=scale, enable_gqa=enable_gqa)
    return to_tokens(y, 2, n).transpose(1, 2).contiguous().transpose(1, 2)  # SDPA's layout, (B, T, heads, hs) in
    # memory, which the graph's views of its output may rely on (capture drops a .contiguous() that did nothing)


def to_heads(x: torch.Tensor, seq: int, n: int) -> torch.Tensor:
    """The rank's tokens of every head (heads on dim 1, T/n tokens on dim `seq`) exchanged over "cp" for every
    token of the rank's 1/n of the heads, in sequence order (the load-balanced chunks put back)."""
    gathered = _gathered(x.shape[seq] * n, n, x.device)
    return _Exchange.apply(x, 1, seq, n).index_select(seq, gathered.argsort())


def to_tokens(x: torch.Tensor, seq: int, n: int) -> torch.Tensor:
    """`to_heads` undone: every token of the rank's heads back to the rank's tokens of every head."""
    return _Exchange.apply(x.index_select(seq, _gathered(x.shape[seq], n, x.device)), seq, 1, n)


def _gathered(seq: int, n: int, device: torch.device) -> torch.Tensor:
    """The global position of each token an exchange gathers: rank 0's tokens, then rank 1's, ..."""
    return torch.cat([positions(seq, n, r) for r in range(n)]).to(device)


class _Exchange(torch.autograd.Function):
    """All-to-all over "cp": cut along `split`, joined along `join`; backward, the same exchange reversed."""

    @staticmethod
    def forward(ctx, x, split, join, n):
        ctx.split, ctx.join, ctx.n = split, join, n
        return collectives.exchange(x, GROUP, n, split, join)

    @staticmethod
    def backward(ctx, grad):
        return collectives.exchange(grad, GROUP, ctx.n, ctx.join, ctx.split), None, None, None
