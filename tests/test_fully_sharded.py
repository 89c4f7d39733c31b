"""--data-parallel-sharding-strategy optim_grads_params (ZeRO-3 / FSDP, passes/fully_sharded.py): against
single-device eager, its gathers and reduce-scatters in the graphs, the memory its ranks hold, checkpoints
across layouts, and its flags.

Numerics as in tests/test_data_parallel.py: 1e-5 relative in fp32 (2e-5 on parameters when compiled), the bf16
tolerances there, 3 steps on random batches.
"""

import pytest
import torch

from gcompile.axes import Coords
from gcompile.check import MeasuredMemory, check_plan, estimate_memory
from gcompile.config import build_config
from gcompile.collectives import collective_nodes
from gcompile.pipeline import build_rank_program, builtin_passes
from gcompile.state import TrainState
from gcompile.train import train
from gcompile.world import build_world
from tests.multirank import assert_succeeded, launch, run_layouts
from tests.test_checkpoint import N, WORKER, assert_close, assert_resume_is_exact, config, cut_resumed_straight, \
    losses
from tests.reference import ADAM_EPS, random_batches, reference_run
from tests.test_data_parallel import LRS, assert_matches, check_dp_cases, in_one_process, small_config

ZERO3 = dict(data_parallel_sharding_strategy="optim_grads_params")
MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
           torch.ops.aten.embedding.default, torch.ops.aten.embedding_dense_backward.default)


def test_zero3_matches_eager():
    check_dp_cases({
        "dp2 zero3": small_config(dp=2, **ZERO3),
        "dp4 zero3": small_config(dp=4, micro_batch_size=1, **ZERO3),
        "dp2 zero3, gathered weights kept from forward to backward": small_config(
            dp=2, fsdp_reshard_after_forward=False, **ZERO3),
        "dp2 zero3 recompute": small_config(dp=2, recompute_activations=True, **ZERO3),
        "dp2 bf16 zero3": small_config(dp=2, bf16=True, **ZERO3),
    }, in_one_process)


def test_zero3_with_model_parallel_matches_eager():
    check_dp_cases({
        "tp2 dp2 zero3": small_config(tp=2, dp=2, **ZERO3),
        "tp2 sp dp2 zero3": small_config(tp=2, dp=2, sequence_parallel=True, **ZERO3),
        "tp2 pp2 dp2 zero3 1f1b": small_config(tp=2, pp=2, dp=2, **ZERO3),
        "tp2 pp2 dp2 zero3 zb1f1b": small_config(tp=2, pp=2, dp=2, pipeline_schedule="zb1f1b", **ZERO3),
    }, in_one_process)


def test_zero3_with_interleaved_pipeline_matches_eager():
    def config(**parallel):
        return build_config({"model": dict(n_layer=4, n_head=4, n_embd=64, block_size=32),
                             "parallel": parallel,
                             "train": dict(micro_batch_size=2, global_batch_size=8, seq_length=32, lr=1e-3,
                                           clip_grad=0.5, adam_eps=ADAM_EPS)})
    batches = random_batches(config(), 3)
    (result,) = in_one_process([config(pp=2, virtual_pipeline_size=2, dp=2, **ZERO3)], batches)
    assert_matches(result, reference_run(config(), batches, LRS), 64, "pp2 vpp2 dp2 zero3")


def test_hybrid_sharding_matches_eager():
    """HSDP, shard size 2 on dp 4: weights sharded over dp ranks {0, 1} and {2, 3}, gradients reduce-scattered
    there and all-reduced between the two groups."""
    hsdp = dict(dp=4, micro_batch_size=1, data_parallel_shard_size=2, **ZERO3)
    check_dp_cases({"dp4 shard size 2": small_config(**hsdp),
                    "tp2 dp4 shard size 2": small_config(tp=2, **hsdp)}, in_one_process)
    program = build_rank_program(small_config(**hsdp), Coords.from_rank(2, small_config(**hsdp).mesh_sizes),
                                 log=lambda _: None)
    groups = {(op, args["group_name"]) for _, op, args in collective_nodes(program.stages[0].backward)}
    assert groups == {("all_gather_into_tensor", "dp_shard"), ("reduce_scatter_tensor", "dp_shard"),
                      ("all_reduce", "dp_replicate")}
    assert all(p.shards[-1].axis == "dp_shard" for p in program.layout.params)
    assert estimate_memory(program).gathered > 0, "the estimate counts the gathers over dp_shard too"


@pytest.mark.slow
def test_zero3_compiled_on_ranks(tmp_path):
    cases = {"dp2 zero3, compiled": small_config(dp=2, compile=True, **ZERO3)}
    check_dp_cases(cases, lambda configs, batches: run_layouts(tmp_path, configs, batches, LRS))


def test_layers_gather_one_ahead_and_backward_gathers_again_only_when_resharding():
    """One all-gather per layer (embeddings, each block, the final norm) in forward and again in backward, each
    issued before the previous layer's first matmul; reduce-scatters of the gradients in backward, each waited for after the next is
    issued; the backward gathers again
    under --fsdp-reshard-after-forward (the default) and never without it."""
    programs = {reshard: build_rank_program(small_config(dp=2, fsdp_reshard_after_forward=reshard, **ZERO3),
                                            Coords.from_rank(1, {"dp": 2}), log=lambda _: None)
                for reshard in (True, False)}
    for graph in (programs[True].stages[0].forward, programs[True].stages[0].backward):
        nodes = list(graph.graph.nodes)
        gathers = [n for n, op, args in collective_nodes(graph) if op == "all_gather_into_tensor"]
        assert len(gathers) == 2 + 2  # n_layer = 2
        for gather, previous in zip(gathers[1:], gathers):
            wait = next(u for u in previous.users if "wait_tensor" in str(u.target))
            first_matmul = next(n for n in nodes[nodes.index(wait):] if n.target in MATMULS)
            assert nodes.index(gather) < nodes.index(first_matmul), f"{gather} waits for {first_matmul}"
    backward = programs[True].stages[0].backward.graph
    scatters = list(backward.find_nodes(op="call_function", target=torch.ops._c10d_functional.reduce_scatter_tensor.default))
    nodes = list(backward.nodes)
    for scatter, following in zip(scatters, scatters[1:]):  # each waited for once the next is under way
        wait = next(iter(scatter.users))
        assert nodes.index(following) < nodes.index(wait), f"{scatter} is waited for before {following} starts"
    for reshard, program in programs.items():
        backward = [op for _, op, args in collective_nodes(program.stages[0].backward) if args["group_name"] == "dp"]
        assert backward.count("reduce_scatter_tensor") == 4
        assert backward.count("all_gather_into_tensor") == (4 if reshard else 0), backward  # the embeddings'
        # too: the tied head reads them
    assert builtin_passes(small_config(dp=2, **ZERO3)) == ["fully_sharded"]


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_gradients_are_reduced_in_fp32(precision):
    """The model dtype's gradients are summed over dp in fp32, as --bf16/--fp16 promise: summed in fp16, a sum over
    the ranks overflowed where each rank's gradient did not, and every such step was skipped."""
    program = build_rank_program(small_config(dp=2, **{precision: True}, **ZERO3), Coords.from_rank(0, {"dp": 2}),
                                 log=lambda _: None)
    backward = program.stages[0].backward.graph
    scatters = backward.find_nodes(op="call_function", target=torch.ops._c10d_functional.reduce_scatter_tensor.default)
    assert [node.meta["val"].dtype for node in scatters] == [torch.float32] * 4


def test_zero3_holds_a_dp_th_of_the_model_states():
    """dp 4, fp32: weights, gradients and AdamW states (with flags) are a quarter of no_shard's, up to the
    padding of each parameter's dim 0 to a multiple of dp; no fp32 main copy (the weights are the shard);
    the estimate adds the two largest consecutive gathered layers."""
    held = {}
    for strategy in ("no_shard", "optim_grads_params"):
        program = build_world(small_config(dp=4, data_parallel_sharding_strategy=strategy), log=lambda _: None)[3]
        held[strategy] = MeasuredMemory.of(TrainState.allocate(program, "meta")), estimate_memory(program)
    (full, _), (zero3, estimate) = held["no_shard"], held["optim_grads_params"]
    states = lambda m: m.weights + m.grads + m.optimizer
    assert zero3.during_step == 0
    assert abs(states(zero3) - states(full) / 4) / (states(full) / 4) < 0.02, (zero3, full)
    block = (12 * 64 * 64 + 13 * 64) * 4  # fp32 bytes of a GPT-2 block of width 64; the two blocks are the
    assert estimate.gathered == 2 * block  # largest consecutive pair (the embeddings: (260 + 32) * 64 * 4)


def test_plan_checker_accepts_zero3():
    for layout in (dict(dp=4), dict(tp=2, pp=2, dp=2)):
        assert check_plan(build_world(small_config(**layout, **ZERO3), log=lambda _: None)).startswith("plan checked")


@pytest.fixture(scope="module")
def zero3_saves(tmp_path_factory):
    """On 2 ranks, one launch: ZeRO-3 dp2 cut, resumed and straight; its cut continued on tp2; and a tp2 save
    continued under ZeRO-3."""
    root = tmp_path_factory.mktemp("zero3")
    z3 = ["--dp", 2, "--data-parallel-sharding-strategy", "optim_grads_params"]
    dirs, configs = cut_resumed_straight(root, {"": z3})
    for name, flags, load in (("tp2", ["--tp", 2], dirs["cut"] / "save"),
                              ("tp2 cut", ["--tp", 2, "--save", root / "tp2 cut" / "save", "--exit-interval", N], None),
                              ("from tp2", z3, root / "tp2 cut" / "save")):
        dirs[name] = root / name
        configs.append(config(*flags, *(["--load", load] if load else []), "--run-dir", dirs[name] / "run"))
    assert_succeeded(root, launch(root, WORKER, dict(configs=configs), world=2))
    return dirs


@pytest.mark.slow
def test_zero3_checkpoint_resumes_exactly_and_reshards(zero3_saves, tmp_path):
    dirs = zero3_saves
    assert_resume_is_exact(dirs, "")
    straight = losses(dirs["straight"] / "run")
    assert_close(losses(dirs["tp2"] / "run"), straight[N:], "ZeRO-3 dp2 save continued on tp2")
    assert_close(losses(dirs["from tp2"] / "run"), straight[N:], "tp2 save continued under ZeRO-3 dp2")
    train(config("--load", dirs["cut"] / "save", "--run-dir", tmp_path / "one"), Coords.from_rank(0, {}),
          log=lambda _: None)
    assert_close(losses(tmp_path / "one"), straight[N:], "ZeRO-3 dp2 save continued on one rank")
