"""Random layouts against one device, every rank in this process: what no listed test case combines.

    python -m tests.sweep                      # 40 layouts, seed 0, fp32: a few minutes here
    python -m tests.sweep --layouts 100 --seed 7
    python -m tests.sweep --bf16               # against single-device bf16 eager, bf16's tolerances

Each layout draws its model (GPT-2, Llama with or without a tied head, either with experts, the
examples' own model) and tp, pp, dp, cp and its flavour, the schedule and vpp, uneven pipeline
layers, sequence parallel, the sharding strategy (HSDP too), overlapped buckets, the micro-batch
size, recompute and ep; a draw the config or a pass refuses (a2a's heads over cp) is skipped
(`--show-refused` prints why). It trains 3 steps on random tokens in gcompile.harness and is
compared with single-device eager autograd + AdamW (tests/reference.py): each line says OK or BAD
and the layout's flags, which a test case or `python run_gpt.py` takes as they are. Exit status 1
where any layout is BAD. It found the distributed optimizer's gradient norm 4.7e-4 low at cp2 dp2
ep2, which no test combined.
"""

import argparse
import random
import sys
import time

import torch

from gcompile import harness
from gcompile.config import ConfigError, parse_args, validate
from gcompile.pass_manager import PassError
from gcompile.pipeline import BuildCache
from tests.reference import ADAM_EPS, random_batches, reference_run, rel_err

LRS = [1e-3, 8e-4, 6e-4]
FP32_TOL = 1e-5
"""Losses and grad norms, as the suite's numerics tests."""
FP32_PARAM_TOL = 1e-3
"""Final parameters, looser than the suite's 1e-5, whose cases are picked: on random tokens an element of a
bias's gradient can be a near-total cancellation (4e-6 from terms of 0.3: the examples' model at tp2, seed 24),
whose rounding differs by summation order by a part in 400, and AdamW's step, lr * g / (|g| + eps), carries that
into the bias (1.3e-4 there; 8.6e-7 at tp1, one order). AdamW's steps hardly see a gradient's scale, so a wrong
reduction shows in the loss and the grad norm (1e-5) first, where the sweep's one find did (4.7e-4)."""
BF16_TOLS = (1e-3, 1e-2, 3e-2)
"""Loss, grad norm, matrices (not biases, 2-D experts' ones neither) under --bf16, as tests/test_data_parallel.py's
BF16_*_TOL say why; the matrices' 3e-2, not 1e-2, for tp: a row-parallel linear's partial sums are rounded to bf16
before the all-reduce (as Megatron's are), where one device's matmul accumulates them in fp32 (Llama's o_proj at
tp2 1.8e-2, at dp4 7.9e-3, over 3 steps of 4 layers)."""
REFUSED_AT_MOST = 200
"""Refused draws per trained layout past which the sweep stops: a config or check that refuses every draw
(vocab padding larger than its vocab did) would otherwise keep it drawing, silent, for ever."""
MODELS = {
    "gpt2": [],
    "llama": ["--arch", "llama", "--n-kv-head", "2", "--ffn-hidden-size", "48"],
    "moe": ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01"],
    "llama-moe": ["--arch", "llama", "--n-kv-head", "2", "--ffn-hidden-size", "48", "--num-experts", "4"],
    "own": ["--arch", "examples/parallel_block.py:SPEC"],
}
SHAPE = ["--n-layer", "4", "--n-head", "4", "--n-embd", "32", "--block-size", "32", "--seq-length", "16",
         "--vocab-size", "96", "--lr", "1e-3", "--clip-grad", "0.5", "--weight-decay", "0.1",
         "--adam-eps", str(ADAM_EPS), "--eval-interval", "0"]


def draw_model(rng: random.Random, bf16: bool) -> list[str]:
    """Under bf16 every token goes to every expert. Picking the top 2 is not continuous: two correct bf16
    computations that round apart (the ring's blocks in fp32, SDPA's bf16 kernel with its probabilities in bf16)
    can pick different experts for a token whose scores nearly tie, and its gradients then differ by far more
    than rounding (--cp 2 --cp-comm-type p2p, seed 15: the weights' gradients 4e-2 from fp32's after one step,
    against 7e-3 at top 4, at seed 3, without experts, or for all_gather and a2a, which run one device's kernel)."""
    name = rng.choice(list(MODELS))
    flags = [*SHAPE, *MODELS[name]]
    if name == "llama" and rng.random() < 0.5:
        flags.append("--tie-word-embeddings")
    if name == "moe" and rng.random() < 0.4:
        flags += ["--moe-router-score-function", "sigmoid", "--moe-shared-expert-intermediate-size", "32"]
    if bf16 and "--num-experts" in flags:
        at = flags.index("--moe-router-topk") if "--moe-router-topk" in flags else len(flags)
        flags[at:at + 2] = ["--moe-router-topk", flags[flags.index("--num-experts") + 1]]
    return flags


def draw_layout(rng: random.Random, experts: bool) -> list[str]:
    """Layout flags, the batch sizes last (the one-device reference takes those alone)."""
    tp, pp, dp, cp = rng.choice([1, 1, 2, 4]), rng.choice([1, 2, 2, 4]), rng.choice([1, 2, 4]), rng.choice([1, 1, 2])
    flags = ["--tp", str(tp), "--pp", str(pp), "--dp", str(dp), "--cp", str(cp)]
    if cp > 1:
        flags += ["--cp-comm-type", rng.choice(["p2p", "all_gather", "a2a"])]
    if tp > 1 and rng.random() < 0.5:
        flags.append("--sequence-parallel")
    if pp > 1:
        schedule = rng.choice(["1f1b", "zb1f1b", "interleaved", "gpipe"])
        flags += ["--pipeline-schedule", schedule]
        if schedule == "interleaved":
            flags += ["--virtual-pipeline-size", "2"]
        elif rng.random() < 0.2:
            flags += ["--pipeline-layers", "3,1" if pp == 2 else "1,1,1,1"]
    if dp * cp > 1:
        strategy = rng.choice(["no_shard", "optim", "optim_grads", "optim_grads_params"])
        flags += ["--data-parallel-sharding-strategy", strategy]
        if strategy == "optim_grads_params" and dp == 4 and rng.random() < 0.5:
            flags += ["--data-parallel-shard-size", "2"]
        if rng.random() < 0.3:
            flags.append("--overlap-grad-reduce")
    if experts and dp * cp % 2 == 0 and rng.random() < 0.5:
        flags += ["--ep", "2"]
    if rng.random() < 0.2:
        flags.append("--recompute-activations")
    micro = rng.choice([1, 2])
    return flags + ["--micro-batch-size", str(micro), "--global-batch-size", str(micro * dp * rng.choice([1, 2, 4]))]


def errors(result, expected, bf16: bool) -> tuple[float, float, float, str]:
    """(worst loss, worst grad norm, worst parameter error, that parameter's name) over the steps."""
    loss = max(abs(result.losses[s] - r.loss) / r.loss for s, r in enumerate(expected))
    norm = max(abs(result.grad_norms[s] - r.grad_norm) / r.grad_norm for s, r in enumerate(expected))
    final = expected[-1].model_params if bf16 else expected[-1].params
    param, name = max((rel_err(result.params[n].float(), v.float()), n) for n, v in final.items()
                      if not bf16 or v.dim() == 2 and not n.endswith("bias"))
    return loss, norm, param, name


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layouts", type=int, default=40, help="layouts to train (refused draws not counted)")
    p.add_argument("--seed", type=int, default=0, help="draws the layouts; the same seed, the same layouts")
    p.add_argument("--bf16", action="store_true", help="train in bf16 against single-device bf16 eager")
    p.add_argument("--show-refused", action="store_true", help="print each draw the config or a pass refused, and why")
    args = p.parse_args()
    if args.layouts < 1:
        p.error(f"--layouts {args.layouts} must be at least 1")
    rng, cache, bad, draws, tried, last_refusal = random.Random(args.seed), BuildCache(), 0, 0, 0, None
    loss_tol, norm_tol, param_tol = BF16_TOLS if args.bf16 else (FP32_TOL, FP32_TOL, FP32_PARAM_TOL)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    while tried < args.layouts:
        if draws - tried >= REFUSED_AT_MOST * (tried + 1):  # a config every draw breaks
            sys.exit(f"tests/sweep.py: {draws - tried} draws refused, {tried} trained; the last: {last_refusal}")
        draws += 1
        model = draw_model(rng, args.bf16) + (["--bf16"] if args.bf16 else [])
        layout = draw_layout(rng, "--num-experts" in model)
        try:
            config, _ = parse_args(model + layout)
            validate(config)
        except ConfigError as e:
            last_refusal = e
            if args.show_refused:
                print(f"refused {' '.join(layout)}: {e}", flush=True)
            continue
        one_device, _ = parse_args(model + layout[-4:])
        batches = random_batches(config, len(LRS), seed=tried + 1)
        start = time.perf_counter()
        try:
            (result,) = harness.run_layouts([config], batches, LRS, cache=cache)
        except PassError as e:  # a pass that cannot cut this model so (a2a's heads over cp): one line in a run
            last_refusal = e
            if args.show_refused:
                print(f"refused {' '.join(layout)}: {e}", flush=True)
            continue
        tried += 1
        loss, norm, param, name = errors(result, reference_run(one_device, batches, LRS, dtype=dtype), args.bf16)
        ok = loss < loss_tol and norm < norm_tol and param < param_tol
        bad += not ok
        print(f"{'OK ' if ok else 'BAD'} {' '.join(model[len(SHAPE):])} {' '.join(layout)}: loss {loss:.1e}, "
              f"grad norm {norm:.1e}, worst parameter {param:.1e} ({name}); {time.perf_counter() - start:.0f} s",
              flush=True)
    print(f"{tried} layouts ({draws - tried} draws refused): {tried - bad} OK, {bad} BAD")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
