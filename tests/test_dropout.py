"""Dropout runs repeat and resume bit for bit per layout: every rank's generators are seeded from
--seed and its pipeline and dp ranks (gcompile.train.seed_generators) and restored at --load.

One rank runs in this process, after other runs that moved the global generator, as a user's
second run would not start afresh either; the tp2 case runs on gloo ranks (tests/workers/train_worker.py),
cut, resumed and straight in one process each, in that order.
"""

import json
import os

import pytest

from gcompile.axes import Coords
from gcompile.config import parse_args
from gcompile.train import train
from tests.multirank import assert_succeeded, launch

N = 2
SMALL = ["--n-layer", "2", "--n-head", "4", "--n-embd", "32", "--block-size", "16", "--seq-length", "16",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", str(2 * N), "--dropout", "0.2",
         "--eval-interval", str(N), "--eval-iters", "1"]
WORKER = os.path.join(os.path.dirname(__file__), "workers", "train_worker.py")


def config(*flags):
    return parse_args(SMALL + [str(f) for f in flags])[0]


def losses(run_dir) -> list[float]:
    """Training and validation losses, in the order logged."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r.get("lm_loss", r.get("val_loss")) for r in map(json.loads, f)]


def cut_resumed_straight(root, *flags) -> list:
    return [config(*flags, "--save", root / "save", "--exit-interval", N, "--run-dir", root / "cut"),
            config(*flags, "--load", root / "save", "--run-dir", root / "resumed"),
            config(*flags, "--run-dir", root / "straight")]


def assert_repeats_and_resumes(root) -> None:
    straight, cut, resumed = (losses(root / name) for name in ("straight", "cut", "resumed"))
    assert len(straight) == 2 * N + 2 and len(cut) == N + 1, "a validation every N iterations"
    assert cut == straight[:len(cut)], f"run again: {cut} != {straight[:len(cut)]}"
    assert cut + resumed == straight, f"cut at {N} and resumed: {cut} + {resumed} != {straight}"


def test_one_rank_repeats_and_resumes_exactly(tmp_path):
    for c in cut_resumed_straight(tmp_path):
        train(c, Coords.from_rank(0, {}), log=lambda _: None)
    assert_repeats_and_resumes(tmp_path)
    train(config("--dropout", "0", "--train-iters", 1, "--eval-interval", 0, "--run-dir", tmp_path / "none"),
          Coords.from_rank(0, {}), log=lambda _: None)
    assert losses(tmp_path / "none")[0] != losses(tmp_path / "straight")[0], "dropout is on"


@pytest.mark.slow
def test_tp2_repeats_and_resumes_exactly(tmp_path):
    configs = cut_resumed_straight(tmp_path, "--tp", 2)
    assert_succeeded(tmp_path, launch(tmp_path, WORKER, dict(configs=configs), world=2))
    assert_repeats_and_resumes(tmp_path)
