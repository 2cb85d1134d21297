"""`MoE`: a drop-in ``nn.Module`` for a Mixture-of-Experts block.

Legend: T tokens, H hidden size, I expert intermediate size, S shared-expert
intermediate size, E experts, K experts per token.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

import torch_moe_ops.backends  # noqa: F401  (installs the eager kernels of the ops)
from torch_moe_ops import checkpoints, load_balance, quant
from torch_moe_ops.backends.common.kernels.activation import activation
from torch_moe_ops.config import MoEConfig
from torch_moe_ops.ops.checks import OP_FLOAT_DTYPES
from torch_moe_ops.routed_experts import (
    EXPERT_TENSORS,
    SCALE_TENSORS,
    autocast_dtype,
    experts_of_rank,
    keep_local_slice,
    local_part,
    route_logits,
    run_experts,
)


def without_autocast(device_type: str):
    """A context that turns autocast off on ``device_type`` where it is on (the
    router: under autocast its GEMM runs in low precision and tokens pick other
    experts). Where autocast is off it does nothing, so a traced graph shows no
    autocast nodes."""
    if autocast_dtype(device_type) is not None:
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def ep_process_group(cfg: MoEConfig, ep_group):
    """The ``ProcessGroup`` of ``ep_group`` (a group or a 1-D ``DeviceMesh``), checked
    against ``cfg.ep_size``; ``None`` for ``ep_size == 1``."""
    if ep_group is None:
        if cfg.ep_size > 1:
            raise ValueError(f"ep_group must be the expert-parallel ProcessGroup or 1-D "
                             f"DeviceMesh when ep_size > 1, got None (ep_size={cfg.ep_size})")
        return None
    if hasattr(ep_group, "get_group"):
        if ep_group.ndim != 1:
            raise ValueError(f"ep_group must be a 1-D DeviceMesh, got {ep_group.ndim}-D")
        ep_group = ep_group.get_group()
    size = ep_group.size()
    if size != cfg.ep_size:
        raise ValueError(f"ep_group must have cfg.ep_size ({cfg.ep_size}) ranks, got {size}")
    return ep_group if size > 1 else None


class SharedExperts(nn.Module):
    """A gated MLP every token goes through: ``act(x @ w13.T) @ w2.T``, optionally
    scaled by ``sigmoid(x @ gate.T)`` (Qwen2-MoE's ``shared_expert_gate``)."""

    def __init__(self, cfg: MoEConfig, device=None, dtype=None):
        super().__init__()
        size = cfg.shared_expert_intermediate_size
        self.cfg = cfg
        self.w13 = nn.Parameter(torch.empty(2 * size, cfg.hidden_size, device=device,
                                            dtype=dtype))  # [2S, H]
        self.w2 = nn.Parameter(torch.empty(cfg.hidden_size, size, device=device,
                                           dtype=dtype))  # [H, S]
        self.gate = (nn.Linear(cfg.hidden_size, 1, bias=False, device=device, dtype=dtype)
                     if cfg.shared_expert_gate else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.w13, a=math.sqrt(5))
        nn.init.kaiming_uniform_(self.w2, a=math.sqrt(5))
        if self.gate is not None:
            self.gate.reset_parameters()

    def extra_repr(self) -> str:
        return (f"intermediate={self.cfg.shared_expert_intermediate_size}, "
                f"activation={self.cfg.activation}, gated={self.gate is not None}")

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        gate_TS, up_TS = F.linear(x_TH, self.w13).chunk(2, dim=-1)
        cfg = self.cfg
        y_TH = F.linear(activation(gate_TS, up_TS, cfg.activation,
                                   cfg.static_float("swiglu_alpha"),
                                   cfg.static_float("swiglu_limit")), self.w2)
        if self.gate is not None:
            y_TH = torch.sigmoid(self.gate(x_TH)) * y_TH
        return y_TH


class MoE(nn.Module):
    """A Mixture-of-Experts block: router, routed experts, optional shared experts.

    ``forward(x [..., H]) -> [..., H]`` in ``x``'s dtype. The router runs in fp32,
    under autocast too (``gate.weight [E, H]``, optional ``gate.bias [E]``, and for
    sigmoid scoring with ``correction_bias`` an fp32 buffer
    ``e_score_correction_bias [E]`` that only steers selection). Expert weights are
    canonical: ``w13 [E, 2I, H]`` (gate rows then up rows), ``w2 [E, H, I]``,
    optional ``b13 [E, 2I]``, ``b2 [E, H]``.

    The block calls the generic ops ``moe::route`` and ``moe::experts`` only, so
    the kernels are chosen when the model is compiled
    (``torch.compile(model, backend=torch_moe_ops.backend(...))``); eagerly, the
    default backend of ``x``'s device runs.

    Expert parallelism: with ``cfg.ep_size > 1``, ``ep_group`` (a
    ``ProcessGroup`` or a 1-D ``DeviceMesh`` of ``ep_size`` ranks) is required;
    rank ``p`` of it holds experts ``[p * E_l, (p + 1) * E_l)`` with
    ``E_l = E / ep_size`` (``w13 [E_l, 2I, H]``, ...), the router and shared
    experts whole. ``forward`` then calls ``moe::dispatch``,
    ``moe::experts_rows`` and ``moe::combine``: the a2a backend is chosen at
    compile time (``backend(a2a="all_to_all" | "allgather" | ...)``), eagerly
    ``all_to_all`` runs. Every rank must call ``forward`` together, with at most
    ``cfg.max_tokens_per_rank`` tokens (0 too). `load_state_dict` (and
    `load_full_weights`) takes full ``[E, ...]`` expert tensors and keeps this
    rank's slice.

    Quantized experts (``cfg.quant``, a `QuantSpec`; inference only): ``w13``,
    ``w2`` and their scales ``w13_scale``, ``w2_scale`` are buffers in the
    stored format (`torch_moe_ops.quant`: shapes and dtypes per format), and
    ``forward`` calls ``moe::experts_quant`` (``moe::experts_rows_quant``).
    ``dtype`` is then the activations' (and biases') dtype; ``module.to(dtype)``
    leaves the stored bits alone. `reset_parameters` quantizes random weights;
    checkpoints load with `load_state_dict`, DeepSeek-V3's and GPT-OSS's own with
    `load_quantized` (`torch_moe_ops.checkpoints`).

    Load balancing (`MoEConfig`'s ``aux_loss``, ``z_loss_coeff``,
    ``bias_update_speed``, ``count_tokens_per_expert``), read after each ``forward``,
    compiled (``fullgraph=True``, CUDA graphs) or not:

    - ``tokens_per_expert [E]`` int64 (a buffer, not saved): the slots of the last
      call's tokens that chose each expert, summed over the expert-parallel group;
    - ``aux_loss`` and ``z_loss``: 0-d fp32 tensors of the last call, already scaled
      by their coefficients, differentiable in the router's weights (`router_loss`
      sums them over a model); ``None`` where off. ``aux_loss="sequence"`` takes
      ``x [..., S, H]`` as sequences of ``S`` tokens;
    - ``expert_load [E]`` int64 (a buffer, with ``bias_update_speed``): the tokens of
      every call since the last `update_bias`, which nudges
      ``e_score_correction_bias`` towards balance and restarts it (call it after the
      optimizer step: `update_correction_biases`). The bias is updated in its own
      dtype: keep the module in fp32 to train (autocast for low precision).
    """

    def __init__(self, cfg: MoEConfig, device=None, dtype=None, ep_group=None):
        super().__init__()
        self.cfg = cfg
        self.ep_group = ep_process_group(cfg, ep_group)
        self.ep_rank = 0 if self.ep_group is None else self.ep_group.rank()
        # The ops take the group by name (a constant to torch.compile), as torch's
        # functional collectives do.
        self.ep_group_name = "" if self.ep_group is None else self.ep_group.group_name
        num_experts, hidden, inter = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        factory = {"device": device, "dtype": dtype}
        self.gate = nn.Linear(hidden, num_experts, bias=cfg.router_bias, **factory)
        if cfg.correction_bias:
            self.register_buffer("e_score_correction_bias",
                                 torch.zeros(num_experts, device=device, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None
        for name, wanted in (("tokens_per_expert", cfg.counts_tokens),
                             ("expert_load", cfg.bias_update_speed > 0)):
            if wanted:
                self.register_buffer(name, torch.zeros(num_experts, device=device,
                                                       dtype=torch.int64), persistent=False)
            else:
                setattr(self, name, None)
        self.aux_loss: torch.Tensor | None = None
        self.z_loss: torch.Tensor | None = None
        num_local = cfg.num_local_experts
        if cfg.quant is None:
            self.w13 = nn.Parameter(torch.empty(num_local, 2 * inter, hidden, **factory))
            self.w2 = nn.Parameter(torch.empty(num_local, hidden, inter, **factory))
        else:
            for name, rows, cols in (("w13", 2 * inter, hidden), ("w2", hidden, inter)):
                self.register_buffer(name, torch.empty(
                    quant.weight_shape(cfg.quant, num_local, rows, cols),
                    dtype=quant.weight_dtype(cfg.quant), device=device))
                self.register_buffer(name + "_scale", torch.empty(
                    quant.scale_shape(cfg.quant, num_local, rows, cols),
                    dtype=quant.scale_dtype(cfg.quant), device=device))
        self.b13 = (nn.Parameter(torch.empty(num_local, 2 * inter, **factory))
                    if cfg.expert_bias else None)
        self.b2 = (nn.Parameter(torch.empty(num_local, hidden, **factory))
                   if cfg.expert_bias else None)
        self.shared_experts = (SharedExperts(cfg, **factory)
                               if cfg.shared_expert_intermediate_size else None)
        self.reset_parameters()
        if cfg.ep_size > 1:
            self._register_load_state_dict_pre_hook(self._keep_local_experts)

    @property
    def local_experts(self) -> range:
        """The global ids of the experts this rank holds."""
        return experts_of_rank(self.cfg, self.ep_rank)

    def _keep_local_experts(self, state_dict, prefix, *_) -> None:
        keep_local_slice(state_dict, [prefix + name for name in EXPERT_TENSORS + SCALE_TENSORS],
                         self.cfg, self.local_experts)

    def load_full_weights(self, state_dict, strict: bool = True):
        """`load_state_dict` of a checkpoint that holds every expert (``w13 [E, 2I, H]``,
        ...): each rank keeps its experts' slice. Returns what `load_state_dict` does."""
        return self.load_state_dict(state_dict, strict=strict)

    def load_quantized(self, path, prefix: str) -> None:
        """Load the block under ``prefix`` (e.g. ``"model.layers.3.mlp"``) of the
        quantized safetensors checkpoint at ``path`` (a file, or a folder of
        shards): DeepSeek-V3's fp8 experts (``cfg.quant=QuantSpec("fp8_block")``)
        or GPT-OSS's MXFP4 experts (``QuantSpec("mxfp4")``), kept as stored, with
        the router and the shared experts (dequantized to the block's dtype).
        With expert parallelism only this rank's experts are read. The layouts
        and what is checked: `torch_moe_ops.checkpoints` (needs safetensors).

        A block too large to build in float first can be built on the meta device,
        given memory with ``to_empty(device=...)``, then loaded."""
        cfg = self.cfg
        if cfg.quant is None:
            raise ValueError("moe.cfg.quant must be a QuantSpec to load a quantized checkpoint "
                             "(QuantSpec('fp8_block') for DeepSeek-V3's, QuantSpec('mxfp4') for "
                             "GPT-OSS's), got None")
        checkpoint = checkpoints.Checkpoint(path)
        read = checkpoints.read_experts(checkpoint, prefix, self.local_experts)
        if (read.spec.weights, read.spec.block_size) != (cfg.quant.weights, cfg.quant.block_size):
            raise ValueError(f"moe.cfg.quant must have weights={read.spec.weights!r}"
                             + ("" if read.spec.block_size is None
                                else f" and block_size={read.spec.block_size}")
                             + f" for the {checkpoints.layout_of(checkpoint, prefix)} checkpoint "
                             f"{str(checkpoint.path)!r} (activations as you choose), got "
                             f"{cfg.quant}")
        dense = checkpoints.read_dense(checkpoint, prefix, read.spec.block_size)
        state = {**read.tensors(), "gate.weight": dense.router_weight}
        for name, tensor in (("gate.bias", dense.router_bias),
                             ("e_score_correction_bias", dense.correction_bias)):
            if tensor is not None:
                state[name] = tensor
        if dense.shared_gate is not None:
            state["shared_experts.w13"] = torch.cat([dense.shared_gate, dense.shared_up])
            state["shared_experts.w2"] = dense.shared_down
        self.load_state_dict(state)

    def reset_parameters(self) -> None:
        """Initialise everything the block holds, submodules included: after
        ``to_empty`` (deferred initialisation from the meta device) this alone
        leaves no tensor holding uninitialised memory."""
        self.gate.reset_parameters()
        cfg = self.cfg
        # Same scale as nn.Linear's default: uniform(+-1/sqrt(fan_in)) per expert matrix.
        for name, fan_in in (("w13", cfg.hidden_size), ("w2", cfg.intermediate_size)):
            bound = 1 / math.sqrt(fan_in)
            if cfg.quant is None:
                nn.init.uniform_(getattr(self, name), -bound, bound)
                continue
            rows, cols = ((2 * cfg.intermediate_size, cfg.hidden_size) if name == "w13"
                          else (cfg.hidden_size, cfg.intermediate_size))
            stored = getattr(self, name)
            w_ENK = torch.empty((stored.shape[0], rows, cols), device=stored.device,
                                dtype=torch.float32).uniform_(-bound, bound)
            q, scale = quant.quantize_weights(w_ENK, cfg.quant)
            with torch.no_grad():
                stored.copy_(q)
                getattr(self, name + "_scale").copy_(scale)
        for zeroed in (self.b13, self.b2, self.e_score_correction_bias, self.tokens_per_expert,
                       self.expert_load):
            if zeroed is not None:
                nn.init.zeros_(zeroed)
        if self.shared_experts is not None:
            self.shared_experts.reset_parameters()

    def __getstate__(self):
        # The last forward's losses hold that forward's autograd graph, which neither
        # deep-copies nor pickles: a copy (an EMA model, torch.save) keeps their values.
        state = super().__getstate__()
        for name in ("aux_loss", "z_loss"):
            if state[name] is not None:
                state[name] = state[name].detach()
        return state

    def _apply(self, fn, recurse=True):
        if self.cfg.quant is None:
            return super()._apply(fn, recurse)
        with quant.stored_bits(self._buffers):
            return super()._apply(fn, recurse)

    def route(self, x_TH: torch.Tensor):
        """Router logits [T, E] (fp32), top-k weights [T, K] (fp32) and ids [T, K] (int32)."""
        cfg = self.cfg
        bias_E = None if self.gate.bias is None else self.gate.bias.float()
        # .to(dtype) casts buffers too; the correction bias must stay fp32 to steer
        # selection as the checkpoint meant.
        correction_E = (None if self.e_score_correction_bias is None
                        else self.e_score_correction_bias.float())
        with without_autocast(x_TH.device.type):
            logits_TE = F.linear(x_TH.float(), self.gate.weight.float(), bias_E)
        return logits_TE, *route_logits(cfg, logits_TE, correction_E)

    def experts(self, x_TH: torch.Tensor, topk_weights_TK: torch.Tensor,
                topk_ids_TK: torch.Tensor) -> torch.Tensor:
        """The routed experts alone: ``[T, H]`` from tokens and their routing
        (global expert ids); across the expert-parallel group with ``ep_size > 1``."""
        scales = (None, None) if self.cfg.quant is None else (self.w13_scale, self.w2_scale)
        weights = tuple(local_part(w) for w in (self.w13, self.w2, self.b13, self.b2))
        return run_experts(self.cfg, self.ep_group_name, x_TH, topk_weights_TK, topk_ids_TK,
                           weights, scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.cfg.hidden_size:
            raise ValueError(f"x.shape[-1] must equal hidden_size ({self.cfg.hidden_size}), "
                             f"got shape {tuple(x.shape)}")
        # Said here in the module's terms, at the user's call: the ops would name their
        # w13 argument, from deep inside.
        device = self.gate.weight.device
        if x.device != device:
            if device.type == "meta":
                fix = ("the module holds no weights (built on the meta device): give it memory "
                       "(moe.to_empty(device=...)), then load its weights")
            else:
                fix = f"move the input (x.to({str(device)!r}))" + (
                    "" if x.device.type == "meta" else
                    f" or the module (moe.to({str(x.device)!r}))")
            raise ValueError(f"x must be on the module's device ({device}), got {x.device}: "
                             f"{fix}")
        if self.cfg.quant is None and x.dtype not in (self.w13.dtype, autocast_dtype(device.type)):
            # A module in a non-float dtype cannot compute: only the input's cast makes sense.
            fix = (f"cast the module (moe.to({x.dtype})) or the input (x.to({self.w13.dtype}))"
                   if x.dtype in OP_FLOAT_DTYPES else f"cast the input (x.to({self.w13.dtype}))")
            raise ValueError(f"x must have the module's dtype ({self.w13.dtype}), got {x.dtype}: "
                             f"{fix}")
        x_TH = x.reshape(-1, self.cfg.hidden_size)
        logits_TE, topk_weights_TK, topk_ids_TK = self.route(x_TH)
        if self.tokens_per_expert is not None:
            self._balance_load(x, logits_TE, topk_ids_TK)
        y_TH = self.experts(x_TH, topk_weights_TK, topk_ids_TK)
        if self.shared_experts is not None:
            y_TH = y_TH + self.shared_experts(x_TH)
        return y_TH.view(x.shape)

    def _balance_load(self, x: torch.Tensor, logits_TE: torch.Tensor,
                      topk_ids_TK: torch.Tensor) -> None:
        """Count this call's tokens per expert (every rank's) and compute the losses the
        config asks for. Runs on every rank, idle ones too: the count's all-reduce is a
        collective."""
        cfg = self.cfg
        if cfg.aux_loss == "sequence":
            if x.dim() < 3:
                raise ValueError(f"x must be [..., S, H] (sequences of S tokens) with "
                                 f"aux_loss='sequence', got shape {tuple(x.shape)}")
            num_groups, group_size = x.shape[:-2].numel(), x.shape[-2]
        else:
            num_groups, group_size = 1, logits_TE.shape[0]
        counts_BE = load_balance.tokens_per_expert(
            topk_ids_TK.view(num_groups, group_size * cfg.top_k), cfg.num_experts)
        counts_E = load_balance.sum_over_group(counts_BE.sum(dim=0), self.ep_group_name)
        self.tokens_per_expert.copy_(counts_E)
        if self.expert_load is not None:
            self.expert_load.add_(counts_E)
        if cfg.aux_loss != "none":
            probs_BSE = load_balance.router_probs(logits_TE, cfg.scoring).view(
                num_groups, group_size, cfg.num_experts)
            # The batch's fractions are every rank's: the ranks' losses average to the
            # loss of the group's whole batch (at equal token counts).
            counts_for_loss = counts_BE if cfg.aux_loss == "sequence" else counts_E.view(1, -1)
            self.aux_loss = cfg.static_float("aux_loss_coeff") * load_balance.balance_loss(
                probs_BSE, counts_for_loss)
        if cfg.static_float("z_loss_coeff") > 0:
            self.z_loss = cfg.static_float("z_loss_coeff") * load_balance.z_loss(logits_TE)

    def update_bias(self) -> None:
        """DeepSeek-V3's auxiliary-loss-free update (``cfg.bias_update_speed > 0``), in
        place and without a host sync: ``e_score_correction_bias[e] += speed *
        sign(mean(expert_load) - expert_load[e])``, then ``expert_load`` restarts at 0.
        ``expert_load`` is the same on every rank of the expert-parallel group, and so
        the bias stays the same; replicas outside that group (data parallelism) keep
        theirs alike by summing ``expert_load`` over themselves first
        (``dist.all_reduce``). Under
        activation checkpointing the recomputed forward counts its tokens again: every
        load doubles, and the signs stay."""
        if self.expert_load is None:
            raise ValueError(f"update_bias needs cfg.bias_update_speed > 0, got "
                             f"{self.cfg.bias_update_speed}")
        load_balance.nudge_bias(self.e_score_correction_bias, self.expert_load,
                                self.cfg.bias_update_speed)

    def extra_repr(self) -> str:
        cfg = self.cfg
        parts = [f"experts={cfg.num_experts}", f"top_k={cfg.top_k}",
                 *([f"local={self.local_experts.start}..{self.local_experts.stop - 1}",
                    f"ep_size={cfg.ep_size}"] if cfg.ep_size > 1 else []),
                 f"hidden={cfg.hidden_size}", f"intermediate={cfg.intermediate_size}",
                 f"scoring={cfg.scoring}", f"activation={cfg.activation}"]
        if cfg.renormalize:
            parts.append("renormalize")
        if cfg.num_expert_groups > 1:
            parts.append(f"groups={cfg.topk_groups}/{cfg.num_expert_groups}")
        if cfg.routed_scaling_factor != 1.0:
            parts.append(f"scale={cfg.routed_scaling_factor}")
        if cfg.expert_bias:
            parts.append("expert_bias")
        if cfg.quant is not None:
            parts.append(f"quant={cfg.quant.name}")
        if cfg.aux_loss != "none":
            parts.append(f"aux_loss={cfg.aux_loss}")
        if cfg.z_loss_coeff:
            parts.append("z_loss")
        if cfg.bias_update_speed:
            parts.append(f"bias_update_speed={cfg.bias_update_speed}")
        return ", ".join(parts)


def router_loss(model: nn.Module) -> torch.Tensor | int:
    """The sum of every `MoE` block's ``aux_loss`` and ``z_loss`` in ``model`` (a 0-d fp32
    tensor, each already scaled by its coefficient) from the blocks' last ``forward``: add
    it to the training loss. ``0`` where no block has a loss on."""
    return sum(loss for block in model.modules() if isinstance(block, MoE)
               for loss in (block.aux_loss, block.z_loss) if loss is not None)


def update_correction_biases(model: nn.Module) -> None:
    """`MoE.update_bias` of every block of ``model`` with ``bias_update_speed > 0``: call
    it after each optimizer step (or register it,
    ``optimizer.register_step_post_hook(lambda *_: update_correction_biases(model))``)."""
    for block in model.modules():
        if isinstance(block, MoE) and block.expert_load is not None:
            block.update_bias()
