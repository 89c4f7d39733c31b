"""Numerics bisection: the first pass after which a rank's numbers leave single-device eager.

    python -m gcompile.inspect bisect --config configs/tiny.toml --tp 2 --pp 2 [--passes ...] [--tol 1e-5]

Takes run_gpt.py's flags. For each pass in order ("capture" first: no pass), every
rank's program is built with the passes up to that one (build_rank_program(stop_after=))
and run in this process (gcompile.harness) on one seeded global batch, fp32:

    forward passes   every microbatch's forward and backward; each rank's accumulated
                     gradient against eager's over its dp share, cut to the rank's piece
                     (the copies of a tied parameter summed first). Before pipeline_split
                     every pp rank holds the same program, so it runs with pp 1.
    rank passes      the same, gradients averaged over dp first (a pass may reduce them in
                     backward); then one optimizer step, and each rank's weights against
                     eager AdamW's. Weight elements whose eager gradient is under 1e-4 of
                     the parameter's largest are left out: AdamW's first step,
                     lr * g / (|g| + eps), turns rounding noise there into lr-sized steps.

Errors are norm-wise relative, ||a - e|| / ||e||, per rank and parameter; the loss is the
mean over dp of the last stage's. One line per pass; exit status 1 at the first pass over
`--tol`, naming the rank and the parameter.
"""

import sys
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from gcompile.arguments import ArgumentParser
from gcompile.config import ConfigError, RunConfig, parse_args
from gcompile.harness import World
from gcompile.layout import local_value
from gcompile.pass_manager import PassError
from gcompile.axes import REPLICAS, group_members, world_axes_of
from gcompile.pipeline import GRAD_SYNC, BuildCache, captured_program, load_passes, pass_lists
from gcompile.program import node_origin, random_draws
from gcompile.reference import EagerStep, eager_step
from gcompile.train import split_microbatches
from gcompile.world import build_world

TOL = 1e-5
NOISE = 1e-4
"""Weight elements whose eager gradient is under NOISE * the parameter's largest are not compared."""


@dataclass
class Worst:
    err: float = -1.0
    rank: int = -1
    name: str = ""

    def update(self, err: float, rank: int, name: str) -> None:
        if err > self.err:
            self.err, self.rank, self.name = err, rank, name


@dataclass
class PassReport:
    number: int
    name: str
    loss_err: float
    loss_rank: int
    grad: Worst | None
    """None where no whole gradient is kept (optim_grads)."""
    weight: Worst | None
    """None for forward passes (no optimizer step)."""

    def worst(self) -> tuple[float, int, str]:
        candidates = [(self.loss_err, self.loss_rank, "loss")]
        if self.grad is not None:
            candidates.append((self.grad.err, self.grad.rank, self.grad.name))
        if self.weight is not None:
            candidates.append((self.weight.err, self.weight.rank, self.weight.name))
        return max(candidates)

    def line(self, tol: float) -> str:
        text = f"pass {self.number:02d} {self.name}: loss rel {self.loss_err:.1e}, " + \
            (f"worst grad {self.grad.name} {self.grad.err:.1e}" if self.grad else "gradients kept only as shards")
        if self.weight is not None:
            text += f", worst weight {self.weight.name} {self.weight.err:.1e}"
        return text + (" ok" if self.worst()[0] <= tol else " DIVERGES")


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    diff = (actual - expected).norm()
    return 0.0 if diff == 0 else (diff / expected.norm().clamp_min(1e-30)).item()


def unsplit(config: RunConfig) -> RunConfig:
    """The same layout with pp 1: what every pp rank runs before pipeline_split."""
    p = replace(config.parallel, pp=1, virtual_pipeline_size=1, pipeline_schedule="1f1b", pipeline_layers=(),
                num_layers_per_virtual_pipeline_stage=None)
    return replace(config, parallel=p)


def bisect(config: RunConfig, tol: float = TOL, log: Callable[[str], None] = print) -> PassReport | None:
    """Check the program after every pass; the report of the first over `tol`, or None."""
    t = config.train
    if t.bf16 or t.fp16:
        raise ConfigError("bisect compares fp32 runs; drop --bf16 / --fp16")
    load_passes(config)  # a pass that cannot be loaded: refused before the first pass is checked
    cache = BuildCache()
    draws = random_draws(captured_program(config, cache, log=lambda _: None).stages[0].graph)
    if draws:  # each layout draws its own masks: no two runs agree but in distribution
        raise ConfigError(f"bisect compares runs without dropout, but the model draws random numbers at "
                          f"{node_origin(draws[0])}; set --dropout 0 (your own model: build it in eval mode or "
                          f"with no dropout)")
    if config.parallel.cp > 1:  # a cp rank's gradient is its tokens' share until the reduction over cp: bisect
        # compared it with the whole share's and named context_parallel for every cp layout
        raise ConfigError("bisect does not compare context-parallel layouts yet; check one with a short run against "
                          "--cp 1 (python run_gpt.py ... --train-iters 3: the same losses and grad norms)")
    tokens = torch.randint(0, config.model.vocab_size, (t.global_batch_size, t.seq_length + 1),
                           generator=torch.Generator().manual_seed(t.seed))
    eager = eager_step(config, tokens, t.lr)
    forward_passes, rank_passes = pass_lists(config)
    for number, name in enumerate(["capture", *forward_passes, *rank_passes]):
        is_rank_pass = number > len(forward_passes)
        split = "pipeline_split" in forward_passes[:number]
        built = config if split or is_rank_pass or "pipeline_split" not in forward_passes else unsplit(config)
        synced = config.parallel.dp * config.parallel.cp == 1 or bool(
            set(GRAD_SYNC.values()) & set(rank_passes[:number - len(forward_passes)]))
        report = check_pass(built, name, number, is_rank_pass, tokens, eager, cache, weights=is_rank_pass and synced)
        log(report.line(tol))
        err, rank, param = report.worst()
        if err > tol:
            log(f"first divergent pass: {name} (rank {rank}, parameter {param}, rel err {err:.1e} > tol {tol:.0e})")
            return report
    return None


def check_pass(config: RunConfig, name: str, number: int, is_rank_pass: bool, tokens: torch.Tensor,
               eager: EagerStep, cache: BuildCache, weights: bool) -> PassReport:
    """`weights`: also compare the weights after one AdamW step (rank passes once gradients cross the dp
    ranks: before that each dp rank steps on its own share's gradient)."""
    t = config.train
    world = World(build_world(config, log=lambda _: None, cache=cache, stop_after=name), config.model, t.seed)
    per_rank = t.global_batch_size // config.parallel.dp

    def forward_backward(rank, runtime):
        c = runtime.program.coords
        runtime.state.lr.fill_(t.lr)
        return runtime.forward_backward(split_microbatches(tokens[c.axis_rank("dp") * per_rank:(c.axis_rank("dp") + 1) * per_rank],
                                                           t.micro_batch_size))
    losses = world.run(forward_backward)
    last = max(s for p in world.programs.values() for s in p.stages)
    loss_ranks = [r for r, p in world.programs.items() if last in p.stages and p.coords.axis_rank("tp") == 0]
    loss = sum(losses[r] for r in loss_ranks) / len(loss_ranks)
    grad = None  # optim_grads keeps no whole gradient: its reduced shards are checked through the weights
    if all(program.grad_accumulator for program in world.programs.values()):
        grads = gradients(world, average_dp=is_rank_pass)
        coords_of = {r: p.coords for r, p in world.programs.items()}
        grad = Worst()
        for rank, program in world.programs.items():
            c = program.coords
            for param in program.layout.params:
                whole = is_rank_pass or reduced_over_dp(param)
                reached = group_members(c, folded_over(param)) if folded_over(param) else [c.rank]
                shares = [coords_of[m].axis_rank("dp") for m in reached]  # the dp shares whose tokens it holds
                expected = eager.grads[param.name] if whole else sum(eager.share_grads[d][param.name] for d in shares)
                grad.update(rel_err(grads[rank][param.name], local_value(expected, param, c.axis_ranks, c.axis_sizes)),
                            rank, param.name)
    weight = None
    if weights:
        world.run(lambda rank, runtime: runtime.optimizer_step())
        weight = Worst()
        for rank, program in world.programs.items():
            c, views = program.coords, program.layout.views(world.states[rank].params)
            for param in program.layout.params:
                g = eager.grads[param.name].abs()
                compared = local_value(g > NOISE * g.max(), param, c.axis_ranks, c.axis_sizes)
                expected = local_value(eager.params[param.name], param, c.axis_ranks, c.axis_sizes)
                weight.update(rel_err(views[param.name][compared], expected[compared]), rank, param.name)
    return PassReport(number, name, abs(loss.item() - eager.loss) / eager.loss, loss_ranks[0], grad, weight)


def gradients(world: World, average_dp: bool) -> dict[int, dict[str, torch.Tensor]]:
    """Each rank's accumulated gradient per parameter, a tied parameter's copies summed over its group;
    with `average_dp`, averaged over the rank's dp group (in dp rank order)."""
    views = {r: p.layout.views(world.states[r].grads) for r, p in world.programs.items()}
    coords = {r: p.coords for r, p in world.programs.items()}
    tied = {r: {param.name: sum(views[m][param.name] for m in group_members(coords[r], param.tied_group))
                if param.tied_group else views[r][param.name] for param in p.layout.params}
            for r, p in world.programs.items()}
    if not average_dp:
        return tied
    return {r: {param.name: tied[r][param.name] if reduced_over_dp(param) else
                sum(tied[m][param.name] for m in group_members(coords[r], REPLICAS.get(folded_over(param), "dp")))
                / coords[r].size("dp") for param in p.layout.params} for r, p in world.programs.items()}


def folded_over(param) -> str | None:
    """The folded axis that cuts `param` over data-parallel ranks (ep), if any: before the reduction the
    rank's gradient holds the tokens of that axis's group (the all-to-all brought them), not its share."""
    return next((s.axis for s in param.shards if s.axis in REPLICAS), None)


def reduced_over_dp(param) -> bool:
    """Whether a parameter's gradient comes out of backward averaged over dp already: it is cut over dp
    (optim_grads_params), and the backward of its gather reduce-scatters."""
    return any("dp" in world_axes_of(s.axis) for s in param.shards if s.axis not in REPLICAS)


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="python -m gcompile.inspect bisect", add_help=False,
                       description="The first pass after which a rank's numbers leave single-device eager. "
                                   "Takes every run_gpt.py flag too (python run_gpt.py --help lists them).")
    p.add_argument("--tol", type=float, default=TOL, help="relative error a pass may add (default 1e-5)")
    if {"-h", "--help"} & set(argv):
        p.print_help()
        return 0
    known, rest = p.parse_known_args(argv)
    try:
        if not known.tol > 0:
            raise ConfigError(f"--tol {known.tol:g} must be positive (a relative error)")
        config, _ = parse_args(rest)
        diverged = bisect(config, known.tol)
    except (ConfigError, PassError) as e:  # a pass that cannot load, run or be placed, as run_gpt.py says it
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    if diverged is None:
        print(f"all passes within {known.tol:.0e} of single-device eager")
    return 1 if diverged else 0
