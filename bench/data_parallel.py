"""Data parallel, one run: gcompile against torch DDP + torch.optim.AdamW, and optimizer memory per rank.

    python bench/data_parallel.py                    # dp=2, 4 layers, 256 wide, T=256, 8 samples per rank
    python bench/data_parallel.py --memory-config configs/gpt2-small.toml

Throughput: each variant runs on `--dp` gloo ranks (one process each, threads
split evenly), same model, same global batch, timed after warm-up; rank 0
reports the median step time. Memory: fp32 main weights + AdamW states per
rank for dp in {1, 2, 4}, with and without the distributed optimizer, counted
from each rank's flat layout (nothing is allocated).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from gcompile.config import build_config, load_toml
from gcompile.axes import Coords
from gcompile.mesh import init_groups
from flags import adamw_groups  # bench/, first on sys.path when run as a script

VARIANTS = {
    "torch DDP + AdamW (eager)": dict(kind="ddp"),
    "gcompile dp (FX graphs)": dict(kind="gcompile", compile=False, sharded=False),
    "gcompile dp --compile": dict(kind="gcompile", compile=True, sharded=False),
    "gcompile dp --compile --overlap-grad-reduce": dict(kind="gcompile", compile=True, sharded=False, overlap=True),
    "gcompile dp --compile --use-distributed-optimizer": dict(kind="gcompile", compile=True, sharded=True),
}


def make_config(args, dp: int, **train):
    parallel = dict(dp=dp, use_distributed_optimizer=train.pop("sharded", False),
                    overlap_grad_reduce=train.pop("overlap", False), ddp_bucket_size=args.bucket_size)
    return build_config({
        "model": dict(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, block_size=args.seq_length),
        "parallel": parallel,
        "train": dict(micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
                      global_batch_size=args.micro_batch_size * dp, **train),
    })


def ddp_step_fn(config, rank: int):
    t = config.train
    model = config.model_spec.build(config.model, t.seed)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(adamw_groups(model, config), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2))

    def step(tokens):
        idx, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        ddp(idx, targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip_grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def gcompile_step_fn(config, rank: int):
    from gcompile.compile import Compiler, compile_rank_program
    from gcompile.pipeline import build_rank_program
    from gcompile.runtime import Runtime
    from gcompile.state import TrainState
    from gcompile.train import split_microbatches

    coords = Coords.from_rank(rank, config.mesh_sizes)
    init_groups(coords)
    program = build_rank_program(config, coords, log=lambda _: None)
    for turn in range(coords.world_size):  # one rank compiles at a time; the others hit the cache
        if turn == rank:
            functions, opt = compile_rank_program(program, Compiler(enabled=config.train.compile))
        dist.barrier()
    state = TrainState.initial(program, config.model, config.train.seed, "cpu")
    state.lr.fill_(config.train.lr)
    runtime = Runtime(program, functions, opt, state)
    return lambda tokens: runtime.train_step(split_microbatches(tokens, config.train.micro_batch_size))


def worker(args) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=rank, world_size=world)
    variant = VARIANTS[args.variant]
    train = dict(compile=variant.get("compile", False), sharded=variant.get("sharded", False),
                 overlap=variant.get("overlap", False))
    config = make_config(args, world, **train)
    step = (ddp_step_fn if variant["kind"] == "ddp" else gcompile_step_fn)(config, rank)
    tokens = torch.randint(0, config.model.vocab_size, (config.train.micro_batch_size, config.train.seq_length + 1),
                           generator=torch.Generator().manual_seed(rank))
    for _ in range(args.warmup):
        step(tokens)
    times = []
    for _ in range(args.iters):
        dist.barrier()
        start = time.perf_counter()
        step(tokens)
        times.append(time.perf_counter() - start)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(dict(seconds=statistics.median(times)), f)
    dist.destroy_process_group()


def run_variant(args, name: str) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        argv = [sys.executable, os.path.abspath(__file__), "--worker", "--variant", name, "--store",
                os.path.join(tmp, "store"), "--out", out] + _model_flags(args)
        procs = [subprocess.Popen(argv, env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(args.dp)))
                 for r in range(args.dp)]
        if any(p.wait() for p in procs):
            raise RuntimeError(f"{name}: a rank failed")
        with open(out) as f:
            return json.load(f)["seconds"]


def _model_flags(args) -> list[str]:
    return [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
            ("n_layer", "n_embd", "n_head", "seq_length", "micro_batch_size", "iters", "warmup", "bucket_size")]


def optimizer_bytes_table(config_path: str) -> str:
    from gcompile.pipeline import build_rank_program

    overrides = load_toml(config_path)
    lines = [f"optimizer memory per rank ({config_path}: exp_avg + exp_avg_sq, + fp32 main weights when kept apart):",
             f"{'dp':>4} {'plain':>12} {'distributed':>12}"]
    for dp in (1, 2, 4):
        row = []
        for sharded in (False, True):
            parallel = dict(overrides.get("parallel", {}), dp=dp, use_distributed_optimizer=sharded)
            train = dict(overrides.get("train", {}), global_batch_size=overrides.get("train", {}).get(
                "micro_batch_size", 8) * dp * 2)
            config = build_config(dict(overrides, parallel=parallel, train=train))
            program = build_rank_program(config, Coords.from_rank(0, {"dp": dp}), log=lambda _: None)
            numel = program.layout.shard_numel if sharded else program.layout.numel
            buffers = 3 if program.step_settings.separate_main else 2  # no main copy: fp32 weights updated in place
            row.append(buffers * 4 * numel)
        lines.append(f"{dp:>4} {row[0] / 2**30:10.3f} GiB {row[1] / 2**30:10.3f} GiB")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--bucket-size", type=int, default=1_000_000, help="--ddp-bucket-size for gcompile")
    p.add_argument("--memory-config", default="configs/gpt2-small.toml")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    tokens = args.dp * args.micro_batch_size * args.seq_length
    print(f"dp={args.dp}: {args.n_layer} layers, {args.n_embd} wide, T={args.seq_length}, "
          f"{args.micro_batch_size} samples per rank per step, gloo, {os.cpu_count()} cores")
    results = {name: run_variant(args, name) for name in VARIANTS}
    baseline = results["torch DDP + AdamW (eager)"]
    print(f"{'':52s} {'tokens/s':>9s} {'vs DDP':>7s}")
    for name, seconds in results.items():
        print(f"{name:52s} {tokens / seconds:9.0f} {baseline / seconds:6.2f}x")
    print(optimizer_bytes_table(args.memory_config))


if __name__ == "__main__":
    main()
