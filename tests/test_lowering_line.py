"""The planner's derived lowerings (gcompile.lowering_line): a stage on the line of two lowered ones gets
exactly the graphs lowering it gives, and a stage off every line is lowered for real."""

import dataclasses
from fractions import Fraction

from gcompile.axes import Coords
from gcompile.config import build_config
from gcompile.lowering_line import Lines, _position, outline
from gcompile.pipeline import BuildCache, build_rank_program


def column(micro_batch_size: int, cache: BuildCache) -> list:
    """tp 2, pp 2 with zero bubble (B and W apart), one program per pipeline rank."""
    config = build_config({"model": dict(n_layer=2, n_head=2, n_embd=32, block_size=32),
                           "parallel": dict(tp=2, pp=2, pipeline_schedule="zb1f1b"),
                           "train": dict(micro_batch_size=micro_batch_size, global_batch_size=16, seq_length=32)})
    origin = Coords.from_rank(0, config.mesh_sizes)
    return [build_rank_program(config, origin.moved(pp=r), log=lambda _: None, cache=cache) for r in range(2)]


def test_a_stage_on_the_line_of_two_lowered_ones_gets_the_graphs_lowering_gives():
    """Micro-batch sizes 2 and 4 lowered, 8 derived. (Not from 1: there the partitioner saves other tensors
    of the last stage, so its graphs are off the line; `derive` then tries another pair.)"""
    lined = BuildCache(lines=Lines())
    column(2, lined), column(4, lined)
    assert lined.lines.derived == 0
    derived = column(8, lined)
    assert lined.lines.derived == 2, "both stages at micro-batch size 8 are on the line of 2 and 4"
    lowered = column(8, BuildCache())
    for ours, theirs in zip(derived, lowered):
        for stage in ours.stages:
            for name in ("forward", "backward", "backward_weight"):
                got, want = getattr(ours.stages[stage], name), getattr(theirs.stages[stage], name)
                assert (got is None) == (want is None), (stage, name)
                if got is not None:
                    assert got.code == want.code, (stage, name)
                    assert outline(got) == outline(want), (stage, name)  # every shape, stride and offset
            assert dataclasses.replace(ours.stages[stage], forward=None, backward=None, backward_weight=None) == \
                dataclasses.replace(theirs.stages[stage], forward=None, backward=None, backward_weight=None)


def test_a_graph_is_on_a_line_only_where_every_int_is():
    a, b = (1, 64, 32, -1), (2, 128, 32, -1)
    assert _position(a, b, (4, 256, 32, -1)) == 3
    assert _position(a, b, (3, 192, 32, -1)) == 2
    assert _position(a, b, (4, 256, 16, -1)) is None  # an int the line holds still moved
    assert _position(a, b, (4, 192, 32, -1)) is None  # two ints at different places on the line
    assert _position(a, b, (3, 160, 32, -1)) is None
    assert _position((2, 64), (4, 128), (3, 96)) == Fraction(1, 2)
