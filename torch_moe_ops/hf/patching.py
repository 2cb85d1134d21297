"""`patch`: swap, in place, every sparse-MoE block of a supported family for an `HFMoEBlock`.

    report = torch_moe_ops.hf.patch(model)      # in place; report says what changed
    model = torch.compile(model, backend=torch_moe_ops.backend(experts="triton"))

Attention, norms and dense MLP layers are not touched. Kernel choice happens at
compile time (`torch_moe_ops.backend`), so `patch` takes no backend.

Not supported (the block is left as it is and `PatchReport.skipped` says why):
per-expert ``nn.ModuleList`` experts (the transformers 4.x layout; every family
of `FAMILIES` stores fused 3-D experts from transformers 5.0 on), expert-parallel
or quantized experts, activations other than silu/gelu, blocks carrying hooks
(accelerate offloading), and routing our ops cannot express (e.g. groups of
one expert).

Patching a model again leaves the blocks already patched in place (reported as
``"already patched"``) and reconverts their converted expert tensors from the
current weights (`PatchReport.refreshed`): the way to bring them in step after a
change the blocks cannot see (`torch_moe_ops.hf.block` says which).
"""

from __future__ import annotations

import dataclasses

from torch import nn

from torch_moe_ops.hf.block import HFMoEBlock
from torch_moe_ops.hf.families import FAMILIES, Family, Unsupported, family_of
from torch_moe_ops.hf.router import route_with_ops
from torch_moe_ops.hf.weights import LAYOUTS


@dataclasses.dataclass(frozen=True)
class PatchedBlock:
    """One replaced block: its module name, family, and which expert tensors it
    uses in place (``shared``, transformers names) or copied (``converted``)."""

    name: str
    family: str
    shared: tuple[str, ...]
    converted: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class PatchReport:
    """What `patch` did: ``blocks`` replaced (in model order), ``skipped`` (module
    name -> why it was left as it is) and ``refreshed`` (blocks patched before
    whose converted expert tensors were recomputed from the current weights)."""

    blocks: tuple[PatchedBlock, ...]
    skipped: dict[str, str]
    refreshed: tuple[str, ...] = ()

    @property
    def patched(self) -> list[str]:
        return [block.name for block in self.blocks]

    @property
    def shared_weights(self) -> int:
        """Expert tensors used in place (same storage as the transformers parameter)."""
        return sum(len(block.shared) for block in self.blocks)

    @property
    def converted_weights(self) -> int:
        """Expert tensors copied into our layout."""
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
        if self.refreshed:
            lines.append(f"reconverted the expert tensors of {len(self.refreshed)} blocks "
                         "patched before")
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
    return cfg, LAYOUTS[family.layout](experts, cfg)


def patch(model: nn.Module) -> PatchReport:
    """Replace, in place, every sparse-MoE block of a supported family in ``model``.

    Each block of Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3 or GPT-OSS
    (transformers >= 5 layout) becomes an `HFMoEBlock` computing the same
    function with ``moe::route`` and ``moe::experts``; the kernels are chosen when
    the model is compiled with `torch_moe_ops.backend`. Blocks that cannot be
    expressed are left as they are and listed in ``PatchReport.skipped`` with the
    reason, as are MoE-like blocks of other families. Blocks patched before are
    listed there as ``"already patched"``, and those with converted expert tensors
    reconvert them from the current weights (``PatchReport.refreshed``). Returns
    the report.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    model_config = getattr(model, "config", None)
    blocks: list[PatchedBlock] = []
    skipped: dict[str, str] = {}
    refreshed: list[str] = []
    routed_classes: dict[type, type] = {}
    for name, block in list(model.named_modules()):
        if isinstance(block, HFMoEBlock):
            skipped[name] = "already patched"
            if block.refresh_converted(force=True):
                refreshed.append(name)
            continue
        family = family_of(block)
        if family is None:
            if _looks_like_moe(block):
                skipped[name] = (f"{type(block).__name__} is not a supported family "
                                 f"({', '.join(f.name for f in FAMILIES.values())})")
            continue
        if not name:
            raise ValueError(f"model must contain MoE blocks, not be one: got a bare "
                             f"{type(block).__name__}; patch the model that holds it")
        try:
            cfg, weights = _prepare(block, family, model_config)
        except Unsupported as reason:
            skipped[name] = str(reason)
            continue
        route_with_ops(getattr(block, family.router), family, cfg, routed_classes)
        parent_name, _, child_name = name.rpartition(".")
        model.get_submodule(parent_name).add_module(
            child_name, HFMoEBlock(block, family, cfg, weights))
        blocks.append(PatchedBlock(name=name, family=family.name,
                                   shared=tuple(weights.shared.values()),
                                   converted=tuple(c.source for c in weights.converted.values())))
    return PatchReport(blocks=tuple(blocks), skipped=skipped, refreshed=tuple(refreshed))
