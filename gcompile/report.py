"""Values a model reports beside its loss (routing statistics, the load-balancing loss), out of the graphs.

A model calls `report(x, name)` on a value it wants logged: the identity in eager,
an opaque node in the captured graph that every pass carries along. At capture the
model's reports of one name are numbered in forward order (`number_reports`, so
that a pipeline stage knows which layers' values it holds); just before lowering
`to_outputs` makes each an extra output of its stage, after the others and
detached, so no gradient flows back through it and backward takes no tangent for
it:

    before    n = gcompile.report(per_expert, "tokens per expert")   ...uses of n
    after     ...uses of per_expert;  outputs (*outputs, detach(per_expert))
              role "metric:tokens per expert:3/8" (the 4th of the model's 8)

The runtime keeps them per microbatch (Runtime.metrics) and the training loop logs
them; the model itself stays plain PyTorch.
"""

import torch
import torch.fx as fx

PREFIX = "metric:"


@torch.library.custom_op("gcompile::report", mutates_args=())
def _report(x: torch.Tensor, name: str) -> torch.Tensor:
    return x.clone()


@_report.register_fake
def _(x, name):
    return torch.empty_like(x)


_report.register_autograd(lambda ctx, grad: (grad, None), setup_context=lambda ctx, inputs, output: None)
REPORT = torch.ops.gcompile.report.default


def report(x: torch.Tensor, name: str) -> torch.Tensor:
    """`x`, which the training loop logs under `name` (once per call, in forward order)."""
    return REPORT(x, name)


def is_metric(role: str) -> bool:
    return role.startswith(PREFIX)


def parse(role: str) -> tuple[str, int, int]:
    """"metric:NAME:I/N" -> (NAME, I, N)."""
    name, _, position = role[len(PREFIX):].rpartition(":")
    index, _, total = position.partition("/")
    return name, int(index), int(total)


def number_reports(gm: fx.GraphModule) -> None:
    """Mark every report node of the whole model with its place among the reports of its name."""
    nodes = list(gm.graph.find_nodes(op="call_function", target=REPORT))
    totals = {}
    for node in nodes:
        totals[node.args[1]] = totals.get(node.args[1], 0) + 1
    seen = {}
    for node in nodes:
        name = node.args[1]
        node.meta["report"] = f"{PREFIX}{name}:{seen.setdefault(name, 0)}/{totals[name]}"
        seen[name] += 1


def reported(gm: fx.GraphModule) -> tuple[tuple[str, tuple[int, ...], bool], ...]:
    """(role, shape, whether it is a count: an integer value) of every report of a numbered whole-model
    graph, in forward order."""
    return tuple((node.meta["report"], tuple(node.meta["val"].shape), not node.meta["val"].is_floating_point())
                 for node in gm.graph.find_nodes(op="call_function", target=REPORT))


def to_outputs(gm: fx.GraphModule, outputs: list[str]) -> list[str]:
    """Turn `gm`'s report nodes into detached extra outputs (in place); the output roles after."""
    graph, output = gm.graph, gm.graph.output_node()
    values, roles = list(output.args[0]), list(outputs)
    for node in list(graph.find_nodes(op="call_function", target=REPORT)):
        value = node.args[0]
        with graph.inserting_before(output):
            values.append(graph.call_function(torch.ops.aten.detach.default, (value,)))
        roles.append(node.meta["report"])
        node.replace_all_uses_with(value)
        graph.erase_node(node)
    output.args = (tuple(values),)
    gm.recompile()
    return roles
