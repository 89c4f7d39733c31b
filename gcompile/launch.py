"""Start the ranks: join a world torchrun made, or spawn one locally with torch's elastic launcher.

Locally spawned ranks re-run the same command line; the launcher's environment
(RANK, WORLD_SIZE, ...) tells them they are ranks. A standalone c10d rendezvous
on a free port means no fixed ports. Children of the elastic launcher share
Inductor's on-disk cache with the parent and with each other.
"""

import math
import os
import sys
import uuid
from collections.abc import Callable

import torch
import torch.distributed as dist

from gcompile.config import ConfigError
from gcompile.axes import Coords
from gcompile.mesh import init_groups


def under_launcher() -> bool:
    """Started by torchrun or by spawn_local (the elastic agent sets these)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def rank_threads(world_size: int) -> int:
    """CPU threads per locally spawned rank: the cores shared evenly (OMP_NUM_THREADS wins if set)."""
    return int(os.environ.get("OMP_NUM_THREADS", max(1, (os.cpu_count() or 1) // world_size)))


def spawn_local(world_size: int, argv: list[str]) -> int:
    """Run `python argv...` as `world_size` local ranks; 0 if all succeeded."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.setdefault("OMP_NUM_THREADS", str(rank_threads(world_size)))
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world_size, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
                          monitor_interval=0.1)
    try:
        elastic_launch(config, sys.executable)(*argv)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        print(f"{argv[0]}: rank {rank} failed with exit code {code}; its output is above", file=sys.stderr)
        return code if code > 0 else 1
    return 0


def join_world(mesh_sizes: dict[str, int], tp_comm_backend: str = "auto") -> tuple[Coords, str]:
    """Initialize this process as one rank of the launcher's world of `mesh_sizes`; (coords, device)."""
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if world != math.prod(mesh_sizes.values()):
        factors = " * ".join(f"{axis} {size}" for axis, size in mesh_sizes.items() if size > 1) or "1"
        raise ConfigError(f"the launcher started {world} ranks but {factors} = {math.prod(mesh_sizes.values())}")
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device, backend = f"cuda:{local_rank}", "nccl"
    else:
        device, backend = "cpu", "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world)
    coords = Coords.from_rank(rank, mesh_sizes)
    init_groups(coords, tp_comm_backend, "cpu" if device == "cpu" else "cuda")
    return coords, device


def run_ranks(world_size: int, argv: list[str], rank_main: Callable[[], int]) -> int:
    """As a rank: run `rank_main`. Otherwise: run it here for one rank, or spawn `world_size` ranks."""
    if under_launcher():
        try:
            return rank_main()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    if world_size == 1:
        return rank_main()
    return spawn_local(world_size, argv)
