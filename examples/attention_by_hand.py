"""Your own model with its attention written by hand, as nanoGPT without flash and Gemma-2 write it.

    python run_gpt.py --arch examples/attention_by_hand.py:SPEC --cp 2 --cp-comm-type a2a --train-iters 20

examples/parallel_block.py's model, but each block computes its scores itself: q @ k^T, a soft cap
on them (Gemma-2's tanh), a causal mask kept as a buffer (nanoGPT's), a softmax over the keys, @ v.
Context parallel follows the scores from q @ k^T to @ v: under a2a each rank holds whole sequences
for its heads between the two; under all_gather its queries meet every key and the mask is cut to
them. Tensor parallel cuts the heads as for SDPA.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gcompile.models.spec import spec_with_defaults
from parallel_block import TP_PLAN, ParallelBlock, ParallelBlockConfig, ParallelBlockModel


@dataclass(frozen=True)
class SoftCappedConfig(ParallelBlockConfig):
    softcap: float = 50.0
    """Scores pass through softcap * tanh(score / softcap): Gemma-2's bound on attention logits."""


class SoftCappedBlock(ParallelBlock):
    def __init__(self, config: SoftCappedConfig):
        super().__init__(config)
        self.softcap = config.softcap
        self.register_buffer("causal", torch.ones(config.block_size, config.block_size, dtype=torch.bool).tril(),
                             persistent=False)

    def forward(self, x):
        B, T, C = x.size()
        h = self.ln(x)
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in self.qkv(h).split(C, dim=2))  # (B, nh, T, hs)
        att = (q @ k.transpose(-2, -1)) / k.size(-1) ** 0.5  # (B, nh, T, T)
        att = self.softcap * torch.tanh(att / self.softcap)
        att = F.softmax(att.masked_fill(~self.causal[:T, :T], float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        return x + self.out(y) + self.down(F.relu(self.up(h)) ** 2)


class SoftCappedModel(ParallelBlockModel):
    def __init__(self, config: SoftCappedConfig):
        super().__init__(config)
        self.blocks = torch.nn.ModuleList([SoftCappedBlock(config) for _ in range(config.n_layer)])


SPEC = spec_with_defaults("attention_by_hand", SoftCappedConfig, lambda config: SoftCappedModel(config).eval(),
                          tp_plan=TP_PLAN)
