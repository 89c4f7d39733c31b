"""A step's measured memory peak (gcompile.memory, sampled by the runtime): it holds the state and the
saved activations the schedule keeps in flight, the estimate's activation figure agrees with it, and
a run logs it after its first step and writes it to metrics.jsonl."""

import dataclasses
import json
import re
from types import SimpleNamespace

import torch
import torch.fx as fx

from gcompile.axes import Coords
from gcompile.check import MemoryEstimate, _recomputed_bytes, _saved_bytes, estimate_memory
from gcompile.config import build_config, parse_args
from gcompile.harness import World
from gcompile.pipeline import BuildCache
from gcompile.train import split_microbatches, train
from gcompile.world import build_world
from tests.reference import random_batches
from tests.test_own_model import attention_form

M = 8
"""Microbatches per step: gpipe keeps all of them in flight, 1f1b at most pp."""


def config(n_layer: int = 2, **parallel):
    return build_config({"model": dict(n_layer=n_layer, n_head=4, n_embd=64, block_size=32), "parallel": parallel,
                         "train": dict(micro_batch_size=1, global_batch_size=M * parallel.get("dp", 1),
                                       seq_length=32)})


def measured_step(cfg, cache) -> dict:
    """Every rank's (StepPeak, TrainState, RankProgram) over one training step, all ranks in this process."""
    world = World(build_world(cfg, log=lambda _: None, cache=cache), cfg.model, seed=0)
    tokens, per_rank = random_batches(cfg, 1)[0], M

    def on_rank(rank, runtime):
        runtime.state.lr.fill_(1e-3)
        dp = runtime.program.coords.axis_rank("dp")
        runtime.start_measuring()
        batch = split_microbatches(tokens[dp * per_rank:(dp + 1) * per_rank], 1)
        runtime.train_step([(idx.clone(), targets.clone()) for idx, targets in batch])  # not views of one batch
        return runtime.stop_measuring()

    return {rank: (peak, world.states[rank], world.programs[rank]) for rank, peak in world.run(on_rank).items()}


def test_the_peak_holds_the_state_and_grows_with_the_microbatches_in_flight():
    """pp 2, 8 microbatches: gpipe's first stage holds all 8 saved-activation sets before its first
    backward, 1f1b's at most 2; the state and the messages are the same under both."""
    cache = BuildCache()
    gpipe, onef1b = (measured_step(config(pp=2, pipeline_schedule=name), cache) for name in ("gpipe", "1f1b"))
    for runs in (gpipe, onef1b):
        for peak, state, _ in runs.values():
            assert peak.peak.total >= sum(state.buffer_bytes().values()) > 0
            assert peak.boundaries > 2 * M and peak.allocator_peak is None  # CPU: no allocator figure
    (g, _, _), (o, _, _) = gpipe[0], onef1b[0]
    per_microbatch = o.peak.activations / 2
    assert per_microbatch > 0
    assert g.peak.total - o.peak.total >= 0.9 * (M - 2) * per_microbatch, (g, o)
    assert g.peak.state == o.peak.state


def test_a_rank_lets_a_send_go_once_its_receive_is_proven_posted():
    """8 microbatches, sends complete only once waited for (gloo's, the harness's): 1f1b's first stage of pp 2
    waits for each send where the schedule proves it received (gcompile.send_release), so at its peak it holds
    3 messages of 1 x 32 x 64 fp32 (two outputs to send and a receive buffer), where waiting at the end of the
    step held 10, as gpipe still does (its last stage posts no receive the first one could wait for). The
    plan's estimate walks the same instructions and agrees to the byte on every rank, middle stages included
    (pp 3 zb1f1b's holds an output to send beside the send it replaces: counted from its SEND, not from the
    compute that made it, the estimate was a message short) and interleaving's."""
    cache, message = BuildCache(), 32 * 64 * 4
    for layers, parallel, held in ((2, dict(pipeline_schedule="1f1b"), 3), (2, dict(pipeline_schedule="zb1f1b"), 3),
                                   (2, dict(pipeline_schedule="gpipe"), M + 2), (4, dict(pp=4), None),
                                   (6, dict(pp=3, pipeline_schedule="zb1f1b"), None),
                                   (8, dict(pipeline_schedule="interleaved", virtual_pipeline_size=2), None)):
        parallel = dict(dict(pp=2), **parallel)
        measured = measured_step(config(layers, **parallel), cache)
        if held is not None:
            assert measured[0][0].peak.messages == held * message, (parallel, measured[0][0])
        assert measured[0][0].peak.messages > 0
        for rank, (peak, _, program) in measured.items():
            assert estimate_memory(program).messages == peak.peak.messages, \
                (parallel, rank, estimate_memory(program).messages, peak.peak.messages)


def test_the_estimated_activations_match_the_measured_ones():
    """Saved tensors counted once per storage, weights not at all, walked through the rank's instructions:
    the plan's estimate and the bytes the runtime holds agree to the byte on layouts with and without a
    pipeline, zero-bubble's W stash included."""
    cache = BuildCache()
    for layout in (dict(), dict(tp=2), dict(pp=2, pipeline_schedule="1f1b"), dict(pp=2, pipeline_schedule="gpipe"),
                   dict(pp=2, pipeline_schedule="zb1f1b"), dict(dp=2, data_parallel_sharding_strategy="optim_grads")):
        for rank, (peak, _, program) in measured_step(config(**layout), cache).items():
            estimated, measured = estimate_memory(program).activations, peak.peak.activations
            assert estimated == measured, (layout, rank, estimated, measured)


def test_optim_grads_peak_holds_no_full_gradient():
    """Each microbatch's backward reduce-scatters its gradients: at its peak the state holds the reduced
    shard and never the flat accumulator of the local gradient."""
    (peak, state, _), _ = measured_step(config(dp=2, data_parallel_sharding_strategy="optim_grads"),
                                        BuildCache()).values()
    assert state.grads.numel() == 0 and state.reduced_grads.numel() > 0
    assert peak.peak.state == sum(state.buffer_bytes().values())


def test_a_run_logs_its_first_steps_peak_and_writes_it_to_the_metrics(tmp_path):
    lines = []
    cfg, _ = parse_args(["--n-layer", "2", "--n-head", "4", "--n-embd", "64", "--block-size", "32",
                         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
                         "--train-iters", "2", "--eval-interval", "0", "--run-dir", str(tmp_path)])
    train(cfg, Coords.from_rank(0, {}), log=lines.append)
    line = next(line for line in lines if line.startswith("rank 0 memory over its first step: peak "))
    measured, estimated = line.split("; estimated ")
    states = [re.search(r"\(state ([\d.]+) \+ activations ([\d.]+) \+ messages ([\d.]+)", part).groups()
              for part in (measured, estimated)]
    assert states[0] == states[1], line  # the estimate's parts are the measured ones, named alike
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert records[0]["mem_peak_bytes"] >= records[0]["mem_state_bytes"] + records[0]["mem_activation_bytes"] > 0
    assert "mem_peak_bytes" not in records[1]  # measured on the first step only


def test_an_estimate_reads_unpadded_in_a_sentence_and_lines_up_in_the_checkers_rows():
    estimate = MemoryEstimate(weights=2 ** 20, grads=0, optimizer=0, activations=3 * 2 ** 19)
    parts = "MiB = weights 1.000 + grads 0.000 + optimizer 0.000 + activations 1.500"
    assert str(estimate) == f"2.500 {parts}"  # "rank 0 memory: ...; estimated 2.500 MiB = ..."
    assert f"{estimate:10}" == f"     2.500 {parts}"  # the plan checker's column


def test_a_full_recompute_backward_holds_what_it_makes_again_until_its_last_reader():
    """By hand: `a` and `b` remade from the saved input, each 1 KiB, alive together until the gradient reads them;
    `sin`, remade after both are let go, alone; a view holds nothing more; gradients are not counted (as a
    backward without recompute's are not). Full recompute counted nothing: the planner took it as free."""
    aten, graph = torch.ops.aten, fx.Graph()
    x, tangent = graph.placeholder("x"), graph.placeholder("tangent")
    a = graph.call_function(aten.relu.default, (x,))
    b = graph.call_function(aten.mul.Tensor, (a, 2))
    flat = graph.call_function(aten.view.default, (b, [-1]))
    grad = graph.call_function(aten.mul.Tensor, (graph.call_function(aten.mul.Tensor, (tangent, flat)), a))
    late = graph.call_function(aten.sin.default, (x,))
    graph.output((grad, late))
    for node in graph.nodes:
        if node.op != "output":
            node.meta["val"] = torch.zeros(256) if node is not flat else torch.zeros(256).view(-1)
    stage = SimpleNamespace(backward=fx.GraphModule(torch.nn.Module(), graph), num_saved=1, recomputed=True)
    assert _recomputed_bytes(stage) == 2 * 1024
    assert _recomputed_bytes(SimpleNamespace(**{**vars(stage), "recomputed": False})) == 0


def test_a_rank_under_full_recompute_peaks_inside_a_backward():
    """One stage, microbatches one after another: the peak is a backward's, holding its own microbatch's saved
    inputs and what it makes again. At instruction boundaries only (what the runtime measures, which
    bench/cost_model.py compares with), the saved inputs alone."""
    cfg = config()
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, recompute_activations=True))
    (program,) = build_world(cfg, log=lambda _: None).values()
    (stage,) = program.stages.values()
    assert _recomputed_bytes(stage) > 0
    assert estimate_memory(program).activations == _recomputed_bytes(stage) + _saved_bytes(stage)
    assert estimate_memory(program, inside_graphs=False).activations == _saved_bytes(stage)


def test_a_models_buffers_are_counted_once_per_rank_in_the_estimate_and_the_peak(tmp_path):
    """A cos/sin cache per block (gcompile.held) is handed to each stage that reads it: pp 2 x vpp 2 over 4 blocks
    gives a rank 2 blocks of 2 buffers of 32 x 16 fp32, which the estimate and the measured peak count as
    constants, not again among the activations that view them (saved per microbatch, the estimate counted
    them 3 times more)."""
    arch = attention_form("rotary-cache-buffers", "cached_rotary_memory", tmp_path)
    cfg = build_config({"model": dict(arch=arch, n_layer=4, n_head=4, n_embd=64, block_size=32),
                        "parallel": dict(pp=2, virtual_pipeline_size=2),
                        "train": dict(micro_batch_size=1, global_batch_size=M, seq_length=32)})
    for rank, (peak, _, program) in measured_step(cfg, BuildCache()).items():
        estimate = estimate_memory(program)
        assert estimate.constants == peak.peak.constants == 2 * 2 * 32 * 16 * 4, (rank, estimate, peak)
        assert estimate.activations == peak.peak.activations, (rank, estimate, peak)
