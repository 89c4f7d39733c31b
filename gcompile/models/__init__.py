"""The models gcompile knows, by name: each brings its ModelSpec (gcompile/models/spec.py).

The registry names where each spec lives and imports it on first use: a spec
imports torch (seconds), while a model's config class does not, so reading
flags, presets and `run_gpt.py --help` never waits for it. A user's own model
(`--arch pkg.module:spec` or `--arch path/to/file.py:spec`) is registered when
its arch is read: importing it runs the user's code, which the user asked for.
"""

import dataclasses
import typing

from gcompile.user_code import UserCodeError, load_object

from gcompile.models.gpt2_config import GPTConfig
from gcompile.models.llama_config import LlamaConfig

MODELS = {"gpt2": "gcompile.models.gpt2:GPT2", "llama": "gcompile.models.llama:LLAMA"}
"""Where each model's ModelSpec lives, by name: `module:attribute` (or `file.py:attribute`, a user's)."""
CONFIGS = {"gpt2": GPTConfig, "llama": LlamaConfig}
"""Each model's `[model]` config class (its spec's `config`), importable without torch."""
_USER_SPECS = {}
"""User models registered in this process, by name: their specs as loaded."""
DEFAULT_MODEL = "gpt2"
"""The model of the `[model]` section; its config's fields are the model flags."""


def model_spec(name: str):
    """The ModelSpec registered as `name`."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return _USER_SPECS[name] if name in _USER_SPECS else load_object(MODELS[name], "model")


def register_user_model(arch: str, reserved: dict[str, str] | None = None) -> str:
    """Load the ModelSpec (or the function returning it) that `arch` names and register it; its name.
    `reserved`: names its config's fields may not have (the run's own keys, by where they live), since the
    flag of that name sets the run's."""
    from gcompile.models.spec import ModelSpec
    from gcompile.program import BATCH_ROLES

    found = load_object(arch, "model")
    try:
        spec = found() if callable(found) and not isinstance(found, ModelSpec) else found
    except Exception as e:  # the user's function, called with nothing, as a ModelSpec's maker is
        raise UserCodeError(f"model {arch!r}: calling it for its ModelSpec raised {type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}; name a ModelSpec, or a function of no "
                            f"arguments that returns one") from None
    if not isinstance(spec, ModelSpec):
        raise UserCodeError(f"model {arch!r} is a {type(spec).__name__}, not a ModelSpec; return one, e.g. "
                            f"gcompile.models.spec.spec_with_defaults(name, Config, build, tp_plan=...)")
    if dataclasses.is_dataclass(spec.config) and not isinstance(spec.config, type):
        raise UserCodeError(f"model {arch!r}: its config is an instance of {type(spec.config).__name__}; give the "
                            f"class itself (its fields become the [model] keys, their defaults the values)")
    if not (dataclasses.is_dataclass(spec.config) and spec.config.__dataclass_params__.frozen):
        raise UserCodeError(f"model {arch!r}: its config {getattr(spec.config, '__name__', spec.config)!r} is not a "
                            f"frozen dataclass; declare it with @dataclass(frozen=True) (its fields become the "
                            f"[model] keys)")
    if bare := [f.name for f in dataclasses.fields(spec.config)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]:
        raise UserCodeError(f"model {arch!r}: its config's {', '.join(bare)} {'has' if len(bare) == 1 else 'have'} "
                            f"no default; give each field one (a [model] key or flag not given takes it)")
    _resolve_annotations(arch, spec.config)
    if isinstance(spec.tp_plan, str):  # ("blocks.*.qkv=column") without its comma: each letter was an entry
        raise UserCodeError(f"model {arch!r}: its tp_plan is the string {spec.tp_plan!r}; give a tuple of entries, "
                            f"(\"blocks.*.qkv=column\",) for one")
    roles = tuple(i.role for i in spec.example_batch(1, 1))
    if roles != BATCH_ROLES:
        raise UserCodeError(f"model {arch!r}: its example batch names forward's inputs {', '.join(roles)}; the "
                            f"passes and the runtime feed it {', '.join(BATCH_ROLES)} (token ids, next-token "
                            f"targets): leave example_batch to spec_with_defaults, or name them so")
    reserved = reserved or {}
    if clash := [f"{f.name} ({reserved[f.name]})" for f in dataclasses.fields(spec.config) if f.name in reserved]:
        raise UserCodeError(f"model {arch!r}: its config's {', '.join(clash)} {'is' if len(clash) == 1 else 'are'} "
                            f"also the run's, so its flag sets that instead; rename the field (e.g. model_"
                            f"{clash[0].split()[0]})")
    if spec.name in MODELS and MODELS[spec.name] != arch:
        raise UserCodeError(f"model {arch!r} is named {spec.name!r}, which {MODELS[spec.name]} has; rename it")
    MODELS[spec.name], CONFIGS[spec.name], _USER_SPECS[spec.name] = arch, spec.config, spec
    return spec.name


def _resolve_annotations(arch: str, config: type) -> None:
    """Give each field of `config` its type, not the string `from __future__ import annotations` leaves: the flags
    and the [model] keys are parsed by it (a string made `--ratio 2` a traceback, `--gated` want a value)."""
    try:
        hints = typing.get_type_hints(config)
    except Exception as e:
        raise UserCodeError(f"model {arch!r}: its config's annotations cannot be resolved: {type(e).__name__}: "
                            f"{e}") from None
    for f in dataclasses.fields(config):
        f.type = hints[f.name]


def spec_of(config):
    """The ModelSpec of a model config, found by the config's type."""
    names = [name for name, cls in CONFIGS.items() if type(config) is cls]
    if not names:
        raise ValueError(f"no registered model has the config type {type(config).__name__}")
    return model_spec(names[0])


def is_users(config) -> bool:
    """Whether a model config is of a user's own model (its code is theirs, loaded from --arch)."""
    return any(type(config) is CONFIGS[name] for name in _USER_SPECS)
