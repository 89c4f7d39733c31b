"""Floating-point operations of a graph, counted from its nodes' shapes.

The formulas are torch's (`torch.utils.flop_counter`: matmuls and attention; pointwise
ops count zero, as in Megatron's formula). CPU flash attention has no formula there; it
computes what flash attention computes, so it borrows that one.
"""

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map_only
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten

SAME_FLOPS_AS = {
    aten._scaled_dot_product_flash_attention_for_cpu: aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: aten._scaled_dot_product_flash_attention_backward,
}


def graph_flops(gm: fx.GraphModule) -> int:
    """FLOPs of one run of `gm` (its nodes need meta["val"], as every lowered graph has)."""
    total = 0
    for node in gm.graph.nodes:
        packet = getattr(node.target, "overloadpacket", None)  # None for placeholders, outputs, getitem
        formula = flop_registry.get(SAME_FLOPS_AS.get(packet, packet))
        if formula is not None:
            args, kwargs = tree_map_only(fx.Node, lambda n: n.meta["val"], (node.args, node.kwargs))
            total += formula(*args, **kwargs, out_val=node.meta["val"])
    return total
