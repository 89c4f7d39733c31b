"""The models gcompile knows, by name: each brings its ModelSpec (gcompile/models/spec.py).

The registry names where each spec lives and imports it on first use: a spec
imports torch (seconds), while a model's config class does not, so reading
flags, presets and `run_gpt.py --help` never waits for it. A user's own model
(`--arch pkg.module:spec` or `--arch path/to/file.py:spec`) is registered when
its arch is read: importing it runs the user's code, which the user asked for.
"""

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


def register_user_model(arch: str) -> str:
    """Load the ModelSpec (or the function returning it) that `arch` names and register it; its name."""
    from gcompile.models.spec import ModelSpec

    found = load_object(arch, "model")
    try:
        spec = found() if callable(found) and not isinstance(found, ModelSpec) else found
    except Exception as e:  # the user's function, called with nothing, as a ModelSpec's maker is
        raise UserCodeError(f"model {arch!r}: calling it for its ModelSpec raised {type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}; name a ModelSpec, or a function of no "
                            f"arguments that returns one") from None
    if not isinstance(spec, ModelSpec):
        raise UserCodeError(f"model {arch!r} is a {type(spec).__name__}, not a ModelSpec; return one, e.g. "
                            f"gcompile.models.spec.spec_with_defaults(name, config, module)")
    if spec.name in MODELS and MODELS[spec.name] != arch:
        raise UserCodeError(f"model {arch!r} is named {spec.name!r}, which {MODELS[spec.name]} has; rename it")
    MODELS[spec.name], CONFIGS[spec.name], _USER_SPECS[spec.name] = arch, spec.config, spec
    return spec.name


def spec_of(config):
    """The ModelSpec of a model config, found by the config's type."""
    names = [name for name, cls in CONFIGS.items() if type(config) is cls]
    if not names:
        raise ValueError(f"no registered model has the config type {type(config).__name__}")
    return model_spec(names[0])


def is_users(config) -> bool:
    """Whether a model config is of a user's own model (its code is theirs, loaded from --arch)."""
    return any(type(config) is CONFIGS[name] for name in _USER_SPECS)
