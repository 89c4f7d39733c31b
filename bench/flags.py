"""What the benchmarks share: the model they default to (the issue's 4 layers, 256 wide, 8 heads, T=256),
the peers' AdamW groups, and running a variant on gloo ranks (one process each) for its timings."""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from gcompile.config import ConfigError


@contextlib.contextmanager
def refused_in_one_line(p: argparse.ArgumentParser, what: str = ""):
    """A config gcompile refuses (ConfigError) inside the block: argparse's one line and status 2, before any rank
    starts or any timing; `what` names where the config came from."""
    try:
        yield
    except ConfigError as e:
        p.error(f"{what}{e}")


def count(text: str) -> int:
    """argparse type of --iters, --repeats and the like: at least 1 (with none there is no median to report)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """The model's flags; --help shows the defaults the bench runs with (its set_defaults may change them)."""
    p.add_argument("--n-layer", type=int, default=4, help="transformer layers (default: %(default)s)")
    p.add_argument("--n-embd", type=int, default=256, help="hidden width (default: %(default)s)")
    p.add_argument("--n-head", type=int, default=8, help="attention heads (default: %(default)s)")
    p.add_argument("--seq-length", type=int, default=256, help="tokens per sample, and the model's positions "
                                                              "(default: %(default)s)")
    p.add_argument("--arch", choices=("gpt2", "llama"), default="gpt2",
                   help="llama: the same sizes with n_head/2 kv heads and a SwiGLU of 8/3 * n_embd (rounded to 64) "
                        "(default: %(default)s)")


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


def torch_step(wrapped, model, config, around=None):
    """torch's own training step: the wrapped model's loss backward, clip, AdamW with the peers' groups;
    `around(idx, targets)`, if given, is a context both forward and backward run in."""
    t = config.train
    optimizer = torch.optim.AdamW(adamw_groups(model, config), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2))

    def step(tokens):
        idx, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        with around(idx, targets) if around else contextlib.nullcontext():
            wrapped(idx, targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip_grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def add_worker_flags(p: argparse.ArgumentParser) -> None:
    """The hidden flags spawn_ranks starts a rank with, and --variant: which one it runs."""
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)


def spawn_ranks(script: str, argv: list[str], world: int) -> dict:
    """Run `python script argv --worker --store S --out O` as `world` ranks (RANK, WORLD_SIZE set); rank 0's
    JSON from O. RuntimeError with the failing rank's last line of stderr."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        command = [sys.executable, os.path.abspath(script), *argv, "--worker", "--store", os.path.join(tmp, "store"),
                   "--out", out]
        logs = [os.path.join(tmp, f"rank{r}.err") for r in range(world)]
        procs = []
        for r, log in enumerate(logs):
            with open(log, "w") as err:
                procs.append(subprocess.Popen(command, stderr=err,
                                              env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(world))))
        failed = [log for p, log in zip(procs, logs) if p.wait()]
        if failed:
            with open(failed[0]) as f:
                lines = [line.strip() for line in f if line.strip()]
            raise RuntimeError(f"rank failed: {lines[-1] if lines else 'no message'}")
        with open(out) as f:
            return json.load(f)


def join_gloo(store: str) -> tuple[int, int]:
    """As a rank of spawn_ranks: the cores split evenly, the gloo group joined; (rank, world)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    return rank, world


def median_step(step, tokens: torch.Tensor, warmup: int, iters: int) -> float:
    """Median seconds of `iters` steps after `warmup`, the ranks lined up by a barrier before each."""
    for _ in range(warmup):
        step(tokens)
    times = []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        step(tokens)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gcompile_runtime(config, rank: int):
    """Rank `rank`'s gcompile Runtime for `config`, its weights at their initial values, lr set."""
    from gcompile.axes import Coords
    from gcompile.compile import Compiler, compile_rank_program
    from gcompile.mesh import init_groups
    from gcompile.pipeline import build_rank_program
    from gcompile.runtime import Runtime
    from gcompile.state import TrainState

    coords = Coords.from_rank(rank, config.mesh_sizes)
    init_groups(coords)
    program = build_rank_program(config, coords, log=lambda _: None)
    for turn in range(coords.world_size):  # one rank compiles at a time; the others hit the cache
        if turn == rank:
            functions, opt = compile_rank_program(program, Compiler(enabled=config.train.compile))
        dist.barrier()
    state = TrainState.initial(program, config.model, config.train.seed, "cpu")
    state.lr.fill_(config.train.lr)
    return Runtime(program, functions, opt, state)
