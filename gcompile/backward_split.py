"""Split a stage's backward graph in two for zero-bubble schedules: B, then W.

The stage before waits for this stage's input gradients; nobody waits for its
parameter gradients. B computes what the input gradients need, so they can be
sent at once; W computes the rest later, in time the pipeline would otherwise
idle. A node belongs to B when an input gradient depends on it (and so do the
getitems of B's multi-output ops, e.g. LayerNorm's backward yields the input,
weight and bias gradients together); every other node belongs to W.

    before: backward(*saved, *output_grads)          -> (*param_grads, *input_grads)
    after:  backward_input(*saved, *output_grads)     -> (*param_grads_B, *input_grads, *stash)
            backward_weight(*kept, *stash)             -> (*param_grads_W)

param_grads_B and param_grads_W have one entry per parameter, None where the
other graph computes it. `stash` are the tensors B computes and W reads (e.g.
the gradient of a linear layer's output); `kept` are the backward's inputs W
reads (saved activations such as the linear layer's input, output gradients),
named by their index in backward's inputs. Once B has run, the runtime holds
only kept + stash for W and drops the rest.

A stage whose inputs take no gradient (the first, reading token ids) has no
B to hurry: it returns None, and the whole backward runs as B.
"""

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from gcompile.program import ancestors, drop_dead_nodes, node_origin, propagate_shapes
from gcompile.torch_api import graph_module


@dataclass(frozen=True)
class SplitBackward:
    backward_input: fx.GraphModule
    backward_weight: fx.GraphModule
    weight_inputs: tuple[int, ...]
    """Indices into backward's inputs (saved, then output gradients) that backward_weight takes first."""
    num_stash: int
    """Tensors backward_input returns last for backward_weight."""


def split_backward(backward: fx.GraphModule, num_params: int) -> SplitBackward | None:
    graph = backward.graph
    placeholders = list(graph.find_nodes(op="placeholder"))
    outputs = list(graph.output_node().args[0])
    param_grads, input_grads = outputs[:num_params], outputs[num_params:]
    if not any(isinstance(g, fx.Node) for g in input_grads):
        return None

    needed_by_b = ancestors([g for g in input_grads if isinstance(g, fx.Node)])
    for node in list(needed_by_b):  # a multi-output op's other results come out in B too
        needed_by_b.update(user for user in node.users if user.target is operator.getitem)
    in_w = [n for n in graph.nodes if n.op == "call_function" and n not in needed_by_b]
    w_set = set(in_w)
    kept = [p for p in placeholders if any(user in w_set for user in p.users)]
    stash = [n for n in graph.nodes if n.op == "call_function" and n in needed_by_b
             and any(user in w_set for user in n.users)]
    for node in stash:
        if not isinstance(node.meta.get("val"), torch.Tensor):
            raise NotImplementedError(f"backward split: W reads {node_origin(node)} from B, which is not a tensor")

    weight = fx.Graph()
    env = {}
    for node in kept + stash:
        env[node] = weight.placeholder(node.name)
        env[node].meta["val"] = node.meta["val"]
    for node in in_w:
        env[node] = weight.node_copy(node, lambda n: env[n])
    weight.output(tuple(env[g] if g in w_set else None for g in param_grads))
    backward_weight = graph_module(backward, weight)
    propagate_shapes(backward_weight)

    backward_input = graph_module(backward, _copy_with_outputs(
        graph, [g if g not in w_set else None for g in param_grads] + input_grads + stash))
    drop_dead_nodes(backward_input.graph)
    backward_input.recompile()
    return SplitBackward(backward_input=backward_input, backward_weight=backward_weight,
                         weight_inputs=tuple(placeholders.index(p) for p in kept), num_stash=len(stash))


def _copy_with_outputs(graph: fx.Graph, outputs: list) -> fx.Graph:
    """A copy of `graph` that returns `outputs` (nodes of `graph`, or None) instead."""
    copy = fx.Graph()
    env = {}
    for node in graph.nodes:
        if node.op != "output":
            env[node] = copy.node_copy(node, lambda n: env[n])
    copy.output(tuple(env[o] if o is not None else None for o in outputs))
    return copy
