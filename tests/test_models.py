"""A model is a ModelSpec: a model that is not GPT-2 captures and lowers on its own facts."""

import functools
import zlib
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from gcompile.capture import capture
from gcompile.flat import DECAY, flat_layout
from gcompile.lower import lower_stage
from gcompile.models import CONFIGS, MODELS, model_spec, spec_of
from gcompile.models.spec import Input, ModelSpec


@dataclass(frozen=True)
class TinyConfig:
    vocab: int = 16
    """Token ids."""
    width: int = 8
    """Hidden size."""


class Tiny(nn.Module):
    """An embedding, one residual MLP and a head tied to the embedding, named unlike GPT-2."""

    def __init__(self, config: TinyConfig):
        super().__init__()
        self.emb = nn.Embedding(config.vocab, config.width)
        self.up = nn.Linear(config.width, 2 * config.width)
        self.down = nn.Linear(2 * config.width, config.width)
        self.head = nn.Linear(config.width, config.vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens, labels):
        x = self.emb(tokens)  # (B, T, C)
        x = x + self.down(F.relu(self.up(x)))
        return F.cross_entropy(self.head(x).view(-1, self.head.out_features), labels.view(-1))


def init_value(name: str, shape, config: TinyConfig, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed + zlib.crc32(name.encode()))) * 0.1


TINY = ModelSpec(
    name="tiny",
    config=TinyConfig,
    module=Tiny,
    init_value=init_value,
    example_batch=lambda b, t: (Input("tokens", (b, t), torch.long), Input("labels", (b, t), torch.long)),
    tp_plan=("up=column", "down=row"),
    tp_errors=lambda model, name, placement, tp: [],
    config_errors=lambda config: [],
    decays=lambda name, shape: name != "down.weight",  # a rule GPT-2 would not choose: the embedding decays
    context_length=lambda config: 4,
    flops=lambda config, batch, seq: 0.0,
)


def test_registry_finds_gpt2_by_config_type():
    gpt2 = model_spec("gpt2")
    assert spec_of(gpt2.config()) is gpt2


def test_registry_configs_are_their_specs_configs():
    # the torch-free config table (what flags and --help read) agrees with the specs it stands for
    assert sorted(CONFIGS) == sorted(MODELS)
    for name in MODELS:
        assert model_spec(name).name == name
        assert model_spec(name).config is CONFIGS[name]


def test_tiny_captures_with_its_own_decay_rule():
    config = TinyConfig()
    program = capture(functools.partial(TINY.module, config), TINY.example_batch(2, 4), TINY.decays)
    (stage,) = program.stages
    assert stage.inputs == ["tokens", "labels"]
    params = {p.name: p for p in stage.params}
    assert sorted(params) == ["down.bias", "down.weight", "emb.weight", "up.bias", "up.weight"]  # head: emb
    assert {n for n, p in params.items() if p.decays} == {"down.bias", "emb.weight", "up.bias", "up.weight"}

    layout = flat_layout([[(p, p.full_shape) for p in stage.params]], sizes={}, bucket_size=1 << 20)
    flags = layout.flags(lambda param: 1)
    for param, shape, offset in zip(layout.params, layout.shapes, layout.offsets):
        piece = flags[offset:offset + torch.Size(shape).numel()]
        assert bool((piece & DECAY).all()) == TINY.decays(param.name, param.full_shape), param.name
        assert bool((piece & DECAY).any()) == TINY.decays(param.name, param.full_shape), param.name


def test_tiny_lowered_gradients_match_eager():
    """The tied head's gradient is the sum of both uses, as eager autograd makes it."""
    config = TinyConfig()
    program = capture(functools.partial(TINY.module, config), TINY.example_batch(2, 4), TINY.decays)
    lowered = lower_stage(program.stages[0])
    eager = TINY.build(config, seed=3)
    assert eager.head.weight is eager.emb.weight
    g = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, config.vocab, (2, 4), generator=g) for _ in range(2))
    loss = eager(tokens, labels)
    loss.backward()

    weights = dict(eager.named_parameters())
    with torch.no_grad():
        loss_out, *saved = lowered.forward(*[weights[p.name].detach() for p in lowered.params], tokens, labels)
        grads = lowered.backward(*saved, torch.ones(()))
    torch.testing.assert_close(loss_out, loss.detach(), rtol=1e-6, atol=1e-6)
    for param, grad in zip(lowered.params, grads):
        torch.testing.assert_close(grad, weights[param.name].grad, rtol=1e-5, atol=1e-6, msg=param.name)
