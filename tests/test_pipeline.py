"""Pipeline parallel: the split, the schedule runtime (in one process, and on real gloo ranks), and bad input.

Numerics: per-step losses, gradient norms and final parameters of every layout equal
single-device eager autograd + AdamW (tests/reference.py) within 1e-5 relative (fp32);
the key bias is compared by its premise (reference.py). One global batch of 8 samples
serves every microbatch count (m = 8 / micro_batch_size). Cases of one world size share
one launch of ranks, because starting them costs more than the cases; the cases outside
ON_RANKS run every rank in this process (gcompile.harness: the same Runtime, its P2P
through in-process mailboxes), which is faster still.
"""

import dataclasses
import functools
import json
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.export.graph_signature import InputKind

import run_gpt
from gcompile import harness
from gcompile.capture import capture
from gcompile.check import check_plan, estimate_memory
from gcompile.compile import Compiler, compile_rank_program, graph_key
from gcompile.config import build_config, load_toml
from gcompile.layout import Param
from gcompile.axes import Coords
from gcompile.models.gpt2 import GPT2
from gcompile.instructions import lower_instructions
from gcompile.pass_manager import PassContext, PassError, run_passes
from gcompile.pipeline import BuildCache, build_rank_program
from gcompile.program import Program, Stage
from gcompile.runtime import InFlightError, Runtime
from gcompile.schedule import Schedule, build_schedule, gpipe, simulate
from gcompile.state import TrainState
from gcompile.train import split_microbatches
from gcompile.world import build_world
from tests.multirank import run_layouts
from tests.reference import (ADAM_EPS, random_batches, reference_run, rel_err, without_key_bias)
from tests.test_single_rank import run_gcompile

TOL = 1e-5
STEPS = 3
LRS = [1e-3, 6e-4, 3e-4]
GLOBAL_BATCH = 8


def config(pp=1, vpp=1, schedule=None, m=4, n_layer=4, tp=1, layers=(), sequence_parallel=False, **train):
    parallel = dict(tp=tp, pp=pp, virtual_pipeline_size=vpp, pipeline_layers=layers,
                    sequence_parallel=sequence_parallel)
    if schedule:
        parallel["pipeline_schedule"] = schedule
    return build_config({
        "model": dict(n_layer=n_layer, n_head=4, n_embd=64, block_size=32),
        "parallel": parallel,
        "train": dict(micro_batch_size=GLOBAL_BATCH // m, global_batch_size=GLOBAL_BATCH, seq_length=32,
                      lr=1e-3, clip_grad=0.5, weight_decay=0.1, adam_eps=ADAM_EPS, **train),
    })


# Every multi-rank case; cases of one world size (and speed) run in one launch.
CASES = {
    "pp2-1f1b-m1": config(pp=2, schedule="1f1b", m=1),
    "pp2-1f1b-m4": config(pp=2, schedule="1f1b", m=4),
    "pp2-gpipe-m8": config(pp=2, schedule="gpipe", m=8),
    "pp2-interleaved-m4": config(pp=2, vpp=2, schedule="interleaved", m=4),
    "pp2-interleaved-m8": config(pp=2, vpp=2, schedule="interleaved", m=8),
    "pp2-interleaved-vpp3-m4": config(pp=2, vpp=3, schedule="interleaved", m=4, n_layer=6),
    "pp2-1f1b-m4-recompute": config(pp=2, schedule="1f1b", m=4, recompute_activations=True),
    "pp2-layers-3-1": config(pp=2, schedule="1f1b", m=4, layers=(3, 1)),
    "pp4-1f1b-m4": config(pp=4, schedule="1f1b", m=4),
    "pp4-gpipe-m8": config(pp=4, schedule="gpipe", m=8),
    "tp2-pp2-1f1b-m4": config(tp=2, pp=2, schedule="1f1b", m=4),
    "tp2-pp2-interleaved-m4-sp": config(tp=2, pp=2, vpp=2, schedule="interleaved", m=4, sequence_parallel=True),
    "pp2-zb1f1b-m4": config(pp=2, schedule="zb1f1b", m=4),
    "pp4-zb1f1b-m8": config(pp=4, schedule="zb1f1b", m=8),
    "tp2-pp2-zb1f1b-m4-sp": config(tp=2, pp=2, schedule="zb1f1b", m=4, sequence_parallel=True),
}
SLOW_CASES = {
    "pp2-1f1b-m4-compiled": config(pp=2, schedule="1f1b", m=4, compile=True),
    "pp2-interleaved-m4-compiled": config(pp=2, vpp=2, schedule="interleaved", m=4, compile=True),
    "pp4-interleaved-m8": config(pp=4, vpp=2, schedule="interleaved", m=8, n_layer=8),
    "tp2-pp2-1f1b-m4-compiled": config(tp=2, pp=2, schedule="1f1b", m=4, compile=True),
    "pp2-zb1f1b-m4-compiled": config(pp=2, schedule="zb1f1b", m=4, compile=True),
}
ALL_CASES = {**CASES, **SLOW_CASES}
ON_RANKS = {"pp2-1f1b-m4", "pp2-interleaved-m4", *(c for c in SLOW_CASES if SLOW_CASES[c].train.compile)}
"""Cases run on real gloo ranks (P2P, compile); the others run every rank in this process (gcompile.harness)."""
CASE_PARAMS = list(CASES) + [pytest.param(case, marks=pytest.mark.slow) for case in SLOW_CASES]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """`result(case)`: on first use, runs the case in this process, or, for a case ON_RANKS, the whole
    launch of its world size and speed class."""
    done, cache = {}, BuildCache()

    def result(case: str):
        if case not in ON_RANKS:
            if case not in done:
                (done[case],) = harness.run_layouts([ALL_CASES[case]], batches(), LRS, cache=cache)
            return done[case]
        group = (ALL_CASES[case].world_size, case in SLOW_CASES)
        if group not in done:
            names = [c for c in ALL_CASES if c in ON_RANKS and (ALL_CASES[c].world_size, c in SLOW_CASES) == group]
            path = tmp_path_factory.mktemp(f"world{group[0]}{'_slow' if group[1] else ''}")
            configs = [ALL_CASES[c] for c in names]
            done[group] = dict(zip(names, run_layouts(path, configs, batches(), LRS)))
        return done[group][case]
    return result


@functools.cache
def batches():
    return random_batches(config(), STEPS)


@functools.cache
def reference(n_layer: int, m: int):
    return reference_run(config(m=m, n_layer=n_layer), batches(), LRS)


def assert_matches_reference(cfg, losses, grad_norms, params):
    expected = reference(cfg.model.n_layer, cfg.num_microbatches)
    C = cfg.model.n_embd
    for step, ref in enumerate(expected):
        assert abs(losses[step] - ref.loss) / ref.loss < TOL, f"step {step} loss {losses[step]} != {ref.loss}"
        assert abs(grad_norms[step] - ref.grad_norm) / ref.grad_norm < TOL, f"step {step} grad norm"
    final = expected[-1].params
    assert sorted(params) == sorted(final)
    for name in final:
        assert rel_err(without_key_bias(name, params[name], C), without_key_bias(name, final[name], C)) < TOL, name


# --- numerics of every layout ----------------------------------------------------------------------

@pytest.mark.parametrize("case", CASE_PARAMS)
def test_matches_single_device(case, launched):
    result = launched(case)
    assert_matches_reference(ALL_CASES[case], result.losses, result.grad_norms, result.params)


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_saved_activations_reach_the_schedule_bound(case, launched):
    """The runtime stops past the promised bound; here each stage and rank must also reach it.
    Expected: GPipe holds all m, 1F1B and ZB-H1 min(pp - rank, m) (ZB-H1's W keeps less, counted
    apart), interleaved Megatron's warmup + 1 per rank and, per stage, what the simulator counts."""
    cfg, result = ALL_CASES[case], launched(case)
    p, m = cfg.parallel, cfg.num_microbatches
    simulated = simulate(build_schedule(p.pipeline_schedule, p.pp, p.virtual_pipeline_size, m))
    for report in result.ranks:
        rank = report["coords"].axis_rank("pp")
        if p.pipeline_schedule == "gpipe":
            per_rank = m
        elif p.pipeline_schedule in ("1f1b", "zb1f1b"):
            per_rank = min(p.pp - rank, m)
        else:
            per_rank = min((p.pp - rank - 1) * 2 + (p.virtual_pipeline_size - 1) * p.pp + 1,
                           m * p.virtual_pipeline_size)
        per_stage = {s: simulated.peak_in_flight[s] for s in report["peak_saved"]}
        if p.virtual_pipeline_size == 1:
            per_stage = {rank: per_rank}
        assert report["peak_saved"] == per_stage, f"pp rank {rank}"
        assert report["rank_peak_saved"] == per_rank, f"pp rank {rank}"


def test_tied_embedding_copies_stay_equal(launched):
    """The two wte copies (first and last rank) get the summed gradient, so they never drift apart."""
    ranks = launched("pp4-1f1b-m4").ranks
    first, last = ranks[0], ranks[-1]
    name = "transformer.wte.weight"
    assert [p.tied_copy for p in first["params"] if p.name == name] == [False]
    assert [p.tied_copy for p in last["params"] if p.name == name] == [True]
    assert torch.equal(first["values"][name], last["values"][name])


def test_interleaved_on_one_rank_matches_single_device():
    cfg = config(vpp=2, m=4)  # 2 stages on one rank: the tied wte is one buffer read by both
    assert cfg.parallel.pipeline_schedule == "interleaved"
    results = run_gcompile(cfg, batches(), LRS, compile=False)
    assert_matches_reference(cfg, [r[0] for r in results], [r[1] for r in results], results[-1][3])
    program = build_rank_program(cfg, Coords.from_rank(0, {}), log=lambda _: None)
    assert [p.name for p in program.layout.params].count("transformer.wte.weight") == 1
    assert not any(p.tied_copy or p.tied_group for p in program.layout.params)


def test_runtime_refuses_more_in_flight_than_promised():
    cfg = config(m=2)
    program = build_rank_program(cfg, Coords.from_rank(0, {}), log=lambda _: None)
    # GPipe's order under the 1f1b name: 1F1B on one rank promises one microbatch in flight
    schedule = Schedule("1f1b", 1, 1, 2, gpipe(1, 2).actions)
    program = dataclasses.replace(program, schedule=schedule,
                                  instructions=lower_instructions(schedule, program.coords, frozenset()))
    with pytest.raises(InFlightError, match=r"0F1: stage 0 holds 2 saved-activation sets, more than the 1f1b "
                                            r"schedule's bound of 1"):
        run_gcompile_program(cfg, program)


def run_gcompile_program(cfg, program):
    functions, step = compile_rank_program(program, Compiler(enabled=False))
    runtime = Runtime(program, functions, step, TrainState.initial(program, cfg.model, cfg.train.seed, "cpu"))
    runtime.forward_backward(split_microbatches(batches()[0], cfg.train.micro_batch_size))


# --- the split, in one process ---------------------------------------------------------------------

def capture_gpt(cfg, micro_batch_size: int, seq_length: int) -> Program:
    return capture(functools.partial(GPT2.module, cfg.model), GPT2.example_batch(micro_batch_size, seq_length),
                   GPT2.decays)


def split(cfg, pp_rank: int) -> Program:
    program = capture_gpt(cfg, cfg.train.micro_batch_size, cfg.train.seq_length)
    return run_passes(program, ["pipeline_split"], PassContext(cfg, Coords.from_rank(pp_rank, {"pp": cfg.parallel.pp})),
                      log=lambda _: None)


def blocks_of(stage: Stage) -> list[int]:
    return sorted({int(p.name.split(".")[2]) for p in stage.params if p.name.startswith("transformer.h.")})


def ops_of(stage: Stage) -> set[str]:
    return {str(n.target) for n in stage.graph.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("pp, vpp, layers, expected", [
    (2, 1, (), {0: [0, 1], 1: [2, 3]}),
    (4, 1, (), {0: [0], 1: [1], 2: [2], 3: [3]}),
    (2, 2, (), {0: [0], 1: [1], 2: [2], 3: [3]}),
    (2, 1, (3, 1), {0: [0, 1, 2], 1: [3]}),
    (2, 2, (1, 2, 2, 1), {0: [0], 1: [1, 2], 2: [3, 4], 3: [5]}),
])
def test_stage_boundaries(pp, vpp, layers, expected):
    n_layer = sum(len(v) for v in expected.values())
    cfg = config(pp=pp, vpp=vpp, layers=layers, n_layer=n_layer, m=4)
    last = pp * vpp - 1
    order = [p.name for p in capture_gpt(cfg, 2, 32).stages[0].params]
    for rank in range(pp):
        program = split(cfg, rank)
        assert [s.index for s in program.stages] == [s for s in range(pp * vpp) if s % pp == rank]
        for stage in program.stages:
            assert blocks_of(stage) == expected[stage.index]
            first, final = stage.index == 0, stage.index == last
            assert stage.inputs == (["idx"] if first else ["act0"] + (["targets"] if final else []))
            assert stage.outputs == (["loss"] if final else ["act0"])
            assert ("aten.embedding.default" in ops_of(stage)) == first
            assert ("aten.cross_entropy_loss.default" in ops_of(stage)) == final
            names = [p.name for p in stage.params]
            assert ("transformer.ln_f.weight" in names) == final and ("transformer.wpe.weight" in names) == first
            # placeholders: own parameters in the program's order, then the inputs
            placeholders = [n.name for n in stage.placeholders()]
            assert placeholders[len(names):] == stage.inputs
            assert names == sorted(names, key=order.index)


def test_tied_copy_flags():
    cfg = config(pp=2, vpp=2, m=4)
    wte = {s.index: p for r in range(2) for s in split(cfg, r).stages for p in s.params
           if p.name == "transformer.wte.weight"}
    assert sorted(wte) == [0, 3]  # embedding on the first stage, head on the last
    assert (wte[0].tied_copy, wte[0].tied_group) == (False, "embd")
    assert (wte[3].tied_copy, wte[3].tied_group) == (True, "embd")
    # one rank holding both: the same parameter, no copy, nothing to sum
    one_rank = {s.index: p for s in split(config(vpp=2, m=4), 0).stages for p in s.params
                if p.name == "transformer.wte.weight"}
    assert one_rank[0] == one_rank[1] == Param("transformer.wte.weight", one_rank[0].full_shape)


def test_split_stages_compute_the_model():
    """The stage graphs chained in one process give eager's loss and gradients (the tied wte's two
    uses summed by autograd)."""
    cfg = config(pp=2, vpp=2, m=4)
    stages = sorted((s for r in range(2) for s in split(cfg, r).stages), key=lambda s: s.index)
    tokens = batches()[0][:2]
    idx, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    chained, eager = GPT2.build(cfg.model, cfg.train.seed), GPT2.build(cfg.model, cfg.train.seed)
    params = dict(chained.named_parameters())
    acts = []
    for stage in stages:
        fixed = {"idx": idx, "targets": targets}
        received = iter(acts)
        acts = list(stage.graph(*[params[p.name] for p in stage.params],
                                *[fixed[r] if r in fixed else next(received) for r in stage.inputs]))
    (loss,) = acts
    loss.backward()
    expected = eager(idx, targets)
    expected.backward()
    assert rel_err(loss.detach(), expected.detach()) < 1e-6
    for name, p in eager.named_parameters():
        assert rel_err(params[name].grad, p.grad) < TOL, name


def test_identical_middle_stages_are_lowered_once():
    """pp4 of 8 layers: stages 1 and 2 (layers 2-3, 4-5) differ only in their names; a build lowers one of them
    and gives the other the very graphs its own lowering gives (numerics: the pp4 cases above, whose middle
    stages share a lowering this way)."""
    cfg, logs = config(pp=4, n_layer=8, m=4), []
    origin = Coords.from_rank(0, cfg.mesh_sizes)
    cache = BuildCache()
    shared = [build_rank_program(cfg, origin.moved(pp=r), log=logs.append, cache=cache) for r in range(4)]
    assert [line.split(" with")[0] for line in logs if line.startswith("lowered")] == \
        ["lowered stage 0", "lowered stage 1", "lowered stage 3"]
    alone = build_rank_program(cfg, origin.moved(pp=2), log=lambda _: None)
    for graph in ("forward", "backward"):
        assert graph_key(getattr(shared[2].stages[2], graph)) == graph_key(getattr(alone.stages[2], graph))
    assert shared[2].stages[2].params == alone.stages[2].params != shared[1].stages[1].params


def test_zero_bubble_backward_split():
    """B keeps the input gradient and what it computes anyway (LayerNorm's weight and bias come out of
    the op that makes its input gradient); each linear layer's weight gradient, one mm, is W's; the
    first stage, whose input (token ids) takes no gradient, runs its whole backward in B."""
    programs = build_world(config(pp=2, schedule="zb1f1b", m=4), log=lambda _: None)
    assert programs[0].stages[0].backward_weight is None
    stage = programs[1].stages[1]
    b_out = stage.backward.graph.output_node().args[0]
    w_out = stage.backward_weight.graph.output_node().args[0]
    n = len(stage.params)
    assert b_out[n] is not None and len(b_out) == n + 2 + stage.num_stash  # grads of act0 and targets (None)
    for p, in_b, in_w in zip(stage.params, b_out, w_out):
        assert (in_b is None) != (in_w is None), p.name
        assert (in_w is not None) == (len(p.full_shape) == 2 or p.name.endswith(("c_attn.bias", "c_proj.bias",
                                                                                  "c_fc.bias"))), p.name

    def mms(gm):
        return sum(node.target == torch.ops.aten.mm.default for node in gm.graph.nodes)
    linears = sum(len(p.full_shape) == 2 for p in stage.params)
    assert mms(stage.backward_weight) == linears
    whole = build_world(config(pp=2, schedule="1f1b", m=4), log=lambda _: None)
    assert mms(stage.backward) + linears == mms(whole[1].stages[1].backward)
    assert "ranks agree" in check_plan(programs)  # the checker walks W's graphs too
    assert estimate_memory(programs[1]).activations > estimate_memory(whole[1]).activations


# --- the split refuses what it cannot do -----------------------------------------------------------

class Chain(nn.Module):
    """Blocks of Linear layers on an embedding; `variant` adds what the split must refuse."""

    def __init__(self, variant: str):
        super().__init__()
        self.wte = nn.Embedding(16, 8)
        self.h = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.variant = variant

    def forward(self, idx, targets):
        x0 = self.h[0](self.wte(idx))
        x = self.h[1](x0)
        if self.variant == "shared":
            x = x * self.wte.weight.mean()  # wte read on stage 1 of 3: only first and last may share
        x = self.h[2](x)
        if self.variant == "skip":
            x = x + x0  # stage 2 reads block 0's output from stage 0
        return F.cross_entropy(x.view(-1, 8), targets.view(-1) % 8)


def program_of(module: nn.Module, rank_constants: dict[str, int] | None = None) -> Program:
    """Capture `module(idx, targets, *rank constants)` as capture() does a model (no tied weights here)."""
    idx = torch.zeros(2, 4, dtype=torch.long)
    constants = [torch.tensor(v) for v in (rank_constants or {}).values()]
    exported = torch.export.export(module, (idx, idx.clone(), *constants))  # distinct, or export merges them
    nodes = list(exported.graph_module.graph.find_nodes(op="placeholder"))
    params = [Param(spec.target, tuple(node.meta["val"].shape))
              for spec, node in zip(exported.graph_signature.input_specs, nodes) if spec.kind == InputKind.PARAMETER]
    stage = Stage(index=0, graph=exported.graph_module, params=params, inputs=["idx", "targets", *(rank_constants or {})],
                  outputs=["loss"], rank_constants=dict(rank_constants or {}))
    return Program(stages=[stage], history=["capture"])


class Shifted(nn.Module):
    """The embedding and the loss both read a rank constant, as vocab-parallel layers read their shard's start."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(16, 8)
        self.h = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, idx, targets, vocab_start):
        x = self.h[1](self.h[0](self.wte(idx - vocab_start)))
        return F.cross_entropy(x.view(-1, 8), (targets - vocab_start).view(-1) % 8)


def tagged(x):
    """Stands for a module-level wrapper a pass inserts (a differentiable collective)."""
    return x * 1.0


def test_rank_constants_and_wrapper_calls_follow_their_readers():
    cfg = config(pp=2, n_layer=2, m=4)
    program = program_of(Shifted(), {"vocab_start": 3})
    graph = program.stages[0].graph.graph
    block1 = next(n for n in graph.nodes if n.target == torch.ops.aten.linear.default and n.args[1].name == "p_h_1_weight")
    wte = program.stages[0].param_nodes()["wte.weight"]
    for value in (block1, wte):  # wrappers with no module: one after a block, one around a parameter
        with graph.inserting_after(value):
            wrapper = graph.call_function(tagged, (value,))
        value.replace_all_uses_with(wrapper, delete_user_cb=lambda user: user is not wrapper)
    stages = [run_passes(program.clone(), ["pipeline_split"], PassContext(cfg, Coords.from_rank(r, {"pp": 2})),
                         log=lambda _: None).stages[0] for r in range(2)]
    assert [s.inputs for s in stages] == [["idx", "vocab_start"], ["act0", "targets", "vocab_start"]]
    assert [s.rank_constants for s in stages] == [{"vocab_start": 3}, {"vocab_start": 3}]
    assert [[p.name for p in s.params] for s in stages] == [["wte.weight", "h.0.weight", "h.0.bias"],
                                                            ["h.1.weight", "h.1.bias"]]
    assert [sum(n.target is tagged for n in s.graph.graph.nodes) for s in stages] == [1, 1]


@pytest.mark.parametrize("variant, message", [
    ("skip", r"stage 2 reads a tensor made on stage 0, but a stage can only read what the stage right before it "
             r"made; reader add \(aten.add\) at tests/test_pipeline.py:\d+: x = x \+ x0 .*; "
             r"tensor linear \(aten.linear\) at tests/test_pipeline.py:\d+: x0 = self.h\[0\]\(self.wte\(idx\)\)"),
    ("shared", r"parameter wte.weight is read on pipeline ranks \[0, 1\] \(stages \[0, 1\]\); a parameter may be "
               r"shared only by the first and last rank"),
])
def test_split_errors_name_the_node(variant, message):
    cfg = config(pp=3, n_layer=3, m=3)
    with pytest.raises(PassError, match=r"pass 1 'pipeline_split' failed \(after capture\): ValueError: " + message):
        run_passes(program_of(Chain(variant)), ["pipeline_split"], PassContext(cfg, Coords.from_rank(0, {"pp": 3})),
                   log=lambda _: None)


def test_split_needs_blocks_and_one_stage():
    class NoBlocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(16, 8)

        def forward(self, idx, targets):
            return F.cross_entropy(self.wte(idx).view(-1, 8), targets.view(-1) % 8)

    cfg = config(pp=2, m=4)
    ctx = PassContext(cfg, Coords.from_rank(0, {"pp": 2}))
    with pytest.raises(PassError, match=r"expected the blocks <list>.0 .. <list>.N-1 of one module list"):
        run_passes(program_of(NoBlocks()), ["pipeline_split"], ctx, log=lambda _: None)
    with pytest.raises(PassError, match=r"pipeline_split expects the one-stage program, got 2 stages"):
        run_passes(split(config(pp=1, vpp=2, m=4), 0), ["pipeline_split"], ctx, log=lambda _: None)


# --- bad input -------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--pp", "2", "--n-layer", "5"], "n_layer=5 cannot be split into pp 2 * vpp 1 = 2 stages of whole layers"),
    (["--pp", "2", "--virtual-pipeline-size", "2", "--n-layer", "5"],
     "n_layer=5 cannot be split into pp 2 * vpp 2 = 4 stages of whole layers"),
    (["--pp", "2", "--virtual-pipeline-size", "2", "--n-layer", "2"],
     "n_layer=2 cannot be split into pp 2 * vpp 2 = 4 stages of whole layers; use at most 2 stages (pp * vpp; "
     "--pipeline-layers for an uneven split) or a multiple of 4 layers"),
    (["--pp", "2", "--n-layer", "1"], "n_layer=1 cannot be split into pp 2 * vpp 1 = 2 stages of whole layers; use "
                                      "at most 1 stage (pp * vpp;"),
    (["--pp", "2", "--pipeline-layers", "3,2"], "pipeline_layers=3,2 sums to 5, not n_layer=4"),
    (["--pp", "2", "--pipeline-layers", "4"], "pipeline_layers=4 has 1 entries for pp 2 * vpp 1 = 2 stages"),
    (["--pp", "2", "--pipeline-layers", "4,0"], "pipeline_layers=4,0: every stage needs at least one layer"),
    (["--pp", "2", "--pipeline-layers", "3,x"], "--pipeline-layers='x' is not a valid int"),
    (["--pp", "4", "--virtual-pipeline-size", "2", "--n-layer", "8"],
     "interleaved schedule needs num_microbatches (2) divisible by pp (4), where num_microbatches = "
     "global_batch_size 16 / (micro_batch_size 8 * dp 1)"),
    (["--pp", "2", "--virtual-pipeline-size", "2", "--pipeline-schedule", "zb1f1b"],
     "zb1f1b schedule runs one stage per rank (vpp=1), got vpp=2"),
    (["--pp", "2", "--dp", "2", "--pipeline-schedule", "zb1f1b", "--overlap-grad-reduce"],
     "--overlap-grad-reduce and --pipeline-schedule zb1f1b do not combine yet"),
    (["--pp", "2", "--virtual-pipeline-size", "2", "--pipeline-schedule", "1f1b"],
     "1f1b schedule runs one stage per rank (vpp=1), got vpp=2"),
    (["--pp", "2", "--pipeline-schedule", "interleaved"], "interleaved schedule needs vpp >= 2, got vpp=1"),
    (["--pp", "2", "--num-layers-per-virtual-pipeline-stage", "3"],
     "num_layers_per_virtual_pipeline_stage=3 * pp 2 * vpp 1 = 6 is not n_layer=4"),
])
def test_bad_pipeline_flags(argv, message, capsys):
    status = run_gpt.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2
    assert len(err) == 1 and message in err[0], err


def test_megatron_interleaving_flag():
    cfg = build_config({"model": dict(n_layer=8), "parallel": dict(pp=2, num_layers_per_virtual_pipeline_stage=2),
                        "train": dict(micro_batch_size=2, global_batch_size=8)})
    assert (cfg.parallel.virtual_pipeline_size, cfg.parallel.pipeline_schedule) == (2, "interleaved")


def test_pipeline_layers_as_a_toml_list(tmp_path):
    """README's `[parallel] pipeline_layers = [3, 1]`: a TOML list of integers (was an AttributeError from
    `int.strip` in _coerce), and a list of strings with spaces alike."""
    (tmp_path / "a.toml").write_text('[parallel]\npp = 2\npipeline_layers = [3, 1]\n'
                                     'tp_plan = [" transformer.wte=vocab ", "transformer.h.*.mlp.c_fc=column"]\n')
    parallel = load_toml(str(tmp_path / "a.toml"))["parallel"]
    assert parallel["pipeline_layers"] == (3, 1)
    assert parallel["tp_plan"] == ("transformer.wte=vocab", "transformer.h.*.mlp.c_fc=column")
    cfg = build_config({"model": dict(n_layer=4), "parallel": parallel})
    assert cfg.parallel.pipeline_layers == (3, 1)


# --- the command line ------------------------------------------------------------------------------

@pytest.mark.slow
def test_run_gpt_pp2_trains_like_one_device(tmp_path):
    def losses(run_dir, *flags):
        subprocess.run([sys.executable, "run_gpt.py", "--config", "configs/tiny.toml", "--train-iters", "3",
                        "--eval-interval", "0", "--run-dir", str(run_dir), *flags], check=True, capture_output=True)
        return [json.loads(line)["lm_loss"] for line in open(run_dir / "metrics.jsonl")]

    one = losses(tmp_path / "one")
    two = losses(tmp_path / "pp2", "--pp", "2", "--dump-schedule")
    assert two == pytest.approx(one, rel=TOL)
    assert (tmp_path / "pp2" / "schedule.svg").exists()
    assert "rank1 | 1RECV_F0 1F0" in (tmp_path / "pp2" / "schedule.txt").read_text()


def test_unknown_schedule_is_one_error(capsys):
    """Not also a second complaint from the schedule's size check."""
    assert run_gpt.main(["--pp", "2", "--pipeline-schedule", "zb"]) == 2
    assert capsys.readouterr().err.strip() == \
        "run_gpt.py: error: pipeline_schedule='zb' must be gpipe, 1f1b, interleaved or zb1f1b"
