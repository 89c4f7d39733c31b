"""pp = 2 in one run: tokens/s of gcompile against torch.distributed.pipelining, and gcompile's
measured pipeline bubble against the schedule simulator's prediction.

    python bench/pipeline.py                       # 4 layers, 256 wide, 8 heads, T=256, 4 microbatches of 2
    python bench/pipeline.py --n-layer 2 --n-embd 64 --seq-length 64 --rounds 1

Two gloo ranks on this machine, one thread each, started by the elastic launcher (so
Inductor's cache is shared). Every contender trains the same GPT (gcompile/models/gpt2.py)
split after block n_layer/2 (embedding with the first half, final LayerNorm, head and
loss with the second), on the same 4 microbatches, AdamW step and gradient clipping
over the global norm included:

    torch.distributed.pipelining: pipeline() with SplitPoint.BEGINNING at that block,
                                  Schedule1F1B / ScheduleGPipe, eager stage modules
    gcompile --pp 2:              the pipeline_split stages, 1f1b / gpipe / zb1f1b (zero-bubble ZB-H1),
                                  FX graphs or --compile

and, interleaved, both split into 4 stages of n_layer/4 blocks, two per rank (stage s on
rank s % 2): ScheduleInterleaved1F1B against gcompile's interleaved schedule, vpp=2.

(torch.distributed.pipelining leaves the tied wte's two stage copies unsynchronised;
gcompile sums their gradients over the "embd" group, one small extra all-reduce.)
Contenders take turns, `--iters` steps each per round, so background load on the
machine falls on all of them; a step's time is the slower rank's, reported as the median
and as the best step (the better estimate when other work shares the cores).

Bubble: the share of rank-time a rank spends not computing, over one step's
forward-backward (the optimizer step left out), as the simulator defines it:

    measured  = 1 - sum over ranks of busy / (pp * wall)
    busy      = time inside the rank's stage forward and backward callables (zb1f1b: B and W)
    wall      = from the common start (a barrier) until the last rank finishes its instruction list

predicted = simulate(schedule, F, B, W).bubble_fraction with each stage's F, B (the whole
backward) and W (its weight-gradient share, zb1f1b) set to their measured mean times per
microbatch (communication counts as free there); also shown: the uniform-stage formula
(pp-1)/(m+pp-1).
"""

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from flags import add_model_flags, count, model_section, refused_in_one_line  # bench/, first on sys.path
from single_rank import matmul_peak
from gcompile.compile import Compiler, compile_rank_program
from gcompile.config import build_config
from gcompile.launch import join_world, spawn_local, under_launcher
from gcompile.models.gpt2 import GPT2
from gcompile.pipeline import build_rank_program
from gcompile.runtime import Runtime, StageFunctions
from gcompile.schedule import simulate
from gcompile.state import TrainState
from gcompile.train import split_microbatches

PP = 2


@dataclass
class StageTimes:
    """Seconds spent in each stage's forward, backward and weight-backward callables, per call."""
    forward: dict[int, list[float]] = field(default_factory=dict)
    backward: dict[int, list[float]] = field(default_factory=dict)
    weight: dict[int, list[float]] = field(default_factory=dict)
    spans: list[tuple[float, float]] = field(default_factory=list)
    """(start, end) of every call, by time.perf_counter: one clock for every process of the machine."""

    def timed(self, stage: int, fn, table: dict):
        def call(*args):
            start = time.perf_counter()
            out = fn(*args)
            end = time.perf_counter()
            table.setdefault(stage, []).append(end - start)
            self.spans.append((start, end))
            return out
        return call

    def busy(self) -> float:
        return sum(sum(map(sum, table.values())) for table in (self.forward, self.backward, self.weight))

    def clear(self):
        self.forward.clear()
        self.backward.clear()
        self.weight.clear()
        self.spans.clear()


class Gcompile:
    """gcompile's runtime on this rank, with its stage callables timed."""

    def __init__(self, config, coords, tokens):
        program = build_rank_program(config, coords, log=lambda _: None)
        functions, self.optimizer_step = compile_rank_program(program, Compiler(enabled=config.train.compile))
        self.times = StageTimes()
        timed = {s: StageFunctions(self.times.timed(s, f.forward, self.times.forward),
                                   self.times.timed(s, f.backward, self.times.backward),
                                   backward_weight=None if f.backward_weight is None else
                                   self.times.timed(s, f.backward_weight, self.times.weight))
                 for s, f in functions.items()}
        state = TrainState.initial(program, config.model, config.train.seed, "cpu")
        state.lr.fill_(config.train.lr)
        self.runtime = Runtime(program, timed, self.optimizer_step, state)
        self.schedule = program.schedule
        self.micro = split_microbatches(tokens, config.train.micro_batch_size)
        self.walls, self.optimizer_walls = [], []

    def step(self):
        dist.barrier()
        start = time.perf_counter()
        self.runtime.forward_backward(self.micro)
        self.walls.append(time.perf_counter() - start)
        start = time.perf_counter()
        self.runtime.optimizer_step()
        self.optimizer_walls.append(time.perf_counter() - start)


class TorchPipelining:
    """torch.distributed.pipelining on the same model, split and microbatches; stage s on rank s % pp."""

    def __init__(self, config, rank, tokens, schedule_class, vpp: int = 1):
        from torch.distributed.pipelining import SplitPoint, pipeline

        t = config.train
        model = GPT2.build(config.model, t.seed)
        self.idx, self.targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        per_stage = config.model.n_layer // (PP * vpp)
        split = {f"transformer.h.{per_stage * s}": SplitPoint.BEGINNING for s in range(1, PP * vpp)}
        pipe = pipeline(model, mb_args=(self.idx[:t.micro_batch_size],), split_spec=split)
        stages = [pipe.build_stage(rank + PP * chunk, torch.device("cpu")) for chunk in range(vpp)]
        self.rank = rank
        self.params = [p for stage in stages for p in stage.submod.parameters()]
        self.optimizer = torch.optim.AdamW(self.params, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2),
                                           weight_decay=t.weight_decay)
        self.clip = t.clip_grad
        self.schedule = schedule_class(stages if vpp > 1 else stages[0], n_microbatches=config.num_microbatches,
                                       loss_fn=_loss)

    def step(self):
        dist.barrier()
        if self.rank == 0:
            self.schedule.step(self.idx)
        else:
            self.schedule.step(target=self.targets)
        norm_sq = sum(p.grad.pow(2).sum() for p in self.params if p.grad is not None)
        dist.all_reduce(norm_sq)  # the global gradient norm, over both stages
        torch.nn.utils.clip_grads_with_norm_(self.params, self.clip, norm_sq.sqrt())
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def _loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def timed_steps(step, iters: int) -> list[float]:
    """Seconds per step as the slower rank saw it."""
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        elapsed = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    return times


def bubble(runner: Gcompile, iters: int) -> tuple[float, float, list[tuple[float, float, float]], list[list[float]]]:
    """(measured, predicted, per-stage mean forward, whole backward and W seconds per microbatch, per rank mean
    seconds of
    [forward-backward, compute in it, optimizer step]) over `iters` steps, as the module docstring
    defines them."""
    runner.times.clear()
    runner.walls.clear()
    runner.optimizer_walls.clear()
    for _ in range(iters):
        runner.step()
    mine = torch.tensor([sum(runner.walls), runner.times.busy(), sum(runner.optimizer_walls)]) / iters
    ranks = [torch.zeros(3) for _ in range(PP)]
    dist.all_gather(ranks, mine)
    wall = max(r[0].item() for r in ranks)
    measured = 1 - sum(r[1].item() for r in ranks) / (PP * wall)
    costs = [None] * (PP * runner.schedule.vpp)
    local = {}
    for s in runner.times.forward:
        w = sum(runner.times.weight.get(s, [])) / len(runner.times.forward[s])  # 0 where B ran it all
        local[s] = (statistics.mean(runner.times.forward[s]), statistics.mean(runner.times.backward[s]) + w, w)
    gathered = [None] * PP
    dist.all_gather_object(gathered, local)
    for table in gathered:
        for s, cost in table.items():
            costs[s] = cost
    predicted = simulate(runner.schedule, *([c[i] for c in costs] for i in range(3))).bubble_fraction
    return measured, predicted, costs, [r.tolist() for r in ranks]


def bench_config(args: argparse.Namespace, schedule: str, compile: bool, vpp: int = 1):
    return build_config({
        "model": model_section(args),
        "parallel": dict(pp=PP, pipeline_schedule=schedule, virtual_pipeline_size=vpp),
        "train": dict(micro_batch_size=args.micro_batch_size, seq_length=args.seq_length, compile=compile,
                      global_batch_size=args.micro_batch_size * args.num_microbatches),
    })


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])  # its first line ends mid-sentence
    add_model_flags(p)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--num-microbatches", type=int, default=4)
    p.add_argument("--iters", type=count, default=1, help="timed steps per contender per round")
    p.add_argument("--rounds", type=count, default=12)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    if not under_launcher():
        with refused_in_one_line(p):  # here, not as one traceback per rank
            bench_config(args, "1f1b", False)
        sys.exit(spawn_local(PP, [os.path.abspath(__file__), *sys.argv[1:]]))

    coords, _ = join_world({"pp": PP})
    torch.set_num_threads(1)
    peak = torch.tensor(matmul_peak(1024))
    dist.all_reduce(peak, op=dist.ReduceOp.MIN)

    def config(schedule: str, compile: bool, vpp: int = 1):
        return bench_config(args, schedule, compile, vpp)

    base = config("1f1b", False)
    t = base.train
    tokens = torch.randint(0, base.model.vocab_size, (t.global_batch_size, t.seq_length + 1),
                           generator=torch.Generator().manual_seed(0))
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
    contenders = {
        "(a) torch.distributed.pipelining 1F1B": TorchPipelining(base, coords.rank, tokens, Schedule1F1B),
        "(b) torch.distributed.pipelining GPipe": TorchPipelining(base, coords.rank, tokens, ScheduleGPipe),
        "(c) gcompile 1f1b (FX graphs)": Gcompile(config("1f1b", False), coords, tokens),
        "(d) gcompile 1f1b --compile": Gcompile(config("1f1b", True), coords, tokens),
        "(e) gcompile gpipe --compile": Gcompile(config("gpipe", True), coords, tokens),
        "(f) gcompile zb1f1b --compile": Gcompile(config("zb1f1b", True), coords, tokens),
    }
    if args.n_layer % (2 * PP) == 0:  # interleaving: a stage per n_layer / 4 blocks, two per rank
        contenders["(g) torch.d.pipelining Interleaved1F1B"] = TorchPipelining(
            base, coords.rank, tokens, ScheduleInterleaved1F1B, vpp=2)
        contenders["(h) gcompile interleaved vpp=2 --compile"] = Gcompile(config("interleaved", True, vpp=2),
                                                                          coords, tokens)
    for runner in contenders.values():
        for _ in range(args.warmup):
            runner.step()
    times = {name: [] for name in contenders}
    for _ in range(args.rounds):
        for name, runner in contenders.items():
            times[name] += timed_steps(runner.step, args.iters)
    bubbles = {name: bubble(runner, args.iters * args.rounds) for name, runner in contenders.items()
               if isinstance(runner, Gcompile)}

    if coords.rank == 0:
        tokens_per_step = t.global_batch_size * t.seq_length
        m = base.num_microbatches
        print(f"config: {args.n_layer} layers, {args.n_embd} wide, {args.n_head} heads, T={t.seq_length}, "
              f"pp={PP}, {m} microbatches of {t.micro_batch_size}, 1 thread per rank; "
              f"median of {args.rounds} x {args.iters} steps; fp32 matmul peak per rank now "
              f"{peak.item() / 1e9:.1f} GFLOP/s (how busy the machine is)")
        peer = statistics.median(times["(a) torch.distributed.pipelining 1F1B"])
        best_peer = min(times["(a) torch.distributed.pipelining 1F1B"])
        print(f"{'':40s} {'tokens/s':>9s} {'vs (a)':>7s} {'best step':>10s} {'vs (a)':>7s} {'bubble':>8s} "
              f"{'predicted':>9s}")
        for name, samples in times.items():
            seconds, best = statistics.median(samples), min(samples)
            measured, predicted = (f"{b:.1%}" for b in bubbles[name][:2]) if name in bubbles else ("", "")
            print(f"{name:40s} {tokens_per_step / seconds:9.0f} {peer / seconds:6.2f}x {tokens_per_step / best:10.0f} "
                  f"{best_peer / best:6.2f}x {measured:>8s} {predicted:>9s}")
        print(f"uniform-stage formula (pp-1)/(m+pp-1) = {(PP - 1) / (m + PP - 1):.1%}")
        for name, (_, _, costs, ranks) in bubbles.items():
            print(f"{name}: per-stage forward / backward (of it W) ms " +
                  ", ".join(f"s{s} {f * 1e3:.0f} / {b * 1e3:.0f} ({w * 1e3:.0f})" for s, (f, b, w) in enumerate(costs)) +
                  "; per rank forward-backward = compute + waiting, then optimizer, ms: " +
                  ", ".join(f"r{r} {w * 1e3:.0f} = {c * 1e3:.0f} + {(w - c) * 1e3:.0f}, {o * 1e3:.0f}"
                            for r, (w, c, o) in enumerate(ranks)))


if __name__ == "__main__":
    main()
