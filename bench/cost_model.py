"""The cost model against measurement: predicted and measured step time, peak memory and pipeline bubble
over LAYOUTS (2 to 8 gloo ranks on this machine), and the planner's first choice measured.

    python bench/cost_model.py              # every layout, then the planner's choice for 4 ranks
    python bench/cost_model.py --only 0,3   # some layouts, and not the planner's choice (its yardstick is all)
    python bench/cost_model.py --machine ~/.cache/gcompile/machine-<id>.json   # predict from a kept file

The machine is measured first (gcompile.calibrate, 75-95 s here, written nowhere), so the
prediction and the runs see it in one state: on this 2-core machine a layout's step
moved by 40% between two runs an hour apart, and a file measured then predicts
neither.

Model: bench/flags.py's (4 layers, 256 wide, 8 heads, T=256), global batch 8, FX
graphs run uncompiled (what the machine file's per-op host time describes).

Each layout runs as its own world, one process per rank, the cores shared evenly
(as run_gpt.py's launcher shares them). Per layout:

    measured step   median over --iters steps (after --warmup) of the slowest rank's
                    forward-backward + optimizer step, the ranks lined up by a barrier
    predicted step  gcompile.cost_model.predict over the programs of one pipeline column,
                    built here, never run
    memory          per rank, the runtime's measured peak at instruction boundaries
                    (gcompile.memory) against gcompile.check.estimate_memory at the same
                    boundaries (full recompute's peak inside a backward, which the estimate
                    counts, is not measured here); the worst rank
    bubble          measured over the ranks of one pipeline column (tp, dp position 0):
                    1 - sum(time inside stage callables) / (pp x forward-backward wall), as
                    bench/pipeline.py measures it; predicted by the same simulation that
                    predicts the step, communication costed
    opt ms          the slowest rank's time from the end of its forward-backward to the
                    end of its optimizer step (waiting for the other ranks included),
                    against the predicted optimizer step
    in graphs       with a pipeline: how many of the world's ranks are inside a stage graph
                    at once, averaged over the time spent inside graphs (every rank's
                    calls on one clock, the median over the steps), measured/predicted
                    (a pipeline rank's spans count for world / pp ranks). On shared cores
                    a graph runs slower the more graphs run at once, so where the step
                    time is right but the bubble is not, this shows which side is off

Prints each row, then the median and worst absolute step-time error, Spearman's rank
correlation of predicted against measured, and the planner's (gcompile.plan) first
choice for 4 ranks measured against the fastest 4-rank layout measured.
"""

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

from flags import add_model_flags, add_worker_flags, count, join_gloo, model_section, spawn_ranks  # bench/
from pipeline import StageTimes
from gcompile import machine as machine_file
from gcompile.axes import Coords
from gcompile.calibrate import calibrate
from gcompile.check import estimate_memory
from gcompile.compile import Compiler, compile_rank_program
from gcompile.config import ConfigError, build_config
from gcompile.mesh import init_groups
from gcompile.pipeline import BuildCache, build_rank_program
from gcompile.plan import evaluate, search
from gcompile.runtime import Runtime, StageFunctions
from gcompile.state import TrainState
from gcompile.train import split_microbatches

GLOBAL_BATCH = 8

LAYOUTS = [
    dict(dp=2),
    dict(tp=2),
    dict(dp=2, data_parallel_sharding_strategy="optim"),
    dict(tp=2, recompute_activations=True),
    dict(pp=2, micro_batch_size=2),
    dict(pp=2, micro_batch_size=1),
    dict(pp=2, micro_batch_size=1, pipeline_schedule="zb1f1b"),
    dict(pp=2, micro_batch_size=1, pipeline_schedule="interleaved", virtual_pipeline_size=2),
    dict(pp=2, micro_batch_size=2, pipeline_schedule="gpipe"),
    dict(dp=4),
    dict(tp=4),
    dict(tp=2, dp=2),
    dict(tp=2, pp=2, micro_batch_size=1),
    dict(pp=2, dp=2, micro_batch_size=1),
    dict(pp=4, micro_batch_size=1),
    dict(tp=2, pp=2, dp=2, micro_batch_size=1),
]
"""(parallel and train fields) per layout; unnamed: micro batch 4 (the whole per-rank batch at dp 2), 1f1b."""

TRAIN = {"micro_batch_size", "recompute_activations"}


def layout_config(args: argparse.Namespace, layout: dict):
    train = dict(micro_batch_size=4, seq_length=args.seq_length, global_batch_size=GLOBAL_BATCH)
    train.update({k: v for k, v in layout.items() if k in TRAIN})
    train["micro_batch_size"] = min(train["micro_batch_size"], GLOBAL_BATCH // layout.get("dp", 1))
    parallel = {k: v for k, v in layout.items() if k not in TRAIN}
    return build_config({"model": model_section(args), "parallel": parallel, "train": train})


def describe(layout: dict) -> str:
    short = {"micro_batch_size": "mbs", "pipeline_schedule": "", "virtual_pipeline_size": "vpp",
             "recompute_activations": "recompute", "data_parallel_sharding_strategy": ""}
    return " ".join(f"{short.get(k, k)}{'' if v is True else v}" for k, v in layout.items())


def worker(args: argparse.Namespace) -> None:
    rank, world = join_gloo(args.store)
    config = layout_config(args, json.loads(args.variant))
    coords = Coords.from_rank(rank, config.mesh_sizes)
    init_groups(coords, config.parallel.tp_comm_backend)
    program = build_rank_program(config, coords, log=lambda _: None)
    functions, optimizer_step = compile_rank_program(program, Compiler(enabled=False))
    times = StageTimes()
    timed = {s: StageFunctions(times.timed(s, f.forward, times.forward), times.timed(s, f.backward, times.backward),
                               times.timed(s, f.backward_last, times.backward) if f.backward_last else None,
                               times.timed(s, f.backward_weight, times.weight) if f.backward_weight else None)
             for s, f in functions.items()}
    state = TrainState.initial(program, config.model, config.train.seed, "cpu")
    state.lr.fill_(config.train.lr)
    runtime = Runtime(program, timed, optimizer_step, state)
    per_rank = config.train.global_batch_size // coords.size("dp")
    tokens = torch.randint(0, config.model.vocab_size, (per_rank, config.train.seq_length + 1),
                           generator=torch.Generator().manual_seed(rank))
    micro = split_microbatches(tokens, config.train.micro_batch_size)
    steps, walls, busy, optimizer, spans = [], [], [], [], []
    for i in range(args.warmup + args.iters):
        if i == args.warmup - 1:
            runtime.start_measuring()
        times.clear()
        dist.barrier()
        start = time.perf_counter()
        runtime.forward_backward(micro)
        wall = time.perf_counter() - start
        runtime.optimizer_step()
        step = torch.tensor(time.perf_counter() - start)
        stepped = step.item() - wall
        dist.all_reduce(step, op=dist.ReduceOp.MAX)
        if i == args.warmup - 1:
            peak = runtime.stop_measuring().peak.total
        if i >= args.warmup:
            steps.append(step.item())
            walls.append(wall)
            busy.append(times.busy())
            optimizer.append(stepped)
            spans.append(list(times.spans))
    mine = dict(rank=rank, column=coords == coords.moved(**{axis: 0 for axis, _ in coords.ranks if axis != "pp"}),
                wall=statistics.median(walls), busy=statistics.median(busy), peak=peak,
                optimizer=statistics.median(optimizer), spans=spans,
                estimate=estimate_memory(program, inside_graphs=False).total)  # as the peak is measured
    every = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(dict(step=statistics.median(steps), ranks=every), f)
    dist.destroy_process_group()


def predicted(args: argparse.Namespace, layout: dict, machine, cache: BuildCache):
    config = layout_config(args, layout)
    prediction, _ = evaluate(config, machine, cache)  # the planner's own prediction
    return config, prediction


def measured(args: argparse.Namespace, layout: dict, world: int) -> dict:
    argv = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("n_layer", "n_embd", "n_head", "seq_length",
                                                                       "arch", "warmup", "iters")]
    return spawn_ranks(__file__, argv + [f"--variant={json.dumps(layout)}"], world)


def inside_graphs(spans: list[tuple[float, float]]) -> float:
    """How many of `spans` run at once, on average over the time inside them."""
    overlap = sum(max(0.0, min(end, e) - max(start, s)) for start, end in spans for s, e in spans)
    return overlap / sum(end - start for start, end in spans)


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(values):
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        for position, i in enumerate(order):
            out[i] = float(position)
        return out
    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry)) / (n * (n * n - 1))


def progress(line: str) -> None:
    print(line, file=sys.stderr)


def layout_numbers(only: str | None) -> list[int]:
    """--only read: LAYOUTS' indices (all without it); ConfigError naming a bad entry."""
    if only is None:
        return list(range(len(LAYOUTS)))
    entries = [s.strip() for s in only.split(",")]
    if not all(s.isdigit() and int(s) < len(LAYOUTS) for s in entries):
        raise ConfigError(f"--only {only!r}: give layout numbers from 0 to {len(LAYOUTS) - 1}, comma-separated")
    return [int(s) for s in entries]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])  # its first line ends mid-sentence
    add_model_flags(p)
    p.add_argument("--warmup", type=count, default=3, help="steps of each layout before timing, the last one's peak "
                                                          "memory measured (default: 3)")
    p.add_argument("--iters", type=count, default=15, help="timed steps of each layout, their median reported "
                                                          "(default: 15)")
    p.add_argument("--only", help=f"comma-separated layout numbers, 0 to {len(LAYOUTS) - 1} (default: all, and "
                                  f"then the planner's choice too)")
    p.add_argument("--machine", help="machine file to predict with (default: measure this machine first)")
    p.add_argument("--plan-world", type=int, default=4, help="world size the planner picks a layout for (default: 4)")
    add_worker_flags(p)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    try:
        chosen = layout_numbers(args.only)
        for i in chosen:  # each can run this model, before minutes of measuring
            layout_config(args, LAYOUTS[i])
        machine = machine_file.load(args.machine) if args.machine else calibrate(log=progress)
    except (machine_file.MachineError, ConfigError) as e:
        print(f"bench/cost_model.py: error: {e}", file=sys.stderr)
        return 2
    cache = BuildCache()
    waits = ", ".join(f"k={k} {w.get(k, 0) * 1e3:.1f}/{w.get('send_recv', 0) * 1e3:.1f} ms"
                      for k, w in machine.waits.get("gloo", {}).items())
    print(f"model: {args.n_layer} layers, {args.n_embd} wide, {args.n_head} heads, T={args.seq_length}, global batch "
          f"{GLOBAL_BATCH}; FX graphs; median of {args.iters} steps after {args.warmup}; machine "
          f"{machine.description}; slowdown with k ranks computing at once: "
          f"{', '.join(f'k={k} {f:.2f}x' for k, f in machine.contention.items())} (operator calls: "
          f"{', '.join(f'{f:.2f}x' for f in machine.host_contention.values())}); a gloo rank's wait (all-reduce of "
          f"all / a message): {waits}")
    print(f"{'#':>2} {'layout':<34} {'ranks':>5} {'step ms':>8} {'pred':>8} {'err':>6} {'mem MiB':>8} {'pred':>8} "
          f"{'err':>6} {'bubble':>7} {'pred':>7} {'opt ms':>7} {'pred':>7} {'in graphs':>9}")
    rows = []
    for i in chosen:
        layout = LAYOUTS[i]
        config, prediction = predicted(args, layout, machine, cache)
        result = measured(args, layout, config.world_size)
        worst = max(result["ranks"], key=lambda r: abs(r["estimate"] - r["peak"]) / r["peak"])
        column = [r for r in result["ranks"] if r["column"]]
        pp = config.parallel.pp
        bubble = 1 - sum(r["busy"] for r in column) / (pp * max(r["wall"] for r in column)) if pp > 1 else None
        together = statistics.median(inside_graphs([s for r in result["ranks"] for s in r["spans"][i]])
                                     for i in range(args.iters))
        replicas = config.world_size / pp  # ranks a pipeline rank's spans stand for
        predicted_together = replicas * inside_graphs([(s.start, s.end) for rank in prediction.spans for s in rank])
        row = dict(step=result["step"], predicted=prediction.step_seconds, peak=worst["peak"],
                   estimate=worst["estimate"], bubble=bubble, predicted_bubble=prediction.bubble_fraction,
                   layout=layout, world=config.world_size)
        rows.append(row)
        mib = 2 ** 20
        bubbles = f"{bubble:7.1%} {prediction.bubble_fraction:7.1%}" if bubble is not None else f"{'':7} {'':7}"
        optimizer = max(r["optimizer"] for r in result["ranks"])
        print(f"{i:>2} {describe(layout):<34} {config.world_size:>5} {row['step'] * 1e3:8.1f} "
              f"{row['predicted'] * 1e3:8.1f} {row['predicted'] / row['step'] - 1:+6.1%} {worst['peak'] / mib:8.1f} "
              f"{worst['estimate'] / mib:8.1f} {worst['estimate'] / worst['peak'] - 1:+6.1%} {bubbles} "
              f"{optimizer * 1e3:7.1f} {prediction.optimizer_seconds * 1e3:7.1f} "
              f"{f'{together:.2f}/{predicted_together:.2f}' if pp > 1 else '':>9}", flush=True)
    errors = [abs(r["predicted"] / r["step"] - 1) for r in rows]
    rank_order = f"{spearman([r['predicted'] for r in rows], [r['step'] for r in rows]):.2f}" if len(rows) > 1 else "n/a"
    print(f"step time: median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%}; Spearman "
          f"{rank_order} over {len(rows)} layouts; "
          f"memory: worst |error| {max(abs(r['estimate'] / r['peak'] - 1) for r in rows):.1%}")
    same_world = [r for r in rows if r["world"] == args.plan_world]
    if same_world and not args.only:  # the choice is measured against the fastest of every layout
        base = layout_config(args, {})
        top = search(base, args.plan_world, machine, cache=cache).ranked[0]
        choice = {k: v for k, v in top.layout.items()}
        result = measured(args, choice, args.plan_world)
        fastest = min(same_world, key=lambda r: r["step"])
        print(f"planner's first choice for {args.plan_world} ranks: {describe(choice)}: measured "
              f"{result['step'] * 1e3:.1f} ms (predicted {top.prediction.step_seconds * 1e3:.1f}); fastest "
              f"{args.plan_world}-rank layout measured above: {describe(fastest['layout'])} {fastest['step'] * 1e3:.1f} "
              f"ms: the choice is {result['step'] / fastest['step'] - 1:+.1%} from it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
