"""Every rank's program, built in one process; and Inductor run once per distinct graph.

Ranks share the captured program, identical lowerings and identical optimizer
graphs (gcompile.pipeline.BuildCache), so a world of hundreds of ranks builds in
seconds. Ranks that differ only in their dp position run the same program (their
coordinates say which data, optimizer shard and experts are theirs), so
`build_distinct` builds one per class: 128 programs stand for 8192 ranks over
dp 64. That is what `--dump-only` and `--check-plan` inspect, and what the
launcher checks before it starts any rank.

`precompile` compiles each distinct graph of a world once, in this process,
under a process group that runs nothing (Inductor only asks group sizes); the
ranks started afterwards find every graph in Inductor's on-disk cache instead
of all compiling the same graphs at once.
"""

import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from gcompile import checked_plan
from gcompile.check import MeasuredMemory, check_plan, estimate_memory
from gcompile.compile import Compiler, CompileStats, graph_key, named_graphs
from gcompile.config import RunConfig
from gcompile.log import counted
from gcompile.axes import Coords
from gcompile.log import rank_ranges
from gcompile.mesh import init_fake_world
from gcompile.pass_manager import clear_stale_dumps, write_dump_index
from gcompile.pipeline import BuildCache, build_rank_program
from gcompile.rank_program import RankProgram
from gcompile.state import TrainState


def build_world(config: RunConfig, device: str = "cpu", dump_root: str | None = None,
                log: Callable[[str], None] = print, cache: BuildCache | None = None,
                stop_after: str | None = None) -> dict[int, RankProgram]:
    return _build(config, range(config.world_size), device, dump_root, log, cache, stop_after)


def representatives(config: RunConfig) -> dict[int, tuple[int, ...]]:
    """The ranks that run one program, by the rank that stands for them: ranks that differ only in their dp
    position (their data, optimizer shard and experts come from their coordinates, not from their graphs;
    tests/test_plan.py checks it), each class by its rank at dp 0. A user pass may read the dp position,
    so with user passes every rank stands for itself."""
    classes = defaultdict(list)
    for rank in range(config.world_size):
        coords = Coords.from_rank(rank, config.mesh_sizes)
        classes[rank if config.parallel.passes else coords.moved(dp=0).rank].append(rank)
    return {rank: tuple(ranks) for rank, ranks in classes.items()}


def build_distinct(config: RunConfig, device: str = "cpu", dump_root: str | None = None,
                   log: Callable[[str], None] = print, cache: BuildCache | None = None
                   ) -> tuple[dict[int, RankProgram], dict[int, tuple[int, ...]]]:
    """(programs, shared_by): one program per class of `representatives` (128 for 8192 ranks over dp 64),
    and the ranks each stands for. With `dump_root`: a rank folder per program and index.txt naming its ranks."""
    shared_by = representatives(config)
    if dump_root:
        clear_stale_dumps(dump_root, shared_by)
    programs = _build(config, shared_by, device, dump_root, log, cache)
    if dump_root:
        write_dump_index(dump_root, shared_by)
    return programs, shared_by


def _build(config: RunConfig, ranks: Iterable[int], device: str, dump_root: str | None, log: Callable[[str], None],
           cache: BuildCache | None, stop_after: str | None = None) -> dict[int, RankProgram]:
    """Programs of `ranks`, built with one cache; only the first rank logs."""
    cache, programs = cache or BuildCache(), {}
    for rank in ranks:
        programs[rank] = build_rank_program(config, Coords.from_rank(rank, config.mesh_sizes), device, dump_root,
                                            (lambda _: None) if programs else log, cache, stop_after)
    return programs


def rank_graphs(program: RankProgram) -> list:
    return list(named_graphs(program).values())


def precompile(programs: dict[int, RankProgram], threads: int, log: Callable[[str], None] = print,
               shared_by: dict[int, tuple[int, ...]] | None = None) -> CompileStats:
    """Compile every distinct graph of the world once, with the ranks' thread count (part of the cache key);
    a progress line per graph names the ranks that run it (`shared_by`: the ranks each program stands for)."""
    shared_by = shared_by or {rank: (rank,) for rank in programs}
    sharing = {}  # graph key -> (name, graph, ranks running it)
    for rank, program in programs.items():
        for name, gm in named_graphs(program).items():
            sharing.setdefault(graph_key(gm), (name, gm, []))[2].extend(shared_by[rank])
    graphs = {f"{name} ({rank_ranges(ranks)})": gm for name, gm, ranks in sharing.values()}
    ranks = sum(len(shared_by[rank]) for rank in programs)
    log(f"compiling {len(graphs)} distinct graphs for {ranks} ranks with Inductor; the ranks then load "
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
    """Before starting a multi-rank world: build one program per class of ranks that run the same program
    (build_distinct), prove the plan, and with --compile fill Inductor's cache with each distinct graph once.
    Raises PlanError on a fault."""
    start, cache = time.perf_counter(), BuildCache()
    shared_by = representatives(config)
    distinct = "programs" if len(shared_by) == config.world_size else counted(len(shared_by), "distinct program")
    log(f"building the {distinct} of {config.world_size} ranks (capture, passes, lowering) to check the plan")
    programs, shared_by = build_distinct(config, device, log=lambda _: None, cache=cache)
    report = check_plan(programs, config.parallel.memory_budget_gb, shared_by)
    checked_plan.write(config, programs, shared_by)
    steps = ", ".join(f"{step} {seconds:.1f} s" for step, seconds in cache.seconds.items())
    largest = max(programs, key=lambda r: estimate_memory(programs[r]).total)
    log(f"{report.splitlines()[0]} (built in {time.perf_counter() - start:.1f} s: {steps}); "
        f"largest estimate: rank {largest}: {estimate_memory(programs[largest])}; "
        f"{MeasuredMemory.of(TrainState.allocate(programs[largest], 'meta'))}")
    if config.train.compile:
        stats = precompile(programs, threads, log, shared_by)
        log(f"precompiled {stats.distinct} distinct graphs for {config.world_size} ranks in {stats.seconds:.1f} s "
            f"(inductor cache: {stats.cache_hits} hits, {stats.cache_misses} misses)")
    log(f"starting {config.world_size} ranks: each builds its program"
        f"{', then loads its graphs from the cache' if config.train.compile else ''}; rank 0 reports for all")
