"""Named mesh axes: a rank's coordinates, and the one table of process-group roles.

World axes in Megatron's order, fastest first: tp, cp, dp, pp, so that

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

(with cp = 1 this is the tp/dp/pp formula every earlier checkpoint and dump uses).
Expert parallelism is no factor of the world: as in Megatron-Core, ep folds into
the dp x cp ranks, an ep group being a run of ep consecutive ones. An axis of
size 1 costs nothing: no group is created for a role whose groups hold one rank.

Graphs name process groups by role ("tp", "dp_cp", "mp", ...); `GROUP_ROLES` says
which axes each role spans. Group creation, the plan checker, the one-process
harness and the runtime derive a group's members from this table alone.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass

AXES = ("tp", "cp", "dp", "pp")
"""World axes, fastest first; the world size is the product of their sizes."""
FOLDED = {"ep": ("cp", "dp"), "dp_shard": ("dp",)}
"""Axes that subdivide the ranks of world axes instead of multiplying the world: a group is a run of
consecutive positions over the parents."""
ACROSS = {"dp_replicate": "dp_shard", "edp": "ep"}
"""Folded axes whose group is the ranks at one position of every group of another folded axis
(HSDP: dp_shard groups shard the weights, the dp_replicate groups across them hold the same shard;
expert parallel: ep groups split the experts, the edp groups across them hold the same experts)."""
REPLICAS = {"ep": "edp"}
"""For a parameter cut over a folded axis: the role whose ranks hold the same piece, over which its
gradient is reduced (and its optimizer state sharded) in place of dp."""


@dataclass(frozen=True)
class GroupRole:
    axes: tuple[str, ...]
    """The axes whose ranks the group spans; the rank's position on every other axis is fixed."""
    ends_only: bool = False
    """Only the first and last rank along the (single) axis: the two holders of a tied parameter."""


GROUP_ROLES = {
    "tp": GroupRole(("tp",)),
    "cp": GroupRole(("cp",)),
    "dp": GroupRole(("dp",)),
    "dp_cp": GroupRole(("cp", "dp")),  # gradient reduction under context parallel
    "dp_shard": GroupRole(("dp_shard",)),  # HSDP: the ranks that shard the weights between them
    "dp_replicate": GroupRole(("dp_replicate",)),  # HSDP: the ranks that hold the same shard
    "ep": GroupRole(("ep",)),  # expert parallel: the ranks that split the experts between them
    "edp": GroupRole(("edp",)),  # expert data parallel: the ranks that hold the same experts
    "pp": GroupRole(("pp",)),
    "mp": GroupRole(("tp", "pp")),  # model parallel: every parameter once (gradient norm)
    "world": GroupRole(AXES),
    "embd": GroupRole(("pp",), ends_only=True),  # first and last pipeline rank: the tied embedding
}
"""Every process-group role a graph or the runtime may name."""


@dataclass(frozen=True)
class Coords:
    """Where one rank sits: each axis's size and this rank's position on it."""

    sizes: tuple[tuple[str, int], ...]
    """(axis, size) for every world axis in AXES order, then every folded axis."""
    ranks: tuple[tuple[str, int], ...]
    """(axis, position) for every world axis in AXES order."""

    @classmethod
    def from_rank(cls, rank: int, sizes: Mapping[str, int]) -> "Coords":
        """The coordinates of global `rank` in a world of `sizes` (axes left out have size 1)."""
        unknown = set(sizes) - set(AXES) - set(FOLDED) - set(ACROSS)
        if unknown:
            raise ValueError(f"unknown mesh axes {sorted(unknown)}; axes are {AXES + tuple(FOLDED) + tuple(ACROSS)}")
        ordered = tuple((axis, sizes.get(axis, 1)) for axis in AXES)
        folded = tuple((axis, sizes[axis]) for axis in (*FOLDED, *ACROSS) if axis in sizes)
        for axis, size in folded:
            parents = FOLDED[ACROSS.get(axis, axis)]
            if math.prod(sizes.get(a, 1) for a in parents) % size:
                raise ValueError(f"{axis} {size} must divide {' x '.join(parents)}")
        ranks, rest = [], rank
        for axis, size in ordered:
            ranks.append((axis, rest % size))
            rest //= size
        if rest:
            raise ValueError(f"rank {rank} is outside a world of {math.prod(s for _, s in ordered)}")
        return cls(sizes=ordered + folded, ranks=tuple(ranks))

    @property
    def axis_sizes(self) -> dict[str, int]:
        return dict(self.sizes)

    @property
    def axis_ranks(self) -> dict[str, int]:
        """This rank's position on every axis, folded ones included."""
        ranks = dict(self.ranks)
        for axis, parents in FOLDED.items():
            ranks[axis] = _flat_position(self, parents) % self.size(axis)
        for axis, inner in ACROSS.items():
            ranks[axis] = _flat_position(self, FOLDED[inner]) // self.size(inner) % self.size(axis)
        return ranks

    def size(self, axis: str) -> int:
        return dict(self.sizes).get(axis, 1)

    def axis_rank(self, axis: str) -> int:
        return self.axis_ranks[axis]

    @property
    def rank(self) -> int:
        rank, stride = 0, 1
        for (axis, size), (_, position) in zip(self.sizes, self.ranks):
            rank += position * stride
            stride *= size
        return rank

    @property
    def world_size(self) -> int:
        return math.prod(self.size(axis) for axis in AXES)

    def moved(self, **positions: int) -> "Coords":
        """The coordinates of the rank at other positions on some world axes."""
        return Coords(self.sizes, tuple((axis, positions.get(axis, r)) for axis, r in self.ranks))

    def __str__(self) -> str:
        shown = [f"{axis}{r}" for axis, r in reversed(self.ranks) if axis in ("tp", "dp", "pp") or self.size(axis) > 1]
        if self.size("ep") > 1:  # folded into dp x cp: shown after dp
            shown.insert(shown.index(f"dp{dict(self.ranks)['dp']}") + 1, f"ep{self.axis_rank('ep')}")
        return f"({' '.join(shown)})"


def world_axes_of(axis: str) -> tuple[str, ...]:
    """The world axes whose ranks `axis` subdivides; the axis itself for a world axis."""
    return FOLDED.get(ACROSS.get(axis, axis), (axis,))


def _flat_position(coords: Coords, axes: tuple[str, ...]) -> int:
    """The rank's index among the ranks that differ only on `axes` (the first axis fastest)."""
    ranks, position, stride = dict(coords.ranks), 0, 1
    for axis in axes:
        position += ranks[axis] * stride
        stride *= coords.size(axis)
    return position


def group_members(coords: Coords, role: str) -> tuple[int, ...]:
    """The global ranks, ascending, of the `role` group that holds the rank at `coords`."""
    spec = GROUP_ROLES[role]
    members = [coords]
    for axis in spec.axes:
        if axis in FOLDED or axis in ACROSS:
            members = [m for c in members for m in _folded_group(c, axis)]
            continue
        positions = range(coords.size(axis))
        if spec.ends_only:
            positions = sorted({0, coords.size(axis) - 1})
        members = [c.moved(**{axis: p}) for c in members for p in positions]
    return tuple(sorted({c.rank for c in members}))


def _folded_group(coords: Coords, axis: str) -> list[Coords]:
    """The ranks of the folded `axis`'s group: a run of size(axis) consecutive positions over its parents,
    or for an ACROSS axis every size(inner)-th position from the rank's position in its inner group."""
    if axis in ACROSS:
        parents, stride = FOLDED[ACROSS[axis]], coords.size(ACROSS[axis])
        first = _flat_position(coords, parents) % stride
    else:
        parents, stride = FOLDED[axis], 1
        position = _flat_position(coords, parents)
        first = position - position % coords.size(axis)
    return [coords.moved(**_unflatten(coords, parents, first + i * stride)) for i in range(coords.size(axis))]


def _unflatten(coords: Coords, axes: tuple[str, ...], position: int) -> dict[str, int]:
    out = {}
    for axis in axes:
        out[axis] = position % coords.size(axis)
        position //= coords.size(axis)
    return out


def role_size(coords: Coords, role: str) -> int:
    """len(group_members(coords, role)) without listing them: the cost model asks it of every graph it costs,
    and at 1024 ranks listing the dp and world groups was 3% of planning."""
    spec = GROUP_ROLES[role]
    return math.prod(min(coords.size(axis), 2) if spec.ends_only else coords.size(axis) for axis in spec.axes)


def all_groups(coords: Coords, role: str) -> list[tuple[int, ...]]:
    """Every group of `role` in the world, in the order of their lowest rank (the order all ranks create them)."""
    groups = {group_members(Coords.from_rank(r, coords.axis_sizes), role) for r in range(coords.world_size)}
    return sorted(groups)
