"""Blended data: weighted --data-path, realized proportions, a resumable order, dp shares, split, config forms.

Each component's tokens lie in a range of their own, so which component a sample came
from is read off its tokens; the expected order comes from the rule written out as a
plain loop (the component whose next draw is most due), not from the sorted index.
"""

import json
import os
import re

import numpy as np
import pytest
import torch

import run_gpt
from gcompile import prepare
from gcompile.blend import BlendedDataset, blend_index, parse_blend
from gcompile.config import parse_args
from gcompile.data import (DataConfig, DataError, GPTDataset, build_datasets, check_batches, check_token_ids,
                           unknown_tokenizers)
from gcompile.indexed_dataset import IndexedDatasetWriter

L = 8
"""seq_length of the component datasets."""
BASE = 1000
"""Component i holds tokens in [i * BASE, (i + 1) * BASE)."""


def components(sizes, seed=5):
    return [GPTDataset(i * BASE + np.arange(n * L + 1) % BASE, L, seed) for i, n in enumerate(sizes)]


def source(samples: torch.Tensor) -> np.ndarray:
    return (samples[:, 0] // BASE).numpy()


def expected_order(weights, size):
    """Draw k goes to the component whose next draw is due first, due at (count + 0.5) / w; ties to the lower."""
    w = np.asarray(weights) / sum(weights)
    counts, order = [0] * len(w), []
    for _ in range(size):
        i = min(range(len(w)), key=lambda j: ((counts[j] + 0.5) / w[j], j))
        order.append(i)
        counts[i] += 1
    return order


def test_order_follows_the_rule_and_does_not_depend_on_size():
    weights = [0.5, 0.3, 0.2]
    comps, draws = blend_index(np.array(weights), 3000)
    assert comps.tolist() == expected_order(weights, 3000)
    for i in range(3):  # each component's draws are 0, 1, 2, ... in blend order
        assert draws[comps == i].tolist() == list(range((comps == i).sum()))
    small = blend_index(np.array(weights), 777)
    assert (small[0] == comps[:777]).all() and (small[1] == draws[:777]).all()
    assert comps[:7].tolist() == [0, 1, 2, 0, 0, 1, 0]  # due A 1 3 5 7, B 1.67 5, C 2.5 7.5


@pytest.mark.parametrize("weights", [[0.7, 0.3], [0.5, 0.3, 0.2], [1, 1, 1, 5], [0.05, 0.95]])
def test_proportions_within_1_percent_over_10k_samples(weights):
    blend = BlendedDataset(components([50, 7, 300, 20][:len(weights)]), weights)  # sizes unlike the weights
    picked = np.concatenate([source(blend.batch(c, 100)) for c in range(0, 10_000, 100)])
    share = np.bincount(picked, minlength=len(weights)) / len(picked)
    target = np.array(weights) / sum(weights)
    assert np.abs(share - target).max() < 0.01, (share, target)
    running = np.cumsum(picked[:, None] == np.arange(len(weights)), axis=0)  # (10k, m) counts so far
    drift = np.abs(running - np.arange(1, len(picked) + 1)[:, None] * target).max()
    assert drift <= 2, drift  # every prefix of the blend tracks the weights, not only the total


def test_components_draw_in_their_own_seeded_order():
    comps = components([13, 40])
    blend = BlendedDataset(comps, [0.6, 0.4])
    samples = blend.batch(0, 200)
    for i, comp in enumerate(comps):
        mine = samples[torch.from_numpy(source(samples) == i)]
        assert torch.equal(mine, comp.batch(0, len(mine)))  # epochs of 13 wrap in a fresh order each


def test_resumed_blend_equals_uninterrupted():
    weights = [0.7, 0.2, 0.1]
    straight = BlendedDataset(components([30, 11, 5]), weights)
    uninterrupted = torch.cat([straight.batch(c, 8) for c in range(0, 800, 8)])
    for resume in (8, 96, 400, 792):
        fresh = BlendedDataset(components([30, 11, 5]), weights)  # a new process: nothing cached
        resumed = torch.cat([fresh.batch(c, 8) for c in range(resume, 800, 8)])
        assert torch.equal(resumed, uninterrupted[resume:])
    other_seed = BlendedDataset(components([30, 11, 5], seed=6), weights)
    assert not torch.equal(other_seed.batch(0, 800), uninterrupted)


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_every_dp_layout_sees_the_same_samples(dp):
    """train.microbatches: dp rank r takes draws consumed + r * B/dp onwards."""
    blend = BlendedDataset(components([30, 11]), [0.7, 0.3])
    one = BlendedDataset(components([30, 11]), [0.7, 0.3])
    for consumed in (0, 16, 48):
        shares = [blend.batch(consumed + r * 16 // dp, 16 // dp) for r in range(dp)]
        assert torch.equal(torch.cat(shares), one.batch(consumed, 16))


def write(prefix, tokens):
    with IndexedDatasetWriter(str(prefix)) as writer:
        writer.add_document(tokens)
    return str(prefix)


def test_build_datasets_blends_train_with_train_and_valid_with_valid(tmp_path):
    a = write(tmp_path / "a", np.arange(0, 1000))
    b = write(tmp_path / "b with space", np.arange(2000, 3000))
    train, valid = build_datasets(DataConfig(f"0.7 {a} 0.3 '{b}'", split="8,2"), seq_length=L, seed=0)
    assert isinstance(train, BlendedDataset) and isinstance(valid, BlendedDataset)
    tr, va = train.batch(0, 1000), valid.batch(0, 1000)
    for samples, ranges in ((tr, [(0, 800), (2000, 2800)]), (va, [(800, 1000), (2800, 3000)])):
        from_a = samples[:, 0] < 2000
        assert abs(from_a.float().mean().item() - 0.7) < 0.01
        for rows, (lo, hi) in ((samples[from_a], ranges[0]), (samples[~from_a], ranges[1])):
            assert rows.min() >= lo and rows.max() < hi


def test_data_path_forms(tmp_path):
    toml = tmp_path / "blend.toml"
    toml.write_text('[data]\ndata_path = [0.7, "A", 0.3, "dir/B"]\n')
    from_toml = parse_args(["--config", str(toml)])[0].data.data_path
    from_flags = parse_args(["--data-path", "0.7", "A", "0.3", "dir/B"])[0].data.data_path
    twice = parse_args(["--data-path", "0.7", "A", "--data-path", "0.3", "dir/B"])[0].data.data_path
    assert parse_blend(from_toml) == parse_blend(from_flags) == parse_blend(twice) == [(0.7, "A"), (0.3, "dir/B")]
    assert parse_blend(parse_args(["--data-path", "my data/x"])[0].data.data_path) == [(1.0, "my data/x")]
    toml.write_text('[data]\ndata_path = "2 A 1 B"\n')
    assert parse_blend(parse_args(["--config", str(toml)])[0].data.data_path) == [(2.0, "A"), (1.0, "B")]


@pytest.mark.parametrize("data_path, match", [
    ("0.7 A 0.3", "3 words; give one PREFIX, or weighted prefixes"),
    ("A B", "'A' is not a weight"),
    ("0.7 A -1 B", "weight -1 of B must be a positive number"),
    ("0.7 A nan B", "weight nan of B must be a positive number"),
])
def test_bad_blend(data_path, match):
    with pytest.raises(DataError, match=match):
        parse_blend(data_path)


def test_bad_blend_is_one_line_before_any_rank(tmp_path, capsys):
    a = write(tmp_path / "a", np.arange(0, 1000) % 257)
    status = run_gpt.main(["--data-path", "0.5", a, "0.5", str(tmp_path / "missing"), "--seq-length", "8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1
    assert err[0].startswith(f"run_gpt.py: error: --data-path {tmp_path / 'missing'}: no ")



def test_data_checks_of_a_blend(tmp_path):
    """The token-id check reads each component and names the one at fault; the batch check counts the
    samples of all of them."""
    a = write(tmp_path / "a", np.arange(0, 1000) % 257)
    b = write(tmp_path / "b", np.arange(0, 1000) % 300)
    config = DataConfig(f"0.5 {a} 0.5 {b}", split="1,1")
    train, valid = build_datasets(config, seq_length=L, seed=0)
    with pytest.raises(DataError, match=re.escape(f"--data-path {b}: the train part holds token id 299 but "
                                                  "vocab_size=257; raise --vocab-size to at least 300")):
        check_token_ids(config, train, valid, 257)
    check_token_ids(config, train, valid, 300)
    assert len(train) == 2 * (499 // L)
    check_batches(config, train, valid, len(train), evaluates=False)
    with pytest.raises(DataError, match=re.escape(f"--data-path {config.data_path}: the train part holds "
                                                  f"{len(train)} samples")):
        check_batches(config, train, valid, len(train) + 1, evaluates=False)

def test_a_blend_of_data_from_two_tokenizers_is_refused(tmp_path):
    """Each stream's ids meant other text; the blend trained on both without a word."""
    (tmp_path / "text.py").write_text("def add(x, y):\n    return x + y\n" * 200)
    prefixes = [str(tmp_path / "bytes"), str(tmp_path / "bpe")]
    prepare.main(["prepare", "--input", str(tmp_path / "text.py"), "--output", prefixes[0]])
    prepare.main(["prepare", "--input", str(tmp_path / "text.py"), "--output", prefixes[1], "--train-tokenizer",
                  "--vocab-size", "300"])
    config = DataConfig(f"0.5 {prefixes[0]} 0.5 {prefixes[1]}", split="1,1")
    train, valid = build_datasets(config, seq_length=L, seed=0)
    with pytest.raises(DataError, match=re.escape(f"--data-path blends data of different tokenizers ({prefixes[0]}: "
                                                  f"ByteLevel of 257 ids; {prefixes[1]}: HuggingFaceTokenizer of")):
        check_token_ids(config, train, valid, 300)
    same = DataConfig(f"0.5 {prefixes[1]} 0.5 {prefixes[1]}", split="1,1")
    check_token_ids(same, *build_datasets(same, seq_length=L, seed=0), 300)


def test_a_stream_whose_tokenizer_is_unknown_is_said(tmp_path):
    """A damaged PREFIX.meta.json was ignored without a word, and then a blend of byte-level and BPE data
    trained (a walk of the README): where a record is missing or not believed, a note says so."""
    (tmp_path / "text.py").write_text("def add(x, y):\n    return x + y\n" * 200)
    prefixes = [str(tmp_path / "bytes"), str(tmp_path / "bpe"), str(tmp_path / "raw")]
    prepare.main(["prepare", "--input", str(tmp_path / "text.py"), "--output", prefixes[0]])
    prepare.main(["prepare", "--input", str(tmp_path / "text.py"), "--output", prefixes[1], "--train-tokenizer",
                  "--vocab-size", "300"])
    write(tmp_path / "raw", np.arange(600) % 257)  # Megatron's files: no record
    with open(prefixes[0] + ".meta.json", "w") as f:
        f.write('{"vocab_size": "x"')

    def notes(data_path: str) -> list[str]:
        config = DataConfig(data_path, split="1,1")
        return unknown_tokenizers(config, *build_datasets(config, seq_length=L, seed=0))

    assert notes(prefixes[0]) == [f"--data-path {prefixes[0]}: {prefixes[0]}.meta.json is damaged or not of these "
                                  f"tokens, so their tokenizer is unknown; prepare the data again to restore it"]
    assert notes(f"0.5 {prefixes[1]} 0.5 {prefixes[2]}") == [
        f"--data-path {prefixes[2]} has no {prefixes[2]}.meta.json (not made by prepare), so the blend cannot "
        f"check that its streams share one tokenizer"]
    assert notes(prefixes[2]) == notes(prefixes[1]) == notes(f"0.5 {prefixes[1]} 0.5 {prefixes[1]}") == []


def test_a_blend_tells_tokenizers_apart_by_what_their_ids_mean(tmp_path):
    """Two BPEs of one size trained on other text were taken for one (kind, size and end-of-document id agreed);
    GPT-2's vocab.json + merges.txt and the tokenizer.json they came from were refused as two."""
    from tokenizers import Tokenizer
    (tmp_path / "code.py").write_text("def add(x, y):\n    return x + y\n" * 200)
    (tmp_path / "prose.txt").write_text("the quick brown fox jumps over the lazy dog, again and again. " * 200)
    prefixes = {name: str(tmp_path / name) for name in ("code", "prose", "code_gpt2")}
    for name, text in (("code", "code.py"), ("prose", "prose.txt")):
        prepare.main(["prepare", "--input", str(tmp_path / text), "--output", prefixes[name], "--train-tokenizer",
                      "--vocab-size", "270"])  # both texts have the merges to reach it: the same size
    Tokenizer.from_file(prefixes["code"] + ".tokenizer.json").model.save(str(tmp_path))  # vocab.json, merges.txt
    prepare.main(["prepare", "--input", str(tmp_path / "prose.txt"), "--output", prefixes["code_gpt2"],
                  "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tmp_path / "vocab.json"),
                  "--merge-file", str(tmp_path / "merges.txt")])
    two = DataConfig(f"0.5 {prefixes['code']} 0.5 {prefixes['prose']}", split="1,1")
    with pytest.raises(DataError, match="blends data of different tokenizers"):
        check_token_ids(two, *build_datasets(two, seq_length=L, seed=0), 300)
    one = DataConfig(f"0.5 {prefixes['code']} 0.5 {prefixes['code_gpt2']}", split="1,1")
    check_token_ids(one, *build_datasets(one, seq_length=L, seed=0), 300)


def losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r["lm_loss"] for r in map(json.loads, f) if "lm_loss" in r]


def test_training_on_a_blend_resumes_exactly(tmp_path):
    rng = np.random.default_rng(0)
    a = write(tmp_path / "a", rng.integers(0, 100, 3000))
    b = write(tmp_path / "b", rng.integers(100, 257, 3000))
    run = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "16", "--seq-length", "16",
           "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", "4", "--eval-interval", "0",
           "--data-path", "0.8", a, "0.2", b]
    assert run_gpt.main(run + ["--run-dir", str(tmp_path / "straight")]) == 0
    assert run_gpt.main(run + ["--run-dir", str(tmp_path / "cut"), "--save", str(tmp_path / "ck"),
                               "--exit-interval", "2"]) == 0
    assert run_gpt.main(run + ["--run-dir", str(tmp_path / "resumed"), "--load", str(tmp_path / "ck")]) == 0
    straight = losses(tmp_path / "straight")
    assert len(straight) == 4
    assert losses(tmp_path / "cut") + losses(tmp_path / "resumed") == straight
