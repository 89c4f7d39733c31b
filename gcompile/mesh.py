"""Process groups at run time: one per role of gcompile.axes.GROUP_ROLES, registered under the role's name.

Graphs name groups by role ("tp", "dp", "mp", ...); every rank registers its own
group of each role under that name, so the same graph text is right on every rank
and compiles once. Which ranks a group holds comes from gcompile.axes alone.
"""

import os
import socket

import torch
import torch.distributed as dist

from gcompile import shm_group
from gcompile.axes import GROUP_ROLES, Coords, all_groups, group_members
from gcompile.torch_api import fake_store, register_process_group, resolve_process_group, unregister_process_group


class MeshError(ValueError):
    """A transport asked for that cannot work where the ranks run; the message names the alternative."""


def init_groups(coords: Coords, tp_comm_backend: str | None = None, device: str = "cpu") -> dict[str, dist.ProcessGroup]:
    """Create every group of every role whose groups hold more than one rank (all ranks take part in
    each creation, in one order) and register this rank's under the role name, so `all_reduce(x, "tp")`
    in a graph means this rank's tp group. `tp_comm_backend` (parallel.tp_comm_backend; None: the
    world's) may put the tp groups on shared memory (tp_group_backend)."""
    backends = {"tp": tp_group_backend(tp_comm_backend, coords, device)} if tp_comm_backend else {}
    groups, created = {"world": dist.group.WORLD}, {}
    for role in GROUP_ROLES:
        if role == "world" or len(group_members(coords, role)) == 1:
            continue
        for ranks in all_groups(coords, role):
            key = (ranks, backends.get(role))  # roles with the same ranks (dp_cp and dp at cp 1) share a group
            if key not in created:
                try:
                    created[key] = dist.new_group(list(ranks), backend=backends.get(role))
                except shm_group.ShmRoomError as e:
                    raise MeshError(str(e)) from None
            if coords.rank in ranks:
                groups[role] = created[key]
    for role, group in groups.items():
        register_group(role, group)
    return groups


def register_group(name: str, group: dist.ProcessGroup) -> None:
    """Make `name` in a graph's collectives mean `group` on this rank."""
    if name in _registered:
        unregister_process_group(name)
    register_process_group(name, group)
    _registered.add(name)


_registered: set[str] = set()


def tp_group_backend(requested: str, coords: Coords, device: str) -> str | None:
    """The backend for the tp groups (parallel.tp_comm_backend), None for the world's.

    auto picks shared memory for CPU ranks when every tp group sits on one host: there it
    all-reduces about 6x faster than gloo's loopback TCP (gcompile/shm_group.py). The
    choice is made from every rank's host name, so all ranks make the same one."""
    if device != "cpu" or coords.size("tp") == 1 or requested == "gloo":
        if requested == "shm" and device != "cpu":
            raise MeshError("tp_comm_backend='shm' is for CPU ranks; on GPUs tp groups use nccl")
        return None
    if not shm_group.available():
        if requested == "shm":
            raise MeshError("tp_comm_backend='shm' needs x86-64 Linux with /dev/shm; use gloo here")
        return None
    local_groups = int(os.environ.get("LOCAL_WORLD_SIZE", coords.world_size)) // coords.size("tp")
    seen = [None] * coords.world_size  # (host, why its /dev/shm is too small or None), from every rank
    dist.all_gather_object(seen, (socket.gethostname(), shm_group.room_error(local_groups, coords.size("tp"))))
    hosts = [host for host, _ in seen]
    spread = [[hosts[r] for r in ranks] for ranks in all_groups(coords, "tp")
              if len({hosts[r] for r in ranks}) > 1]
    if spread:
        if requested == "shm":
            raise MeshError(f"tp_comm_backend='shm' needs each tp group on one host, but one spans "
                            f"{sorted(set(spread[0]))}; use gloo or place tp ranks together")
        return None
    short = next((why for _, why in seen if why), None)
    if short:
        if requested == "shm":
            raise MeshError(short)
        return None
    shm_group.register()
    return shm_group.BACKEND


def check_shm_room(config, log=print) -> None:
    """Before local ranks start: shared-memory tp groups need room in /dev/shm for every group's
    mapping at once. With tp_comm_backend='shm' too little is an error; with auto the ranks use gloo."""
    p = config.parallel
    if p.tp_comm_backend == "gloo" or p.tp == 1 or torch.cuda.is_available() or not shm_group.available():
        return
    why = shm_group.room_error(config.world_size // p.tp, p.tp)
    if why and p.tp_comm_backend == "shm":
        raise MeshError(why)
    if why:
        log(f"tp groups use gloo, not shared memory: {why.partition(': give')[0]}")


def group(name: str) -> dist.ProcessGroup:
    """This rank's group registered under `name` by init_groups."""
    return resolve_process_group(name)


def init_fake_world(coords: Coords) -> None:
    """A process group that runs nothing, of the world's shape, with the named groups registered:
    enough for Inductor to compile graphs that name groups (it asks their sizes), in one process."""
    dist.init_process_group("fake", store=fake_store(), rank=coords.rank, world_size=coords.world_size)
    init_groups(coords)
