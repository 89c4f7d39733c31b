"""Predicted time of a training iteration, from the built programs (never run) and a machine file.

A graph's time is its nodes walked in order, as the runtime runs them:

    matmul-like op (torch's FLOP formula)    FLOPs / the machine's matmul rate at that size and dtype
    attention                                FLOPs / the attention rate at that size
    any other op                             host time of a call + bytes read and written / bandwidth
                                             (the in-place rate for an op that writes its input, add_)
    a collective (start)                     queued on the rank's one communication channel:
                                             starts when issued and the channel is free, lasts
                                             latency + bytes / bandwidth of its transport, kind, group size
                                             (+ on shared cores, the measured wait to be run again)
    wait_tensor                              the graph's clock moves to the collective's end

so a collective waited at once costs its whole time, and one the overlap passes
start early (tp_comm_overlap, bucket overlap) costs only what compute between its
start and its wait does not cover. Ranks that share cores compute slower, by what
the machine file measured for as many ranks computing at once (operator calls by
the slowdown measured for host work, the rest by that for arithmetic), and a gloo
rank that waits loses the measured time to be run again (`predict` says how).

A rank's iteration is its pipeline schedule simulated (gcompile.schedule.simulate)
with every F, B and W costed from the graph its instruction runs, at the slowdown
of the ranks computing while it runs, each message arriving latency + bytes /
bandwidth (+ the wait) after its send, then the optimizer step (the slowest rank's:
its gradient-norm all-reduce lines the ranks up).
"""

import bisect
import dataclasses
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.fx as fx

from gcompile.axes import GROUP_ROLES, role_size
from gcompile.check import message_bytes, pipeline_messages
from gcompile.collectives import collective_nodes, is_collective
from gcompile.config import RunConfig
from gcompile.comm_summary import collective_bytes
from gcompile.flops import SAME_FLOPS_AS, node_flops
from gcompile.machine import Machine
from gcompile.rank_program import RankProgram
from gcompile.schedule import Action, Kind, Span, simulate
from gcompile.torch_api import tree_flatten

aten = torch.ops.aten

ATTENTION = {aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_flash_attention_backward,
             aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_efficient_attention_backward,
             aten._scaled_dot_product_cudnn_attention, aten._scaled_dot_product_cudnn_attention_backward,
             torch.ops.gcompile.attend_block, torch.ops.gcompile.attend_block_backward}
"""Ops costed at the attention rate (after SAME_FLOPS_AS maps the CPU ones onto them; the ring's blocks too)."""
SAME_LINK_AS = {"all_to_all_rows": "all_to_all_single", "ring_shift": "all_to_all_single",
                "all_reduce_coalesced": "all_reduce"}
"""Collectives costed as a measured kind that moves bytes the same way."""
FREE = {"getitem", "view", "_unsafe_view", "alias", "t", "transpose", "permute", "expand", "squeeze",
        "unsqueeze", "detach", "slice", "select", "split", "unbind", "as_strided", "reshape"}
"""Ops that only make a view: a host call, no bytes moved."""


@dataclass(frozen=True)
class Rates:
    """What one rank of one world gets from the machine."""

    machine: Machine
    threads: int
    """CPU threads per rank (the cores shared evenly); on a GPU unused."""
    slowdown: float
    """Compute is this much slower because ranks share cores (1 when each thread has its own)."""
    host_slowdown: float
    """The same for operator calls (host work), which sharing cores slows more."""
    transports: dict[str, str]
    """Group role -> transport ("gloo", "shm", "nccl"); roles not named use `default_transport`."""
    default_transport: str
    ranks: int = 1
    """Ranks of the world on this machine's cores (what `slowdown` is for when all compute at once)."""

    def transport(self, role: str) -> str:
        return self.transports.get(role, self.default_transport)

    def sharing(self, ranks: float) -> "Rates":
        """These rates with `ranks` computing at once on the machine's cores (both slowdowns)."""
        return dataclasses.replace(self, slowdown=self.machine.slowdown(ranks),
                                   host_slowdown=self.machine.slowdown(ranks, host=True))


def rates_for(machine: Machine, world_size: int, threads: int, shm_tp: bool) -> Rates:
    """A rank's share: `threads` each, all ranks of the world on this machine's cores (a GPU each on a GPU
    machine)."""
    if machine.on_gpu:
        return Rates(machine, threads, 1.0, 1.0, {}, "nccl")
    return Rates(machine, threads, 1.0, 1.0, {"tp": "shm"} if shm_tp else {}, "gloo", world_size).sharing(world_size)


def rates_of(config: RunConfig, machine: Machine) -> Rates:
    """What each rank of `config`'s world gets, launched as run_gpt.py launches it on the file's machine."""
    return rates_for(machine, config.world_size, *launched(config, machine))


def launched(config: RunConfig, machine: Machine) -> tuple[int, bool]:
    """(CPU threads a rank gets, whether tp runs over shared memory): what a prediction reads besides the
    machine file and the programs. The threads are the file's cores shared evenly, as the launcher shares a
    host's (OMP_NUM_THREADS wins where set)."""
    from gcompile import shm_group
    from gcompile.launch import rank_threads
    p = config.parallel
    return rank_threads(config.world_size, machine.cores), p.tp > 1 and p.tp_comm_backend != "gloo" and \
        shm_group.available()


@dataclass(frozen=True)
class GraphTime:
    seconds: float
    """From the first node to the output, collectives waited where the graph waits."""
    compute: float
    """Seconds of compute alone."""
    communication: float
    """Seconds of collectives, overlapped or not."""


@dataclass(frozen=True)
class Work:
    """What one node asks of the machine, whatever the rates: `kind` matmul (`amount` FLOPs, of `dtype`),
    attention (FLOPs at the causal rate), pointwise or inplace (bytes read and written), call (a host call
    alone: views, placeholders at zero)."""

    kind: str
    amount: float = 0.0
    dtype: str = ""


NOTHING = Work("nothing")


def node_work(node: fx.Node) -> Work:
    """What `node` computes (NOTHING for placeholders and outputs; collectives are costed apart)."""
    if node.op != "call_function":
        return NOTHING
    name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
    packet = getattr(node.target, "overloadpacket", None)
    flops = node_flops(node)
    if flops is not None:
        if SAME_FLOPS_AS.get(packet, packet) in ATTENTION:
            return Work("attention", flops if _causal(node) else 2 * flops)  # the rate is causal attention's,
            # which skips half
        return Work("matmul", flops, str(_tensors(node.meta["val"])[0].dtype).removeprefix("torch."))
    if name in FREE:
        return Work("call")
    moved = sum(t.numel() * t.element_size() for t in _tensors(node.meta.get("val")))
    moved += sum(t.numel() * t.element_size() for a in node.all_input_nodes for t in _tensors(a.meta.get("val")))
    return Work("inplace" if name.endswith("_") else "pointwise", moved)


def work_seconds(work: Work, rates: Rates) -> float:
    """Compute time of `work` at these rates."""
    if work.kind == "nothing":
        return 0.0
    machine, threads = rates.machine, rates.threads
    call = machine.op_seconds * rates.host_slowdown
    if work.kind == "attention":
        return call + machine.attention_seconds(work.amount, threads) * rates.slowdown
    if work.kind == "matmul":
        return call + machine.matmul_seconds(work.amount, work.dtype, threads) * rates.slowdown
    if work.kind == "call":
        return call
    return call + machine.pointwise_seconds(work.amount, threads, inplace=work.kind == "inplace") * rates.slowdown


def _causal(node: fx.Node) -> bool:
    """Whether an attention node masks the future (its `is_causal` or `causal` argument; True for an op without
    one). Calibration times causal attention against torch's FLOP formula, which counts the masked half too; an
    attention without the mask (the ring's off-diagonal blocks, an explicit mask) computes all it counts."""
    for i, argument in enumerate(node.target._schema.arguments):
        if argument.name in ("is_causal", "causal"):
            return bool(node.args[i] if i < len(node.args) else node.kwargs.get(argument.name,
                                                                                 argument.default_value))
    return True


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):  # most nodes: flattening a tree is most of what costing a graph costs
        return [value]
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def collective_seconds(kind: str, group: str, nbytes: int, size: int, rates: Rates) -> float:
    """The link's time, and on shared cores what waiting for the group's ranks to be run again costs."""
    if size <= 1:
        return 0.0
    transport = rates.transport(group)
    return rates.machine.link(transport, SAME_LINK_AS.get(kind, kind), size).seconds(nbytes) + \
        rates.machine.wait_seconds(transport, rates.ranks, size)


def message_seconds(nbytes: int, group: str, rates: Rates) -> float:
    """A pipeline message, sent until received, waiting on shared cores included."""
    transport = rates.transport(group)
    return rates.machine.link(transport, "send_recv", 2).seconds(nbytes) + \
        rates.machine.wait_seconds(transport, rates.ranks, "send_recv")


def graph_time(gm: fx.GraphModule, rates: Rates, group_sizes: dict[str, int]) -> GraphTime:
    """One run of `gm` (nodes need meta["val"], as lowered graphs have); `group_sizes`: ranks per group role."""
    clock = compute = communication = channel = 0.0
    done = {}  # step index of a collective -> when its result is there
    for i, step in enumerate(_steps(gm)):
        if isinstance(step, Issue):
            seconds = collective_seconds(step.op, step.group, step.nbytes, group_sizes.get(step.group, 1), rates)
            channel = max(clock, channel) + seconds
            done[i] = channel
            communication += seconds
        elif isinstance(step, Wait):
            clock = max(clock, done.get(step.issued, clock))
        else:
            seconds = work_seconds(step, rates)
            clock += seconds
            compute += seconds
    return GraphTime(clock, compute, communication)


class Issue(NamedTuple):
    """A collective started: `nbytes` over the ranks of `group` (a role)."""

    op: str
    group: str
    nbytes: int


class Wait(NamedTuple):
    issued: int
    """The step that started what is waited for (-1: a value no collective of this graph made)."""


_STEPS = weakref.WeakKeyDictionary()
"""Graph -> `_steps`: the planner predicts each shared graph (a lowering, an optimizer step) for many
candidates at many rates, and its nodes' FLOPs and bytes are the same every time (a graph is not changed
once built: builds copy a shared graph before rewriting it)."""


def _steps(gm: fx.GraphModule) -> list[Issue | Wait | Work]:
    """`gm`'s nodes in order, as what each asks of the machine."""
    if gm not in _STEPS:
        issued = {node: (op, args) for node, op, args in collective_nodes(gm)}
        index, steps = {}, []
        for node in gm.graph.nodes:
            index[node] = len(steps)
            if node in issued:
                op, args = issued[node]
                steps.append(Issue(op, args.get("group_name", "?"), collective_bytes(node)))
            elif node.op == "call_function" and is_collective(node.target):  # wait_tensor
                steps.append(Wait(index[node.args[0]] if node.args[0] in issued else -1))
            else:
                steps.append(node_work(node))
        _STEPS[gm] = steps
    return _STEPS[gm]


def group_sizes_of(program: RankProgram) -> dict[str, int]:
    """Ranks in each group role a graph may name, for this rank."""
    return {role: role_size(program.coords, role) for role in GROUP_ROLES}


@dataclass(frozen=True)
class RankTime:
    """One pipeline rank's costs: per instruction action, per message, and its optimizer step."""

    compute: dict[Action, float]
    """Seconds of each F, B and W it runs (W left out where its stage's backward is whole): its graph, and
    adding the parameter gradients it returns into the flat accumulator (the runtime, outside the graph)."""
    busy: dict[Action, float]
    """Of that, the graph alone: what a pipeline bubble is measured against."""
    sends: dict[Action, float]
    """Seconds from each SEND_F / SEND_B until the tensor is at its peer."""
    optimizer: float
    graphs: dict[str, GraphTime] = field(default_factory=dict)
    """Each distinct graph's time, by "stage{s}.{graph}" or "optimizer"."""


def rank_time(program: RankProgram, rates: Rates) -> RankTime:
    sizes = group_sizes_of(program)
    graphs, compute, busy, sends = {}, {}, {}, {}
    sends_in_order = iter(pipeline_messages(program)[0])
    for instruction in program.instructions:
        if instruction.is_compute:
            name = instruction.graph if instruction.stage is None else f"stage{instruction.stage}.{instruction.graph}"
            if name not in graphs:
                graphs[name] = graph_time(program.graph(instruction), rates, sizes)
            if instruction.action is not None:
                busy[instruction.action] = graphs[name].seconds
                compute[instruction.action] = graphs[name].seconds + _accumulate_seconds(program, instruction, rates)
        elif instruction.op in (Kind.SEND_F, Kind.SEND_B):
            nbytes = message_bytes(next(sends_in_order))
            sends[instruction.action] = message_seconds(nbytes, instruction.group, rates)
    return RankTime(compute, busy, sends, graphs["optimizer"].seconds, graphs)


def _accumulate_seconds(program: RankProgram, instruction, rates: Rates) -> float:
    """The runtime adds a stage's parameter gradients into the flat fp32 accumulator after the graph that
    returns them: W where the stage's backward is split, else B; nothing where every microbatch's backward
    reduce-scatters them (no accumulator). Read the gradient and the accumulator, write the accumulator: an
    in-place add, yet costed at the element-wise rate, not the in-place one, which put the measured pipeline
    bubbles of bench/cost_model.py 3 to 7 points too low (this rate: within 1)."""
    stage = program.stages[instruction.stage]
    returns = Kind.W if stage.backward_weight is not None else Kind.B
    if instruction.op != returns or not program.grad_accumulator:
        return 0.0
    weights = list(stage.forward.graph.find_nodes(op="placeholder"))[:len(stage.params)]
    elements = sum(node.meta["val"].numel() for node in weights)
    return rates.machine.pointwise_seconds(3 * 4 * elements, rates.threads) * rates.slowdown


@dataclass(frozen=True)
class StepTime:
    """A predicted iteration in totals: what the planner ranks by and keeps between runs (gcompile.plan_cache)."""

    step_seconds: float
    """One iteration: the pipeline's forward and backward, then the optimizer step."""
    pipeline_seconds: float
    optimizer_seconds: float
    bubble_fraction: float
    """The simulated share of pipeline rank-time not inside a graph (waiting, or adding up gradients)."""

    def __str__(self) -> str:
        return (f"predicted {self.step_seconds * 1e3:.1f} ms per iteration = pipeline {self.pipeline_seconds * 1e3:.1f} "
                f"(bubble {self.bubble_fraction:.1%}) + optimizer step {self.optimizer_seconds * 1e3:.1f}")

    def totals(self) -> "StepTime":
        return StepTime(self.step_seconds, self.pipeline_seconds, self.optimizer_seconds, self.bubble_fraction)


@dataclass(frozen=True)
class Prediction(StepTime):
    ranks: tuple[RankTime, ...]
    """Per pipeline rank, every rank of the world computing at once."""
    spans: tuple[tuple[Span, ...], ...]
    """Per pipeline rank, its F, B and W placed in time."""


def predict(column: list[RankProgram], rates: Rates) -> Prediction:
    """The iteration of a world from one program per pipeline rank (`column[r]` at pp position r; ranks that
    differ only in tp, cp or dp position cost the same). On CPU cores the ranks share, a rank that waits in a
    pipeline bubble computes nothing, so an action computes at the slowdown of the ranks computing while it
    runs: in 1f1b's steady state every rank computes, in its warm-up and cool-down few do. Each action's cost
    lies between its cost with one rank computing and with all of them, by the slowdown for the ranks busy
    during its span in the previous simulation (a pipeline rank's busy spans count its world / pp replicas),
    simulated again until it settles. The optimizer step runs on every rank at once. Not with shared-memory tp
    groups: their ranks wait by polling and yielding (gcompile/shm_group.py), which keeps taking a share of the
    cores (measured here: tp2 pp2 ran as if all four ranks computed throughout)."""
    full = [rank_time(program, rates) for program in column]
    polls = rates.transport("tp") == "shm" and column[0].coords.size("tp") > 1
    if rates.machine.on_gpu or polls or rates.ranks <= 1:
        return _predict(column, full, full, lambda a: 1.0)
    alone = [rank_time(program, rates.sharing(1)) for program in column]
    low, high = rates.machine.slowdown(1), rates.slowdown
    replicas = rates.ranks / len(column)
    computing = {}  # action -> ranks of the world computing during it, from the last simulation (first: all)

    def share(a: Action) -> float:
        k = computing.get(a, rates.ranks)
        return 1.0 if high <= low else (rates.machine.slowdown(k) - low) / (high - low)
    for _ in range(6):
        prediction = _predict(column, alone, full, share)
        found = _concurrency(prediction.spans, replicas)
        if computing and all(abs(k - computing[a]) < 0.05 for a, k in found.items()):
            break
        computing = {a: (k + computing[a]) / 2 if computing else k for a, k in found.items()}  # then halfway:
        # an action made cheaper overlaps less with the others, which would make it dearer again
    return prediction


def _concurrency(spans: tuple[tuple[Span, ...], ...], replicas: float) -> dict[Action, float]:
    """Each span's action -> the mean number of the world's ranks computing while it runs."""
    edges = sorted({t for rank in spans for s in rank for t in (s.start, s.end)})
    count = [0] * len(edges)
    for rank in spans:
        for s in rank:
            for i in range(bisect.bisect_left(edges, s.start), bisect.bisect_left(edges, s.end)):
                count[i] += 1
    area = [0.0]
    for i in range(len(edges) - 1):
        area.append(area[-1] + count[i] * (edges[i + 1] - edges[i]))
    found = {}
    for rank in spans:
        for s in rank:
            if s.end > s.start:
                inside = area[bisect.bisect_left(edges, s.end)] - area[bisect.bisect_left(edges, s.start)]
                found[s.action] = replicas * inside / (s.end - s.start)
    return found


def _predict(column: list[RankProgram], alone: list[RankTime], full: list[RankTime],
             share: Callable[[Action], float]) -> Prediction:
    """The pipeline simulated with each action's cost `share(action)` of the way from `alone` to `full`, then
    the optimizer step at `full`."""
    schedule = column[0].schedule

    def between(table: str, a: Action) -> float:
        rank = schedule.stage_rank(a.stage)
        low, high = getattr(alone[rank], table).get(a, 0.0), getattr(full[rank], table).get(a, 0.0)
        return low + share(a) * (high - low)

    def cost(a: Action) -> float:
        return between("compute", a)

    def whole_backward(a: Action) -> float:  # simulate() takes B as the whole backward and W as its share
        return cost(a) + (cost(Action(a.stage, Kind.W, a.mb)) if schedule.splits_backward else 0.0)

    def send(a: Action) -> float:
        return full[schedule.stage_rank(a.stage)].sends.get(a, 0.0)

    result = simulate(schedule, f_time=cost, b_time=whole_backward, w_time=cost, send_time=send)
    step = max(t.optimizer for t in full)
    busy = sum(between("busy", s.action) for rank in result.spans for s in rank)
    return Prediction(result.makespan + step, result.makespan, step, 1 - busy / (schedule.pp * result.makespan),
                      tuple(full), result.spans)


def pipeline_column(programs: dict[int, RankProgram]) -> list[RankProgram]:
    """One program per pipeline position, at position 0 on every other axis (present among any world's
    distinct programs)."""
    first = next(iter(programs.values())).coords
    origin = first.moved(**{axis: 0 for axis, _ in first.ranks})
    return [programs[origin.moved(pp=r).rank] for r in range(origin.size("pp"))]


def format_rank_time(program: RankProgram, rates: Rates) -> str:
    """summary.txt's section: each graph's predicted time and what of it is communication, with every rank of the
    world computing at once (the header says so: in a pipeline's warm-up fewer do, and the iteration's
    prediction charges each action at the ranks computing during it, so these do not add up to it)."""
    shared = (f"; every one of the world's {rates.ranks} ranks computing at once on {rates.machine.cores} cores, "
              f"{rates.slowdown:.2f}x one rank's time (the iteration's prediction simulates the schedule, each graph "
              f"at the ranks computing while it runs)" if rates.slowdown != 1 else "")
    lines = [f"# predicted time per run of each graph (gcompile.cost_model; communication overlapped where the graph "
             f"starts it early{shared})", f"{'graph':<22} {'ms':>9} {'compute ms':>11} {'comm ms':>9}"]
    for name, g in rank_time(program, rates).graphs.items():
        lines.append(f"{name:<22} {g.seconds * 1e3:9.3f} {g.compute * 1e3:11.3f} {g.communication * 1e3:9.3f}")
    return "\n".join(lines) + "\n"
