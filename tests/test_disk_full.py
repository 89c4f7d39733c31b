"""A save that runs out of disk space: one line naming the folder and the space the checkpoint
needs, the half-written iter_N.tmp removed, the previous checkpoint and the tracker as they were.

The real thing needs a small filesystem: a tmpfs sized to hold one checkpoint of the tiny model
and not two, mounted by the test (root only; skipped otherwise, with the reason). /dev/full
gives every process an ENOSPC to check the detection on.
"""

import contextlib
import os
import subprocess

import pytest

import run_gpt
from gcompile.checkpoint import TMP, TRACKER, Checkpoint, iteration_dir
from gcompile.stop import PhaseFailed, together

SMALL = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "16", "--seq-length", "16",
         "--micro-batch-size", "2", "--global-batch-size", "2", "--eval-interval", "0"]


@contextlib.contextmanager
def tmpfs(path, nbytes: int):
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={nbytes}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({mounted.stderr.strip() or 'mount failed'}); needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def checkpoint_bytes(tmp_path) -> int:
    """What one checkpoint of the tiny model takes on a tmpfs (whole pages per file)."""
    save = tmp_path / "measure"
    assert run_gpt.main(SMALL + ["--train-iters", "1", "--save", str(save), "--run-dir", str(tmp_path / "run")]) == 0
    folder = iteration_dir(save, 1)
    return sum(-(-os.path.getsize(os.path.join(folder, name)) // 4096) * 4096 for name in os.listdir(folder))


def test_full_disk_keeps_the_previous_checkpoint(tmp_path, capsys):
    one = checkpoint_bytes(tmp_path)
    capsys.readouterr()
    with tmpfs(tmp_path / "small", one + one // 2) as save:
        status = run_gpt.main(SMALL + ["--train-iters", "3", "--save", str(save), "--save-interval", "1",
                                       "--run-dir", str(tmp_path / "run")])
        err = capsys.readouterr().err.strip().splitlines()
        assert status == 1 and len(err) == 1, err
        assert (f"--save {save}: saving iteration 2 failed, no space left on the device (" in err[0] and
                "free; the checkpoint's tensors alone take" in err[0]), err
        assert (f"removed the half-written {os.path.basename(iteration_dir(save, 2))}{TMP}; {TRACKER} still names "
                f"iteration 1") in err[0], err
        assert sorted(os.listdir(save)) == [os.path.basename(iteration_dir(save, 1)), TRACKER]
        assert (save / TRACKER).read_text().strip() == "1"
        Checkpoint(iteration_dir(save, 1)).verify()


def test_enospc_is_recognised_on_every_rank():
    with pytest.raises(PhaseFailed) as failed:
        with together(), open("/dev/full", "w") as f:
            f.write("x")
            f.flush()
    assert failed.value.no_space and "No space left on device" in str(failed.value)
    with pytest.raises(PhaseFailed) as failed:
        with together():
            os.makedirs("/dev/null/x")
    assert not failed.value.no_space


def test_full_disk_inside_a_shard_write(tmp_path, capsys):
    """Half a checkpoint's room: DCP's shard write fails; torch.save's error holds the ENOSPC as its context."""
    one = checkpoint_bytes(tmp_path)
    capsys.readouterr()
    with tmpfs(tmp_path / "small", one // 2) as save:
        status = run_gpt.main(SMALL + ["--train-iters", "1", "--save", str(save), "--run-dir", str(tmp_path / "run")])
        err = capsys.readouterr().err.strip().splitlines()
        assert status == 1 and len(err) == 1, err
        assert "saving iteration 1 failed, no space left on the device" in err[0], err
        assert "no checkpoint was committed before" in err[0] and os.listdir(save) == [], err


@pytest.mark.slow
def test_full_disk_stops_every_rank(tmp_path):
    """dp2: both ranks write shards; both stop at the failed save, neither waits for the other."""
    from gcompile.config import parse_args
    from tests.multirank import launch

    one = checkpoint_bytes(tmp_path)
    with tmpfs(tmp_path / "small", one // 2) as save:
        config = parse_args(SMALL + ["--dp", "2", "--global-batch-size", "4", "--train-iters", "1", "--save", str(save),
                                     "--run-dir", str(tmp_path / "run")])[0]
        codes = launch(tmp_path, os.path.join(os.path.dirname(__file__), "workers", "train_worker.py"),
                       dict(configs=[config]), world=2, timeout=300)
        assert codes == [1, 1], codes
        logs = [(tmp_path / f"rank{r}.log").read_text() for r in range(2)]
        assert all("saving iteration 1 failed, no space left on the device" in log for log in logs), logs
        assert os.listdir(save) == []


def test_failed_commit_puts_the_folders_back(tmp_path):
    """The tracker cannot be replaced (here: it is a folder): the renamed folders go back where they were."""
    from gcompile import checkpoint

    for name in ("iter_0000002", "iter_0000002.tmp"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "was").write_text(name)
    (tmp_path / TRACKER).mkdir()
    with pytest.raises(IsADirectoryError):
        checkpoint._commit(str(tmp_path), str(tmp_path / "iter_0000002.tmp"), str(tmp_path / "iter_0000002"), 2)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "iter_0000002.tmp", TRACKER]
    for name in ("iter_0000002", "iter_0000002.tmp"):
        assert (tmp_path / name / "was").read_text() == name
