"""Pick a layout: every valid one for a world size, built, predicted, ranked.

    python -m gcompile.plan --config configs/gpt2-small.toml --world-size 8
    python -m gcompile.plan --config configs/tiny.toml --world-size 4 --memory-budget-gb 0.05 --top 5
    python run_gpt.py --config configs/tiny.toml --auto-layout --world-size 4   # train with the first

Candidates: tp x cp x pp x dp = world (tp and cp powers of two up to 8), ep over
the dp x cp ranks where the model has experts; with a pipeline the 1f1b, zb1f1b and
interleaved (every number of stages per rank, vpp, that splits the layers evenly) schedules;
every micro-batch size of 1, 2, 4 or 8
that divides the per-rank batch; the dp sharding strategies no_shard and optim
(ZeRO-1); sequence parallel (where tp > 1), ZeRO-2 (optim_grads), ZeRO-3
(optim_grads_params) and full recompute only where the cheaper ones do not fit (each
alone, then in pairs, then in threes; every one of a tier that fits is ranked): none is
faster here, all save memory.
Where cp > 1, the config's cp_comm_type, or each of --cp-comm-types.

Each candidate is checked as a run would be (gcompile.config.validate: its one
line is the refusal; a pass that cannot rewrite it, GraphMismatch, refuses it too),
then built: one program per pipeline rank (ranks that
differ only in tp, cp or dp position cost the same). Candidates share what they
can (gcompile.pipeline.BuildCache: captures, the forward passes' results,
lowerings). A stage is lowered block by block, each distinct block once, and stitched
(gcompile.lower_pieces); a piece on the line of two lowered ones (the same piece at other
micro-batch sizes) is derived from them, not lowered (gcompile.lowering_line).
Families of candidates (same tp, cp and ep) are built in --workers processes.
Its memory is gcompile.check.estimate_memory's largest rank, over the budget is a
refusal; its time is gcompile.cost_model.predict with this machine's file (or
--machine FILE). The ranking is by predicted time per iteration. Predictions are kept
between runs (gcompile.plan_cache): a layout predicted before, on the same machine file
by the same code, is not built again (--fresh builds every one).
"""

import contextlib
import dataclasses
import functools
import gc
import itertools
import math
import multiprocessing
import os
import signal
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import NamedTuple

from gcompile import shutdown

if __name__ == "__main__":  # before the imports below load torch (seconds): a Ctrl-C then is one line too
    shutdown.install(shutdown.stopper(exit_signal_handler=False), "python -m gcompile.plan")

from gcompile.arguments import ArgumentParser, flag_names
from gcompile.axes import Coords
from gcompile.check import estimate_memory
from gcompile.config import CP_COMM_TYPES, PLANNED_FROM, ConfigError, RunConfig, parse_args, validate
from gcompile.config import parser as run_parser
from gcompile.models.moe_config import MoEConfig
from gcompile.cost_model import Prediction, StepTime, launched, predict, rates_of
from gcompile.machine import Machine, MachineError
from gcompile import machine as machine_file
from gcompile.log import counted
from gcompile.lowering_line import Lines
from gcompile.pass_manager import PassError
from gcompile.pipeline import BuildCache, build_rank_program
from gcompile import plan_cache
from gcompile.plan_cache import Known, PlanCache, layout_key
from gcompile.torch_api import import_lowering
from passes.rewrite import GraphMismatch

TRAIN_FIELDS = ("micro_batch_size", "recompute_activations")
"""Layout keys that live in the [train] section; the others are [parallel] fields."""
SCHEDULES = ("1f1b", "zb1f1b", "interleaved")
MICRO_BATCH_SIZES = (1, 2, 4, 8)
SHARDING = ("no_shard", "optim")
SAVERS = ({"sequence_parallel": True}, {"data_parallel_sharding_strategy": "optim_grads"},
          {"data_parallel_sharding_strategy": "optim_grads_params"}, {"recompute_activations": True})
SAVING = tuple(filter(None, (tuple({k: v for saver in chosen for k, v in saver.items()}
                                   for chosen in itertools.combinations(SAVERS, n)
                                   if len({k for saver in chosen for k in saver}) == n)  # one sharding strategy
                             for n in range(1, len(SAVERS) + 1))))
"""Memory savers for a candidate over the budget, in tiers: each alone, then in pairs, then in threes. Every
saver of a tier is tried and each that fits is ranked; the next tier only where none did. Sequence parallel
shards the activations tp does not (norms, residuals, dropout masks) for collectives of the same volume, which
is why Megatron pairs it with every tp > 1; ZeRO-2 shards the gradients, ZeRO-3 the weights too."""
PLANNED = PLANNED_FROM["parallel"]
"""[parallel] fields every candidate sets, where its layout does not name them (a layout names cp, ep and vpp
only above 1; how dp shards it names by the sharding strategy, interleaving by vpp)."""
MAX_WORLD = 2 ** 40
"""Ranks a plan may be for: its divisors are found in a blink (up to the square root), where 10^23 ranks ran on."""
LAYOUTS_PER_WORKER = 10
"""A worker process starts only for this many layouts: each captures the model and lowers its first graphs
again, seconds that a small search does not win back (tiny on 2 ranks here, 30 layouts: one process 11.1 s, two
forked workers 9.8 s; when workers were spawned, and imported torch first too, 8 layouts took 10.2 s in one
process and 12.0 s in two)."""


@dataclass(frozen=True)
class Candidate:
    layout: dict
    """Config fields that make this layout, as run_gpt.py flags name them (`flags()`)."""
    config: RunConfig
    prediction: StepTime
    memory: int
    """Estimated peak bytes of the largest rank."""

    def flags(self) -> list[str]:
        return layout_flags(self.layout)

    def run_fields(self) -> dict:
        """The layout and every other field the planner set (its cp, ep and vpp of 1 too)."""
        return {**self.layout, **{k: v for k, v in PLANNED.items() if k not in self.layout}}

    def run_flags(self) -> list[str]:
        """`run_fields()` as flags, so that a run given them after its own flags (or a preset's keys) is this
        layout, whatever those said."""
        return layout_flags(self.run_fields())


class Refusal(NamedTuple):
    """A layout left out: why, in one line, and the reasons it counts under."""

    layout: dict
    why: str
    reasons: tuple[str, ...]
    over_budget: bool = False
    """Left out only for its memory: with a memory saver it may fit."""


@dataclass
class Search:
    ranked: list[Candidate] = field(default_factory=list)
    refused: list[tuple[dict, str]] = field(default_factory=list)
    """(layout, why) of every candidate left out."""
    reasons: Counter = field(default_factory=Counter)
    """How many candidates each reason refused (a candidate refused for several counts under each)."""
    seconds: float = 0.0
    layouts: int = 0
    """How many `layouts` gave; the tries are more where one over the budget was tried again with savers."""
    reused: int = 0
    """How many predictions came from earlier runs (gcompile.plan_cache), nothing built for them."""
    budget_gb: float | None = None
    """The memory budget searched under: without one no layout is refused for its memory, so none is said to fit."""


def layout_flags(layout: dict) -> list[str]:
    flags = []
    for key, value in layout.items():
        flags += [f"--{key.replace('_', '-')}", str(value).lower() if isinstance(value, bool) or value is None
                  else str(value)]
    return flags


def describe(layout: dict) -> str:
    return " ".join(layout_flags(layout))


def _powers_of_two(limit: int, divides: int) -> list[int]:
    return [n for n in (1, 2, 4, 8) if n <= limit and divides % n == 0]


def _divisors(n: int) -> list[int]:
    """Every divisor of `n`, ascending, found up to its square root (a world of 10^9 ranks in a blink)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _chunks(layers: int, pp: int, listed: tuple[int, ...] = ()) -> list[int]:
    """Interleaved's stages per rank (vpp) that cut `layers` into pp x vpp stages of whole layers, more than one;
    with the user's split (`listed`, pipeline_layers), the one it gives. Where none can, 2 (validation says
    why)."""
    if listed:
        return [len(listed) // pp] if len(listed) % pp == 0 and len(listed) // pp > 1 else [2]
    per_rank = layers // pp if layers % pp == 0 else 2
    return [vpp for vpp in range(2, per_rank + 1) if per_rank % vpp == 0] or [2]


def layouts(base: RunConfig, world: int, schedules=SCHEDULES, micro_batch_sizes=MICRO_BATCH_SIZES,
            cp_comm_types: tuple[str, ...] = ()) -> list[dict]:
    """Every candidate shape of `world` ranks, before validation, memory savers left out; with cp > 1 one for each
    of `cp_comm_types` (none given: the base config's, not named in the layout)."""
    m, t = base.model, base.train
    experts = m.num_experts if isinstance(m, MoEConfig) else 0
    found = []
    for tp in _powers_of_two(8, world):
        for cp in _powers_of_two(8, world // tp):
            rest = world // (tp * cp)
            for pp in _divisors(rest):
                dp = rest // pp
                chunks = _chunks(m.n_layer, pp, base.parallel.pipeline_layers)
                pipelines = [("1f1b", 1)] if pp == 1 else \
                    [(name, vpp) for name in schedules for vpp in (chunks if name == "interleaved" else (1,))]
                eps = [e for e in range(1, dp * cp + 1) if (dp * cp) % e == 0 and e <= experts] if experts else [1]
                for ep in eps:
                    for schedule, vpp in pipelines:
                        for mbs in micro_batch_sizes:
                            if t.global_batch_size % (mbs * dp):
                                continue
                            for sharding in SHARDING if dp * cp > 1 else ("no_shard",):
                                for comm in cp_comm_types if cp > 1 and cp_comm_types else (None,):
                                    layout = dict(tp=tp, cp=cp, cp_comm_type=comm, pp=pp, dp=dp, ep=ep,
                                                  pipeline_schedule=schedule, virtual_pipeline_size=vpp,
                                                  micro_batch_size=mbs, data_parallel_sharding_strategy=sharding)
                                    found.append({k: v for k, v in layout.items() if v is not None and
                                                  not (k in ("cp", "ep", "virtual_pipeline_size") and v == 1)})
    return found


def configure(base: RunConfig, layout: dict) -> RunConfig:
    """`base` with the layout's fields; ConfigError (every reason, one line) when it cannot run."""
    train = {k: v for k, v in layout.items() if k in TRAIN_FIELDS}
    parallel = {**PLANNED, **{k: v for k, v in layout.items() if k not in TRAIN_FIELDS}}
    config = dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, **parallel),
                                 train=dataclasses.replace(base.train, **train))
    validate(config)
    return config


def evaluate(config: RunConfig, machine: Machine, cache) -> tuple[Prediction, int]:
    """(predicted iteration, largest rank's estimated peak bytes) from one program per pipeline rank."""
    origin = Coords.from_rank(0, config.mesh_sizes)
    column = [build_rank_program(config, origin.moved(pp=r), log=lambda _: None, cache=cache)
              for r in range(config.parallel.pp)]
    return predict(column, rates_of(config, machine)), max(estimate_memory(program).total for program in column)


@contextlib.contextmanager
def fewer_collections():
    """Python's cycle collector walks every object the planner holds (the builds a family's layouts share) at
    each full collection: at the default thresholds a fifth of tiny's planning time at 1024 ranks, with the
    same peak memory either way. The objects made so far (torch's modules) are set aside (gc.freeze), and a
    collection waits for COLLECT_AFTER new objects, not 700. Forked workers inherit both."""
    thresholds = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(COLLECT_AFTER, *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


COLLECT_AFTER = 10_000
"""New objects between the planner's cycle collections (`fewer_collections`)."""


@fewer_collections()
def search(base: RunConfig, world: int, machine: Machine, budget_gb: float | None = None, cache=None,
           progress=lambda line: None, schedules=SCHEDULES, micro_batch_sizes=MICRO_BATCH_SIZES,
           workers: int = 1, kept: PlanCache | None = None, cp_comm_types: tuple[str, ...] = ()) -> Search:
    """Every layout of `layouts`, refused with its reason or predicted; `ranked` fastest first. `workers` > 1
    builds in up to that many processes (one per LAYOUTS_PER_WORKER layouts), each a family of layouts at a
    time (`_family`: what shares lowerings). `kept`: earlier runs' predictions, used where they are for this
    machine file and code; what this one predicts goes to `kept.added` (`kept_predictions` saves it)."""
    result, start = Search(budget_gb=budget_gb), time.perf_counter()
    shapes = layouts(base, world, schedules, micro_batch_sizes, cp_comm_types)
    result.layouts = len(shapes)
    families = {}
    for layout in shapes:
        families.setdefault(_family(layout), []).append(layout)
    known, machine_text = (kept.known if kept else {}), machine.to_json()
    outcomes, done = {}, 0
    if shapes:
        progress(f"planning: 0/{len(shapes)} layouts (0 s)")

    def finished(family: tuple, found: list, added: Known, reused: int, shown: bool = True) -> None:
        nonlocal done
        outcomes[family] = found
        result.reused += reused
        if kept:
            kept.added.update(added)
        done += len(families[family])
        if shown:  # a family earlier runs predicted in full took no time: no line of its own
            progress(f"planning: {done}/{len(shapes)} layouts ({time.perf_counter() - start:.0f} s)")
    unknown = {}
    for family, members in families.items():  # what earlier runs predicted (or validation refused) needs no build
        try:
            finished(family, *_search_family(base, machine, budget_gb, members, known=known,
                                             machine_text=machine_text, build=False), shown=False)
        except _Unknown:
            unknown[family] = members
    workers = min(workers, len(unknown), -(-sum(map(len, unknown.values())) // LAYOUTS_PER_WORKER))
    if workers > 1:
        import_lowering()  # once, here, not in each worker
        if QUIET_TRACKER not in sys.warnoptions:  # read when multiprocessing starts its tracker, below
            sys.warnoptions.append(QUIET_TRACKER)
        with ProcessPoolExecutor(workers, mp_context=_worker_context(), initializer=_tied_worker,
                                 initargs=(os.getpid(),)) as pool:
            running = {pool.submit(_search_family, base, machine, budget_gb, unknown[family], known=known,
                                   machine_text=machine_text): family
                       for family in sorted(unknown, key=lambda family: -math.prod(family))}  # the families whose
            # ranks are cut most first: their stages hold the most pieces (cp's ring above all), and one begun
            # last would run on alone (tiny at 1024 ranks on 2 workers: 1.7 s of compute sooner)
            for future in as_completed(running):
                finished(running[future], *future.result())
    else:
        cache = cache or _process_cache()
        for family, members in unknown.items():
            finished(family, *_search_family(base, machine, budget_gb, members, cache, known, machine_text))
    tried = {family: iter(found) for family, found in outcomes.items()}
    for layout in shapes:  # in the order of `layouts`, however the processes finished
        for ok, outcome in next(tried[_family(layout)]):
            if ok:
                result.ranked.append(outcome)
            else:
                result.refused.append((outcome.layout, outcome.why))
                result.reasons.update(outcome.reasons)
    result.ranked.sort(key=lambda c: c.prediction.step_seconds)
    result.seconds = time.perf_counter() - start
    return result


QUIET_TRACKER = "ignore::UserWarning:multiprocessing.resource_tracker"
"""A planner stopped by a signal exits at once (gcompile.shutdown), leaving its pool's semaphores to
multiprocessing's tracker process, which removes them, as it should, and warns of each, which says nothing
to the user; the tracker takes its warning filters from the interpreter's -W options."""


def _worker_context() -> multiprocessing.context.BaseContext:
    """Workers forked from the planner where the platform forks: it has imported torch and gcompile (seconds of
    a core that each spawned worker paid again) and computed nothing yet, so a worker inherits no thread pool
    and no half-done work."""
    return multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")


def _tied_worker(planner: int) -> None:
    """A planning worker ignores a terminal's Ctrl-C (the planner says the one line) and ends with the planner
    (gcompile.shutdown.end_with_parent). A forked one drops the planner's signal handling
    (gcompile.shutdown.install), whose watching thread it has not: a SIGTERM ends it."""
    signal.set_wakeup_fd(-1)
    gc.set_threshold(COLLECT_AFTER)  # as fewer_collections sets it, where a worker is spawned, not forked
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    shutdown.end_with_parent(planner)


def _family(layout: dict) -> tuple:
    """Layouts whose stages lower from the same pieces (gcompile.lower_pieces): they differ only in pp, the
    schedule, how dp shards and the micro-batch size (whose pieces are derived from two lowered ones,
    gcompile.lowering_line). A family is built in one process, which lowers each piece once for all of it
    (tiny at 1024 ranks with a family per pp too: 44 s on 2 workers here, against 39 s)."""
    return layout["tp"], layout.get("cp", 1), layout.get("ep", 1)


class _Unknown(Exception):
    """A layout no earlier run predicted, met where nothing may be built."""


def _search_family(base: RunConfig, machine: Machine, budget_gb: float | None, members: list[dict],
                   cache: BuildCache | None = None, known: Known | None = None, machine_text: str = "",
                   build: bool = True) -> tuple[list[list[tuple[bool, Candidate | Refusal]]], Known, int]:
    """Per member, (True, candidate) or (False, refusal) for each layout tried, in
    order: one over the budget is tried again with the memory savers (SAVING), a tier at a time, until a tier
    has one that fits (a saver this layout cannot run is refused, the others tried). Then what it predicted that
    `known` (by gcompile.plan_cache.layout_key with `machine_text`) did not hold, and how many predictions it
    took from `known`; without `build`, a layout `known` does not hold raises _Unknown."""
    known = known or {}
    everything, seen, added, reused = [], {}, {}, 0
    for layout in members:
        found, cannot = [], []  # the savers this layout cannot run: no combination with one is tried
        everything.append(found)
        for tier in (({},),) + SAVING:
            fits = False
            for saver in tier:
                if _changes_nothing(base, layout, saver) or any(refused.items() <= saver.items() for refused in cannot):
                    continue
                tried = {**layout, **saver}
                if tuple(tried.items()) not in seen:  # no_shard and optim meet again under ZeRO-2 and -3
                    outcome, from_known = _try(base, machine, budget_gb, tried, cache, known, machine_text, build,
                                               added)
                    found.append(outcome)
                    reused += from_known
                    seen[tuple(tried.items())] = outcome
                ok, outcome = seen[tuple(tried.items())]
                fits = fits or ok
                if not ok and not outcome.over_budget:
                    cannot.append(saver)
            if fits or {} in cannot:  # one fits, or the layout itself cannot run
                break
    return everything, added, reused


def _over(budget_gb: float | None) -> str:
    return f"over the budget of {budget_gb} GiB"


def _changes_nothing(base: RunConfig, layout: dict, saver: dict) -> bool:
    """Whether `saver` leaves this layout as it is: nothing to shard over (sequence parallel at tp 1, a dp
    sharding strategy over one dp x cp rank, ZeRO-3's weights over one dp rank), or the run planned for does it
    already where the layout leaves it (a config with recompute on, say)."""
    strategy = saver.get("data_parallel_sharding_strategy")
    nothing_to_shard = "sequence_parallel" in saver and layout["tp"] == 1 or \
        strategy and layout["dp"] * layout.get("cp", 1) == 1 or strategy == "optim_grads_params" and layout["dp"] == 1
    return nothing_to_shard or any(
        key not in layout and getattr(base.train if key in TRAIN_FIELDS else base.parallel, key) == value
        for key, value in saver.items())


def _try(base: RunConfig, machine: Machine, budget_gb: float | None, tried: dict, cache: BuildCache | None,
         known: Known, machine_text: str, build: bool, added: Known) -> tuple[tuple[bool, Candidate | Refusal], bool]:
    """One layout: (True, candidate) or (False, refusal), and whether its
    prediction came from `known` (what it predicts anew goes to `added`)."""
    try:
        config = configure(base, tried)
    except ConfigError as e:
        return (False, Refusal(tried, str(e), e.reasons)), False
    key = layout_key(config, machine_text, launched(config, machine))
    if key in known:
        step, memory = known[key]
    elif not build:
        raise _Unknown
    else:
        try:
            prediction, memory = evaluate(config, machine, cache or _process_cache())
        except PassError as e:
            if not isinstance(e.__cause__, GraphMismatch):
                raise  # a pass that broke, not one that cannot rewrite this layout
            return (False, Refusal(tried, str(e.__cause__), (str(e.__cause__),))), False
        step = prediction.totals()
        if key is not None:
            added[key] = step, memory
    if budget_gb is None or memory <= budget_gb * 2 ** 30:
        return (True, Candidate(tried, config, step, memory)), key in known
    over = _over(budget_gb)
    needs = f"needs about {memory / 2 ** 30:.3g} GiB on its largest rank"
    return (False, Refusal(tried, f"{over}; {needs}", (over,), over_budget=True)), key in known


@functools.cache
def _process_cache() -> BuildCache:
    """A planning process's builds, kept from one family to the next (captures are shared across them)."""
    return BuildCache(lines=Lines(), by_pieces=True)


def format_search(found: Search, world: int, top: int, refused: int) -> str:
    retries = len(found.ranked) + len(found.refused) - found.layouts
    tried = f"{counted(found.layouts, 'layout')} of {counted(world, 'rank')}" + \
        (f" and {retries} retries with memory savers" if retries else "")
    reused = f", {found.reused} predicted by earlier runs" if found.reused else ""
    rows = found.ranked[:top]
    kept = "fit" if found.budget_gb is not None else "predicted (no --memory-budget-gb: none refused for memory)"
    lines = [f"{tried}: {len(found.ranked)} {kept}, {len(found.refused)} refused ({found.seconds:.1f} s{reused})" +
             ("; fastest first:" if rows else "")]
    if rows:
        lines.append(f"{'#':>3} {'ms/iter':>9} {'GiB/rank':>9} {'bubble':>7}  layout (run_gpt.py flags)")
    for i, c in enumerate(rows):
        lines.append(f"{i + 1:>3} {c.prediction.step_seconds * 1e3:9.1f} {c.memory / 2 ** 30:9.4g} "
                     f"{c.prediction.bubble_fraction:7.1%}  {describe(c.layout)}")
    if found.refused:
        listed = found.refused[:refused]
        every = len(listed) == len(found.refused)
        shown = "each with its reason" if every else f"the first {len(listed)}, then counts by reason" if listed \
            else "counts by reason"
        lines.append(f"refused ({len(found.refused)}; {shown}):")
        lines += [f"  {describe(layout)}: {why}" for layout, why in listed]
        if not every:
            lines += _reason_counts(found)
    return "\n".join(lines)


def _reason_counts(found: Search) -> list[str]:
    """How many layouts each reason refused, the five commonest (six where that is all of them)."""
    shown = 6 if len(found.reasons) == 6 else 5
    lines = [f"  {n:4d} x {why}" for why, n in found.reasons.most_common(shown)]
    if len(found.reasons) > shown:
        rest, others = sum(n for _, n in found.reasons.most_common()[shown:]), len(found.reasons) - shown
        lines.append(f"  {rest:4d} x one of {counted(others, 'other reason')} (--refused {len(found.refused)} "
                     f"lists each)")
    if found.reasons.total() > len(found.refused):
        lines.append("  (a layout refused for several reasons counts under each)")
    return lines


def something_to_try(base: RunConfig, world: int, schedules: tuple[str, ...], micro_batch_sizes: tuple[int, ...],
                     cp_comm_types: tuple[str, ...]) -> None:
    """ConfigError when there is no layout to try at all, named before a machine file is read or measured."""
    if not layouts(base, world, schedules, micro_batch_sizes, cp_comm_types):
        raise ConfigError(no_layout(Search(), world))


def no_layout(found: Search, world: int) -> str:
    if found.refused:
        return (f"no layout of {counted(world, 'rank')} can run this config; the reasons above say what to change "
                f"(a dp size --global-batch-size cannot be split over is not tried: a multiple of it is)")
    return (f"no layout of {counted(world, 'rank')} to try: no --micro-batch-sizes entry times a dp size divides "
            f"--global-batch-size")


def search_space(schedules: str, micro_batch_sizes: str,
                 cp_comm_types: str | None = None) -> tuple[tuple[str, ...], tuple[int, ...], tuple[str, ...]]:
    """--schedules, --micro-batch-sizes and --cp-comm-types read; ConfigError naming a bad entry."""
    names = _names(schedules, SCHEDULES, "--schedules")
    comms = _names(cp_comm_types, CP_COMM_TYPES, "--cp-comm-types") if cp_comm_types is not None else ()
    try:
        sizes = tuple(dict.fromkeys(int(s) for s in micro_batch_sizes.split(",") if s.strip()))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"--micro-batch-sizes {micro_batch_sizes!r}: give positive whole numbers, e.g. 1,2,4")
    return names, sizes, comms


def _names(given: str, known: tuple[str, ...], flag: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(s.strip() for s in given.split(",") if s.strip()))  # each once
    if not names or any(n not in known for n in names):
        raise ConfigError(f"{flag} {given!r}: choose from {', '.join(known)}")
    return names


@contextlib.contextmanager
def kept_predictions(fresh: bool = False):
    """This user's plan cache (gcompile.plan_cache) for a search, its predictions set aside where `fresh`; what
    the search added is saved on the way out, an interrupted one's too (its finished families): a signal's
    stop (gcompile.shutdown) ends the process at once, so its action saves first. A file that cannot be read,
    or written, is a note on stderr: the plan stands."""
    kept = PlanCache()
    if kept.unread:
        print(f"note: {kept.unread}", file=sys.stderr)
    if fresh:
        kept.known = {}

    def save() -> None:
        kept.added = dict(kept.added)  # a copy, whatever the main thread adds meanwhile
        if note := kept.save():
            print(f"note: {note}", file=sys.stderr)

    def saved_first(signum: int) -> None:
        save()
        if stop is not None:
            stop(signum)
    stop = shutdown.set_action(saved_first)
    try:
        yield kept
    finally:
        shutdown.set_action(stop)
        save()


def cores() -> int:
    """The cores this process may run on: planning builds in as many processes."""
    return len(os.sched_getaffinity(0))


def load_machine(path: str | None, world_size: int) -> Machine:
    """The machine file to predict `world_size` ranks with; MachineError naming the fix when there is none or it
    cannot predict that many."""
    found = machine_file.load(path)
    if found is None:
        raise MachineError(machine_file.missing())
    if why := found.cannot_predict(world_size):
        raise MachineError(why)
    return found


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = ArgumentParser(prog="python -m gcompile.plan", description=__doc__.split("\n")[0],
                       epilog="Every run_gpt.py flag (--config, --global-batch-size, --seq-length, ...) sets "
                              "the run the layouts are planned for; its layout flags are replaced.")
    p.add_argument("--world-size", type=int, required=True, help="ranks to plan for")
    p.add_argument("--memory-budget-gb", type=float, help="refuse layouts whose largest rank needs more")
    p.add_argument("--machine", help="machine file (default: this machine's, from python -m gcompile.calibrate)")
    p.add_argument("--schedules", default=",".join(SCHEDULES), help="pipeline schedules to try (comma-separated)")
    p.add_argument("--micro-batch-sizes", default=",".join(map(str, MICRO_BATCH_SIZES)),
                   help="micro-batch sizes to try (comma-separated)")
    p.add_argument("--cp-comm-types", help=f"context-parallel attentions to try where cp > 1 (comma-separated, of "
                                            f"{', '.join(CP_COMM_TYPES)}; default: the config's cp_comm_type)")
    p.add_argument("--workers", type=int, default=cores(),
                   help=f"processes that build layouts at once, one per {LAYOUTS_PER_WORKER} layouts at most "
                        f"(default: this machine's cores, {cores()})")
    p.add_argument("--fresh", action="store_true",
                   help=f"build every layout again, not reusing what earlier runs predicted (kept in "
                        f"{plan_cache.default_path()}, for the same machine file and code)")
    p.add_argument("--top", type=int, default=10, help="rows to print (default: 10)")
    p.add_argument("--refused", type=int, default=5,
                   help="refused layouts to print, each with its reason (default: 5)")
    args, rest = p.parse_known_args(argv)
    p.passed_on = flag_names(run_parser())
    p.refuse_unknown(rest)
    try:
        if not 1 <= args.world_size <= MAX_WORLD:
            raise ConfigError(f"--world-size {args.world_size} must be from 1 to {MAX_WORLD:,}")
        if args.workers < 1:
            raise ConfigError(f"--workers {args.workers} must be at least 1")
        if args.memory_budget_gb is not None and not 0 < args.memory_budget_gb < math.inf:
            raise ConfigError(f"--memory-budget-gb {args.memory_budget_gb:g} must be a positive finite number")
        for flag, value in (("--top", args.top), ("--refused", args.refused)):
            if value < 0:
                raise ConfigError(f"{flag} {value} must be 0 or more")
        schedules, sizes, comms = search_space(args.schedules, args.micro_batch_sizes, args.cp_comm_types)
        base, actions = parse_args(rest, planned=True)
        if asked := [f"--{name.replace('_', '-')}" for name in ("check_plan", "dump_only", "auto_layout")
                     if getattr(actions, name)]:
            raise ConfigError(f"{' '.join(asked)}: run_gpt.py's, not the planner's; it plans only (python run_gpt.py "
                              f"--auto-layout --world-size N trains with its first layout)")
        something_to_try(base, args.world_size, schedules, sizes, comms)
        machine = load_machine(args.machine, args.world_size)
    except (ConfigError, MachineError) as e:
        print(f"python -m gcompile.plan: error: {e}", file=sys.stderr)
        return 2
    budget = args.memory_budget_gb if args.memory_budget_gb is not None else base.parallel.memory_budget_gb
    with kept_predictions(fresh=args.fresh) as kept:
        found = search(base, args.world_size, machine, budget, progress=lambda line: print(line, file=sys.stderr),
                       schedules=schedules, micro_batch_sizes=sizes, workers=args.workers, kept=kept,
                       cp_comm_types=comms)
    if found.layouts:  # else no table, only the error below
        print(format_search(found, args.world_size, args.top, args.refused))
    if found.ranked and (note := machine.extrapolated(args.world_size)):
        print(note)
    if not found.ranked:
        print(f"python -m gcompile.plan: error: {no_layout(found, args.world_size)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
