"""GPT-2's `[model]` section, apart from the model so that reading flags and presets needs no torch.

`run_gpt.py --help` lists these fields without importing torch (which takes seconds);
gcompile/models/gpt2.py builds the model from them.
"""

from dataclasses import dataclass

from gcompile.models.moe_config import MoEConfig


@dataclass(frozen=True)
class GPTConfig(MoEConfig):
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

    @property
    def ffn_hidden_size(self) -> int:
        return 4 * self.n_embd
