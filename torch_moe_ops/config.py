"""Configuration of an MoE block (`MoEConfig`) and of the kernels that run it (`BackendSpec`).

Both are frozen dataclasses validated at construction: a bad value raises
`ValueError` naming the field, the value received and what is allowed. Their
fields reach the custom ops as compile-time constants, never as graph inputs.
"""

from __future__ import annotations

import dataclasses
import math

import torch

SCORINGS = ("softmax", "topk_softmax", "sigmoid")
ACTIVATIONS = ("silu", "gelu", "swiglu_oai")
EXPERTS_BACKEND_NAMES = ("auto", "reference", "cpu", "triton", "grouped_mm", "flashinfer")
A2A_BACKEND_NAMES = ("none", "allgather", "all_to_all", "deepep", "flashinfer")
FLOAT_FIELDS = ("routed_scaling_factor", "swiglu_alpha", "swiglu_limit")
# What a layer may ask its tokens to travel in (`backends.dispatch_dtype` resolves
# the choice per layer; today only the activations' own dtype has kernels, fp8
# falls back with a warning). Quantized experts have no kernel yet.
DISPATCH_DTYPES = (None, torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
QUANT_METHODS = (None,)


def worst_case_capacity(max_tokens_per_rank: int, top_k: int, num_local_experts: int) -> int:
    """Most rows one expert-parallel rank can send another: each of its tokens sends
    one row per chosen expert on that rank, at most ``min(top_k, experts per rank)``."""
    return max_tokens_per_rank * min(top_k, num_local_experts)


def _fail(field: str, got: object, expected: str) -> None:
    raise ValueError(f"{field} must be {expected}, got {got!r}")


def _check_positive_int(field: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        _fail(field, value, "a positive int")


def _check_choice(field: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        _fail(field, value, "one of " + ", ".join(repr(a) for a in allowed))


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Shapes, routing and activation of one MoE block.

    Routing (``scoring``), with ``logits [T, E]``:

    - ``"softmax"``: ``p = softmax(logits)``; ``w, ids = topk(p, top_k)``;
      ``w /= w.sum()`` if ``renormalize`` (Mixtral, Qwen-MoE, OLMoE).
    - ``"topk_softmax"``: ``v, ids = topk(logits, top_k)``; ``w = softmax(v)`` (GPT-OSS).
    - ``"sigmoid"``: ``s = sigmoid(logits)``; experts are chosen on
      ``s + correction_bias`` (if ``correction_bias``), the weights are the unbiased
      ``s[ids]``, renormalized if asked (DeepSeek-V3).

    With ``num_expert_groups > 1`` selection is group-limited in every family: a
    group's score is the sum of its two best selection scores (``p``, the raw
    ``logits`` for ``"topk_softmax"``, ``s + correction_bias``), only the
    ``topk_groups`` best groups stay eligible, and ``top_k`` experts are chosen
    among theirs; the weights follow from the chosen experts as above. Every
    family ends with ``w *= routed_scaling_factor``.

    Experts compute ``act(x @ w13[e].T + b13[e]) @ w2[e].T + b2[e]`` where
    ``w13 [E, 2I, H]`` holds the gate rows then the up rows and ``act`` is
    ``silu(gate) * up``, ``gelu(gate) * up`` or ``swiglu_oai``:
    ``gate = min(gate, limit)``, ``up = clamp(up, -limit, limit)``,
    ``(up + 1) * gate * sigmoid(alpha * gate)``.

    Shared experts (``shared_expert_intermediate_size > 0``) are one gated MLP
    applied to every token, optionally scaled by ``sigmoid(x @ w_gate)``
    (``shared_expert_gate``, as Qwen2-MoE does).

    Expert parallelism (``ep_size > 1``): each of ``ep_size`` ranks holds
    ``num_experts // ep_size`` experts and tokens travel to them and back in
    static buffers sized by ``max_tokens_per_rank`` (required: the most tokens
    one rank passes in one call) and ``ep_capacity`` (rows one rank may send
    another; ``None`` is the worst case, which never overflows; a smaller one
    moves fewer bytes, and a batch that overflows it raises on every rank).
    """

    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    scoring: str = "softmax"
    renormalize: bool = False
    correction_bias: bool = False
    num_expert_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    router_bias: bool = False
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    expert_bias: bool = False
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    ep_size: int = 1
    max_tokens_per_rank: int | None = None
    ep_capacity: int | None = None

    def __post_init__(self) -> None:
        for field in ("hidden_size", "intermediate_size", "num_experts", "top_k",
                      "num_expert_groups", "topk_groups", "ep_size"):
            _check_positive_int(field, getattr(self, field))
        if self.top_k > self.num_experts:
            _fail("top_k", self.top_k, f"<= num_experts ({self.num_experts})")
        _check_choice("scoring", self.scoring, SCORINGS)
        _check_choice("activation", self.activation, ACTIVATIONS)
        for field in ("renormalize", "correction_bias", "router_bias", "expert_bias",
                      "shared_expert_gate"):
            if not isinstance(getattr(self, field), bool):
                _fail(field, getattr(self, field), "a bool")
        if self.num_experts % self.num_expert_groups:
            _fail("num_expert_groups", self.num_expert_groups,
                  f"a divisor of num_experts ({self.num_experts})")
        if self.topk_groups > self.num_expert_groups:
            _fail("topk_groups", self.topk_groups,
                  f"<= num_expert_groups ({self.num_expert_groups})")
        if self.num_expert_groups > 1:
            group_size = self.num_experts // self.num_expert_groups
            if group_size < 2:
                _fail("num_expert_groups", self.num_expert_groups,
                      "small enough that each group holds at least 2 experts "
                      f"(num_experts={self.num_experts})")
            if self.top_k > self.topk_groups * group_size:
                _fail("top_k", self.top_k,
                      f"<= topk_groups * experts per group ({self.topk_groups * group_size})")
        if self.correction_bias and self.scoring != "sigmoid":
            _fail("correction_bias", self.correction_bias, "False unless scoring='sigmoid'")
        for field in FLOAT_FIELDS:
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                _fail(field, value, "a positive float")
            if not math.isfinite(value):
                _fail(field, value, "a finite float")
        size = self.shared_expert_intermediate_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            _fail("shared_expert_intermediate_size", size, "an int >= 0 (0 means none)")
        if self.shared_expert_gate and size == 0:
            _fail("shared_expert_gate", True,
                  "False when there is no shared expert (shared_expert_intermediate_size=0)")
        if self.num_experts % self.ep_size:
            _fail("ep_size", self.ep_size, f"a divisor of num_experts ({self.num_experts})")
        self._check_ep_sizes()
        # Not a field: equality, hashing, repr and dataclasses.replace ignore it.
        object.__setattr__(self, "_float_text",
                           {field: repr(float(getattr(self, field))) for field in FLOAT_FIELDS})

    def static_float(self, field: str) -> float:
        """The float field ``field`` (one of `FLOAT_FIELDS`), read so that
        ``torch.compile`` keeps it a compile-time constant.

        Dynamo makes a float attribute that forward reads a graph input once shapes
        are dynamic (``dynamic=True``, or after the value changed between calls):
        the op then receives ``.item()`` of a tensor and Dynamo restarts its
        analysis. A string is always a constant to Dynamo, guarded by value, and
        ``float()`` of a constant is folded while tracing: the value reaches the op
        as a literal, and equal configs share one graph.
        """
        return float(self._float_text[field])

    def _check_ep_sizes(self) -> None:
        for field in ("max_tokens_per_rank", "ep_capacity"):
            if getattr(self, field) is not None:
                _check_positive_int(field, getattr(self, field))
        if self.ep_size == 1:
            for field in ("max_tokens_per_rank", "ep_capacity"):
                if getattr(self, field) is not None:
                    _fail(field, getattr(self, field), "None when ep_size == 1")
            return
        if self.max_tokens_per_rank is None:
            _fail("max_tokens_per_rank", None,
                  f"a positive int when ep_size > 1 (got ep_size={self.ep_size}): the "
                  "largest token count one rank sends, which sizes the static buffers")
        if self.ep_capacity is not None and self.ep_capacity > self.worst_case_capacity:
            _fail("ep_capacity", self.ep_capacity,
                  f"<= the worst case max_tokens_per_rank * min(top_k, experts per rank) "
                  f"({self.worst_case_capacity}), or None for it")

    @property
    def num_local_experts(self) -> int:
        """Experts each expert-parallel rank holds: ``num_experts // ep_size``."""
        return self.num_experts // self.ep_size

    @property
    def worst_case_capacity(self) -> int:
        """`worst_case_capacity` of this layer (0 without ``max_tokens_per_rank``)."""
        return worst_case_capacity(self.max_tokens_per_rank or 0, self.top_k,
                                   self.num_local_experts)

    @property
    def rows_per_rank(self) -> int:
        """The static capacity of expert parallelism: rows one rank receives from
        each rank (``ep_capacity``, by default the worst case, which never overflows)."""
        return self.ep_capacity or self.worst_case_capacity


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """Which kernels run the MoE ops, chosen when the model is compiled.

    ``experts="auto"`` picks the fastest available experts backend for the
    device and dtype. ``dispatch_dtype`` asks the tokens to travel in that dtype
    (resolved per layer, `torch_moe_ops.backends.dispatch_dtype`; ``None`` leaves
    it to the rule, today the activation dtype). ``quant=None`` runs unquantized
    weights, the only value with kernels today.
    """

    experts: str = "auto"
    a2a: str = "none"
    dispatch_dtype: torch.dtype | None = None
    quant: str | None = None

    def __post_init__(self) -> None:
        _check_choice("experts", self.experts, EXPERTS_BACKEND_NAMES)
        _check_choice("a2a", self.a2a, A2A_BACKEND_NAMES)
        _check_choice("dispatch_dtype", self.dispatch_dtype, DISPATCH_DTYPES)
        _check_choice("quant", self.quant, QUANT_METHODS)
