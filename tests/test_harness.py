"""The in-process harness: its collectives against their definitions, and deadlocks end in errors.

The layouts it runs are checked against single-device eager in test_tensor_parallel.py,
test_pipeline.py and test_data_parallel.py, like the multi-process ones.
"""

import threading

import pytest
import torch

from gcompile.harness import HarnessError, Hub, Mailbox, _RankInterpreter
from gcompile.axes import Coords

OPS = torch.ops._c10d_functional
WAIT = OPS.wait_tensor.default


def run_ranks(world: int, fn) -> dict:
    """fn(rank) in one thread per rank; results by rank, or the errors raised."""
    out = {}

    def body(rank):
        try:
            out[rank] = fn(rank)
        except HarnessError as e:
            out[rank] = e
    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def graph_of(*calls) -> torch.fx.GraphModule:
    """x -> one output per call (op, *args after the input), each waited for (what lowered graphs hold)."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(tuple(graph.call_function(WAIT, (graph.call_function(op, (x, *args)),)) for op, *args in calls))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_collectives_follow_their_definitions():
    tp = 4
    xs = [torch.randn(4, 2, generator=torch.Generator().manual_seed(r)) for r in range(tp)]
    hub = Hub({r: Coords.from_rank(r, {"tp": tp}) for r in range(tp)})
    gm = graph_of((OPS.all_reduce.default, "sum", "tp"), (OPS.all_reduce.default, "max", "tp"),
                  (OPS.all_reduce.default, "avg", "tp"), (OPS.all_gather_into_tensor.default, tp, "tp"),
                  (OPS.reduce_scatter_tensor.default, "sum", tp, "tp"), (OPS.all_to_all_single.default, [], [], "tp"))
    out = run_ranks(tp, lambda r: _RankInterpreter(gm, r, hub).run(xs[r]))
    total = xs[0] + xs[1] + xs[2] + xs[3]  # rank order
    for r in range(tp):
        summed, largest, mean, gathered, scattered, exchanged = out[r]
        assert torch.equal(summed, total) and torch.equal(mean, total / tp)
        assert torch.equal(largest, torch.stack(xs).amax(0))
        assert torch.equal(gathered, torch.cat(xs))
        assert torch.equal(scattered, total[r:r + 1])
        assert torch.equal(exchanged, torch.cat([x[r:r + 1] for x in xs]))  # row r of every rank


def test_a_missing_collective_is_an_error_naming_the_ranks():
    hub = Hub({r: Coords.from_rank(r, {"tp": 2}) for r in range(2)}, timeout=0.5)
    gm = graph_of((OPS.all_reduce.default, "sum", "tp"))
    out = run_ranks(2, lambda r: _RankInterpreter(gm, r, hub).run(torch.ones(4, 2)) if r == 0 else None)
    assert isinstance(out[0], HarnessError)
    assert "rank 0 waited 0.5 s at all_reduce #0 on group tp [0, 1]: ranks [0] arrived, [1] never did" in str(out[0])


def test_a_receive_that_never_comes_is_an_error():
    box = Mailbox(timeout=0.5)
    a, b = box.endpoint(0), box.endpoint(1)
    a.batch_isend_irecv([a.P2POp(a.isend, torch.ones(3), 1)])
    (first,) = b.batch_isend_irecv([b.P2POp(b.irecv, torch.zeros(3), 0)])
    (second,) = b.batch_isend_irecv([b.P2POp(b.irecv, buffer := torch.zeros(3), 0)])
    first.wait()
    with pytest.raises(HarnessError, match="rank 1 waited 0.5 s for message 1 from rank 0; rank 0 sent 1"):
        second.wait()
    assert not buffer.any()


def test_a_mismatched_collective_is_an_error_naming_what_each_rank_issued():
    hub = Hub({r: Coords.from_rank(r, {"tp": 2}) for r in range(2)})
    graphs = [graph_of((OPS.all_reduce.default, op, "tp")) for op in ("sum", "max")]
    out = run_ranks(2, lambda r: _RankInterpreter(graphs[r], r, hub).run(torch.ones(4, 2)))
    assert all(isinstance(e, HarnessError) for e in out.values())
    assert "collective 0 on group tp [0, 1] differs between ranks: {0: 'all_reduce sum (4, 2) torch.float32', " \
           "1: 'all_reduce max (4, 2) torch.float32'}" in str(out[0])
