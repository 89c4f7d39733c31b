"""GPT-2's `[model]` section, apart from the model so that reading flags and presets needs no torch.

`run_gpt.py --help` lists these fields without importing torch (which takes seconds);
gcompile/models/gpt2.py builds the model from them.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class GPTConfig:
    block_size: int = 256
    """Learned positions; the longest sequence the model accepts."""
    vocab_size: int = 257
    """256 byte values + end-of-document; padding for tp happens in the pass, not here."""
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 8
    """Attention heads; tp must divide it (8: the default model splits over up to 8 tp ranks)."""
    n_embd: int = 128
    """Hidden size; n_head must divide it."""
    dropout: float = 0.0
    """0 by default: dropout makes runs depend on the layout's RNG streams."""
    bias: bool = True
    """Biases in Linear and LayerNorm, as GPT-2."""
    activation: str = "gelu"
    """MLP activation: gelu (exact, nanoGPT's) or gelu_tanh (the tanh approximation of the original GPT-2,
    Hugging Face's gelu_new)."""
    num_experts: int = 0
    """0: one MLP per block; E > 0: each block's MLP becomes E experts of its shape and a router
    (mixture of experts, gcompile/models/moe.py; Megatron's --num-experts)."""
    moe_router_topk: int = 2
    """Experts each token goes to (Megatron's --moe-router-topk); every token reaches all of them (dropless)."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the Switch load-balancing loss added to the loss (Megatron's --moe-aux-loss-coeff)."""

    @property
    def ffn_hidden_size(self) -> int:
        return 4 * self.n_embd
