"""Lower a stage from the lowerings of its blocks, for the planner.

Lowering (aot_autograd's joint trace, then the partitioner) takes time in
proportion to a stage's nodes, and the planner meets the same blocks in stages
of every split: gpt2-small's 12 whole, by 6, by 3, by 2 and by 1, at each tp,
cp and micro-batch size. So a stage is cut into pieces: what runs before its
first block (the embedding), each block, what runs after its last (the head and
loss). Each distinct piece is lowered once (every block of a model is one piece,
whatever its index: gcompile.program.structure_key), and the lowerings are
stitched: the pieces' forward graphs in order, then their backward graphs in
reverse, the gradient of a value summed over the pieces that read it, as
autograd sums it over a whole stage.

The stitched graphs compute the stage's outputs and gradients (tested against
its lowering). The partitioner, cut at block boundaries, keeps each piece's
inputs where it needs them, which over the whole stage it might recompute; the
saved bytes and nodes can differ a little from a whole lowering, which is why
a run lowers every stage whole. Full recompute and resharding
(recompute_from_params) are lowered whole here too: by pieces, each block would
keep its own input where the stage keeps only its first.
"""

from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx

from gcompile.lower import wait_one_behind
from gcompile.pass_manager import PassError
from gcompile.program import Stage, ancestors, draws_random
from gcompile.rank_program import LoweredStage
from gcompile.report import PREFIX, is_metric
from gcompile.torch_api import graph_module
from passes.pipeline_split import block_of

LowerPiece = Callable[[Stage, tuple[bool, ...]], LoweredStage]
"""Lowers a piece whose placeholders need gradients as the tuple says."""


@dataclass
class _Piece:
    stage: Stage
    """The piece as a stage of its own: forward(*params, *inputs) -> (*outputs,)."""
    reads: list[fx.Node]
    """The stage graph's nodes its placeholders stand for: parameters, earlier pieces' values, stage inputs."""
    gives: list[fx.Node]
    """The stage graph's nodes its outputs are: the ones later pieces or the stage's output read."""


def lower_by_pieces(stage: Stage, lower: LowerPiece) -> LoweredStage | None:
    """The stage's lowering stitched from its pieces' (`lower` lowers each), or None where it cannot be cut
    into more than one piece."""
    if stage.recompute_from_params:
        return None
    found = _place(stage)
    if found is None or len(set(found[0].values())) < 2:
        return None
    if stage.graph.graph.find_nodes(op="get_attr"):
        return None
    needs_grad = _needs_grad(stage)
    pieces = _pieces(stage, *found, needs_grad)
    if pieces is None:
        return None
    try:
        lowered = [lower(p.stage, tuple(needs_grad[n] for n in p.reads)) for p in pieces]
    except PassError:  # a value taken to need a gradient has none (made of floats, but not of the inputs)
        return None
    if any(gm.graph.find_nodes(op="get_attr") for low in lowered for gm in (low.forward, low.backward)):
        return None
    forward, saved, kept = _stitch_forward(stage, pieces, lowered)
    backward = _stitch_backward(stage, pieces, lowered, saved, kept, needs_grad)
    if backward is None:
        return None
    constants = stage.constant_nodes()
    merge_constants(forward, {p for p, n in zip(forward.graph.find_nodes(op="placeholder"), stage.placeholders())
                              if n in constants})
    merge_constants(backward)
    wait_one_behind(backward)
    return LoweredStage(index=stage.index, forward=forward, backward=backward, params=list(stage.params),
                        inputs=list(stage.inputs), outputs=list(stage.outputs), num_saved=len(saved),
                        rank_constants=dict(stage.rank_constants))


def _place(stage: Stage) -> tuple[dict[fx.Node, int], set[fx.Node]] | None:
    """(piece of every call node, the constants): 0 before the first block, a block's own (1, 2, ...), the last
    after the last block; a node between blocks outside them runs with the latest piece it reads. A node made
    of parameters alone (a cast, a pass's wrapper), or between blocks of placeholders alone, runs with the first
    piece that reads it. A constant (made of no input: rotary tables) is in none: each piece that reads it
    makes it. None where the blocks are not of one module list, a node would read a later piece, or the stage
    returns what no piece makes."""
    nodes = [n for n in stage.graph.graph.nodes if n.op not in ("placeholder", "output")]
    constants = _constants(stage.graph, stage.constant_nodes())
    nodes = [n for n in nodes if n not in constants]
    params, of_params = set(stage.placeholders()[:len(stage.params)]), set()
    for node in nodes:
        if all(p in params or p in constants or p in of_params for p in node.all_input_nodes):
            of_params.add(node)
    blocks = {n: block_of(n) for n in nodes}
    inside = [i for i, n in enumerate(nodes) if blocks[n] is not None]
    if not inside or len({b[0] for b in blocks.values() if b}) != 1:
        return None
    order = {index: k + 1 for k, index in enumerate(sorted({b[1] for b in blocks.values() if b}))}
    after = len(order) + 1
    placed, floating = {}, []
    for i, node in enumerate(nodes):
        producers = [placed[p] for p in node.all_input_nodes if p in placed]
        if node in of_params:
            floating.append(node)
        elif blocks[node] is not None:
            placed[node] = order[blocks[node][1]]
        elif i < inside[0] or i > inside[-1]:
            placed[node] = 0 if i < inside[0] else after
        elif producers:
            placed[node] = max(producers)
        else:
            floating.append(node)
    for node in reversed(floating):
        placed[node] = min((placed[u] for u in node.users if u.op != "output"), default=after)
    if any(placed[p] > placed[n] for n in nodes for p in n.all_input_nodes if p in placed) or \
            not set(stage.output_node().all_input_nodes) <= placed.keys():  # a constant or an input returned
        return None
    return placed, constants


def _constants(gm: fx.GraphModule, sources: set[fx.Node]) -> set[fx.Node]:
    """The call nodes made of no input but `sources` (rotary tables; a cp rank's positions), random ones aside."""
    found = set()
    for node in gm.graph.nodes:
        if node.op == "call_function" and not draws_random(node) and \
                all(p in found or p in sources for p in node.all_input_nodes):
            found.add(node)
    return found


def merge_constants(gm: fx.GraphModule, sources: set[fx.Node] = frozenset()) -> None:
    """Compute each constant once: pieces that read one each made it."""
    made = {}
    for node in sorted(_constants(gm, sources), key=list(gm.graph.nodes).index):
        key = (node.target, repr(node.args), repr(node.kwargs))
        if key in made:
            node.replace_all_uses_with(made[key])
            gm.graph.erase_node(node)
        else:
            made[key] = node
    gm.recompile()


def _needs_grad(stage: Stage) -> dict[fx.Node, bool]:
    """Whether autograd gives each node a gradient: a floating-point value computed from one that has one
    (every floating-point placeholder but a constant has one, as gcompile.lower gives them)."""
    found, constants = {}, stage.constant_nodes()
    for node in stage.graph.graph.nodes:
        val = node.meta.get("val")
        floating = isinstance(val, torch.Tensor) and val.dtype.is_floating_point
        found[node] = floating and (node.op == "placeholder" and node not in constants or
                                    any(found[p] for p in node.all_input_nodes))
    return found


def _pieces(stage: Stage, placed: dict[fx.Node, int], constants: set[fx.Node],
            needs_grad: dict[fx.Node, bool]) -> list[_Piece] | None:
    """The pieces in order, or None where one would hand on what is not a tensor."""
    placeholders = stage.placeholders()
    params = set(placeholders[:len(stage.params)])
    roles = dict(zip(placeholders, [p.name for p in stage.params] + list(stage.inputs)))
    read_by_output = set(stage.output_node().all_input_nodes)
    nodes = [n for n in stage.graph.graph.nodes if n in placed]
    pieces = []
    for k in sorted(set(placed.values())):
        members = [n for n in nodes if placed[n] == k]
        made = [n for n in ancestors([p for n in members for p in n.all_input_nodes if p in constants])
                if n.op != "placeholder"]
        outside = {p for n in members + made for p in n.all_input_nodes
                   if p.op == "placeholder" or p in placed and placed[p] != k}
        reads = [p for p in placeholders if p in outside and p in params] + \
                [n for n in nodes if n in outside] + [p for p in placeholders if p in outside and p not in params]
        given = [n for n in members if n in read_by_output or any(u.op != "output" and placed[u] != k for u in n.users)]
        if not all(isinstance(n.meta.get("val"), torch.Tensor) for n in given):
            return None
        gives = [n for n in given if needs_grad[n]] + [n for n in given if not needs_grad[n]]
        graph, env = fx.Graph(), {}
        for node in reads:
            env[node] = graph.placeholder(node.name)
            env[node].meta.update(node.meta)
        for node in [n for n in stage.graph.graph.nodes if n in made] + members:
            env[node] = graph.node_copy(node, env.__getitem__)
        graph.output(tuple(env[n] for n in gives))
        inputs = [roles.get(n, n.name) for n in reads[sum(n in params for n in reads):]]
        outputs = [n.name if needs_grad[n] else f"{PREFIX}{n.name}:0/1" for n in gives]  # no gradient: as a metric
        piece = Stage(index=stage.index, graph=graph_module(stage.graph, graph),
                      params=[stage.params[placeholders.index(n)] for n in reads if n in params], inputs=inputs,
                      outputs=outputs,
                      rank_constants={r: v for r, v in stage.rank_constants.items() if r in inputs})
        pieces.append(_Piece(piece, reads, gives))
    return pieces


def _copy_body(graph: fx.Graph, gm: fx.GraphModule, env: dict) -> list:
    """Copy `gm`'s nodes into `graph` after its placeholders (given in `env`); what its output returns."""
    for node in gm.graph.nodes:
        if node.op not in ("placeholder", "output"):
            env[node] = graph.node_copy(node, env.__getitem__)
    return [env[v] if isinstance(v, fx.Node) else v for v in gm.graph.output_node().args[0]]


def _stitch_forward(stage: Stage, pieces: list[_Piece], lowered: list[LoweredStage]):
    """forward(*params, *inputs) -> (*outputs, *saved); the saved tensors (each once), and per piece where
    each of its saved ones is among them."""
    graph, value = fx.Graph(), {}
    for node in stage.placeholders():
        value[node] = graph.placeholder(node.name)
        value[node].meta.update(node.meta)
    saved, kept = [], []
    for piece, low in zip(pieces, lowered):
        placeholders = low.forward.graph.find_nodes(op="placeholder")
        returned = _copy_body(graph, low.forward, {p: value[r] for p, r in zip(placeholders, piece.reads)})
        value.update(zip(piece.gives, returned))
        mine = []
        for node in returned[len(piece.gives):]:
            if node not in saved:
                saved.append(node)
            mine.append(saved.index(node))
        kept.append(mine)
    graph.output((*[value[v] for v in stage.output_node().args[0]], *saved))
    return graph_module(stage.graph, graph), saved, kept


def _stitch_backward(stage: Stage, pieces: list[_Piece], lowered: list[LoweredStage], saved: list[fx.Node],
                     kept: list[list[int]], needs_grad: dict[fx.Node, bool]) -> fx.GraphModule | None:
    """backward(*saved, *output_grads) -> (*param_grads, *input_grads), or None where a piece's output that
    needs a gradient gets none."""
    graph = fx.Graph()
    saved_inputs = []
    for node in saved:
        saved_inputs.append(graph.placeholder(node.name))
        saved_inputs[-1].meta.update(node.meta)
    producer = {v: (k, piece.gives.index(v)) for k, piece in enumerate(pieces) for v in piece.gives}
    grads = {}
    for role, value in zip(stage.outputs, stage.output_node().args[0]):
        if is_metric(role):
            continue
        k, i = producer[value]
        like = list(lowered[k].backward.graph.find_nodes(op="placeholder"))[len(kept[k]) + i]
        tangent = graph.placeholder(f"tangents_{role}")
        tangent.meta.update(like.meta)
        grads.setdefault(value, []).append(tangent)
    for piece, low, mine in reversed(list(zip(pieces, lowered, kept))):
        placeholders = list(low.backward.graph.find_nodes(op="placeholder"))
        env = {p: saved_inputs[i] for p, i in zip(placeholders, mine)}
        for value, tangent in zip([v for v in piece.gives if needs_grad[v]], placeholders[len(mine):]):
            if value not in grads:
                return None
            env[tangent] = _summed(graph, grads.pop(value))
        for read, grad in zip(piece.reads, _copy_body(graph, low.backward, env)):
            if grad is not None:
                grads.setdefault(read, []).append(grad)
    returned = [_summed(graph, grads[p]) if p in grads else None for p in stage.placeholders()]
    graph.output(tuple(returned))
    return graph_module(stage.graph, graph)


def _summed(graph: fx.Graph, nodes: list[fx.Node]) -> fx.Node:
    total = nodes[0]
    for node in nodes[1:]:
        added = graph.call_function(torch.ops.aten.add.Tensor, (total, node))
        with total.meta["val"].fake_mode:
            added.meta["val"] = total.meta["val"] + node.meta["val"]
        total = added
    return total
