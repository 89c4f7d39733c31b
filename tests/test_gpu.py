"""CUDA-only checks (skipped without a GPU; bench/gpu_check.sh runs them on a lent one)."""

import os

import pytest
import torch

from gcompile.compile import Compiler, compile_rank_program
from gcompile.config import build_config
from gcompile.cuda_graphs import GraphedTrainStep
from gcompile.axes import Coords
from gcompile.pipeline import build_rank_program
from gcompile.runtime import Runtime
from gcompile.state import TrainState
from gcompile.train import split_microbatches
from tests.reference import random_batches

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS first starts: deterministic GEMMs


@pytest.fixture
def deterministic():
    """Bitwise comparisons need deterministic kernels: without them two plain fp32 runs on an H200 already
    differed in the last bit of the grad norm (Inductor lowers scatter-adds such as the embedding's
    backward to atomic adds; in deterministic mode it falls back to ATen's sorted kernel)."""
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def runtime_for(config):
    program = build_rank_program(config, Coords.from_rank(0, {}), device="cuda", log=lambda _: None)
    functions, step = compile_rank_program(program, Compiler(enabled=config.train.compile))
    state = TrainState.initial(program, config.model, config.train.seed, "cuda")
    state.lr.fill_(config.train.lr)
    return Runtime(program, functions, step, state)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_cuda_graph_replay_equals_the_plain_run(bf16, deterministic):
    config = build_config({"model": dict(n_layer=2, n_head=4, n_embd=128, block_size=64),
                           "train": dict(micro_batch_size=2, global_batch_size=4, seq_length=64, compile=True,
                                         bf16=bf16)})
    batches = [split_microbatches(b.cuda(), 2) for b in random_batches(config, 6)]
    plain, graphed = runtime_for(config), GraphedTrainStep(runtime_for(config))
    for step, batch in enumerate(batches):
        expected, actual = plain.train_step(batch), graphed(batch)
        assert actual.loss.item() == expected.loss.item(), step
        assert actual.grad_norm.item() == expected.grad_norm.item(), step
    assert graphed.graph is not None, "the last steps replayed a captured graph"
    assert torch.equal(graphed.runtime.state.params, plain.state.params)


def test_the_allocator_saw_at_least_the_measured_peak():
    """The runtime's boundary samples count allocated storages, so CUDA's allocator peak over the same step
    (which also sees the graphs' intermediates) is at least their sum."""
    config = build_config({"model": dict(n_layer=2, n_head=4, n_embd=128, block_size=64),
                           "train": dict(micro_batch_size=2, global_batch_size=4, seq_length=64)})
    runtime = runtime_for(config)
    runtime.start_measuring()
    runtime.train_step(split_microbatches(random_batches(config, 1)[0].cuda(), 2))
    peak = runtime.stop_measuring()
    assert peak.allocator_peak >= peak.peak.total > sum(runtime.state.buffer_bytes().values())


def test_experts_train_on_cuda_like_on_cpu():
    """MoE on CUDA (its grouped matmul one matmul per expert, read counts on the host; CUDA graphs stay off):
    three compiled steps on the GPU give the CPU's losses (fp32, TF32 off by default) to 1e-4."""
    config = build_config({"model": dict(n_layer=2, n_head=4, n_embd=64, block_size=32, num_experts=4,
                                         moe_aux_loss_coeff=0.01),
                           "train": dict(micro_batch_size=2, global_batch_size=4, seq_length=32, compile=True)})
    batches = random_batches(config, 3)
    losses = {}
    for device in ("cpu", "cuda"):
        program = build_rank_program(config, Coords.from_rank(0, {}), device=device, log=lambda _: None)
        functions, step = compile_rank_program(program, Compiler(enabled=True))
        state = TrainState.initial(program, config.model, config.train.seed, device)
        state.lr.fill_(config.train.lr)
        runtime = Runtime(program, functions, step, state)
        losses[device] = [runtime.train_step(split_microbatches(b.to(device), 2)).loss.item() for b in batches]
    assert all(abs(g - c) / c < 1e-4 for g, c in zip(losses["cuda"], losses["cpu"])), losses
