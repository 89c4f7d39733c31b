"""Where a rank's parameters live in its flat buffers, how they are bucketed, and what each dp rank owns.

The model's parameters are views of one flat buffer, and so are their fp32
gradients. Parameters are laid out in the order backward finishes them (later
stages first, and within a stage the reverse of forward order), so that a
bucket, a contiguous range, is complete early and its reduction can start
while backward goes on. A bucket holds parameters that the same ranks hold
alike: dp ranks, or for parameters cut over a folded axis (expert parallel's
"ep") the ranks of its replica role ("edp", gcompile.axes.REPLICAS). Each
bucket's size is a multiple of that role's size: under the sharded optimizer,
rank i of it owns the i-th 1/n of the bucket, and a rank's optimizer shard is
its pieces end to end.

Per element, `flags` says how the optimizer treats it (bit 0: weight decay;
bits 1-7: over how many ranks its squared gradient is summed into the global norm), so the update
is elementwise with no knowledge of parameter boundaries.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from gcompile.axes import REPLICAS
from gcompile.layout import Param

ALIGN = 16
"""Elements; every parameter and shard piece starts aligned (Inductor assumes aligned inputs)."""

DECAY = 1
"""Bit 0: weight decay applies."""
COPIES_SHIFT = 1
"""Bits 1-7: on how many ranks of the gradient norm's group the element sits (it counts 1/copies there);
0: not counted (a tied copy whose twin is counted elsewhere, or padding)."""
MAX_COPIES = 127


@dataclass(frozen=True)
class Bucket:
    start: int
    end: int
    replicas: str = "dp"
    """The axis whose ranks hold this bucket's parameters alike (and, sharded, split it): dp, or edp."""
    ways: int = 1
    """That axis's size: the bucket's pieces under the sharded optimizer."""

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Span:
    """Elements [start, end) of one parameter's flattened local piece, held from `at` on in an optimizer buffer."""

    start: int
    end: int
    at: int


@dataclass(frozen=True)
class FlatLayout:
    params: tuple[Param, ...]
    shapes: tuple[tuple[int, ...], ...]
    """Local (per-rank) shapes, in buffer order."""
    offsets: tuple[int, ...]
    buckets: tuple[Bucket, ...]
    numel: int
    """Buffer length, padding included (the end of the last bucket)."""

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each parameter as a view of `flat`, by name."""
        return {p.name: flat[o:o + _numel(s)].view(s) for p, s, o in zip(self.params, self.shapes, self.offsets)}

    @property
    def shard_numel(self) -> int:
        return sum(b.numel // b.ways for b in self.buckets)

    def shard_pieces(self, positions: Mapping[str, int]) -> list[Bucket]:
        """The ranges of the flat buffer the rank at `positions` (axis -> its rank there) owns, one per bucket,
        in shard order."""
        return [Bucket(b.start + positions[b.replicas] * b.numel // b.ways,
                       b.start + (positions[b.replicas] + 1) * b.numel // b.ways) for b in self.buckets]

    def shard_of(self, flat: torch.Tensor, positions: Mapping[str, int]) -> torch.Tensor:
        """The pieces of a flat-buffer-sized tensor that the rank at `positions` owns, end to end (a copy)."""
        return torch.cat([flat[p.start:p.end] for p in self.shard_pieces(positions)])

    def spans(self, positions: Mapping[str, int] | None = None) -> dict[str, list[Span]]:
        """Where each parameter's elements sit in the optimizer's buffers, by name: in the whole flat
        buffer (`positions` None), or in the shard of the rank at `positions`, where a parameter may have
        no elements."""
        if positions is None:
            return {p.name: [Span(0, _numel(s), o)] for p, s, o in zip(self.params, self.shapes, self.offsets)}
        pieces, at = [], 0
        for piece in self.shard_pieces(positions):
            pieces.append((piece, at))
            at += piece.numel
        spans = {}
        for param, shape, offset in zip(self.params, self.shapes, self.offsets):
            end = offset + _numel(shape)
            spans[param.name] = [Span(max(offset, piece.start) - offset, min(end, piece.end) - offset,
                                      at + max(offset, piece.start) - piece.start)
                                 for piece, at in pieces if max(offset, piece.start) < min(end, piece.end)]
        return spans

    def flags(self, copies: Callable[[Param], int]) -> torch.Tensor:
        """Per-element optimizer flags for the whole buffer (uint8); `copies(param)`: on how many ranks of
        the norm's group each element of the parameter sits (gcompile.layout.replicas)."""
        flags = torch.zeros((self.numel,), dtype=torch.uint8)
        for param, shape, offset in zip(self.params, self.shapes, self.offsets):
            n = 0 if param.tied_copy else copies(param)
            if n > MAX_COPIES:
                raise ValueError(f"{param.name} sits on {n} ranks of the norm's group; at most {MAX_COPIES} fit")
            flags[offset:offset + _numel(shape)] = (DECAY if param.decays else 0) | n << COPIES_SHIFT
        return flags


def flat_layout(stage_params: list[list[tuple[Param, tuple[int, ...]]]], sizes: Mapping[str, int],
                bucket_size: int) -> FlatLayout:
    """Lay out the (param, local shape) lists of a rank's stages, given in the order their backwards finish;
    `sizes`: the mesh's axis sizes.

    A parameter that appears in several local stages (a tied weight with pp=1 and
    vpp>1) gets one entry: its gradient contributions add up in one place. A bucket
    ends where the next parameter's replicas differ (an expert's after a dense one).
    """
    params, shapes, offsets, buckets = [], [], [], []
    seen, end, bucket_start, replicas = set(), 0, 0, "dp"

    def close(at: int) -> int:
        ways = sizes.get(replicas, 1)
        at = _round_up(max(at, bucket_start + 1), ALIGN * ways)  # so every shard piece stays aligned
        buckets.append(Bucket(bucket_start, at, replicas, ways))
        return at

    for stage in stage_params:
        for param, shape in reversed(stage):
            if param.name in seen:
                continue
            seen.add(param.name)
            mine = replicas_of(param)
            if mine != replicas:
                if end > bucket_start:
                    end = bucket_start = close(end)
                replicas = mine
            params.append(param)
            shapes.append(tuple(shape))
            offsets.append(end)
            end = _round_up(end + _numel(shape), ALIGN)
            if end - bucket_start >= bucket_size:
                end = bucket_start = close(end)
    if end > bucket_start or not buckets:
        end = close(end)
    return FlatLayout(params=tuple(params), shapes=tuple(shapes), offsets=tuple(offsets), buckets=tuple(buckets),
                      numel=end)


def replicas_of(param: Param) -> str:
    """The axis whose ranks hold `param` alike among the data-parallel ranks: dp, or the replica role of a
    folded axis that cuts it (gcompile.axes.REPLICAS)."""
    return next((REPLICAS[s.axis] for s in param.shards if s.axis in REPLICAS), "dp")


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
