"""User code named on the command line (`pkg.module:name` or `path/to/file.py:name`), imported on request.

Passes (`--passes`) and models (`--arch`) are code the user asked to run; nothing else a run
loads (a checkpoint, data, a preset's values) is imported. A name that cannot be loaded is a
`UserCodeError` whose one line points into the user's file.
"""

import importlib
import importlib.util
import os
import re
import sys
import traceback


class UserCodeError(ValueError):
    """The named code cannot be loaded; the message says why, in one line."""


def load_object(spec: str, what: str):
    """The object `spec` names; `what` ("pass", "model") words the errors."""
    module_name, _, name = spec.rpartition(":")
    try:
        module = _load_file(module_name) if module_name.endswith(".py") else importlib.import_module(module_name)
        return getattr(module, name)
    except FileNotFoundError:
        raise UserCodeError(f"{what} {spec!r} cannot be loaded: no file {module_name}") from None
    except ModuleNotFoundError as e:
        raise UserCodeError(f"{what} {spec!r} cannot be loaded: {e}; name a module importable from this folder "
                            f"or PYTHONPATH, or give the file: path/to/file.py:{name}") from None
    except AttributeError:
        raise UserCodeError(f"{what} {spec!r} cannot be loaded: {module_name} has no {name!r}") from None
    except Exception as e:
        raise UserCodeError(f"{what} {spec!r} cannot be loaded: {_load_failure(e)}") from None


def _load_failure(error: Exception) -> str:
    """`RuntimeError at FILE:LINE: first line of its message`: one line that points into the user's code."""
    text = (str(error).strip().splitlines() or [""])[0]
    if isinstance(error, SyntaxError):  # its message names the file and line already
        return f"SyntaxError: {text}"
    frame = traceback.extract_tb(error.__traceback__)[-1]
    return f"{type(error).__name__} at {frame.filename}:{frame.lineno}: {text}"


def _load_file(path: str):
    """Import a user file by path (once per process)."""
    name = "gcompile_user_code_" + re.sub(r"\W", "_", os.path.abspath(path))
    if name not in sys.modules:
        if not os.path.isfile(path):
            raise FileNotFoundError(path)
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]
