"""The compiler, top to bottom: from a run config to the program one rank runs.

    capture          torch.export of the single-device GPT + loss
    passes           tensor_parallel, sequence_parallel, pipeline_split, user passes
    schedule         the rank's static instruction list
    lower            per stage: autograd -> forward graph + backward graph
    layout           the rank's parameters in flat buffers and reduction buckets
    optimizer        AdamW over the flat buffers, as a graph
    rank passes      data_parallel or sharded_optimizer: how gradients cross dp

Every step can be dumped (`--dump-graphs DIR` -> DIR/rank{r}/NN_step.txt).
"""

from collections.abc import Callable

import torch

from gcompile.capture import capture
from gcompile.comm_summary import format_summary
from gcompile.config import RunConfig
from gcompile.lower import lower_stage
from gcompile.mesh import Coords
from gcompile.flat import flat_layout
from gcompile.optimizer import AdamWSettings, LocalGrads, LossScaling, StepSettings, tied_reductions
from gcompile.pass_manager import PassContext, rank_dump_dir, run_passes, run_rank_passes
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


def rank_pass_list(config: RunConfig) -> list[str]:
    """Passes over the lowered rank program (gradient reduction and optimizer sharding)."""
    p = config.parallel
    if p.use_distributed_optimizer:
        return ["sharded_optimizer"]
    return ["data_parallel"] if p.dp > 1 else []


def build_rank_program(config: RunConfig, coords: Coords, device: str = "cpu",
                       dump_root: str | None = None, log: Callable[[str], None] = print) -> RankProgram:
    t, p = config.train, config.parallel
    dump_dir = rank_dump_dir(dump_root, coords.rank)
    ctx = PassContext(config, coords, dump_dir)

    program = capture(config.model, t.micro_batch_size, t.seq_length, device, config.param_dtype)
    program = run_passes(program, pass_list(config), ctx, log)
    schedule = build_schedule(p.pipeline_schedule, p.pp, p.virtual_pipeline_size, config.num_microbatches)
    if schedule.num_stages > 1:
        log(f"schedule {schedule.name} pp={p.pp} vpp={p.virtual_pipeline_size} m={schedule.num_microbatches}: "
            f"predicted bubble {simulate(schedule).bubble_fraction:.1%} (forward 1, backward 2)")
    stages = {s.index: lower_stage(s, t.recompute_activations) for s in program.stages}
    if sorted(stages) != sorted(schedule.local_stages(coords.pp_rank)):
        raise AssertionError(f"rank {coords.rank} holds stages {sorted(stages)} but its schedule runs "
                             f"{schedule.local_stages(coords.pp_rank)}")

    finishing_order = sorted(program.stages, key=lambda s: -s.index)  # later stages' backwards end first
    layout = flat_layout([[(param, tuple(node.meta["val"].shape)) for param, node in
                           zip(stage.params, stage.placeholders())] for stage in finishing_order],
                         dp=coords.dp, bucket_size=config.bucket_size)
    adamw = AdamWSettings(t.adam_beta1, t.adam_beta2, t.adam_eps, t.weight_decay, t.clip_grad)
    scaling = LossScaling(t.initial_loss_scale, t.min_loss_scale, t.loss_scale_window, t.hysteresis) \
        if t.fp16 else None
    settings = StepSettings(adamw=adamw, tp=coords.tp, norm_group=None, loss_scaling=scaling,
                            reductions=tied_reductions(layout),
                            separate_main=config.param_dtype != torch.float32, param_dtype=config.param_dtype)
    rank_program = RankProgram(coords=coords, stages=stages, layout=layout, step_settings=settings,
                               grad_sync=None, optimizer=None, schedule=schedule).with_grad_sync(LocalGrads())
    rank_program = run_rank_passes(rank_program, rank_pass_list(config), ctx, log)

    if dump_dir:
        number = len(program.history)
        for s, stage in stages.items():
            dump_text(dump_dir, f"{number:02d}_lower_stage{s}.txt", str(stage))
        dump_text(dump_dir, f"{number + 1:02d}_optimizer.txt", str(rank_program.optimizer.graph.code))
        dump_text(dump_dir, "schedule.txt", rank_program.format_instructions())
        dump_text(dump_dir, "summary.txt", format_summary(rank_program))
    return rank_program
