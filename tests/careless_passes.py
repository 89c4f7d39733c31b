"""User passes with the mistakes a newcomer makes (issue 12, 6 a-e), for the pass driver's tests."""

import copy
from dataclasses import replace

import torch

from gcompile.pass_manager import PassContext
from gcompile.rank_program import RankProgram


def _scale_first_grad(gm) -> None:
    """Multiply the backward graph's first output by 2, in `gm`."""
    output = gm.graph.output_node()
    outputs = list(output.args[0])
    first = next(i for i, o in enumerate(outputs) if o is not None)
    with gm.graph.inserting_before(output):
        outputs[first] = gm.graph.call_function(torch.ops.aten.mul.Tensor, (outputs[first], 2.0))
    output.args = (tuple(outputs),)
    gm.recompile()


def edits_in_place(program: RankProgram, ctx: PassContext) -> RankProgram:
    """(a) On rank 1 only, edits the shared backward graph instead of a copy."""
    if ctx.coords.rank == 1:
        _scale_first_grad(program.stages[min(program.stages)].backward)
    return program


def copies_but_forgets_shapes(program: RankProgram, ctx: PassContext) -> RankProgram:
    """(c) Edits a copy, as it should, but leaves the new node without meta['val']."""
    index = min(program.stages)
    backward = copy.deepcopy(program.stages[index].backward)
    _scale_first_grad(backward)
    return replace(program, stages={**program.stages, index: replace(program.stages[index], backward=backward)})


def returns_the_graph(program: RankProgram, ctx: PassContext):
    """(c) Returns a GraphModule instead of the program."""
    return program.optimizer.graph


def expects_the_rank_program(program: RankProgram, ctx: PassContext) -> RankProgram:
    """(d) Reads RankProgram fields; placed without a point it would get the forward Program."""
    return replace(program, stages=dict(program.stages))


def does_nothing(program: RankProgram, ctx: PassContext) -> RankProgram:
    return program
