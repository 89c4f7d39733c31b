"""Run layouts on real gloo ranks (one process each, a FileStore in tmp_path) and reassemble the results.

Several cases of the same world size share one launch, so the cost of starting
ranks is paid once per test.
"""

import os
import subprocess
import sys
from dataclasses import dataclass

import torch

from gcompile.layout import full_value

WORKER = os.path.join(os.path.dirname(__file__), "workers", "layout_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout, not another install


@dataclass
class LayoutResult:
    losses: list[float]
    """Mean loss of the global batch per step (from the last pipeline stage)."""
    grad_norms: list[float]
    params: dict[str, torch.Tensor]
    """Final parameters, reassembled to full single-device shapes."""
    ranks: list[dict]
    """What each rank reported (coords, peak_saved, compile_stats, ...), by rank."""


def run_layouts(tmp_path, configs, batches, lrs, timeout: float = 900, inject_inf=None) -> list[LayoutResult]:
    """Train each config on the given global batches and learning rates, one launch for all.

    `inject_inf` {step: rank} puts an inf into that rank's gradient before that step's update."""
    world = configs[0].world_size
    assert all(c.world_size == world for c in configs), "one launch runs cases of one world size"
    codes = launch(tmp_path, WORKER, dict(configs=configs, batches=batches, lrs=lrs, inject_inf=inject_inf or {}),
                   world, timeout)
    assert_succeeded(tmp_path, codes)
    return [_collect(tmp_path, i, world) for i in range(len(configs))]


def launch(tmp_path, worker: str, job: dict, world: int, timeout: float = 900) -> list[int | None]:
    """Run `worker JOB STORE` as `world` gloo ranks; their exit codes (None: killed at the timeout).

    The job is saved to tmp_path/job.pt; rank r's output goes to tmp_path/rank{r}.log."""
    job_path = os.path.join(tmp_path, "job.pt")
    torch.save(job, job_path)
    store = os.path.join(tmp_path, "store")
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
        log = open(os.path.join(tmp_path, f"rank{rank}.log"), "w")
        procs.append(subprocess.Popen([sys.executable, worker, job_path, store], env=env, stdout=log,
                                      stderr=subprocess.STDOUT))
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            codes.append(None)
    if any(code != 0 for code in codes):
        for proc in procs:
            proc.kill()
    return codes


def assert_succeeded(tmp_path, codes: list[int | None]) -> None:
    failed = [rank for rank, code in enumerate(codes) if code != 0]
    if failed:
        logs = "\n".join(f"--- rank {r} ---\n" + open(os.path.join(tmp_path, f"rank{r}.log")).read()[-3000:]
                         for r in failed)
        raise AssertionError(f"ranks {failed} failed:\n{logs}")


def _collect(tmp_path, case: int, world: int) -> LayoutResult:
    ranks = [torch.load(os.path.join(tmp_path, f"case{case}_rank{r}.pt"), weights_only=False) for r in range(world)]
    last = next(r for r in ranks if r["losses"][0] is not None)
    params = reassemble([(r["coords"], r["params"], r["values"]) for r in ranks])
    return LayoutResult(losses=last["losses"], grad_norms=ranks[0]["grad_norms"], params=params, ranks=ranks)


def reassemble(ranks: list[tuple]) -> dict[str, torch.Tensor]:
    """Full parameters from every rank's (coords, params, values by name), for cuts over any axes.

    The first holder of each piece (position 0 on every axis that does not cut it; pipeline
    stages apart) gives it; every other holder is a replica and must be bitwise equal to it."""
    by_rank = {coords.rank: values for coords, _, values in ranks}
    pieces, cuts = {}, {}
    for coords, params, values in ranks:
        for param in params:
            if param.tied_copy:
                continue
            first = coords.moved(**{axis: 0 for axis, _ in coords.ranks if axis != "pp" and not param.sharded_over(axis)})
            if first != coords:
                if not torch.equal(values[param.name], by_rank[first.rank][param.name]):
                    raise AssertionError(f"{param.name}: the copy on rank {coords.rank} {coords} differs from "
                                         f"rank {first.rank}'s")
                continue
            cuts[param.name] = (param, coords.axis_sizes)
            position = tuple(coords.axis_rank(s.axis) for s in param.shards)  # the first cut outermost
            pieces.setdefault(param.name, []).append((position, values[param.name]))
    return {name: full_value([v for _, v in sorted(found, key=lambda x: x[0])], *cuts[name])
            for name, found in pieces.items()}
