"""The ``torch.compile`` backend: picks the kernels of every MoE op when the model is compiled.

    model = torch.compile(model, backend=torch_moe_ops.backend(experts="triton"))
    model = torch.compile(model, backend="moe")   # entry point, experts="auto"

It rewrites each generic ``moe::*`` node of the graph Dynamo hands it to the
chosen backend's concrete op, then compiles the graph with the inner compiler.
"""

from torch_moe_ops.lowering.compile import MoECompileBackend, backend, moe_backend
from torch_moe_ops.lowering.rewrite import lower, moe_op_sequence

__all__ = ["MoECompileBackend", "backend", "lower", "moe_backend", "moe_op_sequence"]
