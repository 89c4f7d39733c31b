"""Start the ranks: join a world torchrun made, or start one locally and watch over it.

Locally started ranks re-run the same command line; their environment (RANK,
WORLD_SIZE, MASTER_ADDR, ...) tells them they are ranks, as torchrun's does. The
launcher hosts the ranks' store on a free port of 127.0.0.1 and points gloo and nccl
at the loopback interface, so no socket of a local run is reachable from another
host. The launcher stays with its ranks until they end: it passes SIGINT and SIGTERM
on (gcompile.shutdown), stops the others when one fails, and stops a job whose ranks
have all stopped progressing (gcompile.flight). Each rank exits at once when the
launcher has ended, however it ended (gcompile.shutdown.tie_to_launcher).

Ranks are forked from a server process that imported torch and the launching
script's modules once (multiprocessing's forkserver), not started as fresh
interpreters: each import of torch and gcompile is seconds of one core, paid once
per run instead of once per rank (the tiny model's 8 ranks on 2 cores start, train
2 iterations and exit in 22 s, 39 s as fresh interpreters). The server imports only,
so nothing it forks holds threads or state of a computation. A rank gets the
launcher's environment, working directory, stdout and stderr, as a subprocess would,
and shares Inductor's on-disk cache with the other ranks. Its command line is the
server's (`ps` shows `python -c from multiprocessing.forkserver import main ...`), its
name `rank R` (`top`, `ps -o comm`).
"""

import ctypes
import math
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import signal
import socket
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing import reduction

import torch
import torch.distributed as dist

from gcompile import checked_plan, flight, shutdown
from gcompile.config import ConfigError, RunConfig
from gcompile.axes import AXES, Coords
from gcompile.mesh import init_groups


def under_launcher() -> bool:
    """Started by torchrun or by spawn_local (both set these)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def under_torchrun() -> bool:
    """Started by a launcher not ours (torchrun): nothing holds the run's folders for its ranks."""
    return under_launcher() and checked_plan.LAUNCHED_BY not in os.environ


def rank_threads(world_size: int, cores: int | None = None) -> int:
    """CPU threads per locally spawned rank: this host's cores (or `cores`) shared evenly (OMP_NUM_THREADS wins
    if set)."""
    return int(os.environ.get("OMP_NUM_THREADS", max(1, (cores or os.cpu_count() or 1) // world_size)))


def spawn_local(world_size: int, argv: list[str], config: RunConfig | None = None) -> int:
    """Run `python argv...` as `world_size` local ranks; 0 if all succeeded, else the status to exit with.

    `config` (the run's): its run dir holds the ranks' flight records, which the hang watchdog
    reads (parallel.hang_timeout_s); with checkpoint.exit_signal_handler a SIGTERM is given time
    to finish the iteration and save."""
    listening = socket.create_server(("127.0.0.1", 0))  # loopback only: nothing off this host reaches it
    port = listening.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, is_master=True, master_listen_fd=listening.detach(),  # the store's now
                          wait_for_workers=False)
    loopback = loopback_interface()
    env = dict(os.environ, WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",  # ranks are clients of `store`
               **{checked_plan.LAUNCHED_BY: str(os.getpid())})
    env.setdefault("OMP_NUM_THREADS", str(rank_threads(world_size)))
    env.setdefault("GLOO_SOCKET_IFNAME", loopback)  # gloo's and nccl's own listening sockets on loopback too
    env.setdefault("NCCL_SOCKET_IFNAME", loopback)
    watchdog = flight.Watchdog(flight.flight_dir(config.log.run_dir), world_size,
                               config.parallel.hang_timeout_s) if config else None
    if watchdog:
        watchdog.clear()
    signals = []
    previous = shutdown.set_action(signals.append)  # acted on below, in this thread
    procs = []
    ended, alive = os.pipe()  # written by nobody; the ranks read its end of file when this process ends
    try:
        for rank in range(world_size):
            inherited = _Inherited(1), _Inherited(2), _Inherited(ended)
            proc = _RANKS.Process(target=_run_rank, args=(argv, dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                                                          *inherited), name=f"rank {rank}")
            proc.start()
            procs.append(proc)
        return _supervise(procs, signals, watchdog, config)
    finally:
        os.close(ended)
        os.close(alive)
        shutdown.set_action(previous)
        for proc in procs:
            if proc.exitcode is None:
                proc.kill()
            proc.join()
        del store


PRELOAD = ["__main__", "torch", "torch.distributed", "gcompile.train", "gcompile.fork_server"]
"""What the server ranks fork from imports: the launching script (run_gpt.py), what it imports, and what every
rank imports; and gcompile.fork_server, which makes the server outlive a SIGTERM to the launcher's process
group. None of it may initialize CUDA, whose driver a forked process cannot use after its parent did."""
_RANKS = multiprocessing.get_context("forkserver")
_RANKS.set_forkserver_preload(PRELOAD)
_PR_SET_NAME = 15  # linux/prctl.h


def start_rank_server() -> None:
    """Start the server ranks fork from now: its imports (seconds) run while the launcher checks the run."""
    multiprocessing.forkserver.ensure_running()


def _run_rank(argv: list[str], env: dict[str, str], stdout: int, stderr: int, launcher: int) -> None:
    """In a forked rank: set up what a fresh `python argv...` with `env` would have, then run the script as
    __main__. The fork server kept what the launcher had when it started it (environment, threads setting,
    session, standard streams), and its start method: under forkserver's, multiprocessing registers each lock
    it makes (tqdm makes one) for cleanup, and a stopped rank's would be reported leaked on the launcher's
    stderr."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the server ignores it (gcompile.fork_server); a rank does not
    multiprocessing.set_start_method(None, force=True)  # this platform's default, not the server's forkserver
    os.environ.clear()
    os.environ.update(env, **{shutdown.LAUNCHER: str(launcher)})
    shutdown.tie_to_launcher()
    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # read by torch at import, in the server
    os.setsid()  # a terminal's Ctrl-C reaches the launcher alone
    if sys.platform.startswith("linux"):  # what top and ps -o comm show: every rank has the server's command line
        ctypes.CDLL(None).prctl(_PR_SET_NAME, f"rank {env['RANK']}".encode())
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    os.close(stdout)
    os.close(stderr)
    sys.argv = list(argv)
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except Exception as e:
        time.sleep(REPORT_AFTER_S)
        frames = e.__traceback__
        while frames.tb_next and frames.tb_frame.f_code.co_filename != argv[0]:
            frames = frames.tb_next  # from the script on, as a fresh interpreter's traceback starts
        sys.excepthook(type(e), e.with_traceback(frames), frames)  # torch.distributed's once it has a world:
        # [rankR] before each line
        sys.exit(1)


REPORT_AFTER_S = 1.0
"""A rank that fails waits this long before it prints why: where its failure follows another rank's death (a
collective's connection reset by the dead peer), the launcher has stopped it by then, and names the rank that
died alone instead of under a traceback that blames the network."""


class _Inherited:
    """A file descriptor of the launcher, given to a forked rank as a copy (the fork server's are not the
    launcher's now: pytest, for one, swaps them per test)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _detach, (reduction.DupFd(self.fd),)


def _detach(duplicate) -> int:
    return duplicate.detach()


GRACE_S = 5.0
"""Ranks told to stop now get this long before they are killed."""


def _supervise(procs: list[multiprocessing.Process], signals: list[int], watchdog: "flight.Watchdog | None",
               config: RunConfig | None) -> int:
    """Wait for the ranks: pass signals on, stop the rest when one fails, stop a hung job."""
    prog = os.path.basename(sys.argv[0])
    deferred = config is not None and config.checkpoint.exit_signal_handler
    # with --exit-signal-handler a rank sent SIGTERM itself stops, saved, with the others: no failure
    orderly = (shutdown.exit_status(signal.SIGTERM),) if deferred else ()
    forwarded, deadline, failure = 0, None, None
    early = {}

    def ended_early(rank: int) -> str:
        """`_ended_early`, read once a rank: an ended rank's flight record is final."""
        if rank not in early:
            early[rank] = _ended_early(watchdog, rank)
        return early[rank]

    while True:
        alive = [proc.exitcode is None for proc in procs]
        if len(signals) > forwarded:  # the first is passed on; another kills at once
            signum = signals[0] if forwarded == 0 else signal.SIGKILL
            _send(procs, signum)
            forwarded = len(signals)
            if not (deferred and signum == signal.SIGTERM):
                deadline = time.monotonic() + GRACE_S
        if failure is None and not signals:
            failed = [(rank, proc.exitcode) for rank, proc in enumerate(procs)
                      if proc.exitcode not in (None, 0, *orderly) or proc.exitcode == 0 and ended_early(rank)]
            failure = min(failed, key=lambda f: f[1] >= 0, default=None)  # killed by a signal: the cause, not a
            # peer whose collective failed with it
            if failure:
                _send(procs, signal.SIGKILL)  # the others would wait on it in their next collective
        if not any(alive):
            break
        if deadline is not None and time.monotonic() > deadline:
            _send(procs, signal.SIGKILL)
        if watchdog and watchdog.hung():
            names = [str(Coords.from_rank(r, config.mesh_sizes)) for r in range(len(procs))]
            print(f"{prog}: error: " + flight.report(watchdog, names, [_process_note(p) for p in procs]),
                  file=sys.stderr, flush=True)
            _send(procs, signal.SIGKILL)
            return 1
        time.sleep(0.05)
    if not signals and failure is None and any(proc.exitcode in orderly for proc in procs):
        signals = [signal.SIGTERM]
    if signals:
        print(f"{prog}: stopped by {shutdown.name(signals[0])}", file=sys.stderr, flush=True)
        return shutdown.exit_status(signals[0])
    if failure is None:
        return 0
    rank, code = failure
    if code == 0:
        print(f"{prog}: rank {rank} ended with status 0 while {early[rank]}, before its training "
              f"did (a sys.exit or os._exit in a pass or the model?); stopped the others", file=sys.stderr)
        return 1
    if code == 2:  # the rank printed its one-line error
        return 2
    if code < 0:
        print(f"{prog}: rank {rank} was killed by {shutdown.name(-code)}; its output is above", file=sys.stderr)
        return shutdown.exit_status(-code)
    print(f"{prog}: rank {rank} failed with exit code {code}; its output is above", file=sys.stderr)
    return code


def _ended_early(watchdog: "flight.Watchdog | None", rank: int) -> str:
    """For a rank that ended with status 0: what its flight record says it was doing where that is not the end
    of training ("" where it is, or there is no watchdog to read it)."""
    if watchdog is None:
        return ""
    record = flight.read(flight.rank_file(watchdog.folder, rank))
    phase = record and record["phase"]
    return "" if phase == "done" else phase or "starting"


def _send(procs: list[multiprocessing.Process], signum: int) -> None:
    for proc in procs:
        if proc.exitcode is None:
            os.kill(proc.pid, signum)


def _process_note(proc: multiprocessing.Process) -> str:
    """"process stopped" for a process the kernel has stopped (SIGSTOP, a debugger), else ""."""
    try:
        with open(f"/proc/{proc.pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return ""
    return "process stopped" if state in ("T", "t") else ""


def loopback_interface() -> str:
    """The name of the loopback network interface (lo on Linux)."""
    for _, interface in socket.if_nameindex():
        try:
            with open(f"/sys/class/net/{interface}/flags") as f:
                if int(f.read(), 16) & 0x8:  # IFF_LOOPBACK
                    return interface
        except OSError:
            continue
    return "lo"


def join_world(mesh_sizes: dict[str, int], tp_comm_backend: str = "auto",
               timeout_minutes: float = 10) -> tuple[Coords, str]:
    """Initialize this process as one rank of the launcher's world of `mesh_sizes`; (coords, device).
    A collective that waits longer than `timeout_minutes` fails (parallel.distributed_timeout_minutes)."""
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    sizes = {axis: size for axis, size in mesh_sizes.items() if axis in AXES}  # folded axes add no ranks
    if world != math.prod(sizes.values()):
        if int(os.environ.get("LOCAL_RANK", 0)):  # every rank finds it: the first of each host says it, and
            time.sleep(REPORT_AFTER_S)  # exits first (the launcher stops the others once one has exited)
            raise SystemExit(2)
        factors = " * ".join(f"{axis} {size}" for axis, size in sizes.items() if size > 1) or "1"
        raise ConfigError(f"the launcher started {world} ranks but the layout ({factors}) needs "
                          f"{math.prod(sizes.values())}; start that many (torchrun --nnodes * --nproc-per-node) "
                          f"or change the layout")
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device, backend = f"cuda:{local_rank}", "nccl"
    else:
        device, backend = "cpu", "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(minutes=timeout_minutes))
    coords = Coords.from_rank(rank, mesh_sizes)
    init_groups(coords, tp_comm_backend, "cpu" if device == "cpu" else "cuda")
    return coords, device


def run_ranks(config: RunConfig, argv: list[str], rank_main: Callable[[], int]) -> int:
    """As a rank: run `rank_main`. Otherwise: run it here for one rank, or spawn the world's ranks."""
    if under_launcher() or config.world_size == 1:
        shutdown.set_action(shutdown.stopper(config.checkpoint.exit_signal_handler))
        try:
            return rank_main()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    return spawn_local(config.world_size, argv, config)
