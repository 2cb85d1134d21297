"""The ``flashinfer`` experts backend: FlashInfer's CUTLASS fused MoE
(``flashinfer.fused_moe.cutlass_fused_moe``, TensorRT-LLM's kernels) on sm90.

Legend: T tokens, H hidden size, I expert intermediate size, F = 2 * I, E experts,
K experts per token, R rows.

One FlashInfer call runs the whole layer: it sorts the (token, slot) pairs by
expert, skipping ids outside ``[0, E)`` (-1 included), runs the grouped GEMM of
``fc1``, the gated activation, the grouped GEMM of ``fc2`` and each token's
weighted sum, accumulating in fp32:

    for t, k: if 0 <= ids[t, k] < E:
        e = ids[t, k]
        h = x[t] @ fc1[e].T + fc1_bias[e]                  h[:I] up, h[I:] gate
        out[t] += weights[t, k] * (act(h[I:], h[:I]) @ fc2[e].T + fc2_bias[e])

Its layout differs from ours in one way: ``fc1`` holds the up rows first and the
gate rows second (``w13`` the other way round); ``fc2`` is ``w2`` as is, and the
biases come both or neither, in the activations' dtype. `prepare_weights`
converts once (`PreparedWeights`). Activations: ``silu`` is FlashInfer's
``Swiglu``, ``gelu`` its ``Geglu`` (erf), ``swiglu_oai`` its ``Swiglu`` with
per-expert ``swiglu_alpha = alpha``, ``swiglu_beta = 1``, ``swiglu_limit =
limit`` (its SwigluBias: ``min(g, l) * sigmoid(alpha * min(g, l)) * (clamp(u, -l,
l) + beta)``). ``experts_rows`` runs each row as a token of one slot of weight 1.

Formats: bf16 activations and weights; and ``QuantSpec("fp8_block")`` (128 x 128
fp8 weight blocks, fp8_group activations: DeepSeek-V3) on FlashInfer's
``use_deepseek_fp8_block_scale`` path, which quantizes each row's 128-column
groups itself (scale ``amax / 448``) before both GEMMs, from bf16. What does not
map, and why, `format_reason` says. Rows never arrive quantized
(``quantized_rows=()``): the dispatch sends them in bf16.

Weights are converted once per (tensor, version) and kept in this module's one
cache (`WeightCache`; `clear_prepared_weights` empties it): the ``fc1`` copy
takes as much memory as ``w13`` (and ``b13``, and the block scales of fp8
``w13``). The first call of a layer makes it, outside CUDA-graph capture (a
miss during capture raises: run the layer once first).

With expert parallelism it reads what the planned format delivers: the tokens format's
receive buffers through its ``experts`` op (tokens, local ids with -1, weights: what
``cutlass_fused_moe`` takes as they are), or rows through ``experts_rows``.

No gradient of its own: a layer trained on it computes its gradient on the
reference backend (the ``backward`` column of `available_backends()`), and it
ranks below ``triton`` and ``grouped_mm`` for ``experts="auto"``. FlashInfer's
module for it takes about 45 minutes to build: `supports` refuses until it is
built (`cutlass_module`).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable

import torch

from torch_moe_ops import torch_compat
from torch_moe_ops.backends.flashinfer import cutlass_module, library
from torch_moe_ops.backends.registry import REGISTRY, ExpertsBackend
from torch_moe_ops.config import QuantSpec
from torch_moe_ops.ops import define_backend_ops

NAMESPACE = "moe_flashinfer"
DTYPE = torch.bfloat16
SM90 = (9, 0)
# FlashInfer's ActivationType per activation of ours.
ACTIVATION_TYPES = {"silu": "Swiglu", "gelu": "Geglu", "swiglu_oai": "Swiglu"}
# The fp8 format FlashInfer's block-scaled path computes (DeepSeek-V3's).
FP8_BLOCK = QuantSpec("fp8_block", "fp8_group", (128, 128))
# Its TMA loads read 16-byte rows: H and I in multiples of 8 bf16 values.
ALIGNMENT = 8


def format_reason(spec: QuantSpec) -> str | None:
    """Why FlashInfer's fused MoE cannot run weights and activations of ``spec``
    here, or ``None``."""
    if spec == FP8_BLOCK:
        return None
    if spec.weights == "fp8_block" and spec.activations == "none":
        return (f"does not run {spec.name} (weight-only fp8): FlashInfer's block-scaled "
                f"path quantizes the activations too, in 1 x 128 groups")
    if spec.weights == "fp8_block":
        return (f"does not run {spec.name}: FlashInfer's block-scaled path takes "
                f"128 x 128 weight blocks only")
    if spec.weights == "mxfp4":
        return (f"does not run {spec.name}: FlashInfer's sm90 W4A16 mxfp4 path (weights "
                f"and scales interleaved by its module) is not wired to this backend")
    if spec.activations == "none":
        return f"does not run {spec.name}: FlashInfer has no weight-only fp8 path"
    return (f"does not run {spec.name}: FlashInfer's per-tensor fp8 path takes activations "
            f"quantized beforehand with one static scale, not {spec.activations} scales "
            f"computed per row, and one weight scale per expert")


def supports(spec, problem, device) -> str | None:
    """``None`` where FlashInfer's fused MoE runs ``problem`` on ``device`` without
    building anything first, else why not (the registry's ``supports``
    signature; ``spec`` is not read)."""
    reason = library.device_reason(device, SM90)
    if reason is not None:
        return reason
    capability = torch.cuda.get_device_capability(device)
    if capability != SM90:
        return (f"runs FlashInfer's SM90 fused-MoE module, on sm90 (Hopper) only here, "
                f"got sm{capability[0]}{capability[1]}")
    if problem.dtype != DTYPE:
        return f"runs bfloat16 activations (FlashInfer's bf16 kernels), got {problem.dtype}"
    if problem.activation is not None and problem.activation not in ACTIVATION_TYPES:
        return (f"has no FlashInfer activation for {problem.activation!r} (it maps "
                f"{', '.join(ACTIVATION_TYPES)})")
    if problem.quant is not None:
        reason = format_reason(problem.quant)
        if reason is not None:
            return reason
    sizes = (problem.hidden_size, problem.intermediate_size)
    if None not in sizes and any(size % ALIGNMENT for size in sizes):
        return (f"needs hidden_size and intermediate_size divisible by {ALIGNMENT} "
                f"(FlashInfer's TMA loads), got {sizes[0]} and {sizes[1]}")
    return cutlass_module.not_built_reason()


def _check_runs(x_NH: torch.Tensor, w2_EHI: torch.Tensor, activation: str) -> None:
    """What `supports` asks of a call, for a direct call of the ops."""
    if x_NH.dtype != DTYPE:
        raise ValueError(f"experts backend 'flashinfer' runs bfloat16 activations, got "
                         f"{x_NH.dtype}")
    hidden, inter = w2_EHI.shape[1], w2_EHI.shape[2]
    if hidden % ALIGNMENT or inter % ALIGNMENT:
        raise ValueError(f"experts backend 'flashinfer' needs H and I divisible by "
                         f"{ALIGNMENT}, got H={hidden}, I={inter}")
    if activation not in ACTIVATION_TYPES:
        raise ValueError(f"activation must be one of {', '.join(map(repr, ACTIVATION_TYPES))} "
                         f"for experts backend 'flashinfer', got {activation!r}")


def swap_halves(t_EF: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t_EF`` (``[E, F, ...]``) with the two halves of dim 1
    swapped: gate rows then up rows become up rows then gate rows."""
    half = t_EF.shape[1] // 2
    out = torch.empty_like(t_EF, memory_format=torch.contiguous_format)
    out[:, :half].copy_(t_EF[:, half:])
    out[:, half:].copy_(t_EF[:, :half])
    return out


@dataclasses.dataclass(frozen=True)
class PreparedWeights:
    """One layer's experts in FlashInfer's layout.

    ``fc1 [E, F, H]``: ``w13`` with its halves swapped (up rows, then gate rows);
    ``fc2 [E, H, I]``: ``w2``; ``fc1_bias [E, F]`` (halves swapped) and
    ``fc2_bias [E, H]``: both or neither, zeros standing in for the absent one;
    ``quant_scales``: ``[]`` for bf16 weights, ``[fc1 scales [E, F/128, H/128]
    (halves swapped), fc2 scales [E, H/128, I/128]]`` (fp32) for fp8 blocks.
    ``swiglu`` holds the per-expert ``swiglu_alpha``/``_beta``/``_limit`` tensors of
    each ``(alpha, limit)`` a call asked for.
    """

    fc1: torch.Tensor
    fc2: torch.Tensor
    fc1_bias: torch.Tensor | None
    fc2_bias: torch.Tensor | None
    quant_scales: list[torch.Tensor]
    swiglu: dict = dataclasses.field(default_factory=dict)

    def activation_kwargs(self, activation: str, alpha: float, limit: float) -> dict:
        """``cutlass_fused_moe``'s activation arguments for ``activation``."""
        from flashinfer.fused_moe import ActivationType

        kwargs = {"activation_type": getattr(ActivationType, ACTIVATION_TYPES[activation])}
        if activation == "swiglu_oai":
            if (alpha, limit) not in self.swiglu:
                num_experts, device = self.fc1.shape[0], self.fc1.device
                self.swiglu[(alpha, limit)] = {
                    f"swiglu_{name}": torch.full((num_experts,), value, dtype=torch.float32,
                                                 device=device)
                    for name, value in (("alpha", alpha), ("beta", 1.0), ("limit", limit))}
            kwargs.update(self.swiglu[(alpha, limit)])
        return kwargs


def prepare_weights(w13_EFH: torch.Tensor, w2_EHI: torch.Tensor, b13_EF: torch.Tensor | None,
                    b2_EH: torch.Tensor | None, w13_scale: torch.Tensor | None = None,
                    w2_scale: torch.Tensor | None = None) -> PreparedWeights:
    """Our canonical experts (``w13 [E, F, H]`` gate rows then up rows, ``w2 [E, H, I]``,
    optional ``b13 [E, F]``, ``b2 [E, H]``; for fp8 blocks their fp32 scales
    ``[E, F/128, H/128]`` and ``[E, H/128, I/128]``) in FlashInfer's layout
    (`PreparedWeights`). Copies ``w13``, ``b13`` and ``w13_scale``; the rest is
    used as is where contiguous."""
    with torch.no_grad():
        fc1_bias = fc2_bias = None
        if b13_EF is not None or b2_EH is not None:
            like = b13_EF if b13_EF is not None else b2_EH
            num_experts, hidden = w2_EHI.shape[:2]
            fc1_bias = (swap_halves(b13_EF) if b13_EF is not None
                        else like.new_zeros((num_experts, w13_EFH.shape[1])))
            fc2_bias = (b2_EH.contiguous() if b2_EH is not None
                        else like.new_zeros((num_experts, hidden)))
        scales = [] if w13_scale is None else [swap_halves(w13_scale.float()),
                                               w2_scale.float().contiguous()]
        return PreparedWeights(swap_halves(w13_EFH), w2_EHI.contiguous(), fc1_bias, fc2_bias,
                               scales)


@dataclasses.dataclass(frozen=True)
class _Entry:
    versions: tuple
    storages: tuple
    prepared: PreparedWeights
    # One per source storage; each holds the entry weakly (``prepared`` may hold a
    # source itself: a strong hold would keep that source alive for good).
    finalizers: list = dataclasses.field(default_factory=list)

    def detach(self) -> None:
        for finalizer in self.finalizers:
            finalizer.detach()


def _where(t: torch.Tensor | None) -> tuple | None:
    if t is None:
        return None
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
            tuple(t.stride()), t.dtype, t.device)


def _version(t: torch.Tensor | None) -> int | None:
    return None if t is None else torch_compat.tensor_version(t)


class WeightCache:
    """Prepared weights by their source tensors, as DESIGN asks: by (tensor, version).

    An entry serves a call whose sources have the storage, offset, shape, strides,
    dtype and version counter the entry was prepared from, and is dropped when
    the storage of one of its sources is freed. Writes that bypass the version
    counter (``.data`` writes, writes into inference tensors) are not seen: call
    `clear_prepared_weights` after them.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, sources: tuple[torch.Tensor | None, ...],
            prepare: Callable[[], PreparedWeights]) -> PreparedWeights:
        """The entry of ``sources``, made with ``prepare()`` where there is none."""
        key = tuple(_where(t) for t in sources)
        versions = tuple(_version(t) for t in sources)
        entry = self._entries.get(key)
        if (entry is not None and entry.versions == versions
                and all(ref() is t.untyped_storage()
                        for ref, t in zip(entry.storages, sources) if t is not None)):
            return entry.prepared
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            # Kernels do not run during capture: a copy made now would hold garbage.
            raise RuntimeError("experts backend 'flashinfer' converts a layer's weights on "
                               "its first call, which cannot be captured in a CUDA graph: "
                               "run the layer once before capturing (or after changing its "
                               "weights)")
        storages = tuple(weakref.ref(t.untyped_storage()) for t in sources if t is not None)
        if entry is not None:
            entry.detach()
        entry = _Entry(versions, storages, prepare())
        self._entries[key] = entry
        for t in sources:
            if t is not None:
                finalizer = weakref.finalize(t.untyped_storage(), self._forget, key,
                                             weakref.ref(entry))
                finalizer.atexit = False
                entry.finalizers.append(finalizer)
        return entry.prepared

    def _forget(self, key: tuple, entry_ref: weakref.ref) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry is entry_ref():
            entry.detach()
            del self._entries[key]

    def clear(self) -> None:
        for entry in self._entries.values():
            entry.detach()
        self._entries.clear()


# The one cache of this module: prepared weights of the layers that ran here.
_PREPARED = WeightCache()


def clear_prepared_weights() -> None:
    """Drop every prepared copy (they are made again on the next call of each layer)."""
    _PREPARED.clear()


def _prepared(w13, w2, b13, b2, w13_scale=None, w2_scale=None) -> PreparedWeights:
    sources = (w13, w2, b13, b2, w13_scale, w2_scale)
    return _PREPARED.get(sources, lambda: prepare_weights(*sources))


def _run(x_NH, weights_NK, ids_NK, prepared: PreparedWeights, activation, alpha, limit,
         fp8_blocks: bool = False) -> torch.Tensor:
    out_NH = torch.empty(x_NH.shape, dtype=x_NH.dtype, device=x_NH.device)
    if x_NH.shape[0] == 0:
        return out_NH
    from flashinfer.fused_moe import cutlass_fused_moe

    cutlass_module.use_trimmed_module()
    cutlass_fused_moe(x_NH.contiguous(), ids_NK.to(torch.int32).contiguous(),
                      weights_NK.float().contiguous(), prepared.fc1, prepared.fc2,
                      x_NH.dtype, prepared.quant_scales, fc1_expert_biases=prepared.fc1_bias,
                      fc2_expert_biases=prepared.fc2_bias, output=out_NH,
                      use_deepseek_fp8_block_scale=fp8_blocks,
                      **prepared.activation_kwargs(activation, alpha, limit))
    return out_NH


def _ones(x_RH: torch.Tensor) -> torch.Tensor:
    """``[R, 1]`` fp32 ones: each row is a token of one slot of weight 1."""
    return torch.ones((x_RH.shape[0], 1), dtype=torch.float32, device=x_RH.device)


def experts(hidden_TH, topk_weights_TK, topk_ids_TK, w13_EFH, w2_EHI, b13_EF, b2_EH,
            activation, alpha, limit):
    _check_runs(hidden_TH, w2_EHI, activation)
    prepared = _prepared(w13_EFH, w2_EHI, b13_EF, b2_EH)
    return _run(hidden_TH, topk_weights_TK, topk_ids_TK, prepared, activation, alpha, limit)


def experts_rows(x_RH, expert_R, count_E, w13_EFH, w2_EHI, b13_EF, b2_EH, activation, alpha,
                 limit):
    _check_runs(x_RH, w2_EHI, activation)
    prepared = _prepared(w13_EFH, w2_EHI, b13_EF, b2_EH)
    return _run(x_RH, _ones(x_RH), expert_R.unsqueeze(1), prepared, activation, alpha, limit)


def _check_format(weight_format: str, activation_format: str, block_size) -> None:
    reason = format_reason(QuantSpec.from_op_args(weight_format, activation_format,
                                                  list(block_size)))
    if reason is not None:
        raise ValueError(f"experts backend 'flashinfer' {reason}")


def experts_quant(hidden_TH, topk_weights_TK, topk_ids_TK, w13, w2, w13_scale, w2_scale,
                  b13_EF, b2_EH, weight_format, activation_format, block_size, activation,
                  alpha, limit):
    _check_format(weight_format, activation_format, block_size)
    _check_runs(hidden_TH, w2, activation)
    prepared = _prepared(w13, w2, b13_EF, b2_EH, w13_scale, w2_scale)
    return _run(hidden_TH, topk_weights_TK, topk_ids_TK, prepared, activation, alpha, limit,
                fp8_blocks=True)


def experts_rows_quant(x_RH, x_scale, expert_R, count_E, w13, w2, w13_scale, w2_scale, b13_EF,
                       b2_EH, weight_format, activation_format, block_size, activation, alpha,
                       limit, out_dtype):
    if x_scale is not None:
        raise ValueError("x_rows must arrive unquantized, in bfloat16, for experts backend "
                         "'flashinfer' (FlashInfer quantizes them itself, in 1 x 128 groups), "
                         f"got {x_RH.dtype} x_rows with x_scale")
    _check_format(weight_format, activation_format, block_size)
    _check_runs(x_RH, w2, activation)
    prepared = _prepared(w13, w2, b13_EF, b2_EH, w13_scale, w2_scale)
    return _run(x_RH, _ones(x_RH), expert_R.unsqueeze(1), prepared, activation, alpha, limit,
                fp8_blocks=True)


define_backend_ops(NAMESPACE, {"experts": experts, "experts_rows": experts_rows,
                               "experts_quant": experts_quant,
                               "experts_rows_quant": experts_rows_quant})

REGISTRY.register_experts(ExpertsBackend(
    name="flashinfer", namespace=NAMESPACE, supports=supports,
    # Below triton and grouped_mm for "auto" until a benchmark shows it faster.
    priority=8,
    description="FlashInfer's CUTLASS fused MoE (bf16; fp8 128x128 weight blocks; sm90; "
                "forward only)"))
