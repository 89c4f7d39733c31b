"""Overlap tensor-parallel collectives with the compute that does not need their result.

Requires: a lowered RankProgram whose graphs start collectives on "tp" as functional
          collectives, each read by wait_tensor only (autograd may wait on one twice, e.g. for an
          input copied to two column-parallel linears: the waits become one).
Ensures:  each tp collective starts as soon as its input exists: the nodes just before it
          (back to the previous collective or wait) that it does not depend on move to
          right after it, in their order. Its wait sits right before the first node that
          reads the result. Only the order changes, so the math does not, and tp ranks,
          which run the same graph text, keep one collective order.

What it buys is Megatron's asynchronous input-gradient all-reduce. In the backward of a
column-parallel linear, autograd emits the weight-gradient matmul before the partial
input gradient's all-reduce; moved, that matmul runs while the all-reduce is in flight
(gloo: while it transfers; shared memory: while the other ranks arrive).

Rewrite (backward of a column-parallel linear):
    before: dx = mm(dy, W); dW = mm(dy.t(), x); r = all_reduce(view(dx)); w = wait(r); ln_backward(w)
    after:  dx = mm(dy, W); r = all_reduce(view(dx)); dW = mm(dy.t(), x); w = wait(r); ln_backward(w)
"""

import copy
import weakref
from dataclasses import replace

import torch
import torch.fx as fx

from gcompile.collectives import collective_nodes, is_collective
from gcompile.pass_manager import PassContext, register_pass
from gcompile.rank_program import RankProgram

NAME = "tp_comm_overlap"
WAIT = torch.ops._c10d_functional.wait_tensor.default


@register_pass(NAME)
def tp_comm_overlap_pass(program: RankProgram, ctx: PassContext) -> RankProgram:
    stages = {}
    for index, stage in program.stages.items():
        moved = {name: overlap_tp_comm(gm, index) for name, gm in
                 (("forward", stage.forward), ("backward", stage.backward),
                  ("backward_last", stage.backward_last), ("backward_weight", stage.backward_weight))
                 if gm is not None}
        stages[index] = replace(stage, **moved)
    return replace(program, stages=stages)


def overlap_tp_comm(gm: fx.GraphModule, stage: int) -> fx.GraphModule:
    """A copy of `gm` (lowered graphs are shared between ranks) with its tp collectives moved; made once per
    lowered graph, as the copy is shared in turn (no rank pass edits a graph in place: run_rank_passes)."""
    if gm not in _MOVED:
        _MOVED[gm] = _moved_copy(gm, stage)
    return _MOVED[gm]


_MOVED = weakref.WeakKeyDictionary()
"""Lowered graph -> its copy with the collectives moved, while the lowered graph lives (in a build cache)."""


def _moved_copy(gm: fx.GraphModule, stage: int) -> fx.GraphModule:
    gm = copy.deepcopy(gm)
    started = [node for node, _, args in collective_nodes(gm) if args.get("group_name") == "tp"]
    for node in started:
        waits = [user for user in node.users if user.target is WAIT]
        if len(waits) != len(node.users) or not waits:
            raise ValueError(f"stage {stage}: tp collective {node.name} ({node.target}) should be read by "
                             f"wait_tensor only, not by {[u.name for u in node.users]}; "
                             f"from: {node.meta.get('stack_trace', '?')}")
        order = _order(gm.graph)
        wait, *others = sorted(waits, key=order.__getitem__)
        for other in others:  # the same wait twice: the first serves every reader
            other.replace_all_uses_with(wait)
            gm.graph.erase_node(other)
        _start_early(node)
        _wait_late(wait)
    gm.graph.lint()
    gm.recompile()
    return gm


def _start_early(collective: fx.Node) -> None:
    window = []  # the nodes since the previous collective, wait or side effect, nearest first
    node = collective.prev
    while node.op == "call_function" and not _is_comm(node) and not node.is_impure():
        window.append(node)
        node = node.prev
    in_window, needed, todo = set(window), set(), list(collective.all_input_nodes)
    while todo:
        node = todo.pop()
        if node in in_window and node not in needed:
            needed.add(node)
            todo += node.all_input_nodes
    anchor = collective
    for node in reversed(window):
        if node not in needed:
            anchor.append(node)
            anchor = node


def _wait_late(wait: fx.Node) -> None:
    order = _order(wait.graph)
    first = min(wait.users, key=order.__getitem__)
    if order[first] > order[wait] + 1:
        first.prepend(wait)


def _is_comm(node: fx.Node) -> bool:
    return is_collective(node.target)


def _order(graph: fx.Graph) -> dict[fx.Node, int]:
    return {node: i for i, node in enumerate(graph.nodes)}
