"""The model every benchmark defaults to: the issue's 4 layers, 256 wide, 8 heads, T=256."""

import argparse


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--arch", choices=("gpt2", "llama"), default="gpt2",
                   help="llama: the same sizes with n_head/2 kv heads and a SwiGLU of 8/3 * n_embd (rounded to 64)")


def model_section(args: argparse.Namespace) -> dict:
    """The [model] section of a run config for these flags (positions = sequence length)."""
    section = dict(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, block_size=args.seq_length)
    if args.arch == "llama":  # Llama's shapes at this width: GQA, SwiGLU with about the MLP's parameters
        section.update(arch="llama", n_kv_head=max(1, args.n_head // 2), ffn_hidden_size=64 * -(-8 * args.n_embd // 192))
    return section


def adamw_groups(model, config) -> list[dict]:
    """The peers' AdamW parameter groups, with weight decay where the model's spec puts it."""
    decays = config.model_spec.decays
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if decays(n, tuple(p.shape))], "weight_decay": config.train.weight_decay},
            {"params": [p for n, p in named if not decays(n, tuple(p.shape))], "weight_decay": 0.0}]
