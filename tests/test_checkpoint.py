"""Checkpoints: exact resume, resharding across layouts, a save killed midway, export, bad input.

Runs go through gcompile.train.train, the loop run_gpt.py runs, on gloo ranks
(tests/workers/train_worker.py) or in this process for one rank, and are compared by
the per-iteration lm_loss in RUN_DIR/metrics.jsonl against a run that was never cut.
Resuming on the layout that saved is bitwise exact on CPU. Another layout sums in
another order, so it matches within TOL, as every numerics test does.
"""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

import run_gpt
from gcompile import checkpoint, paths
from gcompile.checkpoint import TMP, TRACKER, iteration_dir
from gcompile.config import parse_args
from gcompile.data import build_datasets
from gcompile.flat import flat_layout
from gcompile.layout import Param, Shard, full_value, local_value
from gcompile.axes import Coords
from gcompile.models.gpt2 import GPT, GPT2, NANOGPT_ARGS
from gcompile.pipeline import build_rank_program
from gcompile.sample import generate_text, sample
from gcompile.tokenizer import decode
from gcompile.state import TrainState
from gcompile.train import train
from tests.multirank import ROOT, assert_succeeded, launch

TOL = 1e-5
N = 3
"""Iterations before the cut; every run is 2N iterations long (its lr schedule spans 2N)."""
WORKER = os.path.join(os.path.dirname(__file__), "workers", "train_worker.py")
SMALL = ["--n-layer", "2", "--n-head", "4", "--n-embd", "64", "--block-size", "32", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(2 * N), "--lr", "1e-3",
         "--lr-warmup-iters", "2", "--eval-interval", "0"]
DP2_DISTOPT = ["--dp", "2", "--use-distributed-optimizer"]


def config(*flags):
    return parse_args(SMALL + [str(f) for f in flags])[0]


def losses(run_dir) -> list[float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r["lm_loss"] for r in map(json.loads, f) if "lm_loss" in r]


def assert_close(actual: list[float], expected: list[float], label: str) -> None:
    assert len(actual) == len(expected), (label, actual, expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert abs(a - e) / abs(e) < TOL, f"{label}: loss {i} is {a}, expected {e}"


DTYPES = {"": [], "bf16 ": ["--bf16"],
          "fp16 ": ["--fp16", "--initial-loss-scale", "1048576", "--loss-scale-window", "2"]}
"""Label prefix -> flags. fp16: the scale overflows, backs off and grows again on both sides of the cut."""


def cut_resumed_straight(root, layouts: dict[str, list]) -> tuple[dict[str, object], list]:
    """Per layout (label prefix -> flags): a run cut at N by --exit-interval, its resumption from
    the cut's checkpoint, and an uninterrupted run. ({label: folder for run/ and save/}, configs)."""
    dirs, configs = {}, []
    for prefix, flags in layouts.items():
        cut, resumed, straight = (root / (prefix + label) for label in ("cut", "resumed", "straight"))
        dirs.update({prefix + "cut": cut, prefix + "resumed": resumed, prefix + "straight": straight})
        configs += [config(*flags, "--save", cut / "save", "--exit-interval", N, "--run-dir", cut / "run"),
                    config(*flags, "--load", cut / "save", "--save", resumed / "save", "--run-dir", resumed / "run"),
                    config(*flags, "--run-dir", straight / "run")]
    return dirs, configs


def assert_resume_is_exact(dirs, prefix: str) -> None:
    straight = losses(dirs[prefix + "straight"] / "run")
    cut, resumed = losses(dirs[prefix + "cut"] / "run"), losses(dirs[prefix + "resumed"] / "run")
    assert len(straight) == 2 * N and len(cut) == N, "--exit-interval stops after iteration N"
    assert cut + resumed == straight, f"{prefix}cut at {N} and resumed: {cut} + {resumed} != {straight}"


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    """dp2 with the distributed optimizer in fp32, bf16 and fp16: cut, resumed, straight; one launch."""
    root = tmp_path_factory.mktemp("dp2")
    dirs, configs = cut_resumed_straight(root, {prefix: DP2_DISTOPT + flags for prefix, flags in DTYPES.items()})
    assert_succeeded(root, launch(root, WORKER, dict(configs=configs), world=2))
    return dirs


def test_resume_is_exact(dp2):
    for prefix in DTYPES:
        assert_resume_is_exact(dp2, prefix)
    save = dp2["cut"] / "save"
    assert sorted(os.listdir(save)) == [os.path.basename(iteration_dir("", N)), TRACKER]
    assert (save / TRACKER).read_text().strip() == str(N)
    assert (dp2["resumed"] / "save" / TRACKER).read_text().strip() == str(2 * N), "a save at the end of training"


MODEL_PARALLEL = ["--tp", 2, "--pp", 2, *DP2_DISTOPT]
"""The layout saved by the model-parallel tests."""
RESHARD_TO = ["--tp", 4, "--dp", 2]
"""Another layout of as many ranks: other tp cuts, no pipeline, no distributed optimizer."""


@pytest.fixture(scope="module")
def model_parallel(tmp_path_factory):
    """MODEL_PARALLEL: cut, resumed, straight, and the cut's checkpoint continued on RESHARD_TO; one launch."""
    root = tmp_path_factory.mktemp("model_parallel")
    dirs, configs = cut_resumed_straight(root, {"": MODEL_PARALLEL})
    dirs["resharded"] = root / "resharded"
    configs.append(config(*RESHARD_TO, "--load", dirs["cut"] / "save", "--run-dir", dirs["resharded"] / "run"))
    assert_succeeded(root, launch(root, WORKER, dict(configs=configs), world=configs[0].world_size))
    return dirs


@pytest.mark.slow
def test_model_parallel_resume_is_exact_and_reshards(model_parallel):
    assert_resume_is_exact(model_parallel, "")
    assert_close(losses(model_parallel["resharded"] / "run"), losses(model_parallel["straight"] / "run")[N:],
                 f"{MODEL_PARALLEL} -> {RESHARD_TO}")


@pytest.mark.parametrize("runs", ["dp2", pytest.param("model_parallel", marks=pytest.mark.slow)])
def test_reshard_to_one_rank(runs, request, tmp_path):
    dirs, run_dir = request.getfixturevalue(runs), tmp_path / "run"
    train(config("--load", dirs["cut"] / "save", "--run-dir", run_dir), Coords.from_rank(0, {}), log=lambda _: None)
    assert_close(losses(run_dir), losses(dirs["straight"] / "run")[N:], f"{runs} -> one rank")


def loaded_state(folder, *flags) -> TrainState:
    """A one-rank state loaded from `folder` under the layout `flags` give."""
    cfg = config(*flags)
    program = build_rank_program(cfg, Coords.from_rank(0, {}), log=lambda _: None)
    state = TrainState.initial(program, cfg.model, cfg.train.seed, "cpu")
    checkpoint.load(folder, cfg, program, state, log=lambda _: None)
    return state


def test_reshard_between_fp32_and_bf16_main_weights(dp2):
    """Main weights go from one layout to another unrounded; a bf16 model gets their rounding."""
    for source in ("cut", "bf16 cut"):
        folder = iteration_dir(dp2[source] / "save", N)
        fp32 = loaded_state(folder)  # the model's fp32 weights are the main weights
        bf16 = loaded_state(folder, "--bf16", "--use-distributed-optimizer")  # dp1: one shard, the same order
        assert fp32.main is None and bf16.main is not None
        assert torch.equal(bf16.main, fp32.params), source
        assert torch.equal(bf16.params, fp32.params.to(torch.bfloat16)), source
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(getattr(bf16, name), getattr(fp32, name)), (source, name)


def test_export_of_a_bf16_run_holds_its_fp32_main_weights(dp2, tmp_path):
    """As export-hf: export wrote the bf16 weights, their rounding, so the two exports of one run differed."""
    assert checkpoint.main(["export", str(dp2["bf16 cut"] / "save"), "--output", str(tmp_path / "m.pt")]) == 0
    exported = torch.load(tmp_path / "m.pt", weights_only=True)["model"]
    saved = checkpoint.Checkpoint(iteration_dir(dp2["bf16 cut"] / "save", N))
    assert saved.master == "main" and saved.params
    for name in saved.params:
        assert exported[name].dtype == torch.float32 and torch.equal(exported[name], saved.full("main", name)), name


def test_fused_parts_of_unequal_sizes_cut_each_on_its_own_and_reassemble():
    """A fused q, k, v of grouped kv heads (8, 4 and 4 rows): rank r holds rows r of each part, in part order; the
    pieces put back give the full tensor, as a checkpoint reassembles it for another tp."""
    full = torch.arange(16 * 3, dtype=torch.float32).view(16, 3)
    param = Param("qkv.weight", (16, 3), shards=(Shard("tp", 0, parts=(8, 4, 4)),))
    pieces = [local_value(full, param, {"tp": r}, {"tp": 2}) for r in range(2)]
    q, k, v = full.split([8, 4, 4])
    for r, piece in enumerate(pieces):
        assert torch.equal(piece, torch.cat([q.chunk(2)[r], k.chunk(2)[r], v.chunk(2)[r]]))
    assert torch.equal(full_value(pieces, param, {"tp": 2}), full)


def test_spans_place_every_element_once():
    """Dense parameters are split over dp; expert-parallel ones (cut over ep = 2) over the edp ranks that hold
    the same experts, in buckets of their own: each element sits in exactly one rank's shard of its group."""
    sizes = [37, 5, 300, 64, 1, 48]
    params = [(Param(f"p{i}", (n,), shards=(Shard("ep", 0),) if i in (2, 3) else ()), (n,))
              for i, n in enumerate(sizes)]
    for dp in (2, 4):
        layout = flat_layout([params], sizes={"dp": dp, "ep": 2, "edp": dp // 2}, bucket_size=100)
        assert [b.replicas for b in layout.buckets] == ["dp", "edp", "dp"]  # laid out last parameter first
        flat = torch.arange(layout.numel, dtype=torch.float32)
        views = layout.views(flat)
        seen = {name: torch.zeros(view.numel()) for name, view in views.items()}
        for dp_rank in range(dp):
            positions = {"dp": dp_rank, "edp": dp_rank // 2}  # ep rank dp_rank % 2
            shard = layout.shard_of(flat, positions)
            for name, spans in layout.spans(positions).items():
                expert = name in ("p2", "p3")
                for s in spans:
                    assert torch.equal(shard[s.at:s.at + s.end - s.start], views[name][s.start:s.end])
                    if not expert or dp_rank % 2 == 0:  # one ep rank's experts: its edp group covers them once
                        seen[name][s.start:s.end] += 1
        assert all(torch.equal(count, torch.ones_like(count)) for count in seen.values()), dp


def test_killed_save_leaves_the_previous_checkpoint(dp2, tmp_path, capsys):
    save, run_dir = tmp_path / "save", tmp_path / "run"
    cut = config(*DP2_DISTOPT, "--save", save, "--save-interval", N, "--run-dir", tmp_path / "killed")
    codes = launch(tmp_path, WORKER, dict(configs=[cut], kill=(1, 2 * N)), world=2, timeout=300)
    assert codes[1] == -9 and codes[0] != 0, codes
    killed = iteration_dir(save, 2 * N) + TMP
    assert os.path.isdir(killed) and not os.path.exists(iteration_dir(save, 2 * N))
    assert (save / TRACKER).read_text().strip() == str(N)

    status = run_gpt.main(SMALL + ["--load", str(save), "--save", str(save), "--run-dir", str(run_dir)])
    assert status == 0, capsys.readouterr().err
    assert_close(losses(run_dir), losses(dp2["straight"] / "run")[N:], "resumed after a killed save")
    assert (save / TRACKER).read_text().strip() == str(2 * N)
    assert not [name for name in os.listdir(save) if name.endswith(TMP)], "the next save clears leftovers"


def test_a_second_run_saving_into_a_folder_in_use_is_refused(tmp_path, capsys):
    """Two runs saving into one new folder both found it empty, then renamed and deleted each other's iter_N.tmp:
    one committed a checkpoint of its metadata and the other's shards, and said "saved"."""
    save = tmp_path / "save"
    with checkpoint.claimed(str(save)):  # the first run, still going
        status = run_gpt.main(SMALL + ["--save", str(save), "--run-dir", str(tmp_path / "second")])
        assert status == 2 and capsys.readouterr().err == (
            f"run_gpt.py: error: --save {save} is in use: another run is saving there; wait for it to end, or save "
            f"to another folder\n")
        assert not os.path.exists(tmp_path / "second" / "metrics.jsonl"), "it trained"
    assert run_gpt.main(SMALL + ["--train-iters", "1", "--save", str(save), "--run-dir", str(tmp_path / "after")]) == 0
    assert (save / TRACKER).read_text().strip() == "1"


def test_a_second_run_logging_into_a_run_dir_in_use_is_refused(tmp_path, capsys):
    """A second run in the first's --run-dir cleared the watchdog records the first's ranks were writing, so the
    first, hundreds of iterations on, was stopped as hung; and it moved the first's live metrics.jsonl aside."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with paths.claimed(str(run_dir), RuntimeError("the test's hold")):  # the first run, still going
        status = run_gpt.main(SMALL + ["--run-dir", str(run_dir)])
        assert status == 2 and capsys.readouterr().err == (
            f"run_gpt.py: error: --run-dir {run_dir} is in use: another run logs there (its metrics, its watchdog's "
            f"records); wait for it to end, or give another --run-dir\n")
        assert os.listdir(run_dir) == [], "it trained"
        assert run_gpt.main(SMALL + ["--train-iters", "1", "--run-dir", str(run_dir), "--save", str(run_dir)]) == 2
    assert run_gpt.main(SMALL + ["--train-iters", "1", "--run-dir", str(run_dir), "--save", str(run_dir)]) == 0


@pytest.mark.parametrize("flag", ["--save", "--run-dir"])
def test_under_torchrun_a_folder_in_use_is_refused_too(flag, tmp_path):
    """Under torchrun no launcher of ours holds the folders: its first rank does, or a second job saved and
    logged over a live one's."""
    folder = tmp_path / "in_use"
    folder.mkdir()
    with paths.claimed(str(folder), RuntimeError("the test's hold")):  # the first run, still going
        result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                 "1", os.path.join(ROOT, "run_gpt.py"), *SMALL, "--run-dir", str(tmp_path / "run"),
                                 flag, str(folder)], capture_output=True, text=True, timeout=600,
                                env=dict(os.environ, PYTHONPATH=ROOT))
    assert result.returncode != 0 and f"run_gpt.py: error: {flag} {folder} is in use" in result.stderr, result.stderr
    assert os.listdir(folder) == [] and not os.path.exists(tmp_path / "run" / "metrics.jsonl"), "it trained"


@pytest.mark.parametrize("runs", ["dp2", pytest.param("model_parallel", marks=pytest.mark.slow)])
def test_export_gives_the_distributed_loss(runs, request, tmp_path):
    dirs, output = request.getfixturevalue(runs), tmp_path / "model.pt"
    assert checkpoint.main(["export", str(dirs["cut"] / "save"), "--output", str(output)]) == 0
    exported = torch.load(output, weights_only=True)
    assert sorted(exported["model_args"]) == sorted(NANOGPT_ARGS), "nanoGPT's GPTConfig(**model_args) takes these"
    cfg = config()
    model = GPT(cfg.model)
    model.load_state_dict(exported["model"])  # strict: every nanoGPT name, lm_head.weight included
    assert exported["model"]["lm_head.weight"] is exported["model"]["transformer.wte.weight"]
    train_data, _ = build_datasets(cfg.data, cfg.train.seq_length, cfg.train.seed)
    tokens = train_data.batch(N * cfg.train.global_batch_size, cfg.train.global_batch_size)  # iteration N + 1
    with torch.no_grad():
        loss = model(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()).item()
    assert_close([loss], losses(dirs["straight"] / "run")[N:N + 1], f"model exported from {runs}")


def test_generate_is_seeded_and_top_1_is_greedy(tmp_path, capsys):
    cfg = config()
    output = tmp_path / "model.pt"
    model = GPT2.build(cfg.model, seed=0)
    torch.save(dict(model=model.state_dict(), model_args=dataclasses.asdict(cfg.model)), output)
    texts = []
    for seed in (1, 1, 2):
        assert checkpoint.main(["generate", str(output), "--prompt", "def ", "--max-new-tokens", "30",
                                "--seed", str(seed)]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] != texts[2] and texts[0].startswith("def ")
    ids = torch.tensor([[100, 101, 102]])
    greedy = ids
    with torch.no_grad():
        for _ in range(5):
            greedy = torch.cat([greedy, model(greedy)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(sample(model, cfg.model.block_size, ids, 5, 1.0, 1, torch.Generator()), greedy)


def test_generate_shows_the_text_as_it_comes_and_it_is_the_text_decoded_at_once():
    """200 tokens of an 82M model took 90 s with nothing shown until the end. Pieces hold back a character cut
    between two tokens (multi-byte UTF-8 from the byte tokenizer), and join to what decoding at once gives."""
    model = GPT2.build(config().model, seed=0)
    pieces = list(generate_text(model, 32, "naïve ", 40, 1.5, None, seed=3))
    tokens = sample(model.eval(), 32, torch.tensor([list("naïve ".encode())]), 40, 1.5, None,
                    torch.Generator().manual_seed(3))
    assert "".join(pieces) == decode(tokens[0].tolist()) and pieces[0] == "naïve "
    assert len(pieces) > 10 and not any(piece.endswith("\ufffd") for piece in pieces[:-1])


def flip_tensor_bytes(folder) -> None:
    """Invert 8 bytes in the middle of the largest tensor DCP wrote: the file still parses."""
    storage = dcp.FileSystemReader(folder).read_metadata().storage_data
    info = max(storage.values(), key=lambda info: info.length)
    with open(os.path.join(folder, info.relative_path), "r+b") as f:
        f.seek(info.offset + info.length // 2)
        data = f.read(8)
        f.seek(info.offset + info.length // 2)
        f.write(bytes(b ^ 0xFF for b in data))


def truncate_shards(folder, names=None) -> None:
    for name in names if names is not None else [name for name in os.listdir(folder) if name.endswith(".distcp")]:
        os.truncate(os.path.join(folder, name), os.path.getsize(os.path.join(folder, name)) // 2)


@pytest.mark.parametrize("damage, flags, message", [
    (truncate_shards, [], "cannot read __0_0.distcp (truncated or damaged?)"),
    (flip_tensor_bytes, [], "does not match its checksum; the file is corrupted"),
    (None, ["--n-layer", "3"], "holds a different model: n_layer=2 (this run: 3)"),
    (lambda folder: os.remove(os.path.join(folder, "gcompile.json")), [], "not a gcompile checkpoint"),
    (lambda folder: open(os.path.join(os.path.dirname(folder), TRACKER), "w").write("99\n"), [],
     "does not exist; write "),  # was: no fix named
])
def test_bad_checkpoint_is_one_line(dp2, tmp_path, capsys, damage, flags, message):
    save = tmp_path / "save"
    shutil.copytree(dp2["cut"] / "save", save)
    if damage:
        damage(iteration_dir(save, N))
    status = run_gpt.main(SMALL + flags + ["--load", str(save)])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and message in err[0], err
    if damage is not None:  # the exports refuse it too, wherever the damage is (not only in what they write)
        for argv in (["export", str(save), "--output", str(tmp_path / "model.pt")],
                     ["export-hf", str(save), str(tmp_path / "hf")]):
            status = checkpoint.main(argv)
            err = capsys.readouterr().err.strip().splitlines()
            assert status == 2 and len(err) == 1, (argv[0], err)


def test_a_damaged_shard_is_named_not_the_first_file_read(dp2, tmp_path, capsys):
    """One read of a parameter's optimizer state spans both dp ranks' files: the error names the damaged one,
    wherever its keys come in the read."""
    save = tmp_path / "save"
    shutil.copytree(dp2["cut"] / "save", save)
    folder = iteration_dir(save, N)
    truncate_shards(folder, ["__1_0.distcp"])
    stored = checkpoint.Checkpoint(str(folder))
    keys = sorted(stored.meta["keys"], key=lambda key: stored._file_of(key))  # __0_0's keys first
    assert {stored._file_of(keys[0]), stored._file_of(keys[-1])} == {"__0_0.distcp", "__1_0.distcp"}
    with pytest.raises(checkpoint.CheckpointError, match=r"cannot read __1_0\.distcp \(truncated or damaged\?\)"):
        stored.read(keys)
    status = run_gpt.main(SMALL + ["--load", str(save)])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and "cannot read __1_0.distcp (truncated or damaged?)" in err[0], err


@pytest.mark.parametrize("argv, message", [
    (["export", "/nonexistent/save", "--output", "model.pt"], "/nonexistent/save: no such folder"),
    (["generate", "/nonexistent/model.pt"], "/nonexistent/model.pt: no such file"),
])
def test_bad_export_and_generate_input(argv, message, capsys):
    status = checkpoint.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and message in err[0], err


def test_unwritable_save_folder_is_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    status = run_gpt.main(SMALL + ["--save", str(tmp_path / "file" / "save")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and "file is a file, not a folder" in err[0], err


def test_command_line_error_has_no_traceback(tmp_path):
    result = subprocess.run([sys.executable, "-m", "gcompile.checkpoint", "export", str(tmp_path / "missing"),
                             "--output", str(tmp_path / "model.pt")], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().startswith("python -m gcompile.checkpoint: error:"), result.stderr


def test_load_without_a_checkpoint_starts_fresh(tmp_path, capsys):
    """--load and --save of one folder (a job that resumes itself whenever it is started): none there yet."""
    status = run_gpt.main(SMALL + ["--train-iters", "1", "--load", str(tmp_path / "none"), "--save",
                                   str(tmp_path / "none"), "--run-dir", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert status == 0
    assert [line for line in out.splitlines() if "checkpoint" in line][0] == \
        f"no checkpoint in {tmp_path / 'none'}; starting from iteration 0"


def test_commit_replaces_an_iteration_and_clears_leftovers(tmp_path):
    for name in ("iter_0000002", "iter_0000002.tmp", "iter_0000004.tmp", "iter_0000004"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "was").write_text(name)
    (tmp_path / TRACKER).write_text("4\n")
    checkpoint._commit(str(tmp_path), str(tmp_path / "iter_0000002.tmp"), str(tmp_path / "iter_0000002"), 2)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "iter_0000004", TRACKER]
    assert (tmp_path / "iter_0000002" / "was").read_text() == "iter_0000002.tmp"
    assert checkpoint.latest(str(tmp_path)) == str(tmp_path / "iter_0000002")


def test_a_save_clears_only_the_unfinished_folders_saves_leave(tmp_path):
    """A save killed mid-way leaves iter_N.tmp, which the next save removes; a user's own folder that happens to
    end in .tmp beside the checkpoints is theirs (it was removed too)."""
    for name in ("iter_0000002.tmp", "iter_0000002.old.tmp", "mydata.tmp"):
        (tmp_path / name).mkdir()
    (tmp_path / "mydata.tmp" / "notes").write_text("kept")
    (tmp_path / "iter_0000004.tmp").mkdir()
    checkpoint._commit(str(tmp_path), str(tmp_path / "iter_0000004.tmp"), str(tmp_path / "iter_0000004"), 4)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000004", checkpoint.TRACKER, "mydata.tmp"]
    assert (tmp_path / "mydata.tmp" / "notes").read_text() == "kept"
