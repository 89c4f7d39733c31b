"""Named mesh axes: rank order, the group-role table, and a new axis used by a pass written here alone.

The cp case is the compiler's claim in small: a test-only pass that all-reduces over
the cp axis, with no file outside this one touched, gets its groups created, its
collectives seen by the plan checker and named in the dump, and trains the same
model as one device (real gloo ranks against eager autograd + torch.optim.AdamW,
1e-5 relative, fp32). The built-in context_parallel pass runs before it: each cp
rank's loss is the mean over its tokens, so the test pass's average over cp is the
batch's loss, and its identity backward leaves the gradients as the built-in pass needs.
"""

import os

import torch

from gcompile import collectives
from gcompile.axes import GROUP_ROLES, Coords, all_groups, group_members, role_size
from gcompile.check import check_plan
from gcompile.config import build_config
from gcompile.world import build_world
from passes.rewrite import insert_call
from tests.multirank import run_layouts
from tests.reference import ADAM_EPS, random_batches, reference_run, rel_err

TOL = 1e-5
LRS = [1e-3, 8e-4, 6e-4]
PASS = "tests.test_axes:average_loss_over_cp"


def test_rank_order_with_every_axis():
    sizes = {"tp": 2, "cp": 3, "dp": 2, "pp": 2}
    for rank in range(24):
        c = Coords.from_rank(rank, sizes)
        tp, cp, dp, pp = (c.axis_rank(a) for a in ("tp", "cp", "dp", "pp"))
        assert rank == tp + 2 * (cp + 3 * (dp + 2 * pp))  # Megatron's order, tp fastest
        assert c.moved(cp=0).rank == tp + 2 * (3 * (dp + 2 * pp))


def test_group_roles():
    c = Coords.from_rank(13, {"tp": 2, "cp": 2, "dp": 2, "pp": 2})  # tp1 cp0 dp1 pp1
    assert [c.axis_rank(a) for a in ("tp", "cp", "dp", "pp")] == [1, 0, 1, 1]
    assert group_members(c, "tp") == (12, 13)
    assert group_members(c, "cp") == (13, 15)
    assert group_members(c, "dp") == (9, 13)
    assert group_members(c, "dp_cp") == (9, 11, 13, 15)
    assert group_members(c, "pp") == (5, 13)
    assert group_members(c, "mp") == (4, 5, 12, 13)
    assert group_members(c, "embd") == (5, 13)
    assert group_members(c, "world") == tuple(range(16))
    assert all_groups(c, "dp_cp") == [(0, 2, 4, 6), (1, 3, 5, 7), (8, 10, 12, 14), (9, 11, 13, 15)]


def test_role_size_counts_the_members():
    for sizes in ({"tp": 2, "cp": 2, "dp": 4, "pp": 3}, {"tp": 1, "cp": 2, "dp": 4, "pp": 1, "ep": 4},
                  {"tp": 2, "dp": 4, "pp": 2, "dp_shard": 2, "ep": 2}, {"pp": 1}):
        for rank in range(Coords.from_rank(0, sizes).world_size):
            c = Coords.from_rank(rank, sizes)
            for role in GROUP_ROLES:
                assert role_size(c, role) == len(group_members(c, role)), (sizes, rank, role)


def test_expert_parallel_folds_into_dp_cp():
    sizes = {"tp": 1, "cp": 2, "dp": 2, "ep": 2}
    groups = {group_members(Coords.from_rank(r, sizes), "ep") for r in range(4)}
    assert groups == {(0, 1), (2, 3)}  # runs of ep consecutive dp x cp ranks, cp fastest
    assert Coords.from_rank(3, sizes).axis_rank("ep") == 1


class _AverageOverCP(torch.autograd.Function):
    """Forward: the mean over the cp ranks; backward: each rank's gradient as it is (the ranks hold the same)."""

    @staticmethod
    def forward(ctx, x):
        return collectives.all_reduce(x, "cp") / 2

    @staticmethod
    def backward(ctx, grad):
        return grad


def average_over_cp(x: torch.Tensor) -> torch.Tensor:
    return _AverageOverCP.apply(x)


def average_loss_over_cp(program, ctx):
    """Test-only pass: the loss becomes its mean over the cp ranks."""
    for stage in program.stages:
        output = stage.output_node()
        outputs = list(output.args[0])
        if "loss" in stage.outputs:
            i = stage.outputs.index("loss")
            outputs[i] = insert_call(outputs[i], average_over_cp, (outputs[i],), "average_loss_over_cp")
            output.args = (tuple(outputs),)
            stage.graph.recompile()
    return program


def config(cp=1, passes=()):
    return build_config({
        "model": dict(n_layer=2, n_head=4, n_embd=32, block_size=16),
        "parallel": dict(cp=cp, passes=passes),
        "train": dict(micro_batch_size=2, global_batch_size=4, seq_length=16, lr=1e-3, clip_grad=0.5,
                      weight_decay=0.1, adam_eps=ADAM_EPS),
    })


def test_a_new_axis_and_its_pass(tmp_path):
    cfg = config(cp=2, passes=(PASS,))
    programs = build_world(cfg, dump_root=str(tmp_path / "dump"), log=lambda _: None)
    assert "2 ranks agree on every collective" in check_plan(programs)
    summary = open(tmp_path / "dump" / "rank1" / "summary.txt").read()
    assert any(line.split()[:2] == ["all_reduce", "cp"] for line in summary.splitlines()), summary
    dumped = sorted(os.listdir(tmp_path / "dump" / "rank1"))
    assert any(name.endswith("_average_loss_over_cp.txt") for name in dumped), dumped

    batches = random_batches(cfg, len(LRS))
    expected = reference_run(config(), batches, LRS)
    (result,) = run_layouts(tmp_path, [cfg], batches, LRS)
    for step, ref in enumerate(expected):
        assert abs(result.losses[step] - ref.loss) / ref.loss < TOL, f"step {step} loss"
        assert abs(result.grad_norms[step] - ref.grad_norm) / ref.grad_norm < TOL, f"step {step} norm"
    for name, value in expected[-1].params.items():
        if not name.endswith("attn.c_attn.bias"):  # its key third is rounding noise (tests/reference.py)
            assert rel_err(result.params[name], value) < TOL, name
