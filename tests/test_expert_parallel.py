"""Expert parallel (passes/expert_parallel.py): the experts split over ep ranks train like one device.

Numerics as in tests/test_moe.py: fp32, relative error at most 1e-5 of losses and grad norms per step and
of the final parameters, against single-device eager autograd + AdamW on random tokens over 3 steps, the
load-balancing loss (coefficient 0.01) included, so its gradient reaches the routers. Routing is dropless,
so the ep exchange moves every routed row and the sums are one device's. In this process unless marked
slow (gloo ranks, real all-to-alls, Inductor-compiled).
"""

import dataclasses
import json

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from gcompile import harness
from gcompile.axes import Coords
from gcompile.check import check_plan
from gcompile.collectives import collective_nodes
from gcompile.pipeline import build_rank_program, builtin_passes
from gcompile.program import ancestors
from gcompile.train import train
from gcompile.world import build_world
from tests import multirank
from tests.reference import random_batches, reference_run
from tests.test_checkpoint import N, WORKER, assert_close, assert_resume_is_exact, cut_resumed_straight, losses
from tests.test_checkpoint import config as checkpoint_config
from tests.test_llama import COMPILED_PARAM_TOL, assert_matches
from tests.test_moe import DEEPSEEK, LLAMA, LRS, config

DIST_OPT = dict(use_distributed_optimizer=True)
FSDP = dict(data_parallel_sharding_strategy="optim_grads_params")


def layout(model, compile: bool = False, **parallel):
    cfg = config(model, **parallel)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compile=compile))


def check(cases: dict, run, model=None) -> None:
    batches = random_batches(config(model), len(LRS))
    reference = reference_run(config(model), batches, LRS)
    for label, result in zip(cases, run([layout(model, **parallel) for parallel in cases.values()], batches)):
        assert_matches(result.losses, result.grad_norms, result.params, reference, label,
                       COMPILED_PARAM_TOL if "compiled" in label else 1e-5)


def in_one_process(configs, batches):
    return harness.run_layouts(configs, batches, LRS)


def test_gpt2_experts_split_over_ep_match_eager():
    """ep2 and ep4 (one expert a rank: no sort after the exchange), with tp, pp, the distributed optimizer
    sharding the experts' state over the edp ranks that hold the same experts, ZeRO-2, overlapped buckets,
    and FSDP (the experts' weights sharded over edp, or whole where edp = 1)."""
    check({"ep2": dict(dp=2, ep=2), "ep4": dict(dp=4, ep=4), "ep2 tp2": dict(dp=2, ep=2, tp=2),
           "ep2 pp2": dict(dp=2, ep=2, pp=2), "ep2 dp4 distributed optimizer": dict(dp=4, ep=2, **DIST_OPT),
           "ep2 dp2 distributed optimizer": dict(dp=2, ep=2, **DIST_OPT),
           "ep2 dp4 optim_grads overlapped": dict(dp=4, ep=2, data_parallel_sharding_strategy="optim_grads",
                                                  overlap_grad_reduce=True),
           "ep2 dp4 FSDP": dict(dp=4, ep=2, **FSDP), "ep2 dp2 FSDP (experts whole)": dict(dp=2, ep=2, **FSDP),
           "ep2 dp4 FSDP pp2": dict(dp=4, ep=2, pp=2, **FSDP)}, in_one_process)


@pytest.mark.parametrize("model, parallel", [(LLAMA, dict(dp=2, ep=2, tp=2, pp=2)),
                                             (dict(LLAMA, **DEEPSEEK), dict(dp=2, ep=2)),
                                             (dict(LLAMA, **DEEPSEEK), dict(cp=2, ep=2)),
                                             (dict(LLAMA, **DEEPSEEK), dict(tp=2, dp=2, ep=2, sequence_parallel=True))],
                         ids=["llama-ep2-tp2-pp2", "llama-sigmoid-shared-expert-ep2",
                              "llama-sigmoid-shared-expert-cp2-ep2", "llama-sigmoid-shared-expert-tp2-sp-ep2"])
def test_llama_experts_split_over_ep_match_eager(model, parallel):
    check({f"llama {parallel}": parallel}, in_one_process, model)


def test_experts_under_context_parallel_match_eager():
    """cp splits every sample's tokens: each rank routes its own through the experts, and the load-balancing
    loss reads the micro-batch's tokens per expert (summed over cp) against the rank's mean router probabilities,
    which the gradients' average over cp makes the micro-batch's. With ep, the tensor- and pipeline-parallel
    splits, the all-gather attention, and the distributed optimizer, whose expert shards span dp and cp (the
    gradient norm had counted each expert element as held by the cp ranks twice: 4.7e-4 low)."""
    check({"cp2": dict(cp=2), "cp4": dict(cp=4), "cp2 ep2": dict(cp=2, ep=2), "cp2 dp2 ep4": dict(cp=2, dp=2, ep=4),
           "cp2 dp2 ep2 distributed optimizer": dict(cp=2, dp=2, ep=2, **DIST_OPT),
           "cp2 tp2": dict(cp=2, tp=2), "cp2 pp2 all_gather": dict(cp=2, pp=2, cp_comm_type="all_gather")},
          in_one_process)


def test_experts_under_sequence_parallel_match_eager():
    """Sequence parallel splits the tokens over tp between the tensor-parallel blocks, and a MoE layer sits
    there: each tp rank routes its own T/tp through experts it holds whole (their gradients summed over tp); the
    load-balancing loss reads the micro-batch's counts and mean router probabilities (sums over tp), so every
    tp rank has the same loss. With ep, pp, and cp on top."""
    sp = dict(sequence_parallel=True)
    check({"tp2 sp": dict(tp=2, **sp), "tp4 sp": dict(tp=4, **sp), "tp2 sp dp2 ep2": dict(tp=2, dp=2, ep=2, **sp),
           "tp2 sp pp2": dict(tp=2, pp=2, **sp), "tp2 sp cp2 ep2": dict(tp=2, cp=2, ep=2, **sp)}, in_one_process)


def test_under_context_parallel_routing_counts_the_ranks_tokens_and_the_balance_loss_the_micro_batchs():
    cfg = config(cp=2)
    stage = build_rank_program(cfg, Coords.from_rank(1, cfg.mesh_sizes), log=lambda _: None).stages[0]
    totals = [(node.meta["val"].dtype, tuple(node.meta["val"].shape))
              for node, op, a in collective_nodes(stage.forward) if op == "all_reduce" and a["group_name"] == "cp"]
    assert totals == [(torch.int64, (4,))] * 2 + [(torch.int64, ())]  # each layer's tokens per expert, once; the
    # micro-batch's counted targets
    for mm in stage.forward.graph.find_nodes(op="call_function", target=torch.ops.gcompile.grouped_mm.default):
        assert mm.args[0].meta["val"].shape[0] == 2 * 32 * 2 // 2  # the rank's half of B x T tokens, k copies each
        assert not any(n.op == "call_function" and "all_reduce" in str(n.target) for n in ancestors([mm.args[2]]))


@pytest.mark.slow
def test_compiled_on_ranks_matches_eager(tmp_path):
    """On gloo ranks, Inductor-compiled: the all-to-alls are real, their counts read on the host, and the
    expert buckets are reduce-scattered and gathered over real edp groups."""
    check({"ep2 dp4 distributed optimizer compiled": dict(dp=4, ep=2, compile=True, **DIST_OPT)},
          lambda configs, batches: multirank.run_layouts(tmp_path, configs, batches, LRS))


def test_experts_exchange_rows_with_all_to_all_and_reduce_over_edp():
    cfg = config(dp=4, ep=2)
    assert builtin_passes(cfg) == ["expert_parallel", "data_parallel"]
    program = build_rank_program(cfg, Coords.from_rank(1, cfg.mesh_sizes), log=lambda _: None)
    stage = program.stages[0]
    per_layer = [("all_to_all_single", "ep"), ("all_to_all_rows", "ep"), ("all_to_all_rows", "ep")]
    assert [(op, a["group_name"]) for _, op, a in collective_nodes(stage.forward)] == per_layer * 2
    assert [(op, a["group_name"]) for _, op, a in collective_nodes(stage.backward)] == [("all_to_all_rows", "ep")] * 4
    experts = {p.name for p in program.layout.params if p.sharded_over("ep")}
    assert experts == {f"transformer.h.{i}.mlp.experts.{m}.{w}" for i in range(2) for m in ("c_fc", "c_proj")
                       for w in ("weight", "bias")}
    assert all(p.local_shape(cfg.mesh_sizes)[0] == 2 for p in program.layout.params if p.name in experts)
    groups = [a["group_name"] for _, _, a in collective_nodes(program.optimizer.graph)]
    assert set(groups) == {"dp_cp", "edp", "world"} and groups.count("edp") == 2  # a bucket of each layer's
    report = check_plan(build_world(cfg, log=lambda _: None))  # says what it cannot check
    assert "the row counts of rank 0's 8 all_to_all_rows per iteration (expert parallel's routing) are data" in report


@pytest.mark.slow
def test_checkpoints_cross_ep_sizes(tmp_path):
    """An ep2 save (dp4, distributed optimizer: expert state sharded over edp) resumes exactly at ep2 and
    continues at ep4 and at ep1 on one rank, each with the uninterrupted ep2 run's losses."""
    moe = ["--num-experts", 4, "--moe-router-topk", 2, "--moe-aux-loss-coeff", 0.01, "--dp", 4,
           "--use-distributed-optimizer"]
    dirs, configs = cut_resumed_straight(tmp_path, {"": moe + ["--ep", 2]})
    saved = dirs["cut"] / "save"
    configs.append(checkpoint_config(*moe, "--ep", 4, "--load", saved, "--run-dir", tmp_path / "ep4"))
    multirank.assert_succeeded(tmp_path, multirank.launch(tmp_path, WORKER, dict(configs=configs), world=4))
    assert_resume_is_exact(dirs, "")
    straight = losses(dirs["straight"] / "run")
    assert_close(losses(tmp_path / "ep4"), straight[N:], "an ep2 save continued at ep4")
    train(checkpoint_config(*moe[:6], "--load", saved, "--run-dir", tmp_path / "one"), Coords.from_rank(0, {}),
          log=lambda _: None)
    assert_close(losses(tmp_path / "one"), straight[N:], "an ep2 save continued on one rank")


@pytest.mark.slow
def test_routing_statistics_logged_alike_on_ranks(tmp_path):
    """The logged tokens per expert (summed over the global batch: every token's k copies) and load-balancing
    loss (the mean over microbatches) of a pp2 dp2 ep2 run, its reports totalled over the ranks
    (gcompile.reported) and averaged over a log interval of 2 steps, are the mean of one rank's two steps
    logged one by one: counts exactly, the loss at 1e-5; TensorBoard has them too. So are those of tp2 with
    sequence parallel and cp2, where each rank routes a quarter of every sample's tokens: the counts, summed
    over tp by the layer and over cp when logged, are the micro-batch's."""
    moe = ["--num-experts", 4, "--moe-router-topk", 2, "--moe-aux-loss-coeff", 0.01]
    train(checkpoint_config(*moe, "--log-interval", 1, "--run-dir", tmp_path / "one"), Coords.from_rank(0, {}),
          log=lambda _: None)
    ranks = checkpoint_config(*moe, "--log-interval", 2, "--pp", 2, "--dp", 2, "--ep", 2, "--run-dir", tmp_path / "ranks")
    split_tokens = checkpoint_config(*moe, "--log-interval", 2, "--tp", 2, "--sequence-parallel", "--cp", 2,
                                     "--run-dir", tmp_path / "split_tokens")
    multirank.assert_succeeded(tmp_path, multirank.launch(tmp_path, WORKER, dict(configs=[ranks, split_tokens]),
                                                          world=4))
    one = records(tmp_path / "one")
    assert all(sum(layer) == 8 * 32 * 2 for a in one for layer in a["tokens_per_expert"])  # batch x seq x top-k
    for four in (records(tmp_path / name) for name in ("ranks", "split_tokens")):
        assert len(one) == 2 * len(four) == 2 * N
        for a, b, mean in zip(one[::2], one[1::2], four):
            pairs = zip(a["tokens_per_expert"], b["tokens_per_expert"])
            assert mean["tokens_per_expert"] == [[(x + y) / 2 for x, y in zip(*layers)] for layers in pairs]
            losses = [(x + y) / 2 for x, y in zip(a["load_balancing_loss"], b["load_balancing_loss"])]
            assert all(abs(x - y) < 1e-5 * x for x, y in zip(losses, mean["load_balancing_loss"]))
    events = EventAccumulator(str(tmp_path / "one" / "tensorboard"))
    events.Reload()
    assert {"load balancing loss", "load balancing loss/layer 1"} <= set(events.Tags()["scalars"])
    assert {"tokens per expert/layer 0", "tokens per expert/layer 1"} <= set(events.Tags()["histograms"])


def records(run_dir) -> list[dict]:
    with open(run_dir / "metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if "tokens_per_expert" in r]
