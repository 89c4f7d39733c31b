"""Hugging Face in and out, checked by transformers itself (a test-only dependency; random weights, no download).

A model saved by `save_pretrained` is imported, exported back as gcompile's single-device model, and its
logits and loss compared with transformers' on the same tokens; a model trained on tp 2 is exported with
export-hf and loaded by `from_pretrained`. fp32 throughout; relative error at most 1e-5 (norm-wise over
all logits): the two implementations order a few reductions differently (attention, GELU's formula).
"""

import json
import os
import subprocess
import sys

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F

import run_gpt
from gcompile.checkpoint import export, load_exported, main as checkpoint_main
from gcompile.models import model_spec
from tests.reference import rel_err

transformers = pytest.importorskip("transformers")

TOL = 1e-5


def hf_llama(tie: bool):
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                                      num_key_value_heads=4, max_position_embeddings=32, vocab_size=257,
                                      rope_theta=5000.0, rms_norm_eps=1e-5, tie_word_embeddings=tie)
    return transformers.LlamaForCausalLM(config)


def hf_gpt2(activation: str):
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=32, vocab_size=257,
                                     activation_function=activation, bos_token_id=256, eos_token_id=256)
    return transformers.GPT2LMHeadModel(config)


def gcompile_model(save, tmp_path, name: str):
    """The single-device model a checkpoint holds, through gcompile's own export."""
    export(str(save), str(tmp_path / "model.pt"))
    model, _ = load_exported(str(tmp_path / "model.pt"), model_spec(name))
    return model.eval()


def assert_same_outputs(hf_model, model):
    tokens = torch.randint(0, 257, (2, 17), generator=torch.Generator().manual_seed(0))
    idx, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    with torch.no_grad():
        expected = hf_model(idx).logits
        logits = model(idx)
        loss = model(idx, targets)
    assert rel_err(logits, expected) < TOL
    hf_loss = F.cross_entropy(expected.reshape(-1, expected.size(-1)), targets.reshape(-1))
    assert abs(loss.item() - hf_loss.item()) / hf_loss.item() < TOL


@pytest.mark.parametrize("family, make, option", [
    ("llama", hf_llama, False), ("llama", hf_llama, True), ("gpt2", hf_gpt2, "gelu_new"), ("gpt2", hf_gpt2, "gelu"),
], ids=["llama", "llama-tied", "gpt2-gelu_new", "gpt2-gelu"])
def test_import_gives_transformers_logits(family, make, option, tmp_path, capsys):
    torch.manual_seed(0)
    hf_model = make(option).eval()
    hf_model.save_pretrained(tmp_path / "hf")
    assert checkpoint_main(["import-hf", str(tmp_path / "hf"), "--save", str(tmp_path / "save")]) == 0
    assert f"--config {tmp_path / 'save' / 'model.toml'} --load {tmp_path / 'save'}" in capsys.readouterr().out
    assert_same_outputs(hf_model, gcompile_model(tmp_path / "save", tmp_path, family))


@pytest.mark.parametrize("make, option, family, written", [(hf_llama, False, "llama", {"head_dim": None}),
                                                             (hf_gpt2, "gelu", "gpt2", {"n_inner": 4 * 64})],
                         ids=["llama-head-dim-null", "gpt2-n-inner-written-out"])
def test_import_reads_a_config_written_out_as_transformers_does(make, option, family, written, tmp_path):
    """A head_dim of null and GPT-2's n_inner of 4 x n_embd given as a number mean what leaving them out does
    to transformers; the import refused both."""
    torch.manual_seed(0)
    make(option).save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **written}))
    assert checkpoint_main(["import-hf", str(tmp_path / "hf"), "--save", str(tmp_path / "save")]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert_same_outputs(loaded, gcompile_model(tmp_path / "save", tmp_path, family))


def test_export_hf_round_trips_through_transformers(tmp_path):
    torch.manual_seed(1)
    hf_gpt2("gelu_new").save_pretrained(tmp_path / "hf")
    assert checkpoint_main(["import-hf", str(tmp_path / "hf"), "--save", str(tmp_path / "save")]) == 0
    assert checkpoint_main(["export-hf", str(tmp_path / "save"), str(tmp_path / "out")]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["activation_function"] == "gelu_pytorch_tanh" and config["architectures"] == ["GPT2LMHeadModel"]
    assert config["eos_token_id"] == config["bos_token_id"] == 256  # the byte tokenizer's end of document
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert_same_outputs(loaded, gcompile_model(tmp_path / "save", tmp_path, "gpt2"))


def test_exports_stopped_midway_leave_nothing_half_written(tmp_path, monkeypatch):
    """export and export-hf wrote their files in place: a stop while the weights were written left a file that
    loads as nothing (a truncated .pt, a config.json beside no weights)."""
    hf_gpt2("gelu_new").save_pretrained(tmp_path / "hf")
    assert checkpoint_main(["import-hf", str(tmp_path / "hf"), "--save", str(tmp_path / "save")]) == 0

    def stopped(_, path, **__):
        open(path, "wb").write(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", stopped)
    monkeypatch.setattr(safetensors.torch, "save_file", stopped)
    for argv in (["export", str(tmp_path / "save"), "--output", str(tmp_path / "model.pt")],
                 ["export-hf", str(tmp_path / "save"), str(tmp_path / "out")]):
        with pytest.raises(KeyboardInterrupt):
            checkpoint_main(argv)
    assert sorted(os.listdir(tmp_path)) == ["hf", "save"]
    # a stop by a signal ends the process without unwinding: the next export-hf clears what it left
    monkeypatch.undo()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / f"out.tmp-{dead.stdout.strip()}-0123abcd").mkdir()
    (tmp_path / f"out.tmp-{dead.stdout.strip()}-0123abcd" / "config.json").write_text("{}")
    assert checkpoint_main(["export-hf", str(tmp_path / "save"), str(tmp_path / "out")]) == 0
    assert sorted(os.listdir(tmp_path)) == ["hf", "out", "save"]


@pytest.mark.slow
def test_trained_on_tp2_then_loaded_by_from_pretrained(tmp_path, capfd):
    """import-hf -> 3 steps on tp 2 (two gloo ranks) -> export-hf -> from_pretrained gives gcompile's logits. The
    import is iteration 0, which no learning-rate schedule has run: training from it warns of no change."""
    torch.manual_seed(2)
    hf_llama(False).save_pretrained(tmp_path / "hf")
    save, trained = tmp_path / "save", tmp_path / "trained"
    assert checkpoint_main(["import-hf", str(tmp_path / "hf"), "--save", str(save)]) == 0
    assert run_gpt.main(["--config", str(save / "model.toml"), "--load", str(save), "--save", str(trained), "--tp", "2",
                         "--train-iters", "3", "--micro-batch-size", "2", "--global-batch-size", "4",
                         "--seq-length", "32", "--eval-interval", "0", "--run-dir", str(tmp_path / "run")]) == 0
    out = capfd.readouterr().out
    assert "loaded" in out and "learning-rate schedule differs" not in out, out
    assert checkpoint_main(["export-hf", str(trained), str(tmp_path / "out")]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    model = gcompile_model(trained, tmp_path, "llama")
    before = gcompile_model(save, tmp_path / "hf", "llama")
    assert rel_err(model.lm_head.weight, before.lm_head.weight) > 1e-4  # training moved the weights
    assert_same_outputs(loaded, model)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(rope_scaling={"rope_type": "llama3", "factor": 32.0}), "is not modelled here"),
    (lambda c: c.update(attention_bias=True), "attention_bias=True is not supported"),
    (lambda c: c.update(model_type="mistral"), "model_type 'mistral' has no converter"),
])
def test_import_refuses_what_it_would_compute_differently(edit, message, tmp_path, capsys):
    hf_llama(False).save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    edit(config)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    capsys.readouterr()  # transformers' own progress bar
    assert checkpoint_main(["import-hf", str(tmp_path / "hf"), "--save", str(tmp_path / "save")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
