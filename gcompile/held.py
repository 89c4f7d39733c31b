"""The tensors a model holds besides its parameters (register_buffer, a tensor attribute), as values.

Capture builds the model under a fake mode, where such a tensor is a shape alone; the ranks need its
numbers (rotary's inv_freq, a causal mask, a cos/sin cache), which are not trained and are the same on
every rank. So the model is built once more, with each parameter moved to the meta device as it is
registered: nothing stays allocated for the weights (one layer's, for a moment), while the buffers hold
what __init__ computed. The ranks are handed the values as constant inputs (`Stage.rank_constants`), never
checkpointed: they follow from the config, as the forward that makes them does.
"""

import contextlib
from collections.abc import Callable

import torch
import torch.nn as nn

from gcompile.config import ConfigError
from gcompile.user_code import failure_line


def held_values(build: Callable[[], nn.Module], targets: list[str], model: str) -> dict[str, torch.Tensor]:
    """target (blocks.0.inv_freq) -> its value, as `build` makes it on the CPU (under the caller's default
    dtype), with the global random state left as it was."""
    with parameters_on_meta(), torch.device("cpu"), torch.random.fork_rng(devices=[]):
        try:
            built = build()
        except Exception as e:
            raise ConfigError(f"{model} could not be built for the values of its buffers: {failure_line(e)}") from e
    values = {}
    for target in targets:
        owner, _, name = target.rpartition(".")
        value = getattr(built.get_submodule(owner), name).detach()
        if value.is_meta:
            raise ConfigError(f"{model} makes its buffer {target} from its parameters in __init__, so it has no value "
                              f"before training; compute it in forward")
        values[target] = value.clone()
    return values


@contextlib.contextmanager
def parameters_on_meta(keep: Callable[[nn.Module, str, nn.Parameter], bool] = lambda *_: False):
    """Every parameter registered while this runs (but those `keep(module, name, param)` keeps) is moved to
    the meta device (as `accelerate`'s init_empty_weights does): the module's own initialisation then runs on
    shapes alone."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta and not keep(module, name, param):
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register
