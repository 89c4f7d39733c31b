"""Faults that stop every rank together: a non-finite loss or gradient norm, a checkpoint that cannot be written.

One rank may be the only one to see the fault (the loss lives on the last pipeline stage; a disk
fills up under one rank's write), but every rank must stop at the same point, or the others wait
in their next collective for a rank that is gone. So each rank marks what it sees, one MAX
all-reduce over the world (`any_rank`) makes it every rank's decision, and every rank raises
`RunStopped`; rank 0 alone prints the reason, so it is one line however many ranks run.

Megatron's --check-for-nan-in-loss-and-grad (`check_step`, on by default): a loss or gradient norm
that is NaN or inf stops the run after that iteration is logged, before validation and before any
save. An fp16 step that loss scaling skipped is not a fault, and is not seen as one: its gradients
are zeroed before the norm (gcompile.optimizer) and its loss is finite. `check_state` runs before
each save, so no checkpoint ever holds a NaN or inf, even when weights overflow under a finite
gradient.
"""

import torch
import torch.distributed as dist

from gcompile.state import TrainState


class RunStopped(RuntimeError):
    """Every rank stops here; `report` is true on the one rank that prints the reason (rank 0)."""

    def __init__(self, message: str, report: bool):
        super().__init__(message)
        self.report = report


def any_rank(flags: torch.Tensor) -> list[bool]:
    """Per entry of `flags` (0 or 1 on this rank), whether any rank of the world set it."""
    if dist.is_initialized():
        flags = flags.clone()
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [bool(f) for f in flags.tolist()]


def check_step(iteration: int, loss: torch.Tensor | None, grad_norm: torch.Tensor, report: bool) -> None:
    """Stop every rank when this step's loss (where this rank has it) or gradient norm is not finite."""
    no_loss = torch.zeros((), device=grad_norm.device)
    flags = torch.stack([no_loss if loss is None else (~torch.isfinite(loss)).float(),
                         (~torch.isfinite(grad_norm)).float()])
    bad_loss, bad_norm = any_rank(flags)
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
