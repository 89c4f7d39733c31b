"""Training logs in Megatron's words: console lines, TensorBoard tags, and metrics.jsonl."""

import json
import math
import os
import time
from collections.abc import Callable


def counted(n: int, noun: str) -> str:
    """`n noun`, the noun plural unless n is 1: "1 rank", "8 ranks"."""
    return f"{n} {noun}{'s' * (n != 1)}"


def metrics_path(run_dir: str) -> str:
    return os.path.join(run_dir, "metrics.jsonl")


def metrics_error(run_dir: str) -> str | None:
    """Why a run cannot write its metrics.jsonl (something else stands there), or None: asked before any rank
    starts, not found when rank 0 opens it after the build."""
    path = metrics_path(run_dir)
    if os.path.exists(path) and not os.path.isfile(path):
        return f"--run-dir {run_dir}: {path} is not a file (a folder?); move it, or give another --run-dir"
    return None


class MetricsLog:
    """Everything one step or validation reports, to every sink at once (one rank calls it).

    RUN_DIR/metrics.jsonl holds one run: a run continues the file only when the file ends at the
    iteration the run starts from (a resume of the run that wrote it); otherwise the file is kept
    as metrics.N.jsonl (the first free N) and a fresh one is started."""

    def __init__(self, run_dir: str, tensorboard_dir: str | None, train_iters: int, world_size: int,
                 start_iteration: int, log: Callable[[str], None], skipped_before: int = 0):
        """`skipped_before`: the steps fp16's loss scaling skipped before `start_iteration` (a resumed run's)."""
        self.skipped_at_last_line = skipped_before
        os.makedirs(run_dir, exist_ok=True)
        path = metrics_path(run_dir)
        last = last_iteration(path)
        if last is not None and last != start_iteration:
            n = 1
            while os.path.exists(os.path.join(run_dir, f"metrics.{n}.jsonl")):
                n += 1
            os.replace(path, os.path.join(run_dir, f"metrics.{n}.jsonl"))
            log(f"{path} held another run (up to iteration {last}); kept as metrics.{n}.jsonl, "
                f"this run starts a fresh one")
        elif last is not None:
            _drop_cut_line(path)
        self.jsonl = open(path, "a")
        self.train_iters = train_iters
        self.world_size = world_size
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only where logging happens
        self.tensorboard = SummaryWriter(tensorboard_dir or os.path.join(run_dir, "tensorboard"))

    def step(self, *, iteration: int, consumed_samples: int, elapsed_ms: float, tokens: int, flops: float,
             lr: float, loss: float, grad_norm: float | None, batch_size: int, loss_scale: float | None,
             skipped_iterations: int, print_line: bool, memory: dict[str, int] | None = None,
             reports: dict | None = None) -> None:
        """`memory`: the logging rank's measured peak (gcompile.memory.StepPeak.metrics), on a run's first step.
        `reports`: what the model reported this step, totalled over the ranks (gcompile.reported), at log
        intervals."""
        tokens_per_s = tokens / (elapsed_ms / 1e3)
        tflops = flops / (elapsed_ms / 1e3) / self.world_size / 1e12
        record = dict(iteration=iteration, consumed_samples=consumed_samples, lm_loss=loss, lr=lr,
                      grad_norm=grad_norm, elapsed_ms=elapsed_ms, tokens_per_s=tokens_per_s,
                      tflops_per_rank=tflops, batch_size=batch_size, loss_scale=loss_scale,
                      skipped_iterations=skipped_iterations, **(memory or {}))
        summary = self._reports(reports or {}, iteration, record)
        self._write(record)
        tb = self.tensorboard
        tb.add_scalar("learning-rate", lr, iteration)
        tb.add_scalar("learning-rate vs samples", lr, consumed_samples)
        tb.add_scalar("batch-size", batch_size, iteration)
        tb.add_scalar("lm loss", loss, iteration)
        tb.add_scalar("lm loss vs samples", loss, consumed_samples)
        if grad_norm is not None:  # None on a step fp16's loss scaling skipped, as Megatron logs none
            tb.add_scalar("grad-norm", grad_norm, iteration)
            tb.add_scalar("grad-norm vs samples", grad_norm, consumed_samples)
        tb.add_scalar("iteration-time", elapsed_ms / 1e3, iteration)
        tb.add_scalar("throughput", tflops, iteration)
        for key, value in (memory or {}).items():
            tb.add_scalar(key.replace("_", "-"), value, iteration)
        if loss_scale is not None:
            tb.add_scalar("loss-scale", loss_scale, iteration)
            tb.add_scalar("loss-scale vs samples", loss_scale, consumed_samples)
        if print_line:
            print(f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] iteration {iteration:8d}/{self.train_iters:8d} |"
                  f" consumed samples: {consumed_samples:12d} |"
                  f" elapsed time per iteration (ms): {elapsed_ms:.1f} |"
                  f" tokens per second: {tokens_per_s:.1f} |"
                  f" throughput per GPU (TFLOP/s/GPU): {tflops:.3f} |"
                  f" learning rate: {lr:.6E} |"
                  f" global batch size: {batch_size:5d} |"
                  f" lm loss: {loss:.6E} |"
                  + (f" loss scale: {loss_scale:.1f} |" if loss_scale is not None else "")
                  + (f" grad norm: {grad_norm:.3f} |" if grad_norm is not None else "")
                  + f" number of skipped iterations: {skipped_iterations - self.skipped_at_last_line:3d} |"
                  + summary, flush=True)  # since the last line, as Megatron counts them; metrics.jsonl has the total
            self.skipped_at_last_line = skipped_iterations

    def _reports(self, reports: dict, iteration: int, record: dict) -> str:
        """Log what the model reported: each value per report (a model reports once per layer) into the record
        and TensorBoard; counts (tokens per expert) also as their imbalance, max / mean per layer. The part
        of the console line that shows them."""
        shown = ""
        for name, values in reports.items():
            key = name.replace(" ", "_")
            record[key] = values.tolist()
            if values.dim() == 1:  # one number per layer (the load-balancing loss)
                mean = values.mean().item()
                self.tensorboard.add_scalar(name, mean, iteration)
                for layer, value in enumerate(values.tolist()):
                    self.tensorboard.add_scalar(f"{name}/layer {layer}", value, iteration)
                shown += f" {name}: {mean:.4f} |"
                continue
            imbalance = values.amax(-1) / values.mean(-1).clamp(min=1e-12)  # 1: every expert alike
            record[f"{key}_max_over_mean"] = imbalance.tolist()
            for layer, (counts, worst) in enumerate(zip(values, imbalance.tolist())):
                self.tensorboard.add_histogram(f"{name}/layer {layer}", counts, iteration)
                self.tensorboard.add_scalar(f"{name} max over mean/layer {layer}", worst, iteration)
            shown += f" {name} max/mean: {imbalance.max().item():.2f} (layer {imbalance.argmax().item()}) |"
        return shown

    def validation(self, *, iteration: int, consumed_samples: int, loss: float) -> None:
        ppl = math.nan if math.isnan(loss) else math.exp(min(20.0, loss))  # min(20, nan) is 20
        self._write(dict(iteration=iteration, val_loss=loss, val_ppl=ppl))
        self.tensorboard.add_scalar("lm loss validation", loss, iteration)
        self.tensorboard.add_scalar("lm loss validation vs samples", loss, consumed_samples)
        self.tensorboard.add_scalar("lm loss validation ppl", ppl, iteration)
        self.tensorboard.add_scalar("lm loss validation ppl vs samples", ppl, consumed_samples)
        line = f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "
        print("-" * len(line), line, "-" * len(line), sep="\n", flush=True)

    def _write(self, record: dict) -> None:
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()

    def close(self) -> None:
        self.jsonl.close()
        self.tensorboard.close()


def _drop_cut_line(path: str) -> None:
    """Remove a last record a crash cut short: the run that continues the file appended its first record to it,
    which lost both."""
    with open(path, "rb+") as f:
        start = max(0, f.seek(0, os.SEEK_END) - 4096)  # a record is a few hundred bytes
        f.seek(start)
        tail = f.read()
        if tail and not tail.endswith(b"\n"):
            f.truncate(start + tail.rfind(b"\n") + 1)


def last_iteration(path: str) -> int | None:
    """The iteration of the last record of a metrics.jsonl; None when there is no file or no record."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))  # a record is a few hundred bytes
            lines = f.read().splitlines()
    except FileNotFoundError:
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["iteration"])
        except (ValueError, KeyError, TypeError):  # a line cut by a crash, or the tail of one
            continue
    return None


def rank_ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 3, 8, 9] -> "ranks 0-3,8-9", [3] -> "rank 3", [0, 8, 16, 24] -> "ranks 0,8,...,24" (the
    ranks of a dp group): the ranks a line speaks for, short enough for 128 of them. parse_rank_ranges
    reads it back."""
    ranks = sorted(ranks)
    steps = {b - a for a, b in zip(ranks, ranks[1:])}
    if len(ranks) > 3 and len(steps) == 1 and steps != {1}:
        return f"ranks {ranks[0]},{ranks[1]},...,{ranks[-1]}"
    runs = []
    for rank in ranks:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


MAX_RANKS = 1 << 24
"""More ranks than any world: a range beyond it is text no dump wrote (listing it would take all memory)."""


def parse_rank_ranges(text: str) -> list[int]:
    """The ranks that rank_ranges wrote as `text`; ValueError for text it cannot have written."""
    parts = text.removeprefix("ranks ").removeprefix("rank ").split(",")
    if len(parts) == 4 and parts[2] == "...":  # first, second, ..., last
        first, second, last = int(parts[0]), int(parts[1]), int(parts[3])
        runs = [range(first, last + 1, second - first)]
    else:
        runs = [range(int(a), int(b or a) + 1) for a, _, b in (part.partition("-") for part in parts)]
    if sum(map(len, runs)) > MAX_RANKS:
        raise ValueError(f"more than {MAX_RANKS} ranks")
    return [rank for run in runs for rank in run]
