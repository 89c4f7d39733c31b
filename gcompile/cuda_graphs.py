"""Replay a rank's whole training iteration as one CUDA graph.

After warm-up (which also creates the NCCL communicators and Inductor's
workspaces), one iteration — every microbatch's forward and backward, the
pipeline sends and receives, the gradient reductions, the optimizer step — is
captured once and replayed from then on. It can be, because the runtime keeps
everything that changes per iteration in device tensors: the batch is copied
into static buffers, the learning rate lives in the state, and nothing in the
step reads a value back to the host. The host reads the loss after the replay.
"""

import torch

from gcompile.rank_program import RankProgram
from gcompile.runtime import Runtime, StepResult
from gcompile.torch_api import is_op_overload

HOST_READS = ("gcompile::grouped_mm", "gcompile::grouped_mm_weight_grad", "gcompile::all_to_all_rows")
"""Ops that read a device value on the host (a grouped matmul its groups' ends): a capture cannot hold them."""


def host_reads(program: RankProgram) -> list[str]:
    """The ops of HOST_READS the rank's stage graphs call, once each, in order."""
    found = [node.target.name() for stage in program.stages.values() for gm in stage.graphs().values()
             for node in gm.graph.nodes if is_op_overload(node.target) and node.target.name() in HOST_READS]
    return list(dict.fromkeys(found))


class GraphedTrainStep:
    def __init__(self, runtime: Runtime, warmup_steps: int = 2):
        self.runtime = runtime
        self.warmup_steps = warmup_steps
        self.steps = 0
        self.static_batch: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.result: StepResult | None = None

    def __call__(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepResult:
        if self.static_batch is None:
            self.static_batch = [(idx.clone(), targets.clone()) for idx, targets in microbatches]
        for (idx, targets), (static_idx, static_targets) in zip(microbatches, self.static_batch):
            static_idx.copy_(idx, non_blocking=True)
            static_targets.copy_(targets, non_blocking=True)
        self.steps += 1
        if self.steps <= self.warmup_steps:
            return self.runtime.train_step(self.static_batch)
        if self.graph is None:
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.result = self.runtime.train_step(self.static_batch)
        self.graph.replay()
        return self.result
