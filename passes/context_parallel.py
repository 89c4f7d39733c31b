"""Context parallelism (Megatron-Core's) as a rewrite of the forward program.

Every cp rank holds T/cp tokens of every sample in the load-balanced layout of
gcompile/cp_ops.py (chunks i and 2cp-1-i of 2cp). Everything but attention works
token by token, so it runs unchanged on the rank's tokens; attention sees every
rank's keys and values by cp_comm_type (p2p: a ring of K/V blocks; all_gather:
K and V gathered, masked by global positions; a2a: all-to-alls to 1/cp of the
heads over the whole sequence), which gives the exact single-device result.
Each rank's loss is the mean over its tokens, weighted by its share of the micro-batch's
counted tokens (those whose target is not ignore_index; equal shares where none is
ignored), so averaging parameter gradients over dp_cp (data_parallel) gives the
single-device gradient.

Requires: the whole model in one stage (runs after tensor_parallel and sequence_parallel,
  before pipeline_split); "idx" and
  "targets" are (B, T) inputs; every op that reads the rank's tokens is one this
  pass knows to be token-wise, a view or transpose that keeps the sequence dim
  whole, attention (an explicit mask only whole, made of positions, and not with p2p; written by
  hand, q @ k^T then element-wise ops and a softmax over the keys then @ v, not with p2p), the mean or
  summed cross-entropy or nll_loss
  and a logsumexp or gather over the vocab (tensor parallel's vocab-parallel ops included),
  or a MoE layer's routing (rows picked and
  placed by their indices among the rank's rows, counts, and means the loss is linear
  in); anything else is refused with the node,
  its op and its source line. seq_length is divisible by 2 * cp, and by 2 * cp * tp under
  sequence parallel (config.validate), whose cuts then split the rank's tokens over tp.
Ensures: every value derived from the batch holds the rank's T/cp tokens; a value
  every rank computes whole (positions, a position embedding, RoPE's cos/sin) is
  cut to the rank's tokens where it meets them, so each token keeps its global
  position; the graph text is the same on every cp rank (`cp_rank` is a rank
  constant); nodes it makes carry `meta["pass"] == "context_parallel"`.

Rewrite (n = cp, P = the rank's global positions, T/n of them):

    before                                     after
    idx, targets                 # (B,T)       local_tokens(idx, 1, n, cp_rank)       # (B,T/n)
    add(tok, wpe(arange(T)))     # (T,C)       add(tok, local_tokens(wpe(arange(T)), 0, n, cp_rank))
    mul(q, cos)                  # cos (T,hs)  mul(q, local_tokens(cos, 0, n, cp_rank))
    view(x, [B, T, nh, hs])                    view(x, [B, T/n, nh, hs])
    sdpa(q, k, v, is_causal)     # (B,nh,T,hs) attention(q, k, v, n, mask, ...)   # all-gather K, V; mask:
                                               mask = causal_mask(T, n, cp_rank)  # P >= key positions, one per stage
                                               heads_attention(q, k, v, n, ...)  # a2a: all-to-alls to 1/n of the
                                                                                 # heads over all T, and back
    s = matmul(q, kt)            # by hand     s = matmul(to_heads(q, 2, n), to_heads(kt, 3, n))   # a2a
    p = softmax(tanh(s) + b)                   p = softmax(tanh(s) + rank_part(b, 1, n, cp_rank))  # b per head
    matmul(p, v)                               to_tokens(matmul(p, to_heads(v, 2, n)), 2, n)
                                               s = matmul(q, gather(kt, 3, n))                     # all_gather
                                               p = softmax(tanh(s) + gathered_mask(b, n, cp_rank))
                                               matmul(p, gather(v, 2, n))
    cross_entropy_loss(z, t)                   cross_entropy_loss(z, t) * share   # the mean over the rank's tokens,
                                                                          # by its share of the counted ones
    cross_entropy_loss(z, t, None, 2)          cross_entropy_loss(z, t, None, 2) * n   # a sum
    per_expert = sum(one_hot(routed), [0])     per_expert = sum(one_hot(routed), [0])   # the rank's, for its routing
    share = to(per_expert) / (N*k)             share = to(sum_counts(per_expert, "cp")) / (N*k)
"""

import operator

import torch
import torch.fx as fx

from gcompile import collectives, cp_ops, ring_attention, tp_ops
from gcompile.pass_manager import PassContext, register_pass
from gcompile.program import BATCH_ROLES, Program, Stage
from gcompile.report import REPORT
from passes.rewrite import GraphMismatch, insert_call, rank_constant, replace_call, whole_model_copy
from passes.sequence_parallel import TOKEN_WISE
from passes.tensor_parallel import BROADCASTING, NORMS, SHAPE_PRESERVING, SOFTMAX, VIEWS, full_shape, is_elementwise
from passes.token_rows import ALONG, APART, GROUPED_MM, REORDERS, ROUTING, TokenRows

NAME = "context_parallel"
aten = torch.ops.aten

SAME_CUT = (*SHAPE_PRESERVING, *TOKEN_WISE, *ROUTING, aten.alias.default, aten.detach.default, operator.getitem,
            aten.repeat_interleave.self_int, tp_ops.copy_to_tp, tp_ops.reduce_from_tp, tp_ops.rank_part)
"""Ops whose output holds the tokens of their input on the same dim (checked by `same_cut`)."""
BY_HAND_HEADS = ": use --cp-comm-type all_gather, which needs no heads to divide, or heads that tp x cp divides"
"""What to do where a2a cannot split the heads of attention written by hand."""
SEQUENCE_PARALLEL = (tp_ops.reduce_scatter_to_sequence, tp_ops.gather_from_sequence, tp_ops.scatter_to_sequence)
"""Sequence parallel's cuts of the sequence over tp: on the rank's tokens they cut or gather those further."""
LOSSES = {aten.cross_entropy_loss.default: (2, 3, 4), aten.nll_loss_nd.default: (2, 3, 4),
          aten.nll_loss.default: (2, 3, 4), tp_ops.vocab_parallel_cross_entropy: (None, 5, 4),
          tp_ops.vocab_parallel_nll_loss: (None, 3, 4)}
"""Losses over (N, V) logits or log-probabilities (args[0]) and (N,) targets (args[1]), by where their class
weights, reduction and ignore_index are given."""
LOGSUMEXP = {aten.logsumexp.default: lambda node: node.args[1],
             tp_ops.vocab_parallel_logsumexp: lambda node: [node.args[1]]}
"""log(sum(exp)) over the dims given (a z-loss over the vocab), by how to read them; keepdim is args[2]."""
GATHER = (aten.gather.default, tp_ops.vocab_parallel_gather)
"""x.gather(dim, index): (x, dim, index, ...)."""
LINEAR = (aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.neg.default, aten.sum.default,
          aten.sum.dim_IntList, aten.clone.default, aten.to.dtype, REPORT, tp_ops.mean_over_sequence, *VIEWS)
"""Ops through which a loss stays linear in their first argument (mul: in each; div: in the numerator)."""


@register_pass(NAME)
def context_parallel_pass(program: Program, ctx: PassContext) -> Program:
    program = whole_model_copy(program, NAME)
    for stage in program.stages:
        _Splitter(stage, ctx).run()
    return program


class _Splitter(TokenRows):
    name, group = NAME, cp_ops.GROUP
    keeps_counts = (collectives.sum_counts,)  # sequence parallel's sum over tp

    def __init__(self, stage: Stage, ctx: PassContext):
        self.stage, self.n, self.comm_type = stage, ctx.coords.size("cp"), ctx.config.parallel.cp_comm_type
        self.cp_rank = rank_constant(stage, "cp_rank", ctx.coords.axis_rank("cp"))
        self.dims: dict[fx.Node, int] = {}
        """The sequence dim of every value that holds the rank's tokens."""
        self.locals: dict[tuple[fx.Node, int], fx.Node] = {}
        """local_tokens(x, dim) by (x, dim), shared by the ops that read it."""
        self.masks: dict[torch.dtype, fx.Node] = {}
        """The causal mask by dtype, shared by the stage's attentions."""
        self.merged, self.counts, self.totals = {}, set(), {}
        self.means: list[fx.Node] = []
        """Means over the rank's tokens outside the loss ops (a MoE layer's mean router probabilities)."""
        self.attending: set[fx.Node] = set()
        """Values of attention written by hand between q @ k^T and @ v (`scores`): under a2a the rank's 1/n of the
        heads over the whole sequence (Ulysses); under all_gather the rank's queries against every key."""

    def run(self) -> None:
        graph = self.stage.graph.graph
        for role, node in self.stage.input_nodes().items():
            if role in BATCH_ROLES and node.users:
                first_use = next(n for n in graph.nodes if n in node.users)  # keeps it in that use's pipeline stage
                local = self.local(node, 1, first_use)
                node.replace_all_uses_with(local, delete_user_cb=lambda user: user is not local)
        for node in graph.find_nodes(op="call_function", target=tp_ops.scatter_to_sequence):
            node.update_arg(0, self.local(node.args[0], node.args[1], node))  # the cp cut first, then sp's
        for node in list(graph.nodes):
            if any(a in self.attending for a in node.all_input_nodes):
                self.attend(node)
            elif node not in self.dims and any(a in self.dims for a in node.all_input_nodes):
                self.propagate(node)
            elif node not in self.counts and any(a in self.counts for a in node.all_input_nodes):
                self.read_count(node)
        self.check_means()
        graph.lint()

    def local(self, x: fx.Node, dim: int, before: fx.Node) -> fx.Node:
        """The rank's tokens of `x` (whole on every rank) along `dim`, made once."""
        if (x, dim) not in self.locals:
            node = insert_call(before, cp_ops.local_tokens, (x, dim, self.n, self.cp_rank), NAME, before=True)
            node.meta["val"] = x.meta["val"]  # full shapes until the pass manager re-derives them
            self.locals[x, dim] = node
            self.dims[node] = dim
        return self.locals[x, dim]

    def propagate(self, node: fx.Node) -> None:
        """Rewrite `node`, which reads the rank's tokens, for T/n of them; record where its sequence dim is."""
        if node.op == "output":
            raise GraphMismatch(NAME, node, "returns a value that holds the rank's tokens; only the mean loss "
                                            "may leave the program")
        x = node.args[0] if node.args else None
        if isinstance(x, (list, tuple)):  # cat's tensors
            x = x[0]
        dim = self.dims.get(x)
        target = node.target
        if target is aten.scaled_dot_product_attention.default:
            self.attention(node)
        elif target in LOSSES:
            self.loss(node)
        elif target in (aten.index_select.default, aten.index_add.default):
            self.index(node)
        elif target is GROUPED_MM:
            self.grouped_mm(node)
        elif self.is_reduction_of_tokens(node, dim):
            self.reduce(node)
        elif target in (aten.embedding.default, tp_ops.vocab_parallel_embedding):
            if node.args[0] in self.dims or node.args[1] not in self.dims:
                raise GraphMismatch(NAME, node, "looks up a table that holds the rank's tokens")
            self.dims[node] = self.dims[node.args[1]]
        elif target in BROADCASTING or is_elementwise(target):
            self.broadcast(node)
        elif dim is None:
            raise GraphMismatch(NAME, node, "reads the rank's tokens in an argument other than the first; only "
                                            "element-wise ops, embeddings, attention and the loss may")
        elif target in SEQUENCE_PARALLEL:
            if node.args[1] != dim:
                raise GraphMismatch(NAME, node, f"cuts or gathers dim {node.args[1]} over tp, but the sequence is "
                                                f"on dim {dim}")
            self.dims[node] = dim
        elif target in VIEWS:
            self.token_view(node, dim)
        elif target in REORDERS:
            self.reorder(node, dim)
        elif target is aten.unsqueeze.default:
            self.dims[node] = dim + (node.args[1] % len(full_shape(node)) <= dim)
        elif target in ALONG:
            self.along(node, dim)
        elif target in LOGSUMEXP:
            self.logsumexp(node, dim)
        elif target in GATHER:
            self.gather(node, dim)
        elif target in APART:
            self.along_other_dim(node, dim)
        elif target in SAME_CUT:
            self.same_cut(node, dim)
        elif target is aten.matmul.default and node.args[1] not in self.dims and dim < len(full_shape(x)) - 1:
            self.dims[node] = dim + len(full_shape(node)) - len(full_shape(x))  # x @ W: a linear, token by token
        elif target in (aten.matmul.default, aten.bmm.default):
            self.scores(node)
        else:
            raise GraphMismatch(NAME, node, "reads the rank's tokens but is not known to work token by token; "
                                            "context parallel knows element-wise ops, norms over the hidden dim, "
                                            "linears, views that keep the sequence dim, attention, the loss and "
                                            "MoE routing")
        if node in self.dims:
            self.inherit_merged(node)

    def logsumexp(self, node: fx.Node, dim: int) -> None:
        """Over dims other than the sequence (the vocab), token by token."""
        x, keepdim = node.args[0], (*node.args, False)[2]
        reduced = [d % len(full_shape(x)) for d in LOGSUMEXP[node.target](node)]
        if dim in reduced:
            raise GraphMismatch(NAME, node, f"takes a logsumexp over dims {reduced}, which include the sequence dim")
        self.dims[node] = dim if keepdim else dim - sum(d < dim for d in reduced)

    def gather(self, node: fx.Node, dim: int) -> None:
        """Entries picked along another dim than the sequence (each target's log-probability) by an index that
        holds the rank's tokens on the same dim."""
        x, at, index = node.args[:3]
        if at % len(full_shape(x)) == dim or self.dims.get(index) != dim:
            raise GraphMismatch(NAME, node, f"picks along dim {at} by an index that does not hold the rank's tokens "
                                            f"on dim {dim}, as its input does")
        self.dims[node] = dim

    def same_cut(self, node: fx.Node, dim: int) -> None:
        """An op that leaves the sequence dim where it is and whole (a norm, GQA's kv heads repeated, a cast)."""
        if node.target is operator.getitem:  # a part of a split
            self.dims[node] = dim
            return
        shape_in, shape_out = full_shape(node.args[0]), full_shape(node)
        if dim >= len(shape_out) or shape_out[dim] != shape_in[dim]:
            raise GraphMismatch(NAME, node, f"turns {list(shape_in)} into {list(shape_out)}; context parallel "
                                            f"needs the sequence dim {dim} kept whole")
        if node.target in NORMS and len(node.args[1]) > len(shape_in) - 1 - dim:
            raise GraphMismatch(NAME, node, f"normalizes over {node.args[1]}, which includes the sequence dim")
        if node.target in (aten.mean.dim, aten.sum.dim_IntList) and \
                any(d % len(shape_in) == dim for d in node.args[1]):
            raise GraphMismatch(NAME, node, f"reduces over dims {node.args[1]}, which include the sequence dim")
        if node.target is aten.linear.default and dim == len(shape_in) - 1:
            raise GraphMismatch(NAME, node, "multiplies along the sequence dim")
        self.dims[node] = dim

    def broadcast(self, node: fx.Node) -> None:
        """Inputs with the rank's tokens agree on the dim; a whole value with T there is cut to them."""
        ndim = len(full_shape(node))
        tensors = [a for a in node.args if isinstance(a, fx.Node)]
        dims = {self.dims[a] + ndim - len(full_shape(a)) for a in tensors if a in self.dims}
        if len(dims) != 1:
            raise GraphMismatch(NAME, node, f"combines values holding the rank's tokens on different dims {dims}")
        dim = dims.pop()
        args = []
        for a in node.args:
            at = dim - (ndim - len(full_shape(a))) if isinstance(a, fx.Node) and a not in self.dims else -1
            if at >= 0 and full_shape(a)[at] > 1:
                a = self.local(a, at, node)
            args.append(a)
        node.args = tuple(args)
        self.dims[node] = dim

    def report_count(self, report: fx.Node) -> None:
        self.counts.add(report)  # the rank's: reports add over dp x cp when logged

    def rank_mean(self, mean: fx.Node) -> None:
        self.means.append(mean)  # right where the loss is linear in it (`check_means`)

    def check_means(self) -> None:
        """Every value computed from a mean over the rank's tokens reaches the loss linearly: added, scaled by
        values that hold no such mean, summed, reported."""
        reached = set(self.means)
        for node in self.stage.graph.graph.nodes:
            inputs = [a for a in node.all_input_nodes if a in reached]
            if node in reached or not inputs or node.op == "output":
                continue
            linear = node.target in LINEAR and not any(a in self.dims for a in node.all_input_nodes) and \
                not (node.target is aten.mul.Tensor and len(inputs) > 1) and \
                not (node.target is aten.div.Tensor and node.args[1] in reached)
            if not linear:
                raise GraphMismatch(NAME, node, "uses a mean over the rank's tokens other than linearly on its way "
                                                "to the loss; each cp rank's loss is the mean over its own tokens, "
                                                "which is right only for a loss linear in such means")
            reached.add(node)

    def attention(self, node: fx.Node) -> None:
        schema = node.target._schema.arguments
        bound = {**dict(zip((a.name for a in schema), node.args)), **node.kwargs}
        q, k, v = bound["query"], bound["key"], bound["value"]
        mask = bound.get("attn_mask")
        if any(self.dims.get(t) != 2 for t in (q, k, v)):
            raise GraphMismatch(NAME, node, "is an attention context parallel cannot rewrite: it needs q, k and "
                                            "v as (B, heads, T, head_dim), each from the batch")
        if mask is not None and (mask in self.dims or self.comm_type == "p2p"):
            raise GraphMismatch(NAME, node, "has an explicit attention mask, which context parallel takes whole "
                                            "(made of positions, not of the batch) and with cp_comm_type all_gather "
                                            "or a2a: run with --cp-comm-type all_gather or a2a (the default p2p "
                                            "ring knows only is_causal=True)")
        if self.comm_type == "p2p":
            if bound.get("dropout_p", 0.0):
                raise GraphMismatch(NAME, node, "has attention dropout, which the p2p ring does not support; use "
                                                "cp_comm_type all_gather or a2a, or dropout 0")
            fn, args = ring_attention.attention, (q, k, v, self.n, self.cp_rank, bool(bound.get("is_causal")),
                                                  bound.get("scale"), cp_ops.GROUP)
        elif self.comm_type == "a2a":
            self.check_heads(node, q, k, v, advice=": use p2p or all_gather")
            fn, args = cp_ops.heads_attention, (q, k, v, self.n, bool(bound.get("is_causal")),
                                                bound.get("dropout_p", 0.0), bound.get("scale"),
                                                bound.get("enable_gqa", False), mask, self.cp_rank)
        else:
            if mask is not None:
                mask = insert_call(node, cp_ops.gathered_mask, (mask, self.n, self.cp_rank), NAME, before=True)
            elif bound.get("is_causal"):
                mask = self.causal_mask(node, full_shape(k)[2], q.meta["val"].dtype)
            fn, args = cp_ops.attention, (q, k, v, self.n, mask, bound.get("dropout_p", 0.0), bound.get("scale"),
                                          bound.get("enable_gqa", False))
        self.dims[replace_call(node, fn, args, NAME)] = 2

    def scores(self, node: fx.Node) -> None:
        """q @ k^T of attention written by hand (soft-capped, masked by a buffer), for what is made of the scores up
        to @ v (`attend`). a2a: q and k^T exchanged to the rank's heads over the whole sequence, so the scores are
        one device's for those heads. all_gather: k^T gathered, the scores the rank's queries against every key in
        the order gathered. The p2p ring merges blocks of scores it computes itself, which a graph written by
        hand does not say how to compute."""
        q, keys = node.args[:2]
        if self.comm_type == "p2p" or node.target is not aten.matmul.default or len(full_shape(node)) != 4 or \
                self.dims.get(q) != 2 or self.dims.get(keys) != 3:
            raise GraphMismatch(NAME, node, "multiplies values that hold the rank's tokens, as attention written by "
                                            "hand does (q @ k^T): context parallel rewrites it with "
                                            "--cp-comm-type a2a or all_gather from (B, heads, T, head_dim) q and "
                                            "k^T, else only F.scaled_dot_product_attention(q, k, v, "
                                            "is_causal=True) (or with a mask made of positions)")
        if self.comm_type == "a2a":
            self.check_heads(node, q, keys, advice=BY_HAND_HEADS)
            node.args = (*(insert_call(node, cp_ops.to_heads, (t, self.dims[t], self.n), NAME, before=True)
                           for t in (q, keys)), *node.args[2:])
        else:
            node.update_arg(1, insert_call(node, tp_ops.gather, (keys, 3, self.n, cp_ops.GROUP), NAME, before=True))
        self.attending.add(node)

    def attend(self, node: fx.Node) -> None:
        """A node that reads the scores of attention written by hand (`scores`): element-wise ops and a softmax
        over the keys stay as they are, a whole value they read cut to match (a2a: a heads dim to the rank's heads;
        all_gather: its queries to the rank's, its keys put in the order gathered); @ v exchanges v likewise
        (all_gather: gathers it), which brings the result to the rank's tokens. Anything else (a view, a
        reduction, the scores returned) is refused."""
        if node.target is aten.matmul.default and node.args[0] in self.attending and \
                node.args[1] not in self.attending:
            self.values(node, node.args[1])
            return
        softmax = node.target in SOFTMAX and node.args[1] % len(full_shape(node)) == len(full_shape(node)) - 1
        if node.op != "call_function" or any(isinstance(a, fx.Node) for a in node.kwargs.values()) or \
                not (softmax or node.target in SHAPE_PRESERVING or node.target in BROADCASTING or
                     is_elementwise(node.target)):
            raise GraphMismatch(NAME, node, "reads attention scores written by hand (q @ k^T), which context "
                                            "parallel takes only through element-wise ops and a softmax over the "
                                            "keys to @ v")
        ndim, args = len(full_shape(node)), []
        for a in node.args:
            if isinstance(a, fx.Node) and a not in self.attending:
                if a in self.dims:
                    raise GraphMismatch(NAME, node, "combines attention scores written by hand with a value that "
                                                    "holds the rank's tokens; a mask must be made of positions")
                a = self.against_scores(a, ndim, node)
            args.append(a)
        node.args = tuple(args)
        self.attending.add(node)

    def against_scores(self, a: fx.Node, ndim: int, reader: fx.Node) -> fx.Node:
        """A whole value read with scores of `ndim` dims (B, heads, queries, keys), cut as the scores are."""
        shape = full_shape(a)
        if self.comm_type == "a2a":
            heads = 1 - (ndim - len(shape))  # the dim of `a` against the scores' heads
            if heads >= 0 and shape[heads] > 1:
                return insert_call(reader, tp_ops.rank_part, (a, heads, self.n, self.cp_rank), NAME, before=True)
            return a
        if any(n > 1 for n in shape[-2:]):  # queries and keys, as an explicit mask is read (dims of 1 broadcast)
            return insert_call(reader, cp_ops.gathered_mask, (a, self.n, self.cp_rank), NAME, before=True)
        return a

    def values(self, node: fx.Node, v: fx.Node) -> None:
        """scores @ v: v exchanged as q was (a2a: to the rank's heads, and the result back to the rank's tokens;
        all_gather: gathered, the rank's queries' result)."""
        if self.dims.get(v) != 2:
            raise GraphMismatch(NAME, node, "multiplies attention scores written by hand by a value that does "
                                            "not hold the rank's tokens as (B, heads, T, head_dim)")
        if self.comm_type == "all_gather":
            node.update_arg(1, insert_call(node, tp_ops.gather, (v, 2, self.n, cp_ops.GROUP), NAME, before=True))
            self.dims[node] = 2
            return
        self.check_heads(node, v, advice=BY_HAND_HEADS)
        node.update_arg(1, insert_call(node, cp_ops.to_heads, (v, 2, self.n), NAME, before=True))
        back = insert_call(node, cp_ops.to_tokens, (node, 2, self.n), NAME)
        back.meta["val"] = node.meta["val"]
        node.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)
        self.dims[back] = 2

    def check_heads(self, node: fx.Node, *values: fx.Node, advice: str = "") -> None:
        """The heads (dim 1) of each of `values` divide by cp, as a2a's exchanges need."""
        heads = {full_shape(t)[1] for t in values}
        if any(h % self.n for h in heads):
            raise GraphMismatch(NAME, node, f"has {' and '.join(map(str, sorted(heads)))} heads on this rank, "
                                            f"which cp={self.n} does not divide; cp_comm_type a2a gives each cp "
                                            f"rank 1/cp of the heads (K and V's too){advice}")

    def causal_mask(self, attention: fx.Node, seq: int, dtype: torch.dtype) -> fx.Node:
        """One mask per stage and dtype, made before the first attention that needs it."""
        if dtype not in self.masks:
            self.masks[dtype] = insert_call(attention, cp_ops.causal_mask, (seq, self.n, self.cp_rank, dtype), NAME,
                                            before=True)
        return self.masks[dtype]

    def loss(self, node: fx.Node) -> None:
        """The rank's mean over its counted tokens, weighted by its share of the micro-batch's: ranks whose tokens
        hold more or fewer ignored targets (ignore_index) count for as many tokens as they have, so the average
        over cp is the micro-batch's mean, as on one device. Where no target is ignored the weight is exactly 1."""
        logits, targets = node.args[:2]
        weight, reduction, ignore_index = (node.args[i] if i is not None and i < len(node.args) else default
                                           for i, default in zip(LOSSES[node.target], (None, 1, -100)))
        if self.dims.get(logits) != 0 or self.dims.get(targets) != 0 or reduction not in (1, 2) or \
                weight is not None:
            raise GraphMismatch(NAME, node, "is a loss context parallel cannot split: it needs (N, V) logits and "
                                            "(N,) targets, both of the rank's tokens, the mean or sum reduction and "
                                            "no class weights")
        if reduction == 2:  # the rank's sum n times: the mean over cp is the sum over its ranks
            weighted = insert_call(node, aten.mul.Tensor, (node, self.n), NAME)
            node.replace_all_uses_with(weighted, delete_user_cb=lambda user: user is not weighted)
            return
        counted = insert_call(node, aten.ne.Scalar, (targets, ignore_index), NAME)
        count = insert_call(counted, aten.sum.default, (counted,), NAME)
        total = insert_call(count, collectives.sum_counts, (count, self.group), NAME)
        scaled = insert_call(total, aten.mul.Tensor, (count, self.n), NAME)
        share = insert_call(scaled, aten.div.Tensor, (scaled, total), NAME)
        some = insert_call(share, aten.gt.Scalar, (count, 0), NAME)
        kept = insert_call(some, aten.where.ScalarOther, (some, node, 0.0), NAME)  # a rank whose targets are all
        # ignored has a mean of 0/0
        weighted = insert_call(kept, aten.mul.Tensor, (kept, share), NAME)
        node.replace_all_uses_with(weighted, delete_user_cb=lambda user: user is not kept)
