"""One rank, one run: tokens/s of eager, torch.compile and gcompile on the same model and batch.

    python bench/single_rank.py                 # 4 layers, 256 wide, T=256 (the issue's config)
    python bench/single_rank.py --n-layer 2 --n-embd 64 --seq-length 64
    python bench/single_rank.py --arch llama    # Llama's shapes at the same width

(a) eager module + torch.optim.AdamW
(b) torch.compile(model) + torch.optim.AdamW (nanoGPT's way)
(c) gcompile, graphs run uncompiled
(d) gcompile --compile
Each also reports achieved FLOP/s (Megatron's formula) as a fraction of this
machine's fp32 matmul peak, measured in the same run.
"""

import argparse
import statistics
import time

import torch

from flags import adamw_groups, add_model_flags, count, model_section, refused_in_one_line  # bench/, on sys.path
from gcompile.compile import Compiler, compile_rank_program
from gcompile.config import build_config
from gcompile.axes import Coords
from gcompile.pipeline import build_rank_program
from gcompile.runtime import Runtime
from gcompile.state import TrainState
from gcompile.train import split_microbatches


def matmul_peak(n: int = 2048, repeats: int = 10) -> float:
    """Best fp32 FLOP/s of an n x n x n matmul on this machine."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(2):
        a @ b
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * n ** 3 / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def time_round_robin(steps: dict, tokens, warmup: int, iters: int) -> dict[str, float]:
    """Median seconds per step of each contender, taking turns step by step so that load on a shared
    machine falls on all of them alike."""
    for step in steps.values():
        for _ in range(warmup):
            step(tokens)
    times = {name: [] for name in steps}
    for _ in range(iters):
        for name, step in steps.items():
            times[name].append(_timed(lambda: step(tokens)))
    return {name: statistics.median(t) for name, t in times.items()}


def torch_step_fn(config, compiled: bool):
    t = config.train
    model = config.model_spec.build(config.model, t.seed)
    optimizer = torch.optim.AdamW(adamw_groups(model, config), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2))
    forward = torch.compile(model) if compiled else model

    def step(tokens):
        micro = split_microbatches(tokens, t.micro_batch_size)
        for idx, targets in micro:
            (forward(idx, targets) / len(micro)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip_grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def one_rank_runtime(config, compiled: bool) -> Runtime:
    """gcompile's Runtime for `config` on one rank, its weights at their initial values, lr set."""
    program = build_rank_program(config, Coords.from_rank(0, {}), log=lambda _: None)
    functions, opt_step = compile_rank_program(program, Compiler(enabled=compiled))
    state = TrainState.initial(program, config.model, config.train.seed, "cpu")
    state.lr.fill_(config.train.lr)
    return Runtime(program, functions, opt_step, state)


def gcompile_step_fn(config, compiled: bool):
    runtime = one_rank_runtime(config, compiled)
    return lambda tokens: runtime.train_step(split_microbatches(tokens, config.train.micro_batch_size))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_flags(p)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--iters", type=count, default=20)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    with refused_in_one_line(p):
        config = build_config({
            "model": model_section(args),
            "train": dict(micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
                          seq_length=args.seq_length),
        })
    t = config.train
    tokens = torch.randint(0, config.model.vocab_size, (t.global_batch_size, t.seq_length + 1),
                           generator=torch.Generator().manual_seed(0))
    flops = config.model_spec.flops(config.model, t.global_batch_size, t.seq_length)
    peak = matmul_peak()
    print(f"config: {args.arch}, {args.n_layer} layers, {args.n_embd} wide, {args.n_head} heads, T={t.seq_length}, "
          f"{t.global_batch_size // t.micro_batch_size} x {t.micro_batch_size} samples/step, "
          f"{torch.get_num_threads()} threads")
    runs = {
        "(a) eager + AdamW": lambda: torch_step_fn(config, compiled=False),
        "(b) torch.compile + AdamW": lambda: torch_step_fn(config, compiled=True),
        "(c) gcompile (FX graphs)": lambda: gcompile_step_fn(config, compiled=False),
        "(d) gcompile --compile": lambda: gcompile_step_fn(config, compiled=True),
    }
    results = time_round_robin({name: make() for name, make in runs.items()}, tokens, args.warmup, args.iters)
    peak = max(peak, matmul_peak())  # again after the run: the better of two readings
    print(f"fp32 matmul peak (2048^3, best of two readings): {peak / 1e9:.1f} GFLOP/s")
    baseline = results["(b) torch.compile + AdamW"]
    print(f"{'':28s} {'tokens/s':>10s} {'vs (b)':>7s} {'GFLOP/s':>8s} {'of peak':>8s}")
    for name, seconds in results.items():
        print(f"{name:28s} {t.global_batch_size * t.seq_length / seconds:10.0f} {baseline / seconds:6.2f}x "
              f"{flops / seconds / 1e9:8.1f} {flops / seconds / peak:7.0%}")


if __name__ == "__main__":
    main()
