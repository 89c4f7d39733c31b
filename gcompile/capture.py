"""torch.export of the single-device GPT + loss into a one-stage Program.

The model is built and traced under a fake tensor mode, so capture allocates no
weights: a 1.3B-parameter layout can be inspected on a laptop. Capture runs on the
device the program will run on, because attention lowers differently per device
(on CPU, SDPA becomes `_scaled_dot_product_flash_attention_for_cpu`).

Tied `wte`/`lm_head`: export may show the tied weight as two placeholders. We keep
one, named `transformer.wte.weight`, used by both the embedding and the head;
autograd then sums the two gradient contributions as eager does.
"""

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export.graph_signature import InputKind

from gcompile.layout import Param
from gcompile.model import GPT, GPTConfig
from gcompile.program import Program, Stage, refresh_meta


def capture(config: GPTConfig, micro_batch_size: int, seq_length: int,
            device: str = "cpu", dtype: torch.dtype = torch.float32) -> Program:
    """The forward+loss program of one microbatch: forward(*params, idx, targets) -> (loss,)."""
    fake_mode = FakeTensorMode()
    with fake_mode, torch.device(device), _default_dtype(dtype):
        model = GPT(config).train(config.dropout > 0)
        idx = torch.empty((micro_batch_size, seq_length), dtype=torch.long)
        targets = torch.empty((micro_batch_size, seq_length), dtype=torch.long)
    exported = torch.export.export(model, (idx, targets))
    graph = exported.graph_module

    canonical = _canonical_names(model)
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
        params.append(Param(name=name, full_shape=tuple(node.meta["val"].shape)))
    inputs = [n.name for n in placeholders if n.name in ("idx", "targets")]
    if inputs != ["idx", "targets"]:
        raise AssertionError(f"capture: expected user inputs idx, targets; got {inputs}")
    # Parameter placeholders must come first; export orders parameters before user inputs.
    order = [n.target for n in graph.graph.find_nodes(op="placeholder")]
    if order[-2:] != ["idx", "targets"]:
        raise AssertionError(f"capture: unexpected placeholder order {order}")

    for node in list(graph.graph.find_nodes(op="call_function", target=torch.ops.aten._assert_tensor_metadata.default)):
        graph.graph.erase_node(node)  # export's dtype/device checks: nothing for a pass to carry around
    graph.graph.eliminate_dead_code()
    graph.recompile()
    stage = Stage(index=0, graph=graph, params=params, inputs=inputs, outputs=["loss"])
    refresh_meta(stage)
    return Program(stages=[stage], history=["capture"])


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    """Build parameters in `dtype` directly (`.to()` cannot swap fake parameters)."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def _canonical_names(model: GPT) -> dict[str, str]:
    """Every parameter name, tied aliases included -> the name nanoGPT's state dict uses first."""
    first_name = {id(p): name for name, p in reversed(list(model.named_parameters(remove_duplicate=False)))}
    return {name: first_name[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}
