"""Llama trains like one device under every pass, with no model-specific code in the passes.

Numerics: fp32, relative error at most 1e-5 of losses and grad norms per step and of the final
parameters (norm-wise), against single-device eager autograd + AdamW (tests/reference.py) on
random tokens over 3 steps; every rank in this process (gcompile.harness), plus Inductor on one
rank and on tp2 pp2 gloo ranks (final parameters at tests/test_data_parallel.py's COMPILED_PARAM_TOL,
whose reason is written there). The tiny model has grouped-query attention (8 query heads, 4 kv heads), an
untied head unless a case ties it, and an SwiGLU width that is not 4x the hidden size.
"""

import functools

import pytest
import torch

import run_gpt
from gcompile import harness
from gcompile.config import ConfigError, build_config, load_toml
from gcompile.models.llama import LLAMA, rope, rotate_half
from gcompile.pipeline import BuildCache
from gcompile.world import build_world
from tests.multirank import run_layouts
from tests.test_data_parallel import COMPILED_PARAM_TOL, assert_bf16_matches
from tests.reference import ADAM_EPS, random_batches, reference_run, rel_err
from tests.test_single_rank import run_gcompile

TOL = 1e-5
LRS = [1e-3, 6e-4, 3e-4]
BUILD = BuildCache()


def config(tie=False, n_layer=2, compile=False, bf16=False, **parallel):
    return build_config({
        "model": dict(arch="llama", n_layer=n_layer, n_head=8, n_kv_head=4, n_embd=64, ffn_hidden_size=96,
                      block_size=32, tie_word_embeddings=tie),
        "parallel": parallel,
        "train": dict(micro_batch_size=2, global_batch_size=4 * parallel.get("dp", 1), seq_length=32, lr=1e-3,
                      clip_grad=0.5, weight_decay=0.1, adam_eps=ADAM_EPS, compile=compile,
                      bf16=bf16),
    })


@functools.cache
def expected(tie: bool, n_layer: int, dp: int):
    cfg = config(tie, n_layer, dp=dp)
    batches = random_batches(cfg, len(LRS))
    return batches, reference_run(cfg, batches, LRS)


def assert_matches(losses, grad_norms, params, reference, label, param_tol=TOL):
    for step, ref in enumerate(reference):
        assert abs(losses[step] - ref.loss) / ref.loss < TOL, f"{label} step {step} loss"
        assert abs(grad_norms[step] - ref.grad_norm) / ref.grad_norm < TOL, f"{label} step {step} grad norm"
    assert sorted(params) == sorted(reference[-1].params)
    for name, value in reference[-1].params.items():
        assert rel_err(params[name], value) < param_tol, f"{label}: {name}"


CASES = {
    "tp2": dict(tp=2),
    "tp4-gqa": dict(tp=4),
    "tp2-sp": dict(tp=2, sequence_parallel=True),
    "tp4-sp": dict(tp=4, sequence_parallel=True),
    "pp2-1f1b": dict(pp=2),
    "tp2-pp2-interleaved-sp-tied": dict(tp=2, pp=2, virtual_pipeline_size=2, sequence_parallel=True, tie=True,
                                        n_layer=4),
    "tp2-pp2-zb1f1b": dict(tp=2, pp=2, pipeline_schedule="zb1f1b"),
    "tp2-pp2-dp2-distributed-optimizer": dict(tp=2, pp=2, dp=2, use_distributed_optimizer=True),
}


@pytest.mark.parametrize("case", CASES)
def test_layout_matches_single_device(case):
    options = dict(CASES[case])
    tie, n_layer = options.pop("tie", False), options.pop("n_layer", 2)
    batches, reference = expected(tie, n_layer, options.get("dp", 1))
    (result,) = harness.run_layouts([config(tie, n_layer, **options)], batches, LRS, cache=BUILD)
    assert_matches(result.losses, result.grad_norms, result.params, reference, case)


def test_bf16_tp2_matches_single_device_bf16():
    """Mixed precision at test_data_parallel.py's bf16 tolerances (their reasons are written there)."""
    batches, _ = expected(False, 2, 1)
    reference = reference_run(config(bf16=True), batches, LRS, dtype=torch.bfloat16)
    (result,) = harness.run_layouts([config(bf16=True, tp=2)], batches, LRS, cache=BUILD)
    assert_bf16_matches(result, reference, "bf16 tp2")


@pytest.mark.slow
def test_compiled_tp2_pp2_on_ranks_matches_single_device(tmp_path):
    """Inductor-compiled graphs on real gloo ranks (P2P, shared-memory tp groups)."""
    batches, reference = expected(False, 2, 1)
    (result,) = run_layouts(tmp_path, [config(tp=2, pp=2, compile=True)], batches, LRS)
    assert_matches(result.losses, result.grad_norms, result.params, reference, "tp2-pp2-compiled",
                   COMPILED_PARAM_TOL)


def test_compiled_on_one_rank_matches_single_device():
    batches, reference = expected(False, 2, 1)
    results = run_gcompile(config(), batches, LRS, compile=True)
    assert_matches([r[0] for r in results], [r[1] for r in results], results[-1][3], reference, "inductor",
                   COMPILED_PARAM_TOL)


def test_tensor_parallel_cuts_kv_heads():
    """Rank 1 of tp 2 holds query heads 4..7 and kv heads 2..3 (the kv heads its query heads read)."""
    cfg = config(tp=2)
    program = build_world(cfg, log=lambda _: None, cache=BUILD)[1]
    shapes = {p.name: p.local_shape(program.coords.axis_sizes) for p in program.layout.params}
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (32, 64)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (16, 64)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (64, 32)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (64, 48)
    assert shapes["lm_head.weight"] == (256, 64)  # the vocab 257 padded to a multiple of 128 * 2, then halved


def test_rotary_embedding_rotates_pairs_by_position():
    """Against the definition: dims i and i + hd/2 of position p turn by the angle p * theta^(-2i/hd)."""
    cfg = config().model
    x = torch.randn(1, 1, 5, cfg.head_dim, dtype=torch.float64)
    cos, sin = (t.double() for t in rope(cfg, 5, "cpu"))
    rotated = x * cos + rotate_half(x) * sin
    half = cfg.head_dim // 2
    for p in range(5):
        for i in range(half):
            angle = torch.tensor(p * cfg.rope_theta ** (-2 * i / cfg.head_dim), dtype=torch.float64)
            a, b = x[0, 0, p, i], x[0, 0, p, i + half]
            assert torch.allclose(rotated[0, 0, p, i], a * angle.cos() - b * angle.sin(), atol=1e-6)
            assert torch.allclose(rotated[0, 0, p, i + half], b * angle.cos() + a * angle.sin(), atol=1e-6)


@pytest.mark.parametrize("argv, message", [
    (["--arch", "llama", "--tp", "8"], "n_kv_head=4 is not divisible by tp=8"),
    (["--arch", "llama", "--n-kv-head", "3"], "n_kv_head=3 must divide n_head=8"),
    (["--n-kv-head", "2"], "n_kv_head: not a key of arch=gpt2"),
    (["--arch", "llama", "--dropout", "0.1"], "dropout: not a key of arch=llama"),
    (["--arch", "mamba"], "arch='mamba' is not a model family here; known: gpt2, llama"),
])
def test_bad_model_flags(argv, message, capsys):
    assert run_gpt.main(argv + ["--train-iters", "1"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_presets_build_and_fit_their_shapes(capsys):
    """The published shapes: parameter counts of Llama 3.2 1B (tied) and Llama 3 8B."""
    for preset, billions in (("configs/llama3.2-1b.toml", 1.236), ("configs/llama3-8b.toml", 8.030)):
        cfg = build_config(load_toml(preset))
        with torch.device("meta"):
            model = LLAMA.module(cfg.model)
        assert abs(sum(p.numel() for p in model.parameters()) / 1e9 - billions) < 0.001, preset
    with pytest.raises(ConfigError):
        build_config({"model": dict(arch="llama", n_embd=65, n_head=5, n_kv_head=5)})  # odd head_dim: no RoPE
