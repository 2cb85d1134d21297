"""The patched router: the transformers router object, routing with ``moe::route``.

Legend: T tokens, H hidden size, E experts, K experts per token.

The router stays the same object: `patch` sets its class to a subclass of its own
class whose ``forward`` computes the logits as transformers does and calls
``moe::route``. The ``OutputRecorder`` that transformers installs on the router
class for ``output_router_logits`` therefore still matches, and hooks already
installed on the router stay. The router returns ``(logits [T, E], weights [T, K]
fp32, ids [T, K] int32)``; transformers returns weights in the logits dtype
(except Mixtral and DeepSeek-V3) and int64 ids, which nothing downstream reads.

The logits are in the router weight's dtype (DeepSeek-V3: fp32), as transformers
computes them without autocast. Autocast is turned off around them, so an fp32
model under ``torch.autocast(dtype=torch.bfloat16)`` routes exactly as without it
(transformers' own routers would take bf16 logits there).

Routing is computed exactly as transformers does, with two differences that do
not change results: DeepSeek-V3 renormalizes with ``sum + 1e-20`` and we divide
by the sum (the same in fp32 for any sum above 1e-13), and both mask groups that
are not selected with -inf (transformers 4.x used 0.0, which differs only when
every eligible ``sigmoid + correction bias`` is negative).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torch_moe_ops.config import MoEConfig
from torch_moe_ops.hf.families import Family
from torch_moe_ops.layer import without_autocast
from torch_moe_ops.routed_experts import route_logits


class RoutedRouter(nn.Module):
    """Mixed in front of a transformers router class by `patch`.

    ``forward(hidden_states [..., H]) -> (logits [T, E], weights [T, K] fp32,
    ids [T, K] int32)``: the logits in the router weight's dtype (fp32 where
    ``logits_in_fp32``), whatever autocast says, the rest from ``moe::route``.
    Uses the router's own ``weight [E, H]``, ``bias [E]`` (``router_bias``) and
    ``e_score_correction_bias [E]`` (``correction_bias``).
    """

    moe_config: MoEConfig
    logits_in_fp32: bool

    def forward(self, hidden_states: torch.Tensor):
        cfg = self.moe_config
        x_TH = hidden_states.reshape(-1, cfg.hidden_size)
        weight_EH = self.weight
        bias_E = self.bias if cfg.router_bias else None
        logits_dtype = torch.float32 if self.logits_in_fp32 else weight_EH.dtype
        with without_autocast(x_TH.device.type):
            logits_TE = F.linear(x_TH.to(logits_dtype), weight_EH.to(logits_dtype),
                                 None if bias_E is None else bias_E.to(logits_dtype))
        # The buffer is fp32 when loaded (transformers keeps it so), but a later
        # model.to(bfloat16) casts it; moe::route wants fp32.
        correction_E = self.e_score_correction_bias.float() if cfg.correction_bias else None
        return logits_TE, *route_logits(cfg, logits_TE, correction_E)

    def __reduce_ex__(self, protocol):
        # The class is made at patch time and cannot be found by name: pickle (torch.save,
        # deepcopy) rebuilds it from the transformers class it extends.
        return _unpickle_router, (type(self).__bases__[1],), self.__dict__


def _routed_router_class(hf_class: type) -> type:
    """A subclass of the transformers router class ``hf_class`` whose forward is
    `RoutedRouter.forward`, with the same name so the model prints as before."""
    return type(hf_class.__name__, (RoutedRouter, hf_class), {"__module__": __name__})


def _unpickle_router(hf_class: type) -> nn.Module:
    return nn.Module.__new__(_routed_router_class(hf_class))


def route_with_ops(router: nn.Module, family: Family, cfg: MoEConfig,
                   routed_classes: dict[type, type]) -> None:
    """Give ``router`` a subclass of its own class whose forward calls ``moe::route``;
    ``routed_classes`` (transformers class -> subclass) makes one subclass per class."""
    hf_class = type(router)
    if hf_class not in routed_classes:
        routed_classes[hf_class] = _routed_router_class(hf_class)
    router.__class__ = routed_classes[hf_class]
    router.moe_config = cfg
    router.logits_in_fp32 = family.logits_in_fp32
