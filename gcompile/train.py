"""The training loop: data, learning-rate schedule, steps, validation, logging, checkpoints.

Each rank builds its own program, state and runtime, then every rank steps in
lockstep; the loss lives on the last pipeline stage and is logged by the rank
at (last pp stage, dp 0, tp 0). The learning rate is a function of the
iteration, and the batch one of the consumed-sample count, so a run resumed
from a checkpoint takes the same steps as one that was never cut.
"""

import math
import os
import time

import torch
import torch.distributed as dist

from gcompile import checkpoint, stop
from gcompile.checkpoint import Progress
from gcompile.compile import Compiler, compile_rank_program, dump_generated_code
from gcompile.cuda_graphs import GraphedTrainStep
from gcompile.config import ConfigError, RunConfig, TrainConfig
from gcompile.data import GPTDataset, build_datasets
from gcompile.flight import FlightRecorder, flight_dir, rank_file
from gcompile.log import MetricsLog
from gcompile.axes import Coords
from gcompile.mesh import group
from gcompile.pass_manager import rank_dump_dir
from gcompile.pipeline import build_rank_program
from gcompile.program import dump_text
from gcompile.rank_program import RankProgram
from gcompile.runtime import Runtime
from gcompile.schedule import Schedule, format_table, simulate
from gcompile.schedule_render import render_svg
from gcompile.state import TrainState


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


def microbatches(dataset: GPTDataset, consumed_samples: int, config: RunConfig, coords: Coords, device):
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
    _check_vocab(train_data, config)
    logging = is_logging_rank(coords)
    quiet = (lambda _: None) if coords.rank != 0 else log

    recorder.phase("building the rank program")
    program = build_rank_program(config, coords, device, dump_root=config.log.dump_graphs, log=quiet)
    if config.log.dump_schedule and coords.rank == 0:
        dump_schedule(program.schedule, config.log.run_dir, log)
    compiler = Compiler(enabled=t.compile)
    recorder.phase("compiling" if t.compile else "preparing the graphs")
    functions, optimizer_step = compile_rank_program(program, compiler)
    if t.compile and config.log.dump_graphs:
        dump_generated_code(program, compiler, rank_dump_dir(config.log.dump_graphs, coords.rank))
    if t.compile:
        log(f"rank {coords.rank} {coords} compile: {compiler.stats}")
    state = TrainState.initial(program, config.model, t.seed, device)
    recorder.phase("loading the checkpoint")
    progress = resume(config, program, state, log=quiet)
    runtime = Runtime(program, functions, optimizer_step, state, recorder=recorder)
    train_step = runtime.train_step
    if t.cuda_graphs if t.cuda_graphs is not None else t.compile:
        if device.startswith("cuda"):
            train_step = GraphedTrainStep(runtime)
        elif t.cuda_graphs:
            quiet("--cuda-graphs: no CUDA device here; the instruction list runs directly")

    metrics = MetricsLog(config.log.run_dir, config.log.tensorboard_dir, t.train_iters, coords.world_size) \
        if logging else None
    flops = config.model_spec.flops(config.model, t.global_batch_size, t.seq_length)
    records, skipped, consumed = [], 0, progress.consumed_samples
    c = config.checkpoint
    for iteration in range(progress.iteration + 1, t.train_iters + 1):
        recorder.phase(f"iteration {iteration}")
        batch = microbatches(train_data, consumed, config, coords, device)
        lr = lr_at(iteration, t)
        state.lr.fill_(lr)
        start = time.perf_counter()
        result = train_step(batch)
        loss = _mean_over_dp(result.loss, coords, recorder)
        skipped += int(result.skipped.item())
        elapsed_ms = (time.perf_counter() - start) * 1e3
        consumed += t.global_batch_size
        if metrics:
            record = dict(iteration=iteration, consumed_samples=consumed,
                          elapsed_ms=elapsed_ms, tokens=t.global_batch_size * t.seq_length, flops=flops, lr=lr,
                          loss=loss.item(), grad_norm=result.grad_norm.item(), batch_size=t.global_batch_size,
                          loss_scale=None if state.loss_scale is None else state.loss_scale.item(),
                          skipped_iterations=skipped)
            metrics.step(**record, print_line=iteration % config.log.log_interval == 0)
            records.append(record)
        if t.eval_interval and (iteration % t.eval_interval == 0 or iteration == t.train_iters):
            recorder.phase(f"validation at iteration {iteration}")
            val_loss = evaluate(runtime, valid_data, config, coords, device)
            if metrics:
                metrics.validation(iteration=iteration, consumed_samples=consumed, loss=val_loss)
                records.append(dict(iteration=iteration, val_loss=val_loss))
        exiting = c.exit_interval is not None and iteration % c.exit_interval == 0
        signalled = c.exit_signal_handler and _stop_agreed(coords, device, recorder)
        interval = c.save_interval is not None and iteration % c.save_interval == 0
        if c.save and (exiting or signalled or interval or iteration == t.train_iters):
            recorder.phase(f"saving the checkpoint of iteration {iteration}")
            started = time.perf_counter()
            folder = checkpoint.save(c.save, Progress(iteration, consumed), config, program, state)
            quiet(f"saved checkpoint at iteration {iteration} to {folder} ({time.perf_counter() - started:.2f} s)")
        if exiting:
            quiet(f"exiting at iteration {iteration} (--exit-interval {c.exit_interval})")
            break
        if signalled:
            quiet(f"exiting at iteration {iteration} on SIGTERM (--exit-signal-handler)")
            break
    recorder.phase("done")
    if metrics:
        metrics.close()
    return records


def resume(config: RunConfig, program: RankProgram, state: TrainState, log) -> Progress:
    """Where training starts: the latest checkpoint in --load (any layout) loaded into `state`, or iteration 0."""
    root = config.checkpoint.load
    folder = checkpoint.latest(root) if root else None
    if folder is None:
        if root:
            log(f"no checkpoint in {root}; starting from iteration 0")
        return Progress(0, 0)
    return checkpoint.load(folder, config, program, state, log)


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


def evaluate(runtime: Runtime, valid_data: GPTDataset, config: RunConfig, coords: Coords, device) -> float:
    """Mean loss over the first eval_iters global batches of the validation split (the same ones each time)."""
    losses = []
    for i in range(config.train.eval_iters):
        loss = runtime.eval_step(microbatches(valid_data, i * config.train.global_batch_size, config, coords, device))
        losses.append(_mean_over_dp(loss, coords, runtime.recorder))
    return torch.stack(losses).mean().item() if losses[0] is not None else float("nan")


def _mean_over_dp(loss: torch.Tensor | None, coords: Coords, recorder: FlightRecorder) -> torch.Tensor | None:
    if loss is None or coords.size("dp") == 1:
        return loss
    loss = loss.clone()
    recorder.start("collective", "all_reduce of the loss over dp")
    dist.all_reduce(loss, group=group("dp"))
    recorder.finish("collective")
    return loss / coords.size("dp")


def _stop_agreed(coords: Coords, device: str, recorder: FlightRecorder) -> bool:
    """--exit-signal-handler: whether any rank got SIGTERM, the same answer on every rank."""
    recorder.start("collective", "all_reduce of the SIGTERM flag over the world (--exit-signal-handler)")
    agreed = stop.agreed(coords.world_size, device)
    recorder.finish("collective")
    if agreed:
        stop.requested.set()  # this rank too exits as signalled, whichever rank got the signal
    return agreed


def _check_vocab(dataset: GPTDataset, config: RunConfig) -> None:
    largest = int(dataset.tokens.max())
    if largest >= config.model.vocab_size:
        raise ConfigError(f"the data holds token id {largest} but vocab_size={config.model.vocab_size}; "
                          f"raise --vocab-size to at least {largest + 1} or use data from this tokenizer")
