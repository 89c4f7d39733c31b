"""The training loop: data, learning-rate schedule, steps, validation, logging, checkpoints.

Each rank builds its own program, state and runtime, then every rank steps in
lockstep; the loss lives on the last pipeline stage and is logged by the rank
at (last pp stage, dp 0, tp 0). The learning rate is a function of the
iteration, and the batch one of the consumed-sample count, so a run resumed
from a checkpoint takes the same steps as one that was never cut.
"""

import dataclasses
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist

from gcompile import checkpoint, shutdown
from gcompile.checkpoint import Progress
from gcompile.compile import Compiler, compile_rank_program, dump_generated_code, format_rank_stats
from gcompile.reported import Interval
from gcompile.cuda_graphs import GraphedTrainStep, host_reads
from gcompile.config import RunConfig, TrainConfig
from gcompile.blend import BlendedDataset, parse_blend
from gcompile.check import MeasuredMemory, estimate_memory
from gcompile.checked_plan import check_built
from gcompile.data import DataError, GPTDataset, build_datasets, check_token_ids
from gcompile.flight import FlightRecorder, flight_dir, rank_file
from gcompile.log import MetricsLog
from gcompile.memory import MIB
from gcompile.axes import Coords, role_size
from gcompile.mesh import group
from gcompile.pass_manager import rank_dump_dir
from gcompile.pipeline import build_rank_program
from gcompile.program import dump_text
from gcompile.rank_program import RankProgram
from gcompile.runtime import Runtime
from gcompile.schedule import Schedule, format_table, simulate
from gcompile.schedule_render import render_svg
from gcompile.state import TrainState
from gcompile.stop import any_rank, check_state, check_step, step_flags


LR_SCHEDULE = ("lr", "min_lr", "lr_warmup_iters", "lr_decay_iters", "lr_decay_style", "train_iters")
"""The TrainConfig fields `lr_at` reads: a resume that changes one of them changes the learning-rate curve."""


def lr_at(iteration: int, t: TrainConfig) -> float:
    """Learning rate of step `iteration` (1-based): linear warmup, then decay to min_lr (Megatron's shapes)."""
    if t.lr_warmup_iters > 0 and iteration <= t.lr_warmup_iters:
        return t.lr * iteration / t.lr_warmup_iters
    if t.lr_decay_style == "constant":
        return t.lr
    decay_iters = t.lr_decay_iters or t.train_iters
    if iteration > decay_iters:
        return t.min_lr
    ratio = (iteration - t.lr_warmup_iters) / max(1, decay_iters - t.lr_warmup_iters)
    coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0) if t.lr_decay_style == "cosine" else 1.0 - ratio
    return t.min_lr + coeff * (t.lr - t.min_lr)


def microbatches(dataset: GPTDataset | BlendedDataset, consumed_samples: int, config: RunConfig, coords: Coords, device):
    """This dp rank's share of the global batch starting at `consumed_samples`, as (idx, targets) pairs."""
    t = config.train
    per_rank = t.global_batch_size // coords.size("dp")
    tokens = dataset.batch(consumed_samples + coords.axis_rank("dp") * per_rank, per_rank).to(device)  # (B, T+1)
    return split_microbatches(tokens, t.micro_batch_size)


def split_microbatches(tokens: torch.Tensor, micro_batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(B, T+1) samples -> [(idx, targets)] of (micro_batch_size, T) each, contiguous as the graphs expect."""
    return [(mb[:, :-1].contiguous(), mb[:, 1:].contiguous()) for mb in tokens.split(micro_batch_size)]


def is_logging_rank(coords: Coords) -> bool:
    """The last pipeline stage's rank at position 0 on every other axis: it holds the loss."""
    return coords == coords.moved(**dict({axis: 0 for axis, _ in coords.ranks}, pp=coords.size("pp") - 1))


def train(config: RunConfig, coords: Coords, device: str = "cpu", log=print) -> list[dict]:
    """Run the whole training; returns the logged records (on the logging rank; empty elsewhere)."""
    t = config.train
    recorder = FlightRecorder(rank_file(flight_dir(config.log.run_dir), coords.rank))
    recorder.phase("reading data")
    train_data, valid_data = build_datasets(config.data, t.seq_length, t.seed)
    check_token_ids(config.data, train_data, valid_data, config.model.vocab_size)  # under torchrun too
    logging = is_logging_rank(coords)
    quiet = (lambda _: None) if coords.rank != 0 else log

    recorder.phase("building the rank program")
    program = build_rank_program(config, coords, device, dump_root=config.log.dump_graphs, log=quiet)
    check_built(config, program)  # the program the launcher checked for this rank
    if config.log.dump_schedule and coords.rank == 0:
        dump_schedule(program.schedule, config.log.run_dir, log)
    compiler = Compiler(enabled=t.compile, log=quiet)
    recorder.phase("compiling" if t.compile else "preparing the graphs")
    functions, optimizer_step = compile_rank_program(program, compiler)
    if t.compile and config.log.dump_graphs:
        dump_generated_code(program, compiler, rank_dump_dir(config.log.dump_graphs, coords.rank))
    if t.compile:
        for line in format_rank_stats(_every_rank(compiler.stats, coords)):
            quiet(line)
    state = TrainState.initial(program, config.model, t.seed, device)
    quiet(f"rank 0 memory: {MeasuredMemory.of(state)}; estimated {estimate_memory(program)}")
    seed_generators(t.seed, coords)
    recorder.phase("loading the checkpoint")
    progress = resume(config, program, state, log=quiet)  # on the saving layout, restores the generators
    if progress.iteration >= t.train_iters:
        quiet(f"the checkpoint is at iteration {progress.iteration}, --train-iters {t.train_iters}: nothing to "
              f"train (raise --train-iters to go on)")
    runtime = Runtime(program, functions, optimizer_step, state, recorder=recorder)
    train_step = runtime.train_step
    if t.cuda_graphs if t.cuda_graphs is not None else t.compile:
        if not device.startswith("cuda"):
            if t.cuda_graphs:
                quiet("--cuda-graphs: no CUDA device here; the instruction list runs directly")
        elif program.grad_accumulator and not program.grads_between_steps:  # a replay cannot free and
            # reallocate the accumulator
            quiet("CUDA graphs: not under optim_grads with a pipeline-tied embedding, whose gradient "
                  "accumulator is freed between steps")
        elif reads := host_reads(program):
            quiet(f"CUDA graphs: not with {', '.join(reads)} (mixture of experts), which reads its "
                  f"group sizes on the host; the instruction list runs directly")
        else:
            train_step = GraphedTrainStep(runtime)

    metrics = MetricsLog(config.log.run_dir, config.log.tensorboard_dir, t.train_iters, coords.world_size,
                         progress.iteration, log, progress.skipped_iterations) if logging else None
    flops = config.model_spec.flops(config.model, t.global_batch_size, t.seq_length)
    records, skipped, consumed = [], progress.skipped_iterations, progress.consumed_samples
    reported = Interval(program, config.num_microbatches, device)  # since the last log line
    c = config.checkpoint
    for iteration in range(progress.iteration + 1, t.train_iters + 1):
        recorder.phase(f"iteration {iteration}")
        batch = microbatches(train_data, consumed, config, coords, device)
        lr = lr_at(iteration, t)
        state.lr.fill_(lr)
        first = iteration == progress.iteration + 1
        if first:
            runtime.start_measuring()  # a little host work per instruction, this step only
        start = time.perf_counter()
        result = train_step(batch)
        peak = runtime.stop_measuring() if first else None
        loss = _mean_over_dp(result.loss, coords, recorder)
        step_skipped = int(result.skipped.item())
        skipped += step_skipped
        elapsed_ms = (time.perf_counter() - start) * 1e3
        if peak:
            estimate = estimate_memory(program)
            gathered = f" + gathered {estimate.gathered / MIB:.1f}" if estimate.gathered else ""
            inside = "; its activations at the peak inside a backward, which recomputes its forward there and " \
                     "which the measure, taken between instructions, does not see" if t.recompute_activations else ""
            quiet(f"rank 0 memory over its first step: {peak}; estimated {estimate.total / MIB:.1f} MiB "
                  f"(state {estimate.state / MIB:.1f} + activations {estimate.activations / MIB:.1f} + messages "
                  f"{estimate.messages / MIB:.1f}{gathered}{inside})")
        consumed += t.global_batch_size
        reported.add(runtime.metrics)
        reports = reported.mean() if iteration % config.log.log_interval == 0 else None  # every rank: all-reduces
        if metrics:
            record = dict(iteration=iteration, consumed_samples=consumed,
                          elapsed_ms=elapsed_ms, tokens=t.global_batch_size * t.seq_length, flops=flops, lr=lr,
                          loss=loss.item(), grad_norm=None if step_skipped else result.grad_norm.item(),
                          batch_size=t.global_batch_size,
                          loss_scale=None if state.loss_scale is None else state.loss_scale.item(),
                          skipped_iterations=skipped)
            metrics.step(**record, print_line=iteration % config.log.log_interval == 0,
                         memory=peak.metrics() if peak else None, reports=reports)
            records.append(record)
        signalled = False
        if t.check_for_nan_in_loss_and_grad or c.exit_signal_handler:
            recorder.start("collective", "all_reduce of this step's stop flags over the world (a NaN or inf "
                                         "loss or grad norm, SIGTERM under --exit-signal-handler)")
            bad_loss, bad_norm, signalled = any_rank(step_flags(loss, result.grad_norm, shutdown.requested.is_set()))
            recorder.finish("collective")
            if t.check_for_nan_in_loss_and_grad:
                check_step(iteration, bad_loss, bad_norm, report=coords.rank == 0)
            signalled = c.exit_signal_handler and signalled
            if signalled:
                shutdown.requested.set()  # this rank too exits as signalled, whichever rank got the signal
        if t.eval_interval and (iteration % t.eval_interval == 0 or iteration == t.train_iters):
            recorder.phase(f"validation at iteration {iteration}")
            val_loss = evaluate(runtime, valid_data, config, coords, device)
            if metrics:
                metrics.validation(iteration=iteration, consumed_samples=consumed, loss=val_loss)
                records.append(dict(iteration=iteration, val_loss=val_loss))
        exiting = c.exit_interval is not None and iteration % c.exit_interval == 0
        interval = c.save_interval is not None and iteration % c.save_interval == 0
        if c.save and (exiting or signalled or interval or iteration == t.train_iters):
            if t.check_for_nan_in_loss_and_grad:
                check_state(iteration, state, report=coords.rank == 0)
            recorder.phase(f"saving the checkpoint of iteration {iteration}")
            started = time.perf_counter()
            folder = checkpoint.save(c.save, Progress(iteration, consumed, skipped), config, program, state)
            quiet(f"saved checkpoint at iteration {iteration} to {folder} ({time.perf_counter() - started:.2f} s)")
        if exiting:
            quiet(f"exiting at iteration {iteration} (--exit-interval {c.exit_interval})" +
                  ("" if c.save else "; nothing saved: no --save"))
            break
        if signalled:
            quiet(f"exiting at iteration {iteration} on SIGTERM (--exit-signal-handler)")
            break
    recorder.phase("done")
    if metrics:
        metrics.close()
    return records


def seed_generators(seed: int, coords: Coords) -> None:
    """Seed this rank's default generators (CPU and CUDA; dropout draws from them) from --seed and its
    pipeline and dp ranks. The ranks of a tp (and cp) group share the seed: they hold some activations
    alike (after a row-parallel all-reduce), whose dropout masks must agree, and they draw as many
    elements in the same order (their heads, their sequence slices), so their streams stay in step.
    The price: a tp-sharded region repeats one mask over the ranks' pieces (Megatron draws those from
    a second, per-tp-rank generator)."""
    mixed = np.random.SeedSequence([seed, coords.axis_rank("pp"), coords.axis_rank("dp")]).generate_state(1, np.uint64)
    torch.manual_seed(int(mixed[0]))


def resume(config: RunConfig, program: RankProgram, state: TrainState, log) -> Progress:
    """Where training starts: the latest checkpoint in --load (any layout) loaded into `state`, or iteration 0."""
    root = config.checkpoint.load
    folder = checkpoint.latest(root) if root else None
    if folder is None:
        if root:
            log(f"no checkpoint in {root}; starting from iteration 0")
        return Progress(0, 0)
    progress = checkpoint.load(folder, config, program, state, log)
    saved = checkpoint.Checkpoint(folder).meta["config"]
    if progress.iteration:  # at iteration 0 (import-hf's checkpoint) no step followed a schedule or read data
        for change in (lr_schedule_change(saved["train"], config.train, progress.iteration),
                       data_change(saved, config), batch_change(saved["train"], config.train)):
            if change:
                log(change)
    return progress


DATA_ORDER = (("data", "data_path"), ("data", "split"), ("train", "seed"), ("train", "seq_length"))
"""What the batches after a resume are drawn from: with any of them changed, they are not the saved run's."""


def _meaning(name: str, value):
    """A data_path as the files it names (data/x and /abs/data/x are one stream), other values as they are."""
    if name != "data_path" or not isinstance(value, str) or not value:
        return value
    try:
        return [(weight, os.path.realpath(path)) for weight, path in parse_blend(value)]
    except DataError:
        return value


def data_change(saved: dict, config: RunConfig) -> str | None:
    """A line when this run draws its batches otherwise than the saved run (`saved`, its config) would have:
    other data, split, seed or sequence length; None when they are the same."""
    now = dataclasses.asdict(config)
    changed = [f"{name} {saved.get(section, {}).get(name)} -> {now[section][name]}" for section, name in DATA_ORDER
               if _meaning(name, saved.get(section, {}).get(name)) != _meaning(name, now[section][name])]
    return f"the batches differ from the saved run's ({'; '.join(changed)}): training goes on from its consumed " \
           f"samples, in another order or of other data" if changed else None


def batch_change(saved_train: dict, t: TrainConfig) -> str | None:
    """A line when this run's global batch is not the saved run's: a step reads another number of samples, so
    --train-iters ends at another sample than the saved run's would have; None when it is the same."""
    saved = saved_train.get("global_batch_size", t.global_batch_size)
    if saved == t.global_batch_size:
        return None
    return (f"the global batch differs from the saved run's ({saved} -> {t.global_batch_size} samples): each step "
            f"from here reads {t.global_batch_size}, going on from its consumed samples")


def lr_schedule_change(saved_train: dict, t: TrainConfig, iteration: int) -> str | None:
    """A line when this run's flags change the learning rate of the steps left after `iteration` from what
    the saved run's config (`saved_train`, its `[train]` section) gives, say a reshard with another
    --train-iters; None when the curve is the same."""
    saved = dataclasses.replace(t, **{name: saved_train[name] for name in LR_SCHEDULE})
    changed = [f"{name} {getattr(saved, name)} -> {getattr(t, name)}" for name in LR_SCHEDULE
               if getattr(saved, name) != getattr(t, name)]
    first = next((i for i in range(iteration + 1, t.train_iters + 1) if lr_at(i, saved) != lr_at(i, t)),
                 None) if changed else None
    if first is None:
        return None
    return (f"the learning-rate schedule differs from the saved run's ({'; '.join(changed)}): iteration {first} "
            f"trains at {lr_at(first, t):.6E}, where the saved run's schedule gives {lr_at(first, saved):.6E}")


def dump_schedule(schedule: Schedule, run_dir: str, log=print) -> None:
    """--dump-schedule: every rank's instructions as a table on the console and in RUN_DIR/schedule.txt,
    the simulated timeline in RUN_DIR/schedule.svg."""
    result = simulate(schedule)
    text = (f"{format_table(schedule, communication=True)}\n"
            f"simulated with forward 1, backward 2{' (W 1 of it)' if schedule.splits_backward else ''}: makespan {result.makespan:g}, "
            f"bubble {result.bubble_fraction:.1%}, saved-activation peak per rank {list(result.rank_peak_in_flight)}")
    log(text)
    dump_text(run_dir, "schedule.txt", text + "\n")
    render_svg(schedule, os.path.join(run_dir, "schedule.svg"))
    log(f"schedule written to {os.path.join(run_dir, 'schedule.txt')} and schedule.svg")


def evaluate(runtime: Runtime, valid_data: GPTDataset | BlendedDataset, config: RunConfig, coords: Coords, device) -> float:
    """Mean loss over the first eval_iters global batches of the validation split (the same ones each time)."""
    losses = []
    for i in range(config.train.eval_iters):
        loss = runtime.eval_step(microbatches(valid_data, i * config.train.global_batch_size, config, coords, device))
        losses.append(_mean_over_dp(loss, coords, runtime.recorder))
    return torch.stack(losses).mean().item() if losses[0] is not None else float("nan")


def _every_rank(obj, coords: Coords) -> dict:
    """{rank: obj} of every rank, on every rank, so that rank 0 can print one line for many alike."""
    if not dist.is_initialized():
        return {coords.rank: obj}
    every = [None] * coords.world_size
    dist.all_gather_object(every, obj)
    return dict(enumerate(every))


def _mean_over_dp(loss: torch.Tensor | None, coords: Coords, recorder: FlightRecorder) -> torch.Tensor | None:
    """The mean loss of the global batch: over dp ranks, and over cp ranks, each of which holds the mean of
    its share of every sample's tokens."""
    ranks = role_size(coords, "dp_cp")
    if loss is None or ranks == 1:
        return loss
    loss = loss.clone()
    recorder.start("collective", "all_reduce of the loss over dp x cp")
    dist.all_reduce(loss, group=group("dp_cp"))
    recorder.finish("collective")
    return loss / ranks
