"""A MoE layer's routing on a rank's share of the tokens: the rules the passes that split tokens share.

Context parallel (over cp) and sequence parallel (over tp) give a rank some tokens of
every sample. A mixture-of-experts layer (gcompile/models/moe.py) works on tokens as
rows: it flattens them (B*T rows; k routed copies each), sorts the copies by expert,
runs each expert's rows through a grouped matmul and adds the results back to their
tokens. Every step is exact on the rank's own tokens, as long as the indices it sorts
and picks by are indices among the rank's rows, and the counts it splits the rows by
are the rank's:

    view(x, [B*T, C])                     view(x, [B*T/n, C])      # rows merge B and T, come apart again
    topk, softmax, cumsum, one_hot        unchanged along any dim but the tokens'
    argsort(routed)                       the order among the rank's rows
    index_select / index_add by it        pick and place the rank's rows
    grouped_mm(rows, w, ends)             ends: the rank's tokens per expert
    sum(one_hot(routed), [0])  (a count)  the rank's where it routes; the micro-batch's (`whole_count`) elsewhere
    mean(probs, [0])           (a mean)   the rank's; each pass says what it then means (`rank_mean`)

A pass mixes `TokenRows` into the class that follows the rank's tokens through a
stage: `dims[node]` is where a value holds them, `merged[node]` what that dim merged.
"""

import math

import torch
import torch.fx as fx

from gcompile import collectives, tp_ops
from gcompile.models import moe  # noqa: F401  registers gcompile::grouped_mm, the experts' op
from gcompile.report import REPORT
from passes.rewrite import GraphMismatch, insert_call
from passes.tensor_parallel import SPLITS, full_shape, is_elementwise

aten = torch.ops.aten

ALONG = {aten.softmax.int: lambda node: node.args[1], aten._softmax.default: lambda node: node.args[1],
         aten.log_softmax.int: lambda node: node.args[1], aten._log_softmax.default: lambda node: node.args[1],
         tp_ops.vocab_parallel_log_softmax: lambda node: node.args[1], aten.cumsum.default: lambda node: node.args[1],
         aten.topk.default: lambda node: (*node.args, -1)[2],
         aten.argsort.stable: lambda node: node.kwargs.get("dim", -1)}
"""Ops along one dim, by how to read that dim."""
REORDERS = (aten.transpose.int, aten.permute.default, aten.expand.default)
"""Ops that move the tokens' dim with its entries (`TokenRows.reorder`)."""
APART = (*SPLITS, aten.slice.Tensor, aten.select.int, aten.cat.default)
"""Ops that take values apart or join them, along another dim than the tokens' (`TokenRows.along_other_dim`)."""
ROUTING = (aten.one_hot.default, aten.zeros_like.default)
"""Ops whose output holds the rank's rows where their input does (one more dim for one_hot)."""
GROUPED_MM = torch.ops.gcompile.grouped_mm.default


class TokenRows:
    """The rules; the class mixing them in sets `name` (its pass), `group` (the ranks that split the tokens), `n`,
    `dims`, `merged`, `counts` and `totals`, and says what a reported count (`report_count`) and a mean over the
    rank's tokens (`rank_mean`) become."""

    name: str
    group: str
    n: int
    dims: dict[fx.Node, int]
    """The dim where each value holds the rank's tokens."""
    merged: dict[fx.Node, tuple[int, int]]
    """(outer, inner) of a tokens' dim merged with others: it holds outer x T x inner entries (B*T rows of
    tokens, k routed copies of each); absent, (1, 1)."""
    counts: set[fx.Node]
    """Integer sums over the rank's tokens (a MoE layer's tokens per expert), and what routing makes of them."""
    totals: dict[fx.Node, fx.Node]
    """A count summed over `group` (the micro-batch's), made once."""
    keeps_counts: tuple = ()
    """Ops that leave a count the rank's own (another pass's sum over its group, already applied)."""

    def whole_count(self, count: fx.Node, reader: fx.Node) -> fx.Node:
        """The micro-batch's count: the ranks' of `group` summed (made before `reader`, its first reader)."""
        if count not in self.totals:
            self.totals[count] = insert_call(reader, collectives.sum_counts, (count, self.group), self.name,
                                             before=True)
        return self.totals[count]

    def report_count(self, report: fx.Node) -> None:
        raise NotImplementedError

    def rank_mean(self, mean: fx.Node) -> None:
        raise NotImplementedError

    def token_view(self, node: fx.Node, dim: int) -> None:
        """The tokens' dim may merge with the dims around it (B*T rows, the k copies of each) and come apart from
        them again, never be split itself; the view gets the rank's size there."""
        shape_in, shape_out = full_shape(node.args[0]), full_shape(node)
        outer, inner = self.merged.get(node.args[0], (1, 1))
        seq = shape_in[dim] // (outer * inner)
        before, after = math.prod(shape_in[:dim]) * outer, inner * math.prod(shape_in[dim + 1:])
        for at, size in enumerate(shape_out):
            pre, post = math.prod(shape_out[:at]), math.prod(shape_out[at + 1:])
            if before % pre == 0 and after % post == 0 and size == before // pre * seq * (after // post):
                break
        else:
            raise GraphMismatch(self.name, node, f"reshapes {list(shape_in)} to {list(shape_out)}, which does not "
                                                 f"keep the sequence dim {dim} whole")
        node.args = (node.args[0], [n // self.n if i == at else n for i, n in enumerate(shape_out)])
        self.dims[node] = at
        if (before // pre, after // post) != (1, 1):
            self.merged[node] = before // pre, after // post

    def reorder(self, node: fx.Node, dim: int) -> None:
        """transpose and permute move the tokens' dim with its entries; expand adds dims before it and keeps its
        local size (GQA's kv heads expanded over the query heads they serve)."""
        x = node.args[0]
        ndim = len(full_shape(x))
        if node.target is aten.transpose.int:
            d0, d1 = node.args[1] % ndim, node.args[2] % ndim
            self.dims[node] = {d0: d1, d1: d0}.get(dim, dim)
        elif node.target is aten.permute.default:
            self.dims[node] = [d % ndim for d in node.args[1]].index(dim)
        else:
            sizes = node.args[1]
            at = dim + len(sizes) - ndim
            node.args = (x, [n // self.n if i == at and n != -1 else n for i, n in enumerate(sizes)],
                         *node.args[2:])
            self.dims[node] = at

    def along_other_dim(self, node: fx.Node, dim: int) -> None:
        """split, slice, select or cat along another dim than the tokens' (q, k and v apart, rotate_half; Falcon's
        and BLOOM's q, k and v picked from a fused dim): the tokens stay where they are, a dim before them fewer
        after a select."""
        x = node.args[0][0] if node.target is aten.cat.default else node.args[0]
        ndim, out = len(full_shape(x)), dim
        if node.target is aten.cat.default:
            tensors, at = (*node.args, 0)[:2]
            crosses = any(self.dims.get(t) != dim for t in tensors) or at % ndim == dim
        elif node.target is aten.slice.Tensor:
            crosses = full_shape(node)[dim] != full_shape(x)[dim]
        elif node.target is aten.select.int:
            crosses, out = node.args[1] % ndim == dim, dim - (node.args[1] % ndim < dim)
        else:
            crosses = (*node.args, 0)[2] % ndim == dim
        if crosses:
            raise GraphMismatch(self.name, node, f"splits, slices, selects or joins along the sequence dim {dim}, or "
                                                 f"joins values that do not all hold the rank's tokens there")
        self.dims[node] = out

    def inherit_merged(self, node: fx.Node) -> None:
        """`node` holds the rank's tokens as the first input whose tokens' dim has its size (any, for an op that
        returns several values or a part of them)."""
        if node in self.merged:
            return
        for a in [a for a in node.all_input_nodes if a in self.merged]:
            several = not all(isinstance(v.meta["val"], torch.Tensor) for v in (a, node))
            if several or full_shape(a)[self.dims[a]] == full_shape(node)[self.dims[node]]:
                self.merged[node] = self.merged[a]
                return

    def along(self, node: fx.Node, dim: int) -> None:
        """An op along one dim (top-k of the router's logits, softmax, a cumulative sum, argsort): along any
        other than the tokens', token by token; argsort along the rank's rows gives their order among
        themselves, which `index` lets only pick and place the rank's rows."""
        along = ALONG[node.target](node) % len(full_shape(node.args[0]))
        if along == dim and node.target is not aten.argsort.stable:
            raise GraphMismatch(self.name, node, f"works along the sequence dim {dim}, across other ranks' tokens")
        self.dims[node] = dim

    def index(self, node: fx.Node) -> None:
        """index_select(x, d, i) and index_add(x, d, i, src) where `i` picks the rank's rows (MoE routing): `x`
        either holds the rank's tokens on d too (their rows, reordered) or is a table every rank has whole (the
        experts' biases by expert). An index every rank has whole picks along another dim of the rank's tokens."""
        x, at, index = node.args[:3]
        at %= len(full_shape(x))
        if index not in self.dims and node.target is aten.index_select.default and self.dims.get(x, at) != at:
            self.dims[node] = self.dims[x]
            return
        tracked = [a for a in node.args[:1] + node.args[3:] if isinstance(a, fx.Node) and a in self.dims]
        if index not in self.dims or any(self.dims[a] != at for a in tracked) or \
                node.target is aten.index_add.default and len(tracked) != 2:
            raise GraphMismatch(self.name, node, "indexes the rank's tokens other than by their own rows (MoE "
                                                 "routing picks rows and adds them back by indices among the "
                                                 "rank's rows)")
        self.dims[node] = at

    def grouped_mm(self, node: fx.Node) -> None:
        """A MoE layer's experts over the rank's routed rows, split by the rank's counts."""
        rows, weight, ends = node.args
        if self.dims.get(rows) != 0 or weight in self.dims or ends in self.dims:
            raise GraphMismatch(self.name, node, "runs experts over values other than the rank's routed rows")
        self.dims[node] = 0

    def reduce(self, node: fx.Node) -> None:
        """A sum or mean over the rank's tokens: an integer sum is a count (a MoE layer's tokens per expert), a
        mean the rank's mean (`rank_mean`); a floating sum is refused."""
        if node.target is aten.sum.dim_IntList and not node.meta["val"].dtype.is_floating_point:
            self.counts.add(node)
        elif node.target in (aten.mean.dim, aten.mean.default):
            self.rank_mean(node)
        else:
            raise GraphMismatch(self.name, node, f"sums over dims {node.args[1]}, which include the sequence dim; "
                                                 f"a pass that splits the tokens knows counts (integer sums) and "
                                                 f"means over them")

    def read_count(self, node: fx.Node) -> None:
        """`node` reads a count over the rank's tokens. Routing keeps the rank's own: its offsets (a cumulative
        sum, an integer conversion) and the grouped matmuls they split (`grouped_mm`). Anything else (the
        load-balancing loss's share per expert) reads the micro-batch's count, as one device counts."""
        if self.routes(node):
            self.counts.add(node)
        elif node.target is REPORT:
            self.report_count(node)
        else:
            for count in [a for a in node.all_input_nodes if a in self.counts]:
                node.replace_input_with(count, self.whole_count(count, node))

    def routes(self, node: fx.Node) -> bool:
        """Whether `node` makes routing's offsets of a count (a cumulative sum, an integer conversion)."""
        integer = isinstance(node.meta.get("val"), torch.Tensor) and not node.meta["val"].dtype.is_floating_point
        return integer and node.target in (aten.cumsum.default, aten.to.dtype, aten._to_copy.default,
                                           *self.keeps_counts)

    def is_reduction_of_tokens(self, node: fx.Node, dim: int | None) -> bool:
        if node.target is aten.mean.default:  # over every dim
            return dim is not None
        return node.target in (aten.sum.dim_IntList, aten.mean.dim) and dim is not None and \
            any(d % len(full_shape(node.args[0])) == dim for d in node.args[1])
