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
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.export.graph_signature import InputKind

from gcompile.config import ConfigError
from gcompile.layout import Param
from gcompile.models.spec import Input, canonical_names
from gcompile.report import number_reports
from gcompile.program import Program, Stage, refresh_meta
from gcompile.torch_api import FakeTensorMode


def capture(build: Callable[[], nn.Module], batch: tuple[Input, ...], decays: Callable[[str, tuple[int, ...]], bool],
            device: str = "cpu", dtype: torch.dtype = torch.float32) -> Program:
    """The forward+loss program of one microbatch: forward(*params, *batch) -> (loss,).

    `build` makes the module (called under the fake mode); `batch` is forward's inputs by role;
    `decays(name, full_shape)` says which parameters take weight decay (`Param.decays`).
    """
    fake_mode = FakeTensorMode()
    with fake_mode, torch.device(device), _default_dtype(dtype):
        model = build()
        example = tuple(torch.empty(i.shape, dtype=i.dtype) for i in batch)
    exported = torch.export.export(model, example)
    graph = exported.graph_module
    _check_loss(graph, type(model).__name__)

    canonical = canonical_names(model)
    placeholders = list(graph.graph.find_nodes(op="placeholder"))
    params, kept = [], {}
    for spec, node in zip(exported.graph_signature.input_specs, placeholders):
        if spec.kind == InputKind.USER_INPUT:
            continue
        if spec.kind != InputKind.PARAMETER:
            raise NotImplementedError(f"capture: {spec.kind.name} input {spec.target} is not supported")
        name = canonical[spec.target]
        if name in kept:  # second placeholder of a tied parameter
            node.replace_all_uses_with(kept[name])
            graph.graph.erase_node(node)
            continue
        kept[name] = node
        shape = tuple(node.meta["val"].shape)
        params.append(Param(name=name, full_shape=shape, decays=decays(name, shape)))
    roles = [i.role for i in batch]
    # Parameter placeholders must come first; export orders parameters before user inputs.
    order = [n.target for n in graph.graph.find_nodes(op="placeholder")]
    if order[len(params):] != roles:
        raise AssertionError(f"capture: expected parameters, then the user inputs {roles}; got {order}")

    for node in list(graph.graph.find_nodes(op="call_function", target=torch.ops.aten._assert_tensor_metadata.default)):
        graph.graph.erase_node(node)  # export's dtype/device checks: nothing for a pass to carry around
    graph.graph.eliminate_dead_code()
    number_reports(graph)
    graph.recompile()
    stage = Stage(index=0, graph=graph, params=params, inputs=roles, outputs=["loss"])
    refresh_meta(stage)
    return Program(stages=[stage], history=["capture"])


def _check_loss(graph: torch.fx.GraphModule, model: str) -> None:
    """ConfigError unless forward's (first) output is a floating-point scalar: the loss every pass, the schedule
    and the optimizer step read. A model that returns its logits instead fails later, deep inside autograd."""
    returned = graph.graph.output_node().args[0]
    first = returned[0] if isinstance(returned, (tuple, list)) and returned else returned
    value = first.meta.get("val") if isinstance(first, torch.fx.Node) else first
    if not (isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point()):
        held = f"a {value.dtype} tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else \
            type(value).__name__
        raise ConfigError(f"{model}.forward returns {held}, not the loss: return the scalar loss (the mean over "
                          f"the batch's tokens) first")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    """Build parameters in `dtype` directly (`.to()` cannot swap fake parameters)."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)
