"""Overlap dp gradient reduction with backward (`--overlap-grad-reduce`).

Requires: a lowered RankProgram with a bucketed flat layout, and a way to start one
          bucket's reduction (all-reduce, or reduce-scatter under the distributed optimizer).
Ensures:  each local stage whose last-microbatch backward finishes some buckets gets a
          `backward_last` graph that, right after the last gradient of such a bucket is
          computed, adds it to the accumulated gradients and starts the bucket's
          collective; the waits come at the end of that graph, so the collective runs
          while backward computes the earlier layers. The results are copied into the
          state buffers the optimizer reads; the stage's last B instruction runs `backward_last`.
          Buckets holding a tied parameter are left
          to the optimizer step (their pipeline-stage sum must come first).
          Every microbatch (optim_grads): each B instruction runs `backward_last`, which
          reduces that microbatch's gradients alone (zeros where the bucket holds other
          stages' parameters) and returns no gradient of them to the accumulator; the runtime
          adds the results into the buffer, so no full gradient of those buckets is kept.

Rewrite (backward of the last microbatch, per finished bucket b):
    before: g_p = ...grad of p...                           (runtime: acc[p] += g_p)
    after:  g_p = ...grad of p...
            total_b = cat(acc[b] pieces, with acc[p] + g_p for this stage's p in b)
            started_b = reduce(total_b)                     # right after the last g_p of b
            ... rest of backward ...
            return (*grads, *wait(started_b))               # runtime: buffer[b] = result
"""

import copy
import math
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.fx as fx

from gcompile.collectives import is_collective
from gcompile.flat import Bucket
from gcompile.program import propagate_shapes
from gcompile.rank_program import LoweredStage, RankProgram
from gcompile.schedule import Kind

aten = torch.ops.aten
NAME = "bucket_overlap"

StartReduction = Callable[[fx.Graph, fx.Node, int], fx.Node]
"""(graph, node of the bucket's summed gradient, bucket index) -> node whose value is the started collective."""
Finish = Callable[[fx.Graph, fx.Node, int], fx.Node]
"""(graph, waited collective) -> node of the value to store (e.g. divided by dp)."""


def overlappable_buckets(program: RankProgram) -> frozenset[int]:
    layout = program.layout
    tied = [o for p, o in zip(layout.params, layout.offsets) if p.tied_group]
    return frozenset(i for i, b in enumerate(layout.buckets) if not any(b.start <= o < b.end for o in tied))


def overlap_buckets(program: RankProgram, buckets: frozenset[int], start: StartReduction, finish: Finish,
                    destination: Callable[[int, Bucket], tuple[str, int, int]],
                    every_microbatch: bool = False) -> RankProgram:
    """Move the reduction of `buckets` into the backward graphs that finish them. `every_microbatch`: every
    microbatch's backward reduces its own gradients of every bucket its stage holds a parameter of, and
    the runtime adds the results up (nothing of those buckets accumulates in the flat gradient buffer)."""
    layout = program.layout
    b_instructions = {}
    for i, a in enumerate(program.instructions):
        if a.op == Kind.B:
            b_instructions.setdefault(a.stage, []).append(i)
    holders = {name: [s for s, st in program.stages.items() if name in {p.name for p in st.params}]
               for name in (p.name for p in layout.params)}
    reduced_by = {}
    for i in sorted(buckets):
        b = layout.buckets[i]
        stages = {s for p, o in zip(layout.params, layout.offsets) if b.start <= o < b.end for s in holders[p.name]}
        for s in stages if every_microbatch else [max(stages, key=lambda s: b_instructions[s][-1])]:
            reduced_by.setdefault(s, []).append(i)
    stages, instructions = dict(program.stages), list(program.instructions)
    for s, bucket_ids in reduced_by.items():
        stages[s] = _with_reductions(stages[s], program, bucket_ids, start, finish, destination, every_microbatch)
        for i in b_instructions[s] if every_microbatch else b_instructions[s][-1:]:
            instructions[i] = replace(instructions[i], graph="backward_last")
    covered = {p.name for p, o in zip(layout.params, layout.offsets)
               if any(layout.buckets[i].start <= o < layout.buckets[i].end for i in buckets)}
    accumulates = not every_microbatch or any(p.name not in covered for p in layout.params)
    return replace(program, stages=stages, instructions=tuple(instructions), grad_accumulator=accumulates)


def _with_reductions(stage: LoweredStage, program: RankProgram, bucket_ids: list[int], start: StartReduction,
                     finish: Finish, destination, every_microbatch: bool) -> LoweredStage:
    layout = program.layout
    gm = copy.deepcopy(stage.backward)
    graph = gm.graph
    output = graph.output_node()
    outputs = list(output.args[0])
    grad_of = {p.name: g for p, g in zip(stage.params, outputs[:len(stage.params)]) if g is not None}
    order = {node: i for i, node in enumerate(graph.nodes)}
    anchor = list(graph.find_nodes(op="placeholder"))[-1]
    val = anchor.meta["val"]

    def zeros(n: int) -> fx.Node:
        return graph.call_function(aten.zeros.default, ([n],), {"dtype": torch.float32, "device": val.device})

    inputs, finals, reduced = [], [], set()
    for i in bucket_ids:
        b = layout.buckets[i]
        if every_microbatch:
            acc = None
        else:
            with graph.inserting_after(anchor):
                acc = anchor = graph.placeholder(f"bucket{i}_accumulated")
            with val.fake_mode:
                acc.meta["val"] = torch.empty(b.numel, dtype=torch.float32, device=val.device)
            inputs.append(("grads", b.start, b.end))
        members = [(p, shape, o) for p, shape, o in zip(layout.params, layout.shapes, layout.offsets)
                   if b.start <= o < b.end]
        grads = [grad_of[p.name] for p, _, _ in members if p.name in grad_of]
        last = max(grads, key=order.__getitem__, default=None)
        with graph.inserting_before(last.next if last is not None else output):  # keeps creation order

            def held(begin: int, end: int) -> fx.Node:  # what the accumulator holds of [begin, end)
                return zeros(end - begin) if acc is None else slice_of(graph, acc, begin - b.start, end - b.start)

            pieces, cursor = [], b.start
            for p, shape, o in members:
                if o > cursor:
                    pieces.append(held(cursor, o))
                piece = held(o, o + math.prod(shape))
                if p.name in grad_of:
                    flat = graph.call_function(aten.reshape.default, (grad_of[p.name], [-1]))
                    flat = graph.call_function(aten._to_copy.default, (flat,), {"dtype": torch.float32})
                    piece = flat if acc is None else graph.call_function(aten.add.Tensor, (piece, flat))
                    reduced.add(p.name)
                pieces.append(piece)
                cursor = o + math.prod(shape)
            if cursor < b.end:
                pieces.append(held(cursor, b.end))
            total = graph.call_function(aten.cat.default, (pieces,))
            started = start(graph, total, i)
        with graph.inserting_before(output):
            finals.append(finish(graph, wait(graph, started), i))
    if every_microbatch:  # the reduced shard holds them: nothing of them goes to the accumulator
        outputs = [None if k < len(stage.params) and stage.params[k].name in reduced else g
                   for k, g in enumerate(outputs)]
    output.args = (tuple(outputs) + tuple(finals),)
    for node in graph.nodes:
        if node.op == "call_function" and "val" not in node.meta:
            node.meta["pass"] = NAME
    propagate_shapes(gm)
    return replace(stage, backward_last=gm, last_inputs=tuple(inputs), last_outputs_add=every_microbatch,
                   last_outputs=tuple(destination(i, layout.buckets[i]) for i in bucket_ids))


def wait(graph: fx.Graph, started: fx.Node) -> fx.Node:
    """The result of a started collective, waited for; a value that needed none (one rank) as it is."""
    return graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (started,)) if is_collective(started.target) else started


def slice_of(graph: fx.Graph, x: fx.Node, start: int, end: int) -> fx.Node:
    return graph.call_function(aten.slice.Tensor, (x, 0, start, end))
