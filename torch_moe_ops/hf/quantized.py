"""Quantized experts from a checkpoint into a patched model (`load_into`).

The checkpoint is read by `torch_moe_ops.checkpoints` (its layouts and checks);
here each patched block gets a `QuantizedExperts` in place of transformers' experts.
"""

from __future__ import annotations

import os

from torch import nn

from torch_moe_ops import checkpoints, quant
from torch_moe_ops.hf.block import HFMoEBlock
from torch_moe_ops.hf.weights import QuantizedExperts, quantized_weights


def load_into(model: nn.Module, path: str | os.PathLike, key_prefix: str = "") -> list[str]:
    """Give every patched block of ``model`` (`torch_moe_ops.hf.patch`) the
    quantized experts its checkpoint holds at ``path``; returns the blocks' names.

    For each `HFMoEBlock` named ``name``, the experts under ``key_prefix + name``
    (e.g. ``model.layers.3.mlp``; ``key_prefix="model."`` for a base model whose
    blocks are named ``layers.3.mlp``) are read in our layout (this rank's only,
    with expert parallelism) into a `QuantizedExperts` that replaces the block's
    experts module on the same device, biases in that module's float dtype. The
    block then runs ``moe::experts_quant`` (inference only) and its state dict
    holds ``experts.w13``, ``experts.w13_scale``, ... in place of transformers'
    expert tensors. The router, shared experts and the rest of the model keep
    what transformers loaded.

    This is how a model runs quantized experts where transformers dequantized
    them at load: GPT-OSS's MXFP4 experts without transformers' hub kernels, or
    DeepSeek-V3's fp8 experts without a GPU that runs fp8. Call it before
    compiling the model.
    """
    checkpoint = checkpoints.Checkpoint(path)
    loaded = []
    for name, block in model.named_modules():
        if not isinstance(block, HFMoEBlock):
            continue
        read = checkpoints.read_experts(checkpoint, key_prefix + name, block.local_experts)
        _check_fits(name, block.cfg, read, len(block.local_experts), checkpoint)
        w13, _, b13, _ = block.expert_weights()
        # The biases are added to the activations: they take the dtype of the
        # block's own (those of a checkpoint are bf16).
        tensors = {key: tensor.to(w13.device, b13.dtype if key in ("b13", "b2") else None)
                   for key, tensor in read.tensors().items()}
        experts = QuantizedExperts(read.spec, **tensors)
        block.use_experts(experts, quantized_weights(experts))
        loaded.append(name)
    return loaded


def _check_fits(name: str, cfg, read: checkpoints.ExpertTensors, num_local: int,
                checkpoint: checkpoints.Checkpoint) -> None:
    """The experts read are the ones a patched block of ``cfg`` runs."""
    expected = quant.weight_shape(read.spec, num_local, 2 * cfg.intermediate_size,
                                  cfg.hidden_size)
    if tuple(read.w13.shape) != expected:
        raise ValueError(f"{name}'s experts in {str(checkpoint.path)!r} must have w13 of shape "
                         f"{list(expected)} ({read.spec.weights}, from the block's config), "
                         f"got {list(read.w13.shape)}")
    if (read.b13 is not None) != cfg.expert_bias:
        raise ValueError(f"{name}'s experts in {str(checkpoint.path)!r} must "
                         f"{'have' if cfg.expert_bias else 'have no'} biases, as the block's "
                         f"config says, got {'none' if read.b13 is None else 'biases'}")
