"""The one place that names torch's functional collectives.

Graphs refer to process groups by name; every rank registers its own groups
under role names ("tp", "dp", "mp", ...; see gcompile.mesh), so the same graph
text is right on every rank and compiles once. The ops are private torch API:
a torch upgrade that moves them touches this file only.
"""

import torch

from gcompile.torch_api import is_op_overload

_ops = torch.ops._c10d_functional


def all_reduce(x: torch.Tensor, group: str, op: str = "sum") -> torch.Tensor:
    return _ops.wait_tensor(_ops.all_reduce(x, op, group))


def start_all_reduce(x: torch.Tensor, group: str, op: str = "sum") -> torch.Tensor:
    """Issue an all-reduce and return at once; `wait` before reading the result (lets several overlap)."""
    return _ops.all_reduce(x, op, group)


def start_reduce_scatter(x: torch.Tensor, group: str, group_size: int, op: str = "sum") -> torch.Tensor:
    """Sum `x` over `group`, this rank keeping its 1/n slice of dim 0; `wait` before reading."""
    return _ops.reduce_scatter_tensor(x.contiguous(), op, group_size, group)


def start_all_gather(x: torch.Tensor, group: str, group_size: int) -> torch.Tensor:
    """Every rank's `x` concatenated along dim 0 in rank order; `wait` before reading."""
    return _ops.all_gather_into_tensor(x.contiguous(), group_size, group)


def wait(x: torch.Tensor) -> torch.Tensor:
    return _ops.wait_tensor(x)


def all_gather(x: torch.Tensor, group: str, group_size: int, dim: int = 0) -> torch.Tensor:
    """Pieces of `x` from every rank of `group`, concatenated along `dim` in rank order."""
    out = _ops.wait_tensor(_ops.all_gather_into_tensor(x.contiguous(), group_size, group))  # (n*d0, ...)
    if dim == 0:
        return out
    return torch.cat(out.chunk(group_size, dim=0), dim=dim)


def reduce_scatter(x: torch.Tensor, group: str, group_size: int, dim: int = 0, op: str = "sum") -> torch.Tensor:
    """Sum over `group`, each rank keeping its 1/n slice along `dim`."""
    if dim != 0:
        x = torch.cat(x.chunk(group_size, dim=dim), dim=0)
    return _ops.wait_tensor(_ops.reduce_scatter_tensor(x.contiguous(), op, group_size, group))


def collective_nodes(gm) -> list[tuple["torch.fx.Node", str, dict]]:
    """(node, op name, arguments by schema name) of every functional collective call in a graph,
    in graph order; their wait_tensor calls are left out."""
    found = []
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not is_op_overload(target) or \
                target.namespace != "_c10d_functional" or target._opname == "wait_tensor":
            continue
        found.append((node, target._opname, dict(zip((a.name for a in target._schema.arguments), node.args))))
    return found
