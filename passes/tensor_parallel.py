"""Tensor parallelism (Megatron-LM's layout) as a rewrite of the captured forward program.

The plan (`[parallel] tp_plan`, see gcompile/tp_plan.py) says which modules are
column-parallel, row-parallel or vocab-parallel; this pass cuts their parameter
placeholders to the rank's piece and rewrites the graph between them for local
shapes, inserting the differentiable collectives of gcompile/tp_ops.py.

Requires: stage graphs as capture makes them: linears are `aten.linear`,
  embeddings `aten.embedding` and the loss `aten.cross_entropy_loss` (or log_softmax
  then `nll_loss` or `gather`; a z-loss's logsumexp), linears and embeddings taking
  parameter placeholders directly; every tensor a column-parallel (or vocab) linear
  produces reaches a row-parallel linear or the loss through ops this pass knows
  (split, view, transpose, attention: SDPA or batched matmuls and softmax over the
  heads, activations). Anything else is refused with the node, its op and its source line.
Ensures: parameter placeholders hold the local shape (`meta["val"]`) and their
  `Param.shards` say how the full tensor was cut; the graph text is the same on
  every tp rank (the rank comes in as the rank constant `tp_rank`); each node
  the pass makes has `meta["pass"] == "tensor_parallel"`.

Rewrite (n = tp, full sizes on the left; one attention block, the MLP alike):

    before                                      after
    h = linear(x, W_qkv, b_qkv)    # (B,T,3C)   h = linear(copy_to_tp(x), W_qkv[r], b_qkv[r])   # (B,T,3C/n)
    q, k, v = split(h, C, 2)                    q, k, v = split(h, C/n, 2)    # W_qkv[r]: rank r's heads of q, k, v
    view(q, [B, T, nh, hs])                     view(q, [B, T, nh/n, hs])
    y = sdpa(q, k, v); view(y, [B, T, C])       y = sdpa(q, k, v); view(y, [B, T, C/n])
    o = linear(y, W_o, b_o)                     o = reduce_from_tp(linear(y, W_o[:, r])) + b_o
    e = embedding(W_te, idx)                    e = reduce_from_tp(vocab_parallel_embedding(W_te[r], idx, tp_rank))
    z = linear(x, W_te)            # (B,T,V)    z = linear(copy_to_tp(x), W_te[r])            # (B,T,Vp/n)
    cross_entropy_loss(view(z, [-1, V]), t)     vocab_parallel_cross_entropy(view(z, [-1, Vp/n]), t, tp_rank, V, ...)
    log_softmax(z, -1)                          vocab_parallel_log_softmax(z, 2, tp_rank, V)  # max, sum of exp over tp
    logsumexp(z, [-1])                          vocab_parallel_logsumexp(z, 2, False, tp_rank, V)

Vp is the vocab padded to a multiple of make_vocab_size_divisible_by * n; the
padded rows are zeros that no id selects and no loss term sees.
"""

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from gcompile import tp_ops
from gcompile.canonical import VIEWS
from gcompile.layout import Param, Shard
from gcompile.pass_manager import PassContext, register_pass
from gcompile.program import Program, Stage
from gcompile.tp_plan import Plan, module_of, padded_vocab_size, parse_plan
from gcompile.torch_api import is_op_overload
from passes.rewrite import GraphMismatch, fake_like, insert_call, rank_constant, replace_call

NAME = "tensor_parallel"
aten = torch.ops.aten

SHAPE_PRESERVING = (aten.gelu.default, aten.relu.default, aten.silu.default, aten.tanh.default, aten.neg.default,
                    aten.pow.Tensor_Scalar,
                    aten.dropout.default, aten.clone.default, aten.contiguous.default, aten.to.dtype,
                    aten._to_copy.default, aten.type_as.default)
"""Ops that act element by element on one tensor: the cut passes through them unchanged."""
BROADCASTING = (aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.masked_fill.Tensor,
                aten.where.ScalarOther, aten.where.ScalarSelf)
"""Element-wise ops over several tensors: cut inputs must be cut alike, the others broadcast over the cut dim
(RoPE's q * cos, SwiGLU's silu(gate) * up)."""
SOFTMAX = (aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default)
INSTEAD = {
    aten.einsum.default: "an einsum is not cut by heads here: write it with @ (torch.matmul) over the heads",
    aten.repeat_interleave.self_Tensor: "repeating by a tensor of counts is not cut here: repeat by an int",
    aten.repeat.default: "tiling with repeat is not cut here: repeat each kv head with repeat_interleave(n, dim) "
                         "or expand and reshape",
}
"""Ops the pass refuses over a cut tensor, each with what to write instead."""
REDUCTIONS = (aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default, aten.sum.default,
              aten.mean.default)
"""Ops that reduce over the dims they are given (args[1]; every dim where none are), keeping them as 1 where
args[2] (keepdim) is set."""
SUMS = (aten.sum.dim_IntList, aten.sum.default)
MEANS = (aten.mean.dim, aten.mean.default)
SPLITS = (aten.split.Tensor, aten.split_with_sizes.default)
NLL_LOSSES = (aten.nll_loss_nd.default, aten.nll_loss.default)
"""F.nll_loss: (input, target, weight, reduction, ignore_index), the classes on dim 1."""
NORMS = (aten.layer_norm.default, aten.rms_norm.default)
"""Norms over the last len(args[1]) dims, with a weight (and bias) every rank holds whole."""


def is_elementwise(target) -> bool:
    """Ops that compute each entry from the entries at its place (broadcasting), so from its token and feature
    alone: torch's pointwise ops, and floor_divide (a routed copy's token), which torch does not tag."""
    return target is aten.floor_divide.default or is_op_overload(target) and torch.Tag.pointwise in target.tags


@dataclass(frozen=True)
class Cut:
    """How a tensor of the rewritten graph is split over the tp ranks."""

    dim: int
    local: int
    """Entries of `dim` on one rank."""
    full: int
    """Entries of `dim` on one device (before padding)."""
    source: str
    """The module whose parameters cut it, for error messages."""
    parts: tuple[int, ...] = ()
    """`dim` holds fused parts (q, k, v) of these full sizes, each cut on its own; () for one."""

    def alike(self, other: "Cut") -> bool:
        """Cut the same way, whichever module cut it: element-wise ops may combine them."""
        return (self.dim, self.local, self.full, self.parts) == (other.dim, other.local, other.full, other.parts)


@register_pass(NAME)
def tensor_parallel_pass(program: Program, ctx: PassContext) -> Program:
    program = program.clone()
    plan = parse_plan(ctx.config.tp_plan)
    for stage in program.stages:
        _Sharder(stage, plan, ctx).run()
    return program


class _Sharder:
    def __init__(self, stage: Stage, plan: Plan, ctx: PassContext):
        self.stage, self.plan, self.ctx = stage, plan, ctx
        self.tp = ctx.coords.size("tp")
        self.graph = stage.graph.graph
        self.placement: dict[fx.Node, str] = {}
        """Placement of each sharded parameter placeholder."""
        self.cuts: dict[fx.Node, Cut] = {}
        """Every activation the rewrite has made rank-local so far."""
        self.part_cuts: dict[fx.Node, list[Cut]] = {}
        """Per split along a cut dim into fused parts, how each part is cut."""
        self.copies: dict[fx.Node, fx.Node] = {}
        """copy_to_tp(x) by x, shared by the column-parallel linears that read x and the ops that read it against
        a cut tensor (`whole_operand`)."""

    def run(self) -> None:
        self.shard_params()
        for node in list(self.graph.nodes):
            if node.target is aten.embedding.default and node.args[0] in self.placement:
                self.rewrite_embedding(node)
            elif node.target is aten.linear.default and node.args[1] in self.placement:
                if self.placement[node.args[1]] == "row":
                    self.rewrite_row(node)
                else:
                    self.rewrite_column(node)
            elif any(a in self.cuts for a in node.all_input_nodes):
                self.propagate(node)
        self.graph.lint()

    # -- parameters -------------------------------------------------------------------------------

    def shard_params(self) -> None:
        nodes = self.stage.placeholders()
        for i, param in enumerate(self.stage.params):
            placement, node = self.plan.placement(module_of(param.name)), nodes[i]
            if placement == "replicate" or (placement == "row" and param.name.endswith(".bias")):
                continue  # a row-parallel bias is added once, after the sum over ranks
            self.check_uses(node, param.name, placement)
            transposes = [user for user in node.users if user.target is aten.t.default]  # HF's Conv1D: (in, out)
            out_dim = 1 if transposes else 0
            if placement == "vocab":
                v = self.ctx.config.parallel.make_vocab_size_divisible_by
                shard = Shard("tp", 0, padded_size=padded_vocab_size(param.full_shape[0], v, self.tp))
            elif placement == "row":
                shard = Shard("tp", 1 - out_dim)
            else:
                shard = Shard("tp", out_dim, parts=self.fused_parts(node))
            if param.full_shape[shard.dim] % self.tp and shard.padded_size is None:
                raise GraphMismatch(NAME, node, f"{param.name} has {param.full_shape[shard.dim]} entries on the dim "
                                                f"{placement}-parallel cuts (dim {shard.dim}), not divisible by "
                                                f"tp={self.tp}")
            self.stage.params[i] = param = param.with_shard(shard)
            node.meta["val"] = fake_like(node, param.local_shape(self.ctx.coords.axis_sizes))
            for user in [node, *transposes]:
                self.placement[user] = placement

    def check_uses(self, node: fx.Node, name: str, placement: str) -> None:
        allowed = {(aten.linear.default, 1), (aten.linear.default, 2)}
        if placement == "vocab":
            allowed = {(aten.linear.default, 1), (aten.linear.default, 2), (aten.embedding.default, 0)}
        for user in node.users:
            if user.target is aten.t.default and placement != "vocab" and user.users and \
                    all(u.target is aten.linear.default and u.args[1] is user for u in user.users):
                continue  # a linear of the transpose: HF's Conv1D, its weight (in, out) (gcompile.canonical)
            if not any(user.target is op and len(user.args) > i and user.args[i] is node for op, i in allowed):
                raise GraphMismatch(NAME, user, f"uses {name}, which the plan makes {placement}-parallel; "
                                                f"only a linear (F.linear or x @ W.T; for vocab, an embedding too) "
                                                f"may use it: leave it out of tp_plan")

    def fused_parts(self, param: fx.Node) -> tuple[int, ...]:
        """The sizes of the parts the outputs of the linears using `param` are split into right away (q, k, v;
        unequal with grouped kv heads), maybe after ops of that output alone that keep its shape (MPT's
        clip_qkv clamp); () for no split."""
        parts = set()
        for linear in [u for user in param.users for u in (user.users if user.target is aten.t.default else [user])]:
            value, out = linear, linear.meta["val"].shape
            while len(value.users) == 1 and _keeps_shape(next(iter(value.users)), value):
                value = next(iter(value.users))
            users = list(value.users)
            split = users[0] if len(users) == 1 and users[0].target in SPLITS else None
            if split is None or _dim((*split.args, 0)[2], len(out)) != len(out) - 1:
                parts.add(())
            elif split.target is aten.split.Tensor:
                parts.add((split.args[1],) * (out[-1] // split.args[1]) if split.args[1] < out[-1] else ())
            else:
                parts.add(tuple(split.args[1]))
        if len(parts) > 1:
            raise GraphMismatch(NAME, param, f"is used by linears whose outputs are split differently ({parts})")
        return parts.pop()

    # -- the sharded modules ----------------------------------------------------------------------

    def rewrite_column(self, linear: fx.Node) -> None:
        x, weight = linear.args[0], linear.args[1]
        if x in self.cuts:
            raise GraphMismatch(NAME, linear, f"is column-parallel but its input is already cut by "
                                              f"{self.cuts[x].source}; put a row-parallel linear between them")
        if x not in self.copies:
            self.copies[x] = insert_call(linear, tp_ops.copy_to_tp, (x,), NAME, before=True)
            if "nn_module_stack" in linear.meta:  # the linear's block's, on its pipeline stage: made on the stage
                # before (a post-norm block reads its input itself), it was sent there with the input, an alias
                # autograd gives no gradient
                self.copies[x].meta["nn_module_stack"] = linear.meta["nn_module_stack"]
        linear.args = (self.copies[x], *linear.args[1:])
        param = self.param_of(weight)
        out = linear.meta["val"].shape
        shard = param.shards[0]
        self.cuts[linear] = Cut(dim=len(out) - 1, local=param.local_shape(self.ctx.coords.axis_sizes)[shard.dim],
                                full=out[-1], source=module_of(param.name), parts=shard.parts)

    def rewrite_row(self, linear: fx.Node) -> None:
        x, weight, bias = (*linear.args, None)[:3]
        param = self.param_of(weight)
        cut, ndim = self.cuts.get(x), len(x.meta["val"].shape)
        takes = param.full_shape[param.shards[0].dim]
        if cut is None or cut.dim != ndim - 1 or cut.parts or cut.local * self.tp != takes:
            raise GraphMismatch(NAME, linear, f"is row-parallel ({module_of(param.name)}) and needs its input cut on "
                                              f"the last dim by a column-parallel linear; the input is "
                                              f"{self._row_input(cut, ndim, takes)}")
        linear.args = (x, weight)
        out = insert_call(linear, tp_ops.reduce_from_tp, (linear,), NAME)
        result = out
        if bias is not None:
            result = insert_call(out, aten.add.Tensor, (out, bias), NAME)
        linear.replace_all_uses_with(result, delete_user_cb=lambda user: user is not out)

    def _row_input(self, cut: Cut | None, ndim: int, takes: int) -> str:
        """How a row-parallel linear's input is cut, where not as it needs."""
        if cut is None:
            return "replicated"
        if cut.dim != ndim - 1:
            return f"cut by {cut.source} on dim {cut.dim}"
        if cut.parts:
            return f"cut by {cut.source} into fused parts of sizes {list(cut.parts)}, each on its own"
        placement = self.plan.placement(cut.source)
        return f"cut by {cut.source} into {cut.local} a rank, {cut.local * self.tp} in all where it takes {takes}" + (
            f" (vocab pads the rows it cuts: it is for the embedding and the output head; make {cut.source} "
            f"column-parallel)" if placement == "vocab" else "")

    def rewrite_embedding(self, embedding: fx.Node) -> None:
        weight, idx, *options = embedding.args
        padding_idx, *rest = options or [-1]
        if rest not in ([], [False], [False, False]):
            raise GraphMismatch(NAME, embedding, f"has options {options} a vocab-parallel embedding does not support "
                                                 f"(scale_grad_by_freq, sparse)")
        partial = insert_call(embedding, tp_ops.vocab_parallel_embedding, (weight, idx, self.tp_rank(), padding_idx),
                              NAME)
        total = insert_call(partial, tp_ops.reduce_from_tp, (partial,), NAME)
        embedding.replace_all_uses_with(total)
        self.graph.erase_node(embedding)

    # -- what lies between them -------------------------------------------------------------------

    def propagate(self, node: fx.Node) -> None:
        """Rewrite `node`, which reads a cut tensor, for local sizes, and record how its output is cut."""
        if node.op == "output":
            raise GraphMismatch(NAME, node, "returns a tensor cut over tp; the plan must close every "
                                            "column-parallel block with a row-parallel linear or the loss")
        x = node.args[0]
        cut = self.cuts.get(x)
        if node.target is operator.getitem and cut is not None:
            self.cuts[node] = self.part_cuts[x][node.args[1]] if x in self.part_cuts else cut
        elif node.target in SHAPE_PRESERVING and cut is not None:
            self.cuts[node] = cut
        elif node.target in SPLITS and cut is not None:
            self.split(node, cut)
        elif node.target in VIEWS and cut is not None:
            self.view(node, cut)
        elif node.target in BROADCASTING or is_elementwise(node.target):
            self.broadcast(node)
        elif node.target is aten.slice.Tensor and cut is not None:
            self.slice(node, cut)
        elif node.target is aten.cat.default:
            self.cat(node)
        elif node.target is aten.unsqueeze.default and cut is not None:
            d = _dim(node.args[1], len(full_shape(node)))
            self.cuts[node] = _moved(cut, cut.dim + (d <= cut.dim))
        elif node.target is aten.select.int and cut is not None:
            d = _dim(node.args[1], len(full_shape(x)))
            if d == cut.dim:
                raise GraphMismatch(NAME, node, f"picks one entry of dim {d}, which {cut.source} cut over the tp "
                                                f"ranks")
            self.cuts[node] = _moved(cut, cut.dim - (d < cut.dim))
        elif node.target is aten.expand.default and cut is not None:
            self.expand(node, cut)
        elif node.target is aten.repeat_interleave.self_int and cut is not None:
            self.repeat_interleave(node, cut)
        elif node.target is aten.transpose.int and cut is not None:
            ndim = len(x.meta["val"].shape)
            d0, d1 = _dim(node.args[1], ndim), _dim(node.args[2], ndim)
            self.cuts[node] = _moved(cut, {d0: d1, d1: d0}.get(cut.dim, cut.dim))
        elif node.target is aten.permute.default and cut is not None:
            self.cuts[node] = _moved(cut, [_dim(d, len(full_shape(x))) for d in node.args[1]].index(cut.dim))
        elif node.target in REDUCTIONS and cut is not None:
            self.reduction(node, cut)
        elif node.target in NORMS and cut is not None:
            self.norm(node, cut)
        elif node.target is aten.scaled_dot_product_attention.default:
            self.attention(node)
        elif node.target is aten.matmul.default:
            self.batched_matmul(node)
        elif node.target in SOFTMAX and cut is not None:
            self.softmax(node, cut)
        elif node.target is aten.logsumexp.default and cut is not None:
            self.logsumexp(node, cut)
        elif node.target is aten.gather.default and cut is not None and node.args[2] not in self.cuts:
            self.gather(node, cut)
        elif node.target is aten.cross_entropy_loss.default and cut is not None:
            self.cross_entropy(node, cut)
        elif node.target in NLL_LOSSES and cut is not None:
            self.nll_loss(node, cut)
        elif node.target is aten.linear.default and cut is not None:
            raise GraphMismatch(NAME, node, f"is a linear over a tensor cut by {cut.source}, but the plan "
                                            f"replicates its weight; make it row-parallel in tp_plan")
        elif node.target in INSTEAD:
            source = next(self.cuts[a].source for a in node.all_input_nodes if a in self.cuts)
            raise GraphMismatch(NAME, node, f"reads a tensor cut by {source}; {INSTEAD[node.target]}")
        else:
            source = next(self.cuts[a].source for a in node.all_input_nodes if a in self.cuts)
            raise GraphMismatch(NAME, node, f"reads a tensor cut by {source}, but the pass only knows how to carry a "
                                            f"cut through split, view, transpose, permute, slice, cat, expand, "
                                            f"repeat_interleave (by a count), attention (SDPA, or matmuls and softmax "
                                            f"over a batch dim such as heads), norms and reductions over other dims, "
                                            f"and elementwise ops into a row-parallel linear or the loss")

    def split(self, node: fx.Node, cut: Cut) -> None:
        """Along another dim, each part keeps the cut; along the cut dim into the fused parts the linear was cut
        by (q, k, v, equal or not), each part is cut on its own."""
        x, size, *rest = node.args
        if _dim(rest[0] if rest else 0, len(full_shape(x))) != cut.dim:
            self.cuts[node] = cut
            return
        sizes = tuple(size) if node.target is aten.split_with_sizes.default else (size,) * -(-cut.full // size)
        if sizes != (cut.parts or (cut.full,)) or any(n % self.tp for n in sizes):
            raise GraphMismatch(NAME, node, f"splits dim {cut.dim} into parts of {list(sizes)}, but {cut.source} "
                                            f"cut it into parts of {list(cut.parts or (cut.full,))}, each over "
                                            f"{self.tp} ranks")
        node.args = (x, [n // self.tp for n in sizes] if isinstance(size, list) else size // self.tp, *rest)
        self.part_cuts[node] = [Cut(cut.dim, n // self.tp, n, cut.source) for n in sizes]
        self.cuts[node] = cut

    def view(self, node: fx.Node, cut: Cut) -> None:
        """A view keeps the cut if the cut dim stays the outermost of the dims it is merged or split into."""
        x, shape_in, shape_out = node.args[0], full_shape(node.args[0]), full_shape(node)
        before = math.prod(shape_in[:cut.dim])
        i = next((i for i, n in enumerate(shape_out) if math.prod(shape_out[:i]) == before and n > 1), None)
        padded = cut.local * self.tp != cut.full
        if i is None or cut.parts:
            local = None
        elif padded:  # only a view that keeps the dim as it is can carry padding
            same = shape_out[i] == cut.full and math.prod(shape_out[i + 1:]) == math.prod(shape_in[cut.dim + 1:])
            local = cut.local if same else None
        else:
            local = shape_out[i] // self.tp if shape_out[i] % self.tp == 0 else None
        if local is None:
            heads = f"; {shape_out[i]} (heads?) is not divisible by tp={self.tp}: choose a tp that divides it, or " \
                    f"give kv heads a Linear of their own and leave it out of tp_plan (fewer kv heads than " \
                    f"ranks are then read whole)" \
                if i is not None and not cut.parts and not padded and shape_out[i] % self.tp else ""
            raise GraphMismatch(NAME, node, f"reshapes {list(shape_in)} to {list(shape_out)}, which does not keep "
                                            f"dim {cut.dim} (cut by {cut.source}) whole over {self.tp} ranks{heads}")
        node.args = (x, [local if d == i else n for d, n in enumerate(shape_out)])
        self.cuts[node] = Cut(i, local, shape_out[i], cut.source)

    def broadcast(self, node: fx.Node) -> None:
        """Cut inputs cut alike; every other tensor input has the cut dim of the output as 1 or not at all, or is
        whole along it and no Linear's output (ALiBi's bias per head): its rank's part is read."""
        ndim = len(full_shape(node))
        tensors = [a for a in node.args if isinstance(a, fx.Node)]
        cuts = [_moved(self.cuts[a], self.cuts[a].dim + ndim - len(full_shape(a))) for a in tensors if a in self.cuts]
        cut = cuts[0]
        parts = {}
        for a in tensors:
            shape = full_shape(a)
            at = cut.dim - (ndim - len(shape))
            if a in self.cuts or at < 0 or shape[at] == 1:
                continue
            linear = self.linear_behind(a)
            if linear is None and self.splits_evenly(cut, shape[at]):  # a Linear's output: cut it instead
                parts[a] = self.rank_part(a, at, node)
            else:
                fix = f"; make {linear} {self.plan.placement(cut.source)}-parallel in tp_plan, as {cut.source} is" \
                    if linear else ""
                raise GraphMismatch(NAME, node, f"combines a tensor cut by {cut.source} on dim {cut.dim} with "
                                                f"{a.name}, which is whole along that dim (size {shape[at]}){fix}")
        if any(not c.alike(cut) for c in cuts):
            raise GraphMismatch(NAME, node, f"combines tensors cut differently: {cuts}")
        node.args = tuple(parts.get(a) or self.whole_operand(a, node) if isinstance(a, fx.Node) and a not in self.cuts
                          else a for a in node.args)
        self.cuts[node] = cut

    def splits_evenly(self, cut: Cut, size: int) -> bool:
        """Whether a whole dim of `size` splits over the tp ranks as `cut` did its own: the same full size, in
        one block, every rank an equal part."""
        return size == cut.full == cut.local * self.tp and not cut.parts

    def rank_part(self, value: fx.Node, dim: int, reader: fx.Node) -> fx.Node:
        """This rank's part along `dim` of a value every rank holds whole, read against a tensor cut there (ALiBi's
        bias per head, a gain per head, against the cut heads); its gradient is gathered from every rank's part."""
        return insert_call(reader, tp_ops.scatter_to_tp, (value, dim, self.tp, self.tp_rank()), NAME, before=True)

    def whole_operand(self, value: fx.Node, reader: fx.Node) -> fx.Node:
        """A value every rank holds whole, read against a cut one (a kv head shared by all query heads, a gate,
        a gain, a bias over the scores): each rank's part of the cut tensor gives part of its gradient, which
        copy_to_tp sums over tp. Without it each rank's copy learned from its own heads alone (relative error
        1e-3 in the loss, 0.6 in the gain's Adam state)."""
        if not value.meta["val"].dtype.is_floating_point:
            return value
        if value not in self.copies:
            self.copies[value] = insert_call(reader, tp_ops.copy_to_tp, (value,), NAME, before=True)
        return self.copies[value]

    def slice(self, node: fx.Node, cut: Cut) -> None:
        """A slice of another dim keeps the cut; of the cut dim only when it takes the whole dim."""
        x, dim = node.args[0], (*node.args, 0)[1]
        if _dim(dim, len(full_shape(x))) == cut.dim and full_shape(node)[cut.dim] != full_shape(x)[cut.dim]:
            raise GraphMismatch(NAME, node, f"slices dim {cut.dim}, which {cut.source} cut over the tp ranks; take "
                                            f"fused parts (q, k, v) apart with torch.split or slices that tile the "
                                            f"dim")
        self.cuts[node] = cut

    def cat(self, node: fx.Node) -> None:
        """Tensors cut alike, joined along another dim (RoPE's rotate_half)."""
        tensors, dim = (*node.args, 0)[:2]
        cuts = [self.cuts.get(t) for t in tensors]
        if None in cuts or any(not c.alike(cuts[0]) for c in cuts) or _dim(dim, len(full_shape(node))) == cuts[0].dim:
            raise GraphMismatch(NAME, node, "joins tensors that are not all cut alike on a dim other than the "
                                            "joined one")
        self.cuts[node] = cuts[0]

    def expand(self, node: fx.Node, cut: Cut) -> None:
        """The cut dim keeps its local size (GQA's kv heads, expanded over the query heads they serve)."""
        x, sizes = node.args[:2]
        at = cut.dim + len(sizes) - len(full_shape(x))
        node.args = (x, [cut.local if d == at else n for d, n in enumerate(sizes)], *node.args[2:])
        self.cuts[node] = _moved(cut, at)

    def repeat_interleave(self, node: fx.Node, cut: Cut) -> None:
        """Each entry repeated in place along one dim (GQA's kv heads, repeated for the query heads they serve):
        a rank's contiguous share of the cut dim repeated is its share of the result."""
        x, repeats, dim = (*node.args, None)[:3]
        if dim is None:
            raise GraphMismatch(NAME, node, f"repeats a tensor cut by {cut.source} flattened (no dim); repeat "
                                            f"along a dim")
        if _dim(dim, len(full_shape(x))) != cut.dim:
            self.cuts[node] = cut
            return
        if cut.parts or cut.local * self.tp != cut.full:
            raise GraphMismatch(NAME, node, f"repeats dim {cut.dim}, which {cut.source} cut into fused parts or "
                                            f"padded; repeat a tensor cut into whole heads")
        if node.kwargs.get("output_size") is not None:
            node.kwargs = {**node.kwargs, "output_size": cut.local * repeats}
        self.cuts[node] = Cut(cut.dim, cut.local * repeats, cut.full * repeats, cut.source)

    def batched_matmul(self, node: fx.Node) -> None:
        """Attention written by hand (q @ k^T, then the weights @ v): a product whose operands are cut alike on a
        batch dim (the heads) is that dim's products, each on the rank that holds it; a cut of the two matrix
        dims would be a contraction over ranks, which only a row-parallel linear makes."""
        ndim = len(full_shape(node))
        tensors = node.args[:2]
        if any(len(full_shape(t)) < 3 for t in tensors):
            raise GraphMismatch(NAME, node, "multiplies with a 1-D or 2-D operand (a vector or matrix product, not "
                                            "batched over the cut heads); a weight belongs in a Linear the plan cuts")
        cuts = [_moved(self.cuts[t], self.cuts[t].dim + ndim - len(full_shape(t))) for t in tensors if t in self.cuts]
        if cuts[0].dim >= ndim - 2:
            raise GraphMismatch(NAME, node, f"multiplies over dim {cuts[0].dim}, which {cuts[0].source} cut over "
                                            f"the tp ranks; only a batch dim (heads) of a product can be cut")
        self.broadcast(node)

    def reduction(self, node: fx.Node, cut: Cut) -> None:
        """Over other dims than the cut one (a hand-written softmax's max and sum, an RMSNorm's mean of squares
        over the head dim), each rank reduces what it holds."""
        x, dims, keepdim = (*node.args, None, False)[:3]
        ndim = len(full_shape(x))
        reduced = [_dim(d, ndim) for d in dims] if dims else list(range(ndim))  # none given: every dim
        if cut.dim not in reduced:
            self.cuts[node] = cut if keepdim else _moved(cut, cut.dim - sum(d < cut.dim for d in reduced))
        elif node.target in SUMS + MEANS and self.splits_evenly(cut, cut.full):
            total = insert_call(node, tp_ops.reduce_from_tp, (node,), NAME)  # each rank's sum, or mean of an
            # equal part, summed over the ranks
            whole = total if node.target in SUMS else insert_call(total, aten.div.Tensor, (total, self.tp), NAME)
            node.replace_all_uses_with(whole, delete_user_cb=lambda user: user is not total)
        else:
            padded = " (padded to a multiple of the ranks: no sum or mean over it)" \
                if cut.local * self.tp != cut.full else ""
            raise GraphMismatch(NAME, node, f"reduces over dim {cut.dim}, which {cut.source} cut over the tp "
                                            f"ranks{padded}")

    def norm(self, node: fx.Node, cut: Cut) -> None:
        """Over trailing dims the cut is not in (QK-norm over the head dim): each rank normalises its heads;
        the weight and bias are whole values read against them. Over dims the cut is in (OLMo-2's q_norm over
        every head), from sums over every rank's part, the weight and bias cut to the rank's."""
        x, shape = node.args[:2]
        ndim = len(full_shape(x))
        if cut.dim < ndim - len(shape):
            node.args = (x, shape, *(self.whole_operand(a, node) if isinstance(a, fx.Node) else a
                                     for a in node.args[2:]))
            self.cuts[node] = cut
            return
        if not self.splits_evenly(cut, cut.full):
            raise GraphMismatch(NAME, node, f"normalises over dim {cut.dim}, which {cut.source} cut over the tp "
                                            f"ranks into unequal or fused parts")
        if node.target is aten.layer_norm.default:
            _, _, weight, bias, eps, _ = _given(node, None, None, 1e-5, True)
        else:
            (_, _, weight, eps), bias = _given(node, None, None), None
        at = cut.dim - (ndim - len(shape))
        weight, bias = (self.rank_part(p, at, node) if isinstance(p, fx.Node) else p for p in (weight, bias))
        self.cuts[replace_call(node, tp_ops.norm_over_tp, (x, len(shape), weight, bias, eps, math.prod(shape),
                                                           node.target is aten.layer_norm.default), NAME)] = cut

    def softmax(self, node: fx.Node, cut: Cut) -> None:
        """Along another dim than the cut one, each rank's entries are normalised over what it holds; a
        log_softmax over the cut dim (the vocab, for F.nll_loss) from the max and sum of every rank's entries."""
        x, dim, *rest = node.args
        dim = _dim(dim, len(full_shape(node)))
        if dim != cut.dim:
            self.cuts[node] = cut
        elif node.target in (aten.log_softmax.int, aten._log_softmax.default) and not cut.parts:
            dtype = rest[0] if node.target is aten.log_softmax.int and rest else None
            self.cuts[replace_call(node, tp_ops.vocab_parallel_log_softmax,
                                   (x, dim, self.tp_rank(), cut.full, dtype), NAME)] = cut
        else:
            raise GraphMismatch(NAME, node, f"normalises over dim {cut.dim}, which {cut.source} cut over the tp "
                                            f"ranks; only a log_softmax (for a loss) can be")

    def logsumexp(self, node: fx.Node, cut: Cut) -> None:
        """Over the cut dim (a z-loss over the vocab) from every rank's entries; over others, each rank's."""
        x, dims, keepdim = (*node.args, False)[:3]
        reduced = [_dim(d, len(full_shape(x))) for d in dims]
        if cut.dim not in reduced:
            self.cuts[node] = cut if keepdim else _moved(cut, cut.dim - sum(d < cut.dim for d in reduced))
        elif reduced == [cut.dim] and not cut.parts:
            replace_call(node, tp_ops.vocab_parallel_logsumexp, (x, cut.dim, keepdim, self.tp_rank(), cut.full),
                         NAME)
        else:
            raise GraphMismatch(NAME, node, f"takes a logsumexp over dims {reduced}, with dim {cut.dim}, which "
                                            f"{cut.source} cut over the tp ranks; take it over that dim alone")

    def gather(self, node: fx.Node, cut: Cut) -> None:
        """Entries picked along the cut dim (a target's log-probability) by an index every rank holds whole: each
        from the rank holding it."""
        x, dim, index = node.args[:3]
        if _dim(dim, len(full_shape(x))) != cut.dim:
            raise GraphMismatch(NAME, node, f"picks along dim {dim} of a tensor {cut.source} cut on dim {cut.dim}; "
                                            f"only picks along the cut dim (a target's entry of the vocab) are cut")
        if node.kwargs.get("sparse_grad") or len(node.args) > 3 and node.args[3]:
            raise GraphMismatch(NAME, node, "gathers with sparse_grad, which the vocab-parallel gather does not do")
        replace_call(node, tp_ops.vocab_parallel_gather, (x, cut.dim, index, self.tp_rank()), NAME)

    def attention(self, node: fx.Node) -> None:
        q, k, v, *rest = node.args
        cuts = [self.cuts.get(t) for t in (q, k, v)]
        if cuts[0] is not None and cuts[0].dim == 1 and cuts[1:] == [None, None] and node.kwargs.get("enable_gqa") \
                and full_shape(k)[1] == full_shape(v)[1] == 1:  # one kv head for all (MQA): whole
            node.args = (q, self.whole_operand(k, node), self.whole_operand(v, node), *rest)
            cuts = [cuts[0]] * 3
        elif cuts[0] is not None and cuts[0].dim == 1:  # kv heads repeated to every query head (HF's repeat_kv)
            # from a Linear whose heads tp cannot cut: each rank reads its query heads' rows
            for i, t in ((1, k), (2, v)):
                if cuts[i] is None and full_shape(t)[1] == cuts[0].full and \
                        not self.cuttable_heads(t, full_shape(q)[-1]):
                    node.update_arg(i, self.rank_part(t, 1, node))
                    cuts[i] = cuts[0]
        if any(c is None or c.dim != 1 for c in cuts):
            whole = [linear for t, c in zip((q, k, v), cuts) if c is None and (linear := self.linear_behind(t))]
            fix = f"; make {', '.join(whole)} column-parallel in tp_plan" if whole else ""
            raise GraphMismatch(NAME, node, f"needs q, k and v all cut by heads (dim 1){fix}")
        self.attention_mask(node)
        self.cuts[node] = cuts[0]

    def cuttable_heads(self, value: fx.Node, head_dim: int) -> bool:
        """Whether `value` is a replicated Linear's output whose heads (of `head_dim`) tp could cut: the plan
        should make it column-parallel. Not one kv head for all (MQA), nor fewer kv heads than tp ranks."""
        weight = self.weight_behind(value)
        return weight is not None and weight.full_shape[0] % (head_dim * self.tp) == 0

    def attention_mask(self, node: fx.Node) -> None:
        """SDPA's attn_mask, broadcast over (batch, heads, queries, keys): one cut by heads as q is; one whole on
        every rank with no heads dim or a heads dim of 1 (a causal, sliding-window or padding mask, HF's
        (B, 1, T, S)), read whole against each rank's heads; one whole with a row per head, its rank's rows."""
        positional = len(node.args) > 3
        mask = node.args[3] if positional else node.kwargs.get("attn_mask")
        if not isinstance(mask, fx.Node):
            return
        shape, cut = full_shape(mask), self.cuts.get(mask)
        heads = len(shape) - 3  # the heads dim of a mask of fewer than 4 dims, once broadcast
        if cut is None and (heads < 0 or shape[heads] == 1):
            mask = self.whole_operand(mask, node)
        elif cut is None:  # whole, a row per head (ALiBi's bias)
            mask = self.rank_part(mask, heads, node)
        elif cut.dim != heads:
            raise GraphMismatch(NAME, node, f"reads an attention mask cut by {cut.source} on dim {cut.dim}, not on "
                                            f"its heads dim ({heads}); build the mask from whole values or from "
                                            f"the cut heads")
        if positional:
            node.args = (*node.args[:3], mask, *node.args[4:])
        else:
            node.kwargs = {**node.kwargs, "attn_mask": mask}

    def cross_entropy(self, node: fx.Node, cut: Cut) -> None:
        """F.cross_entropy over logits cut on the classes (dim 1): Megatron's vocab-parallel loss, any reduction,
        with label smoothing."""
        logits, targets, weight, reduction, ignore_index, smoothing = _given(node, None, 1, -100, 0.0)
        self.check_loss(node, cut, weight, "cross-entropy")
        replace_call(node, tp_ops.vocab_parallel_cross_entropy,
                     (logits, targets, self.tp_rank(), cut.full, ignore_index, reduction, smoothing), NAME)

    def nll_loss(self, node: fx.Node, cut: Cut) -> None:
        """F.nll_loss of log-probabilities cut on the classes (dim 1): each target's from the rank holding it."""
        log_probs, targets, weight, reduction, ignore_index = _given(node, None, 1, -100)
        self.check_loss(node, cut, weight, "nll_loss")
        replace_call(node, tp_ops.vocab_parallel_nll_loss,
                     (log_probs, targets, self.tp_rank(), reduction, ignore_index), NAME)

    def check_loss(self, node: fx.Node, cut: Cut, weight, name: str) -> None:
        if weight is not None:
            raise GraphMismatch(NAME, node, f"is a {name} with class weights, which the vocab-parallel loss does not "
                                            f"take: drop weight=, or leave {cut.source} out of tp_plan")
        if cut.dim != 1 or cut.parts:
            raise GraphMismatch(NAME, node, f"is a {name} the vocab-parallel loss cannot replace: it needs the "
                                            f"classes on dim 1, cut by a vocab-parallel head (here cut by "
                                            f"{cut.source} on dim {cut.dim})")

    def tp_rank(self) -> fx.Node:
        return rank_constant(self.stage, "tp_rank", self.ctx.coords.axis_rank("tp"))

    def linear_behind(self, node: fx.Node) -> str | None:
        """The module of the replicated linear whose output `node` is, through ops of one tensor (SwiGLU's
        silu(gate(x)) where only up is cut): what the plan should cut as well; None for anything else."""
        weight = self.weight_behind(node)
        return module_of(weight.name) if weight is not None else None

    def weight_behind(self, node: fx.Node) -> Param | None:
        """The weight of that linear (`linear_behind`)."""
        while node.op == "call_function" and node.target is not aten.linear.default:
            tensors = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
            if len(tensors) != 1:
                return None
            node = tensors[0]
        weight = node.args[1] if node.op == "call_function" else None
        return self.param_of(weight) if weight is not None and weight.op == "placeholder" and \
            self.stage.placeholders().index(weight) < len(self.stage.params) else None

    def param_of(self, node: fx.Node):
        """The parameter of a placeholder, or of its transpose (HF's Conv1D)."""
        node = node.args[0] if node.target is aten.t.default else node
        return self.stage.params[self.stage.placeholders().index(node)]


def full_shape(node: fx.Node) -> tuple[int, ...]:
    """Full (single-device) shape: the rewrite reads meta before shape propagation reruns."""
    return tuple(node.meta["val"].shape)


def _keeps_shape(node: fx.Node, x: fx.Node) -> bool:
    """Whether `node` is an op of `x` alone (numbers aside) that keeps its shape entry by entry."""
    alone = [a for a in node.all_input_nodes] == [x]
    return alone and (node.target in SHAPE_PRESERVING or is_elementwise(node.target)) and \
        tuple(node.meta["val"].shape) == tuple(x.meta["val"].shape)


def _given(node: fx.Node, *defaults) -> tuple:
    """An op's first two arguments (a loss's two tensors, a norm's input and shape) and its options, each given or
    its `defaults` entry."""
    return (*node.args, *defaults[len(node.args) - 2:])


def _dim(dim: int, ndim: int) -> int:
    return dim % ndim


def _moved(cut: Cut, dim: int) -> Cut:
    return Cut(dim, cut.local, cut.full, cut.source, cut.parts)
