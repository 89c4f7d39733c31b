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
  token-wise (elementwise, LayerNorm over the hidden dim, linear) or a MoE layer's
  routing of the rank's tokens (passes/token_rows.py), and holds T/tp tokens; the
  load-balancing loss reads the micro-batch's tokens per expert and mean router
  probabilities (sums over tp); a replicated value used there is either cut to the rank's tokens
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
    view(h, [B*T, C])                        view(h, [B*T/n, C])          # a MoE layer's rows of tokens
    grouped_mm(rows, w, ends)                grouped_mm(rows, copy_to_tp(w), ends)   # ends: the rank's counts
    to(report(per_expert))                   to(report(sum_counts(per_expert, "tp")))
    mean(probs, [0])                         mean_over_sequence(mean(probs, [0]), n)
    copy_to_tp(k)        # MQA: (B,1,T,hs)   gather_from_sequence(k, 2, n)       # whole against the cut heads
    scatter_to_tp(k, 1, n, tp_rank)          rank_part(gather_from_sequence(k, 2, n), 1, n, tp_rank)
"""

import operator

import torch
import torch.fx as fx

from gcompile import tp_ops
from gcompile.pass_manager import PassContext, register_pass
from gcompile.program import Program, Stage
from passes.rewrite import GraphMismatch, insert_call, rank_constant, replace_call
from passes.tensor_parallel import NLL_LOSSES, NORMS, VIEWS, is_elementwise
from passes.token_rows import ALONG, APART, GROUPED_MM, REORDERS, ROUTING, TokenRows

NAME = "sequence_parallel"
SEQ_DIM = 1
aten = torch.ops.aten

TOKEN_WISE = (aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.dropout.default,
              aten.gelu.default, aten.relu.default, aten.silu.default, aten.tanh.default, aten.clone.default,
              aten.neg.default, aten.rsqrt.default, aten.pow.Tensor_Scalar, aten.to.dtype, aten._to_copy.default,
              aten.layer_norm.default, aten.rms_norm.default, aten.type_as.default, aten.linear.default,
              aten.mean.dim, aten.sum.dim_IntList)
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
        _Sharder(stage, ctx).run()
    return program


class _Sharder(TokenRows):
    """Follows the rank's T/tp tokens from each reduce-scatter to the next all-gather."""

    name, group = NAME, tp_ops.GROUP

    def __init__(self, stage: Stage, ctx: PassContext):
        self.stage, self.ctx, self.n = stage, ctx, ctx.coords.size("tp")
        self.dims, self.merged, self.counts, self.totals = {}, {}, set(), {}

    def run(self) -> None:
        graph, seq = self.stage.graph.graph, self.ctx.config.train.seq_length
        for node in list(graph.nodes):
            if node.target is tp_ops.reduce_from_tp:
                shape = tuple(node.meta["val"].shape)
                if len(shape) < 2 or shape[SEQ_DIM] != seq:
                    raise GraphMismatch(NAME, node, f"sums a {list(shape)} tensor over tp, which has no sequence "
                                                    f"dim of {seq} at dim {SEQ_DIM} to scatter")
                self.dims[replace_call(node, tp_ops.reduce_scatter_to_sequence, (node.args[0], SEQ_DIM, self.n), NAME)] = SEQ_DIM
            elif node.target in (tp_ops.copy_to_tp, tp_ops.scatter_to_tp) and node.args[0] in self.dims:
                self.gather(node)
            elif any(a in self.dims for a in node.all_input_nodes):
                self.propagate(node)
            elif any(a in self.counts for a in node.all_input_nodes):
                self.read_count(node)
        graph.lint()

    def gather(self, node: fx.Node) -> None:
        """The rank's tokens read whole: into a column-parallel block, or as a value tensor parallel reads whole
        against the cut heads (the kv heads of a Linear the plan leaves whole: MQA), or its rows for the rank's
        heads (`scatter_to_tp`, kv heads repeated to every query head). An all-gather of the sequence, whose
        backward reduce-scatters the gradient: sums each rank's part (its heads') and keeps the rank's tokens."""
        x = node.args[0]
        if x in self.merged:
            raise GraphMismatch(NAME, node, "gathers the rank's tokens from a view of them as rows; a "
                                            "column-parallel block reads (B, T, ...) activations")
        target, part = node.target, node.args[1:]
        gathered = replace_call(node, tp_ops.gather_from_sequence, (x, self.dims[x], self.n), NAME)
        if target is tp_ops.scatter_to_tp:
            rows = insert_call(gathered, tp_ops.rank_part, (gathered, *part), NAME)
            gathered.replace_all_uses_with(rows, delete_user_cb=lambda user: user is not rows)

    def propagate(self, node: fx.Node) -> None:
        """Rewrite `node`, which reads the rank's tokens: a token-wise op, or a MoE layer's routing (TokenRows)."""
        x = node.args[0] if node.args else None
        if isinstance(x, (list, tuple)):  # cat's tensors
            x = x[0]
        dim = self.dims.get(x)
        if node.target in VIEWS and dim is not None:
            self.token_view(node, dim)
        elif node.target in (aten.index_select.default, aten.index_add.default):
            self.index(node)
            node.update_arg(0, self.whole_operand(node.args[0], node))  # the experts' biases: a table
        elif node.target is GROUPED_MM:
            self.grouped_mm(node)
            node.update_arg(1, self.whole_operand(node.args[1], node))  # the experts' weights
        elif self.is_reduction_of_tokens(node, dim):
            self.reduce(node)
        elif node.target in ALONG and dim is not None:
            self.along(node, dim)
        elif node.target in ROUTING + (operator.getitem,) and dim is not None:
            self.dims[node] = dim
        elif node.target is aten.unsqueeze.default and dim is not None:
            self.dims[node] = dim + (node.args[1] % node.meta["val"].dim() <= dim)
        elif node.target in REORDERS and dim is not None:
            self.reorder(node, dim)
        elif node.target in APART and dim is not None:
            self.along_other_dim(node, dim)
        else:
            dim = self.token_wise(node)
            node.args = tuple(self.local_operand(a, node, dim) for a in node.args)
            self.dims[node] = dim
        if node in self.dims:
            self.inherit_merged(node)

    def token_wise(self, node: fx.Node) -> int:
        """The dim of the rank's tokens in what `node` returns; GraphMismatch unless it works token by token."""
        if node.op == "output":
            raise GraphMismatch(NAME, node, "returns a sequence-sharded tensor; a column-parallel block (all-gather) "
                                            "must come before the end of the program")
        if node.target in (aten.cross_entropy_loss.default, *NLL_LOSSES):
            raise GraphMismatch(NAME, node, "is the loss over logits of the rank's tokens only: make the output head "
                                            "vocab-parallel in tp_plan (its input is then gathered over the sequence)")
        if node.target not in TOKEN_WISE and not is_elementwise(node.target):
            raise GraphMismatch(NAME, node, "reads a sequence-sharded tensor but mixes tokens or is not known to be "
                                            "token-wise; tokens may only meet inside tensor-parallel blocks: make "
                                            "attention's projections column then row parallel and the embedding "
                                            "vocab-parallel in tp_plan")
        ndim = node.meta["val"].dim()
        dims = {self.dims[a] + ndim - a.meta["val"].dim() for a in node.all_input_nodes if a in self.dims}
        if len(dims) != 1:
            raise GraphMismatch(NAME, node, f"combines values holding the rank's tokens on different dims {dims}")
        dim = dims.pop()
        if node.target in NORMS and len(node.args[1]) > ndim - 1 - dim:
            raise GraphMismatch(NAME, node, f"normalizes over {node.args[1]}, which includes the sequence dim")
        if node.target in REDUCTIONS:
            reduced = node.args[0].meta["val"].dim()
            if any(d % reduced <= dim for d in node.args[1]):
                raise GraphMismatch(NAME, node, f"reduces over dims {node.args[1]}, which include the batch or "
                                                f"sequence dim")
        return dim

    def local_operand(self, arg, node: fx.Node, dim: int):
        """What `node` must read instead of `arg` when it runs on the rank's tokens only (tokens on `dim`)."""
        if not isinstance(arg, fx.Node) or arg in self.dims or not arg.meta["val"].dtype.is_floating_point:
            return arg
        if node.target is aten.linear.default:
            return self.whole_operand(arg, node)
        out_ndim, shape = node.meta["val"].dim(), tuple(arg.meta["val"].shape)
        at = dim - (out_ndim - len(shape))  # the operand's dim that broadcasts against the tokens
        if at < 0 or shape[at] == 1:
            return self.whole_operand(arg, node)
        if node in self.merged or any(a in self.merged for a in node.all_input_nodes):
            raise GraphMismatch(NAME, node, "reads a whole value against rows of the rank's tokens; sequence "
                                            "parallel cuts whole values along a (B, T, ...) sequence dim only")
        tp_rank = rank_constant(self.stage, "tp_rank", self.ctx.coords.axis_rank("tp"))
        return insert_call(node, tp_ops.scatter_to_sequence, (arg, at, self.n, tp_rank), NAME, before=True)

    def whole_operand(self, arg, node: fx.Node):
        """A value every tp rank holds whole (a weight, a norm's scale) read with the rank's tokens: each rank's
        tokens give part of its gradient, which copy_to_tp sums over tp."""
        if not isinstance(arg, fx.Node) or arg in self.dims or not arg.meta["val"].dtype.is_floating_point:
            return arg
        return insert_call(node, tp_ops.copy_to_tp, (arg,), NAME, before=True)

    def report_count(self, report: fx.Node) -> None:
        """Reports are not added over tp when logged: the report reads the micro-batch's count; routing that read
        it reads the rank's."""
        count = report.args[0]
        for user in [u for u in report.users if self.routes(u)]:
            user.replace_input_with(report, count)
        report.update_arg(0, self.whole_count(count, report))

    def rank_mean(self, mean: fx.Node) -> None:
        """The loss is every tp rank's alike: the rank's mean becomes the micro-batch's."""
        whole = insert_call(mean, tp_ops.mean_over_sequence, (mean, self.n), NAME)
        mean.replace_all_uses_with(whole, delete_user_cb=lambda user: user is not whole)
