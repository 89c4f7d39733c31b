"""Run layouts on real gloo ranks (one process each, a FileStore in tmp_path) and reassemble the results.

For numerics alone, gcompile.harness runs the same layouts in this process, much faster;
these launches are for what only real ranks show: transports, launch, compile, checkpoints.

Several cases of the same world size share one launch, so the cost of starting
ranks is paid once per test. Ranks are forked from a server that imported torch and
gcompile once for the whole session (multiprocessing's forkserver): each is still a
process of its own with its own gloo, but skips the seconds of imports a fresh
interpreter pays, which over the suite's launches add up to minutes on two cores.
"""

import multiprocessing
import os
import runpy
import signal
import sys

import torch

from gcompile.harness import LayoutResult, assemble
from gcompile.launch import PRELOAD

WORKER = os.path.join(os.path.dirname(__file__), "workers", "layout_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout, not another install


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
    procs = [_FORKS.Process(target=_run_rank, args=(worker, [job_path, store], rank, world,
                                                    os.path.join(tmp_path, f"rank{rank}.log")))
             for rank in range(world)]
    for proc in procs:
        proc.start()
    codes = []
    for proc in procs:
        proc.join(timeout)
        codes.append(proc.exitcode)
    if any(code != 0 for code in codes):
        for proc in procs:
            proc.kill()
    for proc in procs:
        proc.join()
    return codes


_FORKS = multiprocessing.get_context("forkserver")  # the one fork server of this process, the launcher's too:
_FORKS.set_forkserver_preload([*PRELOAD, "torch.distributed.checkpoint", "torch.export",  # it preloads for both
                               "torch._functorch.aot_autograd", "gcompile.harness"])


def _run_rank(worker: str, argv: list[str], rank: int, world: int, log_path: str) -> None:
    """In a forked rank: its environment and output file, then the worker script as __main__."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the server ignores it (gcompile.fork_server); a rank does not
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    with open(log_path, "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    sys.argv = [worker, *argv]
    runpy.run_path(worker, run_name="__main__")


def assert_succeeded(tmp_path, codes: list[int | None]) -> None:
    failed = [rank for rank, code in enumerate(codes) if code != 0]
    if failed:
        logs = "\n".join(f"--- rank {r} ---\n" + open(os.path.join(tmp_path, f"rank{r}.log")).read()[-3000:]
                         for r in failed)
        raise AssertionError(f"ranks {failed} failed:\n{logs}")


def _collect(tmp_path, case: int, world: int) -> LayoutResult:
    return assemble([torch.load(os.path.join(tmp_path, f"case{case}_rank{r}.pt"), weights_only=False)
                     for r in range(world)])
