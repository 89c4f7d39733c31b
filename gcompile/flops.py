"""Floating-point operations of a graph, counted from its nodes' shapes.

The formulas are torch's (`torch.utils.flop_counter`: matmuls and attention; pointwise
ops count zero, as in Megatron's formula). CPU flash attention has no formula there; it
computes what flash attention computes, so it borrows that one; context parallel's
attention blocks count it at their rows (gcompile/ring_attention.py). The experts' grouped
matmuls count as one matmul over all their rows (under expert parallel: over the room
for the most rows that can arrive, n times the average: an upper bound).
"""

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from gcompile import ring_attention
from gcompile.models import moe  # noqa: F401  registers the grouped matmul ops counted below

aten = torch.ops.aten

SAME_FLOPS_AS = {
    aten._scaled_dot_product_flash_attention_for_cpu: aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: aten._scaled_dot_product_flash_attention_backward,
}


OURS = {
    torch.ops.gcompile.grouped_mm: lambda rows, weight, ends, out_val: 2 * rows.shape[0] * weight.shape[1] * weight.shape[2],
    torch.ops.gcompile.grouped_mm_weight_grad: lambda rows, grad, ends, out_val: 2 * rows.shape[0] * rows.shape[1] * grad.shape[1],
    torch.ops.gcompile.attend_block: ring_attention.block_flops,
    torch.ops.gcompile.attend_block_backward: ring_attention.block_backward_flops,
}
"""FLOPs of gcompile's own ops, by op, with flop_registry's calling convention."""


def node_flops(node: fx.Node) -> int | None:
    """FLOPs of one node (it needs meta["val"]); None for an op no formula counts (pointwise, views, ...)."""
    packet = getattr(node.target, "overloadpacket", None)  # None for placeholders, outputs, getitem
    formula = OURS.get(packet) or flop_registry.get(SAME_FLOPS_AS.get(packet, packet))
    if formula is None:
        return None
    args, kwargs = _values(node.args), {name: _values(arg) for name, arg in node.kwargs.items()}
    key = (node.target, _shapes((args, kwargs, node.meta["val"])))
    if key not in _COUNTED:
        _COUNTED[key] = formula(*args, **kwargs, out_val=node.meta["val"])
    return _COUNTED[key]


_COUNTED: dict[tuple, int] = {}
"""FLOPs by op and the shapes it meets: the planner counts the same matmuls in every candidate's graphs, and
torch's formulas map their arguments' trees to shapes first (most of what costing a graph costs)."""


def _values(arg):
    """`arg` with each node its value (tree_map_only's work, at a tenth of its cost)."""
    if isinstance(arg, fx.Node):
        return arg.meta["val"]
    if isinstance(arg, (list, tuple)):
        return [_values(a) for a in arg] if isinstance(arg, list) else tuple(_values(a) for a in arg)
    return arg


def _shapes(value):
    """`value` with each tensor its shape and dtype, hashable: what a FLOP formula reads."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.dtype
    if isinstance(value, (list, tuple)):
        return tuple(map(_shapes, value))
    if isinstance(value, dict):
        return tuple((name, _shapes(v)) for name, v in value.items())
    return value


def graph_flops(gm: fx.GraphModule) -> int:
    """FLOPs of one run of `gm` (its nodes need meta["val"], as every lowered graph has)."""
    return sum(node_flops(node) or 0 for node in gm.graph.nodes)
