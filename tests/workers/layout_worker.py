"""One rank of a multi-rank numerics test: train each case of a job and save what the test compares.

Started by tests/multirank.py with RANK / WORLD_SIZE in the environment and a
FileStore path; writes case{i}_rank{r}.pt with the losses and grad norms this rank
saw and its local parameter pieces.
"""

import os
import sys

import torch
import torch.distributed as dist

from gcompile.compile import Compiler, compile_rank_program
from gcompile.axes import Coords
from gcompile.mesh import group, init_groups
from gcompile.pipeline import build_rank_program
from gcompile.runtime import Runtime
from gcompile.state import TrainState
from gcompile.train import split_microbatches


def run_case(config, batches, lrs, rank: int, inject_inf: dict) -> dict:
    """`inject_inf` {step: rank}: that rank's gradient gets an inf before that step's optimizer update."""
    p, t = config.parallel, config.train
    coords = Coords.from_rank(rank, config.mesh_sizes)
    init_groups(coords, p.tp_comm_backend)
    program = build_rank_program(config, coords, log=lambda _: None)
    compiler = Compiler(enabled=t.compile)
    for turn in range(coords.world_size):  # one rank compiles at a time; the rest hit Inductor's cache
        if turn == rank:
            functions, step = compile_rank_program(program, compiler)
        dist.barrier()
    state = TrainState.initial(program, config.model, t.seed, "cpu")
    runtime = Runtime(program, functions, step, state)
    per_rank = t.global_batch_size // p.dp
    losses, norms, skipped, scales, digests = [], [], [], [], []
    for i, (tokens, lr) in enumerate(zip(batches, lrs)):
        mine = tokens[coords.axis_rank("dp") * per_rank:(coords.axis_rank("dp") + 1) * per_rank]
        state.lr.fill_(lr)
        loss = runtime.forward_backward(split_microbatches(mine, t.micro_batch_size))
        if inject_inf.get(i) == rank:
            state.grads[0] = float("inf")
        grad_norm, skip = runtime.optimizer_step()
        if loss is not None and p.dp * p.cp > 1:  # a cp rank's loss is the mean over its tokens
            dist.all_reduce(loss, group=group("dp_cp"))
            loss /= p.dp * p.cp
        losses.append(None if loss is None else loss.item())
        norms.append(grad_norm.item())
        skipped.append(int(skip.item()))
        digests.append([float(t.double().sum()) for t in (state.params, state.exp_avg, state.exp_avg_sq, state.step)])
        scales.append(None if state.loss_scale is None else state.loss_scale.item())
    params = {name: view.clone() for name, view in program.layout.views(state.params).items()}
    return dict(coords=coords, losses=losses, grad_norms=norms, skipped=skipped, loss_scales=scales, digests=digests,
                optimizer_bytes=sum(b.numel() * b.element_size() for b in
                                    (state.main, state.exp_avg, state.exp_avg_sq) if b is not None),
                params=program.layout.params,
                values=params, peak_saved=dict(runtime.peak_saved), rank_peak_saved=runtime.rank_peak_saved,
                compile_stats=compiler.stats, tp_backend=group("tp").name() if p.tp > 1 else None)


def main(job_path: str, store_path: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    job = torch.load(job_path, weights_only=False)
    out_dir = os.path.dirname(job_path)
    for i, config in enumerate(job["configs"]):
        result = run_case(config, job["batches"], job["lrs"], rank, job.get("inject_inf", {}))
        torch.save(result, os.path.join(out_dir, f"case{i}_rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
