"""Lower one rank: its lowered stages, flat layout and schedule, plus the optimizer step graph.

The step is the dp = 1 step (gcompile.optimizer): gradients as this rank computed
them, state as large as its flat buffer. Rank passes turn it into a dp strategy
by rewriting that graph at its marks. Tracing is cached on (layout, settings,
norm group), so ranks with the same layout share one graph; a pass copies
before it edits.
"""

from gcompile.flat import FlatLayout
from gcompile.mesh import Coords
from gcompile.optimizer import build_optimizer_graph
from gcompile.rank_program import LoweredStage, RankProgram, StepSettings
from gcompile.schedule import Schedule


def lower_rank(coords: Coords, stages: dict[int, LoweredStage], layout: FlatLayout, schedule: Schedule,
               settings: StepSettings) -> RankProgram:
    norm_group = "mp" if coords.tp * coords.pp > 1 else None  # tp x pp ranks hold each gradient once
    return RankProgram(coords=coords, stages=stages, layout=layout, step_settings=settings,
                       optimizer=build_optimizer_graph(layout, settings, norm_group), schedule=schedule)
