"""`patch`: swap, in place, every sparse-MoE block of a supported family for an `HFMoEBlock`.

    report = torch_moe_ops.hf.patch(model)      # in place; report says what changed
    model = torch.compile(model, backend=torch_moe_ops.backend(experts="triton"))

Attention, norms and dense MLP layers are not touched. Kernel choice happens at
compile time (`torch_moe_ops.backend`), so `patch` takes no backend.

Expert parallelism: ``patch(model, ep_group=group, max_tokens_per_rank=M)`` on
every rank of ``group`` shards each patched block's experts over the group
(rank ``p`` keeps experts ``[p * E_l, (p + 1) * E_l)``, ``E_l = E / P``) and
drops the others from the model; see `patch`.

Quantized experts: transformers' fp8 experts with block scales (``FP8Experts``,
what it loads a DeepSeek-V3-style fp8 checkpoint into on a GPU that runs fp8)
are used in place and run on ``moe::experts_quant`` (`torch_moe_ops.hf.weights`).
Where transformers dequantized a checkpoint at load (fp8 without such a GPU,
MXFP4 without its hub kernels) the block holds float experts and is patched as
such; `torch_moe_ops.hf.load_into` then gives the patched blocks the
quantized experts of the checkpoint's files.

Not supported (the block is left as it is and `PatchReport.skipped` says why):
per-expert ``nn.ModuleList`` experts (the transformers 4.x layout; every family
of `FAMILIES` stores fused 3-D experts from transformers 5.0 on), experts that
transformers itself made expert-parallel (``tp_plan``), quantized experts other
than fp8 with block scales (transformers' MXFP4 GPT-OSS block, whose hub kernels
hold the weights in their own swizzled layout), activations other than
silu/gelu, blocks carrying hooks (accelerate offloading), and routing our ops
cannot express (e.g. groups of one expert).

Patching a model again leaves the blocks already patched as they are (reported
as ``"already patched"``).

GPT-OSS's experts are held in our layout from `patch` on: its ``gate_up_proj``,
``gate_up_proj_bias`` and ``down_proj`` parameters are replaced by parameters
``w13``, ``b13``, ``w2`` of the same experts module, converted once, while
``state_dict`` and ``load_state_dict`` keep transformers' keys and layout
(`torch_moe_ops.hf.block`). Build optimizers after `patch`; `renamed_parameters`
maps transformers' parameter names to the new ones (for optimizer groups, LoRA
targets or wrap policies written with transformers' names).
"""

from __future__ import annotations

import dataclasses

from torch import nn

from torch_moe_ops.config import MoEConfig
from torch_moe_ops.hf.block import HFMoEBlock
from torch_moe_ops.hf.families import FAMILIES, Family, Unsupported, family_of
from torch_moe_ops.hf.router import route_with_ops
from torch_moe_ops.hf.weights import LAYOUTS, keep_local_experts
from torch_moe_ops.layer import ep_process_group
from torch_moe_ops.routed_experts import experts_of_rank

# What to do instead, for the blocks transformers swaps in for quantized experts.
MXFP4_HINT = {"Mxfp4GptOssMLP": (
    "; transformers' MXFP4 kernels hold the experts in their own swizzled layout: load the "
    "model with quantization_config=Mxfp4Config(dequantize=True), patch it, then "
    "torch_moe_ops.hf.load_into(model, checkpoint) for MXFP4 experts")}


@dataclasses.dataclass(frozen=True)
class PatchedBlock:
    """One replaced block: its module name, family, which expert tensors it
    uses in place (``shared``, transformers names) or holds converted once into
    our layout (``converted``, transformers names of what they replaced), and
    with expert parallelism the global ids of the experts this rank holds
    (``local_experts``; None without)."""

    name: str
    family: str
    shared: tuple[str, ...]
    converted: tuple[str, ...]
    local_experts: range | None = None


@dataclasses.dataclass(frozen=True)
class PatchReport:
    """What `patch` did: ``blocks`` replaced (in model order) and ``skipped``
    (module name -> why it was left as it is)."""

    blocks: tuple[PatchedBlock, ...]
    skipped: dict[str, str]

    @property
    def patched(self) -> list[str]:
        return [block.name for block in self.blocks]

    @property
    def shared_weights(self) -> int:
        """Expert tensors used in place (same storage as the transformers parameter)."""
        return sum(len(block.shared) for block in self.blocks)

    @property
    def converted_weights(self) -> int:
        """Expert tensors converted once into our layout (parameters of their own)."""
        return sum(len(block.converted) for block in self.blocks)

    @property
    def families(self) -> dict[str, int]:
        """Blocks replaced per family."""
        counts: dict[str, int] = {}
        for block in self.blocks:
            counts[block.family] = counts.get(block.family, 0) + 1
        return counts

    def __str__(self) -> str:
        families = ", ".join(f"{name}: {count}" for name, count in self.families.items())
        lines = [(f"patched {len(self.blocks)} MoE blocks ({families or 'none'}); expert "
                  f"tensors: {self.shared_weights} shared, {self.converted_weights} converted")]
        held = sorted({(block.local_experts.start, block.local_experts.stop - 1)
                       for block in self.blocks if block.local_experts is not None})
        if held:
            ranges = ", ".join(f"{first}..{last}" for first, last in held)
            lines.append(f"expert-parallel: this rank holds experts {ranges} of its blocks")
        lines += [f"skipped {name}: {reason}" for name, reason in self.skipped.items()]
        return "\n".join(lines)


def _looks_like_moe(module: nn.Module) -> bool:
    return isinstance(getattr(module, "experts", None), nn.Module)


def _prepare(block: nn.Module, family: Family, model_config):
    """The block's `MoEConfig` and expert weights, or `Unsupported` with the reason."""
    experts = getattr(block, "experts", None)
    if isinstance(experts, nn.ModuleList):
        raise Unsupported("per-expert nn.ModuleList experts (the transformers 4.x layout) "
                          "are not supported; transformers >= 5.0 builds fused [E, 2I, H] "
                          "experts")
    if experts is None or not isinstance(getattr(block, family.router, None), nn.Module):
        raise Unsupported(f"expected submodules 'experts' and {family.router!r}, got "
                          f"{[name for name, _ in block.named_children()]}")
    if getattr(experts, "_is_expert_parallel", False):
        raise Unsupported("expert-parallel experts (tp_plan / distributed_config) are not "
                          "supported")
    if (block._forward_hooks or block._forward_pre_hooks or hasattr(block, "_hf_hook")):
        raise Unsupported("the block carries hooks (e.g. accelerate offloading) that a "
                          "replacement would lose; patch before adding them")
    config = getattr(experts, "config", None) or model_config
    if config is None:
        raise Unsupported("no transformers config on the experts module or the model")
    try:
        cfg = family.make_config(config, experts)
    except AttributeError as error:
        raise Unsupported(f"the {family.name} config or experts module lacks a field: "
                          f"{error}") from None
    except ValueError as error:
        raise Unsupported(f"routing not expressible with moe::route: {error}") from None
    weights = LAYOUTS[family.layout](experts, cfg)
    return dataclasses.replace(cfg, quant=weights.quant), weights


def _check_ep_args(ep_group, max_tokens_per_rank, ep_capacity) -> None:
    if ep_group is None:
        for name, value in (("max_tokens_per_rank", max_tokens_per_rank),
                            ("ep_capacity", ep_capacity)):
            if value is not None:
                raise ValueError(f"{name} must be None without ep_group (it sizes the "
                                 f"expert-parallel buffers), got {value!r}")
        return
    if (not isinstance(max_tokens_per_rank, int) or isinstance(max_tokens_per_rank, bool)
            or max_tokens_per_rank < 1):
        raise ValueError(f"max_tokens_per_rank must be a positive int when ep_group is given "
                         f"(the most tokens, batch x sequence, one rank passes through a "
                         f"block in one forward; it sizes the static buffers), got "
                         f"{max_tokens_per_rank!r}")


def _expert_parallel(cfg: MoEConfig, ep_group, max_tokens_per_rank, ep_capacity):
    """``cfg`` sharded over ``ep_group`` and its ``ProcessGroup`` (None on one rank),
    or `Unsupported` when the experts do not divide over the ranks."""
    size = ep_group.size()
    if cfg.num_experts % size:
        raise Unsupported(f"expert parallelism needs num_experts ({cfg.num_experts}) "
                          f"divisible by the ep_group size ({size})")
    if size == 1:
        return cfg, None
    cfg = dataclasses.replace(cfg, ep_size=size, max_tokens_per_rank=max_tokens_per_rank,
                              ep_capacity=ep_capacity)
    return cfg, ep_process_group(cfg, ep_group)


def patch(model: nn.Module, ep_group=None, max_tokens_per_rank: int | None = None,
          ep_capacity: int | None = None) -> PatchReport:
    """Replace, in place, every sparse-MoE block of a supported family in ``model``.

    Each block of Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3 or GPT-OSS
    (transformers >= 5 layout) becomes an `HFMoEBlock` computing the same
    function with ``moe::route`` and ``moe::experts``; the kernels are chosen when
    the model is compiled with `torch_moe_ops.backend`. Blocks that cannot be
    expressed are left as they are and listed in ``PatchReport.skipped`` with the
    reason, as are MoE-like blocks of other families. Blocks patched before are
    listed there as ``"already patched"``. Returns the report.

    GPT-OSS's interleaved, transposed expert parameters are replaced by parameters
    in our layout (converted once, here), which every forward reads as they are:
    build optimizers after `patch` (one built before holds transformers' old
    parameters, which the patched model no longer reads; its steps change nothing
    the model computes). ``state_dict``, ``save_pretrained`` and ``load_state_dict``
    keep transformers' keys and layout (`torch_moe_ops.hf.block`).

    Expert parallelism: with ``ep_group`` (a ``ProcessGroup`` or a 1-D
    ``DeviceMesh`` of P ranks), call ``patch`` on every rank of the group, on the
    same model (same weights). Each patched block then holds experts
    ``[p * E_l, (p + 1) * E_l)`` on rank ``p`` (``E_l = E / P``) and calls
    ``moe::dispatch``, ``moe::experts_rows`` and ``moe::combine`` (the a2a backend
    is chosen at compile time, ``torch_moe_ops.backend(a2a=...)``; eagerly
    ``all_to_all`` runs). The other experts are dropped: each expert parameter
    of the transformers experts module (``gate_up_proj``, ``down_proj``, their
    biases) is replaced by a new parameter holding a copy of this rank's slice,
    so the full tensor is freed once nothing else refers to it (an optimizer
    built before `patch` would). ``state_dict`` keeps its keys with
    ``[E_l, ...]`` expert tensors; ``load_state_dict`` takes those or a full
    checkpoint's ``[E, ...]`` ones, keeping this rank's slice. To run a model
    whose experts do not fit one GPU, load it on the CPU, patch, then move it
    to the rank's GPU.

    ``max_tokens_per_rank`` is required with ``ep_group``: the most tokens
    (batch x sequence) one rank passes through a block in one forward; more
    raise a ValueError. ``ep_capacity`` (rows one rank may send another; None,
    the worst case, never overflows; a batch that overflows a smaller one
    raises on every rank) is as in `torch_moe_ops.MoEConfig`. Every rank must
    run every forward together, with its own tokens (at least one: transformers'
    attention does not take an empty batch; a rank with nothing to do passes a
    dummy token and drops its output). A block whose experts do not divide over
    the group is left unpatched and listed in ``PatchReport.skipped``. A group
    of one rank patches as without ``ep_group``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    _check_ep_args(ep_group, max_tokens_per_rank, ep_capacity)
    model_config = getattr(model, "config", None)
    blocks: list[PatchedBlock] = []
    skipped: dict[str, str] = {}
    routed_classes: dict[type, type] = {}
    for name, block in list(model.named_modules()):
        if isinstance(block, HFMoEBlock):
            skipped[name] = "already patched"
            continue
        family = family_of(block)
        if family is None:
            if _looks_like_moe(block):
                skipped[name] = (f"{type(block).__name__} is not a supported family "
                                 f"({', '.join(f.name for f in FAMILIES.values())})"
                                 + MXFP4_HINT.get(type(block).__name__, ""))
            continue
        if not name:
            raise ValueError(f"model must contain MoE blocks, not be one: got a bare "
                             f"{type(block).__name__}; patch the model that holds it")
        try:
            cfg, weights = _prepare(block, family, model_config)
            group = None
            if ep_group is not None:
                cfg, group = _expert_parallel(cfg, ep_group, max_tokens_per_rank, ep_capacity)
        except Unsupported as reason:
            skipped[name] = str(reason)
            continue
        route_with_ops(getattr(block, family.router), family, cfg, routed_classes)
        local = None
        if group is not None:
            local = experts_of_rank(cfg, group.rank())
            keep_local_experts(block.experts, weights, local)
        parent_name, _, child_name = name.rpartition(".")
        model.get_submodule(parent_name).add_module(
            child_name, HFMoEBlock(block, family, cfg, weights, ep_group=group))
        blocks.append(PatchedBlock(name=name, family=family.name,
                                   shared=tuple(weights.shared.values()),
                                   converted=tuple(c.source for c in weights.converted.values()),
                                   local_experts=local))
    return PatchReport(blocks=tuple(blocks), skipped=skipped)


def renamed_parameters(model: nn.Module) -> dict[str, str]:
    """transformers' name -> the name in ``model.named_parameters()`` of each expert
    parameter that `patch` converted into our layout (GPT-OSS's), e.g.
    ``"model.layers.0.mlp.experts.gate_up_proj"`` -> ``"model.layers.0.mlp.experts.w13"``.

    The parameter under the new name holds our layout, not transformers' (``w13
    [E, 2I, H]``: gate rows, then up rows; ``b13 [E, 2I]``; ``w2 [E, H, I]``, where
    transformers holds ``gate_up_proj [E, H, 2I]`` with gate and up columns interleaved
    and ``down_proj [E, I, H]``); only `state_dict` and ``save_pretrained`` write
    transformers' names and layout. Names of expert tensors used in place (every other
    family's) do not change and are not listed. For optimizer groups, LoRA targets or
    FSDP wrap policies that name transformers' parameters: look each name up here.
    """
    return {f"{block_name}.experts.{conversion.source}": f"{block_name}.experts.{name}"
            for block_name, block in model.named_modules() if isinstance(block, HFMoEBlock)
            for name, conversion in block.conversions.items()}
