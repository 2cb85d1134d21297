"""`HFMoEBlock`: a transformers sparse-MoE block running on ``moe::route`` and ``moe::experts``.

Legend: B batch, S sequence, T tokens (B * S), H hidden size, I expert
intermediate size, E experts, K experts per token, F = 2 * I.

What the rest of the model relies on is kept:

- Submodules keep their transformers names (``gate``/``router``, ``experts``,
  ``shared_expert``, ``shared_expert_gate``, ``shared_experts``), so
  ``state_dict`` keys, ``save_pretrained`` and ``load_state_dict`` are unchanged.
- Blocks return what they returned: ``[B, S, H]``, and for GPT-OSS
  ``([B, S, H], router_scores [T, K])`` with the scores in the activation dtype.

Converted expert tensors (GPT-OSS) follow their sources:

- ``load_state_dict`` on the model (or any module holding the block), in place
  or with ``assign=True``, reconverts right after loading;
- an eager forward first reconverts every converted tensor whose source tensor
  was replaced, moved (``.to()``, ``param.data = ...``) or written in place
  (`weights.SourceStamp`);
- `torch_moe_ops.hf.patch` on an already patched model reconverts all of them.

The refresh writes into the existing buffers where dtype, shape and device
allow, so compiled graphs and captured CUDA graphs read the new values. A
compiled forward does not look at the sources (the check is Python that
Dynamo leaves out of the graph): after changing expert weights by anything other
than ``load_state_dict`` (assigning parameters, writing into them, an optimizer
step), call ``patch(model)`` again before calling the compiled model. `patch`
reconverts unconditionally, so it also catches the writes that the eager check
cannot see (``param.data.copy_``, writes into inference tensors). ``model.to(...)`` and
``.half()`` cast the buffers with their sources, so those stay in step, compiled
or not (the next eager forward still reconverts once: the sources moved).

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
from torch_moe_ops.hf.weights import ExpertWeights, SourceStamp, source_names
from torch_moe_ops.routed_experts import (
    EXPERT_TENSORS,
    SCALE_TENSORS,
    experts_of_rank,
    keep_local_slice,
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
        self.conversions = {}
        self._bind(weights)
        self.register_load_state_dict_post_hook(_refresh_after_load)
        if cfg.ep_size > 1:
            self._register_load_state_dict_pre_hook(self._keep_local_experts)
        self.train(block.training)

    def _bind(self, weights: ExpertWeights) -> None:
        """Read the expert tensors where ``weights`` says: attributes of the experts
        module used in place, converted copies kept as buffers of the block."""
        if weights.quant != self.cfg.quant:
            raise ValueError(f"weights.quant must be the block's cfg.quant ({self.cfg.quant}), "
                             f"got {weights.quant}")
        for name in self.conversions:
            del self._buffers[name]
        self.expert_sources = source_names(weights)
        self.weight_sources = tuple(
            ("experts", weights.shared[name]) if name in weights.shared
            else ("self", name) if name in weights.converted else None
            for name in EXPERT_TENSORS + SCALE_TENSORS)
        self.conversions = weights.converted
        self.converted_names = tuple(c.source for c in weights.converted.values())
        self.source_stamps: dict[str, SourceStamp] = {}
        for name, conversion in weights.converted.items():
            # Not persistent: the state dict keeps transformers' own tensors only.
            self.register_buffer(name, conversion(self.experts), persistent=False)
            self.source_stamps[name] = SourceStamp(getattr(self.experts, conversion.source))

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

    def _keep_local_experts(self, state_dict, prefix, *_) -> None:
        keep_local_slice(state_dict, [f"{prefix}experts.{name}" for name in self.expert_sources],
                         self.cfg, self.local_experts)

    def refresh_converted(self, force: bool = False) -> tuple[str, ...]:
        """Reconvert the converted expert tensors whose source changed since they
        were made (every one with ``force``); returns their sources' names."""
        refreshed = []
        for name, conversion in self.conversions.items():
            source = getattr(self.experts, conversion.source)
            if not force and self.source_stamps[name].matches(source):
                continue
            self._store(name, conversion(self.experts))
            self.source_stamps[name] = SourceStamp(source)
            refreshed.append(conversion.source)
        return tuple(refreshed)

    def _store(self, name: str, tensor: torch.Tensor) -> None:
        buffer = self._buffers[name]
        if (buffer.shape == tensor.shape and buffer.dtype == tensor.dtype
                and buffer.device == tensor.device and not torch.is_inference(buffer)):
            # In place: compiled graphs and captured CUDA graphs hold this buffer.
            with torch.no_grad():
                buffer.copy_(tensor)
        else:
            self._buffers[name] = tensor

    def _tensors(self, sources) -> tuple:
        return tuple(None if source is None
                     else getattr(self if source[0] == "self" else self.experts, source[1])
                     for source in sources)

    def expert_weights(self):
        """``(w13 [E, 2I, H], w2 [E, H, I], b13 [E, 2I] or None, b2 [E, H] or None)``,
        ``E_l`` experts (this rank's) in place of ``E`` with expert parallelism;
        quantized experts' ``w13``, ``w2`` in their stored format."""
        return self._tensors(self.weight_sources[:len(EXPERT_TENSORS)])

    def expert_scales(self):
        """``(w13_scale, w2_scale)`` of quantized experts (`torch_moe_ops.quant`),
        ``(None, None)`` for float experts."""
        return self._tensors(self.weight_sources[len(EXPERT_TENSORS):])

    def trainable_expert_weights(self):
        """`expert_weights`, the converted ones made from transformers' parameters
        in this call, with autograd, so that their gradients reach those parameters.
        A forward with autograd on (in training or eval mode) pays one copy of the
        converted expert tensors (the kept copies serve forwards without it)."""
        weights = dict(zip(EXPERT_TENSORS, self.expert_weights()))
        for name, conversion in self.conversions.items():
            weights[name] = conversion.convert(getattr(self.experts, conversion.source))
        return tuple(weights[name] for name in EXPERT_TENSORS)

    def _converted_need_grad(self) -> bool:
        # Whether autograd would reach a converted tensor's source; eval mode
        # does not turn autograd off, so this reads the grad mode, not .training.
        return torch.is_grad_enabled() and any(
            getattr(self.experts, name).requires_grad for name in self.converted_names)

    def forward(self, hidden_states: torch.Tensor):
        cfg = self.cfg
        if self._converted_need_grad():
            weights = self.trainable_expert_weights()
        else:
            if not torch.compiler.is_compiling():
                self.refresh_converted()
            weights = self.expert_weights()
        x_TH = hidden_states.reshape(-1, cfg.hidden_size)
        if self.training and self.jitter_noise > 0:
            x_TH = x_TH * torch.empty_like(x_TH).uniform_(1.0 - self.jitter_noise,
                                                          1.0 + self.jitter_noise)
        _, topk_weights_TK, topk_ids_TK = getattr(self, self.router_name)(x_TH)
        y_TH = run_experts(cfg, self.ep_group_name, x_TH, topk_weights_TK, topk_ids_TK, weights,
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
                f"converted={list(self.converted_names)}{quantized}")


def _refresh_after_load(block: HFMoEBlock, incompatible_keys) -> None:
    # A load_state_dict post-hook: runs outside any compiled region, so a compiled
    # model reads the loaded weights too.
    block.refresh_converted()
