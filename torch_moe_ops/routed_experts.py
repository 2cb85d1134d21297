"""The routed experts' tensors as `MoE` and `HFMoEBlock` both name them."""

from __future__ import annotations

# Our names of the expert tensors, in the order moe::experts takes them.
EXPERT_TENSORS = ("w13", "w2", "b13", "b2")
# The scales of quantized experts (moe::experts_quant takes them after w13 and w2).
SCALE_TENSORS = ("w13_scale", "w2_scale")
