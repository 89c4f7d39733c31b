"""What one rank runs: its lowered stages, its optimizer graph, and its instruction list."""

from dataclasses import dataclass, replace

import torch.fx as fx

from gcompile.flat import FlatLayout
from gcompile.instructions import OPTIMIZER, Instruction, format_instructions
from gcompile.lower import LoweredStage
from gcompile.axes import Coords
from gcompile.optimizer import GradSync, OptimizerGraph, StepSettings, build_optimizer_graph
from gcompile.program import format_graph
from gcompile.schedule import Schedule


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
    instructions: tuple[Instruction, ...]
    """What the rank runs per iteration, in order, the optimizer step last (gcompile.instructions)."""
    history: tuple[str, ...] = ()
    """The passes and lowering steps that made this program, in order."""

    def graph(self, instruction: Instruction) -> fx.GraphModule:
        """The graph an instruction runs."""
        if instruction.graph == OPTIMIZER:
            return self.optimizer.graph
        return self.stages[instruction.stage].graphs()[instruction.graph]

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
        return format_instructions(self.instructions, f"rank {self.coords.rank} {self.coords}, schedule "
                                   f"{self.schedule.name} pp={self.schedule.pp} vpp={self.schedule.vpp} "
                                   f"m={self.schedule.num_microbatches}")

    def __str__(self) -> str:
        parts = [self.format_instructions()]
        parts += [str(stage) for stage in self.stages.values()]
        parts.append(f"# optimizer step{self.optimizer.inputs}\n{format_graph(self.optimizer.graph)}")
        return "\n\n".join(parts)
