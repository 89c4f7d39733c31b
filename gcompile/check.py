"""Prove a world's plan before any rank starts: collectives, pipeline messages, memory.

From a world's programs, built in one process (one per class of ranks that run the same
program, gcompile.world.build_distinct: a group spanning dp has one member there), it checks that

- every process group's ranks issue the same collectives in the same order, with
  the same kind, shape, dtype and reduce op (otherwise a real run hangs or
  silently reduces mismatched tensors);
- every pipeline send has its receive on the peer, in the same order, with the
  same shapes and dtypes, and every receive its send;
- (what cannot be checked is said: expert parallel's row counts are data)
- each rank's estimated peak memory (weights, gradients, optimizer state,
  in-flight saved activations) fits a budget, when one is given.

Before any of that, `check_fits_machine` asks only the model's size, from its
module built on meta: a model whose weights cannot fit the machine at all is
refused with the bytes it needs before anything is allocated.

A failure is a PlanError that names the two ranks, the group and the instruction.
"""

import math
import operator
import os
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.fx as fx

from gcompile.collectives import collective_nodes
from gcompile.config import RunConfig
from gcompile.log import counted
from gcompile.machine import ram_bytes
from gcompile.axes import group_members
from gcompile.log import rank_ranges
from gcompile.program import descendants
from gcompile.report import is_metric
from gcompile.rank_program import RankProgram
from gcompile.state import TrainState
from gcompile.torch_api import is_op_overload
from gcompile.instructions import WAIT_SEND
from gcompile.schedule import Kind


class PlanError(ValueError):
    """The ranks' programs would not run together; names the ranks, the group and the instruction."""


@dataclass(frozen=True)
class Call:
    kind: str
    signature: tuple
    """What must agree across the group: shape, dtype, reduce op, group size."""
    where: str
    """The instruction and node, for the error message."""


def collective_calls(program: RankProgram) -> list[tuple[str, Call]]:
    """(group name, call) for every collective the rank issues in one iteration, in order."""
    calls = []
    for i, instruction in enumerate(program.instructions):
        if instruction.is_compute:
            calls += _calls_in(program.graph(instruction), f"instruction {i:02d} {instruction.op}"
                               + (f" stage={instruction.stage} mb={instruction.mb}" if instruction.stage is not None
                                  else "") + f" ({instruction.graph})")
    return calls


def _calls_in(gm: fx.GraphModule, where: str) -> list[tuple[str, Call]]:
    calls = []
    for node, op, args in collective_nodes(gm):
        x = node.args[0].meta["val"]
        signature = (op, tuple(x.shape), str(x.dtype), args.get("reduce_op"), args.get("group_size"))
        calls.append((args["group_name"], Call(op, signature, f"{where}, node {node.name}")))
    return calls


def check_collectives(programs: dict[int, RankProgram]) -> None:
    sequences = defaultdict(lambda: defaultdict(list))  # (group name, members) -> rank -> calls
    for rank, program in programs.items():
        for group, call in collective_calls(program):
            members = group_members(program.coords, group)
            sequences[(group, members)][rank].append(call)
    for (group, members), per_rank in sequences.items():
        present = [r for r in members if r in programs]
        first = present[0]
        for other in present[1:]:
            a, b = per_rank.get(first, []), per_rank.get(other, [])
            for k in range(max(len(a), len(b))):
                ca, cb = (a[k] if k < len(a) else None), (b[k] if k < len(b) else None)
                if ca is None or cb is None or ca.signature != cb.signature:
                    counts = f" ({len(a)} against {len(b)} per iteration)" if len(a) != len(b) else ""
                    raise PlanError(
                        f"group {group!r} {list(members)}: rank {first} and rank {other} disagree at collective "
                        f"#{k} on it{counts}: rank {first} issues {_describe(ca)}; rank {other} issues {_describe(cb)}")


def _describe(call: Call | None) -> str:
    if call is None:
        return "nothing (its sequence ends here)"
    kind, shape, dtype, op, size = call.signature
    return f"{kind}{list(shape)} {dtype}{f' {op}' if op else ''} at {call.where}"


@dataclass(frozen=True)
class Message:
    src: int
    dst: int
    what: str
    """act[s{stage},mb{mb}] or grad[s{stage},mb{mb}]: the tensor set both ends must name alike."""
    shapes: tuple
    where: str


def pipeline_messages(program: RankProgram) -> tuple[list[Message], list[Message]]:
    """(sends, receives) of one iteration, in posting order."""
    rank, sends, recvs = program.coords.rank, [], []
    for i, a in enumerate(program.instructions):
        if a.is_compute or a.op == WAIT_SEND:
            continue
        stage = program.stages[a.stage]
        where = f"rank {rank} instruction {i:02d} {a.action}"
        if a.op == Kind.SEND_F:
            sends.append(Message(rank, a.peer, a.reads[0], _output_shapes(stage), where))
        elif a.op == Kind.RECV_F:
            recvs.append(Message(a.peer, rank, a.writes[0], _activation_input_shapes(stage), where))
        elif a.op == Kind.SEND_B:
            sends.append(Message(rank, a.peer, a.reads[0], _activation_input_shapes(stage), where))
        else:
            recvs.append(Message(a.peer, rank, a.writes[0], _output_shapes(stage), where))
    return sends, recvs


def _output_shapes(stage) -> tuple:
    outs = stage.forward.graph.output_node().args[0][:len(stage.outputs)]
    return tuple((tuple(n.meta["val"].shape), str(n.meta["val"].dtype)) for n, role in zip(outs, stage.outputs)
                 if not is_metric(role))


def _activation_input_shapes(stage) -> tuple:
    nodes = list(stage.forward.graph.find_nodes(op="placeholder"))[len(stage.params):]
    acts = stage.activation_inputs()
    return tuple((tuple(n.meta["val"].shape), str(n.meta["val"].dtype))
                 for role, n in zip(stage.inputs, nodes) if role in acts)


def check_messages(programs: dict[int, RankProgram]) -> None:
    sent, received = defaultdict(list), defaultdict(list)  # (src, dst) -> messages in order
    for program in programs.values():
        sends, recvs = pipeline_messages(program)
        for m in sends:
            sent[(m.src, m.dst)].append(m)
        for m in recvs:
            received[(m.src, m.dst)].append(m)
    for pair in sorted(set(sent) | set(received)):
        if pair[0] not in programs or pair[1] not in programs:
            continue
        s, r = sent[pair], received[pair]
        received_what, sent_what = {m.what for m in r}, {m.what for m in s}
        for m in s:
            if m.what not in received_what:
                raise PlanError(f"rank {pair[0]} sends {m.what} to rank {pair[1]} ({m.where}), "
                                f"but rank {pair[1]} has no matching receive")
        for m in r:
            if m.what not in sent_what:
                raise PlanError(f"rank {pair[1]} receives {m.what} from rank {pair[0]} ({m.where}), "
                                f"but rank {pair[0]} never sends it")
        for k, (ms, mr) in enumerate(zip(s, r)):
            if (ms.what, ms.shapes) != (mr.what, mr.shapes):
                raise PlanError(f"message #{k} from rank {pair[0]} to rank {pair[1]}: rank {pair[0]} sends "
                                f"{ms.what} {ms.shapes} ({ms.where}) but rank {pair[1]} receives {mr.what} "
                                f"{mr.shapes} ({mr.where}); both ends must post them in the same order")


@dataclass(frozen=True)
class MemoryEstimate:
    weights: int
    grads: int
    optimizer: int
    activations: int
    gathered: int = 0
    """optim_grads_params: weights all-gathered at once (the unit in use and the one prefetched)."""
    messages: int = 0
    """Pipeline messages held at the activations' peak: received ones not yet used, and outputs to send from the
    compute that made them until their WAIT_SEND (gcompile.send_release)."""
    constants: int = 0
    """Tensors the model holds (buffers: a causal mask, a rotary table) that the rank's stages read."""

    @property
    def total(self) -> int:
        return self.state + self.activations + self.gathered + self.messages + self.constants

    @property
    def state(self) -> int:
        """What the measured peak calls state (gcompile.memory.HeldBytes): the TrainState's buffers."""
        return self.weights + self.grads + self.optimizer

    def __str__(self) -> str:
        return format(self, "")

    def __format__(self, width: str) -> str:
        """`f"{estimate:10}"`: the total right-aligned in 10 characters, as the plan checker's rows line up."""
        mib = 2 ** 20  # as MeasuredMemory's, which the plan checker prints beside it
        gathered = f" + gathered {self.gathered / mib:.3f}" if self.gathered else ""
        messages = f" + messages {self.messages / mib:.3f}" if self.messages else ""
        constants = f" + constants {self.constants / mib:.3f}" if self.constants else ""
        return (f"{self.total / mib:{width}.3f} MiB = weights {self.weights / mib:.3f} + grads {self.grads / mib:.3f} "
                f"+ optimizer {self.optimizer / mib:.3f} + activations {self.activations / mib:.3f}{gathered}"
                f"{messages}{constants}")


@dataclass(frozen=True)
class MeasuredMemory:
    """What a rank's TrainState holds between steps, by kind, from its buffers (TrainState.buffer_bytes);
    `during_step`: the gradient accumulator allocated only from a step's first backward to its optimizer
    update (optim_grads), 0 when it is held throughout (and counted in `grads`)."""

    weights: int
    """Model weights."""
    grads: int
    """The gradient accumulator when held between steps, and the reduced gradient shard."""
    optimizer: int
    """fp32 main weights, AdamW states, per-element flags and the step's scalars (as MemoryEstimate counts)."""
    during_step: int

    @classmethod
    def of(cls, state: TrainState) -> "MeasuredMemory":
        held = state.buffer_bytes()
        accumulator = held["grads"]
        weights, grads = held.pop("params"), held.pop("grads") + held.pop("reduced_grads", 0)
        return cls(weights=weights, grads=grads, optimizer=sum(held.values()),
                   during_step=0 if accumulator else state.grads.numel() * state.grads.element_size())

    def __str__(self) -> str:
        mib = 2 ** 20
        step = f" (+ accumulator {self.during_step / mib:.3f} during a step)" if self.during_step else ""
        return (f"allocated {(self.weights + self.grads + self.optimizer) / mib:.3f} MiB = weights "
                f"{self.weights / mib:.3f} + grads {self.grads / mib:.3f} + optimizer {self.optimizer / mib:.3f}"
                f"{step}")


def estimate_memory(program: RankProgram, inside_graphs: bool = True) -> MemoryEstimate:
    """Peak bytes of what a rank holds at once: its state, and the saved activations and pipeline messages
    of the instruction boundary where they are most (`_held_at_peak`), or inside a full-recompute backward
    where that holds more. Without `inside_graphs`, at instruction boundaries only: what the runtime measures
    (gcompile.memory), which sees no peak inside a graph."""
    layout, settings = program.layout, program.step_settings
    held = {name: v.numel() * v.element_size() for name, v in program.optimizer.values().items()}
    reduced = held.pop("reduced_grads", 0)  # the averaged gradient shard, written in backward
    optimizer = sum(b for name, b in held.items() if name not in ("params", "grads"))  # main weights, AdamW
    # states, flags, as the step reads them
    activations, messages = _held_at_peak(program, inside_graphs)
    constants = {role: value.nbytes for stage in program.stages.values()
                 for role, value in stage.rank_constants.items() if isinstance(value, torch.Tensor)}
    return MemoryEstimate(weights=layout.numel * settings.param_dtype.itemsize, grads=held["grads"] + reduced,
                          optimizer=optimizer, activations=activations, messages=messages,
                          gathered=max((_gathered_bytes(stage) for stage in program.stages.values()), default=0),
                          constants=sum(constants.values()))


def _held_at_peak(program: RankProgram, inside_graphs: bool = True) -> tuple[int, int]:
    """(saved activations, pipeline messages) at the instruction boundary where they add up to most, walking
    the rank's instructions: F keeps what its backward reads, B lets it go (and keeps what a W reads, which
    W lets go); a receive holds its tensors until the compute that reads them, an output to send from the
    compute that makes it until its WAIT_SEND (or the step's end)."""
    saved = {s: _saved_bytes(stage) for s, stage in program.stages.items()}
    for_w = {s: _weight_bytes(stage) for s, stage in program.stages.items()}
    remade = {s: _recomputed_bytes(stage) if inside_graphs else 0 for s, stage in program.stages.items()}
    sends, recvs = pipeline_messages(program)
    to_send = {m.what: message_bytes(m) for m in sends}
    recvs = iter(recvs)
    held = defaultdict(int)  # buffer name -> bytes of a received message not yet read
    sending = {}  # buffer name -> bytes of an output to send, not yet waited for
    activations = sent = peak = peak_activations = peak_messages = 0
    for instruction in program.instructions:
        op, s = instruction.op, instruction.stage
        if op == Kind.F:
            activations += saved[s]
        elif op == Kind.B:
            during = activations + remade[s] + sent + sum(held.values())  # inside it, before it lets go
            if during > peak:
                peak, peak_activations, peak_messages = during, activations + remade[s], sent + sum(held.values())
            activations += for_w[s] - saved[s]  # for_w: 0 where the backward is whole
        elif op == Kind.W:
            activations -= for_w[s]
        elif op == WAIT_SEND:
            sent -= sending.pop(instruction.reads[0])
        elif op in (Kind.RECV_F, Kind.RECV_B):
            held[instruction.writes[0]] += message_bytes(next(recvs))
        if instruction.is_compute:
            for buffer in instruction.reads:
                held.pop(buffer, None)
            for buffer in instruction.writes:
                if buffer in to_send:
                    sending[buffer] = to_send[buffer]
                    sent += to_send[buffer]
        if activations + sent + sum(held.values()) > peak:
            peak = activations + sent + sum(held.values())
            peak_activations, peak_messages = activations, peak - activations
    return peak_activations, peak_messages


def message_bytes(message: Message) -> int:
    """Bytes of the tensors one pipeline message carries."""
    return sum(math.prod(shape) * getattr(torch, dtype.removeprefix("torch.")).itemsize
               for shape, dtype in message.shapes)


def _gathered_bytes(stage) -> int:
    """The two largest consecutive parameter all-gathers (over dp, or dp_shard under HSDP) of a forward: one
    unit's weights in use while the next unit's arrive."""
    sizes = [n.meta["val"].numel() * n.meta["val"].element_size() for n, op, args in collective_nodes(stage.forward)
             if op == "all_gather_into_tensor" and args["group_name"] in ("dp", "dp_shard")]  # dp_shard: HSDP
    return max((a + b for a, b in zip(sizes, sizes[1:])), default=sum(sizes))


def _saved_bytes(stage) -> int:
    """Bytes a forward saves for its backward, not counting weights it passes through."""
    return _held_bytes(stage, _saved(stage))


def _recomputed_bytes(stage) -> int:
    """Most bytes a full-recompute backward holds at once of what it makes again before any gradient (forward's
    activations): each made where it is computed (a view holds nothing more), let go after its last reader."""
    if not stage.recomputed:
        return 0
    graph = stage.backward.graph
    tangents = list(graph.find_nodes(op="placeholder"))[stage.num_saved:]
    gradients = set().union(*(descendants(t) for t in tangents))
    order = {node: i for i, node in enumerate(graph.nodes)}
    remade = [n for n in graph.nodes if n.op == "call_function" and n not in gradients and
              isinstance(n.meta.get("val"), torch.Tensor) and _base(n) is n]
    last_read = {n: max((order[u] for u in n.users), default=order[n]) for n in remade}
    ends = sorted((last_read[n], _nbytes(n)) for n in remade)
    live = freed = most = 0
    for node in remade:
        live += _nbytes(node)
        while ends[freed][0] < order[node]:
            live -= ends[freed][1]
            freed += 1
        most = max(most, live)
    return most


def _weight_bytes(stage) -> int:
    """Bytes a microbatch holds from its B until its W: the tensors W reads (saved ones as _held_bytes
    counts them; output gradients and B's stash as they are)."""
    if stage.backward_weight is None:
        return 0
    saved = _saved(stage)
    reads = list(stage.backward_weight.graph.find_nodes(op="placeholder"))
    kept = [i if i < len(saved) else None for i in stage.weight_inputs]
    others = [node for node, i in zip(reads, kept + [None] * (len(reads) - len(kept))) if i is None]
    return _held_bytes(stage, [saved[i] for i in kept if i is not None]) + sum(_nbytes(n) for n in others)


def _saved(stage) -> list[fx.Node]:
    return [n for n in stage.forward.graph.output_node().args[0][len(stage.outputs):]
            if isinstance(n.meta.get("val"), torch.Tensor)]


def _held_bytes(stage, nodes: list[fx.Node]) -> int:
    """Bytes that tensors of the forward graph hold: each storage once (a view, such as a weight's transpose
    or a reshaped output, holds its base's), the weights' and buffers' not at all (the state and the
    constants hold them)."""
    placeholders = list(stage.forward.graph.find_nodes(op="placeholder"))
    held = set(placeholders[:len(stage.params)]) | {node for node, role in zip(placeholders[len(stage.params):],
                                                                                stage.inputs)
                                                    if isinstance(stage.rank_constants.get(role), torch.Tensor)}
    return sum(_nbytes(base) for base in {_base(n) for n in nodes} if base not in held)


def _base(node: fx.Node) -> fx.Node:
    """The node whose storage `node` views (itself if it is no view): through view ops, and through the
    pieces of one that returns several (split)."""
    while True:
        source = node.args[0] if node.target is operator.getitem else node  # a piece: its op's list
        if not (is_op_overload(source.target) and source.target.is_view):
            return node
        node = source.args[0]


def _nbytes(node: fx.Node) -> int:
    return node.meta["val"].numel() * node.meta["val"].element_size()


def check_plan(programs: dict[int, RankProgram], memory_budget_gb: float | None = None,
               shared_by: dict[int, tuple[int, ...]] | None = None) -> str:
    """Every check over a world's programs; the report, or PlanError on the first fault. `shared_by`: the
    ranks each program stands for (gcompile.world.build_distinct), when `programs` holds one per class;
    a group spanning dp then has one member here, which speaks for the others."""
    shared_by = shared_by or {rank: (rank,) for rank in programs}
    check_collectives(programs)
    check_messages(programs)
    ranks = sum(len(shared_by[rank]) for rank in programs)
    distinct = "" if ranks == len(programs) else f"{counted(len(programs), 'distinct program')} for "
    lines = [f"plan checked: {distinct}{ranks} ranks agree on every collective and pipeline message" if ranks > 1
             else "plan checked: 1 rank, no peer to agree with"]
    first = next(iter(programs.values()))  # the ranks agree on their collectives by now
    data_sized = sum(call.kind == "all_to_all_rows" for _, call in collective_calls(first))
    if data_sized:
        lines.append(f"not checkable before the run: the row counts of rank {first.coords.rank}'s {data_sized} "
                     f"all_to_all_rows per iteration (expert parallel's routing) are data; their order, group and "
                     f"row width agree, and each rank's buffers hold the most rows that can arrive")
    for rank, program in programs.items():
        estimate = estimate_memory(program)
        also = f" for {rank_ranges(shared_by[rank])}" if len(shared_by[rank]) > 1 else ""
        lines.append(f"rank {rank:4d} {program.coords}{also}: {estimate:10}; "
                     f"{MeasuredMemory.of(TrainState.allocate(program, 'meta'))}")
        if memory_budget_gb is not None and estimate.total > memory_budget_gb * 2 ** 30:
            raise PlanError(f"rank {rank} {program.coords}{also} needs about {estimate.total / 2 ** 30:.3g} GiB "
                            f"(> --memory-budget-gb {memory_budget_gb}): {estimate}; save memory (python -m "
                            f"gcompile.plan --world-size {ranks} --memory-budget-gb {memory_budget_gb} and this "
                            f"run's --config and model flags finds the layouts that fit: more tp or pp, ZeRO, "
                            f"--recompute-activations) or raise the budget")
    return "\n".join(lines)


def check_fits_machine(config: RunConfig) -> None:
    """Before anything is allocated: the model's weights, fp32 gradients and AdamW states (fp32 main weights
    too under bf16/fp16), each held at least once over all ranks, fit this machine's memory: its RAM, or
    the memory of the GPUs its ranks take. A lower bound, so what it refuses can never run here."""
    with torch.device("meta"):
        numel = sum(p.numel() for p in config.model_spec.module(config.model).parameters())
    itemsize = config.param_dtype.itemsize
    per_param = itemsize + 4 + 8 + (4 if itemsize != 4 else 0)
    need = numel * per_param
    if torch.cuda.is_available():
        devices = range(min(config.world_size, torch.cuda.device_count()))
        have = sum(torch.cuda.get_device_properties(d).total_memory for d in devices)
        where = f"the {len(devices)} GPU(s) its ranks take"
    else:
        have, where = ram_bytes(), "this machine's RAM"
    if need > have:
        raise PlanError(f"the model's {numel:,} parameters need at least {need:,} bytes ({need / 2 ** 30:,.1f} GiB: "
                        f"{per_param} bytes each for weights, gradients and AdamW states) but {where} holds "
                        f"{have:,} bytes ({have / 2 ** 30:,.1f} GiB); choose a smaller model "
                        f"(--n-layer, --n-embd, --vocab-size, --block-size)")
