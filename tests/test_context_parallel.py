"""Context parallel (passes/context_parallel.py) against single-device eager, and what its graphs hold.

Numerics as in tests/test_data_parallel.py: fp32, 1e-5 relative on losses, grad norms and final
parameters after 3 steps on random batches, every rank in this process (gcompile.harness). GPT-2
carries positions as arange + wpe, Llama as RoPE tables with grouped-query attention: the pass
must give each token its global position in both without naming either model.
"""

import pytest
import torch

import run_gpt

from gcompile import cp_ops, harness, ring_attention
from gcompile.axes import Coords
from gcompile.check import estimate_memory
from gcompile.config import build_config
from gcompile.flops import node_flops
from gcompile.collectives import collective_nodes
from gcompile.cp_ops import positions
from gcompile.pipeline import build_rank_program, builtin_passes
from gcompile.program import SHAPE_FUNCTIONS
from gcompile.ring_attention import block, block_backward, block_backward_by_formula, block_by_formula
from gcompile.torch_api import FakeTensorMode
from gcompile.train import train
from tests import test_llama
from tests.multirank import assert_succeeded, launch, run_layouts
from tests.test_checkpoint import N, WORKER, assert_close, assert_resume_is_exact, cut_resumed_straight, losses
from tests.test_checkpoint import config as checkpoint_config
from tests.test_memory import measured_step
from tests.test_data_parallel import BUILD, LRS, check_dp_cases, in_one_process, small_config
from tests.test_own_model import assert_trains_as_one_device, attention_form
from tests.reference import rel_err


def test_layout_is_megatrons_load_balanced_one():
    """2n chunks; rank i holds chunks i and 2n-1-i, so all ranks together hold every position once."""
    assert positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert sorted(torch.cat([positions(16, 4, r) for r in range(4)]).tolist()) == list(range(16))


P2P, ALL_GATHER, A2A = dict(cp_comm_type="p2p"), dict(cp_comm_type="all_gather"), dict(cp_comm_type="a2a")
# p2p is the default


def test_gpt2_matches_eager():
    check_dp_cases({"cp2": small_config(cp=2), "cp4": small_config(cp=4), "cp2 dp2": small_config(cp=2, dp=2),
                    "cp2 dp2 distributed optimizer": small_config(cp=2, dp=2, use_distributed_optimizer=True),
                    "cp2 dp2 optim_grads": small_config(cp=2, dp=2, data_parallel_sharding_strategy="optim_grads"),
                    "cp2 dp2 ZeRO-3": small_config(cp=2, dp=2, data_parallel_sharding_strategy="optim_grads_params")},
                   in_one_process)


@pytest.mark.parametrize("comm_type", ["p2p", "a2a"])
def test_ignored_targets_count_as_on_one_device(comm_type, tmp_path):
    """A model that ignores some targets (ignore_index, as a padded or prompt-masked batch does): the cp ranks'
    tokens hold different numbers of them, and the micro-batch's mean is over the counted tokens of all. The
    mean of the ranks' means was 1.7e-4 off in the loss and 0.15 in a parameter."""
    source = open("examples/parallel_block.py").read().replace('"parallel_block"', f'"ignoring_{comm_type}"')
    masked = "        targets = targets.masked_fill(targets % 7 == 0, -100)\n"
    (tmp_path / "model.py").write_text(source.replace("        return F.cross_entropy(", masked + "        return F.cross_entropy("))
    assert_trains_as_one_device(f"{tmp_path}/model.py:SPEC", n_head=4, cp=2, cp_comm_type=comm_type)


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
def test_kv_heads_repeated_by_repeat_interleave(comm_type, tmp_path):
    """GQA as Qwen writes it: each kv head repeated for its query heads along the heads dim, which cp leaves
    whole (it was refused as not token-wise)."""
    arch = attention_form("gqa-repeat-interleave", f"cp_gqa_{comm_type}", tmp_path)
    assert_trains_as_one_device(arch, n_head=8, cp=2, cp_comm_type=comm_type)


@pytest.mark.parametrize("form, parallel", [("gqa-sdpa", dict(cp=2)), ("mqa-sdpa", dict(tp=2, cp=2))],
                         ids=["gqa-cp2", "mqa-tp2-cp2"])
def test_the_ring_takes_grouped_kv_heads_through_enable_gqa(form, parallel, tmp_path):
    """Fewer kv heads than queries (SDPA's enable_gqa) travel round the p2p ring as they are, are repeated for
    their query heads in each block, and their gradients summed back (it was refused)."""
    arch = attention_form(form, f"ring_{form}", tmp_path)
    assert_trains_as_one_device(arch, n_head=8, **parallel)


def test_a_head_written_as_a_matmul_works_token_by_token(tmp_path):
    """Falcon's tied head, x @ W.T: a matmul with one operand of the rank's tokens (was refused as attention
    written by hand)."""
    source = open("examples/parallel_block.py").read().replace('"parallel_block"', '"cp_matmul_head"')
    assert "logits = self.head(self.norm(x))" in source
    (tmp_path / "model.py").write_text(source.replace("logits = self.head(self.norm(x))",
                                                      "logits = self.norm(x) @ self.head.weight.T"))
    assert_trains_as_one_device(f"{tmp_path}/model.py:SPEC", n_head=4, cp=2)


@pytest.mark.parametrize("form, parallel", [("matmul-softmax", dict(cp=2, cp_comm_type="a2a")),
                                            ("soft-capped", dict(tp=2, sequence_parallel=True, cp=2,
                                                                 cp_comm_type="a2a")),
                                            ("alibi-by-hand", dict(cp=2, pp=2, cp_comm_type="a2a")),
                                            ("soft-capped", dict(cp=2, cp_comm_type="all_gather")),
                                            ("alibi-by-hand", dict(cp=4, cp_comm_type="all_gather")),
                                            ("causal-mask-buffer", dict(tp=2, cp=2, cp_comm_type="all_gather"))])
def test_attention_written_by_hand_runs_under_a2a_and_all_gather(form, parallel, tmp_path):
    """q @ k^T ... @ v. a2a (Ulysses): q, k^T and v exchanged to the rank's heads over the whole sequence, so the
    scores and what is made of them (nanoGPT's mask, Gemma-2's soft cap, ALiBi's bias per head, cut to the rank's
    heads) are one device's. all_gather: k^T and v gathered, the scores the rank's queries against every key, a
    mask or bias cut to those queries and put in the keys' gathered order."""
    name = f"cp_by_hand_{form.replace('-', '_')}_{parallel['cp_comm_type']}"
    arch = attention_form(form, name, tmp_path)
    assert_trains_as_one_device(arch, n_head=8 if "tp" in parallel else 4, **parallel)


@pytest.mark.parametrize("parallel", [dict(cp=2, cp_comm_type="a2a"), dict(tp=2, cp=2, cp_comm_type="all_gather")],
                         ids=["cp2-a2a", "tp2-cp2-all-gather"])
def test_the_shipped_model_with_attention_by_hand(parallel):
    """examples/attention_by_hand.py, the README's command for it, with a cap its scores reach (at 0.02 the tanh
    bends: it moves the scores at the start by a third), its mask a buffer."""
    assert_trains_as_one_device("examples/attention_by_hand.py:SPEC", n_head=4, model=dict(softcap=0.02), **parallel)


@pytest.mark.parametrize("name, comm_type_and_flags, written, refusal", [
    ("cp_by_hand_p2p", "p2p", None, "node matmul (aten.matmul.default) multiplies values that hold the rank's tokens, as attention "
                  "written by hand does (q @ k^T): context parallel rewrites it with --cp-comm-type a2a or "
                  "all_gather"),
    # the line named is the helper's that made the node, not forward's that called it (HF's eager_attention_forward)
    ("cp_by_hand_in_a_helper", "p2p", ("        att = (q @ k.transpose(-2, -1)) / k.size(-1) ** 0.5\n",
                                       "        def scores(q, k):\n"
                                       "            return (q @ k.transpose(-2, -1)) / k.size(-1) ** 0.5\n"
                                       "        att = scores(q, k)\n"),
     "model.py:50: return (q @ k.transpose(-2, -1)) / k.size(-1) ** 0.5]"),
    ("cp_by_hand_batch_mask", "a2a", ("        att = F.softmax(att.masked_fill(~mask, float('-inf')), dim=-1)\n",
             "        att = F.softmax(att.masked_fill(~mask, float('-inf')), dim=-1)\n"
             "        att = att.masked_fill((x[..., 0] > 0)[:, None, None, :], 0.0)\n"),
     "combines attention scores written by hand with a value that holds the rank's tokens; a mask must be made of "
     "positions"),
    ("cp_by_hand_heads_mean", "a2a", ("y = (att @ v)", "y = (att.mean(1, keepdim=True) @ v)"),
     "reads attention scores written by hand (q @ k^T), which context parallel takes only through element-wise "
     "ops and a softmax over the keys to @ v"),
    ("cp_by_hand_one_head", "a2a --tp 2 --n-head 2", None,
     "has 1 heads on this rank, which cp=2 does not divide; cp_comm_type a2a gives each cp rank 1/cp of the heads "
     "(K and V's too): use --cp-comm-type all_gather, which needs no heads to divide, or heads that tp x cp "
     "divides")])
def test_attention_written_by_hand_is_refused_with_what_to_write(name, comm_type_and_flags, written, refusal,
                                                                  tmp_path, capsys):
    arch = attention_form("matmul-softmax", name, tmp_path)
    if written:
        source = open(arch.partition(":")[0]).read()
        assert written[0] in source
        open(arch.partition(":")[0], "w").write(source.replace(written[0], written[1]))
    assert run_gpt.main(["--arch", arch, "--n-layer", "2", "--cp", "2", "--cp-comm-type", *comm_type_and_flags.split(),
                         "--check-plan"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and refusal in err[0], err


def test_gpt2_all_gather_matches_eager():
    check_dp_cases({"cp2 all_gather": small_config(cp=2, **ALL_GATHER),
                    "cp4 all_gather": small_config(cp=4, **ALL_GATHER),
                    "cp2 dp2 all_gather distributed optimizer": small_config(cp=2, dp=2, use_distributed_optimizer=True,
                                                                             **ALL_GATHER)},
                   in_one_process)


def test_gpt2_with_model_parallel_matches_eager():
    check_dp_cases({"cp2 tp2": small_config(cp=2, tp=2), "cp2 pp2": small_config(cp=2, pp=2),
                    "cp2 tp2 sequence parallel": small_config(cp=2, tp=2, sequence_parallel=True),
                    "cp2 pp2 all_gather": small_config(cp=2, pp=2, **ALL_GATHER),
                    "cp2 tp2 sequence parallel all_gather": small_config(cp=2, tp=2, sequence_parallel=True,
                                                                         **ALL_GATHER)},
                   in_one_process)


def test_gpt2_ulysses_matches_eager():
    """a2a: each rank attends with 1/cp of the heads over the whole sequence (GPT-2 here has 4 heads)."""
    check_dp_cases({"cp2 a2a": small_config(cp=2, **A2A), "cp4 a2a": small_config(cp=4, **A2A),
                    "cp2 dp2 a2a": small_config(cp=2, dp=2, **A2A), "cp2 pp2 a2a": small_config(cp=2, pp=2, **A2A),
                    "cp2 tp2 sequence parallel a2a": small_config(cp=2, tp=2, sequence_parallel=True, **A2A)},
                   in_one_process)


def test_ulysses_exchanges_heads_for_tokens_with_all_to_alls():
    config = small_config(cp=2, **A2A)
    stage = build_rank_program(config, Coords.from_rank(1, config.mesh_sizes), log=lambda _: None).stages[0]
    exchanges = [("all_to_all_single", "cp")] * 8  # q, k, v in and the output out, 2 layers
    counted = [("all_reduce", "cp")]  # the micro-batch's counted targets, at the loss
    assert [(op, args["group_name"]) for _, op, args in collective_nodes(stage.forward)] == exchanges + counted
    assert [(op, args["group_name"]) for _, op, args in collective_nodes(stage.backward)] == exchanges


@pytest.mark.slow
def test_compiled_on_ranks_matches_eager(tmp_path):
    """On gloo ranks, Inductor-compiled: the ring's transfers are real sends, not the harness's, and Ulysses'
    all-to-alls real exchanges."""
    check_dp_cases({"cp2 dp2 compiled": small_config(cp=2, dp=2, compile=True),
                    "cp2 dp2 all_gather compiled": small_config(cp=2, dp=2, compile=True, **ALL_GATHER),
                    "cp2 dp2 a2a compiled": small_config(cp=2, dp=2, compile=True, **A2A)},
                   lambda configs, batches: run_layouts(tmp_path, configs, batches, LRS))


@pytest.mark.parametrize("layout", [dict(cp=2), dict(cp=4), dict(cp=2, tp=2, sequence_parallel=True),
                                    dict(cp=2, **ALL_GATHER), dict(cp=4, **A2A), dict(cp=2, tp=2, **A2A)],
                         ids=["cp2", "cp4", "cp2-tp2-sp", "cp2-all_gather", "cp4-a2a", "cp2-tp2-a2a"])
def test_llama_matches_eager(layout):
    batches, reference = test_llama.expected(False, 2, 1)
    (result,) = harness.run_layouts([test_llama.config(**layout)], batches, LRS, cache=test_llama.BUILD)
    test_llama.assert_matches(result.losses, result.grad_norms, result.params, reference, f"llama {layout}")


@pytest.mark.parametrize("comm_type, at_cp2, at_cp4", [("all_gather", 0.65, 0.4), ("p2p", 0.55, 0.3)])
def test_activations_per_rank_shrink_with_cp(comm_type, at_cp2, at_cp4):
    """Measured saved activations per rank (all ranks alike, and as the estimate says to the byte) at T = 128
    against cp 1. all_gather keeps what does not shrink: the gathered K and V attention's backward reads, and
    the mask; the ring keeps nothing of length T (what it would keep if the partitioner hoisted its backward
    transfers into forward, or shared the forward's score matrices with backward: every block)."""
    held = {}
    for cp in (1, 2, 4):
        cfg = build_config({"model": dict(n_layer=2, n_head=4, n_embd=64, block_size=128),
                            "parallel": dict(cp=cp, cp_comm_type=comm_type),
                            "train": dict(micro_batch_size=1, global_batch_size=8, seq_length=128)})
        ranks = measured_step(cfg, BUILD)
        for peak, _, program in ranks.values():
            assert peak.peak.activations == estimate_memory(program).activations
        held[cp] = {peak.peak.activations for peak, _, _ in ranks.values()}
        assert len(held[cp]) == 1, held  # every rank the same work
    assert max(held[2]) <= at_cp2 * max(held[1]) and max(held[4]) <= at_cp4 * max(held[1]), held


def test_attention_gathers_keys_and_values_and_gradients_average_over_dp_cp():
    config = small_config(cp=2, dp=2, **ALL_GATHER)
    assert builtin_passes(config) == ["context_parallel", "data_parallel"]
    program = build_rank_program(config, Coords.from_rank(1, config.mesh_sizes), log=lambda _: None, cache=BUILD)
    stage = program.stages[0]
    forward = [(op, args["group_name"]) for _, op, args in collective_nodes(stage.forward)]
    backward = [(op, args["group_name"]) for _, op, args in collective_nodes(stage.backward)]
    assert forward == [("all_gather_into_tensor", "cp")] * 4 + [("all_reduce", "cp")]  # K and V of 2 layers, then
    # the micro-batch's counted targets
    assert backward == [("reduce_scatter_tensor", "cp")] * 4
    assert {args["group_name"] for _, op, args in collective_nodes(program.optimizer.graph)} == {"dp_cp"}
    assert stage.rank_constants == {"cp_rank": 1}


def test_the_ring_passes_keys_and_values_round_in_both_directions():
    """cp 4: forward sends K and V 3 steps on; backward sends them round again (in backward, not held from
    forward) and the gradient accumulators 4 steps, the last one home. Nothing is gathered."""
    config = small_config(cp=4, **P2P)
    program = build_rank_program(config, Coords.from_rank(0, config.mesh_sizes), log=lambda _: None, cache=BUILD)
    stage = program.stages[0]
    for graph, per_layer, counted in ((stage.forward, 6, [("all_reduce", "cp")]), (stage.backward, 6 + 4, [])):
        calls = collective_nodes(graph)
        assert [(op, args["group_name"]) for _, op, args in calls] == [("ring_shift", "cp")] * 2 * per_layer + counted
    notes = [args["note"] for _, _, args in collective_nodes(stage.backward)]
    assert notes[:4] == ["backward k 1", "backward v 1", "backward grads 0", "backward k 2"], notes


@pytest.mark.slow
def test_checkpoints_cross_cp_sizes(tmp_path):
    """cp changes nothing a checkpoint holds: a cp2 run cut at N resumes exactly on cp2 and continues on one
    rank, and a one-rank save continues on cp2, each with the losses of the uninterrupted cp2 run."""
    one = tmp_path / "one"
    train(checkpoint_config("--save", one / "save", "--exit-interval", N, "--run-dir", one / "run"),
          Coords.from_rank(0, {}), log=lambda _: None)
    dirs, configs = cut_resumed_straight(tmp_path, {"": ["--cp", 2]})
    configs.append(checkpoint_config("--cp", 2, "--load", one / "save", "--run-dir", tmp_path / "from one" / "run"))
    assert_succeeded(tmp_path, launch(tmp_path, WORKER, dict(configs=configs), world=2))
    assert_resume_is_exact(dirs, "")
    straight = losses(dirs["straight"] / "run")
    assert_close(losses(tmp_path / "from one" / "run"), straight[N:], "a one-rank save continued on cp2")
    train(checkpoint_config("--load", dirs["cut"] / "save", "--run-dir", tmp_path / "to one"),
          Coords.from_rank(0, {}), log=lambda _: None)
    assert_close(losses(tmp_path / "to one"), straight[N:], "a cp2 save continued on one rank")


@pytest.mark.parametrize("causal", [True, False])
def test_ring_blocks_by_formula_match_the_fused_kernels(causal):
    """Off CPU a ring block runs by its formula; on CPU by SDPA's fused kernels: the two agree, the backward
    given another block's output and log-sum-exp too (as every ring step but one gets them)."""
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(2, 3, 8, 16, dtype=torch.float64).float() for _ in range(4))
    out, lse = block(q, k, v, 0.3, causal)
    for fused, formula in zip((out, lse), block_by_formula(q, k, v, 0.3, causal)):
        assert rel_err(formula, fused) < 1e-5
    other_out, other_lse = block(q, k.flip(2), v.flip(2), 0.3, False)
    both_lse = torch.logaddexp(lse, other_lse)
    for fused, formula in zip(block_backward(dout, q, k, v, other_out, both_lse, 0.3, causal),
                              block_backward_by_formula(dout, q, k, v, other_out, both_lse, 0.3, causal)):
        assert rel_err(formula, fused) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shape_propagation_gives_the_ring_output_the_ring_gives(dtype):
    """Propagation makes the ring's output from its shape function (gcompile.program.SHAPE_FUNCTIONS), not by
    walking the ring: the two agree in shape, strides, offset and dtype."""
    with FakeTensorMode():
        q, k, v = (torch.empty(2, 4, 8, 16, dtype=dtype) for _ in range(3))
        args = (q, k, v, 2, torch.tensor(1), True, None, cp_ops.GROUP)
        walked, shaped = ring_attention.attention(*args), ring_attention.output_like(*args)
    assert [(t.shape, t.stride(), t.storage_offset(), t.dtype) for t in (walked, shaped)] == \
        [(walked.shape, walked.stride(), walked.storage_offset(), dtype)] * 2
    assert SHAPE_FUNCTIONS[ring_attention.attention] is ring_attention.output_like


@pytest.mark.parametrize("cp", [2, 4])
def test_a_cp_rank_counts_the_attention_of_its_blocks(cp):
    """The ring's blocks are FLOPs at the attention rate, not bytes: a rank attends 2c queries to its own 2c
    keys (step 0), then two c x c blocks per step, c = T / 2cp; SDPA's formula counts each block in full, as
    it counts the whole causal attention at cp 1. So a rank has (4 + 2 (cp - 1)) / (2 cp)^2 of cp 1's."""
    counted = {}
    for size in (1, cp):
        config = build_config({"model": dict(n_layer=1, n_head=2, n_embd=32, block_size=64),
                               "parallel": dict(cp=size),
                               "train": dict(micro_batch_size=1, global_batch_size=1, seq_length=64)})
        program = build_rank_program(config, Coords.from_rank(0, config.mesh_sizes), log=lambda _: None)
        (stage,) = program.stages.values()
        counted[size] = [sum(node_flops(n) or 0 for n in graph.graph.nodes if "atten" in str(n.target))
                         for graph in (stage.forward, stage.backward)]
    share = (4 + 2 * (cp - 1)) / (2 * cp) ** 2
    assert counted[1][0] > 0 and counted[cp] == [n * share for n in counted[1]]
