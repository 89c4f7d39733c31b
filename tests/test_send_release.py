"""Where a rank waits for its pipeline sends (gcompile.send_release, WAIT_SEND instructions): never before its
receiver has posted the receive, in any run of any schedule, and early enough that the sends in flight stay
bounded as the microbatches grow; and a batch answered with one Work (NCCL's) trains alike.

"Posted before" is checked with vector clocks, not with the code under test: every rank walks its
instruction list; its clock ticks at each instruction and takes in the sender's clock where a compute reads a
received buffer. A WAIT_SEND is safe when the rank's clock has already seen the receiver post the receive.
"""

from dataclasses import replace

import pytest

from gcompile import harness
from gcompile.axes import Coords
from gcompile.config import build_config
from gcompile.instructions import WAIT_SEND, Instruction, lower_instructions
from gcompile.pipeline import BuildCache
from gcompile.schedule import SCHEDULES, build_schedule
from tests.reference import random_batches

CASES = [(name, pp, vpp, m) for name in SCHEDULES for pp in (2, 3, 4)
         for vpp in ((2, 3) if name == "interleaved" else (1,)) for m in (pp, 2 * pp, 4 * pp)]
SENDS = ("SEND_F", "SEND_B")
RECEIVES = ("RECV_F", "RECV_B")


def instruction_lists(name: str, pp: int, vpp: int, m: int) -> list[tuple[Instruction, ...]]:
    schedule = build_schedule(name, pp, vpp, m)
    split = frozenset(range(pp * vpp)) if schedule.splits_backward else frozenset()
    return [lower_instructions(schedule, Coords.from_rank(r, {"pp": pp}), split) for r in range(pp)]


def unsafe_waits(lists: list[tuple[Instruction, ...]]) -> list[str]:
    """Each WAIT_SEND a rank reaches before its clock has seen its receiver post the matching receive."""
    posted_at = {(rank, i.writes[0]): n for rank, listed in enumerate(lists) for n, i in enumerate(listed)
                 if i.op in RECEIVES}
    clocks = [[0] * len(lists) for _ in lists]
    sent = {}  # (receiver, buffer) -> the sender's clock when it sent
    at, unsafe = [0] * len(lists), []
    while any(n < len(listed) for n, listed in zip(at, lists)):
        moved = False
        for rank, listed in enumerate(lists):
            while at[rank] < len(listed):
                i = listed[at[rank]]
                received = [(rank, b) for b in i.reads if i.is_compute and (rank, b) in posted_at]
                if any(r not in sent for r in received):
                    break  # its input is not sent yet
                for r in received:
                    clocks[rank] = [max(a, b) for a, b in zip(clocks[rank], sent[r])]
                clocks[rank][rank] = at[rank] + 1
                if i.op in SENDS:
                    sent[(i.peer, i.reads[0])] = list(clocks[rank])
                if i.op == WAIT_SEND and clocks[rank][i.peer] <= posted_at[(i.peer, i.reads[0])]:
                    unsafe.append(f"rank {rank} {at[rank]:02d} {i}")
                at[rank] += 1
                moved = True
        assert moved, f"the lists deadlock at {at}"
    return unsafe


def sends_in_flight(listed: tuple[Instruction, ...]) -> int:
    """Most sends a rank holds at once, not yet waited for."""
    held = peak = 0
    for i in listed:
        held += (i.op in SENDS) - (i.op == WAIT_SEND)
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("name, pp, vpp, m", CASES)
def test_every_send_is_waited_for_only_after_its_receive_is_posted(name, pp, vpp, m):
    lists = instruction_lists(name, pp, vpp, m)
    assert unsafe_waits(lists) == []
    for listed in lists:
        waited = [i.reads[0] for i in listed if i.op == WAIT_SEND]
        assert len(waited) == len(set(waited)) and set(waited) <= {i.reads[0] for i in listed if i.op in SENDS}


def test_waiting_right_after_sending_is_caught():
    """The check can fail: each send waited for at once, before the schedule proves anything."""
    lists = [tuple(x for i in listed if i.op != WAIT_SEND for x in ([i, replace(i, op=WAIT_SEND)] if i.op in SENDS
                                                                       else [i]))
             for listed in instruction_lists("1f1b", 2, 1, 4)]
    assert unsafe_waits(lists)


@pytest.mark.parametrize("name, pp, vpp", [("1f1b", 4, 1), ("zb1f1b", 4, 1), ("interleaved", 2, 2)])
def test_sends_in_flight_do_not_grow_with_the_microbatches(name, pp, vpp):
    """1f1b's rank r holds at most pp - r sends, whatever the microbatch count; gpipe, which sends every
    activation before any gradient comes back, holds all of them."""
    few, many = (instruction_lists(name, pp, vpp, m) for m in (2 * pp, 16 * pp))
    assert [sends_in_flight(listed) for listed in few] == [sends_in_flight(listed) for listed in many]
    if name != "interleaved":
        assert [sends_in_flight(listed) for listed in many] == [pp - r for r in range(pp)]
    assert sends_in_flight(instruction_lists("gpipe", 2, 1, 16)[0]) == 16


def test_interleaving_holds_no_more_sends_for_more_stages_per_rank():
    """Interleaved 1F1B's messages go round the ring of ranks, so the proof that a receive is posted may come
    back through a third rank: with it, 4 stages per rank hold no more sends than 2 (the peer's own messages
    alone would prove it later: 19 sends on the first of 4 ranks against 11)."""
    two, four = (instruction_lists("interleaved", 4, vpp, 32) for vpp in (2, 4))
    assert [sends_in_flight(listed) for listed in four] == [sends_in_flight(listed) for listed in two]


class _Batch:
    """NCCL's answer to a batch: one Work for all of it, done once every op of it is."""

    def __init__(self, works: list):
        self.works, self.done = works, False

    def wait(self) -> bool:
        if not self.done:
            for work in self.works:
                work.wait()
            self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done


@pytest.mark.parametrize("layers, parallel", [
    (2, dict(pp=2)), (4, dict(pp=4)), (2, dict(pp=2, pipeline_schedule="zb1f1b")),
    (4, dict(pp=2, pipeline_schedule="interleaved", virtual_pipeline_size=2))])
def test_a_batch_with_one_work_trains_alike(layers, parallel, monkeypatch):
    """Where a batch of sends and receives comes back as one Work (NCCL), each receive of it waits for that
    Work before its tensor is read (a receive left unwaited reads an empty buffer), and the steps are
    bitwise those of a Work per op."""
    cfg = build_config({"model": dict(n_layer=layers, n_head=4, n_embd=32, block_size=16), "parallel": parallel,
                        "train": dict(micro_batch_size=1, global_batch_size=8, seq_length=16)})
    tokens, lrs = random_batches(cfg, 2), [1e-3, 1e-3]
    cache = BuildCache()
    (per_op,) = harness.run_layouts([cfg], tokens, lrs, cache=cache)
    batch = harness._Endpoint.batch_isend_irecv
    monkeypatch.setattr(harness._Endpoint, "batch_isend_irecv", lambda self, ops: [_Batch(batch(self, ops))])
    (one,) = harness.run_layouts([cfg], tokens, lrs, cache=cache)
    assert one.losses == per_op.losses and one.grad_norms == per_op.grad_norms
