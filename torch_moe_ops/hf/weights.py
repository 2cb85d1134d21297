"""Expert weights of a transformers experts module in our canonical layout.

Legend: E experts, H hidden size, I expert intermediate size, F = 2 * I.

Our ops take ``w13 [E, F, H]`` (gate rows, then up rows), ``w2 [E, H, I]`` and
the optional biases ``b13 [E, F]``, ``b2 [E, H]``. Where a family stores its
experts so (every family but GPT-OSS), the transformers tensors are used in
place: no copy, and gradients reach them. GPT-OSS stores ``gate_up_proj
[E, H, F]`` with gate and up columns interleaved and ``down_proj [E, I, H]``:
those are converted into copies in our layout (`Conversion`), which the block
keeps as non-persistent buffers and reconverts when a `SourceStamp` shows that
the tensor they came from changed.

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
import weakref
from collections.abc import Callable

import torch
from torch import nn

from torch_moe_ops import quant, torch_compat
from torch_moe_ops.config import MoEConfig, QuantSpec
from torch_moe_ops.hf.families import Unsupported
from torch_moe_ops.ops.checks import FLOAT_DTYPES
from torch_moe_ops.routed_experts import EXPERT_TENSORS, SCALE_TENSORS

# transformers' FP8Experts names of the fp8 block scales.
FP8_SCALES = {"w13_scale": "gate_up_proj_scale_inv", "w2_scale": "down_proj_scale_inv"}


@dataclasses.dataclass(frozen=True)
class Conversion:
    """One of our expert tensors computed from the experts module's attribute
    ``source``: ``convert(source) -> ours``, always a new contiguous tensor (never
    a view of the source, so writing into it leaves the source alone)."""

    source: str
    convert: Callable[[torch.Tensor], torch.Tensor]

    def __call__(self, experts: nn.Module) -> torch.Tensor:
        """Our tensor from the experts' current ``source``: no autograd history,
        and not an inference tensor even when called under `torch.inference_mode`
        (it is kept across calls, in and out of that mode)."""
        with torch.no_grad(), torch.inference_mode(False):
            return self.convert(getattr(experts, self.source).detach())


@dataclasses.dataclass(frozen=True)
class ExpertWeights:
    """Where each canonical expert tensor comes from: ``shared`` maps our name
    (`EXPERT_TENSORS`, and `SCALE_TENSORS` for quantized experts) to the experts
    module's attribute used in place, ``converted`` maps our name to its
    `Conversion`; ``quant`` is the format of quantized experts (None: float)."""

    shared: dict[str, str]
    converted: dict[str, Conversion]
    quant: QuantSpec | None = None


class SourceStamp:
    """What a converted tensor was computed from: the source tensor (held weakly,
    so a replaced parameter is freed), its storage address (``.to()`` and
    ``param.data = ...`` move it) and its version counter (in-place writes such
    as ``load_state_dict``'s copy bump it). ``SourceStamp()`` matches nothing.

    Writes that bypass the version counter (``param.data.copy_(...)``, or any
    write into an inference tensor, which has none) are not seen: after those,
    `torch_moe_ops.hf.patch` the model again.
    """

    __slots__ = ("_data_ptr", "_tensor", "_version")

    def __init__(self, tensor: torch.Tensor | None = None):
        self._tensor = None if tensor is None else weakref.ref(tensor)
        self._data_ptr = None if tensor is None else tensor.data_ptr()
        self._version = None if tensor is None else torch_compat.tensor_version(tensor)

    def matches(self, tensor: torch.Tensor) -> bool:
        return (self._tensor is not None and self._tensor() is tensor
                and tensor.data_ptr() == self._data_ptr
                and torch_compat.tensor_version(tensor) == self._version)

    def __reduce__(self):
        # A weak reference does not survive pickling (torch.save, deepcopy): the copy
        # matches nothing, so its block reconverts once.
        return SourceStamp, ()


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


def _w13_from_gate_up(gate_up_EHF: torch.Tensor) -> torch.Tensor:
    return _gate_then_up(gate_up_EHF).transpose(1, 2).contiguous()


def _w2_from_down(down_EIH: torch.Tensor) -> torch.Tensor:
    # clone, not contiguous(): with a dimension of size 1 the transpose is already
    # contiguous and contiguous() would return a view of the source.
    return down_EIH.transpose(1, 2).clone(memory_format=torch.contiguous_format)


def _gpt_oss_weights(experts: nn.Module, cfg: MoEConfig) -> ExpertWeights:
    num_experts, hidden, inter = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    _check_shape(experts, "gate_up_proj", (num_experts, hidden, 2 * inter))
    _check_shape(experts, "gate_up_proj_bias", (num_experts, 2 * inter))
    _check_shape(experts, "down_proj", (num_experts, inter, hidden))
    _check_shape(experts, "down_proj_bias", (num_experts, hidden))
    return ExpertWeights(shared={"b2": "down_proj_bias"}, converted={
        "w13": Conversion("gate_up_proj", _w13_from_gate_up),
        "b13": Conversion("gate_up_proj_bias", _gate_then_up),
        "w2": Conversion("down_proj", _w2_from_down),
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
