"""The ``deepep`` a2a backend: DeepEP's expert-parallel kernels (NVLink, RDMA) on its public
``deep_ep.Buffer`` API, in three formats (`registry.FORMATS`):

- masked (`masked`: ``moe::dispatch_masked`` / ``moe::combine_masked``, and
  ``moe::dispatch_masked_quant`` for fp8 blocks), DeepEP's low-latency mode with its
  per-expert receive blocks as they are, for decode layers
  (``max_tokens_per_rank <= LOW_LATENCY_MAX_TOKENS``) without gradients, quantized too;
- tokens (`tokens`: ``moe::dispatch_tokens`` / ``moe::combine_tokens``), DeepEP's normal
  mode at its worst-case token count, for layers without gradients; also in flight
  (`in_flight`, `ops.tokens_in_flight`: issued by one op, waited by the graph's wait node,
  with the shared experts or another chunk's experts between);
- rows (`rows`: ``moe::dispatch``, ``moe::dispatch_quant``, ``moe::combine`` and their
  gradients), in normal mode (`normal`, namespace ``moe_deepep``) or, for decode batches,
  low-latency mode (`low_latency`, namespace ``moe_deepep_low_latency``): layers that train,
  and quantized layers.

The mode is the layer plan's (`supports.mode_of`, which ``tmo.explain`` prints): the lowered
graph names the namespace of the mode's ops, and they run that mode whatever else is open.
State lives in one `buffer.DeepEPCommunicator` per (group, layer shape, mode), created by
the first eager call, when the layer is compiled (`prepare`) or by `communicator`, closed by
`close_all` (collective).
Every op carries an ordered effect: ``torch.compile`` neither drops one whose outputs are
empty (an idle rank's ``[0, H]``) nor moves it past another, so every rank runs them in
the same order. Normal mode runs on the ranks of one host only (2, 4 or 8): its dispatch
takes a static receive size (``num_worst_tokens``, what makes it traceable and capturable),
which DeepEP's internode dispatch does not; a group over several hosts is refused
(`modes.normal_mode_reason`, and a check of the ranks' hosts when its communicator is
created). Low-latency mode over several hosts (P > 8, 8 GPUs per host) calls DeepEP's RDMA
kernels through NVSHMEM; that path is written against DeepEP's API but has not been run here.
"""

from __future__ import annotations

from torch_moe_ops.backends.common.transport.token_routing import finish_dispatch
from torch_moe_ops.backends.deepep import in_flight, masked, rows, tokens
from torch_moe_ops.backends.deepep.buffer import (
    NOT_INSTALLED,
    DeepEPCommunicator,
    close_all,
    communicator,
    on,
    open_communicators,
)
from torch_moe_ops.backends.deepep.configs import set_num_sms
from torch_moe_ops.backends.deepep.modes import (
    LOW_LATENCY,
    LOW_LATENCY_MAX_TOKENS,
    NAMESPACE,
    NORMAL,
    NVSHMEM_QP_DEPTH_ENV,
    ROWS_NAMESPACES,
    choose_mode,
    fp8_transport_reason,
    low_latency_mode_reason,
    normal_mode_reason,
)
from torch_moe_ops.backends.deepep.supports import format_reason, mode_of, supports
from torch_moe_ops.backends.registry import REGISTRY, A2ABackend
from torch_moe_ops.ops import define_backend_ops, tokens_in_flight

# The tokens and masked ops have no gradient ops (`tokens`, `masked` say why): a layer that
# trains takes rows. Quantized layers have no gradient in any format.
define_backend_ops(NAMESPACE, {**rows.kernels(NORMAL),
                               "dispatch_tokens": tokens.dispatch_tokens,
                               "combine_tokens": tokens.combine_tokens,
                               "dispatch_masked": masked.dispatch_masked,
                               "dispatch_masked_quant": masked.dispatch_masked_quant,
                               "combine_masked": masked.combine_masked})
define_backend_ops(ROWS_NAMESPACES[LOW_LATENCY], rows.kernels(LOW_LATENCY))
# The tokens format in flight, on normal mode: DeepEP returns each token's sum at home.
define_backend_ops(NAMESPACE, {"dispatch_tokens_start": in_flight.dispatch_tokens_start,
                               "dispatch_tokens_finish": finish_dispatch,
                               "combine_tokens_start": in_flight.combine_tokens_start},
                   tokens_in_flight.contracts(sums_at_home=False))


def prepare(fmt, mode, hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, ep_size,
            group_name, max_tokens_per_rank) -> None:
    """The layer's communicator in the mode its plan took (``mode``, `supports.mode_of`),
    opened when the layer is compiled: made in a warm-up run of ``mode="reduce-overhead"``,
    its tensors would stay in the CUDA graphs' memory pool."""
    if hidden_TH.device.type != "cuda":
        return
    with on(hidden_TH.device):
        communicator(group_name, hidden_TH.shape[1], num_experts, topk_ids_TK.shape[1],
                     max_tokens_per_rank, hidden_TH.dtype, mode=mode.name,
                     device=hidden_TH.device)


REGISTRY.register_a2a(A2ABackend(
    name="deepep", namespace=NAMESPACE, supports=supports, prepare=prepare,
    format_reason=format_reason, mode_of=mode_of, environment=(NVSHMEM_QP_DEPTH_ENV,),
    description=(f"DeepEP: for max_tokens_per_rank <= {LOW_LATENCY_MAX_TOKENS}, masked "
                 f"format on low-latency mode, else tokens format on normal mode (worst-case "
                 f"static receive, NVLink/RDMA), both without gradients; rows in normal mode "
                 f"or, for max_tokens_per_rank <= {LOW_LATENCY_MAX_TOKENS}, low-latency "
                 f"mode")))

__all__ = ["LOW_LATENCY", "LOW_LATENCY_MAX_TOKENS", "NAMESPACE", "NORMAL", "NOT_INSTALLED",
           "ROWS_NAMESPACES", "DeepEPCommunicator", "choose_mode", "close_all", "communicator",
           "fp8_transport_reason", "low_latency_mode_reason", "normal_mode_reason",
           "open_communicators", "set_num_sms", "supports"]
