"""``python -m torch_moe_ops.backends.flashinfer {build,status}``: build FlashInfer's
SM90 fused-MoE module on purpose, or see how far a build has got (`cutlass_module`)."""

import sys

from torch_moe_ops.backends.flashinfer.cutlass_module import main

sys.exit(main(sys.argv[1:]))
