"""The cost model on hand-built graphs and timelines with known costs (exact answers), the machine file,
and the planner: refusal reasons, and every layout it proposes passes the plan checker."""

import dataclasses
import json
import os
from collections import Counter
import subprocess
import sys

import pytest
import torch
import torch.fx as fx

import run_gpt
from gcompile import machine as machine_file, plan, plan_cache
from gcompile.axes import Coords
from gcompile.calibrate import SIZES, _link, busy_warning
from gcompile.check import check_plan
from gcompile.config import build_config, parse_args
from gcompile.cost_model import Rates, StepTime, _concurrency, format_rank_time, graph_time, predict, rates_for
from gcompile.machine import Link, Machine, MachineError, rate_at
from gcompile.pipeline import BuildCache, builtin_passes, build_rank_program
from gcompile.plan import Search, configure, evaluate, format_search, layouts, search
from gcompile.plan_cache import PlanCache, code_version, layout_key
from gcompile.schedule import Action, Kind, Span, build_schedule, simulate
from gcompile.world import build_world
from tests.multirank import ROOT

c10d = torch.ops._c10d_functional
aten = torch.ops.aten

MATMUL, BANDWIDTH, INPLACE, OP, LATENCY, LINK_BANDWIDTH = 1e9, 2e9, 8e9, 1e-6, 1e-3, 1e8


def flat_machine(cores: int = 64) -> Machine:
    """Every rate one number, so each cost below is a formula."""
    link = Link(LATENCY, LINK_BANDWIDTH)
    kinds = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "send_recv")
    return Machine(fingerprint="test", description="flat rates", cores=cores,
                   matmul={"1": {"float32": [[1.0, MATMUL]]}}, attention={"1": [[1.0, MATMUL]]},
                   bandwidth={"1": BANDWIDTH}, inplace_bandwidth={"1": INPLACE}, op_seconds=OP,
                   collectives={"gloo": {kind: {"2": link} for kind in kinds}}, contention={"1": 1.0, "2": 1.0},
                   host_contention={"1": 1.0, "2": 1.0})


def hand_graph() -> fx.GraphModule:
    """y = x @ w; start all_reduce(y) over tp; z = x + x (while it runs); wait; out (y', z)."""
    x, w = torch.randn(64, 32), torch.randn(32, 16)
    g = fx.Graph()
    nx, nw = g.placeholder("x"), g.placeholder("w")
    nx.meta["val"], nw.meta["val"] = x, w
    y = g.call_function(aten.mm.default, (nx, nw))
    y.meta["val"] = x @ w
    start = g.call_function(c10d.all_reduce.default, (y, "sum", "tp"))
    start.meta["val"] = x @ w
    z = g.call_function(aten.add.Tensor, (nx, nx))
    z.meta["val"] = x + x
    done = g.call_function(c10d.wait_tensor.default, (start,))
    done.meta["val"] = x @ w
    g.output((done, z))
    return fx.GraphModule(torch.nn.Module(), g)


def test_graph_time_overlaps_a_collective_with_the_compute_before_its_wait():
    rates = Rates(flat_machine(), threads=1, slowdown=1.0, host_slowdown=1.0, transports={}, default_transport="gloo")
    got = graph_time(hand_graph(), rates, {"tp": 2})
    mm = OP + 2 * 64 * 32 * 16 / MATMUL
    add = OP + 2 * 64 * 32 * 4 / BANDWIDTH  # reads x (one tensor, counted once), writes z
    reduce = LATENCY + 64 * 16 * 4 / LINK_BANDWIDTH
    assert got.compute == pytest.approx(mm + add, rel=1e-12)
    assert got.communication == pytest.approx(reduce, rel=1e-12)
    assert got.seconds == pytest.approx(mm + max(add, reduce), rel=1e-12)  # the add runs under the all-reduce
    alone = graph_time(hand_graph(), rates, {"tp": 1})  # a group of one rank: no collective
    assert alone.seconds == pytest.approx(mm + add, rel=1e-12)
    waiting = dataclasses.replace(flat_machine(), waits={"gloo": {"2": {"2": 7e-3}}})
    slow = graph_time(hand_graph(), Rates(waiting, 1, 1.0, 1.0, {}, "gloo", ranks=2), {"tp": 2})
    assert slow.seconds == pytest.approx(mm + reduce + 7e-3, rel=1e-12)  # on shared cores: the wait too
    shared = graph_time(hand_graph(), Rates(flat_machine(), 1, 3.0, 5.0, {}, "gloo"), {"tp": 1})
    assert shared.seconds == pytest.approx(5 * 2 * OP + 3 * (mm + add - 2 * OP), rel=1e-12)  # sharing cores:
    # arithmetic 3x slower, operator calls 5x


def test_an_op_that_writes_its_input_costs_its_bytes_at_the_in_place_rate():
    """acc.add_(g) (an optimizer's or an accumulator's op) allocates nothing: bytes at the in-place rate."""
    acc, grad = torch.randn(256), torch.randn(256)
    g = fx.Graph()
    nacc, ngrad = g.placeholder("acc"), g.placeholder("grad")
    nacc.meta["val"], ngrad.meta["val"] = acc, grad
    added = g.call_function(aten.add_.Tensor, (nacc, ngrad))
    added.meta["val"] = acc + grad
    g.output((added,))
    rates = Rates(flat_machine(), threads=1, slowdown=1.0, host_slowdown=1.0, transports={}, default_transport="gloo")
    got = graph_time(fx.GraphModule(torch.nn.Module(), g), rates, {})
    assert got.seconds == pytest.approx(OP + 3 * 256 * 4 / INPLACE, rel=1e-12)  # writes acc, reads acc and grad


@pytest.mark.parametrize("causal", [True, False])
def test_attention_without_the_causal_mask_costs_twice_its_counted_flops(causal):
    """The attention rate is measured on causal attention, counted as torch counts it (the masked half too): an
    attention that computes every score (the ring's off-diagonal blocks, an explicit mask) takes twice as long."""
    q = torch.randn(1, 2, 64, 16)
    g = fx.Graph()
    inputs = [g.placeholder(name) for name in "qkv"]
    for node in inputs:
        node.meta["val"] = q
    attend = g.call_function(aten._scaled_dot_product_flash_attention_for_cpu.default, (*inputs, 0.0, causal))
    attend.meta["val"] = aten._scaled_dot_product_flash_attention_for_cpu.default(q, q, q, 0.0, causal)
    g.output((attend,))
    rates = Rates(flat_machine(), threads=1, slowdown=1.0, host_slowdown=1.0, transports={}, default_transport="gloo")
    got = graph_time(fx.GraphModule(torch.nn.Module(), g), rates, {})
    flops = 4 * 2 * 64 * 64 * 16  # QK^T and PV, 2 FLOPs a multiply-add, counted whole
    assert got.seconds == pytest.approx(OP + (1 if causal else 2) * flops / MATMUL, rel=1e-12)


def test_simulated_messages_take_their_time():
    """1f1b, pp 2, 2 microbatches, F 1 and B 2 everywhere, every message 0.5: hand-traced."""
    schedule = build_schedule("1f1b", 2, 1, 2)
    result = simulate(schedule, 1.0, 2.0, send_time=lambda a: 0.5)
    assert [[(str(s.action), s.start, s.end) for s in spans] for spans in result.spans] == [
        [("0F0", 0, 1), ("0F1", 1, 2), ("0B0", 5, 7), ("0B1", 8, 10)],  # 1B0's gradient: sent 4.5, there 5
        [("1F0", 1.5, 2.5), ("1B0", 2.5, 4.5), ("1F1", 4.5, 5.5), ("1B1", 5.5, 7.5)],
    ]
    assert result.makespan == 10


def test_a_link_prices_small_messages_by_the_smallest_call():
    """Calls that lie on latency + bytes / bandwidth give back exactly those; noise in the largest call moves the
    bandwidth, not the latency small messages pay."""
    exact = _link([LATENCY + n / LINK_BANDWIDTH for n in SIZES])
    assert exact["latency"] == pytest.approx(LATENCY, rel=1e-9)
    assert exact["bandwidth"] == pytest.approx(LINK_BANDWIDTH, rel=1e-9)
    noisy = _link([LATENCY + n / LINK_BANDWIDTH for n in SIZES[:-1]] + [2 * (LATENCY + SIZES[-1] / LINK_BANDWIDTH)])
    assert noisy["latency"] + SIZES[0] / noisy["bandwidth"] == pytest.approx(LATENCY + SIZES[0] / LINK_BANDWIDTH)


def test_machine_file_rates_and_links():
    assert rate_at([[1e3, 10.0], [1e5, 30.0]], 1e4) == pytest.approx(20.0)  # halfway in log(FLOPs)
    assert rate_at([[1e3, 10.0], [1e5, 30.0]], 1.0) == 10.0
    assert rate_at([[1e3, 10.0], [1e5, 30.0]], 1e9) == 30.0
    m = flat_machine()
    four = m.link("gloo", "all_reduce", 4)  # from the 2-rank measurement, scaled as a ring
    assert four.latency == pytest.approx(3 * LATENCY)
    assert four.bandwidth == pytest.approx(LINK_BANDWIDTH / 1.5)
    assert m.link("shm", "all_reduce", 2) == m.link("gloo", "all_reduce", 2)  # unmeasured transport: gloo's
    shared = dataclasses.replace(m, contention={"1": 1.0, "2": 1.5})
    assert (shared.slowdown(1.5), shared.slowdown(2), shared.slowdown(4)) == (1.25, 1.5, 3.0)  # beyond: in proportion
    waits = dataclasses.replace(m, waits={"gloo": {"2": {"2": 1.0, "send_recv": 0.5},
                                                    "4": {"2": 2.0, "4": 6.0, "send_recv": 1.5}}})
    assert waits.wait_seconds("gloo", 1, 2) == 0.0  # no core shared
    assert waits.wait_seconds("gloo", 4, 3) == 4.0  # a group between the pairs and all four: linear
    assert waits.wait_seconds("gloo", 3, 2) == 1.5  # between measured worlds: linear
    assert waits.wait_seconds("gloo", 8, "send_recv") == 3.0  # beyond: in proportion
    assert waits.wait_seconds("shm", 2, 2) == 0.0  # its ranks poll: nothing measured, no wait
    assert Machine.from_json(waits.to_json(), "here") == waits
    again = Machine.from_json(m.to_json(), "here")
    assert again == m
    with pytest.raises(MachineError, match="not one gcompile.calibrate wrote"):
        Machine.from_json(json.dumps({"format": 5, "fingerprint": "x", "cores": 2}), "bad.json")
    with pytest.raises(MachineError, match="has format 4, this gcompile reads 5; measure the machine it describes "
                                           "again: python -m gcompile.calibrate --out old.json"):
        Machine.from_json('{"format": 4, "fingerprint": "x"}', "old.json")  # what every format held


@pytest.mark.parametrize("change, named", [
    ({"op_seconds": -1}, "op_seconds is -1, not a non-negative finite number"),
    ({"bandwidth": {"1": 0}}, "bandwidth.1 is 0, not a positive finite number"),
    ({"matmul": {"1": {"float32": [[1.0, float("nan")]]}}}, "matmul.1.float32[0][1] is nan, not a positive"),
    ({"matmul": {"1": {"float32": []}}}, "matmul.1.float32 is not a list of [FLOPs, FLOP/s] points"),
    ({"matmul": {"1": {"bfloat16": [[1.0, 1e9]]}}}, "matmul.1 has no float32 curve"),  # a KeyError traceback
    ({"contention": {}}, "contention is {}, not a non-empty object"),
    ({"contention": {"two": 1.0}}, 'contention has the key "two", which is not a count of at least 1'),
    ({"cores": "2"}, 'cores is "2", not a whole number of at least 1'),
    ({"collectives": {"gloo": {"all_reduce": {"2": {"latency": 1e-3, "bandwidth": -1.0}}}}},
     "collectives.gloo.all_reduce.2.bandwidth is -1.0, not a positive finite number"),
    ({"collectives": {}}, "collectives.gloo has no all_reduce, all_gather_into_tensor"),
    ({"waits": {"gloo": {"4": {"send_recv": None}}}}, "waits.gloo.4.send_recv is null, not a non-negative"),
    ({"evil": 1}, "it has fields no machine file has (evil)"),
])
def test_a_machine_file_calibration_could_not_have_written_is_refused_naming_the_field(change, named):
    """A file damaged or edited by hand: one line naming the field, before any prediction (which would otherwise
    print negative or NaN times, or fail deep inside), and the fix."""
    raw = {**json.loads(flat_machine().to_json()), **change}
    with pytest.raises(MachineError) as refused:
        Machine.from_json(json.dumps(raw), "m.json")
    assert str(refused.value).startswith(f"machine file m.json is not one gcompile.calibrate wrote: {named}")
    assert str(refused.value).endswith("; measure the machine it describes again: python -m gcompile.calibrate "
                                       "--out m.json")


@pytest.mark.parametrize("text, why", [
    ("# gcompile\n", "it is not JSON (Expecting value: line 1 column 1 (char 0))"),
    ('{"name": "gcompile", "format": 5}', "it is JSON without the format and fingerprint every machine file holds"),
    ("[1, 2]", "it is JSON without the format and fingerprint every machine file holds"),
    ("1" * 5000, "it is not JSON calibration writes (a number or nesting far too long to read)"),
], ids=["markdown", "other JSON", "a list", "a 5000-digit number"])
def test_a_file_that_is_no_machine_file_is_refused_without_advice_to_measure_over_it(text, why):
    """`--machine README.md` advised `python -m gcompile.calibrate --out README.md`, which would replace the user's
    file with machine JSON; a damaged machine file keeps that advice (above)."""
    with pytest.raises(MachineError) as refused:
        Machine.from_json(text, "README.md")
    assert str(refused.value) == f"README.md is not a machine file: {why}; give a file python -m gcompile.calibrate " \
                                 f"wrote, or measure this machine with: python -m gcompile.calibrate"


def tiny(**parallel):
    train = dict(micro_batch_size=2, global_batch_size=8, seq_length=32)
    train.update({k: parallel.pop(k) for k in ("micro_batch_size",) if k in parallel})
    return build_config({"model": dict(n_layer=2, n_head=2, n_embd=32, block_size=32), "parallel": parallel,
                         "train": train})


def test_a_machine_measured_while_busy_is_warned_about():
    """More threads slower than one at the largest matmul: the cores were shared with other work."""
    idle = dataclasses.replace(flat_machine(), matmul={"1": {"float32": [[1.0, 5e9], [8.0, 9e10]]},
                                                       "2": {"float32": [[1.0, 4e9], [8.0, 1.7e11]]}})
    assert busy_warning(idle) is None and busy_warning(flat_machine()) is None
    busy = dataclasses.replace(idle, matmul={**idle.matmul, "2": {"float32": [[1.0, 1e7], [8.0, 3e8]]}})
    assert busy_warning(busy).startswith("warning: 2 threads multiplied matrices slower than 1 (0.3 against 90.0 "
                                         "GFLOP/s)")


def test_prediction_of_one_rank_is_the_sum_of_its_instructions():
    """No pipeline: the iteration is every instruction's graph time, one after the other, and after each of the
    4 backwards the runtime's add of the gradients into the accumulator (read both, write one, fp32; at the
    element-wise rate, as cost_model._accumulate_seconds says why)."""
    config = tiny()
    program = build_rank_program(config, Coords.from_rank(0, config.mesh_sizes), log=lambda _: None)
    rates = rates_for(flat_machine(), 1, 1, shm_tp=False)
    graphs = sum(graph_time(program.graph(i), rates, {}).seconds for i in program.instructions if i.is_compute)
    accumulate = 4 * 3 * 4 * program.layout.numel / BANDWIDTH
    got = predict([program], rates)
    assert got.step_seconds == pytest.approx(graphs + accumulate, rel=1e-9)
    assert got.bubble_fraction == pytest.approx(accumulate / got.pipeline_seconds, rel=1e-9)


def test_pipeline_prediction_costs_every_message():
    """pp 2: the prediction with messages of known cost is the simulation of the graph times plus them."""
    config = tiny(pp=2, micro_batch_size=1)
    cache = BuildCache()
    origin = Coords.from_rank(0, config.mesh_sizes)
    column = [build_rank_program(config, origin.moved(pp=r), log=lambda _: None, cache=cache) for r in range(2)]
    rates = rates_for(flat_machine(), 2, 1, shm_tp=False)
    activation = 1 * 32 * 32 * 4  # (B, T, C) float32 between the stages
    message = LATENCY + activation / LINK_BANDWIDTH
    seconds = {}
    for program in column:
        accumulate = 3 * 4 * program.layout.numel / BANDWIDTH  # after each backward, as above
        for i in program.instructions:
            if i.is_compute and i.action is not None:
                seconds[i.action] = graph_time(program.graph(i), rates, {}).seconds + accumulate * (i.op == "B")
    expected = simulate(column[0].schedule, lambda a: seconds[a], lambda a: seconds[a], send_time=message)
    optimizer = max(graph_time(p.optimizer.graph, rates, {"mp": 2, "embd": 2}).seconds for p in column)  # norm, tied wte
    got = predict(column, rates)
    assert got.pipeline_seconds == pytest.approx(expected.makespan, rel=1e-9)
    assert got.step_seconds == pytest.approx(expected.makespan + optimizer, rel=1e-9)
    free = simulate(column[0].schedule, lambda a: seconds[a], lambda a: seconds[a])
    assert got.pipeline_seconds > free.makespan  # communication is no longer free


def test_planner_refuses_with_reasons_and_proposes_layouts_that_pass_the_checker():
    base = tiny()
    cache = BuildCache()
    found = search(base, 4, flat_machine(), budget_gb=None, cache=cache, schedules=("1f1b",),
                   micro_batch_sizes=(1,))
    reasons = {" ".join(f"{k}={v}" for k, v in layout.items() if k in ("tp", "pp", "dp")): why
               for layout, why in found.refused}
    assert "n_layer=2 cannot be split into pp 4" in reasons["tp=1 pp=4 dp=1"]
    assert "n_head=2 is not divisible by tp=4" in reasons["tp=4 pp=1 dp=1"]
    assert found.reasons == Counter(reasons.values())  # one reason each
    assert found.ranked, "some layout of 4 ranks runs this model"
    times = [c.prediction.step_seconds for c in found.ranked]
    assert times == sorted(times)
    for candidate in found.ranked[:3]:
        programs = build_world(candidate.config, log=lambda _: None, cache=cache)
        assert "4 ranks agree" in check_plan(programs), candidate.layout
    tight = search(base, 2, flat_machine(), budget_gb=1e-4, cache=cache, schedules=("1f1b",), micro_batch_sizes=(1,))
    assert not tight.ranked
    assert all("over the budget of 0.0001 GiB" in why for _, why in tight.refused)
    assert tight.reasons == Counter({"over the budget of 0.0001 GiB": len(tight.refused)})  # counted without figures


def test_a_layout_a_pass_cannot_rewrite_is_refused_with_its_line():
    """Ulysses (a2a) gives each cp rank 1/cp of the heads: at cp 4, tiny's 2 heads do not divide (nor 1 at tp 2
    cp 2), which only the context-parallel pass sees; the other layouts are planned, each comm type asked for."""
    found = search(tiny(), 4, flat_machine(), schedules=("1f1b",), micro_batch_sizes=(1,),
                   cp_comm_types=("p2p", "a2a"))
    assert {c.layout.get("cp_comm_type") for c in found.ranked} == {None, "p2p", "a2a"}  # None: cp 1
    refused = {(layout["tp"], layout.get("cp")): why for layout, why in found.refused
               if layout.get("cp_comm_type") == "a2a"}
    assert refused[1, 4].startswith("context_parallel: node scaled_dot_product_attention") and \
        "has 2 heads on this rank, which cp=4 does not divide" in refused[1, 4]
    assert "has 1 heads on this rank, which cp=2 does not divide" in refused[2, 2]  # tp halves them
    assert (1, 2) not in refused and any((c.layout["tp"], c.layout.get("cp")) == (1, 2) for c in found.ranked)


def test_sequence_parallel_asked_of_a_plan_is_on_wherever_tp_is_above_one():
    """As in Megatron, sequence parallel at tp 1 does nothing, so a plan (and --auto-layout) may ask for it."""
    found = search(tiny(sequence_parallel=True), 2, flat_machine(), schedules=("1f1b",), micro_batch_sizes=(1,))
    passes = {c.layout["tp"]: builtin_passes(c.config) for c in found.ranked}
    assert "sequence_parallel" in passes[2] and "sequence_parallel" not in passes[1]


def test_planning_in_worker_processes_finds_what_one_process_finds(monkeypatch):
    """A search this small (8 layouts) stays in this process even with workers; given a worker per layout,
    it finds the same."""
    base, machine = tiny(), flat_machine()
    with monkeypatch.context() as patched:
        patched.setattr(plan, "ProcessPoolExecutor", None)  # calling it fails the test
        here = search(base, 2, machine, schedules=("1f1b",), micro_batch_sizes=(2,), workers=2)
    monkeypatch.setattr(plan, "LAYOUTS_PER_WORKER", 1)
    spawned = search(base, 2, machine, schedules=("1f1b",), micro_batch_sizes=(2,), workers=2)
    assert len(here.ranked) == 6  # dp2 and cp2 each with no_shard and optim, tp2, pp2
    assert [(c.layout, c.prediction.step_seconds, c.memory) for c in spawned.ranked] == \
        [(c.layout, c.prediction.step_seconds, c.memory) for c in here.ranked]
    assert spawned.refused == here.refused


def test_a_second_plan_takes_every_prediction_from_the_first_and_builds_nothing(tmp_path, monkeypatch):
    """The plan cache (gcompile.plan_cache): the same table, nothing built; another machine file or another
    version of the code predicts again."""
    path, base, machine = str(tmp_path / "plans.json"), tiny(), flat_machine()
    space = dict(schedules=("1f1b",), micro_batch_sizes=(2,))
    kept = PlanCache(path)
    first = search(base, 2, machine, kept=kept, **space)
    assert first.reused == 0 and kept.save() is None
    with monkeypatch.context() as patched:
        patched.setattr(plan, "evaluate", None)  # building fails the test
        again = search(base, 2, machine, kept=PlanCache(path), **space)
    assert again.reused == len(first.ranked) == 6
    assert [(c.layout, c.prediction, c.memory) for c in again.ranked] == \
        [(c.layout, c.prediction, c.memory) for c in first.ranked]
    assert again.refused == first.refused and ", 6 predicted by earlier runs)" in format_search(again, 2, 1, 0)
    with monkeypatch.context() as patched:  # what no build reads (UNREAD) is no other layout
        patched.setattr(plan, "evaluate", None)
        longer = dataclasses.replace(base, train=dataclasses.replace(base.train, train_iters=7, lr=0.5, seed=3))
        assert search(longer, 2, machine, kept=PlanCache(path), **space).reused == 6
    other_comm = dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, cp_comm_type="all_gather"))
    assert search(other_comm, 2, machine, kept=PlanCache(path), **space).reused == \
        sum(c.config.parallel.cp == 1 for c in first.ranked) > 0  # cp 1 layouts have no comm type to differ in
    assert search(base, 2, flat_machine(cores=32), kept=PlanCache(path), **space).reused == 0
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # each rank's threads: another prediction (it kept 2's)
    assert search(base, 2, machine, kept=PlanCache(path), **space).reused == 0
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(plan_cache, "code_version", lambda: "another version")
    assert PlanCache(path).known == {}


def test_plan_fresh_builds_again(tmp_path, capsys):
    machine = tmp_path / "machine.json"
    machine_file.save(flat_machine(), str(machine))
    argv = ["--config", os.path.join(ROOT, "configs", "tiny.toml"), "--world-size", "1", "--machine", str(machine),
            "--micro-batch-sizes", "1,2"]
    headers = []
    for extra in ([], ["--fresh"], []):
        assert plan.main(argv + extra) == 0
        headers.append(capsys.readouterr().out.splitlines()[0])
    assert [", 2 predicted by earlier runs)" in h for h in headers] == [False, False, True], headers


def test_an_interrupted_plan_keeps_what_it_predicted(tmp_path, monkeypatch):
    machine = tmp_path / "machine.json"
    machine_file.save(flat_machine(), str(machine))
    first_family, built = plan._search_family, []

    def interrupted(*args, **kwargs):
        if built:
            raise KeyboardInterrupt
        built.append(first_family(*args, **kwargs))
        return built[-1]
    monkeypatch.setattr(plan, "_search_family", interrupted)
    with pytest.raises(KeyboardInterrupt):
        plan.main(["--config", os.path.join(ROOT, "configs", "tiny.toml"), "--world-size", "2", "--workers", "1",
                   "--machine", str(machine), "--micro-batch-sizes", "2"])
    (_, predicted, _), = built
    assert predicted and PlanCache().known == predicted


def test_a_plan_cache_that_cannot_be_read_is_said_and_replaced(tmp_path):
    """Not JSON, not ours, or an entry no prediction could be (it would rank layouts wrongly): one note, never a
    traceback, and the file is written anew."""
    path = tmp_path / "plans.json"
    good = {"step_seconds": 1.0, "pipeline_seconds": 0.5, "optimizer_seconds": 0.5, "bubble_fraction": 0.1,
            "memory": 42}
    bad_entries = [{"step_seconds": 1.0}, {**good, "step_seconds": "1"}, {**good, "memory": -5},
                   {**good, "step_seconds": -1.0, "pipeline_seconds": -1.5}, {**good, "memory": 10 ** 400},
                   {**good, "bubble_fraction": 2.0}, {**good, "step_seconds": 3.0}, {**good, "memory": 4.5}]
    texts = ["not json", "", json.dumps({"entries": []}), "[" * 100000] + [
        json.dumps({"format": plan_cache.FORMAT, "code": code_version(), "entries": {"k": entry}})
        for entry in bad_entries]
    for text in texts:
        path.write_text(text)
        kept = PlanCache(str(path))
        assert kept.known == {} and kept.unread.startswith(f"{path} is not a plan cache gcompile can read ("), \
            text[:80]
    kept.added["k"] = StepTime(1.0, 0.5, 0.5, 0.1), 42
    assert kept.save() is None and PlanCache(str(path)).known == {"k": (StepTime(1.0, 0.5, 0.5, 0.1), 42)}
    (tmp_path / "file").write_text("")
    blocked = PlanCache(str(tmp_path / "file" / "plans.json"))
    blocked.added["k"] = StepTime(1.0, 0.5, 0.5, 0.1), 42
    assert blocked.unread is None and blocked.save().startswith("the plan was not kept for next time: ")
    (tmp_path / "folder.json").mkdir()
    folder = PlanCache(str(tmp_path / "folder.json"))
    folder.added["k"] = StepTime(1.0, 0.5, 0.5, 0.1), 42
    assert folder.unread == f"{tmp_path / 'folder.json'} is a folder, so no plan is kept; remove it to keep them"
    assert folder.save() is None  # said once, by `unread`
    os.mkfifo(tmp_path / "pipe.json")
    pipe = PlanCache(str(tmp_path / "pipe.json"))  # opened, it would wait for a writer for ever
    assert pipe.unread == f"{tmp_path / 'pipe.json'} is not a regular file (a pipe or a device), so no plan is " \
                          f"kept; remove it to keep them"


def test_a_prediction_the_plan_cache_would_refuse_is_never_written(tmp_path):
    """A machine file calibration could not have written once ranked layouts at negative times, and saved them;
    the next run refused the whole file, every good prediction with it. Only what `_read` takes is written."""
    path = str(tmp_path / "plans.json")
    kept = PlanCache(path)
    kept.added.update({"good": (StepTime(1.0, 0.5, 0.5, 0.1), 42), "negative": (StepTime(-1.0, -0.5, -0.5, 0.1), 42),
                       "nan": (StepTime(float("nan"), 0.5, 0.5, 0.1), 42)})
    assert kept.save() is None
    again = PlanCache(path)
    assert again.unread is None and again.known == {"good": (StepTime(1.0, 0.5, 0.5, 0.1), 42)}


def test_the_plan_cache_is_for_one_version_of_gcompile_and_its_passes(tmp_path, monkeypatch):
    """A changed file of gcompile/ or passes/ (a pass, the cost model) is another version: nothing kept is used."""
    import passes
    version = plan_cache.code_version.__wrapped__
    (tmp_path / "passes").mkdir()
    (tmp_path / "passes" / "__init__.py").write_text("")
    monkeypatch.setattr(passes, "__file__", str(tmp_path / "passes" / "__init__.py"))
    empty = version()
    (tmp_path / "passes" / "a_pass.py").write_text("def a_pass(program, ctx):\n    return program\n")
    added = version()
    assert added != empty and version() == added
    (tmp_path / "passes" / "a_pass.py").write_text("def a_pass(program, ctx):\n    return None\n")
    assert version() not in (empty, added)


def test_a_plan_of_the_users_own_code_is_never_kept():
    """Nothing here can tell when a user's model or pass changes."""
    own = build_config({"model": dict(arch="examples/parallel_block.py:SPEC", n_layer=2, n_head=2, n_embd=32,
                                      block_size=32), "train": dict(seq_length=32)})
    with_pass = build_config({"parallel": dict(passes=("after:lower=examples.all_reduce_split:"
                                                       "all_reduce_as_reduce_scatter_all_gather",))})
    assert layout_key(tiny(), "machine", (2, False)) is not None
    assert layout_key(own, "machine", (2, False)) is None and layout_key(with_pass, "machine", (2, False)) is None


def test_a_world_beyond_what_the_machine_measured_is_noted():
    machine = flat_machine(cores=2)  # slowdowns measured for 1 and 2 ranks at once
    assert machine.extrapolated(2) is None
    assert machine.extrapolated(16) == ("note: the machine file measured up to 2 ranks sharing its 2 cores; for 16, "
                                        "its slowdowns and waits are grown in proportion from there")
    gpu = machine_file.load(os.path.join(ROOT, "machines", "h100-80gb-1gpu.json"))
    assert gpu.extrapolated(1) is None


def test_the_kept_gpu_machine_file_predicts_one_rank():
    machine = machine_file.load(os.path.join(ROOT, "machines", "h100-80gb-1gpu.json"))
    assert machine.on_gpu and machine.cannot_predict(1) is None and "one GPU" in machine.cannot_predict(2)
    found = search(tiny(), 1, machine, schedules=("1f1b",), micro_batch_sizes=(1, 2))
    times = [c.prediction.step_seconds for c in found.ranked]
    assert len(times) == 2 and 0 < times[0] < found.ranked[-1].prediction.step_seconds


def test_configure_refuses_in_one_line():
    with pytest.raises(ValueError, match="global_batch_size=8 is not divisible"):
        configure(tiny(), dict(dp=4, micro_batch_size=4))
    with pytest.raises(ValueError) as refused:  # two reasons, one with its fix after a "; " of its own
        configure(tiny(), dict(tp=4, pp=4))
    assert len(refused.value.reasons) == 2 and str(refused.value) == "; ".join(refused.value.reasons)
    assert refused.value.reasons[1].endswith("; use at most 2 stages (pp * vpp; --pipeline-layers for an uneven split) "
                                             "or a multiple of 4 layers")


def test_refusals_count_under_each_reason_and_not_again_once_all_are_listed():
    split = "n_layer=2 cannot be split into pp 4 * vpp 1 = 4 stages of whole layers; use a multiple of 4 layers"
    found = Search(refused=[(dict(tp=4, pp=4), f"n_head=2 is not divisible by tp=4; {split}"),
                            (dict(tp=1, pp=4), split)],
                   reasons=Counter({split: 2, "n_head=2 is not divisible by tp=4": 1}), layouts=2)
    counted = format_search(found, 16, top=1, refused=1).splitlines()
    assert counted[1:] == ["refused (2; the first 1, then counts by reason):",
                           f"  --tp 4 --pp 4: n_head=2 is not divisible by tp=4; {split}",
                           f"     2 x {split}", "     1 x n_head=2 is not divisible by tp=4",
                           "  (a layout refused for several reasons counts under each)"]
    listed = format_search(found, 16, top=1, refused=2).splitlines()
    assert listed[1:] == ["refused (2; each with its reason):", f"  --tp 4 --pp 4: n_head=2 is not divisible by tp=4; "
                          f"{split}", f"  --tp 1 --pp 4: {split}"]


def test_a_plan_table_of_no_rows_has_no_header_and_the_rarest_reasons_are_summed():
    reasons = Counter({f"reason {i}": 10 - i for i in range(7)})
    found = Search(refused=[(dict(tp=1), "reason 0")] * reasons.total(), reasons=reasons, layouts=reasons.total())
    lines = format_search(found, 16, top=0, refused=0).splitlines()
    assert lines[0].endswith("49 refused (0.0 s)") and lines[1] == "refused (49; counts by reason):", lines
    assert lines[-1] == "     9 x one of 2 other reasons (--refused 49 lists each)", lines
    del reasons["reason 6"]  # six reasons: the sixth is listed, not summed as "one of 1 other reason"
    found = Search(refused=[(dict(tp=1), "reason 0")] * reasons.total(), reasons=reasons, layouts=reasons.total())
    assert format_search(found, 16, top=0, refused=0).splitlines()[-1] == "     5 x reason 5"


@pytest.mark.parametrize("budget_gb, said", [(None, "0 predicted (no --memory-budget-gb: none refused for memory), "),
                                             (1.0, "0 fit, ")])
def test_a_plan_says_layouts_fit_only_under_a_budget(budget_gb, said):
    """Without a budget nothing is checked against memory: a model no machine holds was said to fit."""
    found = Search(refused=[(dict(tp=1), "reason")], reasons=Counter(reason=1), layouts=1, budget_gb=budget_gb)
    assert f": {said}1 refused" in format_search(found, 1, top=0, refused=0).splitlines()[0]


def test_plan_command_needs_a_machine_file(tmp_path):
    missing = tmp_path / "none.json"
    done = subprocess.run([sys.executable, "-m", "gcompile.plan", "--world-size", "2", "--machine", str(missing)],
                          capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"python -m gcompile.plan: error: no machine file {missing}; make one with: python -m gcompile.calibrate "
        f"--out {missing}"]


def test_auto_layout_that_finds_none_prints_the_reasons_it_names(tmp_path, capsys):
    """3 ranks of tiny (2 layers, global batch 8): a pipeline of 3 or dp 3 cannot run it. The error line points at
    the reasons, so they are printed above it, and names the command that lists every refused layout (without
    --check-plan, which is run_gpt.py's: the planner refused the command it was given)."""
    machine = tmp_path / "machine.json"
    machine_file.save(flat_machine(), str(machine))
    status = run_gpt.main(["--config", os.path.join(ROOT, "configs", "tiny.toml"), "--auto-layout", "--check-plan",
                           "--world-size", "3", "--machine", str(machine), "--run-dir", str(tmp_path / "run")])
    out, err = capsys.readouterr()
    assert status == 2
    assert "refused (" in out and "x n_layer=2 cannot be split into pp 3" in out, out
    assert err.strip().splitlines() == [  # refused: pp 3 x 3 schedules x 4 micro-batch sizes
        "run_gpt.py: error: --auto-layout: no layout of 3 ranks can run this config; the reasons above say what to "
        "change (a dp size --global-batch-size cannot be split over is not tried: a multiple of it is); each "
        f"refused layout with its reason: python -m gcompile.plan --world-size 3 --config "
        f"{os.path.join(ROOT, 'configs', 'tiny.toml')} --machine {machine} --run-dir {tmp_path / 'run'} --refused 12"]


@pytest.mark.parametrize("flags, refusal", [
    (["--data-path", "{tmp}/missing.bin"], "--data-path {tmp}/missing.bin"),
    (["--n-embd", "65536"], "choose a smaller model"),
    (["--dump-only"], "--dump-only writes the programs to --dump-graphs DIR; give a folder")],
    ids=["data-missing", "model-over-ram", "dump-without-folder"])
def test_auto_layout_refuses_what_no_layout_changes_before_planning(flags, refusal, tmp_path, capsys):
    """Refused after the minutes of planning and its table, these were."""
    flags = [flag.replace("{tmp}", str(tmp_path)) for flag in flags]
    status = run_gpt.main(["--config", os.path.join(ROOT, "configs", "tiny.toml"), "--auto-layout", "--world-size",
                           "2", "--run-dir", str(tmp_path / "run"), *flags])
    out, err = capsys.readouterr()
    assert status == 2 and "planning:" not in out, out
    assert len(err.strip().splitlines()) == 1 and refusal.replace("{tmp}", str(tmp_path)) in err, err


def auto_layout(tmp_path, capsys, *flags) -> tuple[list[str], list[str], str]:
    """(the run's flags, the flags --auto-layout makes of them on tiny.toml, its `training with` line: what it does)."""
    machine = tmp_path / "machine.json"
    machine_file.save(flat_machine(), str(machine))
    argv = ["--config", os.path.join(ROOT, "configs", "tiny.toml"), *flags, "--machine", str(machine)]
    chosen = run_gpt.auto_layout(*parse_args(argv), argv)
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("--auto-layout: ")]
    return argv, chosen, line


def test_auto_layout_names_the_layout_flags_it_replaces(tmp_path, capsys):
    argv, chosen, line = auto_layout(tmp_path, capsys, "--micro-batch-size", "2", "--auto-layout", "--world-size", "1")
    assert chosen[:4] == argv[:4] and chosen[4:6] == ["--tp", "1"]  # the plan's flags come last: they win
    assert line.endswith("; in place of the given --micro-batch-size 2"), line


def test_auto_layout_names_the_preset_values_it_replaces(tmp_path, capsys):
    """tiny.toml's micro_batch_size = 4 gave way to the planner's 8 unnamed: only flags were listed."""
    _, chosen, line = auto_layout(tmp_path, capsys, "--global-batch-size", "16", "--auto-layout", "--world-size", "2")
    assert chosen[chosen.index("--micro-batch-size") + 1] == "8"
    assert line.endswith("; in place of the preset's micro_batch_size = 4"), line


def test_auto_layout_trains_the_world_it_planned(tmp_path, capsys):
    """A layout names cp, ep and vpp only above 1, yet the run is parsed from the user's flags too: a given
    --context-parallel-size 2 (Megatron's spelling of --cp) must not survive into a run of twice the ranks, nor a
    given --use-distributed-optimizer into one that shards where the planner predicted none."""
    _, chosen, line = auto_layout(tmp_path, capsys, "--context-parallel-size", "2", "--use-distributed-optimizer",
                                  "--auto-layout", "--world-size", "1")
    config, _ = parse_args(chosen)
    assert config.world_size == 1 and (config.parallel.cp, config.parallel.sharding) == (1, "no_shard")
    assert line.endswith("; in place of the given --context-parallel-size 2, --use-distributed-optimizer and the "
                         "preset's micro_batch_size = 4"), line


def test_an_action_computes_at_the_slowdown_of_the_ranks_computing_while_it_runs():
    """Spans by hand: the mean number of ranks busy over each span, each pipeline rank's count times its
    replicas. Then pp 2 on a machine where 2 ranks computing at once each run 2x slower (1 alone: 1x): with one
    microbatch no action overlaps another, so the pipeline costs what it costs alone and only the optimizer
    step, every rank at once, pays the slowdown; with 8, the steady state does."""
    spans = ((Span(Action(0, Kind.F, 0), 0.0, 2.0),), (Span(Action(1, Kind.F, 0), 1.0, 3.0),
                                                        Span(Action(1, Kind.B, 0), 3.0, 4.0)))
    assert _concurrency(spans, replicas=2) == {Action(0, Kind.F, 0): 3.0, Action(1, Kind.F, 0): 3.0,
                                               Action(1, Kind.B, 0): 2.0}
    machine = dataclasses.replace(flat_machine(), contention={"1": 1.0, "2": 2.0}, host_contention={"1": 1.0, "2": 2.0})

    cache, columns = BuildCache(), {}
    for microbatches in (1, 8):
        config = dataclasses.replace(tiny(pp=2, micro_batch_size=1), train=dataclasses.replace(
            tiny().train, micro_batch_size=1, global_batch_size=microbatches))
        origin = Coords.from_rank(0, config.mesh_sizes)
        columns[microbatches] = [build_rank_program(config, origin.moved(pp=r), log=lambda _: None, cache=cache)
                                 for r in range(2)]

    def predicted(microbatches: int, slowdown: float | None = None):
        every = {"1": slowdown, "2": slowdown}  # a machine where any number of ranks computes this much slower
        used = machine if slowdown is None else dataclasses.replace(machine, contention=every, host_contention=every)
        return predict(columns[microbatches], rates_for(used, 2, 1, shm_tp=False))
    one = predicted(1)
    assert one.pipeline_seconds == pytest.approx(predicted(1, 1.0).pipeline_seconds, rel=1e-12)
    assert one.optimizer_seconds == pytest.approx(predicted(1, 2.0).optimizer_seconds, rel=1e-12)
    eight = predicted(8)
    assert predicted(8, 1.0).pipeline_seconds * 1.2 < eight.pipeline_seconds < predicted(8, 2.0).pipeline_seconds
    # summary.txt's time per graph is at every rank computing: its header says so, as they add up to more than one
    header = format_rank_time(columns[1][0], rates_for(machine, 2, 1, shm_tp=False)).splitlines()[0]
    assert "every one of the world's 2 ranks computing at once on 64 cores, 2.00x one rank's time" in header, header


def test_a_world_of_a_billion_ranks_is_listed_from_its_divisors():
    """Pipeline sizes are the divisors of what tp and cp leave: found up to the square root (a loop to n took
    minutes at 10^9 ranks, with nothing printed)."""
    assert all(plan._divisors(n) == [d for d in range(1, n + 1) if n % d == 0] for n in range(1, 400))
    base = dataclasses.replace(tiny(), train=dataclasses.replace(tiny().train, global_batch_size=10 ** 9))
    found = layouts(base, 10 ** 9, schedules=("1f1b",), micro_batch_sizes=(1,))
    assert {layout["pp"] for layout in found if layout["tp"] == layout.get("cp", 1) == 1} == set(plan._divisors(10 ** 9))


def test_planner_saves_memory_only_for_a_layout_over_the_budget():
    """One rank, no dp to shard over: over a budget that recompute meets, the layout it keeps recomputes;
    under a budget that fits both, it does not."""
    base, cache = tiny(), BuildCache()
    plain = search(base, 1, flat_machine(), cache=cache, micro_batch_sizes=(2,)).ranked[0]
    saving = configure(base, {**plain.layout, "recompute_activations": True})
    _, recomputed = evaluate(saving, flat_machine(), cache)
    assert recomputed < plain.memory
    between = (recomputed + plain.memory) / 2 / 2 ** 30
    kept = search(base, 1, flat_machine(), budget_gb=between, cache=cache, micro_batch_sizes=(2,))
    assert [c.layout.get("recompute_activations") for c in kept.ranked] == [True]
    assert "over the budget" in kept.refused[0][1]
    roomy = search(base, 1, flat_machine(), budget_gb=1.0, cache=cache, micro_batch_sizes=(2,))
    assert [c.layout.get("recompute_activations") for c in roomy.ranked] == [None]


def test_planner_shards_the_sequence_of_a_tp_layout_over_the_budget():
    """Two ranks of tp: over a budget sequence parallel meets, the tp layout it keeps shards the sequence; a
    layout without tp is never given it (nothing to shard over)."""
    base, cache = tiny(), BuildCache()
    tp2 = {"tp": 2, "pp": 1, "dp": 1, "pipeline_schedule": "1f1b", "micro_batch_size": 4,
           "data_parallel_sharding_strategy": "no_shard"}
    _, whole = evaluate(configure(base, tp2), flat_machine(), cache)
    _, sharded = evaluate(configure(base, {**tp2, "sequence_parallel": True}), flat_machine(), cache)
    assert sharded < whole
    found = search(base, 2, flat_machine(), budget_gb=(whole + sharded) / 2 / 2 ** 30, cache=cache,
                   micro_batch_sizes=(4,), schedules=("1f1b",))
    kept = [c.layout for c in found.ranked if c.layout["tp"] == 2]
    assert {**tp2, "sequence_parallel": True} in kept and tp2 not in kept
    tried = [c.layout for c in found.ranked] + [layout for layout, _ in found.refused]
    assert all("sequence_parallel" not in layout for layout in tried if layout["tp"] == 1)
    assert any(layout == tp2 and "over the budget" in why for layout, why in found.refused)


def test_a_memory_saver_the_layout_cannot_run_is_refused_and_the_next_tried():
    """seq_length 31 over tp 2 cannot be sharded: sequence parallel is refused with validation's line, and
    recompute, the next saver, is kept."""
    base, cache = tiny(), BuildCache()
    base = dataclasses.replace(base, train=dataclasses.replace(base.train, seq_length=31))
    tp2 = {"tp": 2, "pp": 1, "dp": 1, "pipeline_schedule": "1f1b", "micro_batch_size": 2,
           "data_parallel_sharding_strategy": "no_shard"}
    _, whole = evaluate(configure(base, tp2), flat_machine(), cache)
    _, recomputed = evaluate(configure(base, {**tp2, "recompute_activations": True}), flat_machine(), cache)
    [found], _, _ = plan._search_family(base, flat_machine(), (whole + recomputed) / 2 / 2 ** 30, [tp2], cache)
    assert [(ok, "sequence_parallel" in c[0] if not ok else c.layout.get("recompute_activations"))
            for ok, c in found] == [(False, False), (False, True), (True, True)]
    assert "not divisible by tp=2 (sequence_parallel)" in found[1][1][1]
    # under a budget recompute misses too, no pair with sequence parallel is tried, nor recompute where the run
    # recomputes already
    [found], _, _ = plan._search_family(base, flat_machine(), recomputed / 2 / 2 ** 30, [tp2], cache)
    assert [sorted(set(c[0]) - set(tp2)) for _, c in found] == [[], ["sequence_parallel"], ["recompute_activations"]]
    recomputing = dataclasses.replace(base, train=dataclasses.replace(base.train, recompute_activations=True))
    [found], _, _ = plan._search_family(recomputing, flat_machine(), recomputed / 2 / 2 ** 30, [tp2], cache)
    assert [sorted(set(c[0]) - set(tp2)) for _, c in found] == [[], ["sequence_parallel"]]


def test_interleaved_layouts_try_every_even_split_of_the_layers():
    """12 layers: over pp 2, 2, 3 or 6 stages per rank; over pp 4, 3; over pp 8 none splits evenly, and the one
    tried (vpp 2) is refused by validation with its reason."""
    base = build_config({"model": dict(n_layer=12, n_head=2, n_embd=32, block_size=32),
                         "train": dict(micro_batch_size=1, global_batch_size=16, seq_length=32)})

    def chunks(world: int) -> dict[int, list[int]]:
        found = {}
        for layout in layouts(base, world, schedules=("interleaved",), micro_batch_sizes=(1,)):
            if layout["pp"] > 1 and layout["tp"] == layout["dp"] == 1 and "cp" not in layout and \
                    layout["data_parallel_sharding_strategy"] == "no_shard":
                found.setdefault(layout["pp"], []).append(layout["virtual_pipeline_size"])
        return found
    assert chunks(2) == {2: [2, 3, 6]} and chunks(4) == {4: [3]} and chunks(8) == {8: [2]}
    assert plan._chunks(13, 2, (2, 2, 2, 2, 2, 3)) == [3], "the user's split of 6 stages: 3 a rank over pp 2"
    with pytest.raises(plan.ConfigError, match="cannot be split into pp 8 \\* vpp 2"):
        configure(base, {"tp": 1, "pp": 8, "dp": 1, "pipeline_schedule": "interleaved", "virtual_pipeline_size": 2,
                         "micro_batch_size": 1, "data_parallel_sharding_strategy": "no_shard"})


def test_every_saver_of_a_tier_that_fits_is_ranked_and_the_next_tier_is_not_tried():
    """dp 2 over a budget that sharding the gradients meets: ZeRO-2, ZeRO-3 and recompute each fit and are each
    ranked (the planner picks by predicted time, not by the order it tried them); no pair of savers is built."""
    base, cache = tiny(), BuildCache()
    dp2 = {"tp": 1, "pp": 1, "dp": 2, "pipeline_schedule": "1f1b", "micro_batch_size": 2,
           "data_parallel_sharding_strategy": "optim"}
    memory = {sharding: evaluate(configure(base, {**dp2, "data_parallel_sharding_strategy": sharding}),
                                 flat_machine(), cache)[1] for sharding in ("optim", "optim_grads")}
    assert memory["optim_grads"] < memory["optim"]
    budget = (memory["optim"] + memory["optim_grads"]) / 2 / 2 ** 30
    [found], _, _ = plan._search_family(base, flat_machine(), budget, [dp2], cache)
    tried = [(ok, {k: v for k, v in (c.layout if ok else c[0]).items() if k not in dp2 or dp2[k] != v})
             for ok, c in found]
    assert tried == [(False, {}), (True, {"data_parallel_sharding_strategy": "optim_grads"}),
                     (True, {"data_parallel_sharding_strategy": "optim_grads_params"}),
                     (True, {"recompute_activations": True})]


def test_check_plan_with_no_usable_machine_file_checks_the_plan_and_says_why_it_predicts_nothing(tmp_path, monkeypatch,
                                                                                                  capsys):
    """This machine's own file missing, written by an older gcompile, or a GPU's that measured no collectives:
    the plan is still checked and the prediction line says why there is none (the same file given with --machine
    is an error: test_bad_input's "check-plan" cases)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    argv = ["--config", os.path.join(ROOT, "configs", "tiny.toml"), "--pp", "2", "--check-plan"]
    older = {**json.loads(flat_machine().to_json()), "format": machine_file.FORMAT - 1}
    one_gpu = machine_file.load(os.path.join(ROOT, "machines", "h100-80gb-1gpu.json"))
    for found, why in ((None, machine_file.missing()),
                       (json.dumps(older), f"has format {machine_file.FORMAT - 1}, this gcompile reads"),
                       (one_gpu.to_json(), "measured no collectives (one GPU: nccl needs two), so it predicts one")):
        if found is not None:
            os.makedirs(os.path.dirname(machine_file.default_path()), exist_ok=True)
            with open(machine_file.default_path(), "w") as f:
                f.write(found)
        assert run_gpt.main(argv) == 0
        out = capsys.readouterr().out
        assert "plan checked: 2 ranks agree" in out and "predicted time: none, " in out, out
        assert why in out.split("predicted time: none, ")[1], out


def test_auto_layout_replaces_a_layout_the_flags_could_not_run(tmp_path, capsys):
    """--dp 4 of 8 samples at tiny.toml's micro-batch size 4 was refused before planning, as if it would run."""
    _, chosen, _ = auto_layout(tmp_path, capsys, "--dp", "4", "--pipeline-schedule", "interleaved", "--auto-layout",
                               "--world-size", "2")
    config, _ = parse_args(chosen)
    assert config.world_size == 2 and config.parallel.pipeline_schedule != "interleaved"


def test_auto_layout_checks_its_plan_on_the_machine_it_planned_with(tmp_path, capsys):
    """--check-plan predicted on this machine's file after a plan on --machine's, and said `training with`."""
    argv, chosen, line = auto_layout(tmp_path, capsys, "--check-plan", "--tp", "1", "--auto-layout", "--world-size",
                                     "1")
    assert chosen[chosen.index("--machine") + 1] == argv[argv.index("--machine") + 1]
    assert line.startswith("--auto-layout: checking the plan of --tp 1"), line
    assert "--tp 1" not in line.partition("in place of")[2], line  # the value it chose too: nothing replaced


def test_auto_layout_under_a_launcher_is_refused(monkeypatch, capsys):
    """torchrun's ranks ignored it, each running a layout of one rank."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert run_gpt.main(["--config", os.path.join(ROOT, "configs", "tiny.toml"), "--auto-layout", "--world-size",
                         "2"]) == 2
    assert "--auto-layout plans and starts the ranks itself" in capsys.readouterr().err
