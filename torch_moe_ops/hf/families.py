"""The transformers sparse-MoE blocks `patch` knows, and their routing as `MoEConfig`.

Families (transformers block class: routing as `MoEConfig` options; expert weights):

- mixtral (MixtralSparseMoeBlock): softmax, top-k, always renormalized; used in place.
- qwen2_moe (Qwen2MoeSparseMoeBlock): softmax, top-k, renormalized if
  ``norm_topk_prob``; used in place; the sigmoid-gated shared expert is kept.
- qwen3_moe (Qwen3MoeSparseMoeBlock), olmoe (OlmoeSparseMoeBlock): softmax,
  top-k, renormalized if ``norm_topk_prob``; used in place.
- deepseek_v3 (DeepseekV3MoE): sigmoid, selection on ``+ e_score_correction_bias``,
  ``n_group``/``topk_group`` groups, renormalized if ``norm_topk_prob``, times
  ``routed_scaling_factor``; used in place; the shared experts are kept.
- gpt_oss (GptOssMLP): top-k of the biased logits, softmax over those k;
  swiglu_oai with the experts' ``alpha``/``limit``, expert biases; converted
  (`torch_moe_ops.hf.weights`).

A family whose routing or activation our ops cannot express raises `Unsupported`
from its config builder; `patch` then leaves the block as it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torch import nn

from torch_moe_ops.config import MoEConfig

# transformers' ``hidden_act`` names whose gated MLP our ``activation`` computes exactly.
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu"}


class Unsupported(Exception):
    """A block `patch` leaves as it is; the message goes to `PatchReport.skipped`."""


def _activation(hidden_act: object) -> str:
    if hidden_act not in ACTIVATIONS:
        raise Unsupported(f"hidden_act must be one of {', '.join(map(repr, ACTIVATIONS))}, "
                          f"got {hidden_act!r}")
    return ACTIVATIONS[hidden_act]


def _mixtral(config, experts) -> MoEConfig:
    # MixtralTopKRouter renormalizes the top-k probabilities unconditionally.
    return MoEConfig(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                     num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
                     scoring="softmax", renormalize=True,
                     activation=_activation(config.hidden_act))


def _qwen2_moe(config, experts) -> MoEConfig:
    return MoEConfig(hidden_size=config.hidden_size,
                     intermediate_size=config.moe_intermediate_size,
                     num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                     scoring="softmax", renormalize=bool(config.norm_topk_prob),
                     activation=_activation(config.hidden_act),
                     shared_expert_intermediate_size=config.shared_expert_intermediate_size,
                     shared_expert_gate=True)


def _qwen3_moe(config, experts) -> MoEConfig:
    return MoEConfig(hidden_size=config.hidden_size,
                     intermediate_size=config.moe_intermediate_size,
                     num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                     scoring="softmax", renormalize=bool(config.norm_topk_prob),
                     activation=_activation(config.hidden_act))


def _olmoe(config, experts) -> MoEConfig:
    return MoEConfig(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                     num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                     scoring="softmax", renormalize=bool(config.norm_topk_prob),
                     activation=_activation(config.hidden_act))


def _deepseek_v3(config, experts) -> MoEConfig:
    return MoEConfig(hidden_size=config.hidden_size,
                     intermediate_size=config.moe_intermediate_size,
                     num_experts=config.n_routed_experts, top_k=config.num_experts_per_tok,
                     scoring="sigmoid", correction_bias=True,
                     renormalize=bool(config.norm_topk_prob),
                     num_expert_groups=config.n_group or 1, topk_groups=config.topk_group or 1,
                     routed_scaling_factor=float(config.routed_scaling_factor),
                     activation=_activation(config.hidden_act),
                     shared_expert_intermediate_size=(config.moe_intermediate_size
                                                      * (config.n_shared_experts or 0)))


def _gpt_oss(config, experts) -> MoEConfig:
    # alpha and limit come from the experts module: transformers 5.17 hard-codes
    # them there, later versions copy them from the config.
    return MoEConfig(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                     num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
                     scoring="topk_softmax", router_bias=True, activation="swiglu_oai",
                     swiglu_alpha=float(experts.alpha), swiglu_limit=float(experts.limit),
                     expert_bias=True)


@dataclasses.dataclass(frozen=True)
class Family:
    """How one transformers sparse-MoE block maps onto our ops.

    ``make_config(hf_config, experts_module) -> MoEConfig`` reads the routing from
    the family's config attribute names; ``layout`` names the experts' weight
    layout in `torch_moe_ops.hf.weights.LAYOUTS`: ``"canonical"`` (used in place)
    or ``"gpt_oss"`` (converted).
    """

    name: str
    block_class: str
    router: str
    make_config: Callable[..., MoEConfig]
    logits_in_fp32: bool = False
    layout: str = "canonical"
    shared_expert: str | None = None
    shared_expert_gate: str | None = None
    returns_router_scores: bool = False


def _models(path: str) -> str:
    return "transformers.models." + path


FAMILIES = {family.block_class: family for family in (
    Family("mixtral", _models("mixtral.modeling_mixtral.MixtralSparseMoeBlock"), "gate",
           _mixtral),
    Family("qwen2_moe", _models("qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock"), "gate",
           _qwen2_moe, shared_expert="shared_expert", shared_expert_gate="shared_expert_gate"),
    Family("qwen3_moe", _models("qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock"), "gate",
           _qwen3_moe),
    Family("olmoe", _models("olmoe.modeling_olmoe.OlmoeSparseMoeBlock"), "gate", _olmoe),
    Family("deepseek_v3", _models("deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE"), "gate",
           _deepseek_v3, logits_in_fp32=True, shared_expert="shared_experts"),
    Family("gpt_oss", _models("gpt_oss.modeling_gpt_oss.GptOssMLP"), "router", _gpt_oss,
           layout="gpt_oss", returns_router_scores=True),
)}


def family_of(module: nn.Module) -> Family | None:
    """The `Family` whose block class ``module`` is exactly (not a subclass), or None."""
    cls = type(module)
    return FAMILIES.get(f"{cls.__module__}.{cls.__qualname__}")
