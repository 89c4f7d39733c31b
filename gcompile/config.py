"""Run configuration: frozen dataclasses, TOML presets, CLI flags, one validation.

Every field of every section is a TOML key (`[model] n_layer = 4`) and a CLI flag
(`--n-layer 4`); flags override the preset named by `--config`. Training flags use
Megatron-LM's spellings, and Megatron's model and parallel spellings are accepted
as aliases (`--num-layers`, `--tensor-model-parallel-size`). Unknown keys and
impossible combinations are `ConfigError`s that name every factor involved.
"""

import argparse
import ast
import contextlib
import dataclasses
import inspect
import math
import os
import shlex
import textwrap
import tomllib
import types
import typing
from dataclasses import dataclass, field, fields

from gcompile.arguments import UNRECOGNIZED, ArgumentParser
from gcompile.data import DataConfig, DataError, parse_split
from gcompile.log import counted
from gcompile.models import CONFIGS, DEFAULT_MODEL, is_users, register_user_model, spec_of
from gcompile.models.moe_config import MoEConfig, idle_settings
from gcompile.paths import path_error
from gcompile.user_code import UserCodeError
from gcompile.schedule import SCHEDULES, SPLIT_BACKWARD, ScheduleError, check_sizes


ModelConfig = CONFIGS[DEFAULT_MODEL]
"""The `[model]` section by default: the config of the default model's spec (GPT-2's). `arch` picks another
family; the section's keys are then that family's config fields."""


@dataclass(frozen=True)
class ModelChoice:
    arch: str = DEFAULT_MODEL
    """Model family (gcompile/models): gpt2 or llama, or your own model as pkg.module:spec or
    path/to/file.py:spec (a ModelSpec, or a function returning one; this imports and runs that code).
    The other [model] keys are that family's; a key another family has is an error."""

TP_COMM_BACKENDS = ("auto", "shm", "gloo")
"""Values of parallel.tp_comm_backend (gcompile.mesh.tp_group_backend)."""
CP_COMM_TYPES = ("all_gather", "p2p", "a2a")
"""Values of parallel.cp_comm_type."""
SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
"""Megatron-FSDP's --data-parallel-sharding-strategy values."""
MAX_TIMEOUT_S = 10 ** 8
"""The longest timeout a run may be given: the watchdog's faulthandler fallback waits twice it, and past about
3e9 s the platform's clock overflows (a traceback from every rank's first collective, or from a pass's timer)."""
FP16_ONLY = ("initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")
"""[train] fields only fp16's loss scaling reads."""

POINTS = ("capture", "tensor_parallel", "sequence_parallel", "context_parallel", "expert_parallel",
          "pipeline_split", "fully_sharded", "lower",
          "tp_comm_overlap",
          "data_parallel", "sharded_optimizer")
"""The named points of the compiler, in order; a user pass goes `before:` or `after:` one of them
(up to pipeline_split it sees the forward Program, after lower the lowered RankProgram)."""


class ConfigError(ValueError):
    """A configuration a run cannot start with; the message says what to change: each reason, `; `-joined
    (a reason may hold a `; ` of its own, before its fix), and `reasons` keeps them apart."""

    def __init__(self, *reasons: str):
        super().__init__("; ".join(reasons))
        self.reasons = reasons


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel size: weights sharded Megatron-style across this many ranks."""
    pp: int = 1
    """Pipeline-parallel size: the layers split into this many stages."""
    dp: int = 1
    """Data-parallel size: replicas that each see 1/dp of the global batch."""
    cp: int = 1
    """Context-parallel size (mesh axis cp, between tp and dp): each cp rank holds seq_length/cp tokens of every
    sample (chunks i and 2cp-1-i of 2cp) and attention sees every rank's keys and values (cp_comm_type)."""
    cp_comm_type: str = "p2p"
    """How context-parallel attention sees the other ranks' keys and values (Megatron's flag and default): p2p (a
    ring of K/V blocks merged by online softmax, transfers overlapped: holds nothing of length seq_length),
    all_gather (gather K and V, then one masked attention: holds them, and a (T/cp, T) mask, whole) or a2a
    (Ulysses: all-to-alls turn the rank's tokens of every head into every token of 1/cp of the heads; the heads,
    K and V's too, must divide by cp)."""
    ep: int = 1
    """Expert-parallel size (Megatron's --expert-model-parallel-size): each block's experts split over ep ranks
    folded into dp x cp, tokens sent to their experts' rank by all-to-all and back (passes/expert_parallel.py)."""
    expert_tensor_parallel_size: int = 1
    """Megatron's --expert-tensor-parallel-size; only 1 is built: every tp rank holds its experts whole."""
    sequence_parallel: bool = False
    """Shard LayerNorm/residual regions along the sequence across the tp ranks; at tp 1 it does nothing (as in
    Megatron, which turns it off there), so a config or a plan may ask for it whatever tp a layout has."""
    tp_plan: tuple[str, ...] = ()
    """Tensor-parallel plan: module-glob=placement (column, row, vocab, replicate), first match wins;
    empty = the model's default plan (GPT-2: Megatron's)."""
    make_vocab_size_divisible_by: int = 128
    """A vocab-parallel embedding is padded to a multiple of this times tp (Megatron's flag)."""
    overlap_tp_comm: bool = True
    """Start each tp collective as soon as its input exists and wait where its result is first read
    (backward: the input-gradient all-reduce runs during the weight-gradient matmul)."""
    tp_comm_backend: str = "auto"
    """How CPU tp groups move tensors: shm (shared memory; ranks on one x86-64 Linux host), gloo, or auto
    (shm where it applies). GPU ranks use nccl."""
    virtual_pipeline_size: int = 1
    """Model chunks per pipeline rank (interleaved 1F1B); 1 = no interleaving."""
    num_layers_per_virtual_pipeline_stage: int | None = None
    """Megatron's way to ask for interleaving: virtual_pipeline_size = n_layer / (pp * this)."""
    pipeline_schedule: str = "1f1b"
    """Static pipeline schedule: gpipe, 1f1b, interleaved (the default when virtual_pipeline_size > 1) or zb1f1b
    (zero-bubble ZB-H1: 1f1b with parameter gradients computed apart, filling the pipeline bubble)."""
    pipeline_layers: tuple[int, ...] = ()
    """Layers per pipeline stage in stage order (pp * vpp entries, e.g. 3,5); empty = n_layer split evenly."""
    use_distributed_optimizer: bool = False
    """ZeRO-1: AdamW states and fp32 main weights sharded over dp (= data_parallel_sharding_strategy optim)."""
    data_parallel_sharding_strategy: str | None = None
    """What dp ranks shard: no_shard, optim (ZeRO-1), optim_grads (ZeRO-2: gradients reduce-scattered into
    the owner's shard too) or optim_grads_params (ZeRO-3 / FSDP: parameters too, all-gathered per layer
    where used); None = optim with use_distributed_optimizer, else no_shard."""
    data_parallel_shard_size: int | None = None
    """optim_grads_params, hybrid (HSDP): shard over groups of this many consecutive dp ranks and replicate
    across the groups (gradients all-reduced over the replicas); None = shard over all dp ranks."""
    fsdp_reshard_after_forward: bool = True
    """optim_grads_params: free each layer's gathered weights after forward and gather them again in
    backward (less memory); false keeps them from forward to backward (one all-gather fewer per layer)."""
    ddp_bucket_size: int | None = None
    """Elements per gradient-reduction bucket; None = Megatron's max(40M, 1M * dp)."""
    overlap_grad_reduce: bool = False
    """Start each bucket's dp reduction inside the last microbatch's backward, as soon as it is final."""
    memory_budget_gb: float | None = None
    """Refuse to launch when a rank's estimated peak memory exceeds this many GiB (checked before launch)."""
    distributed_timeout_minutes: float = 10
    """Minutes a collective (or joining the world) may wait before it fails (Megatron's flag)."""
    hang_timeout_s: float = 300
    """Local launcher: when no rank has progressed for this long, print where each rank is (RUN_DIR/flight)
    and stop the job; long enough for a cold compile; 0 = never."""
    passes: tuple[str, ...] = ()
    """User passes (this imports and runs their code in the launcher and every rank): `pkg.module:function` or
    `path/to/file.py:function` (after pipeline_split, before lowering), or `after:POINT=...` / `before:POINT=...`
    with POINT capture, lower, grad_sync (whichever dp strategy runs) or a built-in pass this run runs."""

    @property
    def sharding(self) -> str:
        """The dp sharding strategy this run builds, the alias resolved (SHARDING_STRATEGIES)."""
        if self.data_parallel_sharding_strategy is not None:
            return self.data_parallel_sharding_strategy
        return "optim" if self.use_distributed_optimizer else "no_shard"


@dataclass(frozen=True)
class TrainConfig:
    micro_batch_size: int = 8
    """Samples per microbatch on one data-parallel rank."""
    global_batch_size: int = 16
    """Samples per optimizer step over all dp ranks; a multiple of micro_batch_size * dp."""
    seq_length: int = 128
    """Tokens per sample; at most the model's block_size."""
    train_iters: int = 100
    """Optimizer steps to run."""
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 1e-4
    """Learning rate at the end of decay."""
    lr_warmup_iters: int = 10
    """Linear warmup from 0 to lr over this many steps."""
    lr_decay_iters: int | None = None
    """Steps over which lr decays to min_lr; None = train_iters."""
    lr_decay_style: str = "cosine"
    """cosine, linear or constant."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    weight_decay: float = 0.1
    """Decoupled (AdamW) decay on matmul weights; none on biases, LayerNorm and embeddings."""
    adam_beta1: float = 0.9
    """AdamW first-moment decay."""
    adam_beta2: float = 0.95
    """AdamW second-moment decay."""
    adam_eps: float = 1e-8
    """AdamW denominator epsilon."""
    seed: int = 1234
    """Seeds initial weights and data order; the same seed gives the same run on every layout."""
    eval_interval: int = 50
    """Run validation every this many steps (and at the end); 0 disables it."""
    eval_iters: int = 4
    """Global batches per validation."""
    bf16: bool = False
    """bf16 weights and activations; fp32 main weights, gradient accumulation and reduction."""
    fp16: bool = False
    """fp16 weights and activations with dynamic loss scaling; fp32 main weights and gradients."""
    initial_loss_scale: float = 2.0 ** 32
    """fp16: the first loss scale."""
    min_loss_scale: float = 1.0
    """fp16: the scale never drops below this."""
    loss_scale_window: int = 1000
    """fp16: double the scale after this many steps without overflow."""
    hysteresis: int = 2
    """fp16: overflows tolerated before the scale is halved."""
    compile: bool = False
    """Compile every graph with Inductor; without it the same graphs run as FX code."""
    cuda_graphs: bool | None = None
    """Capture the steady-state iteration once and replay it as a CUDA graph; None = on with --compile on CUDA."""
    recompute_activations: bool = False
    """Recompute the forward in backward instead of saving activations (full recompute; saves memory)."""
    check_for_nan_in_loss_and_grad: bool = True
    """Stop every rank when a loss or gradient norm is NaN or inf (fp16 skipped steps aside), and never
    save weights that are."""


@dataclass(frozen=True)
class LogConfig:
    log_interval: int = 1
    """Print a console line every this many steps."""
    run_dir: str = "runs/latest"
    """metrics.jsonl and the default TensorBoard folder go here."""
    tensorboard_dir: str | None = None
    """TensorBoard event files; None = RUN_DIR/tensorboard."""
    dump_graphs: str | None = None
    """Write each rank's program after every step of the compiler to this folder."""
    dump_schedule: bool = False
    """Print every rank's instruction list and write RUN_DIR/schedule.txt and RUN_DIR/schedule.svg (timeline)."""


@dataclass(frozen=True)
class CheckpointConfig:
    save: str | None = None
    """Save checkpoints here (iter_0000100/, latest_checkpointed_iteration.txt): at the end, every save_interval."""
    load: str | None = None
    """Resume from this folder's latest checkpoint, saved with any layout; none there = start from iteration 0."""
    save_interval: int | None = None
    """Save every this many iterations (needs --save); None = only at the end of training."""
    exit_interval: int | None = None
    """Save (with --save) and exit when the iteration is a multiple of this (Megatron's meaning)."""
    exit_signal_handler: bool = False
    """On SIGTERM, every rank finishes the iteration, saves to --save and exits 143 (Megatron's flag)."""


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    @property
    def mesh_sizes(self) -> dict[str, int]:
        """Size per mesh axis (gcompile.axes)."""
        p = self.parallel
        sizes = {"tp": p.tp, "cp": p.cp, "dp": p.dp, "pp": p.pp}
        if p.data_parallel_shard_size not in (None, p.dp):  # HSDP: axes folded into dp (no ranks of their own)
            sizes.update(dp_shard=p.data_parallel_shard_size, dp_replicate=p.dp // p.data_parallel_shard_size)
        if p.ep > 1:  # expert parallel: folded into dp x cp, the edp groups across the ep groups
            sizes.update(ep=p.ep, edp=p.dp * p.cp // p.ep)
        return sizes

    @property
    def model_spec(self):
        """The ModelSpec of the `[model]` section's model, by its config's type (imports torch)."""
        return spec_of(self.model)

    @property
    def tp_plan(self) -> tuple[str, ...]:
        """The tensor-parallel plan in force: parallel.tp_plan, or the model's default when it is empty."""
        return self.parallel.tp_plan or self.model_spec.tp_plan

    @property
    def world_size(self) -> int:
        p = self.parallel
        return p.tp * p.cp * p.dp * p.pp

    @property
    def param_dtype(self) -> "torch.dtype":
        import torch  # here, not at the top: flags and --help are read without torch
        return torch.bfloat16 if self.train.bf16 else torch.float16 if self.train.fp16 else torch.float32

    @property
    def bucket_size(self) -> int:
        return self.parallel.ddp_bucket_size or max(40_000_000, 1_000_000 * self.parallel.dp)

    @property
    def num_microbatches(self) -> int:
        """Microbatches per step on one dp rank (Megatron's get_num_microbatches)."""
        return self.train.global_batch_size // (self.train.micro_batch_size * self.parallel.dp)

    def without(self, unread: dict[str, tuple[str, ...]]) -> "RunConfig":
        """This config as a cache key for work that does not read `unread` (section -> field names): blanked."""
        return dataclasses.replace(self, **{section: dataclasses.replace(getattr(self, section),
                                                                         **dict.fromkeys(names))
                                            for section, names in unread.items()})


SECTIONS = {f.name: f.type for f in fields(RunConfig)}

MEGATRON_ALIASES = {
    "num-layers": "n-layer",
    "hidden-size": "n-embd",
    "num-attention-heads": "n-head",
    "max-position-embeddings": "block-size",
    "tensor-model-parallel-size": "tp",
    "pipeline-model-parallel-size": "pp",
    "data-parallel-size": "dp",
    "context-parallel-size": "cp",
    "expert-model-parallel-size": "ep",
    "virtual-pipeline-model-parallel-size": "virtual-pipeline-size",
    "num-query-groups": "n-kv-head",
    "rotary-base": "rope-theta",
    "norm-epsilon": "norm-eps",
}
MEGATRON_HERE = {
    "recompute-granularity": "--recompute-activations recomputes each stage's whole forward (Megatron's full); "
                             "without it the partitioner already recomputes the cheap ops (as selective does)",
    "recompute-method": "--recompute-activations recomputes each stage's whole forward",
    "recompute-num-layers": "--recompute-activations recomputes each stage's whole forward",
    "decoder-first-pipeline-num-layers": "--pipeline-layers gives every stage's layers (--pipeline-layers 3,1)",
    "decoder-last-pipeline-num-layers": "--pipeline-layers gives every stage's layers (--pipeline-layers 1,3)",
    "hierarchical-context-parallel-sizes": "hierarchical (a2a+p2p) context parallel is not built; --cp-comm-type "
                                           "is p2p, a2a or all_gather",
    "moe-ffn-hidden-size": "each expert is the model's MLP, --ffn-hidden-size wide",
    "group-query-attention": "attention is grouped wherever --n-kv-head (--num-query-groups) is below --n-head",
    "untie-embeddings-and-output-weights": "give --tie-word-embeddings false",
    "swiglu": "the Llama models' MLP is SwiGLU (--arch llama); gpt2's --activation is gelu or gelu_tanh",
    "attention-dropout": "--dropout sets every dropout",
    "hidden-dropout": "--dropout sets every dropout",
}
"""Megatron-LM flags with no flag of that name here, and what does their work."""


def canonical_flag(flag: str) -> str:
    """A flag by gcompile's name for it: Megatron's spelling (--context-parallel-size) as --cp."""
    return f"--{MEGATRON_ALIASES.get(flag.removeprefix('--'), flag.removeprefix('--'))}"


def _flag(name: str) -> str:
    return name.replace("_", "-")


def field_docs(cls) -> dict[str, str]:
    """The docstring under each field of a dataclass and of the dataclasses it extends: the --help text of
    its flag."""
    docs = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, after in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and \
                    isinstance(after.value, ast.Constant):
                docs[node.target.id] = after.value.value
    return docs


def _section_classes(section: str) -> list[type]:
    """The dataclasses whose fields are a section's keys: for [model], `arch` and every family's config."""
    if section == "model":
        return [ModelChoice, *CONFIGS.values()]
    return [SECTIONS[section]]


def section_fields(section: str) -> dict[str, dataclasses.Field]:
    """A section's keys -> their fields; a key several model families share comes from the first of them."""
    known = {}
    for cls in _section_classes(section):
        for f in fields(cls):
            known.setdefault(f.name, f)
    return known


def section_docs(section: str) -> dict[str, str]:
    docs = {}
    for cls in reversed(_section_classes(section)):
        docs.update(field_docs(cls))
    return docs


def _field_index() -> dict[str, tuple[str, dataclasses.Field]]:
    """Every config key by flag name -> (section, field); keys are unique across sections."""
    return {_flag(name): (section, f) for section in SECTIONS for name, f in section_fields(section).items()}


def _base_type(annotation):
    """int | None -> int; tuple[int, ...] -> tuple."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return next(a for a in typing.get_args(annotation) if a is not type(None))
    return typing.get_origin(annotation) or annotation


TOML_TYPES = {bool: "true or false", int: "an integer", float: "a number", str: "a string", tuple: "a list"}
"""What a key of each field type takes, in TOML's words."""


def _parses(annotation) -> bool:
    """Whether `_coerce` reads a value of this field type: a bare `tuple` has no item type to parse "3,4" into
    (an IndexError), a `list` made "3,4" its characters."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        others = [a for a in typing.get_args(annotation) if a is not type(None)]
        return len(others) == 1 and _parses(others[0])
    if typing.get_origin(annotation) is tuple:
        items = typing.get_args(annotation)
        return len(items) == 2 and items[1] is Ellipsis and _parses(items[0])
    return annotation in TOML_TYPES and annotation is not tuple


def _coerce(value, annotation, key: str):
    """A TOML or CLI value as the field's type; strings from the CLI are parsed."""
    kind = _base_type(annotation)
    if value is None or (isinstance(value, str) and value.lower() == "none" and kind is not str):
        return None
    if isinstance(value, bool) != (kind is bool) and not isinstance(value, str):  # TOML `n_layer = true`
        shown = str(value).lower() if isinstance(value, bool) else repr(value)
        raise ConfigError(f"{key} = {shown}, but it takes {TOML_TYPES[kind]}")
    try:
        if kind is bool:
            if isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(value)
                return value.lower() in ("true", "1")
            return value
        if kind is tuple:  # "a, b", or a list of such (a flag given more than once; a TOML list)
            given = [value] if isinstance(value, str) else value
            pieces = [piece for item in given for piece in (item.split(",") if isinstance(item, str) else [item])]
            items = [p.strip() if isinstance(p, str) else p for p in pieces]  # a TOML list of ints too: [3, 1]
            items = [item for item in items if item != ""]
            return tuple(_coerce(v, typing.get_args(annotation)[0], key) for v in items)
        if kind is str and isinstance(value, list):  # a TOML list, or the words after a flag of nargs="+"
            if not all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value):
                raise ValueError(value)  # a list in the list, a table
            return shlex.join(str(v) for v in value) if value != [""] else ""  # "" stays "": validate refuses it
        if kind is str and not isinstance(value, str):  # TOML's data_path = 5
            raise ValueError(value)
        if kind is int and isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        return kind(value)
    except ConfigError:  # an item of a tuple
        raise
    except (TypeError, ValueError):
        choices = " (true or false)" if kind is bool else ""
        raise ConfigError(f"{key}={value!r} is not a valid {kind.__name__}{choices}") from None


def load_toml(path: str) -> dict[str, dict]:
    """A preset as {section: {field: value}}; unknown sections or keys are errors."""
    if os.path.exists(path) and not os.path.isdir(path) and not os.path.isfile(path):
        raise ConfigError(f"--config {path} is not a regular file (a device or a pipe); name a TOML file")
    if os.path.isfile(path) and os.path.getsize(path) > MAX_PRESET_BYTES:
        raise ConfigError(f"--config {path} holds {os.path.getsize(path):,} bytes, not a preset (at most "
                          f"{MAX_PRESET_BYTES:,}); name a TOML file such as configs/tiny.toml")
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"--config {path} is a folder; name a TOML file in it (configs/*.toml)") from None
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"--config {path}: not UTF-8 text (byte {e.start}); a preset is a TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: not valid TOML ({e})") from None
    overrides, wrong = {}, []
    for section, values in raw.items():
        if section not in SECTIONS or not isinstance(values, dict):
            raise ConfigError(f"{path}: unknown section [{section}]; known: {', '.join(SECTIONS)}")
        if section == "model" and "arch" in values:
            _family(values["arch"])  # a user's model brings its own keys
        known = section_fields(section)
        for key, value in values.items():
            if key not in known:
                raise ConfigError(f"{path}: unknown key {key!r} in [{section}]; known: {', '.join(known)}")
            try:
                overrides.setdefault(section, {})[key] = _coerce(value, known[key].type, f"[{section}] {key}")
            except ConfigError as e:  # every value of the wrong type, all at once
                wrong += e.reasons
    if wrong:
        raise ConfigError(*wrong)
    return overrides


def build_config(overrides: dict[str, dict]) -> RunConfig:
    """RunConfig from {section: {field: value}} over the defaults, validated."""
    sections = {name: cls(**overrides.get(name, {})) for name, cls in SECTIONS.items() if name != "model"}
    sections["model"] = _model_config(overrides.get("model", {}))
    sections["parallel"] = _derive_interleaving(sections["parallel"], sections["model"].n_layer,
                                                given=overrides.get("parallel", {}))
    config = RunConfig(**sections)
    validate(config)
    return config


MAX_PRESET_BYTES = 1 << 20
"""A TOML preset is a few hundred bytes; one of a megabyte is some other file, read whole otherwise."""
MAX_LAYERS = 10_000
"""Checks below build the model on meta tensors, about a millisecond a layer: a typo of n_layer=100000000 would
hang there before any line is printed. The deepest models trained have some hundred and fifty."""
COMPILER_READS = ("n_layer", "block_size", "vocab_size")
"""Model config fields outside the model itself reads: blocks to split over pipeline stages, the longest
sequence, the largest token id."""


def _family(arch: str) -> str:
    """The registered family `arch` names; a user's model (`pkg.module:spec`, `file.py:spec`) is loaded
    and registered first."""
    if arch in CONFIGS:
        return arch
    if ":" in arch:
        taken = {n: section for section in SECTIONS if section != "model" for n in section_fields(section)}
        try:
            name = register_user_model(arch, reserved={**taken, **dict.fromkeys(RUN_FLAGS, "run_gpt.py")})
        except UserCodeError as e:
            raise ConfigError(str(e)) from None
        if unread := [f"{f.name}: {getattr(f.type, '__name__', f.type)}" for f in fields(CONFIGS[name])
                      if not _parses(f.type)]:
            raise ConfigError(f"model {arch!r}: its config's {', '.join(unread)} cannot be read from a flag or a "
                              f"[model] key, which take bool, int, float, str, tuple[int, ...] (or of those), or "
                              f"X | None of them; write it as one")
        return name
    raise ConfigError(f"arch={arch!r} is not a model family here; known: {', '.join(CONFIGS)}, or your own "
                      f"model as pkg.module:spec or path/to/file.py:spec")


def _model_config(values: dict):
    """The config of the family `arch` names, from the [model] keys; keys of another family are an error."""
    values = dict(values)
    arch = _family(values.pop("arch", DEFAULT_MODEL))
    own = {f.name for f in fields(CONFIGS[arch])}
    missing = [name for name in COMPILER_READS if name not in own]
    if missing:
        raise ConfigError(f"arch={arch}: its config has no {', '.join(missing)}; every model config needs "
                          f"{', '.join(COMPILER_READS)} (the compiler and the data read them)")
    foreign = [key for key in values if key not in own]
    if foreign:
        raise ConfigError(f"{', '.join(foreign)}: not a key of arch={arch} (its keys: {', '.join(sorted(own))}); "
                          f"drop {'them' if len(foreign) > 1 else 'it'} or choose the arch that has "
                          f"{'them' if len(foreign) > 1 else 'it'}")
    return CONFIGS[arch](**values)


def _derive_interleaving(p: ParallelConfig, n_layer: int, given: dict) -> ParallelConfig:
    """Megatron's spelling of vpp (layers per virtual stage) turned into vpp; interleaved as the schedule
    when vpp > 1 and none was named. Sizes that do not fit are left for `validate` to report."""
    per = p.num_layers_per_virtual_pipeline_stage
    if per and "virtual_pipeline_size" not in given and p.pp >= 1 and n_layer % (p.pp * per) == 0:
        p = dataclasses.replace(p, virtual_pipeline_size=n_layer // (p.pp * per))
    if p.virtual_pipeline_size > 1 and "pipeline_schedule" not in given:
        p = dataclasses.replace(p, pipeline_schedule="interleaved")
    return p


class _ArgumentParser(ArgumentParser):
    def error(self, message):
        raise ConfigError(self.explain(message))

    def explain(self, message: str) -> str:
        """Megatron's flags that have no namesake here say what does their work; others as every parser."""
        if not message.startswith(UNRECOGNIZED):
            return super().explain(message)
        given = []  # each flag with the values after it
        for word in message.removeprefix(UNRECOGNIZED).split():
            if word.startswith("--") or not given:
                given.append([word])
            else:
                given[-1].append(word)
        named = [(flag[0].split("=")[0].removeprefix("--"), flag) for flag in given]
        here = [f"--{name} is Megatron's: {MEGATRON_HERE[name]}" for name, _ in named if name in MEGATRON_HERE]
        others = [word for name, flag in named if name not in MEGATRON_HERE for word in flag]
        return "; ".join(here + ([super().explain(UNRECOGNIZED + " ".join(others))] if others else []))


RUN_FLAGS = ("config", "dump_only", "check_plan", "auto_layout", "world_size", "machine", "help")
"""run_gpt.py's flags that are no config key (`parser`)."""


class _GivenOnce(argparse.Action):
    """A flag whose second value would replace the first whole, unseen: a second --config dropped the first
    file's model and layout without a word."""

    def __call__(self, parser, namespace, value, option_string=None):
        if hasattr(namespace, self.dest):
            parser.error(f"{option_string} given twice ({getattr(namespace, self.dest)}, then {value}): one file "
                         f"holds a run's settings; put them in one, or give the second's keys as flags")
        setattr(namespace, self.dest, value)


def parser() -> argparse.ArgumentParser:
    p = _ArgumentParser(
        prog="run_gpt.py",
        description="Train a GPT: one single-device program compiled into one program per rank.",
        argument_default=argparse.SUPPRESS,
    )
    p.add_argument("--config", action=_GivenOnce, help="TOML preset (configs/*.toml); flags override its keys")
    p.add_argument("--dump-only", action="store_true",
                   help="build and dump each distinct program in this one process (ranks that differ only in dp "
                        "share one; DIR/index.txt names them), without training (needs --dump-graphs)")
    p.add_argument("--check-plan", action="store_true",
                   help="build each distinct program in this one process (ranks that differ only in dp share one), "
                        "check the plan, print it, and exit")
    p.add_argument("--auto-layout", action="store_true",
                   help="choose tp, pp, dp, cp, schedule, micro-batch size and sharding for --world-size ranks with "
                        "the planner (python -m gcompile.plan), then train with its first choice")
    p.add_argument("--world-size", type=int, help="ranks to plan for with --auto-layout")
    p.add_argument("--machine", help="machine file the predictions read; without it, this machine's own, made by "
                                     "python -m gcompile.calibrate")
    docs = {section: section_docs(section) for section in SECTIONS}
    for flag, (section, f) in _field_index().items():
        aliases = [f"--{a}" for a, target in MEGATRON_ALIASES.items() if target == flag]
        help_text = f"[{section}] {docs[section].get(f.name, '')} (default: {_show_default(f)})"
        if _base_type(f.type) is bool:
            p.add_argument(f"--{flag}", *aliases, dest=f.name, nargs="?", const="true", metavar="BOOL",
                           help=help_text)
        elif f.type == tuple[str, ...]:  # given more than once, the entries add up (--passes A --passes B)
            p.add_argument(f"--{flag}", *aliases, dest=f.name, metavar=f.name.upper(), help=help_text,
                           action="append")
        elif f.metadata.get("nargs") == "+":  # given more than once, the words add up (a blend in two flags)
            p.add_argument(f"--{flag}", *aliases, dest=f.name, metavar=f.name.upper(), help=help_text,
                           nargs="+", action="extend")
        else:
            p.add_argument(f"--{flag}", *aliases, dest=f.name, metavar=f.name.upper(), help=help_text)
    return p


def _show_default(f: dataclasses.Field) -> str:
    """A field's default as it would be written on the command line (argparse's %(default)s would show
    SUPPRESS: flags default to absent so that a preset's keys are not overridden)."""
    value = f.default_factory() if f.default is dataclasses.MISSING else f.default
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return ",".join(map(str, value)) or "empty"
    return "none" if value is None else str(value)


def answer_help(argv: list[str]) -> None:
    """Print --help and exit when argv asks for it (by argparse's own rules); anything else, including
    a bad flag, is left for `parse_args`. Callers ask before importing torch, which takes seconds; only a help
    for your own model (--arch file.py:SPEC) loads it first, so that its config's fields are listed too."""
    with contextlib.suppress(ConfigError):
        if "-h" in argv or "--help" in argv:
            _load_named_model(argv)
        parser().parse_known_args(argv)


def _load_named_model(argv: list[str]) -> None:
    """Register the user's model that --arch (or the preset's [model] arch) names before the flags are read:
    its config's fields are flags too."""
    early = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    early.add_argument("--arch")
    early.add_argument("--config")
    known, _ = early.parse_known_args(argv)
    arch = known.arch or known.config and load_toml(known.config).get("model", {}).get("arch")
    if isinstance(arch, str) and ":" in arch:
        _family(arch)


PLANNED_FROM = {"parallel": dict(tp=1, cp=1, pp=1, dp=1, ep=1, pipeline_schedule="1f1b", virtual_pipeline_size=1,
                                 num_layers_per_virtual_pipeline_stage=None,
                                 data_parallel_sharding_strategy="no_shard", use_distributed_optimizer=False),
                "train": dict(micro_batch_size=1)}
"""The keys a layout is made of, at values any run can take: the planner starts from these and sets its own,
whatever a preset or a flag said."""


def parse_args(argv: list[str], planned: bool = False) -> tuple[RunConfig, argparse.Namespace]:
    """The run config from `--config` and flags, and the flags that are not config keys. `planned` (or
    --auto-layout): the config the planner starts from, its layout at PLANNED_FROM (a preset's pp and a flag's
    dp are replaced, not checked)."""
    _load_named_model(argv)
    args = parser().parse_args(argv)
    overrides = load_toml(args.config) if "config" in args else {}
    overrides_of_preset = {section: dict(values) for section, values in overrides.items()}
    index = {f.name: (section, f) for section, f in _field_index().values()}
    for name, value in vars(args).items():
        if name in index:
            section, f = index[name]
            overrides.setdefault(section, {})[name] = _coerce(value, f.type, f"--{_flag(name)}")
    extras = argparse.Namespace(dump_only=getattr(args, "dump_only", False),
                                check_plan=getattr(args, "check_plan", False),
                                auto_layout=getattr(args, "auto_layout", False),
                                world_size=getattr(args, "world_size", None), machine=getattr(args, "machine", None),
                                preset=overrides_of_preset)
    if planned or extras.auto_layout:
        for section, values in PLANNED_FROM.items():
            overrides.setdefault(section, {}).update(values)
    if extras.world_size is not None and not extras.auto_layout:
        raise ConfigError("--world-size is what --auto-layout plans for; give both, or give --tp, --pp, --dp")
    if extras.machine is not None and not (extras.auto_layout or extras.check_plan or extras.dump_only):
        raise ConfigError("--machine is what --check-plan, --dump-only and --auto-layout predict with; a run "
                          "trains without it: give one of those, or leave --machine out")
    return build_config(overrides), extras


def idle_flags(config: RunConfig) -> list[str]:
    """A line for each setting that does nothing in this layout: asked for, so said, but no error."""
    p = config.parallel
    idle = []
    if p.sequence_parallel and p.tp == 1:
        idle.append("--sequence-parallel does nothing at tp 1 (it shards the sequence over tp ranks)")
    if p.pipeline_schedule != "1f1b" and p.pp == 1:
        idle.append(f"--pipeline-schedule {p.pipeline_schedule} does nothing at pp 1 (it orders a pipeline's "
                    f"micro-batches over its stages)")
    if p.sharding in ("optim", "optim_grads") and p.dp * p.cp == 1:
        mixed = config.train.bf16 or config.train.fp16  # which keep fp32 main weights apart anyway
        idle.append(f"data-parallel sharding {p.sharding} shards nothing at dp 1 (it cuts the optimizer's states "
                    f"over dp ranks){'' if mixed else ', and keeps fp32 main weights apart from the model weights'}")
    if not config.train.fp16:
        defaults = TrainConfig()
        idle += [f"--{_flag(name)} does nothing without --fp16 (only fp16 scales the loss)"
                 for name in FP16_ONLY if getattr(config.train, name) != getattr(defaults, name)]
    if isinstance(config.model, MoEConfig):
        idle += idle_settings(config.model)
    return idle


def validate(config: RunConfig) -> None:
    """Every reason this config cannot run, all at once, each naming its factors."""
    m, p, t = config.model, config.parallel, config.train
    errors = []

    def positive(section, obj, *names):
        for name in names:
            if getattr(obj, name) < 1:
                errors.append(f"{_flag(name)}={getattr(obj, name)} must be at least 1")

    positive("model", m, *COMPILER_READS)
    positive("parallel", p, "tp", "pp", "dp", "cp", "ep", "virtual_pipeline_size", "make_vocab_size_divisible_by")
    positive("train", t, "micro_batch_size", "global_batch_size", "seq_length", "train_iters")
    positive("log", config.log, "log_interval")
    if m.n_layer > MAX_LAYERS:
        errors.append(f"n_layer={m.n_layer} is more than {MAX_LAYERS} layers; lower --n-layer")
    if not errors:  # the model's own rules (GPT-2's dropout range) before the plan below builds the model
        errors += config.model_spec.config_errors(m)
    if errors:
        raise ConfigError(*errors)
    errors += _number_errors(config)
    errors += _path_errors(config)
    most = max(m.vocab_size, ParallelConfig.make_vocab_size_divisible_by)  # the default serves a vocab of 65 too
    if p.make_vocab_size_divisible_by > most:  # a typo of a huge one overflowed inside torch
        errors.append(f"make-vocab-size-divisible-by={p.make_vocab_size_divisible_by} is more than the vocabulary's "
                      f"{m.vocab_size} ids: under tp the vocabulary is padded to a multiple of it times tp; give at "
                      f"most {most} (Megatron's default is 128)")
    if t.seq_length > m.block_size:
        errors.append(f"seq_length={t.seq_length} is longer than the model's block_size={m.block_size}; "
                      f"raise --block-size or lower --seq-length")
    per_step = t.micro_batch_size * p.dp
    if t.global_batch_size % per_step:
        errors.append(f"global_batch_size={t.global_batch_size} is not divisible by "
                      f"micro_batch_size={t.micro_batch_size} * dp={p.dp} = {per_step}; make --global-batch-size a "
                      f"multiple of {per_step}")
    if t.lr_decay_style not in ("cosine", "linear", "constant"):
        errors.append(f"lr_decay_style={t.lr_decay_style!r} must be cosine, linear or constant")
    if t.bf16 and t.fp16:
        errors.append("bf16 and fp16 are both set; choose one")
    c = config.checkpoint
    for name in ("save_interval", "exit_interval"):
        if getattr(c, name) is not None and getattr(c, name) < 1:
            errors.append(f"{_flag(name)}={getattr(c, name)} must be at least 1")
    if c.save_interval is not None and c.save is None:
        errors.append(f"save-interval={c.save_interval} needs --save DIR")
    if c.exit_signal_handler and c.save is None:
        errors.append("exit-signal-handler saves a checkpoint on SIGTERM and needs --save DIR")
    if not 0 < p.distributed_timeout_minutes <= MAX_TIMEOUT_S / 60:
        errors.append(f"distributed-timeout-minutes={p.distributed_timeout_minutes} must be positive and at most "
                      f"{MAX_TIMEOUT_S // 60:,} (about {MAX_TIMEOUT_S // 86400} days)")
    if not 0 <= p.hang_timeout_s <= MAX_TIMEOUT_S:
        errors.append(f"hang-timeout-s={p.hang_timeout_s} must be 0 (no watchdog) or positive, at most "
                      f"{MAX_TIMEOUT_S:,} (about {MAX_TIMEOUT_S // 86400} days)")
    elif 0 < p.hang_timeout_s < 1:  # it would call a healthy run hung while it builds
        errors.append(f"hang-timeout-s={p.hang_timeout_s}: the watchdog looks once a second; give 0 (no watchdog) "
                      f"or at least 1")
    if p.ddp_bucket_size is not None and p.ddp_bucket_size < 1:
        errors.append(f"ddp_bucket_size={p.ddp_bucket_size} must be at least 1 element")
    if t.min_lr > t.lr:
        errors.append(f"min_lr={t.min_lr} is above lr={t.lr}")
    if p.tp_comm_backend not in TP_COMM_BACKENDS:
        errors.append(f"tp_comm_backend={p.tp_comm_backend!r} must be {', '.join(TP_COMM_BACKENDS[:-1])} "
                      f"or {TP_COMM_BACKENDS[-1]}")
    if p.pipeline_schedule not in SCHEDULES:
        errors.append(f"pipeline_schedule={p.pipeline_schedule!r} must be {', '.join(SCHEDULES[:-1])} "
                      f"or {SCHEDULES[-1]}")
    from gcompile.tp_plan import plan_errors  # builds the model on meta: torch, which --help does without
    # an entry that matches no module is a typo where the user wrote the plan: --tp-plan, or their model's own
    errors += plan_errors(config.model_spec, m, config.tp_plan, p.tp,
                          written=bool(p.tp_plan) or is_users(m) and p.tp > 1)
    if p.sequence_parallel and t.seq_length % p.tp:
        errors.append(f"seq_length={t.seq_length} is not divisible by tp={p.tp} (sequence_parallel)")
    if p.overlap_grad_reduce and p.pipeline_schedule in SPLIT_BACKWARD:
        errors.append(f"--overlap-grad-reduce and --pipeline-schedule {p.pipeline_schedule} do not combine yet "
                      f"(the last backward is split in two); drop one of them")
    strategy = p.data_parallel_sharding_strategy
    if strategy is not None and strategy not in SHARDING_STRATEGIES:
        errors.append(f"data_parallel_sharding_strategy={strategy!r} must be {', '.join(SHARDING_STRATEGIES[:-1])} "
                      f"or {SHARDING_STRATEGIES[-1]}")
    elif strategy == "no_shard" and p.use_distributed_optimizer:
        errors.append("use_distributed_optimizer (= sharding strategy optim) disagrees with "
                      "data_parallel_sharding_strategy=no_shard; give one of them")
    if p.sharding == "optim_grads" and p.pipeline_schedule in SPLIT_BACKWARD and p.dp * p.cp > 1:
        errors.append(f"data_parallel_sharding_strategy optim_grads and --pipeline-schedule {p.pipeline_schedule} "
                      f"do not combine yet (the reduce-scatter runs in the last backward, which W splits); "
                      f"use optim or another schedule")
    if p.data_parallel_shard_size is not None:
        if p.sharding != "optim_grads_params":
            errors.append(f"data_parallel_shard_size (HSDP) shards the weights and needs "
                          f"--data-parallel-sharding-strategy optim_grads_params (this run: {p.sharding})")
        elif p.data_parallel_shard_size < 1 or p.dp % p.data_parallel_shard_size:
            errors.append(f"data_parallel_shard_size={p.data_parallel_shard_size} does not divide dp={p.dp}; "
                          f"give a divisor of dp")
        elif p.data_parallel_shard_size == 1 < p.dp:
            errors.append("data_parallel_shard_size=1 shards nothing; give 2 or more, or use "
                          "--data-parallel-sharding-strategy no_shard")
    if p.overlap_grad_reduce and p.dp == 1:
        errors.append("overlap_grad_reduce overlaps the dp reduction with backward and needs dp > 1 (dp=1)")
    elif t.global_batch_size % per_step == 0 and p.pipeline_schedule in SCHEDULES:  # whole microbatches
        try:
            check_sizes(p.pipeline_schedule, p.pp, p.virtual_pipeline_size, config.num_microbatches)
        except ScheduleError as e:
            where = (f", where num_microbatches = global_batch_size {t.global_batch_size} / "
                     f"(micro_batch_size {t.micro_batch_size} * dp {p.dp})") if "num_microbatches" in str(e) else ""
            errors.append(f"{e}{where}")
    per = p.num_layers_per_virtual_pipeline_stage
    if per is not None and per * p.pp * p.virtual_pipeline_size != m.n_layer:
        errors.append(f"num_layers_per_virtual_pipeline_stage={per} * pp {p.pp} * vpp {p.virtual_pipeline_size} "
                      f"= {per * p.pp * p.virtual_pipeline_size} is not n_layer={m.n_layer}")
    else:
        try:
            stage_layers(m.n_layer, p.pp, p.virtual_pipeline_size, p.pipeline_layers)
        except ConfigError as e:
            errors.append(str(e))
    for entry in p.passes:
        errors += _user_pass_errors(entry)
    errors += _context_parallel_errors(config)
    errors += _experts_errors(config)
    if p.memory_budget_gb is not None and p.memory_budget_gb <= 0:
        errors.append(f"memory_budget_gb={p.memory_budget_gb} must be positive")
    if errors:
        raise ConfigError(*errors)


def _context_parallel_errors(config: RunConfig) -> list[str]:
    p, seq = config.parallel, config.train.seq_length
    errors = []
    if p.cp_comm_type not in CP_COMM_TYPES:
        errors.append(f"cp_comm_type={p.cp_comm_type!r} must be {', '.join(CP_COMM_TYPES[:-1])} or "
                      f"{CP_COMM_TYPES[-1]}")
    if p.cp == 1:
        return errors
    if seq % (2 * p.cp):
        errors.append(f"seq_length={seq} is not divisible by 2 * cp={p.cp} = {2 * p.cp} (context parallel cuts "
                      f"each sample into 2 * cp chunks); give a multiple of {2 * p.cp}")
    elif p.sequence_parallel and seq // p.cp % p.tp:
        errors.append(f"seq_length={seq} / cp={p.cp} is not divisible by tp={p.tp} (sequence_parallel cuts each cp "
                      f"rank's tokens over tp); give a multiple of {math.lcm(2 * p.cp, p.cp * p.tp)}")
    if p.sharding == "optim_grads_params" and p.data_parallel_shard_size not in (None, p.dp):
        errors.append("HSDP (data_parallel_shard_size) and cp > 1 do not combine yet: their gradient shards would "
                      "need one all-reduce over dp_replicate x cp; drop one of them")
    if p.sharding == "optim_grads_params" and p.dp == 1:  # its pass shards over dp alone: cp's gradients went
        # unsummed, and the run trained on each cp rank's tokens
        errors.append(f"data_parallel_sharding_strategy optim_grads_params shards the weights over dp, which is 1 "
                      f"(cp={p.cp} ranks hold them whole); use no_shard at dp 1, or dp above 1")
    return errors


def _experts_errors(config: RunConfig) -> list[str]:
    """Layouts a mixture of experts does not run under yet, named before capture rather than at the pass."""
    p = config.parallel
    if p.expert_tensor_parallel_size != 1:
        return [f"expert_tensor_parallel_size={p.expert_tensor_parallel_size}: only 1 is built (every tp rank holds "
                f"its experts whole); drop --expert-tensor-parallel-size, or split the experts with --ep"]
    if not (isinstance(config.model, MoEConfig) and config.model.num_experts):
        return [f"ep={p.ep} splits the experts, but the model has none; give --num-experts (a multiple of "
                f"{p.ep}) or drop --ep"] if p.ep > 1 else []
    experts = config.model.num_experts
    if experts % p.ep:
        fits = [str(d) for d in range(1, experts + 1) if experts % d == 0 and p.dp * p.cp % d == 0]
        return [f"ep={p.ep} does not divide num_experts={experts} (each ep rank holds num_experts / ep of "
                f"them); give an ep that divides both it and dp x cp = {p.dp * p.cp}: {', '.join(fits)}"]
    if p.dp * p.cp % p.ep:
        return [f"ep={p.ep} does not divide dp x cp = {p.dp * p.cp} (expert parallel folds into the data-parallel "
                f"ranks, as in Megatron-Core); give a dp that is a multiple of {p.ep}"]
    if p.ep > 1 and p.data_parallel_shard_size not in (None, p.dp):
        return [f"ep={p.ep} and HSDP (data_parallel_shard_size) do not combine yet: the experts would need "
                f"replica groups of their own; drop --data-parallel-shard-size, or --ep"]
    return []


def _number_errors(config: RunConfig) -> list[str]:
    """Numbers out of their range that would otherwise train silently wrong (a NaN lr) or fail late."""
    t, d = config.train, config.data
    errors = [f"{_flag(f.name)}={getattr(section, f.name)} must be a finite number"
              for section in (config.model, config.parallel, t) for f in fields(section)
              if _base_type(f.type) is float and getattr(section, f.name) is not None
              and not math.isfinite(getattr(section, f.name))]
    errors += [f"{_flag(name)}={getattr(t, name)} must not be negative"
               for name in ("lr", "min_lr", "clip_grad", "weight_decay", "adam_eps", "lr_warmup_iters",
                            "eval_interval")
               if getattr(t, name) < 0]
    errors += [f"{_flag(name)}={getattr(t, name)} must be above 0"
               for name in ("initial_loss_scale", "min_loss_scale") if not getattr(t, name) > 0]
    if 0 < t.initial_loss_scale < t.min_loss_scale:
        errors.append(f"min-loss-scale={t.min_loss_scale} is above initial-loss-scale={t.initial_loss_scale}; "
                      f"lower --min-loss-scale or raise --initial-loss-scale")
    errors += [f"{_flag(name)}={getattr(t, name)} must be at least 1"
               for name in ("loss_scale_window", "hysteresis") if getattr(t, name) < 1]
    if t.lr_decay_iters is not None and t.lr_decay_style != "constant" and 1 <= t.lr_decay_iters <= t.lr_warmup_iters:
        errors.append(f"lr-decay-iters={t.lr_decay_iters} must be above lr-warmup-iters={t.lr_warmup_iters} "
                      f"(decay follows warmup, as in Megatron); raise --lr-decay-iters or lower --lr-warmup-iters")
    errors += [f"{_flag(name)}={getattr(t, name)} must be in [0, 1)" for name in ("adam_beta1", "adam_beta2")
               if not 0 <= getattr(t, name) < 1]
    if t.lr_decay_iters is not None and t.lr_decay_iters < 1:
        errors.append(f"lr-decay-iters={t.lr_decay_iters} must be at least 1 (leave it out to decay over train_iters)")
    if t.eval_interval > 0 and t.eval_iters < 1:
        errors.append(f"eval-iters={t.eval_iters} must be at least 1 while evaluation is on; "
                      f"turn it off with --eval-interval 0")
    if not 0 <= t.seed < 2 ** 63:
        errors.append(f"seed={t.seed} must be in [0, 2^63)")
    try:
        parse_split(d.split)
    except DataError as e:
        errors.append(str(e))
    return errors


def _path_errors(config: RunConfig) -> list[str]:
    """Paths given empty (which would silently mean the default), and folders a run writes with a file in the way."""
    folders = {"--run-dir": config.log.run_dir, "--tensorboard-dir": config.log.tensorboard_dir,
               "--dump-graphs": config.log.dump_graphs, "--cache-dir": config.data.cache_dir,
               "--save": config.checkpoint.save}
    load = config.checkpoint.load
    given = {**folders, "--data-path": config.data.data_path, "--load": load}
    errors = [f"{flag} is empty; give a path, or leave the flag out" for flag, path in given.items() if path == ""]
    errors += [e for flag, path in folders.items() if path and (e := path_error(flag, path))]
    if load and os.path.exists(load) and not os.path.isdir(load):
        errors.append(f"--load {load} is a file; give the SAVE folder a run wrote with --save")
    return errors


def _user_pass_errors(entry: str) -> list[str]:
    where, _, spec = entry.rpartition("=") if "=" in entry else ("", "", entry)
    side, _, point = where.partition(":")
    if where and (side not in ("before", "after") or point not in POINTS + ("grad_sync",)
                  or (side, point) == ("before", "capture")):
        return [f"passes entry {entry!r}: where must be before:POINT or after:POINT, POINT one of "
                f"{', '.join(POINTS)} or grad_sync (not before capture)"]
    module, _, function = spec.rpartition(":")
    if not module or not function.isidentifier():
        return [f"passes entry {entry!r}: a pass is named pkg.module:function or path/to/file.py:function"]
    return []


def stage_layers(n_layer: int, pp: int, vpp: int, explicit: tuple[int, ...] = ()) -> list[int]:
    """Transformer blocks per pipeline stage, in stage order: `explicit`, or an even split."""
    stages = pp * vpp
    if explicit:
        listed = ",".join(map(str, explicit))
        if len(explicit) != stages:
            raise ConfigError(f"pipeline_layers={listed} has {len(explicit)} entries "
                              f"for pp {pp} * vpp {vpp} = {stages} stages")
        if min(explicit) < 1:
            raise ConfigError(f"pipeline_layers={listed}: every stage needs at least one layer")
        if sum(explicit) != n_layer:
            raise ConfigError(f"pipeline_layers={listed} sums to {sum(explicit)}, not n_layer={n_layer}")
        return list(explicit)
    if n_layer % stages:
        fix = (f"use a multiple of {stages} layers or give --pipeline-layers" if n_layer > stages else
               f"use at most {counted(n_layer, 'stage')} (pp * vpp; --pipeline-layers for an uneven split) or a "
               f"multiple of {stages} layers")
        raise ConfigError(f"n_layer={n_layer} cannot be split into pp {pp} * vpp {vpp} = {stages} stages of "
                          f"whole layers; {fix}")
    return [n_layer // stages] * stages
