"""The plan the launcher checked, kept for its ranks: each rank builds its program again, and must build that one.

The launcher builds one program per class of ranks and proves the plan (gcompile.check) before it
starts any rank; every rank then builds its own program in its own process. A user pass that acts
otherwise there than in the launcher (it reads os.environ["RANK"], asks torch.distributed whether
a world is up, draws random numbers) would run a plan nobody checked, and a collective one rank
dropped hangs the job. So the launcher writes each class's signature into the run's flight folder,
and a rank whose build differs stops before it runs anything, in one line.

A signature covers every graph's ops and shapes (in any order), its collectives in order (kind, group,
size), and the instruction list with the peers left out (ranks of one class run it with other peers);
node names are left out too (the launcher's build shares lowerings between stages alike but for their
names). A file is read only by the ranks of the launcher that wrote it (LAUNCHED_BY), for the run config it
was written for: torchrun's ranks, whose launch wrote none, may meet an earlier run's, and compare nothing.
"""

import hashlib
import json
import os

from gcompile.check import PlanError, collective_calls
from gcompile.config import RunConfig
from gcompile.flight import flight_dir
from gcompile.rank_program import RankProgram

FILE = "checked_plan.json"
LAUNCHED_BY = "GCOMPILE_LAUNCHER_PID"
"""Environment of a rank gcompile.launch started: the launcher's process id, which its file names."""


def signature(program: RankProgram) -> str:
    graphs = [(name, gm) for s, stage in sorted(program.stages.items())
              for name, gm in ((f"stage{s}.{n}", g) for n, g in stage.graphs().items())]
    graphs.append(("optimizer", program.optimizer.graph))
    digest = hashlib.sha256()
    for name, gm in graphs:  # each graph's nodes as a multiset: the order of independent ops is no plan
        nodes = sorted(f"{node.op} {node.target if node.op == 'call_function' else ''} "
                       f"{tuple(getattr(node.meta.get('val'), 'shape', ()))}" for node in gm.graph.nodes)
        digest.update(f"{name}: {';'.join(nodes)}".encode())
    for where, call in collective_calls(program):
        digest.update(f"{where} {call};".encode())
    for instruction in program.instructions:
        digest.update(f"{instruction.op} {instruction.stage} {instruction.mb} {instruction.graph} {instruction.reads} "
                      f"{instruction.writes} {instruction.group};".encode())
    return digest.hexdigest()[:16]


def _config_id(config: RunConfig) -> str:
    return hashlib.sha256(repr(config).encode()).hexdigest()[:16]


def write(config: RunConfig, programs: dict[int, RankProgram], shared_by: dict[int, tuple[int, ...]]) -> None:
    """Each rank's checked signature (its class's), for this run config."""
    signatures = {program_rank: signature(program) for program_rank, program in programs.items()}
    by_rank = {rank: signatures[program_rank] for program_rank, ranks in shared_by.items() for rank in ranks}
    folder = flight_dir(config.log.run_dir)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, FILE), "w") as f:
        json.dump({"launcher": os.getpid(), "config": _config_id(config), "ranks": by_rank}, f)


def check_built(config: RunConfig, program: RankProgram) -> None:
    """PlanError where this rank built another program than the one checked for it."""
    try:
        with open(os.path.join(flight_dir(config.log.run_dir), FILE)) as f:
            checked = json.load(f)
        ours = str(checked["launcher"]) == os.environ.get(LAUNCHED_BY) and checked["config"] == _config_id(config)
        expected = checked["ranks"][str(program.coords.rank)] if ours else None
    except (OSError, ValueError, KeyError, TypeError):  # none written, or not for this run
        return
    if expected is not None and signature(program) != expected:
        raise PlanError(f"rank {program.coords.rank} {program.coords} built another program than the launcher "
                        f"checked for it: a pass acts otherwise in the ranks than in the launcher (reads "
                        f"os.environ['RANK'], torch.distributed's state, random numbers?); a pass may read only "
                        f"its program and ctx (ctx.coords is the rank)")
