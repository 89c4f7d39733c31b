"""Pipeline schedules: golden orders, Megatron's warmup counts, the simulator's checks, timing and drawing.

Expected orders are written out by hand from Megatron's loops
(forward_backward_pipelining_without_interleaving / _with_interleaving) and, for
ZB-H1, from the zero-bubble paper's figure as PaddlePaddle's ZBH1 job list spells
it (rank r: pp-r forwards, then r times B F, then B W F pairs, the remaining B W,
and the r held-back W's last);
warmup counts, bubbles and in-flight peaks come from their formulas,
computed here, never from the code under test.
"""

import functools
import xml.etree.ElementTree as ET

import pytest

from gcompile.schedule import (COMPUTE, SCHEDULES, Action, Kind, Schedule, ScheduleError, build_schedule, gpipe,
                               in_flight_bound, interleaved_1f1b, one_f_one_b, parse_action, simulate,
                               warmup_forwards, zero_bubble_h1)
from gcompile.schedule_render import render_svg


def compute_order(schedule: Schedule) -> list[str]:
    return [" ".join(str(a) for a in actions if a.kind in COMPUTE) for actions in schedule.actions]


def from_strings(name: str, pp: int, vpp: int, m: int, rows: list[str]) -> Schedule:
    return Schedule(name, pp, vpp, m, tuple(tuple(parse_action(t) for t in row.split()) for row in rows))


def edited(schedule: Schedule, rank: int, edit) -> Schedule:
    """The schedule with one rank's action strings passed through `edit`."""
    rows = [" ".join(str(a) for a in actions) for actions in schedule.actions]
    rows[rank] = " ".join(edit(rows[rank].split()))
    return from_strings(schedule.name, schedule.pp, schedule.vpp, schedule.num_microbatches, rows)


built = functools.cache(build_schedule)
"""build_schedule (which simulates) once per config for the whole module."""


def valid_configs():
    for pp in range(1, 9):
        for vpp in (1, 2, 3):
            for m in (1, 2, 4, 8, 12):
                for name in SCHEDULES:
                    if (vpp == 1) == (name != "interleaved") and (name != "interleaved" or m % pp == 0):
                        yield name, pp, vpp, m


# --- golden orders ---------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule, expected", [
    # 1F1B: rank r runs min(pp-r-1, m) forwards, then F/B pairs, then the remaining backwards.
    (one_f_one_b(2, 4), ["0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3",
                         "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3"]),
    (one_f_one_b(4, 8), ["0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7",
                         "1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1F6 1B4 1F7 1B5 1B6 1B7",
                         "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2F6 2B5 2F7 2B6 2B7",
                         "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7"]),
    # fewer microbatches than ranks: warmup capped at m
    (one_f_one_b(4, 2), ["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1", "2F0 2F1 2B0 2B1", "3F0 3B0 3F1 3B1"]),
    (gpipe(2, 3), ["0F0 0F1 0F2 0B0 0B1 0B2", "1F0 1F1 1F2 1B0 1B1 1B2"]),
    # Interleaved pp=2 vpp=2: virtual microbatch k -> chunk (k % 4) // 2, mb (k // 4) * 2 + k % 2;
    # rank 0 (stages 0, 2) warms up 2*1 + 1*2 = 4, rank 1 (stages 1, 3) 0 + 2 = 2;
    # the k-th backward runs on chunk 1 - chunk(k).
    (interleaved_1f1b(2, 2, 4), ["0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
                                 "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"]),
    # rank 0: warmup 4 = all of m*vpp, so every forward precedes every backward
    (interleaved_1f1b(2, 2, 2), ["0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1",
                                 "1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1"]),
    # one rank: all chunks local, warmup vpp-1
    (interleaved_1f1b(1, 3, 2), ["0F0 1F0 2F0 2B0 0F1 1B0 1F1 0B0 2F1 2B1 1B1 0B1"]),
    # ZB-H1: 1F1B's F and B order; rank r holds its first r W's back to the end
    (zero_bubble_h1(2, 4), ["0F0 0F1 0B0 0W0 0F2 0B1 0W1 0F3 0B2 0W2 0B3 0W3",
                            "1F0 1B0 1F1 1B1 1W1 1F2 1B2 1W2 1F3 1B3 1W3 1W0"]),
    (zero_bubble_h1(4, 8), ["0F0 0F1 0F2 0F3 0B0 0W0 0F4 0B1 0W1 0F5 0B2 0W2 0F6 0B3 0W3 0F7 0B4 0W4 0B5 0W5 "
                            "0B6 0W6 0B7 0W7",
                            "1F0 1F1 1F2 1B0 1F3 1B1 1W1 1F4 1B2 1W2 1F5 1B3 1W3 1F6 1B4 1W4 1F7 1B5 1W5 1B6 1W6 "
                            "1B7 1W7 1W0",
                            "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2W2 2F4 2B3 2W3 2F5 2B4 2W4 2F6 2B5 2W5 2F7 2B6 2W6 2B7 2W7 "
                            "2W0 2W1",
                            "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3W3 3F4 3B4 3W4 3F5 3B5 3W5 3F6 3B6 3W6 3F7 3B7 3W7 "
                            "3W0 3W1 3W2"]),
    # fewer microbatches than ranks: at most m held back
    (zero_bubble_h1(4, 2), ["0F0 0F1 0B0 0W0 0B1 0W1", "1F0 1F1 1B0 1B1 1W1 1W0", "2F0 2F1 2B0 2B1 2W0 2W1",
                            "3F0 3B0 3F1 3B1 3W0 3W1"]),
])
def test_golden_compute_order(schedule, expected):
    assert compute_order(schedule) == expected


def test_golden_communication_placement():
    schedule = build_schedule("1f1b", 2, 1, 2)
    # each receive is posted one compute before the compute that uses it; sends follow their compute
    assert [" ".join(map(str, actions)) for actions in schedule.actions] == [
        "0F0 0SEND_F0 0RECV_B0 0F1 0SEND_F1 0RECV_B1 0B0 0B1",
        "1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1",
    ]
    interleaved = build_schedule("interleaved", 2, 2, 2)
    assert " ".join(map(str, interleaved.actions[1][:8])) == \
        "1RECV_F0 1RECV_F1 1F0 1SEND_F0 3RECV_F0 1F1 1SEND_F1 3F0"  # 3F0 is the loss stage: no send after it
    assert all(len(actions) == 12 for actions in build_schedule("interleaved", 1, 3, 2).actions), \
        "one rank: no communication at all"


def test_table_and_placement():
    schedule = build_schedule("1f1b", 2, 1, 4)
    assert str(schedule).splitlines()[1:] == ["rank0 | 0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3",
                                              "rank1 | 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3"]
    interleaved = build_schedule("interleaved", 4, 2, 8)
    assert [interleaved.stage_rank(s) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert interleaved.local_stages(1) == [1, 5]


# --- Megatron's warmup -----------------------------------------------------------------------------

def leading_forwards(actions) -> int:
    compute = [a for a in actions if a.kind in (Kind.F, Kind.B)]
    return next(i for i, a in enumerate(compute) if a.kind == Kind.B)


@pytest.mark.parametrize("pp, m, rank", [(4, 8, 0), (4, 8, 1), (4, 8, 3), (4, 2, 0), (4, 2, 2), (8, 3, 1),
                                         (8, 12, 0), (2, 1, 0), (1, 4, 0)])
def test_one_f_one_b_warmup(pp, m, rank):
    warmup = min(pp - rank - 1, m)
    schedule = build_schedule("1f1b", pp, 1, m)
    assert warmup_forwards("1f1b", pp, 1, m, rank) == warmup
    # one more forward opens the steady state before the first backward, unless warmup took them all
    assert leading_forwards(schedule.actions[rank]) == min(warmup + 1, m)


@pytest.mark.parametrize("pp, vpp, m, rank", [(4, 2, 8, 0), (4, 2, 8, 3), (4, 3, 4, 0), (4, 3, 4, 2),
                                              (2, 2, 2, 1), (2, 2, 2, 0), (8, 2, 16, 0), (8, 2, 16, 7),
                                              (3, 3, 12, 1), (1, 3, 4, 0)])
def test_interleaved_warmup(pp, vpp, m, rank):
    warmup = min((pp - rank - 1) * 2 + (vpp - 1) * pp, m * vpp)
    schedule = build_schedule("interleaved", pp, vpp, m)
    assert warmup_forwards("interleaved", pp, vpp, m, rank) == warmup
    assert leading_forwards(schedule.actions[rank]) == min(warmup + 1, m * vpp)
    # Megatron's chunk of the k-th forward, reversed for the k-th backward
    compute = [a for a in schedule.actions[rank] if a.kind in (Kind.F, Kind.B)]
    forwards = [a.stage // pp for a in compute if a.kind == Kind.F]
    backwards = [a.stage // pp for a in compute if a.kind == Kind.B]
    assert forwards == [(k % (pp * vpp)) // pp for k in range(m * vpp)]
    assert backwards == [vpp - 1 - (k % (pp * vpp)) // pp for k in range(m * vpp)]


# --- every schedule runs -----------------------------------------------------------------------------

def test_every_schedule_passes_the_simulator():
    count = 0
    for name, pp, vpp, m in valid_configs():
        schedule = built(name, pp, vpp, m)  # simulates
        result = simulate(schedule)
        assert len(result.busy) == pp and result.makespan > 0
        for actions in schedule.actions:
            for a in actions:
                assert parse_action(str(a)) == a
        count += 1
    assert count == 8 * 5 * 3 + sum(1 for pp in range(1, 9) for m in (1, 2, 4, 8, 12) if m % pp == 0) * 2


@pytest.mark.parametrize("text, action", [("2F0", Action(2, Kind.F, 0)), ("1B13", Action(1, Kind.B, 13)),
                                          ("3W2", Action(3, Kind.W, 2)),
                                          ("0SEND_F1", Action(0, Kind.SEND_F, 1)),
                                          ("12RECV_B3", Action(12, Kind.RECV_B, 3))])
def test_action_string_round_trip(text, action):
    assert str(action) == text and parse_action(text) == action


@pytest.mark.parametrize("text", ["F0", "0X1", "0F", "0 F 1", "0SEND1"])
def test_parse_rejects(text):
    with pytest.raises(ScheduleError, match="cannot parse action"):
        parse_action(text)


@pytest.mark.parametrize("args, message", [
    (("interleaved", 4, 2, 6), r"interleaved schedule needs num_microbatches \(6\) divisible by pp \(4\)"),
    (("interleaved", 4, 2, 2), r"num_microbatches \(2\) divisible by pp \(4\)"),
    (("interleaved", 2, 1, 4), r"interleaved schedule needs vpp >= 2, got vpp=1; use '1f1b'"),
    (("gpipe", 2, 2, 4), r"gpipe schedule runs one stage per rank \(vpp=1\), got vpp=2"),
    (("1f1b", 2, 3, 4), r"1f1b schedule runs one stage per rank \(vpp=1\), got vpp=3"),
    (("1f1b", 2, 1, 0), r"num_microbatches >= 1, got 0"),
    (("zb1f1b", 2, 2, 4), r"zb1f1b schedule runs one stage per rank \(vpp=1\), got vpp=2"),
    (("zb", 2, 1, 4), r"unknown schedule 'zb'"),
])
def test_invalid_sizes(args, message):
    with pytest.raises(ScheduleError, match=message):
        build_schedule(*args)


# --- seeded faults ---------------------------------------------------------------------------------

def test_deleted_receive():
    schedule = edited(build_schedule("1f1b", 2, 1, 4), 1, lambda row: [t for t in row if t != "1RECV_F2"])
    with pytest.raises(ScheduleError, match=r"rank 1: 1F2 needs the activation of stage 0 from rank 0, "
                                            r"but rank 1 never receives it \(no 1RECV_F2 to match 0SEND_F2\)"):
        simulate(schedule)


def test_deleted_send():
    schedule = edited(build_schedule("1f1b", 2, 1, 4), 0, lambda row: [t for t in row if t != "0SEND_F2"])
    with pytest.raises(ScheduleError, match="rank 1: 1RECV_F2 waits for 0SEND_F2, which rank 0 never sends"):
        simulate(schedule)


def test_backward_before_its_forward():
    def swap(row):
        i, j = row.index("0F3"), row.index("0B3")
        row[i], row[j] = row[j], row[i]
        return row

    schedule = edited(build_schedule("1f1b", 2, 1, 4), 0, swap)
    with pytest.raises(ScheduleError, match=r"rank 0: 0B3 \(instruction \d+\) runs before 0F3, "
                                            r"which provides its own forward"):
        simulate(schedule)


def test_send_before_compute():
    schedule = from_strings("1f1b", 2, 1, 1, ["0SEND_F0 0F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"])
    with pytest.raises(ScheduleError, match="rank 0: 0SEND_F0 .* runs before 0F0, which provides the activation"):
        simulate(schedule)


def test_deadlock_each_rank_waits_for_the_other():
    # rank 0 sends microbatch 0's activation only after its backward, which needs rank 1's gradient
    schedule = from_strings("1f1b", 2, 1, 1, ["0F0 0RECV_B0 0B0 0SEND_F0", "1RECV_F0 1F0 1B0 1SEND_B0"])
    with pytest.raises(ScheduleError) as error:
        simulate(schedule)
    message = str(error.value)
    assert "deadlock after 2 steps" in message
    assert "rank 0 waits at 0B0 (instruction 2) for 1SEND_B0 from rank 1, which is at 1F0 (instruction 1)" in message
    assert "rank 1 waits at 1F0 (instruction 1) for 0SEND_F0 from rank 0, which is at 0B0 (instruction 2)" in message
    assert message.splitlines()[-1].split() == ["stuck", "|", "0B0", "|", "1F0", "<--", "ERROR", "HERE"]


def test_deadlock_after_progress_prints_the_grid():
    # rank 0 waits for microbatch 0's gradient before sending microbatch 1's activation, which rank 1 needs first
    schedule = from_strings("gpipe", 2, 1, 2, ["0F0 0SEND_F0 0RECV_B0 0B0 0F1 0SEND_F1 0RECV_B1 0B1",
                                               "1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1"])
    with pytest.raises(ScheduleError) as error:
        simulate(schedule)
    grid = str(error.value).splitlines()[3:]
    # posting a receive never blocks; 1F0 waits one step for 0SEND_F0, which runs in the same step as its check
    assert [line.split() for line in grid] == [
        ["step", "|", "rank0", "|", "rank1"],
        ["0", "|", "0F0", "|", "1RECV_F0"],
        ["1", "|", "0SEND_F0", "|"],
        ["2", "|", "0RECV_B0", "|", "1F0"],
        ["3", "|", "|", "1RECV_F1"],
        ["stuck", "|", "0B0", "|", "1F1", "<--", "ERROR", "HERE"],
    ]


def test_messages_out_of_channel_order():
    # both microbatches' activations are received, but in the other order than rank 0 sent them
    schedule = from_strings("gpipe", 2, 1, 2, ["0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
                                               "1RECV_F1 1RECV_F0 1F0 1F1 1B0 1SEND_B0 1B1 1SEND_B1"])
    with pytest.raises(ScheduleError, match="rank 1: 1RECV_F1 is its receive number 0 from rank 0, but rank 0's "
                                            "send number 0 to it is 0SEND_F0"):
        simulate(schedule)


def test_duplicate_and_missing_compute():
    base = build_schedule("1f1b", 2, 1, 4)
    with pytest.raises(ScheduleError, match="rank 0: 0F1 appears more than once"):
        simulate(edited(base, 0, lambda row: row + ["0F1"]))
    with pytest.raises(ScheduleError, match="rank 1: 1B3 is missing: stage 1 never runs the backward of microbatch 3"):
        simulate(edited(base, 1, lambda row: [t for t in row if t != "1B3"]))


def test_weight_backward_faults():
    base = build_schedule("zb1f1b", 2, 1, 4)
    with pytest.raises(ScheduleError, match="rank 1: 1W2 is missing: stage 1 never runs the parameter-gradient "
                                            "backward of microbatch 2"):
        simulate(edited(base, 1, lambda row: [t for t in row if t != "1W2"]))
    with pytest.raises(ScheduleError, match="rank 1: 1W0 .instruction 3. runs before 1B0, which provides the "
                                            "gradients it continues from"):
        simulate(edited(base, 1, lambda row: row[:3] + ["1W0"] + [t for t in row[3:] if t != "1W0"]))
    with pytest.raises(ScheduleError, match="rank 0: 0W0 is a W, but the 1f1b schedule runs each backward whole"):
        simulate(edited(build_schedule("1f1b", 2, 1, 4), 0, lambda row: row + ["0W0"]))


def test_action_on_the_wrong_rank():
    with pytest.raises(ScheduleError, match="rank 0: 1F0 belongs to stage 1, which lives on rank 1"):
        simulate(from_strings("1f1b", 2, 1, 1, ["1F0 0F0 0B0", "1B0"]))


def test_in_flight_over_the_bound():
    # GPipe's order under the 1f1b name: a single-rank 1F1B keeps one microbatch in flight
    with pytest.raises(ScheduleError, match="rank 0: 0F1 makes 2 microbatches in flight on stage 0, "
                                            "more than the 1f1b schedule's bound of 1"):
        simulate(from_strings("1f1b", 1, 1, 2, ["0F0 0F1 0B0 0B1"]))


# --- timing ----------------------------------------------------------------------------------------

def test_golden_timeline():
    result = simulate(build_schedule("1f1b", 2, 1, 2), f_time=1, b_time=2)
    assert [[(str(s.action), s.start, s.end) for s in spans] for spans in result.spans] == [
        [("0F0", 0, 1), ("0F1", 1, 2), ("0B0", 4, 6), ("0B1", 7, 9)],
        [("1F0", 1, 2), ("1B0", 2, 4), ("1F1", 4, 5), ("1B1", 5, 7)],
    ]
    assert result.makespan == 9 and result.busy == (6, 6)
    # hand-traced: 1F0 waits a step for 0SEND_F0, 0B1 two steps for 1SEND_B1; posting receives never waits
    assert result.steps == 10


def test_per_stage_costs():
    # 1F1B pp=2 m=2 with stage 1 twice as slow (F 2, B 4): hand-traced
    result = simulate(build_schedule("1f1b", 2, 1, 2), f_time=[1, 2], b_time=[2, 4])
    assert [[(str(s.action), s.start, s.end) for s in spans] for spans in result.spans] == [
        [("0F0", 0, 1), ("0F1", 1, 2), ("0B0", 7, 9), ("0B1", 13, 15)],
        [("1F0", 1, 3), ("1B0", 3, 7), ("1F1", 7, 9), ("1B1", 9, 13)],
    ]
    assert result.bubble_fraction == pytest.approx(1 - (6 + 12) / (2 * 15))
    with pytest.raises(ScheduleError, match="per-stage costs need 2 entries, got forward 3, backward 2"):
        simulate(build_schedule("1f1b", 2, 1, 2), f_time=[1, 1, 1], b_time=[2, 2])


@pytest.mark.parametrize("f_time, b_time", [(1, 2), (1, 1), (1, 3)])
def test_bubble_matches_the_formulas(f_time, b_time):
    for name, pp, vpp, m in valid_configs():
        if name == "zb1f1b":
            continue
        result = simulate(built(name, pp, vpp, m), f_time, b_time)
        # GPipe and 1F1B: (pp-1) idle slots of (m + pp - 1). Interleaved: Megatron's bubble over ideal time
        # (pp-1)/(vpp*m), as a share of the whole run (pp-1)/(vpp*m + pp-1); vpp=1 is the same formula.
        assert result.bubble_fraction == pytest.approx((pp - 1) / (vpp * m + pp - 1)), (name, pp, vpp, m)
        assert result.makespan == pytest.approx((vpp * m + pp - 1) * (f_time + b_time))


@pytest.mark.parametrize("f_time, b_time, w_time", [(1, 2, 1), (1, 3, 1), (2, 3, 1), (1, 1, 0)])
def test_zero_bubble_h1_bubble(f_time, b_time, w_time):
    """The paper's ZB-H1 bubble, (pp-1)(F + B - W) with B the input-gradient part, where m >= pp and
    W is no longer than F or B; W = 0 is 1F1B's (pp-1)(F + B)."""
    for pp in range(1, 9):
        for m in (pp, pp + 1, 2 * pp, 12):
            result = simulate(built("zb1f1b", pp, 1, m), f_time, b_time, w_time)
            b_input = b_time - w_time
            assert result.makespan == pytest.approx(m * (f_time + b_time) + (pp - 1) * (f_time + b_input - w_time))
    assert simulate(built("zb1f1b", 2, 1, 4)).bubble_fraction < simulate(built("1f1b", 2, 1, 4)).bubble_fraction


def test_peak_in_flight_reaches_the_bound():
    for name, pp, vpp, m in valid_configs():
        schedule = built(name, pp, vpp, m)
        result = simulate(schedule)
        if name == "gpipe":
            expected = [m] * pp
        elif name in ("1f1b", "zb1f1b"):
            expected = [min(pp - rank, m) for rank in range(pp)]
        else:
            expected = [min((pp - rank - 1) * 2 + (vpp - 1) * pp + 1, m * vpp) for rank in range(pp)]
        assert list(result.rank_peak_in_flight) == expected, (name, pp, vpp, m)
        if vpp == 1:
            assert list(result.peak_in_flight) == expected
            assert [in_flight_bound(schedule, s) for s in range(pp)] == expected
        else:
            assert list(result.peak_in_flight) == [in_flight_bound(schedule, s) for s in range(pp * vpp)]


def test_interleaved_stage_peaks():
    # From the golden order: rank 0 runs 0F0..0F3 before 0B0, and stage 2 holds 2F0 2F1 (later 2F2 2F3);
    # rank 1 runs 1F0 1F1 1F2 before 1B0, and the loss stage 3 runs each F right before its B.
    # The stages peak at different times: rank 0 holds 5 at most (warmup 4 + 1), not 4 + 2.
    result = simulate(build_schedule("interleaved", 2, 2, 4))
    assert result.peak_in_flight == (4, 3, 2, 1)
    assert result.rank_peak_in_flight == (5, 3)


# --- drawing ---------------------------------------------------------------------------------------

def test_render_svg(tmp_path):
    schedule = build_schedule("interleaved", 2, 2, 4)
    path = tmp_path / "schedule.svg"
    render_svg(schedule, str(path))
    root = ET.parse(path).getroot()
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert "rank 0" in texts and "rank 1" in texts
    labels = {str(a) for actions in schedule.actions for a in actions if a.kind in (Kind.F, Kind.B)}
    assert labels <= set(texts)
    assert any("bubble 11.1%" in t for t in texts)  # (pp-1)/(vpp*m + pp-1) = 1/9
    zero_bubble = build_schedule("zb1f1b", 2, 1, 4)
    render_svg(zero_bubble, str(path))
    texts = [t.text for t in ET.parse(path).getroot().iter("{http://www.w3.org/2000/svg}text")]
    assert {str(a) for actions in zero_bubble.actions for a in actions if a.kind == Kind.W} <= set(texts)
    assert any("bubble 7.7%" in t for t in texts)  # makespan 4*3 + (2-1)(1+1-1) = 13, busy 12 per rank
