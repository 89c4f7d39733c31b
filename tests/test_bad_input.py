"""Bad input, every CLI: one line on stderr that names the problem, exit status 2, no traceback, before any work.

One table: a case is the command (`run_gpt.py` flags, `python -m gcompile.checkpoint`, `gcompile.inspect`,
`gcompile.data`), what it finds in tmp_path (a file in the way, a damaged checkpoint, a data file), and a
part of the line it must print. The CLIs' `main` functions run in this process, so a case also checks
that nothing was logged (torch logs tracebacks before some failures) and that run_gpt.py never called
run_ranks: refused before any rank starts. run_gpt.py's cases pass a tiny model and `--run-dir`, whose
metrics must stay unwritten: no training step ran. One case runs as a real process, where argv holds raw bytes.
"""

import json
import logging
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import run_gpt
from gcompile.checkpoint_files import CHECKSUMS, write_checksums
from gcompile import calibrate, checkpoint, data, inspect, plan
from gcompile.checkpoint import TRACKER
from gcompile.tokenizer import VOCAB_SIZE
from gcompile.indexed_dataset import IndexedDatasetWriter
from gcompile.launch import run_ranks
from tests.multirank import ROOT

ONE_GPU = os.path.join(ROOT, "machines", "h100-80gb-1gpu.json")
"""The machine file kept from the one GPU a session was lent: it measured no collectives."""

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "16", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "1", "--eval-interval", "0"]
"""A model and run so small that a case which fails to refuse costs a second, not a training run."""
CLIS = {"run_gpt": run_gpt.main, "checkpoint": checkpoint.main, "inspect": inspect.main, "data": data.main,
        "plan": plan.main, "calibrate": calibrate.main}
ITERATION = "iter_0000001"
REFUSED_IN_THE_BUILD = {"pass returning None", "own model returning logits", "own model returning two values",
                        "own model with a float64 loss", "own model updating a buffer", "own model branching on values",
                        "own model ignoring the targets", "own model head narrower than the vocabulary",
                        "own model naming its inputs otherwise", "own model without targets"}
"""Cases that only building the program finds: with one rank that happens in this process, after run_ranks
is called but before any step; every other case is refused before run_ranks."""


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A real checkpoint of TINY after one iteration, and the model exported from it."""
    root = tmp_path_factory.mktemp("saved")
    assert run_gpt.main(TINY + ["--save", str(root / "save"), "--run-dir", str(root / "run")]) == 0
    assert checkpoint.main(["export", str(root / "save"), "--output", str(root / "model.pt")]) == 0
    return root


# ------------------------------------------------------------------ what a case finds in tmp_path


def a_file(tmp, saved=None, name="file"):
    (tmp / name).write_text("not a folder\n")


def machine_file_with(**fields):
    """The kept one-GPU machine file (a good one) as m.json, with `fields` changed."""
    def setup(tmp, saved=None):
        with open(ONE_GPU) as f:
            (tmp / "m.json").write_text(json.dumps({**json.load(f), **fields}))
    return setup


def not_utf8(name):
    def setup(tmp, saved=None):
        (tmp / name).write_bytes(b"\xff\xfe{}")
    return setup


def a_pipe(name):
    def setup(tmp, saved=None):
        os.mkfifo(tmp / name)
    return setup


def nan_export(tmp, saved):
    """The run's export with one weight NaN: a model that trained into NaN."""
    exported = torch.load(saved() / "model.pt", weights_only=True)
    exported["model"]["transformer.wte.weight"][0, 0] = float("nan")
    torch.save(exported, tmp / "nan.pt")


def tokens(dtype, values):
    def write(tmp, saved=None):
        with IndexedDatasetWriter(str(tmp / "corpus"), dtype=dtype) as writer:
            writer.add_document(np.array(values, dtype=dtype))
    return write


VALID_BEYOND_VOCAB = [i % 256 for i in range(100)] + [VOCAB_SIZE + 43] * 100
"""With --split 1,1: a train part the old check read, and token id 300 in the valid part only."""


def a_pass(source):
    def write(tmp, saved):
        (tmp / "user_pass.py").write_text(source)
    return write


def copy_checkpoint(damage):
    def make(tmp, saved):
        shutil.copytree(saved() / "save", tmp / "save")
        damage(tmp / "save")
    return make


def edit_meta(edit):
    """A gcompile.json edited and checksummed again: what the field checks must catch, past the checksum."""
    def damage(save):
        path = save / ITERATION / "gcompile.json"
        meta = json.loads(path.read_text())
        edit(meta)
        path.write_text(json.dumps(meta))
        (save / ITERATION / CHECKSUMS).write_text(write_checksums(str(save / ITERATION)))
    return damage


def truncate_metadata(save):
    """Cut short and checksummed again: what the reader itself must refuse."""
    path = save / ITERATION / ".metadata"
    os.truncate(path, os.path.getsize(path) // 2)
    (save / ITERATION / CHECKSUMS).write_text(write_checksums(str(save / ITERATION)))


def dump_folder(rank0):
    def make(tmp, saved):
        (tmp / "dump").mkdir()
        rank0(tmp / "dump")
    return make


def non_utf8_rank0(dump):
    (dump / "rank0").mkdir()
    (dump / "rank0" / "schedule.txt").write_bytes(b"# rank 0 \xff\xfe\n")


def garbled_index(dump):
    (dump / "rank0").mkdir()
    (dump / "index.txt").write_text("rank0: ranks zero to seven\n")


MASKED_ATTENTION = '''"""A model whose attention takes an explicit mask, which context parallel's p2p ring refuses."""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from gcompile.models.spec import spec_with_defaults


@dataclass(frozen=True)
class MaskedConfig:
    vocab_size: int = 257
    """Token ids."""
    block_size: int = 128
    """The longest sequence."""
    n_layer: int = 1
    """One attention, no blocks."""
    n_head: int = 1
    """One head."""
    n_embd: int = 16
    """Hidden size."""


class Masked(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed = nn.Embedding(config.vocab_size, config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size)

    def forward(self, idx, targets):
        x = self.embed(idx).unsqueeze(1)  # (B, 1, T, C)
        mask = torch.ones(idx.size(1), idx.size(1), dtype=torch.bool, device=idx.device).tril()
        y = F.scaled_dot_product_attention(x, x, x, attn_mask=mask).squeeze(1)
        return F.cross_entropy(self.head(y).view(-1, 257), targets.view(-1))


SPEC = spec_with_defaults("masked", MaskedConfig, Masked)
'''
SQUARED_MEAN = MASKED_ATTENTION.replace("whose attention takes an explicit mask, which", "whose loss squares a mean "
                                        "over the tokens, which").replace(
    """        x = self.embed(idx).unsqueeze(1)  # (B, 1, T, C)
        mask = torch.ones(idx.size(1), idx.size(1), dtype=torch.bool, device=idx.device).tril()
        y = F.scaled_dot_product_attention(x, x, x, attn_mask=mask).squeeze(1)
        return F.cross_entropy(self.head(y).view(-1, 257), targets.view(-1))""",
    """        y = self.embed(idx)  # (B, T, C)
        return F.cross_entropy(self.head(y).view(-1, 257), targets.view(-1)) + y.mean(1).pow(2).sum()""").replace(
    'spec_with_defaults("masked"', 'spec_with_defaults("squared"')

LOGITS = SQUARED_MEAN.replace("whose loss squares a mean over the tokens, which", "whose forward returns its logits, "
                                                                                 "which no").replace(
    "return F.cross_entropy(self.head(y).view(-1, 257), targets.view(-1)) + y.mean(1).pow(2).sum()",
    "return self.head(y)").replace('spec_with_defaults("squared"', 'spec_with_defaults("logits"')
RETURNS_TWO = LOGITS.replace('"logits"', '"two"').replace("return self.head(y)",
                                                             "return F.cross_entropy(self.head(y).view(-1, 257), "
                                                             "targets.view(-1)), y")
FLOAT64_LOSS = RETURNS_TWO.replace('"two"', '"double"').replace("targets.view(-1)), y", "targets.view(-1)).double()")
BATCH_NORM = SQUARED_MEAN.replace('"squared"', '"batch_norm"').replace(
    "self.head = nn.Linear(config.n_embd, config.vocab_size)",
    "self.head = nn.Linear(config.n_embd, config.vocab_size)\n        self.norm = nn.BatchNorm1d(config.n_embd)").replace(
    "        y = self.embed(idx)  # (B, T, C)\n", "        y = self.norm(self.embed(idx).transpose(1, 2)).transpose(1, 2)\n")
BRANCHES = SQUARED_MEAN.replace('"squared"', '"branches"').replace("        y = self.embed(idx)  # (B, T, C)\n",
                                                              "        y = self.embed(idx)  # (B, T, C)\n"
                                                              "        if y.sum() > 0:\n            y = -y\n")
FAILS_TO_BUILD = SQUARED_MEAN.replace('"squared"', '"broken"').replace(
    "        self.embed = nn.Embedding(config.vocab_size, config.n_embd)\n",
    "        raise ValueError('no embedding for this vocabulary')\n")
NOT_FROZEN = SQUARED_MEAN.replace('"squared"', '"thawed"').replace("@dataclass(frozen=True)", "@dataclass")
SHARES_A_FLAG = SQUARED_MEAN.replace('"squared"', '"lr"').replace('    """Hidden size."""\n',
                                                            '    """Hidden size."""\n    lr: float = 0.1\n')
IGNORES_TARGETS = SQUARED_MEAN.replace('"squared"', '"untargeted"').replace(
    "return F.cross_entropy(self.head(y).view(-1, 257), targets.view(-1)) + y.mean(1).pow(2).sum()",
    "return self.head(y).pow(2).mean()")
SMALL_HEAD = SQUARED_MEAN.replace('"squared"', '"narrow"').replace(
    "nn.Linear(config.n_embd, config.vocab_size)", "nn.Linear(config.n_embd, 100)").replace(
    "self.head(y).view(-1, 257)", "self.head(y).view(-1, 100)")
HF_NAMES = SQUARED_MEAN.replace('"squared"', '"hf_names"').replace(
    "def forward(self, idx, targets):", "def forward(self, input_ids, labels=None):").replace(
    "self.embed(idx)", "self.embed(input_ids)").replace("targets.view(-1)", "labels.view(-1)")
NO_TARGETS = SQUARED_MEAN.replace('"squared"', '"no_targets"').replace(
    "def forward(self, idx, targets):", "def forward(self, idx):").replace(
    "F.cross_entropy(self.head(y).view(-1, 257), targets.view(-1)) + ", "")
NOT_A_MODULE = LOGITS.replace('spec_with_defaults("logits", MaskedConfig, Masked)',
                              'spec_with_defaults("number", MaskedConfig, lambda config: 5)')


# (id, cli, argv with {tmp} and {saved}, setup(tmp, saved) or None, a part of the one line);
# `saved()` is the `saved_run` fixture's folder, made when a case first asks for it
CASES = [
    ("log-interval 0", "run_gpt", ["--log-interval", "0"], None, "log-interval=0 must be at least 1"),
    ("config twice", "run_gpt", ["--config", f"{ROOT}/configs/tiny.toml", "--config", f"{ROOT}/configs/moe-tiny.toml"],
     None, "--config given twice"),  # was: the first file's model and layout dropped without a word
    ("abbreviated flag", "run_gpt", ["--pipeline-sched", "1f1b"], None, "unrecognized arguments: --pipeline-sched"),
    ("eval-iters 0", "run_gpt", ["--eval-interval", "1", "--eval-iters", "0"], None,
     "eval-iters=0 must be at least 1 while evaluation is on"),
    ("seed -1", "run_gpt", ["--seed", "-1"], None, "seed=-1 must be in [0, 2^63)"),
    ("seed 2^63", "run_gpt", ["--seed", str(2 ** 63)], None, f"seed={2 ** 63} must be in [0, 2^63)"),
    ("split inf", "run_gpt", ["--split", "inf,1"], None, "split 'inf,1': expected"),
    ("dropout 1.5", "run_gpt", ["--dropout", "1.5"], None, "dropout=1.5 must be in [0, 1)"),
    ("n-embd 65536", "run_gpt", ["--n-embd", "65536"], None, "bytes"),
    ("block-size 1e11", "run_gpt", ["--block-size", str(10 ** 11)], None, "choose a smaller model"),
    ("lr nan", "run_gpt", ["--lr", "nan"], None, "lr=nan must be a finite number"),
    ("lr negative", "run_gpt", ["--lr", "-1"], None, "lr=-1.0 must not be negative"),
    ("min-lr negative", "run_gpt", ["--min-lr", "-1"], None, "min-lr=-1.0 must not be negative"),
    ("clip-grad negative", "run_gpt", ["--clip-grad", "-1"], None, "clip-grad=-1.0 must not be negative"),
    ("lr-warmup-iters negative", "run_gpt", ["--lr-warmup-iters", "-1"], None, "lr-warmup-iters=-1 must not be"),
    ("eval-interval negative", "run_gpt", ["--eval-interval", "-1"], None, "eval-interval=-1 must not be"),
    ("adam-beta1 2", "run_gpt", ["--adam-beta1", "2"], None, "adam-beta1=2.0 must be in [0, 1)"),
    ("adam-eps negative", "run_gpt", ["--adam-eps", "-1"], None,
     "adam-eps=-1.0 must not be negative"),  # was: trained with sqrt(v) - 1 as the denominator
    ("initial-loss-scale 0", "run_gpt", ["--fp16", "--initial-loss-scale", "0"], None,
     "initial-loss-scale=0.0 must be above 0"),  # was: a skipped step, then scale 1
    ("initial-loss-scale negative", "run_gpt", ["--fp16", "--initial-loss-scale", "-5"], None,
     "initial-loss-scale=-5.0 must be above 0"),  # was: trained with loss scale -5
    ("min-loss-scale 0", "run_gpt", ["--fp16", "--min-loss-scale", "0"], None, "min-loss-scale=0.0 must be above 0"),
    ("min-loss-scale above the initial", "run_gpt", ["--fp16", "--initial-loss-scale", "1024", "--min-loss-scale", "1e6"],
     None, "min-loss-scale=1000000.0 is above initial-loss-scale=1024.0"),
    ("loss-scale-window 0", "run_gpt", ["--fp16", "--loss-scale-window", "0"], None,
     "loss-scale-window=0 must be at least 1"),  # was: the scale doubled on every step, overflowing ones too
    ("hysteresis 0", "run_gpt", ["--fp16", "--hysteresis", "0"], None, "hysteresis=0 must be at least 1"),
    ("lr-decay-iters within the warmup", "run_gpt", ["--lr-warmup-iters", "10", "--lr-decay-iters", "5"], None,
     "lr-decay-iters=5 must be above lr-warmup-iters=10"),  # was: warmup to lr, then a drop to min_lr
    ("data-path empty", "run_gpt", ["--data-path", ""], None, "--data-path is empty"),
    ("data-path a folder", "run_gpt", ["--data-path", "{tmp}/corpus.bin"], lambda tmp, _: (tmp / "corpus.bin").mkdir(),
     "{tmp}/corpus.bin is a folder, not a file"),  # was: "no {tmp}/corpus.bin / ... found", though it is there
    ("sharding strategy unknown", "run_gpt", ["--dp", "2", "--data-parallel-sharding-strategy", "zero3"], None,
     "must be no_shard, optim, optim_grads or optim_grads_params"),
    ("shard size not dividing dp", "run_gpt", ["--dp", "4", "--global-batch-size", "32",
                                               "--data-parallel-sharding-strategy", "optim_grads_params",
                                               "--data-parallel-shard-size", "3"], None,
     "data_parallel_shard_size=3 does not divide dp=4"),
    ("shard size without ZeRO-3", "run_gpt", ["--dp", "4", "--global-batch-size", "32",
                                              "--data-parallel-shard-size", "2"], None,
     "needs --data-parallel-sharding-strategy optim_grads_params (this run: no_shard)"),
    ("run-dir under a file", "run_gpt", ["--run-dir", "{tmp}/file/run"], a_file, "/file is a file, not a folder"),
    ("run-dir is a file", "run_gpt", ["--run-dir", "{tmp}/file"], a_file, "/file is a file, not a folder"),
    ("tensorboard-dir under a file", "run_gpt", ["--tensorboard-dir", "{tmp}/file/tb"], a_file, "--tensorboard-dir"),
    ("dump-graphs under a file", "run_gpt", ["--dump-graphs", "{tmp}/file/dump"], a_file, "--dump-graphs"),
    ("cache-dir under a file", "run_gpt", ["--cache-dir", "{tmp}/file/cache"], a_file, "--cache-dir"),
    ("save under a file", "run_gpt", ["--save", "{tmp}/file/save"], a_file, "--save"),
    ("save is a file", "run_gpt", ["--save", "{tmp}/file"], a_file, "/file is a file, not a folder"),
    ("config is a folder", "run_gpt", ["--config", "{tmp}"], None, "is a folder; name a TOML file"),
    ("config not UTF-8", "run_gpt", ["--config", "{tmp}/bad.toml"],
     lambda tmp, saved: (tmp / "bad.toml").write_bytes(b"[model]\nn_layer = 2 # \xff\n"), "not UTF-8 text"),
    ("config with several wrong types", "run_gpt", ["--config", "{tmp}/bad.toml"],
     lambda tmp, saved: (tmp / "bad.toml").write_text('[model]\nn_layer = "two"\n[train]\nlr = "fast"\n'),
     "[model] n_layer='two' is not a valid int; [train] lr='fast' is not a valid float"),  # was: the first only
    ("config data path a number", "run_gpt", ["--config", "{tmp}/bad.toml"],
     lambda tmp, saved: (tmp / "bad.toml").write_text("[data]\ndata_path = 5\n"),
     "[data] data_path=5 is not a valid str"),  # was: "no 5.bin / 5.idx found"
    ("config boolean for an integer", "run_gpt", ["--config", "{tmp}/bad.toml"],
     lambda tmp, saved: (tmp / "bad.toml").write_text("[model]\nn_layer = true\n"),
     "[model] n_layer = true, but it takes an integer"),
    ("load a file", "run_gpt", ["--load", "{tmp}/file"], a_file, "/file is a file; give the SAVE folder"),
    ("token id beyond the vocab in valid", "run_gpt", ["--data-path", "{tmp}/corpus", "--split", "1,1"],
     tokens(np.uint16, VALID_BEYOND_VOCAB), "the valid part holds token id 300 but vocab_size=257"),
    ("negative token id", "run_gpt", ["--data-path", "{tmp}/corpus", "--split", "1,1"],
     tokens(np.int16, [5] * 50 + [-3] * 150),
     "holds token id -3"),
    ("NaN in a float index", "run_gpt", ["--data-path", "{tmp}/corpus", "--split", "1,1"],
     tokens(np.float32, [5.0] * 100 + [float("nan")] + [5.0] * 99), "holds token id nan in a float32 index"),
    ("inf in a float index", "run_gpt", ["--data-path", "{tmp}/corpus", "--split", "1,1"],
     tokens(np.float64, [5.0] * 100 + [float("inf")] + [5.0] * 99),
     "holds token id inf in a float64 index"),  # was: an OverflowError traceback
    ("split past a float", "run_gpt", ["--split", "1e308,1e308"], None,
     "(each at least a billionth of the whole)"),  # was: a ValueError traceback (NaN)
    ("cache-dir that cannot be made", "run_gpt", ["--cache-dir", "/proc/gcompile-cache"], None,
     "--cache-dir /proc/gcompile-cache: cannot make /proc/gcompile-cache"),  # was: a FileNotFoundError traceback
    ("prepare a vocabulary past int32", "data", ["prepare", "--input", "{tmp}/file", "--output", "{tmp}/out",
                                                 "--train-tokenizer", "--vocab-size", "99999999999999999999"],
     a_file, "--vocab-size 99999999999999999999: at most 2,147,483,647"),  # was: an OverflowError traceback
    ("prepare where the tokenizer file is a folder", "data", ["prepare", "--input", "{tmp}/file", "--output",
                                                              "{tmp}/out", "--train-tokenizer", "--vocab-size", "300"],
     lambda tmp, saved: (a_file(tmp), (tmp / "out.tokenizer.json").mkdir()),
     "out.tokenizer.json, where the trained tokenizer goes, is a folder"),  # was: "Exception: Is a directory"
    ("prepare into /proc", "data", ["prepare", "--input", "{tmp}/file", "--output", "/proc/gcompile-out"], a_file,
     "--output /proc/gcompile-out must be writable"),  # was: a FileNotFoundError traceback
    ("corpus smaller than a batch", "run_gpt", ["--data-path", "{tmp}/corpus", "--split", "1,1"],
     tokens(np.uint16, list(range(40))), "fewer than one global batch of 2"),
    ("pass with a syntax error", "run_gpt", ["--passes", "{tmp}/user_pass.py:my_pass"], a_pass("def my_pass(:\n"),
     "SyntaxError: invalid syntax (user_pass.py, line 1)"),
    ("pass raising at import", "run_gpt", ["--passes", "{tmp}/user_pass.py:my_pass"],
     a_pass("import os\nraise RuntimeError('first line\\nsecond line')\n"),
     "RuntimeError at {tmp}/user_pass.py:2: first line"),
    ("pass returning None", "run_gpt", ["--passes", "{tmp}/user_pass.py:my_pass"],
     a_pass("def my_pass(program, ctx):\n    return None\n"), "pass 'my_pass' returned NoneType"),
    ("top-k above the experts", "run_gpt", ["--num-experts", "4", "--moe-router-topk", "5"], None,
     "moe_router_topk=5 must be between 1 and num_experts=4 (its default is 2); give --moe-router-topk 1 to 4"),
    ("unknown router score", "run_gpt", ["--num-experts", "4", "--moe-router-score-function", "tanh"], None,
     "moe_router_score_function='tanh' must be softmax or sigmoid"),
    ("negative load-balancing weight", "run_gpt", ["--num-experts", "4", "--moe-aux-loss-coeff", "-1"], None,
     "moe_aux_loss_coeff=-1.0 must be 0 or more"),
    ("ep not dividing the experts", "run_gpt", ["--num-experts", "6", "--dp", "4", "--ep", "4"], None,
     "ep=4 does not divide num_experts=6 (each ep rank holds num_experts / ep of them); give an ep that divides both "
     "it and dp x cp = 4: 1, 2"),
    ("ep not dividing dp", "run_gpt", ["--num-experts", "4", "--dp", "2", "--expert-model-parallel-size", "4"], None,
     "ep=4 does not divide dp x cp = 2 (expert parallel folds into the data-parallel ranks, as in Megatron-Core); "
     "give a dp that is a multiple of 4"),
    ("ep without experts", "run_gpt", ["--dp", "2", "--ep", "2"], None,
     "ep=2 splits the experts, but the model has none; give --num-experts (a multiple of 2) or drop --ep"),
    ("ep with HSDP", "run_gpt", ["--num-experts", "4", "--dp", "4", "--ep", "2", "--data-parallel-sharding-strategy",
                                 "optim_grads_params", "--data-parallel-shard-size", "2"], None,
     "ep=2 and HSDP (data_parallel_shard_size) do not combine yet"),
    ("expert tensor parallel", "run_gpt", ["--num-experts", "4", "--tp", "2", "--expert-tensor-parallel-size", "2"],
     None, "expert_tensor_parallel_size=2: only 1 is built (every tp rank holds its experts whole)"),
    ("ep zero", "run_gpt", ["--num-experts", "4", "--ep", "0"], None, "ep=0 must be at least 1"),
    ("seq length not divisible by 2 * cp", "run_gpt", ["--cp", "2", "--seq-length", "14"], None,
     "seq_length=14 is not divisible by 2 * cp=2 = 4"),
    ("cp-comm-type a2a+p2p", "run_gpt", ["--cp", "2", "--cp-comm-type", "a2a+p2p"], None,
     "cp_comm_type='a2a+p2p' must be all_gather, p2p or a2a"),
    ("cp a2a with more cp ranks than heads", "run_gpt", ["--n-head", "4", "--cp", "8", "--cp-comm-type", "a2a",
                                                         "--check-plan"], None,
     "has 4 heads on this rank, which cp=8 does not divide; cp_comm_type a2a gives each cp rank 1/cp of the heads"),
    ("ZeRO-2 with zero bubble", "run_gpt", ["--n-layer", "4", "--pp", "2", "--dp", "2", "--pipeline-schedule",
                                            "zb1f1b", "--data-parallel-sharding-strategy", "optim_grads",
                                            "--micro-batch-size", "1"], None,
     "data_parallel_sharding_strategy optim_grads and --pipeline-schedule zb1f1b do not combine yet"),
    ("ZeRO-3 over cp alone", "run_gpt", ["--cp", "2", "--dp", "1", "--data-parallel-sharding-strategy",
                                         "optim_grads_params"], None,
     "optim_grads_params shards the weights over dp, which is 1 (cp=2 ranks hold them whole); use no_shard"),
    ("cp with HSDP", "run_gpt", ["--cp", "2", "--dp", "4", "--data-parallel-sharding-strategy", "optim_grads_params",
                                 "--data-parallel-shard-size", "2"], None,
     "HSDP (data_parallel_shard_size) and cp > 1 do not combine yet"),
    ("cp p2p with attention dropout", "run_gpt", ["--cp", "2", "--cp-comm-type", "p2p", "--dropout", "0.1",
                                                  "--check-plan"], None,
     "context_parallel: node scaled_dot_product_attention (aten.scaled_dot_product_attention.default) has "
     "attention dropout"),
    ("cp with a mask the p2p ring cannot take", "run_gpt", ["--arch", "{tmp}/masked.py:SPEC", "--cp", "2",
                                                           "--check-plan"],
     lambda tmp, saved: (tmp / "masked.py").write_text(MASKED_ATTENTION),
     "context_parallel: node scaled_dot_product_attention (aten.scaled_dot_product_attention.default) has an "
     "explicit attention mask, which context parallel takes whole (made of positions, not of the batch) and with "
     "cp_comm_type all_gather or a2a"),
    ("cp with a loss not linear in a mean over tokens", "run_gpt", ["--arch", "{tmp}/squared.py:SPEC", "--cp", "2",
                                                                    "--check-plan"],
     lambda tmp, saved: (tmp / "squared.py").write_text(SQUARED_MEAN),
     "(aten.pow.Tensor_Scalar) uses a mean over the rank's tokens other than linearly"),
    ("load a folder whose tracker is gone", "run_gpt", ["--load", "{tmp}/save", "--save", "{tmp}/save"],
     copy_checkpoint(lambda save: os.remove(save / TRACKER)),  # was: trained from 0, then wrote over iter_1
     "{tmp}/save holds iter_0000001 but no latest_checkpointed_iteration.txt (copied without it?); write the "
     "iteration to resume into it: echo 1 > {tmp}/save/latest_checkpointed_iteration.txt"),
    ("load one iteration's folder", "run_gpt", ["--load", "{saved}/save/" + ITERATION], None,
     "save/iter_0000001 is one checkpoint's folder; give the folder that holds it"),
    ("load a Hugging Face folder", "run_gpt", ["--load", "{tmp}"],
     lambda tmp, saved: (tmp / "config.json").write_text("{}"), "is a Hugging Face model; convert it first: "
                                                                "python -m gcompile.checkpoint import-hf"),
    ("save into a Hugging Face folder", "run_gpt", ["--save", "{tmp}"],
     lambda tmp, saved: (tmp / "config.json").write_text("{}"), "--save {tmp} is a Hugging Face model's folder, "
                                                                "which the run would write beside; save to a new folder"),
    # was: "convert it first: import-hf ... then give DIR", the advice for --load
    ("save over another run's checkpoint", "run_gpt", ["--save", "{tmp}/save"], copy_checkpoint(lambda save: None),
     "--save {tmp}/save holds another run's checkpoint (iter_0000001); resume it with --load {tmp}/save, or save "
     "to a new folder"),
    ("export into the checkpoint it reads", "checkpoint",
     ["export", "{tmp}/save", "--output", "{tmp}/save/" + ITERATION + "/__0_0.distcp"], copy_checkpoint(lambda _: None),
     "--output {tmp}/save/iter_0000001/__0_0.distcp is inside the checkpoint folder {tmp}/save it reads"),
    ("import-hf into a checkpoint", "checkpoint", ["import-hf", "{tmp}", "--save", "{tmp}/save"],
     copy_checkpoint(lambda _: None), "--save {tmp}/save holds files already; give a new or empty folder"),
    ("own model returning logits", "run_gpt", ["--arch", "{tmp}/logits.py:SPEC"],
     lambda tmp, saved: (tmp / "logits.py").write_text(LOGITS),  # was: a traceback deep inside autograd
     "Masked.forward returns a torch.float32 tensor of shape [2, 16, 257], not the loss: return the scalar loss"),
    ("own model naming its inputs otherwise", "run_gpt", ["--arch", "{tmp}/hf_names.py:SPEC"],
     lambda tmp, saved: (tmp / "hf_names.py").write_text(HF_NAMES),  # was: an AssertionError traceback from capture
     "Masked.forward(input_ids, labels) must take (idx, targets): gcompile calls forward(idx, targets)"),
    ("own model without targets", "run_gpt", ["--arch", "{tmp}/no_targets.py:SPEC"],
     lambda tmp, saved: (tmp / "no_targets.py").write_text(NO_TARGETS),  # was: TypeError, too many arguments
     "Masked.forward(idx) must take (idx, targets)"),
    ("own model's tp plan misspelt", "run_gpt", ["--arch", "{tmp}/typo.py:SPEC", "--tp", "2", "--check-plan"],
     lambda tmp, saved: (tmp / "typo.py").write_text(open(os.path.join(ROOT, "examples", "parallel_block.py")).read()
                                                    .replace('"blocks.*.qkv=column"', '"blocks.*.qkvv=column"')
                                                    .replace('"parallel_block"', '"misspelt_plan"')),
     "tp_plan entry 'blocks.*.qkvv=column' matches no module"),  # was: a GraphMismatch at another line
    ("own model returning two values", "run_gpt", ["--arch", "{tmp}/two.py:SPEC"],
     lambda tmp, saved: (tmp / "two.py").write_text(RETURNS_TWO),  # was: a traceback from lowering
     "Masked.forward returns 2 values; return the loss alone"),
    ("own model with a float64 loss", "run_gpt", ["--arch", "{tmp}/double.py:SPEC"],
     lambda tmp, saved: (tmp / "double.py").write_text(FLOAT64_LOSS),  # was: a traceback from the first backward
     "Masked.forward returns a torch.float64 loss: return it in float32"),
    ("own model ignoring the targets", "run_gpt", ["--arch", "{tmp}/untargeted.py:SPEC"],
     lambda tmp, saved: (tmp / "untargeted.py").write_text(IGNORES_TARGETS),  # was: trained on nothing, silently
     "Masked.forward never reads targets"),
    ("own model head narrower than the vocabulary", "run_gpt", ["--arch", "{tmp}/narrow.py:SPEC"],
     lambda tmp, saved: (tmp / "narrow.py").write_text(SMALL_HEAD),  # was: an IndexError from the first step
     "Masked's cross-entropy scores 100 classes, but token ids go up to vocab_size=257 - 1"),
    ("own model updating a buffer", "run_gpt", ["--arch", "{tmp}/batch_norm.py:SPEC"],
     lambda tmp, saved: (tmp / "batch_norm.py").write_text(BATCH_NORM),  # was: "returns 4 values", of a loss alone
     "Masked.forward updates norm.running_mean, norm.running_var, norm.num_batches_tracked in place at "
     "batch_norm.py:33: y = self.norm(self.embed(idx)"),
    ("own model branching on values", "run_gpt", ["--arch", "{tmp}/branches.py:SPEC"],
     lambda tmp, saved: (tmp / "branches.py").write_text(BRANCHES),  # was: torch.export's 250 lines
     "torch.export cannot capture Masked.forward(idx, targets): GuardOnDataDependentSymNode at {tmp}/branches.py:33: "),
    ("own model failing to build", "run_gpt", ["--arch", "{tmp}/broken.py:SPEC"],
     lambda tmp, saved: (tmp / "broken.py").write_text(FAILS_TO_BUILD),
     "model broken could not be built: ValueError at {tmp}/broken.py:28: no embedding for this vocabulary"),
    ("own model config not frozen", "run_gpt", ["--arch", "{tmp}/thawed.py:SPEC"],
     lambda tmp, saved: (tmp / "thawed.py").write_text(NOT_FROZEN),  # was: TypeError: unhashable type
     "its config 'MaskedConfig' is not a frozen dataclass; declare it with @dataclass(frozen=True)"),
    ("own model config field a run flag", "run_gpt", ["--arch", "{tmp}/lr.py:SPEC"],
     lambda tmp, saved: (tmp / "lr.py").write_text(SHARES_A_FLAG),  # was: --lr set the learning rate, not it
     "its config's lr (train) is also the run's, so its flag sets that instead; rename the field"),
    ("own model at tp 2 without a tp plan", "run_gpt", ["--arch", "{tmp}/two.py:SPEC", "--tp", "2"],
     lambda tmp, saved: (tmp / "two.py").write_text(MASKED_ATTENTION.replace('"masked"', '"plain"')),
     "tp=2, but the tp plan of plain cuts none of its parameters"),  # was: two ranks, each the whole model
    ("pass a module it cannot import", "run_gpt", ["--passes", "{tmp}/user_pass.py:my_pass"],
     a_pass("import no_such_module_of_mine\n"),  # was: "name a module importable from this folder"
     "ModuleNotFoundError at {tmp}/user_pass.py:1: No module named 'no_such_module_of_mine'"),
    ("pass that is no function", "run_gpt", ["--passes", "{tmp}/user_pass.py:my_pass"], a_pass("my_pass = 42\n"),
     "is a int, not a function"),
    ("own model function returning a number", "run_gpt", ["--arch", "{tmp}/number.py:SPEC"],
     lambda tmp, saved: (tmp / "number.py").write_text(NOT_A_MODULE),
     "model number: its module(config) returned a int, not a torch.nn.Module"),
    ("own model a function of arguments", "run_gpt", ["--arch", "json:loads"], None,
     "model 'json:loads': calling it for its ModelSpec raised TypeError"),
    ("tracker with a non-ASCII digit", "run_gpt", ["--load", "{tmp}/save"],
     copy_checkpoint(lambda save: (save / TRACKER).write_text("\u0661\n")), "expected an iteration number in ASCII"),
    ("gcompile.json missing a key", "run_gpt", ["--load", "{tmp}/save"],
     copy_checkpoint(edit_meta(lambda meta: meta.pop("consumed_samples"))), "gcompile.json: no 'consumed_samples'"),
    ("gcompile.json with negative samples", "run_gpt", ["--load", "{tmp}/save"],
     copy_checkpoint(edit_meta(lambda meta: meta.update(consumed_samples=-100))),  # was: a traceback mid-run
     "'consumed_samples' is -100, not a count this run could have reached"),
    ("gcompile.json with a key of another shape", "checkpoint", ["export", "{tmp}/save", "--output", "{tmp}/m.pt"],
     copy_checkpoint(edit_meta(lambda meta: meta["keys"][next(iter(meta["keys"]))].update(shape=[10 ** 11]))),
     "is [100000000000] there, "),  # was: an allocation of 400 GB
    ("gcompile.json with a model size of a wrong type", "checkpoint", ["export", "{tmp}/save", "--output",
                                                                         "{tmp}/m.pt"],
     copy_checkpoint(edit_meta(lambda meta: meta["config"]["model"].update(n_embd="x"))),
     "'config.model.n_embd' is \"x\", of the wrong type"),
    ("an iteration's files copied into another's folder", "run_gpt", ["--load", "{tmp}/save"],
     copy_checkpoint(lambda save: (os.rename(save / ITERATION, save / "iter_0000004"),
                                   (save / TRACKER).write_text("4\n"))),
     "gcompile.json records iteration 1 but lies in iter_0000004 (files copied between iterations?)"),
    ("gcompile.json of a wrong type", "checkpoint", ["export", "{tmp}/save", "--output", "{tmp}/model.pt"],
     copy_checkpoint(edit_meta(lambda meta: meta["layout"].update(tp="2"))), "'layout.tp' is \"2\", of the wrong type"),
    (".metadata missing", "run_gpt", ["--load", "{tmp}/save"],
     copy_checkpoint(lambda save: os.remove(save / ITERATION / ".metadata")), "no .metadata; the checkpoint is incomplete"),
    (".metadata truncated", "checkpoint", ["export", "{tmp}/save", "--output", "{tmp}/model.pt"],
     copy_checkpoint(truncate_metadata), ".metadata: not DCP metadata"),
    ("export under a file", "checkpoint", ["export", "{saved}/save", "--output", "{tmp}/file/model.pt"], a_file,
     "--output {tmp}/file/model.pt: {tmp}/file is a file"),
    ("export of a file", "checkpoint", ["export", "{tmp}/file", "--output", "{tmp}/model.pt"], a_file,
     "{tmp}/file is a file; give the folder a run saved to (its --save DIR)"),  # was: "no such folder"
    ("export over a file", "checkpoint", ["export", "{saved}/save", "--output", "{tmp}/file"], a_file,
     "--output {tmp}/file exists; name a new file, or remove that one first"),  # was: replaced without a word
    ("export-hf into a model's folder", "checkpoint", ["export-hf", "{saved}/save", "{tmp}/hf"],
     lambda tmp, saved: ((tmp / "hf").mkdir(), a_file(tmp / "hf", name="config.json")),
     "{tmp}/hf holds files already; give a new or empty folder for the export"),  # was: another model's config.json
    # and weights replaced, its shards left beside
    ("generate temperature nan", "checkpoint", ["generate", "{saved}/model.pt", "--temperature", "nan"], None,
     "--temperature nan must be above 0"),  # was: a traceback from torch.multinomial
    ("generate a torch file of something else", "checkpoint", ["generate", "{tmp}/other.pt"],
     lambda tmp, saved: torch.save({"weights": torch.zeros(2)}, tmp / "other.pt"),
     "other.pt: not a gpt2 model exported by gcompile.checkpoint: it holds no model and model_args"),  # was: "its
    # model_args are not a gpt2 config's ('model_args'); is --model-name right?"
    ("generate a text file", "checkpoint", ["generate", "{tmp}/text.pt"],
     lambda tmp, saved: (tmp / "text.pt").write_text("hello\n"),
     "give a file `export` wrote (python -m gcompile.checkpoint export SAVE --output FILE)"),  # was: no fix
    ("generate a folder", "checkpoint", ["generate", "{tmp}"], None,
     "{tmp} is a folder; give the file export wrote"),
    ("generate from NaN weights", "checkpoint", ["generate", "{tmp}/nan.pt"], nan_export,
     "{tmp}/nan.pt: its transformer.wte.weight holds NaN or infinite values"),
    ("generate with model_args of another model", "checkpoint", ["generate", "{saved}/model.pt", "--model-name",
                                                                   "llama"], None,
     "not a llama model exported by gcompile.checkpoint: its model_args are not a llama config's"),
    ("config a device", "run_gpt", ["--config", "/dev/zero"], None,
     "--config /dev/zero is not a regular file (a device or a pipe)"),  # was: read until memory ran out
    ("blend weights past a float", "run_gpt", ["--data-path", "1e308", "{tmp}/a", "1e308", "{tmp}/b"], None,
     "the weights sum to more than a float holds"),
    ("prepare workers 100000", "data", ["prepare", "--input", "{tmp}/file", "--output", "{tmp}/out",
                                        "--workers", "100000"], a_file, "--workers 100000: give 1 to 256"),
    ("generate top-k -5", "checkpoint", ["generate", "{saved}/model.pt", "--top-k", "-5"], None,
     "--top-k -5 must be 0 (all tokens) or more"),
    ("inspect a file", "inspect", ["{tmp}/file"], a_file, "{tmp}/file is a file; give the folder run_gpt.py "
     "--dump-graphs DIR wrote"),
    ("inspect rank0 a file", "inspect", ["{tmp}/dump"], dump_folder(lambda dump: a_file(dump, name="rank0")),
     "rank0 is a file where a rank folder belongs"),
    ("inspect non-UTF-8 dump", "inspect", ["{tmp}/dump"], dump_folder(non_utf8_rank0), "schedule.txt: not UTF-8"),
    ("inspect an empty schedule.txt", "inspect", ["{tmp}/dump"],
     dump_folder(lambda dump: ((dump / "rank0").mkdir(), (dump / "rank0" / "schedule.txt").write_text(""))),
     "rank0/schedule.txt is empty: a dump writes none (was it cut short?)"),  # was: an IndexError
    ("inspect an empty graph file", "inspect", ["{tmp}/dump", "show", "0", "lower"],
     dump_folder(lambda dump: ((dump / "rank0").mkdir(), (dump / "rank0" / "02_lower_stage0.txt").write_text(""))),
     "rank0/02_lower_stage0.txt is empty"),  # was: nothing printed, status 0
    ("inspect a summary.txt cut short", "inspect", ["{tmp}/dump"],
     dump_folder(lambda dump: ((dump / "rank0").mkdir(),
                               (dump / "rank0" / "summary.txt").write_text("# per iteration\nall_reduce tp\n"))),
     "summary.txt: cannot read 'all_reduce tp' under '# per iteration'"),  # was: a ValueError
    ("inspect index.txt of a huge range", "inspect", ["{tmp}/dump"],
     dump_folder(lambda dump: ((dump / "rank0").mkdir(), (dump / "index.txt").write_text("rank0: ranks 0-10000000000\n"))),
     "index.txt: cannot read 'rank0: ranks 0-10000000000'"),  # was: a MemoryError listing them
    ("inspect a rank whose folder is gone", "inspect", ["{tmp}/dump", "show", "2"],
     dump_folder(lambda dump: ((dump / "rank1").mkdir(), (dump / "index.txt").write_text("rank0: ranks 0,2\nrank1: ranks 1,3\n"))),
     "index.txt of {tmp}/dump names rank0/ for rank 2, and there is no such folder"),  # was: "no rank 2; ranks: 0..3"
    ("dump into a folder with a plan.txt of the user's", "run_gpt", ["--dump-graphs", "{tmp}"],
     lambda tmp, saved: (tmp / "plan.txt").write_text("my own plan\n"),  # was: deleted without a word
     "--dump-graphs {tmp} holds plan.txt, which no dump wrote; give an empty folder or one a dump wrote"),
    ("run dir that cannot be made", "run_gpt", ["--run-dir", "/proc/gcompile-run"], None,
     "--run-dir /proc/gcompile-run: cannot make the folder"),  # was: a traceback from every rank
    ("hang timeout under a second", "run_gpt", ["--hang-timeout-s", "0.001"], None,
     "hang-timeout-s=0.001: the watchdog looks once a second"),  # was: a healthy run called hung
    ("hang timeout past the clock", "run_gpt", ["--hang-timeout-s", "1e30"], None,
     "hang-timeout-s=1e+30 must be 0 (no watchdog) or positive, at most 100,000,000 (about 1157 days)"),
    ("rope theta infinite", "run_gpt", ["--arch", "llama", "--n-kv-head", "1", "--rope-theta", "inf"], None,
     "rope-theta=inf must be a finite number"),  # was: trained, its rotary embedding turned off
    ("norm eps infinite", "run_gpt", ["--arch", "llama", "--n-kv-head", "1", "--norm-eps", "1e400"], None,
     "norm-eps=inf must be a finite number"),  # was: trained, every RMSNorm's output 0
    ("load-balancing loss coefficient infinite", "run_gpt", ["--num-experts", "4", "--moe-aux-loss-coeff", "inf"],
     None, "moe-aux-loss-coeff=inf must be a finite number"),  # was: planned, and stopped at its first loss
    ("vocab padding past the vocab", "run_gpt", ["--make-vocab-size-divisible-by", "99999999999999999999"], None,
     "make-vocab-size-divisible-by=99999999999999999999 is more than the vocabulary's 257 ids"),  # was: at tp 2 a
    # stack of torch's C++ frames; at 10^6, 2 million padded rows planned without a word
    ("vocab padding past a small vocab", "run_gpt", ["--vocab-size", "65", "--make-vocab-size-divisible-by", "256"],
     None, "make-vocab-size-divisible-by=256 is more than the vocabulary's 65 ids: under tp the vocabulary is padded "
           "to a multiple of it times tp; give at most 128"),  # the default, 128, serves a vocab of 65
    ("collective timeout past the clock", "run_gpt", ["--distributed-timeout-minutes", "1e30"], None,
     "distributed-timeout-minutes=1e+30 must be positive and at most 1,666,666 (about 1157 days)"),  # was: a
    # traceback from every rank's init_process_group
    ("inspect index.txt garbled", "inspect", ["{tmp}/dump", "show", "3"], dump_folder(garbled_index),
     "index.txt: cannot read 'rank0: ranks zero to seven'"),
    ("world-size without auto-layout", "run_gpt", ["--world-size", "4"], None,
     "--world-size is what --auto-layout plans for"),
    ("auto-layout without world-size", "run_gpt", ["--auto-layout"], None,
     "--auto-layout plans for --world-size N ranks"),
    ("auto-layout machine missing", "run_gpt", ["--auto-layout", "--world-size", "2", "--machine", "{tmp}/m.json"],
     None, "no machine file {tmp}/m.json; make one with: python -m gcompile.calibrate --out {tmp}/m.json"),
    ("plan world-size 0", "plan", ["--world-size", "0"], None, "--world-size 0 must be from 1 to 1,099,511,627,776"),
    ("plan world-size 10^23", "plan", ["--world-size", str(10 ** 23)], None,
     f"--world-size {10 ** 23} must be from 1 to 1,099,511,627,776"),  # its divisors were sought for minutes
    ("plan workers 0", "plan", ["--world-size", "2", "--workers", "0"], None, "--workers 0 must be at least 1"),
    ("plan workers not a number", "plan", ["--world-size", "2", "--workers", "two"], None,
     "argument --workers: invalid int value: 'two' (python -m gcompile.plan --help lists the flags)"),
    ("plan no world size", "plan", [], None, "the following arguments are required: --world-size"),
    ("plan flag misspelt", "plan", ["--world-size", "2", "--schedul", "1f1b"], None,
     "unrecognized arguments: --schedul; did you mean --schedules for --schedul?"),  # was: --dump-schedule, a
    # run_gpt.py flag: the planner's own were not offered
    ("plan cp comm type unknown", "plan", ["--world-size", "2", "--cp-comm-types", "p2p,ring"], None,
     "--cp-comm-types 'p2p,ring': choose from all_gather, p2p, a2a"),
    ("plan run flag is not a prefix of a plan flag", "plan", ["--world-size", "2", "--micro-batch-size", "abc"], None,
     "--micro-batch-size='abc' is not a valid int"),  # not --micro-batch-sizes: flags are never abbreviated
    ("calibrate unknown flag", "calibrate", ["--bogus"], None, "unrecognized arguments: --bogus"),
    ("inspect no folder", "inspect", [], None, "the following arguments are required: dir"),
    ("metrics.jsonl a folder", "run_gpt", ["--run-dir", "{tmp}/mine"],
     lambda tmp, saved: (tmp / "mine" / "metrics.jsonl").mkdir(parents=True),
     "--run-dir {tmp}/mine: {tmp}/mine/metrics.jsonl is not a file (a folder?)"),  # was: IsADirectoryError after
    # the build
    ("Megatron's flag that has no namesake", "run_gpt", ["--recompute-granularity", "full", "--micro-batch", "2"], None,
     "--recompute-granularity is Megatron's: --recompute-activations recomputes each stage's whole forward "
     "(Megatron's full); without it the partitioner already recomputes the cheap ops (as selective does); "
     "unrecognized arguments: --micro-batch 2; did you mean --micro-batch-size"),  # was: "did you mean
    # --recompute-activations", and --hierarchical-context-parallel-sizes was offered --context-parallel-size
    ("vocab on an inner linear", "run_gpt", ["--n-embd", "48", "--tp", "2", "--tp-plan",
                                             "transformer.h.*.mlp.c_fc=vocab,transformer.h.*.mlp.c_proj=row"], None,
     "the input is cut by transformer.h.0.mlp.c_fc into 128 a rank, 256 in all where it takes 192 (vocab pads the "
     "rows it cuts"),  # was: "needs its input cut on the last dim ...; the input is cut ... on dim 2", the last
    ("row after replicate", "run_gpt", ["--tp", "2", "--tp-plan", "transformer.h.*.attn.c_attn=column,"
                                        "transformer.h.*.attn.c_proj=row,transformer.h.*.mlp.c_proj=row"], None,
     "is row-parallel (transformer.h.0.mlp.c_proj) and needs its input cut on the last dim by a column-parallel "
     "linear; the input is replicated"),
    ("load a folder that does not exist", "run_gpt", ["--load", "{tmp}/typo", "--save", "{tmp}/save"], None,
     "--load {tmp}/typo: no such folder; give the folder a run saved to"),  # was: trained from iteration 0
    ("a switch given a value", "run_gpt", ["--check-plan=false"], None,
     "--check-plan takes no value; give --check-plan alone to turn it on, leave it out for off"),  # was: argparse's
    # "ignored explicit argument 'false'" alone
    ("inspect with the folder after show", "inspect", ["show", "{tmp}", "0"], None,
     "the dump folder comes first: python -m gcompile.inspect {tmp} show 0"),  # was: "invalid choice: '{tmp}'"
    ("export no output", "checkpoint", ["export", "{tmp}"], None,
     "python -m gcompile.checkpoint export: error: the following arguments are required: --output"),
    ("data no command", "data", [], None, "python -m gcompile.data: error: the following arguments are required"),
    ("plan schedules", "plan", ["--world-size", "2", "--schedules", "1f2b"], None,
     "--schedules '1f2b': choose from 1f1b, zb1f1b, interleaved"),
    ("plan micro-batch sizes", "plan", ["--world-size", "2", "--micro-batch-sizes", "0,2"], None,
     "--micro-batch-sizes '0,2': give positive whole numbers"),
    ("machine file not json", "plan", ["--world-size", "2", "--machine", "{tmp}/file"], a_file,
     "{tmp}/file is not a machine file: it is not JSON (Expecting value: line 1 column 1 (char 0)); give a file "
     "python -m gcompile.calibrate wrote, or measure this machine with: python -m gcompile.calibrate"),
    ("check-plan machine a README", "run_gpt", ["--check-plan", "--machine", "{tmp}/README.md"],
     lambda tmp, saved: (tmp / "README.md").write_text("# my project\n"),  # was: advised calibrate --out README.md
     "{tmp}/README.md is not a machine file: it is not JSON"),
    ("machine file with a negative time", "plan", ["--world-size", "1", "--machine", "{tmp}/m.json"],
     machine_file_with(op_seconds=-1), "machine file {tmp}/m.json is not one gcompile.calibrate wrote: op_seconds "
                                       "is -1, not a non-negative finite number"),  # was: ranked at -2e6 ms
    ("machine file with a rate of 0", "run_gpt", ["--check-plan", "--machine", "{tmp}/m.json"],
     machine_file_with(bandwidth={"gpu": 0}), "bandwidth.gpu is 0, not a positive finite number"),  # was: a
    # ZeroDivisionError after every program was built
    ("machine file not UTF-8", "plan", ["--world-size", "1", "--machine", "{tmp}/m.json"], not_utf8("m.json"),
     "machine file {tmp}/m.json cannot be read ('utf-8' codec can't decode byte 0xff"),
    ("machine file a pipe", "plan", ["--world-size", "1", "--machine", "{tmp}/m.json"], a_pipe("m.json"),
     "machine file {tmp}/m.json is not a regular file"),  # was: read for ever
    ("machine given to a run", "run_gpt", ["--machine", "{tmp}/m.json"], None,
     "--machine is what --check-plan, --dump-only and --auto-layout predict with"),  # was: silently unread
    ("one GPU's machine file, 2 ranks", "plan", ["--world-size", "2", "--machine", ONE_GPU], None,
     "measured no collectives (one GPU: nccl needs two), so it predicts one rank, not 2"),
    ("auto-layout with one GPU's machine file", "run_gpt", ["--auto-layout", "--world-size", "2", "--machine", ONE_GPU],
     None, "measured no collectives (one GPU: nccl needs two), so it predicts one rank, not 2"),
    ("check-plan machine missing", "run_gpt", ["--tp", "2", "--check-plan", "--machine", "{tmp}/m.json"], None,
     "no machine file {tmp}/m.json; make one with: python -m gcompile.calibrate --out {tmp}/m.json"),
    ("check-plan with one GPU's machine file", "run_gpt", ["--tp", "2", "--check-plan", "--machine", ONE_GPU], None,
     "measured no collectives (one GPU: nccl needs two), so it predicts one rank, not 2"),
    ("plan budget 0", "plan", ["--world-size", "2", "--memory-budget-gb", "0"], None,
     "--memory-budget-gb 0 must be a positive finite number"),
    ("plan budget nan", "plan", ["--world-size", "2", "--memory-budget-gb", "nan"], None,
     "--memory-budget-gb nan must be a positive finite number"),  # was: every layout built, then refused
    ("plan with a run's action", "plan", ["--world-size", "2", "--check-plan"], None,
     "--check-plan: run_gpt.py's, not the planner's; it plans only"),
    ("plan nothing to try", "plan", ["--world-size", "2", "--micro-batch-sizes", "3", "--machine", "{tmp}/none.json"],
     None,  # named before the machine file, which is missing
     "no layout of 2 ranks to try: no --micro-batch-sizes entry times a dp size divides --global-batch-size"),
    ("plan top negative", "plan", ["--world-size", "2", "--top", "-1"], None, "--top -1 must be 0 or more"),
    ("machine file a folder", "plan", ["--world-size", "2", "--machine", "{tmp}"], None,
     "machine file {tmp} is a folder; give the file in it"),
    ("calibrate out a folder", "calibrate", ["--out", "{tmp}"], None,
     "--out '{tmp}': that is a folder; give a file name, e.g. {tmp}/machine.json"),  # before minutes of measuring
    ("calibrate out a folder's name", "calibrate", ["--out", "{tmp}/new/"], None,
     "--out '{tmp}/new/': that names no file; give a file name"),  # was: measured, then no file to write
    ("calibrate out a device", "calibrate", ["--out", "/dev/null"], None,
     "--out '/dev/null': that is not a regular file (a device or a pipe); give a file name"),
    ("calibrate out under a file", "calibrate", ["--out", "{tmp}/file/m.json"], a_file,
     "--out '{tmp}/file/m.json': {tmp}/file is a file where a folder should be"),
    ("calibrate out a config", "calibrate", ["--out", "{tmp}/tiny.toml"],
     lambda tmp, saved: (tmp / "tiny.toml").write_text("[model]\nn_layer = 2\n"),  # was: replaced by machine JSON
     "--out '{tmp}/tiny.toml' is not a machine file: it is not JSON"),
    ("bisect a cp layout", "inspect", ["bisect", "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--cp", "2"],
     None, "bisect does not compare context-parallel layouts yet"),  # was: context_parallel named divergent
    ("bisect tol negative", "inspect", ["bisect", "--tol", "-1"], None, "--tol -1 must be positive"),
    ("calibrate show missing", "calibrate", ["--show", "--out", "{tmp}/none.json"], None,
     "no machine file {tmp}/none.json"),
    ("prepare output empty", "data", ["prepare", "--input", "{tmp}/file", "--output", ""], a_file,
     "--output '' names no file"),
]


def run_cli(cli: str, argv: list[str]) -> int:
    try:
        return CLIS[cli](argv)
    except SystemExit as e:  # gcompile.data exits instead of returning
        return e.code


@pytest.mark.parametrize("name, cli, argv, setup, message", CASES, ids=[case[0] for case in CASES])
def test_bad_input_is_one_line(name, cli, argv, setup, message, tmp_path, capsys, caplog, monkeypatch, request):
    def saved():
        return request.getfixturevalue("saved_run")

    if setup is not None:
        setup(tmp_path, saved)
    argv = [a.replace("{tmp}", str(tmp_path)).replace("{saved}", str(saved())) if "{saved}" in a
            else a.replace("{tmp}", str(tmp_path)) for a in argv]
    if cli == "run_gpt":
        argv = TINY + ["--run-dir", str(tmp_path / "run")] + argv
    launches = []
    monkeypatch.setattr(run_gpt, "run_ranks", lambda *args: launches.append(args) or run_ranks(*args))
    monkeypatch.chdir(tmp_path)  # what a case that fails writes to its working folder stays in tmp_path
    had_run_dir = os.path.exists(tmp_path / "run")
    status = run_cli(cli, argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2, (status, err)
    assert len(err) == 1 and message.replace("{tmp}", str(tmp_path)) in err[0], err
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING], "logged (with tracebacks)"
    assert not launches or name in REFUSED_IN_THE_BUILD, "refused only after run_ranks was called"
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl"), "a training step ran"
    if cli == "run_gpt" and not launches:
        assert os.path.exists(tmp_path / "run") == had_run_dir, "a refused run left its empty run folder"


def test_prompt_that_is_not_utf8_is_one_line(saved_run):
    """Raw bytes in argv: what Python makes of them only a real process shows."""
    result = subprocess.run([sys.executable, "-m", "gcompile.checkpoint", "generate", str(saved_run / "model.pt"),
                             "--prompt", b"def \xff\xfe".decode("utf-8", "surrogateescape")],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines() == [
        "python -m gcompile.checkpoint: error: --prompt is not valid UTF-8 (at character 4); give UTF-8 text"]


def test_small_valid_part_is_one_warning(tmp_path, capsys):
    """A valid part smaller than one batch only weights its samples: a warning, not a refusal."""
    tokens(np.uint16, list(range(200)))(tmp_path)
    config = data.DataConfig(str(tmp_path / "corpus"), split="9,1")
    train, valid = data.build_datasets(config, seq_length=16, seed=0)
    data.check_batches(config, train, valid, global_batch_size=4, evaluates=True)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning:") and "the valid part holds 1 samples" in err[0], err
    data.check_batches(config, train, valid, global_batch_size=4, evaluates=False)
    assert capsys.readouterr().err == ""
