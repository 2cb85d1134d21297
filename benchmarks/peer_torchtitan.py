"""torchtitan's MoE layer with its expert-parallel token dispatcher, as a peer of
bench_ep_train.py.

Legend: P ranks, T tokens per rank, H hidden size (torchtitan's D), I expert
intermediate size (its F), E experts, K experts per token.

torchtitan is not a dependency of this repository: it is imported from wherever Python
finds it, ``pip install torchtitan==0.3.0`` or its wheel unpacked onto ``PYTHONPATH``
with the wheels its MoE modules import (``spmd_types``, ``tyro``, ``docstring_parser``:
torchtitan's config package imports tyro). Without it, `missing_reason` says why.

The layer is built the way torchtitan 0.3.0 builds the MoE FFN of a Qwen3 MoE block and
applies expert parallelism to it, without the model around it:

- config: ``models.common.config_utils``' ``make_moe_config`` with ``make_router_config``
  (softmax, ``route_norm``: Qwen3's) and ``make_routed_experts_config(comm_backend=
  "standard")``, whose token dispatcher is ``AllToAllTokenDispatcher`` (an all-to-all
  of the token counts, a host sync for the splits, then uneven ``all_to_all_single``
  there and back); no shared experts; ``load_balance_coeff`` left at its default (the
  MoE counts tokens per expert in training);
- sharding: ``models.common.moe_sharding.set_moe_sharding_config(enable_ep=True,
  enable_sp=False)`` with the Qwen3 / DeepSeek-V3 expert layout, as the models'
  ``sharding.py`` calls it;
- mesh: ``ParallelDims(dp_shard=P, ep=P)`` on torchtitan's default SPMD backend
  (``spmd_types``), whose ``parallelize`` keeps each rank's E/P experts as plain tensors;
- weights: built on the meta device with bf16 as the default dtype (torchtitan's
  ``training.dtype="bfloat16"``), then ``parallelize``, ``to_empty`` and ``init_states``
  (the trainer's order), the seed set first;
- run inside ``distributed.utils.get_spmd_context`` (the trainer's ``train_context``);
- compiled as torchtitan's ``apply_compile`` compiles each transformer block: dynamo's
  ``capture_scalar_outputs`` (and ``skip_fwd_side_effects_in_bwd_under_checkpoint``
  where torch has it) on, then ``module.compile(backend=..., fullgraph=True)``.

torch older than torchtitan 0.3.0 expects: torch 2.11 lacks
``torch.compiler._is_non_strict_tracing`` (whether a non-strict ``make_fx`` export trace is
running), which torchtitan's all-to-all dispatcher asks when it runs eagerly;
`torch_shims` adds it answering False (nothing here traces that way) and names it.

Not applied: FSDP (torchtitan wraps the experts in FSDP over ``efsdp``, of size 1 here,
for mixed precision; the weights here are bf16 already), activation checkpointing, and
the optimizer hook that updates the load-balancing bias.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
from collections.abc import Callable
from functools import partial

import torch

# Qwen3's and DeepSeek-V3's routed-expert layout under tensor parallelism (unused with
# EP, but set_moe_sharding_config asks for it): the placement of each weight on the TP axis.
EXPERT_TP_DIMS = {"w1_EFD": 1, "w2_EDF": 2, "w3_EFD": 1}
# torchtitan's Qwen3 initialisation (normal, std 0.02), for the router and the experts.
INIT_STD = 0.02


@dataclasses.dataclass
class TorchtitanLayer:
    """The layer, and the context its forward and backward run in."""

    module: torch.nn.Module
    context: Callable[[], contextlib.AbstractContextManager]


def version() -> str | None:
    try:
        return importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        return None


def missing_reason() -> str | None:
    """Why torchtitan's MoE modules cannot be imported here, or None."""
    try:
        import torchtitan.distributed.compile
        import torchtitan.models.common.config_utils
        import torchtitan.models.common.moe_sharding  # noqa: F401
    except ImportError as error:
        return (f"torchtitan's MoE modules do not import ({type(error).__name__}: {error}); "
                "install torchtitan==0.3.0 or put its wheel and spmd_types, tyro, "
                "docstring_parser on PYTHONPATH")
    return None


_SHIMS: list[str] = []


def torch_shims() -> list[str]:
    """What this torch lacks of torchtitan's needs, each added as torch 2.13 has it (once
    per process): their names."""
    if not hasattr(torch.compiler, "_is_non_strict_tracing"):
        torch.compiler._is_non_strict_tracing = lambda: False
        _SHIMS.append("torch.compiler._is_non_strict_tracing (returns False)")
    return list(_SHIMS)


@functools.cache
def _parallel_dims(world: int, device_type: str):
    """One ``ParallelDims`` (and its meshes) per process: each build makes process groups."""
    from torchtitan.distributed import parallel_dims
    from torchtitan.distributed import utils as dist_utils

    # torchtitan picks "cuda" where no accelerator is found; the CPU check runs on "cpu".
    parallel_dims.device_type = device_type
    dist_utils.set_spmd_backend("spmd_types")
    dims = parallel_dims.ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=world,
                                      world_size=world, spmd_backend="spmd_types")
    dims.build_mesh()
    return dims


def build(*, hidden: int, inter: int, experts: int, top_k: int, world: int,
          device: torch.device, dtype: torch.dtype, seed: int) -> TorchtitanLayer:
    """torchtitan's MoE layer with expert parallelism over the default group's ``world``
    ranks: each holds ``experts / world`` experts, the router whole."""
    import spmd_types as spmd
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.common.config_utils import (
        make_moe_config,
        make_routed_experts_config,
        make_router_config,
    )
    from torchtitan.models.common.moe_sharding import set_moe_sharding_config

    dims = _parallel_dims(world, device.type)
    init = partial(torch.nn.init.normal_, std=INIT_STD)
    cfg = make_moe_config(
        num_experts=experts,
        router=make_router_config(dim=hidden, num_experts=experts, top_k=top_k,
                                  gate_param_init={"weight": init,
                                                   "bias": torch.nn.init.zeros_},
                                  score_func="softmax", route_norm=True),
        routed_experts=make_routed_experts_config(
            dim=hidden, hidden_dim=inter, num_experts=experts, top_k=top_k,
            param_init={name: init for name in EXPERT_TP_DIMS}, comm_backend="standard"))
    set_moe_sharding_config(cfg, enable_ep=True, enable_sp=False,
                            expert_param_layout={name: spmd.S(dim)
                                                 for name, dim in EXPERT_TP_DIMS.items()})
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            module = cfg.build()
    finally:
        torch.set_default_dtype(default_dtype)
    module.parallelize(dims)
    module.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        module.init_states()
    module.train()
    return TorchtitanLayer(module, dist_utils.get_spmd_context(parallel_dims=dims))


# What torchtitan's apply_compile sets before compiling (dynamo's names).
COMPILE_SETTINGS = {"capture_scalar_outputs": True,
                    "skip_fwd_side_effects_in_bwd_under_checkpoint": True}


def compile_settings() -> tuple[contextlib.AbstractContextManager, list[str]]:
    """Dynamo configured as torchtitan's ``apply_compile`` configures it (a context, since
    torchtitan sets it for the whole process), and the settings this torch lacks."""
    import torch._dynamo.config as dynamo_config
    import torchtitan.distributed.compile  # noqa: F401  (its FakeTensorMode patch)

    present = {k: v for k, v in COMPILE_SETTINGS.items() if hasattr(dynamo_config, k)}
    return dynamo_config.patch(present), sorted(set(COMPILE_SETTINGS) - set(present))
