"""Distributed checkpoints: every rank saves its pieces, any layout loads them.

On disk (Megatron's folders, torch.distributed.checkpoint files inside):

    SAVE/latest_checkpointed_iteration.txt      "100": the last committed save
    SAVE/iter_0000100/.metadata, __R_0.distcp   DCP: one file per rank, plain tensors by key
    SAVE/iter_0000100/gcompile.json             what the keys mean (below), the model, the run config, progress
    SAVE/iter_0000100/checksums.json            CRC-32 of gcompile.json and .metadata (gcompile.checkpoint_files)
    SAVE/iter_0000200.tmp/                      a save in progress (or killed): never read

Keys. A parameter's piece is named by the ranks it was cut for (`tp1`; `full` when uncut);
a piece is written once, by the rank at dp 0 and, for an axis it is not cut over, rank 0
of that axis; the tied copy on the last pipeline stage is not written.

    model/{name}/{piece}                        the weights, in the model's dtype
    optim/{state}/{name}/{piece}/{a}-{b}        elements [a, b) of the flattened piece, for state
                                                main (fp32 main weights, when apart from the model),
                                                exp_avg, exp_avg_sq; under the distributed optimizer
                                                each dp rank writes the range it owns
    rng/rank{r}/{device}                        each rank's RNG state

gcompile.json holds, per parameter, the `Param` (full shape and cuts) it was saved with, and
per key its dtype, shape and CRC-32. Loading reassembles one parameter at a time with
`layout.full_value` and cuts it for the loading rank with `layout.local_value`, so any layout
(tp, pp, dp, the distributed optimizer, main-weight dtype) loads any other.

A save is atomic: every rank writes into iter_N.tmp, rank 0 adds gcompile.json and
checksums.json, and once every rank's files are complete rank 0 renames the folder into place
and then replaces the tracker file. The ranks agree after each of these phases: a failure on
one (a full disk) fails the save on all, which remove iter_N.tmp and stop (gcompile.stop).

    python -m gcompile.checkpoint export SAVE --output model.pt
    python -m gcompile.checkpoint generate model.pt --prompt "def " --max-new-tokens 200

An export is nanoGPT's file ({"model": state dict, "model_args": config}) with the model
module's own names (GPT-2: nanoGPT's, the tied head included); it does not say which model
it holds, so `generate --model` does.
"""

import contextlib
import dataclasses
import json
import math
import os
import pickle
import re
import shutil
import sys
import warnings
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from gcompile import hf, shutdown
from gcompile import tokenizer as tok
from gcompile.arguments import ArgumentParser
from gcompile.checkpoint_files import (CHECKSUMS, GCOMPILE_JSON, CheckpointError, MetadataReader, read_checked,
                                       write_checksums)
from gcompile.config import MAX_LAYERS, RunConfig
from gcompile.flat import Span
from gcompile import paths
from gcompile.layout import Param, Shard, first_holder, full_value, local_value
from gcompile.machine import ram_bytes
from gcompile.axes import ACROSS, AXES, FOLDED, Coords
from gcompile.models import DEFAULT_MODEL, MODELS, is_users, model_spec, spec_of
from gcompile.models.spec import ModelSpec
from gcompile.paths import path_error
from gcompile.rank_program import RankProgram
from gcompile.sample import generate_text
from gcompile.state import TrainState
from gcompile.stop import PhaseFailed, RunStopped, all_ranks, first_line, size_text, together

TRACKER = "latest_checkpointed_iteration.txt"
METADATA = GCOMPILE_JSON
TMP = ".tmp"
"""Suffix of a folder that is not a committed checkpoint."""
ITERATION = re.compile(r"iter_(\d{7})")
"""A committed checkpoint's folder (`iteration_dir`)."""
OURS = re.compile(ITERATION.pattern + r"(\.old)?\.tmp")
"""The unfinished folders a save leaves (killed mid-save): the only ones a save removes."""
STATES = ("main", "exp_avg", "exp_avg_sq")
SCALER = ("loss_scale", "growth_tracker", "hysteresis_left")
"""fp16 loss-scaler scalars of TrainState."""


@dataclass(frozen=True)
class Progress:
    iteration: int
    consumed_samples: int
    skipped_iterations: int = 0
    """Steps an fp16 overflow skipped so far, counted on across resumes as the log's total."""


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


EARLIER = f"load an earlier checkpoint: write its N (of a folder iter_N beside this one) into {TRACKER}"
"""The fix for a checkpoint whose files cannot be read."""


def latest(root: str) -> str | None:
    """The last committed checkpoint folder under `root`; None when there is none yet (CheckpointError where
    the folder holds one that cannot be found so: see `unfound`)."""
    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        if why := unfound(root):
            raise CheckpointError(why)
        return None
    with open(tracker, "rb") as f:
        text = f.read().decode("utf-8", errors="replace").strip()
    if not (text.isascii() and text.isdigit()):  # '١٢'.isdigit() and int('١٢') == 12
        raise CheckpointError(f"{tracker}: expected an iteration number in ASCII digits, found {text[:40]!r}; "
                              f"write the N of a folder iter_N beside it, or remove the file")
    folder = iteration_dir(root, int(text))
    if not os.path.isdir(folder):
        there = sorted(n for n in os.listdir(root) if re.fullmatch(r"iter_\d+", n))
        fix = f"write {int(there[-1].removeprefix('iter_'))} (its last, {there[-1]}) into it" if there else \
            "restore that folder"
        raise CheckpointError(f"{tracker} names iteration {text} but {folder} does not exist; {fix}")
    return folder


def unfound(root: str) -> str | None:
    """Why `root`, without a tracker, is not simply a folder with no checkpoint yet, or None: it holds
    checkpoints the tracker would name, or is one checkpoint's folder, or a Hugging Face model. Training from
    iteration 0 there would ignore what the user meant to resume, then overwrite it."""
    tracker = os.path.join(root, TRACKER)
    if os.path.exists(tracker):
        return f"{tracker} is not a file; remove it, then write the N of a folder iter_N beside it into a file of " \
               f"that name"
    if not os.path.isdir(root):
        return None
    names = os.listdir(root)
    saved = sorted(n for n in names if ITERATION.fullmatch(n) and os.path.isdir(os.path.join(root, n)))
    if saved:
        return (f"{root} holds {saved[-1]} but no {TRACKER} (copied without it?); write the iteration to resume "
                f"into it: echo {int(saved[-1][5:])} > {tracker}")
    if METADATA in names:
        return f"{root} is one checkpoint's folder; give the folder that holds it: {os.path.dirname(os.path.abspath(root))}"
    if hf.CONFIG in names:
        return (f"{root} is a Hugging Face model; convert it first: python -m gcompile.checkpoint import-hf {root} "
                f"--save DIR, then give DIR")
    return None


# ---------------------------------------------------------------- save


def save(root: str, progress: Progress, config: RunConfig, program: RankProgram, state: TrainState) -> str:
    """Write this rank's pieces; every rank calls it. Returns the committed folder.

    The ranks agree after each phase, so a failure on any rank (a full disk, most often) fails the
    save on every rank: the half-written folder is removed, the tracker still names the previous
    checkpoint, and every rank raises RunStopped, whose line says why and how much space it takes."""
    coords = program.coords
    final = iteration_dir(root, progress.iteration)
    tmp = final + TMP
    tensors = _rank_tensors(program, state)
    try:
        with together():
            if coords.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)  # a save of this iteration killed earlier
                os.makedirs(tmp)
        with together(), _quiet_dcp():
            dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp), no_dist=not dist.is_initialized())
        mine = ({p.name: _describe(p) for p in program.layout.params if not p.tied_copy},
                {key: _key_record(t) for key, t in tensors.items()})
        gathered = _gather(mine)
        with together():
            if coords.rank == 0:
                params, keys = {}, {}
                for rank_params, rank_keys in gathered:
                    params.update(rank_params)
                    keys.update(rank_keys)
                meta = dict(iteration=progress.iteration, consumed_samples=progress.consumed_samples,
                            skipped_iterations=progress.skipped_iterations,
                            step=state.step.item(),
                            scaler={n: getattr(state, n).item() for n in SCALER}
                            if state.loss_scale is not None else None,
                            layout=dict(coords.axis_sizes, distributed_optimizer=program.optimizer_shard is not None,
                                        param_dtype=str(program.step_settings.param_dtype).removeprefix("torch."),
                                        main=state.main is not None),
                            model=config.model_spec.name, config=dataclasses.asdict(config), params=params, keys=keys,
                            **({"arch": MODELS[config.model_spec.name]} if is_users(config.model) else {}))
                _write_durably(os.path.join(tmp, METADATA), json.dumps(meta, indent=1))
                _write_durably(os.path.join(tmp, CHECKSUMS), write_checksums(tmp))
        with together():  # every rank's files are complete
            if coords.rank == 0:
                _commit(root, tmp, final, progress.iteration)
    except PhaseFailed as failure:
        if coords.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        needed = sum(all_ranks(sum(t.numel() * t.element_size() for t in tensors.values())))
        raise RunStopped(_save_failure(root, tmp, progress.iteration, failure, needed), coords.rank == 0) from None
    return final


def _rank_tensors(program: RankProgram, state: TrainState) -> dict[str, torch.Tensor]:
    """What this rank writes, by key (views of its buffers)."""
    layout, coords, sharded = program.layout, program.coords, program.shard_positions is not None
    views = layout.views(state.params)
    buffers = {name: getattr(state, name) for name in STATES if getattr(state, name) is not None}
    spans = layout.spans(program.shard_positions)
    tensors = {}
    for param in layout.params:
        if param.tied_copy:
            continue  # the first stage's copy is written
        piece = _piece_name(param, coords.axis_ranks)
        if first_holder(param, coords.axis_ranks):
            tensors[f"model/{param.name}/{piece}"] = views[param.name]
        if first_holder(param, coords.axis_ranks, apart=("pp", "dp") if sharded else ("pp",)):
            for name, buffer in buffers.items():
                for s in spans[param.name]:
                    tensors[f"optim/{name}/{param.name}/{piece}/{s.start}-{s.end}"] = \
                        buffer[s.at:s.at + s.end - s.start]
    tensors[f"rng/rank{coords.rank}/cpu"] = torch.get_rng_state()
    if state.params.is_cuda:
        tensors[f"rng/rank{coords.rank}/cuda"] = torch.cuda.get_rng_state(state.params.device)
    return tensors


def _commit(root: str, tmp: str, final: str, iteration: int) -> None:
    """Rename the finished folder into place, then point the tracker at it; clear leftovers."""
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if OURS.fullmatch(name) and os.path.isdir(path) and path != tmp:  # not a user's own data.tmp
            shutil.rmtree(path, ignore_errors=True)
    replaced = final + ".old" + TMP
    if os.path.exists(final):  # saving an iteration again after resuming from an earlier one
        os.rename(final, replaced)
    os.rename(tmp, final)
    try:
        _write_durably(os.path.join(root, TRACKER), f"{iteration}\n")
    except OSError:  # the tracker still names the previous save: put the folders back as they were
        os.rename(final, tmp)
        if os.path.exists(replaced):
            os.rename(replaced, final)
        raise
    shutil.rmtree(replaced, ignore_errors=True)


def _write_durably(path: str, text: str) -> None:
    """Write a temporary file, fsync it, rename it over `path`, fsync the folder."""
    try:
        with open(path + TMP, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + TMP, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(path + TMP)
        raise
    folder = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


# ---------------------------------------------------------------- read


class Checkpoint:
    """One committed checkpoint folder, read a parameter at a time."""

    def __init__(self, folder: str):
        self.folder = folder
        path = os.path.join(folder, METADATA)
        if not os.path.isdir(folder):
            raise CheckpointError(f"{folder}: no such checkpoint folder")
        if not os.path.isfile(path):
            raise CheckpointError(f"{folder}: not a gcompile checkpoint (no {METADATA})")
        try:
            self.meta = json.loads(read_checked(folder, METADATA))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: unreadable ({e})") from None
        if isinstance(self.meta, dict) and isinstance(name := self.meta.get("model"), str) and name not in MODELS:
            arch = self.meta.get("arch") if isinstance(self.meta.get("arch"), str) else "FILE:SPEC"
            raise CheckpointError(f"{folder} holds a {name!r} model, your own, which this command has not loaded: "
                                  f"run_gpt.py --arch {arch} --load resumes it; export, export-hf and generate take "
                                  f"the built-in models ({', '.join(MODELS)})")
        try:
            _check_meta(self.meta)
            layout = self.meta["layout"]
            self.axis_sizes = {axis: layout.get(axis, 1) for axis in (*AXES, *FOLDED, *ACROSS)}  # absent = 1
            self.params = {name: _param(name, d) for name, d in self.meta["params"].items()}
            self.ranges = {}  # (state, name, piece) -> [(start, key)]
            for key in self.meta["keys"]:
                if key.startswith("optim/"):
                    _, state, rest = key.split("/", 2)
                    name, piece, span = rest.rsplit("/", 2)
                    self.ranges.setdefault((state, name, piece), []).append((int(span.split("-")[0]), key))
        except (TypeError, ValueError) as e:  # a field missing, of the wrong type, or a key not of our making
            raise CheckpointError(f"{path}: {first_line(e)}; the file is damaged or not written by gcompile, "
                                  f"load an earlier checkpoint or save again") from None
        named = ITERATION.fullmatch(os.path.basename(os.path.normpath(folder)))
        if named and int(named[1]) != self.meta["iteration"]:
            raise CheckpointError(f"{path} records iteration {self.meta['iteration']} but lies in "
                                  f"{os.path.basename(os.path.normpath(folder))} (files copied between iterations?); "
                                  f"load an earlier checkpoint or save again")
        self.reader = MetadataReader(folder)
        try:  # here, so that DCP's own read does not print its tracebacks before failing
            self.reader.read_metadata()
        except CheckpointError:
            raise
        except Exception as e:  # a missing or damaged file fails as whatever its reader raised
            raise CheckpointError(f"{folder}: cannot read its DCP .metadata ({first_line(e)}); the save is "
                                  f"incomplete or damaged, load an earlier checkpoint or save again") from None
        stored = self.reader.metadata.state_dict_metadata
        for key, record in self.meta["keys"].items():  # what a read allocates: the shape DCP stored, no other
            size = getattr(stored.get(key), "size", None)
            if size is None or list(size) != record["shape"]:
                raise CheckpointError(f"{path}: key {key!r} is {record['shape']} there, {list(size or [])} in the DCP "
                                      f".metadata; load an earlier checkpoint or save again")
        self.files = None  # key -> file name, read on the first failure

    @property
    def model_spec(self) -> ModelSpec:
        return model_spec(self.meta["model"])

    @property
    def model_config(self):
        return self.model_spec.config(**self.meta["config"]["model"])

    @property
    def master(self) -> str:
        """Where the most precise weights are: the fp32 main weights when they were kept apart."""
        return "main" if self.meta["layout"]["main"] else "model"

    def describe_layout(self) -> str:
        layout = self.meta["layout"]
        axes = " ".join(f"{axis}{self.axis_sizes[axis]}" for axis in ("tp", "cp", "pp", "dp", "ep")
                        if axis not in ("cp", "ep") or self.axis_sizes[axis] > 1)
        fully_sharded = any(s["axis"] in ("dp", "dp_shard") for d in self.meta["params"].values() for s in d["shards"])
        hybrid = f" in groups of {self.axis_sizes['dp_shard']}" if self.axis_sizes["dp_shard"] > 1 else ""
        sharding = f", fully sharded{hybrid}" if fully_sharded else ", distributed optimizer" \
            if layout["distributed_optimizer"] else ""
        return f"{axes}{sharding}, {layout['param_dtype']}"

    def check_model(self, model) -> None:
        """`model` (a model config) is the model saved here, up to dropout."""
        if spec_of(model) is not self.model_spec:
            raise CheckpointError(f"{self.folder} holds a {self.model_spec.name} model "
                                  f"(this run: {spec_of(model).name}); give the run its model (--arch "
                                  f"{self.meta.get('arch', self.model_spec.name)})")
        saved = self.model_config
        diffs = [f"{f.name}={getattr(saved, f.name)} (this run: {getattr(model, f.name)})"
                 for f in dataclasses.fields(saved) if f.name != "dropout"
                 and getattr(saved, f.name) != getattr(model, f.name)]
        if diffs:
            raise CheckpointError(f"{self.folder} holds a different model: {', '.join(diffs)}; give the run the "
                                  f"saved sizes, or --load another folder")

    def full(self, state: str, name: str) -> torch.Tensor:
        """The full single-device tensor of parameter `name`'s `state` ("model", "main", "exp_avg", ...)."""
        if name not in self.params:
            raise CheckpointError(f"{self.folder} holds no parameter {name}")
        param = self.params[name]
        pieces = _piece_names(param, self.axis_sizes)
        if state == "model":
            keys = {piece: [f"model/{name}/{piece}"] for piece in pieces}
        else:
            keys = {piece: [key for _, key in sorted(self.ranges.get((state, name, piece), []))] for piece in pieces}
        values = self.read([key for piece in pieces for key in keys[piece]])
        shape = param.local_shape(self.axis_sizes)
        flat = [torch.cat([values[key].reshape(-1) for key in keys[piece]]) if keys[piece] else torch.empty(0)
                for piece in pieces]
        for piece, value in zip(pieces, flat):
            if value.numel() != math.prod(shape):
                raise CheckpointError(f"{self.folder}: {state} of {name} piece {piece} holds {value.numel()} "
                                      f"elements, its shape {list(shape)} needs {math.prod(shape)}")
        return full_value([value.view(shape) for value in flat], param, self.axis_sizes)

    def local(self, state: str, param: Param, coords: Coords) -> torch.Tensor:
        """`state` of a parameter as the rank at `coords` holds it under `param`'s cuts, flattened."""
        full = self.full(state, param.name)
        return local_value(full, param, coords.axis_ranks, coords.axis_sizes).reshape(-1)

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """Load `keys` with DCP and check each against its CRC-32."""
        records = self.meta["keys"]
        for key in keys:
            if key not in records:
                raise CheckpointError(f"{self.folder} has no {key}")
        tensors = {key: torch.empty(records[key]["shape"], dtype=_dtype(records[key]["dtype"])) for key in keys}
        try:
            self._load(tensors)
        except (Exception, dcp.CheckpointException) as e:  # a bad file fails as whatever its reader raised
            raise CheckpointError(f"{self.folder}: cannot read {self._failing_file(tensors)} "
                                  f"(truncated or damaged?): {first_line(e)}; {EARLIER}") from None
        for key, value in tensors.items():
            if _crc32(value) != records[key]["crc32"]:
                raise CheckpointError(f"{self.folder}: {key} in {self._file_of(key)} does not match its "
                                      f"checksum; the file is corrupted: {EARLIER}")
        return tensors

    def verify(self) -> None:
        """Read every key once (a parameter at a time), so a damaged file fails before any rank starts."""
        states = ("model", *(s for s in STATES if s != "main" or self.meta["layout"]["main"]))
        for name in self.params:
            for state in states:
                self.full(state, name)
        self.read([key for key in self.meta["keys"] if key.startswith("rng/")])

    def _load(self, tensors: dict[str, torch.Tensor]) -> None:
        with _quiet_dcp():
            dcp.load(tensors, storage_reader=self.reader, no_dist=True)

    def _failing_file(self, tensors: dict[str, torch.Tensor]) -> str:
        """The files a read of `tensors` failed on: one read spans the files of several ranks, so each file's keys
        are read again alone."""
        by_file = {}
        for key, tensor in tensors.items():
            by_file.setdefault(self._file_of(key), {})[key] = tensor
        failing = []
        for file, some in by_file.items():
            try:
                self._load(some)
            except (Exception, dcp.CheckpointException):
                failing.append(file)
        return " and ".join(failing) if failing else " or ".join(by_file)

    def _file_of(self, key: str) -> str:
        if self.files is None:
            try:
                storage = self.reader.read_metadata().storage_data
            except Exception:
                return "its DCP .metadata"
            self.files = {index.fqn: info.relative_path for index, info in storage.items()}
        return self.files.get(key, "its DCP .metadata")


@contextlib.contextmanager
def claimed(save: str):
    """Hold the --save folder for as long as the run lasts (`paths.claimed`): two runs saving into one folder
    renamed and deleted each other's iter_N.tmp and committed one run's metadata with the other's shards. A
    second run is refused (CheckpointError) while the first lives."""
    try:
        os.makedirs(save, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"--save {save}: cannot create the folder ({e.strerror})") from None
    if not os.access(save, os.W_OK | os.X_OK):
        raise CheckpointError(f"--save {save}: the folder is not writable")
    with paths.claimed(save, CheckpointError(f"--save {save} is in use: another run is saving there; wait for it "
                                             f"to end, or save to another folder")):
        yield


def check(config: RunConfig) -> None:
    """Before any rank starts: --save can be written, and the checkpoint --load resumes from (if any) is
    whole and of this model. The caller holds --save (`claimed`) first: two runs could both find it empty."""
    c = config.checkpoint
    resumed = paths.same_folder(c.load, c.save)
    if c.load and not resumed and not os.path.exists(c.load):  # a typo would train from iteration 0 unseen
        raise CheckpointError(f"--load {c.load}: no such folder; give the folder a run saved to (its --save), or "
                              f"leave --load out to start from iteration 0 (--load and --save of one folder start "
                              f"there at 0 until it holds a checkpoint)")
    if c.save:
        if not resumed and os.path.isfile(os.path.join(c.save, hf.CONFIG)):  # unfound's advice is --load's
            raise CheckpointError(f"--save {c.save} is a Hugging Face model's folder, which the run would write "
                                  f"beside; save to a new folder (import-hf converts that model to --load it)")
        if not resumed and (other := latest(c.save)) is not None:  # its iter_N would be written over
            raise CheckpointError(f"--save {c.save} holds another run's checkpoint ({os.path.basename(other)}); "
                                  f"resume it with --load {c.save}, or save to a new folder")
    folder = latest(c.load) if c.load else None
    if folder is not None:
        checkpoint = Checkpoint(folder)
        checkpoint.check_model(config.model)
        checkpoint.verify()


def load(folder: str, config: RunConfig, program: RankProgram, state: TrainState, log=print) -> Progress:
    """Fill this rank's state from a checkpoint saved with any layout (ranks load independently)."""
    coords = program.coords
    checkpoint = Checkpoint(folder)
    checkpoint.check_model(config.model)
    layout = program.layout
    views = layout.views(state.params)
    spans = layout.spans(program.shard_positions)
    with torch.no_grad():
        for param in layout.params:  # one full parameter in memory at a time
            weights = checkpoint.local(checkpoint.master, param, coords)
            views[param.name].view(-1).copy_(weights)  # in the model's dtype
            if state.main is not None:
                _put(state.main, spans[param.name], weights)
            for name in ("exp_avg", "exp_avg_sq"):
                _put(getattr(state, name), spans[param.name], checkpoint.local(name, param, coords))
    meta = checkpoint.meta
    state.step.fill_(meta["step"])
    if meta["scaler"] is not None and state.loss_scale is not None:
        for name in SCALER:
            getattr(state, name).fill_(meta["scaler"][name])
    saved = checkpoint.meta["layout"]
    same_ranks = all(saved.get(axis, 1) == size for axis, size in coords.axis_sizes.items())
    if same_ranks:
        rng = checkpoint.read([k for k in meta["keys"] if k.startswith(f"rng/rank{coords.rank}/")])
        torch.set_rng_state(rng[f"rng/rank{coords.rank}/cpu"])
        if state.params.is_cuda and f"rng/rank{coords.rank}/cuda" in rng:
            torch.cuda.set_rng_state(rng[f"rng/rank{coords.rank}/cuda"], state.params.device)
    log(f"loaded {folder}: iteration {meta['iteration']}, consumed samples {meta['consumed_samples']} "
        f"(saved on {checkpoint.describe_layout()}"
        f"{'' if same_ranks else '; on other ranks, so RNG states are not restored'})")
    skipped = meta.get("skipped_iterations", 0)  # absent: saved before gcompile counted them here
    return Progress(meta["iteration"], meta["consumed_samples"], skipped if type(skipped) is int else 0)


# ---------------------------------------------------------------- export


def resolve(path: str) -> str:
    """A committed checkpoint folder from SAVE (its latest) or from one iter_N folder."""
    if os.path.isfile(path):
        raise CheckpointError(f"{path} is a file; give the folder a run saved to (its --save DIR)")
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such folder")
    if os.path.isfile(os.path.join(path, METADATA)):
        return path
    folder = latest(path)
    if folder is None:
        raise CheckpointError(f"{path}: no checkpoint (neither {TRACKER} nor {METADATA})")
    return folder


def export(path: str, output: str) -> str:
    """Write the model as one single-device nanoGPT checkpoint: {"model": state dict, "model_args": ...}."""
    checkpoint = Checkpoint(resolve(path))
    checkpoint.verify()  # damage anywhere refused, as --load refuses it, not only in the weights written
    config = checkpoint.model_config
    with torch.device("meta"):
        model = checkpoint.model_spec.module(config)
    names = {id(p): name for name, p in model.named_parameters()}
    weights = {name: checkpoint.full(checkpoint.master, name) for name in names.values()}  # fp32 where kept,
    # as export-hf writes: a bf16 run's weights are their rounding
    # every state-dict key, a tied alias included, as the same tensor as its parameter
    state_dict = {key: weights[names[id(p)]] for key, p in model.state_dict(keep_vars=True).items()}
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with paths.replacing(output) as partial:  # renamed into place whole: a stop meanwhile leaves no half file
        torch.save(dict(model=state_dict, model_args=checkpoint.model_spec.export_args(config),
                        iter_num=checkpoint.meta["iteration"]), partial)
    return checkpoint.folder


PADDED_AT_MOST = 1024
"""More ids than a tokenizer gives that a model may score: a vocabulary padded to a multiple of 128 x tp (tp up to 8).
A model of 50257 sampled with a tokenizer of 2048 ids printed a few words, the rest of its ids decoding to nothing."""


def load_exported(path: str, spec: ModelSpec) -> tuple[torch.nn.Module, object]:
    """The single-device model of a file `export` wrote (or nanoGPT saved), of the model `spec`, and its config."""
    if os.path.isdir(path):
        raise CheckpointError(f"{path} is a folder; give the file export wrote (export SAVE --output FILE)")
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such file")
    not_ours = f"{path}: not a {spec.name} model exported by gcompile.checkpoint"
    try:
        with warnings.catch_warnings():  # torch's own advice on old pickles: not ours to print
            warnings.simplefilter("ignore")
            exported = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # torch's message advises weights_only=False, which would run the file's code
        raise CheckpointError(f"{not_ours}: it holds Python objects beyond tensors and numbers, and loading them "
                              f"could run code; refused") from None
    except Exception as e:  # anything else torch.load refuses: not a torch file, truncated
        raise CheckpointError(f"{not_ours} (torch.load: {first_line(e)}); give a file `export` wrote "
                              f"(python -m gcompile.checkpoint export SAVE --output FILE)") from None
    if not isinstance(exported, dict) or not {"model", "model_args"} <= exported.keys():
        raise CheckpointError(f"{not_ours}: it holds no model and model_args, which export writes (a folder "
                              f"export-hf wrote loads with transformers' from_pretrained)")
    try:
        config = spec.config(**exported["model_args"])
        if getattr(config, "n_layer", 0) > MAX_LAYERS:
            raise ValueError(f"n_layer={config.n_layer} is more than {MAX_LAYERS} layers")
        with torch.device("meta"):
            numel = sum(p.numel() for p in spec.module(config).parameters())
    except (TypeError, KeyError, ValueError, RuntimeError) as e:  # RuntimeError: sizes no tensor can have
        raise CheckpointError(f"{not_ours}: its model_args are not a {spec.name} config's ({first_line(e)}); is "
                              f"--model-name right?") from None
    if numel * 4 > ram_bytes():
        raise CheckpointError(f"{not_ours}: its model_args make {numel:,} parameters, more than this machine's "
                              f"memory holds")
    try:
        model = spec.module(config)
        model.load_state_dict(exported["model"])
    except Exception as e:  # load_state_dict's first line only names the model; its second names the keys
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        raise CheckpointError(f"{not_ours} ({(lines[1:] or lines or [type(e).__name__])[0][:200]})") from None
    if broken := next((name for name, p in model.named_parameters() if not torch.isfinite(p).all()), None):
        raise CheckpointError(f"{path}: its {broken} holds NaN or infinite values; nothing can be sampled from it")
    return model, config


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m gcompile.checkpoint",
                            description="Export a distributed checkpoint, sample from an export, or convert "
                                        "to and from Hugging Face.")
    commands = parser.add_subparsers(dest="command", required=True)
    ex = commands.add_parser("export", help="write a single-device state dict with the model's names")
    ex.add_argument("checkpoint", help="SAVE folder (its latest checkpoint) or one SAVE/iter_N folder")
    ex.add_argument("--output", required=True, help="file to write (torch.save)")
    imp = commands.add_parser("import-hf", help="a Hugging Face model folder (config.json + safetensors) as an "
                                                "iteration-0 checkpoint any layout loads")
    imp.add_argument("hf_dir", help="folder written by save_pretrained (GPT2LMHeadModel or LlamaForCausalLM)")
    imp.add_argument("--save", required=True, help="checkpoint folder to write (as run_gpt.py --save)")
    exh = commands.add_parser("export-hf", help="write config.json + model.safetensors that from_pretrained loads")
    exh.add_argument("checkpoint", help="SAVE folder (its latest checkpoint) or one SAVE/iter_N folder")
    exh.add_argument("output_dir", help="folder to write")
    gen = commands.add_parser("generate", help="sample text from an exported model")
    gen.add_argument("model", help="a file written by export")
    gen.add_argument("--model-name", choices=sorted(MODELS), default=DEFAULT_MODEL, help="the model the file holds")
    gen.add_argument("--prompt", default="", help="text to continue; empty = a new document")
    gen.add_argument("--max-new-tokens", type=int, default=200)
    gen.add_argument("--temperature", type=float, default=0.8, help="above 0; lower = more likely tokens")
    gen.add_argument("--top-k", type=int, default=200, help="sample among the k most likely tokens; 0 = all")
    gen.add_argument("--seed", type=int, default=1337)
    gen.add_argument("--tokenizer-model", help="the Hugging Face tokenizer.json (or its folder) the model's data was "
                                               "prepared with (default: the byte tokenizer, 257 ids)")
    args = parser.parse_args(argv)
    try:
        if args.command == "export":
            problem = ("--output is empty; name the file to write" if not args.output
                       else f"--output {args.output} is a folder; name a file in it" if os.path.isdir(args.output)
                       else _inside("--output", args.output, args.checkpoint)
                       or (f"--output {args.output} exists; name a new file, or remove that one first"
                           if os.path.lexists(args.output) else path_error("--output", args.output, folder=False)))
            if problem:  # before the checkpoint is read, which takes a while
                raise CheckpointError(problem)
            folder = export(args.checkpoint, args.output)
            print(f"exported {folder} to {args.output}")
        elif args.command == "import-hf":
            problem = path_error("--save", args.save)
            if not problem and os.path.isdir(args.save) and os.listdir(args.save):
                problem = f"--save {args.save} holds files already; give a new or empty folder for the import"
            if problem:
                raise CheckpointError(problem)
            hf.import_hf(args.hf_dir, args.save)
        elif args.command == "export-hf":
            problem = path_error("output_dir", args.output_dir) or _inside("output_dir", args.output_dir,
                                                                            args.checkpoint)
            if not problem and os.path.isdir(args.output_dir) and os.listdir(args.output_dir):
                problem = f"{args.output_dir} holds files already; give a new or empty folder for the export"
            if problem:
                raise CheckpointError(problem)
            hf.export_hf(args.checkpoint, args.output_dir)
        else:
            if not (0 < args.temperature < math.inf):
                raise CheckpointError(f"--temperature {args.temperature} must be above 0")
            if args.max_new_tokens < 0:
                raise CheckpointError(f"--max-new-tokens {args.max_new_tokens} must be 0 or more")
            if args.top_k < 0:
                raise CheckpointError(f"--top-k {args.top_k} must be 0 (all tokens) or more")
            try:
                args.prompt.encode("utf-8")
            except UnicodeEncodeError as e:  # bytes that are not UTF-8 reach Python as lone surrogates
                raise CheckpointError(f"--prompt is not valid UTF-8 (at character {e.start}); give UTF-8 text") from None
            spec = model_spec(args.model_name)
            tokenizer = _tokenizer(args.tokenizer_model, args.prompt)
            model, model_config = load_exported(args.model, spec)
            if model_config.vocab_size < tokenizer.id_bound or args.tokenizer_model is None and \
                    model_config.vocab_size != tokenizer.id_bound or \
                    model_config.vocab_size >= tokenizer.id_bound + PADDED_AT_MOST:
                raise CheckpointError(f"{args.model} scores {model_config.vocab_size} token ids, the tokenizer "
                                      f"gives {tokenizer.id_bound}: give --tokenizer-model, the tokenizer.json its "
                                      f"data was prepared with")
            for piece in generate_text(model, spec.context_length(model_config), args.prompt, args.max_new_tokens,
                                       args.temperature, args.top_k or None, args.seed, tokenizer):
                print(piece, end="", flush=True)
            print()
    except CheckpointError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    return 0


# ---------------------------------------------------------------- helpers

def _tokenizer(model: str | None, prompt: str) -> tok.ByteLevel | tok.HuggingFace:
    """generate's tokenizer: the byte tokenizer, or `model` (--tokenizer-model); CheckpointError where it cannot
    be read, or where an empty prompt asks for an end-of-document token it lacks."""
    try:
        tokenizer = tok.build(tok.TokenizerSpec("HuggingFaceTokenizer", tokenizer_model=model)) if model else \
            tok.ByteLevel()
    except tok.TokenizerError as e:
        raise CheckpointError(str(e)) from None
    if not prompt and tokenizer.eod is None:
        raise CheckpointError(f"--tokenizer-model {model} has no end-of-document token to start a document with; "
                              f"give a --prompt")
    return tokenizer


def _inside(flag: str, output: str, checkpoint: str) -> str | None:
    """Why `output` may not be written: it lies in the checkpoint being read (its SAVE folder, where it is given
    one iter_N folder), where it would replace a shard or the tracker. None when it lies elsewhere."""
    given = os.path.realpath(checkpoint)
    root = os.path.dirname(given) if os.path.isfile(os.path.join(given, METADATA)) else given
    target = os.path.realpath(output)
    if target == root or target.startswith(root + os.sep):
        return f"{flag} {output} is inside the checkpoint folder {checkpoint} it reads; write it elsewhere"
    return None


def _put(buffer: torch.Tensor, spans: list[Span], values: torch.Tensor) -> None:
    """Write the elements of a flattened parameter piece that `spans` place in an optimizer buffer."""
    for s in spans:
        buffer[s.at:s.at + s.end - s.start].copy_(values[s.start:s.end])


def _piece_name(param: Param, axis_ranks) -> str:
    """`tp1` for tp rank 1's piece of a tp-cut parameter; `full` when uncut."""
    return "_".join(f"{s.axis}{axis_ranks[s.axis]}" for s in param.shards) or "full"


def _piece_names(param: Param, axis_sizes) -> list[str]:
    """Every piece of a parameter, in the order full_value takes them (the first cut's axis outermost)."""
    names = [{}]
    for s in param.shards:
        names = [dict(ranks, **{s.axis: r}) for ranks in names for r in range(axis_sizes[s.axis])]
    return [_piece_name(param, ranks) for ranks in names]


def _describe(param: Param) -> dict:
    return dict(full_shape=list(param.full_shape), shards=[dataclasses.asdict(s) for s in param.shards])


META_FIELDS = {
    "": dict(iteration=int, consumed_samples=int, step=(int, float), scaler=(dict, type(None)), layout=dict,
             model=str, config=dict, params=dict, keys=dict),
    "layout": dict(tp=int, pp=int, dp=int, distributed_optimizer=bool, param_dtype=str, main=bool),
    "config": dict(model=dict),
    "params": dict(full_shape=list, shards=list),
    "keys": dict(dtype=str, shape=list, crc32=int),
}
"""gcompile.json's fields and their JSON types: at the top, in the layout and the run config, per parameter
and per key."""


def _check_meta(meta) -> None:
    """ValueError naming the first field of gcompile.json that is missing or of the wrong type."""
    records = [("", meta)]
    if isinstance(meta, dict):
        records += [(section, meta.get(section, {})) for section in ("layout", "config")]
        for section in ("params", "keys"):
            records += [(section, record) for record in (meta.get(section) or {}).values()]
    for section, record in records:
        if not isinstance(record, dict):
            raise ValueError(f"{section or 'the file'} holds {type(record).__name__} where an object belongs")
        for name, kind in META_FIELDS[section].items():
            where = f"{section}.{name}" if section else name
            if name not in record:
                raise ValueError(f"no {where!r}")
            if not isinstance(record[name], kind) or (isinstance(record[name], bool) and kind is int):
                raise ValueError(f"{where!r} is {json.dumps(record[name])[:40]}, of the wrong type")
    config = model_spec(meta["model"]).config
    config(**meta["config"]["model"])  # TypeError: a field this model does not have
    kinds = {f.name: type(f.default) for f in dataclasses.fields(config)
             if f.default is not dataclasses.MISSING and f.default is not None}  # None: of no one kind
    for name, value in meta["config"]["model"].items():
        kind = kinds.get(name, type(value))
        if not (type(value) is kind or kind is float and type(value) is int):  # a bool is no int here
            raise ValueError(f"'config.model.{name}' is {json.dumps(value)[:40]}, of the wrong type")
    for name in ("iteration", "consumed_samples", "step"):
        if not 0 <= meta[name] < 10 ** 12:  # NaN fails too
            raise ValueError(f"{name!r} is {meta[name]}, not a count this run could have reached")
    for axis in ("tp", "pp", "dp"):
        if meta["layout"][axis] < 1:
            raise ValueError(f"'layout.{axis}' is {meta['layout'][axis]}, not a number of ranks")
    shapes = [(f"params.{name}.full_shape", record["full_shape"]) for name, record in meta["params"].items()]
    for where, shape in shapes + [(f"keys.{key}.shape", record["shape"]) for key, record in meta["keys"].items()]:
        if not all(type(n) is int and n >= 0 for n in shape) or math.prod(shape) >= 2 ** 40:
            raise ValueError(f"{where!r} is {json.dumps(shape)[:40]}, not the shape of a tensor saved here")
    for key, record in meta["keys"].items():
        if not isinstance(getattr(torch, record["dtype"], None), torch.dtype):
            raise ValueError(f"{key!r} has dtype {record['dtype']!r}, not a torch dtype")


def _param(name: str, described: dict) -> Param:
    return Param(name=name, full_shape=tuple(described["full_shape"]),
                 shards=tuple(Shard(**s) for s in described["shards"]))


def _key_record(value: torch.Tensor) -> dict:
    return dict(dtype=str(value.dtype).removeprefix("torch."), shape=list(value.shape), crc32=_crc32(value))


def _crc32(value: torch.Tensor) -> int:
    return zlib.crc32(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _save_failure(root: str, tmp: str, iteration: int, failure: PhaseFailed, needed: int) -> str:
    """The one line a failed save ends the run with (on rank 0, after the half-written folder is removed)."""
    tracker = os.path.join(root, TRACKER)
    kept = (f"{TRACKER} still names iteration {open(tracker).read().strip()}" if os.path.isfile(tracker)
            else "no checkpoint was committed before")
    if failure.no_space:
        why = (f"no space left on the device ({size_text(shutil.disk_usage(root).free)} free; the checkpoint's "
               f"tensors alone take {size_text(needed)}, its files more)")
    else:
        why = f"{failure}"
    return f"--save {root}: saving iteration {iteration} failed, {why}; removed the half-written {os.path.basename(tmp)}; {kept}"


def _gather(obj) -> list:
    """Every rank's `obj` on rank 0 (a list by rank); [] elsewhere."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out or []


@contextlib.contextmanager
def _quiet_dcp():
    """DCP warns on every single-process save or load that it assumes one process; we mean it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


if __name__ == "__main__":
    shutdown.install(shutdown.stopper(exit_signal_handler=False), "python -m gcompile.checkpoint")  # Ctrl-C: one line
    sys.exit(main())
