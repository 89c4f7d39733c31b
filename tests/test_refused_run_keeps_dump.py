"""A run that is refused (exit status 2) leaves the --dump-graphs folder of an earlier dump as it was: the
earlier dump's other rank folders, index.txt and plan.txt are cleared only once the run goes ahead."""

import os

import pytest

import run_gpt
from gcompile.config import ConfigError
from gcompile.pass_manager import clear_stale_dumps
from tests.test_bad_input import TINY


def an_earlier_dump(root):
    """What a --dump-only of 2 distinct programs for 4 ranks leaves (files named as a dump names them)."""
    for rank in (0, 1):
        os.makedirs(root / f"rank{rank}")
        (root / f"rank{rank}" / "00_capture.txt").write_text("# stage 0\n")
        (root / f"rank{rank}" / "schedule.txt").write_text("# rank\n")
    (root / "index.txt").write_text("rank0: ranks 0,2\nrank1: ranks 1,3\n")
    (root / "plan.txt").write_text("plan checked: 2 distinct programs for 4 ranks agree\n")


def files(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, names in os.walk(root) for f in names)


@pytest.mark.parametrize("flags", [
    ["--passes", "no_such_folder/no_such_pass.py:p"],
    ["--passes", "no_such_folder/no_such_pass.py:p", "--dump-only"],
    ["--passes", "no_such_folder/no_such_pass.py:p", "--check-plan"],
    ["--load", "{tmp}/save"],
], ids=["train with a pass that cannot be loaded", "dump-only with it", "check-plan with it",
        "a --load whose tracker names no checkpoint"])
def test_a_refused_run_leaves_an_earlier_dump_as_it_was(tmp_path, capsys, flags):
    dump = tmp_path / "dump"
    an_earlier_dump(dump)
    os.makedirs(tmp_path / "save")
    (tmp_path / "save" / "latest_checkpointed_iteration.txt").write_text("5\n")
    before = files(dump)
    assert run_gpt.main(TINY + ["--run-dir", str(tmp_path / "run"), "--dump-graphs", str(dump),
                         *(flag.format(tmp=tmp_path) for flag in flags)]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "error:" in err
    assert "captured" not in out  # refused before any build
    assert files(dump) == before


def test_a_users_plan_file_is_refused_before_any_rank_folder_is_cleared(tmp_path):
    an_earlier_dump(tmp_path)
    (tmp_path / "plan.txt").write_text("my own notes\n")
    before = files(tmp_path)
    with pytest.raises(ConfigError, match="plan.txt, which no dump wrote"):
        clear_stale_dumps(str(tmp_path), [0])
    assert files(tmp_path) == before
