"""The single-device eager reference every layout is compared with.

Plain nn.Module autograd + torch.optim.AdamW + clip_grad_norm_, written from
the definitions, not from gcompile's optimizer: weight decay where the model's
spec says (GPT-2: the matmul weights c_attn, c_proj, c_fc; none on biases,
LayerNorm, embeddings).
"""

from dataclasses import dataclass

import torch

from gcompile.config import RunConfig

ADAM_EPS = 1e-6
"""AdamW epsilon for numerics tests (the default is 1e-8).

Why: the first AdamW update of an element is lr * g / (|g| + eps). Where |g| is
near eps, that is ill-conditioned: d(update)/dg = lr * eps / (|g| + eps)^2, so a
gradient element that differs by 3e-9 between two correct summation orders (a
norm-wise gradient error of 3e-7, well inside tolerance) moves the parameter by
~lr * 0.07. With eps = 1e-6 the same rounding moves it by ~lr * 1e-3, and the
parameter comparison measures the code instead of the conditioning of AdamW.
"""


@dataclass
class ReferenceStep:
    loss: float
    """Mean loss over the global batch."""
    grad_norm: float
    """Global gradient norm before clipping."""
    grads: dict[str, torch.Tensor]
    """Gradients of the mean loss, before clipping."""
    params: dict[str, torch.Tensor]
    """Parameters after the optimizer step (the fp32 main weights)."""
    model_params: dict[str, torch.Tensor]
    """The model's weights after the step (in the model's dtype)."""


def random_batches(config: RunConfig, steps: int, seed: int = 0) -> list[torch.Tensor]:
    """`steps` global batches of random token ids, (global_batch, seq_length + 1) each."""
    g = torch.Generator().manual_seed(seed)
    t = config.train
    return [torch.randint(0, config.model.vocab_size, (t.global_batch_size, t.seq_length + 1), generator=g)
            for _ in range(steps)]


def reference_run(config: RunConfig, batches: list[torch.Tensor], lrs: list[float],
                  dtype: torch.dtype = torch.float32) -> list[ReferenceStep]:
    """Eager training; with a low-precision `dtype`, Megatron's recipe: weights and activations in
    `dtype`, fp32 main weights updated by AdamW from fp32 copies of the gradients."""
    t = config.train
    spec = config.model_spec
    model = spec.build(config.model, t.seed).to(dtype)  # in the mode spec.module gives (dropout on or off)
    named = dict(model.named_parameters())
    main = {n: torch.nn.Parameter(p.detach().float().clone()) if dtype != torch.float32 else p
            for n, p in named.items()}
    decay = [p for n, p in main.items() if spec.decays(n, tuple(p.shape))]
    no_decay = [p for n, p in main.items() if not spec.decays(n, tuple(p.shape))]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=lrs[0], betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, foreach=False)
    steps = []
    for tokens, lr in zip(batches, lrs):
        model.zero_grad()
        micro = tokens.split(t.micro_batch_size)
        losses = []
        for mb in micro:
            loss = model(mb[:, :-1].contiguous(), mb[:, 1:].contiguous())
            (loss / len(micro)).backward()
            losses.append(loss.detach())
        for n, p in named.items():
            main[n].grad = p.grad.float()
        grads = {n: p.grad.clone() for n, p in main.items()}
        max_norm = t.clip_grad if t.clip_grad > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(main.values(), max_norm)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        with torch.no_grad():
            for n, p in named.items():
                p.copy_(main[n])
        steps.append(ReferenceStep(loss=torch.stack(losses).mean().item(), grad_norm=grad_norm.item(), grads=grads,
                                   params={n: p.detach().clone() for n, p in main.items()},
                                   model_params={n: p.detach().clone() for n, p in named.items()}))
    return steps


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Norm-wise relative error, ||a - e|| / ||e||."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def without_key_bias(name: str, value: torch.Tensor, n_embd: int) -> torch.Tensor:
    """`value` minus the key third of a c_attn bias, which is excluded from comparisons.

    Why: softmax is invariant to adding a constant to every score of a query, so the
    key bias has an exactly zero true gradient; what autograd computes is rounding
    noise (~1e-11), and AdamW's normalisation turns noise into lr-sized steps that
    differ between any two summation orders. The key bias cannot change the loss.
    `assert_key_bias_is_noise` checks that premise instead.
    """
    if name.endswith("attn.c_attn.bias"):
        return torch.cat([value[:n_embd], value[2 * n_embd:]])
    return value


def assert_key_bias_is_noise(name: str, grad: torch.Tensor, n_embd: int) -> None:
    if name.endswith("attn.c_attn.bias"):
        assert grad[n_embd:2 * n_embd].abs().max() < 1e-8, f"{name}: key-bias gradient is not rounding noise"
