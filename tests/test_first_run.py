"""What a new user meets on the first runs: a fast --help with defaults, progress lines instead of
silence, one metrics file per run, a schedule picture that shows its title, dumps that list their
collectives, and a word when a resume changes the learning-rate curve."""

import dataclasses
import fnmatch
import json
import os
import subprocess
import sys
import tomllib
import xml.etree.ElementTree as ET

import pytest

import run_gpt
from gcompile.compile import CompileStats, format_rank_stats
from gcompile.config import TrainConfig, parse_args
from gcompile.inspect import main as inspect_main
from gcompile.axes import Coords
from gcompile.log import MetricsLog, rank_ranges
from gcompile.schedule import build_schedule
from gcompile.schedule_render import render_svg
from gcompile.train import batch_change, data_change, lr_schedule_change, train
from gcompile.world import prepare_launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--config", os.path.join(ROOT, "configs", "tiny.toml")]
SMALL = ["--n-layer", "2", "--n-head", "4", "--n-embd", "64", "--block-size", "32", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--lr-warmup-iters", "1", "--eval-interval", "0"]


# --- --help ------------------------------------------------------------------------------------------

def test_the_package_holds_every_subpackage():
    # `pip install .` (not -e) installs only what pyproject names; a subpackage left out imports only in a checkout
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        include = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]["include"]
    on_disk = {os.path.relpath(folder, ROOT).replace(os.sep, ".")
               for top in ("gcompile", "passes") for folder, _, files in os.walk(os.path.join(ROOT, top))
               if "__init__.py" in files}
    assert "gcompile.models" in on_disk
    assert {name for name in on_disk if any(fnmatch.fnmatchcase(name, glob) for glob in include)} == on_disk


def test_help_imports_no_torch_and_shows_every_default():
    result = subprocess.run([sys.executable, "-X", "importtime", "run_gpt.py", "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert "numpy" in imported and "torch" not in imported  # numpy: the parse of -X importtime's lines works, sorted(m for m in imported if "torch" in m)
    text = " ".join(result.stdout.split())  # argparse wraps lines
    assert "--seed SEED [train] Seeds initial weights" in text and "(default: 1234)" in text
    assert "--tp-comm-backend TP_COMM_BACKEND" in text and "(default: auto)" in text
    assert "(default: false)" in text and "(default: none)" in text
    assert "--num-experts NUM_EXPERTS [model] 0: one MLP per block" in text  # a field a model config inherits
    fields = subprocess.run([sys.executable, "-c", "from gcompile.config import SECTIONS, section_fields; "
                             "print(sum(len(section_fields(section)) for section in SECTIONS))"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)  # a process of its own, as --help's: this
    # one's registry may hold the own models other tests loaded, whose fields are keys too
    assert text.count("(default: ") == int(fields.stdout), fields.stderr[-2000:]


# --- progress instead of silence ---------------------------------------------------------------------

def test_a_compiled_run_says_what_it_builds_and_compiles(tmp_path):
    lines = []
    config, _ = parse_args(TINY + ["--compile", "--train-iters", "1", "--eval-interval", "0",
                                   "--run-dir", str(tmp_path / "run")])
    train(config, Coords.from_rank(0, {}), log=lines.append)
    text = "\n".join(lines)
    assert "captured gpt2 with torch.export in" in text
    assert "lowered stage 0 with autograd (forward and backward graphs) in" in text
    compiled = [line for line in lines if line.startswith("compiled ")]
    assert [line.split()[1:3] for line in compiled] == [["1/3", "stage0.forward"], ["2/3", "stage0.backward"],
                                                          ["3/3", "optimizer"]], compiled
    assert all(line.endswith(("(inductor cache hit)", "(inductor cache miss)")) for line in compiled), compiled
    assert [line for line in lines if line.startswith("compile, ")] == \
        [next(line for line in lines if line.startswith("compile, rank 0: 3 graphs, 3 distinct, in "))]


def test_a_line_for_one_rank_says_rank():
    # the launcher's "compiled 1/7 stage0.forward (rank 0)" under pp, where a stage runs on one rank
    assert rank_ranges([3]) == "rank 3"
    assert rank_ranges([9, 0, 1, 2, 3, 8]) == "ranks 0-3,8-9"


def test_identical_ranks_fold_into_one_compile_line():
    same = {rank: CompileStats(graphs=3, distinct=3, seconds=1.0 + rank / 10, cache_hits=3) for rank in range(16)}
    assert format_rank_stats(same) == [
        "compile, ranks 0-15: 3 graphs, 3 distinct, in 1.0 to 2.5 s (inductor cache: 3 hits, 0 misses each)"]
    same[9] = CompileStats(graphs=4, distinct=4, seconds=2.0, cache_hits=3, cache_misses=1)
    assert format_rank_stats(same) == [
        "compile, ranks 0-8,10-15: 3 graphs, 3 distinct, in 1.0 to 2.5 s (inductor cache: 3 hits, 0 misses each)",
        "compile, rank 9: 4 graphs, 4 distinct, in 2.0 s (inductor cache: 3 hits, 1 misses)"]


@pytest.mark.slow
def test_the_launcher_reports_build_and_each_distinct_graph(tmp_path):
    lines = []
    config, _ = parse_args(TINY + ["--tp", "2", "--compile"])
    prepare_launch(config, "cpu", threads=1, log=lines.append)
    assert lines[0] == "building the programs of 2 ranks (capture, passes, lowering) to check the plan"
    assert lines[1].startswith("plan checked: 2 ranks agree") and "capture " in lines[1] and "lowering " in lines[1]
    assert lines[2] == "compiling 3 distinct graphs for 2 ranks with Inductor; the ranks then load them from its cache"
    assert [line.split(" in ")[0] for line in lines[3:6]] == [
        "compiled 1/3 stage0.forward (ranks 0-1)", "compiled 2/3 stage0.backward (ranks 0-1)",
        "compiled 3/3 optimizer (ranks 0-1)"]
    assert lines[6].startswith("precompiled 3 distinct graphs for 2 ranks")
    assert lines[7].startswith("starting 2 ranks")


# --- metrics.jsonl: one run per file -----------------------------------------------------------------

def write_steps(run_dir, start: int, stop: int, lines: list) -> None:
    log = MetricsLog(str(run_dir), None, train_iters=stop, world_size=1, start_iteration=start, log=lines.append)
    for iteration in range(start + 1, stop + 1):
        log.step(iteration=iteration, consumed_samples=iteration, elapsed_ms=1.0, tokens=1, flops=0.0, lr=0.1,
                 loss=float(iteration), grad_norm=1.0, batch_size=1, loss_scale=None, skipped_iterations=0,
                 print_line=False)
    log.close()


def iterations(path) -> list[int]:
    return [json.loads(line)["iteration"] for line in open(path)]


def test_a_new_run_starts_its_own_metrics_file_and_a_resume_continues_it(tmp_path):
    lines = []
    write_steps(tmp_path, 0, 3, lines)
    write_steps(tmp_path, 3, 5, lines)  # a resume of that run, from its iteration 3
    assert iterations(tmp_path / "metrics.jsonl") == [1, 2, 3, 4, 5] and lines == []
    write_steps(tmp_path, 0, 2, lines)  # another run
    write_steps(tmp_path, 1, 2, lines)  # a resume from a checkpoint this file did not end at
    assert iterations(tmp_path / "metrics.1.jsonl") == [1, 2, 3, 4, 5]
    assert iterations(tmp_path / "metrics.2.jsonl") == [1, 2]
    assert iterations(tmp_path / "metrics.jsonl") == [2]
    assert lines == [f"{tmp_path / 'metrics.jsonl'} held another run (up to iteration 5); kept as metrics.1.jsonl, "
                     "this run starts a fresh one",
                     f"{tmp_path / 'metrics.jsonl'} held another run (up to iteration 2); kept as metrics.2.jsonl, "
                     "this run starts a fresh one"]


def test_a_resume_after_a_crash_cut_the_last_record_starts_on_a_line_of_its_own(tmp_path):
    """The resume appended its first record to the cut one, and both were lost to a reader."""
    write_steps(tmp_path, 0, 3, [])
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"iteration": 4, "consumed_sam')  # the crash, mid-record
    write_steps(tmp_path, 3, 5, [])
    assert iterations(tmp_path / "metrics.jsonl") == [1, 2, 3, 4, 5]


# --- the schedule picture, and --dump-schedule with --check-plan --------------------------------------

GLYPH = 0.6
"""Advance of a monospace glyph per unit of font size (Menlo, DejaVu Sans Mono)."""


@pytest.mark.parametrize("name, pp, vpp, m", [("1f1b", 2, 1, 2), ("gpipe", 2, 1, 1), ("zb1f1b", 2, 1, 4),
                                              ("interleaved", 2, 2, 4), ("1f1b", 4, 1, 8)])
def test_every_text_of_the_schedule_svg_fits_its_picture(tmp_path, name, pp, vpp, m):
    render_svg(build_schedule(name, pp, vpp, m), str(tmp_path / "s.svg"))
    svg = ET.parse(tmp_path / "s.svg").getroot()
    _, _, width, height = map(float, svg.get("viewBox").split())
    texts = svg.iter("{http://www.w3.org/2000/svg}text")
    for text in texts:
        x, y, size = float(text.get("x")), float(text.get("y")), float(text.get("font-size"))
        extent = len(text.text) * size * GLYPH
        left = {"start": x, "middle": x - extent / 2, "end": x - extent}[text.get("text-anchor", "start")]
        assert 0 <= left and left + extent <= width, (text.text, left, left + extent, width)
        assert 0 <= y - size and y <= height, (text.text, y, height)


def test_check_plan_with_dump_schedule_writes_the_schedule(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert run_gpt.main(SMALL + ["--pp", "2", "--check-plan", "--dump-schedule", "--run-dir", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "rank1 | 1RECV_F0 1F0" in (run_dir / "schedule.txt").read_text()
    assert (run_dir / "schedule.svg").read_text().startswith("<svg")
    assert f"schedule written to {run_dir / 'schedule.txt'} and schedule.svg" in out


# --- dumps list their collectives --------------------------------------------------------------------

def test_inspect_lists_each_ranks_collectives(tmp_path, capsys):
    dump = tmp_path / "dump"
    assert run_gpt.main(SMALL + ["--tp", "2", "--dump-only", "--dump-graphs", str(dump)]) == 0
    capsys.readouterr()
    assert inspect_main([str(dump)]) == 0
    ranks = [line for line in capsys.readouterr().out.splitlines() if line.startswith("rank ")]
    assert len(ranks) == 2
    for line in ranks:  # per layer 2 all-reduces forward and 2 backward (README), plus the embedding's and the loss's
        collectives = line.split("collectives/iteration: ")[1]
        assert "all_reduce tp x" in collectives and "all_reduce mp x1 4 B" in collectives, line


# --- a resume that changes the learning-rate curve says so --------------------------------------------

def test_lr_schedule_change_names_the_changed_keys_and_the_first_step_that_differs():
    t = TrainConfig(train_iters=40, lr=1e-3, min_lr=1e-4, lr_warmup_iters=2)
    saved = dataclasses.asdict(t)
    assert lr_schedule_change(saved, t, 20) is None
    assert lr_schedule_change(saved, dataclasses.replace(t, eval_interval=5, seed=1), 20) is None
    decayed = dataclasses.replace(t, lr_decay_iters=10)
    assert lr_schedule_change(dataclasses.asdict(decayed), dataclasses.replace(decayed, train_iters=60), 20) is None
    longer = lr_schedule_change(saved, dataclasses.replace(t, train_iters=60), 20)
    assert longer.startswith("the learning-rate schedule differs from the saved run's (train_iters 40 -> 60): "
                              "iteration 21 trains at "), longer


def test_a_resume_with_another_train_iters_says_so(tmp_path, capsys):
    save = str(tmp_path / "save")
    assert run_gpt.main(SMALL + ["--train-iters", "2", "--save", save, "--run-dir", str(tmp_path / "a")]) == 0
    capsys.readouterr()
    assert run_gpt.main(SMALL + ["--train-iters", "4", "--load", save, "--run-dir", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "the learning-rate schedule differs from the saved run's (train_iters 2 -> 4): iteration 3" in out, out
    assert "the batches differ" not in out, out


def test_a_resume_with_another_global_batch_says_so(tmp_path, capsys):
    """8 -> 16 samples a step went on without a word, where a changed seed or split was named."""
    t = TrainConfig(global_batch_size=8)
    assert batch_change(dataclasses.asdict(t), dataclasses.replace(t, micro_batch_size=2, train_iters=9)) is None
    save = str(tmp_path / "save")
    assert run_gpt.main(SMALL + ["--train-iters", "2", "--save", save, "--run-dir", str(tmp_path / "a")]) == 0
    capsys.readouterr()
    doubled = str(2 * parse_args(SMALL)[0].train.global_batch_size)
    assert run_gpt.main(SMALL + ["--train-iters", "3", "--global-batch-size", doubled, "--load", save,
                                 "--run-dir", str(tmp_path / "b")]) == 0
    assert (f"the global batch differs from the saved run's ({parse_args(SMALL)[0].train.global_batch_size} -> "
            f"{doubled} samples)") in capsys.readouterr().out


def test_a_resume_with_nothing_left_to_train_says_so(tmp_path, capsys):
    save = str(tmp_path / "save")
    assert run_gpt.main(SMALL + ["--train-iters", "2", "--save", save, "--run-dir", str(tmp_path / "a")]) == 0
    capsys.readouterr()
    assert run_gpt.main(SMALL + ["--train-iters", "2", "--load", save, "--run-dir", str(tmp_path / "b")]) == 0
    assert "the checkpoint is at iteration 2, --train-iters 2: nothing to train" in capsys.readouterr().out


def test_a_resume_drawing_other_batches_says_so():
    """Another seed, split, sequence length or data went on from the saved run's consumed samples unnoticed."""
    config, _ = parse_args(SMALL)
    saved = dataclasses.asdict(config)
    assert data_change(saved, config) is None
    assert data_change(saved, parse_args(SMALL + ["--train-iters", "9", "--lr", "1e-2"])[0]) is None
    moved = dataclasses.replace(config, data=dataclasses.replace(config.data, data_path="corpus"))
    assert data_change(dataclasses.asdict(moved), parse_args(SMALL + ["--data-path", os.path.abspath("corpus")])[0]) \
        is None, "one stream, named two ways"
    other, _ = parse_args(SMALL + ["--seed", "7", "--split", "50,50"])
    assert data_change(saved, other) == (f"the batches differ from the saved run's (split 98,2 -> 50,50; seed "
                                         f"{config.train.seed} -> 7): training goes on from its consumed samples, "
                                         f"in another order or of other data")
