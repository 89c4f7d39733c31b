"""One training step of the single-device eager model: what the numerics bisection compares with.

Plain nn.Module autograd, clip_grad_norm_ and torch.optim.AdamW, weight decay where the
model's spec says; nothing of gcompile's compiler or optimizer. The
tests keep their own oracle (tests/reference.py), so that no test checks this against itself.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn

from gcompile.config import RunConfig


@dataclass
class EagerStep:
    loss: float
    """Mean loss over the global batch."""
    share_grads: list[dict[str, torch.Tensor]]
    """Per dp share of the batch (in dp rank order): the mean gradient over its microbatches."""
    grads: dict[str, torch.Tensor]
    """The mean gradient over the global batch, before clipping."""
    params: dict[str, torch.Tensor]
    """Parameters after one AdamW step."""


def eager_step(config: RunConfig, tokens: torch.Tensor, lr: float) -> EagerStep:
    """One step on `tokens` (global_batch, seq_length + 1), the batch cut into dp shares and microbatches."""
    t, dp = config.train, config.parallel.dp
    model = config.model_spec.build(config.model, t.seed)
    named = dict(model.named_parameters())  # a tied head appears once
    losses, share_grads = [], []
    for share in tokens.chunk(dp):
        model.zero_grad()
        micro = share.split(t.micro_batch_size)
        for mb in micro:
            loss = model(mb[:, :-1].contiguous(), mb[:, 1:].contiguous())
            (loss / len(micro)).backward()
            losses.append(loss.detach())
        share_grads.append({n: p.grad.clone() for n, p in named.items()})
    grads = {n: sum(g[n] for g in share_grads) / dp for n in named}
    for n, p in named.items():
        p.grad = grads[n].clone()
    torch.nn.utils.clip_grad_norm_(named.values(), t.clip_grad if t.clip_grad > 0 else float("inf"))
    decays = {n: config.model_spec.decays(n, tuple(p.shape)) for n, p in named.items()}  # the model's rule
    decay = [p for n, p in named.items() if decays[n]]
    no_decay = [p for n, p in named.items() if not decays[n]]
    torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                      lr=lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, foreach=False).step()
    return EagerStep(loss=torch.stack(losses).mean().item(), share_grads=share_grads, grads=grads,
                     params={n: p.detach().clone() for n, p in named.items()})
