"""Rank <-> mesh coordinates, and the process groups graphs refer to by name.

Megatron's order, tp fastest: rank = tp_rank + tp * (dp_rank + dp * pp_rank).
Passes see only `Coords` (plain numbers); process groups exist only at run time.
"""

import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gcompile import shm_group
from gcompile.config import ConfigError


@dataclass(frozen=True)
class Coords:
    tp: int
    pp: int
    dp: int
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0

    @classmethod
    def from_rank(cls, rank: int, tp: int, pp: int, dp: int) -> "Coords":
        return cls(tp, pp, dp, tp_rank=rank % tp, dp_rank=rank // tp % dp, pp_rank=rank // (tp * dp))

    @property
    def rank(self) -> int:
        return self.tp_rank + self.tp * (self.dp_rank + self.dp * self.pp_rank)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def axis_sizes(self) -> dict[str, int]:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp}

    @property
    def axis_ranks(self) -> dict[str, int]:
        return {"tp": self.tp_rank, "pp": self.pp_rank, "dp": self.dp_rank}

    def __str__(self) -> str:
        return f"(pp{self.pp_rank} dp{self.dp_rank} tp{self.tp_rank})"


# Groups a graph may name, by the axes whose ranks they span; plus "embd" (embedding_group_ranks).
GROUP_AXES = {
    "tp": ("tp",),
    "dp": ("dp",),
    "mp": ("pp", "tp"),  # model parallel: every parameter once (gradient norm)
    "world": ("pp", "dp", "tp"),
}


def group_ranks(coords: Coords, axes: tuple[str, ...]) -> list[int]:
    """Global ranks of the group spanning `axes` that contains the rank at `coords`."""
    ranks = []
    for pp in range(coords.pp) if "pp" in axes else [coords.pp_rank]:
        for dp in range(coords.dp) if "dp" in axes else [coords.dp_rank]:
            for tp in range(coords.tp) if "tp" in axes else [coords.tp_rank]:
                ranks.append(Coords(coords.tp, coords.pp, coords.dp, tp, pp, dp).rank)
    return ranks


def embedding_group_ranks(coords: Coords) -> list[int]:
    """The first and last pipeline rank at this rank's (dp, tp): each holds a copy of the tied embedding."""
    return sorted({Coords(coords.tp, coords.pp, coords.dp, coords.tp_rank, pp, coords.dp_rank).rank
                   for pp in (0, coords.pp - 1)})


def init_groups(coords: Coords, tp_backend: str | None = None) -> dict[str, dist.ProcessGroup]:
    """Create every group (all ranks take part in each creation) and register this rank's
    under its role name, so `all_reduce(x, "tp")` in a graph means this rank's tp group.
    `tp_backend` (tp_group_backend's choice) puts the tp groups on another backend than the world's."""
    mesh = dist.device_mesh.init_device_mesh(
        "cuda" if torch.cuda.is_available() else "cpu", (coords.pp, coords.dp, coords.tp),
        mesh_dim_names=("pp", "dp", "tp"))
    groups = {"tp": mesh["tp"].get_group(), "dp": mesh["dp"].get_group(),
              "mp": mesh["pp", "tp"]._flatten("mp").get_group(), "world": dist.group.WORLD}
    if tp_backend is not None:
        for first in range(0, coords.world_size, coords.tp):  # tp is the fastest axis: tp groups are runs of ranks
            created = dist.new_group(list(range(first, first + coords.tp)), backend=tp_backend)
            if first <= coords.rank < first + coords.tp:
                groups["tp"] = created
    for name, group in groups.items():
        if sorted(dist.get_process_group_ranks(group)) != group_ranks(coords, GROUP_AXES[name]):
            raise AssertionError(f"group {name} of rank {coords.rank} has ranks "
                                 f"{dist.get_process_group_ranks(group)}, expected {group_ranks(coords, GROUP_AXES[name])}")
    for dp_rank in range(coords.dp):  # every rank joins every creation, in the same order
        for tp_rank in range(coords.tp):
            ranks = embedding_group_ranks(Coords(coords.tp, coords.pp, coords.dp, tp_rank, 0, dp_rank))
            created = dist.new_group(ranks)
            if coords.rank in ranks:
                groups["embd"] = created
    for name, created in groups.items():
        register_group(name, created)
    return groups


def register_group(name: str, group: dist.ProcessGroup) -> None:
    """Make `name` in a graph's collectives mean `group` on this rank."""
    if name in _registered:
        torch._C._distributed_c10d._unregister_process_group(name)
    torch._C._distributed_c10d._register_process_group(name, group)
    _registered.add(name)


_registered: set[str] = set()


def tp_group_backend(requested: str, coords: Coords, device: str) -> str | None:
    """The backend for the tp groups (parallel.tp_comm_backend), None for the world's.

    auto picks shared memory for CPU ranks when every tp group sits on one host: there it
    all-reduces about 6x faster than gloo's loopback TCP (gcompile/shm_group.py). The
    choice is made from every rank's host name, so all ranks make the same one."""
    if device != "cpu" or coords.tp == 1 or requested == "gloo":
        if requested == "shm" and device != "cpu":
            raise ConfigError("tp_comm_backend='shm' is for CPU ranks; on GPUs tp groups use nccl")
        return None
    if not shm_group.available():
        if requested == "shm":
            raise ConfigError("tp_comm_backend='shm' needs x86-64 Linux with /dev/shm; use gloo here")
        return None
    hosts = [None] * coords.world_size
    dist.all_gather_object(hosts, socket.gethostname())
    spread = [hosts[first:first + coords.tp] for first in range(0, coords.world_size, coords.tp)
              if len(set(hosts[first:first + coords.tp])) > 1]
    if spread:
        if requested == "shm":
            raise ConfigError(f"tp_comm_backend='shm' needs each tp group on one host, but one spans "
                              f"{sorted(set(spread[0]))}; use gloo or place tp ranks together")
        return None
    shm_group.register()
    return shm_group.BACKEND


def group(name: str) -> dist.ProcessGroup:
    """This rank's group registered under `name` by init_groups."""
    return torch._C._distributed_c10d._resolve_process_group(name)


def group_members(coords: Coords, name: str) -> tuple[int, ...]:
    """The global ranks of the group a graph names `name`, as seen from the rank at `coords`."""
    if name == "embd":
        return tuple(embedding_group_ranks(coords))
    return tuple(group_ranks(coords, GROUP_AXES[name]))


def init_fake_world(coords: Coords) -> None:
    """A process group that runs nothing, of the world's shape, with the named groups registered:
    enough for Inductor to compile graphs that name groups (it asks their sizes), in one process."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=coords.rank, world_size=coords.world_size)
    init_groups(coords)
