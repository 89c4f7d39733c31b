"""One rank: captured, lowered (and compiled) graphs train exactly like eager autograd + AdamW.

Tolerance: fp32 on CPU, relative error of losses, gradients and parameters at
most 1e-5 (norm-wise per tensor); the key bias is compared by its premise only
(see tests/reference.py: its true gradient is zero). Two microbatches per step exercise gradient
accumulation; clipping is active (clip_grad below the norms seen).
"""

import pytest
import torch

from gcompile.compile import Compiler, compile_rank_program
from gcompile.config import build_config
from gcompile.axes import Coords
from gcompile.pipeline import build_rank_program
from gcompile.runtime import Runtime
from gcompile.state import TrainState
from gcompile.train import split_microbatches
from tests.reference import (ADAM_EPS, assert_key_bias_is_noise, random_batches, reference_run, rel_err,
                             without_key_bias)

TOL = 1e-5
STEPS = 3


def small_config(**train):
    return build_config({
        "model": dict(n_layer=2, n_head=4, n_embd=64, block_size=32),
        "train": dict(micro_batch_size=2, global_batch_size=4, seq_length=32, lr=1e-3, clip_grad=0.5,
                      weight_decay=0.1, adam_eps=ADAM_EPS, **train),
    })


def run_gcompile(config, batches, lrs, compile: bool):
    program = build_rank_program(config, Coords.from_rank(0, {}), log=lambda _: None)
    functions, step = compile_rank_program(program, Compiler(enabled=compile))
    state = TrainState.initial(program, config.model, config.train.seed, "cpu")
    runtime = Runtime(program, functions, step, state)
    results = []
    for tokens, lr in zip(batches, lrs):
        micro = split_microbatches(tokens, config.train.micro_batch_size)
        state.lr.fill_(lr)
        loss = runtime.forward_backward(micro)
        grads = {n: v.clone() for n, v in program.layout.views(state.grads).items()}
        grad_norm, _ = runtime.optimizer_step()
        params = {n: v.clone() for n, v in program.layout.views(state.params).items()}
        results.append((loss.item(), grad_norm.item(), grads, params))
    return results


@pytest.mark.parametrize("compile", [False, True], ids=["fx", "inductor"])
@pytest.mark.parametrize("recompute", [False, True], ids=["save", "recompute"])
def test_matches_eager_adamw(compile, recompute):
    config = small_config(recompute_activations=recompute)
    C = config.model.n_embd
    batches = random_batches(config, STEPS)
    lrs = [1e-3, 6e-4, 3e-4]
    expected = reference_run(config, batches, lrs)
    actual = run_gcompile(config, batches, lrs, compile)
    for step, (ref, (loss, grad_norm, grads, params)) in enumerate(zip(expected, actual)):
        assert abs(loss - ref.loss) / ref.loss < TOL, f"step {step} loss {loss} != {ref.loss}"
        assert abs(grad_norm - ref.grad_norm) / ref.grad_norm < TOL, f"step {step} grad norm"
        assert ref.grad_norm > config.train.clip_grad, "clipping must be active for this test to mean anything"
        assert grads.keys() == ref.grads.keys()
        for name in ref.grads:
            assert rel_err(grads[name], ref.grads[name]) < TOL, f"step {step} grad {name}"
            assert_key_bias_is_noise(name, ref.grads[name], C)
            assert rel_err(without_key_bias(name, params[name], C),
                           without_key_bias(name, ref.params[name], C)) < TOL, f"step {step} param {name}"
