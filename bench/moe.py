"""Tokens/s of a mixture-of-experts GPT-2 trained five ways (3 on one rank, 2 on N ranks), same weights and batch.

    python bench/moe.py                          # moe-tiny's shape: 2 layers, 64 wide, 4 heads, 4 experts, top-2
    python bench/moe.py --num-experts 8 --moe-router-topk 2 --n-embd 256 --seq-length 256

(a) plain PyTorch, eager: gcompile's GPT module with each block's MoE swapped for
    LoopedMoE below, the way a user writes one (per expert: its tokens picked with
    nonzero, its MLP, the gated outputs index_add-ed back), + torch.optim.AdamW
(b) gcompile, FX graphs run uncompiled (the grouped matmul over rows sorted by expert)
(c) gcompile --compile
(d) gcompile --compile with --ep N (default 2): the experts split over N gloo ranks (dp N, so each takes
    1/N of the batch, one process each, the cores split evenly), tokens exchanged by all-to-all; launched
    after each round of (a)-(c), timed on its own (the median of barrier-lined steps), so its ratio to (a)
    of that round also carries launch-to-launch noise
(e) as (d) with the experts whole on both ranks (dp N, no ep): what the exchange costs against plain dp
All start from the same initial weights (LoopedMoE copies gcompile's stacked experts);
before timing, (a) and (b) must give the same loss on the batch (1e-5 relative), so
the rows compare one model. One step is forward, backward, clip and AdamW on the
same batch of random tokens. A round times `--iters` steps of each after
`--warmup`, the three taking turns step by step (bench/single_rank.py's
time_round_robin); tokens/s is from the median step, the ratio to (a) from the
same round. `--repeats` rounds show how much a shared machine moves the figures.
"""

import argparse
import json
import statistics

import torch
import torch.distributed as dist
import torch.nn as nn

from flags import (add_worker_flags, count, gcompile_runtime, join_gloo, median_step, refused_in_one_line,  # bench/
                   spawn_ranks, torch_step)
from gcompile.config import build_config
from gcompile.models.moe import MoE
from gcompile.train import split_microbatches
from single_rank import one_rank_runtime, time_round_robin


class LoopedMoE(MoE):
    """`moe`'s router and experts as plain PyTorch: one Linear-activation-Linear per expert, run in a
    loop over the tokens routed to it. An MoE subclass only so that gcompile's Block takes it for one."""

    def __init__(self, moe: MoE):
        fc, proj = moe.experts.c_fc, moe.experts.c_proj
        experts = nn.ModuleList(
            nn.Sequential(nn.Linear(*fc.weight.shape[1:], bias=fc.bias is not None), moe.experts.activation,
                          nn.Linear(*proj.weight.shape[1:], bias=proj.bias is not None))
            for _ in range(moe.num_experts))
        super().__init__(moe.router.in_features, experts, moe.num_experts, moe.topk, "softmax", None)
        with torch.no_grad():
            self.router.weight.copy_(moe.router.weight)
            for e, (first, _, second) in enumerate(experts):
                first.weight.copy_(fc.weight[e].t())  # stacked (E, in, out) -> Linear's (out, in)
                second.weight.copy_(proj.weight[e].t())
                if fc.bias is not None:
                    first.bias.copy_(fc.bias[e])
                    second.bias.copy_(proj.bias[e])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = x.reshape(-1, x.shape[-1])  # (N, C)
        logits = self.router(tokens)  # (N, E)
        top, chosen = logits.topk(self.topk, dim=-1)  # (N, k)
        gates = top.softmax(dim=-1)
        out = torch.zeros_like(tokens)
        counts = torch.zeros(self.num_experts)
        for e, expert in enumerate(self.experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            out.index_add_(0, token, expert(tokens[token]) * gates[token, slot, None])
            counts[e] = token.numel()
        balance = self.num_experts * (counts / chosen.numel() * logits.softmax(dim=-1).mean(0)).sum()
        return out.view(x.shape), balance


def looped_reference(config) -> nn.Module:
    """gcompile's eager GPT on its initial weights, every MoE layer replaced by a LoopedMoE of it."""
    model = config.model_spec.build(config.model, config.train.seed)
    for block in model.transformer.h:
        block.mlp = LoopedMoE(block.mlp)
    return model


def check_same_loss(reference: nn.Module, runtime, tokens: torch.Tensor) -> None:
    """Exit unless the looped reference and gcompile's uncompiled program agree on this batch's loss."""
    (idx, targets), = split_microbatches(tokens, len(tokens))
    with torch.no_grad():
        expected = reference(idx, targets).item()
    got = runtime.eval_step([(idx, targets)]).item()
    diff = abs(got - expected) / abs(expected)
    print(f"first-batch loss: (a) {expected:.7f}, (b) {got:.7f}, relative difference {diff:.1e}")
    if diff > 1e-5:
        raise SystemExit("moe.py: error: the looped reference and gcompile disagree on the loss; the rows would "
                         "compare different models")


def ep_worker(args) -> None:
    """One rank of (d): its dp slice of the batch each step; rank 0 writes the median step's seconds."""
    rank, world = join_gloo(args.store)
    config = make_config(args, dp=world, ep=world if args.variant == "ep" else 1)
    runtime = gcompile_runtime(config, rank)
    per_rank = args.batch_size // world
    mine = batch(args, config)[rank * per_rank:(rank + 1) * per_rank]
    seconds = median_step(lambda tokens: runtime.train_step(split_microbatches(tokens, per_rank)), mine,
                          args.warmup, args.iters)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(dict(seconds=seconds), f)
    dist.destroy_process_group()


def make_config(args, dp: int = 1, ep: int = 1):
    per_rank = args.batch_size // dp
    return build_config({
        "model": dict(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, block_size=args.seq_length,
                      num_experts=args.num_experts, moe_router_topk=args.moe_router_topk, moe_aux_loss_coeff=0.01),
        "parallel": dict(dp=dp, ep=ep),
        "train": dict(micro_batch_size=per_rank, global_batch_size=args.batch_size, seq_length=args.seq_length,
                      compile=dp > 1),
    })


def batch(args, config) -> torch.Tensor:
    return torch.randint(0, config.model.vocab_size, (args.batch_size, args.seq_length + 1),
                         generator=torch.Generator().manual_seed(0))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--num-experts", type=count, default=4, help="experts per layer (default: %(default)s)")
    p.add_argument("--moe-router-topk", type=int, default=2)
    p.add_argument("--batch-size", type=count, default=8,
                   help="samples per step, one microbatch (default: %(default)s)")
    p.add_argument("--iters", type=count, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=count, default=5)
    p.add_argument("--ep", type=count, default=2, help="ranks of rows (d) (ep N) and (e) (dp N); 1: neither row "
                                                      "(default: %(default)s)")
    add_worker_flags(p)
    args = p.parse_args()
    if args.worker:
        return ep_worker(args)
    if args.batch_size % args.ep:  # its config would name --global-batch-size, which the bench does not take
        p.error(f"--batch-size {args.batch_size} must be a multiple of --ep {args.ep}: rows (d) and (e) split it "
                f"over the ep ranks")
    with refused_in_one_line(p):
        config = make_config(args)
        if args.ep > 1:
            make_config(args, args.ep, args.ep)  # a layout the config refuses stops here, before any timing
    tokens = batch(args, config)
    print(f"config: gpt2, {args.n_layer} layers, {args.n_embd} wide, {args.n_head} heads, {args.num_experts} "
          f"experts, top-{args.moe_router_topk}, T={args.seq_length}, {args.batch_size} samples/step, "
          f"{torch.get_num_threads()} threads")
    reference = looped_reference(config)
    runtimes = {compiled: one_rank_runtime(config, compiled) for compiled in (False, True)}
    check_same_loss(reference, runtimes[False], tokens)
    steps = {"(a) looped experts, eager": torch_step(reference, reference, config)}
    for name, runtime in (("(b) gcompile (FX graphs)", runtimes[False]), ("(c) gcompile --compile", runtimes[True])):
        steps[name] = lambda batch, runtime=runtime: runtime.train_step(split_microbatches(batch, len(batch)))
    rounds = []
    for _ in range(args.repeats):
        rounds.append(time_round_robin(steps, tokens, args.warmup, args.iters))
        if args.ep > 1:
            worker = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
                      ("n_layer", "n_embd", "n_head", "seq_length", "num_experts", "moe_router_topk", "batch_size",
                       "iters", "warmup")]
            rounds[-1][f"(d) --compile, ep {args.ep}"] = spawn_ranks(__file__, worker + ["--variant=ep"],
                                                                     args.ep)["seconds"]
            rounds[-1][f"(e) --compile, dp {args.ep}"] = spawn_ranks(__file__, worker + ["--variant=dp"],
                                                                     args.ep)["seconds"]
    per_step = args.batch_size * args.seq_length
    print(f"{'':27s} {'tokens/s, round by round':>{8 * args.repeats}s}   {'vs (a), median [min-max]'}")
    for name in rounds[0]:
        rates = "".join(f"{per_step / r[name]:8.0f}" for r in rounds)
        ratios = [r["(a) looped experts, eager"] / r[name] for r in rounds]
        print(f"{name:27s} {rates}   {statistics.median(ratios):5.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]")


if __name__ == "__main__":
    main()
