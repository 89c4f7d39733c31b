"""Sample text from a single-device model (nanoGPT's generate, with a seeded generator)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from gcompile.tokenizer import ByteLevel, HuggingFace


@torch.no_grad()
def sample(model: nn.Module, context_length: int, ids: torch.Tensor, max_new_tokens: int, temperature: float,
           top_k: int | None, generator: torch.Generator) -> torch.Tensor:
    """`ids` (B, T) continued by `max_new_tokens` sampled tokens -> (B, T + max_new_tokens).

    `model(ids)` gives logits (B, T, V); it sees the last `context_length` tokens (ModelSpec.context_length)."""
    for _ in range(max_new_tokens):
        context = ids[:, -context_length:]  # (B, <= context_length)
        logits = model(context)[:, -1, :].float() / temperature  # (B, V)
        if top_k is not None:
            kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]  # (B, 1)
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = F.softmax(logits, dim=-1)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator)], dim=1)
    return ids


def generate_text(model: nn.Module, context_length: int, prompt: str, max_new_tokens: int, temperature: float,
                  top_k: int | None, seed: int, tokenizer: ByteLevel | HuggingFace = ByteLevel()) -> str:
    """The prompt and its continuation, in the tokenizer the model's data was prepared with. An empty prompt
    starts a new document (the tokenizer's EOD)."""
    ids = [int(i) for i in tokenizer.encode(prompt.encode())] if prompt else [tokenizer.eod]
    device = next(model.parameters()).device
    start = torch.tensor([ids], dtype=torch.long, device=device)  # (1, T)
    generator = torch.Generator(device=device).manual_seed(seed)
    out = sample(model.eval(), context_length, start, max_new_tokens, temperature, top_k, generator)
    return tokenizer.decode(out[0].tolist()[0 if prompt else 1:])
