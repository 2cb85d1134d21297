"""The ``flashinfer`` backends, on flashinfer-python's kernels: routing
(``fused_topk_deepseek``), the MoE all-to-all (``MoeAlltoAll``) and the CUTLASS
fused experts (``cutlass_fused_moe``). Each is a backend of its own kind in its own
module; what they share is here and in `library`: whether flashinfer imports, and
whether one of its JIT modules is built. Nothing here builds a module.

`build` compiles the one module that takes long to build (a trimmed copy of the CUTLASS
fused MoE's: 54 of FlashInfer's 248 objects, whose full build took about 45 minutes on 16
cores; `cutlass_module`): no call builds it implicitly, and `cutlass_symbols` checks what it
leaves unresolved. The others build on first use, in seconds.
"""

from torch_moe_ops.backends.flashinfer.cutlass_module import build

__all__ = ["build"]
