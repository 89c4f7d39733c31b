"""The model every benchmark defaults to: the issue's 4 layers, 256 wide, 8 heads, T=256."""

import argparse


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=256)


def model_section(args: argparse.Namespace) -> dict:
    """The [model] section of a run config for these flags (positions = sequence length)."""
    return dict(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, block_size=args.seq_length)
