"""Corpus preparation: files -> token ids -> PREFIX.bin / PREFIX.idx (+ PREFIX.meta.json).

One file is one document. The tokenizer is chosen with Megatron's flags (tokenizer.py);
`--train-tokenizer --vocab-size N` first trains a byte-level BPE on the same files and
saves it as PREFIX.tokenizer.json. `--workers N` tokenizes in N processes; documents are
written in file order whatever the worker count, so the output does not depend on it.

PREFIX.meta.json records what the ids mean and the largest one, so a run can refuse a
model whose vocabulary is too small without reading the tokens:

    {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": "/abs/PREFIX.tokenizer.json",
     "vocab_size": 5000, "eod": 0, "largest_id": 4987, "num_tokens": 123456, "bin": [bytes, mtime_ns], ...}

Megatron ignores the file; files without one (Megatron's own) are scanned instead, and so are
files whose .bin is not the one the record was written beside (its size and modification time:
a record copied from another pair of the same token count once let ids past the vocabulary in).

    python -m gcompile.data prepare --input DIR_OR_FILE [...] --output PREFIX [--pattern '*.py']
        [--tokenizer-type T ...] [--train-tokenizer --vocab-size N] [--workers N] [--append-eod]
"""

import argparse
import dataclasses
import fnmatch
import json
import multiprocessing
import os
import sys
import time

import numpy as np

from gcompile import tokenizer as tok
from gcompile.arguments import ArgumentParser
from gcompile.indexed_dataset import DataError, IndexedDataset, IndexedDatasetWriter
from gcompile.paths import path_error, write_replacing

MAX_WORKERS = 256
"""Tokenizing processes at most: each starts Python and a tokenizer (10^5 of them took the machine down)."""
META_SUFFIX = ".meta.json"
"""PREFIX + this: the tokenizer and largest id of a prepared pair."""


def bin_stamp(path: str) -> list[int]:
    """What tells one .bin from another without reading it: its bytes and modification time."""
    found = os.stat(path)
    return [found.st_size, found.st_mtime_ns]


def find_files(inputs: list[str], pattern: str = "*", skip_dirs: tuple[str, ...] = ()) -> list[str]:
    """Files named directly, plus files under folders whose name matches `pattern`, sorted per folder.

    Sorted so that the same folder always gives the same token stream.
    """
    files = []
    for path in inputs:
        if os.path.isfile(path):
            files.append(path)
        elif os.path.isdir(path):
            for root, dirs, names in os.walk(path):
                dirs[:] = sorted(d for d in dirs if d not in skip_dirs)
                files += [os.path.join(root, n) for n in sorted(fnmatch.filter(names, pattern))
                          if os.path.isfile(os.path.join(root, n))]
        else:
            raise DataError(f"--input {path}: no such file or folder; give files, or folders holding them")
    if not files:
        raise DataError(f"--input {' '.join(inputs)}: no files matching --pattern {pattern!r}")
    return files


def _count(n: float) -> str:
    """12345678 -> '12.3M'."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


class Progress:
    """`[####......]  912/1790 files  15.2 MB  4.1M tokens  2.3M tokens/s` on stderr.

    Redrawn in place at most 10 times a second on a terminal; elsewhere (logs,
    pipes) only the final line is written, so logs stay one line per run.
    """

    def __init__(self, total: int, stream=None):
        self.total, self.stream = total, stream or sys.stderr  # looked up now: tests and callers redirect it
        self.done = self.bytes = self.tokens = 0
        self.start = self.drawn = time.monotonic()

    def update(self, nbytes: int, ntokens: int) -> None:
        self.done += 1
        self.bytes += nbytes
        self.tokens += ntokens
        now = time.monotonic()
        if self.done == self.total or (self.stream.isatty() and now - self.drawn > 0.1):
            self.drawn = now
            self._draw(now, end="\n" if self.done == self.total else "")

    def _draw(self, now: float, end: str) -> None:
        width = 30
        filled = width * self.done // self.total
        rate = self.tokens / max(now - self.start, 1e-9)
        line = (f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done:>{len(str(self.total))}}/"
                f"{self.total} files  {self.bytes / 1e6:.1f} MB  {_count(self.tokens)} tokens  "
                f"{_count(rate)} tokens/s")
        print(line, end=end, file=self.stream, flush=True)


def read_file(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise DataError(f"--input {path}: cannot read ({e.strerror}); fix its permissions or "
                        "leave it out with --pattern") from None


_worker_tokenizer = None


def _start_worker(spec: tok.TokenizerSpec) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tok.build(spec)


def _tokenize(path: str) -> tuple[int, np.ndarray]:
    """(bytes read, ids) of one file, in a worker (or in this process with one worker)."""
    data = read_file(path)
    return len(data), np.asarray(_worker_tokenizer.encode(data), dtype=np.int64)


def _tokenized(files: list[str], spec: tok.TokenizerSpec, workers: int):
    """(bytes, ids) per file in file order; `spawn` so that workers never inherit a tokenizer's threads."""
    if workers == 1:
        _start_worker(spec)
        yield from map(_tokenize, files)
        return
    context = multiprocessing.get_context("spawn")
    with context.Pool(workers, initializer=_start_worker, initargs=(spec,)) as pool:
        yield from pool.imap(_tokenize, files, chunksize=max(1, min(64, len(files) // (workers * 8))))


def prepare(inputs: list[str], output: str, pattern: str = "*", skip_dirs: tuple[str, ...] = (),
            spec: tok.TokenizerSpec = tok.TokenizerSpec(), append_eod: bool = False,
            train_vocab_size: int | None = None, workers: int = 1) -> IndexedDataset:
    """Tokenize every file (one file = one document) into OUTPUT.bin / OUTPUT.idx / OUTPUT.meta.json."""
    if not output or output.endswith(("/", os.sep)):
        raise DataError(f"--output {output!r} names no file; give a PREFIX such as data/corpus "
                        f"(writes data/corpus.bin, .idx and .meta.json)")
    if problem := path_error("--output", output, folder=False):
        raise DataError(problem)
    if not 1 <= workers <= MAX_WORKERS:
        raise DataError(f"--workers {workers}: give 1 to {MAX_WORKERS} (this machine has {os.cpu_count()} cores)")
    files = find_files(inputs, pattern, skip_dirs)
    workers = min(workers, len(files))  # a process per file at most
    try:
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        return _prepare(files, output, spec, append_eod, train_vocab_size, workers)
    except OSError as e:  # a folder that cannot be made or written, a full disk, a file size limit
        raise DataError(f"{e.strerror or e}{f': {e.filename}' if e.filename else ''}; --output {output} must be "
                        f"writable with room (and under the file size limit), the inputs readable") from None


def _prepare(files: list[str], output: str, spec: tok.TokenizerSpec, append_eod: bool, train_vocab_size: int | None,
             workers: int) -> IndexedDataset:
    """`prepare`'s work, its arguments checked."""
    if train_vocab_size is not None:
        path = os.path.abspath(output + ".tokenizer.json")
        if os.path.isdir(path):
            raise DataError(f"--output {output}: {path}, where the trained tokenizer goes, is a folder; move it, "
                            f"or choose another --output")
        start = time.monotonic()
        size = tok.train_bpe(map(read_file, files), train_vocab_size, path)
        short = f" (the corpus had no more pairs to merge for {train_vocab_size})" if size < train_vocab_size else ""
        print(f"trained a byte-level BPE of {size} entries{short} on {len(files)} files in "
              f"{time.monotonic() - start:.1f} s: {path}", file=sys.stderr)
        spec = tok.TokenizerSpec("HuggingFaceTokenizer", tokenizer_model=path)
    tokenizer = tok.build(spec)
    if append_eod and tokenizer.eod is None:
        raise DataError(f"--append-eod: {spec.tokenizer_model} has no end-of-document token (no eos_token in a "
                        f"tokenizer_config.json beside it, none of {', '.join(tok.END_OF_DOCUMENT)}); "
                        "add one to the tokenizer or leave out --append-eod")
    dtype = np.uint16 if tokenizer.id_bound < 65500 else np.int32  # Megatron's rule, on the largest id
    progress, largest = Progress(len(files)), -1
    with IndexedDatasetWriter(output, dtype=dtype) as writer:
        for nbytes, ids in _tokenized(files, spec, workers):
            if append_eod:
                ids = np.append(ids, tokenizer.eod)
            writer.add_document(ids)
            largest = max(largest, int(ids.max(initial=-1)))
            progress.update(nbytes, len(ids))
    meta = dict(dataclasses.asdict(spec), vocab_size=tokenizer.vocab_size, vocab_digest=tokenizer.digest,
                eod=tokenizer.eod,
                largest_id=largest, num_tokens=int(sum(writer.lengths)), append_eod=append_eod,
                bin=bin_stamp(output + ".bin"))
    write_replacing(output + META_SUFFIX, json.dumps(meta, indent=1))
    return IndexedDataset(output)


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m gcompile.data", description="Prepare token data.")
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="tokenize files, one document each, into PREFIX.bin/.idx")
    prep.add_argument("--input", nargs="+", required=True, help="files, or folders searched recursively")
    prep.add_argument("--output", required=True, help="PREFIX: writes PREFIX.bin, PREFIX.idx, PREFIX.meta.json")
    prep.add_argument("--pattern", default="*", help="glob on file names inside folders, e.g. '*.py'")
    prep.add_argument("--tokenizer-type", default=None, help=f"{' | '.join(tok.TOKENIZER_TYPES)} (default ByteLevel)")
    prep.add_argument("--vocab-file", help="GPT2BPETokenizer: vocab.json")
    prep.add_argument("--merge-file", help="GPT2BPETokenizer: merges.txt")
    prep.add_argument("--tokenizer-model", help="HuggingFaceTokenizer: tokenizer.json, or the folder holding it")
    prep.add_argument("--train-tokenizer", action="store_true",
                      help="train a byte-level BPE of --vocab-size entries on the input first; saved as "
                           "PREFIX.tokenizer.json and used as a HuggingFaceTokenizer")
    prep.add_argument("--vocab-size", type=int, help="with --train-tokenizer: entries of the trained vocabulary")
    prep.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    prep.add_argument("--append-eod", action="store_true", help="end every document with the tokenizer's EOD")
    args = parser.parse_args(argv)
    try:
        spec = tokenizer_spec(args)
        dataset = prepare(args.input, args.output, args.pattern, spec=spec, append_eod=args.append_eod,
                          train_vocab_size=args.vocab_size, workers=args.workers)
    except (DataError, tok.TokenizerError) as e:
        print(f"{prep.prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {args.output}.bin and {args.output}.idx: {len(dataset)} documents, {len(dataset.tokens)} tokens")


def tokenizer_spec(args: argparse.Namespace) -> tok.TokenizerSpec:
    """The tokenizer flags as a spec; a flag that does not apply to the chosen type is an error."""
    kind = args.tokenizer_type or ("HuggingFaceTokenizer" if args.train_tokenizer else "ByteLevel")
    if kind not in tok.TOKENIZER_TYPES:
        raise tok.TokenizerError(f"--tokenizer-type {kind}: unknown; choose one of {', '.join(tok.TOKENIZER_TYPES)}")
    if args.train_tokenizer != (args.vocab_size is not None):
        raise tok.TokenizerError("--train-tokenizer and --vocab-size N go together: N is the size of the "
                                 "vocabulary to train")
    applies = {"ByteLevel": (), "GPT2BPETokenizer": ("vocab_file", "merge_file"),
               "HuggingFaceTokenizer": () if args.train_tokenizer else ("tokenizer_model",)}[kind]
    for name in ("vocab_file", "merge_file", "tokenizer_model"):
        if getattr(args, name) is not None and name not in applies:
            flag = "--" + name.replace("_", "-")
            why = "--train-tokenizer makes the tokenizer" if args.train_tokenizer else f"--tokenizer-type {kind}"
            raise tok.TokenizerError(f"{flag} does not apply with {why}; leave it out")
    if args.train_tokenizer and kind != "HuggingFaceTokenizer":
        raise tok.TokenizerError(f"--train-tokenizer makes a HuggingFaceTokenizer, not --tokenizer-type {kind}; "
                                 "leave out --tokenizer-type")
    files = (args.vocab_file, args.merge_file, args.tokenizer_model)
    return tok.TokenizerSpec(kind, *(path and os.path.abspath(path) for path in files))  # meta.json works from anywhere
