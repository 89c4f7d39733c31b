"""User code named on the command line (`pkg.module:name` or `path/to/file.py:name`), imported on request.

Passes (`--passes`) and models (`--arch`) are code the user asked to run; nothing else a run
loads (a checkpoint, data, a preset's values) is imported. A name that cannot be loaded is a
`UserCodeError` whose one line points into the user's file.
"""

import difflib
import importlib
import importlib.util
import os
import re
import sys
import sysconfig
import traceback


class UserCodeError(ValueError):
    """The named code cannot be loaded; the message says why, in one line."""


def load_object(spec: str, what: str):
    """The object `spec` names; `what` ("pass", "model") words the errors."""
    module_name, _, name = spec.rpartition(":")
    try:
        module = _load_file(module_name) if module_name.endswith(".py") else importlib.import_module(module_name)
        _claim(module)
    except FileNotFoundError:
        raise UserCodeError(f"{what} {spec!r} cannot be loaded: no file {module_name}") from None
    except ModuleNotFoundError as e:
        if module_name.endswith(".py") or not _names_module(e, module_name):  # a module the user's code imports
            raise UserCodeError(f"{what} {spec!r} cannot be loaded: {failure_line(e)}") from None
        raise UserCodeError(f"{what} {spec!r} cannot be loaded: {e}; name a module importable from this folder "
                            f"or PYTHONPATH, or give the file: path/to/file.py:{name}") from None
    except Exception as e:  # an AttributeError too: raised while the module ran, it has no module to name
        raise UserCodeError(f"{what} {spec!r} cannot be loaded: {failure_line(e)}") from None
    if not hasattr(module, name):
        raise UserCodeError(f"{what} {spec!r} cannot be loaded: {module_name} has no {name!r}"
                            f"{_did_you_mean(name, dir(module))}")
    return getattr(module, name)


def _did_you_mean(name: str, names: list[str]) -> str:
    """"; did you mean 'SPEC'?" for the name `name` was likely meant to be (another case, a typo), or ""."""
    public = [n for n in names if not n.startswith("_")]
    close = [n for n in public if n.lower() == name.lower()] or difflib.get_close_matches(name, public, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _names_module(error: ModuleNotFoundError, module_name: str) -> bool:
    """Whether the module not found is `module_name` or a package above it (not one it imports)."""
    return error.name is None or module_name == error.name or module_name.startswith(error.name + ".")


OURS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "")
LIBRARIES = tuple(os.path.join(sysconfig.get_paths()[key], "") for key in ("stdlib", "purelib", "platlib")) + (OURS,)
"""Where frames are not the user's: Python's library, installed packages (torch), and gcompile."""
CLAIMED: set[str] = set()
"""Folders (with a trailing separator) and files of the packages `load_object` loaded: the user's, also where
installed among LIBRARIES (a team's passes, pip-installed)."""


def _claim(module) -> None:
    """Count the package `module` belongs to as the user's code (gcompile's own modules excepted)."""
    top = sys.modules.get(module.__name__.partition(".")[0], module)
    path = getattr(top, "__file__", None)
    if path:
        path = os.path.abspath(path)
        root = os.path.join(os.path.dirname(path), "") if os.path.basename(path) == "__init__.py" else path
        if not root.startswith(OURS):
            CLAIMED.add(root)


def user_frame(frames: traceback.StackSummary) -> traceback.FrameSummary | None:
    """The innermost of `frames` in the user's code (in a package `load_object` loaded, or outside LIBRARIES;
    never generated code), or None."""
    def users(path: str) -> bool:
        path = os.path.abspath(path)
        return path.startswith(tuple(CLAIMED)) or not path.startswith(LIBRARIES)
    return next((f for f in reversed(frames) if not f.filename.startswith("<") and users(f.filename)), None)


def failure_line(error: BaseException) -> str:
    """`KeyError at FILE:LINE: first line of its message` (or `AssertionError at FILE:LINE (the line)` where
    it has none), at the innermost frame of the user's code: one line that points into it."""
    text = (str(error).strip().splitlines() or [""])[0]
    if isinstance(error, SyntaxError):  # its message names the file and line already
        return f"SyntaxError: {text}"
    frame = user_frame(traceback.extract_tb(error.__traceback__))
    if frame is None:
        return f"{type(error).__name__}: {text}"
    where = f"{type(error).__name__} at {os.path.normpath(frame.filename)}:{frame.lineno}"
    return f"{where}: {text}" if text else f"{where} ({frame.line})"


def _load_file(path: str):
    """Import a user file by path (once per process). Its folder becomes importable, as a script's is to
    `python path/to/file.py`: a model file may import the module beside it."""
    name = "gcompile_user_code_" + re.sub(r"\W", "_", os.path.abspath(path))
    if name not in sys.modules:
        if not os.path.isfile(path):
            raise FileNotFoundError(path)
        folder = os.path.dirname(os.path.abspath(path))
        if folder not in sys.path:
            sys.path.append(folder)
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module  # before it runs, as import does: a dataclass of string annotations
        try:  # (`from __future__ import annotations`) looks its module up there
            module_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]
