"""`HFMoEBlock`: a transformers sparse-MoE block running on ``moe::route`` and ``moe::experts``.

Legend: B batch, S sequence, T tokens (B * S), H hidden size, I expert
intermediate size, E experts, K experts per token, F = 2 * I.

What the rest of the model relies on is kept:

- Submodules keep their transformers names (``gate``/``router``, ``experts``,
  ``shared_expert``, ``shared_expert_gate``, ``shared_experts``), so
  ``state_dict`` keys, ``save_pretrained`` and ``load_state_dict`` are unchanged.
- Blocks return what they returned: ``[B, S, H]``, and for GPT-OSS
  ``([B, S, H], router_scores [T, K])`` with the scores in the activation dtype.

Converted expert tensors (GPT-OSS) are held in our layout, converted once when
the block is built (`weights.hold_in_our_layout`): they are the experts module's
parameters ``w13 [E, F, H]``, ``b13 [E, F]``, ``w2 [E, H, I]`` in place of
transformers' ``gate_up_proj``, ``gate_up_proj_bias``, ``down_proj``, and every
forward (training, eval, generation, compiled or not) reads them as they are.
Two state-dict hooks keep checkpoints in transformers' layout:

- ``state_dict()`` (and so ``save_pretrained``) writes them back under
  transformers' keys, in its layout and key order (a copy each call, a plain
  tensor even with ``keep_vars=True``);
- ``load_state_dict`` of such a state dict converts them on the way in, then
  copies into the same parameters (``assign=True`` replaces them).

An optimizer must be built after `torch_moe_ops.hf.patch`: one built before
holds transformers' old tensors, which the patched model no longer reads (its
steps change nothing the model computes, and it keeps their memory).

Quantized experts (``cfg.quant``; transformers' fp8 experts used in place, or
`weights.QuantizedExperts` from `torch_moe_ops.hf.load_into`) run on
``moe::experts_quant`` (``moe::experts_rows_quant``), for inference only.

Expert parallelism (``cfg.ep_size > 1``, built by ``patch(model, ep_group=...)``):
the experts module holds this rank's experts only (`weights.keep_local_experts`),
so ``state_dict`` has the same keys with ``[E_l, ...]`` expert tensors;
``load_state_dict`` takes those or full ``[E, ...]`` ones, of which it keeps
this rank's slice (the same checkpoint loads on every rank).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from torch_moe_ops.config import MoEConfig
from torch_moe_ops.hf.families import Family
from torch_moe_ops.hf.weights import ExpertWeights, hold_in_our_layout, source_names
from torch_moe_ops.routed_experts import (
    EXPERT_TENSORS,
    SCALE_TENSORS,
    experts_of_rank,
    keep_local_slice,
    local_part,
    run_experts,
)


class HFMoEBlock(nn.Module):
    """A transformers sparse-MoE block running on ``moe::route`` and ``moe::experts``.

    ``forward(hidden_states [B, S, H]) -> [B, S, H]`` (GPT-OSS: also
    ``router_scores [T, K]``)::

        logits, w, ids = router(x)                       # moe::route inside
        y = experts(x, w, ids)                           # moe::experts
        # or, expert-parallel: moe::dispatch -> moe::experts_rows -> moe::combine
        y += sigmoid(shared_expert_gate(x)) * shared_expert(x)   # Qwen2-MoE
        y += shared_experts(x)                           # DeepSeek-V3

    Built by `patch`; keeps the block's submodules under their transformers names.
    With ``cfg.ep_size > 1``, ``ep_group`` is the expert-parallel ``ProcessGroup``
    of ``cfg.ep_size`` ranks and ``experts`` must already hold this rank's experts
    only, ``local_experts`` (global ids).
    """

    def __init__(self, block: nn.Module, family: Family, cfg: MoEConfig, weights: ExpertWeights,
                 ep_group=None):
        super().__init__()
        self.family = family.name
        self.cfg = cfg
        if (cfg.ep_size > 1) != (ep_group is not None):
            raise ValueError(f"ep_group must be given exactly when cfg.ep_size > 1, got "
                             f"ep_size={cfg.ep_size} and ep_group={ep_group!r}")
        self.ep_rank = 0 if ep_group is None else ep_group.rank()
        # The ops take the group by name (a constant to torch.compile).
        self.ep_group_name = "" if ep_group is None else ep_group.group_name
        for name, child in block.named_children():
            self.add_module(name, child)
        self.router_name = family.router
        self.shared_expert_name = family.shared_expert
        self.shared_expert_gate_name = family.shared_expert_gate
        self.returns_router_scores = family.returns_router_scores
        # Mixtral multiplies its input by uniform(1 - j, 1 + j) noise in training.
        self.jitter_noise = float(getattr(block, "jitter_noise", 0.0))
        self._bind(weights)
        if cfg.ep_size > 1:
            # Before the conversion hook: it slices transformers' tensors.
            self.register_load_state_dict_pre_hook(_keep_local_experts)
        self.register_load_state_dict_pre_hook(_load_in_our_layout)
        self.register_state_dict_post_hook(_save_in_transformers_layout)
        self.train(block.training)

    def _bind(self, weights: ExpertWeights) -> None:
        """Read the expert tensors where ``weights`` says, from the experts module
        (its converted ones held in our layout from now on)."""
        if weights.quant != self.cfg.quant:
            raise ValueError(f"weights.quant must be the block's cfg.quant ({self.cfg.quant}), "
                             f"got {weights.quant}")
        # transformers' names of the expert tensors: the state dict's keys.
        self.expert_sources = source_names(weights)
        hold_in_our_layout(self.experts, weights)
        self.weight_sources = tuple(weights.attribute(name)
                                    for name in EXPERT_TENSORS + SCALE_TENSORS)
        self.conversions = weights.converted

    def use_experts(self, experts: nn.Module, weights: ExpertWeights) -> None:
        """Run on ``experts`` from now on, its tensors read as ``weights`` says, in
        place of the experts module the block holds (which it drops; the state dict
        then holds ``experts``' tensors under ``experts.*``). ``weights.quant`` is
        the experts' format (None: float). Call it before compiling the model:
        graphs compiled before keep the old experts."""
        self.cfg = dataclasses.replace(self.cfg, quant=weights.quant)
        self.experts = experts
        self._bind(weights)

    @property
    def local_experts(self) -> range:
        """The global ids of the experts this rank holds (all of them without
        expert parallelism)."""
        return experts_of_rank(self.cfg, self.ep_rank)

    def _tensors(self, names) -> tuple:
        return tuple(None if name is None else getattr(self.experts, name) for name in names)

    def expert_weights(self):
        """``(w13 [E, 2I, H], w2 [E, H, I], b13 [E, 2I] or None, b2 [E, H] or None)``,
        ``E_l`` experts (this rank's) in place of ``E`` with expert parallelism;
        quantized experts' ``w13``, ``w2`` in their stored format."""
        return self._tensors(self.weight_sources[:len(EXPERT_TENSORS)])

    def expert_scales(self):
        """``(w13_scale, w2_scale)`` of quantized experts (`torch_moe_ops.quant`),
        ``(None, None)`` for float experts."""
        return self._tensors(self.weight_sources[len(EXPERT_TENSORS):])

    def forward(self, hidden_states: torch.Tensor):
        cfg = self.cfg
        x_TH = hidden_states.reshape(-1, cfg.hidden_size)
        if self.training and self.jitter_noise > 0:
            x_TH = x_TH * torch.empty_like(x_TH).uniform_(1.0 - self.jitter_noise,
                                                          1.0 + self.jitter_noise)
        _, topk_weights_TK, topk_ids_TK = getattr(self, self.router_name)(x_TH)
        y_TH = run_experts(cfg, self.ep_group_name, x_TH, topk_weights_TK, topk_ids_TK,
                           tuple(local_part(w) for w in self.expert_weights()),
                           self.expert_scales())
        if self.shared_expert_name is not None:
            shared_TH = getattr(self, self.shared_expert_name)(x_TH)
            if self.shared_expert_gate_name is not None:
                gate_T1 = getattr(self, self.shared_expert_gate_name)(x_TH)
                shared_TH = torch.sigmoid(gate_T1) * shared_TH
            y_TH = y_TH + shared_TH
        y = y_TH.view(hidden_states.shape)
        if self.returns_router_scores:
            return y, topk_weights_TK.to(hidden_states.dtype)
        return y

    def extra_repr(self) -> str:
        ep = ""
        if self.cfg.ep_size > 1:
            local = self.local_experts
            ep = f", local={local.start}..{local.stop - 1}, ep_size={self.cfg.ep_size}"
        quantized = "" if self.cfg.quant is None else f", quant={self.cfg.quant.name}"
        return (f"family={self.family}, experts={self.cfg.num_experts}{ep}, "
                f"top_k={self.cfg.top_k}, scoring={self.cfg.scoring}, "
                f"converted={[c.source for c in self.conversions.values()]}{quantized}")


# The hooks are module-level functions (not bound methods): torch marks the
# public ones with an attribute, and they pickle with the block.


def _keep_local_experts(block: HFMoEBlock, state_dict, prefix, *_) -> None:
    keep_local_slice(state_dict, [f"{prefix}experts.{name}" for name in block.expert_sources],
                     block.cfg, block.local_experts)


def _load_in_our_layout(block: HFMoEBlock, state_dict, prefix, local_metadata, strict,
                        missing_keys, unexpected_keys, error_msgs) -> None:
    """transformers' converted expert tensors in ``state_dict`` into ours, renamed."""
    for name, conversion in block.conversions.items():
        source_key = f"{prefix}experts.{conversion.source}"
        if source_key not in state_dict:
            continue
        source = state_dict.pop(source_key).detach()
        expected = conversion.source_shape(getattr(block.experts, name))
        if tuple(source.shape) != expected:
            error_msgs.append(f"size mismatch for {source_key}: copying a param with shape "
                              f"{tuple(source.shape)} from checkpoint, the shape in current "
                              f"model (transformers' layout of experts.{name}) is {expected}.")
            continue
        state_dict[f"{prefix}experts.{name}"] = conversion.to_ours(source)


def _save_in_transformers_layout(block: HFMoEBlock, state_dict, prefix, local_metadata) -> None:
    """Our converted expert tensors in ``state_dict`` back into transformers' keys and
    layout, in the block's key order."""
    if not block.conversions:
        return
    renamed = {f"{prefix}experts.{name}": conversion
               for name, conversion in block.conversions.items()}
    # The block's keys are the last ones in: popping and re-adding them in order keeps
    # the state dict's order.
    for key in [key for key in state_dict if key.startswith(prefix)]:
        value = state_dict.pop(key)
        if key in renamed:
            conversion = renamed[key]
            key = f"{prefix}experts.{conversion.source}"
            value = conversion.to_source(value.detach())
        state_dict[key] = value
