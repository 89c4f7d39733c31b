"""Ring attention: context parallel's p2p flavour (Megatron-Core's cp_comm_type p2p, torchtitan's ring).

Each cp rank keeps its queries; keys and values travel around the ring of cp
ranks, one rank's block per step, and the transfer of the next block is issued
before the rank attends to the one it holds, so the two overlap. The partial
results merge by their log-sum-exp (online softmax), which makes the result
exact. Backward is a ring too: K and V go around again, each with the gradient
accumulator of its owner, which one more step delivers home. Nothing of length
T is ever held (no gathered K/V, no (T/n, T) mask): a rank saves its own q, k,
v, output and log-sum-exp.

Causal attention in the load-balanced layout of gcompile/cp_ops.py: rank i holds
chunks i and 2n-1-i (halves a and b of its tokens, c each). At step s it holds
the keys of rank j = i - s mod n:

    s = 0     its own keys, causal over its 2c tokens (its two chunks are in global order)
    j < i     every query sees chunk j (k_a) and none sees chunk 2n-1-j (k_b)
    j > i     q_b sees all of k, q_a nothing

Both off-diagonal cases are q_b x k_a plus one c x c block, q_a x k_a (j < i) or
q_b x k_b (j > i): rows o..o+c of q and k with o = c * (j > i), and j > i holds
exactly when i < s. The rank's index is a tensor, so every rank runs the same
graph text, and every step costs every rank the same (two c x c blocks).

Blocks run in fp32; a score matrix lives inside one block only. Dropout inside
attention is not supported. Grouped kv heads (SDPA's enable_gqa: fewer K and V
heads than queries) travel as they are and are repeated for their query heads
in each block; their gradients are summed back over those heads before they
travel.
"""

import math
from typing import Optional

import torch
from torch.utils.flop_counter import flop_registry

from gcompile import collectives
from gcompile.program import SHAPE_FUNCTIONS
from gcompile.torch_api import flash_attention_cpu, flash_attention_cpu_backward


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int, cp_rank: torch.Tensor, causal: bool,
              scale: float | None, group: str) -> torch.Tensor:
    """Exact attention of the rank's queries (B, nh, T/n, hs) against every cp rank's keys and values, alike."""
    return _RingAttention.apply(q, k, v, cp_rank, n, causal, scale or 1 / math.sqrt(q.shape[-1]), group)


def output_like(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int, cp_rank: torch.Tensor, causal: bool,
                scale: float | None, group: str) -> torch.Tensor:
    """`attention`'s output as shape propagation sees it, without walking the ring (each propagation of a cp graph
    did: a seventh of planning 1024 ranks): q's shape and dtype, laid out as the forward lays it out."""
    B, nh, T, _ = q.shape
    return q.new_empty(B, T, nh, v.shape[-1]).transpose(1, 2)


SHAPE_FUNCTIONS[attention] = output_like


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp_rank, n, causal, scale, group):
        ctx.n, ctx.causal, ctx.scale, ctx.group = n, causal, scale, group
        qf, out, lse = q.float(), None, None
        group_size = q.shape[1] // k.shape[1]
        for step, keys, values in _around(k, v, n, group, "forward"):
            keys, values = _repeated(keys, group_size), _repeated(values, group_size)
            for rows, cols, masked in _blocks(step, cp_rank, q.shape[2] // 2, causal):
                out, lse = ATTEND(out, lse, qf, keys, values, rows, cols, scale, masked)
        # laid out (B, T, nh, hs) in memory, as SDPA's output is: the captured graph views it that way
        out = out.to(q.dtype).transpose(1, 2).contiguous().transpose(1, 2)
        ctx.save_for_backward(q, k, v, out, lse, cp_rank)  # what the layer after saves too: held once
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cp_rank = ctx.saved_tensors
        qf, dout, outf = q.float(), dout.float(), out.float()
        dq, arriving = qf.new_zeros(qf.shape), None  # contiguous, as ATTEND_BACKWARD's sums are
        group_size = q.shape[1] // k.shape[1]
        for step, keys, values in _around(k, v, ctx.n, ctx.group, "backward"):
            keys, values = _repeated(keys, group_size), _repeated(values, group_size)
            dk, dv = keys.new_zeros(keys.shape), values.new_zeros(values.shape)
            for rows, cols, masked in _blocks(step, cp_rank, q.shape[2] // 2, ctx.causal):
                dq, dk, dv = ATTEND_BACKWARD(dq, dk, dv, dout, qf, keys, values, outf, lse, rows, cols, ctx.scale,
                                             masked)
            if group_size > 1:  # summed over each kv head's query heads
                dk, dv = (g.unflatten(1, (k.shape[1], group_size)).sum(2) for g in (dk, dv))
            grads = torch.stack([dk, dv])  # of the block's owner
            if arriving is not None:  # what the ranks before added, sent a step ago while this one computed
                grads = grads + collectives.wait(arriving)
            arriving = collectives.start_ring_shift(grads, ctx.group, f"backward grads {step}")
        dk, dv = collectives.wait(arriving)  # one more step brings each rank its own
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def _around(k: torch.Tensor, v: torch.Tensor, n: int, group: str, phase: str):
    """(step, keys, values) in fp32: this rank's, then the previous rank's, and so on round the ring; the
    next block's transfers are in flight while the caller works on the current one. K and V travel apart,
    not stacked, so nothing but the views of the layer's own output is held for backward."""
    for step in range(n):
        if step < n - 1:
            arriving = [collectives.start_ring_shift(x, group, f"{phase} {name} {step + 1}")
                        for x, name in ((k, "k"), (v, "v"))]
        yield step, k.float(), v.float()
        if step < n - 1:
            k, v = (collectives.wait(x) for x in arriving)


def _repeated(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Each kv head repeated for the `group_size` query heads it serves (SDPA's enable_gqa); no copy without."""
    return x.repeat_interleave(group_size, 1) if group_size > 1 else x


def _blocks(step: int, cp_rank: torch.Tensor, c: int, causal: bool) -> list:
    """(query rows, key rows, causal mask?) of what the rank's queries see of the block held at `step`;
    rows None means all 2c."""
    if step == 0 or not causal:
        return [(None, None, causal and step == 0)]
    first = torch.arange(c, device=cp_rank.device)
    both = (cp_rank < step) * c + first  # a when the block's owner is earlier, b when later
    return [(first + c, first, False), (both, both, False)]


def _take(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return x if rows is None else x.index_select(2, rows)


def _add_at(x: torch.Tensor, rows: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    return x + y if rows is None else x.index_add(2, rows, y)


def _merge_into(out, lse, rows, block_out, block_lse) -> tuple[torch.Tensor, torch.Tensor]:
    """Online softmax: fold one block's result into the rows it covers."""
    old_out, old_lse = _take(out, rows), _take(lse, rows)
    new_lse = torch.logaddexp(old_lse, block_lse)
    merged = old_out * torch.exp(old_lse - new_lse)[..., None] + block_out * torch.exp(block_lse - new_lse)[..., None]
    if rows is None:
        return merged, new_lse
    return out.index_copy(2, rows, merged), lse.index_copy(2, rows, new_lse)


# One block's attention and its gradients are ops of their own, opaque to the compiler: traced open, the
# partitioner would find the backward's score matrix equal to the forward's and keep every block's (T/n)^2
# scores from forward to backward instead of recomputing them, which is most of what the ring saves. Each op
# also takes its block's rows and folds its result into the rank's (the merge, the gradients' sums): a few
# nodes a block instead of some twenty, which lowering, the passes and the planner walk at every step of
# every layer. On CPU a block is SDPA's fused kernels (25x the formula's speed here); elsewhere the formula,
# which tests/test_context_parallel.py checks against them.

@torch.library.custom_op("gcompile::attend_block", mutates_args=())
def _attend_block(out: Optional[torch.Tensor], lse: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, rows: Optional[torch.Tensor], cols: Optional[torch.Tensor], scale: float,
                  causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank's output (B, heads, L, hs) and log-sum-exp per query (B, heads, L) with one block folded in:
    q's `rows` against k's and v's `cols` (None: all). `out` and `lse` are None before the first block."""
    block_out, block_lse = block(_take(q, rows), _take(k, cols), _take(v, cols), scale, causal)
    if out is None:
        return block_out, block_lse
    return _merge_into(out, lse, rows, block_out, block_lse)


@_attend_block.register_fake
def _(out, lse, q, k, v, rows, cols, scale, causal):
    return q.new_empty(*q.shape[:-1], v.shape[-1]), q.new_empty(q.shape[:-1])


@torch.library.custom_op("gcompile::attend_block_backward", mutates_args=())
def _attend_block_backward(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, dout: torch.Tensor,
                           q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                           rows: Optional[torch.Tensor], cols: Optional[torch.Tensor], scale: float,
                           causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) with one block's gradients added at its rows and cols, given the whole attention's output and
    log-sum-exp for its queries: with those the block's probabilities are its share of the full softmax, so
    the blocks' gradients add up exactly."""
    dq_b, dk_b, dv_b = block_backward(_take(dout, rows), _take(q, rows), _take(k, cols), _take(v, cols),
                                      _take(out, rows), _take(lse, rows), scale, causal)
    return _add_at(dq, rows, dq_b), _add_at(dk, cols, dk_b), _add_at(dv, cols, dv_b)


@_attend_block_backward.register_fake
def _(dq, dk, dv, dout, q, k, v, out, lse, rows, cols, scale, causal):
    return dq.new_empty(dq.shape), dk.new_empty(dk.shape), dv.new_empty(dv.shape)


ATTEND, ATTEND_BACKWARD = torch.ops.gcompile.attend_block.default, torch.ops.gcompile.attend_block_backward.default


def block_flops(out, lse, q, k, v, rows, cols, scale, causal, out_val) -> int:
    """ATTEND's FLOPs, SDPA's formula at the block's shapes (flop_registry's calling convention)."""
    return _SDPA_FLOPS(_rows(q, rows), _rows(k, cols), _rows(v, cols))


def block_backward_flops(dq, dk, dv, dout, q, k, v, out, lse, rows, cols, scale, causal, out_val) -> int:
    return _SDPA_BACKWARD_FLOPS(_rows(dout, rows), _rows(q, rows), _rows(k, cols), _rows(v, cols))


_SDPA_FLOPS = flop_registry[torch.ops.aten._scaled_dot_product_flash_attention]
_SDPA_BACKWARD_FLOPS = flop_registry[torch.ops.aten._scaled_dot_product_flash_attention_backward]


def _rows(x: torch.Tensor, rows: torch.Tensor | None) -> tuple[int, ...]:
    """The shape of `x`'s `rows` (dim 2)."""
    return tuple(x.shape) if rows is None else (*x.shape[:2], rows.numel(), *x.shape[3:])


def block(q, k, v, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of one block and its log-sum-exp per query, (B, heads, L, hs) and (B, heads, L)."""
    if q.device.type == "cpu":
        out, lse = flash_attention_cpu(q, k, v, causal, scale)
        return out.contiguous(), lse.contiguous()
    return block_by_formula(q, k, v, scale, causal)


def block_backward(dout, q, k, v, out, lse, scale: float, causal: bool):
    """(dq, dk, dv) of one block."""
    if q.device.type == "cpu":
        return tuple(g.contiguous() for g in flash_attention_cpu_backward(dout, q, k, v, out, lse, causal, scale))
    return block_backward_by_formula(dout, q, k, v, out, lse, scale, causal)


def block_by_formula(q, k, v, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    scores = _scores(q, k, scale, causal)
    lse = torch.logsumexp(scores, -1)
    return torch.matmul(torch.exp(scores - lse[..., None]), v), lse


def block_backward_by_formula(dout, q, k, v, out, lse, scale: float, causal: bool):
    probs = torch.exp(_scores(q, k, scale, causal) - lse[..., None])
    delta = (dout * out).sum(-1, keepdim=True)  # rowsum(dO * O), softmax's backward term
    dscores = probs * (torch.matmul(dout, v.transpose(-2, -1)) - delta) * scale
    dv = torch.matmul(probs.transpose(-2, -1), dout)
    return torch.matmul(dscores, k), torch.matmul(dscores.transpose(-2, -1), q), dv


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if causal:
        above = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    return scores
