"""User passes with seeded faults, for the plan checker's tests."""

import copy
from dataclasses import replace

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
