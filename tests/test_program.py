"""Shape propagation after a rewrite (gcompile.program.propagate_shapes): a node whose op, arguments and
input values did not change keeps its value, every other gets what a propagation from scratch gives. And
a graph's structure key (gcompile.program.structure_key): its names aside, everything that lowering reads."""

import copy

import torch
import torch.fx as fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from gcompile.program import propagate_shapes, structure_key
from gcompile.torch_api import FakeTensorMode

aten = torch.ops.aten


def program(x, w):
    product = aten.view.default(aten.mm.default(x, w), [2, 8])
    return aten.relu.default(product), aten.sin.default(x)


def values(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    return {n.name: n.meta["val"] for n in gm.graph.nodes if n.op == "call_function"}


def from_scratch(gm: fx.GraphModule) -> dict[str, tuple]:
    """Each node's (shape, stride) by torch's own propagation, on a copy that remembers nothing."""
    fresh = fx.GraphModule(torch.nn.Module(), copy.deepcopy(gm.graph))
    vals = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
    mode = vals[0].fake_mode
    with mode:
        FakeTensorProp(fresh, mode).propagate_dont_convert_inputs(*vals)
    return {name: (v.shape, v.stride()) for name, v in values(fresh).items()}


def test_unchanged_nodes_keep_their_values_and_changed_ones_match_a_fresh_propagation():
    gm = fx.symbolic_trace(program)
    mode = FakeTensorMode()
    x, w = gm.graph.find_nodes(op="placeholder")
    with mode:
        x.meta["val"], w.meta["val"] = torch.empty(4, 4), torch.empty(4, 4)
    propagate_shapes(gm)
    first = values(gm)
    propagate_shapes(gm)
    assert all(values(gm)[name] is val for name, val in first.items()), "nothing changed: every value is kept"

    with mode:
        w.meta["val"] = torch.empty(4, 2)  # a new input shape (a pass sharding a weight)
    view = next(n for n in gm.graph.nodes if n.target is aten.view.default)
    view.args = (view.args[0], [1, 8])  # and a rewritten argument
    propagate_shapes(gm)
    now = values(gm)
    assert {name: (v.shape, v.stride()) for name, v in now.items()} == from_scratch(gm)
    assert now["sin_default"] is first["sin_default"], "sin reads only x, which did not change"
    assert all(now[name] is not first[name] for name in ("mm_default", "view_default", "relu_default")), "downstream of w: recomputed"
    assert now["relu_default"].shape == (1, 8)


def traced(fn, *shapes) -> fx.GraphModule:
    gm = fx.symbolic_trace(fn)
    with FakeTensorMode():
        for node, shape in zip(gm.graph.find_nodes(op="placeholder"), shapes):
            node.meta["val"] = torch.empty(shape)
    return gm


def test_structure_key_sees_all_but_names():
    def renamed(a, b):  # program's ops, other names
        mm = aten.view.default(aten.mm.default(a, b), [2, 8])
        return aten.relu.default(mm), aten.sin.default(a)

    def rewired(x, w):  # the same ops, the matmul's operands swapped
        product = aten.view.default(aten.mm.default(w, x), [2, 8])
        return aten.relu.default(product), aten.sin.default(x)

    key = structure_key(traced(program, (4, 4), (4, 4)))
    assert structure_key(traced(renamed, (4, 4), (4, 4))) == key
    assert structure_key(traced(rewired, (4, 4), (4, 4))) != key
    assert structure_key(traced(program, (4, 4), (4, 2))) != key  # an input shape
    changed = traced(program, (4, 4), (4, 4))
    view = next(n for n in changed.graph.nodes if n.target is aten.view.default)
    view.args = (view.args[0], [1, 16])
    assert structure_key(changed) != key  # an argument

    def with_constant(constant: torch.Tensor) -> fx.GraphModule:  # a tensor as an argument, not an input
        graph = fx.Graph()
        x = graph.placeholder("x")
        graph.output(graph.call_function(aten.add.Tensor, (x, constant)))
        gm = fx.GraphModule(torch.nn.Module(), graph)
        with FakeTensorMode():
            x.meta["val"] = torch.empty(2000)
        return gm
    ones = torch.ones(2000)
    other = ones.clone()
    other[1000] = 2  # where a tensor's repr elides its values
    assert structure_key(with_constant(ones)) == structure_key(with_constant(ones))
    assert structure_key(with_constant(ones)) != structure_key(with_constant(other))
