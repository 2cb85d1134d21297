"""The generic MoE ops (namespace ``moe``): schema, checks, fake kernels, autograd.

Their eager kernels forward to the default backend of the input's device; those
kernels are installed by `torch_moe_ops.backends`.
"""

from torch_moe_ops.ops import (
    dispatch_quant,
    experts,
    masked,
    masked_quant,
    quant,
    route,
    rows,
    tokens,
    tokens_in_flight,
)
from torch_moe_ops.ops.library import (
    GENERIC_NAMESPACE,
    OpContract,
    argument_index,
    decompose,
    define,
    implement,
    op_overload,
)

CONTRACTS = {
    contract.name: contract
    for contract in (route.CONTRACT, experts.CONTRACT, experts.BACKWARD_CONTRACT,
                     rows.DISPATCH, rows.EXPERTS_ROWS, rows.COMBINE,
                     rows.DISPATCH_BACKWARD, rows.COMBINE_BACKWARD, quant.CONTRACT,
                     quant.ROWS_CONTRACT, dispatch_quant.CONTRACT, *tokens.CONTRACTS.values(),
                     *masked.CONTRACTS.values(), *masked_quant.CONTRACTS.values())
}


def define_backend_ops(namespace: str, kernels: dict, contracts: dict | None = None) -> None:
    """Define ``namespace::<name>`` from each op's contract (in ``contracts``, by default the
    generic ops') and implement it with ``kernels[name]`` (CPU and CUDA): what every backend
    does to register."""
    contracts = CONTRACTS if contracts is None else contracts
    for name, kernel in kernels.items():
        define(namespace, contracts[name])
        implement(namespace, contracts[name], kernel)


def decompose_backend_ops(namespace: str, bodies: dict, applies,
                          contracts: dict | None = None) -> None:
    """Under ``torch.compile``, trace ``bodies[name]`` into the graph in place of
    ``namespace::<name>`` where ``applies(*args)`` holds (`library.decompose`)."""
    contracts = CONTRACTS if contracts is None else contracts
    for name, body in bodies.items():
        decompose(namespace, contracts[name], body, applies)


__all__ = ["CONTRACTS", "GENERIC_NAMESPACE", "OpContract", "argument_index",
           "decompose_backend_ops",
           "define_backend_ops", "op_overload", "tokens_in_flight"]
