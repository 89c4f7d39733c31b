"""Your own model (`--arch file.py:SPEC`): examples/parallel_block.py trains like one device under tp and pp.

Numerics as everywhere: fp32, relative error at most 1e-5 of losses and grad norms per step and of the
final parameters, against single-device eager autograd + AdamW, every rank in this process.
"""

import subprocess
import sys
from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import run_gpt
from gcompile import harness
from gcompile.config import answer_help, build_config
from gcompile.models.spec import spec_with_defaults
from tests.reference import ADAM_EPS, random_batches, reference_run, rel_err

ARCH = "examples/parallel_block.py:SPEC"
LRS = [1e-3, 6e-4, 3e-4]


def config(**parallel):
    return build_config({
        "model": dict(arch=ARCH, n_layer=4, n_head=4, n_embd=64, block_size=32),
        "parallel": parallel,
        "train": dict(micro_batch_size=2, global_batch_size=4, seq_length=32, lr=1e-3, clip_grad=0.5,
                      adam_eps=ADAM_EPS),
    })


def assert_trains_as_one_device(arch: str, n_head: int, model: dict | None = None, **parallel) -> None:
    """A two-block model of `arch` (`model` sets more of its config) at a layout (tp 2 unless given): its losses
    per step and final parameters within 1e-5 of one device's."""
    cfg = build_config({"model": dict(arch=arch, n_layer=2, n_head=n_head, n_embd=64, block_size=32, **(model or {})),
                        "train": dict(micro_batch_size=2, global_batch_size=4, seq_length=32, lr=1e-3,
                                      adam_eps=ADAM_EPS)})
    batches = random_batches(cfg, len(LRS))
    reference = reference_run(cfg, batches, LRS)
    (result,) = harness.run_layouts([replace(cfg, parallel=replace(cfg.parallel, **(parallel or dict(tp=2))))],
                                    batches, LRS)
    for step, ref in enumerate(reference):
        assert abs(result.losses[step] - ref.loss) / ref.loss < 1e-5, f"step {step} loss"
    for name, value in reference[-1].params.items():
        assert rel_err(result.params[name], value) < 1e-5, name


@pytest.mark.parametrize("parallel", [dict(tp=2, pp=2), dict(tp=2, sequence_parallel=True)], ids=["tp2-pp2", "tp2-sp"])
def test_parallel_block_model_matches_single_device(parallel):
    batches = random_batches(config(), len(LRS))
    reference = reference_run(config(), batches, LRS)
    (result,) = harness.run_layouts([config(**parallel)], batches, LRS)
    for step, ref in enumerate(reference):
        assert abs(result.losses[step] - ref.loss) / ref.loss < 1e-5, f"step {step} loss"
        assert abs(result.grad_norms[step] - ref.grad_norm) / ref.grad_norm < 1e-5, f"step {step} grad norm"
    for name, value in reference[-1].params.items():
        assert rel_err(result.params[name], value) < 1e-5, name


@pytest.mark.parametrize("arch, message", [
    ("examples/parallel_block.py:NOPE", "examples/parallel_block.py has no 'NOPE'"),
    ("examples/parallel_block.py:TP_PLAN", "is a tuple, not a ModelSpec"),
    ("examples/missing.py:SPEC", "no file examples/missing.py"),
    ("examples/parallel_block.py:spec", "has no 'spec'; did you mean 'SPEC'?"),
    ("tests.test_models:TINY", "its example batch names forward's inputs tokens, labels; the passes and the "
                               "runtime feed it idx, targets"),  # a model otherwise right: a StopIteration
    # traceback from its first forward
])
def test_a_model_that_cannot_be_loaded_is_one_line(arch, message, capsys):
    assert run_gpt.main(["--arch", arch, "--train-iters", "1"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("source, message", [
    ("import torch.nn as nn\nBLOCK = nn.Linaer\n", "AttributeError at {path}:2: module 'torch.nn' has no attribute "
                                                  "'Linaer'"),  # was an UnboundLocalError traceback
    (open(ARCH.partition(":")[0]).read().replace(
        "tp_plan=TP_PLAN)", "tp_plan=TP_PLAN)\nSPEC = replace(SPEC, config=ParallelBlockConfig())")
     .replace("from dataclasses import dataclass", "from dataclasses import dataclass, replace"),
     "its config is an instance of ParallelBlockConfig; give the class itself"),  # an AttributeError traceback
    (open(ARCH.partition(":")[0]).read().replace("vocab_size: int = 257", "vocab_size: int"),
     "its config's vocab_size has no default"),  # a TypeError traceback
    (open(ARCH.partition(":")[0]).read().replace("tp_plan=TP_PLAN)", 'tp_plan=("blocks.*.qkv=column"))'),
     "its tp_plan is the string 'blocks.*.qkv=column'; give a tuple"),  # "tp_plan entry 'b' must be pattern=..."
    (open(ARCH.partition(":")[0]).read().replace("vocab_size: int = 257",
                                                 "vocab_size: int = 257\n    dims: tuple = (1, 2)"),
     "its config's dims: tuple cannot be read from a flag or a [model] key"),  # --dims 3,4 was an IndexError
], ids=["attribute-error-on-import", "config-instance", "field-without-default", "tp-plan-a-string", "bare-tuple"])
def test_a_model_file_wrong_in_these_ways_is_one_line(source, message, tmp_path, capsys):
    (tmp_path / "wrong.py").write_text(source.replace('"parallel_block"', '"wrong"'))
    assert message.format(path=tmp_path / "wrong.py") in refusal(capsys, f"{tmp_path}/wrong.py:SPEC")


def test_a_model_file_of_string_annotations_loads_and_its_fields_are_flags(tmp_path, capsys):
    """`from __future__ import annotations`: its dataclass looked its module up in sys.modules, which the file was
    put in only after it ran (an AttributeError, then a traceback); its fields' types, strings, parsed no flag."""
    source = open(ARCH.partition(":")[0]).read().replace('"parallel_block"', '"annotated"').replace(
        '    """Hidden size."""\n', '    """Hidden size."""\n    ratio: float = 1.0\n    gated: bool = False\n')
    (tmp_path / "annotated.py").write_text("from __future__ import annotations\n" + source)
    assert run_gpt.main(["--arch", f"{tmp_path}/annotated.py:SPEC", "--ratio", "2", "--gated", "--n-layer", "2",
                         "--check-plan"]) == 0, capsys.readouterr().err


def test_a_graph_the_pass_cannot_cut_names_the_node_and_line(capsys):
    """Cutting the embedding's output dim is not a Megatron layout: the pass names the node and its source."""
    assert run_gpt.main(["--arch", ARCH, "--tp", "2", "--tp-plan", "blocks.*.qkv=column", "--check-plan"]) == 2
    err = capsys.readouterr().err
    assert "tensor_parallel" in err and "parallel_block.py" in err and err.count("\n") == 1, err


def refusal(capsys, arch: str, *flags: str) -> str:
    """The one line `run_gpt.py --arch arch *flags --check-plan` refuses with, exiting with status 2."""
    assert run_gpt.main(["--arch", arch, *flags, "--check-plan"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_a_plan_that_names_what_tp_cannot_cut_is_refused_only_at_tp_above_1(tmp_path, capsys):
    """HF GPT-2's plan names its Conv1D modules, which tp cannot cut: the model was refused even at tp 1."""
    (tmp_path / "norm_plan.py").write_text(open("examples/parallel_block.py").read().replace(
        '"parallel_block"', '"norm_plan"').replace('"blocks.*.qkv=column"', '"blocks.*.ln=column"'))
    arch = f"{tmp_path}/norm_plan.py:SPEC"
    assert run_gpt.main(["--arch", arch, "--n-layer", "2", "--check-plan"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert run_gpt.main(["--arch", arch, "--n-layer", "2", "--tp", "2", "--check-plan"]) == 2
    assert "tp_plan: blocks.0.ln is LayerNorm, but column applies to Linear" in capsys.readouterr().err


def test_a_model_file_imports_the_module_beside_it(tmp_path, capsys):
    """As `python path/to/file.py` makes its folder importable: a model split over two files loads by path."""
    (tmp_path / "block_beside.py").write_text(open("examples/parallel_block.py").read()
                                              .replace('"parallel_block"', '"block_beside"'))  # a name of its own
    (tmp_path / "front.py").write_text("from block_beside import SPEC\n")
    assert run_gpt.main(["--arch", f"{tmp_path}/front.py:SPEC", "--n-layer", "2", "--check-plan"]) == 0, \
        capsys.readouterr().err


def test_a_checkpoint_of_an_own_model_names_the_arch_to_load_it_with(tmp_path, capsys):
    """It was called damaged ("model 'parallel_block' is none of gpt2, llama ... load an earlier checkpoint")."""
    small = ["--n-layer", "2", "--train-iters", "1", "--eval-interval", "0"]
    assert run_gpt.main(["--arch", ARCH, *small, "--save", str(tmp_path / "save"), "--run-dir", str(tmp_path)]) == 0
    capsys.readouterr()
    assert run_gpt.main([*small, "--train-iters", "2", "--load", str(tmp_path / "save")]) == 2
    assert capsys.readouterr().err.endswith(f"holds a parallel_block model (this run: gpt2); give the run its model "
                                            f"(--arch {ARCH})\n")
    fresh = subprocess.run([sys.executable, "run_gpt.py", *small, "--load", str(tmp_path / "save")],
                           capture_output=True, text=True)  # where nothing registered parallel_block
    assert fresh.returncode == 2 and fresh.stderr.endswith(
        f"holds a 'parallel_block' model, your own, which this command has not loaded: run_gpt.py --arch {ARCH} "
        f"--load resumes it; export, export-hf and generate take the built-in models (gpt2, llama)\n"), fresh.stderr


@dataclass(frozen=True)
class ScaledConfig:
    vocab_size: int = 16
    block_size: int = 8
    n_layer: int = 2
    n_embd: int = 8


class ZeroCenteredRMSNorm(nn.Module):
    """Gemma's: the weight starts at zero and scales by 1 + weight."""

    def __init__(self, size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))

    def forward(self, x):
        return F.rms_norm(x, x.shape[-1:]) * (1 + self.weight)


class Scaled(nn.Module):
    """Parameters GPT-2's rule does not know (a gain per block, a layer scale, a 0-d temperature) beside ones it
    does (a Linear's weight and bias, an embedding), and norms: torch's, one with a weight per head (Cohere's
    QK-norm) and one whose weight starts at zero."""

    def __init__(self, config: ScaledConfig):
        super().__init__()
        self.embed = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList([nn.Linear(config.n_embd, config.n_embd) for _ in range(config.n_layer)])
        self.gains = nn.ParameterList([nn.Parameter(torch.ones(config.n_embd)) for _ in range(config.n_layer)])
        self.layer_scale = nn.Parameter(torch.full((config.n_layer,), 0.1))
        self.temperature = nn.Parameter(torch.tensor(0.5))
        self.norm = nn.LayerNorm(config.n_embd)
        self.head_norm = nn.LayerNorm((2, config.n_embd // 2))
        self.zero_norm = ZeroCenteredRMSNorm(config.n_embd)

    def forward(self, idx, targets):
        x = self.embed(idx)
        for i, block in enumerate(self.blocks):
            x = x + block(x) * self.gains[i] * self.layer_scale[i]
        x = self.zero_norm(self.head_norm(x.unflatten(-1, (2, -1))).flatten(-2))
        logits = self.norm(x) @ self.embed.weight.t() / self.temperature
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_an_own_model_keeps_its_values_for_parameters_gpt2s_rule_does_not_know():
    """GPT-2's rule zeroed `gains.0` as if a bias (the model never trained: every step the same loss, grad norm
    0), drew the 0-d temperature and a 2-D norm weight as matrices, and set to one a norm weight that starts at
    zero (Gemma's norms then scaled by 2)."""
    model = spec_with_defaults("scaled", ScaledConfig, Scaled).build(ScaledConfig(), seed=3)
    assert all(torch.equal(g, torch.ones(8)) for g in model.gains)
    assert torch.equal(model.layer_scale, torch.full((2,), 0.1))
    assert model.temperature.item() == 0.5
    assert torch.equal(model.norm.weight, torch.ones(8)) and torch.equal(model.norm.bias, torch.zeros(8))
    assert torch.equal(model.head_norm.weight, torch.ones(2, 4)) and torch.equal(model.zero_norm.weight, torch.zeros(8))
    assert torch.equal(model.blocks[0].bias, torch.zeros(8))
    assert 0.01 < model.blocks[0].weight.std().item() < 0.04  # N(0, 0.02), not torch's own init


def test_any_pointwise_op_carries_a_tensor_parallel_cut(tmp_path):
    """`square`, `sigmoid`, `clamp` (torch's pointwise ops, not only a listed few) between a column- and a
    row-parallel linear: they were refused as ops the pass could not carry a cut through."""
    (tmp_path / "pointwise_mlp.py").write_text(
        open("examples/parallel_block.py").read().replace('"parallel_block"', '"pointwise_mlp"')
        .replace("F.relu(self.up(h)) ** 2", "F.relu(self.up(h)).square() * torch.sigmoid(self.up(h)).clamp(max=0.9)"))
    arch = f"{tmp_path}/pointwise_mlp.py:SPEC"
    assert_trains_as_one_device(arch, n_head=4)


QKV = "        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in self.qkv(h).split(C, dim=2))"
SDPA = "        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)"
GROUPED = ("        q = q.view(B, T, self.n_head, -1).transpose(1, 2)\n"
           "        k, v = (t.view(B, T, self.n_head // 2, -1).transpose(1, 2).repeat_interleave(2, dim=1) for t in (k, v))")
ATTENTION_FORMS = {
    # grouped kv heads repeated with repeat_interleave (not expand and reshape); q and kv without bias, as
    # Llama's: a key's bias shifts every score of a query alike, which softmax ignores, so its gradient is
    # rounding noise that Adam turns into whole steps (relative error 1.3e-5 on 1e-3 values)
    "gqa-repeat-interleave": [
        ("        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)",
         "        self.q = nn.Linear(config.n_embd, config.n_embd, bias=False)\n"
         "        self.kv = nn.Linear(config.n_embd, config.n_embd, bias=False)  # 2 x half the heads"),
        (QKV, "        q = self.q(h).view(B, T, self.n_head, -1).transpose(1, 2)\n"
              "        k, v = (t.view(B, T, self.n_head // 2, -1).transpose(1, 2).repeat_interleave(2, dim=1)\n"
              "                for t in self.kv(h).split(C // 2, dim=2))"),
        ('"blocks.*.qkv=column"', '"blocks.*.q=column", "blocks.*.kv=column"')],
    # one kv head (MQA) from Linears the plan leaves whole, broadcast over the query heads by the matmuls; a
    # learned gain per head dim on q; a gate per token from a whole Linear: each read against the heads,
    # each rank's heads give part of their gradient
    "whole-values-against-heads": [
        ("        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)",
         "        self.q = nn.Linear(config.n_embd, config.n_embd, bias=False)\n"
         "        self.kv = nn.Linear(config.n_embd, 2 * config.n_embd // config.n_head, bias=False)\n"
         "        self.gate = nn.Linear(config.n_embd, 1)\n"
         "        self.q_gain = nn.Parameter(torch.linspace(0.5, 1.5, config.n_embd // config.n_head))"),
        (QKV, "        hs = C // self.n_head\n"
              "        q = self.q(h).view(B, T, self.n_head, hs).transpose(1, 2) * self.q_gain\n"
              "        k, v = (t.view(B, T, 1, hs).transpose(1, 2) for t in self.kv(h).split(hs, dim=2))"),
        (SDPA, "        att = F.softmax((q @ k.transpose(-2, -1)) / hs ** 0.5 + torch.full((T, T), float('-inf'))"
               ".triu(1), dim=-1)\n"
               "        y = ((att @ v) * torch.sigmoid(self.gate(h)).view(B, 1, T, 1)).transpose(1, 2).reshape(B, T, C)"),
        ('"blocks.*.qkv=column"', '"blocks.*.q=column"')],
    # QK-norm (an RMSNorm over the head dim, its weight whole on every rank), heads moved by permute, the mask
    # by torch.where, a softmax written out (max, exp, sum), and an upcast and type_as back
    "qk-norm-permute-where": [
        ("        self.n_head = config.n_head",
         "        self.n_head = config.n_head\n"
         "        self.q_norm = nn.RMSNorm(config.n_embd // config.n_head)\n"
         "        self.k_norm = nn.RMSNorm(config.n_embd // config.n_head)"),
        (QKV, "        q, k, v = (t.view(B, T, self.n_head, -1) for t in self.qkv(h).split(C, dim=2))\n"
              "        q, k, v = self.q_norm(q).permute(0, 2, 1, 3), self.k_norm(k).permute(0, 2, 1, 3), "
              "v.permute(0, 2, 1, 3)"),
        (SDPA, "        mask = torch.ones(T, T, dtype=torch.bool).tril()\n"
               "        att = torch.where(mask, (q @ k.transpose(-2, -1)).float() / k.size(-1) ** 0.5, float('-inf'))\n"
               "        att = (att - att.amax(-1, keepdim=True)).exp()\n"
               "        att = (att / att.sum(-1).unsqueeze(-1)).type_as(v)\n"
               "        y = (att @ v).permute(0, 2, 1, 3).reshape(B, T, C)")],
    # grouped kv heads (half as many as q's) through SDPA's enable_gqa
    "gqa-sdpa": [
        ("        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)",
         "        self.q = nn.Linear(config.n_embd, config.n_embd, bias=False)\n"
         "        self.kv = nn.Linear(config.n_embd, config.n_embd, bias=False)  # 2 x half the heads"),
        (QKV, "        q = self.q(h).view(B, T, self.n_head, -1).transpose(1, 2)\n"
              "        k, v = (t.view(B, T, self.n_head // 2, -1).transpose(1, 2) for t in self.kv(h).split(C // 2, dim=2))"),
        (SDPA, SDPA.replace("is_causal=True", "is_causal=True, enable_gqa=True")),
        ('"blocks.*.qkv=column"', '"blocks.*.q=column", "blocks.*.kv=column"')],
    # OLMo-2's QK-norm: an RMSNorm over the whole width of q and of k, every head at once, before the heads are
    # split off (no bias on qkv or k_norm: the norm takes away any shift of q or k, and a shift of k changes no
    # softmax; their gradients are rounding noise)
    "qk-norm-over-heads": [
        ("        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)",
         "        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)\n"
         "        self.q_norm = nn.RMSNorm(config.n_embd)\n"
         "        self.k_norm = nn.LayerNorm(config.n_embd, bias=False)"),
        (QKV, "        q, k, v = self.qkv(h).split(C, dim=2)\n"
              "        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (self.q_norm(q), self.k_norm(k), v))")],
    # one kv head for all (MQA) from a Linear the plan leaves whole, through SDPA's enable_gqa
    "mqa-sdpa": [
        ("        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)",
         "        self.q = nn.Linear(config.n_embd, config.n_embd, bias=False)\n"
         "        self.kv = nn.Linear(config.n_embd, 2 * config.n_embd // config.n_head, bias=False)"),
        (QKV, "        q = self.q(h).view(B, T, self.n_head, -1).transpose(1, 2)\n"
              "        k, v = (t.view(B, T, 1, -1).transpose(1, 2) for t in self.kv(h).split(C // self.n_head, dim=2))"),
        (SDPA, SDPA.replace("is_causal=True", "is_causal=True, enable_gqa=True")),
        ('"blocks.*.qkv=column"', '"blocks.*.q=column"')],
    # QK-norm by F.layer_norm after the heads are split off and moved, then q @ k^T: the real gradient of a layer
    # norm over a transposed input is contiguous where its traced one is not, so backward's view of it failed (at
    # tp 1 too). qkv without bias: the norm takes away any shift of q or k, so their bias's gradient is rounding
    # noise
    "layer-norm-after-transpose": [
        ("        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)",
         "        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)"),
        (QKV, QKV + "\n        q, k = F.layer_norm(q, (q.size(-1),)), F.layer_norm(k, (k.size(-1),))"),
        (SDPA, "        att = (q @ k.transpose(-2, -1)) / k.size(-1) ** 0.5 + torch.full((T, T), float('-inf')).triu(1)\n"
               "        y = (F.softmax(att, dim=-1) @ v).transpose(1, 2).reshape(B, T, C)")],
    # SDPA given a mask: a sliding window of 8 keys as a (T, T) bool, and as HF passes masks, an additive float
    # (B, 1, T, T); each read whole against the cut heads
    "sdpa-bool-window": [
        (SDPA, "        window = torch.ones(T, T, dtype=torch.bool).tril().triu(-7)\n" +
         SDPA.replace("is_causal=True", "attn_mask=window"))],
    "sdpa-float-mask": [
        (SDPA, "        window = torch.ones(T, T, dtype=torch.bool).tril().triu(-7)\n"
               "        mask = torch.zeros(B, 1, T, T).masked_fill(~window, float('-inf'))\n" +
         SDPA.replace("is_causal=True", "mask"))],
    # ALiBi (BLOOM, MPT): a bias per head from constant slopes, whole on every rank, added to the scores written
    # by hand, and a learned gain per head on the output; each rank reads its heads' rows
    "alibi-gain-per-head": [
        ("        self.n_head = config.n_head",
         "        self.n_head = config.n_head\n"
         "        self.head_gain = nn.Parameter(torch.linspace(0.5, 1.5, config.n_head).view(config.n_head, 1, 1))"),
        (SDPA, "        slopes = 2.0 ** -torch.arange(1, self.n_head + 1).float()\n"
               "        distance = torch.arange(T).view(1, T) - torch.arange(T).view(T, 1)\n"
               "        alibi = slopes.view(1, -1, 1, 1) * distance.clamp(max=0) + torch.full((T, T), float('-inf')).triu(1)\n"
               "        att = F.softmax((q @ k.transpose(-2, -1)) / k.size(-1) ** 0.5 + alibi, dim=-1)\n"
               "        y = ((att @ v) * self.head_gain).transpose(1, 2).reshape(B, T, C)")],
    # the same bias through SDPA's attn_mask, (1, heads, T, T); qkv without bias: a key's bias shifts
    # every score of a query alike, so its gradient is rounding noise that Adam turns into whole steps (relative
    # error 2.1e-5 on an AMD EPYC host, under 1e-5 on an Intel Xeon one)
    "alibi-sdpa": [
        ("        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)",
         "        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)"),
        (SDPA, "        slopes = 2.0 ** -torch.arange(1, self.n_head + 1).float()\n"
               "        distance = torch.arange(T).view(1, T) - torch.arange(T).view(T, 1)\n"
               "        alibi = slopes.view(1, -1, 1, 1) * distance.clamp(max=0) + torch.full((T, T), float('-inf')).triu(1)\n" +
         SDPA.replace("is_causal=True", "alibi"))],
    # one kv head (MQA) repeated to every query head by HF's repeat_kv (expand, reshape) from a Linear tp cannot
    # cut by heads: each rank reads its query heads' rows
    "mqa-repeat-kv": [
        ("        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)",
         "        self.q = nn.Linear(config.n_embd, config.n_embd, bias=False)\n"
         "        self.kv = nn.Linear(config.n_embd, 2 * config.n_embd // config.n_head, bias=False)"),
        (QKV, "        hs = C // self.n_head\n"
              "        q = self.q(h).view(B, T, self.n_head, hs).transpose(1, 2)\n"
              "        k, v = (t.view(B, T, 1, hs).transpose(1, 2)[:, :, None].expand(B, 1, self.n_head, T, hs)\n"
              "                .reshape(B, self.n_head, T, hs) for t in self.kv(h).split(hs, dim=2))"),
        ('"blocks.*.qkv=column"', '"blocks.*.q=column"')],
    # fewer kv heads (2) than query heads, from a Linear the plan leaves whole, rotated by rotate_half (slices
    # and cat) and repeated by HF's repeat_kv: each rank reads its query heads' rows
    "kv-whole-rotate-half": [
        ("        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)",
         "        self.q = nn.Linear(config.n_embd, config.n_embd, bias=False)\n"
         "        self.kv = nn.Linear(config.n_embd, 4 * config.n_embd // config.n_head, bias=False)"),
        (QKV, "        hs = C // self.n_head\n"
              "        q = self.q(h).view(B, T, self.n_head, hs).transpose(1, 2)\n"
              "        k, v = (t.view(B, T, 2, hs).transpose(1, 2) for t in self.kv(h).split(2 * hs, dim=2))\n"
              "        k = k + 0.5 * torch.cat((-k[..., hs // 2:], k[..., :hs // 2]), dim=-1)\n"
              "        k, v = (t[:, :, None].expand(B, 2, self.n_head // 2, T, hs).reshape(B, self.n_head, T, hs)\n"
              "                for t in (k, v))"),
        ('"blocks.*.qkv=column"', '"blocks.*.q=column"')],
    # q, k and v laid out per head (BLOOM's, GPT-NeoX's fused qkv), picked by select
    "qkv-per-head-select": [
        (QKV, "        fused = self.qkv(h).view(B, T, self.n_head, 3, C // self.n_head)\n"
              "        q, k, v = (fused[:, :, :, i].transpose(1, 2) for i in range(3))")],
    # q, k and v by torch.chunk, heads by unflatten, kv heads repeated by broadcast_to, merged back by flatten
    "chunk-unflatten-broadcast-flatten": [
        (QKV, "        q, k, v = (t.unflatten(2, (self.n_head, -1)).transpose(1, 2) for t in self.qkv(h).chunk(3, dim=2))"),
        (SDPA, "        k, v = (t.broadcast_to(q.shape) for t in (k, v))\n" +
         SDPA.replace(".reshape(B, T, C)", ".flatten(2)"))],
    # timm's attention: the fused qkv viewed as (B, T, 3, heads, head dim), permuted, taken apart by unbind
    "qkv-unbind-permute": [
        (QKV, "        q, k, v = self.qkv(h).reshape(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)"
              ".unbind(0)")],
    "qkv-unbind": [
        (QKV, "        q, k, v = (t.transpose(1, 2) for t in self.qkv(h).view(B, T, 3, self.n_head, -1).unbind(2))")],
    # q, k and v sliced off the fused qkv
    "qkv-slices": [
        (QKV, "        fused = self.qkv(h)\n"
              "        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2)\n"
              "                   for t in (fused[..., :C], fused[..., C:2 * C], fused[..., 2 * C:]))")],
    # GPT-J's rotary: every two entries of the head dim rotated, by strided slices, torch.stack and flatten
    "rotary-every-two-stack": [
        (SDPA, "        angle = torch.arange(T, dtype=torch.float32).view(T, 1) * 0.1 ** torch.arange(C // self.n_head // 2)\n"
               "        cos, sin = (f(angle).repeat_interleave(2, dim=-1) for f in (torch.cos, torch.sin))\n"
               "        q, k = (t * cos + torch.stack((-t[..., 1::2], t[..., ::2]), dim=-1).flatten(-2) * sin for t in (q, k))\n"
               + SDPA)],
    # a causal mask made by x.new_ones (MPT's), which reads x only for its dtype
    "new-ones-mask": [
        (SDPA, "        att = (q @ k.transpose(-2, -1)) / k.size(-1) ** 0.5\n"
               "        att = att.masked_fill(att.new_ones(T, T).tril() == 0, float('-inf'))\n"
               "        y = (F.softmax(att, dim=-1) @ v).transpose(1, 2).reshape(B, T, C)")],
    # Phi-3's fused qkv of grouped kv heads (half as many as q's): parts of unequal sizes, by torch.split and by
    # slices; each part cut on its own, so a rank holds its query heads and their kv heads
    "grouped-qkv-split": [
        ("        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)",
         "        self.qkv = nn.Linear(config.n_embd, 2 * config.n_embd, bias=False)"),
        (QKV, "        q, k, v = self.qkv(h).split([C, C // 2, C // 2], dim=2)\n" + GROUPED)],
    "grouped-qkv-slices": [
        ("        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)",
         "        self.qkv = nn.Linear(config.n_embd, 2 * config.n_embd, bias=False)"),
        (QKV, "        fused = self.qkv(h)\n"
              "        q, k, v = fused[..., :C], fused[..., C:C + C // 2], fused[..., C + C // 2:]\n" + GROUPED)],
    # HF's rotary: inv_freq a buffer (register_buffer, not persistent), the angles made from it in forward
    "rotary-inv-freq-buffer": [
        ("        self.n_head = config.n_head",
         "        self.n_head = config.n_head\n"
         "        hs = config.n_embd // config.n_head\n"
         "        self.register_buffer('inv_freq', 1.0 / 10000 ** (torch.arange(0, hs, 2).float() / hs), persistent=False)"),
        (SDPA, "        angle = torch.outer(torch.arange(T, device=x.device).float(), self.inv_freq)\n"
               "        cos, sin = torch.cat((angle, angle), dim=-1).cos(), torch.cat((angle, angle), dim=-1).sin()\n"
               "        half = q.size(-1) // 2\n"
               "        q, k = (t * cos + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin for t in (q, k))\n"
               + SDPA)],
    # a cos/sin cache of block_size rows in persistent buffers, its first T rows read
    "rotary-cache-buffers": [
        ("        self.n_head = config.n_head",
         "        self.n_head = config.n_head\n"
         "        hs = config.n_embd // config.n_head\n"
         "        angle = torch.arange(config.block_size).float()[:, None] * 0.1 ** torch.arange(hs // 2)\n"
         "        self.register_buffer('cos_cached', torch.cat((angle, angle), dim=-1).cos())\n"
         "        self.register_buffer('sin_cached', torch.cat((angle, angle), dim=-1).sin())"),
        (SDPA, "        cos, sin, half = self.cos_cached[:T], self.sin_cached[:T], q.size(-1) // 2\n"
               "        q, k = (t * cos + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin for t in (q, k))\n"
               + SDPA)],
    # minGPT's causal mask: a (1, 1, block_size, block_size) buffer, sliced to T
    "causal-mask-buffer": [
        ("        self.n_head = config.n_head",
         "        self.n_head = config.n_head\n"
         "        self.register_buffer('bias', torch.tril(torch.ones(config.block_size, config.block_size))\n"
         "                             .view(1, 1, config.block_size, config.block_size))"),
        (SDPA, "        att = (q @ k.transpose(-2, -1)) / k.size(-1) ** 0.5\n"
               "        att = F.softmax(att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf')), dim=-1)\n"
               "        y = (att @ v).transpose(1, 2).reshape(B, T, C)")],
    # a mask held as a plain tensor attribute (not registered), handed to SDPA
    "mask-tensor-attribute": [
        ("        self.n_head = config.n_head",
         "        self.n_head = config.n_head\n"
         "        self.mask = torch.ones(config.block_size, config.block_size, dtype=torch.bool).tril()"),
        (SDPA, SDPA.replace("is_causal=True", "attn_mask=self.mask[:T, :T]"))],
    # Phi-3's rotary over the first rotary_dim entries of each head, here all of them: a slice of every entry (an
    # alias) and an empty one, joined back by cat
    "rotary-dim-slices": [
        (SDPA, "        hs, half = q.size(-1), q.size(-1) // 2\n"
               "        angle = torch.arange(T).float()[:, None] * 0.1 ** torch.arange(half)\n"
               "        cos, sin = torch.cat((angle, angle), dim=-1).cos(), torch.cat((angle, angle), dim=-1).sin()\n"
               "        q, k = (torch.cat((t[..., :hs] * cos + torch.cat((-t[..., half:hs], t[..., :half]), dim=-1) * sin,\n"
               "                           t[..., hs:]), dim=-1) for t in (q, k))\n" + SDPA)],
    # MPT's clip_qkv: the fused qkv clamped, then chunked
    "qkv-clamped-chunk": [
        (QKV, "        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2)\n"
              "                   for t in self.qkv(h).clamp(-2.0, 2.0).chunk(3, dim=2))")],
    # Gemma-2's: scores soft-capped by tanh, an additive causal mask made of positions
    "soft-capped": [
        (SDPA, "        att = (q @ k.transpose(-2, -1)) / k.size(-1) ** 0.5\n"
               "        att = torch.tanh(att / 5.0) * 5.0\n"
               "        mask = torch.full((T, T), float('-inf'), device=x.device).triu(1)\n"
               "        att = F.softmax(att + mask, dim=-1, dtype=torch.float32).to(q.dtype)\n"
               "        y = (att @ v).transpose(1, 2).reshape(B, T, C)")],
    # ALiBi by hand: a bias per head, linear in the distance to the key, added to the scores
    "alibi-by-hand": [
        (SDPA, "        att = (q @ k.transpose(-2, -1)) / k.size(-1) ** 0.5\n"
               "        slopes = 2.0 ** -torch.arange(1, self.n_head + 1, device=x.device).float()\n"
               "        distance = torch.arange(T, device=x.device)[None, :] - torch.arange(T, device=x.device)[:, None]\n"
               "        bias = slopes[:, None, None] * distance.float()  # (heads, T, T)\n"
               "        att = att + bias.masked_fill(distance > 0, float('-inf'))\n"
               "        y = (F.softmax(att, dim=-1) @ v).transpose(1, 2).reshape(B, T, C)")],
    # nanoGPT's attention without flash: matmuls, a causal mask, softmax
    "matmul-softmax": [
        (SDPA, "        att = (q @ k.transpose(-2, -1)) / k.size(-1) ** 0.5\n"
               "        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()\n"
               "        att = F.softmax(att.masked_fill(~mask, float('-inf')), dim=-1)\n"
               "        y = (att @ v).transpose(1, 2).reshape(B, T, C)")],
}


def attention_form(form: str, name: str, tmp_path) -> str:
    """The --arch of examples/parallel_block.py with its attention written as ATTENTION_FORMS[form], under `name`
    (a model's name is its own in a process)."""
    source = open("examples/parallel_block.py").read().replace('"parallel_block"', f'"{name}"')
    for old, new in ATTENTION_FORMS[form]:
        assert old in source, old
        source = source.replace(old, new)
    (tmp_path / "model.py").write_text(source)
    return f"{tmp_path}/model.py:SPEC"


@pytest.mark.parametrize("form", ATTENTION_FORMS)
def test_attention_written_other_ways_is_cut_by_heads(form, tmp_path):
    """Attention forms the tensor-parallel pass refused, each cut by heads at tp 2 as on one device."""
    assert_trains_as_one_device(attention_form(form, form, tmp_path), n_head=8)


@pytest.mark.parametrize("form,parallel", [
    ("rotary-inv-freq-buffer", dict(tp=2, pp=2)), ("rotary-cache-buffers", dict(cp=2)),
    ("causal-mask-buffer", dict(tp=2, sequence_parallel=True)),
    ("mask-tensor-attribute", dict(cp=2, cp_comm_type="all_gather"))],
    ids=["inv-freq-tp2-pp2", "cos-sin-cache-cp2", "causal-mask-tp2-sp", "mask-attribute-cp2-all-gather"])
def test_tensors_the_model_holds_are_constants_of_every_rank(form, parallel, tmp_path):
    """Buffers (register_buffer, persistent or not) and tensor attributes: each stage that reads one is handed
    its value as __init__ made it; context parallel cuts a table or mask read against the tokens to the rank's
    positions. They were refused ("compute it in forward"), the first thing many real models met."""
    name = f"{form}_{'_'.join(map(str, parallel.values()))}".replace("-", "_")
    assert_trains_as_one_device(attention_form(form, name, tmp_path), n_head=8, **parallel)


@pytest.mark.parametrize("form", ["qkv-per-head-select", "rotary-dim-slices"])
def test_attention_forms_under_context_parallel(form, tmp_path):
    """q, k and v picked from a fused dim by select (Falcon's, BLOOM's) and a rotary over slices of the head dim
    (Phi-3's) hold the rank's tokens where their input does. Both were refused at cp."""
    assert_trains_as_one_device(attention_form(form, f"{form}_cp".replace("-", "_"), tmp_path), n_head=8, cp=2)


def test_fewer_kv_heads_than_ranks_in_a_column_linear_says_to_leave_it_whole(tmp_path, capsys):
    arch = attention_form("gqa-repeat-interleave", "gqa_over_tp4", tmp_path)
    line = refusal(capsys, arch, "--n-layer", "2", "--n-head", "4", "--tp", "4")
    assert "2 (heads?) is not divisible by tp=4: choose a tp that divides it, or give kv heads a " \
        "Linear of their own and leave it out of tp_plan" in line, line


def test_a_post_norm_block_over_pipeline_stages(tmp_path):
    """Post-LN (GPT-1, BERT): a block's column-parallel qkv reads its input, the residual stream, itself. The
    copy into the column-parallel linear was made on the stage before, which sent the input and its copy (an
    alias, which autograd gives no gradient: refused as an output that does not depend on the parameters)."""
    source = open("examples/parallel_block.py").read().replace('"parallel_block"', '"post_norm"')
    block = [("        h = self.ln(x)\n", "        h = x\n"),
             ("        return x + self.out(y) + self.down(F.relu(self.up(h)) ** 2)",
              "        return self.ln(x + self.out(y) + self.down(F.relu(self.up(h)) ** 2))")]
    for old, new in block:
        assert old in source, old
        source = source.replace(old, new)
    (tmp_path / "model.py").write_text(source)
    assert_trains_as_one_device(f"{tmp_path}/model.py:SPEC", n_head=4, tp=2, pp=2)


@pytest.mark.parametrize("form", ["mqa-sdpa", "mqa-repeat-kv", "whole-values-against-heads", "kv-whole-rotate-half"])
def test_whole_values_against_heads_under_sequence_parallel(form, tmp_path):
    """A kv head (MQA) or gate from a Linear the plan leaves whole reads the rank's tokens under sequence parallel:
    its value is gathered over the sequence before the cut heads read it (each rank's rows of it, for kv heads
    repeated to every query head), its gradient reduce-scattered back. It was refused, with advice that could
    not be followed."""
    assert_trains_as_one_device(attention_form(form, f"{form}_sp", tmp_path), n_head=8, tp=2, sequence_parallel=True)


@pytest.mark.parametrize("form", ["sdpa-bool-window", "sdpa-float-mask", "alibi-sdpa"])
@pytest.mark.parametrize("parallel", [dict(cp=2, cp_comm_type="all_gather"), dict(tp=2, cp=2, cp_comm_type="a2a")],
                         ids=["cp2-all-gather", "tp2-cp2-a2a"])
def test_an_attention_mask_under_context_parallel(form, parallel, tmp_path):
    """SDPA's attn_mask over the whole sequence (a sliding window, HF's (B, 1, T, T), ALiBi's bias per head): with
    all_gather its rows are the rank's queries and its columns the keys in gathered order; with a2a it applies as
    it is to the whole sequence, but for the rank's heads. It was refused at any cp."""
    assert_trains_as_one_device(attention_form(form, f"{form}_{len(parallel)}_cp", tmp_path), n_head=8, **parallel)


def test_an_attention_mask_in_the_p2p_ring_is_one_line(tmp_path, capsys):
    arch = attention_form("sdpa-bool-window", "window_p2p", tmp_path)
    line = refusal(capsys, arch, "--n-layer", "2", "--cp", "2")
    assert "has an explicit attention mask, which context parallel takes whole (made of " \
        "positions, not of the batch) and with cp_comm_type all_gather or a2a" in line, line


RMS_NORM = '''
class RMSNorm(nn.Module):  # Meta's Llama and T5: in float32, back to the input's dtype by type_as
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(x) * self.weight


class ParallelBlock(nn.Module):'''


@pytest.mark.parametrize("norm, parallel", [("nn.RMSNorm", dict(tp=2, sequence_parallel=True)),
                                            ("nn.RMSNorm", dict(cp=2)),
                                            ("RMSNorm", dict(tp=2, sequence_parallel=True))],
                         ids=["nn-rms-norm-sp", "nn-rms-norm-cp", "type-as-rms-norm-sp"])
def test_rms_norms_work_token_by_token(norm, parallel, tmp_path):
    """Sequence and context parallel refused torch's RMSNorm (aten.rms_norm) and a norm that casts back by
    type_as as not token-wise."""
    source = open("examples/parallel_block.py").read().replace('"parallel_block"', f'"{norm}_{len(parallel)}"')
    source = source.replace("nn.LayerNorm(config.n_embd, bias=False)", f"{norm}(config.n_embd)")
    (tmp_path / "model.py").write_text(source.replace("\n\nclass ParallelBlock(nn.Module):", RMS_NORM))
    assert_trains_as_one_device(f"{tmp_path}/model.py:SPEC", n_head=4, **parallel)


@pytest.mark.parametrize("sdpa, message", [
    ("        y = torch.einsum('bhqk,bhkd->bhqd', F.softmax(torch.einsum('bhqd,bhkd->bhqk', q, k), dim=-1), v)"
     ".transpose(1, 2).reshape(B, T, C)", "an einsum is not cut by heads here: write it with @ (torch.matmul)"),
    ("        y = F.scaled_dot_product_attention(q, k.repeat(1, 1, 1, 1), v).transpose(1, 2).reshape(B, T, C)",
     "tiling with repeat is not cut here: repeat each kv head with repeat_interleave(n, dim) or expand"),
], ids=["einsum", "repeat"])
def test_an_attention_form_the_pass_refuses_says_what_to_write(sdpa, message, tmp_path, capsys):
    source = open("examples/parallel_block.py").read().replace('"parallel_block"', f'"refused_{len(sdpa)}"')  # a
    # model's name is its own in a process
    assert SDPA in source
    (tmp_path / "model.py").write_text(source.replace(SDPA, sdpa))
    line = refusal(capsys, f"{tmp_path}/model.py:SPEC", "--n-layer", "2", "--tp", "2")
    assert message in line, line


EMBED = "        x = self.embed(idx) + self.positions(torch.arange(T, device=idx.device))  # (B, T, C)"


def test_a_number_forward_makes_a_tensor_of_is_made_in_the_graph(tmp_path):
    """HF Gemma scales its embedding by torch.tensor(hidden ** 0.5): export lifts that to an input, which capture
    refused as a tensor attribute the model does not have, on one device too."""
    source = open("examples/parallel_block.py").read().replace('"parallel_block"', '"scaled_embedding"')
    assert EMBED in source
    (tmp_path / "model.py").write_text(source.replace(EMBED, EMBED.replace(
        "self.embed(idx)", "self.embed(idx) * torch.tensor(self.head.in_features ** 0.5, dtype=torch.float32)")))
    assert_trains_as_one_device(f"{tmp_path}/model.py:SPEC", n_head=4)


@pytest.mark.parametrize("parallel", [dict(tp=2), dict(tp=2, sequence_parallel=True)], ids=["tp2", "tp2-sp"])
def test_a_vocab_parallel_head_with_a_bias(parallel, tmp_path):
    """Phi-2's head has a bias: cut over the vocab with the weight (padded alike; the padding's logits are masked
    in the loss). It was refused as a use of a vocab-parallel parameter other than by a linear."""
    source = open("examples/parallel_block.py").read().replace('"parallel_block"', f'"head_bias_{len(parallel)}"')
    head = "self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)"
    assert head in source
    (tmp_path / "model.py").write_text(source.replace(head, head.replace(", bias=False", "")))
    assert_trains_as_one_device(f"{tmp_path}/model.py:SPEC", n_head=4, **parallel)


def test_a_vocab_parallel_embedding_with_a_padding_row(tmp_path):
    """nn.Embedding(padding_idx=...) (HF's pad_token_id: Gemma, Cohere, OLMo) cut over the vocab: the rank holding
    the padding row gives it no gradient, as one device does. It was refused at any tp. The row is token 149,
    the first of the test's first batch."""
    source = open("examples/parallel_block.py").read().replace('"parallel_block"', '"padded_embedding"')
    embed = "self.embed = nn.Embedding(config.vocab_size, config.n_embd)"
    assert embed in source
    (tmp_path / "model.py").write_text(source.replace(embed, embed.replace(")", ", padding_idx=149)")))
    cfg = build_config({"model": dict(arch=f"{tmp_path}/model.py:SPEC", n_layer=2, block_size=32),
                        "train": dict(micro_batch_size=2, global_batch_size=4, seq_length=32)})
    assert random_batches(cfg, 1)[0][0, 0] == 149
    assert_trains_as_one_device(f"{tmp_path}/model.py:SPEC", n_head=4, tp=2)


def test_linears_written_as_matmuls(tmp_path):
    """x @ W.T (+ b) of a Linear's weight, as Falcon's Linear and a tied head written by hand do, is that linear
    (gcompile.canonical): column, row and vocab-parallel under sequence parallel. It was refused ("write x @ W.T
    as F.linear(x, W)"), which meant editing the model."""
    source = open("examples/parallel_block.py").read().replace('"parallel_block"', '"matmul_linears"')
    for old, new in [("logits = self.head(self.norm(x))", "logits = self.norm(x) @ self.head.weight.T"),
                     ("self.qkv(h)", "(h @ self.qkv.weight.t() + self.qkv.bias)"),
                     ("x + self.out(y)", "x + torch.matmul(y, self.out.weight.transpose(0, 1)) + self.out.bias")]:
        assert old in source, old
        source = source.replace(old, new)
    (tmp_path / "model.py").write_text(source)
    assert_trains_as_one_device(f"{tmp_path}/model.py:SPEC", n_head=4, tp=2, sequence_parallel=True)


CONV1D = '''

class Conv1D(nn.Module):
    """HF's: a Linear whose weight is (in, out), applied by addmm to the rows flattened."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(*x.shape[:-1], self.nf)
'''


def conv1d_model(name: str, tmp_path) -> str:
    """examples/parallel_block.py with qkv and out as Conv1D modules."""
    source = open("examples/parallel_block.py").read().replace('"parallel_block"', f'"{name}"')
    for old, new in [("\n\nclass ParallelBlock(", CONV1D + "\n\nclass ParallelBlock("),
                     ("self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)",
                      "self.qkv = Conv1D(3 * config.n_embd, config.n_embd)"),
                     ("self.out = nn.Linear(config.n_embd, config.n_embd)", "self.out = Conv1D(config.n_embd, config.n_embd)")]:
        assert old in source, old
        source = source.replace(old, new)
    (tmp_path / "model.py").write_text(source)
    return f"{tmp_path}/model.py:SPEC"


def test_a_linear_whose_weight_is_in_by_out(tmp_path):
    """HF's Conv1D (GPT-2's): column- and row-parallel by the other dim of its weight than a Linear's, under
    sequence parallel. The plan refused it (Conv1D is not a Linear), and cp refused its addmm."""
    assert_trains_as_one_device(conv1d_model("conv1d_qkv", tmp_path), n_head=4, tp=2, sequence_parallel=True)


def test_a_conv1d_that_tp_cannot_cut_evenly_is_one_line(tmp_path, capsys):
    arch = conv1d_model("conv1d_uneven", tmp_path)
    line = refusal(capsys, arch, "--n-layer", "2", "--n-embd", "60", "--n-head", "6", "--tp", "8")
    assert "blocks.0.qkv.weight has 180 entries on the dim column-parallel cuts (dim 1), not " \
        "divisible by tp=8" in line, line


def test_a_cut_weight_read_by_other_than_a_linear_is_refused(tmp_path, capsys):
    source = open("examples/parallel_block.py").read().replace('"parallel_block"', '"weight_penalty"')
    loss = "return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))"
    assert loss in source
    (tmp_path / "model.py").write_text(source.replace(loss, loss + " + 1e-4 * self.head.weight.pow(2).sum()"))
    line = refusal(capsys, f"{tmp_path}/model.py:SPEC", "--n-layer", "2", "--tp", "2")
    assert "uses head.weight, which the plan makes vocab-parallel; only a linear (F.linear or " \
        "x @ W.T; for vocab, an embedding too) may use it: leave it out of tp_plan" in line, line


def test_a_head_left_whole_under_sequence_parallel_is_refused_naming_the_head(tmp_path, capsys):
    source = open("examples/parallel_block.py").read().replace('"parallel_block"', '"whole_head_sp"')
    assert '"head=vocab")' in source
    (tmp_path / "model.py").write_text(source.replace(', "head=vocab")', ")"))
    line = refusal(capsys, f"{tmp_path}/model.py:SPEC", "--n-layer", "2", "--tp", "2", "--sequence-parallel")
    assert "is the loss over logits of the rank's tokens only: make the output head vocab-parallel " \
        "in tp_plan" in line, line


def test_a_tensor_forward_makes_of_a_list_is_refused_at_its_line(tmp_path, capsys):
    source = open("examples/parallel_block.py").read().replace('"parallel_block"', '"listed_scale"')
    (tmp_path / "model.py").write_text(source.replace(EMBED, EMBED.replace(
        "self.embed(idx)", "self.embed(idx) * torch.tensor([1.0, 2.0]).mean()")))
    line = refusal(capsys, f"{tmp_path}/model.py:SPEC", "--n-layer", "2")
    assert "ParallelBlockModel.forward makes a tensor of 2 numbers from Python data (torch.tensor " \
        "of a list, at " in line and "model.py:64: x = self.embed(idx) * torch.tensor([1.0, 2.0]).mean()" in line \
        and line.endswith("make it with torch ops (torch.arange, torch.full, torch.linspace)"), line


LOSS = "        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))"
Z, Y = "logits.float().view(-1, logits.size(-1))", "targets.view(-1)"
LOSS_FORMS = {
    # label smoothing (Megatron's --label-smoothing), some targets ignored (padding, prompt tokens)
    "smoothing-ignored": f"F.cross_entropy({Z}, {Y}.masked_fill({Y} % 5 == 0, -100), label_smoothing=0.1)",
    # a loss per token, masked and averaged by hand (supervised fine-tuning's loss mask)
    "masked-per-token": f"(F.cross_entropy({Z}, {Y}, reduction='none') * ({Y} % 3 != 0)).sum() / ({Y} % 3 != 0).sum()",
    "sum": f"F.cross_entropy({Z}, {Y}, reduction='sum') / targets.numel()",
    # PaLM's z-loss: the square of log Z over the vocab, held near 0
    "z-loss": f"F.cross_entropy({Z}, {Y}) + 1e-3 * torch.logsumexp({Z}, -1).pow(2).mean()",
    "log-softmax-nll": f"F.nll_loss(F.log_softmax({Z}, -1), {Y})",
    "log-softmax-gather": f"-F.log_softmax({Z}, -1).gather(-1, {Y}.unsqueeze(1)).mean()",
    # (B, V, T) logits: the classes on dim 1, as torch takes them
    "classes-on-dim-1": "F.cross_entropy(logits.float().transpose(1, 2), targets)",
    # label smoothing by hand, a mean over the vocab: summed over the ranks' parts where they are equal (a vocab
    # of 256, not padded at tp 2; 257 is refused, below)
    "smoothing-by-hand": f"0.9 * F.nll_loss(F.log_softmax({Z}, -1), {Y}) - 0.1 * F.log_softmax({Z}, -1).mean()",
}
EVEN_VOCAB = ("smoothing-by-hand",)
LOSS_LAYOUTS = {"tp2": dict(tp=2), "cp2": dict(cp=2), "tp2-cp2": dict(tp=2, cp=2),
                "tp2-sp": dict(tp=2, sequence_parallel=True)}


@pytest.mark.parametrize("form, layout", [
    ("smoothing-ignored", "tp2"), ("smoothing-ignored", "cp2"), ("masked-per-token", "tp2"), ("sum", "tp2"),
    ("sum", "tp2-cp2"), ("z-loss", "tp2"), ("z-loss", "cp2"), ("z-loss", "tp2-sp"), ("log-softmax-nll", "tp2"),
    ("log-softmax-nll", "tp2-cp2"), ("log-softmax-gather", "tp2"), ("classes-on-dim-1", "tp2"),
    ("smoothing-by-hand", "tp2")])
def test_losses_written_other_ways_train_as_on_one_device(form, layout, tmp_path):
    """Over a vocab-parallel head each is computed from the ranks' parts of the logits, never gathered (each was
    refused at tp); at cp each rank's part of a sum counts n times, a mean over every token as one of its means."""
    source = open("examples/parallel_block.py").read().replace('"parallel_block"', f'"loss_{form}_{layout}"')
    assert LOSS in source
    if form in EVEN_VOCAB:
        source = source.replace("vocab_size: int = 257", "vocab_size: int = 256")
    (tmp_path / "model.py").write_text(source.replace(LOSS, f"        return {LOSS_FORMS[form]}"))
    assert_trains_as_one_device(f"{tmp_path}/model.py:SPEC", n_head=4, **LOSS_LAYOUTS[layout])


@pytest.mark.parametrize("loss, parallel, message", [
    (f"F.cross_entropy({Z}, {Y}, weight=torch.linspace(0.5, 1.5, logits.size(-1)))", ["--tp", "2"],
     "is a cross-entropy with class weights, which the vocab-parallel loss does not take: drop weight=, or leave "
     "head out of tp_plan"),
    (f"F.cross_entropy({Z}, {Y}) - 0.1 * F.log_softmax({Z}, -1).mean()", ["--tp", "2"],
     "reduces over dim 1, which head cut over the tp ranks (padded to a multiple of the ranks: no sum or mean "
     "over it)"),
    (f"F.cross_entropy({Z}, {Y}, reduction='none').max()", ["--cp", "2"],
     "is a loss context parallel cannot split: it needs (N, V) logits and (N,) targets, both of the rank's tokens, "
     "the mean or sum reduction and no class weights"),
], ids=["class-weights", "mean-over-padded-vocab", "cp-per-token"])
def test_a_loss_a_layout_cannot_split_is_one_line(loss, parallel, message, tmp_path, capsys):
    source = open("examples/parallel_block.py").read().replace('"parallel_block"', f'"refused_loss_{len(loss)}"')
    (tmp_path / "model.py").write_text(source.replace(LOSS, f"        return {loss}"))
    line = refusal(capsys, f"{tmp_path}/model.py:SPEC", "--n-layer", "2", *parallel)
    assert message in line, line


def test_an_own_models_config_fields_are_flags(tmp_path, capsys):
    """As its [model] keys are: --width was an unrecognized argument, the model unloaded when flags were read."""
    (tmp_path / "wide.py").write_text(open("examples/parallel_block.py").read().replace('"parallel_block"', '"wide"')
                                      .replace('    """Hidden size."""\n', '    """Hidden size."""\n    width: int = 3\n'))
    with pytest.raises(SystemExit):  # first, while the model is not yet loaded: --help loads it to list its fields
        answer_help(["--arch", f"{tmp_path}/wide.py:SPEC", "--help"])
    assert "--width WIDTH" in capsys.readouterr().out
    assert run_gpt.main(["--arch", f"{tmp_path}/wide.py:SPEC", "--width", "5", "--n-layer", "2", "--check-plan"]) == 0, \
        capsys.readouterr().err


def test_a_skip_over_several_stages_is_refused_with_the_fix(tmp_path, capsys):
    """The first block's output added after the last block: at pp 4 the last stage reads the first's tensor."""
    (tmp_path / "long_skip.py").write_text(
        open("examples/parallel_block.py").read().replace('"parallel_block"', '"long_skip"')
        .replace("        for block in self.blocks:\n            x = block(x)\n",
                 "        first = x = self.blocks[0](x)\n        for block in self.blocks[1:]:\n            x = block(x)\n"
                 "        x = x + first\n"))
    argv = ["--arch", f"{tmp_path}/long_skip.py:SPEC", "--micro-batch-size", "1", "--global-batch-size", "4"]
    assert run_gpt.main([*argv, "--pp", "2", "--check-plan"]) == 0, capsys.readouterr().err
    assert run_gpt.main([*argv, "--pp", "4", "--check-plan"]) == 2
    err = capsys.readouterr().err
    assert "stage 3 reads a tensor made on stage 0" in err and err.endswith(
        "use fewer stages (--pp, --virtual-pipeline-size) or --pipeline-layers that put the two on neighbouring "
        "stages\n"), err



HF_MODEL = '''
from dataclasses import dataclass

import torch.nn as nn
import torch.nn.functional as F
import transformers

from gcompile.models.spec import spec_with_defaults


@dataclass(frozen=True)
class Config:
    vocab_size: int = 257
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64


class HF(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.lm = transformers.CAUSAL_LM(transformers.MODELConfig(
            vocab_size=config.vocab_size, hidden_size=config.n_embd, num_hidden_layers=config.n_layer,
            num_attention_heads=config.n_head, max_position_embeddings=config.block_size,
            **{"attn_implementation": "sdpa", **OPTIONS}))

    def forward(self, idx, targets):
        logits = self.lm(input_ids=idx).logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


SPEC = spec_with_defaults("NAME", Config, HF, tp_plan=TP_PLAN)
'''
LAYERS = "lm.model.layers.*."
LLAMA_PLAN = (*(LAYERS + f"self_attn.{p}_proj=column" for p in "qkv"), LAYERS + "self_attn.o_proj=row",
              LAYERS + "mlp.gate_proj=column", LAYERS + "mlp.up_proj=column", LAYERS + "mlp.down_proj=row",
              "lm.model.embed_tokens=vocab", "lm.lm_head=vocab")
HF_MODELS = {
    # inv_freq a buffer; a DynamicCache started from empty tensors; the last hidden states sliced whole
    "Llama": (dict(intermediate_size=256, num_key_value_heads=2), LLAMA_PLAN),
    # q, k and v in one Linear and gate and up in another, taken apart by slices and chunk; a rotary over a slice
    # of every entry of the head dim joined to an empty one
    "Phi3": (dict(intermediate_size=256, num_key_value_heads=2, pad_token_id=None),
             (LAYERS + "self_attn.qkv_proj=column", LAYERS + "self_attn.o_proj=row",
              LAYERS + "mlp.gate_up_proj=column", LAYERS + "mlp.down_proj=row", "lm.model.embed_tokens=vocab",
              "lm.lm_head=vocab")),
    # a padding row in the vocab-parallel embedding (pad_token_id: token 149, the first of the test's batches);
    # norms whose weight starts at zero
    "Gemma": (dict(intermediate_size=256, num_key_value_heads=2, head_dim=16, pad_token_id=149), LLAMA_PLAN),
    # attention written by hand (eager), its scores soft-capped by tanh
    "Gemma2": (dict(intermediate_size=256, num_key_value_heads=2, head_dim=16, attn_implementation="eager"),
               LLAMA_PLAN),
    # its Linear is x @ W.T + b; q, k and v picked from a fused dim by select
    "Falcon": (dict(new_decoder_architecture=True, num_kv_heads=2),
               tuple(f"lm.transformer.h.*.{m}" for m in ("self_attention.query_key_value=column",
                                                         "self_attention.dense=row", "mlp.dense_h_to_4h=column",
                                                         "mlp.dense_4h_to_h=row")) +
               ("lm.transformer.word_embeddings=vocab", "lm.lm_head=vocab")),
    # its Conv1D: a weight of (in, out), used by addmm on the rows flattened
    "GPT2LMHeadModel": (dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
                        tuple(f"lm.transformer.h.*.{m}" for m in ("attn.c_attn=column", "attn.c_proj=row",
                                                                  "mlp.c_fc=column", "mlp.c_proj=row")) +
                        ("lm.transformer.wte=vocab", "lm.lm_head=vocab")),
}


@pytest.mark.parametrize("model,parallel", [
    ("Llama", dict(tp=2, sequence_parallel=True)), ("Llama", dict(tp=2, cp=2, cp_comm_type="a2a")),
    ("Llama", dict(pp=2)), ("Phi3", dict(tp=2, sequence_parallel=True)), ("Gemma", dict(tp=2)),
    ("Gemma2", dict(tp=2, cp=2, cp_comm_type="a2a")), ("Falcon", dict(tp=2, sequence_parallel=True)),
    ("Falcon", dict(cp=2, cp_comm_type="a2a")),
    ("GPT2LMHeadModel", dict(tp=2, sequence_parallel=True)), ("GPT2LMHeadModel", dict(cp=2, cp_comm_type="a2a"))],
    ids=["llama-tp2-sp", "llama-tp2-cp2-a2a", "llama-pp2", "phi3-tp2-sp", "gemma-tp2", "gemma2-tp2-cp2-a2a", "falcon-tp2-sp",
         "falcon-cp2-a2a", "gpt2-tp2-sp", "gpt2-cp2-a2a"])
def test_a_hugging_face_model_as_it_is(model, parallel, tmp_path):
    """transformers' models, unchanged, as your own model, each a wrapper that returns the loss and a tp plan
    naming its Linears: each met refusals (the comments of HF_MODELS) in real HF code that the forms above
    were written after."""
    pytest.importorskip("transformers")
    options, plan = HF_MODELS[model]
    name = f"hf_{model}_" + "_".join(map(str, parallel.values()))
    causal_lm, family = (model, model.removesuffix("LMHeadModel")) if model.endswith("Model") else \
        (f"{model}ForCausalLM", model)
    (tmp_path / "hf.py").write_text(HF_MODEL.replace("CAUSAL_LM", causal_lm).replace("MODEL", family)
                                    .replace('"NAME"', f'"{name}"')
                                    .replace("**OPTIONS", f"**{options!r}").replace("TP_PLAN", repr(plan)))
    assert_trains_as_one_device(f"{tmp_path}/hf.py:SPEC", n_head=4, **parallel)
