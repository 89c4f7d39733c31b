"""Data parallel, one run: gcompile against torch DDP and FSDP2 + torch.optim.AdamW, and optimizer memory per rank.

    python bench/data_parallel.py                    # dp=2, 4 layers, 256 wide, T=256, 8 samples per rank
    python bench/data_parallel.py --memory-config configs/gpt2-small.toml

Throughput: each variant runs on `--dp` gloo ranks (one process each, threads
split evenly), same model, same weights, same data, same global batch, timed
after warm-up; rank 0 reports the median step time. All variants run once per
round, `--repeats` rounds, so launch-to-launch noise shows as the spread of a
row. FSDP2 is torchtitan's: `fully_shard` on each transformer block, then on
the root, fp32; compiled as torchtitan compiles, each block by itself before
sharding. A variant whose config gcompile refuses (a sharding strategy not
built yet) or whose ranks fail keeps its row, with the reason.

Memory: fp32 main weights + AdamW states per rank for dp in {1, 2, 4}, with and
without the distributed optimizer, counted from each rank's flat layout
(nothing is allocated).
"""

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist

from gcompile.config import ConfigError, build_config, load_toml
from gcompile.axes import Coords
from flags import (add_worker_flags, count, gcompile_runtime, join_gloo, median_step,  # bench/, first on sys.path
                   refused_in_one_line, spawn_ranks, torch_step)

COMPILE = dict(compile=True)
VARIANTS = {  # name -> the step's kind and the [train] / [parallel] keys it runs with
    "torch DDP + AdamW (eager)": dict(kind="ddp"),
    "torch FSDP2 fully_shard + AdamW (eager)": dict(kind="fsdp2"),
    "torch FSDP2 fully_shard + AdamW (torch.compile)": dict(kind="fsdp2", train=COMPILE),
    "gcompile dp (FX graphs)": dict(kind="gcompile"),
    "gcompile dp --compile": dict(kind="gcompile", train=COMPILE),
    "gcompile dp --compile --overlap-grad-reduce": dict(kind="gcompile", train=COMPILE,
                                                        parallel=dict(overlap_grad_reduce=True)),
    "gcompile dp --compile --use-distributed-optimizer": dict(kind="gcompile", train=COMPILE,
                                                              parallel=dict(use_distributed_optimizer=True)),
    "gcompile dp --compile ZeRO-2 (optim_grads)": dict(
        kind="gcompile", train=COMPILE, parallel=dict(data_parallel_sharding_strategy="optim_grads")),
    "gcompile dp --compile ZeRO-3 (optim_grads_params)": dict(
        kind="gcompile", train=COMPILE, parallel=dict(data_parallel_sharding_strategy="optim_grads_params")),
}
BASELINES = {"vs DDP": "torch DDP + AdamW (eager)",
             "vs FSDP2 compiled": "torch FSDP2 fully_shard + AdamW (torch.compile)"}
"""Column -> the row every other row is divided by: DDP as before, and FSDP2 compiled (issue 15's target)."""


def make_config(args, dp: int, variant: dict):
    return build_config({
        "model": dict(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, block_size=args.seq_length),
        "parallel": dict(dp=dp, ddp_bucket_size=args.bucket_size, **variant.get("parallel", {})),
        "train": dict(micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
                      global_batch_size=args.micro_batch_size * dp, **variant.get("train", {})),
    })


def ddp_step_fn(config, rank: int):
    model = config.model_spec.build(config.model, config.train.seed)
    return torch_step(torch.nn.parallel.DistributedDataParallel(model), model, config)


def fsdp2_step_fn(config, rank: int):
    """torchtitan's FSDP2: each block of the model's ModuleLists sharded by itself (one all-gather per block,
    resharded after forward), then the root (embeddings, final norm, head); with compile, each block is
    torch.compile'd (fullgraph) before it is sharded, as torchtitan does: compiling the whole sharded model
    instead leaves FSDP2's sharded blocks to run eagerly."""
    from torch.distributed.fsdp import fully_shard

    model = config.model_spec.build(config.model, config.train.seed)
    for blocks in [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]:
        for i, block in enumerate(blocks):
            if config.train.compile:
                blocks[i] = block = torch.compile(block, fullgraph=True)
            fully_shard(block)
    fully_shard(model)
    return torch_step(model, model, config)


def gcompile_step_fn(config, rank: int):
    from gcompile.train import split_microbatches

    runtime = gcompile_runtime(config, rank)
    return lambda tokens: runtime.train_step(split_microbatches(tokens, config.train.micro_batch_size))


STEP_FNS = {"ddp": ddp_step_fn, "fsdp2": fsdp2_step_fn, "gcompile": gcompile_step_fn}


def worker(args) -> None:
    rank, world = join_gloo(args.store)
    variant = VARIANTS[args.variant]
    config = make_config(args, world, variant)
    step = STEP_FNS[variant["kind"]](config, rank)
    tokens = torch.randint(0, config.model.vocab_size, (config.train.micro_batch_size, config.train.seq_length + 1),
                           generator=torch.Generator().manual_seed(rank))
    seconds = median_step(step, tokens, args.warmup, args.iters)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(dict(seconds=seconds), f)
    dist.destroy_process_group()


def run_variant(args, name: str) -> float:
    """Rank 0's median step time; RuntimeError with the failing rank's last line of stderr."""
    return spawn_ranks(__file__, ["--variant", name] + _model_flags(args), args.dp)["seconds"]


def measure(args) -> dict[str, list[float] | str]:
    """Each variant's tokens/s, one per round, or why it did not run: refused by gcompile's config (checked
    before any rank starts) or a failed rank. Each round runs every variant in turn, so a row's launches
    are a round apart and a busy spell of the machine shows as that row's spread."""
    tokens = args.dp * args.micro_batch_size * args.seq_length
    results = {}
    chosen = {name: v for name, v in VARIANTS.items()
              if not args.only or name in BASELINES.values() or any(word in name for word in args.only)}
    for name, variant in chosen.items():
        try:
            make_config(args, args.dp, variant)
            results[name] = []
        except ConfigError as e:
            results[name] = f"not run: {e}"
    for _ in range(args.repeats):
        for name, runs in list(results.items()):
            if isinstance(runs, list):
                try:
                    runs.append(tokens / run_variant(args, name))
                except RuntimeError as e:
                    results[name] = str(e)
    return results


def throughput_table(results: dict[str, list[float] | str]) -> str:
    """tokens/s (median over rounds), spread ((max - min) / median over rounds) and ratios to BASELINES."""
    medians = {name: statistics.median(runs) for name, runs in results.items() if isinstance(runs, list)}
    lines = [f"{'':50s} {'tokens/s':>9s} {'spread':>7s}" + "".join(f" {column:>17s}" for column in BASELINES)]
    for name, runs in results.items():
        if name not in medians:
            lines.append(f"{name:50s} {runs}")
            continue
        ratios = [f" {medians[name] / medians[b]:16.2f}x" if b in medians else f" {'-':>17s}"
                  for b in BASELINES.values()]
        spread = (max(runs) - min(runs)) / medians[name]
        lines.append(f"{name:50s} {medians[name]:9.0f} {spread:7.1%}" + "".join(ratios))
    return "\n".join(lines)


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
    p.add_argument("--iters", type=count, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=count, default=2, help="rounds of all variants; the spread column is across them")
    p.add_argument("--only", nargs="+", default=[], metavar="WORD",
                   help="run the baselines and the variants whose name holds one of these words (e.g. ZeRO-3)")
    p.add_argument("--bucket-size", type=int, default=1_000_000, help="--ddp-bucket-size for gcompile")
    p.add_argument("--memory-config", default="configs/gpt2-small.toml")
    add_worker_flags(p)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    with refused_in_one_line(p, "--memory-config: "):  # seconds: a config it refuses stops before the runs
        memory = optimizer_bytes_table(args.memory_config)
    print(f"dp={args.dp}: {args.n_layer} layers, {args.n_embd} wide, T={args.seq_length}, "
          f"{args.micro_batch_size} samples per rank per step, gloo, {os.cpu_count()} cores, "
          f"{args.repeats} rounds of {args.iters} timed steps", flush=True)
    print(throughput_table(measure(args)))
    print(memory)


if __name__ == "__main__":
    main()
