"""The distributed optimizer (Megatron's ZeRO-1, strategy optim): each dp rank updates 1/dp of the weights;
and ZeRO-2 (strategy optim_grads): the gradients, too, are kept only as each rank's reduced shard.

Requires: a lowered RankProgram whose flat layout is bucketed with every bucket a
          multiple of dp (gcompile.flat guarantees it), and whose optimizer step is the
          dp = 1 step with fp32 main weights apart from the model's (marks GRAD, NORM_SQ,
          WRITE_BACK; gcompile.optimizer).
Ensures:  dp rank i owns the i-th 1/dp of every bucket (of a bucket of expert-parallel parameters: edp rank
          i the i-th 1/edp, reduce-scattered and gathered over "edp", Bucket.replicas); the step's main weights, AdamW
          states and flags are those pieces end to end (1/dp of the unsharded memory;
          program.optimizer_shard = "dp"); the gradient norm (and the fp16 overflow flag)
          is reduced over the whole world (each piece counted once). With
          `--overlap-grad-reduce` a bucket's reduce-scatter starts inside the last
          microbatch's backward (passes/bucket_overlap.py) and lands in `reduced_grads`,
          a new input of the step. Under context parallel the cp ranks hold the same shard:
          each reduced shard is all-reduced over "cp" too and divided by dp * cp (as
          passes/data_parallel.py averages over dp_cp), and the norm counts the cp copies
          once through the flags (gcompile.state.norm_copies).
          optim_grads: every bucket that can (all but those holding a pipeline-tied weight)
          is reduce-scattered by every microbatch's backward, each microbatch's own gradients,
          and the runtime adds the shards up in `reduced_grads`; when that is every bucket
          the step reads and zeroes no full gradient and the runtime never allocates the flat
          accumulator (program.grad_accumulator is False). Otherwise the accumulator holds the
          tied buckets from a step's first backward to its update, and is freed after it
          (program.grads_between_steps is False).

Rewrite (optimizer graph):
    before: main, exp_avg, exp_avg_sq, flags: (numel,)
            grad = alias(accumulated gradient)                           # marked GRAD
            norm_sq = all_reduce(sum(grad^2 ...), "mp")  (or no all_reduce)
            AdamW(main, grad);  params.copy_(main)                       # marked WRITE_BACK
    after:  main, exp_avg, exp_avg_sq, flags: (numel / dp,)
            started_b = reduce_scatter(grad[bucket b], "sum", dp, "dp")  # every b, in order
            shard = cat(wait(started_b) / dp ...)                        # overlapped b: reduced_grads[piece b]
            norm_sq = all_reduce(sum(shard^2 ...), "world")
            AdamW(main, shard)
            params.copy_(cat(wait(all_gather(main[piece b], dp, "dp")) ...))   # back to every rank, in bucket order
"""

from dataclasses import replace

import torch
import torch.fx as fx

from gcompile.flat import FlatLayout
from gcompile.optimizer import FOUND_INF, GRAD, NORM_SQ, WRITE_BACK, marked
from gcompile.pass_manager import PassContext, register_pass
from gcompile.rank_program import RankProgram
from passes.bucket_overlap import overlap_buckets, overlappable_buckets, slice_of
from passes.optimizer_rewrite import drop_unread, finished, reduce_gradient, reduce_over, required, rewritten, wait

NAME = "sharded_optimizer"
SHARDED_STATE = ("main", "exp_avg", "exp_avg_sq", "flags")
_ops = torch.ops._c10d_functional


@register_pass(NAME)
def sharded_optimizer_pass(program: RankProgram, ctx: PassContext) -> RankProgram:
    dp, cp, layout = ctx.coords.size("dp"), ctx.coords.size("cp"), program.layout
    if not program.step_settings.separate_main:
        raise ValueError("sharded_optimizer needs fp32 main weights apart from the model's "
                         "(StepSettings.separate_main, set by --use-distributed-optimizer)")
    offsets = _piece_offsets(layout)

    def start(graph: fx.Graph, total: fx.Node, bucket: int) -> fx.Node:
        b = layout.buckets[bucket]
        if b.ways == 1:  # experts no other rank holds: nothing to sum
            return total
        return graph.call_function(_ops.reduce_scatter_tensor.default, (total, "sum", b.ways, b.replicas))

    def finish(graph: fx.Graph, reduced: fx.Node, bucket: int) -> fx.Node:
        if cp > 1 and layout.buckets[bucket].replicas == "dp":  # context parallel: the cp ranks hold the same
            # shard, each summed over its dp ranks only (an edp group spans cp already)
            reduced = graph.call_function(_ops.wait_tensor.default,
                                          (graph.call_function(_ops.all_reduce.default, (reduced, "sum", "cp")),))
        return graph.call_function(torch.ops.aten.div.Tensor, (reduced, dp * cp))

    overlapped = frozenset()
    shard_grads = ctx.config.parallel.sharding == "optim_grads"
    if ctx.config.parallel.overlap_grad_reduce or shard_grads:
        overlapped = overlappable_buckets(program)
        program = overlap_buckets(program, overlapped, start, finish,
                                  lambda i, b: ("reduced_grads", offsets[i], offsets[i + 1]), every_microbatch=shard_grads)
    world = ctx.coords.world_size

    def rewrite(gm: fx.GraphModule) -> tuple[fx.GraphModule, tuple[str, ...]]:
        inputs = program.optimizer.inputs
        placeholders = dict(zip(inputs, gm.graph.find_nodes(op="placeholder"), strict=True))
        for name in SHARDED_STATE:
            placeholders[name].meta["val"] = _shard_sized(placeholders[name].meta["val"], layout)
        reduced_grads = None
        if overlapped:
            with gm.graph.inserting_after(placeholders[inputs[-1]]):
                reduced_grads = gm.graph.placeholder("reduced_grads")
            reduced_grads.meta["val"] = _shard_sized(placeholders["exp_avg"].meta["val"], layout)
            reduced_grads.meta["pass"] = NAME
            inputs += ("reduced_grads",)
        full_grad = required(gm, GRAD)
        reduce_gradient(gm, layout, start, finish, overlapped,
                        ready=lambda graph, grad, i: slice_of(graph, reduced_grads, offsets[i], offsets[i + 1]))
        drop_unread(gm, full_grad)  # every bucket overlapped: the step copies no full gradient
        if not program.grad_accumulator:  # and zeroes none: the runtime never allocates it
            for node in list(placeholders["grads"].users):
                gm.graph.erase_node(node)
            with placeholders["grads"].meta["val"].fake_mode:
                placeholders["grads"].meta["val"] = torch.empty(0, device=placeholders["grads"].meta["val"].device)
        if world > 1:
            for mark, op in ((NORM_SQ, "sum"), (FOUND_INF, "max")):
                if (node := marked(gm, mark)) is not None:
                    reduce_over(gm, node, op, "world", NAME)
        _gather_write_back(gm, required(gm, WRITE_BACK), offsets, layout)
        return finished(gm, NAME), inputs
    reads = (NAME, layout, ctx.coords.sizes, overlapped, program.grad_accumulator)
    return replace(program, optimizer=rewritten(program, reads, rewrite), optimizer_shard="dp",
                   norm_group="world" if world > 1 else None, grads_between_steps=not shard_grads)


def _gather_write_back(gm: fx.GraphModule, write_back: fx.Node, offsets: list[int], layout: FlatLayout) -> None:
    """params.copy_(main) -> params.copy_(every rank's pieces of main, gathered bucket by bucket)."""
    graph, main = gm.graph, write_back.args[1]
    with graph.inserting_before(write_back):
        started = [slice_of(graph, main, offsets[i], offsets[i + 1]) for i in range(len(layout.buckets))]
        started = [s if b.ways == 1 else graph.call_function(_ops.all_gather_into_tensor.default, (s, b.ways, b.replicas))
                   for s, b in zip(started, layout.buckets)]
        gathered = graph.call_function(torch.ops.aten.cat.default, ([wait(graph, s) for s in started],))
    write_back.update_arg(1, gathered)


def _shard_sized(val: torch.Tensor, layout: FlatLayout) -> torch.Tensor:
    with val.fake_mode:
        return torch.empty(layout.shard_numel, dtype=val.dtype, device=val.device)


def _piece_offsets(layout: FlatLayout) -> list[int]:
    """Where each bucket's piece starts in a shard-sized buffer (and where the last ends)."""
    offsets = [0]
    for b in layout.buckets:
        offsets.append(offsets[-1] + b.numel // b.ways)
    return offsets
