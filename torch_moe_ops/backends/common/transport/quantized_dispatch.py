"""fp8 dispatch (``moe::dispatch_quant``) on the transport of an a2a backend's ``dispatch``.

Legend: T tokens, H hidden size, R rows, G activation scale groups per row,
B = H + 4 * G bytes of one packed row.

Each token is quantized once, before it travels (`quant.quantize_activations`,
the formula every quantized kernel is tested against), and its fp8 values and
fp32 scales are packed into one row of bytes::

    packed[t] = bytes(q[t]) ++ bytes(scale[t])            # [T, B] uint8

which the backend's own ``dispatch`` moves as it moves any rows: the scales
ride in the same message as their row, so an fp8 dispatch runs the same
collectives as a bf16 one, on ``B / (2 H)`` of the bytes (bf16 activations).
Bytes go through every transport (NCCL, gloo) and every gather of
`common.kernels.rows`, which float8 does not on the CPU. The received rows are split
back into ``x_rows`` (float8_e4m3fn) and ``x_scale``; padding rows are zero
bytes: value 0, scale 0.

A backend opts in by registering ``dispatch_quant = quantized_dispatch(dispatch)``
where its ``dispatch`` moves rows without reading them (no arithmetic on
``hidden``). Compiled, the packing fuses with the quantization and the split
with the receiver's gather.
"""

from __future__ import annotations

import torch

from torch_moe_ops import quant
from torch_moe_ops.config import QuantSpec

_BYTES = torch.uint8


def pack_rows(hidden_TH: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """``[T, B]`` uint8: each token's fp8 values, then its fp32 scales, as bytes."""
    num_tokens, hidden_size = hidden_TH.shape
    q_TH, scale = quant.quantize_activations(hidden_TH, spec)
    # Sized from H, not inferred: 0 tokens still give rows of B bytes. The scales' bytes
    # are taken with shifts from their int32 bits (a view of the same width, free of any
    # stride rule), little-endian as a byte view reads them: Inductor lays a scale tensor
    # of size 1 out with stride 0, which no narrowing dtype view takes.
    groups = hidden_size // quant.activation_group(spec, hidden_size)
    bits_TG1 = scale.reshape(num_tokens, groups).view(torch.int32).unsqueeze(-1)
    shifts = torch.arange(0, 32, 8, dtype=torch.int32, device=hidden_TH.device)
    scale_bytes = ((bits_TG1 >> shifts) & 0xFF).to(_BYTES).reshape(num_tokens, 4 * groups)
    return torch.cat([q_TH.view(_BYTES), scale_bytes], dim=1)


def unpack_rows(packed_RB: torch.Tensor, hidden_size: int, spec: QuantSpec
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_rows [R, H] fp8, x_scale)`` of packed rows; ``x_scale`` is ``[R]`` for
    ``fp8_token``, ``[R, G]`` for ``fp8_group`` (fp32), both contiguous."""
    # Copies (a slice of rows is not contiguous), never views: with R = 0 a
    # contiguous() would hand back two views of one storage.
    x_RH = packed_RB[:, :hidden_size].clone(memory_format=torch.contiguous_format)
    scale_RG = packed_RB[:, hidden_size:].clone(memory_format=torch.contiguous_format)
    x_RH, scale_RG = x_RH.view(quant.FP8_DTYPE), scale_RG.view(torch.float32)
    return x_RH, scale_RG[:, 0] if spec.activations == "fp8_token" else scale_RG


def quantized_dispatch(dispatch):
    """The ``dispatch_quant`` kernel (``moe::dispatch_quant``'s arguments and
    outputs) that runs ``dispatch`` (a backend's ``dispatch`` kernel) on packed rows."""

    def dispatch_quant(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, weight_format,
                       activation_format, block_size, *dispatch_args):
        spec = QuantSpec.from_op_args(weight_format, activation_format, block_size)
        packed_RB, *routing = dispatch(pack_rows(hidden_TH, spec), topk_weights_TK,
                                       topk_ids_TK, num_experts, *dispatch_args)
        x_RH, x_scale = unpack_rows(packed_RB, hidden_TH.shape[1], spec)
        return (x_RH, *routing, x_scale)

    return dispatch_quant
