"""A rank of the shared-memory group test: every collective on the shm group and on gloo, results saved.

Slots are made small, so that tensors go through in several pieces. Rank 1 then skips a
collective on a group with a 1 s timeout; rank 0 saves the error it gets.
"""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from gcompile import collectives, shm_group

SLOT_BYTES = 4096


def main(out_dir: str, store_path: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    shm_group.SLOT_BYTES = SLOT_BYTES
    shm_group.register()
    shm = dist.new_group(list(range(world)), backend=shm_group.BACKEND)
    torch._C._distributed_c10d._register_process_group("shm", shm)
    torch._C._distributed_c10d._register_process_group("gloo", dist.group.WORLD)
    groups = {"shm": shm, "gloo": dist.group.WORLD}
    g = torch.Generator().manual_seed(rank)
    results = {}
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for numel in (5, 3 * SLOT_BYTES + 3):  # one piece; several, the last one short
            x = (torch.randn(numel, generator=g) * 100).to(dtype)
            y = (torch.randn(world * numel, generator=g) * 100).to(dtype)
            results[("inputs", str(dtype), numel)] = x, y
            for name in ("shm", "gloo"):
                ops = {f"all_reduce {op}": collectives.all_reduce(x, name, op) for op in ("sum", "max", "min")}
                if dtype.is_floating_point:
                    ops["all_reduce avg"] = collectives.all_reduce(x, name, "avg")
                ops["all_gather"] = collectives.all_gather(x, name, world)
                ops["reduce_scatter"] = collectives.reduce_scatter(y, name, world)
                ops["broadcast"] = x.clone()
                dist.broadcast(ops["broadcast"], src=1, group=groups[name])
                ops["scatter"] = torch.empty_like(x)
                dist.scatter(ops["scatter"], list(y.chunk(world)) if rank == 2 else None, src=2, group=groups[name])
                for op, value in ops.items():
                    results[(name, str(dtype), numel, op)] = value
    strided = torch.randn(64, 48, generator=g).t()  # not contiguous: reduced in a copy, written back
    results["strided input"] = strided.clone()
    dist.all_reduce(strided, group=shm)
    results["strided"] = strided
    dist.barrier(group=shm)
    late = dist.new_group(list(range(world)), backend=shm_group.BACKEND, timeout=timedelta(seconds=1))
    if rank == 0:
        try:
            dist.all_reduce(torch.ones(4), group=late)
        except RuntimeError as e:
            results["timeout"] = str(e)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(os.path.dirname(sys.argv[1]), sys.argv[2])
