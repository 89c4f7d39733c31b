"""Whole-world builds in one process: --dump-only, the plan checker, user passes, compile once per graph."""

import dataclasses
import filecmp
import os
import subprocess
import sys

import pytest

import run_gpt
from gcompile import harness, inspect
from gcompile.check import PlanError, check_plan, estimate_memory
from gcompile.compile import graph_key, named_graphs
from gcompile.config import build_config, parse_args
from gcompile.flops import graph_flops
from gcompile.log import rank_ranges
from gcompile.pipeline import BuildCache, build_rank_program
from gcompile.rank_program import RankProgram
from gcompile.axes import Coords
from gcompile.schedule import Kind
from gcompile.train import train
from gcompile.world import build_world, precompile, rank_graphs, representatives
from tests.reference import ADAM_EPS, random_batches, reference_run, rel_err, without_key_bias

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPLIT_PASS = "after:lower=examples.all_reduce_split:all_reduce_as_reduce_scatter_all_gather"


def config(passes=(), **parallel):
    return build_config({
        "model": dict(n_layer=4, n_head=8, n_embd=64, block_size=32),
        "parallel": dict(parallel, passes=passes),
        "train": dict(micro_batch_size=1, global_batch_size=4 * parallel.get("dp", 1), seq_length=32, lr=1e-3,
                      clip_grad=0.5, adam_eps=ADAM_EPS),
    })


def run(*args, **kwargs):
    return subprocess.run([sys.executable, "run_gpt.py", *args], capture_output=True, text=True, cwd=ROOT, **kwargs)


def test_dump_only_with_a_user_pass_says_each_rank_is_built(tmp_path, capsys):
    """It said "4 distinct programs" of tp2 dp2, whose dp pairs are alike: each rank is built, not distinct."""
    assert run_gpt.main(["--config", "configs/tiny.toml", "--tp", "2", "--dp", "2", "--micro-batch-size", "2",
                         "--passes", "after:lower=tests.careless_passes:does_nothing", "--dump-only",
                         "--dump-graphs", str(tmp_path)]) == 0
    assert "4 programs, one a rank (a user pass may read the dp position), for 4 ranks in" in capsys.readouterr().out


def test_dump_only_builds_a_large_world_in_one_process(tmp_path, capsys):
    """128 ranks, 32 distinct programs: a folder each, index.txt for the ranks of each, and inspect reads a
    rank without a folder from its program's."""
    result = run("--tp", "8", "--pp", "4", "--dp", "4", "--n-layer", "4", "--micro-batch-size", "1",
                 "--global-batch-size", "16", "--dump-only", "--dump-graphs", str(tmp_path), timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    folders = sorted(p for p in os.listdir(tmp_path) if p.startswith("rank"))
    assert len(folders) == 32
    for folder in folders:
        summary = open(tmp_path / folder / "summary.txt").read()
        assert "all_reduce               tp" in summary, folder
    index = open(tmp_path / "index.txt").read().splitlines()
    assert index[:2] == ["rank0: ranks 0,8,...,24", "rank1: ranks 1,9,...,25"] and len(index) == 32
    assert "32 distinct programs for 128 ranks agree" in open(tmp_path / "plan.txt").read()
    assert "32 distinct programs for 128 ranks in" in result.stdout
    capsys.readouterr()
    assert inspect.main([str(tmp_path), "show", "17", "schedule"]) == 0  # tp1 dp2 pp0
    out, err = capsys.readouterr()
    assert out.startswith("# rank 1 (pp0 dp0 tp1)") and f"reading {tmp_path / 'rank1'}" in err


def test_a_dump_folder_holds_one_run(tmp_path, capsys):
    """Dumping into a folder again replaces the earlier build's files, a larger world's ranks included, and
    the folders of ranks that now share another's program."""
    small = ["--n-layer", "2", "--n-head", "4", "--n-embd", "64", "--block-size", "32", "--seq-length", "32",
             "--micro-batch-size", "1", "--global-batch-size", "4", "--dump-only", "--dump-graphs"]
    reused, fresh = tmp_path / "reused", tmp_path / "fresh"
    (reused / "rank0").mkdir(parents=True)
    (reused / "rank0" / "notes.md").write_text("not ours")
    assert run_gpt.main(small + [str(reused), "--tp", "2", "--pp", "2"]) == 0
    assert run_gpt.main(small + [str(reused), "--pp", "2", "--dp", "2"]) == 0
    assert run_gpt.main(small + [str(fresh), "--pp", "2", "--dp", "2"]) == 0
    assert run_gpt.main(small + [str(tp_pp := tmp_path / "tp_pp"), "--tp", "2", "--pp", "2"]) == 0
    assert sorted(os.listdir(reused)) == sorted(os.listdir(fresh)) == ["index.txt", "plan.txt", "rank0", "rank2"]
    assert (fresh / "index.txt").read_text() == "rank0: ranks 0-1\nrank2: ranks 2-3\n"
    for rank in ("rank0", "rank2"):
        ours = sorted(set(os.listdir(reused / rank)) - {"notes.md"})
        assert ours == sorted(os.listdir(fresh / rank)), rank
    assert (reused / "rank0" / "notes.md").read_text() == "not ours"
    assert run_gpt.main(small + [str(one := tmp_path / "one")]) == 0
    capsys.readouterr()
    (tp_pp / "index.txt").unlink()  # as a training run's dump, where every rank writes its own folder
    for folder, first in ((fresh, "2 folders for 4 ranks (index.txt: "), (tp_pp, "4 folders for 4 ranks (each runs "),
                          (one, "1 folder for 1 rank (")):
        assert inspect.main([str(folder)]) == 0
        assert capsys.readouterr().out.startswith(first), folder


def test_inspect_says_what_is_no_whole_dump(tmp_path, capsys):
    """A dump cut short (a rank folder without the files its build writes last, a --dump-only without the
    index.txt it writes last) and a rank folder holding no dump are named as such, not listed as ranks."""
    assert run_gpt.main(["--n-layer", "2", "--n-head", "4", "--n-embd", "64", "--block-size", "32", "--seq-length",
                         "32", "--micro-batch-size", "1", "--global-batch-size", "4", "--pp", "2", "--dp", "2",
                         "--dump-only", "--dump-graphs", str(tmp_path)]) == 0
    (tmp_path / "rank2" / "summary.txt").unlink()
    (tmp_path / "rank1").mkdir()
    (tmp_path / "rank1" / "notes.md").write_text("mine")
    capsys.readouterr()
    assert inspect.main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "3 folders for 4 ranks (index.txt: ranks that differ only in dp run one program)"
    assert [line.rpartition("  (")[2] for line in lines if line.startswith("rank ")][1:] == [
        "holds no dump (notes.md))", "cut short: no summary.txt; write the dump again)"]
    assert inspect.main([str(tmp_path), "show", "1"]) == 2
    assert "rank1 holds no dump (notes.md): no rank of a dump" in capsys.readouterr().err
    (tmp_path / "index.txt").unlink()
    (tmp_path / "rank1" / "notes.md").unlink()
    os.rmdir(tmp_path / "rank1")
    assert inspect.main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("2 folders for unknown ranks: the rank folders are not 0, 1, 2, ...")
    assert inspect.main([str(tmp_path), "show", "3"]) == 2  # was: "no rank 3; ranks: 0..2"
    assert "no index.txt names the ranks each runs for (a --dump-only cut short?)" in capsys.readouterr().err


def program_up_to_coords(program: RankProgram) -> dict:
    """Everything a rank's program holds but its coordinates: graph keys, instructions with each peer as
    its distance from the rank, rank constants, stage and program fields."""
    instructions = [dataclasses.replace(i, peer=i.peer - program.coords.rank) if i.peer is not None else i
                    for i in program.instructions]
    stages = {s: (st.params, st.inputs, st.outputs, st.num_saved, st.rank_constants, st.last_inputs,
                  st.last_outputs, st.last_outputs_add, st.weight_inputs, st.num_stash)
              for s, st in program.stages.items()}
    fields = {f.name: getattr(program, f.name) for f in dataclasses.fields(program)
              if f.name not in ("coords", "stages", "instructions", "optimizer")}
    return dict(graphs={name: graph_key(gm) for name, gm in named_graphs(program).items()},
                instructions=instructions, stages=stages, optimizer_inputs=program.optimizer.inputs, **fields)


@pytest.mark.parametrize("layout", [
    "--tp 2 --pp 2 --dp 2 --data-parallel-sharding-strategy optim_grads",
    "--cp 2 --dp 2 --use-distributed-optimizer",
    "--config configs/moe-tiny.toml --ep 2 --dp 4 --data-parallel-sharding-strategy optim_grads_params"])
def test_ranks_that_differ_only_in_dp_run_one_program(layout):
    """What --dump-only and --check-plan build one program per class for: every rank of a whole world
    holds its representative's program up to its coordinates (ep folds into dp: experts differ by
    coordinates alone too); the checker over the representatives speaks for every rank."""
    preset = [] if "--config" in layout else ["--config", "configs/tiny.toml"]  # one preset a run
    cfg, _ = parse_args([*preset, "--micro-batch-size", "1", *layout.split()])
    programs = build_world(cfg, log=lambda _: None)
    shared_by = representatives(cfg)
    representative = {rank: rep for rep, ranks in shared_by.items() for rank in ranks}
    assert sorted(representative) == list(range(cfg.world_size)) and len(shared_by) < cfg.world_size
    for rank, program in programs.items():
        assert program_up_to_coords(program) == program_up_to_coords(programs[representative[rank]]), rank
    report = check_plan({rep: programs[rep] for rep in shared_by}, shared_by=shared_by)
    programs_for = f"{len(shared_by)} distinct program{'s' * (len(shared_by) > 1)} for {cfg.world_size} ranks"
    assert report.startswith(f"plan checked: {programs_for} agree"), report
    assert f"rank    0 {programs[0].coords} for {rank_ranges(shared_by[0])}: " in report


def test_ranks_of_a_world_share_the_whole_model_passes_as_if_built_alone(tmp_path):
    """Ranks that differ only in pp share the passes before pipeline_split (BuildCache.whole_model): their
    programs and dumps are those each builds alone."""
    cfg, _ = parse_args(["--config", "configs/tiny.toml", "--micro-batch-size", "1", "--tp", "2", "--pp", "2",
                         "--sequence-parallel"])
    world = build_world(cfg, dump_root=str(tmp_path / "world"), log=lambda _: None)
    for rank in (2, 3):  # pp 1: what ranks 0 and 1 ran before the split, reused
        alone = build_rank_program(cfg, Coords.from_rank(rank, cfg.mesh_sizes), dump_root=str(tmp_path / "alone"),
                                   log=lambda _: None)
        assert program_up_to_coords(alone) == program_up_to_coords(world[rank]), rank
        files = filecmp.dircmp(tmp_path / "world" / f"rank{rank}", tmp_path / "alone" / f"rank{rank}")
        assert files.left_list == files.right_list and not files.diff_files, rank


def test_layouts_that_differ_in_pp_dp_and_vpp_share_the_whole_model_passes_as_if_built_alone():
    """The planner's candidates of one tp and cp share the passes before pipeline_split, whatever their pp (1
    too), dp and vpp (BuildCache.whole_model): each rank's program is the one built with nothing shared. ZeRO-3's
    pass, after pipeline_split's place, reads the dp size, so it is the rank's own."""
    fsdp = ["--data-parallel-sharding-strategy", "optim_grads_params"]
    layouts = [["--pp", "2"], ["--pp", "4"], ["--pp", "2", "--dp", "2"],
               ["--pp", "2", "--virtual-pipeline-size", "2", "--pipeline-schedule", "interleaved"],
               ["--dp", "2", *fsdp], ["--dp", "4", *fsdp], ["--dp", "1", *fsdp]]
    shared, alone_ones = BuildCache(), BuildCache()
    for layout in layouts:
        cfg, _ = parse_args(["--config", "configs/tiny.toml", "--n-layer", "4", "--micro-batch-size", "1",
                             "--global-batch-size", "4", "--tp", "2", *layout])
        for rank in (0, cfg.world_size - 1):  # the first rank (tp 0, pp 0), and the last (tp 1, pp last)
            coords = Coords.from_rank(rank, cfg.mesh_sizes)
            alone = build_rank_program(cfg, coords, log=lambda _: None,  # shares captures and lowerings only
                                       cache=BuildCache(captured=alone_ones.captured, lowered=alone_ones.lowered))
            assert program_up_to_coords(build_rank_program(cfg, coords, log=lambda _: None, cache=shared)) == \
                program_up_to_coords(alone), (layout, rank)
    assert len(shared.whole_model) == 2  # one per tp rank


def test_with_a_user_pass_every_rank_stands_for_itself():
    """A user pass may read the dp position: every rank is built and checked."""
    assert representatives(config(dp=2, pp=2, passes=(SPLIT_PASS,))) == {r: (r,) for r in range(4)}


def test_flops_count_the_model():
    """A stage's forward FLOPs are the model's matmuls and attention, counted by hand; its backward
    does twice the matmul work plus flash attention's backward (torch's formula: 2.5x its forward)."""
    B, T, h, L, V = 2, 32, 64, 2, 257
    cfg = build_config({"model": dict(n_layer=L, n_head=4, n_embd=h, block_size=T, vocab_size=V),
                        "train": dict(micro_batch_size=B, global_batch_size=B, seq_length=T)})
    stage = build_world(cfg, log=lambda _: None)[0].stages[0]
    matmuls = L * 2 * B * T * 12 * h * h + 2 * B * T * h * V  # qkv 3h^2, proj h^2, mlp 8h^2; the head
    attention = L * 4 * B * T * T * h  # q k^T and p v
    assert graph_flops(stage.forward) == matmuls + attention
    assert graph_flops(stage.backward) == 2 * matmuls + 2.5 * attention


def test_compiled_dump_holds_the_generated_code_and_flops(tmp_path):
    run_dir, dump = tmp_path / "run", tmp_path / "dump"
    config, _ = parse_args(["--config", os.path.join(ROOT, "configs", "tiny.toml"), "--compile", "--train-iters", "1", "--eval-interval", "0",
                            "--run-dir", str(run_dir), "--dump-graphs", str(dump)])
    train(config, Coords.from_rank(0, {}), log=lambda _: None)
    for graph in ("stage0.forward", "stage0.backward", "optimizer"):
        assert "def call(" in (dump / "rank0" / f"inductor_{graph}.py").read_text(), graph
    summary = (dump / "rank0" / "summary.txt").read_text()
    assert "# FLOPs per training iteration" in summary and "stage0.backward" in summary


def test_checker_refuses_a_rank_that_drops_a_collective():
    cfg = config(tp=2, pp=2, passes=("after:lower=tests.faulty_passes:drop_one_all_reduce_on_tp_rank_1",))
    with pytest.raises(PlanError, match=r"group 'tp' \[0, 1\]: rank 0 and rank 1 disagree at collective #\d+ on it "
                                        r"\(36 against 32 per iteration\)"):
        check_plan(build_world(cfg, log=lambda _: None))
    result = run("--tp", "2", "--pp", "2", "--n-layer", "4", "--n-head", "8", "--check-plan",
                 "--passes", "after:lower=tests.faulty_passes:drop_one_all_reduce_on_tp_rank_1", timeout=300)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "rank 0 and rank 1 disagree" in result.stderr, result.stderr


def test_checker_refuses_a_missing_receive():
    programs = build_world(config(pp=2), log=lambda _: None)
    rank1 = programs[1]
    dropped = next(i for i in rank1.instructions if i.op == Kind.RECV_F)
    programs[1] = dataclasses.replace(rank1, instructions=tuple(i for i in rank1.instructions if i != dropped))
    with pytest.raises(PlanError, match=r"rank 0 sends act\[s0,mb0\] to rank 1 .* but rank 1 has no matching receive"):
        check_plan(programs)


def test_memory_budget():
    programs = build_world(config(dp=2, use_distributed_optimizer=True), log=lambda _: None)
    need = estimate_memory(programs[0]).total / 2 ** 30
    check_plan(programs, memory_budget_gb=need * 1.01)
    with pytest.raises(PlanError, match=r"rank 0 .* needs about .* GiB \(> --memory-budget-gb .*; save memory "
                                        r"\(python -m gcompile.plan --world-size 2 --memory-budget-gb .* and this run's --config and "
                                        r"model flags finds the layouts that fit"):
        check_plan(programs, memory_budget_gb=need * 0.9)
    sharded = estimate_memory(programs[0]).optimizer
    unsharded = estimate_memory(build_world(config(dp=2), log=lambda _: None)[0]).optimizer
    assert sharded < unsharded  # 3 fp32 buffers of half the size against 2 of the whole


def test_user_pass_changes_the_dump_and_keeps_the_numerics(tmp_path, capsys):
    """The dump through run_gpt.py's --dump-only, the numerics on every rank in this process (gcompile.harness)."""
    split = config(tp=2, passes=(SPLIT_PASS,))
    for name, passes in (("plain", ()), ("split", ("--passes", SPLIT_PASS))):
        assert run_gpt.main(["--tp", "2", "--n-layer", "4", "--n-head", "8", "--micro-batch-size", "1",
                             "--global-batch-size", "4", "--seq-length", "32", "--block-size", "32", "--dump-only",
                             "--dump-graphs", str(tmp_path / name), *passes]) == 0
    before = open(tmp_path / "plain" / "rank0" / "summary.txt").read()
    after = open(tmp_path / "split" / "rank0" / "summary.txt").read()
    assert "reduce_scatter_tensor" not in before and "reduce_scatter_tensor    tp" in after
    assert "all_gather_into_tensor   tp" in after
    assert os.path.exists(tmp_path / "split" / "rank0" / "03_all_reduce_as_reduce_scatter_all_gather.txt")

    batches = random_batches(split, 3)
    lrs = [1e-3, 6e-4, 3e-4]
    expected = reference_run(split, batches, lrs)
    (result,) = harness.run_layouts([split], batches, lrs)
    for step, ref in enumerate(expected):
        assert abs(result.losses[step] - ref.loss) / ref.loss < 1e-5
    for name, value in expected[-1].params.items():
        assert rel_err(without_key_bias(name, result.params[name], 64), without_key_bias(name, value, 64)) < 1e-5


@pytest.mark.slow
def test_tp2_pp2_compiles_each_distinct_graph_once():
    programs = build_world(dataclasses.replace(config(tp=2, pp=2)), log=lambda _: None)
    graphs = [gm for p in programs.values() for gm in rank_graphs(p)]
    distinct = {graph_key(gm) for gm in graphs}
    assert len(distinct) < len(graphs)  # tp ranks of a stage share their graphs
    stats = precompile(programs, threads=1)
    assert stats.distinct == len(distinct) == stats.cache_hits + stats.cache_misses
