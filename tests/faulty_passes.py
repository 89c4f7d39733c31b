"""User passes with seeded faults, for the plan checker's and the numerics bisection's tests."""

import copy
from dataclasses import replace

import torch

from gcompile.collectives import collective_nodes
from gcompile.pass_manager import PassContext
from gcompile.program import propagate_shapes
from gcompile.rank_program import RankProgram


def drop_one_all_reduce_on_tp_rank_1(program: RankProgram, ctx: PassContext) -> RankProgram:
    """On tp rank 1 only, the first all-reduce of the first stage's forward becomes the identity."""
    if ctx.coords.axis_rank("tp") != 1:
        return program
    index = min(program.stages)
    forward = copy.deepcopy(program.stages[index].forward)
    node, _, _ = collective_nodes(forward)[0]
    (wait,) = node.users
    wait.replace_all_uses_with(node.args[0])
    forward.graph.erase_node(wait)
    forward.graph.erase_node(node)
    propagate_shapes(forward)
    return replace(program, stages={**program.stages, index: replace(program.stages[index], forward=forward)})


SCALED = "transformer.h.0.mlp.c_fc.weight"


def scale_one_gradient_on_rank_1(program: RankProgram, ctx: PassContext) -> RankProgram:
    """On global rank 1 only, the backward's gradient of SCALED comes out 1.01 times too large."""
    held = [s for s, stage in program.stages.items() if SCALED in [p.name for p in stage.params]]
    if ctx.coords.rank != 1 or not held:
        return program
    stage = program.stages[held[0]]
    backward = copy.deepcopy(stage.backward)
    output = backward.graph.output_node()
    grads = list(output.args[0])
    index = [p.name for p in stage.params].index(SCALED)
    with backward.graph.inserting_before(output):
        grads[index] = backward.graph.call_function(torch.ops.aten.mul.Tensor, (grads[index], 1.01))
    output.args = (tuple(grads),)
    propagate_shapes(backward)
    return replace(program, stages={**program.stages, held[0]: replace(stage, backward=backward)})
