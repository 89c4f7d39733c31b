"""A rank of the launcher test: join the world, all-reduce the global rank over each named group."""

import json
import os
import sys

import torch
import torch.distributed as dist

from gcompile import collectives
from gcompile.launch import join_world
from gcompile.axes import GROUP_ROLES, group_members
from gcompile.mesh import group


def main(out_dir: str, tp: int, pp: int, dp: int) -> None:
    coords, _ = join_world({"tp": tp, "pp": pp, "dp": dp})
    rank = torch.tensor(float(coords.rank))
    sums = {}
    for name in [role for role in GROUP_ROLES if len(group_members(coords, role)) > 1]:  # the groups created
        via_graph_op = collectives.all_reduce(rank.clone(), name)  # the functional op the graphs use
        via_group = rank.clone()
        dist.all_reduce(via_group, group=group(name))
        sums[name] = [via_graph_op.item(), via_group.item()]
    record = dict(rank=coords.rank, env_rank=int(os.environ["RANK"]), tp_rank=coords.axis_rank("tp"),
                  dp_rank=coords.axis_rank("dp"), pp_rank=coords.axis_rank("pp"), sums=sums, tp_backend=group("tp").name())
    with open(os.path.join(out_dir, f"rank{coords.rank}.json"), "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:5]))
