"""Lower a stage's forward program into a forward graph and a backward graph.

Autograd of the rewritten forward gives the backward, so the backward halves of
the differentiable collectives a pass inserted land in the backward graph by
construction. The joint graph comes from aot_autograd (traced on fake tensors:
nothing runs, no collective fires); a partitioner cuts it in two:

    forward(*params, *inputs)        -> (*outputs, *saved)
    backward(*saved, *output_grads)  -> (*param_grads, *input_grads)

`output_grads` has one entry per output ("loss" takes the loss scale); a gradient
is None where its input is not differentiable (token ids). The partitioner is
the activation-recompute knob. By default it is torch.compile's min-cut
partitioner: matmul and attention outputs are saved, cheap pointwise ops are
recomputed in backward (less memory and, measured here, faster than saving
everything). `--recompute-activations` gives it a zero activation-memory budget:
backward recomputes the stage's forward from its inputs (Megatron's full
recompute), trading about one extra forward for activation memory.

A partitioner may copy into the backward forward nodes it can compute
from the saved tensors, then keeps those whose chain ends in a collective's
`wait_tensor` (an op with side effects): the backward would redo forward matmuls
and collectives and drop the results. `_drop_dead_code` removes them (a
collective nobody reads is dead on every rank alike) and the saved tensors only
they read.
"""

import contextlib
from dataclasses import replace

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from gcompile.backward_split import split_backward
from gcompile.collectives import is_collective
from gcompile.pass_manager import PassError
from gcompile.torch_api import activation_memory_budget, aot_export_joint_with_descriptors, min_cut_rematerialization_partition
from gcompile.report import is_metric
from gcompile.program import Stage, ancestors, descendants, drop_dead_nodes
from gcompile.rank_program import LoweredStage


def lower_stage(stage: Stage, recompute: bool = False, needs_grad: tuple[bool, ...] | None = None) -> LoweredStage:
    """`needs_grad`: per placeholder, whether backward gives its gradient (default: each floating-point one but
    the constants)."""
    placeholders, constants = stage.placeholders(), stage.constant_nodes()
    vals = [n.meta["val"] for n in placeholders]
    needs_grad = needs_grad or tuple(v.dtype.is_floating_point and n not in constants for n, v in zip(placeholders, vals))
    fake_mode = vals[0].fake_mode
    with fake_mode:
        args = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device).requires_grad_(grad)
                for v, grad in zip(vals, needs_grad)]
    with contextlib.ExitStack() as stack:
        joint = aot_export_joint_with_descriptors(stack, stage.graph, tuple(args)).graph_module
    _check_joint_convention(joint, len(args), stage.outputs, stage.index,
                            differentiable=sum(not is_metric(role) for role in stage.outputs))
    if stage.recompute_from_params:
        _recompute_parameter_derived(joint, len(stage.params))
    _communicate_in_backward(joint, len(args), len(stage.outputs))

    with activation_memory_budget(0.0 if recompute else 1.0):
        forward, backward = min_cut_rematerialization_partition(joint, None, num_fwd_outputs=len(stage.outputs))
    num_saved = _drop_dead_code(forward, backward, len(stage.outputs))
    if stage.recompute_from_params:
        _gather_one_ahead(backward)
    wait_one_behind(backward)
    for gm in (forward, backward):
        _reshape_strided_views(gm)
        for node in gm.graph.find_nodes(op="placeholder"):
            if not isinstance(node.meta.get("val"), torch.Tensor):
                raise NotImplementedError(f"stage {stage.index}: non-tensor graph input {node.name} "
                                          f"(dynamic shapes are not supported)")
    return LoweredStage(index=stage.index, forward=forward, backward=backward, params=list(stage.params),
                        inputs=list(stage.inputs), outputs=list(stage.outputs), num_saved=num_saved,
                        rank_constants=dict(stage.rank_constants), recomputed=recompute)


def split_lowered(lowered: LoweredStage) -> LoweredStage:
    """Its backward as B then W, for zero-bubble schedules (gcompile.backward_split): the same autograd and
    partition as the whole backward, so a build lowers once for both and splits a copy."""
    parts = split_backward(lowered.backward, len(lowered.params))
    if parts is None:
        return lowered
    return replace(lowered, backward=parts.backward_input, backward_weight=parts.backward_weight,
                   weight_inputs=parts.weight_inputs, num_stash=parts.num_stash)


def _reshape_strided_views(gm: fx.GraphModule) -> None:
    """Make each view of a tensor traced as non-contiguous a reshape. Fake tensors give some ops' results their
    input's strides where the CPU kernel returns a contiguous tensor (the gradient of a layer norm over a
    transposed input: pytorch#120035), so a view legal on the traced strides fails on the real ones (QK-norm
    after the heads are split). A reshape is the same view where the strides allow it, a copy where not."""
    strided = [node for node in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.view.default)
               if not node.args[0].meta["val"].is_contiguous()]
    for node in strided:
        node.target = torch.ops.aten.reshape.default
    if strided:
        gm.recompile()


def _recompute_parameter_derived(joint: fx.GraphModule, num_params: int) -> None:
    """Have the partitioner recompute in backward every node that reads parameters alone (their gathers,
    views and casts): backward then holds the shards, which live in the state anyway, not their results."""
    derived = set(list(joint.graph.find_nodes(op="placeholder"))[:num_params])
    for node in joint.graph.nodes:
        if node.op == "call_function" and node.all_input_nodes and set(node.all_input_nodes) <= derived:
            derived.add(node)
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE


def _communicate_in_backward(joint: fx.GraphModule, num_inputs: int, num_outputs: int) -> None:
    """Keep in backward a transfer only backward reads that needs no output gradient (ring attention sends K
    and V round again): the partitioner cannot recompute communication, so it would issue it in forward and
    hold its result until backward. It and what backward derives from it before any gradient are marked to
    recompute, which places them in backward."""
    graph = joint.graph
    tangents = list(graph.find_nodes(op="placeholder"))[num_inputs:]
    after_gradients = set().union(*(descendants(t) for t in tangents))
    forward = ancestors([n for n in graph.output_node().args[0][:num_outputs] if isinstance(n, fx.Node)])
    marked = set()
    for node in graph.nodes:
        if node.op == "call_function" and node not in forward and node not in after_gradients and \
                (is_collective(node.target) or not marked.isdisjoint(node.all_input_nodes)):
            marked.add(node)
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE


def _gather_one_ahead(gm: fx.GraphModule) -> None:
    """Issue each all-gather that reads only graph inputs (a parameter gather recomputed in backward) as soon
    as the one before it is waited for, so it arrives while the layer before it computes; the partitioner
    leaves each right before its use."""
    graph = gm.graph
    inputs = set(graph.find_nodes(op="placeholder"))
    gathers = [n for n in graph.nodes if n.target is torch.ops._c10d_functional.all_gather_into_tensor.default]
    for previous, gather in zip(gathers, gathers[1:]):
        chain = ancestors([gather]) - inputs
        if any(n.op != "call_function" or not set(n.all_input_nodes) <= chain | inputs for n in chain):
            continue  # reads more than saved shards: it cannot move
        anchor = next(u for u in previous.users if u.target is torch.ops._c10d_functional.wait_tensor.default)
        order = list(graph.nodes)
        if order.index(anchor) > order.index(gather):
            continue  # issued already
        _move_after(anchor, chain, order[order.index(anchor) + 1:])  # only earlier
    graph.lint()  # still in dependency order
    gm.recompile()


def wait_one_behind(gm: fx.GraphModule) -> None:
    """Wait for a gradient reduce-scatter (one whose result is only divided, cut into gradients, and maybe
    all-reduced on) after the next one is issued, so each runs while backward computes the layer before
    it; at most two are in flight, so at most two layers' unreduced gradients are held."""
    graph = gm.graph
    output = graph.output_node()
    waits = []
    for node in graph.nodes:
        if node.target is _ops.wait_tensor.default and node.args[0].target is _ops.reduce_scatter_tensor.default:
            after = descendants(node)
            if all(n.target in _GRADIENT_TAIL for n in after - {node}) and \
                    all(user in after or user is output for n in after for user in n.users):
                waits.append((node, after))
    for (wait, after), (next_wait, _) in zip(waits, waits[1:]):
        order = list(graph.nodes)
        issued = next_wait.args[0]
        if order.index(issued) < order.index(wait):
            continue  # issued before this wait already
        _move_after(issued, after, order)
    graph.lint()  # still in dependency order
    gm.recompile()


_ops = torch.ops._c10d_functional
_GRADIENT_TAIL = {torch.ops.aten.div.Tensor, torch.ops.aten.slice.Tensor, torch.ops.aten.view.default,
                  torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default, _ops.all_reduce.default,
                  _ops.wait_tensor.default}
"""What may follow a gradient reduce-scatter's wait for `wait_one_behind` to move it: no compute."""


def _move_after(anchor: fx.Node, nodes: set[fx.Node], order: list[fx.Node]) -> None:
    """Place `nodes` right after `anchor`, in their graph order."""
    for node in [n for n in order if n in nodes]:
        anchor.append(node)
        anchor = node


def _drop_dead_code(forward: fx.GraphModule, backward: fx.GraphModule, num_outputs: int) -> int:
    """Remove dead nodes (collectives included) and unread saved tensors; returns the number saved."""
    drop_dead_nodes(backward.graph)
    saved = list(backward.graph.find_nodes(op="placeholder"))
    output = forward.graph.output_node()
    outputs = list(output.args[0])
    num_saved = len(outputs) - num_outputs
    unread = {i for i, node in enumerate(saved[:num_saved]) if not node.users}
    for i in unread:
        backward.graph.erase_node(saved[i])
    output.args = ([o for i, o in enumerate(outputs) if i - num_outputs not in unread],)
    drop_dead_nodes(forward.graph)
    forward.recompile()
    backward.recompile()
    return num_saved - len(unread)


def _check_joint_convention(joint: fx.GraphModule, num_inputs: int, outputs: list[str], stage: int,
                            differentiable: int) -> None:
    """The joint graph must take (*primals, *tangents) and return (*outputs, *grads) in order, a tangent for
    each of the first `differentiable` outputs (the rest are reported metrics, detached).

    aot_autograd only guarantees this through descriptors; a graph with input
    mutations or aliased outputs could differ, and we would rather stop than
    silently misplace a gradient. An output autograd gives no tangent does not depend differentiably on
    the inputs (detached, integer, or a model without parameters): PassError, which names it.
    """
    num_outputs = len(outputs)
    descs = [str(n.meta.get("desc")) for n in joint.graph.find_nodes(op="placeholder")]
    constant = [role for i, role in enumerate(outputs[:differentiable])
                if f"TangentAOTInput(output=PlainAOTOutput(idx={i}))" not in descs]
    if constant:
        raise PassError(f"stage {stage}: its {', '.join(constant)} output does not depend on the parameters "
                        f"through anything autograd differentiates (detached, integer, or a model without "
                        f"parameters); a pass or the model's forward cut it off")
    expected = [f"PlainAOTInput(idx={i})" for i in range(num_inputs)]
    expected += [f"TangentAOTInput(output=PlainAOTOutput(idx={i}))" for i in range(differentiable)]
    out_descs = [str(d) for d in joint.graph.output_node().meta.get("desc", [])]
    expected_out = [f"PlainAOTOutput(idx={i})" for i in range(num_outputs)]
    expected_out += [f"GradAOTOutput(grad_of=PlainAOTInput(idx={i}))" for i in range(num_inputs)]
    grads_ok = all(d in (e, "None") for d, e in zip(out_descs[num_outputs:], expected_out[num_outputs:]))
    if descs != expected or out_descs[:num_outputs] != expected_out[:num_outputs] or not grads_ok \
            or len(out_descs) != len(expected_out):
        raise NotImplementedError(
            f"stage {stage}: aot_autograd produced an unexpected joint calling convention "
            f"(inputs {descs}, outputs {out_descs}); outputs that alias inputs or mutate them are not supported")
