"""Data parallelism: gradients averaged over the dp group in flat buckets.

Requires: a lowered RankProgram whose flat layout is bucketed (gcompile.flat).
Ensures:  every bucket is all-reduced over "dp" and divided by dp before the norm and
          the update, so every dp rank updates identical full weights. By default the
          optimizer step starts with the reductions, all issued before any is waited
          for; with `--overlap-grad-reduce` each bucket's all-reduce starts inside the
          last microbatch's backward as soon as the bucket is final (passes/bucket_overlap.py).

Rewrite (optimizer graph):
    before: grad = accumulated local gradient;                 AdamW(grad)
    after:  grad = cat(all_reduce(grad[bucket]) ...) / dp;     AdamW(grad)

Each dp rank sees the same number of tokens, so the mean of the dp ranks' mean
gradients is the gradient of the mean loss over the global batch, as one device
computes it.
"""

from dataclasses import dataclass

import torch
import torch.fx as fx

from gcompile import collectives
from gcompile.flat import FlatLayout
from gcompile.pass_manager import PassContext, register_pass
from gcompile.rank_program import RankProgram
from passes.bucket_overlap import overlap_buckets, overlappable_buckets

_ops = torch.ops._c10d_functional


@dataclass(frozen=True)
class BucketAllReduce:
    group: str
    dp: int
    overlapped: frozenset[int] = frozenset()
    """Buckets already reduced (and averaged) in place during backward."""
    sharded = False
    extra_inputs = ()

    def reduce(self, grad: torch.Tensor, layout: FlatLayout) -> torch.Tensor:
        started = [grad[b.start:b.end] if i in self.overlapped else
                   collectives.start_all_reduce(grad[b.start:b.end], self.group)
                   for i, b in enumerate(layout.buckets)]
        return torch.cat([t if i in self.overlapped else collectives.wait(t) / self.dp
                          for i, t in enumerate(started)])

    def gather(self, main: torch.Tensor, layout: FlatLayout) -> torch.Tensor:
        return main


@register_pass("data_parallel")
def data_parallel_pass(program: RankProgram, ctx: PassContext) -> RankProgram:
    dp = ctx.coords.size("dp")
    if not ctx.config.parallel.overlap_grad_reduce:
        return program.with_grad_sync(BucketAllReduce("dp", dp))
    buckets = overlappable_buckets(program)

    def start(graph: fx.Graph, total: fx.Node, bucket: int) -> fx.Node:
        return graph.call_function(_ops.all_reduce.default, (total, "sum", "dp"))

    def finish(graph: fx.Graph, reduced: fx.Node) -> fx.Node:
        return graph.call_function(torch.ops.aten.div.Tensor, (reduced, dp))

    program = overlap_buckets(program, buckets, start, finish, lambda i, b: ("grads", b.start, b.end))
    return program.with_grad_sync(BucketAllReduce("dp", dp, buckets))
