"""The pass driver stops a careless user pass before any rank trains, naming the pass (issue 12, 6 a-e).

Each case builds every rank's program in this process (as the launcher does before it
starts ranks) and must fail there, or, where the mistake is made impossible, build a
program the plan checker accepts.
"""

import dataclasses
import os
import subprocess
import sys

import pytest

from gcompile.check import PlanError, check_plan
from gcompile.collectives import collective_nodes
from gcompile.config import build_config, parse_args
from gcompile import checked_plan, user_code
from gcompile.pass_manager import PassError
from gcompile.world import build_world

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CARELESS = "tests.careless_passes"


def config(passes, **parallel):
    return build_config({
        "model": dict(n_layer=2, n_head=4, n_embd=32, block_size=16),
        "parallel": dict(parallel, passes=passes),
        "train": dict(micro_batch_size=1, global_batch_size=4, seq_length=16),
    })


def build(passes, **parallel):
    return build_world(config(passes, **parallel), log=lambda _: None)


def test_in_place_edit_of_a_shared_graph_is_refused():
    with pytest.raises(PassError, match=r"rank pass \d+ 'edits_in_place' edited a graph of the program it was given "
                                        r"in place .*copy.deepcopy"):
        build((f"after:lower={CARELESS}:edits_in_place",), dp=2)


def test_a_point_that_does_not_run_is_refused_and_grad_sync_follows_either_strategy():
    with pytest.raises(PassError, match=r"after:data_parallel=.*data_parallel does not run in this layout \(its built-in passes are sharded_optimizer\).*grad_sync"):
        build((f"after:data_parallel={CARELESS}:does_nothing",), dp=2, use_distributed_optimizer=True)
    for sharded, op in ((False, "all_reduce"), (True, "reduce_scatter_tensor")):
        history = build((f"after:grad_sync={CARELESS}:does_nothing",), dp=2,
                        use_distributed_optimizer=sharded)[0].history
        assert history[-2:] == ("sharded_optimizer" if sharded else "data_parallel", "does_nothing")


def test_a_pass_that_forgets_shapes_gets_them_and_one_that_returns_a_graph_is_named():
    programs = build((f"after:lower={CARELESS}:copies_but_forgets_shapes",), dp=2)
    check_plan(programs)  # reads meta["val"] of every collective input: the driver re-derived them
    assert all("val" in n.meta for n in programs[0].stages[0].backward.graph.nodes if n.op == "call_function")
    with pytest.raises(PassError, match=r"pass 'returns_the_graph' returned a GraphModule, not the RankProgram"):
        build((f"after:lower={CARELESS}:returns_the_graph",))


def test_a_rank_pass_placed_before_lowering_is_named():
    with pytest.raises(PassError, match=r"pass 'expects_the_rank_program' takes a RankProgram but is placed before "
                                        r"lowering.*after:lower="):
        build((f"{CARELESS}:expects_the_rank_program",))


def test_a_pass_given_as_a_file(tmp_path):
    path = os.path.join(ROOT, "tests", "careless_passes.py")
    assert build((f"after:lower={path}:does_nothing",))[0].history[-1] == "does_nothing"
    with pytest.raises(PassError, match=r"no_such_module.*PYTHONPATH, or give the file: path/to/file.py:fn"):
        build(("after:lower=no_such_module:fn",))


def test_the_command_line_says_it_in_one_line_before_any_rank_starts():
    result = subprocess.run([sys.executable, "run_gpt.py", "--dp", "2", "--use-distributed-optimizer",
                             "--n-layer", "2", "--n-embd", "32", "--n-head", "4", "--check-plan",
                             "--passes", f"after:data_parallel={CARELESS}:does_nothing"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "does_nothing" in result.stderr, result.stderr


def test_dp_reductions_are_graph_nodes():
    for sharded, ops in ((False, {"all_reduce"}), (True, {"reduce_scatter_tensor", "all_gather_into_tensor"})):
        optimizer = build((), dp=2, use_distributed_optimizer=sharded)[0].optimizer.graph
        assert ops <= {op for _, op, _ in collective_nodes(optimizer)}


@pytest.mark.parametrize("sharded, pass_name, op", [(False, "data_parallel", "all_reduce"),
                                                     (True, "sharded_optimizer", "reduce_scatter_tensor")])
def test_dp_rewrites_show_in_the_numbered_dump_the_log_and_the_schedule(tmp_path, sharded, pass_name, op):
    lines = []
    build_world(config((), dp=2, use_distributed_optimizer=sharded), dump_root=str(tmp_path), log=lines.append)
    logged = next(line for line in lines if line.startswith("rank pass ") and f" {pass_name} " in line)
    assert f"_c10d_functional.{op}: " in logged, logged
    (dump,) = [name for name in os.listdir(tmp_path / "rank1") if name.endswith(f"_{pass_name}.txt")]
    assert f"_c10d_functional.{op}.default" in open(tmp_path / "rank1" / dump).read()
    schedule = open(tmp_path / "rank1" / "schedule.txt").read().splitlines()
    assert schedule[-1].split()[1:3] == ["OPT_STEP", "optimizer"], schedule[-1]


@pytest.mark.parametrize("name, message", [
    ("drops_a_gradient", r"'drops_a_gradient' \(after .*\) broke the program: stage 0's backward graph takes "
                         r"\d+ inputs and returns (\d+); the runtime passes it \d+ and reads (?!\1)\d+"),
    ("drops_the_optimizer_step", r"'drops_the_optimizer_step' .* broke the program: the optimizer step is at no place"),
    ("assigns_into_a_stage", r"'assigns_into_a_stage' assigned into the program it was given .*dataclasses.replace"),
])
def test_a_rank_pass_that_breaks_the_program_is_named(name, message):
    """Each of these trained (a gradient one place off, no step) or crashed mid-run with a KeyError before."""
    with pytest.raises(PassError, match=message):
        build((f"after:lower={CARELESS}:{name}",), dp=2)


def test_a_forward_pass_that_breaks_the_loss_or_exits_is_named():
    with pytest.raises(PassError, match=r"'makes_the_loss_a_vector' \(after capture\) broke the program: stage 0's "
                                        r"loss is a torch.float32 tensor of shape \[3\], not a floating-point scalar"):
        build((f"after:capture={CARELESS}:makes_the_loss_a_vector",))
    with pytest.raises(PassError, match=r"'exits' failed on rank 0 .* it called sys.exit\(0\)"):
        build((f"after:capture={CARELESS}:exits",))


def test_a_failing_user_pass_is_named_with_its_rank_and_line():
    line = next(i for i, text in enumerate(open(os.path.join(ROOT, "tests", "careless_passes.py")), 1)
                if 'return {}["missing"]' in text)
    with pytest.raises(PassError, match=rf"pass 2 'fails_on_rank_1' failed for rank 1 \(pp0 dp0 tp1\) in the launcher \(after "
                                        rf"capture -> tensor_parallel\): KeyError at .*tests/careless_passes.py:"
                                        rf"{line}: 'missing'"):
        build((f"{CARELESS}:fails_on_rank_1",), tp=2)


def test_a_pass_reading_the_rank_environment_in_the_launcher_is_told_where_the_rank_is(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(PassError, match=r"'reads_the_rank_environment' failed for rank 0 \(pp0 dp0 tp0\) in the "
                                        r"launcher .*: KeyError at .*careless_passes.py:\d+: 'RANK' \(the launcher "
                                        r"runs every pass .* read the rank from ctx.coords"):
        build((f"{CARELESS}:reads_the_rank_environment",), tp=2)


def test_a_failing_pass_from_an_installed_package_is_named_at_its_line(tmp_path, monkeypatch):
    """A team's passes installed with pip sit among the installed packages: their frames are still the user's."""
    site = tmp_path / "site-packages"
    (site / "teampasses").mkdir(parents=True)
    (site / "teampasses" / "__init__.py").write_text("")
    (site / "teampasses" / "rules.py").write_text("def fails(program, ctx):\n    return _lookup()\n\n\n"
                                                   "def _lookup():\n    return {}['missing']\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(user_code, "LIBRARIES", user_code.LIBRARIES + (os.path.join(str(site), ""),))
    monkeypatch.setattr(user_code, "CLAIMED", set())
    with pytest.raises(PassError, match=r"'fails' failed on rank 0 .*: KeyError at .*teampasses/rules.py:6: "
                                        r"'missing'"):
        build(("teampasses.rules:fails",))


def test_a_checked_plan_binds_only_the_ranks_of_the_launcher_that_wrote_it(tmp_path, monkeypatch):
    """torchrun's ranks met an earlier launch's file in the run folder and refused a correct run."""
    checked = dataclasses.replace(config(()), log=dataclasses.replace(config(()).log, run_dir=str(tmp_path)))
    (program,) = build_world(checked, log=lambda _: None).values()
    fewer_layers = dataclasses.replace(checked, model=dataclasses.replace(checked.model, n_layer=1))
    (other,) = build_world(fewer_layers, log=lambda _: None).values()
    checked_plan.write(checked, {0: other}, {0: (0,)})
    monkeypatch.delenv(checked_plan.LAUNCHED_BY, raising=False)
    checked_plan.check_built(checked, program)  # torchrun: no launcher, nothing to compare
    monkeypatch.setenv(checked_plan.LAUNCHED_BY, str(os.getpid() + 1))
    checked_plan.check_built(checked, program)  # another launcher's file
    monkeypatch.setenv(checked_plan.LAUNCHED_BY, str(os.getpid()))
    with pytest.raises(PlanError, match="rank 0 .* built another program than the launcher checked for it"):
        checked_plan.check_built(checked, program)


def run(*flags, timeout=300):
    """run_gpt.py on two tp ranks of a small model, as a user runs it."""
    return subprocess.run([sys.executable, "run_gpt.py", "--n-layer", "2", "--n-embd", "32", "--n-head", "4",
                           "--block-size", "16", "--seq-length", "16", "--micro-batch-size", "1",
                           "--global-batch-size", "2", "--train-iters", "2", "--eval-interval", "0", "--tp", "2",
                           *flags], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_a_rank_that_ends_early_or_builds_another_program_stops_the_run():
    """A rank that ended with status 0 mid-build was not noticed (the others waited for the hang watchdog), and
    one that built another program than the launcher checked hung in the collective it dropped."""
    ended = run("--run-dir", "runs/test-ends-early", "--hang-timeout-s", "60",
                "--passes", f"after:lower={CARELESS}:ends_rank_1")
    assert ended.returncode == 1
    assert "run_gpt.py: rank 1 ended with status 0 while building the rank program, before its training did" \
        in ended.stderr, ended.stderr
    other = run("--run-dir", "runs/test-other-program", "--hang-timeout-s", "60",
                "--passes", f"after:lower={CARELESS}:drops_a_collective_in_the_ranks")
    assert other.returncode == 2
    assert "run_gpt.py: error: rank 1 (pp0 dp0 tp1) built another program than the launcher checked for it" \
        in other.stderr, other.stderr


@pytest.mark.slow
def test_a_user_pass_that_never_returns_stops_at_the_hang_timeout_with_its_line():
    line = next(i for i, text in enumerate(open(os.path.join(ROOT, "tests", "careless_passes.py")), 1)
                if text.strip() == "while True:")
    hung = run("--hang-timeout-s", "3", "--passes", f"{CARELESS}:loops_forever", timeout=120)
    assert hung.returncode == 1
    assert hung.stderr.splitlines() == [(f"run_gpt.py: error: pass 2 'loops_forever' for rank 0 (pp0 dp0 tp0) in the "
                                            f"launcher has run for 3 s (--hang-timeout-s), at {ROOT}/tests/careless_passes.py:"
                                            f"{line} in loops_forever; stopped")], hung.stderr


def test_passes_given_twice_or_after_a_comma_and_a_space_are_all_read():
    """The second --passes replaced the first, and ' tests.x:y' after a comma named no file."""
    config, _ = parse_args(["--passes", f"{CARELESS}:does_nothing, {CARELESS}:exits",
                            "--passes", f"after:lower={CARELESS}:does_nothing"])
    assert config.parallel.passes == (f"{CARELESS}:does_nothing", f"{CARELESS}:exits",
                                      f"after:lower={CARELESS}:does_nothing")
