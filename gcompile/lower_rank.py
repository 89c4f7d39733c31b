"""Lower one rank: its lowered stages, flat layout and schedule, plus the optimizer step graph and
the instruction list (gcompile.instructions).

The step is the dp = 1 step (gcompile.optimizer): gradients as this rank computed
them, state as large as its flat buffer. Rank passes turn it into a dp strategy
by rewriting that graph at its marks. Tracing is cached on (layout, settings,
norm group), so ranks with the same layout share one graph; a pass copies
before it edits.
"""

from gcompile.flat import FlatLayout
from gcompile.instructions import lower_instructions
from gcompile.axes import Coords, role_size
from gcompile.optimizer import build_optimizer_graph
from gcompile.rank_program import LoweredStage, RankProgram, StepSettings
from gcompile.schedule import Schedule


def lower_rank(coords: Coords, stages: dict[int, LoweredStage], layout: FlatLayout, schedule: Schedule,
               settings: StepSettings, history: tuple[str, ...], device: str = "cpu") -> RankProgram:
    """`history`: the passes that made the forward program, then this step. `device`: where the rank runs."""
    norm_group = "mp" if role_size(coords, "mp") > 1 else None  # tp x pp ranks hold each gradient once
    split = frozenset(s for s, stage in stages.items() if stage.backward_weight is not None)
    return RankProgram(coords=coords, stages=stages, layout=layout, step_settings=settings,
                       optimizer=build_optimizer_graph(layout, settings, norm_group, device), schedule=schedule,
                       instructions=lower_instructions(schedule, coords, split), history=history,
                       norm_group=norm_group)
