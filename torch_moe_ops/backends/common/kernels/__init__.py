"""Kernels several backends run; none of them registers an op.

- `sorting`: slots grouped by expert (a stable sort on the device).
- `rows`: moving rows between the frames of dispatch and combine.
- `activation`: the gated activations and their gradients in plain PyTorch.
- `triton_activation`, `epilogues`: the same as Triton functions, and
  elementwise Triton kernels around library GEMMs (need triton).
- `grouped_backward`: the experts' gradient on the routed rows only, grouped GEMMs.
- `grouped_gemm`: the experts and their gradient on ``torch._grouped_mm`` with
  those epilogues.
- `act_quant`: dynamic fp8 quantization of activation rows (per row or per group), one
  Triton launch, torch's quantizer bit for bit.
- `scaled_grouped_gemm`: quantized experts (fp8 w8a8, rowwise scales) on
  ``torch._scaled_grouped_mm`` with the same sort and epilogues.
- `launch`, `tracing`: how a backend op traced into a compiled graph launches its
  Triton kernels, and what it may ask of the trace (Inductor or not, fixed sizes).
"""
