"""The models gcompile knows, by name: each brings its ModelSpec (gcompile/models/spec.py)."""

from gcompile.models.gpt2 import GPT2
from gcompile.models.llama import LLAMA
from gcompile.models.spec import ModelSpec

MODELS = {spec.name: spec for spec in (GPT2, LLAMA)}
DEFAULT_MODEL = "gpt2"
"""The model of the `[model]` section; its config's fields are the model flags."""


def model_spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return MODELS[name]


def spec_of(config) -> ModelSpec:
    """The spec of a model config, found by the config's type."""
    specs = [spec for spec in MODELS.values() if type(config) is spec.config]
    if not specs:
        raise ValueError(f"no registered model has the config type {type(config).__name__}")
    return specs[0]
