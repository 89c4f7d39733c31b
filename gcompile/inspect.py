"""Read a `--dump-graphs` folder: list ranks, show one rank's files, diff two ranks or two passes.

    python -m gcompile.inspect DIR                       # every rank folder: coordinates, files, collectives
    python -m gcompile.inspect DIR show 3                # rank 3's files
    python -m gcompile.inspect DIR show 3 schedule       # a file of rank 3 (any unique part of its name)
    python -m gcompile.inspect DIR diff 0 5 lower_stage  # the same file of two ranks, as a unified diff
    python -m gcompile.inspect DIR passes 0 capture tensor_parallel   # one rank, before -> after a pass

    python -m gcompile.inspect bisect --config configs/tiny.toml --tp 2 --pp 2   # numerics pass by pass
                                                                                 # (gcompile/bisection.py)

A --dump-only writes one folder per distinct program and DIR/index.txt naming the ranks that run it
(`rank1: ranks 1,9,...,505`); a rank without a folder of its own is read from its program's folder.
"""

import difflib
import os
import re
import sys

from gcompile import shutdown
from gcompile.arguments import ArgumentParser
from gcompile.log import counted, parse_rank_ranges, rank_ranges


class InspectError(ValueError):
    pass


def rank_dirs(root: str) -> dict[int, str]:
    if os.path.exists(root) and not os.path.isdir(root):
        raise InspectError(f"{root} is a file; give the folder run_gpt.py --dump-graphs DIR wrote")
    if not os.path.isdir(root):
        raise InspectError(f"{root}: no such folder (write one with run_gpt.py --dump-graphs {root})")
    ranks = {int(m[1]): os.path.join(root, name) for name in os.listdir(root)
             if (m := re.fullmatch(r"rank(\d+)", name))}
    if not ranks:
        raise InspectError(f"{root}: no rank folders in it; is it a --dump-graphs folder?")
    files = [path for path in ranks.values() if not os.path.isdir(path)]
    if files:
        raise InspectError(f"{files[0]} is a file where a rank folder belongs; is {root} a --dump-graphs folder? "
                           f"Write one with run_gpt.py --dump-graphs DIR")
    return dict(sorted(ranks.items()))


DUMP_FILE = re.compile(r"\d\d_\w+\.txt|schedule\.txt|summary\.txt")
"""What a dump writes in a rank folder (gcompile.pass_manager, gcompile.pipeline): a folder without one holds no
dump, whatever its name (a re-dump keeps a user's files there)."""
COMPLETE = ("schedule.txt", "summary.txt")
"""The files a rank's build writes last: a folder of a dump without them was cut short."""


def dump_state(folder: str) -> str | None:
    """Why the rank folder is no whole dump, or None where it is one."""
    files = sorted(os.listdir(folder))
    if not any(DUMP_FILE.fullmatch(name) for name in files):
        return f"holds no dump ({', '.join(files) or 'empty'})"
    missing = [name for name in COMPLETE if name not in files]
    return f"cut short: no {' or '.join(missing)}; write the dump again" if missing else None


def find_file(rank_dir: str, part: str) -> str:
    """The one file of a rank whose name contains `part` (a pass name, 'schedule', 'summary', ...)."""
    names = sorted(os.listdir(rank_dir))
    matches = [n for n in names if part in n]
    if len(matches) != 1:
        raise InspectError(f"{part!r} matches {matches or 'nothing'} in {rank_dir}; files: {', '.join(names)}")
    return os.path.join(rank_dir, matches[0])


def _read(path: str) -> list[str]:
    """A dump file's lines; InspectError for one no dump writes (empty: a dump cut short, not text)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines(keepends=True)
    except UnicodeDecodeError as e:
        raise InspectError(f"{path}: not UTF-8 text (byte {e.start}); dumps are text that run_gpt.py "
                           f"--dump-graphs wrote, write it again") from None
    if not lines:
        raise InspectError(f"{path} is empty: a dump writes none (was it cut short?); write it again with "
                           f"run_gpt.py --dump-graphs DIR")
    return lines


def list_ranks(root: str) -> str:
    shared_by, folders = _shared_by(root), rank_dirs(root)
    ranks = sum(len(ranks) for ranks in shared_by.values()) or len(folders)
    if _index_missing(folders, shared_by):
        lines = [f"{counted(len(folders), 'folder')} for unknown ranks: {_INDEX_MISSING}"]
    else:
        lines = [f"{counted(len(folders), 'folder')} for {counted(ranks, 'rank')} " + (
            "(index.txt: ranks that differ only in dp run one program)" if ranks > len(folders) else
            "(each runs a program of its own)")]
    for rank, folder in folders.items():
        files = sorted(os.listdir(folder))
        header = _read(os.path.join(folder, "schedule.txt"))[0].strip().lstrip("# ") if "schedule.txt" in files else ""
        collectives = _collectives(os.path.join(folder, "summary.txt")) if "summary.txt" in files else ""
        problem = f"  ({problem})" if (problem := dump_state(folder)) else ""
        lines.append(f"rank {rank:4d}  {header}  {collectives}".rstrip() + problem)
        if len(shared_by.get(rank, ())) > 1:
            lines.append(f"           runs for: {rank_ranges(shared_by[rank])}")
        lines.append(f"           files: {' '.join(files)}")
    return "\n".join(lines)


_INDEX_MISSING = ("the rank folders are not 0, 1, 2, ... and no index.txt names the ranks each runs for (a "
                  "--dump-only cut short?); write the dump again")


def _index_missing(folders: dict[int, str], shared_by: dict[int, list[int]]) -> bool:
    """A --dump-only's folders (one per distinct program) without the index.txt it writes last."""
    return not shared_by and list(folders) != list(range(len(folders)))


def _shared_by(root: str) -> dict[int, list[int]]:
    """index.txt (gcompile.pass_manager.write_dump_index): the ranks each rank folder stands for; {} when the
    folder has none (a run's dump, where every rank writes its own folder)."""
    path = os.path.join(root, "index.txt")
    if not os.path.isfile(path):
        return {}
    shared_by = {}
    for line in _read(path):
        folder, _, ranks = line.strip().partition(": ")
        match = re.fullmatch(r"rank(\d+)", folder)
        try:
            shared_by[int(match[1])] = parse_rank_ranges(ranks)
        except (TypeError, ValueError):
            raise InspectError(f"{path}: cannot read {line.strip()!r}; a line is `rank1: ranks 1,9,...,505`, as "
                               f"run_gpt.py --dump-only writes it; write the dump again") from None
    return shared_by


def _collectives(summary: str) -> str:
    """`collectives/iteration: all_reduce mp x1 4 B, all_reduce tp x26 1,316,864 B`, from the
    `# per iteration` part of a summary.txt (gcompile.comm_summary.format_summary)."""
    lines = [line.split() for line in _read(summary)]
    start = next((i for i, words in enumerate(lines) if words[:3] == ["#", "per", "iteration"]), None)
    if start is None:
        return ""
    calls = []
    for words in lines[start + 1:]:
        if not words or words[0].startswith(("#", "(")):
            break
        if len(words) != 6:  # all_reduce tp 26 calls 1,316,864 bytes
            raise InspectError(f"{summary}: cannot read {' '.join(words)!r} under '# per iteration'; a line is "
                               f"`all_reduce tp 26 calls 1,316,864 bytes`, as run_gpt.py --dump-graphs writes it; "
                               f"write the dump again")
        kind, group, count, _, nbytes, _ = words
        calls.append(f"{kind} {group} x{count} {nbytes} B")
    return f"collectives/iteration: {', '.join(calls) or 'none'}"


def show(root: str, rank: int, part: str | None) -> str:
    folder = _rank(root, rank)
    if part is None:
        return "\n".join(sorted(os.listdir(folder)))
    return "".join(_read(find_file(folder, part)))


def diff_ranks(root: str, rank_a: int, rank_b: int, part: str) -> str:
    a, b = find_file(_rank(root, rank_a), part), find_file(_rank(root, rank_b), part)
    return "".join(difflib.unified_diff(_read(a), _read(b), os.path.relpath(a, root), os.path.relpath(b, root))) \
        or "(identical)\n"


def diff_passes(root: str, rank: int, before: str, after: str) -> str:
    folder = _rank(root, rank)
    a, b = find_file(folder, before), find_file(folder, after)
    return "".join(difflib.unified_diff(_read(a), _read(b), os.path.basename(a), os.path.basename(b))) \
        or "(identical)\n"


def _rank(root: str, rank: int) -> str:
    """The folder holding `rank`'s program: its own, or (said on stderr) the one index.txt names for it."""
    ranks, shared_by = rank_dirs(root), _shared_by(root)
    if rank in ranks:
        if (problem := dump_state(ranks[rank])) and problem.startswith("holds no dump"):
            raise InspectError(f"{ranks[rank]} {problem}: no rank of a dump; give another rank")
        return ranks[rank]
    owner = next((r for r, members in shared_by.items() if rank in members and r in ranks), None)
    if owner is None:
        if (gone := next((r for r, members in shared_by.items() if rank in members), None)) is not None:
            raise InspectError(f"index.txt of {root} names rank{gone}/ for rank {rank}, and there is no such "
                               f"folder; write the dump again")
        every = [r for members in shared_by.values() for r in members] or list(ranks)
        raise InspectError(f"no rank {rank} in {root}: " + (
            f"{_INDEX_MISSING}" if _index_missing(ranks, shared_by) else f"it holds {rank_ranges(every)}"))
    print(f"rank {rank} runs rank {owner}'s program (index.txt): reading {ranks[owner]}", file=sys.stderr)
    return ranks[owner]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bisect"]:  # takes run_gpt.py's flags, not a dump folder
        from gcompile.bisection import main as bisect_main  # builds and runs programs: torch only when asked
        return bisect_main(argv[1:])
    p = ArgumentParser(prog="python -m gcompile.inspect", description=__doc__.splitlines()[0],
                       epilog="python -m gcompile.inspect bisect [run_gpt.py flags] [--tol TOL]: the first pass "
                              "whose numbers leave single-device eager (its --help says more)")
    p.add_argument("dir")
    sub = p.add_subparsers(dest="command", prog=f"{p.prog} DIR")
    s = sub.add_parser("show", help="a rank's files, or one of them")
    s.add_argument("rank", type=int)
    s.add_argument("file", nargs="?")
    d = sub.add_parser("diff", help="the same file of two ranks")
    d.add_argument("rank_a", type=int)
    d.add_argument("rank_b", type=int)
    d.add_argument("file")
    q = sub.add_parser("passes", help="two files (passes) of one rank")
    q.add_argument("rank", type=int)
    q.add_argument("before")
    q.add_argument("after")
    if argv[:1] in (["show"], ["diff"], ["passes"]) and not os.path.isdir(argv[0]):
        command, *rest = argv
        folder = rest.pop(0) if rest and os.path.isdir(rest[0]) else "DIR"
        p.error(f"the dump folder comes first: {p.prog} {' '.join([folder, command, *rest])}")
    args = p.parse_args(argv)
    try:
        if args.command == "show":
            out = show(args.dir, args.rank, args.file)
        elif args.command == "diff":
            out = diff_ranks(args.dir, args.rank_a, args.rank_b, args.file)
        elif args.command == "passes":
            out = diff_passes(args.dir, args.rank, args.before, args.after)
        else:
            out = list_ranks(args.dir)
    except InspectError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(out if out.endswith("\n") else out + "\n")
    return 0


if __name__ == "__main__":
    shutdown.install(shutdown.stopper(exit_signal_handler=False), "python -m gcompile.inspect")  # Ctrl-C: one line
    sys.exit(main())
