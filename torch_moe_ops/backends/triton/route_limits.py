"""What the ``triton`` route kernel (`route`) computes, readable without importing triton."""

from __future__ import annotations

import torch

SCORING_CODES = {"softmax": 0, "sigmoid": 1, "topk_softmax": 2}
LOGITS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# All E logits of a token sit in one program's registers.
MAX_EXPERTS = 1024
MAX_TOP_K = 32


def limits(problem) -> str | None:
    """Why the kernel cannot compute ``problem``'s routing (a `Problem`), or None; a
    field that is None rules nothing out."""
    if problem.dtype not in LOGITS_DTYPES:
        return (f"computes in fp32 from float32, bfloat16 or float16 logits, got "
                f"{problem.dtype}")
    if problem.scoring is not None and problem.scoring not in SCORING_CODES:
        return f"computes scoring in {tuple(SCORING_CODES)}, got {problem.scoring!r}"
    if problem.num_expert_groups not in (None, 1):
        return (f"chooses among all experts at once (no expert groups), got "
                f"num_expert_groups={problem.num_expert_groups}")
    if problem.num_experts is not None and problem.num_experts > MAX_EXPERTS:
        return f"needs num_experts <= {MAX_EXPERTS}, got {problem.num_experts}"
    if problem.top_k is not None and problem.top_k > MAX_TOP_K:
        return f"needs top_k <= {MAX_TOP_K}, got {problem.top_k}"
    return None
