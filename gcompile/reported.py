"""What the model reported over one step (gcompile.report), totalled over the ranks for the log.

Every rank holds the reports of its own stages, one value per microbatch. A count
(an integer value: tokens per expert) is summed over the microbatches and the data
ranks: the global batch's total. Anything else (the load-balancing loss) is
averaged over them. Pipeline stages hold different reports, so the rank-sums over
"dp_cp" and then "pp" leave every report once on the logging rank; tp ranks hold
the same values and are not summed.

    totals = total_reports(program, runtime.metrics, num_microbatches)
    {"tokens per expert": tensor (n_layer, E), "load balancing loss": tensor (n_layer,)}

The log shows their mean over the steps since its last line (`Interval`), as Megatron's
MoE metrics do.
"""

import torch
import torch.distributed as dist

from gcompile.axes import role_size
from gcompile.mesh import group
from gcompile.rank_program import RankProgram
from gcompile.report import parse


def total_reports(program: RankProgram, metrics: dict[str, list[torch.Tensor]], num_microbatches: int,
                  device) -> dict[str, torch.Tensor]:
    """Every report name -> its values over the model's reports in forward order, stacked (float64), summed
    or averaged over the step as the module docstring says. Every rank must call it (it all-reduces)."""
    rows, counts = {}, set()
    for role, shape, is_count in program.reported:
        name, index, total = parse(role)
        rows.setdefault(name, torch.zeros((total, *shape), dtype=torch.float64, device=device))
        if is_count:
            counts.add(name)
        if role in metrics:
            rows[name][index] = torch.stack(metrics[role]).to(torch.float64).sum(0)
    if not rows:
        return {}
    flat = torch.cat([values.reshape(-1) for values in rows.values()])
    for role in ("dp_cp", "pp"):
        if role_size(program.coords, role) > 1:
            dist.all_reduce(flat, group=group(role))
    totals, at = {}, 0
    for name, values in rows.items():
        value = flat[at:at + values.numel()].view(values.shape)
        at += values.numel()
        totals[name] = value if name in counts else value / (num_microbatches * role_size(program.coords, "dp_cp"))
    return totals


class Interval:
    """Step totals summed until the log asks for their mean (which starts the next interval)."""

    def __init__(self):
        self.sums: dict[str, torch.Tensor] = {}
        self.steps = 0

    def add(self, totals: dict[str, torch.Tensor]) -> None:
        for name, value in totals.items():
            self.sums[name] = self.sums[name] + value if name in self.sums else value
        self.steps += 1

    def mean(self) -> dict[str, torch.Tensor]:
        means = {name: value / self.steps for name, value in self.sums.items()}
        self.sums, self.steps = {}, 0
        return means
