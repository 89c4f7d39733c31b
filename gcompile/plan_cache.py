"""What the planner worked out, kept between runs: a layout predicted before, on the same machine file by the
same code, is not built again.

Planning builds every candidate (tiny for 1024 ranks: about a minute and a half here), and `run_gpt.py
--auto-layout` after `python -m gcompile.plan` would build them all again. What the planner keeps of a build
is five numbers: the predicted totals and the largest rank's memory. They live in one JSON file (nothing in it
is code), each under a hash of what decides it: the candidate's model, parallel and train sections (less what
no build reads, UNREAD) and the machine file. The file holds one version of gcompile's source (its passes
too) and of torch, and starts afresh when either changes. A plan of the user's own code (a model or passes
from a file) is never kept: nothing here can tell when that code changes. Validation is not kept either: it
takes a second for every candidate of 1024 ranks, and it reads more than those sections (data files, folders).
"""

import dataclasses
import functools
import hashlib
import json
import math
import os

import torch

import passes
from gcompile.config import RunConfig
from gcompile.cost_model import StepTime
from gcompile.models import is_users
from gcompile.paths import cache_home, write_replacing

FORMAT = 1
"""Bumped when an entry's fields change."""

Known = dict[str, tuple[StepTime, int]]
"""Layout key -> (predicted totals, largest rank's estimated peak bytes)."""


def default_path() -> str:
    return os.path.join(cache_home(), "plans.json")


@functools.cache
def code_version() -> str:
    """gcompile's source and its built-in passes', every file, and torch's version: a changed pass or cost model
    predicts anew."""
    digest = hashlib.sha256(f"{FORMAT} {torch.__version__}".encode())
    for package in (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.abspath(passes.__file__))):
        sources = sorted(os.path.relpath(os.path.join(folder, name), package)
                         for folder, _, names in os.walk(package) for name in names if name.endswith(".py"))
        for source in sources:
            with open(os.path.join(package, source), "rb") as f:
                digest.update(f"{os.path.basename(package)}/{source}".encode() + b"\0" + f.read() + b"\0")
    return digest.hexdigest()


UNREAD = {"train": ("train_iters", "lr", "min_lr", "lr_warmup_iters", "lr_decay_iters", "lr_decay_style", "seed",
                    "eval_interval", "eval_iters"),
          "parallel": ("memory_budget_gb", "distributed_timeout_minutes", "hang_timeout_s")}
"""Fields no build reads (the learning rate is the runtime's state, not a constant of a graph): a run of other
length, learning rate or budget takes the same predictions."""


def layout_key(config: RunConfig, machine_text: str, launched: tuple) -> str | None:
    """The key of a candidate's prediction on the machine file `machine_text`, its ranks launched so
    (gcompile.cost_model.launched: threads, shared-memory tp); None for the user's own code."""
    if is_users(config.model) or config.parallel.passes:
        return None
    decides = config.without(UNREAD)
    parallel = decides.parallel if decides.parallel.cp > 1 else dataclasses.replace(decides.parallel, cp_comm_type="")
    decides = repr((decides.model, parallel, decides.train, launched))  # cp 1 has no comm type: any is the same
    return hashlib.sha256(f"{decides}\n{machine_text}".encode()).hexdigest()


class PlanCache:
    """The file at `path`, read once; `added` is written back by `save`, merged with what others wrote since."""

    def __init__(self, path: str | None = None):
        self.path = path or default_path()
        self.known: Known = {}
        self.added: Known = {}
        self.unread: str | None = None
        """Why the file could not be used, where one exists that is not a plan cache (or a folder)."""
        try:
            self.known = _read(self.path)
        except (FileNotFoundError, NotADirectoryError):  # none yet; `save` says why where it cannot make one
            pass
        except IsADirectoryError:
            self.unread = f"{self.path} is a folder, so no plan is kept; remove it to keep them"
        except _NotRegular:
            self.unread = f"{self.path} is not a regular file (a pipe or a device), so no plan is kept; remove it " \
                          f"to keep them"
        except (OSError, ValueError) as e:
            self.unread = f"{self.path} is not a plan cache gcompile can read ({e}); it will be replaced"

    def save(self) -> str | None:
        """Write what was added; None, or why it could not be (the plan stands, it is only not kept)."""
        if not self.added or os.path.exists(self.path) and not os.path.isfile(self.path):  # `unread` said why
            return None
        try:
            entries = _read(self.path)
        except (OSError, ValueError):
            entries = {}
        entries.update((key, (step, memory)) for key, (step, memory) in self.added.items()  # what `_read` takes
                       if _is_prediction({**dataclasses.asdict(step), "memory": memory}))
        text = json.dumps({"format": FORMAT, "code": code_version(), "entries": {
            key: {**dataclasses.asdict(step), "memory": memory} for key, (step, memory) in entries.items()}})
        try:
            write_replacing(self.path, text)
        except OSError as e:
            return f"the plan was not kept for next time: {e}"
        return None


class _NotRegular(OSError):
    """A plan cache path that holds a pipe or a device: reading it could wait for ever."""


def _read(path: str) -> Known:
    """The entries of the file at `path` for this code ({} for another version's); ValueError when it is not a
    plan cache, or one entry is not a prediction this code could have made (its ranking would be wrong)."""
    if os.path.exists(path) and not os.path.isdir(path) and not os.path.isfile(path):
        raise _NotRegular(path)
    with open(path) as f:
        try:
            raw = json.load(f)
        except RecursionError:
            raise ValueError("nested too deeply for JSON this code writes") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("entries"), dict):
        raise ValueError('not an object with "entries"')
    if raw.get("format") != FORMAT or raw.get("code") != code_version():
        return {}
    known = {}
    for key, entry in raw["entries"].items():
        if not _is_prediction(entry):
            raise ValueError(f"entry {key[:12]} is not a prediction: five numbers of the sizes one has")
        step = StepTime(*(entry[name] for name in StepTime.__dataclass_fields__))
        known[key] = step, entry["memory"]
    return known


def _is_prediction(entry) -> bool:
    """Five finite numbers, none negative, the bubble a fraction, the step its two parts, the memory whole bytes."""
    names = (*StepTime.__dataclass_fields__, "memory")
    if not isinstance(entry, dict) or any(type(entry.get(name)) not in (int, float) for name in names):
        return False
    if not all(0 <= entry[name] < 1e30 for name in names):  # no float() of a 400-digit int: no OverflowError
        return False
    return isinstance(entry["memory"], int) and entry["bubble_fraction"] <= 1 and math.isclose(
        entry["step_seconds"], entry["pipeline_seconds"] + entry["optimizer_seconds"], rel_tol=1e-9)
