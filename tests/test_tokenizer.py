"""Tokenizers in `prepare`: each --tokenizer-type on a small corpus, a BPE trained here, workers, EOD,
the vocab size that travels with the data, and one-line errors.

Expected ids come from the `tokenizers` library called directly on each file's text;
decoding the prepared ids must give the text back.
"""

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from tokenizers import ByteLevelBPETokenizer, Tokenizer, models, pre_tokenizers, trainers

import run_gpt
from gcompile import checkpoint, prepare, tokenizer
from gcompile.data import DataConfig, DataError, build_datasets, check_token_ids
from gcompile.prepare import bin_stamp
from gcompile.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from gcompile.models.gpt2 import GPT2
from gcompile.models.gpt2_config import GPTConfig

TEXTS = {
    "a.py": "def add(x, y):\n    return x + y\n\nprint(add(1, 2))\n",
    "b.txt": "Héllo, wörld! 你好 — tabs\tand  spaces  \n" * 3,
    "c.md": "# Title\n\nSome *markdown* with `code` and émojis 🙂.\n",
    "d.py": "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n" * 4,
    "e.txt": "A document may name <|endoftext|> without ending there.\n",
}


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    for name, text in TEXTS.items():
        (folder / name).write_text(text, encoding="utf-8")
    return folder


def cli(*args) -> int:
    try:
        prepare.main(["prepare", *map(str, args)])
    except SystemExit as e:
        return e.code
    return 0


def documents(prefix) -> list[list[int]]:
    ds = IndexedDataset(str(prefix))
    return [ds.get(i).tolist() for i in range(len(ds))]


def gpt2_files(folder) -> tuple[str, str]:
    """A tiny GPT-2-style vocab.json + merges.txt, trained here on the same texts."""
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(list(TEXTS.values()), vocab_size=280, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    bpe.save_model(str(folder))
    return str(folder / "vocab.json"), str(folder / "merges.txt")


def test_byte_level(corpus, tmp_path):
    assert cli("--input", corpus, "--output", tmp_path / "bytes", "--append-eod") == 0
    docs = documents(tmp_path / "bytes")
    for doc, text in zip(docs, TEXTS.values()):
        assert doc == list(text.encode()) + [256]
        assert tokenizer.ByteLevel().decode(doc[:-1]) == text
    meta = json.loads((tmp_path / "bytes.meta.json").read_text())
    assert meta["vocab_size"] == 257 and meta["eod"] == 256 and meta["largest_id"] == max(max(d) for d in docs)


def test_train_tokenizer_then_hugging_face(corpus, tmp_path, capsys):
    assert cli("--input", corpus, "--output", tmp_path / "bpe", "--train-tokenizer", "--vocab-size", 300,
               "--append-eod") == 0
    path = tmp_path / "bpe.tokenizer.json"
    assert "trained a byte-level BPE of 300 entries on 5 files" in capsys.readouterr().err
    reference = Tokenizer.from_file(str(path))
    reference.encode_special_tokens = True  # "<|endoftext|>" inside e.txt is text, not the end of it
    eod = reference.token_to_id("<|endoftext|>")
    assert reference.get_vocab_size() == 300
    docs = documents(tmp_path / "bpe")
    ours = tokenizer.build(tokenizer.TokenizerSpec("HuggingFaceTokenizer", tokenizer_model=str(path)))
    for doc, text in zip(docs, TEXTS.values()):
        assert doc == reference.encode(text).ids + [eod] and eod not in doc[:-1]
        assert len(doc) < len(text.encode())  # merges were learned
        assert ours.decode(doc[:-1]) == text
    meta = json.loads((tmp_path / "bpe.meta.json").read_text())
    assert meta["tokenizer_type"] == "HuggingFaceTokenizer" and meta["tokenizer_model"] == str(path)
    assert meta["vocab_size"] == 300 and meta["eod"] == eod and meta["num_tokens"] == sum(map(len, docs))

    # the same tokenizer.json, given back: a folder holding it, with transformers' config naming the EOD
    folder = tmp_path / "hf"
    folder.mkdir()
    reference.add_special_tokens(["<|end|>"])
    reference.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|end|>"}}))
    assert cli("--input", corpus, "--output", tmp_path / "again", "--tokenizer-type", "HuggingFaceTokenizer",
               "--tokenizer-model", folder, "--append-eod") == 0
    end = reference.token_to_id("<|end|>")
    assert end == 300 and [d[:-1] for d in documents(tmp_path / "again")] == [d[:-1] for d in docs]
    assert {d[-1] for d in documents(tmp_path / "again")} == {end}


def test_gpt2_bpe_with_workers(corpus, tmp_path):
    vocab, merges = gpt2_files(tmp_path)
    outputs = {}
    for workers in (1, 2):
        outputs[workers] = tmp_path / f"gpt2-{workers}"
        assert cli("--input", corpus, "--output", outputs[workers], "--tokenizer-type", "GPT2BPETokenizer",
                   "--vocab-file", vocab, "--merge-file", merges, "--workers", workers, "--append-eod") == 0
    for ext in (".bin", ".idx"):  # the worker count does not change the output
        assert (tmp_path / f"gpt2-1{ext}").read_bytes() == (tmp_path / f"gpt2-2{ext}").read_bytes()
    reference = ByteLevelBPETokenizer(vocab, merges)
    eod = json.loads(open(vocab).read())["<|endoftext|>"]
    ours = tokenizer.build(tokenizer.TokenizerSpec("GPT2BPETokenizer", vocab, merges))
    for doc, text in zip(documents(outputs[2]), TEXTS.values()):
        assert doc == reference.encode(text).ids + [eod]
        assert ours.decode(doc[:-1]) == text


def test_without_append_eod_documents_end_as_they_are(corpus, tmp_path):
    assert cli("--input", corpus / "a.py", "--output", tmp_path / "plain") == 0
    assert documents(tmp_path / "plain") == [list(TEXTS["a.py"].encode())]


def test_progress_line_counts_files_and_tokens(corpus, tmp_path, capsys):
    assert cli("--input", corpus, "--output", tmp_path / "p") == 0
    last = capsys.readouterr().err.strip().splitlines()[-1]
    tokens = sum(len(t.encode()) for t in TEXTS.values())
    assert "5/5 files" in last and f"{tokens} tokens" in last and "tokens/s" in last


def test_run_refuses_a_vocab_smaller_than_the_data(corpus, tmp_path, capsys):
    assert cli("--input", corpus, "--output", tmp_path / "bpe", "--train-tokenizer", "--vocab-size", 400,
               "--append-eod") == 0
    largest = max(max(d) for d in documents(tmp_path / "bpe"))
    vocab = json.loads((tmp_path / "bpe.meta.json").read_text())["vocab_size"]
    assert largest >= 257 and vocab > largest
    assert f"of {vocab} entries (the corpus had no more pairs to merge for 400)" in capsys.readouterr().err
    config = DataConfig(str(tmp_path / "bpe"), split="1,1")
    train, valid = build_datasets(config, seq_length=8, seed=0)
    part, beyond = next((part, d.tokens.max()) for part, d in (("train", train), ("valid", valid))
                        if d.tokens.max() >= 257)
    status = run_gpt.main(["--data-path", str(tmp_path / "bpe"), "--split", "1,1", "--seq-length", "8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and err == [f"run_gpt.py: error: --data-path {tmp_path / 'bpe'}: the {part} part holds token "
                                   f"id {beyond} (its tokenizer has {vocab}) but vocab_size=257; raise --vocab-size "
                                   f"to at least {vocab} or use data made with this model's tokenizer"]
    check_token_ids(config, train, valid, vocab)


def test_vocab_check_believes_only_a_record_of_these_tokens(tmp_path):
    """Megatron's files carry no .meta.json: their tokens are read. A record of another token count (left
    from an earlier pair), of another .bin of the same count (copied from it), or a damaged one is not believed;
    one written beside this .bin is, and no token is read."""
    with IndexedDatasetWriter(str(tmp_path / "meg")) as writer:
        writer.add_document([1, 2, 300, 4] * 10)
    config = DataConfig(str(tmp_path / "meg"), split="1,1")
    parts = build_datasets(config, seq_length=4, seed=0)
    beyond = r"the train part holds token id 300 but vocab_size=257; raise --vocab-size to at least 301"
    with pytest.raises(DataError, match=beyond):
        check_token_ids(config, *parts, 257)
    stamp = bin_stamp(str(tmp_path / "meg.bin"))
    other = [stamp[0], stamp[1] + 1]  # another .bin of the same size: written at another time
    for record in (json.dumps(dict(largest_id=5, vocab_size=257, num_tokens=3, bin=stamp)), "{not json",
                   json.dumps(dict(largest_id=5, vocab_size=257, num_tokens=40, bin=other)),
                   json.dumps(dict(largest_id=5, vocab_size=257, num_tokens=40))):
        (tmp_path / "meg.meta.json").write_text(record)
        with pytest.raises(DataError, match=beyond):
            check_token_ids(config, *parts, 257)
    (tmp_path / "meg.meta.json").write_text(json.dumps(dict(largest_id=5, vocab_size=257, num_tokens=40, bin=stamp)))
    check_token_ids(config, *parts, 257)  # the record says 5: believed, the 300 unread
    os.remove(tmp_path / "meg.meta.json")
    check_token_ids(config, *parts, 301)


@pytest.mark.parametrize("args, message", [
    (["--tokenizer-type", "SentencePiece"], r"--tokenizer-type SentencePiece: unknown; choose one of ByteLevel, "),
    (["--tokenizer-type", "GPT2BPETokenizer"], r"no --vocab-file given; GPT2BPETokenizer needs --vocab-file"),
    (["--tokenizer-type", "HuggingFaceTokenizer"], r"no --tokenizer-model given; HuggingFaceTokenizer needs "),
    (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "NOPE"],
     r"--tokenizer-model .*NOPE: no such file; HuggingFaceTokenizer needs --tokenizer-model tokenizer.json"),
    (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "BAD"],
     r"--tokenizer-model .*BAD: not a Hugging Face tokenizer.json"),
    (["--vocab-file", "v.json"], r"--vocab-file does not apply with --tokenizer-type ByteLevel; leave it out"),
    (["--vocab-size", "300"], r"--train-tokenizer and --vocab-size N go together"),
    (["--train-tokenizer", "--vocab-size", "100"], r"--vocab-size 100: a byte-level BPE needs at least 257"),
    (["--train-tokenizer", "--vocab-size", "300", "--tokenizer-type", "GPT2BPETokenizer"],
     r"--train-tokenizer makes a HuggingFaceTokenizer, not --tokenizer-type GPT2BPETokenizer"),
    (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "NO_EOD", "--append-eod"],
     r"--append-eod: .*NO_EOD has no end-of-document token"),
    (["--workers", "0"], r"--workers 0: give 1 to 256"),
])
def test_bad_tokenizer_flags_are_one_line(corpus, tmp_path, capsys, args, message):
    (tmp_path / "BAD").write_text("{not json")
    bpe = Tokenizer(models.BPE())  # a vocabulary with no end-of-document entry
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(list(TEXTS.values()), trainers.BpeTrainer(vocab_size=270, show_progress=False))
    bpe.save(str(tmp_path / "NO_EOD"))
    args = [str(tmp_path / a) if a in ("NOPE", "BAD", "NO_EOD") else a for a in args]
    assert cli("--input", corpus, "--output", tmp_path / "out", *args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m gcompile.data prepare: error: ") and re.search(message, err[0]), err
    assert not os.path.exists(tmp_path / "out.bin")


@pytest.mark.parametrize("config, message", [
    ("{{{", r"tokenizer_config.json: not valid JSON \(.*\); fix it, or remove it"),
    ("[1]", r"tokenizer_config.json: not a JSON object of tokenizer settings"),
    ('{"eos_token": 5}', r"tokenizer_config.json: eos_token is 5, not a token's text"),
    ('{"eos_token": "<notthere>"}', r"tokenizer_config.json: eos_token '<notthere>' is not in .*tokenizer.json's "
                                    r"vocabulary"),  # it fell back to another token without a word
])
def test_a_bad_tokenizer_config_is_one_line(corpus, tmp_path, capsys, config, message):
    """transformers' tokenizer_config.json beside a tokenizer.json names its end-of-document token."""
    folder = tmp_path / "hf"
    folder.mkdir()
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(list(TEXTS.values()), trainers.BpeTrainer(vocab_size=270, show_progress=False,
                                                                      special_tokens=["<|endoftext|>"]))
    bpe.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(config)
    assert cli("--input", corpus, "--output", tmp_path / "out", "--tokenizer-type", "HuggingFaceTokenizer",
               "--tokenizer-model", folder, "--append-eod") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(message, err[0]), err


def test_a_tokenizer_whose_ids_pass_65535_is_written_wide_enough(corpus, tmp_path):
    """The file's dtype came from the tokenizer's entry count: an id of 70000 in a 300-entry vocabulary was
    stored as 70000 - 65536, silently."""
    assert cli("--input", corpus, "--output", tmp_path / "bpe", "--train-tokenizer", "--vocab-size", 300) == 0
    spec = json.loads((tmp_path / "bpe.tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    token = next(t for t, i in vocab.items() if i == max(vocab.values()))
    vocab[token] = 70000  # an id past 65535, the entry count unchanged
    (tmp_path / "wide.json").write_text(json.dumps(spec))
    (corpus / "f.txt").write_text(token * 10)
    assert cli("--input", corpus / "f.txt", "--output", tmp_path / "wide", "--tokenizer-type", "HuggingFaceTokenizer",
               "--tokenizer-model", tmp_path / "wide.json") == 0
    assert 70000 in documents(tmp_path / "wide")[0]


def test_the_writer_refuses_an_id_its_dtype_cannot_hold_and_leaves_nothing(tmp_path):
    with pytest.raises(DataError, match=r"narrow.bin: token id 70000 does not fit its uint16; write it with a wider"):
        with IndexedDatasetWriter(str(tmp_path / "narrow"), np.uint16) as writer:
            writer.add_document([1, 2, 70000])
    assert os.listdir(tmp_path) == []


def test_a_dead_writers_temporary_files_go_with_the_next_writer_and_a_live_ones_stay(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = tmp_path / f"corpus.bin.tmp-{dead.stdout.strip()}-0123abcd"
    left.write_bytes(b"half")
    alive = tmp_path / f"corpus.idx.tmp-{os.getppid()}-0123abcd"  # a writer still at work (pytest's parent)
    alive.write_bytes(b"half")
    with IndexedDatasetWriter(str(tmp_path / "corpus"), np.uint16) as writer:
        writer.add_document([1, 2])
    assert sorted(os.listdir(tmp_path)) == ["corpus.bin", "corpus.idx", alive.name]


WRITER_STOPPED_MIDWAY = """
import sys
import time
from gcompile import paths, shutdown
from gcompile.prepare import write_replacing
shutdown.install(shutdown.stopper(exit_signal_handler=False), "python -m gcompile.data")
write_replacing(sys.argv[1] + ".meta.json", "{}")  # done: in place, kept
with open(paths.temp_name(sys.argv[1] + ".bin"), "w") as half:
    half.write("half")
    half.flush()
    print("writing", flush=True)
    time.sleep(120)  # until the test's signal
"""


def test_a_writer_stopped_by_a_signal_leaves_no_temporary_file(tmp_path):
    """A SIGINT or SIGTERM to `python -m gcompile.data prepare` left PREFIX.bin.tmp-PID-... (5 MB in a walk of the
    README, which said none is left): the signal's exit does not unwind, so no `finally` removed it."""
    writer = subprocess.Popen([sys.executable, "-c", WRITER_STOPPED_MIDWAY, str(tmp_path / "corpus")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(__file__))))
    assert writer.stdout.readline() == "writing\n"
    assert any(".tmp-" in name for name in os.listdir(tmp_path))
    writer.send_signal(signal.SIGINT)
    _, err = writer.communicate(timeout=60)
    assert writer.returncode == 130 and err == "python -m gcompile.data: stopped by SIGINT\n", err
    assert os.listdir(tmp_path) == ["corpus.meta.json"]


def test_generate_from_a_model_of_a_trained_tokenizer(corpus, tmp_path, capsys):
    """It crashed (bytes must be in range(0, 256)): generate knew only the byte tokenizer."""
    assert cli("--input", corpus, "--output", tmp_path / "bpe", "--train-tokenizer", "--vocab-size", 300,
               "--append-eod") == 0
    config = GPTConfig(vocab_size=300, n_layer=1, n_head=2, n_embd=16, block_size=32)
    torch.save(dict(model=GPT2.build(config, seed=0).state_dict(), model_args=dataclasses.asdict(config)),
               tmp_path / "model.pt")
    generate = ["generate", str(tmp_path / "model.pt"), "--prompt", "def add", "--max-new-tokens", "8"]
    capsys.readouterr()
    assert checkpoint.main(generate) == 2
    assert capsys.readouterr().err.endswith("model.pt scores 300 token ids, the tokenizer gives 257: give "
                                            "--tokenizer-model, the tokenizer.json its data was prepared with\n")
    assert checkpoint.main([*generate, "--tokenizer-model", str(tmp_path / "bpe.tokenizer.json")]) == 0
    text = capsys.readouterr().out
    assert text.startswith("def add") and len(text) > len("def add\n")
    # a model of far more ids than the tokenizer gives (GPT-2's 50257 with a BPE of 2048 printed a few words)
    wide = GPTConfig(vocab_size=300 + 1024, n_layer=1, n_head=2, n_embd=16, block_size=32)
    torch.save(dict(model=GPT2.build(wide, seed=0).state_dict(), model_args=dataclasses.asdict(wide)),
               tmp_path / "wide.pt")
    assert checkpoint.main(["generate", str(tmp_path / "wide.pt"), "--tokenizer-model",
                            str(tmp_path / "bpe.tokenizer.json")]) == 2
    assert "wide.pt scores 1324 token ids, the tokenizer gives 300" in capsys.readouterr().err
