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
from gcompile.axes import GROUP_ROLES, Coords, role_size, world_axes_of
from gcompile.optimizer import build_optimizer_graph
from gcompile.rank_program import LoweredStage, RankProgram, StepSettings
from gcompile.schedule import Schedule


def lower_rank(coords: Coords, stages: dict[int, LoweredStage], layout: FlatLayout, schedule: Schedule,
               settings: StepSettings, history: tuple[str, ...], device: str = "cpu") -> RankProgram:
    """`history`: the passes that made the forward program, then this step. `device`: where the rank runs."""
    norm_group = _norm_group(coords, layout)
    split = frozenset(s for s, stage in stages.items() if stage.backward_weight is not None)
    return RankProgram(coords=coords, stages=stages, layout=layout, step_settings=settings,
                       optimizer=build_optimizer_graph(layout, settings, norm_group, device), schedule=schedule,
                       instructions=lower_instructions(schedule, coords, split), history=history,
                       norm_group=norm_group)


def _norm_group(coords: Coords, layout: FlatLayout) -> str | None:
    """The smallest group whose ranks together hold every gradient element: tp x pp ("mp"), or the whole
    world once a parameter is cut over another axis (dp under optim_grads_params); None for one rank."""
    cut = {"tp", "pp"} | {axis for p in layout.params for s in p.shards for axis in world_axes_of(s.axis)}
    role = next(role for role in ("mp", "world") if cut <= set(GROUP_ROLES[role].axes))
    return role if role_size(coords, role) > 1 else None
