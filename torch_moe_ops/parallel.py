"""FSDP2 with expert parallelism on one 2-D ``DeviceMesh`` ``(dp_shard, ep)``, torchtitan's
layout: each MoE block's experts (a `MoE`, or a transformers block patched by
`torch_moe_ops.hf.patch`) split over ``ep`` and every rank's share of them
FSDP-sharded over ``dp_shard``; every other parameter FSDP-sharded over all ranks.
`save_full_checkpoint` writes such a model, gathered, as one process's safetensors
checkpoint (transformers' own format for a transformers model).

Legend: E experts, E_l = E / ep experts of one rank, P = dp_shard * ep ranks.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from torch_moe_ops.layer import MoE
from torch_moe_ops.routed_experts import EXPERT_TENSORS
from torch_moe_ops.torch_compat import checkpoint_wrapper, flatten_mesh, fsdp_shard_placement

MESH_DIMS = ("dp_shard", "ep")


def _is_moe_block(module: nn.Module) -> bool:
    """Whether ``module`` is a `MoE` or a patched transformers block (`HFMoEBlock`, which
    exists only once ``torch_moe_ops.hf`` is imported: this does not import it, nor
    transformers with it)."""
    block = sys.modules.get("torch_moe_ops.hf.block")
    return isinstance(module, MoE) or (block is not None and isinstance(module, block.HFMoEBlock))


def _expert_tensors(moe: nn.Module) -> tuple[nn.Module, tuple[str, ...]]:
    """The module holding the block's expert tensors, and their attribute names on it, in
    `EXPERT_TENSORS` order (the ones the block has): a `MoE` holds ``w13``, ...; a patched
    transformers block's experts module holds them under transformers' names or ours."""
    if isinstance(moe, MoE):
        return moe, EXPERT_TENSORS
    names = moe.weight_sources[:len(EXPERT_TENSORS)]
    return moe.experts, tuple(name for name in names if name is not None)


def _check_moe(name: str, moe: nn.Module, ep_mesh: DeviceMesh) -> None:
    cfg = moe.cfg
    if cfg.quant is not None:
        raise ValueError(f"{name}: parallelize_moe trains, and quantized experts do not: "
                         f"cfg.quant must be None, got {cfg.quant}")
    if cfg.ep_size != ep_mesh.size():
        raise ValueError(f"{name}: cfg.ep_size must equal mesh['ep'].size() ({ep_mesh.size()}), "
                         f"got {cfg.ep_size}")
    # Both kinds of block name their group; the ops run on the group of that name.
    if cfg.ep_size > 1 and moe.ep_group_name != ep_mesh.get_group().group_name:
        raise ValueError(f"{name} must be built (or patched) with ep_group=mesh['ep'] (group "
                         f"{ep_mesh.get_group().group_name!r}), got group "
                         f"{moe.ep_group_name!r}")


def _experts_as_dtensors(moe: nn.Module, ep_mesh: DeviceMesh) -> list[nn.Parameter]:
    """Turn the block's expert parameters (``w13 [E_l, 2I, H]``, ...) into ``DTensor`` s of
    every expert (``[E, 2I, H]``) sharded over ``ep_mesh``, and return them: FSDP2 then
    shards them further, and a state dict holds them at their global offsets (so that
    ``torch.distributed.checkpoint`` reshards them across meshes)."""
    params = []
    holder, names = _expert_tensors(moe)
    for name in names:
        local = getattr(holder, name)
        if local is None:
            continue
        param = nn.Parameter(DTensor.from_local(local.detach(), ep_mesh, [Shard(0)],
                                                run_check=False),
                             requires_grad=local.requires_grad)
        setattr(holder, name, param)
        params.append(param)
    return params


def parallelize_moe(model: nn.Module, mesh: DeviceMesh, *, blocks=None,
                    activation_checkpoint: bool = False, compile_backend=None,
                    **fsdp_options) -> nn.Module:
    """Shard ``model`` in place for training with FSDP2 (``fully_shard``) and expert
    parallelism on ``mesh``, a 2-D ``DeviceMesh`` with ``mesh_dim_names=("dp_shard",
    "ep")``, and return it. Call it on every rank, after building the model with each
    `MoE` given ``ep_group=mesh["ep"]`` and ``MoEConfig(ep_size=mesh["ep"].size(),
    max_tokens_per_rank=M)`` (each rank then holds its ``E_l`` experts; a full checkpoint
    loads with ``load_state_dict`` before this call), or after patching a transformers
    model with ``torch_moe_ops.hf.patch(model, ep_group=mesh["ep"], max_tokens_per_rank=M)``
    (its float experts only), as torchtitan lays a model out::

        for block in blocks:              # default: the parent module of each MoE
            block = torch.compile(block, backend=compile_backend, fullgraph=True)
            block = checkpoint_wrapper(block)                   # activation_checkpoint
            fully_shard(block, mesh=<all P ranks>)    # one group a block, hooks outside
                # each MoE's w13, w2, b13, b2: DTensors [E, ...] Shard(0) over "ep",
                # sharded by FSDP over "dp_shard" (dim 1 where dp_shard > E_l)
        fully_shard(model, mesh=<all P ranks>)        # what no block holds

    ``fsdp_options`` (``mp_policy``, ``reshard_after_forward``, ...) go to every
    ``fully_shard``. With ``mesh["ep"].size() == 1`` the experts are parameters like the
    others: plain FSDP over all ranks. Activation checkpointing wraps the compiled block
    (its recomputation runs the compiled forward again, all-to-alls included).

    Gradients: each rank's loss is taken as the mean over its own tokens. FSDP averages
    every gradient over all P ranks, the experts' too (their reduce-scatter runs over
    ``dp_shard`` only, but each rank's expert gradients already hold every ``ep`` rank's
    tokens): the gradients are those of the mean loss over all ranks' tokens, the
    gradients of one process on the whole batch when every rank holds as many tokens.

    Checkpoints: the expert weights are ``DTensor`` s of their global shape, so
    ``torch.distributed.checkpoint`` (with ``get_model_state_dict`` /
    ``set_model_state_dict`` of ``torch.distributed.checkpoint.state_dict``, which drop
    the compile and checkpoint wrappers' prefixes) saves on one mesh and loads on
    another, or into an unsharded model (``ep_size=1``) in one process;
    `save_full_checkpoint` writes one process's checkpoint (transformers' format for a
    transformers model)."""
    if mesh.ndim != 2 or mesh.mesh_dim_names != MESH_DIMS:
        raise ValueError(f"mesh must be a 2-D DeviceMesh with mesh_dim_names={MESH_DIMS}, got "
                         f"{mesh.ndim}-D with mesh_dim_names={mesh.mesh_dim_names}")
    dp_mesh, ep_mesh = mesh["dp_shard"], mesh["ep"]
    # Everything but the experts shards over every rank of the mesh.
    all_ranks = flatten_mesh(mesh)
    names = {module: name for name, module in model.named_modules()}
    moes = [(name, module) for name, module in model.named_modules() if _is_moe_block(module)]
    if not moes:
        raise ValueError("model must hold at least one torch_moe_ops.MoE block or block "
                         "patched by torch_moe_ops.hf.patch, got none")
    for name, moe in moes:
        _check_moe(name, moe, ep_mesh)
    if blocks is None:
        blocks = list(dict.fromkeys(model.get_submodule(name.rpartition(".")[0])
                                    for name, _ in moes))
    for block in blocks:
        if block is model or block not in names:
            raise ValueError(f"blocks must be submodules of model (not model itself), got "
                             f"{type(block).__name__}")
    experts_of_block = {block: [] for block in blocks}
    for name, moe in moes:
        owners = [block for block in blocks if any(m is moe for m in block.modules())]
        if len(owners) != 1:
            raise ValueError(f"{name} must lie in exactly one of blocks, got {len(owners)}")
        if ep_mesh.size() > 1:
            experts_of_block[owners[0]].extend(_experts_as_dtensors(moe, ep_mesh))
    if ep_mesh.size() > 1:
        shard_over_dp = fsdp_shard_placement(dp_mesh)
    for block in blocks:
        sharded = block
        if compile_backend is not None:
            sharded = torch.compile(sharded, backend=compile_backend, fullgraph=True)
        if activation_checkpoint:
            # Around the compiled block, as torchtitan checkpoints its MoE blocks.
            sharded = checkpoint_wrapper(sharded)
        model.set_submodule(names[block], sharded)
        experts = set(experts_of_block[block])
        placement = None
        if experts:
            def placement(param, experts=experts):
                if param not in experts:
                    return None
                # FSDP pads dim 0 where it has fewer rows than shards: torchtitan's choice.
                dim = 1 if dp_mesh.size() > param.to_local().shape[0] else 0
                return shard_over_dp(Shard(dim))
        fsdp_block = fully_shard(sharded, mesh=all_ranks, shard_placement_fn=placement,
                                 **fsdp_options)
        # The experts' reduce-scatter runs over dp_shard, and would divide by its size.
        fsdp_block.set_gradient_divide_factor(all_ranks.size())
        if dp_mesh.size() > 1 and dist.get_backend(dp_mesh.get_group()) == "gloo":
            # Another factor than the group's size takes NCCL's PREMUL_SUM, which gloo
            # lacks: sum, then divide. (A group of one rank reduces nothing, and divides
            # by the factor once more after the sum's own division: not there.)
            fsdp_block.set_force_sum_reduction_for_comms(True)
    fully_shard(model, mesh=all_ranks, **fsdp_options)
    return model


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective (every rank calls it): the state dict of a model sharded by
    `parallelize_moe`, every tensor gathered whole (the experts of all ``ep`` ranks
    included) onto the CPU of rank 0, under the keys an unsharded model has (no compile or
    checkpoint wrapper prefixes); an empty dict on every other rank."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def _write_safetensors(state: dict[str, torch.Tensor], folder: Path) -> None:
    try:
        from safetensors.torch import save_file
    except ImportError as error:
        raise ImportError("save_full_checkpoint writes safetensors: pip install "
                          "safetensors") from error
    folder.mkdir(parents=True, exist_ok=True)
    save_file({key: value.contiguous() for key, value in state.items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})


def save_full_checkpoint(model: nn.Module, folder: str | os.PathLike) -> None:
    """Collective (every rank calls it; rank 0 writes, the others wait for it): write
    ``model``, sharded by `parallelize_moe`, into ``folder`` as one process's checkpoint::

        state = full_state_dict(model)         # gathered whole on rank 0
        if rank == 0:
            model.save_pretrained(folder, state_dict=state)   # a transformers model
            # else: safetensors.torch.save_file(state, folder / "model.safetensors")

    A transformers model (patched by `torch_moe_ops.hf.patch`) is written as
    ``save_pretrained`` writes it: ``config.json`` and safetensors under transformers'
    names and layout (experts one tensor per expert and projection where transformers
    stores them so, ``experts.0.gate_proj.weight``, ...), which ``from_pretrained`` loads
    into an unsharded, unpatched model. Any other model is written as its state dict's
    keys in ``model.safetensors``, which ``load_state_dict`` takes on one process."""
    if not dist.is_initialized():
        raise ValueError("save_full_checkpoint gathers a sharded model: call it on every rank "
                         "after torch.distributed.init_process_group")
    folder = Path(folder)
    state = full_state_dict(model)
    if dist.get_rank() == 0:
        if hasattr(model, "save_pretrained"):
            model.save_pretrained(folder, state_dict=state)
        else:
            _write_safetensors(state, folder)
    # No rank returns (and reads the folder) before rank 0 has written it.
    dist.barrier()
