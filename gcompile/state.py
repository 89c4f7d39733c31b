"""A rank's training state: flat buffers the graphs read and update in place.

Everything that changes per iteration (weights, gradients, AdamW states, the
step count, the learning rate) is a device tensor, so an iteration never
rebinds a tensor and a CUDA graph can replay it.
"""

from dataclasses import dataclass, fields

import torch

from gcompile.axes import GROUP_ROLES, REPLICAS, world_axes_of
from gcompile.layout import Param, local_value, replicas
from gcompile.models import spec_of
from gcompile.rank_program import RankProgram


@dataclass
class TrainState:
    params: torch.Tensor
    """Flat model weights (model dtype); the graphs see views of it."""
    grads: torch.Tensor
    """Flat fp32 gradient accumulator over microbatches; zeroed by the optimizer step."""
    main: torch.Tensor | None
    """fp32 main weights (this rank's shard when sharded), when apart from `params`."""
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    flags: torch.Tensor
    """Per-element optimizer flags of what this rank updates (gcompile.flat)."""
    step: torch.Tensor
    """Optimizer steps taken (0-d float32)."""
    lr: torch.Tensor
    """Learning rate of the current step (0-d float32)."""
    loss_scale: torch.Tensor | None = None
    """fp16: the dynamic loss scale (0-d); None otherwise."""
    growth_tracker: torch.Tensor | None = None
    """fp16: steps since the last overflow or growth."""
    hysteresis_left: torch.Tensor | None = None
    """fp16: overflows still tolerated before the scale halves."""
    reduced_grads: torch.Tensor | None = None
    """Distributed optimizer with overlapped reduction: this rank's averaged gradient shard, written
    during the last microbatch's backward."""

    @classmethod
    def initial(cls, program: RankProgram, model, seed: int, device) -> "TrainState":
        """Initial weights: each full parameter made from the seed by the model's spec (`model` is its
        config), then cut to this rank's piece; main weights and flags follow from them."""
        state, layout, coords = cls.allocate(program, device), program.layout, program.coords
        views = layout.views(state.params)
        with torch.no_grad():
            for param in layout.params:
                full = spec_of(model).init_value(param.name, param.full_shape, model, seed)
                views[param.name].copy_(local_value(full, param, coords.axis_ranks, coords.axis_sizes))
            flags, main = layout.flags(lambda param: norm_copies(param, program)).to(device), state.params.float()
            if program.shard_positions is not None:
                flags, main = layout.shard_of(flags, program.shard_positions), layout.shard_of(main, program.shard_positions)
            state.flags.copy_(flags)
            if state.main is not None:
                state.main.copy_(main)
        return state

    @classmethod
    def allocate(cls, program: RankProgram, device) -> "TrainState":
        """Every buffer zeroed, each the optimizer step reads shaped as its input there (a pass may have
        sharded it); the gradient accumulator released when the program keeps none between steps.
        On the meta device it allocates nothing: what `--check-plan` measures."""
        layout, settings = program.layout, program.step_settings
        wanted = program.optimizer.values()
        scaling = settings.loss_scaling

        def zeros(name: str) -> torch.Tensor:
            return torch.zeros(wanted[name].shape, dtype=wanted[name].dtype, device=device)

        scalars = {} if scaling is None else dict(
            loss_scale=torch.tensor(scaling.initial, device=device),
            growth_tracker=torch.tensor(0.0, device=device),
            hysteresis_left=torch.tensor(float(scaling.hysteresis), device=device))
        state = cls(
            params=torch.zeros(layout.numel, device=device, dtype=settings.param_dtype),
            grads=zeros("grads"),  # empty where no gradient accumulates (optim_grads)
            main=zeros("main") if "main" in wanted else None,
            exp_avg=zeros("exp_avg"),
            exp_avg_sq=zeros("exp_avg_sq"),
            flags=zeros("flags"),
            step=torch.zeros((), device=device, dtype=torch.float32),
            lr=torch.zeros((), device=device, dtype=torch.float32),
            reduced_grads=zeros("reduced_grads") if "reduced_grads" in wanted else None,
            **scalars,
        )
        for name, value in wanted.items():
            mine = getattr(state, name)
            if (mine.shape, mine.dtype) != (value.shape, value.dtype):
                raise ValueError(f"optimizer input {name!r} is {tuple(value.shape)} {value.dtype} but the state "
                                 f"holds {tuple(mine.shape)} {mine.dtype}")
        if not program.grads_between_steps:
            state.release_grads()
        return state

    def release_grads(self) -> None:
        """Free the gradient accumulator's memory; its views stay valid for `acquire_grads`."""
        self.grads.untyped_storage().resize_(0)

    def acquire_grads(self) -> None:
        """Allocate the gradient accumulator again (zeroed) if `release_grads` freed it."""
        storage = self.grads.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.grads.numel() * self.grads.element_size())
            self.grads.zero_()

    def buffers(self) -> dict[str, torch.Tensor]:
        """Every buffer this state has, by field name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def buffer_bytes(self) -> dict[str, int]:
        """Bytes each buffer holds now, by field name (a released accumulator holds none)."""
        return {name: buffer.untyped_storage().nbytes() for name, buffer in self.buffers().items()}

    def optimizer_args(self, names: tuple[str, ...]) -> list[torch.Tensor]:
        return [getattr(self, name) for name in names]


def norm_copies(param: Param, program: RankProgram) -> int:
    """On how many ranks of the norm's group an element of `param` sits: over the group's axes, those
    that neither cut the parameter, nor separate stages (pp), nor shard the optimizer state (of an expert
    weight: over edp, the ranks across its ep groups, which with ep span every dp and cp rank)."""
    if program.norm_group is None:
        return 1
    apart = {"pp"}
    if program.optimizer_shard:
        group = next((REPLICAS[s.axis] for s in param.shards if s.axis in REPLICAS), program.optimizer_shard)
        apart |= {axis for folded in GROUP_ROLES[group].axes for axis in world_axes_of(folded)}
    return replicas(param, program.coords.axis_sizes, [a for a in GROUP_ROLES[program.norm_group].axes
                                                      if a not in apart])
