"""Sample text from a single-device model (nanoGPT's generate, with a seeded generator)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from gcompile.tokenizer import ByteLevel, HuggingFace


def sample(model: nn.Module, context_length: int, ids: torch.Tensor, max_new_tokens: int, temperature: float,
           top_k: int | None, generator: torch.Generator) -> torch.Tensor:
    """`ids` (B, T) continued by `max_new_tokens` sampled tokens -> (B, T + max_new_tokens).

    `model(ids)` gives logits (B, T, V); it sees the last `context_length` tokens (ModelSpec.context_length)."""
    return torch.cat([ids, *sampled(model, context_length, ids, max_new_tokens, temperature, top_k, generator)], dim=1)


@torch.no_grad()
def sampled(model: nn.Module, context_length: int, ids: torch.Tensor, max_new_tokens: int, temperature: float,
            top_k: int | None, generator: torch.Generator):
    """`sample`'s new tokens, (B, 1) each, as they come."""
    for _ in range(max_new_tokens):
        context = ids[:, -context_length:]  # (B, <= context_length)
        logits = model(context)[:, -1, :].float() / temperature  # (B, V)
        if top_k is not None:
            kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]  # (B, 1)
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = F.softmax(logits, dim=-1)
        token = torch.multinomial(probs, 1, generator=generator)
        ids = torch.cat([ids, token], dim=1)
        yield token


def generate_text(model: nn.Module, context_length: int, prompt: str, max_new_tokens: int, temperature: float,
                  top_k: int | None, seed: int, tokenizer: ByteLevel | HuggingFace = ByteLevel()):
    """The prompt and its continuation, in the tokenizer the model's data was prepared with, in pieces as the
    tokens come (200 tokens of an 82M model took 90 s here, shown at the end): each piece the text decoded so
    far adds (the whole decoded again at each token: each token's text alone would lose what a tokenizer's
    decoder does across tokens), a character cut between two tokens held back until it is whole. An empty
    prompt starts a new document (the tokenizer's EOD)."""
    ids = [int(i) for i in tokenizer.encode(prompt.encode())] if prompt else [tokenizer.eod]
    device = next(model.parameters()).device
    start = torch.tensor([ids], dtype=torch.long, device=device)  # (1, T)
    generator = torch.Generator(device=device).manual_seed(seed)
    text = tokenizer.decode(ids[0 if prompt else 1:])
    yield text
    shown = len(text)
    tokens = sampled(model.eval(), context_length, start, max_new_tokens, temperature, top_k, generator)
    for token in tokens:
        ids.append(int(token))
        text = tokenizer.decode(ids[0 if prompt else 1:])
        whole = len(text.rstrip("\ufffd"))  # a replacement character at the end may be a character half made
        if whole > shown:
            yield text[shown:whole]
            shown = whole
    yield text[shown:]
