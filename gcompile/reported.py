"""What the model reported (gcompile.report), totalled over the steps and ranks for the log.

Every rank holds the reports of its own stages, one value per microbatch. A count
(an integer value: tokens per expert) is summed over the microbatches and the data
ranks: the global batch's total. Anything else (the load-balancing loss) is
averaged over them. Pipeline stages hold different reports, so the rank-sums over
"dp_cp" and then "pp" leave every report once on the logging rank; tp ranks hold
the same values and are not summed.

The log shows their mean over the steps since its last line, as Megatron's MoE metrics do;
each rank sums its own over those steps and the ranks sum once per log line:

    reported = Interval(program, num_microbatches, device)
    reported.add(runtime.metrics)                 # every step
    reported.mean()                               # every log line, on every rank
    {"tokens per expert": tensor (n_layer, E), "load balancing loss": tensor (n_layer,)}
"""

import torch
import torch.distributed as dist

from gcompile.axes import role_size
from gcompile.mesh import group
from gcompile.rank_program import RankProgram
from gcompile.report import parse


class Interval:
    """What the model reported, summed on this rank over the steps since the last log line; `mean` sums that
    over the ranks, once per log line (every rank calls it: it all-reduces), and starts the next interval."""

    def __init__(self, program: RankProgram, num_microbatches: int, device):
        self.program, self.num_microbatches, self.steps = program, num_microbatches, 0
        self.rows: dict[str, torch.Tensor] = {}
        """Report name -> (its reports, *shape) float64 sums of this rank's values, zero for other stages'."""
        self.counts: set[str] = set()
        for role, shape, is_count in program.reported:
            name, _, total = parse(role)
            self.rows.setdefault(name, torch.zeros((total, *shape), dtype=torch.float64, device=device))
            if is_count:
                self.counts.add(name)

    def add(self, metrics: dict[str, list[torch.Tensor]]) -> None:
        """One step's reports of this rank's stages (Runtime.metrics: one value per microbatch)."""
        for role, values in metrics.items():
            name, index, _ = parse(role)
            self.rows[name][index] += torch.stack(values).to(torch.float64).sum(0)
        self.steps += 1

    def mean(self) -> dict[str, torch.Tensor]:
        """Every report name -> its values per report in forward order: a count summed over the global batch,
        anything else averaged over the microbatches and data ranks; each the mean over the interval's steps."""
        if not self.rows:
            return {}
        flat = torch.cat([values.reshape(-1) for values in self.rows.values()])
        for role in ("dp_cp", "pp"):
            if role_size(self.program.coords, role) > 1:
                dist.all_reduce(flat, group=group(role))
        averaged = self.steps * self.num_microbatches * role_size(self.program.coords, "dp_cp")
        means, at = {}, 0
        for name, values in self.rows.items():
            value = flat[at:at + values.numel()].view(values.shape)
            at += values.numel()
            means[name] = value / (self.steps if name in self.counts else averaged)
            values.zero_()
        self.steps = 0
        return means
