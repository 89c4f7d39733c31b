"""Data parallelism: gradients averaged over the dp group (dp x cp under context parallel) in flat buckets;
a bucket of expert-parallel parameters over the ranks that hold the same experts (edp) instead.

Requires: a lowered RankProgram whose flat layout is bucketed (gcompile.flat) and whose
          optimizer step is the dp = 1 step, its gradient marked GRAD (gcompile.optimizer).
Ensures:  every bucket is all-reduced over "dp_cp" (a bucket of parameters cut over a folded axis: over
          the ranks that hold the same piece, its Bucket.replicas role, e.g. "edp") and divided by dp * cp before the norm and
          the update, so every dp rank updates identical full weights. By default the
          optimizer step starts with the reductions, all issued before any is waited
          for; with `--overlap-grad-reduce` each bucket's all-reduce starts inside the
          last microbatch's backward as soon as the bucket is final (passes/bucket_overlap.py),
          and the step reads that bucket as the runtime stored it.

Rewrite (optimizer graph):
    before: grad = alias(accumulated local gradient)                    # marked GRAD
            norm(grad); AdamW(grad)
    after:  started_b = all_reduce(grad[bucket b], "sum", "dp_cp")       # every b, in order
            grad' = cat(wait(started_b) / (dp * cp) ...)                # overlapped b: grad[b] as is
            norm(grad'); AdamW(grad')

Each dp rank sees the same number of tokens, so the mean of the dp ranks' mean
gradients is the gradient of the mean loss over the global batch, as one device
computes it. Context-parallel ranks see the same number of tokens too (each its
share of every sample), so they join the average alike: the group is "dp_cp",
which is "dp" when cp = 1.
"""

from dataclasses import replace

import torch
import torch.fx as fx

from gcompile.axes import role_size
from gcompile.pass_manager import PassContext, register_pass
from gcompile.rank_program import RankProgram
from passes.bucket_overlap import overlap_buckets, overlappable_buckets, slice_of
from passes.optimizer_rewrite import finished, reduce_gradient, rewritten

NAME = "data_parallel"
GROUP = "dp_cp"
_ops = torch.ops._c10d_functional


@register_pass(NAME)
def data_parallel_pass(program: RankProgram, ctx: PassContext) -> RankProgram:
    ranks = role_size(ctx.coords, GROUP)

    def start(graph: fx.Graph, total: fx.Node, bucket: int) -> fx.Node:
        replicas = program.layout.buckets[bucket].replicas
        group = GROUP if replicas == "dp" else replicas
        if role_size(ctx.coords, group) == 1:  # experts no other rank holds: nothing to sum
            return total
        return graph.call_function(_ops.all_reduce.default, (total, "sum", group))

    def finish(graph: fx.Graph, reduced: fx.Node, bucket: int) -> fx.Node:
        return graph.call_function(torch.ops.aten.div.Tensor, (reduced, ranks))

    overlapped = frozenset()
    if ctx.config.parallel.overlap_grad_reduce:
        overlapped = overlappable_buckets(program)
        program = overlap_buckets(program, overlapped, start, finish, lambda i, b: ("grads", b.start, b.end))

    def rewrite(gm: fx.GraphModule) -> tuple[fx.GraphModule, tuple[str, ...]]:
        reduce_gradient(gm, program.layout, start, finish, overlapped,
                        ready=lambda graph, grad, i: slice_of(graph, grad, program.layout.buckets[i].start,
                                                              program.layout.buckets[i].end))
        return finished(gm, NAME), program.optimizer.inputs
    return replace(program, optimizer=rewritten(program, (NAME, program.layout, ctx.coords.sizes, overlapped), rewrite))
