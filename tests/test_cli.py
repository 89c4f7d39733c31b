"""Bad input to run_gpt.py: one clear line on stderr, exit status 2, no traceback."""

import struct
import subprocess
import sys

import numpy as np
import pytest

import run_gpt
from gcompile.config import MEGATRON_ALIASES, parse_args
from gcompile.indexed_dataset import IndexedDatasetWriter


@pytest.fixture
def data_prefix(tmp_path):
    prefix = str(tmp_path / "corpus")
    with IndexedDatasetWriter(prefix) as writer:
        for i in range(20):
            writer.add_document(np.arange(i, i + 300, dtype=np.uint16) % 256)
    return prefix


def run_main(argv, capsys):
    status = run_gpt.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    return status, err


@pytest.mark.parametrize("argv, message", [
    (["--no-such-flag", "1"], "unrecognized arguments: --no-such-flag 1"),
    (["--micro-batch", "2", "--lr-warmup=3"], "unrecognized arguments: --micro-batch 2 --lr-warmup=3; did you mean "
                                               "--micro-batch-size for --micro-batch, --lr-warmup-iters for --lr-warmup?"),
    (["--n-head", "3", "--n-embd", "64"], "n_embd=64 is not divisible by n_head=3"),
    (["--n-layer", "0"], "n-layer=0 must be at least 1"),
    (["--seq-length", "512", "--block-size", "256"], "seq_length=512 is longer than the model's block_size=256"),
    (["--global-batch-size", "10", "--micro-batch-size", "4"],
     "global_batch_size=10 is not divisible by micro_batch_size=4 * dp=1 = 4; make --global-batch-size a multiple of 4"),
    (["--lr-decay-style", "exponential"], "lr_decay_style='exponential' must be cosine, linear or constant"),
    (["--lr", "fast"], "--lr='fast' is not a valid float"),
    (["--sequence-parallel", "maybe"], "--sequence-parallel='maybe' is not a valid bool (true or false)"),
    (["--data-path", "/nonexistent/corpus"], "/nonexistent/corpus"),
    (["--save-interval", "5"], "save-interval=5 needs --save DIR"),
    (["--exit-interval", "0"], "exit-interval=0 must be at least 1"),
])
def test_bad_flags(argv, message, capsys):
    status, err = run_main(argv, capsys)
    assert status == 2
    assert len(err) == 1 and message in err[0], err


def test_unknown_config_key(tmp_path, capsys):
    preset = tmp_path / "bad.toml"
    preset.write_text("[model]\nn_layers = 4\n")
    status, err = run_main(["--config", str(preset)], capsys)
    assert status == 2 and len(err) == 1
    assert "unknown key 'n_layers' in [model]" in err[0]


def test_unknown_config_section(tmp_path, capsys):
    preset = tmp_path / "bad.toml"
    preset.write_text("[optimizer]\nlr = 1.0\n")
    status, err = run_main(["--config", str(preset)], capsys)
    assert status == 2 and "unknown section [optimizer]" in err[0]


def test_empty_data(tmp_path, capsys):
    prefix = str(tmp_path / "empty")
    with IndexedDatasetWriter(prefix):
        pass
    status, err = run_main(["--data-path", prefix], capsys)
    assert status == 2 and len(err) == 1, err


def test_truncated_idx(data_prefix, capsys):
    with open(data_prefix + ".idx", "r+b") as f:
        f.truncate(30)
    status, err = run_main(["--data-path", data_prefix], capsys)
    assert status == 2 and len(err) == 1 and ".idx" in err[0], err


def test_token_ids_beyond_vocab(tmp_path, capsys):
    prefix = str(tmp_path / "wide")
    with IndexedDatasetWriter(prefix) as writer:
        writer.add_document(np.full(20000, 1000, dtype=np.uint16))
    status, err = run_main(["--data-path", prefix, "--train-iters", "1"], capsys)
    assert status == 2 and "token id 1000 but vocab_size=257" in err[0], err


def test_subprocess_has_no_traceback(tmp_path):
    result = subprocess.run([sys.executable, "run_gpt.py", "--n-head", "3"], capture_output=True, text=True)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().startswith("run_gpt.py: error:")


def test_exit_interval_without_save_says_nothing_was_saved(tmp_path, capfd):
    """Megatron's --exit-interval stops a run without --save too; the line that says it stopped says so."""
    argv = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "16", "--seq-length", "16",
            "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "3", "--eval-interval", "0",
            "--exit-interval", "1", "--run-dir", str(tmp_path / "run")]
    assert run_gpt.main(argv) == 0
    assert "exiting at iteration 1 (--exit-interval 1); nothing saved: no --save" in capfd.readouterr().out


@pytest.mark.parametrize("flags, note", [
    (["--sequence-parallel"], "note: --sequence-parallel does nothing at tp 1"),
    (["--pipeline-schedule", "zb1f1b"], "note: --pipeline-schedule zb1f1b does nothing at pp 1"),  # was: silent
    (["--pipeline-schedule", "gpipe", "--pp", "2"], None),
    (["--use-distributed-optimizer"], "note: data-parallel sharding optim shards nothing at dp 1"),
    (["--use-distributed-optimizer", "--dp", "2"], None),
    (["--bf16", "--initial-loss-scale", "1024"], "note: --initial-loss-scale does nothing without --fp16"),
    (["--fp16", "--initial-loss-scale", "1024"], None),
    (["--moe-router-topk", "3"], "note: --moe-router-topk does nothing without --num-experts"),  # was: silent
    (["--num-experts", "0", "--moe-aux-loss-coeff", "0.01"], "note: --moe-aux-loss-coeff does nothing without "
                                                              "--num-experts"),
    (["--num-experts", "4", "--moe-router-topk", "3", "--moe-aux-loss-coeff", "0.01"], None),
])
def test_a_setting_that_does_nothing_in_the_layout_is_said(flags, note, capsys):
    assert run_gpt.main(["--config", "configs/tiny.toml", "--n-layer", "2", *flags, "--check-plan"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert [line.split(" (")[0] for line in notes] == ([note] if note else []), notes


@pytest.mark.parametrize("alias", sorted(MEGATRON_ALIASES))
def test_a_megatron_name_sets_what_its_namesake_sets(alias):
    value, *extra = {"num-layers": ["3"], "hidden-size": ["8"], "max-position-embeddings": ["64"], "num-query-groups": ["1"],
                     "expert-model-parallel-size": ["2", "--num-experts", "4", "--dp", "2"],
                     "virtual-pipeline-model-parallel-size": ["2", "--pp", "2", "--n-layer", "4"]}.get(alias, ["2"])
    given = ["--config", "configs/llama-tiny.toml", *extra]
    megatrons = parse_args([*given, f"--{alias}", value])
    assert megatrons == parse_args([*given, f"--{MEGATRON_ALIASES[alias]}", value])
    assert megatrons != parse_args(given)
