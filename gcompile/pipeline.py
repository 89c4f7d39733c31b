"""The compiler, top to bottom: from a run config to the program one rank runs.

    capture          torch.export of the model's factory (its ModelSpec) on an example batch
    passes           tensor_parallel, sequence_parallel, context_parallel, expert_parallel, pipeline_split,
                     user passes (forward Program)
    reports          what the model reports (gcompile.report) becomes extra, detached stage outputs
    schedule         the pipeline schedule, as data
    lower            per stage: autograd -> forward graph + backward graph (+ W for zero bubble)
    layout           the rank's parameters in flat buffers and reduction buckets
    lower_rank       the dp = 1 optimizer step as a graph, and the rank's instruction list
    rank passes      tp_comm_overlap: tp collectives started early, waited late;
                     data_parallel or sharded_optimizer (optim, optim_grads): gradients across dp (x cp),
                     rewritten into the step;
                     user passes (RankProgram)

This is the one module that imports the built-in passes (registering them by name).
Every step can be dumped (`--dump-graphs DIR` -> DIR/rank{r}/NN_step.txt).
"""

import functools
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from gcompile.capture import capture
from gcompile.comm_summary import format_summary
from gcompile.config import POINTS, RunConfig
from gcompile.lower import lower_stage, split_lowered
from gcompile.lower_pieces import lower_by_pieces
from gcompile.lowering_line import Lines
from gcompile.axes import Coords
from gcompile.flat import flat_layout
from gcompile.lower_rank import lower_rank
from gcompile.optimizer import tied_reductions
import passes  # noqa: F401  registers the built-in passes
from gcompile.pass_manager import (DUMP_FILE, PassContext, PassError, clear_rank_dump, rank_dump_dir, resolve_pass,
                                   run_passes, run_rank_passes)
from gcompile.program import Program, Stage, dump_text, format_graph, refresh_meta, structure_key
from gcompile.report import reported, to_outputs
from gcompile.rank_program import AdamWSettings, LoweredStage, LossScaling, RankProgram, StepSettings
from gcompile.schedule import build_schedule, simulate
from gcompile.torch_api import lazy_graph_modules


GRAD_SYNC = {"no_shard": "data_parallel", "optim": "sharded_optimizer", "optim_grads": "sharded_optimizer",
             "optim_grads_params": "fully_sharded"}
"""The pass that makes gradients cross dp ranks, by sharding strategy (the `grad_sync` point)."""


def builtin_passes(config: RunConfig) -> list[str]:
    """The built-in passes a config asks for, in the order they run."""
    p = config.parallel
    names = []
    if p.tp > 1:
        names.append("tensor_parallel")
    if p.sequence_parallel and p.tp > 1:
        names.append("sequence_parallel")
    if p.cp > 1:
        names.append("context_parallel")
    if p.ep > 1:
        names.append("expert_parallel")
    if p.pp * p.virtual_pipeline_size > 1:
        names.append("pipeline_split")
    if p.tp > 1 and p.overlap_tp_comm:
        names.append("tp_comm_overlap")
    if p.sharding != "no_shard" or p.dp * p.cp > 1:
        names.append(GRAD_SYNC[p.sharding])
    return names


def user_pass_point(entry: str, config: RunConfig, builtin: list[str]) -> tuple[float, str]:
    """`[before:|after:]POINT=SPEC` or a bare SPEC (after pipeline_split, before lowering) -> (position among
    POINTS, spec). POINT is capture, lower, grad_sync (whichever dp strategy this run has) or a built-in
    pass this run runs: a point that does not run would silently move the pass to another place."""
    where, _, spec = entry.rpartition("=") if "=" in entry else ("", "", entry)
    if not where:
        return POINTS.index("pipeline_split") + 0.5, spec
    side, _, point = where.partition(":")
    if point == "grad_sync":
        point = GRAD_SYNC[config.parallel.sharding]
    elif point not in ("capture", "lower") and point not in builtin:
        runs = f"its built-in passes are {', '.join(builtin)}" if builtin else "it runs no built-in pass"
        raise PassError(f"passes entry {entry!r}: {point} does not run in this layout ({runs}); place the pass "
                        f"at capture, lower, grad_sync (where gradients cross dp ranks) or a pass that runs")
    return POINTS.index(point) + (0.5 if side == "after" else -0.5), spec


def pass_lists(config: RunConfig) -> tuple[list[str], list[str]]:
    """(passes over the forward program, passes over the lowered rank program), built-in and user, in order."""
    builtin = builtin_passes(config)
    placed = [(float(POINTS.index(name)), name) for name in builtin]
    placed += [user_pass_point(entry, config, builtin) for entry in config.parallel.passes]
    placed.sort(key=lambda item: item[0])
    lower = POINTS.index("lower")
    return [name for at, name in placed if at < lower], [name for at, name in placed if at > lower]


def load_passes(config: RunConfig) -> None:
    """Import every pass a build of `config` runs, so that a user pass that cannot be placed or loaded
    (a syntax error, an exception at import, no such function) is refused before any rank starts."""
    for spec in sum(pass_lists(config), []):
        resolve_pass(spec)


def passes_until(forward_passes: list[str], rank_passes: list[str], last: str) -> tuple[list[str], list[str]]:
    """`pass_lists` cut after the pass `last` ("capture": before the first)."""
    order = ["capture", *forward_passes, *rank_passes]
    if last not in order:
        raise ValueError(f"no pass {last!r} in this build; its passes: {', '.join(order)}")
    kept = order[1:order.index(last) + 1]
    return kept[:len(forward_passes)], kept[len(forward_passes):]


@dataclass
class BuildCache:
    """What ranks of one world share while their programs are built in one process."""

    captured: dict = field(default_factory=dict)
    forward: dict = field(default_factory=dict)
    """A rank's program after the forward passes, with its reports (_forward_program)."""
    whole_model: dict = field(default_factory=dict)
    """The program after the passes that see the whole model, and their dump files (_forward_passes)."""
    lowered: dict = field(default_factory=dict)
    schedules: dict = field(default_factory=dict)
    seconds: Counter = field(default_factory=Counter)
    """Time spent in capture, passes and lowering, over all ranks built: what the launcher reports."""
    lines: Lines | None = None
    """Where given (the planner), a stage on the line of two lowered ones is not lowered but derived from
    them (gcompile.lowering_line): its program is costed, never run."""
    by_pieces: bool = False
    """Where set (the planner), a stage is lowered from its blocks' lowerings (gcompile.lower_pieces): its
    program is costed, never run."""


def build_rank_program(config: RunConfig, coords: Coords, device: str = "cpu",
                       dump_root: str | None = None, log: Callable[[str], None] = print,
                       cache: BuildCache | None = None, stop_after: str | None = None) -> RankProgram:
    """`stop_after`: build with the passes up to and including this one only ("capture": none), as the
    numerics bisection does (gcompile.bisection). Its graphs make their Python code when first run."""
    with lazy_graph_modules():
        return _build_rank_program(config, coords, device, dump_root, log, cache, stop_after)


def _build_rank_program(config: RunConfig, coords: Coords, device: str, dump_root: str | None,
                        log: Callable[[str], None], cache: BuildCache | None, stop_after: str | None) -> RankProgram:
    t, p = config.train, config.parallel
    cache = cache or BuildCache()
    dump_dir = rank_dump_dir(dump_root, coords.rank)
    if dump_dir:
        clear_rank_dump(dump_dir)
    ctx = PassContext(config, coords, dump_dir)
    forward_passes, rank_passes = pass_lists(config)
    if stop_after is not None:
        forward_passes, rank_passes = passes_until(forward_passes, rank_passes, stop_after)

    key = (config.model, t.micro_batch_size, t.seq_length, device, config.param_dtype)
    captured = captured_program(config, cache, device, log)
    start = time.perf_counter()
    program, reports = _forward_program(captured, forward_passes, ctx, cache, key, log)
    cache.seconds["passes"] += time.perf_counter() - start
    key = (p.pipeline_schedule, p.pp, p.virtual_pipeline_size, config.num_microbatches)
    if key not in cache.schedules:
        cache.schedules[key] = build_schedule(*key)
        if cache.schedules[key].num_stages > 1:
            log(f"schedule {key[0]} pp={p.pp} vpp={p.virtual_pipeline_size} m={key[3]}: bubble at unit costs "
                f"{simulate(cache.schedules[key]).bubble_fraction:.1%} (forward 1, backward 2"
                f"{', of it W 1' if cache.schedules[key].splits_backward else ''})")
    schedule = cache.schedules[key]
    stages = {s.index: _lower(s, t.recompute_activations, schedule.splits_backward, cache, log)
              for s in program.stages}
    if sorted(stages) != sorted(schedule.local_stages(coords.axis_rank("pp"))):
        raise AssertionError(f"rank {coords.rank} holds stages {sorted(stages)} but its schedule runs "
                             f"{schedule.local_stages(coords.axis_rank('pp'))}")

    finishing_order = sorted(program.stages, key=lambda s: -s.index)  # later stages' backwards end first
    layout = flat_layout([[(param, tuple(node.meta["val"].shape)) for param, node in
                           zip(stage.params, stage.placeholders())] for stage in finishing_order],
                         sizes=coords.axis_sizes, bucket_size=config.bucket_size)
    adamw = AdamWSettings(t.adam_beta1, t.adam_beta2, t.adam_eps, t.weight_decay, t.clip_grad)
    scaling = LossScaling(t.initial_loss_scale, t.min_loss_scale, t.loss_scale_window, t.hysteresis) \
        if t.fp16 else None
    settings = StepSettings(adamw=adamw, loss_scaling=scaling, reductions=tied_reductions(layout),
                            separate_main=config.param_dtype != torch.float32 or p.sharding in ("optim", "optim_grads"),
                            param_dtype=config.param_dtype)
    rank_program = lower_rank(coords, stages, layout, schedule, settings, history=(*program.history, "lower"),
                              device=device)
    rank_program = replace(rank_program, reported=reports)
    number = len(program.history)
    if dump_dir:
        for s, stage in stages.items():
            dump_text(dump_dir, f"{number:02d}_lower_stage{s}.txt", str(stage))
    start = time.perf_counter()
    rank_program = run_rank_passes(rank_program, rank_passes, ctx, log, first_number=number + 1)
    cache.seconds["passes"] += time.perf_counter() - start
    if dump_dir:
        number += 1 + len(rank_passes)
        dump_text(dump_dir, f"{number:02d}_optimizer.txt", f"# optimizer step{rank_program.optimizer.inputs}\n"
                                                          f"{format_graph(rank_program.optimizer.graph)}")
        dump_text(dump_dir, "schedule.txt", rank_program.format_instructions() + "\n")
        dump_text(dump_dir, "summary.txt", format_summary(rank_program))
    return rank_program


def captured_program(config: RunConfig, cache: BuildCache, device: str = "cpu",
                     log: Callable[[str], None] = print) -> Program:
    """The model captured for the run's micro-batch, once per cache."""
    t, spec = config.train, config.model_spec
    key = (config.model, t.micro_batch_size, t.seq_length, device, config.param_dtype)
    if key not in cache.captured:
        start = time.perf_counter()
        cache.captured[key] = capture(functools.partial(spec.module, config.model),
                                      spec.example_batch(t.micro_batch_size, t.seq_length), spec.decays,
                                      device, config.param_dtype, config.model.vocab_size)
        seconds = time.perf_counter() - start
        cache.seconds["capture"] += seconds
        log(f"captured {spec.name} with torch.export in {seconds:.1f} s")
    return cache.captured[key]


def _forward_program(captured: Program, forward_passes: list[str], ctx: PassContext, cache: BuildCache,
                     captured_key: tuple, log: Callable[[str], None]) -> tuple[Program, list[str]]:
    """The rank's stages after the forward passes, what the model reports (gcompile.report) as extra outputs,
    and the names of those reports. Builds that differ only in what no forward pass reads (UNREAD_BY_FORWARD)
    share it: the planner's candidates do, many times over; so do ranks that differ only in their dp position,
    which no built-in forward pass reads (world.representatives; tests/test_plan.py checks it)."""
    key = (captured_key, ctx.config.without(UNREAD_BY_FORWARD), ctx.coords.moved(dp=0), tuple(forward_passes))
    shared = ctx.dump_dir is None and not ctx.config.parallel.passes  # a user pass may read anything
    if shared and key in cache.forward:
        return cache.forward[key]
    program = _forward_passes(captured, forward_passes, ctx, cache, captured_key, log)
    reports = reported(captured.stages[0].graph)  # the whole model's, for every rank alike
    for stage in program.stages:
        stage.outputs = to_outputs(stage.graph, stage.outputs)
        refresh_meta(stage)
    if shared:
        cache.forward[key] = program, reports
    return program, reports


def _forward_passes(captured: Program, forward_passes: list[str], ctx: PassContext, cache: BuildCache,
                    captured_key: tuple, log: Callable[[str], None]) -> Program:
    """Run the forward passes. The built-in ones before pipeline_split (WHOLE_MODEL_PASSES; a layout of pp 1 shares
    them with one of pp 2) see the whole model and read only the
    tp, cp and ep axes (WHOLE_MODEL_AXES), so ranks that differ only in their pp or dp position share their
    result and its dumps (a 16-stage world runs them once per 16 ranks), and so do the planner's layouts that
    differ only in pp, dp and vpp (gpt2-small on 8 ranks: a third of its planning time); a user pass may read
    anything, so with user passes every rank runs them all."""
    split = next((i for i, name in enumerate(forward_passes) if name not in WHOLE_MODEL_PASSES), len(forward_passes))
    whole, per_rank = forward_passes[:split], forward_passes[split:]
    if not whole or ctx.config.parallel.passes:
        return run_passes(captured.clone(), forward_passes, ctx, log)
    axes = tuple((axis, ctx.coords.size(axis), ctx.coords.axis_rank(axis)) for axis in WHOLE_MODEL_AXES)
    key = (captured_key, ctx.config.without(UNREAD_BY_WHOLE_MODEL), axes, tuple(whole), ctx.dump_dir is not None)
    if key not in cache.whole_model:
        program = run_passes(captured.clone(), whole, ctx, log)
        dumped = {} if ctx.dump_dir is None else {  # what it wrote into the folder build_rank_program cleared
            name: open(os.path.join(ctx.dump_dir, name)).read() for name in os.listdir(ctx.dump_dir)
            if DUMP_FILE.fullmatch(name)}
        cache.whole_model[key] = (program, dumped)
    program, dumped = cache.whole_model[key]
    for name, text in dumped.items():
        dump_text(ctx.dump_dir, name, text)  # again into the first rank's folder: the same text
    shared = program.stages
    program = run_passes(replace(program, history=list(program.history)), per_rank, ctx, log,
                         first_number=len(whole) + 1)  # run_passes appends to the history
    if any(a is b for a, b in zip(program.stages, shared)):  # no pass made new stages (none ran, or FSDP over one
        return program.clone()  # dp rank): the caller rewrites the stages' outputs in place
    return program


UNREAD_BY_FORWARD = {"parallel": ("pipeline_schedule", "data_parallel_sharding_strategy"),
                     "train": ("recompute_activations", "global_batch_size")}
"""Config fields only the schedule, lowering and the rank's program read (the microbatch count among them;
how dp shards is the rank passes' business)."""
UNREAD_BY_WHOLE_MODEL = {**UNREAD_BY_FORWARD,
                         "parallel": (*UNREAD_BY_FORWARD["parallel"], "pp", "virtual_pipeline_size", "dp")}
"""Config fields the built-in passes before pipeline_split do not read either: how the stages are cut, and
how many replicas there are."""
WHOLE_MODEL_PASSES = POINTS[1:POINTS.index("pipeline_split")]
"""The built-in passes that see the whole model: tensor, sequence, context and expert parallel."""
WHOLE_MODEL_AXES = ("tp", "cp", "ep")
"""The mesh axes (size and this rank's position) the built-in passes before pipeline_split read."""


def _lowered(stage: Stage, key: tuple, cache: BuildCache, log: Callable[[str], None], what: str,
             recompute: bool = False, needs_grad: tuple[bool, ...] | None = None) -> LoweredStage:
    """`stage` lowered, or derived from two lowerings on its line, kept under `key` (its structure_key, then what
    else its lowering depends on)."""
    if key not in cache.lowered:
        start = time.perf_counter()
        derived = cache.lines and cache.lines.derive(stage, key[1:])
        cache.lowered[key] = derived or lower_stage(stage, recompute, needs_grad)
        seconds = time.perf_counter() - start
        cache.seconds["derived" if derived else "lowering"] += seconds
        if cache.lines is not None and not derived:
            cache.lines.add(stage, key[1:], cache.lowered[key])
        log(f"derived {what} from two lowerings on its line in {seconds:.1f} s" if derived else
            f"lowered {what} with autograd (forward and backward graphs) in {seconds:.1f} s")
    return cache.lowered[key]


def _lower_piece(piece: Stage, needs_grad: tuple[bool, ...], cache: BuildCache,
                 log: Callable[[str], None]) -> LoweredStage:
    return _lowered(piece, (structure_key(piece.graph), needs_grad), cache, log, "a piece", needs_grad=needs_grad)


def _lower(stage: Stage, recompute: bool, split: bool, cache: BuildCache, log: Callable[[str], None]) -> LoweredStage:
    """Lower a stage, or reuse the lowering of an identical one (the same ops over the same input values, the
    names aside: a pipeline's middle stages); its backward split for zero bubble is a copy of the whole
    backward's lowering split."""
    whole = (structure_key(stage.graph), recompute, stage.recompute_from_params)
    key = (*whole, "split") if split else whole
    if whole not in cache.lowered:
        stitched = cache.by_pieces and not recompute and \
            lower_by_pieces(stage, functools.partial(_lower_piece, cache=cache, log=log))
        cache.lowered[whole] = stitched or _lowered(stage, whole, cache, log, f"stage {stage.index}", recompute)
    if key not in cache.lowered:
        cache.lowered[key] = split_lowered(cache.lowered[whole])
    return replace(cache.lowered[key], index=stage.index, params=list(stage.params), inputs=list(stage.inputs),
                   outputs=list(stage.outputs), rank_constants=dict(stage.rank_constants))
