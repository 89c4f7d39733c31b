"""What a rank communicates per iteration: every functional collective in its lowered graphs, counted;
and what it computes (FLOPs per graph).

A graph runs once per instruction that calls it (a stage's forward and backward
once per microbatch, the optimizer step once), so the per-iteration numbers are
calls per run times runs. A call's bytes are those of the larger of its input and
its output: the whole tensor an all-gather builds or a reduce-scatter consumes.
"""

import math
from collections import Counter
from dataclasses import dataclass

import torch
import torch.fx as fx

from gcompile.collectives import collective_nodes
from gcompile.flops import graph_flops
from gcompile.rank_program import RankProgram


@dataclass(frozen=True)
class Collective:
    kind: str
    """all_reduce, all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single, ..."""
    group: str
    nbytes: int


def collectives_in(gm: fx.GraphModule) -> list[Collective]:
    """Every functional collective call of a graph (their wait_tensor not counted), in order."""
    return [Collective(op, args.get("group_name", "?"), collective_bytes(node)) for node, op, args in collective_nodes(gm)]


def collective_bytes(node: fx.Node) -> int:
    """What a collective call moves: the larger of its input and its output tensor."""
    tensors = [node.meta["val"], *(a.meta["val"] for a in node.all_input_nodes)]
    return max(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def graph_runs(program: RankProgram) -> list[tuple[str, fx.GraphModule, int]]:
    """(name, graph, runs per iteration) of every graph the rank runs, counted from its instructions."""
    runs, first = Counter(), {}
    for instruction in program.instructions:
        if instruction.is_compute:
            key = (instruction.stage, instruction.graph)
            runs[key] += 1
            first.setdefault(key, instruction)
    return [(graph if stage is None else f"stage{stage}.{graph}", program.graph(first[(stage, graph)]), n)
            for (stage, graph), n in runs.items()]


def format_summary(program: RankProgram) -> str:
    c = program.coords
    lines = [f"# rank {c.rank} {c}: collectives per training iteration "
             f"({program.schedule.num_microbatches} microbatches)",
             f"{'graph':<22} {'runs':>4}  {'kind':<24} {'group':<6} {'calls/run':>9} {'bytes/run':>12}"]
    calls, volume = Counter(), Counter()
    for name, gm, runs in graph_runs(program):
        per_run, per_run_bytes = Counter(), Counter()
        for call in collectives_in(gm):
            per_run[(call.kind, call.group)] += 1
            per_run_bytes[(call.kind, call.group)] += call.nbytes
        for (kind, group), n in sorted(per_run.items()):
            lines.append(f"{name:<22} {runs:>4}  {kind:<24} {group:<6} {n:>9} {per_run_bytes[(kind, group)]:>12,}")
            calls[(kind, group)] += n * runs
            volume[(kind, group)] += per_run_bytes[(kind, group)] * runs
    lines.append("# per iteration")
    for (kind, group), n in sorted(calls.items()):
        lines.append(f"{kind:<24} {group:<6} {n:>6} calls {volume[(kind, group)]:>14,} bytes")
    if not calls:
        lines.append("(no collectives)")
    lines.append("# FLOPs per training iteration (matmuls and attention, torch.utils.flop_counter's formulas)")
    lines.append(f"{'graph':<22} {'runs':>4}  {'FLOPs/run':>18} {'FLOPs/iteration':>18}")
    total = 0
    for name, gm, runs in graph_runs(program):
        flops = graph_flops(gm)
        total += flops * runs
        lines.append(f"{name:<22} {runs:>4}  {flops:>18,} {flops * runs:>18,}")
    lines.append(f"{'total':<22} {'':>4}  {'':>18} {total:>18,}")
    layout = program.layout
    sharded = [p.name for p in layout.params if p.shards]
    local = sum(math.prod(s) for s in layout.shapes)
    full = sum(math.prod(p.full_shape) for p in layout.params)
    lines.append(f"# parameters: {local:,} elements here of {full:,} full; {len(sharded)} of "
                 f"{len(layout.params)} sharded (their cuts: 00_capture.txt and later dumps)")
    return "\n".join(lines) + "\n"
