"""The ``flashinfer`` route backend: FlashInfer's fused DeepSeek-V3 routing kernel
(``flashinfer.fused_moe.fused_topk_deepseek``) as ``moe_flashinfer_route::route``.

Legend: T tokens, E experts, K experts per token, G expert groups.

One kernel launch (one block per token) computes what ``scoring="sigmoid"`` with
``renormalize=True`` asks (`MoEConfig`), in fp32::

    s_TE = sigmoid(logits_TE); choice_TE = s_TE + correction_bias_E
    with G > 1: keep the topk_groups groups with the best sum of their 2 best choices
    ids_TK = top_k of choice_TE (kept groups only)
    weights_TK = s_TE[ids_TK] / sum(s_TE[ids_TK]) * routed_scaling_factor

The kernel always renormalizes and scales, and only scores with a sigmoid: any
other routing, and sizes past its bounds (`limits`), run on the reference
routing, with the reason in `available_backends()` and in the error when this
backend is asked for by name.

- **Weights in fp32.** The kernel writes its weights in the logits' dtype and the
  contract's are fp32: it reads the logits as fp32 (bf16 and fp16 convert exactly,
  and it computes in fp32 whatever it reads, so the choice is the same) and
  writes fp32 weights; bf16 weights would carry bf16 rounding (8 bits). The
  correction bias is fp32 already (the contract's dtype). The layer's router
  logits are fp32 (`MoE.route`): there the conversion is free.
- **No correction bias.** The kernel always adds one: zeros choose exactly as no
  bias does (``s + 0 == s``), for one E-element fill per call.
- **Ties.** Among exactly equal scores the kernel may choose another expert than
  ``torch.topk`` does; on real-valued logits that has probability ~0.
- **Gradient.** The op contract's formula (`torch_moe_ops.ops.route`) on this
  kernel's choice and weights, as for every route backend.
- **Checks.** FlashInfer's own Python checks are skipped (``skip_check=True``): they
  refuse routing without groups (they ask ``topk_group * n_group >= topk``) that
  the kernel runs, and they let through group counts the kernel reads out of
  bounds (more than 8). `limits` is checked before every launch instead.
- **Build.** The kernel's JIT module (``dsv3_fused_routing``) compiles on the
  first call (about 12 s; nvcc must be there, as for every FlashInfer JIT module).
"""

from __future__ import annotations

import torch

from torch_moe_ops.backends.flashinfer.library import device_reason
from torch_moe_ops.backends.problems import problem_of
from torch_moe_ops.backends.registry import REGISTRY, Problem, RouteBackend
from torch_moe_ops.ops import define_backend_ops

NAMESPACE = "moe_flashinfer_route"
# The kernel's bounds (flashinfer-python 0.7.2, csrc/fused_moe/noAuxTcKernels.cu).
MAX_TOP_K = 8  # MaxNumTopExperts: each lane keeps its top-k in 8 registers
MAX_EXPERTS_UNGROUPED = 384  # NumKimiK2Experts: 3 warps of 128 experts each
# With groups: one warp per group in a block of 256 threads, one lane per expert,
# and the final choice reads 4 kept groups (MaxNumTopGroups). Its other two bounds,
# E <= 256 and experts per group * topk_groups <= 128, follow from these.
MAX_GROUPS = 8
MAX_EXPERTS_PER_GROUP = 32
MAX_TOPK_GROUPS = 4
LOGITS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The architectures FlashInfer builds and runs this kernel for (its
# `supported_compute_capability` of the default fused-routing backend).
CAPABILITIES = ((8, 9), (9, 0), (10, 0), (10, 3), (10, 7), (12, 0), (12, 1))


def limits(problem: Problem) -> str | None:
    """Why the kernel cannot compute ``problem``'s routing, or ``None``. A field
    of ``problem`` that is ``None`` rules nothing out."""
    if problem.scoring not in (None, "sigmoid"):
        return f"computes scoring='sigmoid' only, got scoring={problem.scoring!r}"
    if problem.renormalize is False:
        return "always renormalizes the chosen weights, got renormalize=False"
    if problem.dtype not in LOGITS_DTYPES:
        return f"computes in fp32 from float32, bfloat16 or float16 logits, got {problem.dtype}"
    if problem.top_k is not None and problem.top_k > MAX_TOP_K:
        return f"needs top_k <= {MAX_TOP_K}, got {problem.top_k}"
    groups, num_experts = problem.num_expert_groups, problem.num_experts
    if groups is None or groups == 1:
        if num_experts is not None and num_experts > MAX_EXPERTS_UNGROUPED:
            return (f"needs num_experts <= {MAX_EXPERTS_UNGROUPED} without expert groups, "
                    f"got {num_experts}")
        return None
    if groups > MAX_GROUPS:
        return f"needs num_expert_groups <= {MAX_GROUPS}, got {groups}"
    if problem.topk_groups is not None and problem.topk_groups > MAX_TOPK_GROUPS:
        return f"needs topk_groups <= {MAX_TOPK_GROUPS}, got {problem.topk_groups}"
    if num_experts is not None and num_experts // groups > MAX_EXPERTS_PER_GROUP:
        return (f"needs at most {MAX_EXPERTS_PER_GROUP} experts per group (num_experts / "
                f"num_expert_groups), got {num_experts} / {groups} = {num_experts // groups}")
    return None


def _device_reason(device: torch.device) -> str | None:
    reason = device_reason(device, min(CAPABILITIES))
    if reason is not None:
        return reason
    capability = torch.cuda.get_device_capability(device)
    if capability not in CAPABILITIES:
        return (f"runs on sm{', sm'.join(f'{a}{b}' for a, b in CAPABILITIES)}, got "
                f"sm{capability[0]}{capability[1]}")
    return None


def supports(spec, problem: Problem, device: torch.device) -> str | None:
    """The device first, then the routing's limits: where the kernel cannot run at all,
    that is its reason for every layer, as `available_backends` gives it."""
    return _device_reason(device) or limits(problem)


def route(router_logits_TE: torch.Tensor, correction_bias_E: torch.Tensor | None,
          top_k: int, scoring: str, renormalize: bool, num_expert_groups: int,
          topk_groups: int, routed_scaling_factor: float):
    """``moe::route`` on FlashInfer's kernel: fp32 weights ``[T, K]``, int32 ids ``[T, K]``.
    Raises ValueError where the kernel cannot compute this routing here."""
    args = (router_logits_TE, correction_bias_E, top_k, scoring, renormalize,
            num_expert_groups, topk_groups, routed_scaling_factor)
    reason = supports(None, problem_of("route", args), router_logits_TE.device)
    if reason is not None:
        raise ValueError(f"the flashinfer route backend cannot run this routing: {reason}")
    num_tokens, num_experts = router_logits_TE.shape
    topk_weights_TK = router_logits_TE.new_empty((num_tokens, top_k), dtype=torch.float32)
    topk_ids_TK = router_logits_TE.new_empty((num_tokens, top_k), dtype=torch.int32)
    if num_tokens == 0:
        # One block per token: a grid of none is an invalid launch.
        return topk_weights_TK, topk_ids_TK
    if correction_bias_E is None:
        correction_bias_E = router_logits_TE.new_zeros(num_experts, dtype=torch.float32)
    from flashinfer.fused_moe import fused_topk_deepseek

    fused_topk_deepseek(router_logits_TE.float().contiguous(), correction_bias_E.contiguous(),
                        num_expert_groups, topk_groups, top_k, routed_scaling_factor,
                        topk_weights_TK, topk_ids_TK, skip_check=True)
    return topk_weights_TK, topk_ids_TK


define_backend_ops(NAMESPACE, {"route": route})
REGISTRY.register_route(RouteBackend(
    name="flashinfer", namespace=NAMESPACE, supports=supports, priority=10,
    description=(f"FlashInfer's fused DeepSeek-V3 routing kernel: sigmoid (+ correction "
                 f"bias), renormalized, top_k <= {MAX_TOP_K}; groups: at most {MAX_GROUPS} "
                 f"of <= {MAX_EXPERTS_PER_GROUP} experts, topk_groups <= {MAX_TOPK_GROUPS}; "
                 f"else <= {MAX_EXPERTS_UNGROUPED} experts")))
