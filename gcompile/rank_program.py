"""What one rank runs: its lowered stages, its optimizer graph, and its instruction list."""

from dataclasses import dataclass, replace

from gcompile.flat import FlatLayout
from gcompile.lower import LoweredStage
from gcompile.axes import Coords
from gcompile.optimizer import GradSync, OptimizerGraph, StepSettings, build_optimizer_graph
from gcompile.program import format_graph
from gcompile.schedule import Action, Kind, Schedule


@dataclass(frozen=True)
class RankProgram:
    coords: Coords
    stages: dict[int, LoweredStage]
    """This rank's stages by global stage index."""
    layout: FlatLayout
    """This rank's parameters in its flat buffers."""
    step_settings: StepSettings
    grad_sync: GradSync
    """How data parallelism reduces gradients and syncs weights (set by the dp passes)."""
    optimizer: OptimizerGraph
    schedule: Schedule

    @property
    def instructions(self) -> tuple[Action, ...]:
        return self.schedule.actions[self.coords.axis_rank("pp")]

    def with_grad_sync(self, grad_sync: GradSync) -> "RankProgram":
        """The same program with another dp strategy, its optimizer graph rebuilt to match."""
        c = self.coords
        if grad_sync.sharded:
            norm_group = "world" if c.world_size > 1 else None
        else:
            norm_group = "mp" if c.size("tp") * c.size("pp") > 1 else None
        settings = replace(self.step_settings, norm_group=norm_group,
                           separate_main=self.step_settings.separate_main or grad_sync.sharded)
        return replace(self, step_settings=settings, grad_sync=grad_sync,
                       optimizer=build_optimizer_graph(self.layout, settings, grad_sync))

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
        sync = type(self.grad_sync).__name__
        lines.append(f"{len(self.instructions):02d} OPT_STEP params={self.layout.numel} "
                     f"buckets={len(self.layout.buckets)} grad_sync={sync}")
        return "\n".join(lines)

    def __str__(self) -> str:
        parts = [self.format_instructions()]
        parts += [str(stage) for stage in self.stages.values()]
        parts.append(f"# optimizer step{self.optimizer.inputs}\n{format_graph(self.optimizer.graph)}")
        return "\n\n".join(parts)
