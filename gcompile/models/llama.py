"""Llama (Llama 2 / 3 / 3.2) in plain torch.nn, and its ModelSpec.

RMSNorm, rotary position embeddings, a SwiGLU MLP, grouped-query attention, no
biases, tied or untied embeddings. Parameter names are those of Hugging Face's
`LlamaForCausalLM` state dict (`model.layers.0.self_attn.q_proj.weight`), so a
Hugging Face checkpoint converts by copying. Every computation follows the
Hugging Face implementation's order of operations (RMSNorm in fp32, cos/sin from
fp32 outer products), so the two give the same logits. Nothing here knows about
ranks: tensor parallelism cuts q/k/v and gate/up by heads and features, o and
down by input features, as for any model.
"""

import math
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from gcompile.models.llama_config import LlamaConfig
from gcompile.models.moe import GatedExperts, MoE, mlp_with_balance
from gcompile.models.moe_config import mlp_width, moe_errors
from gcompile.models.spec import ModelSpec, head_errors, token_batch


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x):
    """(x1, x2) -> (-x2, x1) over the two halves of the last dim."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        hd = config.head_dim
        self.q_proj = nn.Linear(config.n_embd, config.n_head * hd, bias=False)
        self.k_proj = nn.Linear(config.n_embd, config.n_kv_head * hd, bias=False)
        self.v_proj = nn.Linear(config.n_embd, config.n_kv_head * hd, bias=False)
        self.o_proj = nn.Linear(config.n_head * hd, config.n_embd, bias=False)
        self.n_rep = config.n_head // config.n_kv_head
        self.head_dim = hd

    def forward(self, x, cos, sin):
        B, T, _ = x.size()
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k, v = repeat_kv(k, self.n_rep), repeat_kv(v, self.n_rep)  # (B, nh, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh * hd)
        return self.o_proj(y)


def repeat_kv(x, n_rep: int):
    """(B, nkv, T, hd) -> (B, nkv * n_rep, T, hd): each kv head serves n_rep query heads in a row."""
    if n_rep == 1:
        return x
    B, nkv, T, hd = x.shape
    return x[:, :, None, :, :].expand(B, nkv, n_rep, T, hd).reshape(B, nkv * n_rep, T, hd)


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig, hidden: int | None = None):
        """`hidden`: the inner width, ffn_hidden_size unless given (a shared expert's)."""
        super().__init__()
        hidden = hidden or config.ffn_hidden_size
        self.gate_proj = nn.Linear(config.n_embd, hidden, bias=False)
        self.up_proj = nn.Linear(config.n_embd, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, config.n_embd, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.n_embd, config.norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.n_embd, config.norm_eps)
        if config.num_experts:
            experts = GatedExperts(config.num_experts, config.n_embd, config.ffn_hidden_size)
            shared = config.moe_shared_expert_intermediate_size
            self.mlp = MoE(config.n_embd, experts, config.num_experts, config.moe_router_topk,
                           config.moe_router_score_function, MLP(config, shared) if shared else None)
        else:
            self.mlp = MLP(config)

    def forward(self, x, cos, sin):
        """(x, the MoE layer's load-balancing loss, 0.0 for a dense MLP)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        out, balance = mlp_with_balance(self.mlp, self.post_attention_layernorm(x))
        return x + out, balance


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.n_embd)
        self.layers = nn.ModuleList([DecoderLayer(config) for _ in range(config.n_layer)])
        self.norm = RMSNorm(config.n_embd, config.norm_eps)


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, idx, targets=None):
        """Mean cross-entropy over all tokens when targets are given, else the logits."""
        B, T = idx.size()
        if T > self.config.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than block_size={self.config.block_size}")
        x = self.model.embed_tokens(idx)  # (B, T, C)
        cos, sin = (t.to(x.dtype) for t in rope(self.config, T, idx.device))  # (T, hd) each
        balance = 0.0
        for layer in self.model.layers:
            x, layer_balance = layer(x, cos, sin)
            balance = balance + layer_balance
        logits = self.lm_head(self.model.norm(x))  # (B, T, V)
        if targets is None:
            return logits
        logits = logits.float()
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return loss + self.config.moe_aux_loss_coeff * balance if self.config.num_experts else loss


def rope(config: LlamaConfig, T: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, dimension) angle, (T, head_dim), in fp32 as Hugging Face computes them
    (the position-times-frequency outer product is one rounding, as its one-term matmul)."""
    hd = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64, device=device).float() / hd))
    freqs = torch.arange(T, device=device).float()[:, None] * inv_freq[None, :]  # (T, hd/2)
    angles = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
    return angles.cos(), angles.sin()


def init_value(name: str, shape, config: LlamaConfig, seed: int) -> torch.Tensor:
    """A pure function of (seed, name), as for every model: norms at 1, matrices N(0, 0.02), the
    output projections of each layer scaled by 1/sqrt(2 n_layer) (Megatron's scaled init)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    std = 0.02 / math.sqrt(2 * config.n_layer) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
    return torch.randn(shape, generator=generator) * std


def module(config: LlamaConfig) -> Llama:
    return Llama(config).eval()



TP_PLAN = ("model.layers.*.self_attn.[qkv]_proj=column", "model.layers.*.self_attn.o_proj=row",
           "model.layers.*.mlp.gate_proj=column", "model.layers.*.mlp.up_proj=column",
           "model.layers.*.mlp.down_proj=row", "model.embed_tokens=vocab", "lm_head=vocab")
"""Megatron-LM's layout for Llama: q/k/v by heads, o by its input; gate/up by features, down by its input;
embedding and head by vocabulary (the head's loss a vocab-parallel cross-entropy). Under MoE the MLP entries
match no Linear (experts are GroupedLinear) and experts stay whole on every tp rank."""


def tp_errors(model: Llama, name: str, placement: str, tp: int) -> list[str]:
    """Attention is cut by whole heads (kv heads too: tp must divide n_kv_head, as in Megatron); the MLP by
    its inner features."""
    config = model.config
    if ".self_attn." in name:
        return [f"{what}={n} is not divisible by tp={tp}; choose a tp that divides it (each tp rank holds whole "
                f"heads, kv heads too, as in Megatron)" for what, n in
                (("n_head", config.n_head), ("n_kv_head", config.n_kv_head)) if n % tp]
    size = config.ffn_hidden_size
    return [] if size % tp == 0 else [f"ffn_hidden_size={size} is not divisible by tp={tp}; choose a tp that divides "
                                      f"it"]


def config_errors(config: LlamaConfig) -> list[str]:
    """Sizes the model cannot be built with, in the config's words."""
    errors = head_errors(config)
    if config.n_head < 1 or config.n_embd < 1:
        return errors
    if not errors and config.head_dim % 2:
        errors.append(f"head_dim = n_embd / n_head = {config.head_dim} must be even for rotary embeddings")
    if config.n_kv_head < 1 or config.n_head % config.n_kv_head:
        errors.append(f"n_kv_head={config.n_kv_head} must divide n_head={config.n_head}")
    if config.ffn_hidden_size < 1:
        errors.append(f"ffn_hidden_size={config.ffn_hidden_size} must be at least 1")
    if not config.rope_theta > 0 or not config.norm_eps > 0:
        errors.append(f"rope_theta={config.rope_theta} and norm_eps={config.norm_eps} must be positive")
    return errors + moe_errors(config)


def decays(name: str, full_shape: tuple[int, ...]) -> bool:
    """Weight decay on matrices (experts' stacked ones too), not on RMSNorm weights or the embedding."""
    return len(full_shape) >= 2 and name != "model.embed_tokens.weight"


def num_floating_point_operations(config: LlamaConfig, batch_size: int, seq_length: int) -> float:
    """Megatron-LM's FLOPs per training step with grouped-query attention and SwiGLU (forward + backward:
    3 x 2 FLOPs per multiply-add of every matmul)."""
    h, hd = config.n_embd, config.head_dim
    per_token_layer = (2 * h * (config.n_head + 2 * config.n_kv_head) * hd  # q, k, v
                       + 2 * 2 * seq_length * config.n_head * hd          # scores and values
                       + 2 * config.n_head * hd * h                       # o
                       + 2 * 3 * h * mlp_width(config, config.ffn_hidden_size))  # gate, up, down (k experts)
    return 3 * batch_size * seq_length * (config.n_layer * per_token_layer + 2 * h * config.vocab_size)


LLAMA = ModelSpec(
    name="llama",
    config=LlamaConfig,
    module=module,
    init_value=init_value,
    example_batch=token_batch,
    tp_plan=TP_PLAN,
    tp_errors=tp_errors,
    config_errors=config_errors,
    decays=decays,
    context_length=lambda config: config.block_size,
    flops=num_floating_point_operations,
)
