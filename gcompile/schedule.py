"""Pipeline schedules as data: what each pipeline rank runs, in order.

A schedule is, per pp rank, an ordered list of actions. Each action names a
global stage, a kind and a microbatch, and prints as `2F0`, `1B3`, `1W3`, `0SEND_F1`,
`1RECV_B2` (stage, kind, microbatch); `parse_action` reads that back.

Placement follows Megatron's interleaving: stage s lives on rank s % pp, so
with pp=2, vpp=2 rank 0 runs stages 0 and 2 and rank 1 runs stages 1 and 3.
Stage 0 embeds, the last stage computes the loss; activations flow s -> s+1,
gradients s+1 -> s. `SEND_F` of (s, mb) is received by `RECV_F` of (s+1, mb),
`SEND_B` of (s, mb) by `RECV_B` of (s-1, mb); stages on the same rank hand
tensors over locally, with no communication action.

gpipe, 1f1b and interleaved are Megatron's loop with a different warmup count:

    for k in range(warmup):          forward(k)
    for k in range(total - warmup):  forward(warmup + k); backward(k)
    for k in range(total - warmup, total): backward(k)

with total = m * vpp virtual microbatches; gpipe warms up with all of them.

zb1f1b is ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): it splits
each backward into B, the gradient of the stage's inputs that the stage before
waits for, and W, the parameter gradients nobody waits for. It runs 1f1b's F and
B order with each W right after its B, except that rank r keeps its first r W's
for the end, where they fill the time its 1f1b twin spends waiting for gradients:
the bubble drops from (pp-1)(F+B+W) to (pp-1)(F+B-W) with the same microbatches
in flight (forward done, B pending) as 1f1b.
`build_schedule` generates the compute actions, adds the communication and
checks the result with `simulate`, which also predicts the bubble.
`gcompile.schedule_render` draws a schedule as an SVG timeline.
"""

import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import Enum

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb1f1b")
SPLIT_BACKWARD = ("zb1f1b",)
"""Schedules that run each backward as B (input gradients) and W (parameter gradients)."""


class ScheduleError(ValueError):
    """A schedule cannot be built or would not run; the message names the rank and action."""


class Kind(str, Enum):
    """F and B compute (B: input and weight gradients together, or only input gradients where a W follows);
    W computes parameter gradients; SEND/RECV move an activation (_F) or gradient (_B)."""
    F = "F"
    B = "B"
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"


@dataclass(frozen=True)
class Action:
    stage: int
    """Global stage index, 0 .. pp*vpp-1."""
    kind: Kind
    mb: int
    """Microbatch index."""

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.mb}"


_ACTION = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|W)(\d+)")
COMPUTE = (Kind.F, Kind.B, Kind.W)


def parse_action(text: str) -> Action:
    """`"0SEND_F1"` -> Action(0, Kind.SEND_F, 1); the inverse of `str(action)`."""
    match = _ACTION.fullmatch(text.strip())
    if match is None:
        raise ScheduleError(f"cannot parse action {text!r}: expected stage, kind, microbatch as in "
                            f"'2F0', '1B3', '0SEND_F1'")
    return Action(int(match[1]), Kind(match[2]), int(match[3]))


def stage_rank(stage: int, pp: int) -> int:
    """The pipeline rank that runs `stage` (Megatron's interleaving)."""
    return stage % pp


@dataclass(frozen=True)
class Schedule:
    name: str
    """gpipe, 1f1b, interleaved or zb1f1b: decides the in-flight bound the simulator holds it to."""
    pp: int
    """Pipeline ranks."""
    vpp: int
    """Stages (model chunks) per rank; 1 unless interleaved."""
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    """actions[pp_rank]: that rank's instructions in the order it runs them."""

    @property
    def num_stages(self) -> int:
        return self.pp * self.vpp

    def stage_rank(self, stage: int) -> int:
        return stage_rank(stage, self.pp)

    @property
    def splits_backward(self) -> bool:
        """Each backward runs as B then W (two instructions, two graphs)."""
        return self.name in SPLIT_BACKWARD

    def local_stages(self, pp_rank: int) -> list[int]:
        return [chunk * self.pp + pp_rank for chunk in range(self.vpp)]

    def __str__(self) -> str:
        return format_table(self)


def format_table(schedule: Schedule, communication: bool = False) -> str:
    """One row per rank, one column per compute slot (the rank's k-th F, B or W), or with
    `communication` per instruction (its k-th action, sends and receives included).

    Columns follow each rank's own order, not time: `simulate` gives the timing
    and `render_svg` draws it.
    """
    kinds = tuple(Kind) if communication else COMPUTE
    rows = [[str(a) for a in actions if a.kind in kinds] for actions in schedule.actions]
    width = max((len(cell) for row in rows for cell in row), default=1)
    head = (f"{schedule.name} pp={schedule.pp} vpp={schedule.vpp} m={schedule.num_microbatches}: "
            f"stage kind microbatch per {'instruction' if communication else 'compute slot'}")
    label = len(f"rank{schedule.pp - 1}")
    lines = [f"{f'rank{r}':<{label}} | " + " ".join(f"{cell:<{width}}" for cell in row).rstrip()
             for r, row in enumerate(rows)]
    return "\n".join([head, *lines])


def warmup_forwards(name: str, pp: int, vpp: int, m: int, rank: int) -> int:
    """Forwards a rank runs before its first forward-backward pair, as Megatron counts them.

    1f1b (and zb1f1b): one per stage after the rank, so the last stage starts
    backward at once. interleaved: pp microbatches through each chunk but the last, plus
    two per later rank, which keep the rank busy while its first gradient
    makes the round trip to the last rank. (This is Megatron-core's count with
    microbatch_group_size_per_vp_stage = pp; releases before it warmed up with
    every microbatch when m == pp.)
    """
    if name == "gpipe":
        return m * vpp
    if name in ("1f1b", "zb1f1b"):
        return min(pp - rank - 1, m)
    if name == "interleaved":
        return min((pp - rank - 1) * 2 + (vpp - 1) * pp, m * vpp)
    raise ScheduleError(f"unknown schedule {name!r}: expected one of {', '.join(SCHEDULES)}")


def _virtual_microbatch(pp: int, vpp: int, k: int) -> tuple[int, int]:
    """(chunk, microbatch) of a rank's k-th forward: pp microbatches per chunk, chunks in turn.

    pp=2, vpp=2: k = 0 1 2 3 4 5 6 7 -> chunk 0 0 1 1 0 0 1 1, microbatch 0 1 0 1 2 3 2 3.
    The k-th backward takes the same microbatch on chunk vpp-1-chunk.
    """
    group = pp * vpp
    return (k % group) // pp, (k // group) * pp + k % pp


def _megatron_order(pp: int, vpp: int, m: int, rank: int, warmup: int) -> tuple[Action, ...]:
    def forward(k: int) -> Action:
        chunk, mb = _virtual_microbatch(pp, vpp, k)
        return Action(chunk * pp + rank, Kind.F, mb)

    def backward(k: int) -> Action:
        chunk, mb = _virtual_microbatch(pp, vpp, k)
        return Action((vpp - 1 - chunk) * pp + rank, Kind.B, mb)

    total = m * vpp
    order = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [forward(warmup + k), backward(k)]
    order += [backward(k) for k in range(total - warmup, total)]
    return tuple(order)


def check_sizes(name: str, pp: int, vpp: int, m: int) -> None:
    """All argument validation for the generators, every factor printed."""
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}: expected one of {', '.join(SCHEDULES)}")
    for what, value in (("pp", pp), ("vpp", vpp), ("num_microbatches", m)):
        if value < 1:
            raise ScheduleError(f"{name} schedule needs {what} >= 1, got {value}")
    if name in ("gpipe", "1f1b", "zb1f1b") and vpp != 1:
        raise ScheduleError(f"{name} schedule runs one stage per rank (vpp=1), got vpp={vpp}; "
                            f"use 'interleaved' for vpp > 1")
    if name == "interleaved":
        if vpp < 2:
            raise ScheduleError(f"interleaved schedule needs vpp >= 2, got vpp={vpp}; use '1f1b' for vpp=1")
        # Megatron's chunk order takes microbatches pp at a time; a positive multiple of pp is also >= pp.
        if m % pp:
            raise ScheduleError(f"interleaved schedule needs num_microbatches ({m}) divisible by pp ({pp})")


def _zero_bubble_h1_order(pp: int, m: int, rank: int) -> tuple[Action, ...]:
    """1f1b's order with W(k) right after B(k), but W 0 .. rank-1 last.

    pp=2, m=4, rank 1:  1F0 1B0 1F1 1B1 1W1 1F2 1B2 1W2 1F3 1B3 1W3 1W0
    """
    deferred = min(rank, m)
    order = []
    for a in _megatron_order(pp, 1, m, rank, warmup_forwards("zb1f1b", pp, 1, m, rank)):
        order.append(a)
        if a.kind == Kind.B and a.mb >= deferred:
            order.append(Action(a.stage, Kind.W, a.mb))
    return tuple(order + [Action(rank, Kind.W, mb) for mb in range(deferred)])


def _compute_schedule(name: str, pp: int, vpp: int, m: int) -> Schedule:
    check_sizes(name, pp, vpp, m)
    if name == "zb1f1b":
        actions = tuple(_zero_bubble_h1_order(pp, m, rank) for rank in range(pp))
    else:
        actions = tuple(_megatron_order(pp, vpp, m, rank, warmup_forwards(name, pp, vpp, m, rank))
                        for rank in range(pp))
    return Schedule(name, pp, vpp, m, actions)


def gpipe(pp: int, m: int) -> Schedule:
    """All forwards, then all backwards in microbatch order; compute actions only."""
    return _compute_schedule("gpipe", pp, 1, m)


def one_f_one_b(pp: int, m: int) -> Schedule:
    """Megatron's 1F1B: min(pp-rank-1, m) warmup forwards, then alternate; compute actions only."""
    return _compute_schedule("1f1b", pp, 1, m)


def interleaved_1f1b(pp: int, vpp: int, m: int) -> Schedule:
    """Megatron's interleaved 1F1B over vpp chunks per rank; compute actions only."""
    return _compute_schedule("interleaved", pp, vpp, m)


def zero_bubble_h1(pp: int, m: int) -> Schedule:
    """ZB-H1: 1F1B with B and W apart, rank r's first r W's moved to the end; compute actions only."""
    return _compute_schedule("zb1f1b", pp, 1, m)


def rank_in_flight_bound(schedule: Schedule, rank: int) -> int:
    """Most microbatches a rank may hold forward-done, backward-pending, over all its stages.

    Megatron's loop runs one more forward after the warmup before its first
    backward, then trades one for one: gpipe m, 1f1b and zb1f1b min(pp-rank, m)
    (zb1f1b's W's come after their B's and keep less, which this does not count).
    """
    m, vpp = schedule.num_microbatches, schedule.vpp
    return min(warmup_forwards(schedule.name, schedule.pp, vpp, m, rank) + 1, m * vpp)


def waiting_weight_bound(schedule: Schedule, rank: int) -> int:
    """Most microbatches a rank holds B-done, W-pending (what their W reads): zb1f1b's rank r holds back
    its first r W's and runs each later W right after its B, so r + 1; none where backward is whole."""
    return min(rank + 1, schedule.num_microbatches) if schedule.splits_backward else 0


def in_flight_bound(schedule: Schedule, stage: int) -> int:
    """The per-stage share of `rank_in_flight_bound`, as the schedule promises it.

    With one stage per rank it is the rank's bound. With chunks, this counts
    how the loop's virtual-microbatch table splits the rank's microbatches over
    its chunks at each step (the chunks peak at different steps, so the shares
    add up to more than the rank's bound); it reads the table, never the action list.
    """
    pp, vpp, m = schedule.pp, schedule.vpp, schedule.num_microbatches
    rank, chunk = stage % pp, stage // pp
    warmup = warmup_forwards(schedule.name, pp, vpp, m, rank)
    chunks = [_virtual_microbatch(pp, vpp, k)[0] for k in range(m * vpp)]
    forwards, backwards = chunks[:warmup].count(chunk), 0
    peak = forwards
    for k in range(m * vpp - warmup):
        forwards += chunks[warmup + k] == chunk
        peak = max(peak, forwards - backwards)
        backwards += vpp - 1 - chunks[k] == chunk
    return peak


def add_communication(schedule: Schedule) -> Schedule:
    """Post each receive one compute before the compute that needs it; send right after the
    compute that produced it.

    Before:  1F0 1B0 1F1 1B1
    After:   1RECV_F0 1RECV_B0 1F0 1SEND_F0 1RECV_F1 1B0 1SEND_B0 1RECV_B1 1F1 1SEND_F1 1B1 1SEND_B1
             (stage 1 of 3, one per rank)

    Posting never blocks; the compute waits for the tensor. A receive posted a compute
    early lets the transfer run while that compute does (gloo moves a message only once
    both ends have posted it: posted at the last moment, a 512 KB receive after a compute
    waited 0.6 to 47 ms on this machine, posted before it ~0). One compute ahead keeps at
    most two receive buffers waiting per rank.
    """
    def remote(stage: int, neighbour: int) -> bool:
        return 0 <= neighbour < schedule.num_stages and schedule.stage_rank(neighbour) != schedule.stage_rank(stage)

    def receives(a: Action) -> list[Action]:
        if a.kind == Kind.W:
            return []
        forward = a.kind == Kind.F
        source = a.stage - 1 if forward else a.stage + 1
        return [Action(a.stage, Kind.RECV_F if forward else Kind.RECV_B, a.mb)] if remote(a.stage, source) else []

    def sends(a: Action) -> list[Action]:
        if a.kind == Kind.W:
            return []
        forward = a.kind == Kind.F
        target = a.stage + 1 if forward else a.stage - 1
        return [Action(a.stage, Kind.SEND_F if forward else Kind.SEND_B, a.mb)] if remote(a.stage, target) else []

    ranks = []
    for compute in schedule.actions:
        actions = receives(compute[0]) if compute else []
        for i, a in enumerate(compute):
            actions += (receives(compute[i + 1]) if i + 1 < len(compute) else []) + [a] + sends(a)
        ranks.append(tuple(actions))
    return replace(schedule, actions=tuple(ranks))


_PARTNER = {Kind.SEND_F: (Kind.RECV_F, +1), Kind.RECV_F: (Kind.SEND_F, -1),
            Kind.SEND_B: (Kind.RECV_B, -1), Kind.RECV_B: (Kind.SEND_B, +1)}


def partner(a: Action) -> Action:
    """The other end of a communication: 0SEND_F1 <-> 1RECV_F1, 1SEND_B1 <-> 0RECV_B1."""
    kind, step = _PARTNER[a.kind]
    return Action(a.stage + step, kind, a.mb)


@dataclass(frozen=True)
class Span:
    """A compute action placed in time by the simulator."""
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    makespan: float
    """Time until the last rank finishes; compute costs f_time, b_time or w_time, communication nothing."""
    busy: tuple[float, ...]
    """Compute time per rank."""
    bubble_fraction: float
    """1 - sum(busy) / (pp * makespan): the share of rank-time spent waiting."""
    peak_in_flight: tuple[int, ...]
    """Per stage: most microbatches at once whose F had run and whose B had not (W's inputs not counted)."""
    rank_peak_in_flight: tuple[int, ...]
    """The same per rank, over all its stages."""
    steps: int
    """Simulator steps; in each, every rank that can runs its next action."""
    spans: tuple[tuple[Span, ...], ...]
    """Per rank, its compute actions with their start and end times."""


Cost = float | Sequence[float] | Callable[[Action], float]
"""What one forward (or backward) takes: the same on every stage, one number per stage, or per action
(the cost model's, gcompile.cost_model)."""


def simulate(schedule: Schedule, f_time: Cost = 1.0, b_time: Cost = 2.0, w_time: Cost = 1.0,
             send_time: float | Callable[[Action], float] = 0.0) -> SimResult:
    """Run every rank's list in one process; raise ScheduleError where a real run would fail or hang.

    b_time is a whole backward; where the schedule splits it, B takes
    b_time - w_time and W takes w_time (otherwise w_time is unused).
    send_time: from a SEND_F or SEND_B until its tensor is at the peer (0: free).

    Neither a send nor posting a receive blocks (the runtime waits for a send
    only where its receive is proven posted, gcompile.send_release, and for a
    received tensor when a compute uses it).
    What a compute needs on its own rank (its forward before its backward, an
    input from a stage on the same rank, the posted receive of an input from
    another rank) and what a send sends must already have run there, or the
    order is wrong. Compute starts when the rank is free and its inputs are
    there: a received tensor at the time its sender ran.
    """
    _check_actions(schedule)
    return _Simulation(schedule, f_time, b_time, w_time, send_time).run()


def _check_actions(schedule: Schedule) -> None:
    """What can be judged without running: placement, each F and B (and W where the schedule
    splits backward) once, every message paired.

    Every F and B fed from another rank needs its receive, so a send nobody
    receives shows up as that missing receive, named on the receiving rank.
    """
    n, m, pp = schedule.num_stages, schedule.num_microbatches, schedule.pp
    if len(schedule.actions) != pp:
        raise ScheduleError(f"schedule has {len(schedule.actions)} action lists for pp={pp} ranks")
    rank_of: dict[Action, int] = {}
    for rank, actions in enumerate(schedule.actions):
        for a in actions:
            if not (0 <= a.stage < n and 0 <= a.mb < m):
                raise ScheduleError(f"rank {rank}: {a} is outside stages 0..{n - 1} or microbatches 0..{m - 1}")
            if schedule.stage_rank(a.stage) != rank:
                raise ScheduleError(f"rank {rank}: {a} belongs to stage {a.stage}, "
                                    f"which lives on rank {schedule.stage_rank(a.stage)}")
            if a.kind == Kind.W and not schedule.splits_backward:
                raise ScheduleError(f"rank {rank}: {a} is a W, but the {schedule.name} schedule runs each "
                                    f"backward whole in its B")
            if a.kind not in COMPUTE:
                peer = partner(a).stage
                if not 0 <= peer < n:
                    raise ScheduleError(f"rank {rank}: {a} talks to stage {peer}, which does not exist")
                if schedule.stage_rank(peer) == rank:
                    raise ScheduleError(f"rank {rank}: {a} talks to stage {peer} on the same rank; "
                                        f"stages on one rank hand tensors over without communication")
            if a in rank_of:
                raise ScheduleError(f"rank {rank}: {a} appears more than once")
            rank_of[a] = rank
    for stage in range(n):
        rank = schedule.stage_rank(stage)
        for mb in range(m):
            kinds = ((Kind.F, "forward"), (Kind.B, "backward"))
            kinds += ((Kind.W, "parameter-gradient backward"),) if schedule.splits_backward else ()
            for kind, word in kinds:
                if Action(stage, kind, mb) not in rank_of:
                    raise ScheduleError(f"rank {rank}: {Action(stage, kind, mb)} is missing: stage {stage} "
                                        f"never runs the {word} of microbatch {mb}")
            for a, source, receive, what in ((Action(stage, Kind.F, mb), stage - 1, Kind.RECV_F, "activation"),
                                             (Action(stage, Kind.B, mb), stage + 1, Kind.RECV_B, "gradient")):
                if 0 <= source < n and schedule.stage_rank(source) != rank \
                        and Action(stage, receive, mb) not in rank_of:
                    recv = Action(stage, receive, mb)
                    raise ScheduleError(f"rank {rank}: {a} needs the {what} of stage {source} from rank "
                                        f"{schedule.stage_rank(source)}, but rank {rank} never receives it "
                                        f"(no {recv} to match {partner(recv)})")
    for a, rank in rank_of.items():
        if a.kind in (Kind.RECV_F, Kind.RECV_B) and partner(a) not in rank_of:
            raise ScheduleError(f"rank {rank}: {a} waits for {partner(a)}, which rank "
                                f"{schedule.stage_rank(partner(a).stage)} never sends")
    _check_channel_order(schedule)


def _check_channel_order(schedule: Schedule) -> None:
    """Messages between two ranks are matched in the order each end posts them (gloo and NCCL
    alike), so the k-th receive from a rank must be the partner of that rank's k-th send to it."""
    sent, received = defaultdict(list), defaultdict(list)
    for rank, actions in enumerate(schedule.actions):
        for a in actions:
            if a.kind in (Kind.SEND_F, Kind.SEND_B):
                sent[(rank, schedule.stage_rank(partner(a).stage))].append(a)
            elif a.kind in (Kind.RECV_F, Kind.RECV_B):
                received[(schedule.stage_rank(partner(a).stage), rank)].append(a)
    for (source, rank), receives in received.items():
        for k, (recv, send) in enumerate(zip(receives, sent[(source, rank)])):
            if partner(recv) != send:
                raise ScheduleError(f"rank {rank}: {recv} is its receive number {k} from rank {source}, but "
                                    f"rank {source}'s send number {k} to it is {send}; messages between two "
                                    f"ranks arrive in the order they were sent")


class _Simulation:
    def __init__(self, schedule: Schedule, f_time: Cost, b_time: Cost, w_time: Cost,
                 send_time: float | Callable[[Action], float]):
        self.schedule = schedule
        n = schedule.num_stages
        costs = {Kind.F: f_time, Kind.B: b_time, Kind.W: w_time}
        if any(isinstance(cost, Sequence) and len(cost) != n for cost in costs.values()):
            got = ", ".join(f"{word} {len(costs[kind]) if isinstance(costs[kind], Sequence) else 'one for all'}"
                            for kind, word in ((Kind.F, "forward"), (Kind.B, "backward"), (Kind.W, "weight")))
            raise ScheduleError(f"per-stage costs need {n} entries, got {got}")
        self.cost = {kind: cost if callable(cost) else _per_stage(cost, n) for kind, cost in costs.items()}
        """Cost of each kind of compute, per action."""
        self.send_time = send_time if callable(send_time) else (lambda a: send_time)
        self.position = [0] * schedule.pp
        """Index of each rank's next action."""
        self.clock = [0.0] * schedule.pp
        """When each rank's compute is next free."""
        self.ready_at: dict[Action, float] = {}
        """Each action run so far, and when its result is there: end of compute, time of send or arrival."""
        self.in_flight = [0] * schedule.num_stages
        self.peak = [0] * schedule.num_stages
        self.bound = [in_flight_bound(schedule, s) for s in range(schedule.num_stages)]
        self.rank_in_flight = [0] * schedule.pp
        self.rank_peak = [0] * schedule.pp
        self.rank_bound = [rank_in_flight_bound(schedule, r) for r in range(schedule.pp)]
        self.spans: list[list[Span]] = [[] for _ in range(schedule.pp)]
        self.grid: list[list[str]] = []
        """Per step, what each rank ran ('' if it waited or was done)."""

    def run(self) -> SimResult:
        pp = self.schedule.pp
        while any(self.position[r] < len(self.schedule.actions[r]) for r in range(pp)):
            waiting, runnable = {}, []
            for rank in range(pp):
                if self.position[rank] < len(self.schedule.actions[rank]):
                    a = self.schedule.actions[rank][self.position[rank]]
                    send = self._waits_for(rank, a)
                    if send is None:
                        runnable.append((rank, a))
                    else:
                        waiting[rank] = (a, send)
            if not runnable:
                raise ScheduleError(self._deadlock(waiting))
            row = [""] * pp
            for rank, a in runnable:
                self._execute(rank, a)
                self.position[rank] += 1
                row[rank] = str(a)
            self.grid.append(row)
        busy = tuple(sum(span.end - span.start for span in spans) for spans in self.spans)
        makespan = max(self.clock)
        return SimResult(makespan=makespan, busy=busy, bubble_fraction=1 - sum(busy) / (pp * makespan),
                         peak_in_flight=tuple(self.peak), rank_peak_in_flight=tuple(self.rank_peak),
                         steps=len(self.grid),
                         spans=tuple(tuple(spans) for spans in self.spans))

    def _needs(self, a: Action) -> list[tuple[Action, str]]:
        """What must have run on a's own rank before a, and why."""
        s, mb, last = a.stage, a.mb, self.schedule.num_stages - 1
        local = self.schedule.stage_rank

        def source(neighbour: int, kind: Kind, receive: Kind) -> Action:
            return Action(neighbour, kind, mb) if local(neighbour) == local(s) else Action(s, receive, mb)

        if a.kind == Kind.F:
            return [] if s == 0 else [(source(s - 1, Kind.F, Kind.RECV_F), "its input activation")]
        if a.kind == Kind.B:
            needs = [(Action(s, Kind.F, mb), "its own forward")]
            return needs if s == last else needs + [(source(s + 1, Kind.B, Kind.RECV_B), "its output gradient")]
        if a.kind == Kind.W:
            return [(Action(s, Kind.B, mb), "the gradients it continues from")]
        if a.kind == Kind.SEND_F:
            return [(Action(s, Kind.F, mb), "the activation it sends")]
        if a.kind == Kind.SEND_B:
            return [(Action(s, Kind.B, mb), "the gradient it sends")]
        return []

    def _waits_for(self, rank: int, a: Action) -> Action | None:
        """The send whose tensor a compute still waits for; None when a can run now. Raises on a wrong order."""
        waits = None
        for need, why in self._needs(a):
            if need not in self.ready_at:
                raise ScheduleError(f"rank {rank}: {a} (instruction {self.position[rank]}) runs before {need}, "
                                    f"which provides {why}")
            if need.kind in (Kind.RECV_F, Kind.RECV_B) and partner(need) not in self.ready_at:
                waits = partner(need)
        return waits

    def _arrival(self, need: Action) -> float:
        """When what `need` provides is there: a received tensor when its send ran."""
        if need.kind in (Kind.RECV_F, Kind.RECV_B):
            return self.ready_at[partner(need)] + self.send_time(partner(need))
        return self.ready_at[need]

    def _duration(self, a: Action) -> float:
        """Where the schedule splits backward, B is the whole backward less its W."""
        seconds = self.cost[a.kind](a)
        if a.kind == Kind.B and self.schedule.splits_backward:
            seconds -= self.cost[Kind.W](Action(a.stage, Kind.W, a.mb))
        return seconds

    def _execute(self, rank: int, a: Action) -> None:
        if a.kind in (Kind.SEND_F, Kind.SEND_B, Kind.RECV_F, Kind.RECV_B):
            self.ready_at[a] = self.clock[rank]
            return
        start = max([self.clock[rank]] + [self._arrival(need) for need, _ in self._needs(a)])
        end = start + self._duration(a)
        self.clock[rank] = self.ready_at[a] = end
        self.spans[rank].append(Span(a, start, end))
        if a.kind == Kind.W:
            return
        change = 1 if a.kind == Kind.F else -1
        self.in_flight[a.stage] += change
        self.rank_in_flight[rank] += change
        self.peak[a.stage] = max(self.peak[a.stage], self.in_flight[a.stage])
        self.rank_peak[rank] = max(self.rank_peak[rank], self.rank_in_flight[rank])
        for count, bound, where in ((self.in_flight[a.stage], self.bound[a.stage], f"stage {a.stage}"),
                                    (self.rank_in_flight[rank], self.rank_bound[rank], f"rank {rank}")):
            if count > bound:
                raise ScheduleError(f"rank {rank}: {a} makes {count} microbatches in flight on {where}, "
                                    f"more than the {self.schedule.name} schedule's bound of {bound}")

    def _deadlock(self, waiting: dict[int, tuple[Action, Action]]) -> str:
        lines = [f"deadlock after {len(self.grid)} steps: no rank can progress"]
        for rank, (a, send) in waiting.items():
            other = self.schedule.stage_rank(send.stage)
            # the send exists (checked before running) and has not run, so its rank is not done
            lines.append(f"  rank {rank} waits at {a} (instruction {self.position[rank]}) for {send} from rank "
                         f"{other}, which is at {self.schedule.actions[other][self.position[other]]} "
                         f"(instruction {self.position[other]})")
        stuck = [str(waiting[r][0]) if r in waiting else "" for r in range(self.schedule.pp)]
        return "\n".join(lines + [_format_grid(self.grid, stuck)])


def _per_stage(cost: float | Sequence[float], n: int) -> Callable[[Action], float]:
    costs = list(cost) if isinstance(cost, Sequence) else [cost] * n
    return lambda a: costs[a.stage]


def _format_grid(steps: list[list[str]], stuck: list[str]) -> str:
    """The simulator's step x rank grid, the stuck actions last, marked `<-- ERROR HERE`."""
    pp = len(stuck)
    width = max([len(f"rank{pp - 1}")] + [len(cell) for row in steps + [stuck] for cell in row])

    def line(label: str, cells: list[str]) -> str:
        return f"{label:>5} | " + " | ".join(f"{cell:<{width}}" for cell in cells)

    lines = [line("step", [f"rank{r}" for r in range(pp)])]
    lines += [line(str(i), row) for i, row in enumerate(steps)]
    lines.append(line("stuck", stuck) + "  <-- ERROR HERE")
    return "\n".join(lines)


def build_schedule(name: str, pp: int, vpp: int, m: int) -> Schedule:
    """The schedule a run executes: generated, communication added, checked by the simulator."""
    schedule = add_communication(_compute_schedule(name, pp, vpp, m))
    simulate(schedule)
    return schedule
