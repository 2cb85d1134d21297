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

Its layout differs from ours (`layout`): ``fc1`` holds the up rows first and the gate
rows second (``w13`` the other way round); ``fc2`` is ``w2``; the biases come both or
neither, in the activations' dtype; mxfp4 weights and scales are padded to 128 columns and
interleaved the way the sm90 mixed-input GEMM reads them. `prepare_weights` converts once
(`PreparedWeights`). Activations: ``silu`` is FlashInfer's ``Swiglu``, ``gelu`` its
``Geglu`` (erf), ``swiglu_oai`` its ``Swiglu`` with per-expert ``swiglu_alpha = alpha``,
``swiglu_beta = 1``, ``swiglu_limit = limit`` (its SwigluBias: ``min(g, l) * sigmoid(alpha
* min(g, l)) * (clamp(u, -l, l) + beta)``, GPT-OSS's). ``experts_rows`` runs each row as a
token of one slot of weight 1.

Formats, all with bf16 activations in and out:

- bf16 weights;
- ``QuantSpec("fp8_block")`` (128 x 128 fp8 weight blocks, fp8_group activations:
  DeepSeek-V3) on FlashInfer's ``use_deepseek_fp8_block_scale`` path, which quantizes
  each row's 128-column groups itself (scale ``amax / 448``) before both GEMMs;
- ``QuantSpec("mxfp4")`` (e2m1 weights with an e8m0 scale per 32 columns, bf16
  activations: GPT-OSS's W4A16) on its sm90 mixed-input path (``use_w4_group_scaling``).

What does not map, and why, `format_reason` says; which widths run, `sizes_reason`. Rows
never arrive quantized (``quantized_rows=()``): the dispatch sends them in bf16. A token's
expert ids must be distinct, as top-k routing makes them (FlashInfer's permutation keeps
one row per (token, expert): a repeated expert's sum is wrong); -1 may repeat.

Weights are converted once per (tensor, version) and kept in this module's one cache
(`weight_cache.WeightCache`; `clear_prepared_weights` empties it): the ``fc1`` copy takes
as much memory as ``w13`` (and ``b13``, and the scales of quantized ``w13``); mxfp4 copies
``w2`` too. Where the copy would leave less than `weight_cache.RESERVE_FRACTION` of the
GPU's memory free, the call raises ``torch.OutOfMemoryError`` before allocating, naming
the copy's size and the ``triton`` backend, which needs none. The first call of a layer
makes it, outside CUDA-graph capture (a miss during
capture raises: run the layer once first). The first call of each layer shape also runs
FlashInfer's autotuner (`tuning`). An empty batch (T = 0, an idle rank) returns ``[0, H]``
and launches nothing.

With expert parallelism it reads what the planned format delivers: the tokens format's
receive buffers through its ``experts`` op, as they are: ``x_tokens [N, H]`` (a view of
FlashInfer's all-to-all workspace where that transport ran), its fp32 weights and int32 ids
are what ``cutlass_fused_moe`` takes, with no copy. The ids arrive local (the dispatch's one
kernel that marks padding also subtracts the rank's first expert), so the kernel runs with
``ep_size=1`` on the rank's own experts. Rows arrive through ``experts_rows``.

No gradient of its own: a layer trained on it computes its gradient on the
reference backend (the ``backward`` column of `available_backends()`), and it
ranks below ``triton`` and ``grouped_mm`` for ``experts="auto"``. FlashInfer's
module for it takes about 45 minutes to build: `supports` refuses until it is
built (`cutlass_module`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torch_moe_ops.backends.common.weight_cache import RESERVE_FRACTION, WeightCache, spare_bytes
from torch_moe_ops.backends.flashinfer import cutlass_module, library, tuning
from torch_moe_ops.backends.flashinfer.layout import (
    ACTIVATION_TYPES,
    MXFP4_ALIGNMENT,
    PreparedWeights,
    copy_bytes,
    prepare_weights,
)
from torch_moe_ops.backends.registry import REGISTRY, ExpertsBackend
from torch_moe_ops.config import MXFP4_GROUP, QuantSpec
from torch_moe_ops.ops import define_backend_ops

NAMESPACE = "moe_flashinfer"
DTYPE = torch.bfloat16
SM90 = (9, 0)
# The fp8 format FlashInfer's block-scaled path computes (DeepSeek-V3's).
FP8_BLOCK = QuantSpec("fp8_block", "fp8_group", (128, 128))
# GPT-OSS's W4A16: FlashInfer's sm90 mixed-input path (bf16 activations, mxfp4 weights).
MXFP4 = QuantSpec("mxfp4")
# Its TMA loads read 16-byte rows: H and I in multiples of 8 bf16 values.
ALIGNMENT = 8


def format_reason(spec: QuantSpec) -> str | None:
    """Why FlashInfer's fused MoE cannot run weights and activations of ``spec``
    here, or ``None``."""
    if spec in (FP8_BLOCK, MXFP4):
        return None
    if spec.weights == "fp8_block" and spec.activations == "none":
        return (f"does not run {spec.name} (weight-only fp8): FlashInfer's block-scaled "
                f"path quantizes the activations too, in 1 x 128 groups")
    if spec.weights == "fp8_block":
        return (f"does not run {spec.name}: FlashInfer's block-scaled path takes "
                f"128 x 128 weight blocks only")
    if spec.activations == "none":
        return f"does not run {spec.name}: FlashInfer has no weight-only fp8 path"
    return (f"does not run {spec.name}: FlashInfer's per-tensor fp8 path takes activations "
            f"quantized beforehand with one static scale, not {spec.activations} scales "
            f"computed per row, and one weight scale per expert")


def sizes_reason(hidden_size: int, inter_size: int, spec: QuantSpec | None) -> str | None:
    """Why FlashInfer's kernels cannot run experts of these widths in ``spec``, or ``None``.

    bf16 and fp8 blocks: H and I multiples of `ALIGNMENT` (16-byte TMA rows; fp8 blocks
    also need whole 128 x 128 blocks, which `QuantSpec.check_sizes` asks of the layer).
    mxfp4: multiples of 32 (one e8m0 scale per 32 columns); the mixed-input GEMM's
    128-column tiles are met by padding (`layout`), not asked of the layer.
    """
    mxfp4 = spec is not None and spec.weights == "mxfp4"
    alignment = MXFP4_GROUP if mxfp4 else ALIGNMENT
    if not hidden_size % alignment and not inter_size % alignment:
        return None
    why = (f"one e8m0 scale per {MXFP4_GROUP} columns; FlashInfer's mixed-input GEMM then "
           f"runs them padded to multiples of {MXFP4_ALIGNMENT}" if mxfp4
           else "FlashInfer's TMA loads")
    return (f"needs hidden_size and intermediate_size divisible by {alignment} ({why}), "
            f"got {hidden_size} and {inter_size}")


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
    if None not in (problem.hidden_size, problem.intermediate_size):
        reason = sizes_reason(problem.hidden_size, problem.intermediate_size, problem.quant)
        if reason is not None:
            return reason
    return cutlass_module.not_built_reason()


def _check_runs(x_NH: torch.Tensor, hidden_size: int, inter_size: int, activation: str,
                spec: QuantSpec | None = None) -> None:
    """What `supports` asks of a call, for a direct call of the ops."""
    if x_NH.dtype != DTYPE:
        raise ValueError(f"experts backend 'flashinfer' runs bfloat16 activations, got "
                         f"{x_NH.dtype}")
    reason = sizes_reason(hidden_size, inter_size, spec)
    if reason is not None:
        raise ValueError(f"experts backend 'flashinfer' {reason}")
    if activation not in ACTIVATION_TYPES:
        raise ValueError(f"activation must be one of {', '.join(map(repr, ACTIVATION_TYPES))} "
                         f"for experts backend 'flashinfer', got {activation!r}")


# The one cache of this module: prepared weights of the layers that ran here.
_PREPARED = WeightCache()


def clear_prepared_weights() -> None:
    """Drop every prepared copy (they are made again on the next call of each layer)."""
    _PREPARED.clear()


def _converted(sources: tuple, spec: QuantSpec | None) -> PreparedWeights:
    """`prepare_weights` of ``sources`` where the GPU has the memory to spare for the copy
    (`weight_cache.spare_bytes`); else an out-of-memory error that says what to do, before
    anything is allocated."""
    needed = copy_bytes(*sources, spec)
    spare = spare_bytes(sources[0].device)
    if spare is not None and needed > spare:
        raise torch.OutOfMemoryError(
            f"experts backend 'flashinfer' converts each layer's weights once into "
            f"FlashInfer's layout and keeps the copy: this layer's takes {needed / 2**30:.2f} "
            f"GiB, and the GPU has {max(spare, 0) / 2**30:.2f} GiB to spare if it is to keep "
            f"{RESERVE_FRACTION:.2%} of its memory free. Free memory, or use "
            f"tmo.backend(experts='triton'), which reads the weights as stored")
    return prepare_weights(*sources, spec)


def _prepared(w13, w2, b13, b2, w13_scale, w2_scale, spec) -> PreparedWeights:
    sources = (w13, w2, b13, b2, w13_scale, w2_scale)
    # mxfp4's interleave runs a kernel of the module: the trimmed one must be the one loaded,
    # and load with what the backend calls.
    cutlass_module.use_trimmed_module()
    cutlass_module.check_symbols()
    return _PREPARED.get(sources, lambda: _converted(sources, spec))


def _run(x_NH, weights_NK, ids_NK, weights: tuple, spec: QuantSpec | None, activation, alpha,
         limit) -> torch.Tensor:
    """``[N, H]``: FlashInfer's fused MoE of ``x_NH`` (bf16) routed by ``ids_NK`` (ids of
    the layer's experts, others skipped) with ``weights_NK``, on ``weights`` (``w13, w2,
    b13, b2, w13_scale, w2_scale``) in ``spec``, prepared on the first call. N = 0 launches
    nothing (and converts nothing). The tokens are read where they are (no copy of
    contiguous ones), but padded where the weights' width is (mxfp4 of an H not a multiple
    of 128)."""
    out_NH = torch.empty(x_NH.shape, dtype=x_NH.dtype, device=x_NH.device)
    if x_NH.shape[0] == 0:
        return out_NH
    from flashinfer.fused_moe import cutlass_fused_moe

    prepared = _prepared(*weights, spec)
    pad = prepared.padded_hidden - prepared.hidden_size
    x_NHp = F.pad(x_NH, (0, pad)) if pad else x_NH.contiguous()
    out_NHp = torch.empty(x_NHp.shape, dtype=x_NH.dtype, device=x_NH.device) if pad else out_NH
    ids_NK = ids_NK.to(torch.int32).contiguous()
    weights_NK = weights_NK.float().contiguous()
    activation_kwargs = prepared.activation_kwargs(activation, alpha, limit)

    def run(output_NHp: torch.Tensor) -> None:
        cutlass_fused_moe(x_NHp, ids_NK, weights_NK, prepared.fc1, prepared.fc2, x_NH.dtype,
                          prepared.quant_scales, fc1_expert_biases=prepared.fc1_bias,
                          fc2_expert_biases=prepared.fc2_bias, output=output_NHp,
                          tune_max_num_tokens=tuning.TUNE_MAX_TOKENS,
                          **prepared.format_kwargs, **activation_kwargs)

    shape_key = (x_NHp.device, x_NHp.dtype, ids_NK.shape[1], activation, spec,
                 *((tuple(t.shape), t.dtype) if t is not None else None
                   for t in (prepared.fc1, prepared.fc2, prepared.fc1_bias)))
    tuning.tune_once(shape_key, x_NH.device, lambda: run(torch.empty_like(out_NHp)))
    run(out_NHp)
    if pad:
        out_NH.copy_(out_NHp[:, :prepared.hidden_size])
    return out_NH


def _ones(x_RH: torch.Tensor) -> torch.Tensor:
    """``[R, 1]`` fp32 ones: each row is a token of one slot of weight 1."""
    return torch.ones((x_RH.shape[0], 1), dtype=torch.float32, device=x_RH.device)


def experts(hidden_TH, topk_weights_TK, topk_ids_TK, w13_EFH, w2_EHI, b13_EF, b2_EH,
            activation, alpha, limit):
    _check_runs(hidden_TH, *w2_EHI.shape[1:], activation)
    return _run(hidden_TH, topk_weights_TK, topk_ids_TK,
                (w13_EFH, w2_EHI, b13_EF, b2_EH, None, None), None, activation, alpha, limit)


def experts_rows(x_RH, expert_R, count_E, w13_EFH, w2_EHI, b13_EF, b2_EH, activation, alpha,
                 limit):
    _check_runs(x_RH, *w2_EHI.shape[1:], activation)
    return _run(x_RH, _ones(x_RH), expert_R.unsqueeze(1),
                (w13_EFH, w2_EHI, b13_EF, b2_EH, None, None), None, activation, alpha, limit)


def _quant_spec(weight_format: str, activation_format: str, block_size) -> QuantSpec:
    """The call's format, where FlashInfer runs it (else a ValueError saying why)."""
    spec = QuantSpec.from_op_args(weight_format, activation_format, list(block_size))
    reason = format_reason(spec)
    if reason is not None:
        raise ValueError(f"experts backend 'flashinfer' {reason}")
    return spec


def _quant_sizes(w2, spec: QuantSpec) -> tuple[int, int]:
    """``(H, I)`` of quantized ``w2`` (mxfp4 packs two values a byte)."""
    hidden, cols = w2.shape[1:]
    return hidden, 2 * cols if spec.weights == "mxfp4" else cols


def experts_quant(hidden_TH, topk_weights_TK, topk_ids_TK, w13, w2, w13_scale, w2_scale,
                  b13_EF, b2_EH, weight_format, activation_format, block_size, activation,
                  alpha, limit):
    spec = _quant_spec(weight_format, activation_format, block_size)
    _check_runs(hidden_TH, *_quant_sizes(w2, spec), activation, spec)
    return _run(hidden_TH, topk_weights_TK, topk_ids_TK,
                (w13, w2, b13_EF, b2_EH, w13_scale, w2_scale), spec, activation, alpha, limit)


def experts_rows_quant(x_RH, x_scale, expert_R, count_E, w13, w2, w13_scale, w2_scale, b13_EF,
                       b2_EH, weight_format, activation_format, block_size, activation, alpha,
                       limit, out_dtype):
    if x_scale is not None:
        raise ValueError("x_rows must arrive unquantized, in bfloat16, for experts backend "
                         "'flashinfer' (FlashInfer quantizes them itself, in 1 x 128 groups), "
                         f"got {x_RH.dtype} x_rows with x_scale")
    spec = _quant_spec(weight_format, activation_format, block_size)
    _check_runs(x_RH, *_quant_sizes(w2, spec), activation, spec)
    return _run(x_RH, _ones(x_RH), expert_R.unsqueeze(1),
                (w13, w2, b13_EF, b2_EH, w13_scale, w2_scale), spec, activation, alpha, limit)


define_backend_ops(NAMESPACE, {"experts": experts, "experts_rows": experts_rows,
                               "experts_quant": experts_quant,
                               "experts_rows_quant": experts_rows_quant})

REGISTRY.register_experts(ExpertsBackend(
    name="flashinfer", namespace=NAMESPACE, supports=supports,
    # Below triton and grouped_mm for "auto" until a benchmark shows it faster.
    priority=8,
    description="FlashInfer's CUTLASS fused MoE (bf16; fp8 128x128 weight blocks; mxfp4 "
                "W4A16; sm90; forward only)",
    # Whether a first call may build its module (`cutlass_module.not_built_reason`).
    environment=(cutlass_module.BUILD_ENV,)))
