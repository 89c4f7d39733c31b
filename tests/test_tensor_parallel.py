"""Tensor and sequence parallelism: every tp layout trains the same model as one device.

Numerics: every rank in one process (gcompile.harness), and three cases on real ranks
(tests/multirank.py: tp groups in shared memory, over gloo, and Inductor) against
single-device eager autograd +
torch.optim.AdamW (tests/reference.py): the loss and gradient norm of every step and the
final parameters, gathered to full shape, within 1e-5 relative (fp32, CPU); replicated
parameters must be bitwise equal on all tp ranks (the harness checks). The vocab, 257,
divides by no tp here, so vocab padding is always exercised. Structure: collective
counts per layer are Megatron's, and all tp ranks run the same graph text. Inductor runs
one case (tp 2 with sequence parallelism, whose graphs hold every collective kind): a cold
compile costs ~20 s per graph on 2 cores.
"""

import functools

import pytest
import torch

import run_gpt
from gcompile import harness, shm_group
from gcompile.compile import graph_key
from gcompile.config import build_config, parse_args
from gcompile.layout import Shard
from gcompile.axes import Coords
from gcompile.pipeline import BuildCache, build_rank_program
from gcompile.program import op_counts
from tests.multirank import run_layouts
from tests.reference import (ADAM_EPS, assert_key_bias_is_noise, random_batches, reference_run, rel_err,
                             without_key_bias)

TOL = 1e-5
LRS = [1e-3, 8e-4, 6e-4, 4e-4, 2e-4]
BUILD = BuildCache()
"""The in-process cases share the capture (one model) and identical lowerings."""
MLP_ONLY = ("transformer.h.*.mlp.c_fc=column", "transformer.h.*.mlp.c_proj=row")


def small_config(tp=1, sequence_parallel=False, compile=False, recompute=False, n_layer=2, **parallel):
    return build_config({
        "model": dict(n_layer=n_layer, n_head=8, n_embd=64, block_size=32),
        "parallel": dict(tp=tp, sequence_parallel=sequence_parallel, **parallel),
        "train": dict(micro_batch_size=2, global_batch_size=4, seq_length=32, lr=1e-3, clip_grad=0.5,
                      weight_decay=0.1, adam_eps=ADAM_EPS, compile=compile, recompute_activations=recompute),
    })


@pytest.fixture(scope="module")
def reference():
    config = small_config()
    batches = random_batches(config, len(LRS))
    return batches, reference_run(config, batches, LRS)


def check_cases(results, reference, cases: dict):
    _, expected = reference
    C = 64
    for name, result in zip(cases, results):
        for step, (loss, norm, ref) in enumerate(zip(result.losses, result.grad_norms, expected)):
            assert abs(loss - ref.loss) / ref.loss < TOL, f"{name}: step {step} loss {loss} != {ref.loss}"
            assert abs(norm - ref.grad_norm) / ref.grad_norm < TOL, f"{name}: step {step} grad norm"
            assert ref.grad_norm > 0.5, "clipping must be active for the norm to matter"
        final = expected[-1]
        assert result.params.keys() == final.params.keys()
        for param, value in final.params.items():
            assert_key_bias_is_noise(param, final.grads[param], C)
            err = rel_err(without_key_bias(param, result.params[param], C), without_key_bias(param, value, C))
            assert err < TOL, f"{name}: final {param} off by {err:.2e}"
    return results


def check_ranks(tmp_path, reference, cases: dict):
    """On real ranks: transports and Inductor."""
    return check_cases(run_layouts(tmp_path, list(cases.values()), reference[0], LRS), reference, cases)


def check_in_one_process(reference, cases: dict):
    """Numerics alone: every rank in this process (gcompile.harness)."""
    return check_cases(harness.run_layouts(list(cases.values()), reference[0], LRS, cache=BUILD), reference, cases)


def test_tp2(tmp_path, reference):
    results = check_ranks(tmp_path, reference, {
        "tp2": small_config(tp=2, make_vocab_size_divisible_by=1),
        "tp2 sequence-parallel inductor": small_config(tp=2, sequence_parallel=True, compile=True),
        "tp2 sequence-parallel over gloo": small_config(tp=2, sequence_parallel=True, tp_comm_backend="gloo"),
    })
    shm = shm_group.BACKEND if shm_group.available() else "gloo"
    assert [r.ranks[0]["tp_backend"] for r in results] == [shm] * 2 + ["gloo"]
    compiled = results[1].ranks[1]["compile_stats"]
    assert compiled.distinct == 3 and compiled.cache_misses == 0, f"rank 1 should reuse rank 0's graphs: {compiled}"


def test_tp2_in_one_process(reference):
    results = check_in_one_process(reference, {
        "tp2 sequence-parallel": small_config(tp=2, sequence_parallel=True, make_vocab_size_divisible_by=1),
        "tp2 mlp-only plan": small_config(tp=2, tp_plan=MLP_ONLY),
        "tp2 sequence-parallel recompute": small_config(tp=2, sequence_parallel=True, recompute=True),
    })
    sharded = {p.name for p in results[1].ranks[0]["params"] if p.shards}
    assert sharded == {f"transformer.h.{i}.mlp.{m}.weight" for i in range(2) for m in ("c_fc", "c_proj")} | \
        {f"transformer.h.{i}.mlp.c_fc.bias" for i in range(2)}


def test_tp4(reference):
    check_in_one_process(reference, {
        "tp4 (vocab padded 257 -> 512: one rank all padding)": small_config(tp=4),
        "tp4 sequence-parallel": small_config(tp=4, sequence_parallel=True, make_vocab_size_divisible_by=1),
    })


@pytest.mark.slow
def test_tp8(reference):
    check_in_one_process(reference, {
        "tp8": small_config(tp=8),
        "tp8 sequence-parallel": small_config(tp=8, sequence_parallel=True, make_vocab_size_divisible_by=1),
    })


@functools.cache
def rank_program(tp: int, tp_rank: int, sequence_parallel: bool, n_layer: int = 2):
    config = small_config(tp=tp, sequence_parallel=sequence_parallel, n_layer=n_layer)
    return build_rank_program(config, Coords.from_rank(tp_rank, {"tp": tp}), log=lambda _: None)


def collective_counts(program) -> dict[str, int]:
    """Calls of each functional collective in the lowered forward and backward graphs."""
    (stage,) = program.stages.values()
    counts = {}
    for graph, gm in (("fwd", stage.forward), ("bwd", stage.backward)):
        for op, n in op_counts(gm).items():
            if op.startswith("_c10d_functional.") and op != "_c10d_functional.wait_tensor":
                counts[f"{graph} {op.split('.')[1]}"] = n
    return counts


# Megatron-LM's collectives per transformer layer (ColumnParallelLinear / RowParallelLinear,
# with and without sequence_parallel), and outside the layers: the vocab-parallel embedding
# (all-reduce, or reduce-scatter under SP), the output layer's input (f: all-reduce in
# backward, or all-gather / reduce-scatter under SP) and vocab_parallel_cross_entropy (three
# all-reduces: max, sum of exponentials, target logit). Under SP, LayerNorm weights and
# row-parallel biases see only local tokens and their gradients are summed over tp;
# Megatron coalesces those sums after backward, we do one per use (ln_1, ln_2 weight and
# bias, two row biases per layer; ln_f's two at the end), and the position embedding,
# replicated and cut to the rank's tokens, gathers its gradient back (one all-gather).
MEGATRON_PER_LAYER = {
    False: {"fwd all_reduce": 2, "bwd all_reduce": 2},
    True: {"fwd all_gather_into_tensor": 2, "fwd reduce_scatter_tensor": 2,
           "bwd reduce_scatter_tensor": 2, "bwd all_gather_into_tensor": 2, "bwd all_reduce": 6},
}
OUTSIDE_LAYERS = {
    False: {"fwd all_reduce": 1 + 3, "bwd all_reduce": 1},
    True: {"fwd reduce_scatter_tensor": 1, "fwd all_gather_into_tensor": 1, "fwd all_reduce": 3,
           "bwd all_gather_into_tensor": 1 + 1, "bwd reduce_scatter_tensor": 1, "bwd all_reduce": 2},
}


def matmuls_while_in_flight(gm) -> list[int]:
    """For each all-reduce of the graph: the matmuls between its start and its wait."""
    nodes = list(gm.graph.nodes)
    windows = [(nodes.index(n), nodes.index(next(iter(n.users)))) for n in nodes
               if n.target is torch.ops._c10d_functional.all_reduce.default]
    return [sum(n.target is torch.ops.aten.mm.default for n in nodes[start:end]) for start, end in windows]


@pytest.mark.parametrize("overlap", [True, False])
def test_input_gradient_all_reduces_overlap_weight_gradients(overlap):
    # Megatron's async input-gradient all-reduce: in the backward of each column-parallel
    # linear (c_attn, c_fc, and the vocab-parallel head) the weight-gradient matmul runs
    # while the input gradient's all-reduce is in flight; autograd's order has none there
    config = small_config(tp=2, overlap_tp_comm=overlap)
    (stage,) = build_rank_program(config, Coords.from_rank(0, {"tp": 2}), log=lambda _: None).stages.values()
    in_flight = matmuls_while_in_flight(stage.backward)
    assert len(in_flight) == 2 * 2 + 1
    assert all(n >= 1 for n in in_flight) if overlap else in_flight == [0] * 5, in_flight


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_collectives_per_layer_are_megatrons(sequence_parallel):
    two, three = (collective_counts(rank_program(2, 1, sequence_parallel, n_layer)) for n_layer in (2, 3))
    per_layer = {op: three.get(op, 0) - two.get(op, 0) for op in three.keys() | two.keys()}
    assert {op: n for op, n in per_layer.items() if n} == MEGATRON_PER_LAYER[sequence_parallel]
    outside = {op: n - 2 * per_layer[op] for op, n in two.items()}
    assert {op: n for op, n in outside.items() if n} == OUTSIDE_LAYERS[sequence_parallel]


def test_tp_ranks_share_one_graph():
    programs = [rank_program(4, r, True) for r in range(4)]
    for graph in ("forward", "backward"):
        keys = {graph_key(getattr(p.stages[0], graph)) for p in programs}
        assert len(keys) == 1, f"{graph} graphs differ between tp ranks"
    assert len({graph_key(p.optimizer.graph) for p in programs}) == 1
    assert [p.stages[0].rank_constants for p in programs] == [{"tp_rank": r} for r in range(4)]


def test_shards_follow_megatron():
    params = {p.name: p for p in rank_program(4, 0, False).layout.params}
    assert params["transformer.h.0.attn.c_attn.weight"].shards == (Shard("tp", 0, parts=(64, 64, 64)),)  # by heads
    assert params["transformer.h.0.attn.c_proj.weight"].shards == (Shard("tp", 1),)
    assert params["transformer.h.0.attn.c_proj.bias"].shards == ()  # added once, after the sum
    assert params["transformer.h.0.mlp.c_fc.weight"].shards == (Shard("tp", 0),)
    assert params["transformer.h.0.mlp.c_proj.weight"].shards == (Shard("tp", 1),)
    assert params["transformer.wte.weight"].shards == (Shard("tp", 0, padded_size=512),)  # 128 * 4


def test_plan_mismatch_names_the_node():
    config = small_config(tp=2, tp_plan=("transformer.h.*.mlp.c_fc=column",))
    with pytest.raises(Exception, match=r"node linear_3 \(aten.linear.default\) is a linear over a tensor cut by "
                                        r"transformer.h.0.mlp.c_fc.*gpt2.py:\d+: return self.dropout"):
        build_rank_program(config, Coords.from_rank(0, {"tp": 2}), log=lambda _: None)


def test_a_product_of_a_cut_and_a_whole_linear_names_the_linear_to_cut():
    """SwiGLU's silu(gate(x)) * up(x) with up cut and gate left whole: the refusal says to cut gate too."""
    plan = "model.layers.*.self_attn.[qkv]_proj=column,model.layers.*.self_attn.o_proj=row," \
           "model.layers.*.mlp.up_proj=column,model.layers.*.mlp.down_proj=row"
    config, _ = parse_args(["--config", "configs/llama-tiny.toml", "--tp", "2", "--tp-plan", plan])
    with pytest.raises(Exception, match=r"with silu, which is whole along that dim \(size \d+\); make "
                                        r"model.layers.0.mlp.gate_proj column-parallel in tp_plan, as "
                                        r"model.layers.0.mlp.up_proj is \[at gcompile/models/llama.py"):
        build_rank_program(config, Coords.from_rank(0, config.mesh_sizes), log=lambda _: None)


@pytest.mark.parametrize("argv, message", [
    (["--tp", "3", "--n-head", "4"], "n_head=4 is not divisible by tp=3; choose a tp that divides it"),
    (["--tp", "3", "--tp-plan", "*.mlp.c_fc=column,*.mlp.c_proj=row"],
     "ffn hidden size 4*n_embd=512 is not divisible by tp=3"),
    (["--tp", "3", "--tp-plan", "*.mlp.c_proj=column"], "hidden size n_embd=128 is not divisible by tp=3"),
    (["--tp", "2", "--sequence-parallel", "--seq-length", "63"], "seq_length=63 is not divisible by tp=2"),
    (["--tp-plan", "attention"], "tp_plan entry 'attention' must be pattern=placement"),
    (["--tp-plan", "*.c_fc=diagonal"], "placement must be one of column, row, vocab, replicate"),
    (["--tp-plan", "*.c_fcc=column"], "tp_plan entry '*.c_fcc=column' matches no module"),
    (["--tp-plan", "transformer.wte=column"], "transformer.wte is Embedding, but column applies to Linear"),
    (["--make-vocab-size-divisible-by", "0"], "make-vocab-size-divisible-by=0 must be at least 1"),
])
def test_bad_parallel_flags(argv, message, capsys):
    assert run_gpt.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
