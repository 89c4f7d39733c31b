"""One rank of a checkpoint test: gcompile.train.train for each config of a job, in order.

Started by tests/multirank.py with RANK / WORLD_SIZE in the environment and a FileStore
path. The configs share the launch, so a later one can load what an earlier one saved;
each writes its losses to its own RUN_DIR/metrics.jsonl. With `kill` = (rank, iteration)
in the job, that rank SIGKILLs itself in the middle of writing that iteration's checkpoint:
its shard file is left half written, and the other ranks are left waiting for it.
"""

import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from gcompile.checkpoint import TMP, iteration_dir
from gcompile.axes import Coords
from gcompile.mesh import init_groups
from gcompile.train import train


def die_while_saving(iteration: int) -> None:
    """Make the DCP writer of `iteration`'s checkpoint cut its files in half and kill this process."""
    write_data = dcp.FileSystemWriter.write_data

    def write_then_die(self, plan, planner):
        written = write_data(self, plan, planner)
        if os.path.basename(str(self.path)) == os.path.basename(iteration_dir("", iteration) + TMP):
            for result in written.wait():
                path = os.path.join(str(self.path), result.storage_data.relative_path)
                os.truncate(path, os.path.getsize(path) // 2)
            os.kill(os.getpid(), signal.SIGKILL)
        return written

    dcp.FileSystemWriter.write_data = write_then_die


def main(job_path: str, store_path: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    job = torch.load(job_path, weights_only=False)
    if job.get("kill") and job["kill"][0] == rank:
        die_while_saving(job["kill"][1])
    for config in job["configs"]:
        p = config.parallel
        coords = Coords.from_rank(rank, config.mesh_sizes)
        init_groups(coords, p.tp_comm_backend)
        train(config, coords, "cpu")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
