"""Every rank of a small layout in one process: fast numerics, no process group.

Each rank runs the real `Runtime` on its real `RankProgram`, in its own thread.
Its graphs run uncompiled, through an FX interpreter that hands each functional
collective (`torch.ops._c10d_functional.*`) to a `Hub` shared by the ranks, and
treats `wait_tensor` as the identity. Point-to-point goes through a `Mailbox`
plugged into the runtime's `p2p` seam in place of torch.distributed.

    Hub        a group's members: gcompile.axes.group_members(coords, name); the
               n-th call of every member on a group forms one collective, computed
               in rank order once all have arrived (bitwise deterministic)
    Mailbox    a FIFO per (src, dst); a receive matches the message of its posting
               order, and its wait blocks until that message is there

Every wait has a timeout, and a rank that fails wakes the others: a deadlock or a
mismatched collective ends in an error naming the ranks, never a hang.

    results = run_layouts(configs, batches, lrs)      # what tests/multirank.py's run_layouts returns
    world = World(build_world(config), config.model, seed=0)
    world.run(lambda rank, runtime: runtime.forward_backward(...))   # any step, on every rank at once
"""

import threading
from collections import defaultdict, namedtuple
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx

from gcompile.config import RunConfig
from gcompile.layout import first_holder, full_value
from gcompile.axes import Coords, group_members
from gcompile.pipeline import BuildCache
from gcompile.rank_program import RankProgram
from gcompile.runtime import Runtime, StageFunctions
from gcompile.state import TrainState
from gcompile.train import split_microbatches
from gcompile.collectives import is_collective
from gcompile.world import build_world

TIMEOUT = 120.0
"""Seconds a rank waits for the others at a collective or a receive before the run fails."""


class HarnessError(RuntimeError):
    """A deadlock, a mismatched collective or message, or a rank that failed."""


class _Aborted(HarnessError):
    """This rank stopped because another one failed first."""


# --- collectives ---------------------------------------------------------------------------------

def _fold(op: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    """Reduce in the given (rank) order."""
    combine = {"sum": torch.add, "avg": torch.add, "max": torch.maximum, "min": torch.minimum}[op]
    out = tensors[0]
    for t in tensors[1:]:
        out = combine(out, t)
    return out / len(tensors) if op == "avg" else out


def _compute(name: str, calls: list[dict]) -> list[torch.Tensor]:
    """Each member's result of one collective; `calls` are the members' arguments, in rank order."""
    inputs = [c["input"] for c in calls]
    n = len(calls)
    if name == "all_reduce":
        reduced = _fold(calls[0]["reduce_op"], inputs)
        return [reduced.clone() for _ in calls]
    if name == "all_gather_into_tensor":
        gathered = torch.cat(inputs)  # (n*d0, ...)
        return [gathered.clone() for _ in calls]
    if name == "reduce_scatter_tensor":
        return [piece.clone() for piece in _fold(calls[0]["reduce_op"], inputs).chunk(n)]
    if name == "ring_shift":
        return [inputs[j - 1].clone() for j in range(n)]
    if name == "all_to_all_rows":
        pieces = [x[:int(c["send_counts"].sum())].split(c["send_counts"].tolist()) for x, c in zip(inputs, calls)]
        outs = [torch.cat([p[j] for p in pieces]) for j in range(n)]
        return [torch.cat([out, out.new_zeros((c["rows"] - out.shape[0], *out.shape[1:]))])
                for out, c in zip(outs, calls)]
    if name == "all_to_all_single":
        pieces = [x.split(list(c["input_split_sizes"]) or x.shape[0] // n) for x, c in zip(inputs, calls)]
        return [torch.cat([p[j] for p in pieces]) for j in range(n)]
    raise HarnessError(f"the harness does not simulate _c10d_functional.{name}")


def _signature(name: str, call: dict) -> str:
    """What the members of one collective must agree on: `all_reduce sum (4, 2) torch.float32`."""
    x = call["input"]
    shape = None if name.startswith("all_to_all") else tuple(x.shape)  # its pieces may differ in size
    return " ".join(str(part) for part in (name, call.get("reduce_op"), shape, x.dtype) if part is not None)


class _Meeting:
    """Where ranks wait for each other: one lock, a timeout, and the first failure, which wakes every waiter."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.cond = threading.Condition()
        self.failed: str | None = None

    def wait_until(self, ready: Callable[[], bool], timed_out: Callable[[], str]) -> None:
        """With `cond` held: return once `ready()`; _Aborted where another rank failed first, HarnessError with
        `timed_out()` where nothing came within the timeout (as a hang would have)."""
        arrived = self.cond.wait_for(lambda: ready() or self.failed, self.timeout)
        if self.failed and not ready():
            raise _Aborted(self.failed)
        if not arrived:
            self._fail(timed_out())
            raise HarnessError(self.failed)

    def _fail(self, message: str) -> None:
        with self.cond:
            self.failed = self.failed or message
            self.cond.notify_all()


class Hub(_Meeting):
    """Where the ranks' functional collectives meet."""

    def __init__(self, coords: dict[int, Coords], timeout: float = TIMEOUT):
        super().__init__(timeout)
        self.coords = coords
        self.calls = defaultdict(int)
        """(rank, group name, members) -> collectives this rank has issued on that group."""
        self.pending = {}
        """(group name, members, n) -> {rank: (op, arguments)} of the n-th collective on that group."""
        self.results = {}

    def collective(self, rank: int, op, args, kwargs) -> torch.Tensor:
        call = dict(zip((a.name for a in op._schema.arguments), args), **kwargs)
        name, group = op._opname, call["group_name"]
        members = group_members(self.coords[rank], group)
        if call.get("group_size", len(members)) != len(members):
            raise HarnessError(f"rank {rank}: {name} on group {group} says group_size {call['group_size']}, "
                               f"but the group has ranks {list(members)}")
        with self.cond:
            n = self.calls[(rank, group, members)]
            self.calls[(rank, group, members)] += 1
            key = (group, members, n)
            slot = self.pending.setdefault(key, {})
            slot[rank] = (name, call)
            if len(slot) == len(members):
                issued = {r: _signature(op_name, c) for r, (op_name, c) in sorted(slot.items())}
                if len(set(issued.values())) > 1:
                    self._fail(f"collective {n} on group {group} {list(members)} differs between ranks: {issued}")
                else:
                    self.results[key] = dict(zip(members, _compute(name, [slot[m][1] for m in members])))
                del self.pending[key]
                self.cond.notify_all()
            self.wait_until(lambda: key in self.results, lambda: self._missing(rank, name, n, group, members))
            results = self.results[key]
            out = results.pop(rank)
            if not results:
                del self.results[key]
            return out

    def _missing(self, rank: int, name: str, n: int, group: str, members: tuple) -> str:
        arrived = sorted(self.pending.get((group, members, n), {}))
        return (f"rank {rank} waited {self.timeout:g} s at {name} #{n} on group {group} {list(members)}: "
                f"ranks {arrived} arrived, {sorted(set(members) - set(arrived))} never did")


class _RankInterpreter(fx.Interpreter):
    """Run a graph as `rank`, its collectives through the hub."""

    def __init__(self, gm: fx.GraphModule, rank: int, hub: Hub):
        super().__init__(gm)
        self.rank, self.hub = rank, hub

    def call_function(self, target, args, kwargs):
        if is_collective(target):
            if target._opname == "wait_tensor":
                return args[0]
            return self.hub.collective(self.rank, target, args, kwargs)
        return super().call_function(target, args, kwargs)


def _interpreted(gm: fx.GraphModule | None, rank: int, hub: Hub) -> Callable | None:
    return None if gm is None else _RankInterpreter(gm, rank, hub).run


# --- point-to-point ------------------------------------------------------------------------------

P2POp = namedtuple("P2POp", "op tensor peer")


class Mailbox(_Meeting):
    """Point-to-point between the ranks of this process, matched in posting order per (src, dst)."""

    def __init__(self, timeout: float = TIMEOUT):
        super().__init__(timeout)
        self.sent = defaultdict(list)
        """(src, dst) -> messages, in sending order (None once received)."""
        self.posted = defaultdict(int)
        """(src, dst) -> receives posted so far."""

    def endpoint(self, rank: int) -> "_Endpoint":
        return _Endpoint(self, rank)

    def undelivered(self) -> list[str]:
        return [f"rank {src} -> rank {dst}: {sum(m is not None for m in msgs)} messages never received"
                for (src, dst), msgs in sorted(self.sent.items()) if any(m is not None for m in msgs)]

    def _send(self, src: int, dst: int, tensor: torch.Tensor) -> "_Send":
        with self.cond:
            self.sent[(src, dst)].append(tensor.detach().clone())
            self.cond.notify_all()
            return _Send(self, src, dst, len(self.sent[(src, dst)]) - 1)

    def _post_recv(self, src: int, dst: int, tensor: torch.Tensor) -> "_Recv":
        with self.cond:
            n = self.posted[(src, dst)]
            self.posted[(src, dst)] += 1
            self.cond.notify_all()  # a sender may be waiting for it
        return _Recv(self, src, dst, n, tensor)


@dataclass
class _Send:
    """As gloo's: complete only once waited for, and the wait returns once the receiver has posted the receive
    (so a runtime that waits too early hangs here as it would there, until the timeout names it)."""

    box: Mailbox
    src: int
    dst: int
    n: int
    waited: bool = False

    def wait(self) -> bool:
        box, channel = self.box, (self.src, self.dst)
        with box.cond:
            box.wait_until(lambda: box.posted[channel] > self.n,
                           lambda: f"rank {self.src} waited {box.timeout:g} s for its send {self.n} to rank {self.dst} "
                                   f"to be received; rank {self.dst} posted {box.posted[channel]} receives")
        self.waited = True
        return True

    def is_completed(self) -> bool:
        return self.waited


@dataclass
class _Recv:
    box: Mailbox
    src: int
    dst: int
    n: int
    """This receive takes the n-th message from src to dst."""
    tensor: torch.Tensor

    def wait(self) -> bool:
        box, channel = self.box, (self.src, self.dst)
        with box.cond:
            box.wait_until(lambda: len(box.sent[channel]) > self.n,
                           lambda: f"rank {self.dst} waited {box.timeout:g} s for message {self.n} from rank "
                                   f"{self.src}; rank {self.src} sent {len(box.sent[channel])}")
            message = box.sent[channel][self.n]
            box.sent[channel][self.n] = None
        if message.shape != self.tensor.shape or message.dtype != self.tensor.dtype:
            raise HarnessError(f"rank {self.dst} expected message {self.n} from rank {self.src} as "
                               f"{tuple(self.tensor.shape)} {self.tensor.dtype}, "
                               f"got {tuple(message.shape)} {message.dtype}")
        self.tensor.copy_(message)
        return True


@dataclass
class _Endpoint:
    """One rank's view of the mailbox, shaped like the torch.distributed calls the runtime makes."""

    box: Mailbox
    rank: int
    isend = "isend"
    irecv = "irecv"
    P2POp = P2POp

    def batch_isend_irecv(self, ops: list[P2POp]) -> list:
        works = []
        for op in ops:
            if op.op == self.isend:
                works.append(self.box._send(self.rank, op.peer, op.tensor))
            else:
                works.append(self.box._post_recv(op.peer, self.rank, op.tensor))
        return works


# --- a world of ranks ----------------------------------------------------------------------------

class World:
    """Every rank's Runtime in this process, on its initial weights (TrainState.initial)."""

    def __init__(self, programs: dict[int, RankProgram], model, seed: int, timeout: float = TIMEOUT):
        self.programs = programs
        self.hub = Hub({r: p.coords for r, p in programs.items()}, timeout)
        self.mailbox = Mailbox(timeout)
        self.states = {r: TrainState.initial(p, model, seed, "cpu") for r, p in programs.items()}
        self.runtimes = {}
        for rank, program in programs.items():
            functions = {s: StageFunctions(*(_interpreted(gm, rank, self.hub) for gm in (
                stage.forward, stage.backward, stage.backward_last, stage.backward_weight)))
                for s, stage in program.stages.items()}
            step = _interpreted(program.optimizer.graph, rank, self.hub)
            self.runtimes[rank] = Runtime(program, functions, step, self.states[rank],
                                          p2p=self.mailbox.endpoint(rank))

    def run(self, fn: Callable[[int, Runtime], object]) -> dict:
        """`fn(rank, runtime)` on every rank at once, one thread each; their results by rank.
        Raises the first rank's error (the cause, not the ranks it stopped)."""
        results, errors = {}, {}

        def body(rank: int):
            try:
                results[rank] = fn(rank, self.runtimes[rank])
            except BaseException as e:  # noqa: B036 -- any failure must wake the other ranks
                errors[rank] = e
                message = f"rank {rank} failed: {type(e).__name__}: {e}"
                with self.hub.cond:
                    self.hub._fail(message)
                self.mailbox._fail(message)

        threads = [threading.Thread(target=body, args=(rank,), name=f"rank{rank}", daemon=True)
                   for rank in self.runtimes]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.hub.timeout * 4)
            if t.is_alive():
                raise HarnessError(f"{t.name} is still running after {self.hub.timeout * 4:g} s")
        if errors:
            rank = min(errors, key=lambda r: (isinstance(errors[r], _Aborted), r))
            raise errors[rank]
        if self.mailbox.undelivered():
            raise HarnessError("; ".join(self.mailbox.undelivered()))
        return results


# --- what tests/multirank.py's run_layouts returns -----------------------------------------------

@dataclass
class LayoutResult:
    losses: list[float]
    """Mean loss of the global batch per step (from the last pipeline stage)."""
    grad_norms: list[float]
    params: dict[str, torch.Tensor]
    """Final parameters, reassembled to full single-device shapes."""
    ranks: list[dict]
    """What each rank reported (coords, peak_saved, params, values, ...), by rank."""


def run_layouts(configs: list[RunConfig], batches: list[torch.Tensor], lrs: list[float],
                inject_inf: dict[int, int] | None = None, cache: BuildCache | None = None) -> list[LayoutResult]:
    """Train each config on the global batches and learning rates, every rank in this process.

    `inject_inf` {step: rank} puts an inf into that rank's gradient before that step's update.
    The cases share captures and identical lowerings through `cache` (pass one to share more)."""
    cache = cache or BuildCache()
    return [run_layout(config, batches, lrs, inject_inf or {}, cache) for config in configs]


def run_layout(config: RunConfig, batches, lrs, inject_inf: dict[int, int], cache: BuildCache) -> LayoutResult:
    t, dp = config.train, config.parallel.dp
    world = World(build_world(config, log=lambda _: None, cache=cache), config.model, t.seed)
    per_rank = t.global_batch_size // dp
    reports = {rank: dict(coords=program.coords, losses=[], grad_norms=[], skipped=[], loss_scales=[], digests=[])
               for rank, program in world.programs.items()}

    def step(i: int, tokens: torch.Tensor, lr: float):
        def on_rank(rank: int, runtime: Runtime):
            state, c = runtime.state, runtime.program.coords
            state.lr.fill_(lr)
            loss = runtime.forward_backward(split_microbatches(
                tokens[c.axis_rank("dp") * per_rank:(c.axis_rank("dp") + 1) * per_rank], t.micro_batch_size))
            if inject_inf.get(i) == rank:
                state.grads[0] = float("inf")
            grad_norm, skipped = runtime.optimizer_step()
            return loss, grad_norm, skipped
        return world.run(on_rank)

    for i, (tokens, lr) in enumerate(zip(batches, lrs)):
        out = step(i, tokens, lr)
        for rank, (loss, grad_norm, skipped) in out.items():
            c, state, report = world.programs[rank].coords, world.states[rank], reports[rank]
            if loss is not None:  # the mean over dp x cp, summed in rank order as the hub would
                dp_group = group_members(c, "dp_cp")
                loss = _fold("avg", [out[r][0] for r in dp_group])
            report["losses"].append(None if loss is None else loss.item())
            report["grad_norms"].append(grad_norm.item())
            report["skipped"].append(int(skipped.item()))
            report["digests"].append([float(x.double().sum())
                                      for x in (state.params, state.exp_avg, state.exp_avg_sq, state.step)])
            report["loss_scales"].append(None if state.loss_scale is None else state.loss_scale.item())
    for rank, report in reports.items():
        program, state, runtime = world.programs[rank], world.states[rank], world.runtimes[rank]
        report.update(optimizer_bytes=sum(b.numel() * b.element_size() for b in
                                          (state.main, state.exp_avg, state.exp_avg_sq) if b is not None),
                      params=program.layout.params,
                      values={name: v.clone() for name, v in program.layout.views(state.params).items()},
                      peak_saved=dict(runtime.peak_saved), rank_peak_saved=runtime.rank_peak_saved)
    return assemble([reports[r] for r in sorted(reports)])


def assemble(ranks: list[dict]) -> LayoutResult:
    """Every rank's report -> losses, grad norms and the final parameters at full shape."""
    last = next(r for r in ranks if r["losses"][0] is not None)
    params = reassemble([(r["coords"], r["params"], r["values"]) for r in ranks])
    return LayoutResult(losses=last["losses"], grad_norms=ranks[0]["grad_norms"], params=params, ranks=ranks)


def reassemble(ranks: list[tuple]) -> dict[str, torch.Tensor]:
    """Full parameters from every rank's (coords, params, values by name), for cuts over any axes.

    The first holder of each piece (position 0 on every axis that does not cut it; pipeline
    stages apart) gives it; every other holder is a replica and must be bitwise equal to it."""
    pieces, cuts, replicas = {}, {}, []
    for coords, params, values in ranks:
        for param in params:
            if param.tied_copy:
                continue
            position = tuple(coords.axis_rank(s.axis) for s in param.shards)  # the first cut outermost
            if not first_holder(param, coords.axis_ranks):
                replicas.append((param.name, position, coords, values[param.name]))
                continue
            cuts[param.name] = (param, coords.axis_sizes)
            pieces.setdefault(param.name, {})[position] = (coords, values[param.name])
    for name, position, coords, value in replicas:
        first, expected = pieces[name][position]
        if not torch.equal(value, expected):
            raise AssertionError(f"{name}: the copy on rank {coords.rank} {coords} differs from rank {first.rank}'s")
    return {name: full_value([value for _, (_, value) in sorted(found.items())], *cuts[name])
            for name, found in pieces.items()}
