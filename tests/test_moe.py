"""Mixture of experts (gcompile/models/moe.py) trains like one device under the passes that exist.

Numerics as everywhere: fp32, relative error at most 1e-5 of losses and grad norms per step and of the
final parameters, against single-device eager autograd + AdamW (tests/reference.py) on random tokens
over 3 steps, every rank in this process. The loss includes the load-balancing term (coefficient 0.01),
so its gradient reaches the routers. Routing is dropless, so every layout routes every token alike.
"""

import pytest
import torch

from gcompile import harness, hf
from gcompile.checkpoint_files import CheckpointError
from gcompile.axes import Coords
from gcompile.config import build_config
from gcompile.cuda_graphs import host_reads
from gcompile.flops import graph_flops
from gcompile.models.moe import MoE, grouped_mm, grouped_mm_weight_grad
from gcompile.pipeline import build_rank_program
from gcompile.report import parse
from gcompile.train import split_microbatches
from gcompile.world import build_world
from tests.reference import ADAM_EPS, random_batches, reference_run, rel_err
from tests.test_llama import assert_matches

LRS = [1e-3, 6e-4, 3e-4]


LLAMA = dict(arch="llama", n_head=8, n_kv_head=4, ffn_hidden_size=96)
DEEPSEEK = dict(moe_router_score_function="sigmoid", moe_shared_expert_intermediate_size=48)
"""DeepSeek-V3's router (sigmoid scores, the top k normalized) and a shared expert."""


def config(model=None, **parallel):
    return build_config({
        "model": dict(dict(n_layer=2, n_head=4, n_embd=64, block_size=32, num_experts=4, moe_router_topk=2,
                           moe_aux_loss_coeff=0.01), **(model or {})),
        "parallel": parallel,
        "train": dict(micro_batch_size=2, global_batch_size=8, seq_length=32, lr=1e-3, clip_grad=0.5,
                      weight_decay=0.1, adam_eps=ADAM_EPS),
    })


def test_grouped_matmul_and_its_gradients_are_each_groups_matmul():
    """Group 1 has no rows: its weight gradient is zero, and no row reads it."""
    torch.manual_seed(0)
    rows, weight, grad = torch.randn(10, 8), torch.randn(3, 8, 4), torch.randn(10, 4)
    ends = torch.tensor([3, 3, 10])
    expected = torch.cat([rows[:3] @ weight[0], rows[3:] @ weight[2]])
    assert rel_err(grouped_mm(rows, weight, ends), expected) < 1e-6
    expected_grad = torch.stack([rows[:3].t() @ grad[:3], torch.zeros(8, 4), rows[3:].t() @ grad[3:]])
    assert rel_err(grouped_mm_weight_grad(rows, grad, ends), expected_grad) < 1e-6
    assert torch.autograd.gradcheck(lambda r, w: grouped_mm(r, w, ends),
                                    (rows.double().requires_grad_(), weight.double().requires_grad_()))


@pytest.mark.parametrize("model, parallel", [
    (None, dict()), (None, dict(dp=2)), (None, dict(dp=2, use_distributed_optimizer=True)), (None, dict(pp=2)),
    (None, dict(tp=2)), (LLAMA, dict()), (LLAMA, dict(tp=2, pp=2)), (DEEPSEEK, dict(tp=2)),
    (dict(LLAMA, **DEEPSEEK), dict(pp=2)),
], ids=["one-rank", "dp2", "dp2-distributed-optimizer", "pp2", "tp2-experts-replicated", "llama-one-rank",
        "llama-tp2-pp2", "sigmoid-shared-expert-tp2", "llama-sigmoid-shared-expert-pp2"])
def test_moe_matches_eager(model, parallel):
    batches = random_batches(config(model), len(LRS))
    reference = reference_run(config(model), batches, LRS)
    (result,) = harness.run_layouts([config(model, **parallel)], batches, LRS)
    assert_matches(result.losses, result.grad_norms, result.params, reference, f"moe {parallel}")
    routers = [name for name in reference[-1].grads if name.endswith("router.weight")]
    assert routers and all(reference[-1].grads[name].norm() > 0 for name in routers)
    shared = [name for name in reference[-1].grads if ".shared_expert." in name]
    assert bool(shared) == bool(model and model.get("moe_shared_expert_intermediate_size"))
    assert all(reference[-1].grads[name].norm() > 0 for name in shared if name.endswith("weight"))


def test_hugging_face_export_refuses_experts():
    """GPT2LMHeadModel and LlamaForCausalLM have no experts: export-hf says so (one line, exit 2 from the CLI) instead of writing a
    dense model without them."""
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel has no mixture of experts"):
        hf.FAMILIES["gpt2"].to_hf(config().model)
    with pytest.raises(CheckpointError, match="LlamaForCausalLM has no mixture of experts"):
        hf.FAMILIES["llama"].to_hf(config(LLAMA).model)


def test_cuda_graphs_are_not_used_with_experts():
    """A grouped matmul reads its experts' row counts on the host, which a CUDA graph capture cannot hold:
    train.py runs the instruction list directly for a program that calls one (dense programs call none)."""
    def ops(cfg):
        return host_reads(build_rank_program(cfg, Coords.from_rank(0, cfg.mesh_sizes), log=lambda _: None))
    assert ops(config(tp=2)) == ["gcompile::grouped_mm", "gcompile::grouped_mm_weight_grad"]
    assert ops(config(dict(num_experts=0), tp=2)) == []


def test_routing_reports_match_eager():
    """What each layer reports (gcompile.report: tokens per expert, load-balancing loss) leaves every rank's
    stages per microbatch as one device computes it, under pp2 dp2 ep2 (each pipeline stage holds its own
    layers' reports)."""
    cfg, mbs = config(dp=2, ep=2, pp=2), 2
    (tokens,) = random_batches(cfg, 1)
    world = harness.World(build_world(cfg, log=lambda _: None), cfg.model, cfg.train.seed)
    per_rank = cfg.train.global_batch_size // 2

    def on_rank(rank, runtime):
        d = runtime.program.coords.axis_rank("dp")
        runtime.forward_backward(split_microbatches(tokens[d * per_rank:(d + 1) * per_rank], mbs))
        return d, dict(runtime.metrics)

    model, expected = cfg.model_spec.build(cfg.model, cfg.train.seed), {}
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for layer, moe in enumerate(layers):
        def record(module, inputs, output, layer=layer):
            _, chosen, _ = module.route(module.router(inputs[0].reshape(-1, inputs[0].shape[-1])))
            expected[len(expected) // 2 // len(layers), layer, "tokens per expert"] = \
                torch.bincount(chosen.reshape(-1), minlength=module.num_experts)
            expected[len(expected) // 2 // len(layers), layer, "load balancing loss"] = output[1].detach()
        moe.register_forward_hook(record)
    for mb in tokens.split(mbs):
        model(mb[:, :-1].contiguous(), mb[:, 1:].contiguous())
    checked = set()
    for d, metrics in world.run(on_rank).values():
        for role, values in metrics.items():
            name, layer, total = parse(role)
            assert total == len(layers) and len(values) == per_rank // mbs
            for m, value in enumerate(values):
                want = expected[d * per_rank // mbs + m, layer, name]
                assert torch.equal(value, want) if name == "tokens per expert" else rel_err(value, want) < 1e-5, role
                checked.add((d, m, layer, name))
    assert len(checked) == len(expected)  # every microbatch's every report, once per dp rank


@pytest.mark.parametrize("model", [None, LLAMA, DEEPSEEK], ids=["gpt2", "llama", "gpt2-shared-expert"])
def test_flops_count_each_tokens_k_experts(model):
    """The lowered graphs' FLOPs (torch's formulas; a grouped matmul counted over all its rows) and the model's
    Megatron-style formula (a token's k experts and the shared one) agree within 2% (what differs: the
    router's matmul, which the formula leaves out as Megatron's does)."""
    cfg = config(model)
    stage = build_rank_program(cfg, Coords.from_rank(0, {}), log=lambda _: None).stages[0]
    counted = graph_flops(stage.forward) + graph_flops(stage.backward)
    formula = cfg.model_spec.flops(cfg.model, cfg.train.micro_batch_size, cfg.train.seq_length)
    assert abs(counted / formula - 1) < 0.02, (counted, formula)
