"""Expert-parallel ops: what passes/expert_parallel.py calls from a graph.

The n ranks of an "ep" group split a layer's E experts: rank r holds experts
r*E/n .. (r+1)*E/n - 1. A rank's routed rows come sorted by expert with the
experts' end offsets, so the rows for each rank's experts are one contiguous run.

    dispatch(rows, ends, n)   the rows every rank of the group routed to this rank's experts, sorted by local
                              expert (then by sender), in a buffer of n * R rows (the most that can arrive),
                              zero after the last; their ends and each row's local expert for the grouped
                              matmuls; and the routing that `combine` undoes
    combine(out, routing)     each row back on the rank and at the place it came from

Counts are data: they travel in an all-to-all of fixed size (E numbers per rank), and the rows in an
all-to-all sized by them at run time (gcompile.collectives.all_to_all_rows), so every rank runs one graph
text with static shapes whatever the routing. Backward is the same exchange the other way round.
"""

import torch

from gcompile import collectives

GROUP = "ep"


def dispatch(rows: torch.Tensor, ends: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """rows (R, C) sorted by global expert, ends (E,) -> (local rows (n*R, C), local ends (E/n,) int32,
    local expert of each row (n*R,), then the routing: rows sent to and received from each rank (n,) and
    where each local row arrived (n*R,))."""
    ends = ends.long()
    per_expert = ends - torch.cat([ends.new_zeros(1), ends[:-1]])  # (E,)
    received = collectives.all_to_all(per_expert, GROUP, n).view(n, -1)  # [s, j]: from rank s for local expert j
    send, receive = per_expert.view(n, -1).sum(1), received.sum(1)
    room = n * rows.shape[0]
    arrived = collectives.all_to_all_rows(rows, send, receive, room, GROUP)  # by sender, then local expert
    order = _expert_major(received, room)
    local_ends = received.sum(0).cumsum(0)
    local_expert = torch.searchsorted(local_ends, torch.arange(room, device=rows.device), right=True)
    local_expert = local_expert.clamp(max=received.shape[1] - 1)  # the unused rows: the last expert's, all zero
    return arrived.index_select(0, order), local_ends.to(torch.int32), local_expert, send, receive, order


def combine(out: torch.Tensor, send: torch.Tensor, receive: torch.Tensor, order: torch.Tensor,
            rows: int) -> torch.Tensor:
    """The local experts' output rows (n*R, C), in `dispatch`'s order -> this rank's own R rows, back in the
    order it routed them."""
    by_sender = out.index_select(0, order.argsort())
    return collectives.all_to_all_rows(by_sender, receive, send, rows, GROUP)


def _expert_major(received: torch.Tensor, room: int) -> torch.Tensor:
    """For each local row in expert-major order (expert j, then sender s), the index of the row in arrival
    order (sender s, then expert j); the unused rows after the last keep their place."""
    n, local = received.shape
    arrival_start = received.reshape(-1).cumsum(0) - received.reshape(-1)  # block (s, j) at s * local + j
    by_expert = received.t().reshape(-1)  # block (j, s) at j * n + s
    ends = by_expert.cumsum(0)
    position = torch.arange(room, device=received.device)
    block = torch.searchsorted(ends, position, right=True).clamp(max=n * local - 1)
    sender, expert = block % n, block // n
    source = arrival_start.index_select(0, sender * local + expert) + position - (ends - by_expert).index_select(0, block)
    return torch.where(position < ends[-1], source, position)
