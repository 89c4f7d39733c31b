"""The models gcompile knows, by name: each brings its ModelSpec (gcompile/models/spec.py).

The registry names where each spec lives and imports it on first use: a spec
imports torch (seconds), while a model's config class does not, so reading
flags, presets and `run_gpt.py --help` never waits for it.
"""

import importlib

from gcompile.models.gpt2_config import GPTConfig
from gcompile.models.llama_config import LlamaConfig

MODELS = {"gpt2": "gcompile.models.gpt2:GPT2", "llama": "gcompile.models.llama:LLAMA"}
"""Where each model's ModelSpec lives, by name: `module:attribute`."""
CONFIGS = {"gpt2": GPTConfig, "llama": LlamaConfig}
"""Each model's `[model]` config class (its spec's `config`), importable without torch."""
DEFAULT_MODEL = "gpt2"
"""The model of the `[model]` section; its config's fields are the model flags."""


def model_spec(name: str):
    """The ModelSpec registered as `name`."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    module, _, attribute = MODELS[name].partition(":")
    return getattr(importlib.import_module(module), attribute)


def spec_of(config):
    """The ModelSpec of a model config, found by the config's type."""
    names = [name for name, cls in CONFIGS.items() if type(config) is cls]
    if not names:
        raise ValueError(f"no registered model has the config type {type(config).__name__}")
    return model_spec(names[0])
