"""The pass driver stops a careless user pass before any rank trains, naming the pass (issue 12, 6 a-e).

Each case builds every rank's program in this process (as the launcher does before it
starts ranks) and must fail there, or, where the mistake is made impossible, build a
program the plan checker accepts.
"""

import os
import subprocess
import sys

import pytest

from gcompile.check import check_plan
from gcompile.collectives import collective_nodes
from gcompile.config import build_config
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
