"""Stopping a run: SIGINT and SIGTERM, --exit-signal-handler, the launcher's death, a stalled rank.

Each case starts `run_gpt.py` as a user does, waits until its ranks train (their flight
records, gcompile.flight, name the iteration they are in), does something to one process,
and checks how the launcher exits, what it printed, and that no process of the run is left.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

import run_gpt
from gcompile import flight
from gcompile import machine as machine_file
from gcompile.checkpoint import TRACKER
from gcompile.config import parse_args
from tests.multirank import ROOT, assert_succeeded, launch
from tests.test_checkpoint import WORKER, losses
from tests.test_cost_model import flat_machine

TINY = ["--config", os.path.join(ROOT, "configs", "tiny.toml"), "--eval-interval", "0", "--log-interval", "1000",
        "--lr-decay-style", "constant", "--lr-warmup-iters", "0"]  # the learning rate does not depend on train_iters
FOREVER = ["--train-iters", "1000000"]


def start(tmp_path, *flags, own_group: bool = False) -> subprocess.Popen:
    """`python run_gpt.py` on the tiny model, output to tmp_path/stdout and tmp_path/stderr; with `own_group`, the
    leader of a process group of its own (as a job scheduler starts a job step)."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    with open(tmp_path / "stdout", "w") as out, open(tmp_path / "stderr", "w") as err:
        return subprocess.Popen([sys.executable, os.path.join(ROOT, "run_gpt.py"), *TINY, "--run-dir",
                                 str(tmp_path / "run"), *map(str, flags)], stdout=out, stderr=err, env=env,
                                start_new_session=own_group)


def output(tmp_path) -> tuple[str, str]:
    return (tmp_path / "stdout").read_text(), (tmp_path / "stderr").read_text()


def wait_for_iteration(tmp_path, proc: subprocess.Popen, iteration: int, rank: int = 0) -> None:
    """Until `rank`'s flight record says it is in `iteration` or later (startup takes 10-60 s here)."""
    path = flight.rank_file(flight.flight_dir(str(tmp_path / "run")), rank)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the run ended early with {proc.returncode}:\n{output(tmp_path)}"
        phase = (flight.read(path) or {}).get("phase", "")
        if phase.startswith("iteration ") and int(phase.split()[1]) >= iteration:
            return
        time.sleep(0.2)
    raise AssertionError(f"rank {rank} never reached iteration {iteration}:\n{output(tmp_path)}")


def run_processes(launcher: subprocess.Popen) -> dict[int, str]:
    """pid -> name of the launcher ("launcher") and of every live process under it: its ranks ("rank R", the
    name gcompile.launch gives them), the fork server they came from, multiprocessing's resource tracker."""
    children = {}
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        state, parent = _stat(pid)
        if state not in (None, "Z"):
            children.setdefault(parent, []).append(pid)
    found, todo = {}, [launcher.pid]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/comm") as f:
                found[pid] = "launcher" if pid == launcher.pid else f.read().strip()
        except OSError:
            continue
        todo += children.get(pid, [])
    return found


def rank_pid(launcher: subprocess.Popen, rank: int) -> int:
    return next(pid for pid, name in run_processes(launcher).items() if name == f"rank {rank}")


def assert_all_gone(pids, within: float = 10.0) -> None:
    """Every process of `pids` (a run's, from run_processes while it ran) ends within `within` seconds."""
    deadline = time.monotonic() + within
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _alive(pids)
    for pid in left:  # not to leave them training after the test
        os.kill(pid, signal.SIGKILL)
    assert not left, f"still running {within:g} s later: {left}"


def _alive(pids) -> list[int]:
    """Those of `pids` that run (a zombie has ended)."""
    return [pid for pid in pids if _stat(pid)[0] not in (None, "Z")]


def _stat(pid: int) -> tuple[str | None, int | None]:
    """(state, parent pid) of a process, as /proc says; (None, None) once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state, parent = f.read().rpartition(")")[2].split()[:2]
    except OSError:
        return None, None
    return state, int(parent)


def listening_addresses(pids) -> list[str]:
    """Local addresses (hex, as in /proc/net/tcp*) of the TCP sockets these processes listen on."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[len("socket:["):-1])
        except OSError:
            continue
    addresses = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                fields = row.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    addresses.append(fields[1].rpartition(":")[0])
    return addresses


LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}
"""127.0.0.1, ::1 and ::ffff:127.0.0.1 as /proc/net/tcp* writes them (little-endian words)."""


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_stops_every_rank_with_one_line_and_nothing_listens_beyond_loopback(tmp_path, signum):
    proc = start(tmp_path, "--dp", 2, *FOREVER)
    wait_for_iteration(tmp_path, proc, 2)
    processes = run_processes(proc)
    assert {"launcher", "rank 0", "rank 1"} <= set(processes.values()), processes
    addresses = listening_addresses(processes)
    assert addresses, "the rank store and gloo listen somewhere"
    assert set(addresses) <= LOOPBACK, f"listening beyond loopback: {addresses}"
    proc.send_signal(signum)
    assert proc.wait(timeout=60) == 128 + signum
    stdout, stderr = output(tmp_path)
    assert stderr.splitlines() == [f"run_gpt.py: stopped by {signum.name}"], stderr
    assert "Traceback" not in stdout
    assert_all_gone(processes)


@pytest.mark.slow
def test_killed_launcher_takes_its_ranks_along(tmp_path):
    proc = start(tmp_path, "--dp", 2, *FOREVER)
    wait_for_iteration(tmp_path, proc, 1)
    processes = run_processes(proc)
    assert {"launcher", "rank 0", "rank 1"} <= set(processes.values()), processes
    proc.kill()
    proc.wait()
    assert_all_gone(processes, within=10)


@pytest.mark.parametrize("flags, message", [
    (["--exit-signal-handler"], "exit-signal-handler saves a checkpoint on SIGTERM and needs --save DIR"),
    (["--hang-timeout-s", "-1"], "hang-timeout-s=-1.0 must be 0 (no watchdog) or positive"),
    (["--distributed-timeout-minutes", "0"], "distributed-timeout-minutes=0.0 must be positive"),
])
def test_bad_stop_flags_are_one_line(flags, message, capsys):
    assert run_gpt.main(flags) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and message in err[0], err


def test_one_process_run_stops_on_sigterm_with_one_line(tmp_path):
    proc = start(tmp_path, *FOREVER)
    wait_for_iteration(tmp_path, proc, 1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    stdout, stderr = output(tmp_path)
    assert stderr.splitlines() == ["run_gpt.py: stopped by SIGTERM"] and "Traceback" not in stdout


def test_ctrl_c_while_torch_loads_is_one_line(tmp_path):
    """A second in, the launcher is still importing torch (seconds here), which printed KeyboardInterrupt's
    traceback of the import."""
    proc = start(tmp_path, *FOREVER)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    stdout, stderr = output(tmp_path)
    assert stderr.splitlines() == ["run_gpt.py: stopped by SIGINT"] and "Traceback" not in stdout


@pytest.mark.parametrize("module, flags", [("plan", ["--config", "configs/tiny.toml", "--world-size", "1024"]),
                                           ("calibrate", ["--out", "{tmp}/machine.json"])])
def test_ctrl_c_while_a_tool_loads_torch_is_one_line(module, flags, tmp_path):
    """python -m gcompile.plan and calibrate installed their handler after their imports: a traceback. (Were the
    imports done already, a Ctrl-C while it works is one line too.)"""
    flags = [flag.format(tmp=tmp_path) for flag in flags]
    proc = subprocess.Popen([sys.executable, "-m", f"gcompile.{module}", *flags], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=ROOT, XDG_CACHE_HOME=str(tmp_path)))
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130 and stderr.splitlines() == [f"python -m gcompile.{module}: stopped by SIGINT"], \
        stderr


def test_ctrl_c_while_calibration_ranks_start_is_one_line_and_takes_them_along(tmp_path):
    """A terminal's Ctrl-C reaches every process of its job: calibrate's spawned ranks, interrupted while they
    imported torch, printed a traceback each (about 65 lines); later, torch's tie to their parent (a SIGINT when it
    ends) interrupted their exit ("Exception ignored in atexit callback")."""
    proc = subprocess.Popen([sys.executable, "-m", "gcompile.calibrate", "--out", str(tmp_path / "machine.json")],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, PYTHONPATH=ROOT, XDG_CACHE_HOME=str(tmp_path), PYTHONUNBUFFERED="1"))
    while "2 ranks at once" not in (line := proc.stdout.readline()):  # after the compute phase, 10-20 s here
        assert line, "calibrate ended before it started ranks"
    time.sleep(1.0)  # the ranks are importing torch
    ranks = run_processes(proc)
    assert len(ranks) > 1, "its ranks started"
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal sends it: to the whole job
    assert proc.wait(timeout=60) == 130
    assert_all_gone(ranks, within=2.0)  # taken along, not left to finish importing torch first
    stderr = proc.stderr.read()
    assert stderr.splitlines() == ["python -m gcompile.calibrate: stopped by SIGINT"], stderr


def test_ctrl_c_while_planning_is_one_line_keeps_the_plan_and_takes_the_workers_along(tmp_path):
    """python -m gcompile.plan printed a KeyboardInterrupt traceback, and its workers planned on as orphans."""
    machine = tmp_path / "machine.json"
    machine_file.save(flat_machine(), str(machine))
    proc = subprocess.Popen([sys.executable, "-m", "gcompile.plan", "--config", "configs/tiny.toml", "--world-size",
                             "8", "--workers", "2", "--machine", str(machine)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)})
    progress = ""
    while "/230 layouts" not in progress.removeprefix("planning: 0/230"):  # a family finished
        progress = proc.stderr.readline()
        assert progress, "the planner ended before a family finished"
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)  # an orphaned worker would hold the pipes open past it
    said = [line for line in err.splitlines() if not line.startswith("planning: ")]  # a family may finish meanwhile
    assert proc.returncode == 130 and said == ["python -m gcompile.plan: stopped by SIGINT"], err
    assert (tmp_path / "gcompile" / "plans.json").is_file(), "what it predicted is kept"
    deadline = time.monotonic() + 30
    while (running := [pid for pid in workers if _running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not running, "its workers end with it"


def _running(pid: str) -> bool:
    """Whether the process lives (a zombie, ended and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_sigterm_with_exit_signal_handler_saves_where_every_rank_stops_and_resumes_exactly(tmp_path):
    # SIGTERM to rank 1 alone (a scheduler signals every process; which gets it first is chance):
    # rank 0 learns it from the flag all-reduced each iteration, so both save the same iteration
    layout = ["--dp", 2]
    save = tmp_path / "save"
    proc = start(tmp_path, *layout, *FOREVER, "--exit-signal-handler", "--save", save, "--hang-timeout-s", 60)
    wait_for_iteration(tmp_path, proc, 3, rank=1)
    processes = run_processes(proc)
    os.kill(rank_pid(proc, 1), signal.SIGTERM)
    assert proc.wait(timeout=300) == 143
    stdout, stderr = output(tmp_path)
    assert stderr.splitlines() == ["run_gpt.py: stopped by SIGTERM"] and "Traceback" not in stdout
    assert_all_gone(processes)
    cut = losses(tmp_path / "run")
    stopped_at = int((save / TRACKER).read_text())
    assert stopped_at == len(cut) >= 3, "both ranks saved the iteration they both finished last"
    assert f"exiting at iteration {stopped_at} on SIGTERM" in stdout
    # the checkpoint continued for 2 more iterations against a run that was never stopped, on the same layout
    end = [*map(str, layout), "--train-iters", str(stopped_at + 2)]
    resumed = parse_args(TINY + end + ["--load", str(save), "--run-dir", str(tmp_path / "resumed")])[0]
    straight = parse_args(TINY + end + ["--run-dir", str(tmp_path / "straight")])[0]
    assert_succeeded(tmp_path, launch(tmp_path, WORKER, dict(configs=[resumed, straight]), world=2))
    assert cut + losses(tmp_path / "resumed") == losses(tmp_path / "straight")


@pytest.mark.slow
def test_sigterm_to_the_launchers_process_group_still_saves(tmp_path):
    """`kill -TERM -- -PGID` (a scheduler ending a job step) reaches the launcher and the fork server its ranks
    came from, not the ranks (sessions of their own). multiprocessing reads every rank of a dead fork server as
    exited, so the server must outlive the signal for the launcher to wait for the save."""
    save = tmp_path / "save"
    proc = start(tmp_path, "--dp", 2, *FOREVER, "--exit-signal-handler", "--save", save, own_group=True)
    wait_for_iteration(tmp_path, proc, 2, rank=1)
    processes = run_processes(proc)
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=300) == 143
    stdout, stderr = output(tmp_path)
    assert stderr.splitlines() == ["run_gpt.py: stopped by SIGTERM"] and "Traceback" not in stdout
    stopped_at = int((save / TRACKER).read_text())
    assert f"exiting at iteration {stopped_at} on SIGTERM" in stdout and stopped_at >= 2
    assert_all_gone(processes)


@pytest.mark.slow
def test_stalled_rank_is_named_within_the_hang_timeout(tmp_path):
    proc = start(tmp_path, "--dp", 2, *FOREVER, "--hang-timeout-s", 8)  # a tiny step takes well under a second
    wait_for_iteration(tmp_path, proc, 2, rank=1)
    processes = run_processes(proc)
    os.kill(rank_pid(proc, 1), signal.SIGSTOP)
    assert proc.wait(timeout=300) == 1
    stdout, stderr = output(tmp_path)
    assert "no rank made progress for 8 s" in stderr and "the stalled rank: 1 (process stopped)" in stderr, stderr
    rank1 = next(line for line in stderr.splitlines() if line.strip().startswith("rank 1 "))
    assert "instruction started @" in rank1 and "[process stopped]" in rank1, rank1
    assert "Traceback" not in stdout + stderr
    assert_all_gone(processes)
