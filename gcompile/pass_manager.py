"""Run graph passes in order: timed, shape-checked, diffed and dumped.

A pass is `fn(program, ctx) -> program`, registered by name with
`@register_pass("name")` (the built-in ones live in the top-level `passes`
package, which the compiler imports) or given as `pkg.module:function` or
`path/to/file.py:function`. After each pass every stage's
shapes are re-derived from its placeholders, so a pass that leaves the graph
inconsistent fails right there, named, with the passes that ran before it.
"""

import contextlib
import faulthandler
import io
import os
import re
import sys
import threading
import time
import traceback
import typing
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch.fx as fx

from gcompile.config import ConfigError, RunConfig
from gcompile.axes import Coords
from gcompile.launch import under_launcher
from gcompile.log import rank_ranges
from gcompile.program import (Program, broken_convention, diff_counts, dump_text, op_counts, propagate_shapes,
                              refresh_meta)
from gcompile.rank_program import RankProgram, broken_instructions, broken_stage
from gcompile.user_code import UserCodeError, failure_line, load_object, user_frame


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
    """A registered name, `pkg.module:function` (importable from the working folder or PYTHONPATH), or
    `path/to/file.py:function` for a user pass."""
    if ":" in spec:
        try:
            found = load_object(spec, "pass")
        except UserCodeError as e:
            raise PassError(str(e)) from None
        if not callable(found):
            raise PassError(f"pass {spec!r} is a {type(found).__name__}, not a function; a pass is "
                            f"def name(program, ctx) -> program")
        return spec.rpartition(":")[2], found
    if spec not in _REGISTRY:
        raise PassError(f"unknown pass {spec!r}; registered: {', '.join(sorted(_REGISTRY))}")
    return spec, _REGISTRY[spec]


def run_passes(program: Program, specs: list[str], ctx: PassContext, log: Callable[[str], None] = print,
               first_number: int = 1) -> Program:
    """Forward passes in order; with a dump folder, 00_capture.txt first (when `first_number` is 1: these are
    the first passes) and a numbered file after each."""
    if ctx.dump_dir and first_number == 1:
        dump_text(ctx.dump_dir, "00_capture.txt", str(program))
    for number, spec in enumerate(specs, start=first_number):
        name, fn = resolve_pass(spec)
        _check_takes(fn, name, Program, "before lowering, where passes get the forward Program; place it "
                                         "after:lower=... (or after:grad_sync) to get the RankProgram")
        before = _op_counts(program)
        start = time.perf_counter()
        failed = f"pass {number} {name!r} failed{_on_rank(spec, ctx)} (after {' -> '.join(program.history)})"
        try:
            with _watched(spec, ctx, f"pass {number} {name!r}"):
                result = fn(program, ctx)
            _check_returns(result, name, Program)
            for stage in result.stages:
                refresh_meta(stage)
        except PassError:
            raise
        except (Exception, SystemExit) as e:
            hint = " (before lowering a pass gets the forward Program; one over the RankProgram goes " \
                   "after:lower=...)" if isinstance(e, AttributeError) else ""
            raise PassError(f"{failed}: {_raised(e, spec)}{hint}") from e
        if why := broken_convention(result):
            raise PassError(f"pass {number} {name!r} (after {' -> '.join(program.history)}) broke the program: "
                            f"{why}")
        program = result
        program.history.append(name)
        after = _op_counts(program)
        log(f"pass {number:02d} {name} ({(time.perf_counter() - start) * 1e3:.0f} ms): "
            f"{diff_counts(before, after).replace(chr(10), '; ')}")
        if ctx.dump_dir:
            dump_text(ctx.dump_dir, f"{number:02d}_{name}.txt", str(program))
    return program


def run_rank_passes(rank_program: RankProgram, specs: list[str], ctx: PassContext,
                    log: Callable[[str], None] = print, first_number: int = 0) -> RankProgram:
    """Passes over a lowered RankProgram, with what forward passes get: the op-count diff over all of the
    rank's graphs, shapes re-derived for every graph a pass made, history, a numbered dump, and an
    error naming the pass. A pass must not edit a graph of its input in place: ranks share them."""
    for number, spec in enumerate(specs, start=first_number):
        name, fn = resolve_pass(spec)
        _check_takes(fn, name, RankProgram, "after lowering, where passes get the RankProgram; place it "
                                             "before:lower=... to get the forward Program")
        before = _rank_op_counts(rank_program)
        fingerprints = {id(gm): _fingerprint(gm) for gm in _rank_graphs(rank_program)}
        held = _holdings(rank_program)
        start = time.perf_counter()
        history = " -> ".join(rank_program.history)
        try:
            with _watched(spec, ctx, f"rank pass {number} {name!r}"):
                result = fn(rank_program, ctx)
            _check_returns(result, name, RankProgram)
        except PassError:
            raise
        except (Exception, SystemExit) as e:
            raise PassError(f"rank pass {number} {name!r} failed{_on_rank(spec, ctx)} (after {history}): "
                            f"{_raised(e, spec)}") from e
        if _holdings(rank_program) != held:
            raise PassError(f"rank pass {number} {name!r} assigned into the program it was given (after {history}): "
                            f"ranks share its stages, so other ranks would change too: build new ones and return "
                            f"them with dataclasses.replace(program, stages={{**program.stages, s: "
                            f"dataclasses.replace(stage, backward=new)}})")
        if any(_fingerprint(gm) != fingerprints[id(gm)] for gm in _rank_graphs(rank_program)):
            raise PassError(f"rank pass {number} {name!r} edited a graph of the program it was given in place "
                            f"(after {history}); ranks share those graphs, so other ranks would change too: "
                            f"copy.deepcopy the GraphModule, edit the copy, and return it with dataclasses.replace")
        for gm in _rank_graphs(result):
            if id(gm) not in fingerprints and any("val" not in n.meta for n in gm.graph.nodes if n.op != "output"):
                _refresh(gm, name, number, history)
        if why := next(filter(None, map(broken_stage, result.stages.values())), None) or \
                broken_instructions(result):
            raise PassError(f"rank pass {number} {name!r} (after {history}) broke the program: {why}")
        rank_program = replace(result, history=rank_program.history + (name,))
        log(f"rank pass {number:02d} {name} ({(time.perf_counter() - start) * 1e3:.0f} ms): "
            f"{diff_counts(before, _rank_op_counts(rank_program)).replace(chr(10), '; ')}")
        if ctx.dump_dir:
            dump_text(ctx.dump_dir, f"{number:02d}_{name}.txt", str(rank_program))
    return rank_program


def _check_takes(fn: PassFn, name: str, expected: type, where: str) -> None:
    """Refuse a pass whose first parameter is annotated with the other program type than it would get."""
    try:
        first = next(iter(typing.get_type_hints(fn).items()), (None, None))
    except Exception:  # annotations that do not resolve say nothing either way
        return
    takes = first[1] if first[0] != "return" else None
    other = RankProgram if expected is Program else Program
    if takes is other:
        raise PassError(f"pass {name!r} takes a {other.__name__} but is placed {where}")


def _check_returns(result, name: str, expected: type) -> None:
    if not isinstance(result, expected):
        got = "a GraphModule" if isinstance(result, fx.GraphModule) else type(result).__name__
        raise PassError(f"pass {name!r} returned {got}, not the {expected.__name__} it was given: "
                        f"a pass returns the program, changed (e.g. dataclasses.replace(program, stages=...))")


@contextlib.contextmanager
def _watched(spec: str, ctx: PassContext, what: str):
    """A user pass that runs past --hang-timeout-s stops the process with one line naming it and the line of the
    user's code it is at: a pass that loops forever in the launcher, or in a run of one rank, has no other
    watchdog. Where the pass holds the interpreter (stuck inside a C call), faulthandler prints every thread's
    stack at twice the timeout instead."""
    timeout = ctx.config.parallel.hang_timeout_s
    if ":" not in spec or not timeout:
        yield
        return
    timer = threading.Timer(timeout, _stop_hung_pass, (threading.get_ident(), f"{what}{_on_rank(spec, ctx)}",
                                                       timeout))
    timer.daemon = True
    timer.start()
    try:
        faulthandler.dump_traceback_later(2 * timeout, exit=True, file=sys.__stderr__)
        backstop = True
    except (AttributeError, ValueError, io.UnsupportedOperation):  # no standard error to write it to
        backstop = False
    try:
        yield
    finally:
        timer.cancel()
        if backstop:
            faulthandler.cancel_dump_traceback_later()


def _stop_hung_pass(thread: int, what: str, timeout: float) -> None:
    frame = sys._current_frames().get(thread)
    user = user_frame(traceback.extract_stack(frame)) if frame is not None else None
    at = f", at {user.filename}:{user.lineno} in {user.name}" if user else ""
    os.write(2, f"{os.path.basename(sys.argv[0])}: error: {what} has run for {timeout:g} s (--hang-timeout-s)"
                f"{at}; stopped\n".encode())
    os._exit(1)


def _on_rank(spec: str, ctx: PassContext) -> str:
    """" on rank 1 (pp0 dp0 tp1)" for a user pass (which may act on one rank alone), or " for rank 1 (pp0 dp0
    tp1) in the launcher" where the launcher builds that rank's program to check the plan; "" for a built-in
    one."""
    if ":" not in spec:
        return ""
    return f" for rank {ctx.coords.rank} {ctx.coords} in the launcher" if _in_launcher(ctx) else \
        f" on rank {ctx.coords.rank} {ctx.coords}"


def _in_launcher(ctx: PassContext) -> bool:
    """Whether this process builds ranks' programs for a world it will start (not a rank of it)."""
    return ctx.config.world_size > 1 and not under_launcher()


RANK_ENVIRONMENT = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun and gcompile's launcher tell a rank, and the launcher itself lacks."""


def _raised(error: BaseException, spec: str) -> str:
    """What a pass raised, in one line; for a user pass at the line of the user's code it came from
    (gcompile.user_code.failure_line)."""
    if isinstance(error, SystemExit):
        return f"it called sys.exit({error.code!r}); a pass returns the program, or raises to stop the run"
    if ":" not in spec:
        return f"{type(error).__name__}: {error}"
    if isinstance(error, KeyError) and error.args and error.args[0] in RANK_ENVIRONMENT:
        return f"{failure_line(error)} (the launcher runs every pass before the ranks start, without the ranks' " \
               f"environment: read the rank from ctx.coords, e.g. ctx.coords.rank)"
    return failure_line(error)


def _holdings(program: RankProgram) -> list:
    """Which stage objects and graphs a rank program holds: a pass that assigns into them (stages[s] = ...,
    stage.backward = ...) edits what the ranks share as surely as one that edits a graph."""
    return [(s, id(stage), [(name, id(gm)) for name, gm in stage.graphs().items()])
            for s, stage in program.stages.items()] + [id(program.optimizer)]


def _fingerprint(gm: fx.GraphModule) -> list:
    """What an edit of a graph changes: its nodes, their targets and arguments (cheaper than its code)."""
    return [(node, node.target, node.args, node.kwargs) for node in gm.graph.nodes]


def _refresh(gm: fx.GraphModule, name: str, number: int, history: str) -> None:
    """Derive the shapes of a graph a rank pass made and left without them; a placeholder without a
    fake value is named."""
    for node in gm.graph.find_nodes(op="placeholder"):
        if "val" not in node.meta:
            raise PassError(f"rank pass {number} {name!r} (after {history}) added input {node.name} without "
                            f"meta['val']: give a new placeholder a fake tensor of its shape")
    try:
        propagate_shapes(gm)
    except Exception as e:
        raise PassError(f"rank pass {number} {name!r} (after {history}) left a graph whose shapes do not "
                        f"propagate: {type(e).__name__}: {e}") from e


def _rank_graphs(program: RankProgram) -> list[fx.GraphModule]:
    """Every graph a rank program holds, each once."""
    graphs = {id(gm): gm for stage in program.stages.values() for gm in stage.graphs().values()}
    graphs[id(program.optimizer.graph)] = program.optimizer.graph
    return list(graphs.values())


def _rank_op_counts(program: RankProgram) -> Counter:
    total = Counter()
    for gm in _rank_graphs(program):
        total.update(op_counts(gm))
    return total


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
DUMP_INDEX = "index.txt"
"""Which ranks share each rank folder of a --dump-only (gcompile.inspect reads it)."""


def clear_rank_dump(dump_dir: str) -> None:
    """Remove an earlier build's files from a rank's dump folder: a dump is of one run, and
    numbered files of another layout would read as steps of this one. Other files stay."""
    if os.path.isdir(dump_dir):
        for name in os.listdir(dump_dir):
            if DUMP_FILE.fullmatch(name):
                os.remove(os.path.join(dump_dir, name))


def clear_stale_dumps(root: str, ranks: Iterable[int]) -> None:
    """Before `ranks` dump into `root`: clear the folders of every other rank (a larger earlier world's, or
    one a --dump-only of distinct programs gives no folder) and an earlier --dump-only's plan.txt and
    index.txt, so that the folder holds one run."""
    if not os.path.isdir(root):
        return
    ranks, ours = set(ranks), []
    for name, first in (("plan.txt", "plan checked: "), (DUMP_INDEX, "rank")):
        path = os.path.join(root, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                if f.read(len(first)) != first.encode():  # a user's own file of that name: a dump would write over it
                    raise ConfigError(f"--dump-graphs {root} holds {name}, which no dump wrote; give an empty folder "
                                      f"or one a dump wrote, or move the file")
            ours.append(path)
    for name in os.listdir(root):  # only once refusing is ruled out: a refusal leaves the folder as it was
        match = RANK_FOLDER.fullmatch(name)
        if match and int(match.group(1)) not in ranks:
            folder = os.path.join(root, name)
            clear_rank_dump(folder)
            if not os.listdir(folder):
                os.rmdir(folder)
    for path in ours:
        os.remove(path)


def write_dump_index(root: str, shared_by: dict[int, tuple[int, ...]]) -> None:
    """DIR/index.txt: a line per rank folder naming the ranks that run its program (`rank513: ranks 513,521,...,1017`),
    for gcompile.inspect to find the folder of a rank that has none."""
    dump_text(root, DUMP_INDEX, "".join(f"rank{rank}: {rank_ranges(ranks)}\n" for rank, ranks in shared_by.items()))
