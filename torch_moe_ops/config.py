"""Configuration of an MoE block (`MoEConfig`) and of the kernels that run it (`BackendSpec`).

Both are frozen dataclasses validated at construction: a bad value raises
`ValueError` naming the field, the value received and what is allowed. Their
fields reach the custom ops as compile-time constants, never as graph inputs.
"""

from __future__ import annotations

import dataclasses
import difflib
import math

import torch

SCORINGS = ("softmax", "topk_softmax", "sigmoid")
ACTIVATIONS = ("silu", "gelu", "swiglu_oai")
EXPERTS_BACKEND_NAMES = ("auto", "reference", "cpu", "triton", "grouped_mm", "flashinfer",
                         "deepgemm")
A2A_BACKEND_NAMES = ("none", "allgather", "all_to_all", "deepep", "flashinfer")
ROUTE_BACKEND_NAMES = ("auto", "reference", "triton", "flashinfer")
FLOAT_FIELDS = ("routed_scaling_factor", "swiglu_alpha", "swiglu_limit")
# Load balancing: how the auxiliary loss groups tokens, and its coefficients (0 is off).
AUX_LOSSES = ("none", "batch", "sequence")
COEFF_FIELDS = ("aux_loss_coeff", "z_loss_coeff", "bias_update_speed")
# What a layer may ask its tokens to travel in (`backends.dispatch_dtype` resolves
# the choice per layer).
DISPATCH_DTYPES = (None, torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
# Quantized expert weights (`QuantSpec.weights`) and what their activations become
# before each GEMM (`QuantSpec.activations`); the first activation format of each
# weight format is its default.
QUANT_WEIGHT_FORMATS = {
    "fp8_tensor": ("fp8_token", "none"),
    "fp8_channel": ("fp8_token", "none"),
    "fp8_block": ("fp8_group", "none"),
    "mxfp4": ("none",),
}
QUANT_ACTIVATION_FORMATS = ("fp8_token", "fp8_group", "none")
# MXFP4 (OCP microscaling): 32 e2m1 values share one e8m0 scale.
MXFP4_GROUP = 32


def worst_case_capacity(max_tokens_per_rank: int, top_k: int) -> int:
    """Most rows one expert-parallel rank can send another: each of its tokens sends
    one row per slot whose expert is on that rank, all ``top_k`` of them where a token
    chooses one expert in several slots (each slot is a term of its own)."""
    return max_tokens_per_rank * top_k


def _fail(field: str, got: object, expected: str, hint: str = "") -> None:
    raise ValueError(f"{field} must be {expected}, got {got!r}{hint}")


def _check_positive_int(field: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        _fail(field, value, "a positive int")


def _check_choice(field: str, value: object, allowed: tuple, suggest: bool = False) -> None:
    """``suggest``: name the closest allowed value (for names a user spells, like backends';
    not for formats, where a near spelling is another format: nvfp4 is no mxfp4)."""
    if value not in allowed:
        expected = "one of " + ", ".join(repr(a) for a in allowed)
        names = [a for a in allowed if isinstance(a, str)]
        close = (difflib.get_close_matches(value, names, n=1)
                 if suggest and isinstance(value, str) else [])
        _fail(field, value, expected, f" (did you mean {close[0]!r}?)" if close else "")


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """How a layer's expert weights are quantized, and its activations with them.

    ``weights`` (each expert matrix ``W [N, K]``, ``N`` output and ``K`` input
    columns; ``w = q * scale`` dequantizes):

    - ``"fp8_tensor"``: float8_e4m3fn, one fp32 scale per expert matrix (``[E]``);
    - ``"fp8_channel"``: float8_e4m3fn, one fp32 scale per output row (``[E, N]``);
    - ``"fp8_block"``: float8_e4m3fn, one fp32 scale per ``block_size`` block
      (``[E, N / bn, K / bk]``; DeepSeek-V3's ``weight_scale_inv``, 128 x 128);
    - ``"mxfp4"``: e2m1 values packed two per uint8 (``[E, N, K / 2]``, the even
      column in the low nibble) with one e8m0 scale (uint8, ``2 ** (s - 127)``)
      per 32 columns (``[E, N, K / 32]``; GPT-OSS's ``blocks`` and ``scales``).

    ``activations`` (before each of the two GEMMs, dynamically, from the values
    at hand; ``None`` picks the weight format's default, the first listed):

    - ``"fp8_token"``: float8_e4m3fn with one scale per row (``amax / 448``);
    - ``"fp8_group"``: float8_e4m3fn with one scale per row and ``bk`` columns
      (DeepSeek-V3's 1 x 128 groups), with ``fp8_block`` weights only;
    - ``"none"``: the activations stay in their own dtype (weight-only: W8A16, W4A16).

    Weights as stored: ``"fp8_*"`` with ``fp8_token``/``fp8_group`` is w8a8,
    ``"mxfp4"`` with ``"none"`` is GPT-OSS's W4A16.
    """

    weights: str
    activations: str | None = None
    block_size: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        _check_choice("QuantSpec.weights", self.weights, tuple(QUANT_WEIGHT_FORMATS))
        allowed = QUANT_WEIGHT_FORMATS[self.weights]
        if self.activations is None:
            object.__setattr__(self, "activations", allowed[0])
        _check_choice(f"QuantSpec.activations (with weights={self.weights!r})",
                      self.activations, allowed)
        if self.weights == "fp8_block":
            if self.block_size is None:
                object.__setattr__(self, "block_size", (128, 128))
            block = self.block_size
            if (not isinstance(block, tuple) or len(block) != 2
                    or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0
                               for b in block)):
                _fail("QuantSpec.block_size", block, "a tuple of two positive ints (rows, "
                      "columns of one scale block), e.g. (128, 128)")
        elif self.block_size is not None:
            _fail("QuantSpec.block_size", self.block_size,
                  f"None unless weights='fp8_block' (got weights={self.weights!r})")

    @property
    def name(self) -> str:
        """A short name, as results and errors print it: ``fp8_block128x128+fp8_group``."""
        block = "" if self.block_size is None else "{}x{}".format(*self.block_size)
        return f"{self.weights}{block}+{self.activations}"

    @property
    def block_list(self) -> list[int]:
        """``block_size`` as the ops take it: ``[bn, bk]``, or ``[]`` without blocks."""
        return list(self.block_size or ())

    @classmethod
    def from_op_args(cls, weight_format: str, activation_format: str,
                     block_size: list[int]) -> QuantSpec:
        """The spec of a quantized experts op call (its static arguments)."""
        return cls(weight_format, activation_format, tuple(block_size) or None)

    def check_sizes(self, hidden_size: int, intermediate_size: int) -> None:
        """Every GEMM's input columns (H for ``w13``, I for ``w2``) and output rows
        (2I and H) must split into whole scale blocks and groups."""
        if self.weights == "fp8_block":
            rows, cols = self.block_size
            for dim, size in (("hidden_size", hidden_size),
                              ("intermediate_size", intermediate_size)):
                if size % rows or size % cols:
                    _fail(dim, size, f"a multiple of both block sizes {self.block_size} "
                          f"(QuantSpec.block_size); hidden_size={hidden_size}, "
                          f"intermediate_size={intermediate_size}")
        if self.weights == "mxfp4":
            for dim, size in (("hidden_size", hidden_size),
                              ("intermediate_size", intermediate_size)):
                if size % MXFP4_GROUP:
                    _fail(dim, size, f"a multiple of {MXFP4_GROUP} for mxfp4 weights (one "
                          f"scale per {MXFP4_GROUP} columns); hidden_size={hidden_size}, "
                          f"intermediate_size={intermediate_size}")


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

    Quantized experts (``quant``, a `QuantSpec`): the block holds ``w13``/``w2``
    in that format with their scales, and runs inference only.

    Load balancing (all off by default; `torch_moe_ops.load_balance` has the
    formulas), with ``p`` the router's probabilities (``softmax(logits)``, for
    ``"sigmoid"`` scoring ``s / sum(s)``) and ``f_e`` the fraction of routed slots
    that chose expert ``e``:

    - ``aux_loss``: ``"batch"`` is the Switch / GShard loss
      ``aux_loss_coeff * E * sum_e f_e * mean_t p[t, e]`` over the call's tokens
      (``f_e`` over every rank of the expert-parallel group); ``"sequence"`` is
      DeepSeek-V3's sequence-wise loss, the same over each sequence, averaged over
      sequences: the input is ``[..., S, H]``, one sequence of ``S`` tokens per row.
    - ``z_loss_coeff``: ST-MoE's router z-loss, ``coeff * mean_t logsumexp(logits[t])^2``.
    - ``bias_update_speed``: DeepSeek-V3's auxiliary-loss-free balancing (needs
      ``correction_bias``): after each optimizer step
      ``bias_e += speed * sign(mean(load) - load_e)``, ``load`` the tokens routed to
      each expert since the last update (torchtitan's ``load_balance_coeff``).
    - ``count_tokens_per_expert``: keep each call's tokens per expert (on with any
      of the above).
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
    quant: QuantSpec | None = None
    aux_loss: str = "none"
    aux_loss_coeff: float = 0.01
    z_loss_coeff: float = 0.0
    bias_update_speed: float = 0.0
    count_tokens_per_expert: bool = False

    def __post_init__(self) -> None:
        for field in ("hidden_size", "intermediate_size", "num_experts", "top_k",
                      "num_expert_groups", "topk_groups", "ep_size"):
            _check_positive_int(field, getattr(self, field))
        if self.top_k > self.num_experts:
            _fail("top_k", self.top_k, f"<= num_experts ({self.num_experts})")
        _check_choice("scoring", self.scoring, SCORINGS)
        _check_choice("activation", self.activation, ACTIVATIONS)
        for field in ("renormalize", "correction_bias", "router_bias", "expert_bias",
                      "shared_expert_gate", "count_tokens_per_expert"):
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
        self._check_load_balancing()
        size = self.shared_expert_intermediate_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            _fail("shared_expert_intermediate_size", size, "an int >= 0 (0 means none)")
        if self.shared_expert_gate and size == 0:
            _fail("shared_expert_gate", True,
                  "False when there is no shared expert (shared_expert_intermediate_size=0)")
        if self.num_experts % self.ep_size:
            _fail("ep_size", self.ep_size, f"a divisor of num_experts ({self.num_experts})")
        self._check_ep_sizes()
        if self.quant is not None:
            if not isinstance(self.quant, QuantSpec):
                _fail("quant", self.quant, "a QuantSpec or None")
            self.quant.check_sizes(self.hidden_size, self.intermediate_size)
        # Not a field: equality, hashing, repr and dataclasses.replace ignore it.
        object.__setattr__(self, "_float_text",
                           {field: repr(float(getattr(self, field)))
                            for field in FLOAT_FIELDS + COEFF_FIELDS})

    def static_float(self, field: str) -> float:
        """The float field ``field`` (one of `FLOAT_FIELDS`, `COEFF_FIELDS`), read so that
        ``torch.compile`` keeps it a compile-time constant.

        Dynamo makes a float attribute that forward reads a graph input once shapes
        are dynamic (``dynamic=True``, or after the value changed between calls):
        the op then receives ``.item()`` of a tensor and Dynamo restarts its
        analysis. A string is always a constant to Dynamo, guarded by value, and
        ``float()`` of a constant is folded while tracing: the value reaches the op
        as a literal, and equal configs share one graph.
        """
        return float(self._float_text[field])

    def _check_load_balancing(self) -> None:
        _check_choice("aux_loss", self.aux_loss, AUX_LOSSES)
        for field in COEFF_FIELDS:
            value = getattr(self, field)
            if (not isinstance(value, (int, float)) or isinstance(value, bool)
                    or not math.isfinite(value) or value < 0):
                _fail(field, value, "a finite float >= 0 (0 is off)")
        if self.aux_loss != "none" and self.aux_loss_coeff == 0:
            _fail("aux_loss_coeff", self.aux_loss_coeff,
                  f"> 0 with aux_loss={self.aux_loss!r} (or aux_loss='none')")
        if self.bias_update_speed and not self.correction_bias:
            _fail("bias_update_speed", self.bias_update_speed,
                  "0.0 unless correction_bias=True (the bias it updates; scoring='sigmoid')")

    @property
    def counts_tokens(self) -> bool:
        """Whether the block keeps each call's tokens per expert (`MoE.tokens_per_expert`):
        asked for, or needed by a load-balancing loss or the bias update."""
        return (self.count_tokens_per_expert or self.aux_loss != "none"
                or self.z_loss_coeff > 0 or self.bias_update_speed > 0)

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
                  "<= the worst case max_tokens_per_rank * top_k "
                  f"({self.worst_case_capacity}), or None for it")

    @property
    def num_local_experts(self) -> int:
        """Experts each expert-parallel rank holds: ``num_experts // ep_size``."""
        return self.num_experts // self.ep_size

    @property
    def worst_case_capacity(self) -> int:
        """`worst_case_capacity` of this layer (0 without ``max_tokens_per_rank``)."""
        return worst_case_capacity(self.max_tokens_per_rank or 0, self.top_k)

    @property
    def rows_per_rank(self) -> int:
        """The static capacity of expert parallelism: rows one rank receives from
        each rank (``ep_capacity``, by default the worst case, which never overflows)."""
        return self.ep_capacity or self.worst_case_capacity


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """Which kernels run the MoE ops, chosen when the model is compiled.

    ``experts="auto"`` picks the fastest available experts backend for the
    device and dtype; ``route="auto"`` the fastest routing backend that runs the
    layer's routing (scoring, groups, top_k, logits' dtype) there, the reference
    routing where none other does. ``dispatch_dtype`` asks the tokens to travel in that dtype
    (resolved per layer, `torch_moe_ops.backends.dispatch_dtype`; ``None`` leaves
    it to the rule). How weights are quantized is the layer's (`MoEConfig.quant`):
    the experts backend chosen here must have kernels for it. ``chunks`` splits each
    expert-parallel layer's tokens into that many chunks, so that one chunk's transfers run
    while another chunk's experts compute (``None`` or 1: never, as measured faster,
    `lowering.plan.choose_chunks`); a layer that cannot be chunked runs whole, and
    `torch_moe_ops.explain` says why. ``overlap`` keeps an inference layer's transfers in
    flight at prefill sizes while the work of the graph that needs no routed tokens (its
    shared experts) runs (`lowering.plan.choose_in_flight`; off by default until measured to
    pay).
    """

    experts: str = "auto"
    a2a: str = "none"
    dispatch_dtype: torch.dtype | None = None
    route: str = "auto"
    chunks: int | None = None
    overlap: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.overlap, bool):
            _fail("overlap", self.overlap, "a bool")
        if self.chunks is not None:
            _check_positive_int("chunks", self.chunks)
        _check_choice("experts", self.experts, EXPERTS_BACKEND_NAMES, suggest=True)
        _check_choice("a2a", self.a2a, A2A_BACKEND_NAMES, suggest=True)
        _check_choice("route", self.route, ROUTE_BACKEND_NAMES, suggest=True)
        _check_choice("dispatch_dtype", self.dispatch_dtype, DISPATCH_DTYPES)
