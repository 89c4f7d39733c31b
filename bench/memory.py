"""Model-state memory per rank (weights + gradients + optimizer states) for each dp sharding strategy.

    python bench/memory.py                                    # GPT-2 small and Llama 3 8B at dp 2, 4, 8, 64
    python bench/memory.py --configs configs/tiny.toml --dp 2 4 --measure-up-to 4

Estimated: `estimate_memory` of rank 0's program, built as `--dump-only` builds it (capture
and lowering on fake tensors: nothing allocated, so Llama 3 8B at dp 64 builds here); dp
ranks differ only in which shard they own, so one rank stands for all. Measured: that
program's TrainState allocated for real on this CPU and its buffers' bytes summed, for
the configs whose no_shard states fit `--measure-gib` (GPT-2 small) at dp up to
`--measure-up-to`. Both count the gradient accumulator that optim_grads holds only during a
step (from the first backward to the update), so a cell is the most a rank holds of them;
what it keeps between steps follows in parentheses where it is less. Activations are left
out: they depend on the batch, not on the strategy.

A strategy the config refuses (ZeRO-3, optim_grads_params, until it is built) shows "not
built"; once it builds, its cells fill and the ZeRO-3 check below the table runs: per-rank
model states plus the largest parameter all-gather of a forward, against the full model's
states (no_shard at dp 1) / dp plus that bucket, within 5%.
"""

import argparse
import os
import sys
import time

from flags import count, refused_in_one_line  # bench/, first on sys.path when run as a script
from gcompile.axes import Coords
from gcompile.check import MeasuredMemory, estimate_memory
from gcompile.collectives import collective_nodes
from gcompile.config import ConfigError, build_config, load_toml
from gcompile.pipeline import BuildCache, build_rank_program
from gcompile.rank_program import RankProgram
from gcompile.state import TrainState

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
ZERO3 = "optim_grads_params"
GIB, MIB = 2 ** 30, 2 ** 20
TOLERANCE = 0.05
"""The issue's target for ZeRO-3: within 5% of full / dp + the largest gathered bucket."""


def build(path: str, dp: int, strategy: str, cache: BuildCache) -> RankProgram:
    """Rank 0's program of `path` at `dp` under `strategy`, one sample of 128 tokens per rank (the
    batch changes activations only). Raises ConfigError when the config refuses the strategy."""
    overrides = load_toml(path)
    train = dict(overrides.get("train", {}), micro_batch_size=1, global_batch_size=dp, seq_length=128)
    parallel = dict(overrides.get("parallel", {}), dp=dp, data_parallel_sharding_strategy=strategy)
    config = build_config(dict(overrides, train=train, parallel=parallel))
    return build_rank_program(config, Coords.from_rank(0, config.mesh_sizes), log=lambda _: None, cache=cache)


def estimated(program: RankProgram) -> int:
    e = estimate_memory(program)
    return e.weights + e.grads + e.optimizer


def measured(program: RankProgram) -> int:
    """Bytes of the rank's TrainState, allocated on the CPU, its gradient accumulator as during a step."""
    state = TrainState.allocate(program, "cpu")
    state.acquire_grads()
    return sum(state.buffer_bytes().values())


def largest_gather(program: RankProgram) -> int:
    """Bytes of the largest all-gather over dp in the rank's forward graphs (ZeRO-3's parameter buckets)."""
    return max((node.meta["val"].numel() * node.meta["val"].element_size()
                for stage in program.stages.values() for node, op, args in collective_nodes(stage.forward)
                if op == "all_gather_into_tensor" and args["group_name"] == "dp"), default=0)


def between_steps(program: RankProgram) -> int:
    """What the rank keeps from one step to the next (optim_grads: without the accumulator)."""
    held = MeasuredMemory.of(TrainState.allocate(program, "meta"))
    return held.weights + held.grads + held.optimizer


def cell(est: int, meas: int | None, between: int, unit: int) -> str:
    return (f"{est / unit:,.1f}" + ("" if meas is None else f" / {meas / unit:,.1f}")
            + ("" if between == est else f" ({between / unit:,.1f})"))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", default=["configs/gpt2-small.toml", "configs/llama3-8b.toml"])
    p.add_argument("--dp", type=count, nargs="+", default=[2, 4, 8, 64])
    p.add_argument("--measure-gib", type=float, default=4.0,
                   help="measure (allocate) a config's states only if its no_shard states at dp 1 are below this")
    p.add_argument("--measure-up-to", type=int, default=8, help="measure at dp up to this")
    args = p.parse_args()
    start = time.perf_counter()
    rows, refused, checks = [], {}, []
    for path in args.configs:
        name, cache = os.path.splitext(os.path.basename(path))[0], BuildCache()
        with refused_in_one_line(p):  # not a strategy's refusal: the config cannot run at all
            full = estimated(build(path, 1, "no_shard", cache))
        measures = full < args.measure_gib * GIB
        unit, unit_name = (GIB, "GiB") if full > 10 * GIB else (MIB, "MiB")
        for dp in args.dp:
            cells = []
            for strategy in STRATEGIES:
                try:
                    program = build(path, dp, strategy, cache)
                except ConfigError as e:
                    refused[strategy] = str(e)
                    cells.append("not built")
                    continue
                est = estimated(program)
                meas = measured(program) if measures and dp <= args.measure_up_to else None
                cells.append(cell(est, meas, between_steps(program), unit))
                if strategy == ZERO3:
                    checks.append(zero3_check(name, dp, est, full, largest_gather(program), unit, unit_name))
            rows.append(f"| {name} ({unit_name}) | {dp} | " + " | ".join(cells) + " |")
            print(f"  {name} dp {dp}: built ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    print("Model states per rank (weights + gradients + optimizer states) during a step, estimated / measured "
          "(between steps, where less):\n")
    print("| model | dp | " + " | ".join(f"`{s}`" for s in STRATEGIES) + " |")
    print("|---|---:|" + "---:|" * len(STRATEGIES))
    print("\n".join(rows))
    print()
    for strategy, message in refused.items():
        print(f"not built: {strategy}: {message}")
    print("\n".join(checks) if checks else f"ZeRO-3 check: no {ZERO3} row was built")
    print(f"({time.perf_counter() - start:.0f} s)")


def zero3_check(name: str, dp: int, per_rank: int, full: int, bucket: int, unit: int, unit_name: str) -> str:
    """The issue's target: per-rank model states + the largest gathered bucket within 5% of
    full / dp + that bucket."""
    got, target = per_rank + bucket, full / dp + bucket
    off = got / target - 1
    return (f"ZeRO-3 check {name} dp {dp}: states {per_rank / unit:,.2f} + largest bucket {bucket / unit:,.2f} = "
            f"{got / unit:,.2f} {unit_name} against full {full / unit:,.2f} / {dp} + bucket = {target / unit:,.2f} "
            f"{unit_name}: {off:+.1%}, {'within' if abs(off) <= TOLERANCE else 'NOT within'} {TOLERANCE:.0%}")


if __name__ == "__main__":
    main()
