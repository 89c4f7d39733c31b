"""Turn a rank's graphs into callables: Inductor-compiled, or the FX graphs as they are.

Identical graphs (the same code over the same input shapes) are compiled once
per process; across processes Inductor's on-disk cache makes a graph that any
rank or earlier run compiled a cache hit. Group names in the graphs are role
aliases ("tp", "dp", ...), so all ranks of a stage share the same graph text.
"""

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from gcompile.comm_summary import graph_runs
from gcompile.instructions import OPTIMIZER
from gcompile.log import rank_ranges
from gcompile.program import dump_text
from gcompile.rank_program import RankProgram
from gcompile.runtime import StageFunctions
from gcompile.torch_api import inductor_cache_counts, standalone_compile


@dataclass
class CompileStats:
    graphs: int = 0
    """Graphs this rank runs."""
    distinct: int = 0
    """Distinct graphs among them (each compiled at most once)."""
    seconds: float = 0.0
    cache_hits: int = 0
    """Inductor FX-graph cache hits (compiled by an earlier process or run)."""
    cache_misses: int = 0


@dataclass
class Compiler:
    enabled: bool
    log: Callable[[str], None] = lambda _: None
    """Gets a line per graph Inductor compiles (its time and whether Inductor's cache had it)."""
    compiled: dict[str, Callable] = field(default_factory=dict)
    stats: CompileStats = field(default_factory=CompileStats)

    def compile_graphs(self, graphs: dict[str, fx.GraphModule]) -> dict[str, Callable]:
        """A callable per named graph; with Inductor each distinct graph is compiled once, with a progress line
        (`compiled 2/6 stage0.backward in 7.9 s (inductor cache miss)`), so a cold compile is never silent."""
        self.stats.graphs += len(graphs)
        if not self.enabled:
            return dict(graphs)
        keys = {name: graph_key(gm) for name, gm in graphs.items()}
        todo = {}
        for name, key in keys.items():
            if key not in self.compiled:
                todo.setdefault(key, name)  # a graph shared by several names is compiled under its first
        for i, (key, name) in enumerate(todo.items(), 1):
            gm = graphs[name]
            hits, misses = inductor_cache_counts()
            start = time.perf_counter()
            example = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
            self.compiled[key] = standalone_compile(gm, example)
            seconds = time.perf_counter() - start
            hits_after, misses_after = inductor_cache_counts()
            self.stats.seconds += seconds
            self.stats.cache_hits += hits_after - hits
            self.stats.cache_misses += misses_after - misses
            self.stats.distinct += 1
            self.log(f"compiled {i}/{len(todo)} {name} in {seconds:.1f} s "
                     f"(inductor cache {'hit' if hits_after > hits else 'miss'})")
        return {name: self.compiled[key] for name, key in keys.items()}


def graph_key(gm: fx.GraphModule) -> str:
    """Same key <=> same code over the same input shapes, dtypes and strides."""
    inputs = [(tuple(v.shape), v.dtype, v.stride()) for v in
              (n.meta["val"] for n in gm.graph.find_nodes(op="placeholder"))]
    return hashlib.sha256((gm.code + repr(inputs)).encode()).hexdigest()


def format_rank_stats(stats: dict[int, CompileStats]) -> list[str]:
    """A line per group of ranks whose compiles went alike (times aside): 16 identical ranks make one line."""
    groups = {}
    for rank, s in stats.items():
        groups.setdefault((s.graphs, s.distinct, s.cache_hits, s.cache_misses), []).append(rank)
    lines = []
    for (graphs, distinct, hits, misses), ranks in groups.items():
        seconds = sorted(stats[r].seconds for r in ranks)
        took = f"{seconds[0]:.1f} s" if len(ranks) == 1 else f"{seconds[0]:.1f} to {seconds[-1]:.1f} s"
        lines.append(f"compile, {rank_ranges(ranks)}: {graphs} graphs, "
                     f"{distinct} distinct, in {took} (inductor cache: {hits} hits, {misses} misses"
                     f"{'' if len(ranks) == 1 else ' each'})")
    return lines


def named_graphs(program: RankProgram) -> dict[str, fx.GraphModule]:
    """Every graph a rank holds, by the name the dumps use: `stage{s}.{forward,backward,...}` and `optimizer`."""
    graphs = {f"stage{s}.{name}": gm for s, stage in program.stages.items() for name, gm in stage.graphs().items()}
    return {**graphs, OPTIMIZER: program.optimizer.graph}


def compile_rank_program(program: RankProgram, compiler: Compiler) -> tuple[dict[int, StageFunctions], Callable]:
    compiled = compiler.compile_graphs(named_graphs(program))
    functions = {s: StageFunctions(**{name: compiled[f"stage{s}.{name}"] for name in stage.graphs()})
                 for s, stage in program.stages.items()}
    return functions, compiled[OPTIMIZER]


def generated_code(compiled: Callable | None) -> str | None:
    """The Python Inductor generated for a compiled graph. None for an FX graph, and where this torch
    keeps it elsewhere: it sits on a private attribute of standalone_compile's artifact."""
    return getattr(getattr(compiled, "_compiled_fn", None), "source_code", None)


def dump_generated_code(program: RankProgram, compiler: Compiler, dump_dir: str) -> None:
    """--dump-graphs with --compile: each graph's generated code, as inductor_{graph}.py."""
    for name, gm, _ in graph_runs(program):
        code = generated_code(compiler.compiled.get(graph_key(gm)))
        if code is not None:
            dump_text(dump_dir, f"inductor_{name}.py", code)
