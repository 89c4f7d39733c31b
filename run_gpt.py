#!/usr/bin/env python
"""Train a GPT: one single-device program, compiled by graph passes into one program per rank.

    python run_gpt.py                                   # the default small GPT on the default corpus
    python run_gpt.py --config configs/tiny.toml --train-iters 200
    python run_gpt.py --help                            # every flag, with its TOML section

Ranks: tp * pp * dp. Started plainly, this spawns them locally (gloo on CPU,
nccl on CUDA); under torchrun it joins the given world.
"""

import os
import sys

import torch

from gcompile.checkpoint import CheckpointError, check
from gcompile.config import ConfigError, RunConfig, parse_args
from gcompile.data import DataError, build_datasets
from gcompile.launch import join_world, run_ranks, under_launcher
from gcompile.mesh import Coords
from gcompile.pass_manager import PassError
from gcompile.train import train

USER_ERRORS = (ConfigError, DataError, PassError, CheckpointError)


def error(message: str) -> int:
    print(f"run_gpt.py: error: {message}", file=sys.stderr)
    return 2


def rank_main(config: RunConfig) -> int:
    try:
        if under_launcher():
            coords, device = join_world(config.parallel.tp, config.parallel.pp, config.parallel.dp)
        else:
            coords, device = Coords(1, 1, 1), "cuda" if torch.cuda.is_available() else "cpu"
        train(config, coords, device)
    except USER_ERRORS as e:
        return error(str(e))
    return 0


def main(argv: list[str]) -> int:
    try:
        config, _ = parse_args(argv)
        if not under_launcher():  # check (and prepare) the data and the checkpoint once, before any rank starts
            build_datasets(config.data, config.train.seq_length, config.train.seed)
            check(config)
    except USER_ERRORS as e:
        return error(str(e))
    return run_ranks(config.world_size, [os.path.abspath(__file__), *argv], lambda: rank_main(config))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
