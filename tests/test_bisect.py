"""Numerics bisection (`python -m gcompile.inspect bisect`): every pass of a correct layout is within
tolerance of single-device eager, and a pass that breaks one rank's gradient is named with the rank
and the parameter."""

import re

import pytest

from gcompile import inspect
from tests.faulty_passes import SCALED

TINY = ["--config", "configs/tiny.toml"]


@pytest.mark.parametrize("layout, passes", [
    (["--tp", "2"], ["capture", "tensor_parallel", "tp_comm_overlap"]),
    (["--tp", "2", "--pp", "2"], ["capture", "tensor_parallel", "pipeline_split", "tp_comm_overlap"]),
    (["--n-layer", "4", "--pp", "4", "--micro-batch-size", "1", "--global-batch-size", "1"],
     ["capture", "pipeline_split"]),  # one microbatch: a middle stage receives its activation and gradient at once
    (["--n-layer", "3", "--pp", "3", "--pipeline-schedule", "zb1f1b", "--micro-batch-size", "1",
      "--global-batch-size", "1"], ["capture", "pipeline_split"]),
    (["--dp", "2", "--data-parallel-sharding-strategy", "optim_grads"], ["capture", "sharded_optimizer"]),
    (["--n-layer", "4", "--pp", "2", "--pipeline-schedule", "zb1f1b", "--data-parallel-sharding-strategy",
      "optim_grads", "--micro-batch-size", "1", "--global-batch-size", "4"],
     ["capture", "pipeline_split", "sharded_optimizer"]),  # ZeRO-2 over one dp rank: no reduce-scatter for W to split
    (["--dp", "2", "--data-parallel-sharding-strategy", "optim_grads_params"], ["capture", "fully_sharded"]),
    (["--tp", "2", "--dp", "2", "--micro-batch-size", "2"], ["capture", "tensor_parallel", "tp_comm_overlap",
                                                             "data_parallel"]),  # no weights before dp sync
    (["--num-experts", "4", "--moe-aux-loss-coeff", "0.01", "--dp", "4", "--ep", "2", "--micro-batch-size", "1",
      "--use-distributed-optimizer"], ["capture", "expert_parallel", "sharded_optimizer"]),
])
def test_a_correct_layout_stays_within_tolerance(layout, passes, capsys):
    assert inspect.main(["bisect", *TINY, *layout]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [re.match(r"pass (\d\d) (\S+): loss rel \S+, (worst grad \S+ \S+|gradients kept only as shards)(, worst weight \S+ \S+)? ok$", line)[2]
            for line in lines[:-1]] == passes, lines
    if passes[-1] not in ("fully_sharded", "pipeline_split"):  # forward passes: no rank pass, no step to compare
        assert "worst weight" in lines[-2], "a rank pass runs the optimizer step too"
    assert lines[-1] == "all passes within 1e-05 of single-device eager"


def test_the_pass_that_scales_one_gradient_on_one_rank_is_named(capsys):
    fault = "tests.faulty_passes:scale_one_gradient_on_rank_1"
    assert inspect.main(["bisect", *TINY, "--tp", "2", "--passes", f"after:lower={fault}"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines[:2]] == ["pass 00 capture", "pass 01 tensor_parallel"]
    assert lines[2].startswith(f"pass 02 {fault}") and lines[2].endswith("DIVERGES")
    assert re.fullmatch(rf"first divergent pass: {fault} \(rank 1, parameter {re.escape(SCALED)}, "
                        rf"rel err 1\.0e-02 > tol 1e-05\)", lines[3]), lines[3]
    assert len(lines) == 4, "the bisection stops at the first divergent pass"


def test_help_lists_the_tolerance(capsys):
    assert inspect.main(["bisect", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--tol TOL" in out and "run_gpt.py --help" in out, out


def test_a_model_that_draws_dropout_is_refused_naming_where(capsys):
    assert inspect.main(["bisect", *TINY, "--dropout", "0.1"]) == 2
    err = capsys.readouterr().err
    assert "draws random numbers at " in err and "gpt2.py" in err and "--dropout 0" in err and err.count("\n") == 1, err


def test_an_own_model_in_training_mode_without_dropout_is_bisected(tmp_path, capsys):
    """nn.Module's default mode: it was refused, told to drop a --dropout never given."""
    (tmp_path / "training_mode.py").write_text(open("examples/parallel_block.py").read()
                                               .replace('"parallel_block"', '"training_mode"')
                                               .replace("ParallelBlockModel(config).eval()", "ParallelBlockModel(config)"))
    assert inspect.main(["bisect", "--arch", f"{tmp_path}/training_mode.py:SPEC", "--n-layer", "2", "--tp", "2"]) == 0, \
        capsys.readouterr().err


def test_a_pass_that_cannot_be_loaded_is_refused_before_the_first_pass_is_checked(capsys):
    assert inspect.main(["bisect", *TINY, "--passes", "no_such_folder/no_such_pass.py:p"]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # was: "pass 00 capture: ... ok", the capture built and compared first
    assert err.strip().splitlines() == ["python -m gcompile.inspect bisect: error: pass "
                                        "'no_such_folder/no_such_pass.py:p' cannot be loaded: no file "
                                        "no_such_folder/no_such_pass.py"]
