"""Derive a stage's lowering from two others on its line, for the planner.

Lowering a stage (aot_autograd, then the partitioner) takes about a second,
and the planner meets each stage graph at every micro-batch size it tries.
Those graphs differ only in their ints (view sizes, shapes, strides), and each
int is affine in the micro-batch size; so are the ints of their lowerings
(tiny's stages at 1, 2, 4 and 8, tp 1 and 2: the same nodes, every int on one
line). So a stage graph whose ints are a + t (b - a) for one t, a and b those
of two lowered graphs of the same structure, gets the lowering whose ints are
theirs at the same t. The graph made is checked: its shapes are propagated
again and must be the line's. The planner only costs these graphs; a run
lowers every stage for real.
"""

import dataclasses
from fractions import Fraction

import torch
import torch.fx as fx

from gcompile.program import Stage, propagate_shapes
from gcompile.rank_program import LoweredStage
from gcompile.torch_api import graph_module, tree_flatten, tree_unflatten


@dataclasses.dataclass(frozen=True)
class Outline:
    """A graph apart from its ints, and its ints in graph order (args, then shapes, strides, offsets)."""

    structure: tuple
    ints: tuple[int, ...]


def outline(gm: fx.GraphModule) -> Outline:
    structure, ints = [], []
    index = {node: i for i, node in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        leaves, spec = tree_flatten((node.args, node.kwargs))
        kept = []
        for leaf in leaves:
            if _is_int(leaf):
                ints.append(leaf)
                kept.append("#")
            else:
                kept.append(index[leaf] if isinstance(leaf, fx.Node) else repr(leaf))
        values = _values(node)
        for v in values:
            ints += [*v.shape, *v.stride(), v.storage_offset()]
        structure.append((node.op, str(node.target), str(spec), tuple(kept),
                          tuple((v.dim(), v.dtype, v.device) for v in values)))
    return Outline(tuple(structure), tuple(ints))


class Lines:
    """Lowered stages by structure, each with its stage graph's ints: what `derive` draws lines through."""

    def __init__(self):
        self.lowered: dict[tuple, list[tuple[tuple[int, ...], LoweredStage, Outline, Outline]]] = {}
        """(key, stage graph's structure) -> its ints, lowering, and the outlines of its forward and backward."""
        self.derived = 0

    def add(self, stage: Stage, key: tuple, lowered: LoweredStage) -> None:
        found = outline(stage.graph)
        self.lowered.setdefault((key, found.structure), []).append(
            (found.ints, lowered, outline(lowered.forward), outline(lowered.backward)))

    def derive(self, stage: Stage, key: tuple) -> LoweredStage | None:
        """The lowering of `stage` on the line of two lowered ones (`key`: what else the lowering depends on),
        or None where there is no such line or the graphs it gives do not check."""
        found = outline(stage.graph)
        known = self.lowered.get((key, found.structure), [])[::-1]  # the latest first: nearest, as sizes grow
        for i, (ints_a, a, forward_a, backward_a) in enumerate(known):
            for ints_b, b, forward_b, backward_b in known[i + 1:]:
                t = _position(ints_a, ints_b, found.ints)
                forward = t is not None and _on_line(a.forward, forward_a, forward_b, t, stage.placeholders())
                backward = forward and _on_line(a.backward, backward_a, backward_b, t)
                if backward:  # else the partitioner saved other tensors at a and b: try another pair
                    self.derived += 1
                    return dataclasses.replace(a, forward=forward, backward=backward)
        return None


def _position(a: tuple[int, ...], b: tuple[int, ...], ints: tuple[int, ...]) -> Fraction | None:
    """t where ints = a + t (b - a) entry by entry, or None."""
    t = next((Fraction(i - x, y - x) for x, y, i in zip(a, b, ints) if y != x), None)
    if t is None or any(i != x + t * (y - x) for x, y, i in zip(a, b, ints)):
        return None
    return t


def _on_line(a: fx.GraphModule, first: Outline, second: Outline, t: Fraction,
             placeholders: list[fx.Node] | None = None) -> fx.GraphModule | None:
    """`a`'s graph with every int at t on the line from `first` (a's outline) to `second`, its shapes
    propagated and checked; `placeholders`: nodes whose fake values it takes as inputs (else made at the
    line's shapes)."""
    if first.structure != second.structure or \
            placeholders is not None and len(placeholders) != len(a.graph.find_nodes(op="placeholder")):
        return None
    line = [x + t * (y - x) for x, y in zip(first.ints, second.ints)]
    if any(i.denominator != 1 for i in line):
        return None
    ints = iter(int(i) for i in line)
    graph = fx.Graph()
    returned, output = graph.graph_copy(a.graph, {}, return_output_node=True)
    graph.output(returned).meta = dict(output.meta)
    inputs = iter(placeholders or [])
    for old, node in zip(a.graph.nodes, graph.nodes):
        leaves, spec = tree_flatten((node.args, node.kwargs))
        node.args, node.kwargs = tree_unflatten([next(ints) if _is_int(leaf) else leaf for leaf in leaves], spec)
        values = _values(old)
        shapes = [(tuple(next(ints) for _ in range(v.dim())), tuple(next(ints) for _ in range(v.dim())), next(ints))
                  for v in values]
        if node.op == "placeholder":
            given = next(inputs, None)
            node.meta["val"] = given.meta["val"] if given is not None else _fake_like(values[0], *shapes[0])
    gm = graph_module(a, graph)
    try:
        propagate_shapes(gm)
    except RuntimeError:
        return None
    return gm if list(outline(gm).ints) == line else None


def _fake_like(value: torch.Tensor, shape: tuple, stride: tuple, offset: int) -> torch.Tensor:
    """A fake input of `value`'s kind at the line's shape, stride and offset (a saved view of a bigger tensor)."""
    extent = offset + 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else offset
    with value.fake_mode:
        return torch.empty(extent, dtype=value.dtype, device=value.device).as_strided(shape, stride, offset)


def _values(node: fx.Node) -> list[torch.Tensor]:
    """The fake tensors a node holds (none for the output node: what it returns holds them)."""
    value = node.meta.get("val") if node.op != "output" else None
    return [v for v in tree_flatten(value)[0] if isinstance(v, torch.Tensor)]


def _is_int(leaf) -> bool:
    return isinstance(leaf, int) and not isinstance(leaf, bool)
