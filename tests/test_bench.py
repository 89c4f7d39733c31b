"""The benchmarks under bench/ as a user runs them: the README's commands end with their table, bad input with one
line and status 2. The quick cases (help, refusals) run in one process (tests/bench_runs.py), each as
`python bench/SCRIPT ARGS` runs it."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench(script: str, *argv: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), *argv], cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout, env=dict(os.environ, PYTHONPATH=ROOT))


QUICK_RUNS = []  # (script, argv) of every case below but the slow one: run together, once


def quick(*cases):
    QUICK_RUNS.extend((case[0], case[1]) for case in cases)
    return cases


@pytest.fixture(scope="module")
def ran():
    """(script, argv) -> its exit status, stdout and stderr."""
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "bench_runs.py"), json.dumps(QUICK_RUNS)],
                          cwd=ROOT, text=True, capture_output=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 0, done.stderr[-2000:]
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(results) == len(QUICK_RUNS), done.stdout[-2000:]
    return {(script, tuple(argv)): result for (script, argv), result in zip(QUICK_RUNS, results)}


@pytest.mark.slow
def test_tensor_parallel_runs():
    """Its launcher and the DTensor model's qkv reordering call gcompile's own API, which has moved under it."""
    done = bench("tensor_parallel.py", "--config", "configs/tiny.toml", "--iters", "1", "--warmup", "0")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("(")]
    assert len(rows) == 7, done.stdout
    assert len({round(float(row.split()[-1]), 4) for row in rows}) == 1, done.stdout  # one model, seven ways


@pytest.mark.parametrize("script, argv", quick(("context_parallel.py", ["--help"])))
def test_help_shows_the_defaults_run(ran, script, argv):
    """bench/context_parallel.py runs T = 16384 by default; its --help said 256, bench/flags.py's default."""
    done = ran[script, tuple(argv)]
    assert done["status"] == 0
    assert "(default: 16384)" in " ".join(done["stdout"].split()), done["stdout"]
    assert "(default: 256)" not in " ".join(done["stdout"].split()), done["stdout"]


@pytest.mark.parametrize("script, argv", quick(("pipeline.py", ["--help"]), ("cost_model.py", ["--help"])))
def test_help_describes_in_sentences(ran, script, argv):
    """Their docstring's first sentence runs over two lines: --help printed the first, cut mid-sentence."""
    done = ran[script, tuple(argv)]
    description = " ".join(done["stdout"].split("\n\n")[1].split())
    assert description.endswith("."), description


@pytest.mark.parametrize("script, argv", quick(
    ("single_rank.py", ["--iters", "0"]),
    ("tensor_parallel.py", ["--iters", "0"]),
    ("context_parallel.py", ["--repeats", "0"]),
    ("data_parallel.py", ["--repeats", "0"]),
    ("moe.py", ["--repeats", "0"]),
    ("moe.py", ["--num-experts", "0"]),  # was: a line that named --ep, which was not given
    ("moe.py", ["--ep", "0"]),  # was: ran without rows (d) and (e)
    ("pipeline.py", ["--rounds", "0"]),
    ("compile.py", ["--threads", "0"]),  # was: a traceback, after building 16 ranks
    ("cost_model.py", ["--warmup", "0", "--machine", "no-such-machine.json"]),
))
def test_no_rounds_refused(ran, script, argv):
    """No timed step (or, for cost_model.py, no warm-up step to measure the peak on) failed with a traceback,
    after minutes of building and compiling."""
    done = ran[script, tuple(argv)]
    assert done["status"] == 2, done["stderr"][-2000:]
    assert done["stderr"].splitlines()[-1].endswith(f"argument {argv[0]}: must be at least 1, not 0"), done["stderr"]
    assert "Traceback" not in done["stderr"]


@pytest.mark.parametrize("script, argv, message", quick(
    ("single_rank.py", ["--n-head", "3"], "n_embd=256 is not divisible by n_head=3"),
    ("moe.py", ["--num-experts", "3"], "ep=2 does not divide num_experts=3"),
    ("moe.py", ["--ep", "3"], "--batch-size 8 must be a multiple of --ep 3"),  # was: named --global-batch-size
    ("tensor_parallel.py", ["--config", "no-such.toml"], "--config no-such.toml: no such file"),
    ("compile.py", ["--n-embd", "7"], "n_embd=7 is not divisible by n_head=8"),
    ("pipeline.py", ["--n-head", "3"], "n_embd=256 is not divisible by n_head=3"),
    ("context_parallel.py", ["--n-head", "3"], "n_embd=64 is not divisible by n_head=3"),  # was: every row "not
    # built", status 0
))
def test_config_refused_in_one_line(ran, script, argv, message):
    """A config gcompile refuses was a traceback (tensor_parallel.py, pipeline.py: one per rank; compile.py: a
    child's exit status, without the reason)."""
    done = ran[script, tuple(argv)]
    assert done["status"] == 2, done["stderr"][-2000:]
    assert message in done["stderr"].splitlines()[-1], done["stderr"]
    assert "Traceback" not in done["stderr"]


@pytest.mark.parametrize("script, argv", quick(("planning.py", ["--machine", "no-such-machine.json"])))
def test_planning_names_the_missing_machine_file(ran, script, argv):
    """A --machine FILE that is not there was status 1 and said this machine had no machine file, whether or not
    it had one."""
    done = ran[script, tuple(argv)]
    assert done["status"] == 2, done["stderr"]
    assert done["stderr"].splitlines()[-1].endswith("no machine file no-such-machine.json; make one with: "
                                                 "python -m gcompile.calibrate --out no-such-machine.json")


@pytest.mark.parametrize("script, argv, message", quick(
    ("data_parallel.py", ["--memory-config", "no-such.toml", "--only", "none", "--n-layer", "1", "--n-embd", "32",
                          "--seq-length", "16", "--iters", "1", "--warmup", "0", "--repeats", "1"],
     "error: --memory-config: --config no-such.toml: no such file"),
    ("memory.py", ["--configs", "no-such.toml"], "error: --config no-such.toml: no such file"),
    ("memory.py", ["--configs", "configs/tiny.toml", "--dp", "0"], "argument --dp: must be at least 1, not 0"),
))
def test_memory_configs_refused_first(ran, script, argv, message):
    """data_parallel.py read --memory-config only after every timed run, then failed with a traceback; memory.py's
    missing file was a traceback, its dp 0 a table of "not built" and status 0."""
    done = ran[script, tuple(argv)]
    assert done["status"] == 2, done["stderr"][-2000:]
    assert done["stderr"].splitlines()[-1].endswith(message), done["stderr"]
    assert "Traceback" not in done["stderr"] and not done["stdout"]
