"""python -m gcompile.calibrate's files: which it may replace, and which a busy measurement must not.

The measurement itself (75-95 s) is replaced by a machine made here; the rest of main runs as a user's.
"""

import dataclasses
import json

import pytest

from gcompile import calibrate
from gcompile import machine as machine_file
from tests.test_cost_model import flat_machine

IDLE = dataclasses.replace(flat_machine(), matmul={"1": {"float32": [[8.0, 9e10]]}, "2": {"float32": [[8.0, 1.7e11]]}})
"""Two threads multiply faster than one: measured on idle cores."""
BUSY = dataclasses.replace(IDLE, matmul={**IDLE.matmul, "2": {"float32": [[8.0, 3e8]]}})
"""Two threads 300 times slower than one: other work held the cores (busy_warning warns)."""


@pytest.fixture
def measuring(tmp_path, monkeypatch):
    """Calibrate in tmp_path's cache, measuring the machine given (a test that gives None must not measure)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

    def measures(machine):
        monkeypatch.setattr(calibrate, "calibrate", lambda: machine or pytest.fail("measured"))
    return measures


def test_a_busy_measurement_keeps_a_good_machine_file_unless_forced(tmp_path, measuring, capsys):
    """It replaced this machine's file whatever that held, and every plan after was wrong (tiny at 1 rank: 723.8 ms
    predicted, 8.1 ms measured)."""
    own, out = machine_file.default_path(), str(tmp_path / "machine.json")
    for path in (own, out):
        machine_file.save(IDLE, path)
    measuring(BUSY)
    assert calibrate.main(["--out", out]) == 0
    assert machine_file.load(own) == IDLE and machine_file.load(out) == IDLE
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [calibrate.busy_warning(BUSY), f"kept {own} and {out}, which does not look "
                                         f"measured while busy; add --force to write this measurement over it"]
    assert "written" not in captured.out
    assert calibrate.main(["--out", out, "--force"]) == 0
    assert machine_file.load(own) == BUSY and machine_file.load(out) == BUSY
    assert capsys.readouterr().out.splitlines()[-1] == f"written to {own} and {out}"


def test_a_busy_measurement_is_written_where_no_good_file_is(tmp_path, measuring, capsys):
    """A first calibration on a busy machine still writes its file (plans need one), warned; so does one over a file
    that looks busy itself, or that cannot be read."""
    own, out = machine_file.default_path(), tmp_path / "machine.json"
    out.write_text('{"format": 4, "fingerprint": "older"}')
    measuring(BUSY)
    assert calibrate.main(["--out", str(out)]) == 0
    assert machine_file.load(own) == BUSY and machine_file.load(str(out)) == BUSY
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [calibrate.busy_warning(BUSY)]
    assert captured.out.splitlines()[-1] == f"written to {own} and {out}"
    assert calibrate.main([]) == 0  # over BUSY: nothing better to keep
    assert capsys.readouterr().out.splitlines()[-1] == f"written to {own}"
    measuring(IDLE)
    assert calibrate.main([]) == 0 and machine_file.load(own) == IDLE


@pytest.mark.parametrize("name, text, why", [
    ("tiny.toml", "[model]\nn_layer = 2\n", "it is not JSON (Expecting value: line 1 column 2 (char 1))"),
    ("README.md", "# gcompile\n", "it is not JSON (Expecting value: line 1 column 1 (char 0))"),
    ("package.json", '{"name": "x", "format": 5}',
     "it is JSON without the format and fingerprint every machine file holds"),
], ids=["a config", "a README", "another tool's JSON"])
def test_out_over_a_file_that_is_not_a_machine_file_is_refused_before_measuring(name, text, why, tmp_path, measuring,
                                                                                 capsys):
    """`calibrate --out configs/tiny.toml` replaced the config with machine JSON, exit 0."""
    path = tmp_path / name
    path.write_text(text)
    measuring(None)
    assert calibrate.main(["--out", str(path)]) == 2
    assert path.read_text() == text
    assert capsys.readouterr().err.splitlines() == [
        f"python -m gcompile.calibrate: error: --out {str(path)!r} is not a machine file: {why}; calibrate replaces "
        f"only a machine file: give a new file name, or move that file away"]


@pytest.mark.parametrize("damage", [{"format": 4}, {"op_seconds": -1}, {"cores": None, "matmul": {}}],
                         ids=["an older format", "a negative time", "fields emptied"])
def test_out_over_a_machine_file_even_damaged_or_old_is_measured_again(damage, tmp_path, measuring):
    """What measuring again is for: a machine file of an older format, or damaged by hand."""
    path = tmp_path / "machine.json"
    path.write_text(json.dumps({**json.loads(IDLE.to_json()), **damage}))
    with pytest.raises(machine_file.MachineError, match="measure the machine it describes again"):
        machine_file.load(str(path))
    measuring(IDLE)
    assert calibrate.main(["--out", str(path)]) == 0 and machine_file.load(str(path)) == IDLE
