"""What a rank holds at its peak during a step, measured while the step runs.

The runtime, when asked (`Runtime.start_measuring`, the first step of a run), samples what it holds at
every instruction boundary: the TrainState's buffers (a released optim_grads accumulator holds none),
the saved activations kept for backward (and what zero-bubble W reads), the activations and gradients
received or sent and not yet consumed or completed, and the batch and small constants. Each storage is
counted once, by its address: a saved tensor that is a weight, or a view of another, costs nothing more.

It reads storage sizes only, so it never waits for a device. What happens inside one instruction (a
graph's intermediates) is not seen at a boundary: on CUDA the allocator's `max_memory_allocated` over
the same step is reported beside it, as the truth that includes them.
"""

from collections.abc import Iterable
from dataclasses import dataclass

import torch

MIB = 2 ** 20


@dataclass(frozen=True)
class HeldBytes:
    """Bytes held at one instruction boundary, by what holds them."""

    state: int
    """The TrainState's buffers: weights, gradients, optimizer states."""
    activations: int
    """Saved for backward: forward outputs kept per (stage, microbatch), and what a W reads."""
    messages: int
    """Pipeline activations and gradients received or sent, or handed between local stages, not yet done with."""
    other: int
    """The microbatches' tokens, losses and per-rank numbers."""
    constants: int = 0
    """Tensors the model holds (buffers, gcompile.held), counted before the activations that view them."""

    @property
    def total(self) -> int:
        return self.state + self.activations + self.messages + self.other + self.constants


@dataclass(frozen=True)
class StepPeak:
    """A step's measured peak: the boundary that held most, and on CUDA the allocator's own peak."""

    peak: HeldBytes
    boundaries: int
    """Instruction boundaries sampled."""
    allocator_peak: int | None
    """torch.cuda.max_memory_allocated over the step (intermediates inside graphs included); None off CUDA."""

    def __str__(self) -> str:
        p = self.peak
        allocator = "" if self.allocator_peak is None else \
            f"; CUDA allocator peak {self.allocator_peak / MIB:.1f} MiB (max_memory_allocated)"
        constants = f" + constants {p.constants / MIB:.1f}" if p.constants else ""
        return (f"peak {p.total / MIB:.1f} MiB measured (state {p.state / MIB:.1f} + activations "
                f"{p.activations / MIB:.1f} + messages {p.messages / MIB:.1f} + other {p.other / MIB:.1f}"
                f"{constants}){allocator}")

    def metrics(self) -> dict[str, int]:
        """The figures as metrics.jsonl keys (TensorBoard tags with '-' for '_')."""
        p = self.peak
        found = dict(mem_peak_bytes=p.total, mem_state_bytes=p.state, mem_activation_bytes=p.activations,
                     mem_message_bytes=p.messages)
        if self.allocator_peak is not None:
            found["mem_max_allocated_bytes"] = self.allocator_peak  # Megatron's tag
        return found


class PeakMeter:
    """Samples what a rank holds; the largest sample is the step's peak."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak = HeldBytes(0, 0, 0, 0)
        self.boundaries = 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def sample(self, state: Iterable[torch.Tensor], activations: Iterable[torch.Tensor],
               messages: Iterable[torch.Tensor], other: Iterable[torch.Tensor],
               constants: Iterable[torch.Tensor] = ()) -> None:
        """One boundary; a storage counts in the first group that holds it (state, then constants, then
        activations, ...)."""
        seen = set()

        def held(tensors: Iterable[torch.Tensor]) -> int:
            total = 0
            for t in tensors:
                storage = t.untyped_storage()
                if storage.nbytes() and storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
            return total

        state_bytes, constant_bytes = held(state), held(constants)
        now = HeldBytes(state_bytes, held(activations), held(messages), held(other), constant_bytes)
        self.boundaries += 1
        if now.total > self.peak.total:
            self.peak = now

    def result(self) -> StepPeak:
        allocator = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        return StepPeak(self.peak, self.boundaries, allocator)
