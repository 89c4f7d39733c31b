"""Context-parallel ops: what passes/context_parallel.py calls from a graph.

Megatron's load-balanced layout for causal attention: the sequence is cut into
2n chunks and cp rank i holds chunks i and 2n-1-i, in that order. Under a causal
mask an early chunk attends to few keys and a late one to many, so every rank
gets the same attention work.

    local_tokens(x, dim, n, cp_rank)   the rank's tokens of a whole (.., T, ..) value / gradient scattered back
    causal_mask(seq, n, cp_rank, dtype)  which gathered keys each of the rank's queries sees, by global position
    attention(q, k, v, n, mask, ...)   K and V all-gathered over "cp" (backward: reduce-scatter, tp_ops.gather),
                                       the rank's queries against every key under the mask

The rank's index comes in as a 0-d int64 tensor, `cp_rank`, so every cp rank
runs the same graph text.
"""

import torch
import torch.nn.functional as F

from gcompile import tp_ops

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
    keys = torch.cat([positions(seq, n, r) for r in range(n)]).to(cp_rank.device)  # (T,)
    allowed = positions(seq, n, cp_rank)[:, None] >= keys[None, :]  # (T/n, T)
    return torch.zeros(allowed.shape, dtype=dtype, device=cp_rank.device).masked_fill(~allowed, float("-inf"))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int, mask: torch.Tensor | None,
              dropout_p: float, scale: float | None, enable_gqa: bool) -> torch.Tensor:
    """Exact attention of the rank's queries (B, nh, T/n, hs) against every rank's keys and values; `mask`
    from `causal_mask`, or None for attention that is not causal."""
    k, v = tp_ops.gather(k, 2, n, GROUP), tp_ops.gather(v, 2, n, GROUP)  # (B, nkv, T, hs), rank r's chunks r-th
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                          enable_gqa=enable_gqa)

