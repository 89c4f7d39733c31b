"""Your own model: a transformer with parallel attention and MLP blocks (GPT-J, PaLM), neither GPT-2 nor Llama.

    python run_gpt.py --arch examples/parallel_block.py:SPEC --tp 2 --pp 2 --train-iters 20

Each block reads one LayerNorm of its input into both branches and adds both to the residual,
x + attn(ln(x)) + mlp(ln(x)); the MLP squares its ReLU (Primer); the norms have no bias; the head
is not tied to the embedding. Nothing here knows about ranks: `TP_PLAN` says which Linear is cut
how, and the compiler's passes do the rest. `spec_with_defaults` fills every fact not given here
(initial values, weight decay, FLOPs); see gcompile/models/spec.py.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from gcompile.models.spec import spec_with_defaults


@dataclass(frozen=True)
class ParallelBlockConfig:
    vocab_size: int = 257
    """Token ids (the byte-level default corpus needs 257)."""
    block_size: int = 128
    """Learned positions; the longest sequence."""
    n_layer: int = 4
    """Blocks."""
    n_head: int = 4
    """Attention heads."""
    n_embd: int = 64
    """Hidden size."""


class ParallelBlock(nn.Module):
    def __init__(self, config: ParallelBlockConfig):
        super().__init__()
        self.ln = nn.LayerNorm(config.n_embd, bias=False)
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.out = nn.Linear(config.n_embd, config.n_embd)
        self.up = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.down = nn.Linear(4 * config.n_embd, config.n_embd)
        self.n_head = config.n_head

    def forward(self, x):
        B, T, C = x.size()
        h = self.ln(x)
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in self.qkv(h).split(C, dim=2))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        return x + self.out(y) + self.down(F.relu(self.up(h)) ** 2)


class ParallelBlockModel(nn.Module):
    def __init__(self, config: ParallelBlockConfig):
        super().__init__()
        self.embed = nn.Embedding(config.vocab_size, config.n_embd)
        self.positions = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList([ParallelBlock(config) for _ in range(config.n_layer)])
        self.norm = nn.LayerNorm(config.n_embd, bias=False)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx, targets=None):
        T = idx.size(1)
        x = self.embed(idx) + self.positions(torch.arange(T, device=idx.device))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))  # (B, T, V)
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


TP_PLAN = ("blocks.*.qkv=column", "blocks.*.out=row", "blocks.*.up=column", "blocks.*.down=row",
           "embed=vocab", "head=vocab")

SPEC = spec_with_defaults("parallel_block", ParallelBlockConfig, lambda config: ParallelBlockModel(config).eval(),
                          tp_plan=TP_PLAN)
