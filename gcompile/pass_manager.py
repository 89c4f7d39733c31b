"""Run graph passes in order: timed, shape-checked, diffed and dumped.

A pass is `fn(program, ctx) -> program`, registered by name with
`@register_pass("name")` (the built-in ones live in the top-level `passes`
package) or given as `pkg.module:function`. After each pass every stage's
shapes are re-derived from its placeholders, so a pass that leaves the graph
inconsistent fails right there, named, with the passes that ran before it.
"""

import importlib
import os
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from gcompile.config import RunConfig
from gcompile.axes import Coords
from gcompile.program import Program, diff_counts, dump_text, op_counts, refresh_meta


@dataclass(frozen=True)
class PassContext:
    config: RunConfig
    coords: Coords
    """The rank whose program is being built."""
    dump_dir: str | None = None
    """This rank's dump folder, or None."""


PassFn = Callable[[Program, PassContext], Program]
_REGISTRY: dict[str, PassFn] = {}


class PassError(RuntimeError):
    """A pass failed or broke the program; the message names it and the passes before it."""


def register_pass(name: str) -> Callable[[PassFn], PassFn]:
    def register(fn: PassFn) -> PassFn:
        _REGISTRY[name] = fn
        return fn
    return register


def resolve_pass(spec: str) -> tuple[str, PassFn]:
    """A registered name, or `pkg.module:function` for a user pass."""
    if ":" in spec:
        module_name, _, fn_name = spec.partition(":")
        try:
            fn = getattr(importlib.import_module(module_name), fn_name)
        except (ImportError, AttributeError) as e:
            raise PassError(f"pass {spec!r} cannot be loaded: {e}") from None
        return fn_name, fn
    importlib.import_module("passes")  # registers the built-in passes
    if spec not in _REGISTRY:
        raise PassError(f"unknown pass {spec!r}; registered: {', '.join(sorted(_REGISTRY))}")
    return spec, _REGISTRY[spec]


def run_passes(program: Program, specs: list[str], ctx: PassContext, log: Callable[[str], None] = print) -> Program:
    if ctx.dump_dir:
        dump_text(ctx.dump_dir, "00_capture.txt", str(program))
    for number, spec in enumerate(specs, start=1):
        name, fn = resolve_pass(spec)
        before = _op_counts(program)
        start = time.perf_counter()
        try:
            program = fn(program, ctx)
            for stage in program.stages:
                refresh_meta(stage)
        except Exception as e:
            raise PassError(f"pass {number} {name!r} failed (after {' -> '.join(program.history)}): "
                            f"{type(e).__name__}: {e}") from e
        program.history.append(name)
        after = _op_counts(program)
        log(f"pass {number:02d} {name} ({(time.perf_counter() - start) * 1e3:.0f} ms): "
            f"{diff_counts(before, after).replace(chr(10), '; ')}")
        if ctx.dump_dir:
            dump_text(ctx.dump_dir, f"{number:02d}_{name}.txt", str(program))
    return program


def run_rank_passes(rank_program, specs: list[str], ctx: PassContext, log: Callable[[str], None] = print,
                    first_number: int = 0):
    """Passes over a lowered RankProgram (same registry, same contract, one level down); dumped whole."""
    for number, spec in enumerate(specs, start=first_number):
        name, fn = resolve_pass(spec)
        start = time.perf_counter()
        try:
            rank_program = fn(rank_program, ctx)
        except Exception as e:
            raise PassError(f"rank pass {name!r} failed: {type(e).__name__}: {e}") from e
        log(f"rank pass {name} ({(time.perf_counter() - start) * 1e3:.0f} ms)")
        if ctx.dump_dir:
            dump_text(ctx.dump_dir, f"{number:02d}_{name}.txt", str(rank_program))
    return rank_program


def _op_counts(program: Program) -> Counter:
    total = Counter()
    for stage in program.stages:
        total.update(op_counts(stage.graph))
    return total


def rank_dump_dir(root: str | None, rank: int) -> str | None:
    return os.path.join(root, f"rank{rank}") if root else None


DUMP_FILE = re.compile(r"\d\d_\w+\.txt|inductor_[\w.]+\.py|schedule\.txt|summary\.txt")
"""What a build writes into a rank's dump folder."""
RANK_FOLDER = re.compile(r"rank(\d+)")


def clear_rank_dump(dump_dir: str) -> None:
    """Remove an earlier build's files from a rank's dump folder: a dump is of one run, and
    numbered files of another layout would read as steps of this one. Other files stay."""
    if os.path.isdir(dump_dir):
        for name in os.listdir(dump_dir):
            if DUMP_FILE.fullmatch(name):
                os.remove(os.path.join(dump_dir, name))


def clear_stale_dumps(root: str, world_size: int) -> None:
    """Before a world of `world_size` ranks dumps into `root`: clear the folders of ranks it does not
    have (a larger earlier world's) and an earlier --dump-only's plan.txt."""
    if not os.path.isdir(root):
        return
    for name in os.listdir(root):
        match = RANK_FOLDER.fullmatch(name)
        if match and int(match.group(1)) >= world_size:
            folder = os.path.join(root, name)
            clear_rank_dump(folder)
            if not os.listdir(folder):
                os.rmdir(folder)
    if os.path.isfile(os.path.join(root, "plan.txt")):
        os.remove(os.path.join(root, "plan.txt"))
