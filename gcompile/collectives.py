"""The one place that names torch's functional collectives.

Graphs refer to process groups by name; every rank registers its own groups
under role names ("tp", "dp", "mp", ...; see gcompile.mesh), so the same graph
text is right on every rank and compiles once. The ops are private torch API:
a torch upgrade that moves them touches this file only.
"""

import torch
import torch.distributed as dist

from gcompile.torch_api import is_op_overload, register_work, resolve_process_group

_ops = torch.ops._c10d_functional


@torch.library.custom_op("gcompile::ring_shift", mutates_args=())
def _ring_shift(input: torch.Tensor, group_name: str, note: str) -> torch.Tensor:
    """Send `input` to the next rank of the group, receive the previous rank's; `wait` before reading. One
    op for every rank (the peers come from the group at run time), so the graph text stays the same; torch's
    functional all_to_all_single would bake each rank's split sizes into its graph. `note` says which
    transfer it is (shown in dumps); it also keeps the compiler from merging a backward transfer with the
    forward one of the same tensor, which would hold every block from forward to backward."""
    group = resolve_process_group(group_name)
    rank, n = group.rank(), group.size()
    out = input.new_empty(input.shape)  # contiguous: what arrives is the sender's contiguous copy
    send, receive = [0] * n, [0] * n
    send[(rank + 1) % n] = receive[(rank - 1) % n] = input.shape[0]
    sent = input.clone(memory_format=torch.contiguous_format)  # the compiler may reuse `input`'s memory at once
    register_work(out, dist.all_to_all_single(out, sent, receive, send, group=group, async_op=True))
    return out


@_ring_shift.register_fake
def _(input: torch.Tensor, group_name: str, note: str) -> torch.Tensor:
    return input.new_empty(input.shape)


RING_SHIFT = torch.ops.gcompile.ring_shift.default


@torch.library.custom_op("gcompile::all_to_all_rows", mutates_args=())
def _all_to_all_rows(input: torch.Tensor, send_counts: torch.Tensor, receive_counts: torch.Tensor, rows: int,
                     group_name: str) -> torch.Tensor:
    """Rank r sends its next send_counts[j] rows (from the top of `input`) to rank j and receives
    receive_counts[j] rows from each j, in rank order, into the top of a (rows, ...) result whose other rows
    are zero; `wait` before reading. The counts are data (tensors, read on the host here), so the graph
    keeps static shapes whatever the split: `rows` is the most that can arrive."""
    group = resolve_process_group(group_name)
    send, receive = send_counts.tolist(), receive_counts.tolist()
    out = input.new_zeros((rows, *input.shape[1:]))
    sent = input[:sum(send)].contiguous().clone()  # private: the compiler may reuse `input`'s memory at once
    register_work(out, dist.all_to_all_single(out[:sum(receive)], sent, receive, send, group=group, async_op=True))
    return out


@_all_to_all_rows.register_fake
def _(input, send_counts, receive_counts, rows, group_name):
    return input.new_empty((rows, *input.shape[1:]))


def _all_to_all_rows_setup(ctx, inputs, output):
    input, send_counts, receive_counts, rows, group_name = inputs
    ctx.save_for_backward(send_counts, receive_counts)
    ctx.input_rows, ctx.group_name = input.shape[0], group_name


def _all_to_all_rows_backward(ctx, grad):
    """The rows go back the way they came: each sender gets the gradient of what it sent."""
    send_counts, receive_counts = ctx.saved_tensors
    back = _ops.wait_tensor(ALL_TO_ALL_ROWS(grad, receive_counts, send_counts, ctx.input_rows, ctx.group_name))
    return back, None, None, None, None


_all_to_all_rows.register_autograd(_all_to_all_rows_backward, setup_context=_all_to_all_rows_setup)
ALL_TO_ALL_ROWS = torch.ops.gcompile.all_to_all_rows.default


def is_collective(target) -> bool:
    """Whether a graph node's target talks to other ranks (a functional collective or one of ours)."""
    return target in (RING_SHIFT, ALL_TO_ALL_ROWS) or (is_op_overload(target) and target.namespace == "_c10d_functional")


def all_reduce(x: torch.Tensor, group: str, op: str = "sum") -> torch.Tensor:
    return _ops.wait_tensor(_ops.all_reduce(x, op, group))


def sum_counts(count: torch.Tensor, group: str) -> torch.Tensor:
    """Integer counts (a MoE layer's tokens per expert) summed over `group`: what each rank counted over its share
    of the tokens, made the micro-batch's; no gradient. An all-reduce by a name of its own, which the passes
    that split tokens recognise (one does not sum again what another summed) and dumps show."""
    return all_reduce(count, group)


def start_all_reduce(x: torch.Tensor, group: str, op: str = "sum") -> torch.Tensor:
    """Issue an all-reduce and return at once; `wait` before reading the result (lets several overlap)."""
    return _ops.all_reduce(x, op, group)


def start_reduce_scatter(x: torch.Tensor, group: str, group_size: int, op: str = "sum") -> torch.Tensor:
    """Sum `x` over `group`, this rank keeping its 1/n slice of dim 0; `wait` before reading."""
    return _ops.reduce_scatter_tensor(x.contiguous(), op, group_size, group)


def start_all_gather(x: torch.Tensor, group: str, group_size: int) -> torch.Tensor:
    """Every rank's `x` concatenated along dim 0 in rank order; `wait` before reading."""
    return _ops.all_gather_into_tensor(x.contiguous(), group_size, group)


def start_ring_shift(x: torch.Tensor, group: str, note: str) -> torch.Tensor:
    """The previous rank's `x` (rank r sends to r+1, the last to the first); `wait` before reading."""
    return RING_SHIFT(x, group, note)


def all_to_all_rows(x: torch.Tensor, send_counts: torch.Tensor, receive_counts: torch.Tensor, rows: int,
                    group: str) -> torch.Tensor:
    """Rows of `x` exchanged by per-rank counts (see `gcompile::all_to_all_rows`), differentiable, waited."""
    return _ops.wait_tensor(ALL_TO_ALL_ROWS(x, send_counts, receive_counts, rows, group))


def all_to_all(x: torch.Tensor, group: str, group_size: int) -> torch.Tensor:
    """Equal pieces of dim 0 exchanged: rank r's j-th piece becomes rank j's r-th (no gradient)."""
    split = [x.shape[0] // group_size] * group_size
    return _ops.wait_tensor(_ops.all_to_all_single(x.contiguous(), split, split, group))


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


def exchange(x: torch.Tensor, group: str, group_size: int, split: int, join: int) -> torch.Tensor:
    """`x` cut into n pieces along `split`, piece j to rank j of `group`; the pieces received joined along `join`
    in rank order (one all-to-all)."""
    pieces = torch.stack(x.chunk(group_size, dim=split))  # (n, ...): dim 0 is what all_to_all exchanges
    return torch.cat(all_to_all(pieces, group, group_size).unbind(0), dim=join)


def collective_nodes(gm) -> list[tuple["torch.fx.Node", str, dict]]:
    """(node, op name, arguments by schema name) of every functional collective call in a graph,
    in graph order; their wait_tensor calls are left out."""
    found = []
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not is_collective(target) or target._opname == "wait_tensor":
            continue
        found.append((node, target._opname, dict(zip((a.name for a in target._schema.arguments), node.args))))
    return found
