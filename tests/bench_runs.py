"""Runs bench scripts one after another in this one process, each as `python bench/SCRIPT ARGS` runs it (bench/ first
on sys.path, `__main__`), and prints a JSON line per run: its exit status, stdout and stderr. tests/test_bench.py
checks many refusals; one import of torch for them all, where a process each took a minute of the suite.

    python tests/bench_runs.py '[["memory.py", ["--dp", "0"]], ...]'
"""

import contextlib
import io
import json
import os
import runpy
import sys
import traceback

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def run(script: str, argv: list[str]) -> dict:
    out, err, status = io.StringIO(), io.StringIO(), 0
    sys.argv = [os.path.join(BENCH, script), *argv]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(sys.argv[0], run_name="__main__")
        except SystemExit as stop:  # sys.exit("why") prints why and exits 1
            if isinstance(stop.code, str):
                print(stop.code, file=sys.stderr)
            status = stop.code if isinstance(stop.code, int) else 1 if stop.code else 0
        except BaseException:  # what an uncaught exception prints and exits with
            traceback.print_exc()
            status = 1
    return dict(status=status, stdout=out.getvalue(), stderr=err.getvalue())


if __name__ == "__main__":
    sys.path.insert(0, BENCH)
    for script, argv in json.loads(sys.argv[1]):
        print(json.dumps(run(script, argv)), flush=True)
