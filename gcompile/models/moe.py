"""A mixture-of-experts MLP (Megatron-Core's MoE layer, dropless), for any model's blocks.

A router scores each token against E experts; the token goes to its top k
(Megatron's default order: top-k of the logits, then a softmax over those k
for the gates). Every token reaches all its k experts (no capacity, no drops),
so the layer is exact whatever the batch. The routed copies are sorted by
expert and each expert's contiguous rows go through one grouped matmul
(`gcompile::grouped_mm`, given the experts' end offsets): shapes stay static
(N*k rows) while the split between experts is data, so the captured graph is
one graph for every batch. torch's own `_grouped_mm` would do, but its
shape function takes bf16 only, and the numerics are tested in fp32. Rows are
picked with index_select, never `x[idx]`: the latter's backward (index_put
with accumulation) adds in no fixed order on CPU, so tensor-parallel ranks,
which hold the experts whole, would drift apart by an ulp a step. The outputs come back to their tokens weighted by
their gates.

The Switch/GShard load-balancing loss, E * sum_e f_e * P_e (f_e: the share of
routed copies that went to expert e; P_e: its mean router probability), is
returned beside the output; the model adds coeff times its layers' sum to the
loss (Megatron's --moe-aux-loss-coeff). The layer reports its tokens per expert
and its balance loss (gcompile.report), which the training loop logs.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from gcompile.report import report


@torch.library.custom_op("gcompile::grouped_mm", mutates_args=())
def grouped_mm(rows: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """rows (R, in) sorted by group, weight (G, in, out), ends (G,): group g's rows end at ends[g] -> (R, out);
    rows after the last end (an expert-parallel rank's unused room) come out zero."""
    out = rows.new_empty(rows.shape[0], weight.shape[-1])
    start = 0
    for group, end in enumerate(ends.tolist()):
        torch.matmul(rows[start:end], weight[group], out=out[start:end])
        start = end
    out[start:].zero_()
    return out


@grouped_mm.register_fake
def _(rows, weight, ends):
    return rows.new_empty(rows.shape[0], weight.shape[-1])


@torch.library.custom_op("gcompile::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad(rows: torch.Tensor, grad: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Each group's rows^T @ its gradient rows: (G, in, out), zero for a group without rows."""
    out = rows.new_zeros(ends.shape[0], rows.shape[1], grad.shape[1])
    start = 0
    for group, end in enumerate(ends.tolist()):
        torch.matmul(rows[start:end].t(), grad[start:end], out=out[group])
        start = end
    return out


@grouped_mm_weight_grad.register_fake
def _(rows, grad, ends):
    return rows.new_empty(ends.shape[0], rows.shape[1], grad.shape[1])


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    rows, weight, ends = ctx.saved_tensors
    return grouped_mm(grad, weight.transpose(1, 2), ends), grouped_mm_weight_grad(rows, grad, ends), None


grouped_mm.register_autograd(_backward, setup_context=_setup)


class GroupedLinear(nn.Module):
    """E Linears of one shape, stacked: `weight` (E, in, out) and `bias` (E, out)."""

    def __init__(self, experts: int, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, in_features, out_features))
        self.bias = nn.Parameter(torch.empty(experts, out_features)) if bias else None

    def forward(self, rows: torch.Tensor, ends: torch.Tensor, expert_of_row: torch.Tensor) -> torch.Tensor:
        """rows (R, in), sorted by expert; ends (E,) int32: where each expert's rows end."""
        out = grouped_mm(rows, self.weight, ends)
        return out if self.bias is None else out + self.bias.index_select(0, expert_of_row)


class Experts(nn.Module):
    """E two-layer MLPs (GPT-2's: c_fc, activation, c_proj), each over its own contiguous rows."""

    def __init__(self, experts: int, n_embd: int, hidden: int, activation: nn.Module, bias: bool):
        super().__init__()
        self.c_fc = GroupedLinear(experts, n_embd, hidden, bias)
        self.activation = activation
        self.c_proj = GroupedLinear(experts, hidden, n_embd, bias)

    def forward(self, rows: torch.Tensor, ends: torch.Tensor, expert_of_row: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.activation(self.c_fc(rows, ends, expert_of_row)), ends, expert_of_row)


class GatedExperts(nn.Module):
    """E SwiGLU MLPs (Llama's and Mixtral's: down(silu(gate(x)) * up(x)), no biases)."""

    def __init__(self, experts: int, n_embd: int, hidden: int):
        super().__init__()
        self.gate_proj = GroupedLinear(experts, n_embd, hidden, bias=False)
        self.up_proj = GroupedLinear(experts, n_embd, hidden, bias=False)
        self.down_proj = GroupedLinear(experts, hidden, n_embd, bias=False)

    def forward(self, rows: torch.Tensor, ends: torch.Tensor, expert_of_row: torch.Tensor) -> torch.Tensor:
        gated = F.silu(self.gate_proj(rows, ends, expert_of_row)) * self.up_proj(rows, ends, expert_of_row)
        return self.down_proj(gated, ends, expert_of_row)


class MoE(nn.Module):
    """`experts` (Experts or GatedExperts) behind a top-k router, plus an optional `shared` MLP every token
    goes through (DeepSeek's shared expert); returns (output, load-balancing loss)."""

    def __init__(self, n_embd: int, experts: nn.Module, num_experts: int, topk: int, score_function: str,
                 shared: nn.Module | None):
        super().__init__()
        self.num_experts, self.topk, self.score_function = num_experts, topk, score_function
        self.router = nn.Linear(n_embd, num_experts, bias=False)
        self.experts = experts
        self.shared_expert = shared

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(output like x, load-balancing loss of this layer)."""
        tokens = x.reshape(-1, x.shape[-1])  # (N, C)
        logits = self.router(tokens)  # (N, E)
        gates, chosen, probs = self.route(logits)
        routed = chosen.reshape(-1)  # (N*k,): token i's copies at i*k .. i*k+k-1
        order = routed.argsort(stable=True)  # the copies sorted by expert
        per_expert = report(F.one_hot(routed, self.num_experts).sum(0), "tokens per expert")  # (E,)
        ends = per_expert.cumsum(0).to(torch.int32)
        expert_of_row, token_of_row = routed.index_select(0, order), order // self.topk
        rows = tokens.index_select(0, token_of_row)
        out = self.experts(rows, ends, expert_of_row) * gates.reshape(-1).index_select(0, order)[:, None]
        combined = torch.zeros_like(tokens).index_add(0, token_of_row, out)
        if self.shared_expert is not None:
            combined = combined + self.shared_expert(tokens)
        share = per_expert.to(logits.dtype) / routed.numel()
        balance = report(self.num_experts * (share * probs.mean(0)).sum(), "load balancing loss")
        return combined.view(x.shape), balance

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gates (N, k), chosen experts (N, k), every expert's probability (N, E) for the balance loss), as
        Megatron's router: softmax over the top-k logits, or (DeepSeek-V3) sigmoid scores, the top k of
        them normalized to sum to one."""
        if self.score_function == "softmax":
            top, chosen = logits.topk(self.topk, dim=-1)
            return top.softmax(dim=-1), chosen, logits.softmax(dim=-1)
        scores = logits.sigmoid()
        top, chosen = scores.topk(self.topk, dim=-1)
        return top / top.sum(-1, keepdim=True), chosen, scores / scores.sum(-1, keepdim=True)


def mlp_with_balance(mlp: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | float]:
    """A block's MLP output and its load-balancing loss, 0.0 for a dense MLP, so blocks need no branch."""
    return mlp(x) if isinstance(mlp, MoE) else (mlp(x), 0.0)
