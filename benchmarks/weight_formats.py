"""The weight formats bench_experts.py times: bf16 and quantized formats
(`torch_moe_ops.config.QuantSpec`), each expert's stored bytes in them, and
the call of the experts op that runs them.

Legend: E experts, H hidden size, I expert intermediate size, F = 2 * I; one
expert matrix has N output rows and K input columns (``w13``: N = F, K = H;
``w2``: N = H, K = I).

    bf16:         w13 [E, F, H], w2 [E, H, I]                  2 bytes a weight
    fp8_block:    fp8 + fp32 scale per 128 x 128 block         1 + 4 / 128**2
                  (activations fp8 per 1 x 128 group: DeepSeek-V3)
    fp8_channel:  fp8 + fp32 scale per output row              1 + 4 / K
                  (activations fp8 per token)
    fp8_tensor:   fp8 + one fp32 scale per expert matrix       1 + 4 / (N * K)
    mxfp4:        e2m1 + e8m0 scale per 32 columns             0.5 + 1 / 32
                  (activations stay bf16: W4A16, GPT-OSS)
"""

from __future__ import annotations

import dataclasses

import torch

from torch_moe_ops import quant
from torch_moe_ops.config import QuantSpec

FORMATS: dict[str, QuantSpec | None] = {
    "bf16": None,
    "fp8_block": QuantSpec("fp8_block"),
    "fp8_channel": QuantSpec("fp8_channel"),
    "fp8_tensor": QuantSpec("fp8_tensor"),
    "mxfp4": QuantSpec("mxfp4"),
}
DEFAULT_FORMATS = ("bf16", "fp8_block", "fp8_channel", "mxfp4")


def uses_fp8_math(spec: QuantSpec | None) -> bool:
    """Whether the GEMMs of ``spec`` multiply fp8 by fp8 (w8a8): then the fp8
    dense rate bounds them, else the activations' own (bf16) rate does."""
    return spec is not None and spec.activations != "none"


def why_not(name: str, hidden_size: int, intermediate_size: int) -> str | None:
    """Why format ``name`` cannot hold weights of these widths, or None."""
    spec = FORMATS[name]
    if spec is None:
        return None
    try:
        spec.check_sizes(hidden_size, intermediate_size)
    except ValueError as e:
        return str(e)
    return None


@dataclasses.dataclass(frozen=True)
class ExpertWeights:
    """One format's weights of a shape, as its experts op takes them."""

    format: str
    spec: QuantSpec | None
    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None
    w2_scale: torch.Tensor | None
    b13_EF: torch.Tensor | None
    b2_EH: torch.Tensor | None

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    def bytes_per_expert(self) -> int:
        """What one expert's GEMMs read of memory: weights and their scales (the
        biases, a few KB, are left out as bf16's floor leaves them out)."""
        tensors = (self.w13, self.w2, self.w13_scale, self.w2_scale)
        return sum(t[0].nbytes for t in tensors if t is not None)

    def op(self, namespace: str):
        """The experts op of ``namespace`` for this format."""
        ops = getattr(torch.ops, namespace)
        return ops.experts if self.spec is None else ops.experts_quant

    def op_args(self) -> tuple:
        """The op's arguments after the routing and before the activation."""
        if self.spec is None:
            return (self.w13, self.w2, self.b13_EF, self.b2_EH)
        return (self.w13, self.w2, self.w13_scale, self.w2_scale, self.b13_EF, self.b2_EH,
                self.spec.weights, self.spec.activations, self.spec.block_list)


def expert_weights(name: str, w13_EFH: torch.Tensor, w2_EHI: torch.Tensor,
                   b13_EF: torch.Tensor | None, b2_EH: torch.Tensor | None) -> ExpertWeights:
    """Float weights as format ``name`` stores them (quantized by `torch_moe_ops.quant`);
    the biases stay in the activations' dtype."""
    spec = FORMATS[name]
    if spec is None:
        return ExpertWeights(name, None, w13_EFH, w2_EHI, None, None, b13_EF, b2_EH)
    w13, w13_scale = quant.quantize_weights(w13_EFH, spec)
    w2, w2_scale = quant.quantize_weights(w2_EHI, spec)
    return ExpertWeights(name, spec, w13, w2, w13_scale, w2_scale, b13_EF, b2_EH)
