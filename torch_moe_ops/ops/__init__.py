"""The generic MoE ops (namespace ``moe``): schema, checks, fake kernels, autograd.

Their eager kernels forward to the default backend of the input's device; those
kernels are installed by `torch_moe_ops.backends`.
"""

from torch_moe_ops.ops import experts, route, rows
from torch_moe_ops.ops.library import GENERIC_NAMESPACE, OpContract, op_overload

CONTRACTS = {
    contract.name: contract
    for contract in (route.CONTRACT, experts.CONTRACT, experts.BACKWARD_CONTRACT,
                     rows.DISPATCH, rows.EXPERTS_ROWS, rows.COMBINE)
}

__all__ = ["CONTRACTS", "GENERIC_NAMESPACE", "OpContract", "op_overload"]
