"""The `[model]` keys of a mixture of experts, shared by every model family that offers one (no torch here,
so that reading flags needs none); gcompile/models/moe.py is the layer."""

from dataclasses import dataclass, fields


SCORE_FUNCTIONS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int = 0
    """0: one MLP per block; E > 0: each block's MLP becomes E experts of its shape and a router
    (mixture of experts, gcompile/models/moe.py; Megatron's --num-experts)."""
    moe_router_topk: int = 2
    """Experts each token goes to (Megatron's --moe-router-topk); every token reaches all of them (dropless)."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the Switch load-balancing loss added to the loss (Megatron's --moe-aux-loss-coeff)."""
    moe_router_score_function: str = "softmax"
    """softmax (over the top-k logits) or sigmoid (DeepSeek-V3's: the top-k sigmoid scores, normalized)."""
    moe_shared_expert_intermediate_size: int = 0
    """Hidden size of a shared expert every token also goes through (DeepSeek's); 0: none."""


def mlp_width(config: MoEConfig, ffn_hidden_size: int) -> int:
    """The MLP hidden width one token's matmuls see: its k experts' and the shared expert's (Megatron's
    FLOPs formula; the router's small matmul left out, as there)."""
    if not config.num_experts:
        return ffn_hidden_size
    return config.moe_router_topk * ffn_hidden_size + config.moe_shared_expert_intermediate_size


def moe_errors(config: MoEConfig) -> list[str]:
    if config.num_experts < 0:
        return [f"num_experts={config.num_experts} must be 0 (a dense MLP) or more"]
    errors = []
    if config.num_experts and not 1 <= config.moe_router_topk <= config.num_experts:
        errors.append(f"moe_router_topk={config.moe_router_topk} must be between 1 and num_experts="
                      f"{config.num_experts} (its default is 2); give --moe-router-topk "
                      f"{'1' if config.num_experts == 1 else f'1 to {config.num_experts}'}")
    if config.moe_router_score_function not in SCORE_FUNCTIONS:
        errors.append(f"moe_router_score_function={config.moe_router_score_function!r} must be "
                      f"{' or '.join(SCORE_FUNCTIONS)}")
    if config.moe_shared_expert_intermediate_size < 0:
        errors.append(f"moe_shared_expert_intermediate_size={config.moe_shared_expert_intermediate_size} must be "
                      f"0 (none) or more")
    if not config.moe_aux_loss_coeff >= 0:
        errors.append(f"moe_aux_loss_coeff={config.moe_aux_loss_coeff} must be 0 or more (a negative weight "
                      f"rewards imbalance)")
    return errors


def idle_settings(config: MoEConfig) -> list[str]:
    """A line for each expert setting that a model without experts ignores (gcompile.config.idle_flags)."""
    if config.num_experts:
        return []
    defaults = MoEConfig()
    return [f"--{f.name.replace('_', '-')} does nothing without --num-experts (a model of dense MLPs has no experts "
            f"to route to)" for f in fields(MoEConfig)
            if f.name != "num_experts" and getattr(config, f.name) != getattr(defaults, f.name)]
