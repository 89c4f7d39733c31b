"""The IR that passes rewrite: a forward program made of one or more stage graphs.

Calling convention of a stage graph (an FX GraphModule of pre-autograd ATen ops):

    forward(*params, *inputs) -> (*outputs,)

`params` are the stage's parameter placeholders, described by `Stage.params`
(full shape and the cuts a pass declared). `inputs` are named by role: "idx" and
"targets" come from the microbatch; a name in `rank_constants` is a 0-d int64
tensor holding a per-rank number (a vocab shard's start, say), passed as an input
rather than baked in so that all ranks of a stage share one graph, or a tensor the
model holds (a buffer: "held:<its name>"); any other name is an activation received from the previous stage. `outputs` are "loss" on the last stage and activations for the
next stage elsewhere. Placeholder `meta["val"]` (a fake tensor) is the truth for
input shapes; `refresh_meta` re-derives every other node's shape after a rewrite.

Before pipeline_split a program has one stage holding the whole model.
"""

import copy
import hashlib
import os
import re
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from gcompile.collectives import is_collective
from gcompile.layout import Param
from gcompile.torch_api import TORCH_DIR, FakeTensorMode, is_op_overload


@dataclass
class Stage:
    index: int
    """Global stage index; the rank that runs it follows from the schedule."""
    graph: fx.GraphModule
    """forward(*params, *inputs) -> (*outputs,)."""
    params: list[Param]
    """One entry per leading parameter placeholder, in placeholder order."""
    inputs: list[str]
    """Roles of the remaining placeholders: "idx", "targets" or an activation name."""
    outputs: list[str]
    """Roles of the outputs: "loss" or an activation name."""
    rank_constants: dict[str, int | torch.Tensor] = field(default_factory=dict)
    """Input roles fed with a constant, by role: a per-rank number (as a 0-d int64 tensor), or a buffer's
    value (gcompile.held), which no gradient reaches."""
    recompute_from_params: bool = False
    """Backward recomputes what forward derives from parameters alone rather than keeping it (FSDP's
    reshard after forward: the parameter all-gathers run again in backward)."""

    def activation_inputs(self) -> list[str]:
        return activation_roles(self.inputs, self.rank_constants)

    def placeholders(self) -> list[fx.Node]:
        return list(self.graph.graph.find_nodes(op="placeholder"))

    def param_nodes(self) -> dict[str, fx.Node]:
        """Parameter placeholder node by parameter name."""
        return {p.name: n for p, n in zip(self.params, self.placeholders())}

    def input_nodes(self) -> dict[str, fx.Node]:
        return dict(zip(self.inputs, self.placeholders()[len(self.params):]))

    def constant_nodes(self) -> set[fx.Node]:
        """The placeholders of `rank_constants`."""
        return {node for role, node in self.input_nodes().items() if role in self.rank_constants}

    def output_node(self) -> fx.Node:
        return self.graph.graph.output_node()


BATCH_ROLES = ("idx", "targets")
"""The microbatch's inputs, by role: token ids and next-token targets, in forward's order."""


def activation_roles(inputs: list[str], rank_constants: dict) -> list[str]:
    """The input roles received from the previous stage (not batch data, not rank constants)."""
    return [r for r in inputs if r not in BATCH_ROLES and r not in rank_constants]


@dataclass
class Program:
    stages: list[Stage]
    history: list[str] = field(default_factory=list)
    """Names of the passes that produced this program, in order."""

    def clone(self) -> "Program":
        """A deep copy a pass may rewrite without touching its caller's program."""
        return copy.deepcopy(self)

    def __str__(self) -> str:
        return "\n\n".join(format_stage(s) for s in self.stages)


def broken_convention(program: Program) -> str | None:
    """Why `program` no longer has the shape lowering and the runtime read, or None: each stage's placeholders
    its parameters then its inputs, an output per role, the loss a floating-point scalar. A pass that breaks it
    would otherwise fail deep in autograd, or train with a value in the wrong place."""
    if not program.stages:
        return "the program has no stages"
    for stage in program.stages:
        placeholders, expected = len(stage.placeholders()), len(stage.params) + len(stage.inputs)
        if placeholders != expected:
            return (f"stage {stage.index} has {placeholders} inputs for its {len(stage.params)} parameters and "
                    f"{len(stage.inputs)} inputs {stage.inputs}")
        outputs = [n for n in stage.graph.graph.nodes if n.op == "output"]
        returned = outputs[0].args[0] if len(outputs) == 1 else None
        if not isinstance(returned, (tuple, list)) or len(returned) != len(stage.outputs):
            found = "no output node" if not outputs else f"{len(returned)} outputs" \
                if isinstance(returned, (tuple, list)) else f"output {returned!r}"
            return f"stage {stage.index} has {found} for its output roles {stage.outputs}"
        for role, node in zip(stage.outputs, returned):
            if role == "loss" and (held := not_a_loss(node)):
                return f"stage {stage.index}'s loss is {held}, not a floating-point scalar"
    return None


def not_a_loss(returned) -> str | None:
    """What a graph returns where its loss belongs (a node, or a constant), said in a few words; None where it is
    a floating-point scalar, the loss every pass, the schedule and the optimizer step read."""
    value = returned.meta.get("val") if isinstance(returned, fx.Node) else returned
    if isinstance(value, torch.Tensor):
        return None if value.dim() == 0 and value.is_floating_point() else \
            f"a {value.dtype} tensor of shape {list(value.shape)}"
    return f"{type(value).__name__} {value!r}"


def refresh_meta(stage: Stage) -> None:
    """Re-run shape propagation from the placeholders' fake values (after a rewrite)."""
    propagate_shapes(stage.graph)


def propagate_shapes(gm: fx.GraphModule) -> None:
    """Recompile `gm` and give every node a `meta["val"]` computed from its placeholders' fake values."""
    vals = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
    mode = next((v.fake_mode for v in vals if hasattr(v, "fake_mode")), None) or FakeTensorMode()
    gm.graph.lint()
    gm.recompile()
    with mode:
        _ReusingFakeTensorProp(gm, mode).propagate_dont_convert_inputs(*vals)


SHAPE_FUNCTIONS: dict = {}
"""Python functions a pass calls in a graph -> a function of the same arguments that makes only the fake output:
what propagation runs instead of the function (a custom op's register_fake, for a call that must stay
traceable Python because aot_autograd differentiates through it, e.g. context parallel's ring)."""


class _ReusingFakeTensorProp(FakeTensorProp):
    """Shape propagation that keeps a node's value when its op, arguments and input values are the very
    ones it was last computed from: a pass rewrites some nodes, yet the whole graph is propagated again
    after every pass (a third of a harness run's build time went to propagation). Each node passes on its
    `meta["val"]`, so an input that was not recomputed is the same object as last time."""

    def run_node(self, n: fx.Node):
        if n.op == "placeholder":
            return fx.Interpreter.run_node(self, n)  # its meta["val"] itself, not a fresh snapshot of it
        if n.op != "call_function":
            return super().run_node(n)
        computed_from = (n.target, self.fetch_args_kwargs_from_env(n))
        last = n.meta.get(_COMPUTED_FROM)
        if last is not None and "val" in n.meta and last[2] is n.meta["val"] and _same(last[:2], computed_from):
            return n.meta["val"]
        if n.target in SHAPE_FUNCTIONS:
            n.meta["val"] = SHAPE_FUNCTIONS[n.target](*computed_from[1][0], **computed_from[1][1])
        else:
            result = super().run_node(n)
            if "val" not in n.meta:
                return result
        n.meta[_COMPUTED_FROM] = (*computed_from, n.meta["val"])
        return n.meta["val"]


_COMPUTED_FROM = "gcompile_computed_from"
"""meta key: (target, (args, kwargs) as values, the value computed from them)."""


def _same(a, b) -> bool:
    """Equal, with tensors compared by identity (values are fake: equal shapes may still alias differently)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def structure_key(gm: fx.GraphModule) -> str:
    """Same key <=> the same ops wired the same way over the same input shapes, dtypes and strides, whatever
    the nodes are named: a pipeline's middle stages (layers 3-5 and 6-8, say) differ only in their names,
    and lowering gives them the very same graphs, so a build lowers one of them."""
    index, parts = {}, []
    for i, node in enumerate(gm.graph.nodes):
        index[node] = i
        if node.op == "placeholder":
            v = node.meta["val"]
            parts.append((node.op, tuple(v.shape), v.dtype, v.stride(), v.device))
        else:
            wiring = fx.node.map_aggregate((node.args, node.kwargs), lambda a: _Shown(
                f"%{index[a]}" if isinstance(a, fx.Node) else
                f"tensor@{id(a)}" if isinstance(a, torch.Tensor) else repr(a)))  # a tensor's repr elides values
            parts.append((node.op, str(node.target), repr(wiring)))
    return hashlib.sha256(repr(parts).encode()).hexdigest()


@dataclass(frozen=True)
class _Shown:
    """An argument as structure_key writes it: another node by its position, a tensor by its identity."""
    text: str

    def __repr__(self) -> str:
        return self.text


def ancestors(nodes: list[fx.Node]) -> set[fx.Node]:
    """`nodes` and every node they read, transitively."""
    seen, todo = set(), list(nodes)
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo += node.all_input_nodes
    return seen


def descendants(node: fx.Node) -> set[fx.Node]:
    """`node` and every node that reads it, transitively (the output node aside)."""
    seen, todo = set(), [node]
    while todo:
        node = todo.pop()
        if node not in seen and node.op != "output":
            seen.add(node)
            todo += node.users
    return seen


def drop_dead_nodes(graph: fx.Graph) -> None:
    """Remove the nodes nobody reads, collectives included: a collective nobody reads is dead on every rank alike."""
    graph.eliminate_dead_code(is_impure_node=lambda node: node.is_impure() and not is_collective(node.target))


def format_stage(stage: Stage) -> str:
    """A stage as a person reads it: parameter table, then the graph as code with shapes."""
    lines = [f"# stage {stage.index}: inputs {stage.inputs} -> outputs {stage.outputs}", "# parameters:"]
    for p, node in zip(stage.params, stage.placeholders()):
        local = tuple(node.meta["val"].shape) if "val" in node.meta else "?"
        cuts = ", ".join(f"{s.axis}:dim{s.dim}" + (f"x{len(s.parts)}parts" if s.parts else "")
                         + (f" pad{s.padded_size}" if s.padded_size else "") for s in p.shards)
        tied = " tied-copy" if p.tied_copy else ""
        lines.append(f"#   {node.name:<48} {p.name:<40} full {tuple(p.full_shape)} local {local}"
                     f" {cuts or 'replicated'}{tied}")
    lines.append(format_graph(stage.graph))
    return "\n".join(lines)


def random_draws(gm: fx.GraphModule) -> list[fx.Node]:
    return [node for node in gm.graph.nodes if draws_random(node)]


def draws_random(node: fx.Node) -> bool:
    """A random op, or dropout (attention's too) at a rate above 0 in training."""
    if node.op != "call_function" or torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    schema = node.target._schema.arguments
    given = {a.name: a.default_value for a in schema if a.has_default_value()}
    given |= {a.name: v for a, v in zip(schema, node.args)} | node.kwargs
    rate = given.get("p", given.get("dropout_p"))
    return rate is None or bool(rate) and given.get("train") is not False


def node_origin(node: fx.Node) -> str:
    """`add_4 (aten.add.Tensor) at gcompile/models/gpt2.py:89: x = x + ...`, what an error about a node says."""
    target = _op_name(node.target) if node.op == "call_function" else node.op
    line = source_line(node)
    return f"{node.name} ({target}) at {line}" if line else f"{node.name} ({target}), no source line recorded"


def source_line(node: fx.Node) -> str | None:
    """`gcompile/models/gpt2.py:89: x = x + ...`: the innermost frame of node.meta["stack_trace"] outside torch
    itself, the model's line that made the node; its file relative to the working folder where it is inside it,
    else its full path. None where no frame was recorded."""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    ours = [f for f in frames if not f[0].startswith(TORCH_DIR)] or frames
    if not ours:
        return None
    path, line, code = ours[-1]
    shown = os.path.relpath(path)
    return f"{os.path.normpath(path) if shown.startswith('..') else shown}:{line}: {code.strip()}"


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in [^\n]*\n([^\n]*)')


def format_graph(gm: fx.GraphModule) -> str:
    return gm.print_readable(print_output=False, include_stride=False, include_device=False)


def op_counts(gm: fx.GraphModule) -> Counter:
    """Calls by op name (`aten.mm`, `_c10d_functional.all_reduce`), for one-line pass diffs."""
    counts = Counter()
    for node in gm.graph.nodes:
        if node.op == "call_function":
            counts[_op_name(node.target)] += 1
    return counts


def _op_name(target) -> str:
    if is_op_overload(target):
        return f"{target.namespace}.{target._opname}"
    return getattr(target, "__name__", str(target))


def diff_counts(before: Counter, after: Counter) -> str:
    """`aten.mm: 24 -> 24 (+0)` lines for every op whose count changed."""
    lines = []
    for op in sorted(set(before) | set(after)):
        if before[op] != after[op]:
            lines.append(f"{op}: {before[op]} -> {after[op]} ({after[op] - before[op]:+d})")
    return "\n".join(lines) or "(no op count changed)"


def dump_text(directory: str, filename: str, text: str) -> str:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, filename)
    with open(path, "w") as f:
        f.write(text)
    return path
