"""Compile cost, one run: cold and warm Inductor wall time for a layout, and how many graphs it compiles.

    python bench/compile.py                       # --tp 8 --pp 2 (16 ranks) and tp = pp = 1, tiny model

For each layout: build every rank's program in this process (gcompile.world),
then compile each distinct graph once with an empty Inductor cache (cold) and
again from the cache just written (warm), each in a fresh process so nothing
is held in memory. `ranks x graphs` is what compiling per rank would cost.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from flags import count, refused_in_one_line  # bench/, first on sys.path when run as a script
from gcompile.config import build_config
from gcompile.world import build_world, precompile, rank_graphs

LAYOUTS = {"tp8 pp2": dict(tp=8, pp=2), "tp1 pp1": dict(tp=1, pp=1)}


def make_config(args, parallel: dict):
    return build_config({
        "model": dict(n_layer=args.n_layer, n_head=8, n_embd=args.n_embd, block_size=args.seq_length),
        "parallel": parallel,
        "train": dict(micro_batch_size=1, global_batch_size=4, seq_length=args.seq_length, compile=True),
    })


def measure(args) -> None:
    """In a child process: build the world and compile its distinct graphs; print one JSON line."""
    config = make_config(args, LAYOUTS[args.layout])
    start = time.perf_counter()
    programs = build_world(config, log=lambda _: None)
    built = time.perf_counter() - start
    stats = precompile(programs, threads=args.threads)
    graphs = sum(len(rank_graphs(p)) for p in programs.values())
    print(json.dumps(dict(ranks=len(programs), graphs=graphs, distinct=stats.distinct, build_s=built,
                          compile_s=stats.seconds, hits=stats.cache_hits, misses=stats.cache_misses)))


def run_child(args, layout: str, cache_dir: str) -> dict:
    argv = [sys.executable, os.path.abspath(__file__), "--child", "--layout", layout, "--n-layer", str(args.n_layer),
            "--n-embd", str(args.n_embd), "--seq-length", str(args.seq_length), "--threads", str(args.threads)]
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--threads", type=count, default=1, help="threads per rank (part of the cache key)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layout", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return measure(args)
    with refused_in_one_line(p):  # here: a child's failure shows only its status
        for parallel in LAYOUTS.values():
            make_config(args, parallel)
    print(f"{'layout':8s} {'ranks':>5s} {'graphs':>7s} {'distinct':>8s} {'build s':>8s} {'cold s':>7s} "
          f"{'warm s':>7s} {'misses':>6s} {'hits':>5s}")
    for layout in LAYOUTS:
        with tempfile.TemporaryDirectory() as cache:
            cold = run_child(args, layout, cache)
            warm = run_child(args, layout, cache)
        print(f"{layout:8s} {cold['ranks']:5d} {cold['graphs']:7d} {cold['distinct']:8d} {cold['build_s']:8.1f} "
              f"{cold['compile_s']:7.1f} {warm['compile_s']:7.1f} {cold['misses']:6d} {warm['hits']:5d}")


if __name__ == "__main__":
    main()
