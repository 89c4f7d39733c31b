"""The flight recorder: what a rank writes as it trains, and the report the launcher prints from it.

The watchdog that acts on it runs in tests/test_shutdown.py (a stopped rank named)."""

import os

import run_gpt
from gcompile import flight
from gcompile.flight import FlightRecorder, Watchdog, rank_file, read, report, running
from tests.test_checkpoint import SMALL


def test_a_training_run_records_its_last_instruction(tmp_path):
    assert run_gpt.main(SMALL + ["--train-iters", "2", "--run-dir", str(tmp_path)]) == 0
    record = read(rank_file(flight.flight_dir(str(tmp_path)), 0))
    assert record["phase"] == "done"
    assert int(record["progress"]) > 2 * 3, "a start and a finish per instruction, three instructions an iteration"
    assert "OPT_STEP" in record["instruction finished"] and not running(record, "instruction")


def test_report_names_the_rank_that_does_not_wait(tmp_path):
    waiting, computing = (FlightRecorder(rank_file(str(tmp_path), r)) for r in range(2))
    for recorder in (waiting, computing):
        recorder.phase("iteration 7")
        recorder.start("instruction", "00 F stage=0 mb=0 forward")
        recorder.finish("instruction")
    waiting.start("collective", "all_reduce of the loss over dp")
    computing.start("instruction", "01 B stage=0 mb=0 backward")
    text = report(Watchdog(str(tmp_path), 3, 20), ["(dp0)", "(dp1)", "(dp2)"], ["", "", ""])
    head, rank0, rank1, rank2 = text.splitlines()
    assert "no rank made progress for 20 s" in head and "look there first: rank 1, 2" in head
    assert "collective started @" in rank0 and "all_reduce of the loss over dp (waiting)" in rank0
    assert "instruction started @" in rank1 and "01 B stage=0 mb=0 backward (running)" in rank1
    assert rank2 == "  rank 2 (dp2): no record yet (still starting)"
    stopped = report(Watchdog(str(tmp_path), 2, 20), ["(dp0)", "(dp1)"], ["", "process stopped"])
    assert "the stalled rank: 1 (process stopped)" in stopped
    assert "rank 1 (dp1) [process stopped]: iteration 7" in stopped


def test_a_launch_clears_every_earlier_record_and_keeps_other_files(tmp_path):
    """A 2-rank run into a folder a 4-rank run used left rank2.txt and rank3.txt for `cat` to mislead with."""
    for name in ("rank0.txt", "rank3.txt", "checked_plan.json", "notes.txt"):
        (tmp_path / name).write_text("x")
    Watchdog(str(tmp_path), 2, 20).clear()
    assert sorted(os.listdir(tmp_path)) == ["checked_plan.json", "notes.txt"]
