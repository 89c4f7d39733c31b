"""An example user pass: every tensor-parallel all-reduce becomes a reduce-scatter then an all-gather.

    python run_gpt.py --config configs/tiny.toml --tp 2 \
        --passes "after:lower=examples.all_reduce_split:all_reduce_as_reduce_scatter_all_gather"

It runs after lowering (`after:lower`), so it sees the rank's forward, backward and
optimizer graphs, where collectives are `torch.ops._c10d_functional` calls.
Requires: sum all-reduces over group "tp" followed by their wait_tensor.
Ensures:  the same sums, computed as reduce-scatter + all-gather on the flattened
          tensor (zero-padded to a multiple of tp); nothing else changes.

Rewrite:
    before: y = wait(all_reduce(x, "sum", "tp"))
    after:  flat = pad(x.reshape(-1), to a multiple of tp)
            y = wait(all_gather(wait(reduce_scatter(flat, "sum", tp, "tp")), tp, "tp"))[:x.numel()].reshape(x.shape)
"""

import copy
from dataclasses import replace

import torch
import torch.fx as fx

from gcompile.collectives import collective_nodes
from gcompile.pass_manager import PassContext
from gcompile.program import propagate_shapes
from gcompile.rank_program import RankProgram

aten, c10d = torch.ops.aten, torch.ops._c10d_functional


def all_reduce_as_reduce_scatter_all_gather(program: RankProgram, ctx: PassContext) -> RankProgram:
    tp = ctx.coords.size("tp")
    stages = {s: replace(stage, forward=_rewrite(stage.forward, tp), backward=_rewrite(stage.backward, tp),
                         backward_last=stage.backward_last and _rewrite(stage.backward_last, tp))
              for s, stage in program.stages.items()}
    return replace(program, stages=stages)


def _rewrite(gm: fx.GraphModule, tp: int) -> fx.GraphModule:
    gm = copy.deepcopy(gm)
    graph = gm.graph
    for node, op, args in collective_nodes(gm):
        if op != "all_reduce" or args["group_name"] != "tp" or args["reduce_op"] != "sum":
            continue
        (wait,) = node.users
        x = node.args[0]
        shape, n = list(x.meta["val"].shape), x.meta["val"].numel()
        with graph.inserting_before(wait):
            flat = graph.call_function(aten.reshape.default, (x, [-1]))
            flat = graph.call_function(aten.constant_pad_nd.default, (flat, [0, -n % tp]))
            piece = graph.call_function(c10d.reduce_scatter_tensor.default, (flat, "sum", tp, "tp"))
            piece = graph.call_function(c10d.wait_tensor.default, (piece,))
            whole = graph.call_function(c10d.all_gather_into_tensor.default, (piece, tp, "tp"))
            whole = graph.call_function(c10d.wait_tensor.default, (whole,))
            whole = graph.call_function(aten.slice.Tensor, (whole, 0, 0, n))
            result = graph.call_function(aten.reshape.default, (whole, shape))
        wait.replace_all_uses_with(result)
        graph.erase_node(wait)
        graph.erase_node(node)
    propagate_shapes(gm)
    return gm
