"""Measure this machine for the cost model and write its machine file (gcompile/machine.py).

    python -m gcompile.calibrate                 # measure (75-95 s on 2 cores), write, print
    python -m gcompile.calibrate --show          # print the file in use, measure nothing
    python -m gcompile.calibrate --out FILE      # write FILE too (a GPU's file kept in the repo)
    python -m gcompile.calibrate --force         # write even a measurement taken while the machine was busy

A file there already is replaced only if it is a machine file (--out names no config or README), and a
measurement that looks taken while other work ran (busy_warning) replaces none that does not: that
file is kept, and said so, unless --force.

Compute, in this process, at 1 thread and at all cores (what ranks get: the cores
shared evenly): square matmuls of 32 to 1024 (float32; bfloat16 from 64; both to 4096 on a GPU), causal
attention forward and backward, an element-wise add over 16 MiB (bytes moved per
second) and the host time of a tiny operator call (a mix of add, view, mul,
transpose and sum on 8 x 8). On a GPU the same on the device, synchronized.

Ranks at once, in a world of 2, 4 and 8 spawned ranks each (on GPUs: one per
GPU): how much slower each computes while all do (the cores shared), and all-reduce,
all-gather, reduce-scatter and all-to-all over them, each at 8 KiB, 1 MiB and
4 MiB (the latency from the smallest, the bandwidth from the two largest); in the world of two,
send/recv (half a round trip). Transports: gloo, and on CPU the shared-memory tp
group (gcompile/shm_group.py); on GPUs nccl. Last, on CPU, what a gloo rank loses
each time it waits on the others while every rank computes between waits (an
all-reduce of pairs and of all; a message, while the other ranks compute): it gives up
its core and waits to be run again.
"""

import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta

from gcompile import shutdown

if __name__ == "__main__":  # before the imports below load torch (seconds): a Ctrl-C then is one line too
    shutdown.install(shutdown.stopper(exit_signal_handler=False), "python -m gcompile.calibrate")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from gcompile import collectives
from gcompile import machine as machine_file
from gcompile import shm_group
from gcompile.arguments import ArgumentParser
from gcompile.machine import KINDS, Link, Machine
from gcompile.mesh import register_group
from gcompile.torch_api import resolve_process_group

aten = torch.ops.aten

SHM_KINDS = KINDS[:3]
"""What the shared-memory tp group does (tensor parallelism asks no more; other groups use gloo)."""
SIZES = (8 << 10, 1 << 20, 4 << 20)
"""Message bytes measured: the smallest gives the latency, the two largest the bandwidth (_link)."""


def timed(fn, device: str, seconds: float = 0.05) -> float:
    """Median seconds of one call of `fn`, over enough calls to fill about `seconds` (after one warm-up)."""
    fn()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    once = max(time.perf_counter() - start, 1e-6)
    times = []
    for _ in range(max(3, min(50, int(seconds / once)))):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_curve(dtype: torch.dtype, sizes: list[int], device: str) -> list[list[float]]:
    curve = []
    for n in sizes:
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
        curve.append([2.0 * n ** 3, 2.0 * n ** 3 / timed(lambda: torch.mm(a, b), device)])
    return curve


def attention_curve(device: str) -> list[list[float]]:
    """Causal attention forward + backward; FLOPs as torch's counter counts them (the cost model's unit)."""
    curve = []
    for batch, heads, length, width in ((2, 4, 64, 16), (4, 8, 128, 32), (4, 8, 256, 32), (8, 16, 512, 64)):
        shape = (batch, heads, length, width)
        q, k, v = (torch.randn(shape, device=device, requires_grad=True) for _ in range(3))
        grad = torch.randn(shape, device=device)

        def step():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(grad)
        flops = sdpa_flop_count(shape, shape, shape) + sdpa_backward_flop_count(shape, shape, shape, shape)
        curve.append([float(flops), flops / timed(step, device)])
    return curve


def elementwise_bandwidth(device: str) -> float:
    """Bytes read and written per second by the element-wise ops graphs hold most (add, mul, div, where,
    GELU and its gradient's erf and exp), over activation-sized tensors (4 MiB): a plain add alone moves
    bytes about three times as fast as GELU does."""
    a, b = torch.randn(1 << 20, device=device), torch.randn(1 << 20, device=device)
    ops = (lambda: torch.add(a, b), lambda: torch.mul(a, b), lambda: torch.div(a, b), lambda: torch.where(a > 0, a, b),
           lambda: F.gelu(a), lambda: torch.erf(a), lambda: torch.exp(a))
    moved = (3, 3, 3, 4.25, 2, 2, 2)  # tensors of a's size read and written (where: a bool mask, a quarter)
    return sum(moved) * a.numel() * 4 / timed(lambda: [op() for op in ops], device)


def inplace_bandwidth(device: str) -> float:
    """The same for ops that write into an input, as an optimizer step's and a gradient accumulator's do
    (add_, mul_, lerp_, addcmul_): no output to allocate, so several times the rate of those above."""
    a, b, c = (torch.randn(1 << 20, device=device) for _ in range(3))
    ops = (lambda: a.add_(b), lambda: a.mul_(0.5), lambda: a.lerp_(b, 0.1), lambda: c.addcmul_(a, b, value=0.1))
    moved = (3, 2, 3, 4)  # as gcompile.cost_model counts: the output, then every input (the written one too)
    return sum(moved) * a.numel() * 4 / timed(lambda: [op() for op in ops], device)


def workload(device: str, tokens: int = 1024) -> Callable[[], None]:
    """A bit of what a rank computes: a 256-wide transformer MLP's forward and backward (layer norm, two
    matmuls, GELU, a residual) on `tokens` tokens, as eager calls (16 tokens: almost only operator calls)."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.LayerNorm(256), torch.nn.Linear(256, 1024), torch.nn.GELU(),
                              torch.nn.Linear(1024, 256)).to(device)
    x = torch.randn(tokens, 256, device=device, requires_grad=True)

    def step():
        (x + mlp(x)).sum().backward()
    return step


def measure_compute(device: str, log) -> dict:
    cores = os.cpu_count() or 1
    thread_counts = ["gpu"] if device == "cuda" else [str(t) for t in sorted({1, cores})]
    saved = torch.get_num_threads()
    found = dict(matmul={}, attention={}, bandwidth={}, inplace_bandwidth={})
    try:
        for threads in thread_counts:
            if threads != "gpu":
                torch.set_num_threads(int(threads))
            log(f"  compute at {threads} thread(s): matmul, attention, element-wise bandwidth")
            large = [2048, 4096] if device == "cuda" else []  # a GPU's matmuls are still speeding up at 1024
            found["matmul"][threads] = dict(
                float32=matmul_curve(torch.float32, [32, 64, 128, 256, 512, 1024] + large, device),
                bfloat16=matmul_curve(torch.bfloat16, [64, 256, 512] + large, device))
            found["attention"][threads] = attention_curve(device)
            found["bandwidth"][threads] = elementwise_bandwidth(device)
            found["inplace_bandwidth"][threads] = inplace_bandwidth(device)
        torch.set_num_threads(1)
        x = torch.ones(8, 8, device=device)
        mix = (lambda: aten.add.Tensor(x, x), lambda: aten.view.default(x, [64]), lambda: aten.mul.Tensor(x, 2.0),
               lambda: aten.t.default(x), lambda: aten.sum.dim_IntList(x, [1]))  # what graphs call most, tiny
        found["op_seconds"] = timed(lambda: [op() for _ in range(20) for op in mix], device) / (20 * len(mix))
    finally:
        torch.set_num_threads(saved)
    return found


def _rank_main(rank: int, calibration: int, world: int, store_path: str, transports: list[str],
               repeats: dict[int, int], out: str) -> None:
    """One rank of a world of `world`: every rank computes at once (the slowdown over one rank computing
    `repeats` workloads by itself), then each collective over all of them, and send/recv in
    a world of two. A world of exactly the ranks measured, as a run of that many has: ranks left waiting in
    a larger world would take their share of the cores too. It ends with its calibration, pid `calibration`
    (torch's own tie sends SIGINT, which ranks never take: gcompile.shutdown.starting_helpers)."""
    shutdown.end_with_parent(calibration)
    torch.set_num_threads(1)
    device = "cuda" if "nccl" in transports else "cpu"
    if device == "cuda":
        torch.cuda.set_device(rank)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(minutes=5))
    if "shm" in transports:
        shm_group.register()
    found = {"contention": {str(tokens): _contention(tokens, n) for tokens, n in repeats.items()}
             if device == "cpu" else {}}
    for transport in transports:
        name = f"calibrate_{transport}"
        register_group(name, dist.new_group(list(range(world)), backend=shm_group.BACKEND if transport == "shm"
                                            else None))
        for kind in KINDS if transport != "shm" else SHM_KINDS:
            seconds = [_collective_seconds(kind, nbytes, world, name, device) for nbytes in SIZES]
            found.setdefault(transport, {})[kind] = _link(seconds)
        if transport != "shm" and world == 2:
            seconds = [_send_recv_seconds(nbytes, rank, dist.group.WORLD, device) for nbytes in SIZES]
            found[transport]["send_recv"] = _link(seconds)
    if device == "cpu":
        found["waits"] = _waits(transports, rank, world)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(found, f)
    dist.barrier()
    dist.destroy_process_group()


def _contention(tokens: int, repeats: int, rounds: int = 5) -> float:
    """How much slower ranks compute when all of this world's compute at once: the same work in each, the
    slowest one's wall time over rank 0's alone just before, the others waiting in a barrier (a throughput:
    timing single calls would see the scheduler's time slices, not the share). Alone and together are
    timed in the same round so that a machine whose speed drifts (a shared host) is compared with itself;
    the median of `rounds`."""
    work = workload("cpu", tokens)
    work()
    ratios = []
    for _ in range(rounds):
        dist.barrier()
        alone = torch.tensor(_timed_repeats(work, repeats) if dist.get_rank() == 0 else 0.0)
        dist.broadcast(alone, 0)
        dist.barrier()
        together = torch.tensor(_timed_repeats(work, repeats))
        dist.all_reduce(together, op=dist.ReduceOp.MAX)
        ratios.append(together.item() / alone.item())
    return statistics.median(ratios)


WAIT_TOKENS, WAIT_ROUNDS, WAIT_BLOCKS, MESSAGE_SECONDS = 128, 8, 4, 0.5
"""The work between two waits (about 3 ms alone here), waits per timed block, blocks per wait, and how long
messages are timed for a receiver's wait."""


def _waits(transports: list[str], rank: int, world: int) -> dict[str, dict[str, float]]:
    """transport -> what a rank waits on ("2": an all-reduce of pairs of ranks, "<world>": of every rank,
    "send_recv": a pipeline message) -> the seconds it loses beyond the call itself while the cores are
    shared: a rank that waits gives up its core and gets one back only when the scheduler next runs it.
    An all-reduce: a block of rounds of work alone against one of work and the all-reduce (consecutive
    waits, as a graph's are), every rank computing; a wait costs the median over blocks of the difference per
    wait (a block's time its slowest rank's), less what the call takes with the ranks lined up and idle (what
    the link measured). A message: _message_wait."""
    work = workload("cpu", WAIT_TOKENS)
    work()
    x = torch.ones(SIZES[0] // 4)

    def all_reduces(name: str) -> Callable[[bool], None]:
        def block(waits: bool) -> None:
            for _ in range(WAIT_ROUNDS):
                work()
                if waits:
                    collectives.all_reduce(x, name)
        return block

    measured = {}  # (transport, what) -> (a block with or without its waits, how many waits, one wait's idle call)
    for transport in transports:
        if transport == "shm":
            continue  # its ranks poll, keeping their cores: gcompile.cost_model.predict counts them computing
        pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)] if world > 2 else []
        if pairs:
            register_group(f"calibrate_{transport}_pair", pairs[rank // 2])
        groups = {str(world): f"calibrate_{transport}", **({"2": f"calibrate_{transport}_pair"} if pairs else {})}
        for what, name in groups.items():
            measured[(transport, what)] = (all_reduces(name), WAIT_ROUNDS,
                                           _lined_up(lambda: collectives.all_reduce(x, name), dist.group.WORLD, "cpu"))
    lost = []
    for block, count, _ in measured.values():
        per_wait = []
        for _ in range(WAIT_BLOCKS):
            seconds = []
            for with_waits in (False, True):
                dist.barrier()
                start = time.perf_counter()
                block(with_waits)
                seconds.append(torch.tensor(time.perf_counter() - start))
                dist.all_reduce(seconds[-1], op=dist.ReduceOp.MAX)
            per_wait.append((seconds[1] - seconds[0]).item() / count)
        lost.append(statistics.median(per_wait))
    idle = torch.tensor([call for _, _, call in measured.values()])
    dist.all_reduce(idle)
    found = {}
    for (transport, what), seconds in zip(measured, (torch.tensor(lost) - idle / world).clamp(min=0).tolist()):
        found.setdefault(transport, {})[what] = seconds
    if "gloo" in transports:
        found.setdefault("gloo", {})["send_recv"] = _message_wait(work, rank, world)
    return found


def _message_wait(work: Callable[[], None], rank: int, world: int) -> float:
    """What a pipeline message's receiver loses while the other ranks compute, as a pipeline's other stages do:
    asleep in its receive, it runs again only when the scheduler gives it a core. For MESSAGE_SECONDS rank 0
    computes and sends to rank 1, which waits in its receive and answers; the time from each send to rank 1
    running again (one clock: perf_counter is the host's monotonic clock) averaged, with ranks 2.. computing
    throughout, less the same with them asleep. Most hand-overs cost nothing, one in several a time slice (4 ms
    here): the mean counts."""
    stamp = torch.zeros(1, dtype=torch.float64)
    means = []
    for busy in (False, True):
        dist.barrier()
        until = time.perf_counter() + MESSAGE_SECONDS
        if rank >= 2:
            while busy and time.perf_counter() < until + MESSAGE_SECONDS / 4:  # past rank 0's last message
                work()
            continue
        delays = []
        while True:
            if rank == 0:
                work()
                stamp[0] = time.perf_counter() if time.perf_counter() < until else -1.0  # -1: the last
                dist.send(stamp, 1)
                if stamp.item() < 0:
                    break
                dist.recv(stamp, 1)
            else:
                dist.recv(stamp, 0)
                if stamp.item() < 0:
                    break
                delays.append(time.perf_counter() - stamp.item())
                dist.send(stamp, 0)
        means.append(statistics.mean(delays) if delays else 0.0)
    lost = torch.tensor(means[1] - means[0] if rank == 1 else 0.0)
    dist.broadcast(lost, 1)
    return max(0.0, lost.item())


def _timed_repeats(work: Callable[[], None], repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        work()
    return time.perf_counter() - start


def _link(seconds: list[float]) -> dict:
    """Latency and bandwidth from the seconds of SIZES: the bandwidth the slope between the two largest calls,
    the latency what the smallest one takes beyond it. A least-squares line through all three let noise in
    the largest call move the latency by milliseconds (a 2-rank gloo all-reduce: 0.4 ms in one calibration,
    3.1 ms in the next), and small messages, which a line's latency prices, are the most frequent. A slope
    that noise made flat or negative falls back to the largest call's average rate."""
    slope = (seconds[-1] - seconds[-2]) / (SIZES[-1] - SIZES[-2])
    if slope <= 0:
        slope = seconds[-1] / SIZES[-1]
    return dict(latency=max(seconds[0] - slope * SIZES[0], 1e-6), bandwidth=1 / slope)


def _collective_seconds(kind: str, nbytes: int, size: int, name: str, device: str) -> float:
    """One call, as graphs make it (a functional collective on a group registered by name), moving `nbytes`
    (the larger of input and output, as gcompile.comm_summary counts)."""
    big = torch.ones(nbytes // 4, device=device)
    piece = torch.ones(nbytes // 4 // size, device=device)
    calls = {"all_reduce": lambda: collectives.all_reduce(big, name),
             "all_gather_into_tensor": lambda: collectives.all_gather(piece, name, size),
             "reduce_scatter_tensor": lambda: collectives.reduce_scatter(big, name, size),
             "all_to_all_single": lambda: collectives.all_to_all(big, name, size)}
    return _lined_up(calls[kind], resolve_process_group(name), device)


def _send_recv_seconds(nbytes: int, rank: int, group, device: str) -> float:
    x = torch.ones(nbytes // 4, device=device)

    def round_trip():
        peer = dist.get_global_rank(group, 1 - rank)
        if rank == 0:
            dist.send(x, peer, group=group)
            dist.recv(x, peer, group=group)
        else:
            dist.recv(x, peer, group=group)
            dist.send(x, peer, group=group)
    return _lined_up(round_trip, group, device) / 2


def _lined_up(call, group, device: str, reps: int = 9) -> float:
    """Median seconds of `call` with the group's ranks lined up by a barrier before each."""
    times = []
    for _ in range(reps + 1):
        dist.barrier(group=group)
        start = time.perf_counter()
        call()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


COMPUTE_TOKENS, HOST_TOKENS = 1024, 16
"""The contention workloads: mostly arithmetic (slowed 2.1x by 4 ranks on 2 cores here), and mostly
operator calls, host work (2.4x: time slices cost such work more)."""


def measure_collectives(device: str, log) -> tuple[dict[str, float], dict[str, float], dict, dict]:
    """(compute slowdown by ranks at once, the same for operator calls, links by transport, kind and group
    size, waits by transport, ranks and what is waited), from a world of 2, 4 and 8 ranks each (on GPUs: one
    of every GPU, and no waits: each rank has its own)."""
    sizes = [torch.cuda.device_count()] if device == "cuda" else [2, 4, 8]
    transports = ["nccl"] if device == "cuda" else ["gloo"] + (["shm"] if shm_group.available() else [])
    contention, host_contention, links, waits = {"1": 1.0}, {"1": 1.0}, {}, {}
    if sizes[0] < 2:
        return contention, host_contention, links, waits
    torch.set_num_threads(1)
    repeats = {tokens: max(1, int(0.3 / timed(workload("cpu", tokens), "cpu")))  # 0.3 s: round starts skew less
               for tokens in (COMPUTE_TOKENS, HOST_TOKENS)}
    for world in sizes:
        log(f"  {world} ranks at once: compute, and {', '.join(transports)} collectives over them")
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "links.json")
            with shutdown.starting_helpers():
                ranks = mp.start_processes(_rank_main, args=(os.getpid(), world, os.path.join(tmp, "store"),
                                                              transports, repeats, out),
                                           nprocs=world, join=False, start_method="spawn")
            _join_or_take_along(ranks)
            with open(out) as f:
                raw = json.load(f)
        slowdowns = raw.pop("contention")
        for transport, what in raw.pop("waits", {}).items():
            waits.setdefault(transport, {})[str(world)] = what
        contention[str(world)] = slowdowns.get(str(COMPUTE_TOKENS), 1.0)
        host_contention[str(world)] = slowdowns.get(str(HOST_TOKENS), 1.0)
        for transport, kinds in raw.items():
            for kind, link in kinds.items():
                links.setdefault(transport, {}).setdefault(kind, {})[str(world)] = Link(**link)
    return contention, host_contention, links, waits


def _join_or_take_along(ranks: mp.ProcessContext) -> None:
    """Wait for the ranks; a signal meanwhile kills them, then stops calibrate as before: a rank still importing
    torch (seconds, with 8 ranks on 2 cores) would only then see that calibrate has gone (_rank_main)."""
    stop = shutdown.set_action(lambda signum: ([rank.kill() for rank in ranks.processes], stop(signum)))
    try:
        while not ranks.join():
            pass
    finally:
        shutdown.set_action(stop)


def calibrate(log=print) -> Machine:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    key, description = machine_file.fingerprint()
    log(f"calibrating {description}")
    start = time.perf_counter()
    compute = measure_compute(device, log)
    contention, host_contention, collectives, waits = measure_collectives(device, log)
    log(f"measured in {time.perf_counter() - start:.0f} s")
    return Machine(fingerprint=key, description=description, cores=os.cpu_count() or 1, collectives=collectives,
                   contention=contention, host_contention=host_contention, waits=waits, **compute)


def busy_warning(machine: Machine) -> str | None:
    """A warning when the machine looks measured while other work ran: on idle cores, more threads never multiply
    the largest matrices slower than one does. A file of such a measurement would be reused until the machine
    changes: main writes none over one that does not look so (worth_keeping)."""
    largest = {int(threads): curves["float32"][-1][1] for threads, curves in machine.matmul.items()
               if threads.isdigit()}
    most = max(largest, default=1)
    if most == 1 or largest[most] >= largest[1]:
        return None
    return (f"warning: {most} threads multiplied matrices slower than 1 ({largest[most] / 1e9:.1f} against "
            f"{largest[1] / 1e9:.1f} GFLOP/s): other work was likely running, and its share of the cores is in "
            f"this measurement; measure again when the machine is idle")


def worth_keeping(path: str) -> bool:
    """Whether the machine file at `path` must not be replaced by a measurement busy_warning warns of: there, usable,
    and not looking measured while busy itself (every plan after would be wrong: tiny at 1 rank predicted 723.8 ms,
    against 8.1 ms)."""
    try:
        found = machine_file.load(path)
    except machine_file.MachineError:
        return False
    return busy_warning(found) is None


def describe(machine: Machine) -> str:
    lines = [f"machine {machine.fingerprint}: {machine.description}"]
    for threads, curves in machine.matmul.items():
        for dtype, curve in curves.items():
            lines.append(f"  matmul {dtype:<9} {threads:>3} thread(s): "
                         + ", ".join(f"{c[0]:.0e} FLOPs {c[1] / 1e9:.1f} GFLOP/s" for c in curve))
    for threads, curve in machine.attention.items():
        lines.append(f"  attention {threads:>3} thread(s): "
                     + ", ".join(f"{c[0]:.0e} FLOPs {c[1] / 1e9:.1f} GFLOP/s" for c in curve))
    for threads, rate in machine.bandwidth.items():
        lines.append(f"  element-wise {threads:>3} thread(s): {rate / 1e9:.1f} GB/s, in place "
                     f"{machine.inplace_bandwidth[threads] / 1e9:.1f} GB/s")
    lines.append(f"  one operator call: {machine.op_seconds * 1e6:.1f} us")
    lines.append("  operator-call slowdown with k ranks at once: " + ", ".join(
        f"k={k} {f:.2f}x" for k, f in machine.host_contention.items()))
    lines.append("  compute slowdown with k ranks at once: " + ", ".join(f"k={k} {f:.2f}x"
                                                                        for k, f in machine.contention.items()))
    for transport, worlds in machine.waits.items():
        for world, waited in worlds.items():
            lines.append(f"  {transport:<5} waits with {world} ranks sharing the cores: " + ", ".join(
                f"{'a message' if what == 'send_recv' else f'all-reduce of {what}'} {seconds * 1e3:.1f} ms"
                for what, seconds in waited.items()))
    for transport, kinds in machine.collectives.items():
        for kind, sizes in kinds.items():
            lines.append(f"  {transport:<5} {kind:<23} " + ", ".join(
                f"{size} ranks {link.latency * 1e6:.0f} us + {link.bandwidth / 1e9:.2f} GB/s"
                for size, link in sizes.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m gcompile.calibrate", description=__doc__.split("\n")[0])
    p.add_argument("--out", help="also write the machine file here (default: only this machine's cache file); "
                                 "a file there must be a machine file")
    p.add_argument("--show", action="store_true",
                   help="print the machine file in use (or the one --out names); measure nothing")
    p.add_argument("--force", action="store_true",
                   help="write a measurement that looks taken while other work ran over a good machine file")
    args = p.parse_args(argv)
    path = machine_file.default_path()
    if args.show:
        try:
            found = machine_file.load(args.out)
        except machine_file.MachineError as e:
            print(f"python -m gcompile.calibrate: error: {e}", file=sys.stderr)
            return 2
        if found is None:
            print(f"python -m gcompile.calibrate: error: {machine_file.missing()}", file=sys.stderr)
            return 2
        print(describe(found))
        print(f"read from {args.out or path}")
        return 0
    for target, named in ((path, f"this machine's file {path} (XDG_CACHE_HOME moves it)"),
                          (args.out, f"--out {args.out!r}")):
        if target is not None and (why := machine_file.cannot_write(target)):
            print(f"python -m gcompile.calibrate: error: {named}: {why}", file=sys.stderr)
            return 2
    if args.out and (why := machine_file.foreign(args.out)):  # a config, a README: the user's, not ours to replace
        print(f"python -m gcompile.calibrate: error: --out {args.out!r} is not a machine file: {why}; calibrate "
              f"replaces only a machine file: give a new file name, or move that file away", file=sys.stderr)
        return 2
    measured = calibrate()
    print(describe(measured))
    targets = [path] + ([args.out] if args.out and os.path.abspath(args.out) != os.path.abspath(path) else [])
    warning = busy_warning(measured)
    kept = [target for target in targets if warning and not args.force and worth_keeping(target)]
    written = [target for target in targets if target not in kept]
    for target in written:
        machine_file.save(measured, target)
    if warning:
        print(warning, file=sys.stderr)
    if kept:
        print(f"kept {' and '.join(kept)}, which does not look measured while busy; add --force to write this "
              f"measurement over it", file=sys.stderr)
    if written:
        print(f"written to {' and '.join(written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
