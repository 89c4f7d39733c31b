"""What one rank runs, as data: its lowered stages, its optimizer step graph, and its instruction list.

Lowering steps build it (gcompile.lower per stage, gcompile.lower_rank for the
rank); rank passes rewrite it into a new one. Nothing here builds a graph.
"""

from collections import Counter
from dataclasses import dataclass, replace

import torch
import torch.fx as fx

from gcompile.flat import FlatLayout
from gcompile.axes import Coords, group_members
from gcompile.instructions import OPT_STEP, OPTIMIZER, Instruction, format_instructions
from gcompile.layout import Param
from gcompile.program import activation_roles, format_graph
from gcompile.report import is_metric
from gcompile.schedule import Action, Kind, Schedule


@dataclass(frozen=True)
class GradReduction:
    """Sum the gradient buffer's [start, end) over a process group before the norm and the update
    (e.g. the two copies of a tied embedding on the first and last pipeline stage)."""

    group: str
    start: int
    end: int


@dataclass(frozen=True)
class AdamWSettings:
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    clip_grad: float
    """0 = no clipping."""


@dataclass(frozen=True)
class LossScaling:
    """fp16 dynamic loss scaling in Megatron's meaning (DynamicGradScaler)."""

    initial: float
    min_scale: float
    window: int
    """Steps without overflow after which the scale doubles."""
    hysteresis: int
    """Overflows tolerated (since the last growth) before the scale halves."""


@dataclass(frozen=True)
class StepSettings:
    adamw: AdamWSettings
    reductions: tuple[GradReduction, ...] = ()
    separate_main: bool = False
    """fp32 main weights apart from the model's weights (low precision, or for a pass to shard them);
    else updated in place."""
    param_dtype: torch.dtype = torch.float32
    loss_scaling: LossScaling | None = None


@dataclass
class LoweredStage:
    index: int
    forward: fx.GraphModule
    backward: fx.GraphModule
    params: list[Param]
    inputs: list[str]
    outputs: list[str]
    num_saved: int
    """Tensors forward saves for backward, per microbatch."""
    rank_constants: dict[str, int | torch.Tensor]
    backward_last: fx.GraphModule | None = None
    """The backward of the stage's last microbatch (under optim_grads: of every microbatch) when it also
    starts dp reductions of finished buckets:
    backward_last(*saved, *output_grads, *last_inputs) -> (*param_grads, *input_grads, *last_outputs)."""
    last_inputs: tuple[tuple[str, int, int], ...] = ()
    """(TrainState buffer, start, end) slices fed to backward_last after the output gradients."""
    last_outputs: tuple[tuple[str, int, int], ...] = ()
    """(TrainState buffer, start, end) slices that backward_last's extra outputs are copied into."""
    last_outputs_add: bool = False
    """backward_last runs for every microbatch (optim_grads) and its extra outputs add into those slices."""
    backward_weight: fx.GraphModule | None = None
    """Zero-bubble schedules: W, the parameter gradients `backward` (then B) leaves (gcompile/backward_split.py):
    backward(*saved, *output_grads) -> (*param_grads, *input_grads, *stash);
    backward_weight(*[backward's inputs at weight_inputs], *stash) -> (*param_grads)."""
    weight_inputs: tuple[int, ...] = ()
    """Indices into backward's inputs that backward_weight reads (saved activations, output gradients)."""
    num_stash: int = 0
    """Tensors backward returns last, for backward_weight."""
    recomputed: bool = False
    """Lowered for full recompute: backward makes forward's activations again, and holds them while it runs."""

    def activation_inputs(self) -> list[str]:
        return activation_roles(self.inputs, self.rank_constants)

    def graphs(self) -> dict[str, fx.GraphModule]:
        """The graphs this stage holds, by the names instructions use (gcompile.instructions.STAGE_GRAPHS)."""
        found = {"forward": self.forward, "backward": self.backward, "backward_last": self.backward_last,
                 "backward_weight": self.backward_weight}
        return {name: gm for name, gm in found.items() if gm is not None}

    def __str__(self) -> str:
        split = self.backward_weight is not None
        text = (f"# stage {self.index} forward: (*params[{len(self.params)}], *{self.inputs}) -> "
                f"(*{self.outputs}, *saved[{self.num_saved}])\n{format_graph(self.forward)}\n"
                f"# stage {self.index} backward{' B' if split else ''}: (*saved[{self.num_saved}], "
                f"*grad{self.outputs}) -> (*param_grads, *input_grads{f', *stash[{self.num_stash}]' if split else ''})"
                f"\n{format_graph(self.backward)}")
        if split:
            text += (f"\n# stage {self.index} backward W: (*backward B's inputs {list(self.weight_inputs)}, "
                     f"*stash[{self.num_stash}]) -> (*param_grads)\n{format_graph(self.backward_weight)}")
        if self.backward_last is not None:
            text += (f"\n# stage {self.index} backward of the last microbatch, starting dp reductions: "
                     f"(*saved, *grad{self.outputs}, *{[f'{b}[{a}:{e}]' for b, a, e in self.last_inputs]}) -> "
                     f"(*param_grads, *input_grads, *{[f'{b}[{a}:{e}]' for b, a, e in self.last_outputs]})\n"
                     f"{format_graph(self.backward_last)}")
        return text


def broken_stage(stage: LoweredStage) -> str | None:
    """Why the stage's graphs no longer take and return what the runtime passes and reads (the conventions
    above), or None: a graph with one output too few trains with each later gradient in the wrong place."""
    grads_in = sum(not is_metric(role) for role in stage.outputs)
    split = stage.backward_weight is not None
    returns = len(stage.params) + len(stage.inputs) + (stage.num_stash if split else 0)
    expected = {"forward": (len(stage.params) + len(stage.inputs), len(stage.outputs) + stage.num_saved),
                "backward": (stage.num_saved + grads_in, returns),
                "backward_last": (stage.num_saved + grads_in + len(stage.last_inputs),
                                  returns + len(stage.last_outputs)),
                "backward_weight": (len(stage.weight_inputs) + stage.num_stash, len(stage.params))}
    for name, gm in stage.graphs().items():
        takes, gives = expected[name]
        outputs = [n for n in gm.graph.nodes if n.op == "output"]
        returned = outputs[0].args[0] if len(outputs) == 1 and isinstance(outputs[0].args[0], (tuple, list)) else None
        found = (len(gm.graph.find_nodes(op="placeholder")), None if returned is None else len(returned))
        if found != (takes, gives):
            return (f"stage {stage.index}'s {name} graph takes {found[0]} inputs and returns "
                    f"{'no tuple' if found[1] is None else found[1]}; the runtime passes it {takes} and reads {gives}")
    return None


def broken_instructions(program: "RankProgram") -> str | None:
    """Why the instruction list cannot run an iteration, or None: every microbatch of each of the rank's stages
    forward once, then backward once (W once after it where the backward is split), on graphs the stage
    holds, and the optimizer step once, last."""
    steps = [i for i, instruction in enumerate(program.instructions) if instruction.op == OPT_STEP]
    if steps != [len(program.instructions) - 1]:
        return f"the optimizer step is at {steps or 'no place'} of {len(program.instructions)} instructions, " \
               f"not once and last"
    runs = Counter()
    for instruction in program.instructions[:-1]:
        if not instruction.is_compute:
            continue
        stage = program.stages.get(instruction.stage)
        if stage is None or instruction.graph not in stage.graphs():
            return f"{instruction.action} runs a graph its rank does not hold ({instruction.graph} of stage " \
                   f"{instruction.stage})"
        runs[instruction.action] += 1
        before = {Kind.B: Kind.F, Kind.W: Kind.B}.get(instruction.action.kind)
        if before and not runs[replace(instruction.action, kind=before)]:
            return f"{instruction.action} runs before {replace(instruction.action, kind=before)}"
    for s, stage in program.stages.items():
        for kind in (Kind.F, Kind.B) + ((Kind.W,) if stage.backward_weight is not None else ()):
            for action in (Action(s, kind, mb) for mb in range(program.schedule.num_microbatches)):
                if runs[action] != 1:
                    return f"{action} runs {runs[action]} times, not once"
    return None


@dataclass(frozen=True)
class OptimizerGraph:
    graph: fx.GraphModule
    inputs: tuple[str, ...]
    """TrainState field per graph input, in order."""

    def values(self) -> dict[str, torch.Tensor]:
        """The fake value of each input by TrainState field: what a state buffer must look like."""
        return {name: node.meta["val"] for name, node in
                zip(self.inputs, self.graph.graph.find_nodes(op="placeholder"), strict=True)}


@dataclass(frozen=True)
class RankProgram:
    coords: Coords
    stages: dict[int, LoweredStage]
    """This rank's stages by global stage index."""
    layout: FlatLayout
    """This rank's parameters in its flat buffers."""
    step_settings: StepSettings
    optimizer: OptimizerGraph
    schedule: Schedule
    instructions: tuple[Instruction, ...]
    """What the rank runs per iteration, in order, the optimizer step last (gcompile.instructions)."""
    history: tuple[str, ...] = ()
    """The passes and lowering steps that made this program, in order."""
    reported: tuple[tuple[str, tuple[int, ...], bool], ...] = ()
    """(role, shape, is a count) of every value the whole model reports (gcompile.report), on every rank alike, whichever
    stage computes it: what the ranks sum between them for the log."""
    norm_group: str | None = None
    """The group role whose ranks together hold every gradient element: the global norm sums over it
    (and counts each element once, gcompile.flat); None: this rank alone."""
    optimizer_shard: str | None = None
    """The group whose ranks each hold 1/n of the optimizer state (main weights, AdamW states, flags),
    rank i the i-th 1/n of every bucket (gcompile.flat); None: every rank holds all of it."""
    grad_accumulator: bool = True
    """Whether any gradient accumulates in the flat fp32 buffer; False when every bucket is reduce-scattered
    by each microbatch's backward (optim_grads): the runtime never allocates it."""
    grads_between_steps: bool = True
    """Whether the flat gradient accumulator stays allocated between steps; False under optim_grads (ZeRO-2),
    where the step reads only the reduced shard: the runtime allocates the accumulator at a step's first
    backward and frees it after the optimizer step."""

    def graph(self, instruction: Instruction) -> fx.GraphModule:
        """The graph an instruction runs."""
        if instruction.graph == OPTIMIZER:
            return self.optimizer.graph
        return self.stages[instruction.stage].graphs()[instruction.graph]

    @property
    def shard_positions(self) -> dict[str, int] | None:
        """Which 1/n of each bucket's optimizer state this rank holds: its position on every axis (a bucket
        is split over its `replicas` axis, gcompile.flat); None when it holds all of it."""
        return None if self.optimizer_shard is None else self.coords.axis_ranks

    def format_instructions(self) -> str:
        return format_instructions(self.instructions, f"rank {self.coords.rank} {self.coords}, schedule "
                                   f"{self.schedule.name} pp={self.schedule.pp} vpp={self.schedule.vpp} "
                                   f"m={self.schedule.num_microbatches}")

    def __str__(self) -> str:
        parts = [self.format_instructions()]
        parts += [str(stage) for stage in self.stages.values()]
        parts.append(f"# optimizer step{self.optimizer.inputs}\n{format_graph(self.optimizer.graph)}")
        return "\n\n".join(parts)
