"""How one full parameter maps to the piece a rank holds, and back.

A parameter's layout is data: its full (single-device) shape plus the cuts a
pass declared on it. Initial weights are made full and cut with `local_value`;
checkpoints and tests put pieces back together with `full_value`. Nothing else
in the code needs to know how a Megatron layer is split.
"""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from gcompile.axes import ACROSS, AXES, world_axes_of


@dataclass(frozen=True)
class Shard:
    """Cut `dim` into equal pieces, one per rank of mesh `axis`."""

    axis: str
    """Mesh axis whose ranks each hold one piece: "tp"."""
    dim: int
    """Tensor dimension that is cut."""
    parts: tuple[int, ...] = ()
    """The dim holds fused parts of these sizes (Q, K, V; unequal with grouped kv heads), each cut on its own;
    () for one."""
    padded_size: int | None = None
    """The dim is zero-padded to this size before cutting (vocab padding); None = no padding."""


@dataclass(frozen=True)
class Param:
    """One parameter placeholder of a stage graph."""

    name: str
    """The model's name of the full parameter (its state-dict key, e.g. h.0.attn.c_attn.weight)."""
    full_shape: tuple[int, ...]
    """Shape on a single device."""
    shards: tuple[Shard, ...] = ()
    """Cuts, applied in order; empty = replicated."""
    decays: bool = False
    """AdamW decays it: the model spec's rule, applied at capture."""
    tied_copy: bool = False
    """A second copy of a tied parameter (e.g. GPT-2's embedding on the last stage): left out of the gradient
    norm so the norm counts it once."""
    tied_group: str | None = None
    """Process group whose ranks each hold a copy of this parameter and sum their gradients
    before the update ("embd": first and last pipeline rank); None = held once."""

    def local_shape(self, axis_sizes: Mapping[str, int]) -> tuple[int, ...]:
        shape = list(self.full_shape)
        for s in self.shards:
            shape[s.dim] = (s.padded_size or shape[s.dim]) // axis_sizes[s.axis]
        return tuple(shape)

    def sharded_over(self, axis: str) -> bool:
        return any(s.axis == axis for s in self.shards)

    def with_shard(self, shard: Shard) -> "Param":
        return replace(self, shards=self.shards + (shard,))


def local_value(full: torch.Tensor, param: Param, coords: Mapping[str, int],
                axis_sizes: Mapping[str, int]) -> torch.Tensor:
    """The piece of `full` that the rank at `coords` holds (a new contiguous tensor)."""
    value = full
    for s in param.shards:
        value = _pad(value, s)
        n = axis_sizes[s.axis]
        parts = value.split(list(s.parts), s.dim) if s.parts else (value,)
        value = torch.cat([part.chunk(n, dim=s.dim)[coords[s.axis]] for part in parts], dim=s.dim)
    return value.contiguous()


def replicas(param: Param, axis_sizes: Mapping[str, int], axes) -> int:
    """On how many of the ranks spanning `axes` the same elements of `param` sit: their number over the
    pieces it is cut into there (a cut over a folded axis counts where its parent axes are all in `axes`)."""
    axes = set(axes)
    pieces = math.prod(axis_sizes[s.axis] for s in param.shards if set(world_axes_of(s.axis)) <= axes)
    return math.prod(axis_sizes[axis] for axis in axes) // pieces


def first_holder(param: Param, axis_ranks: Mapping[str, int], apart: tuple[str, ...] = ("pp",)) -> bool:
    """Whether the rank at `axis_ranks` is the one that writes its piece of `param` (to a checkpoint, say):
    position 0 on every world axis that neither cuts the parameter (itself or through an axis folded into
    it) nor is in `apart`, the axes whose ranks hold different things (pipeline stages; dp ranks under a
    sharded optimizer). A folded axis's position follows from the world axes', but for the ranks across
    the groups of a folded axis that cuts it (edp for ep, dp_replicate for dp_shard): they hold the same
    piece, so position 0 there, unless they hold different things too (a sharded optimizer's dp)."""
    cut = {axis for s in param.shards for axis in (s.axis, *world_axes_of(s.axis))}
    alike = {across for across, inner in ACROSS.items() if inner in cut}

    def first_only(axis: str) -> bool:
        if axis in cut:
            return False
        if axis in AXES:
            return axis not in apart
        return axis in alike and not set(world_axes_of(axis)) & set(apart)
    return all(r == 0 for axis, r in axis_ranks.items() if first_only(axis))


def full_value(pieces: Sequence[torch.Tensor], param: Param, axis_sizes: Mapping[str, int]) -> torch.Tensor:
    """Reassemble the full tensor from every rank's piece.

    `pieces` are ordered over the cut axes like nested loops, the first shard's axis
    outermost; for the usual single tp cut that is simply tp rank order.
    """
    shapes = [tuple(param.full_shape)]  # shape before each cut
    for s in param.shards:
        shape = list(shapes[-1])
        shape[s.dim] = (s.padded_size or shape[s.dim]) // axis_sizes[s.axis]
        shapes.append(tuple(shape))
    return _assemble(list(pieces), param.shards, shapes, axis_sizes)


def _pad(value: torch.Tensor, s: Shard) -> torch.Tensor:
    if s.padded_size is None or s.padded_size == value.shape[s.dim]:
        return value
    pad_shape = list(value.shape)
    pad_shape[s.dim] = s.padded_size - value.shape[s.dim]
    return torch.cat([value, value.new_zeros(pad_shape)], dim=s.dim)


def _assemble(pieces, shards, shapes, axis_sizes) -> torch.Tensor:
    if not shards:
        (value,) = pieces
        return value
    s = shards[0]
    n = axis_sizes[s.axis]
    per_rank = len(pieces) // n
    parts = [_assemble(pieces[i * per_rank:(i + 1) * per_rank], shards[1:], shapes[1:], axis_sizes)
             for i in range(n)]
    local = [size // n for size in s.parts] or [shapes[1][s.dim]]
    by_part = zip(*(p.split(local, s.dim) for p in parts))  # per fused part, every rank's piece of it
    value = torch.cat([torch.cat(pieces, dim=s.dim) for pieces in by_part], dim=s.dim)
    return value.narrow(s.dim, 0, shapes[0][s.dim])  # drop the padding
