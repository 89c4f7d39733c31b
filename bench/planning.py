"""Planning time: `python -m gcompile.plan` for a world size, first with nothing kept, then again.

    python bench/planning.py                                  # tiny, 1024 ranks: about 20 s here
    python bench/planning.py --config configs/gpt2-small.toml --world-size 8

Each run is the planner's own command in a process of its own, as a user runs it, with
this machine's file (`--machine`) and a plan cache of its own in a fresh folder, so the
user's is neither read nor written. The first run builds every layout (`--fresh`); the
second takes every prediction from the first (gcompile.plan_cache) and must print the
same table. Per run: wall time (the process, torch's import included), the planner's own
time (its table's first line) and how many predictions came from earlier runs; then the
second's time as a ratio of the first's.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

from gcompile import machine as machine_file

HEADER = re.compile(r"^(?P<layouts>\d+) layouts.*?\((?P<seconds>[\d.]+) s(, (?P<reused>\d+) predicted by earlier "
                    r"runs)?\)")


def plan(args: argparse.Namespace, cache: str, fresh: bool) -> tuple[float, dict, list[str]]:
    """(wall seconds, the table's first line read, the table) of one planner run."""
    command = [sys.executable, "-m", "gcompile.plan", "--config", args.config, "--world-size", str(args.world_size),
               "--global-batch-size", str(args.global_batch_size or args.world_size), "--machine", args.machine,
               *(["--fresh"] if fresh else [])]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "XDG_CACHE_HOME": cache})
    seconds = time.perf_counter() - start
    if done.returncode != 0:  # its one line, and its status (2: bad input)
        print(f"bench/planning.py: {done.stderr.strip().splitlines()[-1]}", file=sys.stderr)
        sys.exit(done.returncode)
    table = done.stdout.splitlines()
    return seconds, HEADER.match(table[0]).groupdict(), table


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/tiny.toml")
    p.add_argument("--world-size", type=int, default=1024)
    p.add_argument("--global-batch-size", type=int, help="default: the world size")
    p.add_argument("--machine", default=machine_file.default_path(),
                   help="machine file (default: this machine's, from python -m gcompile.calibrate)")
    args = p.parse_args()
    if args.machine == machine_file.default_path() and not os.path.exists(args.machine):
        p.error(machine_file.missing())
    try:
        machine = machine_file.load(args.machine)
    except machine_file.MachineError as e:  # a file given, not this machine's: its own message
        p.error(str(e))
    print(f"python -m gcompile.plan --config {args.config} --world-size {args.world_size}; "
          f"machine {machine.description}", flush=True)
    print(f"{'run':<26} {'wall s':>8} {'planning s':>11} {'layouts':>8} {'reused':>7}")
    with tempfile.TemporaryDirectory() as cache:
        runs = []
        for name, fresh in (("first (--fresh)", True), ("again (predictions kept)", False)):
            runs.append(plan(args, cache, fresh))
            seconds, header, _ = runs[-1]
            print(f"{name:<26} {seconds:8.1f} {float(header['seconds']):11.1f} {header['layouts']:>8} "
                  f"{header['reused'] or 0:>7}", flush=True)
    (first, _, first_table), (again, _, again_table) = runs
    same = "the same table" if first_table[1:] == again_table[1:] else "A DIFFERENT TABLE"
    print(f"again / first: {again / first:.3f}x wall ({same})")
    return 0 if first_table[1:] == again_table[1:] else 1


if __name__ == "__main__":
    sys.exit(main())
