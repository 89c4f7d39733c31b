"""Walk one rank's instruction list; know nothing about GPT.

Per iteration: for each instruction, call a stage's forward or backward
callable, or move activations/gradients to and from the neighbouring pipeline
ranks; then run the optimizer step. Forward outputs a stage keeps for its
backward ("saved") are held per (stage, microbatch) until that backward runs;
the runtime counts them and stops if a stage or the rank holds more than the
schedule promised (`in_flight_bound`, `rank_in_flight_bound`). Zero-bubble
schedules split a backward in two: B computes the input gradients and keeps
what W reads, W the parameter gradients; a stage with no W graph (its inputs
take no gradient) runs its whole backward in B, and its W does nothing.

Communication: consecutive SEND/RECV instructions go out as one batched
isend/irecv into freshly allocated contiguous buffers. A receive is waited for
right before its tensor is used. A send is waited for (and its tensor let go)
at its WAIT_SEND, placed where the schedule proves its receiver has posted the
receive (gcompile.send_release), so the wait never blocks on the peer's program;
the rest at the end of the iteration. Sends already delivered (where the
backend says so: NCCL does, gloo only once waited for) are let go before each
new exchange. NCCL gives a batch one Work: each receive of it waits for the
whole batch, and its sends are let go once that is done.
Messages between two ranks are matched in posting order, which the simulator
checks is the same on both ends. Stages on one rank hand tensors
over directly.

Memory: between `start_measuring` and `stop_measuring` (the first step of a
run), every instruction boundary samples what the rank holds (gcompile.memory).
"""

from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gcompile.flight import NO_RECORDER, FlightRecorder
from gcompile.memory import PeakMeter, StepPeak
from gcompile.program import BATCH_ROLES
from gcompile.rank_program import RankProgram
from gcompile.report import is_metric
from gcompile.instructions import OPT_STEP, OPTIMIZER, WAIT_SEND, Instruction
from gcompile.schedule import Kind, in_flight_bound, rank_in_flight_bound
from gcompile.state import TrainState
from gcompile.torch_api import foreach_add_


@dataclass
class StepResult:
    loss: torch.Tensor | None
    """Mean loss over this rank's microbatches; None off the last pipeline stage."""
    grad_norm: torch.Tensor
    """Global gradient norm before clipping (unscaled)."""
    skipped: torch.Tensor
    """1 if a non-finite gradient made every rank skip the update (fp16), else 0."""


@dataclass
class StageFunctions:
    forward: Callable
    backward: Callable
    backward_last: Callable | None = None
    backward_weight: Callable | None = None


@dataclass(frozen=True)
class _Sent:
    work: object
    tensor: torch.Tensor
    """Kept alive until the send is done."""
    alone: bool
    """Whether `work` is this send's alone (gloo), not its whole batch's (NCCL)."""


class InFlightError(RuntimeError):
    """The runtime held more saved activations than the schedule promised."""


class Runtime:
    def __init__(self, program: RankProgram, functions: dict[int, StageFunctions], optimizer_step: Callable,
                 state: TrainState, p2p=dist, recorder: FlightRecorder = NO_RECORDER):
        """`p2p`: what point-to-point goes through, anything with torch.distributed's `isend`, `irecv`,
        `P2POp` and `batch_isend_irecv` (gcompile.harness passes its in-process mailboxes).
        `recorder`: where the instruction and the receive this rank is in are written (gcompile.flight)."""
        self.program = program
        self.recorder = recorder
        self.labels = {id(i): f"{n:02d} {i}" for n, i in enumerate(program.instructions)}
        """Each instruction as printed in the rank's program listing, for the flight recorder."""
        self.p2p = p2p
        self.functions = functions
        self.step_fn = optimizer_step
        self.optimizer_args = state.optimizer_args(program.optimizer.inputs)
        self.state = state
        self.last_stage = program.schedule.pp * program.schedule.vpp - 1
        params = program.layout.views(state.params)
        self.param_args = {s: [params[p.name] for p in st.params] for s, st in program.stages.items()}
        self.grad_views = {s: [] for s in program.stages}  # optim_grads: every gradient goes to its shard
        if program.grad_accumulator:
            state.acquire_grads()  # views need the storage; they outlive a release
            grads = program.layout.views(state.grads)
            self.grad_views = {s: [grads[p.name] for p in st.params] for s, st in program.stages.items()}
            if not program.grads_between_steps:
                state.release_grads()
        self.held = {}
        """The model's buffers by role, on the device once however many of the rank's stages read one."""

        def constant(role: str, value: int | torch.Tensor) -> torch.Tensor:
            if isinstance(value, torch.Tensor):
                return self.held.setdefault(role, value.to(state.params.device))
            return torch.tensor(value, device=state.params.device)
        self.constants = {s: {role: constant(role, value) for role, value in st.rank_constants.items()}
                          for s, st in program.stages.items()}
        self.loss_grad = torch.full((), 1.0 / program.schedule.num_microbatches, dtype=torch.float32,
                                    device=state.params.device)
        """The gradient of the step's loss (the mean over microbatches, times the fp16 loss scale)
        w.r.t. one microbatch's fp32 loss."""
        self.before_step = [i for i in program.instructions if i.op != OPT_STEP]
        self.step_only = [i for i in program.instructions if i.op == OPT_STEP]
        self.forward_only = [i for i in program.instructions if i.op in (Kind.F, Kind.SEND_F, Kind.RECV_F)]
        """The training list without backward, for evaluation."""
        schedule = program.schedule
        self.bound = {s: in_flight_bound(schedule, s) for s in program.stages}
        self.rank_bound = rank_in_flight_bound(schedule, program.coords.axis_rank("pp"))
        self.peak_saved = defaultdict(int)
        """Most (stage, microbatch) saved-activation sets alive at once, per stage, over all iterations."""
        self.rank_peak_saved = 0
        """The same over all of this rank's stages together."""
        self.adds_reduced = any(st.last_outputs_add for st in program.stages.values())
        """optim_grads: every microbatch adds its reduced shard into `reduced_grads`, zeroed after each step."""
        self.meter: PeakMeter | None = None
        """Samples held bytes at every instruction boundary while set (start_measuring)."""

    def start_measuring(self) -> None:
        """From now on, sample what this rank holds at every instruction boundary (a little host work each)."""
        self.meter = PeakMeter(self.state.params.device)

    def stop_measuring(self) -> StepPeak:
        """The peak since start_measuring; sampling stops."""
        peak, self.meter = self.meter.result(), None
        return peak

    def train_step(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepResult:
        """One optimizer step over this rank's microbatches: the whole instruction list."""
        self._prepare_loss_grad()
        self._run(microbatches, self.program.instructions, training=True)
        return StepResult(self._mean_loss(), *self.step_result)

    def forward_backward(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
        """The instructions before the optimizer step: gradients accumulate into the state's flat grad buffer."""
        self._prepare_loss_grad()
        self._run(microbatches, self.before_step, training=True)
        return self._mean_loss()

    def optimizer_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The optimizer step instruction: AdamW on the accumulated gradients (then zeroed);
        (global grad norm, 1 if the step was skipped)."""
        self._run([], self.step_only, training=True)
        return self.step_result

    def eval_step(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
        """Mean loss of the forwards alone (the training instruction list without backward)."""
        self._run(microbatches, self.forward_only, training=False)
        return self._mean_loss()

    def _prepare_loss_grad(self):
        if self.state.loss_scale is not None:
            torch.div(self.state.loss_scale, self.program.schedule.num_microbatches, out=self.loss_grad)

    def _mean_loss(self) -> torch.Tensor | None:
        return torch.stack(self.losses).mean() if self.losses else None

    def _run(self, microbatches, instructions: list[Instruction], training: bool):
        self.batch = microbatches
        self.saved, self.losses = {}, []
        self.messages: dict[str, list[torch.Tensor]] = {}
        """Buffer name (gcompile.instructions: act[...], grad[...]) -> the activations or gradients a stage
        produced for another, or a receive fills, until they are sent or read."""
        self.metrics: dict[str, list[torch.Tensor]] = {}
        """What the model reported (gcompile.report) by role, one value per microbatch, this rank's stages."""
        self.weight_args = {}
        """(stage, mb) -> what its W reads, kept by its B."""
        self.pending_recvs = {}
        """Buffer name -> (label, Works) of each receive posted into it and not yet waited for."""
        self.sends: dict[str, list[_Sent]] = {}
        """Buffer name -> each tensor sent from it and not yet waited for."""
        comm = []
        for instruction in instructions:
            if not instruction.is_compute:
                comm.append(instruction)
                continue
            self._communicate(comm)
            comm = []
            self.recorder.start("instruction", self.labels[id(instruction)])
            if instruction.graph == "forward":
                self._forward(instruction, training)
            elif instruction.graph == "backward_weight":
                self._weight_backward(instruction)
            elif instruction.graph == OPTIMIZER:
                self.step_result = self.step_fn(*self.optimizer_args)
                if not self.program.grads_between_steps:  # optim_grads: only the reduced shard persists
                    self.state.release_grads()
                if self.adds_reduced:
                    self.state.reduced_grads.zero_()  # the next step's microbatches add into it
            else:
                if self.program.grad_accumulator:
                    self.state.acquire_grads()
                self._backward(instruction)
            self.recorder.finish("instruction")
            self._measure()
        self._communicate(comm)
        if self.sends:
            self.recorder.start("collective", f"the {len(self.sends)} sends of this iteration not yet waited for, "
                                              f"to be received")
            for s in sum(self.sends.values(), []):
                s.work.wait()
            self.sends = {}
            self.recorder.finish("collective")

    def _measure(self):
        if self.meter is None:
            return
        self.meter.sample(
            state=self.state.buffers().values(),
            activations=_tensors(*self.saved.values(), *self.weight_args.values()),
            messages=_tensors(*self.messages.values(),
                              [s.tensor for sent in self.sends.values() for s in sent]),
            other=_tensors(*self.batch, self.losses, *(c.values() for c in self.constants.values()), [self.loss_grad]),
            constants=self.held.values())

    def _forward(self, a: Instruction, training: bool):
        stage = self.program.stages[a.stage]
        acts = iter(self._take(a.reads[0]) if a.stage > 0 else [])
        fixed = dict(zip(BATCH_ROLES, self.batch[a.mb]), **self.constants[a.stage])
        inputs = [fixed[role] if role in fixed else next(acts) for role in stage.inputs]
        out = self.functions[a.stage].forward(*self.param_args[a.stage], *inputs)
        outputs, saved = out[:len(stage.outputs)], out[len(stage.outputs):]
        for role, value in zip(stage.outputs, outputs):
            if is_metric(role):
                self.metrics.setdefault(role, []).append(value)
        outputs = [value for role, value in zip(stage.outputs, outputs) if not is_metric(role)]
        if training:
            self.saved[(a.stage, a.mb)] = saved
            self._count_saved(a)
        if a.stage == self.last_stage:
            self.losses.append(outputs[0].detach())
        else:
            self.messages[a.writes[0]] = [t.contiguous() for t in outputs]  # as the next stage was traced

    def _count_saved(self, a: Instruction):
        live = sum(1 for s, _ in self.saved if s == a.stage)
        self.peak_saved[a.stage] = max(self.peak_saved[a.stage], live)
        self.rank_peak_saved = max(self.rank_peak_saved, len(self.saved))
        for count, bound, where in ((live, self.bound[a.stage], f"stage {a.stage}"),
                                    (len(self.saved), self.rank_bound, f"pipeline rank {self.program.coords.axis_rank('pp')}")):
            if count > bound:
                raise InFlightError(f"{a.action}: {where} holds {count} saved-activation sets, more than the "
                                    f"{self.program.schedule.name} schedule's bound of {bound}")

    def _backward(self, a: Instruction):
        stage = self.program.stages[a.stage]
        saved = self.saved.pop((a.stage, a.mb))
        if a.stage == self.last_stage:
            output_grads = [self.loss_grad]
        else:
            output_grads = self._take(a.reads[1])
        last = a.graph == "backward_last"
        if last:
            extra = [getattr(self.state, buffer)[start:end] for buffer, start, end in stage.last_inputs]
            grads = self.functions[a.stage].backward_last(*saved, *output_grads, *extra)
        else:
            grads = self.functions[a.stage].backward(*saved, *output_grads)
        if stage.backward_weight is not None:
            inputs = [*saved, *output_grads]
            stash = grads[len(grads) - stage.num_stash:]
            self.weight_args[(a.stage, a.mb)] = [inputs[i] for i in stage.weight_inputs] + list(stash)
            grads = grads[:len(grads) - stage.num_stash]
        n = len(stage.params)
        self._accumulate(a.stage, grads[:n])
        if last:  # reduced buckets replace what they were reduced from
            reduced = grads[len(grads) - len(stage.last_outputs):]
            for (buffer, start, end), value in zip(stage.last_outputs, reduced):
                target = getattr(self.state, buffer)[start:end]
                target.add_(value) if stage.last_outputs_add else target.copy_(value)
            grads = grads[:len(grads) - len(stage.last_outputs)]
        if a.stage > 0:
            acts = stage.activation_inputs()
            self.messages[a.writes[1]] = [grads[n + i].contiguous()
                                          for i, role in enumerate(stage.inputs) if role in acts]

    def _weight_backward(self, a: Instruction):
        args = self.weight_args.pop((a.stage, a.mb))
        self._accumulate(a.stage, self.functions[a.stage].backward_weight(*args))

    def _accumulate(self, stage: int, param_grads):
        """Add a stage's parameter gradients (None where this graph computes none) to the flat grad buffer."""
        pairs = [(acc, g) for acc, g in zip(self.grad_views[stage], param_grads) if g is not None]
        if pairs:
            foreach_add_([acc for acc, _ in pairs], [g for _, g in pairs])

    def _take(self, buffer: str) -> list[torch.Tensor]:
        """A stage's inputs: produced locally, or received into `buffer` (waited for now)."""
        if buffer in self.pending_recvs:
            label, works = self.pending_recvs.pop(buffer)
            self.recorder.start("collective", label)
            for work in works:
                work.wait()
            self.recorder.finish("collective")
        return self.messages.pop(buffer)

    def _communicate(self, instructions: list[Instruction]):
        if not instructions:
            return
        if not (self.state.params.is_cuda and torch.cuda.is_current_stream_capturing()):  # a query would
            # break the capture; a replay holds its buffers anyway
            self.sends = {buffer: kept for buffer, sent in self.sends.items()  # drop what arrived
                          if (kept := [s for s in sent if not s.work.is_completed()])}
        ops, posted = [], []
        for a in instructions:
            if a.op == WAIT_SEND:
                continue
            sends = a.op in (Kind.SEND_F, Kind.SEND_B)
            if sends:
                tensors = self.messages.pop(a.reads[0])
            else:
                tensors = self.messages[a.writes[0]] = \
                    self._empty_like_inputs(a.stage) if a.op == Kind.RECV_F else self._empty_like_outputs(a.stage)
            ops += [self.p2p.P2POp(self.p2p.isend if sends else self.p2p.irecv, t, a.peer) for t in tensors]
            posted.append((a, sends, tensors))
        works = self.p2p.batch_isend_irecv(ops) if ops else []
        batched = len(works) != len(ops)  # NCCL coalesces a batch into one Work, which every op of it waits for
        i = 0
        for a, sends, tensors in posted:
            own = works[:1] * len(tensors) if batched else works[i:i + len(tensors)]
            if sends:  # keep the sent tensors alive until their sends are done
                self.sends[a.reads[0]] = [_Sent(work, t, alone=not batched) for work, t in zip(own, tensors)]
            else:
                self.pending_recvs[a.writes[0]] = (self.labels[id(a)], own)
            i += len(tensors)
        for a in instructions:
            if a.op == WAIT_SEND:
                self._wait_sent(a)
        self._measure()

    def _wait_sent(self, a: Instruction) -> None:
        """Wait for a send the schedule proves received (gcompile.send_release) and let its tensors go. A send
        sharing its batch's one Work (NCCL) stays until that Work is done: waiting for it would wait for the
        batch's receives too, which nothing proves sent."""
        sent = self.sends.pop(a.reads[0], [])
        self.recorder.start("collective", self.labels[id(a)])
        for s in sent:
            if s.alone:
                s.work.wait()
        self.recorder.finish("collective")
        if kept := [s for s in sent if not s.alone]:
            self.sends[a.reads[0]] = kept

    def _empty_like_inputs(self, stage: int) -> list[torch.Tensor]:
        st = self.program.stages[stage]
        nodes = list(st.forward.graph.find_nodes(op="placeholder"))[len(st.params):]
        acts = st.activation_inputs()
        return [self._empty(n.meta["val"]) for role, n in zip(st.inputs, nodes) if role in acts]

    def _empty_like_outputs(self, stage: int) -> list[torch.Tensor]:
        st = self.program.stages[stage]
        outs = st.forward.graph.output_node().args[0][:len(st.outputs)]
        return [self._empty(n.meta["val"]) for n, role in zip(outs, st.outputs) if not is_metric(role)]

    def _empty(self, val) -> torch.Tensor:
        return torch.empty(val.shape, dtype=val.dtype, device=self.state.params.device)


def _tensors(*groups) -> Iterator[torch.Tensor]:
    """The tensors of several lists (a saved list may hold a None where a graph output is not a tensor)."""
    return (t for group in groups for t in group if isinstance(t, torch.Tensor))
