"""Hugging Face checkpoints in and out: config.json + safetensors <-> a gcompile checkpoint.

    python -m gcompile.checkpoint import-hf HF_DIR --save SAVE     # -> SAVE/iter_0000000, SAVE/model.toml
    python -m gcompile.checkpoint export-hf SAVE OUT_DIR           # -> OUT_DIR/config.json, model.safetensors

A family converts by its table below: the Hugging Face architecture, how config.json's keys
map to the `[model]` section, and which weights are stored transposed (GPT-2's Conv1D keeps
(in, out) where nn.Linear keeps (out, in)). Llama's names are Hugging Face's already; GPT-2's
are nanoGPT's, which are Hugging Face's too. A config.json whose model this code would compute
differently (rope scaling, biases Llama has not, another norm epsilon for GPT-2) is refused in
one line rather than converted approximately. The import writes an iteration-0 checkpoint (zero
AdamW states) that any layout loads, and `model.toml`, the `[model]` section to train it with.
"""

import dataclasses
import json
import math
import os
import shutil

import torch

from gcompile import tokenizer as tok
from gcompile.checkpoint_files import CheckpointError
from gcompile.paths import temp_name
from gcompile.models.spec import canonical_names

CONFIG = "config.json"
UNREAD = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")
"""Buffers older save_pretrained wrote beside the weights (the causal mask, RoPE's frequencies): made, not read."""
SAFETENSORS = "model.safetensors"
INDEX = "model.safetensors.index.json"
"""A sharded checkpoint's map of weight name -> file."""


def _gpt2_from_hf(hf: dict) -> dict:
    activation = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
    if hf.get("n_inner") == 4 * hf.get("n_embd", 0):  # what None means to transformers
        hf = dict(hf, n_inner=None)
    _require(hf, n_inner=None, layer_norm_epsilon=1e-5, scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
             reorder_and_upcast_attn=False)
    if hf.get("activation_function", "gelu_new") not in activation:
        raise CheckpointError(f"config.json: activation_function {hf['activation_function']!r} is not one of "
                              f"{', '.join(activation)}")
    return dict(block_size=hf["n_positions"], vocab_size=hf["vocab_size"], n_layer=hf["n_layer"], n_head=hf["n_head"],
                n_embd=hf["n_embd"], bias=True, dropout=0.0,
                activation=activation[hf.get("activation_function", "gelu_new")])


def _gpt2_to_hf(config) -> dict:
    if not config.bias:
        raise CheckpointError("export-hf: GPT2LMHeadModel always has biases; this model was trained with bias=false")
    _refuse_experts(config, "GPT2LMHeadModel")
    return dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], n_positions=config.block_size,
                n_ctx=config.block_size, vocab_size=config.vocab_size, n_layer=config.n_layer, n_head=config.n_head,
                n_embd=config.n_embd, n_inner=None, layer_norm_epsilon=1e-5, resid_pdrop=0.0, embd_pdrop=0.0,
                attn_pdrop=0.0, tie_word_embeddings=True,
                activation_function={"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}[config.activation])


def _llama_from_hf(hf: dict) -> dict:
    rope = hf.get("rope_parameters") or {"rope_type": "default", "rope_theta": hf.get("rope_theta", 10000.0)}
    if rope.get("rope_type", "default") != "default" or hf.get("rope_scaling"):
        raise CheckpointError(f"config.json: rope scaling {hf.get('rope_scaling') or rope} is not modelled here "
                              f"(plain RoPE only)")
    _require(hf, hidden_act="silu", attention_bias=False, mlp_bias=False)
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    if (hf.get("head_dim") or hidden // heads) != hidden // heads:  # None: what transformers reads as unset
        raise CheckpointError(f"config.json: head_dim {hf['head_dim']} is not hidden_size / num_attention_heads")
    return dict(block_size=hf["max_position_embeddings"], vocab_size=hf["vocab_size"],
                n_layer=hf["num_hidden_layers"], n_head=heads, n_kv_head=hf.get("num_key_value_heads", heads),
                n_embd=hidden, ffn_hidden_size=hf["intermediate_size"], rope_theta=float(rope["rope_theta"]),
                norm_eps=hf.get("rms_norm_eps", 1e-6), tie_word_embeddings=hf.get("tie_word_embeddings", False))


def _refuse_experts(config, architecture: str) -> None:
    if config.num_experts:
        raise CheckpointError(f"export-hf: {architecture} has no mixture of experts; this model has num_experts="
                              f"{config.num_experts}; use export for a state dict with the model's names")


def _llama_to_hf(config) -> dict:
    _refuse_experts(config, "LlamaForCausalLM")
    return dict(model_type="llama", architectures=["LlamaForCausalLM"], max_position_embeddings=config.block_size,
                vocab_size=config.vocab_size, num_hidden_layers=config.n_layer, num_attention_heads=config.n_head,
                num_key_value_heads=config.n_kv_head, hidden_size=config.n_embd,
                intermediate_size=config.ffn_hidden_size, head_dim=config.head_dim, hidden_act="silu",
                rms_norm_eps=config.norm_eps, rope_theta=config.rope_theta,
                rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta}, attention_bias=False,
                mlp_bias=False, attention_dropout=0.0, tie_word_embeddings=config.tie_word_embeddings)


@dataclasses.dataclass(frozen=True)
class Family:
    model: str
    """gcompile's model name (gcompile.models.MODELS)."""
    from_hf: object
    """config.json -> [model] keys."""
    to_hf: object
    """model config -> config.json."""
    transposed: tuple[str, ...] = ()
    """Name suffixes of weights Hugging Face stores as (in, out)."""


FAMILIES = {
    "gpt2": Family("gpt2", _gpt2_from_hf, _gpt2_to_hf,
                   ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")),
    "llama": Family("llama", _llama_from_hf, _llama_to_hf),
}
"""By Hugging Face's model_type."""


def import_hf(hf_dir: str, save: str, log=print) -> str:
    """Write the Hugging Face model in `hf_dir` as an iteration-0 checkpoint in `save`; returns its folder."""
    from gcompile import checkpoint
    from gcompile.check import PlanError, check_fits_machine
    from gcompile.config import ConfigError, build_config
    from gcompile.pipeline import build_rank_program
    from gcompile.axes import Coords
    from gcompile.state import TrainState

    where = os.path.join(hf_dir, CONFIG)
    hf = _read_config(hf_dir)
    family = _family(hf.get("model_type"), where)
    try:
        model = dict(arch=family.model, **family.from_hf(hf))
        config = build_config({"model": model, "train": dict(micro_batch_size=1, global_batch_size=1,
                                                             seq_length=min(128, model["block_size"]))})
        check_fits_machine(config)  # before its weights are allocated
    except CheckpointError:  # what a family's conversion refuses, named already
        raise
    except KeyError as e:
        raise CheckpointError(f"{where} has no {e.args[0]}; give the config.json save_pretrained wrote") from None
    except TypeError as e:
        raise CheckpointError(f"{where}: a value of the wrong kind ({e}); give the config.json save_pretrained "
                              f"wrote") from None
    except (ValueError, ConfigError, PlanError) as e:  # a model that cannot be, or cannot be held here
        raise CheckpointError(f"{where}: {e}") from None
    weights = _read_weights(hf_dir)
    program = build_rank_program(config, Coords.from_rank(0, {}), log=lambda _: None)
    state = TrainState.initial(program, config.model, 0, "cpu")
    views = program.layout.views(state.params)
    aliases = _aliases(config)
    used = set()
    with torch.no_grad():
        for param in program.layout.params:
            value = _weight(weights, param.name, aliases, family, hf_dir, used)
            if tuple(value.shape) != param.full_shape:
                raise CheckpointError(f"{hf_dir}: {param.name} is {list(value.shape)}, the config makes it "
                                      f"{list(param.full_shape)}")
            views[param.name].copy_(value.reshape(views[param.name].shape))
        if state.main is not None:
            state.main.copy_(state.params)
    if unused := sorted(k for k in weights.keys() - used if not k.endswith(UNREAD)):
        raise CheckpointError(f"{hf_dir}: the weights hold {len(unused)} tensor(s) this config.json's model does not "
                              f"have ({', '.join(unused[:3])}{', ...' if len(unused) > 3 else ''}); do its n_layer and "
                              f"tie_word_embeddings match the weights?")
    os.makedirs(save, exist_ok=True)
    folder = checkpoint.save(save, checkpoint.Progress(0, 0), config, program, state)
    with open(os.path.join(save, "model.toml"), "w") as f:
        f.write("[model]\n" + "".join(f"{key} = {_toml(value)}\n" for key, value in model.items()))
    log(f"imported {hf_dir} ({family.model}, {sum(math.prod(p.full_shape) for p in program.layout.params):,} parameters) to {folder}; "
        f"train it with: python run_gpt.py --config {os.path.join(save, 'model.toml')} --load {save}")
    return folder


def export_hf(path: str, out_dir: str, log=print) -> str:
    """Write the checkpoint at `path` as config.json + model.safetensors that `from_pretrained` loads."""
    from safetensors.torch import save_file

    from gcompile.checkpoint import Checkpoint, resolve

    ckpt = Checkpoint(resolve(path))
    ckpt.verify()  # damage anywhere refused, as --load refuses it, not only in the weights written
    config = ckpt.model_config
    family = next((f for f in FAMILIES.values() if f.model == ckpt.model_spec.name), None)
    if family is None:
        raise CheckpointError(f"export-hf: no Hugging Face architecture for a {ckpt.model_spec.name} model")
    hf = dict(family.to_hf(config), torch_dtype="float32")
    if config.vocab_size == tok.VOCAB_SIZE:  # the byte tokenizer's: transformers would take GPT-2's 50256, no id here
        hf.update(bos_token_id=tok.EOD, eos_token_id=tok.EOD)
    tensors = {}
    for name in ckpt.params:
        value = ckpt.full(ckpt.master, name).float()
        tensors[name] = (value.t() if name.endswith(family.transposed) else value).contiguous()
    partial = temp_name(out_dir.rstrip(os.sep))  # renamed into place whole, as a checkpoint is
    try:
        os.makedirs(partial)
        with open(os.path.join(partial, CONFIG), "w") as f:
            json.dump(hf, f, indent=2)
        save_file(tensors, os.path.join(partial, SAFETENSORS), metadata={"format": "pt"})
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(partial, 0o777 & ~umask)
        os.chmod(os.path.join(partial, SAFETENSORS), 0o666 & ~umask)  # safetensors writes 0600: as config.json
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty: the command refuses one that holds files
        os.rename(partial, out_dir)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    log(f"exported {ckpt.folder} to {out_dir} ({hf['architectures'][0]}; load it with from_pretrained)")
    return ckpt.folder


def _read_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, CONFIG)
    try:
        with open(path) as f:
            found = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{hf_dir}: no config.json; give a folder written by save_pretrained") from None
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(found, dict):
        raise CheckpointError(f"{path}: not a JSON object of a model's settings; give the one save_pretrained wrote")
    return found


def _family(model_type, where: str) -> Family:
    if model_type not in FAMILIES:
        raise CheckpointError(f"{where}: model_type {model_type!r} has no converter; known: {', '.join(FAMILIES)}")
    return FAMILIES[model_type]


def _require(hf: dict, **expected) -> None:
    """Keys whose other values this code would compute differently: refused, not approximated."""
    for key, value in expected.items():
        if key in hf and hf[key] != value:
            raise CheckpointError(f"config.json: {key}={hf[key]!r} is not supported (only {value!r})")


def _read_weights(hf_dir: str) -> dict:
    """name -> a lazily read tensor, over one safetensors file or an index of shards (safetensors holds
    plain tensors only: reading it runs no code)."""
    from safetensors import SafetensorError, safe_open

    index = os.path.join(hf_dir, INDEX)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, UnicodeDecodeError, RecursionError, KeyError, TypeError, AttributeError):
            raise CheckpointError(f"{index}: not a safetensors index (a weight_map of names to files)") from None
        if strays := [name for name in files if not (isinstance(name, str) and name.endswith(".safetensors") and
                                                     os.path.basename(name) == name)]:
            raise CheckpointError(f"{index} names {str(strays[0])[:60]!r}, not a .safetensors file in {hf_dir}")
    elif os.path.isfile(os.path.join(hf_dir, SAFETENSORS)):
        files = [SAFETENSORS]
    else:
        raise CheckpointError(f"{hf_dir}: no {SAFETENSORS} or {INDEX} (pytorch_model.bin is not read: it is a pickle)")
    weights = {}
    for name in files:
        path = os.path.join(hf_dir, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"{index} names {name}, which {hf_dir} does not hold")
        try:
            handle = safe_open(path, framework="pt")
        except SafetensorError as e:
            raise CheckpointError(f"{path}: not a safetensors file ({e}); give the one save_pretrained wrote") from None
        weights.update({key: (handle, key) for key in handle.keys()})
    return weights


def _aliases(config) -> dict[str, list[str]]:
    """Every name a parameter may be stored under: save_pretrained keeps one name of a tied pair."""
    with torch.device("meta"):
        module = config.model_spec.module(config.model)
    names = {}
    for name, owner in canonical_names(module).items():
        names.setdefault(owner, []).append(name)
    return names


def _weight(weights: dict, name: str, aliases: dict, family: Family, hf_dir: str, used: set) -> torch.Tensor:
    """The weight of parameter `name` as gcompile holds it (its stored name added to `used`)."""
    for candidate in aliases.get(name, [name]):
        candidate = candidate if candidate in weights else candidate.removeprefix("transformer.")  # GPT2Model's names
        if candidate in weights:
            handle, key = weights[candidate]
            value = handle.get_tensor(key)
            if not value.is_floating_point() or not torch.isfinite(value).all():
                held = "NaN or infinite values" if value.is_floating_point() else f"{value.dtype} values"
                raise CheckpointError(f"{hf_dir}: {candidate} holds {held}, not floating-point weights")
            used.add(candidate)
            value = value.float()
            return value.t() if name.endswith(family.transposed) else value
    raise CheckpointError(f"{hf_dir}: the weights hold no {name}, which the {family.model} model its config.json "
                          f"describes has; give a folder whose weights are that model's, as save_pretrained writes "
                          f"them")


def _toml(value) -> str:
    return "true" if value is True else "false" if value is False else json.dumps(value)
