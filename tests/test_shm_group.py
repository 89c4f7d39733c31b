"""The shared-memory tp group: every collective the graphs use, against a formula and against gloo.

Three real ranks (an odd count: sums of more than two parts, in rank order) with slots
of 4 KiB, so that large tensors go through in pieces. A shared-memory sum adds the ranks'
tensors in rank order on every rank, so its result is bitwise the formula's and bitwise
the same on all ranks; gloo sums in its own order, so it agrees within rounding.
"""

import errno
import glob
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import run_gpt
from gcompile import shm_group
from gcompile.axes import Coords
from gcompile.mesh import MeshError, tp_group_backend
from tests.multirank import assert_succeeded, launch

WORKER = os.path.join(os.path.dirname(__file__), "workers", "shm_worker.py")
WORLD = 3
GLOO_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.int64: 0}
"""Relative; inputs are of order 100, and cancellation in a sum of three makes the absolute bound 100x this."""

pytestmark = pytest.mark.skipif(not shm_group.available(), reason="shared-memory groups need x86-64 Linux")


def in_rank_order(parts: list[torch.Tensor], combine) -> torch.Tensor:
    out = parts[0]
    for part in parts[1:]:
        out = combine(out, part)
    return out


def expected(op: str, xs: list[torch.Tensor], ys: list[torch.Tensor], rank: int) -> torch.Tensor:
    if op == "all_gather":
        return torch.cat(xs)
    if op == "reduce_scatter":
        return in_rank_order([y.chunk(WORLD)[rank] for y in ys], torch.add)
    if op == "broadcast":  # from rank 1
        return xs[1]
    if op == "scatter":  # from rank 2
        return ys[2].chunk(WORLD)[rank]
    reduce = op.split()[1]
    combine = {"sum": torch.add, "avg": torch.add, "max": torch.maximum, "min": torch.minimum}[reduce]
    out = in_rank_order(xs, combine)
    return out / WORLD if reduce == "avg" else out


def test_collectives(tmp_path):
    before = set(glob.glob("/dev/shm/gcompile-*"))
    assert_succeeded(tmp_path, launch(tmp_path, WORKER, {}, WORLD, timeout=300))
    assert set(glob.glob("/dev/shm/gcompile-*")) == before, "every group unlinks its file once mapped"
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    checked = 0
    for key, value in ranks[0].items():
        if not isinstance(key, tuple) or key[0] != "shm":
            continue
        _, dtype, numel, op = key
        xs, ys = zip(*(r[("inputs", dtype, numel)] for r in ranks))
        for rank, r in enumerate(ranks):
            assert torch.equal(r[key], expected(op, xs, ys, rank)), f"{op} {dtype} numel={numel} on rank {rank}"
            tol = GLOO_TOL[r[key].dtype]
            torch.testing.assert_close(r[key], r[("gloo", dtype, numel, op)], rtol=tol, atol=100 * tol)
        checked += 1
    assert checked == 2 * (2 * 8 + 7), "two sizes of every dtype, eight ops on floats, seven on int64"
    for r in ranks:
        assert torch.equal(r["strided"], in_rank_order([q["strided input"] for q in ranks], torch.add))
    assert "ranks [1, 2] of its group did not arrive within 1 s" in ranks[0]["timeout"]


def test_full_shm_is_one_clear_error(monkeypatch):
    def no_room(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    before = set(glob.glob("/dev/shm/gcompile-*"))
    with pytest.raises(shm_group.ShmRoomError, match=r"cannot reserve \d+ MiB in /dev/shm .*--shm-size.*--tp-comm-backend gloo"):
        shm_group.SharedMemoryGroup(dist.HashStore(), 0, 1, timedelta(seconds=5))
    assert set(glob.glob("/dev/shm/gcompile-*")) == before


def test_shm_refused_where_it_cannot_work():
    with pytest.raises(MeshError, match="tp_comm_backend='shm' is for CPU ranks"):
        tp_group_backend("shm", Coords.from_rank(0, {"tp": 2}), "cuda")
    assert tp_group_backend("auto", Coords.from_rank(0, {}), "cpu") is None  # no tp group to speed up
    assert run_gpt.main(["--tp-comm-backend", "tcp"]) == 2
