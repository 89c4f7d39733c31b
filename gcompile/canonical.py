"""Shape ops written other ways, rewritten at capture as the one each is, which the passes know.

Models take q, k and v apart, repeat kv heads and build masks in many ways that
are the same op:

    torch.chunk(x, n, dim)             split into parts of ceil(size / n)
    flatten, unflatten                 reshape
    broadcast_to                       expand
    slices that tile a dim             split, or split_with_sizes where unequal (qkv[..., :C], qkv[..., C:]...)
    unbind of a fused dim's view       split, each part viewed (and permuted) alike (timm's attention)
    stack                              cat of unsqueezed tensors (GPT-J's rotary)
    x.new_ones(size) and its kind      full(size): x gives only the dtype (MPT's mask)
    cat with empty tensors             cat of the others, or a clone of the one (HF's DynamicCache's empty start)
    alias (a slice of every entry)     the tensor itself (HF's x[..., :rotary_dim] of a full rotary)
    x @ W.T (+ b), W a 2-D parameter   linear(x, W, b) (Falcon's Linear, a tied head by hand)
    addmm(b, x, W), W a 2-D parameter  linear(x, W.t(), b) (HF's Conv1D, GPT-2's: its weight is (in, out))
    view(linear(view(x, (-1, C))), ...) linear(x): the rows flattened for a 2-D op, then viewed back (Conv1D's)

The passes carry a cut or the rank's tokens through the one form; the others
they refused. Each rewrite gives the same values: the graph computes what it did.
"""

import operator

import torch

aten = torch.ops.aten


def as_the_ops_passes_know(graph: torch.fx.GraphModule) -> None:
    """Each op of `graph` written another way, as the one it is (the table above), in place."""
    for node in list(graph.graph.nodes):
        x = node.args[0] if node.op == "call_function" and node.args else None
        if node.target is aten.chunk.default:
            chunks, dim = (*node.args[1:], 0)[:2]
            node.target, node.args = aten.split.Tensor, (x, -(-x.meta["val"].shape[dim] // chunks), dim)
        elif node.target in (aten.flatten.using_ints, aten.unflatten.int):
            node.target, node.args = aten.reshape.default, (x, list(node.meta["val"].shape))
        elif node.target is aten.broadcast_to.default:
            node.target = aten.expand.default
        elif node.target is aten.unbind.int:
            _unbound_as_split(graph.graph, node)
        elif node.target is aten.stack.default:
            _stack_as_cat(graph.graph, node)
        elif node.target is aten.cat.default and any(not t.meta["val"].numel() for t in node.args[0]):
            tensors = [t for t in node.args[0] if t.meta["val"].numel()] or node.args[0][:1]
            node.target, node.args = (aten.clone.default, (tensors[0],)) if len(tensors) == 1 else \
                (aten.cat.default, (tensors, *node.args[1:]))
        elif node.target in NEW_FILLED:
            fill = node.args[2] if node.target is aten.new_full.default else NEW_FILLED[node.target]
            kwargs = {"dtype": node.kwargs.get("dtype") or x.meta["val"].dtype, "device": x.meta["val"].device}
            node.target, node.args, node.kwargs = aten.full.default, (node.args[1], fill), kwargs
        elif node.target is aten.matmul.default and _transposed_parameter(node.args[1]) is not None:
            _matmul_as_linear(graph.graph, node)
        elif node.target is aten.addmm.default and _is_parameter(node.args[2]) and len(node.args) == 3 and \
                not node.kwargs:
            with graph.graph.inserting_before(node):
                transposed = graph.graph.call_function(aten.t.default, (node.args[2],))
            transposed.meta["stack_trace"] = node.meta.get("stack_trace")
            node.target, node.args = aten.linear.default, (node.args[1], transposed, node.args[0])
            _on_the_rows_as_they_were(graph.graph, node)
        elif node.target is aten.alias.default:
            node.replace_all_uses_with(x)
            graph.graph.erase_node(node)
            continue
        if isinstance(node.meta.get("val"), torch.Tensor) and len(node.users) > 1:
            _slices_as_split(graph.graph, node)


NEW_FILLED = {aten.new_zeros.default: 0, aten.new_ones.default: 1, aten.new_empty.default: 0, aten.new_full.default: None}
"""x.new_*(size, ...) -> the value it is filled with (new_full's is its argument; new_empty's any)."""


TRANSPOSES = (aten.numpy_T.default, aten.t.default, aten.transpose.int, aten.permute.default)


def _is_parameter(node) -> bool:
    """Whether `node` is a 2-D parameter: a placeholder that requires grad."""
    return isinstance(node, torch.fx.Node) and node.op == "placeholder" and node.meta["val"].dim() == 2 and \
        node.meta["val"].requires_grad


def _transposed_parameter(node: torch.fx.Node) -> torch.fx.Node | None:
    """The 2-D parameter that `node` is the transpose of, or None."""
    if not isinstance(node, torch.fx.Node) or node.target not in TRANSPOSES or not _is_parameter(node.args[0]):
        return None
    weight = node.args[0]
    swaps = node.target is aten.transpose.int and node.args[1] % 2 != node.args[2] % 2 or \
        node.target is aten.permute.default and [d % 2 for d in node.args[1]] == [1, 0] or \
        node.target in (aten.numpy_T.default, aten.t.default)
    return weight if swaps else None


def _matmul_as_linear(graph: torch.fx.Graph, matmul: torch.fx.Node) -> None:
    """x @ W.T -> linear(x, W); a 1-D parameter added right after, its only reader, becomes the bias."""
    x, weight = matmul.args[0], _transposed_parameter(matmul.args[1])
    matmul.target, matmul.args = aten.linear.default, (x, weight)
    (user, *others) = list(matmul.users) or [None]
    if user is not None and not others and user.target is aten.add.Tensor and user.args[0] is matmul and \
            isinstance(bias := user.args[1], torch.fx.Node) and bias.op == "placeholder" and \
            tuple(bias.meta["val"].shape) == tuple(matmul.meta["val"].shape[-1:]):
        matmul.args = (x, weight, bias)
        user.replace_all_uses_with(matmul)
        graph.erase_node(user)


VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
"""The views a pass follows a cut or the tokens' dim through."""


def _on_the_rows_as_they_were(graph: torch.fx.Graph, linear: torch.fx.Node) -> None:
    """linear(x.view(-1, C)).view(*x.shape[:-1], out) -> linear(x): a linear works on any leading dims, and the
    passes follow the tokens' dim through it, where rows of batch and tokens merged they could not."""
    flat, users = linear.args[0], list(linear.users)
    if flat.target not in VIEWS or len(users) != 1 or users[0].target not in VIEWS:
        return
    x, back = flat.args[0], users[0]
    if tuple(back.meta["val"].shape) != (*x.meta["val"].shape[:-1], linear.meta["val"].shape[-1]):
        return
    linear.args = (x, *linear.args[1:])
    linear.meta["val"] = back.meta["val"]
    back.replace_all_uses_with(linear)
    graph.erase_node(back)


def _stack_as_cat(graph: torch.fx.Graph, stack: torch.fx.Node) -> None:
    """torch.stack(tensors, dim): each tensor unsqueezed at dim, joined along it."""
    tensors, dim = (*stack.args, 0)[:2]
    dim %= tensors[0].meta["val"].dim() + 1
    with graph.inserting_before(stack):
        parts = [graph.call_function(aten.unsqueeze.default, (t, dim)) for t in tensors]
    for part in parts:
        part.meta["stack_trace"] = stack.meta.get("stack_trace")
    stack.target, stack.args = aten.cat.default, (parts, dim)


def _slices_as_split(graph: torch.fx.Graph, x: torch.fx.Node) -> None:
    """`x` read only as slices that tile one dim (q, k, v as qkv[..., :C], qkv[..., C:2C], qkv[..., 2C:]; Phi-3's
    of grouped kv heads, unequal): a split into those parts."""
    if any(s.target is not aten.slice.Tensor or s.args[0] is not x for s in x.users):
        return
    shape = x.meta["val"].shape
    taken = {}  # (dim, start, end, step) -> the slice
    for s in x.users:
        dim, start, end, step = (*s.args[1:], *(0, None, None, 1)[len(s.args) - 1:])
        taken[dim % len(shape), start or 0, min(shape[dim], shape[dim] if end is None else end), step] = s
    dims = {dim for dim, _, _, _ in taken}
    bounds = sorted(key[1:] for key in taken)
    starts, ends, steps = zip(*bounds)
    if len(dims) != 1 or len(taken) != len(x.users) or set(steps) != {1} or starts[0] != 0 or \
            ends[-1] != shape[next(iter(dims))] or list(starts[1:]) != list(ends[:-1]):
        return
    sizes = [end - start for start, end, _ in bounds]
    with graph.inserting_after(x):
        split = graph.call_function(aten.split.Tensor, (x, sizes[0], dims.pop())) if len(set(sizes)) == 1 else \
            graph.call_function(aten.split_with_sizes.default, (x, sizes, dims.pop()))
    split.meta["stack_trace"] = next(iter(x.users)).meta.get("stack_trace")
    for (_, start, _, _), s in taken.items():
        s.target, s.args = operator.getitem, (split, starts.index(start))


def _unbound_as_split(graph: torch.fx.Graph, unbind: torch.fx.Node) -> None:
    """A fused dim viewed as (..., k, n, ...) and taken apart on k by unbind, maybe after a permute (timm's
    attention: qkv.reshape(B, T, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)): a split of the fused dim into k
    parts, each viewed as (..., n, ...) and permuted alike."""
    permute = unbind.args[0] if unbind.args[0].target is aten.permute.default else None
    view = (permute or unbind).args[0]
    if view.target not in (aten.view.default, aten.reshape.default) or len(view.users) != 1 or \
            permute is not None and len(permute.users) != 1:
        return
    x, shape = view.args[0], list(view.meta["val"].shape)
    whole = list(x.meta["val"].shape)
    at = len(whole) - 1  # the fused dim: the last, viewed as (k, n, ...) from `at` on
    order = [d % len(shape) for d in permute.args[1]] if permute is not None else list(range(len(shape)))
    if shape[:at] != whole[:at] or order[(*unbind.args, 0)[1] % len(shape)] != at or \
            any(user.target is not operator.getitem for user in unbind.users):
        return
    with graph.inserting_before(unbind):
        made = [graph.call_function(aten.split.Tensor, (x, whole[at] // shape[at], at))]
        for user in list(unbind.users):
            made.append(graph.call_function(operator.getitem, (made[0], user.args[1])))
            made.append(graph.call_function(aten.reshape.default, (made[-1], shape[:at] + shape[at + 1:])))
            if permute is not None:
                made.append(graph.call_function(aten.permute.default,
                                                (made[-1], [d - (d > at) for d in order if d != at])))
            user.replace_all_uses_with(made[-1])
            graph.erase_node(user)
    for node in made:
        node.meta["stack_trace"] = unbind.meta.get("stack_trace")
    for node in (unbind, permute, view):
        if node is not None:
            graph.erase_node(node)
