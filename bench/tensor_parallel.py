"""tp = 2 on 2 gloo ranks, one run: tokens/s of gcompile against DTensor tensor parallelism.

    python bench/tensor_parallel.py                              # 4 layers, 256 wide, 8 heads, T=256
    python bench/tensor_parallel.py --config configs/tiny.toml   # where per-op dispatch dominates

(a) DTensor: torch.distributed.tensor.parallel.parallelize_module, Megatron's plan
    (ColwiseParallel c_attn / c_fc, RowwiseParallel c_proj), eager, on gloo (torch's CPU default)
(b) the same model under torch.compile
(c) gcompile --tp 2 with the same plan (embedding and head replicated), graphs run uncompiled;
    tp group in shared memory (gcompile's default for CPU ranks on one host)
(d) the same, --compile
(e) gcompile --tp 2 --compile with its default plan: embedding, head and loss vocab-parallel
    too (Megatron's), 5 more collectives per microbatch for 1/tp of the head's work
(f) (b) on gcompile's shared-memory group: how much of (d) / (b) is the transport
(g) (d) on gloo (--tp-comm-backend gloo)
Same model, weights, batch and AdamW + clipping; the first step's loss is printed so
one can see they train the same model. The variants take turns step by step, so that
load from elsewhere on the machine hits them alike.
"""

import argparse
import os
import statistics
import sys
import time
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from flags import count, refused_in_one_line  # bench/, first on sys.path when run as a script
from gcompile import shm_group
from gcompile.compile import Compiler, compile_rank_program
from gcompile.config import build_config, load_toml
from gcompile.launch import join_world, spawn_local, under_launcher
from gcompile.layout import Param, Shard, local_value
from gcompile.mesh import group, register_group
from gcompile.models.gpt2 import GPT2, MEGATRON_PLAN
from gcompile.pipeline import build_rank_program
from gcompile.runtime import Runtime
from gcompile.state import TrainState
from gcompile.train import split_microbatches

TP = 2
DTENSOR_PLAN = tuple(entry for entry in MEGATRON_PLAN if not entry.startswith("transformer.wte"))
"""What parallelize_module gets below: the four linears of each layer."""


def local_attention(self, x):
    """nanoGPT's attention with sizes taken from the local shard (ColwiseParallel hands over local tensors)."""
    B, T, _ = x.size()
    q, k, v = self.c_attn(x).chunk(3, dim=2)  # 3 x (B, T, C/tp)
    hs = q.size(-1) // self.n_head
    q, k, v = (t.view(B, T, self.n_head, hs).transpose(1, 2) for t in (q, k, v))  # (B, nh/tp, T, hs)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, -1)))


def dtensor_model(config, mesh: DeviceMesh, compiled: bool):
    model = GPT2.build(config.model, config.train.seed)
    plan = {}
    for i, block in enumerate(model.transformer.h):
        attn = block.attn
        with torch.no_grad():  # ColwiseParallel cuts rows contiguously: order them rank by rank, q k v within
            for p in (attn.c_attn.weight, attn.c_attn.bias):
                param = Param("qkv", tuple(p.shape), (Shard("tp", 0, parts=(p.shape[0] // 3,) * 3),))
                p.copy_(torch.cat([local_value(p, param, {"tp": r}, {"tp": TP}) for r in range(TP)]))
        attn.n_head //= TP
        attn.forward = types.MethodType(local_attention, attn)
        plan |= {f"transformer.h.{i}.attn.c_attn": ColwiseParallel(), f"transformer.h.{i}.attn.c_proj": RowwiseParallel(),
                 f"transformer.h.{i}.mlp.c_fc": ColwiseParallel(), f"transformer.h.{i}.mlp.c_proj": RowwiseParallel()}
    parallelize_module(model, mesh, plan)
    return model, (torch.compile(model) if compiled else model)


def dtensor_step_fn(config, mesh: DeviceMesh, compiled: bool):
    t = config.train
    model, forward = dtensor_model(config, mesh, compiled)
    named = list(model.named_parameters())
    # foreach kernels refuse a mix of DTensor and plain tensors: one AdamW for each kind
    optimizers = [adamw([(n, p) for n, p in named if isinstance(p, DTensor) == sharded], t) for sharded in (True, False)]

    def step(tokens):
        micro = split_microbatches(tokens, t.micro_batch_size)
        losses = []
        for idx, targets in micro:
            loss = forward(idx, targets)
            (loss / len(micro)).backward()
            losses.append(loss.detach())
        clip_grad_norm([p for _, p in named], t.clip_grad)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return torch.stack(losses).mean()
    return step


def adamw(named, t) -> torch.optim.AdamW:
    decayed = [p for n, p in named if n.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))]
    rest = [p for n, p in named if not n.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))]
    return torch.optim.AdamW([{"params": decayed, "weight_decay": t.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=t.lr, betas=(t.adam_beta1, t.adam_beta2))


def clip_grad_norm(params, max_norm: float) -> None:
    """Megatron's way: squares of the sharded gradients summed over tp, the replicated ones counted once."""
    sharded = [p.grad.to_local() for p in params if isinstance(p.grad, DTensor)]
    replicated = [p.grad for p in params if not isinstance(p.grad, DTensor)]
    sq = torch.stack(torch._foreach_norm(sharded)).square().sum()
    dist.all_reduce(sq)
    norm = (sq + torch.stack(torch._foreach_norm(replicated)).square().sum()).sqrt()
    torch._foreach_mul_(sharded + replicated, (max_norm / (norm + 1e-6)).clamp(max=1.0))


def gcompile_step_fn(config, coords, compiled: bool, tp_group: dist.ProcessGroup):
    """Graphs name their group "tp": the step points that name at `tp_group` before it runs."""
    program = build_rank_program(config, coords, log=lambda _: None)
    functions, opt_step = compile_rank_program(program, Compiler(enabled=compiled))
    state = TrainState.initial(program, config.model, config.train.seed, "cpu")
    state.lr.fill_(config.train.lr)
    runtime = Runtime(program, functions, opt_step, state)

    def step(tokens):
        register_group("tp", tp_group)
        return runtime.train_step(split_microbatches(tokens, config.train.micro_batch_size)).loss
    return step


def bench_config(args, tp_plan: tuple[str, ...] = MEGATRON_PLAN):
    overrides = load_toml(args.config) if args.config else {
        "model": dict(n_layer=4, n_embd=256, n_head=8, block_size=256),
        "train": dict(micro_batch_size=8, global_batch_size=8, seq_length=256)}
    overrides.setdefault("parallel", {}).update(tp=TP, tp_plan=tp_plan)
    return build_config(overrides)


def rank_main(args) -> int:
    coords, _ = join_world({"tp": TP})
    shm, gloo = group("tp"), dist.group.WORLD  # the world is the one tp group
    if shm.name() != shm_group.BACKEND:
        raise SystemExit("bench/tensor_parallel.py compares against the shared-memory tp group, which needs "
                         "x86-64 Linux")
    config = bench_config(args)
    same_plan = bench_config(args, DTENSOR_PLAN)
    gloo_mesh, shm_mesh = (DeviceMesh.from_group(g, "cpu") for g in (gloo, shm))
    t = config.train
    tokens = torch.randint(0, config.model.vocab_size, (t.global_batch_size, t.seq_length + 1),
                           generator=torch.Generator().manual_seed(0))
    runs = {
        "(a) DTensor eager": lambda: dtensor_step_fn(config, gloo_mesh, compiled=False),
        "(b) DTensor torch.compile": lambda: dtensor_step_fn(config, gloo_mesh, compiled=True),
        "(c) gcompile (FX graphs)": lambda: gcompile_step_fn(same_plan, coords, False, shm),
        "(d) gcompile --compile": lambda: gcompile_step_fn(same_plan, coords, True, shm),
        "(e) gcompile, vocab-parallel": lambda: gcompile_step_fn(config, coords, True, shm),
        "(f) (b) on shared memory": lambda: dtensor_step_fn(config, shm_mesh, compiled=True),
        "(g) (d) on gloo": lambda: gcompile_step_fn(same_plan, coords, True, gloo),
    }
    steps = {name: make() for name, make in runs.items()}
    first_loss = {name: step(tokens).item() for name, step in steps.items()}
    seconds = {name: [] for name in steps}
    for i in range(args.warmup + args.iters):  # round-robin, so that load from elsewhere hits all alike
        for name, step in steps.items():
            dist.barrier()
            start = time.perf_counter()
            step(tokens)
            if i >= args.warmup:
                seconds[name].append(time.perf_counter() - start)
    results = {name: (statistics.median(s), first_loss[name]) for name, s in seconds.items()}
    if coords.rank == 0:
        m = config.model
        print(f"config: {m.n_layer} layers, {m.n_embd} wide, {m.n_head} heads, T={t.seq_length}, "
              f"{t.global_batch_size // t.micro_batch_size} x {t.micro_batch_size} samples/step, tp={TP}, "
              f"{torch.get_num_threads()} thread(s) per rank")
        eager, compiled = results["(a) DTensor eager"][0], results["(b) DTensor torch.compile"][0]
        print(f"{'':28s} {'tokens/s':>9s} {'vs (a)':>7s} {'vs (b)':>7s} {'step-1 loss':>12s}")
        for name, (median, loss) in results.items():
            print(f"{name:28s} {t.global_batch_size * t.seq_length / median:9.0f} {eager / median:6.2f}x "
                  f"{compiled / median:6.2f}x {loss:12.6f}")
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", help="TOML preset for model and batch (default: 4 layers, 256 wide, T=256)")
    p.add_argument("--iters", type=count, default=20)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    if not under_launcher():
        with refused_in_one_line(p):  # here, not as one traceback per rank
            bench_config(args)
        return spawn_local(TP, [os.path.abspath(__file__), *sys.argv[1:]])
    return rank_main(args)


if __name__ == "__main__":
    sys.exit(main())
