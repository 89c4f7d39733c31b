"""The distributed optimizer (Megatron's ZeRO-1): each dp rank updates 1/dp of the weights.

Requires: a lowered RankProgram whose flat layout is bucketed with every bucket
          a multiple of dp (gcompile.flat guarantees it).
Ensures:  dp rank i owns the i-th 1/dp of every bucket; its fp32 main weights and
          AdamW states hold only those pieces (1/dp of the unsharded memory); the
          gradient norm is summed over the whole world (each piece counted once).
          With `--overlap-grad-reduce` a bucket's reduce-scatter starts inside the last
          microbatch's backward (passes/bucket_overlap.py) and lands in `reduced_grads`.

Rewrite (optimizer graph):
    before: grad = accumulated gradient;  AdamW(main, grad);  params = main
    after:  shard = cat(reduce_scatter(grad[bucket]) ...) / dp
            AdamW(main_shard, shard)
            params = cat(all_gather(main_shard[piece]) ...)     # back to every rank, in bucket order
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
class BucketReduceScatter:
    group: str
    dp: int
    overlapped: frozenset[int] = frozenset()
    """Buckets whose averaged shard piece was written to `reduced_grads` during backward."""
    sharded = True

    @property
    def extra_inputs(self) -> tuple[str, ...]:
        return ("reduced_grads",) if self.overlapped else ()

    def reduce(self, grad: torch.Tensor, layout: FlatLayout, *reduced: torch.Tensor) -> torch.Tensor:
        offsets = _piece_offsets(layout)
        started = [reduced[0][offsets[i]:offsets[i + 1]] if i in self.overlapped else
                   collectives.start_reduce_scatter(grad[b.start:b.end], self.group, self.dp)
                   for i, b in enumerate(layout.buckets)]
        return torch.cat([t if i in self.overlapped else collectives.wait(t) / self.dp
                          for i, t in enumerate(started)])

    def gather(self, main: torch.Tensor, layout: FlatLayout) -> torch.Tensor:
        pieces = main.split([b.numel // self.dp for b in layout.buckets])
        started = [collectives.start_all_gather(piece, self.group, self.dp) for piece in pieces]
        return torch.cat([collectives.wait(t) for t in started])


def _piece_offsets(layout: FlatLayout) -> list[int]:
    """Where each bucket's piece starts in a shard-sized buffer (and where the last ends)."""
    offsets = [0]
    for b in layout.buckets:
        offsets.append(offsets[-1] + b.numel // layout.dp)
    return offsets


@register_pass("sharded_optimizer")
def sharded_optimizer_pass(program: RankProgram, ctx: PassContext) -> RankProgram:
    dp = ctx.coords.size("dp")
    if not ctx.config.parallel.overlap_grad_reduce:
        return program.with_grad_sync(BucketReduceScatter("dp", dp))
    buckets = overlappable_buckets(program)
    offsets = _piece_offsets(program.layout)

    def start(graph: fx.Graph, total: fx.Node, bucket: int) -> fx.Node:
        return graph.call_function(_ops.reduce_scatter_tensor.default, (total, "sum", dp, "dp"))

    def finish(graph: fx.Graph, reduced: fx.Node) -> fx.Node:
        return graph.call_function(torch.ops.aten.div.Tensor, (reduced, dp))

    program = overlap_buckets(program, buckets, start, finish,
                              lambda i, b: ("reduced_grads", offsets[i], offsets[i + 1]))
    return program.with_grad_sync(BucketReduceScatter("dp", dp, buckets))
