"""Drop-in for Hugging Face transformers models: their sparse-MoE blocks on our ops.

    report = torch_moe_ops.hf.patch(model)      # in place; report says what changed
    model = torch.compile(model, backend=torch_moe_ops.backend(experts="triton"))

`patch` replaces every sparse-MoE block of a supported family (Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3, GPT-OSS) with an `HFMoEBlock` that
routes with ``moe::route`` and runs the experts with ``moe::experts``, computing
what transformers computes; what it cannot express it leaves alone and reports.
Importing this package also registers ``"torch_moe_ops"`` as a transformers
experts implementation (experts on ``moe::experts``, routing transformers').

The parts, one job each:

- `families`: the supported block classes (`FAMILIES`) and their routing as `MoEConfig`;
- `router`: the patched router (`RoutedRouter`), logits as transformers computes them;
- `weights`: expert tensors used in place, or converted once into parameters in
  our layout (GPT-OSS);
- `block`: `HFMoEBlock`, and the state-dict hooks that keep transformers' layout
  in checkpoints;
- `patching`: `patch`, `PatchReport`, `renamed_parameters`, and what is not supported;
- `quantized`: `load_into`, a quantized checkpoint's experts into the patched blocks;
- `experts_interface`: the ``"torch_moe_ops"`` experts implementation.
"""

from __future__ import annotations

import torch_moe_ops.backends  # noqa: F401  (installs the eager kernels of the ops)
from torch_moe_ops.hf.block import HFMoEBlock
from torch_moe_ops.hf.experts_interface import (
    EXPERTS_IMPLEMENTATION,
    experts_forward,
    register_experts_implementation,
)
from torch_moe_ops.hf.families import ACTIVATIONS, FAMILIES, Family, family_of
from torch_moe_ops.hf.patching import PatchedBlock, PatchReport, patch, renamed_parameters
from torch_moe_ops.hf.quantized import load_into
from torch_moe_ops.hf.router import RoutedRouter
from torch_moe_ops.hf.weights import ExpertWeights

__all__ = ["ACTIVATIONS", "EXPERTS_IMPLEMENTATION", "FAMILIES", "ExpertWeights", "Family",
           "HFMoEBlock", "PatchReport", "PatchedBlock", "RoutedRouter", "experts_forward",
           "family_of", "load_into", "patch", "register_experts_implementation",
           "renamed_parameters"]

register_experts_implementation()
