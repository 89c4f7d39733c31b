"""What the cost model knows of a machine: measured rates, as data in a small JSON file.

`python -m gcompile.calibrate` measures them (gcompile/calibrate.py) and writes
`~/.cache/gcompile/machine-<fingerprint>.json`; the fingerprint names what the
rates depend on (processor, cores, memory, GPUs, torch version), so the file is
reused until one of those changes. A file made elsewhere (say on a lent GPU) is
given with `--machine FILE`. The file holds numbers only: loading it runs nothing.

Rates are curves: a matmul of 2e6 FLOPs runs far below the rate of one of 2e9,
so each is a list of (FLOPs per call, FLOP/s) points, read by interpolating in
log(FLOPs). A collective's time is `latency + bytes / bandwidth` per transport,
kind and group size.
"""

import hashlib
import json
import math
import os
import platform
from dataclasses import asdict, dataclass, field

import torch

from gcompile.paths import cache_home

FORMAT = 5
"""Bumped when the file's fields change; an older file is measured again."""


class MachineError(ValueError):
    """A machine file that cannot be used; the message names the file and what to do."""


@dataclass(frozen=True)
class Link:
    """One collective kind on one transport and group size: seconds = latency + bytes / bandwidth."""

    latency: float
    """Seconds of a call that moves (almost) nothing."""
    bandwidth: float
    """Bytes per second of the tensor (the larger of input and output) beyond that."""

    def seconds(self, nbytes: int) -> float:
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class Machine:
    fingerprint: str
    description: str
    """Processor or GPU, cores, torch version: for people reading the file."""
    cores: int
    matmul: dict[str, dict[str, list[list[float]]]]
    """threads ("1", "2", ...; on a GPU "gpu") -> dtype ("float32", "bfloat16") -> [[FLOPs per call, FLOP/s], ...]."""
    attention: dict[str, list[list[float]]]
    """threads -> [[FLOPs per call, FLOP/s], ...] of scaled-dot-product attention, forward and backward."""
    bandwidth: dict[str, float]
    """threads -> bytes per second an element-wise op reads and writes, making a new tensor."""
    inplace_bandwidth: dict[str, float]
    """threads -> the same for one that writes into its input (x.add_(y)): with no new tensor to allocate
    and touch first, about four times as fast on this CPU (an optimizer step is all such ops)."""
    op_seconds: float
    """Host time of one operator call (what a graph of many tiny ops pays per op)."""
    collectives: dict[str, dict[str, dict[str, Link]]]
    """transport ("gloo", "shm", "nccl") -> kind (all_reduce, ..., send_recv) -> group size ("2", ...) -> Link."""
    contention: dict[str, float]
    """ranks computing at once ("1", "2", ...) -> how many times slower each computes than one alone (CPU)."""
    host_contention: dict[str, float]
    """The same for operator calls (host work between kernels), which time slices slow more."""
    waits: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    """transport -> ranks sharing the cores ("2", "4", "8") -> what a rank waits on ("2": an all-reduce of two
    ranks, "4": of four, ..., "send_recv": a message) -> seconds it loses beyond the call's own time, because
    a rank that waits gives up its core and gets one back only when the scheduler next runs it (CPU gloo only:
    shm ranks poll, and on GPUs each rank has its own)."""
    format: int = FORMAT

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str, where: str) -> "Machine":
        try:
            raw = json.loads(text)
            if raw.get("format") != FORMAT:
                raise MachineError(f"machine file {where} has format {raw.get('format', 'none')}, this gcompile "
                                   f"reads {FORMAT}; measure again with: python -m gcompile.calibrate --out {where}")
            raw["collectives"] = {transport: {kind: {size: Link(**link) for size, link in sizes.items()}
                                              for kind, sizes in kinds.items()}
                                  for transport, kinds in raw["collectives"].items()}
            return cls(**raw)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            if isinstance(e, MachineError):
                raise
            raise MachineError(f"machine file {where} is not one gcompile.calibrate wrote ({e}); give one it "
                               f"wrote, or measure this machine into a new one: python -m gcompile.calibrate "
                               f"--out FILE.json") from None

    @property
    def on_gpu(self) -> bool:
        """Measured on a GPU (rates keyed "gpu", collectives over nccl), not on CPU cores."""
        return "gpu" in self.matmul

    def cannot_predict(self, world_size: int) -> str | None:
        """Why this file cannot predict a world of `world_size` ranks, or None: a machine of one GPU measured no
        collectives (nccl needs two GPUs), so it predicts one rank only."""
        if world_size > 1 and not self.collectives:
            return (f"the machine file of {self.description} measured no collectives (one GPU: nccl needs two), so "
                    f"it predicts one rank, not {world_size}; plan for --world-size 1 with it, or measure a machine "
                    f"with more GPUs (python -m gcompile.calibrate)")
        return None

    def extrapolated(self, world_size: int) -> str | None:
        """A note where `world_size` ranks are more than a CPU file measured sharing its cores, or None."""
        if self.on_gpu:
            return None
        most = max(int(k) for k in self.contention)
        if world_size <= most:
            return None
        return (f"note: the machine file measured up to {most} ranks sharing its {self.cores} cores; for "
                f"{world_size}, its slowdowns and waits are grown in proportion from there")

    def threads_key(self, table: dict, threads: int) -> str:
        """The measured thread count nearest below `threads` (a GPU's one entry)."""
        counts = sorted(int(k) for k in table if k.isdigit())
        if not counts:
            return next(iter(table))
        return str(max([c for c in counts if c <= threads] or counts[:1]))

    def matmul_seconds(self, flops: float, dtype: str, threads: int) -> float:
        curves = self.matmul[self.threads_key(self.matmul, threads)]
        return flops / rate_at(curves.get(dtype) or curves["float32"], flops)

    def attention_seconds(self, flops: float, threads: int) -> float:
        return flops / rate_at(self.attention[self.threads_key(self.attention, threads)], flops)

    def pointwise_seconds(self, nbytes: float, threads: int, inplace: bool = False) -> float:
        rates = self.inplace_bandwidth if inplace else self.bandwidth
        return nbytes / rates[self.threads_key(rates, threads)]

    def slowdown(self, ranks: float, host: bool = False) -> float:
        """At `ranks` computing at once (a mean, so fractional): linear between the measured counts; beyond the
        largest, grown in proportion. `host`: of operator calls, not of the arithmetic."""
        points = sorted((int(k), f) for k, f in (self.host_contention if host else self.contention).items())
        return points[0][1] if ranks <= points[0][0] else by_ranks(points, ranks)

    def wait_seconds(self, transport: str, ranks: int, waited: str | int) -> float:
        """What a wait on `waited` (a group size, or "send_recv") costs with `ranks` sharing the cores: linear
        between the measured rank counts, grown in proportion beyond the largest; a group size between the
        measured two and all ranks, linear between those. A transport never measured (shm, whose ranks poll
        and keep their cores; nccl, a GPU each) costs no wait."""
        worlds = self.waits.get(transport, {})
        points = sorted((int(k), self._waited(measured, waited, int(k))) for k, measured in worlds.items())
        return 0.0 if not points or ranks < points[0][0] else by_ranks(points, ranks)

    @staticmethod
    def _waited(measured: dict[str, float], waited: str | int, ranks: int) -> float:
        if waited == "send_recv":
            return measured.get("send_recv", 0.0)
        size = min(int(waited), ranks)
        if size < 2:
            return 0.0
        pair, everyone = measured.get("2", 0.0), measured.get(str(ranks), 0.0)
        return pair if ranks == 2 else pair + (size - 2) / (ranks - 2) * (everyone - pair)

    def link(self, transport: str, kind: str, size: int) -> Link:
        """The measured link, or for a group larger than any measured one the largest, scaled as a ring scales:
        latency by the steps (n - 1), bandwidth by the share each rank moves ((n - 1) / n)."""
        sizes = self.collectives.get(transport, {}).get(kind) or self.collectives["gloo"][kind]
        if str(size) in sizes:
            return sizes[str(size)]
        measured = max(int(s) for s in sizes if int(s) <= size) if any(int(s) <= size for s in sizes) \
            else min(int(s) for s in sizes)
        base = sizes[str(measured)]
        steps = (size - 1) / (measured - 1)
        share = ((size - 1) / size) / ((measured - 1) / measured)
        return Link(base.latency * steps, base.bandwidth / share)


def by_ranks(points: list[tuple[int, float]], ranks: float) -> float:
    """A figure measured at sorted rank counts, at `ranks` from the first count on: linear between the
    measured counts, grown in proportion beyond the largest."""
    for (k0, f0), (k1, f1) in zip(points, points[1:]):
        if ranks <= k1:
            return f0 + (ranks - k0) / (k1 - k0) * (f1 - f0)
    k, f = points[-1]
    return f * ranks / k


def rate_at(curve: list[list[float]], flops: float) -> float:
    """FLOP/s at `flops` per call: linear in log(FLOPs) between measured points, flat beyond them."""
    points = sorted(curve)
    if flops <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if flops <= x1:
            share = (math.log(flops) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + share * (y1 - y0)
    return points[-1][1]


def fingerprint() -> tuple[str, str]:
    """(short hash, description) of what the rates depend on."""
    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    gpus = [torch.cuda.get_device_name(d) for d in range(torch.cuda.device_count())] \
        if torch.cuda.is_available() else []
    description = (f"{cpu}, {os.cpu_count()} cores, {memory / 2 ** 30:.0f} GiB"
                   f"{', ' + ', '.join(gpus) if gpus else ''}, torch {torch.__version__}")
    return hashlib.sha256(description.encode()).hexdigest()[:12], description


def default_path() -> str:
    """Where this machine's file lives: one per fingerprint, so a changed machine is measured again."""
    return os.path.join(cache_home(), f"machine-{fingerprint()[0]}.json")


def missing() -> str:
    """What to say when this machine was never measured."""
    return (f"this machine has no machine file ({default_path()}); measure it once with: "
            f"python -m gcompile.calibrate (75-95 s here)")


def load(path: str | None = None) -> Machine | None:
    """The machine file at `path` (MachineError if it is missing or unreadable), or with no path this
    machine's own, None when it was never measured."""
    if path is None:
        path = default_path()
        if not os.path.exists(path):
            return None
    if os.path.isdir(path):
        raise MachineError(f"machine file {path} is a folder; give the file in it (python -m gcompile.calibrate "
                           f"--out FILE.json writes one)")
    if not os.path.isfile(path):
        raise MachineError(f"no machine file {path}; make one with: python -m gcompile.calibrate --out {path}")
    with open(path) as f:
        return Machine.from_json(f.read(), path)


def cannot_write(path: str) -> str | None:
    """Why `calibrate --out path` could not write there, asked before minutes of measuring: None if it can."""
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if os.path.isdir(path):
        return f"--out {path} is a folder; give a file name, e.g. {os.path.join(path, 'machine.json')}"
    if not os.path.isdir(parent):
        return f"--out {path}: {parent} is a file, not a folder"
    if not os.access(parent, os.W_OK) or os.path.exists(path) and not os.access(path, os.W_OK):
        return f"--out {path}: not writable here; give a path you can write"
    return None


def save(machine: Machine, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    temporary = f"{path}.tmp{os.getpid()}"
    with open(temporary, "w") as f:
        f.write(machine.to_json() + "\n")
    os.replace(temporary, path)
