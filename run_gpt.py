#!/usr/bin/env python
"""Train a GPT: one single-device program, compiled by graph passes into one program per rank.

    python run_gpt.py                                   # the default small GPT on the default corpus
    python run_gpt.py --config configs/tiny.toml --train-iters 200
    python run_gpt.py --help                            # every flag, its TOML section and default

Ranks: tp * pp * dp. Started plainly, this spawns them locally (gloo on CPU,
nccl on CUDA); under torchrun it joins the given world.
"""

import contextlib
import os
import signal
import sys
import time

from gcompile import shutdown
from gcompile.config import ConfigError, RunConfig, answer_help, canonical_flag, idle_flags, parse_args

if __name__ == "__main__":
    answer_help(sys.argv[1:])  # before the imports below load torch (seconds): --help is immediate
    shutdown.install(shutdown.stopper(exit_signal_handler=False))  # SIGINT/SIGTERM: one line, 130/143; from
    # here, so that a Ctrl-C while torch loads is that line too, not a traceback of the import

import torch

from gcompile import paths
from gcompile.checkpoint import CheckpointError, check, claimed
from gcompile.data import DataError, build_datasets, check_batches, check_token_ids, unknown_tokenizers
from gcompile.check import PlanError, check_fits_machine, check_plan
from gcompile.mesh import MeshError, check_shm_room
from gcompile.log import counted, metrics_error
from gcompile.launch import join_world, rank_threads, run_ranks, start_rank_server, under_launcher, under_torchrun
from gcompile.axes import Coords
from gcompile.pass_manager import PassError, clear_stale_dumps, rank_dump_dir
from gcompile.cost_model import format_rank_time, pipeline_column, predict, rates_of
from gcompile.machine import MachineError
from gcompile.pipeline import load_passes
from gcompile.plan import MAX_WORLD, cores, format_search, kept_predictions, load_machine, no_layout, search
from gcompile.program import dump_text
from gcompile.stop import RunStopped
from gcompile.train import dump_schedule, train
from gcompile.world import build_distinct, prepare_launch

USER_ERRORS = (ConfigError, DataError, PassError, PlanError, CheckpointError, MeshError, MachineError)


def error(message: str) -> int:
    print(f"run_gpt.py: error: {message}", file=sys.stderr)
    return 2


def rank_main(config: RunConfig) -> int:
    try:
        with contextlib.ExitStack() as held:
            if under_launcher():
                if under_torchrun() and os.environ["RANK"] == "0":  # the first rank holds them, as our
                    os.makedirs(config.log.run_dir, exist_ok=True)  # launcher does for its ranks
                    hold_folders(config, held)
                p = config.parallel
                coords, device = join_world(config.mesh_sizes, p.tp_comm_backend, p.distributed_timeout_minutes)
            else:
                coords, device = Coords.from_rank(0, {}), "cuda" if torch.cuda.is_available() else "cpu"
            train(config, coords, device)
    except USER_ERRORS as e:
        return error(str(e))
    except RunStopped as e:  # every rank stops; one says why
        if e.report:
            print(f"run_gpt.py: error: {e}", file=sys.stderr)
        return 1
    if shutdown.requested.is_set():  # --exit-signal-handler: saved after the iteration SIGTERM ended
        return shutdown.stopped(signal.SIGTERM)
    return 0


def hold_folders(config: RunConfig, held: contextlib.ExitStack) -> None:
    """Hold --save and --run-dir (which must exist) until the run ends: another run that would save or log
    there is refused while this one lives."""
    if config.checkpoint.save:
        held.enter_context(claimed(config.checkpoint.save))
    if not paths.same_folder(config.log.run_dir, config.checkpoint.save):  # else held as --save
        held.enter_context(paths.claimed(config.log.run_dir, ConfigError(
            f"--run-dir {config.log.run_dir} is in use: another run logs there (its metrics, its watchdog's "
            f"records); wait for it to end, or give another --run-dir")))


def plan_only(config: RunConfig, dump_only: bool, machine_path: str | None) -> int:
    """--dump-only / --check-plan: one program per class of ranks that run the same program (they differ only
    in dp), built here, checked, never run (with --dump-schedule, the schedule written as a run writes it);
    the iteration predicted with the machine file (gcompile.cost_model), each folder's summary.txt given
    its graphs' predicted times."""
    try:
        machine, unusable = load_machine(machine_path, config.world_size), None
    except MachineError as e:  # this machine's own file missing, old or one GPU's: the plan is checked, unpredicted
        if machine_path is not None:
            raise
        machine, unusable = None, str(e)
    start = time.perf_counter()
    programs, shared_by = build_distinct(config, "cpu", dump_root=config.log.dump_graphs if dump_only else None)
    report = check_plan(programs, config.parallel.memory_budget_gb, shared_by)
    if machine is None:
        report += f"\npredicted time: none, {unusable}"
    else:
        rates = rates_of(config, machine)
        report += f"\n{predict(pipeline_column(programs), rates)} (machine: {machine.description})"
        if note := machine.extrapolated(config.world_size):
            report += f"\n{note}"
        if dump_only:
            for rank, program in programs.items():
                with open(os.path.join(rank_dump_dir(config.log.dump_graphs, rank), "summary.txt"), "a") as f:
                    f.write(format_rank_time(program, rates))
    print(report)
    if config.log.dump_schedule:
        dump_schedule(programs[0].schedule, config.log.run_dir)
    if dump_only:
        dump_text(config.log.dump_graphs, "plan.txt", report + "\n")
        built = f"{counted(len(programs), 'program')}, one a rank (a user pass may read the dp position)," \
            if config.parallel.passes and len(programs) == config.world_size > 1 else \
            counted(len(programs), 'distinct program')
        print(f"{built} for {counted(config.world_size, 'rank')} in {config.log.dump_graphs}, "
              f"index.txt names the ranks of each folder ({time.perf_counter() - start:.1f} s); "
              f"read them with: python -m gcompile.inspect {config.log.dump_graphs}")
    return 0


def make_folders(folders: dict[str, str | None], made: list[str]) -> None:
    """The folders a run writes, made before any rank starts: a path no folder can have (under /proc, a name
    longer than the file system's limit) is one line here, not a traceback from every rank. What it makes
    (parents first) goes to `made`, for `remove_empty`."""
    for flag, folder in folders.items():
        if folder:
            missing, path = [], os.path.abspath(folder)
            while not os.path.exists(path) and path != os.path.dirname(path):
                missing.append(path)
                path = os.path.dirname(path)
            try:
                os.makedirs(folder, exist_ok=True)
            except OSError as e:
                raise ConfigError(f"{flag} {folder}: cannot make the folder ({e.strerror or e}); give a folder you "
                                  f"can write") from None
            finally:
                made += [m for m in reversed(missing) if os.path.isdir(m)]


def remove_empty(folders: list[str]) -> None:
    """A refused run leaves no folder behind: each it made (`make_folders`) is removed while it is still
    empty, deepest first (runs/latest, then runs)."""
    for folder in reversed(folders):
        with contextlib.suppress(OSError):
            os.rmdir(folder)


def check_data(config: RunConfig) -> None:
    """The data read (a corpus prepared once), its token ids below the vocabulary, and enough samples for a
    global batch."""
    t = config.train
    train_data, valid_data = build_datasets(config.data, t.seq_length, t.seed)
    check_token_ids(config.data, train_data, valid_data, config.model.vocab_size)
    check_batches(config.data, train_data, valid_data, t.global_batch_size, evaluates=t.eval_interval > 0)
    for unknown in unknown_tokenizers(config.data, train_data, valid_data):
        print(f"note: {unknown}", file=sys.stderr)


def auto_layout(config: RunConfig, flags, argv: list[str]) -> list[str]:
    """--auto-layout: the planner's fastest layout of --world-size ranks that fits --memory-budget-gb, as the
    flags the run (and every rank it starts) is then parsed from."""
    if flags.world_size is None or not 1 <= flags.world_size <= MAX_WORLD:
        raise ConfigError(f"--auto-layout plans for --world-size N ranks; give N from 1 to {MAX_WORLD:,}")
    kept, skip = [], False
    dropped = ("--world-size",) if flags.check_plan or flags.dump_only else ("--world-size", "--machine")
    for arg in argv:  # the planner's flags replace these: the ranks must not plan again (a check predicts with
        if skip:  # the machine file the plan did; a run reads none)
            skip = False
        elif arg in dropped:
            skip = True
        elif arg != "--auto-layout" and not arg.startswith(tuple(f"{flag}=" for flag in dropped)):
            kept.append(arg)
    machine = load_machine(flags.machine, flags.world_size)
    with kept_predictions() as kept_before:
        found = search(config, flags.world_size, machine, config.parallel.memory_budget_gb, progress=print,
                       workers=cores(), kept=kept_before)
    if found.layouts:
        print(format_search(found, flags.world_size, top=3, refused=0))
    if not found.ranked:
        planner_flags = [arg for arg in kept if arg not in ("--check-plan", "--dump-only")]  # run_gpt.py's alone
        if flags.machine and "--machine" in dropped:
            planner_flags += ["--machine", flags.machine]  # what it planned with
        raise PlanError(f"--auto-layout: {no_layout(found, flags.world_size)}; each refused layout with its "
                        f"reason: python -m gcompile.plan --world-size {flags.world_size} {' '.join(planner_flags)} "
                        f"--refused {len(found.refused)}")
    best = found.ranked[0]
    chosen = dict(zip(best.run_flags()[::2], best.run_flags()[1::2]))
    replaced = []
    for i, arg in enumerate(kept):  # a layout flag given another value than the plan's
        flag, _, value = arg.partition("=")
        following = i + 1 < len(kept) and not kept[i + 1].startswith("--") and not value
        value = kept[i + 1] if following else value or "true"
        if canonical_flag(flag) in chosen and chosen[canonical_flag(flag)] != value:
            replaced.append(f"{arg} {value}" if following else arg)
    given, fields = {canonical_flag(arg.split("=")[0]) for arg in kept}, best.run_fields()
    from_preset = [f"{key} = {value}" for section in flags.preset.values() for key, value in section.items()
                   if key in fields and f"--{key.replace('_', '-')}" not in given and value != fields[key]]
    instead = [f"the given {', '.join(replaced)}"] * bool(replaced) + [f"the preset's {', '.join(from_preset)}"] * \
        bool(from_preset)
    doing = "checking the plan of" if flags.check_plan else "dumping" if flags.dump_only else "training with"
    print(f"--auto-layout: {doing} {' '.join(best.flags())} ({best.prediction}; "
          f"{best.memory / 2 ** 30:.4g} GiB on its largest rank)"
          + (f"; in place of {' and '.join(instead)}" if instead else ""))
    return kept + best.run_flags()


def main(argv: list[str]) -> int:
    with contextlib.ExitStack() as held:  # what the run holds until it ends: its --save folder
        return _run(argv, held)


def _run(argv: list[str], held: contextlib.ExitStack) -> int:
    made = []  # folders this call made: a refusal removes them again while they are empty
    try:
        config, flags = parse_args(argv)
        if flags.auto_layout and under_launcher():
            raise ConfigError("--auto-layout plans and starts the ranks itself; run python run_gpt.py ... "
                              "--auto-layout without a launcher, or give the launcher the layout flags it chose")
        if flags.dump_only and not config.log.dump_graphs:
            raise ConfigError("--dump-only writes the programs to --dump-graphs DIR; give a folder")
        if not under_launcher() and not (flags.dump_only or flags.check_plan):  # no layout changes these: refused
            check_fits_machine(config)  # before anything is allocated, or planned (--auto-layout)
            check_data(config)
        if flags.auto_layout:
            argv = auto_layout(config, flags, argv)
            config, flags = parse_args(argv)
        if not under_launcher():
            for idle in idle_flags(config):
                print(f"note: {idle}", file=sys.stderr)
            if flags.dump_only or flags.check_plan:
                load_passes(config)  # a pass that cannot be loaded: refused before any build, an earlier dump kept
                make_folders({"--dump-graphs": config.log.dump_graphs} if flags.dump_only else {}, made)
                return plan_only(config, flags.dump_only, flags.machine)
            make_folders({"--run-dir": config.log.run_dir, "--dump-graphs": config.log.dump_graphs,
                          "--tensorboard-dir": config.log.tensorboard_dir}, made)
            if config.world_size > 1:
                start_rank_server()
            load_passes(config)
            hold_folders(config, held)
            if problem := metrics_error(config.log.run_dir):
                raise ConfigError(problem)
            check(config)  # the checkpoint to --load is whole and fits
            if config.log.dump_graphs:  # after every refusal above: a refused run leaves an earlier dump as it was
                clear_stale_dumps(config.log.dump_graphs, range(config.world_size))
            if config.world_size > 1:
                check_shm_room(config)
                device = "cuda" if torch.cuda.is_available() else "cpu"
                prepare_launch(config, device, rank_threads(config.world_size))
    except USER_ERRORS as e:
        remove_empty(made)
        return error(str(e))
    return run_ranks(config, [os.path.abspath(__file__), *argv], lambda: rank_main(config))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
