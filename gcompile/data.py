"""Token data for training: GPT samples from prepared files, the default corpus, blends.

Files on disk are Megatron's indexed dataset (PREFIX.bin + PREFIX.idx, see
indexed_dataset.py; written by prepare.py) or nanoGPT's raw `.bin` (a flat uint16
array). Either is read as one token stream, documents back to back.

    stream   |-------------- train --------------|-- valid --|(-- test, unused --)|
    samples   [0 ....... L][L ....... 2L]...        [0 ...... L][L ..... 2L]...

The split cuts the stream by token position in the ratio of the `split`
weights (a document may straddle the cut; no token is in both parts). Each part
is cut into samples of L + 1 tokens (inputs and shifted targets); consecutive
samples share one token, as in Megatron. The order of samples is a seeded
permutation per epoch that depends only on (seed, epoch, sample count), so a
resumed run draws the same batches as an uninterrupted one. Several weighted
prefixes are split each alike and blended (blend.py), train with train, valid with valid.

    python -m gcompile.data prepare --input DIR_OR_FILE [...] --output PREFIX [--pattern '*.py']
"""

import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
from dataclasses import dataclass, field

import numpy as np

from gcompile import paths, shutdown
from gcompile.blend import BlendedDataset, parse_blend
from gcompile.indexed_dataset import DataError, IndexedDataset
from gcompile.prepare import META_SUFFIX, bin_stamp, main, prepare

STDLIB = sysconfig.get_paths()["stdlib"]
"""The running interpreter's standard library: the default corpus, present on every machine."""
NOT_STDLIB = ("site-packages", "dist-packages")
"""Installed third-party packages live under the stdlib folder; they differ per machine."""


def default_corpus(cache_dir: str | None = None) -> str:
    """PREFIX of the stdlib's own .py sources, prepared on first use and reused afterwards.

    The name carries the Python version and a hash of the stdlib path, so each
    interpreter gets its own. Two processes preparing at once is safe: each
    writes its own temporary files and renames them into place, and both write
    the same bytes, so it does not matter whose rename lands last.
    """
    where = f"--cache-dir {cache_dir}" if cache_dir else "the cache folder ($XDG_CACHE_HOME or ~/.cache)"
    cache_dir = cache_dir or os.path.join(paths.cache_home(), "data")
    try:
        os.makedirs(cache_dir, exist_ok=True)
    except OSError as e:
        raise DataError(f"{where}: cannot make {cache_dir} ({e.strerror}); give a --cache-dir you can write") \
            from None
    tag = hashlib.sha256(STDLIB.encode()).hexdigest()[:8]
    prefix = os.path.join(cache_dir, f"stdlib-py{platform.python_version()}-{tag}")
    if os.path.exists(prefix + ".idx"):
        try:
            IndexedDataset(prefix)  # the sizes agree: a cut or lost .bin is seen here
            return prefix
        except (DataError, OSError):  # our own cache: made again, not handed to the user to mend
            print(f"the default corpus in {prefix}.bin/.idx is damaged; preparing it again", file=sys.stderr)
    print(f"preparing the default corpus ({STDLIB}/**/*.py) into {prefix}.bin/.idx", file=sys.stderr)
    try:
        prepare([STDLIB], prefix, pattern="*.py", skip_dirs=NOT_STDLIB, append_eod=True)
    except DataError as e:  # prepare words it for its own --output, which the user did not give
        raise DataError(f"preparing the default corpus in {where}: {e}") from None
    return prefix


def load_tokens(data_path: str) -> np.ndarray:
    """The token stream of PREFIX.bin + PREFIX.idx, or of a raw nanoGPT uint16 .bin (no .idx)."""
    prefix = data_path.removesuffix(".bin")
    if os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx"):
        return IndexedDataset(prefix).tokens
    if os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + META_SUFFIX):  # prepare wrote an index, which
        # says the dtype: read raw, an int32 pair would be twice as many halves of its ids
        raise DataError(f"--data-path {data_path}: its {prefix}.idx is missing ({prefix}{META_SUFFIX} says "
                        f"prepare wrote the pair): restore the .idx, or prepare the data again")
    if data_path.endswith(".bin") and os.path.isfile(data_path):
        size = os.path.getsize(data_path)
        if size % 2:
            raise DataError(f"--data-path {data_path}: {size} bytes, not a whole number of uint16 tokens; "
                            "a raw .bin must be nanoGPT's flat uint16 array")
        tokens = np.memmap(data_path, dtype="<u2", mode="r") if size else np.empty(0, "<u2")
        _check_not_wider(data_path, tokens)
        return tokens
    if os.path.isfile(prefix + ".bin"):  # a prefix whose .idx is gone
        raise DataError(f"--data-path {data_path}: {prefix}.bin has no {prefix}.idx beside it; restore the .idx, "
                        f"or give --data-path {prefix}.bin to read it as nanoGPT's raw uint16 tokens")
    if folders := [path for path in (prefix + ".bin", prefix + ".idx") if os.path.isdir(path)]:
        raise DataError(f"--data-path {data_path}: {folders[0]} is a folder, not a file; give the PREFIX of a pair "
                        f"made by `python -m gcompile.data prepare` or a nanoGPT .bin file")
    raise DataError(f"--data-path {data_path}: no {prefix}.bin / {prefix}.idx found; give the PREFIX "
                    "of a pair made by `python -m gcompile.data prepare` or a nanoGPT .bin file")


WIDE_CHECKED = 1 << 20
"""Tokens of a raw .bin looked at for the halves of wider ids (its start: a wrong dtype shows at once)."""


def _check_not_wider(data_path: str, tokens: np.ndarray) -> None:
    """A raw .bin of int32 ids (small ids: every high half 0), read as uint16, trained on a zero after each id
    without a word: refused, where the start of the file shows it."""
    head = tokens[:WIDE_CHECKED - WIDE_CHECKED % 2]
    if head.size >= 64 and not head[1::2].any() and head[0::2].any():
        raise DataError(f"--data-path {data_path}: every second uint16 of its start is 0, as in a file of int32 "
                        f"ids; a raw .bin must be nanoGPT's flat uint16 array: write it as uint16 (ids below "
                        f"65536), or prepare the data with python -m gcompile.data prepare")


@dataclass(frozen=True)
class DataConfig:
    data_path: str | None = field(default=None, metadata=dict(nargs="+"))
    """PREFIX of .bin/.idx or a raw nanoGPT .bin, or a blend '0.7 PREFIX_A 0.3 PREFIX_B'; None = the stdlib corpus."""
    split: str = "98,2"
    """train,valid[,test] weights cutting the token stream by position, as Megatron's '969,30,1'."""
    cache_dir: str | None = None
    """Where the default corpus is prepared; None = gcompile's cache folder (paths.cache_home()) /data."""


def parse_split(split: str) -> list[float]:
    """'98,2' or '969,30,1' -> weights; train and valid must both get tokens."""
    try:
        weights = [float(w) for w in split.split(",")]
    except ValueError:
        weights = []
    if (len(weights) not in (2, 3) or not all(math.isfinite(w) and w >= 0 for w in weights)
            or not (weights[0] > 0 and weights[1] > 0) or not math.isfinite(sum(weights))
            or min(weights[:2]) < sum(weights) * 1e-9):  # a part of a billionth: no corpus fills it
        raise DataError(f"split {split!r}: expected 'train,valid' or 'train,valid,test' finite weights such as "
                        "'98,2', train and valid above 0 (each at least a billionth of the whole)")
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


def blend_paths(config: DataConfig) -> list[tuple[float, str]]:
    """(weight, path) of each dataset the run reads; the default corpus is prepared here on first use."""
    return parse_blend(config.data_path) if config.data_path else [(1.0, default_corpus(config.cache_dir))]


def build_datasets(config: DataConfig, seq_length: int, seed: int):
    """Train and valid datasets: the split's first two parts of each token stream, blended when several."""
    blend = blend_paths(config)
    parts = [split_datasets(path, config.split, seq_length, seed) for _, path in blend]
    if len(parts) == 1:
        return parts[0]
    weights = [w for w, _ in blend]
    return BlendedDataset([t for t, _ in parts], weights), BlendedDataset([v for _, v in parts], weights)


def split_datasets(data_path: str, split: str, seq_length: int, seed: int) -> tuple[GPTDataset, GPTDataset]:
    """Train and valid datasets of one token stream."""
    weights = parse_split(split)
    tokens = load_tokens(data_path)
    n, total = len(tokens), sum(weights)
    train_end = round(n * weights[0] / total)
    valid_end = round(n * (weights[0] + weights[1]) / total)
    need = math.ceil((seq_length + 1) * total / min(weights[:2])) + 1  # + 1: the rounding of the cut
    for part, size in (("train", train_end), ("valid", valid_end - train_end)):
        if size < seq_length + 1:
            raise DataError(f"--data-path {data_path}: {n} tokens; split {split!r} leaves {part} "
                            f"{size}, fewer than one sample of seq_length + 1 = {seq_length + 1}; "
                            f"it needs at least {need} tokens, or a shorter seq_length")
    train = GPTDataset(tokens[:train_end], seq_length, seed)
    valid = GPTDataset(tokens[train_end:valid_end], seq_length, seed)
    return train, valid


def _source(config: DataConfig) -> str:
    return f"--data-path {config.data_path}" if config.data_path else "the default corpus"


def _streams(config: DataConfig, train, valid) -> list[tuple[str, str, list[tuple[str, GPTDataset]]]]:
    """(how a message names it, path, [(part, dataset)]) of each token stream the run reads: one, or each
    of a blend's."""
    trains, valids = ([d] if isinstance(d, GPTDataset) else d.datasets for d in (train, valid))
    paths = [path for _, path in blend_paths(config)]
    names = [_source(config)] if len(paths) == 1 else [f"--data-path {path}" for path in paths]
    return [(name, path, [("train", t), ("valid", v)]) for name, path, t, v in zip(names, paths, trains, valids)]


def prepared_record(path: str) -> dict | None:
    """PREFIX.meta.json when prepare wrote it for these very tokens (the same count), else None: Megatron's
    files have none, and one left from an earlier pair, or damaged, is not believed."""
    try:
        with open(path.removesuffix(".bin") + META_SUFFIX) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    whole = isinstance(record, dict) and all(isinstance(record.get(k), int) for k in ("largest_id", "vocab_size"))
    beside = whole and record.get("bin") == bin_stamp(path.removesuffix(".bin") + ".bin")
    return record if beside and record.get("num_tokens") == len(load_tokens(path)) else None


def check_token_ids(config: DataConfig, train, valid, vocab_size: int) -> None:
    """Every id of both parts is a whole number in [0, vocab_size): an id outside indexes the embedding
    out of range, and a NaN or a fraction in a float index would become some other id without a word.

    prepare's record answers without reading a token: the ids it writes are whole and not negative, none
    above its largest_id. That covers the unused test part too, so a record over the limit sends the
    check to the parts themselves, which name the part and the id.
    """
    streams = _streams(config, train, valid)
    records = {path: prepared_record(path) for _, path, _ in streams}
    _check_one_tokenizer(records)
    for name, path, parts in streams:
        record = records[path]
        if record is not None and record["largest_id"] < vocab_size:
            continue
        tokenizer = f" (its tokenizer has {record['vocab_size']})" if record else ""
        for part, dataset in parts:
            tokens = dataset.tokens
            where = f"{name}: the {part} part"
            if tokens.dtype.kind == "f" and (fractional := tokens[(np.floor(tokens) != tokens) |
                                                                  ~np.isfinite(tokens)]).size:
                raise DataError(f"{where} holds token id {fractional[0]} in a {tokens.dtype.name} index; token "
                                f"ids are whole numbers: prepare the data again with an integer dtype")
            smallest, largest = tokens.min(), tokens.max()
            if smallest < 0:
                raise DataError(f"{where} holds token id {smallest}; token ids are 0 .. vocab_size - 1: "
                                f"prepare the data again with this tokenizer")
            if largest >= vocab_size:
                at_least = record["vocab_size"] if record else int(largest) + 1
                raise DataError(f"{where} holds token id {largest}{tokenizer} but vocab_size={vocab_size}; raise "
                                f"--vocab-size to at least {at_least} or use data made with this model's tokenizer")


def unknown_tokenizers(config: DataConfig, train, valid) -> list[str]:
    """A line for each stream whose PREFIX.meta.json is there but not believed (damaged, or of other tokens),
    and, in a blend, for each that has none: what their tokenizers are is unknown, so a blend of two cannot be
    refused (_check_one_tokenizer), and was not said."""
    streams, lines = _streams(config, train, valid), []
    for name, path, _ in streams:
        meta = path.removesuffix(".bin") + META_SUFFIX
        if prepared_record(path) is not None:
            continue
        if os.path.exists(meta):
            lines.append(f"{name}: {meta} is damaged or not of these tokens, so their tokenizer is unknown; "
                         f"prepare the data again to restore it")
        elif len(streams) > 1:
            lines.append(f"{name} has no {meta} (not made by prepare), so the blend cannot check that its "
                         f"streams share one tokenizer")
    return lines


def _check_one_tokenizer(records: dict[str, dict | None]) -> None:
    """A blend of streams prepare made with different tokenizers mixes two meanings of each id: refused, where
    their records say so: their vocabularies' digests (tokenizer.vocab_digest; two BPEs of one size trained on
    other text differ there alone), or in records from before those, their kind, size and end-of-document id."""
    kinds = {path: (r.get("tokenizer_type"), r["vocab_size"], r.get("eod")) for path, r in records.items() if r}
    digests = {path: r.get("vocab_digest") for path, r in records.items() if r}
    differ = len(set(digests.values())) > 1 if None not in digests.values() else len(set(kinds.values())) > 1
    if differ:
        named = "; ".join(f"{path}: {kind} of {size} ids" for path, (kind, size, _) in kinds.items())
        raise DataError(f"--data-path blends data of different tokenizers ({named}); a blend's streams share one "
                        f"tokenizer: prepare them with the same --tokenizer-type and --tokenizer-model")


def check_batches(config: DataConfig, train, valid, global_batch_size: int, evaluates: bool) -> None:
    """A train part of fewer samples than one global batch is refused: every batch would repeat samples.
    A valid part that small is only warned about (one line): a validation batch that repeats samples
    still measures the loss, weighting some samples more. A blend counts the samples of all its streams."""
    shortfall = f"samples of seq_length + 1 = {train.seq_length + 1} tokens, fewer than one global batch of " \
                f"{global_batch_size}, so each batch repeats samples"
    if len(train) < global_batch_size:
        raise DataError(f"{_source(config)}: the train part holds {len(train)} {shortfall}; give more data, "
                        f"or lower --global-batch-size or --seq-length")
    if evaluates and len(valid) < global_batch_size:
        print(f"warning: {_source(config)}: the valid part holds {len(valid)} {shortfall}; a larger valid "
              f"weight in --split gives it more", file=sys.stderr)


if __name__ == "__main__":
    shutdown.install(shutdown.stopper(exit_signal_handler=False), "python -m gcompile.data")  # Ctrl-C: one line
    main()
