"""Megatron-LM's indexed dataset files (`MMIDIDX`), read and written.

Files written by Megatron's `tools/preprocess_data.py` load unchanged, and
ours load in Megatron. A dataset is a pair of files with one PREFIX:

    PREFIX.bin  the token ids of every sequence, back to back, dtype from the index
    PREFIX.idx  all little-endian:
        b"MMIDIDX\\x00\\x00"           9 bytes, magic
        version            <Q  = 1
        dtype code         <B  (DTYPES below)
        sequence count S   <Q
        document count D   <Q  = documents + 1
        sequence lengths   S x int32, tokens per sequence
        sequence pointers  S x int64, byte offset of each sequence in .bin
        document indices   D x int64, first sequence of each document, starting
                           with 0 and ending with S
        (sequence modes    S x int8, multimodal only; accepted and ignored)

A document is a run of sequences; ours are one sequence each. The reader checks
the index against its own size and the .bin size, so a truncated or foreign
file fails with a DataError that names it instead of garbage tokens.
"""

import os
import struct

import numpy as np

from gcompile.paths import temp_name

MAGIC = b"MMIDIDX\x00\x00"
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, S, D: 34 bytes
DTYPES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
"""Megatron's DType codes; the enum order of megatron/core/datasets/indexed_dataset.py."""


class DataError(ValueError):
    """Bad data input, with a one-line message that names the problem and the fix."""


def _token_dtype(dtype) -> np.dtype:
    """Little-endian, as Megatron writes on every machine it runs on."""
    return np.dtype(dtype).newbyteorder("<")


class IndexedDatasetWriter:
    """Writes PREFIX.bin / PREFIX.idx, one sequence per document.

    Both files are written under temporary names and moved into place with
    os.replace when the `with` block ends without error (.bin first, then .idx),
    so a reader never sees a half-written index.
    """

    def __init__(self, prefix: str, dtype=np.uint16):
        self.prefix = prefix
        self.dtype = _token_dtype(dtype)
        self.code = {np.dtype(t): c for c, t in DTYPES.items()}[np.dtype(dtype)]
        self.lengths: list[int] = []
        self._bin_tmp = temp_name(prefix + ".bin")
        self._idx_tmp = temp_name(prefix + ".idx")

    def __enter__(self) -> "IndexedDatasetWriter":
        self._bin = open(self._bin_tmp, "wb")
        return self

    def add_document(self, tokens) -> None:
        tokens = np.asarray(tokens)
        if tokens.size and self.dtype.kind in "iu":
            bounds = np.iinfo(self.dtype)
            if tokens.min() < bounds.min or tokens.max() > bounds.max:  # astype would wrap them
                outside = tokens.max() if tokens.max() > bounds.max else tokens.min()
                raise DataError(f"{self.prefix}.bin: token id {outside} does not fit its {self.dtype.name}; write it "
                                f"with a wider dtype")
        self._bin.write(tokens.astype(self.dtype, copy=False).tobytes())
        self.lengths.append(len(tokens))

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self._bin.close()
            if exc_type is None:
                self._write_index()
                os.replace(self._bin_tmp, self.prefix + ".bin")
                os.replace(self._idx_tmp, self.prefix + ".idx")
        finally:  # a failure (a full disk, an interrupt) leaves nothing behind
            for temp in (self._bin_tmp, self._idx_tmp):
                if os.path.exists(temp):
                    os.remove(temp)

    def _write_index(self) -> None:
        lengths = np.array(self.lengths, dtype="<i4")
        pointers = np.zeros(len(lengths), dtype="<i8")
        np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        documents = np.arange(len(lengths) + 1, dtype="<i8")
        with open(self._idx_tmp, "wb") as f:
            f.write(HEADER.pack(MAGIC, 1, self.code, len(lengths), len(documents)))
            f.write(lengths.tobytes() + pointers.tobytes() + documents.tobytes())


class IndexedDataset:
    """A memory-mapped PREFIX.bin / PREFIX.idx pair; `get(i)` is sequence i."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        idx_path, bin_path = prefix + ".idx", prefix + ".bin"
        idx_size, bin_size = os.path.getsize(idx_path), os.path.getsize(bin_path)
        if idx_size < HEADER.size:
            raise DataError(f"{idx_path}: truncated, {idx_size} bytes but the header alone is "
                            f"{HEADER.size}; prepare it again")
        with open(idx_path, "rb") as f:
            magic, version, code, n_seq, n_doc = HEADER.unpack(f.read(HEADER.size))
        if magic != MAGIC:
            raise DataError(f"{idx_path}: not a Megatron index (magic {magic!r}, expected {MAGIC!r}); "
                            "write it with `python -m gcompile.data prepare` or Megatron's "
                            "preprocess_data.py")
        if version != 1 or code not in DTYPES:
            raise DataError(f"{idx_path}: unsupported index version {version} / dtype code {code} "
                            f"(known: version 1, codes {sorted(DTYPES)})")
        arrays = HEADER.size + n_seq * (4 + 8) + n_doc * 8
        if idx_size not in (arrays, arrays + n_seq):  # + n_seq: the int8 multimodal sequence modes
            raise DataError(f"{idx_path}: {n_seq} sequences and {n_doc} document indices need {arrays} "
                            f"bytes but the file has {idx_size}; the index is truncated or corrupt, "
                            "prepare it again")
        self.dtype = _token_dtype(DTYPES[code])
        idx = np.memmap(idx_path, dtype=np.uint8, mode="r")
        self.sequence_lengths = np.frombuffer(idx, "<i4", n_seq, HEADER.size)
        self.sequence_pointers = np.frombuffer(idx, "<i8", n_seq, HEADER.size + 4 * n_seq)
        # first sequence of each document, then S: document j is sequences [d[j], d[j+1])
        self.document_indices = np.frombuffer(idx, "<i8", n_doc, HEADER.size + 12 * n_seq)
        self._check(idx_path, bin_path, bin_size)
        # every sequence back to back: the stream the GPT dataset cuts samples from
        self.tokens = np.memmap(bin_path, self.dtype, mode="r") if bin_size else np.empty(0, self.dtype)

    def _check(self, idx_path: str, bin_path: str, bin_size: int) -> None:
        lengths = self.sequence_lengths.astype(np.int64)
        pointers, docs = self.sequence_pointers, self.document_indices
        if (lengths < 0).any():
            raise DataError(f"{idx_path}: negative sequence length; the index is corrupt, prepare it again")
        if len(docs) == 0 or docs[0] != 0 or docs[-1] != len(lengths) or (np.diff(docs) < 0).any():
            raise DataError(f"{idx_path}: document indices must rise from 0 to the sequence count "
                            f"{len(lengths)}; the index is corrupt, prepare it again")
        expected = int(lengths.sum()) * self.dtype.itemsize
        if bin_size != expected:
            raise DataError(f"{bin_path}: {bin_size} bytes but {idx_path} describes {expected} "
                            f"({lengths.sum()} tokens of {self.dtype.name}); the pair does not match, "
                            "prepare it again")
        ends = pointers + lengths * self.dtype.itemsize
        if (pointers < 0).any():
            raise DataError(f"{idx_path}: a sequence pointer is negative ({pointers.min()}); the index is corrupt, "
                            f"prepare it again")
        if (ends > bin_size).any():
            raise DataError(f"{idx_path}: sequence pointers reach byte {ends.max()}, beyond the "
                            f"{bin_size}-byte {bin_path}; the index is corrupt, prepare it again")
        if len(pointers) and (pointers[0] != 0 or (pointers[1:] != ends[:-1]).any()):
            raise DataError(f"{idx_path}: sequences are not stored back to back in {bin_path}; "
                            "rewrite the pair with gcompile or Megatron's preprocess_data.py")

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def get(self, i: int) -> np.ndarray:
        start = self.sequence_pointers[i] // self.dtype.itemsize
        return self.tokens[start : start + self.sequence_lengths[i]]
