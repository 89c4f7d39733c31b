"""The planner's stitched lowerings (gcompile.lower_pieces): a stage lowered block by block computes what its
whole lowering computes, saves as many bytes, and is predicted alike; every block is one lowering.

Numerics: fp32 forward outputs and gradients of both lowerings on random real tensors, relative error (max
norm) at most 1e-5; they run the same ops in the same order, so here the error is 0.
"""

import dataclasses

import pytest
import torch

from gcompile.axes import Coords
from gcompile.check import estimate_memory
from gcompile.config import build_config
from gcompile.cost_model import predict, rates_of
from gcompile.pipeline import BuildCache, build_rank_program
from gcompile.report import is_metric
from tests.reference import rel_err
from tests.test_cost_model import flat_machine

TOL = 1e-5


def config(arch="gpt2", n_layer=3, micro_batch_size=2, recompute_activations=False, **parallel):
    model = dict(arch="gpt2" if arch == "moe" else arch, n_layer=n_layer, n_head=4, n_embd=32, block_size=32)
    if arch == "llama":
        model.update(n_kv_head=2, ffn_hidden_size=48)
    if arch == "moe":  # its auxiliary loss adds up over the blocks
        model.update(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01)
    return build_config({"model": model, "parallel": parallel,
                         "train": dict(micro_batch_size=micro_batch_size, global_batch_size=4 * micro_batch_size,
                                       seq_length=32, recompute_activations=recompute_activations)})


def column(cfg, cache: BuildCache) -> list:
    origin = Coords.from_rank(0, cfg.mesh_sizes)
    return [build_rank_program(cfg, origin.moved(pp=r), log=lambda _: None, cache=cache)
            for r in range(cfg.parallel.pp)]


def run(stage, args: list[torch.Tensor]) -> list[torch.Tensor]:
    """Forward on `args`, then backward from random output gradients: the outputs, then the gradients."""
    outputs = stage.forward(*args)
    n = len(stage.outputs)
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(o.shape, generator=g) for o, role in zip(outputs[:n], stage.outputs) if not is_metric(role)]
    return [*outputs[:n], *stage.backward(*outputs[n:], *grads)]


def random_inputs(stage) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    vals = [n.meta["val"] for n in stage.forward.graph.find_nodes(op="placeholder")]
    return [torch.randn(v.shape, generator=g) if v.dtype.is_floating_point else
            torch.randint(0, 50, v.shape, dtype=v.dtype, generator=g) for v in vals]


@pytest.mark.parametrize("arch, pp", [("gpt2", 1), ("gpt2", 3), ("llama", 1), ("llama", 3), ("moe", 1)])
def test_a_stage_stitched_from_its_blocks_computes_what_its_lowering_computes(arch, pp):
    cfg = config(arch, pp=pp)
    whole, pieces = column(cfg, BuildCache()), column(cfg, BuildCache(by_pieces=True))
    for ours, theirs in zip(pieces, whole):
        assert estimate_memory(ours) == estimate_memory(theirs)
        for s in theirs.stages:
            args = random_inputs(theirs.stages[s])
            got, want = run(ours.stages[s], args), run(theirs.stages[s], args)
            assert [g is None for g in got] == [w is None for w in want]
            for g, w in zip(got, want):
                if w is not None:
                    assert rel_err(g, w) <= TOL, (arch, pp, s)


def test_every_block_is_lowered_once_and_a_stage_of_them_is_predicted_as_lowered_whole():
    """tp 2 and sequence parallel (collectives in both graphs), gpt2 with its tied head on one stage: an embedding
    piece, a block piece, a head piece, whatever the stage split."""
    machine = flat_machine()
    cache = BuildCache(by_pieces=True)
    for pp in (1, 3):
        cfg = config(n_layer=6, tp=2, sequence_parallel=True, pp=pp, pipeline_schedule="zb1f1b")
        ours, theirs = column(cfg, cache), column(cfg, BuildCache())
        rates = rates_of(cfg, machine)
        got, want = predict(ours, rates).totals(), predict(theirs, rates).totals()
        assert dataclasses.astuple(got) == pytest.approx(dataclasses.astuple(want), rel=1e-3)
        assert [estimate_memory(p) for p in ours] == [estimate_memory(p) for p in theirs]
    pieces = [key for key in cache.lowered if isinstance(key[-1], tuple)]  # (structure, needs_grad)
    assert len(pieces) == 3, "embedding, one block for all six, head"


def test_full_recompute_is_lowered_whole():
    """By pieces, each block would keep its own input where the stage keeps only its first."""
    cache = BuildCache(by_pieces=True)
    column(config(recompute_activations=True), cache)
    assert not any(isinstance(key[-1], tuple) for key in cache.lowered)
