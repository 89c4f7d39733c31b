"""Where a pipeline send may be waited for, so that its tensor is let go, without risk of a deadlock.

gloo reports a send complete only once it is waited for, so a runtime that waited
for sends only at the end of the step held every activation and gradient it sent
in the step: Llama 3 8B at tp8 pp4 dp2 sends 256 microbatches of 64 MiB a rank.
Waiting for a send right after posting it could deadlock: its receiver may be
waiting for a message from this rank first. Waiting is safe once the receiver has
posted the matching receive: the transfer then needs nothing more from its
program. The schedule proves that when the receive's posting happened before this
point of the rank's list: each rank posts its list in order, and a compute that
uses a received message comes after its sender's send. Vector clocks follow those
orders through every rank (interleaving's messages go round the ring, so the proof
may come through a third rank): a wait goes right after the first compute whose
clock has seen the receive posted. A send nothing proves (a step's last gradients)
is waited for at the end of the step, as before.
"""

import bisect
import functools
from collections import defaultdict

from gcompile.schedule import COMPUTE, Action, Kind, Schedule, ScheduleError, partner

USED_BY = {Kind.RECV_F: Kind.F, Kind.RECV_B: Kind.B}
"""The compute that reads what a receive brings (its stage and microbatch alike)."""


@functools.lru_cache(maxsize=8)  # every rank of a world lowers the same schedule
def send_releases(schedule: Schedule) -> tuple[dict[int, tuple[Action, ...]], ...]:
    """Per pipeline rank: the index of a compute action in its list -> the sends it may wait for right after
    that action (each send once, at the first such action after it)."""
    position = [{a: i for i, a in enumerate(actions)} for actions in schedule.actions]
    seen = _clocks(schedule)
    found = []
    for rank, actions in enumerate(schedule.actions):
        computes = sorted(seen[rank])
        heard = [[seen[rank][c][peer] for c in computes] for peer in range(schedule.pp)]  # each only grows
        releases = defaultdict(list)
        for i, a in enumerate(actions):
            if a.kind not in (Kind.SEND_F, Kind.SEND_B):
                continue
            receive = partner(a)
            peer = schedule.stage_rank(receive.stage)
            k = bisect.bisect_right(heard[peer], position[peer][receive], lo=bisect.bisect_right(computes, i))
            if k < len(computes):
                releases[computes[k]].append(a)
        found.append({use: tuple(sends) for use, sends in releases.items()})
    return tuple(found)


def _clocks(schedule: Schedule) -> list[dict[int, list[int]]]:
    """Per rank, the vector clock after each of its actions: entry p is how many of rank p's actions happened
    before (a compute using a received message takes in its sender's clock at the send)."""
    pp, actions = schedule.pp, schedule.actions
    uses = [{Action(a.stage, USED_BY[a.kind], a.mb): partner(a) for a in listed if a.kind in USED_BY}
            for listed in actions]
    clock, at, sent = [[0] * pp for _ in range(pp)], [0] * pp, {}
    seen = [{} for _ in range(pp)]
    while any(at[r] < len(actions[r]) for r in range(pp)):
        before = list(at)
        for rank in range(pp):
            while at[rank] < len(actions[rank]):
                a = actions[rank][at[rank]]
                send = uses[rank].get(a)
                if send is not None:
                    if send not in sent:
                        break  # its message is not sent yet: another rank goes on
                    clock[rank] = [max(x, y) for x, y in zip(clock[rank], sent[send])]
                clock[rank][rank] = at[rank] + 1
                if a.kind in (Kind.SEND_F, Kind.SEND_B):
                    sent[a] = list(clock[rank])
                if a.kind in COMPUTE:
                    seen[rank][at[rank]] = list(clock[rank])
                at[rank] += 1
        if at == before:
            raise ScheduleError(f"{schedule.name}: every rank waits for a message not sent (at {at})")
    return seen
