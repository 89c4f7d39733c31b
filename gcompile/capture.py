"""torch.export of a single-device model + loss into a one-stage Program.

The model is built and traced under a fake tensor mode, so capture allocates no
weights: a 1.3B-parameter layout can be inspected on a laptop. Capture runs on the
device the program will run on, because attention lowers differently per device
(on CPU, SDPA becomes `_scaled_dot_product_flash_attention_for_cpu`).

Tied parameters (e.g. GPT-2's embedding and head): export may show a tied weight as
two placeholders. We keep one, under the name the module's state dict lists first,
used by every reader; autograd then sums the gradient contributions as eager does.
"""

import contextlib
import inspect
import io
import logging
import sys
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.export.graph_signature import InputKind

from gcompile.canonical import as_the_ops_passes_know
from gcompile.config import ConfigError
from gcompile.held import held_values
from gcompile.layout import Param
from gcompile.models.spec import Input, canonical_names
from gcompile.report import number_reports
from gcompile.program import Program, Stage, not_a_loss, refresh_meta, source_line
from gcompile.torch_api import FakeTensorMode, helper_frames_recorded
from gcompile.user_code import failure_line


def capture(build: Callable[[], nn.Module], batch: tuple[Input, ...], decays: Callable[[str, tuple[int, ...]], bool],
            device: str = "cpu", dtype: torch.dtype = torch.float32, vocab_size: int | None = None) -> Program:
    """The forward+loss program of one microbatch: forward(*params, *batch) -> (loss,).

    `build` makes the module (called under the fake mode); `batch` is forward's inputs by role;
    `decays(name, full_shape)` says which parameters take weight decay (`Param.decays`); `vocab_size`: the
    token ids' bound, which a cross-entropy over the targets must score as classes.
    """
    fake_mode = FakeTensorMode()
    with fake_mode, torch.device(device), _default_dtype(dtype):
        try:
            model = build()
        except Exception as e:
            raise ConfigError(f"the model could not be built: {failure_line(e)}") from e
        example = tuple(torch.empty(i.shape, dtype=i.dtype) for i in batch)
    _check_signature(model, [i.role for i in batch])
    printed = io.StringIO()  # what torch prints on the way: the graph traced so far, where export fails
    try:
        with _quiet(SHAPES_LOG), contextlib.redirect_stderr(printed), helper_frames_recorded():
            exported = torch.export.export(model, example)
    except Exception as e:
        data_dependent = " (code that branches on a tensor's values cannot be captured: compute both sides and " \
                         "pick with torch.where)" if "data-dependent" in str(e) else ""
        call = f"{type(model).__name__}.forward({', '.join(i.role for i in batch)})"
        raise ConfigError(f"torch.export cannot capture {call}: {failure_line(e)}{data_dependent}") from e
    sys.stderr.write(printed.getvalue())
    graph = exported.graph_module
    _check_loss(graph, type(model).__name__)
    _check_reads(graph, type(model).__name__, [i.role for i in batch], vocab_size)

    canonical = canonical_names(model)
    placeholders = list(graph.graph.find_nodes(op="placeholder"))
    params, kept, held = [], {}, {}
    for spec, node in zip(exported.graph_signature.input_specs, placeholders):
        if spec.kind == InputKind.USER_INPUT:
            continue
        if spec.kind == InputKind.CONSTANT_TENSOR and not _held(model, spec.target):  # made in forward
            _fold_constant(graph, node, exported.constants[spec.target], type(model).__name__)
            continue
        if spec.kind != InputKind.PARAMETER:  # a buffer or a tensor attribute: a constant input of its own
            held[spec.target] = node
            continue
        name = canonical[spec.target]
        if name in kept:  # second placeholder of a tied parameter
            node.replace_all_uses_with(kept[name])
            graph.graph.erase_node(node)
            continue
        kept[name] = node
        shape = tuple(node.meta["val"].shape)
        params.append(Param(name=name, full_shape=shape, decays=decays(name, shape)))
    _check_no_updates(held, type(model).__name__)
    roles = [i.role for i in batch]
    # Parameter placeholders must come first; export orders parameters, then buffers, before user inputs.
    order = list(graph.graph.find_nodes(op="placeholder"))
    if order[len(params):len(params) + len(held)] != list(held.values()) or \
            [n.target for n in order[len(params) + len(held):]] != roles:
        raise AssertionError(f"capture: expected parameters, buffers, then the user inputs {roles}; got {order}")
    with _default_dtype(dtype):
        values = held_values(build, list(held), type(model).__name__) if held else {}
    constants = {f"{HELD}{target}": values[target] for target in held}

    for node in list(graph.graph.find_nodes(op="call_function", target=torch.ops.aten._assert_tensor_metadata.default)):
        graph.graph.erase_node(node)  # export's dtype/device checks: nothing for a pass to carry around
    as_the_ops_passes_know(graph)
    graph.graph.eliminate_dead_code()
    number_reports(graph)
    graph.recompile()
    stage = Stage(index=0, graph=graph, params=params, inputs=[*constants, *roles], outputs=["loss"],
                  rank_constants=constants)
    refresh_meta(stage)
    return Program(stages=[stage], history=["capture"])


HELD = "held:"
"""The role of a tensor the model holds (a buffer): this, then its name in the model (held:blocks.0.inv_freq)."""


def _check_no_updates(held: dict[str, torch.fx.Node], model: str) -> None:
    """ConfigError for a forward that writes a buffer, or a view of one (BatchNorm's running statistics, a step
    counter): the ranks hold a buffer as a constant, so an update would be lost, silently."""
    by_line: dict[str, list[str]] = {}
    for target, node in held.items():
        if (writer := _writer(node)) is not None:
            by_line.setdefault(source_line(writer) or "a line not recorded", []).append(target)
    if by_line:
        where = "; ".join(f"{', '.join(targets)} in place at {line}" for line, targets in by_line.items())
        raise ConfigError(f"{model}.forward updates {where} (BatchNorm's running statistics, a counter): the ranks "
                          f"hold buffers as constants; use a LayerNorm or RMSNorm, or keep the state out of the "
                          f"model")


def _writer(value: torch.fx.Node) -> torch.fx.Node | None:
    """The op that writes `value` or a view of it, or None (by its schema's alias annotations; batch_norm, which
    has none, updates its running statistics in training)."""
    aliases, seen = [value], {value}
    while aliases:
        node = aliases.pop()
        for user in node.users:
            if user.target == torch.ops.aten.batch_norm.default and user.args[5] and node in user.args[3:5]:
                return user
            schema = getattr(user.target, "_schema", None)
            if schema is None:
                continue
            for i, argument in enumerate(schema.arguments):
                given = user.args[i] if i < len(user.args) else user.kwargs.get(argument.name)
                if given is not node or argument.alias_info is None:
                    continue
                if argument.alias_info.is_write:
                    return user
                if user not in seen:  # a view of it
                    seen.add(user)
                    aliases.append(user)
    return None


def _held(model: nn.Module, target: str) -> bool:
    """Whether `target` (blocks.0.scale) names a tensor the model holds, rather than one forward made."""
    owner, _, name = target.rpartition(".")
    try:
        return isinstance(getattr(model.get_submodule(owner), name), torch.Tensor)
    except AttributeError:
        return False


def _fold_constant(graph: torch.fx.GraphModule, node: torch.fx.Node, value: torch.Tensor, model: str) -> None:
    """A tensor forward made of one Python number (HF Gemma's torch.tensor(hidden ** 0.5), an index list [-2])
    or of none (the empty key and value tensors HF's DynamicCache starts from), which export lifts to an input:
    made in the graph instead (torch.full), so the program's inputs stay the parameters and the batch. One of
    more numbers is refused with its line (under the fake mode capture builds in, its numbers are unknown)."""
    if value.numel() > 1:
        line = next((where for user in node.users if (where := source_line(user))), "its line unrecorded")
        raise ConfigError(f"{model}.forward makes a tensor of {value.numel()} numbers from Python data "
                          f"(torch.tensor of a list, at {line}), which capture cannot carry to the ranks; make it "
                          f"with torch ops (torch.arange, torch.full, torch.linspace)")
    with graph.graph.inserting_before(node):
        fill = value.item() if value.numel() else 0
        made = graph.graph.call_function(torch.ops.aten.full.default, (list(value.shape), fill),
                                         {"dtype": value.dtype, "device": node.meta["val"].device})
    made.meta.update(node.meta)
    node.replace_all_uses_with(made)
    graph.graph.erase_node(node)


def _check_signature(model: nn.Module, roles: list[str]) -> None:
    """ConfigError unless forward takes the batch's inputs under their names (idx, targets), then nothing that
    lacks a default: capture calls forward(idx, targets), and the passes find each input by its name."""
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a builtin): export says what it finds
        return
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p.name for p in parameters[len(roles):] if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL,
                                                                                                  p.VAR_KEYWORD)]
    if [p.name for p in positional[:len(roles)]] != roles or required:
        given = ", ".join(p.name if p.kind != p.VAR_POSITIONAL else f"*{p.name}" for p in parameters
                          if p.kind != p.VAR_KEYWORD)
        raise ConfigError(f"{type(model).__name__}.forward({given}) must take ({', '.join(roles)}): gcompile calls "
                          f"forward({', '.join(roles)}) with the token ids and the next-token targets, and trains on "
                          f"the loss it returns; name its inputs so")


def _check_loss(graph: torch.fx.GraphModule, model: str) -> None:
    """ConfigError unless forward's (first) output is a floating-point scalar: the loss every pass, the schedule
    and the optimizer step read. A model that returns its logits instead fails later, deep inside autograd."""
    returned = graph.graph.output_node().args[0]
    if isinstance(returned, (tuple, list)) and len(returned) > 1:
        raise ConfigError(f"{model}.forward returns {len(returned)} values; return the loss alone (the mean over "
                          f"the batch's tokens; gcompile.report.report(value, name) logs others)")
    first = returned[0] if isinstance(returned, (tuple, list)) and returned else returned
    if held := not_a_loss(first):
        raise ConfigError(f"{model}.forward returns {held}, not the loss: return the scalar loss (the mean over "
                          f"the batch's tokens)")
    if (dtype := first.meta["val"].dtype) != torch.float32:
        raise ConfigError(f"{model}.forward returns a {dtype} loss: return it in float32, the dtype its "
                          f"gradient starts backward in (bf16 and fp16 runs compute the loss in float32 too)")


def _check_reads(graph: torch.fx.GraphModule, model: str, roles: list[str], vocab_size: int | None) -> None:
    """ConfigError for a forward that never reads one of its inputs (a loss that ignores the targets trains on
    nothing, silently), or whose cross-entropy scores fewer classes than there are token ids (the first batch
    with a larger id failed deep inside the loss)."""
    inputs = [n for n in graph.graph.find_nodes(op="placeholder")][-len(roles):]
    for role, node in zip(roles, inputs):
        if not node.users:
            raise ConfigError(f"{model}.forward never reads {role}: the loss must come from the model's output for "
                              f"idx, scored against targets")
    for node in graph.graph.find_nodes(op="call_function", target=torch.ops.aten.cross_entropy_loss.default):
        scores = node.args[0].meta["val"]
        classes = scores.shape[1] if scores.dim() > 1 else scores.shape[0]
        if vocab_size is not None and classes < vocab_size:
            raise ConfigError(f"{model}'s cross-entropy scores {classes} classes, but token ids go up to "
                              f"vocab_size={vocab_size} - 1: make its output head vocab_size wide")


SHAPES_LOG = "torch.fx.experimental.symbolic_shapes"
"""Where torch warns before export fails on a branch on a tensor's values (and prints the graph traced so
far): the one line capture raises names the user's line instead."""


@contextlib.contextmanager
def _quiet(name: str):
    """Torch's logger `name` says nothing below an error while this runs."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    """Build parameters in `dtype` directly (`.to()` cannot swap fake parameters)."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)
