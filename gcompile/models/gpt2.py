"""GPT-2 as nanoGPT writes it, and its ModelSpec: what the compiler needs to know about it.

It is what torch.export captures, and it is the eager reference that every
parallel layout is tested against. Nothing in it knows about ranks: tensor,
pipeline and data parallelism are graph passes over its captured program.
Names follow nanoGPT so that its checkpoints and ours line up.
"""

import dataclasses
import math
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from gcompile.models.gpt2_config import GPTConfig
from gcompile.models.moe import Experts, MoE, mlp_with_balance
from gcompile.models.moe_config import mlp_width, moe_errors
from gcompile.models.spec import ModelSpec, head_errors, token_batch


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.dropout = config.dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig, hidden: int | None = None):
        """`hidden`: the inner width, ffn_hidden_size unless given (a shared expert's)."""
        super().__init__()
        hidden = hidden or config.ffn_hidden_size
        self.c_fc = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh" if config.activation == "gelu_tanh" else "none")
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        if config.num_experts:
            experts = Experts(config.num_experts, config.n_embd, config.ffn_hidden_size, MLP(config).gelu, config.bias)
            shared = config.moe_shared_expert_intermediate_size
            self.mlp = MoE(config.n_embd, experts, config.num_experts, config.moe_router_topk,
                           config.moe_router_score_function, MLP(config, shared) if shared else None)
        else:
            self.mlp = MLP(config)

    def forward(self, x):
        """(x, the MoE layer's load-balancing loss, 0.0 for a dense MLP)."""
        x = x + self.attn(self.ln_1(x))
        out, balance = mlp_with_balance(self.mlp, self.ln_2(x))
        return x + out, balance


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied, as GPT-2

    def forward(self, idx, targets=None):
        """Mean cross-entropy over all tokens when targets are given, else the logits."""
        B, T = idx.size()
        if T > self.config.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than block_size={self.config.block_size}")
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        balance = 0.0
        for block in self.transformer.h:
            x, layer_balance = block(x)
            balance = balance + layer_balance
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)  # (B, T, V)
        if targets is None:
            return logits
        logits = logits.float()  # the loss in fp32 whatever the weights' dtype, as Megatron does
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return loss + self.config.moe_aux_loss_coeff * balance if self.config.num_experts else loss


def init_value(name: str, shape, config: GPTConfig, seed: int) -> torch.Tensor:
    """The initial value of one parameter, a pure function of (seed, name).

    Every rank can make exactly the full tensors it slices, in any order, without
    building the whole model: that is what keeps all layouts on the same weights.
    Values follow GPT-2: N(0, 0.02), residual projections scaled by 1/sqrt(2 n_layer).
    """
    if name.endswith("bias"):
        return torch.zeros(shape)
    if ".ln_" in name:
        return torch.ones(shape)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    std = 0.02 / math.sqrt(2 * config.n_layer) if name.endswith("c_proj.weight") else 0.02
    return torch.randn(shape, generator=generator) * std


def module(config: GPTConfig) -> GPT:
    """Eval mode unless dropout is on, so that a capture without dropout holds no dropout op."""
    return GPT(config).train(config.dropout > 0)



MEGATRON_PLAN = ("transformer.h.*.attn.c_attn=column", "transformer.h.*.attn.c_proj=row",
                 "transformer.h.*.mlp.c_fc=column", "transformer.h.*.mlp.c_proj=row", "transformer.wte=vocab")
"""Megatron-LM's layout: attention and MLP as column-then-row pairs, the (tied) embedding by vocabulary.
Under MoE the MLP entries match no Linear (experts are GroupedLinear) and experts stay whole on every tp rank."""


def tp_errors(model: GPT, name: str, placement: str, tp: int) -> list[str]:
    """Attention is cut by whole heads; any other Linear by its cut features, named as in the config."""
    config, linear = model.config, model.get_submodule(name)
    if isinstance(model.get_submodule(name.rpartition(".")[0]), CausalSelfAttention):
        return [f"n_head={config.n_head} is not divisible by tp={tp}; choose a tp that divides it (each tp rank "
                f"holds whole heads)"] if config.n_head % tp else []
    size = linear.out_features if placement == "column" else linear.in_features
    if size % tp == 0:
        return []
    what = {config.ffn_hidden_size: "ffn hidden size 4*n_embd", config.n_embd: "hidden size n_embd"}.get(
        size, f"{name} {'out' if placement == 'column' else 'in'}_features")
    return [f"{what}={size} is not divisible by tp={tp}; choose a tp that divides it"]


ACTIVATIONS = ("gelu", "gelu_tanh")


def config_errors(config: GPTConfig) -> list[str]:
    """Sizes the model cannot be built with, in the config's words."""
    errors = head_errors(config)
    if not 0.0 <= config.dropout < 1.0:
        errors.append(f"dropout={config.dropout} must be in [0, 1)")
    if config.activation not in ACTIVATIONS:
        errors.append(f"activation={config.activation!r} must be {' or '.join(ACTIVATIONS)}")
    return errors + moe_errors(config)


def decays(name: str, full_shape: tuple[int, ...]) -> bool:
    """Weight decay on matmul weights only (experts' stacked ones too): not on biases, LayerNorm, or the
    embeddings."""
    return name.endswith("weight") and len(full_shape) >= 2 and \
        not name.startswith(("transformer.wte.", "transformer.wpe."))


def num_floating_point_operations(config: GPTConfig, batch_size: int, seq_length: int) -> float:
    """Megatron-LM's FLOPs per training step (forward + backward), GPT without GQA or SwiGLU.

    12 = 3 (forward, wgrad, dgrad) * 2 (two GEMMs per block part) * 2 (multiply-add).
    """
    h, layers, vocab = config.n_embd, config.n_layer, config.vocab_size
    return 12 * batch_size * seq_length * layers * h * h * (
        (1 + 1 + seq_length / h)                # attention: QKV and projection, scores
        + mlp_width(config, config.ffn_hidden_size) / h  # MLP (a token's k experts under MoE)
        + vocab / (2 * layers * h)              # logits
    )


NANOGPT_ARGS = ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size", "dropout")
"""nanoGPT's GPTConfig fields, all of them: its sample.py builds GPTConfig(**model_args)."""


def nanogpt_args(config: GPTConfig) -> dict:
    """An export's model_args: nanoGPT's fields alone where the model is nanoGPT's (one MLP a block, exact
    GELU); where it is not, every field, which nanoGPT's GPTConfig then refuses instead of building another
    model."""
    args = dataclasses.asdict(config)
    return {k: args[k] for k in NANOGPT_ARGS} if config.num_experts == 0 and config.activation == "gelu" else args


GPT2 = ModelSpec(
    name="gpt2",
    config=GPTConfig,
    module=module,
    init_value=init_value,
    example_batch=token_batch,
    tp_plan=MEGATRON_PLAN,
    tp_errors=tp_errors,
    config_errors=config_errors,
    decays=decays,
    context_length=lambda config: config.block_size,
    flops=num_floating_point_operations,
    export_args=nanogpt_args,
)
