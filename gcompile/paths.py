"""Paths a command will write: checked before any work, and written whole or not at all.

Creating `runs/x/metrics.jsonl` when `runs` is a file fails only when the first line is written,
deep inside a rank, as NotADirectoryError; asking the file system first names the file in the way.
A file others read (a machine file, the plan cache, a dataset's meta.json, an export) is written
beside its place under a name of its writer's own and renamed into it, so a stop midway leaves the
old file or the new one, never half of one.
"""

import contextlib
import fcntl
import os
import re
import shutil
import uuid


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


def same_folder(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b)


@contextlib.contextmanager
def claimed(folder: str, refusal: Exception):
    """Hold `folder` (an exclusive lock on the folder itself) while the block runs; `refusal` is raised where
    another process holds it. The kernel lets go of the lock when the process ends, however it ends, and
    nothing is written into the folder."""
    held = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise refusal from None
        yield
    finally:
        os.close(held)


def cache_home() -> str:
    """Where gcompile keeps what it measured or worked out for this machine ($XDG_CACHE_HOME or ~/.cache)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "gcompile")


def temp_name(path: str) -> str:
    """Unique per writer, so two processes preparing the same files never share one. A signal's exit, which
    does not unwind, removes this process's (`remove_own_temps`); those a killed writer left go with the next
    writer of the path (`remove_leftovers`)."""
    remove_leftovers(path)
    name = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    _TEMPS.setdefault(os.getpid(), set()).add(os.path.abspath(name))
    return name


_TEMPS: dict[int, set[str]] = {}
"""The temporary names each process made, by its pid (a forked child holds its parent's too, which are its
parent's to remove); those moved into place are no longer there."""


def remove_own_temps() -> None:
    """Remove what this process's writers have not finished (gcompile.shutdown.exit_now, before it exits)."""
    for name in list(_TEMPS.get(os.getpid(), ())):
        with contextlib.suppress(OSError):
            shutil.rmtree(name) if os.path.isdir(name) else os.remove(name)


def remove_leftovers(path: str) -> None:
    """Remove `path`'s temporary files (or folders) of writers whose process is gone."""
    folder, name = os.path.split(os.path.abspath(path))
    for entry in os.listdir(folder) if os.path.isdir(folder) else ():
        found = re.fullmatch(re.escape(name) + r"\.tmp-(\d+)-[0-9a-f]{8}", entry)
        if found and not _alive(int(found[1])):
            leftover = os.path.join(folder, entry)
            try:
                shutil.rmtree(leftover) if os.path.isdir(leftover) else os.remove(leftover)
            except OSError:  # another writer took it first, or it is not ours to remove
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@contextlib.contextmanager
def replacing(path: str):
    """A temporary file name beside `path` to write; renamed into place when the block ends, removed where it
    raises: `path` holds the whole new file or what it held before."""
    temporary = temp_name(path)
    try:
        yield temporary
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def write_replacing(path: str, text: str) -> None:
    """`path` holds `text` or what it held before (`replacing`), its folder made if need be."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with replacing(path) as temporary, open(temporary, "w") as f:
        f.write(text)
