"""What one rank runs, as data: its lowered stages, its optimizer step graph, and its instruction list.

Lowering steps build it (gcompile.lower per stage, gcompile.lower_rank for the
rank); rank passes rewrite it into a new one. Nothing here builds a graph.
"""

from dataclasses import dataclass

import torch
import torch.fx as fx

from gcompile.flat import FlatLayout
from gcompile.layout import Param
from gcompile.mesh import Coords
from gcompile.program import activation_roles, format_graph
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
    tp: int
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
    rank_constants: dict[str, int]
    backward_last: fx.GraphModule | None = None
    """The backward of the stage's last microbatch when it also starts dp reductions of finished buckets:
    backward_last(*saved, *output_grads, *last_inputs) -> (*param_grads, *input_grads, *last_outputs)."""
    last_inputs: tuple[tuple[str, int, int], ...] = ()
    """(TrainState buffer, start, end) slices fed to backward_last after the output gradients."""
    last_outputs: tuple[tuple[str, int, int], ...] = ()
    """(TrainState buffer, start, end) slices that backward_last's extra outputs are copied into."""
    backward_weight: fx.GraphModule | None = None
    """Zero-bubble schedules: W, the parameter gradients `backward` (then B) leaves (gcompile/backward_split.py):
    backward(*saved, *output_grads) -> (*param_grads, *input_grads, *stash);
    backward_weight(*[backward's inputs at weight_inputs], *stash) -> (*param_grads)."""
    weight_inputs: tuple[int, ...] = ()
    """Indices into backward's inputs that backward_weight reads (saved activations, output gradients)."""
    num_stash: int = 0
    """Tensors backward returns last, for backward_weight."""

    def activation_inputs(self) -> list[str]:
        return activation_roles(self.inputs, self.rank_constants)

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
    optimizer_shard: str | None = None
    """The group whose ranks each hold 1/n of the optimizer state (main weights, AdamW states, flags),
    rank i the i-th 1/n of every bucket (gcompile.flat); None: every rank holds all of it."""

    @property
    def instructions(self) -> tuple[Action, ...]:
        return self.schedule.actions[self.coords.pp_rank]

    @property
    def shard_rank(self) -> int | None:
        """Which 1/n of the optimizer state this rank holds (the flat layout cuts buckets per dp rank);
        None when it holds all of it."""
        return None if self.optimizer_shard is None else self.coords.dp_rank

    def format_instructions(self) -> str:
        """`07 F stage=1 mb=3 in=act[s0,mb3] out=act[s1,mb3]`, one line per instruction."""
        lines = [f"# rank {self.coords.rank} {self.coords}: {len(self.instructions)} instructions, "
                 f"schedule {self.schedule.name} pp={self.schedule.pp} vpp={self.schedule.vpp} "
                 f"m={self.schedule.num_microbatches}"]
        last = self.schedule.pp * self.schedule.vpp - 1
        for i, a in enumerate(self.instructions):
            s, mb = a.stage, a.mb
            if a.kind == Kind.F:
                src = "batch" if s == 0 else f"act[s{s - 1},mb{mb}]"
                dst = "loss" if s == last else f"act[s{s},mb{mb}]"
                detail = f"in={src} out={dst}"
            elif a.kind == Kind.B:
                src = "loss_scale" if s == last else f"grad[s{s + 1},mb{mb}]"
                dst = "param_grads" if s == 0 else f"param_grads,grad[s{s},mb{mb}]"
                split = self.stages[s].backward_weight is not None
                detail = f"in={src} out={dst}" + (f",for_w[s{s},mb{mb}]" if split else "")
            elif a.kind == Kind.W:
                split = self.stages[s].backward_weight is not None
                detail = f"in=for_w[s{s},mb{mb}] out=param_grads" if split else "nothing left (B ran it all)"
            elif a.kind in (Kind.SEND_F, Kind.RECV_F):
                peer = self.schedule.stage_rank(s + 1 if a.kind == Kind.SEND_F else s - 1)
                detail = f"act[s{s if a.kind == Kind.SEND_F else s - 1},mb{mb}] {'to' if a.kind == Kind.SEND_F else 'from'} pp{peer}"
            else:
                peer = self.schedule.stage_rank(s - 1 if a.kind == Kind.SEND_B else s + 1)
                detail = f"grad[s{s if a.kind == Kind.SEND_B else s + 1},mb{mb}] {'to' if a.kind == Kind.SEND_B else 'from'} pp{peer}"
            lines.append(f"{i:02d} {a.kind.value} stage={s} mb={mb} {detail}")
        lines.append(f"{len(self.instructions):02d} OPT_STEP params={self.layout.numel} "
                     f"buckets={len(self.layout.buckets)} optimizer_shard={self.optimizer_shard}")
        return "\n".join(lines)

    def __str__(self) -> str:
        parts = [self.format_instructions()]
        parts += [str(stage) for stage in self.stages.values()]
        parts.append(f"# optimizer step{self.optimizer.inputs}\n{format_graph(self.optimizer.graph)}")
        return "\n\n".join(parts)
