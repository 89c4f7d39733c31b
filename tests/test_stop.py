"""Faults that stop every rank: a non-finite loss or gradient norm (--check-for-nan-in-loss-and-grad).

A learning rate of 1e10 takes a tiny model from a finite first step to a NaN loss and gradient
norm at iteration 2; run_gpt.main in this process is the one-rank run. Whether every rank stops
together is gcompile.stop.any_rank's all-reduce, exercised by the multi-rank fp16 checkpoint tests
(their skipped steps must not stop them).
"""

import json
import math
import os

import torch

import run_gpt
from gcompile import checkpoint
from gcompile.checkpoint import TRACKER, iteration_dir
from gcompile.state import TrainState
from gcompile.stop import RunStopped, check_state

import pytest

SMALL = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "16", "--seq-length", "16",
         "--micro-batch-size", "2", "--global-batch-size", "2", "--eval-interval", "0",
         "--lr-warmup-iters", "0", "--lr-decay-style", "constant"]
DIVERGING = ["--lr", "1e10", "--train-iters", "4"]


def records(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_nan_stops_the_run_before_it_is_saved(tmp_path, capsys):
    save, run_dir = tmp_path / "save", tmp_path / "run"
    status = run_gpt.main(SMALL + DIVERGING + ["--save", str(save), "--save-interval", "1", "--run-dir", str(run_dir)])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 1 and len(err) == 1, err
    assert "iteration 2: the lm loss and grad norm are NaN or inf" in err[0], err
    assert [r["iteration"] for r in records(run_dir)] == [1, 2], "iteration 2 is logged, then the run stops"
    assert sorted(os.listdir(save)) == [os.path.basename(iteration_dir("", 1)), TRACKER]
    assert (save / TRACKER).read_text().strip() == "1"
    saved = checkpoint.Checkpoint(iteration_dir(save, 1))
    for name in saved.params:
        for state in ("model", "exp_avg", "exp_avg_sq"):
            assert torch.isfinite(saved.full(state, name)).all(), (state, name)


def test_check_off_trains_on_and_validation_prints_nan(tmp_path, capsys):
    run_dir = tmp_path / "run"
    status = run_gpt.main(SMALL + DIVERGING + ["--check-for-nan-in-loss-and-grad", "false", "--run-dir", str(run_dir),
                                               "--eval-interval", "4", "--eval-iters", "1"])
    out = capsys.readouterr().out
    assert status == 0
    logged = records(run_dir)
    assert [r["iteration"] for r in logged if "lm_loss" in r] == [1, 2, 3, 4]
    assert math.isnan(logged[-1]["val_loss"]) and math.isnan(logged[-1]["val_ppl"]), logged[-1]
    assert "lm loss PPL: NAN" in out


def test_fp16_skipped_steps_are_not_faults(tmp_path, capsys):
    """The default initial scale 2**32 overflows: the first steps are skipped, the run goes on."""
    run_dir = tmp_path / "run"
    assert run_gpt.main(SMALL + ["--fp16", "--train-iters", "3", "--log-interval", "1", "--run-dir", str(run_dir)]) == 0
    assert records(run_dir)[-1]["skipped_iterations"] > 0
    first = records(run_dir)[0]  # skipped: no grad norm, as Megatron logs none (was: 0.0, as if it vanished)
    assert first["skipped_iterations"] == 1 and first["grad_norm"] is None, first
    lines = [line for line in capsys.readouterr().out.splitlines() if " iteration " in line]
    assert "grad norm" not in lines[0] and "number of skipped iterations:   1" in lines[0], lines[0]


def test_a_resume_counts_skipped_steps_on_from_the_saved_run(tmp_path):
    """The count restarted from 0 on resume: 1 at iteration 4, where the uninterrupted run had 4."""
    straight, cut, save = tmp_path / "straight", tmp_path / "cut", tmp_path / "save"
    fp16 = ["--fp16", "--initial-loss-scale", "1e30", "--train-iters", "4"]
    assert run_gpt.main(SMALL + fp16 + ["--run-dir", str(straight)]) == 0
    assert run_gpt.main(SMALL + fp16 + ["--save", str(save), "--exit-interval", "2", "--run-dir", str(cut)]) == 0
    assert run_gpt.main(SMALL + fp16 + ["--load", str(save), "--run-dir", str(cut)]) == 0
    skipped = [[r["skipped_iterations"] for r in records(run) if "lm_loss" in r] for run in (straight, cut)]
    assert skipped[0] == skipped[1] and skipped[0][-1] > 2, skipped


def test_the_console_counts_skipped_steps_since_its_last_line(tmp_path, capsys):
    """As Megatron's does; it printed the run's total (4 at iteration 4 where 2 were skipped since the line at 2),
    which metrics.jsonl keeps. A resumed run's first line counts from the resume, not from 0."""
    def printed(*flags) -> list[int]:
        assert run_gpt.main(SMALL + ["--fp16", "--initial-loss-scale", "1e30", "--train-iters", "4",
                                     "--log-interval", "2", *flags]) == 0
        return [int(line.split("number of skipped iterations:")[1].split("|")[0])
                for line in capsys.readouterr().out.splitlines() if "number of skipped iterations:" in line]

    assert printed("--run-dir", str(tmp_path / "straight")) == [2, 2]
    assert [r["skipped_iterations"] for r in records(tmp_path / "straight") if "lm_loss" in r] == [1, 2, 3, 4]
    save = str(tmp_path / "save")
    assert printed("--save", save, "--exit-interval", "2", "--run-dir", str(tmp_path / "cut")) == [2]
    assert printed("--load", save, "--run-dir", str(tmp_path / "cut")) == [2]


def test_non_finite_state_is_not_saved():
    def state(value):
        ones = torch.ones(4)
        return TrainState(params=torch.tensor([1.0, value]), grads=ones, main=None, exp_avg=ones, exp_avg_sq=ones,
                          flags=ones, step=torch.zeros(()), lr=torch.zeros(()))

    check_state(5, state(2.0), report=True)
    for value in (math.inf, math.nan):
        with pytest.raises(RunStopped, match="iteration 5: the weights or optimizer state hold NaN or inf"):
            check_state(5, state(value), report=True)


@pytest.mark.slow
def test_every_pipeline_rank_stops_together(tmp_path):
    """pp2: only the last stage holds the loss; the first stops at the same iteration, nobody hangs."""
    from gcompile.config import parse_args
    from tests.multirank import launch

    save = tmp_path / "save"
    config = parse_args(SMALL + DIVERGING + ["--n-layer", "2", "--pp", "2", "--save", str(save),
                                             "--save-interval", "1", "--run-dir", str(tmp_path / "run")])[0]
    codes = launch(tmp_path, os.path.join(os.path.dirname(__file__), "workers", "train_worker.py"),
                   dict(configs=[config]), world=2, timeout=300)
    assert codes == [1, 1], codes
    logs = [(tmp_path / f"rank{r}.log").read_text() for r in range(2)]
    assert all("RunStopped: iteration 2: the lm loss and grad norm are NaN or inf" in log for log in logs), logs
    assert (save / TRACKER).read_text().strip() == "1"
