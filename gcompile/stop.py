"""Faults that stop every rank together: a non-finite loss or gradient norm, a checkpoint that cannot be written.

One rank may be the only one to see the fault (the loss lives on the last pipeline stage; a disk
fills up under one rank's write), but every rank must stop at the same point, or the others wait
in their next collective for a rank that is gone. So each rank marks what it sees, one MAX
all-reduce over the world (`any_rank`) makes it every rank's decision, and every rank raises
`RunStopped`; rank 0 alone prints the reason, so it is one line however many ranks run. A phase
that may fail on one rank (writing a checkpoint) runs inside `together()`, which agrees the same way.

Megatron's --check-for-nan-in-loss-and-grad (`check_step`, on by default): a loss or gradient norm
that is NaN or inf stops the run after that iteration is logged, before validation and before any
save. An fp16 step that loss scaling skipped is not a fault, and is not seen as one: its gradients
are zeroed before the norm (gcompile.optimizer) and its loss is finite. `check_state` runs before
each save, so no checkpoint ever holds a NaN or inf, even when weights overflow under a finite
gradient.
"""

import contextlib
import errno

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from gcompile.state import TrainState


class RunStopped(RuntimeError):
    """Every rank stops here; `report` is true on the one rank that prints the reason (rank 0)."""

    def __init__(self, message: str, report: bool):
        super().__init__(message)
        self.report = report


class PhaseFailed(Exception):
    """A phase failed on some rank (`together`); raised on every rank, with the first failure's reason."""

    def __init__(self, no_space: bool, reason: str):
        super().__init__(reason)
        self.no_space = no_space


@contextlib.contextmanager
def together():
    """Run this rank's part of a phase, then agree: if it failed on any rank, every rank raises
    PhaseFailed, where the others would wait for the failed rank in their next collective."""
    failure = None
    try:
        yield
    except (Exception, dcp.CheckpointException) as e:  # the latter is a BaseException
        failure = (no_space(e), first_line(e))
    failures = [f for f in all_ranks(failure) if f is not None]
    if failures:
        raise PhaseFailed(any(full for full, _ in failures), failures[0][1])


def no_space(error: BaseException | None) -> bool:
    """ENOSPC (or a quota) anywhere in the chain of `error`: DCP wraps its writer's error, and torch.save's
    short-write RuntimeError holds the OSError as its context."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(error, dcp.CheckpointException):
            return any(no_space(failure[0]) for failure in error.failures.values())
        error = error.__cause__ or error.__context__
    return False


def first_line(error: BaseException) -> str:
    """The first line of what went wrong; DCP wraps what its reader or writer raised in a CheckpointException."""
    if isinstance(error, dcp.CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def size_text(nbytes: int) -> str:
    unit = max((u for u in range(5) if nbytes >= 1024 ** u), default=0)
    return f"{nbytes / 1024 ** unit:.1f} {('bytes', 'KiB', 'MiB', 'GiB', 'TiB')[unit]}"


def all_ranks(obj) -> list:
    """Every rank's `obj`, on every rank (a list by rank)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def any_rank(flags: torch.Tensor) -> list[bool]:
    """Per entry of `flags` (0 or 1 on this rank), whether any rank of the world set it."""
    if dist.is_initialized():
        flags = flags.clone()
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [bool(f) for f in flags.tolist()]


def step_flags(loss: torch.Tensor | None, grad_norm: torch.Tensor, stop_requested: bool) -> torch.Tensor:
    """What this rank saw of the step, for one `any_rank`: the loss (where this rank has it) not finite,
    the gradient norm not finite, a stop asked for (gcompile.shutdown.requested)."""
    no_loss = torch.zeros((), device=grad_norm.device)
    return torch.stack([no_loss if loss is None else (~torch.isfinite(loss)).float(),
                        (~torch.isfinite(grad_norm)).float(), torch.full((), float(stop_requested),
                                                                         device=grad_norm.device)])


def check_step(iteration: int, bad_loss: bool, bad_norm: bool, report: bool) -> None:
    """Stop every rank when any rank saw this step's loss or gradient norm not finite (`step_flags`)."""
    if bad_loss or bad_norm:
        what = {(1, 0): "lm loss is", (0, 1): "grad norm is", (1, 1): "lm loss and grad norm are"}[bad_loss, bad_norm]
        raise RunStopped(f"iteration {iteration}: the {what} NaN or inf; stopped before validating or "
                         f"saving it (lower --lr, or --check-for-nan-in-loss-and-grad false to go on)", report)


def check_state(iteration: int, state: TrainState, report: bool) -> None:
    """Stop every rank, before a save, when any rank's weights or optimizer state hold a NaN or inf."""
    saved = [t for t in (state.params, state.main, state.exp_avg, state.exp_avg_sq) if t is not None]
    bad = torch.stack([(~torch.isfinite(t)).any() for t in saved]).any().float().reshape(1)
    if any_rank(bad)[0]:
        raise RunStopped(f"iteration {iteration}: the weights or optimizer state hold NaN or inf; stopped "
                         f"without saving them (lower --lr, or --check-for-nan-in-loss-and-grad false to go on)",
                         report)
