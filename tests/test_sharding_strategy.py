"""--data-parallel-sharding-strategy: optim_grads (ZeRO-2; ZeRO-3 in tests/test_fully_sharded.py) against single-device eager, its reduce-scatters
in the dumps, the memory its ranks hold, checkpoints across strategies, and the flag's bad input.

Numerics as in tests/test_data_parallel.py (1e-5 relative in fp32, the bf16 tolerances there).
"""

import pytest
import torch

import run_gpt
from gcompile.check import MeasuredMemory, check_plan
from gcompile.config import ConfigError, build_config
from gcompile.pipeline import builtin_passes
from gcompile.state import TrainState
from gcompile.world import build_world
from tests.multirank import assert_succeeded, launch, run_layouts
from tests.test_checkpoint import N, SMALL, WORKER, assert_close, config, losses
from tests.reference import ADAM_EPS, random_batches, reference_run
from tests.test_data_parallel import LRS, assert_matches, check_dp_cases, in_one_process, small_config

ZERO2 = dict(data_parallel_sharding_strategy="optim_grads")


def test_optim_grads_matches_eager():
    check_dp_cases({
        "dp2 optim_grads, buckets": small_config(dp=2, ddp_bucket_size=8000, **ZERO2),
        "dp4 optim_grads, buckets": small_config(dp=4, micro_batch_size=1, ddp_bucket_size=5000, **ZERO2),
        "dp2 bf16 optim_grads": small_config(dp=2, bf16=True, **ZERO2),
    }, in_one_process)


def test_optim_grads_is_the_distributed_optimizer_summed_per_microbatch():
    """The distributed optimizer's update, up to float rounding: each microbatch's gradients are reduced on
    their own and the shards added, where optim reduces their sum. fp16 too: the reduced shard goes
    through the loss-scale check (the scale overflows and backs off, skipping the same steps)."""
    for dtype in ({}, dict(fp16=True, initial_loss_scale=2.0 ** 20, loss_scale_window=2)):
        zero2 = small_config(dp=2, ddp_bucket_size=8000, **ZERO2, **dtype)
        batches = random_batches(zero2, 3)
        got, want = in_one_process([zero2, small_config(dp=2, ddp_bucket_size=8000, use_distributed_optimizer=True,
                                                        **dtype)], batches)
        for a, b in zip(got.losses + got.grad_norms, want.losses + want.grad_norms):
            assert abs(a - b) <= 1e-6 * abs(b), dtype
        assert all(torch.allclose(got.params[name], want.params[name], rtol=1e-5, atol=1e-7)
                   for name in want.params), dtype


def test_plan_checker_accepts_optim_grads():
    for layout in (dict(dp=4), dict(tp=2, pp=2, dp=2)):
        assert check_plan(build_world(small_config(**layout, **ZERO2), log=lambda _: None)).startswith("plan checked")


@pytest.mark.slow
def test_optim_grads_with_model_parallel_matches_eager():
    check_dp_cases({
        "tp2 dp2 optim_grads": small_config(tp=2, dp=2, ddp_bucket_size=4000, **ZERO2),
        "pp2 dp2 optim_grads": small_config(pp=2, dp=2, ddp_bucket_size=4000, **ZERO2),
    }, in_one_process)


def test_optim_grads_with_interleaved_pipeline_matches_eager():
    """Virtual stages: two chunks per pipeline rank, each with buckets reduce-scattered in its last backward."""
    def config(**parallel):
        return build_config({"model": dict(n_layer=4, n_head=4, n_embd=64, block_size=32),
                             "parallel": dict(parallel, ddp_bucket_size=6000),
                             "train": dict(micro_batch_size=2, global_batch_size=8, seq_length=32, lr=1e-3,
                                           clip_grad=0.5, adam_eps=ADAM_EPS)})
    batches = random_batches(config(), 3)
    (result,) = in_one_process([config(pp=2, virtual_pipeline_size=2, dp=2, **ZERO2)], batches)
    assert_matches(result, reference_run(config(), batches, LRS), 64, "pp2 vpp2 dp2 optim_grads")


@pytest.mark.slow
def test_optim_grads_compiled_on_ranks(tmp_path):
    cases = {"dp2 optim_grads, buckets, compiled": small_config(dp=2, ddp_bucket_size=8000, compile=True, **ZERO2)}
    check_dp_cases(cases, lambda configs, batches: run_layouts(tmp_path, configs, batches, LRS))


def test_reduce_scatter_runs_in_backward_and_the_step_copies_no_full_gradient(tmp_path):
    lines = []
    program = build_world(small_config(dp=2, ddp_bucket_size=8000, **ZERO2), dump_root=str(tmp_path),
                          log=lines.append)[0]
    assert not program.grads_between_steps and program.optimizer_shard == "dp"
    buckets = len(program.layout.buckets)
    assert buckets >= 3
    backward = (tmp_path / "rank0" / "02_sharded_optimizer.txt").read_text()
    assert backward.count("reduce_scatter_tensor.default(") == buckets, "every bucket reduce-scattered in backward_last"
    diff = next(line for line in lines if line.startswith("rank pass 02 sharded_optimizer"))
    assert f"_c10d_functional.reduce_scatter_tensor: 0 -> {buckets} (+{buckets})" in diff
    assert "aten.clone" in diff and "aten.alias: 1 -> 0 (-1)" in diff, diff
    step = (tmp_path / "rank0" / "03_optimizer.txt").read_text()
    assert "reduce_scatter" not in step and "clone" not in step


def test_optim_grads_holds_half_the_gradient_and_optimizer_bytes_of_no_shard():
    """dp 2: the gradient (the reduced shard) and the AdamW states and flags are half of no_shard's exactly;
    optim and optim_grads add fp32 main weights, half a model copy; no full gradient is ever allocated (each
    microbatch's backward reduce-scatters its own)."""
    held = {}
    for strategy in ("no_shard", "optim", "optim_grads"):
        program = build_world(small_config(dp=2, data_parallel_sharding_strategy=strategy), log=lambda _: None)[0]
        held[strategy] = TrainState.allocate(program, "meta").buffer_bytes(), MeasuredMemory.of(
            TrainState.allocate(program, "meta"))
    (full, full_m), (zero1, zero1_m), (zero2, zero2_m) = held["no_shard"], held["optim"], held["optim_grads"]
    assert zero2["reduced_grads"] * 2 == full["grads"] and zero2["grads"] == 0
    assert zero2_m.during_step == 0 and full_m.during_step == 0
    for name in ("exp_avg", "exp_avg_sq", "flags"):
        assert zero2[name] * 2 == full[name] == zero1[name] * 2, name
    assert zero2["main"] * 4 == full["params"] * 2 == zero2["params"] * 2  # fp32 main shard: half the weights
    assert zero2_m.grads * 2 == full_m.grads == zero1_m.grads
    assert zero2_m.optimizer == zero1_m.optimizer == full_m.optimizer // 2 + zero2["main"] + 4  # + the 0-d scalars


def test_strategy_spelling():
    assert builtin_passes(small_config(dp=2, use_distributed_optimizer=True)) == \
        builtin_passes(small_config(dp=2, data_parallel_sharding_strategy="optim")) == ["sharded_optimizer"]
    assert builtin_passes(small_config(dp=2, data_parallel_sharding_strategy="no_shard")) == ["data_parallel"]
    for bad, message in ((dict(data_parallel_sharding_strategy="full"),
                          "must be no_shard, optim, optim_grads or optim_grads_params"),
                         (dict(data_parallel_sharding_strategy="no_shard", use_distributed_optimizer=True),
                          "disagrees with data_parallel_sharding_strategy=no_shard"),
                         (dict(pp=2, pipeline_schedule="zb1f1b", **ZERO2), "do not combine yet")):
        with pytest.raises(ConfigError, match=message):
            small_config(dp=2, **bad)


def test_bad_strategy_is_one_line(capsys):
    assert run_gpt.main(SMALL + ["--dp", "2", "--data-parallel-sharding-strategy", "full_shard"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run_gpt.py: error:" in err and "optim_grads_params" in err, err


@pytest.mark.slow
def test_checkpoints_cross_strategies(tmp_path):
    """dp 2: a save under optim_grads continues under no_shard, and one under no_shard under optim_grads,
    each within 1e-5 of a run never cut."""
    zero2, plain = ["--dp", 2, "--data-parallel-sharding-strategy", "optim_grads"], ["--dp", 2]
    runs = {name: tmp_path / name for name in ("zero2_cut", "to_plain", "plain_cut", "to_zero2", "straight")}
    configs = [config(*zero2, "--save", runs["zero2_cut"] / "save", "--exit-interval", N,
                      "--run-dir", runs["zero2_cut"] / "run"),
               config(*plain, "--load", runs["zero2_cut"] / "save", "--run-dir", runs["to_plain"] / "run"),
               config(*plain, "--save", runs["plain_cut"] / "save", "--exit-interval", N,
                      "--run-dir", runs["plain_cut"] / "run"),
               config(*zero2, "--load", runs["plain_cut"] / "save", "--run-dir", runs["to_zero2"] / "run"),
               config(*plain, "--run-dir", runs["straight"] / "run")]
    assert_succeeded(tmp_path, launch(tmp_path, WORKER, dict(configs=configs), world=2))
    straight = losses(runs["straight"] / "run")
    assert_close(losses(runs["zero2_cut"] / "run"), straight[:N], "optim_grads before the cut")
    assert_close(losses(runs["to_plain"] / "run"), straight[N:], "optim_grads save continued as no_shard")
    assert_close(losses(runs["to_zero2"] / "run"), straight[N:], "no_shard save continued as optim_grads")
