"""The compiler, top to bottom: from a run config to the program one rank runs.

    capture          torch.export of the single-device GPT + loss
    passes           tensor_parallel, sequence_parallel, pipeline_split, user passes
    lower            per stage: autograd -> forward graph + backward graph
    optimizer        AdamW over the rank's flat buffers, as a graph
    schedule         the rank's static instruction list

Every step can be dumped (`--dump-graphs DIR` -> DIR/rank{r}/NN_step.txt).
"""

from collections.abc import Callable

import torch

from gcompile.capture import capture
from gcompile.config import RunConfig
from gcompile.lower import lower_stage
from gcompile.mesh import Coords
from gcompile.optimizer import AdamWSettings, build_optimizer_graph, flat_layout, tied_reductions
from gcompile.pass_manager import PassContext, rank_dump_dir, run_passes
from gcompile.program import dump_text
from gcompile.rank_program import RankProgram
from gcompile.schedule import build_schedule, simulate


def pass_list(config: RunConfig) -> list[str]:
    """The passes a config asks for, in the order they run."""
    p = config.parallel
    passes = []
    if p.tp > 1:
        passes.append("tensor_parallel")
    if p.sequence_parallel:
        passes.append("sequence_parallel")
    if p.pp * p.virtual_pipeline_size > 1:
        passes.append("pipeline_split")
    return passes + list(p.passes)


def build_rank_program(config: RunConfig, coords: Coords, device: str = "cpu", dtype: torch.dtype = torch.float32,
                       dump_root: str | None = None, log: Callable[[str], None] = print) -> RankProgram:
    t, p = config.train, config.parallel
    dump_dir = rank_dump_dir(dump_root, coords.rank)

    program = capture(config.model, t.micro_batch_size, t.seq_length, device, dtype)
    program = run_passes(program, pass_list(config), PassContext(config, coords, dump_dir), log)
    schedule = build_schedule(p.pipeline_schedule, p.pp, p.virtual_pipeline_size, config.num_microbatches)
    if schedule.num_stages > 1:
        log(f"schedule {schedule.name} pp={p.pp} vpp={p.virtual_pipeline_size} m={schedule.num_microbatches}: "
            f"predicted bubble {simulate(schedule).bubble_fraction:.1%} (forward 1, backward 2)")
    stages = {s.index: lower_stage(s, t.recompute_activations) for s in program.stages}
    if sorted(stages) != sorted(schedule.local_stages(coords.pp_rank)):
        raise AssertionError(f"rank {coords.rank} holds stages {sorted(stages)} but its schedule runs "
                             f"{schedule.local_stages(coords.pp_rank)}")

    params, shapes = {}, {}
    for stage in program.stages:  # stages of one rank that read one parameter share its buffer
        for param, node in zip(stage.params, stage.placeholders()):
            if params.setdefault(param.name, param) != param:
                raise AssertionError(f"rank {coords.rank}: two stages hold {param.name} differently: "
                                     f"{params[param.name]} and {param}")
            shapes.setdefault(param.name, tuple(node.meta["val"].shape))
    layout = flat_layout(list(params.values()), [shapes[n] for n in params], tp=coords.tp)
    settings = AdamWSettings(t.adam_beta1, t.adam_beta2, t.adam_eps, t.weight_decay, t.clip_grad)
    norm_group = "mp" if coords.tp * coords.pp > 1 else None
    optimizer = build_optimizer_graph(layout, settings, layout.numel, norm_group, tied_reductions(layout))

    rank_program = RankProgram(coords=coords, stages=stages, layout=layout, optimizer=optimizer,
                               shard_numel=layout.numel, schedule=schedule)
    if dump_dir:
        number = len(program.history)
        for s, stage in stages.items():
            dump_text(dump_dir, f"{number:02d}_lower_stage{s}.txt", str(stage))
        dump_text(dump_dir, f"{number + 1:02d}_optimizer.txt", str(rank_program.optimizer.code))
        dump_text(dump_dir, "schedule.txt", rank_program.format_instructions())
    return rank_program
