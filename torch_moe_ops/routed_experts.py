"""The routed experts as `MoE` and `HFMoEBlock` both run them: their tensors'
names, which experts a rank holds, and the forward that picks the ops.

Legend: T tokens, H hidden size, K experts per token, R received rows, E experts.
"""

from __future__ import annotations

import sys

import torch

from torch_moe_ops.config import MoEConfig
from torch_moe_ops.ops.library import call

# Our names of the expert tensors, in the order moe::experts takes them.
EXPERT_TENSORS = ("w13", "w2", "b13", "b2")
# The scales of quantized experts (moe::experts_quant takes them after w13 and w2).
SCALE_TENSORS = ("w13_scale", "w2_scale")


def experts_of_rank(cfg: MoEConfig, ep_rank: int) -> range:
    """The global ids of the experts rank ``ep_rank`` holds (all of them without
    expert parallelism)."""
    num_local = cfg.num_local_experts
    return range(ep_rank * num_local, (ep_rank + 1) * num_local)


def is_dtensor(tensor) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (expert weights under
    `torch_moe_ops.parallel.parallelize_moe`). One exists only once
    ``torch.distributed.tensor`` is imported, which this does not do: that import
    costs every user of the package half a second."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def local_part(tensor):
    """This rank's part of ``tensor`` where it is a ``DTensor``, else ``tensor``: the
    ops take plain tensors."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def keep_local_slice(state_dict: dict, keys, cfg: MoEConfig, local: range) -> None:
    """In ``state_dict``, each tensor under ``keys`` that holds every expert
    (``[E, ...]``) becomes a copy of its ``local`` experts: a full checkpoint then
    loads on every rank. A copy, so that loading with ``assign=True`` does not
    keep the full tensor alive. A ``DTensor`` (a resharded checkpoint) is left as it
    is: its placements say which part is this rank's."""
    for key in keys:
        tensor = state_dict.get(key)
        if (tensor is not None and tensor.shape[:1] == (cfg.num_experts,)
                and not is_dtensor(tensor)):
            state_dict[key] = tensor[local.start:local.stop].clone()


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """Autocast's dtype where autocast is on for ``device_type``, else None. The meta
    device is not asked: autocast does not know it and raises."""
    if device_type != "meta" and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def autocast_inputs(x_TH: torch.Tensor, weights: tuple) -> tuple[torch.Tensor, tuple]:
    """``(x_TH, weights)`` in autocast's dtype where autocast is on for their device and
    the experts are float (their GEMMs then run in low precision, as transformers' experts
    and ``nn.Linear`` do under autocast; the gradients flow back through the casts to the
    parameters' dtype), else as they are. Quantized experts keep their stored format."""
    dtype = autocast_dtype(x_TH.device.type)
    if dtype is None or not weights[0].is_floating_point():
        return x_TH, weights
    return x_TH.to(dtype), tuple(None if w is None else w.to(dtype) for w in weights)


def route_logits(cfg: MoEConfig, logits_TE: torch.Tensor, correction_E: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe::route`` of router logits ``[T, E]`` (fp32) under ``cfg``'s routing:
    ``(topk_weights [T, K] fp32, topk_ids [T, K] int32)``. Through `ops.library.call`:
    eagerly, without a gradient, the kernel runs without the dispatcher."""
    return call(torch.ops.moe.route, logits_TE, correction_E, cfg.top_k, cfg.scoring,
                cfg.renormalize, cfg.num_expert_groups, cfg.topk_groups,
                cfg.static_float("routed_scaling_factor"))


def run_experts(cfg: MoEConfig, ep_group_name: str, x_TH: torch.Tensor,
                topk_weights_TK: torch.Tensor, topk_ids_TK: torch.Tensor, weights: tuple,
                scales: tuple = (None, None)) -> torch.Tensor:
    """The routed experts' output ``[T, H]`` for tokens and their routing (global
    expert ids), on the ops ``cfg`` calls for::

        ep_size == 1:  moe::experts (moe::experts_quant with cfg.quant)
        ep_size > 1:   moe::dispatch -> moe::experts_rows (_quant) -> moe::combine

    each through `ops.library.call` (eagerly and without a gradient: their kernels directly).
    ``weights``: ``(w13, w2, b13, b2)`` of this rank's experts; ``scales``:
    ``(w13_scale, w2_scale)`` of quantized experts (`torch_moe_ops.quant`). Under autocast,
    float experts compute in its dtype and return ``[T, H]`` in it (`autocast_inputs`)."""
    act_args = (cfg.activation, cfg.static_float("swiglu_alpha"),
                cfg.static_float("swiglu_limit"))
    if cfg.quant is None:
        x_TH, weights = autocast_inputs(x_TH, weights)
        expert_args = (*weights, *act_args)
    else:
        w13, w2, b13, b2 = weights
        expert_args = (w13, w2, *scales, b13, b2, cfg.quant.weights, cfg.quant.activations,
                       cfg.quant.block_list, *act_args)
    moe = torch.ops.moe
    if cfg.ep_size == 1:
        experts_op = moe.experts if cfg.quant is None else moe.experts_quant
        return call(experts_op, x_TH, topk_weights_TK, topk_ids_TK, *expert_args)
    ep_args = (cfg.ep_size, ep_group_name, cfg.max_tokens_per_rank)
    x_RH, expert_R, weight_R, src_R, count_E, combine_map_TK = call(
        moe.dispatch, x_TH, topk_weights_TK, topk_ids_TK, cfg.num_experts, *ep_args,
        cfg.rows_per_rank)
    if cfg.quant is None:
        y_RH = call(moe.experts_rows, x_RH, expert_R, count_E, *expert_args)
    else:
        y_RH = call(moe.experts_rows_quant, x_RH, None, expert_R, count_E,
                    *expert_args)
    return call(moe.combine, y_RH, weight_R, src_R, combine_map_TK, *ep_args)
