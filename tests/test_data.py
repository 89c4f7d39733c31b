"""Token data: Megatron .bin/.idx format, byte tokenizer, sample order, split, errors, prepare CLI.

Expected values come from the format spec written out by hand with struct and
from plain slicing of the token stream, never from the code under test.
"""

import os
import re
import struct
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from gcompile import data, prepare, tokenizer
from gcompile.data import DataConfig, DataError, GPTDataset, build_datasets, load_tokens
from gcompile.indexed_dataset import IndexedDataset, IndexedDatasetWriter

MEGATRON_CODES = {np.uint16: 8, np.int32: 4}


def write_megatron_by_hand(prefix, documents, dtype):
    """PREFIX.bin/.idx per Megatron's _IndexWriter, one sequence per sentence.

    `documents` is a list of documents, each a list of sentences (token lists),
    so multi-sequence documents, as preprocess_data.py --split-sentences writes, are covered.
    """
    lengths = [len(s) for doc in documents for s in doc]
    itemsize = np.dtype(dtype).itemsize
    pointers = [sum(lengths[:i]) * itemsize for i in range(len(lengths))]
    doc_idx = [0]
    for doc in documents:
        doc_idx.append(doc_idx[-1] + len(doc))
    with open(prefix + ".bin", "wb") as f:
        for doc in documents:
            for sentence in doc:
                f.write(np.array(sentence, dtype=np.dtype(dtype).newbyteorder("<")).tobytes())
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", MEGATRON_CODES[dtype]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(struct.pack(f"<{len(lengths)}i", *lengths))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_idx)}q", *doc_idx))


def write_documents(prefix, documents, dtype=np.uint16):
    with IndexedDatasetWriter(str(prefix), dtype=dtype) as writer:
        for doc in documents:
            writer.add_document(doc)
    return str(prefix)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "gcompile.data", *args], capture_output=True, text=True)


# --- format -------------------------------------------------------------------------------------

def test_writer_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 257, size=n) for n in (5, 0, 17, 1)]
    prefix = write_documents(tmp_path / "rt", docs)
    ds = IndexedDataset(prefix)
    assert len(ds) == 4
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ds.get(i), doc)
    np.testing.assert_array_equal(ds.document_indices, [0, 1, 2, 3, 4])
    np.testing.assert_array_equal(ds.tokens, np.concatenate(docs))
    assert sorted(os.listdir(tmp_path)) == ["rt.bin", "rt.idx"]  # no temporary files left


def test_writer_leaves_nothing_on_error(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(str(tmp_path / "x")) as writer:
            writer.add_document([1, 2, 3])
            raise RuntimeError("interrupted")
    assert os.listdir(tmp_path) == []


def test_writer_output_matches_hand_written_spec(tmp_path):
    docs = [[3, 1, 4], [1, 5], [9, 2, 6, 5]]
    write_documents(tmp_path / "ours", docs, np.int32)
    write_megatron_by_hand(str(tmp_path / "spec"), [[d] for d in docs], np.int32)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours{ext}").read_bytes() == (tmp_path / f"spec{ext}").read_bytes()


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_reads_megatron_files_written_from_the_spec(tmp_path, dtype):
    big = 70000 if dtype == np.int32 else 65000  # int32 for vocabularies beyond uint16
    docs = [[[1, 2, 3], [big, 5]], [[6]], [[7, 8, 9, 10], [11], [12, 13]]]
    prefix = str(tmp_path / "meg")
    write_megatron_by_hand(prefix, docs, dtype)
    ds = IndexedDataset(prefix)
    sentences = [s for doc in docs for s in doc]
    assert len(ds) == len(sentences) and ds.dtype == np.dtype(dtype)
    for i, s in enumerate(sentences):
        np.testing.assert_array_equal(ds.get(i), s)
    np.testing.assert_array_equal(ds.document_indices, [0, 2, 3, 6])
    np.testing.assert_array_equal(load_tokens(prefix), [t for s in sentences for t in s])


def test_raw_nanogpt_bin(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16) * 50
    tokens.tofile(tmp_path / "train.bin")
    np.testing.assert_array_equal(load_tokens(str(tmp_path / "train.bin")), tokens)
    train, valid = build_datasets(DataConfig(str(tmp_path / "train.bin"), split="9,1"), seq_length=16, seed=0)
    assert len(train) == (900 - 1) // 16 and len(valid) == (100 - 1) // 16


def test_a_prepared_bin_without_its_idx_is_not_read_as_raw_tokens(tmp_path):
    """An int32 pair whose .idx was lost trained as twice as many uint16 halves of each id."""
    (tmp_path / "text.txt").write_text("hello world\n" * 100)
    prepare.main(["prepare", "--input", str(tmp_path / "text.txt"), "--output", str(tmp_path / "corpus")])
    os.remove(tmp_path / "corpus.idx")
    for given in ("corpus.bin", "corpus"):  # the file, or the prefix
        with pytest.raises(DataError, match=re.escape(f"{given}: its {tmp_path / 'corpus'}.idx is missing")):
            load_tokens(str(tmp_path / given))


def test_byte_tokenizer():
    text = "def f():\n    return 'héllo'"
    ids = tokenizer.encode(text.encode())
    assert ids.dtype == np.uint16 and ids[-1] == tokenizer.EOD == 256 and tokenizer.VOCAB_SIZE == 257
    assert list(ids[:-1]) == list(text.encode())
    assert tokenizer.decode(ids) == text + "\n"


# --- samples, order, split -----------------------------------------------------------------------

def test_samples_are_windows_of_the_stream_and_one_epoch_covers_each_once():
    stream = np.random.default_rng(1).integers(0, 257, size=1000)
    L = 10
    ds = GPTDataset(stream, seq_length=L, seed=3)
    assert len(ds) == 99  # sample j = [10j, 10j + 11) must end by 1000
    epoch = ds.batch(0, len(ds))
    assert epoch.shape == (99, L + 1) and epoch.dtype == torch.int64
    windows = {tuple(stream[j * L : j * L + L + 1]) for j in range(99)}
    assert {tuple(row.tolist()) for row in epoch} == windows
    assert not torch.equal(epoch, torch.tensor(np.stack([stream[j * L : j * L + L + 1] for j in range(99)])))


def test_resumed_order_equals_uninterrupted_across_epochs():
    stream = np.arange(700)
    ds = GPTDataset(stream, seq_length=7, seed=11)  # 99 samples per epoch
    uninterrupted = torch.cat([ds.batch(c, 8) for c in range(0, 416, 8)])  # 4+ epochs in steps of 8
    for resume in (0, 40, 96, 99, 200, 299):
        fresh = GPTDataset(stream, seq_length=7, seed=11)
        resumed = torch.cat([fresh.batch(c, 8) for c in range(resume, 400, 8)])
        assert torch.equal(resumed, uninterrupted[resume : resume + len(resumed)])
    first, second = uninterrupted[:99], uninterrupted[99:198]
    assert not torch.equal(first, second)  # a new permutation per epoch
    assert sorted(map(tuple, first.tolist())) == sorted(map(tuple, second.tolist()))
    assert not torch.equal(GPTDataset(stream, 7, seed=12).batch(0, 99), first)


def test_train_and_valid_are_disjoint_token_ranges(tmp_path):
    n = 20000
    prefix = write_documents(tmp_path / "pos", [np.arange(0, 12345), np.arange(12345, n)], np.int32)
    train, valid = build_datasets(DataConfig(prefix, split="969,30,1"), seq_length=32, seed=0)
    train_end, valid_end = round(n * 0.969), round(n * 0.999)
    tr, va = train.batch(0, len(train)), valid.batch(0, len(valid))
    assert len(train) == (train_end - 1) // 32 and len(valid) == (valid_end - train_end - 1) // 32
    assert tr.max() < train_end <= va.min() and va.max() < valid_end
    assert (tr[:, 1:] - tr[:, :-1] == 1).all() and (va[:, 1:] - va[:, :-1] == 1).all()


# --- bad input -----------------------------------------------------------------------------------

def test_missing_data_path(tmp_path):
    with pytest.raises(DataError, match=r"--data-path .*foo: no .*foo\.bin / .*foo\.idx found"):
        build_datasets(DataConfig(str(tmp_path / "foo")), seq_length=8, seed=0)


@pytest.mark.parametrize("docs, match", [
    ([], r"0 tokens.*seq_length \+ 1 = 9"),
    ([[1, 2, 3]], r"3 tokens.*seq_length \+ 1 = 9"),
    ([list(range(100))], r"leaves valid 2, fewer than one sample of .* = 9; it needs at least 451"),
])
def test_too_little_data(tmp_path, docs, match):
    prefix = write_documents(tmp_path / "small", docs)
    with pytest.raises(DataError, match=match):
        build_datasets(DataConfig(prefix), seq_length=8, seed=0)


def test_bad_split(tmp_path):
    prefix = write_documents(tmp_path / "d", [list(range(100))])
    for split in ("98", "a,b", "100,0", "1,2,3,4"):
        with pytest.raises(DataError, match="split"):
            build_datasets(DataConfig(prefix, split=split), seq_length=8, seed=0)


def corrupt(prefix, edit):
    """Apply `edit(idx_bytes, bin_bytes) -> (idx_bytes, bin_bytes)` to a good three-document pair."""
    write_documents(prefix, [[1, 2, 3], [4, 5], [6, 7, 8, 9]])
    idx, bin_ = edit(open(prefix + ".idx", "rb").read(), open(prefix + ".bin", "rb").read())
    open(prefix + ".idx", "wb").write(idx)
    open(prefix + ".bin", "wb").write(bin_)
    return prefix


HEADER = 34  # magic 9 + version 8 + dtype 1 + sequence count 8 + document count 8
BAD_FILES = {
    "short file": (lambda i, b: (i[:20], b), r"truncated, 20 bytes"),
    "wrong magic": (lambda i, b: (b"NOTANIDX\x00" + i[9:], b), r"not a Megatron index"),
    "truncated arrays": (lambda i, b: (i[:-8], b), r"need 102 bytes but the file has 94"),
    "counts too large": (lambda i, b: (i[:18] + struct.pack("<Q", 4) + i[26:], b), r"4 sequences .* need"),
    "pointer beyond bin": (
        lambda i, b: (i[: HEADER + 12 + 16] + struct.pack("<q", 1000) + i[HEADER + 12 + 24 :], b),
        r"pointers reach byte 1008, beyond the 18-byte"),
    "bin too short": (lambda i, b: (i, b[:-2]), r"16 bytes but .* describes 18"),
    "bin too long": (lambda i, b: (i, b + b"\x00\x00"), r"20 bytes but .* describes 18"),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_corrupt_files(tmp_path, case):
    edit, match = BAD_FILES[case]
    prefix = corrupt(str(tmp_path / "c"), edit)
    with pytest.raises(DataError, match=match):
        build_datasets(DataConfig(prefix), seq_length=2, seed=0)


def test_odd_sized_raw_bin(tmp_path):
    (tmp_path / "raw.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(DataError, match="3 bytes, not a whole number of uint16 tokens"):
        load_tokens(str(tmp_path / "raw.bin"))


def test_a_raw_bin_of_int32_ids_is_refused_and_one_of_uint16_read(tmp_path):
    """Read as uint16, int32 ids were trained on with a 0 after each, without a word."""
    ids = np.random.default_rng(0).integers(1, 300, 1000)
    ids.astype(np.int32).tofile(tmp_path / "wide.bin")
    with pytest.raises(DataError, match="every second uint16 of its start is 0, as in a file of int32 ids"):
        load_tokens(str(tmp_path / "wide.bin"))
    ids.astype(np.uint16).tofile(tmp_path / "raw.bin")
    assert np.array_equal(load_tokens(str(tmp_path / "raw.bin")), ids)


# --- prepare -------------------------------------------------------------------------------------

def make_tree(root):
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "pkg" / "b.py").write_text("print('b')\n")
    (root / "pkg" / "a.py").write_text("x = 'é'\n")
    (root / "pkg" / "sub" / "c.py").write_text("")
    (root / "pkg" / "notes.txt").write_text("not python")
    return root / "pkg"


def test_prepare_cli_on_a_folder(tmp_path):
    folder = make_tree(tmp_path)
    extra = tmp_path / "extra.txt"
    extra.write_text("hi")
    out = tmp_path / "out" / "corpus"
    result = run_cli("prepare", "--input", str(folder), str(extra), "--output", str(out), "--pattern", "*.py",
                     "--append-eod")
    assert result.returncode == 0, result.stderr
    assert "4/4 files" in result.stderr and "4 documents" in result.stdout
    ds = IndexedDataset(str(out))
    expected = [b"x = '\xc3\xa9'\n", b"print('b')\n", b"", b"hi"]  # a.py, b.py, sub/c.py, then extra.txt
    for i, doc in enumerate(expected):
        assert ds.get(i).tolist() == list(doc) + [tokenizer.EOD]


@pytest.mark.parametrize("args, match", [
    (["--input", "MISSING"], "--input .*nope: no such file or folder"),
    (["--input", "EMPTY", "--pattern", "*.rs"], "no files matching --pattern '\\*.rs'"),
])
def test_prepare_cli_errors_are_one_line_and_status_2(tmp_path, args, match):
    (tmp_path / "empty").mkdir()
    paths = {"MISSING": str(tmp_path / "nope"), "EMPTY": str(tmp_path / "empty")}
    args = [paths.get(a, a) for a in args]
    result = run_cli("prepare", *args, "--output", str(tmp_path / "o"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m gcompile.data prepare: error: ")
    assert re.search(match, lines[0])


def test_default_corpus_prepared_once_and_reused(tmp_path, monkeypatch):
    stdlib = make_tree(tmp_path / "lib")
    (stdlib / "site-packages").mkdir()
    (stdlib / "site-packages" / "third_party.py").write_text("import numpy\n")
    monkeypatch.setattr(data, "STDLIB", str(stdlib))
    cache = tmp_path / "cache"
    prefixes = []
    threads = [threading.Thread(target=lambda: prefixes.append(data.default_corpus(str(cache))))
               for _ in range(4)]  # concurrent first use
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(prefixes)) == 1
    prefix = prefixes[0]
    assert os.path.basename(prefix).startswith(f"stdlib-py{sys.version_info.major}.{sys.version_info.minor}")
    assert sorted(os.listdir(cache)) == [os.path.basename(prefix) + ext for ext in (".bin", ".idx", ".meta.json")]
    ds = IndexedDataset(prefix)
    assert len(ds) == 3  # a.py, b.py, sub/c.py; not notes.txt, not site-packages
    assert tokenizer.decode(ds.tokens) == "x = 'é'\n\nprint('b')\n\n\n"
    mtime = os.path.getmtime(prefix + ".idx")
    assert data.default_corpus(str(cache)) == prefix and os.path.getmtime(prefix + ".idx") == mtime
    train, valid = build_datasets(DataConfig(cache_dir=str(cache), split="1,1"), seq_length=4, seed=0)
    assert len(train) == (12 - 1) // 4 and len(valid) == (11 - 1) // 4  # 23 tokens, cut at 12
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # without a folder given: the user's cache
    assert data.default_corpus() == str(tmp_path / "xdg" / "gcompile" / "data" / os.path.basename(prefix))
    os.truncate(prefix + ".bin", 5)  # a cut cache was refused ever after, its fix "prepare it again" the user's
    assert data.default_corpus(str(cache)) == prefix
    assert tokenizer.decode(IndexedDataset(prefix).tokens) == "x = 'é'\n\nprint('b')\n\n\n"
