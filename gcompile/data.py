"""Token data for training: a byte-level tokenizer, corpus preparation, and GPT samples.

Files on disk are Megatron's indexed dataset (PREFIX.bin + PREFIX.idx, see
indexed_dataset.py) or nanoGPT's raw `.bin` (a flat uint16 array). Either is
read as one token stream, documents back to back, each ending in EOD.

    stream   |-------------- train --------------|-- valid --|(-- test, unused --)|
    samples   [0 ....... L][L ....... 2L]...        [0 ...... L][L ..... 2L]...

The split cuts the stream by token position in the ratio of the `split`
weights (a document may straddle the cut; no token is in both parts). Each part
is cut into samples of L + 1 tokens (inputs and shifted targets); consecutive
samples share one token, as in Megatron. The order of samples is a seeded
permutation per epoch that depends only on (seed, epoch, sample count), so a
resumed run draws the same batches as an uninterrupted one.

    python -m gcompile.data prepare --input DIR_OR_FILE [...] --output PREFIX [--pattern '*.py']
"""

import argparse
import fnmatch
import hashlib
import math
import os
import platform
import sys
import sysconfig
import time
from dataclasses import dataclass

import numpy as np

from gcompile.indexed_dataset import DataError, IndexedDataset, IndexedDatasetWriter
from gcompile.paths import path_error

EOD = 256
"""End of document, appended after each file's bytes."""
VOCAB_SIZE = 257
"""256 byte values + EOD."""

STDLIB = sysconfig.get_paths()["stdlib"]
"""The running interpreter's standard library: the default corpus, present on every machine."""
NOT_STDLIB = ("site-packages", "dist-packages")
"""Installed third-party packages live under the stdlib folder; they differ per machine."""


def encode(data: bytes) -> np.ndarray:
    """Bytes of UTF-8 text (any bytes, in fact) -> token ids, ending in EOD."""
    return np.append(np.frombuffer(data, dtype=np.uint8).astype(np.uint16), np.uint16(EOD))


def decode(ids) -> str:
    """Token ids -> text; EOD becomes a newline, invalid UTF-8 a replacement character."""
    return bytes(10 if i == EOD else i for i in ids).decode("utf-8", errors="replace")


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
            raise DataError(f"--input {path}: no such file or folder")
    if not files:
        raise DataError(f"--input {' '.join(inputs)}: no files matching --pattern {pattern!r}")
    return files


class Progress:
    """`[####......]  912/1790 files  15.2 MB  48.3 MB/s` on stderr.

    Redrawn in place at most 10 times a second on a terminal; elsewhere (logs,
    pipes) only the final line is written, so logs stay one line per run.
    """

    def __init__(self, total: int, stream=sys.stderr):
        self.total, self.stream = total, stream
        self.done = self.bytes = 0
        self.start = self.drawn = time.monotonic()

    def update(self, nbytes: int) -> None:
        self.done += 1
        self.bytes += nbytes
        now = time.monotonic()
        if self.done == self.total or (self.stream.isatty() and now - self.drawn > 0.1):
            self.drawn = now
            self._draw(now, end="\n" if self.done == self.total else "")

    def _draw(self, now: float, end: str) -> None:
        width = 30
        filled = width * self.done // self.total
        mb = self.bytes / 1e6
        rate = mb / max(now - self.start, 1e-9)
        line = (f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done:>{len(str(self.total))}}/"
                f"{self.total} files  {mb:.1f} MB  {rate:.1f} MB/s")
        print(line, end=end, file=self.stream, flush=True)


def prepare(inputs: list[str], output: str, pattern: str = "*",
            skip_dirs: tuple[str, ...] = ()) -> IndexedDataset:
    """Tokenize every file (one file = one document) into OUTPUT.bin / OUTPUT.idx."""
    if not output or output.endswith(("/", os.sep)):
        raise DataError(f"--output {output!r} names no file; give a PREFIX such as data/corpus "
                        f"(writes data/corpus.bin and data/corpus.idx)")
    if problem := path_error("--output", output, folder=False):
        raise DataError(problem)
    files = find_files(inputs, pattern, skip_dirs)
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    progress = Progress(len(files))
    with IndexedDatasetWriter(output, dtype=np.uint16) as writer:
        for path in files:
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError as e:
                raise DataError(f"--input {path}: cannot read ({e.strerror}); fix its permissions or "
                                "leave it out with --pattern") from None
            writer.add_document(encode(data))
            progress.update(len(data))
    return IndexedDataset(output)


def default_corpus(cache_dir: str | None = None) -> str:
    """PREFIX of the stdlib's own .py sources, prepared on first use and reused afterwards.

    The name carries the Python version and a hash of the stdlib path, so each
    interpreter gets its own. Two processes preparing at once is safe: each
    writes its own temporary files and renames them into place, and both write
    the same bytes, so it does not matter whose rename lands last.
    """
    cache_dir = cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "gcompile", "data")
    tag = hashlib.sha256(STDLIB.encode()).hexdigest()[:8]
    prefix = os.path.join(cache_dir, f"stdlib-py{platform.python_version()}-{tag}")
    if not os.path.exists(prefix + ".idx"):
        print(f"preparing the default corpus ({STDLIB}/**/*.py) into {prefix}.bin/.idx",
              file=sys.stderr)
        prepare([STDLIB], prefix, pattern="*.py", skip_dirs=NOT_STDLIB)
    return prefix


def load_tokens(data_path: str) -> np.ndarray:
    """The token stream of PREFIX.bin + PREFIX.idx, or of a raw nanoGPT uint16 .bin (no .idx)."""
    prefix = data_path.removesuffix(".bin")
    if os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx"):
        return IndexedDataset(prefix).tokens
    if data_path.endswith(".bin") and os.path.isfile(data_path):
        size = os.path.getsize(data_path)
        if size % 2:
            raise DataError(f"--data-path {data_path}: {size} bytes, not a whole number of uint16 tokens; "
                            "a raw .bin must be nanoGPT's flat uint16 array")
        return np.memmap(data_path, dtype="<u2", mode="r") if size else np.empty(0, "<u2")
    raise DataError(f"--data-path {data_path}: no {prefix}.bin / {prefix}.idx found; give the PREFIX "
                    "of a pair made by `python -m gcompile.data prepare` or a nanoGPT .bin file")


@dataclass(frozen=True)
class DataConfig:
    data_path: str | None = None
    """PREFIX of .bin/.idx, or a raw nanoGPT .bin path; None = the stdlib corpus."""
    split: str = "98,2"
    """train,valid[,test] weights cutting the token stream by position, as Megatron's '969,30,1'."""
    cache_dir: str | None = None
    """Where the default corpus is prepared; None = ~/.cache/gcompile/data."""


def parse_split(split: str) -> list[float]:
    """'98,2' or '969,30,1' -> weights; train and valid must both get tokens."""
    try:
        weights = [float(w) for w in split.split(",")]
    except ValueError:
        weights = []
    if (len(weights) not in (2, 3) or not all(math.isfinite(w) and w >= 0 for w in weights)
            or not (weights[0] > 0 and weights[1] > 0)):
        raise DataError(f"split {split!r}: expected 'train,valid' or 'train,valid,test' finite weights such as "
                        "'98,2', train and valid above 0")
    return weights


class GPTDataset:
    """Samples of seq_length + 1 tokens from a token stream, in a seeded order that resumes anywhere.

    Sample j is tokens [j*L, j*L + L + 1). Draw i is sample order(i // n)[i % n],
    where order(epoch) is a permutation seeded by (seed, epoch) alone.
    """

    def __init__(self, tokens: np.ndarray, seq_length: int, seed: int):
        self.tokens, self.seq_length, self.seed = tokens, seq_length, seed
        self.num_samples = (len(tokens) - 1) // seq_length
        if self.num_samples < 1:
            raise DataError(f"{len(tokens)} tokens, fewer than one sample of seq_length + 1 = "
                            f"{seq_length + 1}")
        self._epoch, self._order = -1, np.empty(0, np.int64)

    def __len__(self) -> int:
        return self.num_samples

    def order(self, epoch: int) -> np.ndarray:
        """Sample indices of one epoch; the last one is kept because batches walk epochs in order."""
        if epoch != self._epoch:
            self._epoch = epoch
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        return self._order

    def batch(self, consumed_samples: int, batch_size: int) -> "torch.Tensor":
        """Draws consumed_samples .. consumed_samples + batch_size - 1 -> (B, L + 1) int64."""
        draws = np.arange(consumed_samples, consumed_samples + batch_size)
        epochs, positions = np.divmod(draws, self.num_samples)
        samples = np.empty(batch_size, np.int64)
        for epoch in np.unique(epochs):  # a batch spans two epochs at most, unless B > n
            mask = epochs == epoch
            samples[mask] = self.order(int(epoch))[positions[mask]]
        windows = samples[:, None] * self.seq_length + np.arange(self.seq_length + 1)  # (B, L+1)
        import torch  # here, not at the top: the run config (and --help) reads DataConfig without torch
        return torch.from_numpy(np.array(self.tokens[windows], dtype=np.int64))


def build_datasets(config: DataConfig, seq_length: int, seed: int) -> tuple[GPTDataset, GPTDataset]:
    """Train and valid datasets: the split's first two parts of the token stream."""
    weights = parse_split(config.split)
    data_path = config.data_path or default_corpus(config.cache_dir)
    tokens = load_tokens(data_path)
    n, total = len(tokens), sum(weights)
    train_end = round(n * weights[0] / total)
    valid_end = round(n * (weights[0] + weights[1]) / total)
    need = math.ceil((seq_length + 1) * total / min(weights[:2])) + 1  # + 1: the rounding of the cut
    for part, size in (("train", train_end), ("valid", valid_end - train_end)):
        if size < seq_length + 1:
            raise DataError(f"--data-path {data_path}: {n} tokens; split {config.split!r} leaves {part} "
                            f"{size}, fewer than one sample of seq_length + 1 = {seq_length + 1}; "
                            f"it needs at least {need} tokens, or a shorter seq_length")
    train = GPTDataset(tokens[:train_end], seq_length, seed)
    valid = GPTDataset(tokens[train_end:valid_end], seq_length, seed)
    return train, valid


def _source(config: DataConfig) -> str:
    return f"--data-path {config.data_path}" if config.data_path else "the default corpus"


def check_token_ids(config: DataConfig, train: GPTDataset, valid: GPTDataset, vocab_size: int) -> None:
    """Every id of both parts is a whole number in [0, vocab_size): an id outside indexes the embedding
    out of range, and a NaN or a fraction in a float index would become some other id without a word."""
    for part, dataset in (("train", train), ("valid", valid)):
        tokens = dataset.tokens
        where = f"{_source(config)}: the {part} part"
        if tokens.dtype.kind == "f" and (fractional := tokens[np.floor(tokens) != tokens]).size:
            raise DataError(f"{where} holds token id {fractional[0]} in a {tokens.dtype.name} index; token ids "
                            f"are whole numbers: prepare the data again with an integer dtype")
        smallest, largest = tokens.min(), tokens.max()
        if smallest < 0:
            raise DataError(f"{where} holds token id {smallest}; token ids are 0 .. vocab_size - 1: "
                            f"prepare the data again with this tokenizer")
        if largest >= vocab_size:
            raise DataError(f"{where} holds token id {largest} but vocab_size={vocab_size}; raise --vocab-size "
                            f"to at least {int(largest) + 1} or use data from this tokenizer")


def check_batches(config: DataConfig, train: GPTDataset, valid: GPTDataset, global_batch_size: int,
                  evaluates: bool) -> None:
    """A train part of fewer samples than one global batch is refused: every batch would repeat samples.
    A valid part that small is only warned about (one line): a validation batch that repeats samples
    still measures the loss, weighting some samples more."""
    shortfall = f"samples of seq_length + 1 = {train.seq_length + 1} tokens, fewer than one global batch of " \
                f"{global_batch_size}, so each batch repeats samples"
    if len(train) < global_batch_size:
        raise DataError(f"{_source(config)}: the train part holds {len(train)} {shortfall}; give more data, "
                        f"or lower --global-batch-size or --seq-length")
    if evaluates and len(valid) < global_batch_size:
        print(f"warning: {_source(config)}: the valid part holds {len(valid)} {shortfall}; a larger valid "
              f"weight in --split gives it more", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gcompile.data", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="tokenize files, one document each, into PREFIX.bin/.idx")
    prep.add_argument("--input", nargs="+", required=True, help="files, or folders searched recursively")
    prep.add_argument("--output", required=True, help="PREFIX: writes PREFIX.bin and PREFIX.idx")
    prep.add_argument("--pattern", default="*", help="glob on file names inside folders, e.g. '*.py'")
    args = parser.parse_args(argv)
    try:
        dataset = prepare(args.input, args.output, args.pattern)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"{args.output}.bin/.idx: {len(dataset)} documents, {len(dataset.tokens)} tokens")


if __name__ == "__main__":
    main()
