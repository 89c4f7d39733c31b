"""One GPU, one run: bf16 tokens/s and MFU of gcompile (compiled, CUDA graphs) against torch.compile + fused AdamW.

    python bench/gpu_check.py                     # gpt2-small and gpt2-medium
    python bench/gpu_check.py --peak-tflops 989   # dense bf16 peak for MFU (H100/H200 SXM datasheet)

MFU = Megatron's FLOPs per step / step time / peak. Run by bench/gpu_check.sh.
"""

import argparse
import statistics
import time

import torch

from gcompile.compile import Compiler, compile_rank_program
from gcompile.config import build_config, load_toml
from gcompile.cuda_graphs import GraphedTrainStep
from gcompile.axes import Coords
from gcompile.pipeline import build_rank_program
from gcompile.runtime import Runtime
from gcompile.state import TrainState
from gcompile.train import split_microbatches


def timed(step, tokens, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        step(tokens)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step(tokens)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def torch_compile_step(config):
    t = config.train
    model = config.model_spec.build(config.model, t.seed, device="cuda").to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, fused=True)
    forward = torch.compile(model)

    def step(tokens):
        micro = split_microbatches(tokens, t.micro_batch_size)
        for idx, targets in micro:
            (forward(idx, targets) / len(micro)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip_grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def gcompile_step(config):
    program = build_rank_program(config, Coords.from_rank(0, {}), device="cuda", log=lambda _: None)
    functions, opt = compile_rank_program(program, Compiler(enabled=True))
    state = TrainState.initial(program, config.model, config.train.seed, "cuda")
    state.lr.fill_(config.train.lr)
    graphed = GraphedTrainStep(Runtime(program, functions, opt, state))
    return lambda tokens: graphed(split_microbatches(tokens, config.train.micro_batch_size))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", default=["configs/gpt2-small.toml", "configs/gpt2-medium.toml"])
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16 peak {args.peak_tflops} TFLOP/s")
    print(f"{'config':28s} {'runner':34s} {'tokens/s':>10s} {'MFU':>6s}")
    for path in args.configs:
        overrides = load_toml(path)
        overrides["train"] = dict(overrides.get("train", {}), micro_batch_size=args.micro_batch_size,
                                  global_batch_size=args.micro_batch_size, seq_length=args.seq_length,
                                  bf16=True, compile=True)
        config = build_config(overrides)
        t = config.train
        tokens = torch.randint(0, config.model.vocab_size, (t.global_batch_size, t.seq_length + 1), device="cuda")
        flops = config.model_spec.flops(config.model, t.global_batch_size, t.seq_length)
        for name, make in (("torch.compile + fused AdamW", torch_compile_step),
                           ("gcompile --compile --cuda-graphs", gcompile_step)):
            seconds = timed(make(config), tokens, warmup=4, iters=args.iters)
            print(f"{path:28s} {name:34s} {t.global_batch_size * t.seq_length / seconds:10.0f} "
                  f"{flops / seconds / (args.peak_tflops * 1e12):6.1%}", flush=True)


if __name__ == "__main__":
    main()
