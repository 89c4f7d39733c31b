"""Paths a command will write, checked before any work: a file standing where a folder must be.

Creating `runs/x/metrics.jsonl` when `runs` is a file fails only when the first line is written,
deep inside a rank, as NotADirectoryError; asking the file system first names the file in the way.
"""

import os


def file_in_the_way(path: str, folder: bool = True) -> str | None:
    """The existing non-folder that stops `path` from being written: `path` itself when it must be a
    `folder`, else its nearest existing ancestor when that is not a folder; None when nothing is in the way."""
    path = os.path.abspath(path)
    here = path if folder else os.path.dirname(path)
    while not os.path.exists(here):  # a path through a file does not exist either
        here = os.path.dirname(here)
    return None if os.path.isdir(here) else here


def path_error(flag: str, path: str, folder: bool = True) -> str | None:
    """`flag PATH ...` saying which file is in the way and what to do, or None."""
    blocker = file_in_the_way(path, folder)
    if blocker is None:
        return None
    if blocker == os.path.abspath(path):
        return f"{flag} {path} is a file, not a folder; give a folder"
    return f"{flag} {path}: {blocker} is a file, not a folder; choose a path outside it"


def cache_home() -> str:
    """Where gcompile keeps what it measured or worked out for this machine ($XDG_CACHE_HOME or ~/.cache)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "gcompile")
