"""Data parallelism, the distributed optimizer and mixed precision, against one device.

fp32: losses, grad norms and final parameters within 1e-5 relative of eager
single-device training (tests/reference.py), as everywhere. Mixed precision:
see BF16_* below for the tolerances and why. Every rank runs in this process
(gcompile.harness), except dp2 and a compiled case on real gloo ranks.
"""

import pytest
import torch

from gcompile import harness
from gcompile.collectives import collective_nodes
from gcompile.compile import named_graphs
from gcompile.config import build_config
from gcompile.axes import Coords
from gcompile.optimizer import GRAD, build_optimizer_graph, marked
from gcompile.pipeline import BuildCache, build_rank_program
from gcompile.program import diff_counts, op_counts
from gcompile.state import TrainState
from gcompile.world import build_world
from tests.multirank import run_layouts
from tests.reference import ADAM_EPS, random_batches, reference_run, rel_err, without_key_bias

TOL = 1e-5
COMPILED_PARAM_TOL = 2e-5
"""Final parameters of an Inductor-compiled case. Why: Inductor reorders the LayerNorm-backward
reductions, differently per CPU (this 2-core AMD EPYC without AVX-512 gives 1.14e-5 on
transformer.h.0.ln_2.bias; an AVX-512 machine gave under 1e-5). LayerNorm biases start at zero,
so after 3 steps of lr 1e-3 their norm is a few lr and a rounding-sized change to one update is
a large relative error. Losses and grad norms keep 1e-5; 2e-5 is still 500x below the 1e-2
that one gradient 1% off gives (tests/test_bisect.py)."""
STEPS = 3
LRS = [1e-3, 6e-4, 3e-4]

BUILD = BuildCache()
"""The in-process cases share captures and identical lowerings."""

BF16_LOSS_TOL = 1e-3
"""bf16 against single-device bf16 eager: the loss is an fp32 mean over 256 tokens of logits from
bf16 matmuls that accumulate in fp32; two correct reduction orders differ by ~1e-5 (measured). 1e-3
is 4x below bf16's unit roundoff (2^-8), so a wrong cast or a missing reduction fails it."""
BF16_NORM_TOL = 1e-2
"""The grad norm sums bf16 gradients whose elements carry ~2^-8 relative rounding (measured: 3e-4)."""
BF16_WEIGHT_TOL = 1e-2
"""Final bf16 matmul weights and embeddings (measured: 2e-3 to 3e-3). Biases and LayerNorm are left out:
their gradients are near bf16 noise, which AdamW turns into lr-sized steps (tests/reference.py, ADAM_EPS);
fp32 and bf16 eager themselves differ by up to 6% there."""


def small_config(**parallel_and_train):
    parallel_keys = {"dp", "tp", "pp", "cp", "cp_comm_type", "use_distributed_optimizer", "data_parallel_sharding_strategy", "ddp_bucket_size",
                     "overlap_grad_reduce", "pipeline_schedule", "fsdp_reshard_after_forward", "sequence_parallel",
                     "data_parallel_shard_size"}
    parallel = {k: v for k, v in parallel_and_train.items() if k in parallel_keys}
    train = {k: v for k, v in parallel_and_train.items() if k not in parallel_keys}
    return build_config({
        "model": dict(n_layer=2, n_head=4, n_embd=64, block_size=32),
        "parallel": parallel,
        "train": dict(dict(micro_batch_size=2, global_batch_size=8, seq_length=32, lr=1e-3, clip_grad=0.5,
                           adam_eps=ADAM_EPS), **train),
    })


def assert_matches(result, expected, n_embd, label, param_tol=TOL):
    for step, ref in enumerate(expected):
        assert abs(result.losses[step] - ref.loss) / ref.loss < TOL, f"{label} step {step} loss"
        assert abs(result.grad_norms[step] - ref.grad_norm) / ref.grad_norm < TOL, f"{label} step {step} norm"
    for name, value in expected[-1].params.items():
        err = rel_err(without_key_bias(name, result.params[name], n_embd), without_key_bias(name, value, n_embd))
        assert err < param_tol, f"{label}: {name} off by {err:.2e}"


def assert_bf16_matches(result, expected, label):
    for step, ref in enumerate(expected):
        assert abs(result.losses[step] - ref.loss) / ref.loss < BF16_LOSS_TOL, f"{label} step {step} loss"
        assert abs(result.grad_norms[step] - ref.grad_norm) / ref.grad_norm < BF16_NORM_TOL, f"{label} norm"
    for name, value in expected[-1].model_params.items():
        if value.dim() == 2:
            assert result.params[name].dtype == torch.bfloat16
            err = rel_err(result.params[name], value)
            assert err < BF16_WEIGHT_TOL, f"{label}: {name} off by {err:.2e}"


def check_dp_cases(cases: dict, run) -> None:
    base = small_config()
    batches = random_batches(base, STEPS)
    expected = reference_run(base, batches, LRS)
    bf16_expected = reference_run(small_config(bf16=True), batches, LRS, dtype=torch.bfloat16) \
        if any("bf16" in label for label in cases) else None
    for label, result in zip(cases, run(list(cases.values()), batches)):
        if "bf16" in label:
            assert_bf16_matches(result, bf16_expected, label)
        else:
            assert_matches(result, expected, 64, label, COMPILED_PARAM_TOL if "compiled" in label else TOL)


def test_dp2_on_ranks(tmp_path):
    cases = {
        "dp2": small_config(dp=2),
        "dp2 distributed optimizer, buckets, compiled": small_config(
            dp=2, use_distributed_optimizer=True, ddp_bucket_size=8000, compile=True),
    }
    check_dp_cases(cases, lambda configs, batches: run_layouts(tmp_path, configs, batches, LRS))
    assert len(build_rank_program(cases["dp2 distributed optimizer, buckets, compiled"], Coords.from_rank(0, {"dp": 2}),
                                  log=lambda _: None).layout.buckets) >= 3  # the case really has several buckets


def in_one_process(configs, batches):
    return harness.run_layouts(configs, batches, LRS, cache=BUILD)


def test_dp2_with_and_without_distributed_optimizer():
    check_dp_cases({
        "dp2 distributed optimizer": small_config(dp=2, use_distributed_optimizer=True),
        "dp2 overlapped, buckets": small_config(dp=2, overlap_grad_reduce=True, ddp_bucket_size=8000),
        "dp2 distributed optimizer overlapped, buckets": small_config(
            dp=2, use_distributed_optimizer=True, overlap_grad_reduce=True, ddp_bucket_size=8000),
        "dp2 bf16": small_config(dp=2, bf16=True),
        "dp2 bf16 distributed optimizer": small_config(dp=2, bf16=True, use_distributed_optimizer=True),
    }, in_one_process)


@pytest.mark.slow
def test_dp4_with_and_without_distributed_optimizer():
    check_dp_cases({"dp4": small_config(dp=4, micro_batch_size=1),
                    "dp4 distributed optimizer, buckets": small_config(dp=4, micro_batch_size=1,
                                                                       use_distributed_optimizer=True,
                                                                       ddp_bucket_size=5000)}, in_one_process)


@pytest.mark.slow
def test_tp2_pp2_dp2():
    check_dp_cases({"tp2 pp2 dp2": small_config(tp=2, pp=2, dp=2),
                    "tp2 pp2 dp2 distributed optimizer, buckets": small_config(
                        tp=2, pp=2, dp=2, use_distributed_optimizer=True, ddp_bucket_size=4000),
                    "tp2 pp2 dp2 distributed optimizer overlapped": small_config(
                        tp=2, pp=2, dp=2, use_distributed_optimizer=True, ddp_bucket_size=4000,
                        overlap_grad_reduce=True)}, in_one_process)


@pytest.mark.parametrize("sharded", [False, True], ids=["all_reduce", "reduce_scatter"])
def test_overlapped_reduction_starts_inside_backward(sharded):
    config = small_config(dp=2, overlap_grad_reduce=True, use_distributed_optimizer=sharded, ddp_bucket_size=8000)
    program = build_rank_program(config, Coords.from_rank(0, {"dp": 2}), log=lambda _: None)
    stage = program.stages[0]
    kind = "reduce_scatter_tensor" if sharded else "all_reduce"
    nodes = list(stage.backward_last.graph.nodes)
    starts = [i for i, n in enumerate(nodes) if getattr(n.target, "__name__", "").startswith(kind)]
    waits = [i for i, n in enumerate(nodes) if getattr(n.target, "__name__", "").startswith("wait_tensor")]
    matmuls = [i for i, n in enumerate(nodes) if n.target is torch.ops.aten.mm.default]
    assert len(starts) == len(program.layout.buckets) >= 3
    assert any(starts[0] < m < min(waits) for m in matmuls), "the first bucket's reduction overlaps no backward work"
    assert not any(kind in str(n.target) for n in stage.backward.graph.nodes), "earlier microbatches reduce nothing"
    assert not any(kind in str(n.target) for n in program.optimizer.graph.graph.nodes)


@pytest.mark.parametrize("sharded", [False, True], ids=["data_parallel", "sharded_optimizer"])
def test_dp_strategies_are_rewrites_of_the_optimizer_graph(sharded):
    config = small_config(dp=2, use_distributed_optimizer=sharded, ddp_bucket_size=8000)
    programs = build_world(config, log=lambda _: None)
    program = programs[1]
    layout, buckets = program.layout, len(program.layout.buckets)
    assert buckets >= 3
    lowered = build_optimizer_graph(layout, program.step_settings, None)  # the dp=1 step the ranks share
    assert marked(lowered.graph, GRAD) is not None, "a pass edited the shared lowered graph"
    name = "sharded_optimizer" if sharded else "data_parallel"
    expected = {("reduce_scatter_tensor", "dp"): buckets, ("all_gather_into_tensor", "dp"): buckets,
                ("all_reduce", "world"): 1} if sharded else {("all_reduce", "dp_cp"): buckets}
    for p in programs.values():
        calls = [(op, args["group_name"]) for node, op, args in collective_nodes(p.optimizer.graph)
                 if node.meta.get("pass") == name]
        assert {call: calls.count(call) for call in calls} == expected
    diff = diff_counts(op_counts(lowered.graph), op_counts(program.optimizer.graph))
    kind = "reduce_scatter_tensor" if sharded else "all_reduce"
    assert f"_c10d_functional.{kind}: 0 -> {buckets} (+{buckets})" in diff, diff
    values = program.optimizer.values()
    state_numel = layout.shard_numel if sharded else layout.numel
    assert program.optimizer_shard == ("dp" if sharded else None)
    assert [values[n].numel() for n in ("exp_avg", "exp_avg_sq", "flags")] == [state_numel] * 3
    assert values["grads"].numel() == values["params"].numel() == layout.numel


def optimizer_bytes(config, dp_rank: int) -> int:
    program = build_rank_program(config, Coords.from_rank(dp_rank, {"dp": config.parallel.dp}), log=lambda _: None,
                                 cache=BUILD)
    state = TrainState.initial(program, config.model, 0, "cpu")
    return sum(b.numel() * b.element_size() for b in (state.main, state.exp_avg, state.exp_avg_sq) if b is not None)


@pytest.mark.parametrize("bucket_size", [None, 6000])
def test_optimizer_state_is_split_over_dp(bucket_size):
    unsharded = optimizer_bytes(small_config(ddp_bucket_size=bucket_size), 0)
    for dp in (2, 4):
        config = small_config(dp=dp, micro_batch_size=1, use_distributed_optimizer=True, ddp_bucket_size=bucket_size)
        program = build_rank_program(config, Coords.from_rank(0, {"dp": dp}), log=lambda _: None, cache=BUILD)
        padding_bytes = 3 * 4 * 16 * dp * len(program.layout.buckets)  # main + 2 states, fp32, per bucket
        for dp_rank in range(dp):
            sharded = optimizer_bytes(config, dp_rank)
            assert abs(sharded * dp - unsharded * 1.5) <= padding_bytes * 1.5, (dp, dp_rank, sharded, unsharded)


def test_fp16_overflow_skips_that_step_everywhere():
    config = small_config(dp=2, fp16=True, initial_loss_scale=1024.0, hysteresis=1)
    batches = random_batches(config, STEPS)
    (result,) = harness.run_layouts([config], batches, LRS, inject_inf={1: 1}, cache=BUILD)
    for rank in result.ranks:
        assert rank["skipped"] == [0, 1, 0], rank["skipped"]
        assert rank["loss_scales"][1] == rank["loss_scales"][0] / 2
        assert rank["digests"][1] == rank["digests"][0], "a skipped step must leave weights, states, step alone"
        assert rank["digests"][2] != rank["digests"][1]
    # and training goes on as if batch 1 had never been seen (fp16 weights: their rounding, 2^-11, bounds it)
    (clean,) = harness.run_layouts([config], [batches[0], batches[2]], [LRS[0], LRS[2]], cache=BUILD)
    for name, value in clean.params.items():
        err = rel_err(without_key_bias(name, result.params[name], 64), without_key_bias(name, value, 64))
        assert err < 1e-3, (name, err)


def test_every_graph_of_a_rank_lives_on_its_device():
    """Inductor writes kernels for the device of a graph's traced values: an optimizer step traced on the
    CPU and handed CUDA buffers crashed the first GPU run. `meta` stands in for `cuda` on a CPU-only torch."""
    config = small_config(dp=2, use_distributed_optimizer=True, ddp_bucket_size=8000)
    program = build_rank_program(config, Coords.from_rank(1, {"dp": 2}), device="meta", log=lambda _: None)
    for name, gm in named_graphs(program).items():
        devices = {n.meta["val"].device.type for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)}
        assert devices == {"meta"}, (name, devices)
