"""Sequence parallelism (Megatron-LM's) as a rewrite of a tensor-parallel program.

Outside the column/row-parallel blocks, tensor parallelism leaves every tp rank
doing the same work on the whole sequence (LayerNorm, dropout, residual adds).
Here those regions hold T/tp tokens each: the sum at the end of a row-parallel
block becomes a reduce-scatter along the sequence, the copy into a
column-parallel block an all-gather.

Requires: the tensor_parallel pass ran (its `copy_to_tp` / `reduce_from_tp`
  nodes mark where the blocks start and end); activations are (B, T, ...), the
  sequence on dim 1, and T is divisible by tp (config.validate checks it).
Ensures: every node between a reduce-scatter and the next all-gather is
  token-wise (elementwise, LayerNorm over the hidden dim, linear) and holds T/tp
  tokens; a replicated value used there is either cut to the rank's tokens
  (`scatter_to_sequence`, when it has the sequence dim) or has its gradient
  summed over tp (`copy_to_tp`: each rank's tokens contribute only part of it);
  nodes it makes carry `meta["pass"] == "sequence_parallel"`.

Rewrite (n = tp):

    before (after tensor_parallel)           after
    h = reduce_from_tp(partial)   # (B,T,C)  h = reduce_scatter_to_sequence(partial, 1, n)   # (B,T/n,C)
    x = copy_to_tp(h)                        x = gather_from_sequence(h, 1, n)               # (B,T,C)
    layer_norm(h, [C], w, b)                 layer_norm(h, [C], copy_to_tp(w), copy_to_tp(b))
    add(h, b_o)                              add(h, copy_to_tp(b_o))
    add(e, pos)                   # pos (T,C) add(e, scatter_to_sequence(pos, 0, n, tp_rank))
"""

import torch
import torch.fx as fx

from gcompile import tp_ops
from gcompile.pass_manager import PassContext, register_pass
from gcompile.program import Program, Stage
from passes.rewrite import GraphMismatch, insert_call, rank_constant

NAME = "sequence_parallel"
SEQ_DIM = 1
aten = torch.ops.aten

TOKEN_WISE = (aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.dropout.default,
              aten.gelu.default, aten.relu.default, aten.silu.default, aten.tanh.default, aten.clone.default,
              aten.neg.default, aten.rsqrt.default, aten.pow.Tensor_Scalar, aten.to.dtype, aten._to_copy.default,
              aten.layer_norm.default, aten.linear.default, aten.mean.dim, aten.sum.dim_IntList)
"""Ops that compute each token from that token alone: they run unchanged on a slice of the sequence
(a norm over the hidden dim, LayerNorm or RMSNorm's mean of squares, included; `_check_token_wise`
refuses a reduction over the sequence)."""
REDUCTIONS = (aten.mean.dim, aten.sum.dim_IntList)


@register_pass(NAME)
def sequence_parallel_pass(program: Program, ctx: PassContext) -> Program:
    if "tensor_parallel" not in program.history:
        raise ValueError(f"{NAME} rewrites what tensor_parallel made; run that pass first "
                         f"(passes so far: {', '.join(program.history)})")
    program = program.clone()
    for stage in program.stages:
        _shard_sequence(stage, ctx)
    return program


def _shard_sequence(stage: Stage, ctx: PassContext) -> None:
    graph, tp = stage.graph.graph, ctx.coords.size("tp")
    seq = ctx.config.train.seq_length
    sharded: set[fx.Node] = set()
    """Nodes whose output holds this rank's T/tp tokens."""
    for node in list(graph.nodes):
        if node.target is tp_ops.reduce_from_tp:
            shape = tuple(node.meta["val"].shape)
            if len(shape) < 2 or shape[SEQ_DIM] != seq:
                raise GraphMismatch(NAME, node, f"sums a {list(shape)} tensor over tp, which has no sequence "
                                                f"dim of {seq} at dim {SEQ_DIM} to scatter")
            sharded.add(_replace(node, tp_ops.reduce_scatter_to_sequence, (node.args[0], SEQ_DIM, tp)))
        elif node.target is tp_ops.copy_to_tp and node.args[0] in sharded:
            _replace(node, tp_ops.gather_from_sequence, (node.args[0], SEQ_DIM, tp))
        elif any(a in sharded for a in node.all_input_nodes):
            _check_token_wise(node)
            node.args = tuple(_local_operand(a, node, sharded, stage, ctx) for a in node.args)
            sharded.add(node)
    graph.lint()


def _replace(node: fx.Node, fn, args: tuple) -> fx.Node:
    new = insert_call(node, fn, args, NAME)
    node.replace_all_uses_with(new)
    node.graph.erase_node(node)
    return new


def _check_token_wise(node: fx.Node) -> None:
    if node.op == "output":
        raise GraphMismatch(NAME, node, "returns a sequence-sharded tensor; a column-parallel block (all-gather) "
                                        "must come before the end of the program")
    if node.target not in TOKEN_WISE:
        raise GraphMismatch(NAME, node, "reads a sequence-sharded tensor but mixes tokens or is not known to be "
                                        "token-wise; tokens may only meet inside tensor-parallel blocks: make "
                                        "attention's projections column then row parallel and the embedding "
                                        "vocab-parallel in tp_plan")
    if node.target is aten.layer_norm.default and len(node.args[1]) > node.meta["val"].dim() - 2:
        raise GraphMismatch(NAME, node, f"normalizes over {node.args[1]}, which includes the sequence dim")
    if node.target in REDUCTIONS:
        ndim = node.args[0].meta["val"].dim()
        if any(d % ndim <= SEQ_DIM for d in node.args[1]):
            raise GraphMismatch(NAME, node, f"reduces over dims {node.args[1]}, which include the batch or "
                                            f"sequence dim")


def _local_operand(arg, node: fx.Node, sharded: set[fx.Node], stage: Stage, ctx: PassContext):
    """What `node` must read instead of `arg` when it runs on the rank's tokens only."""
    if not isinstance(arg, fx.Node) or arg in sharded or not arg.meta["val"].dtype.is_floating_point:
        return arg
    out_ndim, shape = node.meta["val"].dim(), tuple(arg.meta["val"].shape)
    dim = SEQ_DIM - (out_ndim - len(shape))  # the operand's dim that broadcasts against the sequence
    if dim >= 0 and shape[dim] > 1:
        tp_rank = rank_constant(stage, "tp_rank", ctx.coords.axis_rank("tp"))
        return insert_call(node, tp_ops.scatter_to_sequence, (arg, dim, ctx.coords.size("tp"), tp_rank), NAME, before=True)
    return insert_call(node, tp_ops.copy_to_tp, (arg,), NAME, before=True)
