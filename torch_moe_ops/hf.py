"""Drop-in for Hugging Face transformers models: their sparse-MoE blocks on our ops.

Legend: B batch, S sequence, T tokens (B * S), H hidden size, I expert
intermediate size, E experts, K experts per token, F = 2 * I.

    report = torch_moe_ops.hf.patch(model)      # in place; report says what changed
    model = torch.compile(model, backend=torch_moe_ops.backend(experts="triton"))

`patch` replaces every sparse-MoE block of a supported family with an
`HFMoEBlock` that routes with ``moe::route`` and runs the experts with
``moe::experts``; attention, norms and dense MLP layers are not touched.

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
  swiglu_oai with the experts' ``alpha``/``limit``, expert biases; converted once.

What the rest of the model relies on is kept:

- Submodules keep their transformers names (``gate``/``router``, ``experts``,
  ``shared_expert``, ``shared_expert_gate``, ``shared_experts``), so
  ``state_dict`` keys, ``save_pretrained`` and ``load_state_dict`` are unchanged.
- The router stays the same object: its class becomes a subclass of its own
  class whose ``forward`` computes the logits as transformers does (in the
  activation dtype, DeepSeek-V3 in fp32) and calls ``moe::route``. The
  ``OutputRecorder`` that transformers installs on the router class for
  ``output_router_logits`` therefore still matches, and hooks it already
  installed stay. The router returns ``(logits [T, E], weights [T, K] fp32,
  ids [T, K] int32)``; transformers returns weights in the logits dtype (except
  Mixtral and DeepSeek-V3) and int64 ids, which nothing downstream reads.
- Blocks return what they returned: ``[B, S, H]``, and for GPT-OSS
  ``([B, S, H], router_scores [T, K])`` with the scores in the activation dtype.
- Expert weights are the transformers tensors themselves where their layout is
  ours (``gate_up_proj [E, 2I, H]`` gate rows then up rows, ``down_proj [E, H, I]``).
  GPT-OSS stores ``gate_up_proj [E, H, 2I]`` with gate and up interleaved and
  ``down_proj [E, I, H]``: those are copied once, at patch time, into non-persistent
  buffers. The copies do not follow later changes of the originals (reloading
  weights needs a fresh model and a new `patch`); the report counts them in
  `PatchReport.converted_weights`, and the block raises in training mode with
  gradients enabled rather than train a copy.

Routing is computed exactly as transformers does, with two differences that do
not change results: DeepSeek-V3 renormalizes with ``sum + 1e-20`` and we divide
by the sum (the same in fp32 for any sum above 1e-13), and both mask groups that
are not selected with -inf (transformers 4.x used 0.0, which differs only when
every eligible ``sigmoid + correction bias`` is negative). Kernel choice happens
at compile time (`torch_moe_ops.backend`), so `patch` takes no backend.

Not supported (the block is left as it is and `PatchReport.skipped` says why):
per-expert ``nn.ModuleList`` experts (the transformers 4.x layout; every family
above stores fused 3-D experts from transformers 5.0 on), expert-parallel or
quantized experts, activations other than silu/gelu, blocks carrying hooks
(accelerate offloading), and routing our ops cannot express (e.g. groups of
one expert).

Importing this module also registers ``"torch_moe_ops"`` in transformers'
experts interface (`register_experts_implementation`), so
``from_pretrained(..., experts_implementation="torch_moe_ops")`` and
``model.set_experts_implementation("torch_moe_ops")`` run the experts of any
model whose experts use the canonical layout on ``moe::experts`` (the routing
stays transformers').
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

import torch_moe_ops.backends  # noqa: F401  (installs the eager kernels of the ops)
from torch_moe_ops.config import MoEConfig
from torch_moe_ops.ops.checks import FLOAT_DTYPES

EXPERTS_IMPLEMENTATION = "torch_moe_ops"

# transformers' ``hidden_act`` names whose gated MLP our ``activation`` computes exactly.
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu"}


class _Unsupported(Exception):
    """A block `patch` leaves as it is; the message goes to `PatchReport.skipped`."""


def _activation(hidden_act: object) -> str:
    if hidden_act not in ACTIVATIONS:
        raise _Unsupported(f"hidden_act must be one of {', '.join(map(repr, ACTIVATIONS))}, "
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
    the family's config attribute names; ``layout`` is ``"canonical"`` (experts
    used in place) or ``"gpt_oss"`` (converted once).
    """

    name: str
    block_class: str
    router: str
    make_config: Callable[..., MoEConfig]
    logits_in_fp32: bool = False
    layout: str = "canonical"
    shared_expert: Optional[str] = None
    shared_expert_gate: Optional[str] = None
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


class RoutedRouter(nn.Module):
    """Mixed in front of a transformers router class by `patch`.

    ``forward(hidden_states [..., H]) -> (logits [T, E], weights [T, K] fp32,
    ids [T, K] int32)``: the logits as transformers computes them (its dtype, or
    fp32 where ``logits_in_fp32``), the rest from ``moe::route``. Uses the router's
    own ``weight [E, H]``, ``bias [E]`` (``router_bias``) and
    ``e_score_correction_bias [E]`` (``correction_bias``).
    """

    moe_config: MoEConfig
    logits_in_fp32: bool

    def forward(self, hidden_states: torch.Tensor):
        cfg = self.moe_config
        x_TH = hidden_states.reshape(-1, cfg.hidden_size)
        weight_EH = self.weight
        bias_E = self.bias if cfg.router_bias else None
        if self.logits_in_fp32:
            x_TH, weight_EH = x_TH.float(), weight_EH.float()
        logits_TE = F.linear(x_TH, weight_EH, bias_E)
        # The buffer is fp32 when loaded (transformers keeps it so), but a later
        # model.to(bfloat16) casts it; moe::route wants fp32.
        correction_E = self.e_score_correction_bias.float() if cfg.correction_bias else None
        topk_weights_TK, topk_ids_TK = torch.ops.moe.route(
            logits_TE, correction_E, cfg.top_k, cfg.scoring, cfg.renormalize,
            cfg.num_expert_groups, cfg.topk_groups, cfg.routed_scaling_factor)
        return logits_TE, topk_weights_TK, topk_ids_TK

    def __reduce_ex__(self, protocol):
        # The class is made at patch time and cannot be found by name: pickle (torch.save,
        # deepcopy) rebuilds it from the transformers class it extends.
        return _unpickle_router, (type(self).__bases__[1],), self.__dict__


def _routed_router_class(hf_class: type) -> type:
    """A subclass of the transformers router class ``hf_class`` whose forward is
    `RoutedRouter.forward`, with the same name so the model prints as before."""
    return type(hf_class.__name__, (RoutedRouter, hf_class), {"__module__": __name__})


def _unpickle_router(hf_class: type) -> nn.Module:
    return nn.Module.__new__(_routed_router_class(hf_class))


@dataclasses.dataclass(frozen=True)
class ExpertWeights:
    """Where each canonical expert tensor comes from: ``shared`` maps our name
    (``w13``, ``w2``, ``b13``, ``b2``) to the experts module's attribute used in
    place; ``converted`` maps our name to (the attribute it was converted from,
    the copy in our layout)."""

    shared: dict[str, str]
    converted: dict[str, tuple[str, torch.Tensor]]


def _canonical_weights(experts: nn.Module, cfg: MoEConfig) -> ExpertWeights:
    num_experts, hidden, inter = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    _check_shape(experts, "gate_up_proj", (num_experts, 2 * inter, hidden))
    _check_shape(experts, "down_proj", (num_experts, hidden, inter))
    return ExpertWeights(shared={"w13": "gate_up_proj", "w2": "down_proj"}, converted={})


def _gpt_oss_weights(experts: nn.Module, cfg: MoEConfig) -> ExpertWeights:
    num_experts, hidden, inter = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    _check_shape(experts, "gate_up_proj", (num_experts, hidden, 2 * inter))
    _check_shape(experts, "gate_up_proj_bias", (num_experts, 2 * inter))
    _check_shape(experts, "down_proj", (num_experts, inter, hidden))
    _check_shape(experts, "down_proj_bias", (num_experts, hidden))
    with torch.no_grad():
        # Columns 0, 2, 4, ... are the gate, 1, 3, 5, ... the up projection.
        gate_up_EHF = experts.gate_up_proj.detach()
        w13_EFH = torch.cat([gate_up_EHF[..., 0::2], gate_up_EHF[..., 1::2]], dim=-1)
        bias_EF = experts.gate_up_proj_bias.detach()
        converted = {
            "w13": ("gate_up_proj", w13_EFH.transpose(1, 2).contiguous()),
            "b13": ("gate_up_proj_bias", torch.cat([bias_EF[:, 0::2], bias_EF[:, 1::2]], dim=-1)),
            "w2": ("down_proj", experts.down_proj.detach().transpose(1, 2).contiguous()),
        }
    return ExpertWeights(shared={"b2": "down_proj_bias"}, converted=converted)


LAYOUTS = {"canonical": _canonical_weights, "gpt_oss": _gpt_oss_weights}
EXPERT_TENSORS = ("w13", "w2", "b13", "b2")


def _check_shape(experts: nn.Module, name: str, expected: tuple[int, ...]) -> None:
    tensor = getattr(experts, name, None)
    if not isinstance(tensor, torch.Tensor):
        raise _Unsupported(f"{type(experts).__name__} has no tensor {name!r}")
    if tuple(tensor.shape) != expected:
        raise _Unsupported(f"{type(experts).__name__}.{name} must have shape {expected} "
                           f"(from the config), got {tuple(tensor.shape)}")
    if tensor.dtype not in FLOAT_DTYPES:
        raise _Unsupported(f"{type(experts).__name__}.{name} must be float32/float16/bfloat16 "
                           f"(quantized experts are not supported), got {tensor.dtype}")


class HFMoEBlock(nn.Module):
    """A transformers sparse-MoE block running on ``moe::route`` and ``moe::experts``.

    ``forward(hidden_states [B, S, H]) -> [B, S, H]`` (GPT-OSS: also
    ``router_scores [T, K]``)::

        logits, w, ids = router(x)                       # moe::route inside
        y = experts(x, w, ids)                           # moe::experts
        y += sigmoid(shared_expert_gate(x)) * shared_expert(x)   # Qwen2-MoE
        y += shared_experts(x)                           # DeepSeek-V3

    Built by `patch`; keeps the block's submodules under their transformers names.
    """

    def __init__(self, block: nn.Module, family: Family, cfg: MoEConfig, weights: ExpertWeights):
        super().__init__()
        self.family = family.name
        self.cfg = cfg
        for name, child in block.named_children():
            self.add_module(name, child)
        self.router_name = family.router
        self.shared_expert_name = family.shared_expert
        self.shared_expert_gate_name = family.shared_expert_gate
        self.returns_router_scores = family.returns_router_scores
        # Mixtral multiplies its input by uniform(1 - j, 1 + j) noise in training.
        self.jitter_noise = float(getattr(block, "jitter_noise", 0.0))
        self.weight_sources = tuple(
            ("experts", weights.shared[name]) if name in weights.shared
            else ("self", name) if name in weights.converted else None
            for name in EXPERT_TENSORS)
        self.converted_names = tuple(source for source, _ in weights.converted.values())
        for name, (_, tensor) in weights.converted.items():
            # Not persistent: the state dict keeps transformers' own tensors only.
            self.register_buffer(name, tensor, persistent=False)
        self.train(block.training)

    def expert_weights(self):
        """``(w13 [E, 2I, H], w2 [E, H, I], b13 [E, 2I] or None, b2 [E, H] or None)``."""
        return tuple(None if source is None
                     else getattr(self if source[0] == "self" else self.experts, source[1])
                     for source in self.weight_sources)

    def forward(self, hidden_states: torch.Tensor):
        cfg = self.cfg
        if self.training and torch.is_grad_enabled() and self.converted_names:
            raise RuntimeError(
                f"this {self.family} block runs on copies of experts."
                f"{', experts.'.join(self.converted_names)} made at patch time: gradients would "
                "not reach those parameters. Train the unpatched model, or run under "
                "model.eval() or torch.no_grad()")
        x_TH = hidden_states.reshape(-1, cfg.hidden_size)
        if self.training and self.jitter_noise > 0:
            x_TH = x_TH * torch.empty_like(x_TH).uniform_(1.0 - self.jitter_noise,
                                                          1.0 + self.jitter_noise)
        _, topk_weights_TK, topk_ids_TK = getattr(self, self.router_name)(x_TH)
        w13_EFH, w2_EHI, b13_EF, b2_EH = self.expert_weights()
        y_TH = torch.ops.moe.experts(x_TH, topk_weights_TK, topk_ids_TK, w13_EFH, w2_EHI,
                                     b13_EF, b2_EH, cfg.activation, cfg.swiglu_alpha,
                                     cfg.swiglu_limit)
        if self.shared_expert_name is not None:
            shared_TH = getattr(self, self.shared_expert_name)(x_TH)
            if self.shared_expert_gate_name is not None:
                gate_T1 = getattr(self, self.shared_expert_gate_name)(x_TH)
                shared_TH = torch.sigmoid(gate_T1) * shared_TH
            y_TH = y_TH + shared_TH
        y = y_TH.view(hidden_states.shape)
        if self.returns_router_scores:
            return y, topk_weights_TK.to(hidden_states.dtype)
        return y

    def extra_repr(self) -> str:
        return (f"family={self.family}, experts={self.cfg.num_experts}, top_k={self.cfg.top_k}, "
                f"scoring={self.cfg.scoring}, converted={list(self.converted_names)}")


@dataclasses.dataclass(frozen=True)
class PatchedBlock:
    """One replaced block: its module name, family, and which expert tensors it
    uses in place (``shared``, transformers names) or copied (``converted``)."""

    name: str
    family: str
    shared: tuple[str, ...]
    converted: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class PatchReport:
    """What `patch` did: ``blocks`` replaced (in model order) and ``skipped``
    (module name -> why it was left as it is)."""

    blocks: tuple[PatchedBlock, ...]
    skipped: dict[str, str]

    @property
    def patched(self) -> list[str]:
        return [block.name for block in self.blocks]

    @property
    def shared_weights(self) -> int:
        """Expert tensors used in place (same storage as the transformers parameter)."""
        return sum(len(block.shared) for block in self.blocks)

    @property
    def converted_weights(self) -> int:
        """Expert tensors copied once into our layout."""
        return sum(len(block.converted) for block in self.blocks)

    @property
    def families(self) -> dict[str, int]:
        """Blocks replaced per family."""
        counts: dict[str, int] = {}
        for block in self.blocks:
            counts[block.family] = counts.get(block.family, 0) + 1
        return counts

    def __str__(self) -> str:
        families = ", ".join(f"{name}: {count}" for name, count in self.families.items())
        lines = [f"patched {len(self.blocks)} MoE blocks ({families or 'none'}); expert tensors: "
                 f"{self.shared_weights} shared, {self.converted_weights} converted"]
        lines += [f"skipped {name}: {reason}" for name, reason in self.skipped.items()]
        return "\n".join(lines)


def _qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _looks_like_moe(module: nn.Module) -> bool:
    return isinstance(getattr(module, "experts", None), nn.Module)


def _prepare(block: nn.Module, family: Family, model_config):
    """The block's `MoEConfig` and expert weights, or `_Unsupported` with the reason."""
    experts = getattr(block, "experts", None)
    if isinstance(experts, nn.ModuleList):
        raise _Unsupported("per-expert nn.ModuleList experts (the transformers 4.x layout) "
                           "are not supported; transformers >= 5.0 builds fused [E, 2I, H] "
                           "experts")
    if experts is None or not isinstance(getattr(block, family.router, None), nn.Module):
        raise _Unsupported(f"expected submodules 'experts' and {family.router!r}, got "
                           f"{[name for name, _ in block.named_children()]}")
    if getattr(experts, "_is_expert_parallel", False):
        raise _Unsupported("expert-parallel experts (tp_plan / distributed_config) are not "
                           "supported")
    if (block._forward_hooks or block._forward_pre_hooks or hasattr(block, "_hf_hook")):
        raise _Unsupported("the block carries hooks (e.g. accelerate offloading) that a "
                           "replacement would lose; patch before adding them")
    config = getattr(experts, "config", None) or model_config
    if config is None:
        raise _Unsupported("no transformers config on the experts module or the model")
    try:
        cfg = family.make_config(config, experts)
    except AttributeError as error:
        raise _Unsupported(f"the {family.name} config or experts module lacks a field: "
                           f"{error}") from None
    except ValueError as error:
        raise _Unsupported(f"routing not expressible with moe::route: {error}") from None
    return cfg, LAYOUTS[family.layout](experts, cfg)


def _route_with_ops(router: nn.Module, family: Family, cfg: MoEConfig,
                    routed_classes: dict[type, type]) -> None:
    """Give ``router`` a subclass of its own class whose forward calls ``moe::route``."""
    hf_class = type(router)
    if hf_class not in routed_classes:
        routed_classes[hf_class] = _routed_router_class(hf_class)
    router.__class__ = routed_classes[hf_class]
    router.moe_config = cfg
    router.logits_in_fp32 = family.logits_in_fp32


def patch(model: nn.Module) -> PatchReport:
    """Replace, in place, every sparse-MoE block of a supported family in ``model``.

    Each block of Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3 or GPT-OSS
    (transformers >= 5 layout) becomes an `HFMoEBlock` computing the same
    function with ``moe::route`` and ``moe::experts``; the kernels are chosen when
    the model is compiled with `torch_moe_ops.backend`. Blocks that cannot be
    expressed are left as they are and listed in ``PatchReport.skipped`` with the
    reason, as are MoE-like blocks of other families. Returns the report.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    model_config = getattr(model, "config", None)
    blocks: list[PatchedBlock] = []
    skipped: dict[str, str] = {}
    routed_classes: dict[type, type] = {}
    for name, block in list(model.named_modules()):
        if isinstance(block, HFMoEBlock):
            skipped[name] = "already patched"
            continue
        family = FAMILIES.get(_qualified_name(type(block)))
        if family is None:
            if _looks_like_moe(block):
                skipped[name] = (f"{type(block).__name__} is not a supported family "
                                 f"({', '.join(f.name for f in FAMILIES.values())})")
            continue
        if not name:
            raise ValueError(f"model must contain MoE blocks, not be one: got a bare "
                             f"{type(block).__name__}; patch the model that holds it")
        try:
            cfg, weights = _prepare(block, family, model_config)
        except _Unsupported as reason:
            skipped[name] = str(reason)
            continue
        _route_with_ops(getattr(block, family.router), family, cfg, routed_classes)
        parent_name, _, child_name = name.rpartition(".")
        model.get_submodule(parent_name).add_module(
            child_name, HFMoEBlock(block, family, cfg, weights))
        blocks.append(PatchedBlock(name=name, family=family.name,
                                   shared=tuple(weights.shared.values()),
                                   converted=tuple(source for source, _
                                                   in weights.converted.values())))
    return PatchReport(blocks=tuple(blocks), skipped=skipped)


def _interface_weights(experts: nn.Module):
    """``(w13, w2, b13, b2, activation, alpha, limit)`` of a ``@use_experts_implementation``
    module, or ValueError if its layout or activation is not ours."""
    name = type(experts).__name__
    flags = {"has_gate": True, "is_concatenated": True, "is_transposed": False,
             "has_post_expert_norm": False}
    for flag, expected in flags.items():
        if getattr(experts, flag, expected) != expected:
            raise ValueError(
                f"experts_implementation={EXPERTS_IMPLEMENTATION!r} needs {flag}={expected} "
                f"(gate_up_proj [E, 2I, H] gate rows then up rows, down_proj [E, H, I]), got "
                f"{name} with {flag}={not expected}; torch_moe_ops.hf.patch(model) converts "
                f"the supported families once instead")
    from transformers.integrations.moe import _default_apply_gate

    if getattr(type(experts), "_apply_gate", _default_apply_gate) is not _default_apply_gate:
        raise ValueError(f"experts_implementation={EXPERTS_IMPLEMENTATION!r} computes "
                         f"act(gate) * up; {name} defines its own _apply_gate")
    activation = ACTIVATIONS.get(getattr(experts.config, "hidden_act", None))
    if activation is None:
        raise ValueError(f"experts_implementation={EXPERTS_IMPLEMENTATION!r} needs hidden_act in "
                         f"{', '.join(map(repr, ACTIVATIONS))}, got "
                         f"{getattr(experts.config, 'hidden_act', None)!r} for {name}")
    has_bias = getattr(experts, "has_bias", False)
    # alpha and limit only shape swiglu_oai: pass MoEConfig's defaults (class attributes).
    return (experts.gate_up_proj, experts.down_proj,
            experts.gate_up_proj_bias if has_bias else None,
            experts.down_proj_bias if has_bias else None, activation,
            MoEConfig.swiglu_alpha, MoEConfig.swiglu_limit)


def experts_forward(experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers experts implementation ``"torch_moe_ops"``: ``moe::experts`` on the
    module's own ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` (and biases).

    ``hidden_states [T, H]``, ``top_k_index [T, K]`` (int), ``top_k_weights [T, K]``
    (float) -> ``[T, H]`` in ``hidden_states``' dtype. Expert-parallel sentinels
    (ids >= E) become our skip id -1.
    """
    w13_EFH, w2_EHI, b13_EF, b2_EH, activation, alpha, limit = _interface_weights(experts)
    topk_ids_TK = top_k_index
    if getattr(experts, "_is_expert_parallel", False):
        topk_ids_TK = topk_ids_TK.masked_fill(topk_ids_TK >= w13_EFH.shape[0], -1)
    # Under autocast the activations can reach here in another dtype than the weights.
    y_TH = torch.ops.moe.experts(hidden_states.to(w13_EFH.dtype), top_k_weights, topk_ids_TK,
                                 w13_EFH, w2_EHI, b13_EF, b2_EH, activation, alpha, limit)
    return y_TH.to(hidden_states.dtype)


def register_experts_implementation() -> bool:
    """Register `experts_forward` as transformers' experts implementation
    ``"torch_moe_ops"``. Returns False, registering nothing, when transformers or
    its experts interface (transformers >= 5) is not installed."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError:
        return False
    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, experts_forward)
    return True


register_experts_implementation()
