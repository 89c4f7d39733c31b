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

import functools
import hashlib
import json
import math
import os
import platform
from dataclasses import MISSING, asdict, dataclass, field, fields

import torch

from gcompile.paths import cache_home, file_in_the_way, temp_name, write_replacing

FORMAT = 5
"""Bumped when the file's fields change; an older file is measured again."""
KINDS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")
"""Collectives measured per transport and group size (with send_recv in a world of two)."""


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
        """The file's machine; MachineError naming the first field no measurement gives (a file damaged or
        edited by hand would otherwise predict negative or NaN times, or fail deep in a prediction)."""
        try:
            raw = _ours(text)
        except _Foreign as e:  # not --out to it: that would measure over the user's file
            raise MachineError(f"{where} is not a machine file: {e}; give a file python -m gcompile.calibrate "
                               f"wrote, or measure this machine with: python -m gcompile.calibrate") from None
        again = f"measure the machine it describes again: python -m gcompile.calibrate --out {where}"
        if raw["format"] != FORMAT:
            raise MachineError(f"machine file {where} has format {json.dumps(raw['format'])[:20]}, this "
                               f"gcompile reads {FORMAT}; {again}")
        try:
            _check(raw)
        except _Unfit as e:
            raise MachineError(f"machine file {where} is not one gcompile.calibrate wrote: {e}; {again}") from None
        raw["collectives"] = {transport: {kind: {size: Link(**link) for size, link in sizes.items()}
                                          for kind, sizes in kinds.items()}
                              for transport, kinds in raw["collectives"].items()}
        return cls(**raw)

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


class _Foreign(ValueError):
    """A file no calibration wrote, in any format: why."""


def _ours(text: str) -> dict:
    """The JSON object of a file calibration wrote, whatever its format or damage: every format has held a
    whole-number format and a text fingerprint. _Foreign if it is not one (a config, a README, another tool's JSON)."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise _Foreign(f"it is not JSON ({e})") from None
    except (ValueError, RecursionError):  # a number of thousands of digits, or brackets thousands deep
        raise _Foreign("it is not JSON calibration writes (a number or nesting far too long to read)") from None
    if not isinstance(raw, dict) or type(raw.get("format")) is not int or not isinstance(raw.get("fingerprint"), str):
        raise _Foreign("it is JSON without the format and fingerprint every machine file holds")
    return raw


LARGEST = 1 << 20
"""Characters of a file read to tell whether it is a machine file: one is a few KiB (a GPU's with collectives more)."""


def foreign(path: str) -> str | None:
    """Why the file at `path` is none calibration wrote, so that calibrating must not write over it; None where there
    is no file, or one of ours, even damaged or of an older format: measuring again is what mends it."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(LARGEST)  # a longer file is cut, not JSON, not ours: a data file is not read whole
    except UnicodeDecodeError:
        return "it is not text"
    except OSError as e:
        return f"it cannot be read ({e.strerror or e})"
    try:
        _ours(text)
    except _Foreign as e:
        return str(e)
    return None


class _Unfit(ValueError):
    """A field of a loaded machine file that no measurement gives: where it is in the file, and what it holds."""


def _check(raw) -> None:
    """_Unfit naming the first field of `raw` (a loaded file) that calibration cannot have written: every field
    there, each rate positive, each time and wait finite and not negative, keys the counts they stand for, and
    on CPU every collective of gloo measured (what predictions fall back on)."""
    required = {f.name for f in fields(Machine) if f.default is MISSING and f.default_factory is MISSING}
    if missing := sorted(required - raw.keys()):
        raise _Unfit(f"it has no {', '.join(missing)}")
    if unknown := sorted(raw.keys() - {f.name for f in fields(Machine)}):
        raise _Unfit(f"it has fields no machine file has ({', '.join(unknown)[:80]})")
    for name in ("fingerprint", "description"):
        if not isinstance(raw[name], str):
            raise _Unfit(f"{name} is not text")
    if type(raw["cores"]) is not int or raw["cores"] < 1:
        raise _Unfit(f"cores is {_shown(raw['cores'])}, not a whole number of at least 1")
    threads, ranks = _Counts(1, "gpu"), _Counts(1)
    curves = functools.partial(_table, keys=None, check=_curve)
    _table(raw["matmul"], "matmul", threads, curves)
    if lacking := [key for key, by_dtype in raw["matmul"].items() if "float32" not in by_dtype]:
        raise _Unfit(f"matmul.{lacking[0]} has no float32 curve (what other dtypes fall back on)")
    _table(raw["attention"], "attention", threads, _curve)
    for name in ("bandwidth", "inplace_bandwidth"):
        _table(raw[name], name, threads, _positive)
    _number(raw["op_seconds"], "op_seconds", positive=False)
    for name in ("contention", "host_contention"):
        _table(raw[name], name, ranks, _positive)
    links = functools.partial(_table, keys=_Counts(2), check=_link)
    _table(raw["collectives"], "collectives", None, functools.partial(_table, keys=set(KINDS) | {"send_recv"},
                                                                        check=links), empty=True)
    gpu = "gpu" in raw["matmul"]
    needed = () if gpu and not raw["collectives"] else (*KINDS, "send_recv")
    default = "nccl" if gpu else "gloo"
    if lacking := [kind for kind in needed if kind not in raw["collectives"].get(default, {})]:
        raise _Unfit(f"collectives.{default} has no {', '.join(lacking)}")
    waited = functools.partial(_table, keys=_Counts(2, "send_recv"), check=functools.partial(_number, positive=False))
    _table(raw.get("waits", {}), "waits", None, functools.partial(_table, keys=_Counts(2), check=waited), empty=True)


def _table(value, path: str, keys, check, empty: bool = False) -> None:
    """An object (empty only where `empty`) whose keys are in `keys` (None: any), each value passing `check`."""
    if not isinstance(value, dict) or not value and not empty:
        raise _Unfit(f"{path} is {_shown(value)}, not {'an' if empty else 'a non-empty'} object")
    for key, item in value.items():
        if keys is not None and key not in keys:
            raise _Unfit(f"{path} has the key {_shown(key)}, which is not {getattr(keys, 'means', 'one it has')}")
        check(item, f"{path}.{key}")


class _Counts:
    """Keys that are whole numbers of at least `least` ("2"), or one of `words`."""

    def __init__(self, least: int, *words: str):
        self.least, self.words = least, words
        self.means = f"a count of at least {least}" + "".join(f" or {w}" for w in words)

    def __contains__(self, key: str) -> bool:
        return key in self.words or key.isascii() and key.isdigit() and int(key) >= self.least


def _curve(value, path: str) -> None:
    if not isinstance(value, list) or not value or \
            not all(isinstance(point, list) and len(point) == 2 for point in value):
        raise _Unfit(f"{path} is not a list of [FLOPs, FLOP/s] points")
    for i, (flops, rate) in enumerate(value):
        _positive(flops, f"{path}[{i}][0]")
        _positive(rate, f"{path}[{i}][1]")


def _link(value, path: str) -> None:
    if not isinstance(value, dict) or sorted(value) != ["bandwidth", "latency"]:
        raise _Unfit(f"{path} is not a latency and a bandwidth")
    _number(value["latency"], f"{path}.latency", positive=False)
    _positive(value["bandwidth"], f"{path}.bandwidth")


def _positive(value, path: str) -> None:
    _number(value, path, positive=True)


def _number(value, path: str, positive: bool) -> None:
    usable = type(value) in (int, float) and abs(value) < 1e300 and math.isfinite(value) and \
        (value > 0 if positive else value >= 0)  # abs() first: no float() of a 400-digit int
    if not usable:
        raise _Unfit(f"{path} is {_shown(value)}, not a {'positive' if positive else 'non-negative'} finite number")


def _shown(value) -> str:
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else str(value)
    return text if len(text) <= 24 else text[:20] + "..."


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
    memory = ram_bytes()
    gpus = [torch.cuda.get_device_name(d) for d in range(torch.cuda.device_count())] \
        if torch.cuda.is_available() else []
    description = (f"{cpu}, {os.cpu_count()} cores, {memory / 2 ** 30:.0f} GiB"
                   f"{', ' + ', '.join(gpus) if gpus else ''}, torch {torch.__version__}")
    return hashlib.sha256(description.encode()).hexdigest()[:12], description


def ram_bytes() -> int:
    """This machine's memory (0 where the OS does not say)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0


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
    if not path:
        raise MachineError("--machine '' names no file; give a machine file (python -m gcompile.calibrate --out "
                           "FILE.json writes one), or leave --machine out for this machine's own")
    if os.path.isdir(path):
        raise MachineError(f"machine file {path} is a folder; give the file in it (python -m gcompile.calibrate "
                           f"--out FILE.json writes one)")
    if not os.path.exists(path):
        raise MachineError(f"no machine file {path}; make one with: python -m gcompile.calibrate --out {path}")
    if not os.path.isfile(path):  # a pipe or a device would be read until it ends, maybe never
        raise MachineError(f"machine file {path} is not a regular file; give the file python -m gcompile.calibrate "
                           f"--out FILE.json wrote")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise MachineError(f"machine file {path} cannot be read ({e}); give the file python -m gcompile.calibrate "
                           f"--out FILE.json wrote") from None
    return Machine.from_json(text, path)


def cannot_write(path: str) -> str | None:
    """Why no machine file can be written at `path`, asked before minutes of measuring: None if it can (its
    folder made, a file opened in it and removed)."""
    if not path or path.endswith(("/", os.sep)):
        return "that names no file; give a file name, e.g. machine.json"
    if os.path.isdir(path):
        return f"that is a folder; give a file name, e.g. {os.path.join(path, 'machine.json')}"
    if os.path.exists(path) and not os.path.isfile(path):
        return "that is not a regular file (a device or a pipe); give a file name"
    if blocker := file_in_the_way(path, folder=False):
        return f"{blocker} is a file where a folder should be; give a path whose folders are folders"
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
        with open(trial := temp_name(path), "w"):
            pass
        os.remove(trial)
    except OSError as e:
        return f"cannot write there ({e.strerror or e}); give a path in a folder you can write"
    return None


def save(machine: Machine, path: str) -> None:
    write_replacing(path, machine.to_json() + "\n")
