"""Where a pipeline send may be waited for, so that its tensor is let go, without risk of a deadlock.

gloo reports a send complete only once it is waited for, so a runtime that waited
for sends only at the end of the step held every activation and gradient it sent
in the step: Llama 3 8B at tp8 pp4 dp2 sends 256 microbatches of 64 MiB a rank.
Waiting for a send right after posting it could deadlock: its receiver may be
waiting for a message from this rank first. Waiting is safe once the receiver has
posted the matching receive: the transfer then needs nothing more from its
program. The schedule proves that when this rank has used a message the
receiver sent after posting it (each rank posts its list in order): the wait goes
right after the compute that used it. A send no later message proves (the last
gradients of the step) is waited for at the end of the step, as before.
"""

import bisect
import functools
import itertools
from collections import defaultdict

from gcompile.schedule import Action, Kind, Schedule, partner

USED_BY = {Kind.RECV_F: Kind.F, Kind.RECV_B: Kind.B}
"""The compute that reads what a receive brings (its stage and microbatch alike)."""


@functools.lru_cache(maxsize=8)  # every rank of a world lowers the same schedule
def send_releases(schedule: Schedule) -> tuple[dict[int, tuple[Action, ...]], ...]:
    """Per pipeline rank: the index of a compute action in its list -> the sends it may wait for right after
    that action (each send once, at the first such action after it)."""
    position = [{a: i for i, a in enumerate(actions)} for actions in schedule.actions]
    used = defaultdict(list)  # (sender, receiver) -> (index in the sender's list, receiver's index of the use)
    for receiver, actions in enumerate(schedule.actions):
        for a in actions:
            if a.kind in USED_BY:
                send = partner(a)
                sender = schedule.stage_rank(send.stage)
                used[(sender, receiver)].append((position[sender][send],
                                                 position[receiver][Action(a.stage, USED_BY[a.kind], a.mb)]))
    for pair in used.values():
        pair.sort()
    found = []
    for rank, actions in enumerate(schedule.actions):
        releases = defaultdict(list)
        for i, a in enumerate(actions):
            if a.kind not in (Kind.SEND_F, Kind.SEND_B):
                continue
            receive = partner(a)
            peer = schedule.stage_rank(receive.stage)
            later = used[(peer, rank)]
            posted = position[peer][receive]
            after = itertools.islice(later, bisect.bisect_right(later, (posted, float("inf"))), None)
            use = next((u for _, u in after if u > i), None)
            if use is not None:
                releases[use].append(a)
        found.append({use: tuple(sends) for use, sends in releases.items()})
    return tuple(found)
