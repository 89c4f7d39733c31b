"""Llama's `[model]` section, apart from the model so that reading flags and presets needs no torch
(gcompile/models/llama.py builds the model from it)."""

from dataclasses import dataclass

from gcompile.models.moe_config import MoEConfig


@dataclass(frozen=True)
class LlamaConfig(MoEConfig):
    block_size: int = 256
    """Longest sequence (Hugging Face's max_position_embeddings); RoPE has no learned positions."""
    vocab_size: int = 257
    """256 byte values + end-of-document by default; a tokenizer's vocabulary size otherwise."""
    n_layer: int = 4
    """Decoder layers (num_hidden_layers)."""
    n_head: int = 8
    """Query heads (num_attention_heads); tp must divide it."""
    n_kv_head: int = 4
    """Key/value heads (num_key_value_heads); divides n_head (grouped-query attention); tp must divide it."""
    n_embd: int = 128
    """Hidden size; n_head must divide it."""
    ffn_hidden_size: int = 352
    """SwiGLU inner size (intermediate_size)."""
    rope_theta: float = 10000.0
    """RoPE base: position p rotates dimension pair i by p * rope_theta^(-2i/head_dim)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon (rms_norm_eps)."""
    tie_word_embeddings: bool = False
    """The output head shares the embedding's weight (Llama 3.2 1B/3B do; Llama 3 8B does not)."""

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head
