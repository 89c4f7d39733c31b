"""Small graph-editing steps the parallel passes share: new calls, rank inputs, local shapes, errors."""

from collections.abc import Callable

import torch
import torch.fx as fx

from gcompile.program import Program, Stage, source_line


class GraphMismatch(ValueError):
    """The graph is not what a pass (or its plan) expects; names the node, its op and its source line."""

    def __init__(self, pass_name: str, node: fx.Node, message: str):
        op = node.target if node.op == "call_function" else node.op
        super().__init__(f"{pass_name}: node {node.name} ({op}) {message} "
                         f"[at {source_line(node) or 'no source line recorded'}]")


def insert_call(anchor: fx.Node, fn: Callable, args: tuple, pass_name: str, before: bool = False) -> fx.Node:
    """`fn(*args)` as a new node right after (or before) `anchor`, tagged with the pass that made it."""
    graph = anchor.graph
    with graph.inserting_before(anchor) if before else graph.inserting_after(anchor):
        node = graph.call_function(fn, args)
    node.meta["pass"] = pass_name
    if "stack_trace" in anchor.meta:
        node.meta["stack_trace"] = anchor.meta["stack_trace"]
    return node


def replace_call(node: fx.Node, fn: Callable, args: tuple, pass_name: str) -> fx.Node:
    """`node` replaced by `fn(*args)`, in its place and its module (so on its pipeline stage), keeping its full-shape
    value until the pass manager derives the new one; the call."""
    call = insert_call(node, fn, args, pass_name)
    call.meta["val"] = node.meta["val"]
    if "nn_module_stack" in node.meta:
        call.meta["nn_module_stack"] = node.meta["nn_module_stack"]
    node.replace_all_uses_with(call)
    node.graph.erase_node(node)
    return call


def fake_like(node: fx.Node, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
    """A fake tensor of `shape` in the fake mode of `node`'s value (same dtype unless given)."""
    val = node.meta["val"]
    with val.fake_mode:
        return torch.empty(shape, dtype=dtype or val.dtype, device=val.device)


def rank_constant(stage: Stage, role: str, value: int) -> fx.Node:
    """The placeholder of a per-rank number (a 0-d int64 input fed by the runtime), made on first use.

    Passing the number in, instead of baking it into the graph, keeps the graph
    text of every rank the same, so it compiles once.
    """
    placeholders = stage.placeholders()
    if role in stage.rank_constants:
        return stage.input_nodes()[role]
    with stage.graph.graph.inserting_after(placeholders[-1]):
        node = stage.graph.graph.placeholder(role)
    node.meta["val"] = fake_like(placeholders[-1], (), torch.int64)
    stage.inputs.append(role)
    stage.rank_constants[role] = value
    return node


def whole_model_copy(program: Program, pass_name: str) -> Program:
    """A copy of `program` to rewrite, for a pass that must see the whole model in one stage."""
    if "pipeline_split" in program.history:
        raise ValueError(f"{pass_name} rewrites the whole model before pipeline_split; run it earlier "
                         f"(passes so far: {', '.join(program.history)})")
    return program.clone()
