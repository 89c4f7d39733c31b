"""A rank's training state: flat buffers the graphs read and update in place.

Everything that changes per iteration (weights, gradients, AdamW states, the
step count, the learning rate) is a device tensor, so an iteration never
rebinds a tensor and a CUDA graph can replay it.
"""

from dataclasses import dataclass

import torch

from gcompile.layout import local_value
from gcompile.model import GPTConfig, init_value
from gcompile.rank_program import RankProgram


@dataclass
class TrainState:
    params: torch.Tensor
    """Flat model parameters; the graphs see views of it."""
    grads: torch.Tensor
    """Flat fp32 gradient accumulator over microbatches; zeroed by the optimizer step."""
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: torch.Tensor
    """Optimizer steps taken (0-d float32)."""
    lr: torch.Tensor
    """Learning rate of the current step (0-d float32)."""
    offset: torch.Tensor
    """Buffer index where this rank's optimizer shard starts (0-d int64)."""

    @classmethod
    def initial(cls, program: RankProgram, model: GPTConfig, seed: int, device, dtype=torch.float32) -> "TrainState":
        """Initial weights: each full parameter made from the seed, then cut to this rank's piece."""
        layout, coords = program.layout, program.coords
        params = torch.zeros(layout.numel, device=device, dtype=dtype)
        views = layout.views(params)
        with torch.no_grad():
            for param in layout.params:
                full = init_value(param.name, param.full_shape, model, seed)
                views[param.name].copy_(local_value(full, param, coords.axis_ranks, coords.axis_sizes))
        shard = program.shard_numel
        return cls(
            params=params,
            grads=torch.zeros(layout.numel, device=device, dtype=torch.float32),
            exp_avg=torch.zeros(shard, device=device, dtype=torch.float32),
            exp_avg_sq=torch.zeros(shard, device=device, dtype=torch.float32),
            step=torch.zeros((), device=device, dtype=torch.float32),
            lr=torch.zeros((), device=device, dtype=torch.float32),
            offset=torch.zeros((), device=device, dtype=torch.long),
        )
