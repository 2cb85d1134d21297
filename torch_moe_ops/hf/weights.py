"""Expert weights of a transformers experts module in our canonical layout.

Legend: E experts, H hidden size, I expert intermediate size, F = 2 * I; A, B
any two sizes.

Our ops take ``w13 [E, F, H]`` (gate rows, then up rows), ``w2 [E, H, I]`` and
the optional biases ``b13 [E, F]``, ``b2 [E, H]``. Where a family stores its
experts so (every family but GPT-OSS), the transformers tensors are used in
place: no copy, and gradients reach them. GPT-OSS stores ``gate_up_proj
[E, H, F]`` with gate and up columns interleaved and ``down_proj [E, I, H]``:
`hold_in_our_layout` converts those once (`Conversion`) into parameters of the
experts module in our layout, under our names (``w13``, ``b13``, ``w2``), which
replace transformers' own; the patched block's state-dict hooks convert them back
(`Conversion.to_source`), so checkpoints keep transformers' keys and layout.

With expert parallelism (`keep_local_experts`) the experts module keeps only
this rank's experts: each expert tensor is replaced by a copy of its slice
``[start, stop)`` along the expert dimension (every family stores the experts
first), and the full tensor is dropped.

Quantized experts (`ExpertWeights.quant`, a `QuantSpec`; inference only) add the
scales ``w13_scale``, ``w2_scale``:

- transformers' fine-grained fp8 experts (``FP8Experts``, what it loads a
  DeepSeek-V3-style fp8 checkpoint into where it runs fp8: a GPU of compute
  capability 8.9 or more) hold ``gate_up_proj`` float8_e4m3fn ``[E, F, H]``
  (gate rows, then up rows) and ``gate_up_proj_scale_inv`` fp32 ``[E, F / bn, H / bk]``
  (``w = q * scale_inv``), ``down_proj`` and ``down_proj_scale_inv`` alike: our
  ``fp8_block`` layout, used in place. Where it does not run fp8 (no GPU) it
  dequantizes them at load, and the block is patched as float experts.
- `QuantizedExperts` holds experts read from a quantized checkpoint in our layout
  (`torch_moe_ops.hf.load_into`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from torch_moe_ops import quant
from torch_moe_ops.config import MoEConfig, QuantSpec
from torch_moe_ops.hf.families import Unsupported
from torch_moe_ops.ops.checks import FLOAT_DTYPES
from torch_moe_ops.routed_experts import EXPERT_TENSORS, SCALE_TENSORS

# transformers' FP8Experts names of the fp8 block scales.
FP8_SCALES = {"w13_scale": "gate_up_proj_scale_inv", "w2_scale": "down_proj_scale_inv"}


@dataclasses.dataclass(frozen=True)
class Conversion:
    """One of our expert tensors that transformers stores in another layout, as the
    experts module's attribute ``source``: ``to_ours(source) -> ours`` and its
    inverse ``to_source(ours) -> source``, each a new contiguous tensor (never a
    view of its input, so writing into one leaves the other alone)."""

    source: str
    to_ours: Callable[[torch.Tensor], torch.Tensor]
    to_source: Callable[[torch.Tensor], torch.Tensor]

    def source_shape(self, ours: torch.Tensor) -> tuple[int, ...]:
        """The shape transformers stores ``ours`` in (computed on the meta device: no copy)."""
        return tuple(self.to_source(ours.detach().to("meta")).shape)


@dataclasses.dataclass(frozen=True)
class ExpertWeights:
    """Where each canonical expert tensor comes from: ``shared`` maps our name
    (`EXPERT_TENSORS`, and `SCALE_TENSORS` for quantized experts) to the experts
    module's attribute used in place, ``converted`` maps our name to its
    `Conversion` (held by the experts module under our name once
    `hold_in_our_layout` ran); ``quant`` is the format of quantized experts
    (None: float)."""

    shared: dict[str, str]
    converted: dict[str, Conversion]
    quant: QuantSpec | None = None

    def attribute(self, name: str) -> str | None:
        """The experts module's attribute holding our tensor ``name`` (None: the
        experts have none, e.g. no biases)."""
        if name in self.converted:
            return name
        return self.shared.get(name)


def _check_shape(experts: nn.Module, name: str, expected: tuple[int, ...],
                 dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES) -> None:
    tensor = getattr(experts, name, None)
    if not isinstance(tensor, torch.Tensor):
        raise Unsupported(f"{type(experts).__name__} has no tensor {name!r}")
    if tuple(tensor.shape) != expected:
        raise Unsupported(f"{type(experts).__name__}.{name} must have shape {expected} "
                          f"(from the config), got {tuple(tensor.shape)}")
    if tensor.dtype not in dtypes:
        names = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        raise Unsupported(f"{type(experts).__name__}.{name} must be {names} (float experts, "
                          f"or transformers' fp8 experts with block scales), got {tensor.dtype}")


def _canonical_weights(experts: nn.Module, cfg: MoEConfig) -> ExpertWeights:
    num_experts, hidden, inter = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    if getattr(getattr(experts, "gate_up_proj", None), "dtype", None) == quant.FP8_DTYPE:
        return _fp8_block_weights(experts, cfg)
    _check_shape(experts, "gate_up_proj", (num_experts, 2 * inter, hidden))
    _check_shape(experts, "down_proj", (num_experts, hidden, inter))
    return ExpertWeights(shared={"w13": "gate_up_proj", "w2": "down_proj"}, converted={})


def _fp8_block_weights(experts: nn.Module, cfg: MoEConfig) -> ExpertWeights:
    """transformers' ``FP8Experts``: our ``fp8_block`` layout with 1 x bk fp8
    activation groups (its ``"dynamic"`` activation scheme), used in place."""
    name = type(experts).__name__
    block = getattr(experts, "block_size", None)
    if block is None:
        raise Unsupported(f"{name} holds fp8 experts with one scale per expert matrix "
                          f"(block_size=None); only block scales (e.g. 128 x 128) are supported")
    scheme = getattr(experts, "activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise Unsupported(f"{name} quantizes activations with activation_scheme={scheme!r}; "
                          f"only 'dynamic' (per 1 x {block[1]} group) is supported")
    if not getattr(experts, "has_gate", True):
        raise Unsupported(f"{name} has no gate projection (has_gate=False)")
    spec = QuantSpec("fp8_block", "fp8_group", tuple(block))
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    try:
        spec.check_sizes(hidden, inter)
    except ValueError as error:
        raise Unsupported(str(error)) from None
    for weight, rows, cols in (("gate_up_proj", 2 * inter, hidden),
                               ("down_proj", hidden, inter)):
        _check_shape(experts, weight, quant.weight_shape(spec, cfg.num_experts, rows, cols),
                     (quant.FP8_DTYPE,))
        _check_shape(experts, weight + "_scale_inv",
                     quant.scale_shape(spec, cfg.num_experts, rows, cols), (torch.float32,))
    return ExpertWeights(shared={"w13": "gate_up_proj", "w2": "down_proj", **FP8_SCALES},
                         converted={}, quant=spec)


def _gate_then_up(interleaved_EF: torch.Tensor) -> torch.Tensor:
    # GPT-OSS interleaves the last dimension: 0, 2, 4, ... gate, 1, 3, 5, ... up.
    return torch.cat([interleaved_EF[..., 0::2], interleaved_EF[..., 1::2]], dim=-1)


def _interleave(gate_then_up_EF: torch.Tensor) -> torch.Tensor:
    gate_EI, up_EI = gate_then_up_EF.chunk(2, dim=-1)
    return torch.stack([gate_EI, up_EI], dim=-1).flatten(-2)


def _w13_from_gate_up(gate_up_EHF: torch.Tensor) -> torch.Tensor:
    return _gate_then_up(gate_up_EHF).transpose(1, 2).contiguous()


def _gate_up_from_w13(w13_EFH: torch.Tensor) -> torch.Tensor:
    return _interleave(w13_EFH.transpose(1, 2))


def _transposed_copy(t_EAB: torch.Tensor) -> torch.Tensor:
    # [E, A, B] -> [E, B, A]. clone, not contiguous(): with a dimension of size 1 the
    # transpose is already contiguous and contiguous() would return a view of the source.
    return t_EAB.transpose(1, 2).clone(memory_format=torch.contiguous_format)


def _gpt_oss_weights(experts: nn.Module, cfg: MoEConfig) -> ExpertWeights:
    num_experts, hidden, inter = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    _check_shape(experts, "gate_up_proj", (num_experts, hidden, 2 * inter))
    _check_shape(experts, "gate_up_proj_bias", (num_experts, 2 * inter))
    _check_shape(experts, "down_proj", (num_experts, inter, hidden))
    _check_shape(experts, "down_proj_bias", (num_experts, hidden))
    return ExpertWeights(shared={"b2": "down_proj_bias"}, converted={
        "w13": Conversion("gate_up_proj", _w13_from_gate_up, _gate_up_from_w13),
        "b13": Conversion("gate_up_proj_bias", _gate_then_up, _interleave),
        "w2": Conversion("down_proj", _transposed_copy, _transposed_copy),
    })


def source_names(weights: ExpertWeights) -> tuple[str, ...]:
    """The experts module's attributes that ``weights`` reads, in `EXPERT_TENSORS`
    then `SCALE_TENSORS` order."""
    return tuple(weights.shared[name] if name in weights.shared else weights.converted[name].source
                 for name in EXPERT_TENSORS + SCALE_TENSORS
                 if name in weights.shared or name in weights.converted)


def keep_local_experts(experts: nn.Module, weights: ExpertWeights, local: range) -> None:
    """Replace each expert tensor of ``experts`` that ``weights`` reads (``[E, ...]``)
    by a copy of its experts ``local`` (``[E_l, ...]``): a parameter stays a
    parameter (same ``requires_grad``), a buffer a buffer. The full tensor is no
    longer referenced by the module, so its memory is freed unless something
    else holds it."""
    for name in source_names(weights):
        full = getattr(experts, name)
        with torch.no_grad(), torch.inference_mode(False):
            part = full.detach()[local.start:local.stop].clone()
        if name in experts._parameters:
            setattr(experts, name, nn.Parameter(part, requires_grad=full.requires_grad))
        else:
            setattr(experts, name, part)


def hold_in_our_layout(experts: nn.Module, weights: ExpertWeights) -> None:
    """Replace each source tensor of ``weights.converted`` on ``experts`` by a tensor
    in our layout under our name, converted once: a parameter stays a parameter
    (same ``requires_grad``), a buffer a buffer, in the source's place in the
    module's order (so the state dict keeps transformers' order). Forwards,
    gradients and optimizers then work on these tensors directly; the source is
    no longer referenced by the module."""
    for name, conversion in weights.converted.items():
        source = getattr(experts, conversion.source)
        # Not an inference tensor even when patched under torch.inference_mode: the
        # parameter is kept and trained outside that mode.
        with torch.no_grad(), torch.inference_mode(False):
            ours = conversion.to_ours(source.detach())
        tensors = experts._parameters if conversion.source in experts._parameters \
            else experts._buffers
        order = [name if key == conversion.source else key for key in tensors]
        delattr(experts, conversion.source)
        if tensors is experts._parameters:
            experts.register_parameter(name, nn.Parameter(ours,
                                                          requires_grad=source.requires_grad))
        else:
            experts.register_buffer(name, ours)
        for key in order:
            tensors[key] = tensors.pop(key)


class QuantizedExperts(nn.Module):
    """Quantized experts in our layout for an `HFMoEBlock`, in place of the
    transformers experts module (`torch_moe_ops.hf.load_into` builds it).

    Buffers ``w13``, ``w2``, ``w13_scale``, ``w2_scale`` in the stored format of
    ``spec`` (`torch_moe_ops.quant`: shapes and dtypes per format), which
    ``.to(dtype)`` and ``.half()`` leave alone and ``.to(device)`` moves bit for
    bit; optional ``b13 [E, F]``, ``b2 [E, H]`` in the activations' dtype.
    """

    def __init__(self, spec: QuantSpec, w13: torch.Tensor, w2: torch.Tensor,
                 w13_scale: torch.Tensor, w2_scale: torch.Tensor, b13: torch.Tensor | None = None,
                 b2: torch.Tensor | None = None):
        super().__init__()
        self.spec = spec
        for name, tensor in (("w13", w13), ("w2", w2), ("w13_scale", w13_scale),
                             ("w2_scale", w2_scale), ("b13", b13), ("b2", b2)):
            if tensor is not None:
                self.register_buffer(name, tensor)

    def _apply(self, fn, recurse=True):
        with quant.stored_bits(self._buffers):
            return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return f"quant={self.spec.name}, experts={self.w13.shape[0]}"


def quantized_weights(experts: QuantizedExperts) -> ExpertWeights:
    """The `ExpertWeights` of `QuantizedExperts`: every tensor used in place."""
    return ExpertWeights(shared={name: name for name in EXPERT_TENSORS + SCALE_TENSORS
                                 if name in experts._buffers}, converted={}, quant=experts.spec)


# Family.layout -> (experts module, config) -> ExpertWeights, or Unsupported.
LAYOUTS = {"canonical": _canonical_weights, "gpt_oss": _gpt_oss_weights}
