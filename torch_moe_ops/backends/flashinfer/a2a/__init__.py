"""The ``flashinfer`` a2a backend: FlashInfer's MoE all-to-all (the NVLink one-sided kernels
of ``flashinfer.comm``, from TensorRT-LLM) behind ``moe::dispatch``, ``moe::combine`` and
their gradients (the rows format), and behind the tokens format (`ops.tokens`): on the
workspace itself for layers without gradients, copied out of it, with gradients, for layers
that train. docs/architecture.md, "The flashinfer all-to-all", says how.

- `comm_api`: the functions of ``flashinfer.comm`` it calls, and the device they take.
- `workspace`: `FlashInferCommunicator`, the workspace of one layer shape on one group,
  in one keyed cache (`communicator`, `close_all`, `open_communicators`).
- `rows`, `bookkeeping`: the rows format's ops, and the index arithmetic between kernels.
- `tokens`: the tokens format's ops for inference (views of the workspace).
- `trainable_tokens`: the tokens format's ops and their gradients for training (copies).
- `backend`: `supports`, and the ops registered in namespaces ``moe_flashinfer_a2a`` and
  ``moe_flashinfer_a2a_trainable``.
"""

from torch_moe_ops.backends.flashinfer.a2a.backend import (
    NAME,
    NAMESPACE,
    TRAINING_NAMESPACE,
    supports,
)
from torch_moe_ops.backends.flashinfer.a2a.workspace import (
    FlashInferCommunicator,
    close_all,
    communicator,
    open_communicators,
)

__all__ = ["NAME", "NAMESPACE", "TRAINING_NAMESPACE", "FlashInferCommunicator", "close_all",
           "communicator", "open_communicators", "supports"]
