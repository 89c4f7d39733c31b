"""Edits of the optimizer step graph at its marks (gcompile.optimizer), shared by the dp passes.

The lowered step is shared by every rank with the same layout, so a pass edits a
copy (`editable`) and hands it back through `finished`, which tags the nodes it
created with meta["pass"] and re-derives every shape from the placeholders.
`rewritten` does both once per step and what else the rewrite reads: ranks (and the
planner's candidates) that share a step share its rewrite too.
"""

import copy
import weakref
from collections.abc import Callable

import torch
import torch.fx as fx

from gcompile.flat import FlatLayout
from gcompile.optimizer import GRAD, MARK, marked
from gcompile.program import propagate_shapes
from gcompile.rank_program import OptimizerGraph, RankProgram
from passes.bucket_overlap import Finish, StartReduction, slice_of, wait

aten = torch.ops.aten
_ops = torch.ops._c10d_functional


def editable(program: RankProgram) -> fx.GraphModule:
    return copy.deepcopy(program.optimizer.graph)


def rewritten(program: RankProgram, reads: tuple,
              rewrite: Callable[[fx.GraphModule], tuple[fx.GraphModule, tuple[str, ...]]]) -> OptimizerGraph:
    """The step `rewrite` makes of a copy of `program`'s (`editable`), with its inputs; made once per step and
    `reads`, all else the rewrite reads (the layout, the mesh's sizes, which buckets backward reduced). The
    planner builds hundreds of candidates that differ only in what the step does not read (the schedule, the
    micro-batch size): each rewrite and its shape propagation were a sixth of its time."""
    done = _REWRITTEN.setdefault(program.optimizer.graph, {})
    key = (program.optimizer.inputs, *reads)
    if key not in done:
        done[key] = OptimizerGraph(*rewrite(editable(program)))
    return done[key]


_REWRITTEN = weakref.WeakKeyDictionary()
"""Step graph -> {(its inputs, what else a rewrite read): the rewritten step}, while the step lives."""


def required(gm: fx.GraphModule, mark: str) -> fx.Node:
    node = marked(gm, mark)
    if node is None:
        raise ValueError(f"optimizer graph has no node marked {mark!r}: not the step gcompile.lower_rank "
                         f"lowers, or a dp pass rewrote it already")
    return node


def reduce_gradient(gm: fx.GraphModule, layout: FlatLayout, start: StartReduction, finish: Finish,
                    overlapped: frozenset[int], ready: Callable[[fx.Graph, fx.Node, int], fx.Node]) -> None:
    """Replace the gradient at GRAD, for all that reads it, by its buckets reduced and concatenated:
    every collective started before any is waited for. A bucket in `overlapped` was reduced during
    backward; `ready(graph, grad, i)` is its result."""
    graph = gm.graph
    grad = required(gm, GRAD)
    readers = list(grad.users)
    with graph.inserting_before(grad.next):  # in creation order
        started = [ready(graph, grad, i) if i in overlapped else start(graph, slice_of(graph, grad, b.start, b.end), i)
                   for i, b in enumerate(layout.buckets)]
        reduced = [s if i in overlapped else finish(graph, wait(graph, s), i)
                   for i, s in enumerate(started)]
        total = graph.call_function(aten.cat.default, (reduced,))
    grad.replace_all_uses_with(total, delete_user_cb=readers.__contains__)
    grad.meta["custom"] = {k: v for k, v in grad.meta["custom"].items() if k != MARK}  # no longer what the
    # update reads; a new dict, as copies of the graph share the old one


def drop_unread(gm: fx.GraphModule, node: fx.Node) -> None:
    """Erase `node` if nothing reads it, and so on up through the copies and aliases it was made of."""
    while node.target in (aten.alias.default, aten.clone.default) and not node.users:
        source = node.args[0]
        gm.graph.erase_node(node)
        node = source


def reduce_over(gm: fx.GraphModule, node: fx.Node, op: str, group: str, name: str) -> None:
    """Make `node`'s value reduced over `group`: re-target the all-reduce that reads it, or add one."""
    graph = gm.graph
    existing = [u for u in node.users if u.target is _ops.all_reduce.default]
    if existing:
        existing[0].update_arg(2, group)
        existing[0].meta["pass"] = name
        return
    readers = list(node.users)
    with graph.inserting_before(node.next):
        waited = graph.call_function(_ops.wait_tensor.default,
                                     (graph.call_function(_ops.all_reduce.default, (node, op, group)),))
    node.replace_all_uses_with(waited, delete_user_cb=readers.__contains__)


def finished(gm: fx.GraphModule, name: str) -> fx.GraphModule:
    """Tag what the pass created (nodes without a value yet) and propagate shapes."""
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "call_function") and "val" not in node.meta:
            node.meta["pass"] = name
    propagate_shapes(gm)
    return gm
