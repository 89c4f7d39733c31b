"""A flight recorder: what each rank is doing, in a small text file per rank that the launcher reads.

RUN_DIR/flight/rankR.txt has fixed-width lines; the rank maps the file into memory and
overwrites a line in place (a memory copy, no system call) when it enters a phase and when
it starts and finishes an instruction (gcompile.runtime) or a collective it waits on:

    progress              217
    phase                 iteration 12
    instruction started   @215 05 B        stage=0 mb=1  backward  saved[s0,mb1], grad[s1,mb1] -> ...
    instruction finished  @211 04 F        stage=0 mb=1  forward   batch[mb1] -> act[s0,mb1], ...
    collective started    @216 RECV_B   stage=0 mb=1  grad[s1,mb1] from rank 1 (group pp)
    collective finished   @209 all_reduce of the loss over dp

`progress` counts the records; a started entry whose @number differs from the finished one
is still running. Collectives inside a graph (tensor parallel) belong to the instruction
that runs the graph. The local launcher's `Watchdog` reads every rank's `progress` each
second; when none has moved for --hang-timeout-s it prints `report` and stops the job.
`cat` reads a file, during a run or after it.
"""

import mmap
import os
import re
import time

FIELDS = ("progress", "phase", "instruction started", "instruction finished", "collective started",
          "collective finished")
_LABEL = 22
_WIDTH = 200
_LINE = _LABEL + _WIDTH + 1


RANK_FILE = re.compile(r"rank\d+\.txt")


def rank_file(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank{rank}.txt")


def flight_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "flight")


class FlightRecorder:
    """One rank's file; `FlightRecorder(None)` records nothing (runs without a run dir, tests)."""

    def __init__(self, path: str | None):
        self._map = None
        self._count = 0
        self._started = {}
        """kind -> the text of its last started entry, @number included."""
        if path is None:
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w+b") as f:
            f.write(b"".join(name.ljust(_LABEL).encode() + b" " * _WIDTH + b"\n" for name in FIELDS))
            f.flush()
            self._map = mmap.mmap(f.fileno(), len(FIELDS) * _LINE)
        self._put("progress", "0")

    def phase(self, text: str) -> None:
        """What the rank does between instruction lists: compiling, iteration N, saving."""
        if self._map is not None:
            self._put("phase", text)

    def start(self, kind: str, text: str) -> None:
        """`kind` ("instruction" or "collective") `text` begins."""
        if self._map is None:
            return
        self._started[kind] = f"@{self._count + 1} {text}"
        self._put(f"{kind} started", self._started[kind])

    def finish(self, kind: str) -> None:
        """The last started `kind` has ended."""
        if self._map is None:
            return
        self._put(f"{kind} finished", self._started[kind])

    def _put(self, field: str, text: str) -> None:
        self._count += 1
        start = FIELDS.index(field) * _LINE + _LABEL
        self._map[start:start + _WIDTH] = text.encode(errors="replace")[:_WIDTH].ljust(_WIDTH)
        start = _LABEL  # progress is the first line
        self._map[start:start + _WIDTH] = str(self._count).encode().ljust(_WIDTH)


NO_RECORDER = FlightRecorder(None)


def read(path: str) -> dict[str, str] | None:
    """A rank's record by field; None if the rank has not written one yet."""
    try:
        with open(path, "rb") as f:
            lines = f.read().decode(errors="replace").split("\n")
    except FileNotFoundError:
        return None
    return {name: line[_LABEL:].strip() for name, line in zip(FIELDS, lines)}


def running(record: dict[str, str], kind: str) -> bool:
    """Whether the rank is inside the last `kind` it started."""
    return record[f"{kind} started"] not in ("", record[f"{kind} finished"])


class Watchdog:
    """Notices when no rank's `progress` has moved for `timeout_s`, counted from the first record."""

    def __init__(self, folder: str, world_size: int, timeout_s: float):
        self.folder, self.world_size, self.timeout_s = folder, world_size, timeout_s
        self.seen, self.since, self.checked = None, None, 0.0

    def clear(self) -> None:
        """Remove records of an earlier run, so that none is read as this one's (a larger world's too)."""
        for name in os.listdir(self.folder) if os.path.isdir(self.folder) else ():
            if RANK_FILE.fullmatch(name):
                try:
                    os.remove(os.path.join(self.folder, name))
                except FileNotFoundError:
                    pass

    def hung(self) -> bool:
        now = time.monotonic()
        if not self.timeout_s or now - self.checked < 1.0:
            return False
        self.checked = now
        progress = [(read(rank_file(self.folder, r)) or {}).get("progress") for r in range(self.world_size)]
        if progress != self.seen:
            self.seen, self.since = progress, now if any(progress) else None
        return self.since is not None and now - self.since > self.timeout_s


def report(watchdog: Watchdog, names: list[str], notes: list[str]) -> str:
    """Where every rank was, one line each (`names[r]` its coordinates, `notes[r]` what its process
    is: "" or e.g. "process stopped"), after a line saying why the job stops and one naming the rank
    to look at: a stopped process, else the ranks not waiting in a collective."""
    lines, waiting = [], []
    for rank in range(watchdog.world_size):
        record = read(rank_file(watchdog.folder, rank))
        where = f"rank {rank} {names[rank]}" + (f" [{notes[rank]}]" if notes[rank] else "")
        if record is None:
            lines.append(f"  {where}: no record yet (still starting)")
            continue
        if running(record, "collective"):
            waiting.append(rank)
        field = {name: " ".join(value.split()) or "-" for name, value in record.items()}  # one space apart
        lines.append(f"  {where}: {field['phase']}; "
                     f"instruction started {field['instruction started']}"
                     f"{' (running)' if running(record, 'instruction') else ''}, "
                     f"finished {field['instruction finished']}; "
                     f"collective started {field['collective started']}{' (waiting)' if rank in waiting else ''}, "
                     f"finished {field['collective finished']}")
    stopped = [r for r, note in enumerate(notes) if note]
    others = [r for r in range(watchdog.world_size) if r not in waiting]
    if stopped:
        culprit = f"the stalled rank: {', '.join(map(str, stopped))} ({notes[stopped[0]]})"
    elif waiting and others:
        culprit = f"not waiting in a collective, so look there first: rank {', '.join(map(str, others))}"
    elif waiting:
        culprit = "every rank waits in a collective: they disagree on the next one"
    else:
        culprit = "no rank waits in a collective of the runtime's: compare their phases (a graph's or a save's wait)"
    head = (f"no rank made progress for {watchdog.timeout_s:g} s (--hang-timeout-s); stopping every rank. "
            f"{culprit}. Last records ({watchdog.folder}/rankR.txt):")
    return "\n".join([head] + lines)
