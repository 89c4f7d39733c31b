"""How the processes of a run stop: on SIGINT or SIGTERM, with their launcher, or at an iteration all agree on.

Python runs a signal handler in the main thread between two bytecodes, so a rank blocked
in a collective would not see a signal for as long as the collective waits. Here Python's
C-level handler only writes the signal's number to a pipe (`signal.set_wakeup_fd`); a
thread blocked on that pipe acts at once, whatever the main thread is doing:

- a process on its own (the launcher before it starts ranks, a one-rank run, a torchrun
  rank) prints one line and exits 128 + the signal: 130 for SIGINT, 143 for SIGTERM;
- a rank of the local launcher exits the same way without a word: the launcher passed
  the signal on and prints the line;
- with --exit-signal-handler, SIGTERM only sets `requested`; after every iteration the
  training loop agrees on the flag over the world (in the all-reduce of gcompile.stop's
  step flags), so every rank stops after the same iteration, saves, and exits 143
  (Megatron's DistributedSignalHandler).

A rank of the local launcher watches a pipe that only the launcher holds open for writing
(`tie_to_launcher`): at its end of file, however the launcher ended (SIGKILL included),
the rank exits at once, --exit-signal-handler or not: no launcher is left to wait for a
save, and every rank must be gone within seconds.

Helper processes of a tool (a planner's workers, a calibration's ranks) never take a signal
themselves: they are started ignoring SIGINT (`starting_helpers`), and end when their
parent does (`end_with_parent`), whose line is the only one.
"""

import contextlib
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

from gcompile import paths

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
LAUNCHER = "GCOMPILE_LAUNCHER_FD"
"""Environment of a rank started by gcompile.launch.spawn_local: the read end of the launcher's pipe."""

requested = threading.Event()
"""SIGTERM arrived with --exit-signal-handler on: stop after this iteration."""
_action: Callable[[int], None] | None = None
_program: str | None = None
_launcher_ended = threading.Event()
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def exit_status(signum: int) -> int:
    """The shell's status for a process ended by `signum`: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + signum


def name(signum: int) -> str:
    return signal.Signals(signum).name


def install(action: Callable[[int], None], program: str | None = None) -> None:
    """Run `action(signum)` on a thread of its own for every SIGINT and SIGTERM from now on.
    Call once, from the main thread, early; `set_action` changes what is done. `program` names the process in
    its line ("python -m gcompile.plan", as its errors do); by default the script's name."""
    global _action, _program
    _action, _program = action, program
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    for signum in STOP_SIGNALS:
        signal.signal(signum, lambda *_: None)  # the C handler writes to the pipe; the thread acts
    threading.Thread(target=_watch, args=(read,), name="gcompile-signals", daemon=True).start()


def set_action(action: Callable[[int], None]) -> Callable[[int], None] | None:
    """What a signal does from now on; the action it replaces. Without `install` (a test calling
    main() in its own process) nothing watches signals and this only records the action."""
    global _action
    previous, _action = _action, action
    return previous


def _watch(read: int) -> None:
    while True:
        for signum in os.read(read, 64):
            if signum in STOP_SIGNALS and _action is not None:
                _action(signum)


def stopper(exit_signal_handler: bool) -> Callable[[int], None]:
    """The action of a process that trains (or prepares to): defer SIGTERM to the end of the
    iteration with --exit-signal-handler, otherwise exit now (silently under the local launcher)."""
    def act(signum: int) -> None:
        if exit_signal_handler and signum == signal.SIGTERM and launcher_alive():
            requested.set()
            return
        exit_now(signum, quiet=LAUNCHER in os.environ)
    return act


def exit_now(signum: int, quiet: bool = False) -> None:
    """One line on stderr (unless `quiet`), then exit 128 + signum without unwinding the main thread."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, RuntimeError):  # closed, or the main thread is inside a write
            pass
    paths.remove_own_temps()  # what the main thread was writing, half-written
    if not quiet:
        os.write(2, _line(signum).encode())
    os._exit(exit_status(signum))


def stopped(signum: int) -> int:
    """After an orderly stop on `signum`: its line (unless the local launcher prints it); the exit status."""
    if LAUNCHER not in os.environ:
        print(_line(signum), end="", file=sys.stderr, flush=True)
    return exit_status(signum)


def _line(signum: int) -> str:
    return f"{_program or os.path.basename(sys.argv[0])}: stopped by {name(signum)}\n"


def tie_to_launcher() -> None:
    """In a rank started by the local launcher (gcompile.launch, first thing): exit at once, silently, when the
    launcher has ended."""
    launcher = os.environ.get(LAUNCHER)
    if launcher is not None:
        threading.Thread(target=_watch_launcher, args=(int(launcher),), daemon=True, name="launcher").start()


def _watch_launcher(read: int) -> None:
    while os.read(read, 1):  # the launcher writes nothing: this returns when its end closes
        pass
    _launcher_ended.set()
    exit_now(signal.SIGTERM, quiet=True)


def launcher_alive() -> bool:
    """False only in a rank whose local launcher has ended (or one not started by one: True)."""
    return not _launcher_ended.is_set()


@contextlib.contextmanager
def starting_helpers() -> Iterator[None]:
    """Start helper processes inside: they ignore SIGINT for life (an ignored signal stays ignored through fork and
    exec, and Python leaves it so), so a terminal's Ctrl-C, which reaches every process of the job, cannot interrupt
    one before its own code runs (a spawned rank imports torch for seconds first, and printed that import's
    traceback). This process ignores it too meanwhile, the milliseconds it takes (a disposition is the process's: a
    Ctrl-C then is lost, and must be pressed again); a SIGTERM is acted on when the block ends (a spawned child whose
    parent exits before handing it what it runs fails with a traceback of its own)."""
    deferred = []
    action = set_action(deferred.append)
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
        set_action(action)
        if deferred and action is not None:
            action(deferred[0])


def end_with_parent(parent: int) -> None:
    """In a helper process, first thing: end (SIGTERM, silently) when its parent, pid `parent`, ends, at once if it
    already has. A tool stopped by a signal exits without waiting for its helpers, which would work on for nothing."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        os._exit(exit_status(signal.SIGTERM))
