"""A rank's schedule lowered into the instructions it runs: which graph, which buffers, which peer.

The list is made once per rank when its program is built. The runtime, the plan
checker, the collective/FLOP summary, bucket overlap and the printed schedule all
read it and decide nothing again:

    07 F         stage=1 mb=3  forward          act[s0,mb3] -> act[s1,mb3], saved[s1,mb3]
    08 SEND_F    stage=1 mb=3  act[s1,mb3] to rank 2 (group pp)
    12 WAIT_SEND stage=1 mb=3  act[s1,mb3] to rank 2 (group pp)
    31 OPT_STEP                optimizer        param_grads -> params

Buffers are named by what they hold: `batch[mb3]`, `act[s1,mb3]` (stage 1's output),
`grad[s2,mb3]` (the gradient of stage 2's inputs), `saved[s1,mb3]` (what forward keeps
for backward), `for_w[s1,mb3]` (what B keeps for W), `loss_scale`, `param_grads`, `params`.
"""

from dataclasses import dataclass, replace

from gcompile.axes import Coords
from gcompile.schedule import Action, Kind, Schedule
from gcompile.send_release import send_releases

STAGE_GRAPHS = ("forward", "backward", "backward_last", "backward_weight")
"""Every graph a lowered stage may hold (gcompile.lower.LoweredStage), by the name instructions use."""
OPTIMIZER = "optimizer"
"""The graph of the OPT_STEP instruction."""
OPT_STEP = "OPT_STEP"
WAIT_SEND = "WAIT_SEND"
"""Wait for an earlier send, letting its tensor go, where the schedule proves the receive posted
(gcompile.send_release)."""


@dataclass(frozen=True)
class Instruction:
    op: str
    """A schedule action's kind (F, B, W, SEND_F, RECV_F, SEND_B, RECV_B), WAIT_SEND or OPT_STEP."""
    stage: int | None
    mb: int | None
    graph: str | None
    """The graph it runs: one of STAGE_GRAPHS of its stage, or OPTIMIZER; None for a send or receive."""
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    peer: int | None = None
    """Global rank at the other end of a send or receive."""
    group: str | None = None
    """The group role (gcompile.axes) the peer is reached through."""

    @property
    def action(self) -> Action | None:
        return None if self.op in (OPT_STEP, WAIT_SEND) else Action(self.stage, Kind(self.op), self.mb)

    @property
    def is_compute(self) -> bool:
        return self.graph is not None

    def __str__(self) -> str:
        where = f"stage={self.stage} mb={self.mb}" if self.stage is not None else ""
        if self.graph is None:
            direction = "from" if self.op.startswith("RECV") else "to"
            return f"{self.op:<9} {where:<13} {', '.join(self.reads + self.writes)} {direction} rank {self.peer} " \
                   f"(group {self.group})"
        return f"{self.op:<9} {where:<13} {self.graph:<16} {', '.join(self.reads)} -> {', '.join(self.writes)}"


def act(stage: int, mb: int) -> str:
    return f"act[s{stage},mb{mb}]"


def grad(stage: int, mb: int) -> str:
    return f"grad[s{stage},mb{mb}]"


def lower_instructions(schedule: Schedule, coords: Coords, split_stages: frozenset[int]) -> tuple[Instruction, ...]:
    """The schedule's actions for this rank's pipeline position, then the optimizer step.

    `split_stages`: the stages whose backward is split into B and W (zero-bubble); a W of
    any other stage has nothing left to do and is left out."""
    last = schedule.num_stages - 1
    pp_rank = coords.axis_rank("pp")
    releases = send_releases(schedule)[pp_rank]
    out = []
    for i, a in enumerate(schedule.actions[pp_rank]):
        s, mb = a.stage, a.mb
        if a.kind == Kind.F:
            out.append(Instruction(a.kind.value, s, mb, "forward", (f"batch[mb{mb}]" if s == 0 else act(s - 1, mb),),
                                   ("loss" if s == last else act(s, mb), f"saved[s{s},mb{mb}]")))
        elif a.kind == Kind.B:
            writes = ("param_grads",) + ((grad(s, mb),) if s > 0 else ()) + \
                ((f"for_w[s{s},mb{mb}]",) if s in split_stages else ())
            out.append(Instruction(a.kind.value, s, mb, "backward",
                                   (f"saved[s{s},mb{mb}]", "loss_scale" if s == last else grad(s + 1, mb)), writes))
        elif a.kind == Kind.W:
            if s in split_stages:
                out.append(Instruction(a.kind.value, s, mb, "backward_weight", (f"for_w[s{s},mb{mb}]",),
                                       ("param_grads",)))
        else:
            out.append(_transfer(a, schedule, coords))
        out += [replace(_transfer(sent, schedule, coords), op=WAIT_SEND) for sent in releases.get(i, ())]
    out.append(Instruction(OPT_STEP, None, None, OPTIMIZER, ("param_grads",), ("params",)))
    return tuple(out)


def _transfer(a: Action, schedule: Schedule, coords: Coords) -> Instruction:
    """A send or receive: the buffer it sends or fills, and the rank at the other end."""
    toward = a.stage + 1 if a.kind in (Kind.SEND_F, Kind.RECV_B) else a.stage - 1
    buffer = {Kind.SEND_F: act(a.stage, a.mb), Kind.RECV_F: act(a.stage - 1, a.mb),
              Kind.SEND_B: grad(a.stage, a.mb), Kind.RECV_B: grad(a.stage + 1, a.mb)}[a.kind]
    sends = a.kind in (Kind.SEND_F, Kind.SEND_B)
    return Instruction(a.kind.value, a.stage, a.mb, None, (buffer,) if sends else (), () if sends else (buffer,),
                       peer=coords.moved(pp=schedule.stage_rank(toward)).rank, group="pp")


def format_instructions(instructions: tuple[Instruction, ...], header: str) -> str:
    """`07 F stage=1 mb=3 forward act[s0,mb3] -> act[s1,mb3], saved[s1,mb3]`, one line per instruction."""
    return "\n".join([f"# {header}: {len(instructions)} instructions"] +
                     [f"{i:02d} {instruction}" for i, instruction in enumerate(instructions)])

