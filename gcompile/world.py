"""Every rank's program, built in one process; and Inductor run once per distinct graph.

Ranks share the captured program, identical lowerings and identical optimizer
graphs (gcompile.pipeline.BuildCache), so a world of hundreds of ranks builds in
seconds. That is what `--dump-only` and `--check-plan` inspect, and what the
launcher checks before it starts any rank.

`precompile` compiles each distinct graph of a world once, in this process,
under a process group that runs nothing (Inductor only asks group sizes); the
ranks started afterwards find every graph in Inductor's on-disk cache instead
of all compiling the same graphs at once.
"""

import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from gcompile.check import MeasuredMemory, check_plan, estimate_memory
from gcompile.compile import Compiler, CompileStats, graph_key, named_graphs
from gcompile.config import RunConfig
from gcompile.axes import Coords
from gcompile.log import rank_ranges
from gcompile.mesh import init_fake_world
from gcompile.pipeline import BuildCache, build_rank_program
from gcompile.rank_program import RankProgram
from gcompile.state import TrainState


def build_world(config: RunConfig, device: str = "cpu", dump_root: str | None = None,
                log: Callable[[str], None] = print, cache: BuildCache | None = None,
                stop_after: str | None = None) -> dict[int, RankProgram]:
    p, cache = config.parallel, cache or BuildCache()
    programs = {}
    for rank in range(config.world_size):
        coords = Coords.from_rank(rank, config.mesh_sizes)
        programs[rank] = build_rank_program(config, coords, device, dump_root,
                                            log if rank == 0 else (lambda _: None), cache, stop_after)
    return programs


def rank_graphs(program: RankProgram) -> list:
    return list(named_graphs(program).values())


def precompile(programs: dict[int, RankProgram], threads: int, log: Callable[[str], None] = print) -> CompileStats:
    """Compile every distinct graph of the world once, with the ranks' thread count (part of the cache key);
    a progress line per graph names the ranks that run it."""
    sharing = {}  # graph key -> (name, graph, ranks running it)
    for rank, program in programs.items():
        for name, gm in named_graphs(program).items():
            sharing.setdefault(graph_key(gm), (name, gm, []))[2].append(rank)
    graphs = {f"{name} ({rank_ranges(ranks)})": gm for name, gm, ranks in sharing.values()}
    log(f"compiling {len(graphs)} distinct graphs for {len(programs)} ranks with Inductor; the ranks then load "
        f"them from its cache")
    compiler = Compiler(enabled=True, log=log)
    saved_threads, saved_env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    init_fake_world(next(iter(programs.values())).coords)
    start = time.perf_counter()
    try:
        compiler.compile_graphs(graphs)
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(saved_threads)
        if saved_env is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved_env
    compiler.stats.seconds = time.perf_counter() - start
    return compiler.stats


def prepare_launch(config: RunConfig, device: str, threads: int, log: Callable[[str], None] = print) -> None:
    """Before starting a multi-rank world: build every rank's program, prove the plan, and with
    --compile fill Inductor's cache with each distinct graph once. Raises PlanError on a fault."""
    log(f"building the programs of {config.world_size} ranks (capture, passes, lowering) to check the plan")
    start, cache = time.perf_counter(), BuildCache()
    programs = build_world(config, device, log=lambda _: None, cache=cache)
    report = check_plan(programs, config.parallel.memory_budget_gb)
    steps = ", ".join(f"{step} {seconds:.1f} s" for step, seconds in cache.seconds.items())
    largest = max(programs, key=lambda r: estimate_memory(programs[r]).total)
    log(f"{report.splitlines()[0]} (built in {time.perf_counter() - start:.1f} s: {steps}); "
        f"largest estimate: rank {largest}: {estimate_memory(programs[largest])}; "
        f"{MeasuredMemory.of(TrainState.allocate(programs[largest], 'meta'))}")
    if config.train.compile:
        stats = precompile(programs, threads, log)
        log(f"precompiled {stats.distinct} distinct graphs for {len(programs)} ranks in {stats.seconds:.1f} s "
            f"(inductor cache: {stats.cache_hits} hits, {stats.cache_misses} misses)")
    log(f"starting {config.world_size} ranks: each imports torch and builds its program"
        f"{', then loads its graphs from the cache' if config.train.compile else ''}; rank 0 reports for all")
