"""A checkpoint is data, never code: crafted pickles are refused on --load, export, export-hf and generate,
and the files that describe the tensors are covered by checksums.

The payload is a live one: plain `pickle.load` of the crafted .metadata creates a marker file
(checked first), and every command that reads the checkpoint exits 2 with one line while the
marker stays absent. checksums.json is rewritten to match, as an attacker would: the allow-list,
not the checksum, is what must stop it.
"""

import builtins
import json
import os
import pickle
import shutil
import zlib

import pytest
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

import run_gpt
from gcompile import checkpoint
from gcompile.checkpoint import iteration_dir
from gcompile.checkpoint_files import CHECKSUMS, DCP_METADATA

SMALL = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "16", "--seq-length", "16",
         "--micro-batch-size", "2", "--global-batch-size", "2", "--eval-interval", "0", "--train-iters", "1"]


class CreateFile:
    """Unpickled, it creates `path`: what a crafted checkpoint could do instead."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return builtins.open, (self.path, "w")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("saved")
    assert run_gpt.main(SMALL + ["--save", str(root / "save"), "--run-dir", str(root / "run")]) == 0
    return root / "save"


def tampered(saved, tmp_path, change) -> str:
    """A copy of `saved` whose .metadata is `change(metadata)` re-pickled, checksums.json made to match."""
    save = tmp_path / "save"
    shutil.copytree(saved, save)
    folder = iteration_dir(save, 1)
    with open(os.path.join(folder, DCP_METADATA), "rb") as f:
        metadata = pickle.load(f)  # our own file: safe here
    data = pickle.dumps(change(metadata))
    with open(os.path.join(folder, DCP_METADATA), "wb") as f:
        f.write(data)
    sums = json.loads(open(os.path.join(folder, CHECKSUMS)).read())
    sums[DCP_METADATA] = zlib.crc32(data)
    open(os.path.join(folder, CHECKSUMS), "w").write(json.dumps(sums))
    return str(save)


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def with_payload(marker):
    def change(metadata):
        metadata.planner_data = CreateFile(marker)
        return metadata
    return change


def with_bytes_entry(metadata):
    """A key DCP would read with torch.load(weights_only=False)."""
    key = next(iter(metadata.state_dict_metadata))
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    return metadata


@pytest.mark.parametrize("change, named", [(with_payload, "io.open"),
                                           (lambda _: with_bytes_entry, "BytesStorageMetadata")],
                         ids=["code", "bytes_entry"])
def test_crafted_metadata_is_refused_and_runs_nothing(saved, tmp_path, capsys, change, named):
    marker = tmp_path / "marker"
    save = tampered(saved, tmp_path, change(marker))
    if change is with_payload:
        with open(os.path.join(iteration_dir(save, 1), DCP_METADATA), "rb") as f:
            pickle.load(f)
        assert marker.exists(), "the payload runs under plain pickle.load"
        marker.unlink()
    status = run_gpt.main(SMALL + ["--train-iters", "2", "--load", save, "--run-dir", str(tmp_path / "run")])
    line = one_line(capsys)
    assert status == 2 and named in line and "never code" in line, line
    assert checkpoint.main(["export", save, "--output", str(tmp_path / "model.pt")]) == 2
    line = one_line(capsys)
    assert named in line and not (tmp_path / "model.pt").exists(), line
    assert checkpoint.main(["export-hf", save, str(tmp_path / "hf")]) == 2
    line = one_line(capsys)
    assert named in line and not (tmp_path / "hf" / "model.safetensors").exists(), line
    assert not marker.exists()


def test_generate_refuses_a_crafted_export(tmp_path, capsys):
    marker, model = tmp_path / "marker", tmp_path / "model.pt"
    torch.save(dict(model={}, model_args=CreateFile(marker)), model)
    torch.load(model, weights_only=False)
    assert marker.exists(), "the payload runs under an unrestricted torch.load"
    marker.unlink()
    assert checkpoint.main(["generate", str(model)]) == 2
    line = one_line(capsys)  # one line: not torch's warnings, nor its advice to load with weights_only=False
    assert line.endswith("not a gpt2 model exported by gcompile.checkpoint: it holds Python objects beyond tensors "
                         "and numbers, and loading them could run code; refused"), line
    assert "weights_only" not in line and not marker.exists()


@pytest.mark.parametrize("name", ["gcompile.json", DCP_METADATA])
def test_damaged_description_fails_its_checksum(saved, tmp_path, capsys, name):
    save = tmp_path / "save"
    shutil.copytree(saved, save)
    path = os.path.join(iteration_dir(save, 1), name)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01  # one bit: JSON and pickle may well still parse
    open(path, "wb").write(bytes(data))
    assert checkpoint.main(["export", str(save), "--output", str(tmp_path / "model.pt")]) == 2
    line = one_line(capsys)
    assert f"{name} does not match its checksum in {CHECKSUMS}" in line, line


def test_missing_checksums_is_one_line(saved, tmp_path, capsys):
    save = tmp_path / "save"
    shutil.copytree(saved, save)
    os.remove(os.path.join(iteration_dir(save, 1), CHECKSUMS))
    assert run_gpt.main(SMALL + ["--load", str(save), "--run-dir", str(tmp_path / "run")]) == 2
    assert f"no {CHECKSUMS}" in one_line(capsys)
