"""torch-moe-ops: a Mixture-of-Experts block as ``torch.library`` custom ops that
``torch.compile`` and CUDA graphs capture whole, with the kernels chosen at compile time."""

from torch_moe_ops import checkpoints
from torch_moe_ops.backends import available_backends
from torch_moe_ops.config import BackendSpec, MoEConfig
from torch_moe_ops.layer import MoE, SharedExperts, router_loss, update_correction_biases
from torch_moe_ops.lowering import backend
from torch_moe_ops.lowering.explain import explain

__all__ = ["BackendSpec", "MoE", "MoEConfig", "SharedExperts", "available_backends", "backend",
           "checkpoints", "explain", "hf", "router_loss", "update_correction_biases"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # `tmo.hf` imports transformers (about 1.5 s): only when it is asked for.
    if name == "hf":
        import importlib

        return importlib.import_module(f"torch_moe_ops.{name}")
    raise AttributeError(f"module 'torch_moe_ops' has no attribute {name!r}")
