"""Data parallelism: gradients averaged over the dp group in flat buckets.

Requires: a lowered RankProgram whose flat layout is bucketed (gcompile.flat).
Ensures:  the optimizer step starts with one all-reduce per bucket over "dp",
          all issued before any is waited for, then divides by dp; every dp rank
          then updates identical full weights.

Rewrite (optimizer graph):
    before: grad = accumulated local gradient;                 AdamW(grad)
    after:  grad = cat(all_reduce(grad[bucket]) ...) / dp;     AdamW(grad)

Each dp rank sees the same number of tokens, so the mean of the dp ranks' mean
gradients is the gradient of the mean loss over the global batch, as one
device computes it.
"""

import torch

from gcompile import collectives
from gcompile.flat import FlatLayout
from gcompile.pass_manager import PassContext, register_pass
from gcompile.rank_program import RankProgram


class BucketAllReduce:
    sharded = False

    def __init__(self, group: str, dp: int):
        self.group, self.dp = group, dp

    def reduce(self, grad: torch.Tensor, layout: FlatLayout) -> torch.Tensor:
        started = [collectives.start_all_reduce(grad[b.start:b.end], self.group) for b in layout.buckets]
        return torch.cat([collectives.wait(t) for t in started]) / self.dp

    def gather(self, main: torch.Tensor, layout: FlatLayout) -> torch.Tensor:
        return main


@register_pass("data_parallel")
def data_parallel_pass(program: RankProgram, ctx: PassContext) -> RankProgram:
    return program.with_grad_sync(BucketAllReduce("dp", ctx.coords.dp))
