"""User passes with the mistakes a newcomer makes (issue 12, 6 a-e), for the pass driver's tests."""

import copy
import os
import sys
from dataclasses import replace

import torch

from gcompile.pass_manager import PassContext
from gcompile.program import Program
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


def drops_a_gradient(program: RankProgram, ctx: PassContext) -> RankProgram:
    """(f) Leaves the backward graph one output short: every later gradient would land one place off."""
    index = min(program.stages)
    backward = copy.deepcopy(program.stages[index].backward)
    output = backward.graph.output_node()
    output.args = (tuple(output.args[0][1:]),)
    backward.graph.eliminate_dead_code()
    backward.recompile()
    return replace(program, stages={**program.stages, index: replace(program.stages[index], backward=backward)})


def drops_the_optimizer_step(program: RankProgram, ctx: PassContext) -> RankProgram:
    """(f) An instruction list that never steps."""
    return replace(program, instructions=program.instructions[:-1])


def assigns_into_a_stage(program: RankProgram, ctx: PassContext) -> RankProgram:
    """(a) Copies the graph, as it should, but puts the copy into the stage it was given, which ranks share."""
    stage = program.stages[min(program.stages)]
    stage.backward = copy.deepcopy(stage.backward)
    return program


def makes_the_loss_a_vector(program: Program, ctx: PassContext) -> Program:
    """(f) A forward pass whose last stage returns the loss times a vector: no scalar to start backward from."""
    stage = program.stages[-1]
    graph, output = stage.graph.graph, stage.output_node()
    with graph.inserting_before(output):
        vector = graph.call_function(torch.ops.aten.expand.default, (output.args[0][0], [3]))
    output.args = ((vector, *output.args[0][1:]),)
    return program


def exits(program: Program, ctx: PassContext) -> Program:
    """(f) Ends the process where it should return the program."""
    sys.exit(0)


def fails_on_rank_1(program: Program, ctx: PassContext) -> Program:
    """(f) Raises on one rank, from a line of this file."""
    if ctx.coords.rank == 1:
        return {}["missing"]
    return program


def _in_a_rank() -> bool:
    """Whether this process is a started rank (its world is up), not the launcher checking the plan."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def ends_rank_1(program: RankProgram, ctx: PassContext) -> RankProgram:
    """(g) Ends rank 1's process with status 0, which no exception handler sees."""
    if _in_a_rank() and ctx.coords.rank == 1:
        os._exit(0)
    return program


def drops_a_collective_in_the_ranks(program: RankProgram, ctx: PassContext) -> RankProgram:
    """(g) Acts otherwise in the ranks than in the launcher (as one that reads os.environ["RANK"] does): rank 1
    drops its first backward's first all-reduce, which the launcher's check never sees."""
    if not (_in_a_rank() and ctx.coords.rank == 1):
        return program
    index = min(program.stages)
    backward = copy.deepcopy(program.stages[index].backward)
    wait = next(n for n in backward.graph.nodes if n.target is torch.ops._c10d_functional.wait_tensor.default)
    wait.replace_all_uses_with(wait.args[0].args[0])
    backward.graph.erase_node(wait)
    backward.graph.eliminate_dead_code()
    backward.recompile()
    return replace(program, stages={**program.stages, index: replace(program.stages[index], backward=backward)})


def reads_the_rank_environment(program: Program, ctx: PassContext) -> Program:
    """(g) Reads the rank from the environment, which the launcher, building every rank's program, lacks."""
    if int(os.environ["RANK"]) == 1:
        print("rank 1")
    return program


def loops_forever(program: Program, ctx: PassContext) -> Program:
    """(g) Never returns."""
    while True:
        pass
