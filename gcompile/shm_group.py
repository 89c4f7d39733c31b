"""A c10d process group for CPU ranks on one host: collectives through shared memory.

gloo moves tensors between local ranks over loopback TCP: an all-reduce of 2 MiB between
two ranks takes about 5 ms here, and Megatron's tensor parallelism puts four of them on
every layer's critical path. Through a shared mapping the same all-reduce is a copy and
an add, about 0.8 ms. This group does what tensor-parallel graphs ask of their group
(all-reduce, all-gather and reduce-scatter into tensors), barriers, and the broadcast and
scatter DTensor uses to place weights. The graphs do not change: they hold torch's
functional collectives, which find this group by name like any other.

One mapping per group: a counter per rank and two sets of slots, a slot per rank.
Step k: every rank copies its input into its slot of set k % 2, publishes k in its
counter, waits until every counter reads k, then reads the others' slots. Each rank sums
all slots itself, in rank order, so every rank gets bitwise the same result. Step k + 1
uses the other set; set k % 2 is written again at step k + 2, which a rank reaches only
after every rank has published k + 1, and each rank finishes reading step k before it
starts another. Tensors larger than a slot go in pieces.

An all-reduce that fits one slot returns once its input is published and sums at `wait`
(at most one such is in flight; the next collective finishes it first), so compute the
graph places between the two (passes/tp_comm_overlap.py) covers the other ranks' arrival.

x86-64 Linux only (`available()`): stores reach other cores in program order there once
a locked instruction has drained the store and write-combining buffers, which is what
`_publish` relies on. Other memory models need real fences.
"""

import mmap
import os
import platform
import threading
import time
import uuid
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

BACKEND = "gcompile_shm"
SLOT_BYTES = 4 << 20
"""Bytes per rank per step; larger tensors go in pieces of this size."""
_COUNTER_BYTES = 64
"""Each rank's counter on its own cache line."""
_SPIN_SECONDS = 0.05
"""A rank with a core of its own waits by polling this long without a system call: measured here, a
neighbour core's sched_yield or sleep loop slows this core's matmuls by 15-20%, a poll loop not at all."""
_YIELD_SECONDS = 2e-3
"""Ranks that share cores yield theirs instead, this long, then sleep between polls."""

_COMBINE = {ReduceOp.SUM: torch.add, ReduceOp.AVG: torch.add, ReduceOp.PRODUCT: torch.mul,
            ReduceOp.MAX: torch.maximum, ReduceOp.MIN: torch.minimum}
_store_order = threading.Lock()


def available() -> bool:
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64") and os.path.isdir("/dev/shm")


def mapping_bytes(size: int) -> int:
    """/dev/shm taken by one group of `size` ranks while it lives: counters, then two sets of slots."""
    return _header_bytes(size) + 2 * size * SLOT_BYTES


def _header_bytes(size: int) -> int:
    return -(-size * _COUNTER_BYTES // mmap.PAGESIZE) * mmap.PAGESIZE


def free_bytes() -> int:
    """Room left in /dev/shm."""
    st = os.statvfs("/dev/shm")
    return st.f_bavail * st.f_frsize


def room_error(groups: int, size: int) -> str | None:
    """Why /dev/shm cannot hold `groups` groups of `size` ranks at once, or None if it can."""
    need, free = groups * mapping_bytes(size), free_bytes()
    if need <= free:
        return None
    return (f"the shared-memory tp groups need {need >> 20} MiB in /dev/shm but {free >> 20} MiB are free: "
            f"give /dev/shm more room (docker run --shm-size {-(-need >> 20) + 64}m) or pass --tp-comm-backend gloo")


def register() -> None:
    """Make `dist.new_group(ranks, backend=BACKEND)` create a SharedMemoryGroup."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, SharedMemoryGroup, devices=["cpu"])


class _Done(dist._Work):
    """The work of a collective that finished before it returned."""

    def __init__(self, tensors: list[torch.Tensor]):
        super().__init__()
        self.tensors = tensors

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self.tensors

    def get_future(self) -> torch.futures.Future:
        self.wait()
        future = torch.futures.Future()
        future.set_result(self.tensors)
        return future


class _Pending(_Done):
    """An all-reduce of one slot's worth whose input is published; it sums at `wait`."""

    def __init__(self, group: "SharedMemoryGroup", tensor: torch.Tensor, combine, average: bool):
        super().__init__([tensor])
        self.group, self.combine, self.average = group, combine, average
        self.step, self.slots, self.completed = 0, None, False

    def complete(self) -> None:
        self.group._wait_all(self.step)
        out = self.tensors[0].view(-1)
        _reduce(self.combine, [slot.view(out.dtype)[:out.numel()] for slot in self.slots], out=out)
        if self.average:
            out.div_(self.group.size())
        self.completed, self.slots = True, None

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        if not self.completed:
            self.group._finish_pending()
        return True

    def is_completed(self) -> bool:
        return self.completed


class SharedMemoryGroup(dist.ProcessGroup):
    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta):
        super().__init__(rank, size)
        self._timeout = timeout.total_seconds()
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", size)))
        self._spin_seconds = _SPIN_SECONDS if local_ranks <= len(os.sched_getaffinity(0)) else 0.0
        header = _header_bytes(size)
        self._mapping = _map_shared(store, rank, size, mapping_bytes(size))
        self._counters = np.frombuffer(self._mapping, np.int64, size * _COUNTER_BYTES // 8)[::_COUNTER_BYTES // 8]
        data = torch.frombuffer(self._mapping, dtype=torch.uint8, offset=header)
        self._sets = data.view(2, size, SLOT_BYTES)
        self._step = 0
        self._pending: _Pending | None = None

    def getBackendName(self) -> str:
        return BACKEND

    def _set_group_name(self, name: str) -> None:  # kept here: torch keeps it in backends, which this group has none of
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def allreduce(self, tensors, opts) -> dist._Work:
        combine, average = _combine(opts.reduceOp), opts.reduceOp == ReduceOp.AVG
        (t, *more) = tensors
        if not more and t.is_contiguous() and t.numel() * t.element_size() <= SLOT_BYTES:
            return self._start(_Pending(self, t, combine, average))
        for t in tensors:  # in pieces, each finished before the next starts
            flat, per = _flat(t), SLOT_BYTES // t.element_size()
            for start in range(0, flat.numel(), per):
                self._start(_Pending(self, flat[start:start + per], combine, average)).wait()
            _restore(t, flat)
        return _Done(tensors)

    def _allgather_base(self, output, input, opts=None) -> dist._Work:
        flat_in, flat_out = _flat(input), _flat(output)
        n, per = flat_in.numel(), SLOT_BYTES // input.element_size()
        for start in range(0, n, per):
            piece = flat_in[start:start + per]
            for r, slot in enumerate(self._exchange(piece)):
                flat_out[r * n + start:r * n + start + piece.numel()].copy_(slot[:piece.numel()])
        _restore(output, flat_out)
        return _Done([output])

    def _reduce_scatter_base(self, output, input, opts) -> dist._Work:
        combine, size = _combine(opts.reduceOp), self.size()
        flat_in, flat_out = _flat(input).view(size, -1), _flat(output)
        n, per = flat_out.numel(), SLOT_BYTES // input.element_size() // size
        for start in range(0, n, per):
            pieces = flat_in[:, start:start + per]  # (size, piece): what each rank gets from this one
            slots = self._exchange(pieces)
            mine = [s.view(size, -1)[self.rank()] for s in (slot[:pieces.numel()] for slot in slots)]
            _reduce(combine, mine, out=flat_out[start:start + pieces.size(1)])
        if opts.reduceOp == ReduceOp.AVG:
            flat_out.div_(size)
        _restore(output, flat_out)
        return _Done([output])

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None) -> dist._Work:
        for output, input in zip(outputs, inputs):
            self._allgather_base(output, input)
        return _Done(outputs)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts) -> dist._Work:
        for output, input in zip(outputs, inputs):
            self._reduce_scatter_base(output, input, opts)
        return _Done(outputs)

    def broadcast(self, tensors, opts) -> dist._Work:
        root = opts.rootRank
        for t in tensors:
            flat, per = _flat(t), SLOT_BYTES // t.element_size()
            for start in range(0, flat.numel(), per):
                piece = flat[start:start + per]
                slots = self._exchange(piece if self.rank() == root else None, t.dtype)
                if self.rank() != root:
                    piece.copy_(slots[root][:piece.numel()])
            _restore(t, flat)
        return _Done(tensors)

    def scatter(self, outputs, inputs, opts) -> dist._Work:
        root, size = opts.rootRank, self.size()
        flat_out = _flat(outputs[0])
        n, per = flat_out.numel(), SLOT_BYTES // outputs[0].element_size() // size
        sources = torch.stack([t.reshape(-1) for t in inputs[0]]) if self.rank() == root else None  # (size, n)
        for start in range(0, n, per):
            length = min(per, n - start)
            slots = self._exchange(sources[:, start:start + per] if sources is not None else None, flat_out.dtype)
            flat_out[start:start + length].copy_(slots[root][:size * length].view(size, length)[self.rank()])
        _restore(outputs[0], flat_out)
        return _Done(outputs)

    def barrier(self, opts=None) -> dist._Work:
        self._exchange(None)
        return _Done([])

    def _exchange(self, mine: torch.Tensor | None, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """One step: `mine` (if this rank sends) into its slot; once every rank has arrived, every
        rank's slot as `dtype` (`mine`'s by default)."""
        self._finish_pending()
        slots = self._send(mine)
        self._wait_all(self._step)
        dtype = dtype or (mine.dtype if mine is not None else None)
        return [slot.view(dtype) for slot in slots] if dtype else []

    def _send(self, mine: torch.Tensor | None) -> torch.Tensor:
        """Start the next step: `mine` into this rank's slot, published; the step's slots (size, SLOT_BYTES)."""
        self._step += 1
        slots = self._sets[self._step % 2]
        if mine is not None:
            slots[self.rank(), :mine.numel() * mine.element_size()].view(mine.dtype).view(mine.shape).copy_(mine)
        self._publish()
        return slots

    def _start(self, pending: "_Pending") -> "_Pending":
        self._finish_pending()
        pending.step, pending.slots = self._step + 1, self._send(pending.tensors[0])
        self._pending = pending
        return pending

    def _finish_pending(self) -> None:
        """Complete the started all-reduce, if any: at most one is in flight, so that a step's slots
        are free again two steps later (every rank has read them before it starts another)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.complete()

    def _publish(self) -> None:
        with _store_order:  # a locked instruction: the slot's bytes are visible before the counter is
            self._counters[self.rank()] = self._step

    def _wait_all(self, step: int) -> None:
        if (self._counters >= step).all():
            return
        start = time.monotonic()
        while not (self._counters >= step).all():
            waited = time.monotonic() - start
            if waited < self._spin_seconds:
                continue
            if waited < self._spin_seconds + _YIELD_SECONDS:
                os.sched_yield()
            elif waited < self._timeout:
                time.sleep(5e-5)
            else:
                late = [r for r in range(self.size()) if self._counters[r] < step]
                raise RuntimeError(f"shared-memory collective {step} of rank {self.rank()}: ranks {late} "
                                   f"of its group did not arrive within {self._timeout:.0f} s")


class ShmRoomError(ValueError):
    """/dev/shm filled up between the check before launch and a group's creation."""


def _map_shared(store: dist.Store, rank: int, size: int, nbytes: int) -> mmap.mmap:
    """A mapping of `nbytes` shared by the group's ranks; its file is unlinked once all have it."""
    if rank == 0:
        path = f"/dev/shm/gcompile-{uuid.uuid4().hex}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)  # fail here, not with SIGBUS on first touch
        except OSError as e:
            os.close(fd)
            os.unlink(path)
            raise ShmRoomError(f"cannot reserve {nbytes >> 20} MiB in /dev/shm for the shared-memory tp group "
                               f"({e.strerror}): give /dev/shm more room (docker run --shm-size) or pass "
                               f"--tp-comm-backend gloo") from None
        store.set("path", path)
    else:
        path = store.get("path").decode()
        fd = os.open(path, os.O_RDWR)
    mapping = mmap.mmap(fd, nbytes)
    os.close(fd)
    store.add("mapped", 1)
    if rank == 0:
        while store.add("mapped", 0) < size:
            time.sleep(1e-3)
        os.unlink(path)
    return mapping


def _combine(op: ReduceOp):
    for known, combine in _COMBINE.items():
        if op == known:
            return combine
    raise ValueError(f"the shared-memory group does not reduce with {op}")


def _reduce(combine, parts: list[torch.Tensor], out: torch.Tensor) -> None:
    """`out` = parts combined in rank order (the same order, hence the same bits, on every rank)."""
    combine(parts[0], parts[1], out=out) if len(parts) > 1 else out.copy_(parts[0])
    for part in parts[2:]:
        combine(out, part, out=out)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1) if t.is_contiguous() else t.reshape(-1).clone()


def _restore(t: torch.Tensor, flat: torch.Tensor) -> None:
    """Write back a result computed in a contiguous copy of a non-contiguous `t`."""
    if flat.data_ptr() != t.data_ptr():
        t.copy_(flat.view(t.shape))
