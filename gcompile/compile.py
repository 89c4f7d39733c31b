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

    def __str__(self) -> str:
        return (f"{self.graphs} graphs, {self.distinct} distinct, compiled in {self.seconds:.1f} s "
                f"(inductor cache: {self.cache_hits} hits, {self.cache_misses} misses)")


@dataclass
class Compiler:
    enabled: bool
    compiled: dict[str, Callable] = field(default_factory=dict)
    stats: CompileStats = field(default_factory=CompileStats)

    def __call__(self, gm: fx.GraphModule) -> Callable:
        self.stats.graphs += 1
        if not self.enabled:
            return gm
        key = graph_key(gm)
        if key not in self.compiled:
            hits, misses = inductor_cache_counts()
            start = time.perf_counter()
            example = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
            self.compiled[key] = standalone_compile(gm, example)
            self.stats.seconds += time.perf_counter() - start
            hits_after, misses_after = inductor_cache_counts()
            self.stats.cache_hits += hits_after - hits
            self.stats.cache_misses += misses_after - misses
            self.stats.distinct += 1
        return self.compiled[key]


def graph_key(gm: fx.GraphModule) -> str:
    """Same key <=> same code over the same input shapes, dtypes and strides."""
    inputs = [(tuple(v.shape), v.dtype, v.stride()) for v in
              (n.meta["val"] for n in gm.graph.find_nodes(op="placeholder"))]
    return hashlib.sha256((gm.code + repr(inputs)).encode()).hexdigest()


def compile_rank_program(program: RankProgram, compiler: Compiler) -> tuple[dict[int, StageFunctions], Callable]:
    def optional(gm: fx.GraphModule | None) -> Callable | None:
        return compiler(gm) if gm is not None else None

    functions = {s: StageFunctions(compiler(stage.forward), compiler(stage.backward),
                                   optional(stage.backward_last), optional(stage.backward_weight))
                 for s, stage in program.stages.items()}
    return functions, compiler(program.optimizer.graph)


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
