"""pipeline_split: the one-stage forward program -> pp * vpp stage programs; keep this rank's.

Requires
  - a program of one stage, forward(*params, *inputs) -> (loss,), inputs "idx", "targets" and
    rank constants;
  - every node of a transformer block carrying its module in node.meta["nn_module_stack"]
    (torch.export records `transformer.h.3...`); a block is `<list>.<i>`, the outermost such
    entry, and the blocks found are 0 .. n_layer-1 of one list.
Ensures
  - stages 0 .. S-1 (S = pp * vpp) hold consecutive blocks, `stage_layers` many each (even, or
    [parallel] pipeline_layers); what runs before the first block (the embedding) is on stage 0,
    what runs after the last (final LayerNorm, head, loss) on stage S-1;
  - a tensor made on stage s and used on stage s+1 is an output of s and an input of s+1 under the
    same role (act0, act1, ... in graph order); the last stage outputs "loss";
  - a stage graph's placeholders are its own parameters (in the program's order), then its
    activations, then the batch inputs and rank constants it uses (so stage 0 takes "idx", the last
    stage "targets", and each stage a rank constant exactly when it reads it);
  - a parameter read on two pipeline ranks (e.g. GPT-2's tied embedding: embedding on the first,
    head on the last) is a copy on each, the later one `tied_copy`, both `tied_group="embd"` so
    the optimizer sums their gradients; two stages on one rank share one parameter;
  - only the stages of ctx.coords.axis_rank("pp") are returned (stage s runs on rank s % pp), by index.
Rewrite (pp 2, 2 blocks)
  before  stage 0: (wte, wpe, h.0.*, h.1.*, ln_f.*, idx, targets) -> (loss,)
  after   stage 0: (wte, wpe, h.0.*, idx) -> (act0,)
          stage 1: (h.1.*, ln_f.*, wte [tied copy], act0, targets) -> (loss,)

Nodes outside blocks (residual adds, views, the embedding, wrapper calls a pass inserted) are
placed by their data: a node fed by placed nodes runs with the latest of them; a node fed only by
placeholders and other such nodes (the embedding, `targets.view`, a wrapper around a parameter)
is copied into every stage that reads it, so that only block activations cross stages.
"""

import re
from dataclasses import replace

import torch
import torch.fx as fx

from gcompile.config import stage_layers
from gcompile.pass_manager import PassContext, register_pass
from gcompile.program import Program, Stage, node_origin
from gcompile.schedule import stage_rank
from gcompile.torch_api import graph_module

PASS = "pipeline_split"
EMBEDDING_GROUP = "embd"
_BLOCK = re.compile(r"(?P<list>.+)\.(?P<index>\d+)")


@register_pass(PASS)
def pipeline_split_pass(program: Program, ctx: PassContext) -> Program:
    if len(program.stages) != 1:
        raise ValueError(f"{PASS} expects the one-stage program, got {len(program.stages)} stages "
                         f"(after {' -> '.join(program.history)})")
    (whole,) = program.stages
    p = ctx.config.parallel
    blocks = _blocks(whole)
    num_stages = p.pp * p.virtual_pipeline_size
    counts = stage_layers(len(set(blocks.values())), p.pp, p.virtual_pipeline_size, p.pipeline_layers)
    block_stage = [s for s, count in enumerate(counts) for _ in range(count)]
    placed = _place(whole, {n: block_stage[i] for n, i in blocks.items()}, num_stages - 1)
    crossing = _boundaries(whole, placed, num_stages)
    params = _stage_params(whole, placed, p.pp, num_stages)
    mine = [s for s in range(num_stages) if stage_rank(s, p.pp) == ctx.coords.axis_rank("pp")]
    return Program(stages=[_build_stage(whole, s, placed, crossing, params[s], num_stages) for s in mine],
                   history=list(program.history))


def block_of(node: fx.Node) -> tuple[str, int] | None:
    """(module list, block index) of the outermost `<list>.<i>` module `node` ran in; None outside blocks."""
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        match = _BLOCK.fullmatch(path)
        if match:
            return match["list"], int(match["index"])
    return None


def _blocks(stage: Stage) -> dict[fx.Node, int]:
    """Block index of every node inside a block."""
    owner, lists = {}, set()
    for node in stage.graph.graph.nodes:
        block = block_of(node)
        if block is not None:
            lists.add(block[0])
            owner[node] = block[1]
    found = sorted(set(owner.values()))
    if len(lists) != 1 or found != list(range(len(found))):
        raise ValueError(f"expected the blocks <list>.0 .. <list>.N-1 of one module list in "
                         f"nn_module_stack; found lists {sorted(lists)} with blocks {found}")
    return owner


def _place(stage: Stage, fixed: dict[fx.Node, int], last: int) -> dict[fx.Node, frozenset[int]]:
    """The stages of every call node: blocks as given, the others by their data (see module docstring)."""
    nodes = [n for n in stage.graph.graph.nodes if n.op not in ("placeholder", "output")]
    placed, floating = {}, set()
    for node in nodes:
        producers = [p for p in node.all_input_nodes if p.op != "placeholder" and p not in floating]
        if node in fixed:
            placed[node] = frozenset([fixed[node]])
        elif producers:
            placed[node] = frozenset([max(max(placed[p]) for p in producers)])
        else:
            floating.add(node)
    for node in reversed(nodes):
        if node in floating:
            readers = [frozenset([last]) if u.op == "output" else placed[u] for u in node.users]
            placed[node] = frozenset().union(*readers) or frozenset([last])
    return placed


def _boundaries(stage: Stage, placed: dict[fx.Node, frozenset[int]], num_stages: int) -> list[list[fx.Node]]:
    """crossing[s]: tensors made on stage s and read on s+1, in graph order; checks every edge."""
    crossing = [[] for _ in range(num_stages)]
    for node in stage.graph.graph.nodes:
        if node.op == "placeholder":
            continue
        for here in [num_stages - 1] if node.op == "output" else placed[node]:
            for p in node.all_input_nodes:
                if p.op == "placeholder" or here in placed[p]:
                    continue
                (source,) = placed[p]  # a node in several stages is in all that read it
                if source > here or here > source + 1:
                    where = "the output" if node.op == "output" else node_origin(node)
                    raise ValueError(f"stage {here} reads a tensor made on stage {source}, but a stage can only "
                                     f"read what the stage right before it made; reader {where}; "
                                     f"tensor {node_origin(p)}; use fewer stages (--pp, --virtual-pipeline-size) "
                                     f"or --pipeline-layers that put the two on neighbouring stages")
                val = p.meta.get("val")
                if not isinstance(val, torch.Tensor) or not val.dtype.is_floating_point:
                    raise ValueError(f"a {getattr(val, 'dtype', type(val).__name__)} value crosses from stage "
                                     f"{source} to {here}, but only floating-point tensors (which have a gradient) "
                                     f"can be sent between stages; value {node_origin(p)}")
                if p not in crossing[source]:
                    crossing[source].append(p)
    order = {n: i for i, n in enumerate(stage.graph.graph.nodes)}
    return [sorted(values, key=order.__getitem__) for values in crossing]


def _stage_params(stage: Stage, placed: dict[fx.Node, frozenset[int]], pp: int, num_stages: int):
    """Per stage, (placeholder, Param) of the parameters it reads, marking copies held on other ranks."""
    params = [[] for _ in range(num_stages)]
    for param, node in zip(stage.params, stage.placeholders()):
        readers = sorted(frozenset().union(*(placed[u] for u in node.users))) or [0]  # unread: kept on stage 0
        ranks = sorted({stage_rank(s, pp) for s in readers})
        if len(ranks) > 1 and ranks != [0, pp - 1]:
            raise ValueError(f"parameter {param.name} is read on pipeline ranks {ranks} (stages "
                             f"{readers}); a parameter may be shared only by the first and last rank")
        first_rank = stage_rank(readers[0], pp)
        for s in readers:
            shared = replace(param, tied_group=EMBEDDING_GROUP) if len(ranks) > 1 else param
            params[s].append((node, replace(shared, tied_copy=stage_rank(s, pp) != first_rank)))
    return params


def _build_stage(whole: Stage, s: int, placed: dict[fx.Node, frozenset[int]], crossing: list[list[fx.Node]],
                 params: list, num_stages: int) -> Stage:
    graph, env = fx.Graph(), {}

    def placeholder(name: str, val, source: fx.Node | None) -> fx.Node:
        node = graph.placeholder(name)
        node.meta.update(source.meta if source is not None else {}, val=val)
        node.meta["pass"] = PASS
        return node

    for node, _ in params:
        env[node] = placeholder(node.name, node.meta["val"], node)
    inputs = []
    if s > 0:
        for k, value in enumerate(crossing[s - 1]):
            env[value] = placeholder(f"act{k}", _received(value.meta["val"]), None)
            inputs.append(f"act{k}")
    for role, node in whole.input_nodes().items():
        if any(s in placed[u] for u in node.users):
            env[node] = placeholder(node.name, node.meta["val"], node)
            inputs.append(role)
    for node in whole.graph.graph.nodes:
        if node.op not in ("placeholder", "output") and s in placed[node]:
            env[node] = graph.node_copy(node, env.__getitem__)
    if s == num_stages - 1:
        values, outputs = whole.output_node().args[0], list(whole.outputs)
    else:
        values, outputs = crossing[s], [f"act{k}" for k in range(len(crossing[s]))]
    graph.output(tuple(env[v] for v in values)).meta["pass"] = PASS
    graph.lint()
    return Stage(index=s, graph=graph_module(whole.graph, graph), params=[p for _, p in params], inputs=inputs,
                 outputs=outputs, rank_constants={r: v for r, v in whole.rank_constants.items() if r in inputs})


def _received(val: torch.Tensor) -> torch.Tensor:
    """What a stage receives for `val`: a fresh contiguous buffer of its shape; `val` itself where it is one
    already, so that shape propagation keeps every value the stage computes from it (it propagates again only
    a node whose inputs are not the very objects it was computed from: gpt2-small's plan on 8 ranks spent a
    fifth of its time propagating the stages after the first)."""
    if val._base is None and val.storage_offset() == 0 and val.is_contiguous() and \
            val.untyped_storage().nbytes() == val.numel() * val.element_size():
        return val
    with val.fake_mode:
        return torch.empty(val.shape, dtype=val.dtype, device=val.device)
