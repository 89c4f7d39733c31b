"""The distributed optimizer (Megatron's ZeRO-1): each dp rank updates 1/dp of the weights.

Requires: a lowered RankProgram whose flat layout is bucketed with every bucket
          a multiple of dp (gcompile.flat guarantees it).
Ensures:  dp rank i owns the i-th 1/dp of every bucket; its fp32 main weights and
          AdamW states hold only those pieces (1/dp of the unsharded memory); the
          gradient norm is summed over the whole world (each piece counted once).

Rewrite (optimizer graph):
    before: grad = accumulated gradient;  AdamW(main, grad);  params = main
    after:  shard = cat(reduce_scatter(grad[bucket]) ...) / dp
            AdamW(main_shard, shard)
            params = cat(all_gather(main_shard[piece]) ...)     # back to every rank, in bucket order
"""

import torch

from gcompile import collectives
from gcompile.flat import FlatLayout
from gcompile.pass_manager import PassContext, register_pass
from gcompile.rank_program import RankProgram


class BucketReduceScatter:
    sharded = True

    def __init__(self, group: str, dp: int):
        self.group, self.dp = group, dp

    def reduce(self, grad: torch.Tensor, layout: FlatLayout) -> torch.Tensor:
        started = [collectives.start_reduce_scatter(grad[b.start:b.end], self.group, self.dp)
                   for b in layout.buckets]
        return torch.cat([collectives.wait(t) for t in started]) / self.dp

    def gather(self, main: torch.Tensor, layout: FlatLayout) -> torch.Tensor:
        pieces = main.split([b.numel // self.dp for b in layout.buckets])
        started = [collectives.start_all_gather(piece, self.group, self.dp) for piece in pieces]
        return torch.cat([collectives.wait(t) for t in started])


@register_pass("sharded_optimizer")
def sharded_optimizer_pass(program: RankProgram, ctx: PassContext) -> RankProgram:
    return program.with_grad_sync(BucketReduceScatter("dp", ctx.coords.dp))
