"""The local launcher: a multi-rank world, Megatron rank order, and the named groups graphs use."""

import json
import os
import signal
import subprocess
import sys

import pytest

import run_gpt
from gcompile import shm_group
from gcompile.launch import spawn_local
from gcompile.axes import Coords, group_members
from tests.multirank import ROOT
from tests.test_checkpoint import SMALL

WORKER = os.path.join(os.path.dirname(__file__), "workers", "mesh_worker.py")
FAILING = os.path.join(os.path.dirname(__file__), "workers", "failing_worker.py")


def test_rank_order_is_megatron():
    # rank = tp_rank + tp * (dp_rank + dp * pp_rank), written out for tp=2 dp=3 pp=2
    expected = {(tp, dp, pp): tp + 2 * (dp + 3 * pp) for pp in range(2) for dp in range(3) for tp in range(2)}
    for (tp, dp, pp), rank in expected.items():
        c = Coords.from_rank(rank, {"tp": 2, "pp": 2, "dp": 3})
        assert (c.axis_rank("tp"), c.axis_rank("dp"), c.axis_rank("pp"), c.rank) == (tp, dp, pp, rank)


def test_spawned_world_has_the_named_groups(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    tp, pp, dp = 2, 2, 1
    assert spawn_local(tp * pp * dp, [WORKER, str(tmp_path), str(tp), str(pp), str(dp)]) == 0
    records = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(tp * pp * dp)]
    for r in records:
        assert r["rank"] == r["env_rank"]
        coords = Coords.from_rank(r["rank"], {"tp": tp, "pp": pp, "dp": dp})
        assert (r["tp_rank"], r["dp_rank"], r["pp_rank"]) == (coords.axis_rank("tp"), coords.axis_rank("dp"), coords.axis_rank("pp"))
        assert r["tp_backend"] == (shm_group.BACKEND if shm_group.available() else "gloo")
        assert sorted(r["sums"]) == ["embd", "mp", "pp", "tp", "world"]  # roles of more than one rank
        for name, sums in r["sums"].items():
            expected = float(sum(group_members(coords, name)))
            assert sums == [expected, expected], f"rank {r['rank']} group {name}"


def test_failed_rank_is_reported(tmp_path, capsys):
    # a worker that cannot join a world of the wrong size exits non-zero; the launcher says which rank
    assert spawn_local(2, [WORKER, str(tmp_path), "1", "1", "1"]) != 0
    assert "rank" in capsys.readouterr().err


def test_a_rank_that_raises_shows_its_traceback_from_the_script_on(tmp_path, capfd):
    assert spawn_local(2, [FAILING, str(tmp_path), "raise"]) == 1
    err = capfd.readouterr().err.splitlines()
    assert err[0] == "Traceback (most recent call last):" and err[1].startswith(f'  File "{FAILING}"'), err
    assert err[-2:] == ["RuntimeError: a bug in rank 1",
                        f"{os.path.basename(sys.argv[0])}: rank 1 failed with exit code 1; its output is above"], err


def test_a_killed_rank_is_named_alone_not_the_peer_that_failed_after_it(tmp_path, capfd):
    # rank 0 raises once rank 1 is gone, as a collective with a dead peer does; the launcher stops it before it
    # prints (gcompile.launch.REPORT_AFTER_S) and names the rank that was killed
    assert spawn_local(2, [FAILING, str(tmp_path), "killed"]) == 128 + signal.SIGKILL
    err = capfd.readouterr().err
    assert err.splitlines() == [f"{os.path.basename(sys.argv[0])}: rank 1 was killed by SIGKILL; its output is "
                                f"above"], err


@pytest.mark.skipif(not shm_group.available(), reason="shared-memory tp groups need x86-64 Linux with /dev/shm")
def test_too_small_dev_shm_is_one_line_before_ranks_start(monkeypatch, capsys):
    # slots larger than any /dev/shm: the launcher refuses before it builds or starts anything
    monkeypatch.setattr(shm_group, "SLOT_BYTES", 1 << 50)
    argv = SMALL + ["--tp", "2", "--tp-comm-backend", "shm", "--train-iters", "1"]
    assert run_gpt.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "MiB in /dev/shm" in err and "--tp-comm-backend gloo" in err, err


def test_torchrun_world_that_does_not_fit_the_layout_is_one_line(tmp_path):
    # torchrun's own ChildFailedError report follows (README, Reliability); the cause is one line, from the
    # host's first rank, which exits first (the others wait, then exit without a word)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             os.path.join(ROOT, "run_gpt.py"), *SMALL, "--tp", "4", "--run-dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=ROOT))
    assert result.returncode != 0
    ours = [line for line in result.stderr.splitlines()
            if line.startswith("run_gpt.py:") and line != "run_gpt.py: stopped by SIGTERM"]
    assert ours == ["run_gpt.py: error: the launcher started 2 ranks but the layout (tp 4) needs 4; "
                    "start that many (torchrun --nnodes * --nproc-per-node) or change the layout"], result.stderr
    assert result.stderr.index("run_gpt.py: error:") < result.stderr.index("ChildFailedError")


def test_the_fork_server_leaves_cuda_alone_while_it_imports():
    # CUDA's driver does not survive a fork: had the server ranks fork from (gcompile.launch) asked it anything
    # while importing, no rank could use a GPU. On a machine without one, every way in is watched instead.
    watch = """
import sys, torch
asked = []
for name in ("is_available", "device_count", "init", "_lazy_init", "get_device_properties", "current_device"):
    setattr(torch.cuda, name, lambda *a, name=name, **k: asked.append(name))
from gcompile.launch import PRELOAD
for module in PRELOAD:
    __import__("run_gpt" if module == "__main__" else module)
print(asked)
"""
    result = subprocess.run([sys.executable, "-c", watch], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout
