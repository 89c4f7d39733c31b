"""Every private torch API gcompile uses, in one place, so that a torch upgrade touches one file.

Each entry says which torch versions it was checked on: 2.13 (CPU, this repo's CI) and
2.11 (the GPU machine's torch): the whole test suite, which runs every entry, passed on
torch 2.11.0 on CPU (2026-12-05; README, Tests). Public torch
(`torch.export`, `torch.fx`, `torch.distributed`) is imported where it is used.
"""

import contextlib
import os
import traceback

import torch
from torch._subclasses.fake_tensor import FakeTensorMode  # 2.11, 2.13
from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module  # 2.11, 2.13
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten  # 2.11, 2.13

__all__ = ["FakeTensorMode", "aot_export_joint_with_descriptors", "min_cut_rematerialization_partition",
           "activation_memory_budget", "graph_module", "lazy_graph_modules", "inductor_cache_counts",
           "standalone_compile", "is_op_overload", "register_process_group", "unregister_process_group",
           "resolve_process_group", "fake_store", "foreach_add_", "DCP_METADATA_GLOBALS", "tree_flatten",
           "tree_map_only", "tree_unflatten", "helper_frames_recorded", "TORCH_DIR", "import_lowering"]

DCP_METADATA_GLOBALS = frozenset({
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "TensorProperties",
        "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # how torch pickles a torch.layout
    ("torch", "Size"),
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
})
"""Every global (module, name) in a `.metadata` that DCP's FileSystemWriter writes for a dict of plain
tensors, torch dtypes aside (2.11, 2.13: listed by unpickling a saved checkpoint with a recording find_class).
Constructing any of them runs no user code."""


def aot_export_joint_with_descriptors(*args, **kwargs):
    """torch's, imported on the first call (2.11, 2.13): with the partitioner, about 0.4 s here (torch imports
    torch._dynamo anyway, once a model is built on the meta device) that a command that builds nothing (a plan
    read from kept predictions) need not wait for."""
    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors as export
    return export(*args, **kwargs)


def min_cut_rematerialization_partition(*args, **kwargs):
    """torch's, imported on the first call, as aot_export_joint_with_descriptors (2.11, 2.13)."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition as partition
    return partition(*args, **kwargs)


def import_lowering() -> None:
    """Import what lowering calls now, not at its first call: before forking workers that each lower."""
    import torch._functorch.aot_autograd  # noqa: F401
    import torch._functorch.partitioners  # noqa: F401


def activation_memory_budget(budget: float):
    """The min-cut partitioner's activation memory budget, as a context manager (2.11, 2.13)."""
    return torch._functorch.config.patch(activation_memory_budget=budget)


TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
"""Where torch's own Python files are: frames there are torch's, not the model's."""


@contextlib.contextmanager
def helper_frames_recorded():
    """While torch.export traces, a node's stack_trace keeps the frames of the functions a forward calls, not
    only frames named `forward` (2.11, 2.13: `TracerBase._filter_traceback_frames`, which torch documents as
    the method to override, keeps those alone for export's tracer). Otherwise a node made in a helper (HF's
    `eager_attention_forward`, a model's `apply_rotary`) names the forward line that called it in refusals
    and dumps. torch's own frames other than a module's forward stay out, as before, so a dump's comment
    still names a torch module's forward where the op was made there (`F.embedding` in Embedding.forward)."""
    tracer = torch.fx.proxy.TracerBase
    only_forwards = tracer._filter_traceback_frames

    def forwards_and_helpers(self, frames: traceback.StackSummary) -> traceback.StackSummary:
        kept, self._record_forward_stack_traces_only = self._record_forward_stack_traces_only, False
        try:
            from_first_forward = only_forwards(self, frames)  # every frame from the first forward on
        finally:
            self._record_forward_stack_traces_only = kept
        return traceback.StackSummary.from_list(
            [f for f in from_first_forward if f.name == "forward" or not f.filename.startswith(TORCH_DIR)])

    tracer._filter_traceback_frames = forwards_and_helpers
    try:
        yield
    finally:
        tracer._filter_traceback_frames = only_forwards


def graph_module(root, graph):
    """`fx.GraphModule(root, graph)`, of torch's lazy kind inside `lazy_graph_modules` (2.11, 2.13)."""
    return _make_graph_module(root, graph)


def lazy_graph_modules():
    """A context in which GraphModules made by `graph_module` or by aot_autograd generate their Python code
    when first called or printed, not at each recompile (2.11, 2.13). A build rewrites, copies and propagates
    each graph many times before anything runs it, and the planner runs none: code generation was a sixth of
    its time."""
    return _use_lazy_graph_module(True)


def inductor_cache_counts() -> tuple[int, int]:
    """(FX graph cache hits, misses) of Inductor in this process so far (2.11, 2.13)."""
    from torch._dynamo.utils import counters
    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]


def standalone_compile(gm, example_inputs):
    """Inductor on one FX graph, with its on-disk cache (2.11, 2.13; 2.11 lacks donate_graph_module= / fake_mode=)."""
    return torch._inductor.standalone_compile(gm, example_inputs, dynamic_shapes="from_example_inputs", options={})


def is_op_overload(target) -> bool:
    """Whether an FX node's target is an ATen-style op overload (`torch.ops.ns.op.overload`) (2.11, 2.13)."""
    return isinstance(target, torch._ops.OpOverload)


def register_process_group(name: str, group) -> None:
    """Make `name` in a functional collective mean `group` on this rank (2.11, 2.13; group_name a str on 2.11)."""
    torch._C._distributed_c10d._register_process_group(name, group)


def unregister_process_group(name: str) -> None:
    torch._C._distributed_c10d._unregister_process_group(name)  # 2.11, 2.13


def resolve_process_group(name: str):
    return torch._C._distributed_c10d._resolve_process_group(name)  # 2.11, 2.13


def register_work(tensor: torch.Tensor, work) -> None:
    """Make `_c10d_functional.wait_tensor(tensor)` wait for `work` (a c10d Work), as torch's own functional
    collectives do (2.11, 2.13)."""
    torch._C._distributed_c10d._register_work(tensor, work)


def flash_attention_cpu(q, k, v, causal: bool, scale: float):
    """(out, logsumexp) of SDPA's fused CPU kernel, the log-sum-exp (B, heads, L) in fp32 (2.11, 2.13)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def flash_attention_cpu_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """(dq, dk, dv) of that kernel, given the output and log-sum-exp to differentiate against (2.11, 2.13)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal,
                                                                             scale=scale)


def fake_store():
    """The store of the `fake` process group, which runs nothing (2.11, 2.13)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def foreach_add_(accumulators: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """accumulators[i] += values[i], one kernel launch per group of tensors (2.11, 2.13)."""
    torch._foreach_add_(accumulators, values)
