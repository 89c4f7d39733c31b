"""Expert parallelism (Megatron-Core's --expert-model-parallel-size) as a rewrite of the forward program.

The n ranks of an "ep" group (folded into dp x cp: each sees its own tokens) split
every MoE layer's E experts, E/n each. A layer routes as before on every rank; the
rows it sorted by expert go to their expert's rank, run through that rank's
experts, and come back (gcompile/ep_ops.py). Everything else (the router, the
gates, the load-balancing loss, the sum over a token's k experts) stays on the
rank whose tokens it is, so each rank's loss is exactly one device's loss over its
tokens, and the expert weights' gradients, summed over the edp ranks that hold
the same experts and divided by dp x cp (the dp passes, gcompile.axes.REPLICAS),
are one device's.

Requires: the whole model in one stage (before pipeline_split); each MoE layer's experts are
  `gcompile::grouped_mm` calls that share one `ends` (E,), read their weights (E, in, out)
  straight from parameters and their rows through element-wise ops, a bias (E, out) only
  as index_select(bias, 0, expert_of_row); E divisible by n (config.validate). The first
  op that reads the experts' rows and is not element-wise over them alone (the gates'
  weighting, the sum over a token's copies) is where they go back; a per-expert weight
  read any other way is refused with the node, its op and its source line.
Ensures: expert parameters are cut over "ep" on dim 0 (Shard("ep", 0)); the graph text is the same
  on every ep rank (the exchange finds its peers in the group); nodes it makes carry
  meta["pass"] == "expert_parallel".

Rewrite (per layer; R routed rows, E experts, n ranks):

    before                                          after
    rows = index_select(x, 0, token_of_row) (R, C)   rows, ends (E,)
    h = grouped_mm(rows, w_fc, ends)   # w (E,C,H)  d = dispatch(rows, ends, n)    # all-to-all of counts, then rows
                                                    h = grouped_mm(d[0], w_fc, d[1])  # (n*R, H), w (E/n, C, H)
    b = index_select(bias, 0, expert_of_row)        b = index_select(bias, 0, d[2])   # bias (E/n, H)
    ... element-wise ...
    out = grouped_mm(g, w_proj, ends) (R, C)        out = combine(grouped_mm(g, w_proj, d[1]), d[3], d[4], d[5], R)
"""

import operator

import torch
import torch.fx as fx

from gcompile import ep_ops, tp_ops
from gcompile.layout import Shard
from gcompile.models import moe  # noqa: F401  registers gcompile::grouped_mm, the op the pass keys on
from gcompile.pass_manager import PassContext, register_pass
from gcompile.program import Program, Stage
from gcompile.torch_api import is_op_overload
from passes.rewrite import GraphMismatch, fake_like, insert_call, whole_model_copy

NAME = "expert_parallel"
aten = torch.ops.aten
GROUPED_MM = torch.ops.gcompile.grouped_mm.default


@register_pass(NAME)
def expert_parallel_pass(program: Program, ctx: PassContext) -> Program:
    program = whole_model_copy(program, NAME)
    n = ctx.coords.size("ep")
    layers = 0
    for stage in program.stages:
        by_ends: dict[fx.Node, list[fx.Node]] = {}
        for node in stage.graph.graph.find_nodes(op="call_function", target=GROUPED_MM):
            by_ends.setdefault(node.args[2], []).append(node)
        for ends, matmuls in by_ends.items():
            _Layer(stage, ends, matmuls, n, ctx).rewrite()
        layers += len(by_ends)
        stage.graph.graph.lint()
    if not layers:
        raise ValueError(f"{NAME}: the model calls no gcompile::grouped_mm, so it has no experts to split "
                         f"(build MoE layers from gcompile.models.moe, or drop --ep)")
    return program


class _Layer:
    """One MoE layer's experts: the region of the graph that works on their rows, and its way in and out."""

    def __init__(self, stage: Stage, ends: fx.Node, matmuls: list[fx.Node], n: int, ctx: PassContext):
        self.stage, self.ends, self.matmuls, self.n, self.ctx = stage, ends, matmuls, n, ctx
        self.params = {node: i for i, node in enumerate(stage.placeholders()[:len(stage.params)])}
        self.experts = ends.meta["val"].shape[0]
        self.region: set[fx.Node] = set(matmuls)
        """Values that hold the experts' rows (one per routed row, sorted by expert)."""
        self.biases: list[fx.Node] = []
        """index_select(bias, 0, expert_of_row) nodes: a per-expert parameter picked for each row."""

    def rewrite(self) -> None:
        for mm in self.matmuls:
            self.cut(mm.args[1], mm)
        first = self.matmuls[0]
        for node in list(first.graph.nodes)[list(first.graph.nodes).index(first):]:
            if node not in self.region and node.op == "call_function" and self.reads_rows(node):
                self.region.add(node)
        entries = {mm.args[0] for mm in self.matmuls if mm.args[0] not in self.region}
        if len(entries) != 1:
            raise GraphMismatch(NAME, first, f"the experts read {len(entries)} different row tensors; expected "
                                             f"one (the routed rows)")
        rows = entries.pop()
        routed = insert_call(first, ep_ops.dispatch, (rows, self.ends, self.n), NAME, before=True)
        local = [insert_call(first, operator.getitem, (routed, i), NAME, before=True) for i in range(6)]
        for mm in self.matmuls:
            if mm.args[0] is rows:
                mm.update_arg(0, local[0])
            mm.update_arg(2, local[1])
        for bias in self.biases:
            bias.update_arg(2, local[2])
        outside = [node for node in self.region if any(u not in self.region for u in node.users)]
        for node in outside:
            users = [u for u in node.users if u not in self.region]
            back = insert_call(node, ep_ops.combine, (node, *local[3:], rows.meta["val"].shape[0]), NAME)
            for user in users:
                user.replace_input_with(node, back)

    def reads_rows(self, node: fx.Node) -> bool:
        """Whether `node` works on the experts' rows alone, element by element (and so joins the region)."""
        inputs = node.all_input_nodes
        if not any(a in self.region for a in inputs):
            return False
        if node.target is GROUPED_MM and node.args[2] is self.ends:
            return True
        row_wise = is_op_overload(node.target) and torch.Tag.pointwise in node.target.tags
        if not row_wise:
            return False  # where the rows leave the experts (a gate's weighting, the sum over a token's copies)
        for a in inputs:
            if a in self.region or a.meta["val"].dim() == 0:
                continue
            if a.target is aten.index_select.default and _param(a.args[0]) in self.params and a.args[1] == 0:
                self.cut(a.args[0], a)
                self.biases.append(a)
                self.region.add(a)
                continue
            return False  # a row-aligned value from outside (the gates): the rows leave here
        return True

    def cut(self, param: fx.Node, reader: fx.Node) -> None:
        """Declare the per-expert parameter `param` cut over ep on dim 0."""
        param = _param(param)
        if param not in self.params:
            raise GraphMismatch(NAME, reader, f"reads per-expert weights {param.name} that are no parameter; "
                                              f"expert parallel splits parameters only")
        i = self.params[param]
        spec = self.stage.params[i]
        if spec.sharded_over("ep"):
            return
        if spec.full_shape[0] != self.experts:
            raise GraphMismatch(NAME, reader, f"reads {spec.name} {spec.full_shape} per expert, but the layer has "
                                              f"{self.experts} experts")
        self.stage.params[i] = spec = spec.with_shard(Shard("ep", 0))
        param.meta["val"] = fake_like(param, spec.local_shape(self.ctx.coords.axis_sizes))


def _param(node: fx.Node) -> fx.Node:
    """The value behind sequence parallel's copy_to_tp (a parameter whose gradient it sums over tp)."""
    return node.args[0] if node.target is tp_ops.copy_to_tp else node
