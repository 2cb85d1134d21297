"""The state of FlashInfer's all-to-all: one `FlashInferCommunicator` per (group, H, K, M,
dtype) holding the workspace, in this module's one keyed cache, opened by `communicator`
and freed by ``close()`` / `close_all` (collective). docs/architecture.md, "The flashinfer
all-to-all", says how the workspace is sized, allocated and shared.

Legend: T tokens on this rank, M = max_tokens_per_rank, P ranks, N = P * M receive
positions, H hidden size, K experts per token, X the width of a payload.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types

import torch
import torch.distributed as dist

from torch_moe_ops.backends.common.transport import collectives
from torch_moe_ops.backends.common.transport.communicators import Communicators
from torch_moe_ops.backends.flashinfer import a2a_sizes as sizes
from torch_moe_ops.backends.flashinfer.a2a import comm_api
from torch_moe_ops.backends.flashinfer.a2a.comm_api import check_activations, on


def _metainfo_index(lib: types.SimpleNamespace, name: str) -> int:
    """Where the workspace offset ``name`` (``MOE_A2A_`` + name in FlashInfer's C++) is
    kept in the metainfo that ``moe_a2a_initialize`` returns."""
    names, values = lib.moe_a2a_get_metainfo_index_pairs()
    return dict(zip(names, values, strict=True))[f"MOE_A2A_{name}"]


def _group_comm(lib: types.SimpleNamespace, group: dist.ProcessGroup):
    """flashinfer's torch.distributed communicator over ``group``. ``MnnvlMemory`` asks it
    for ``Split(0, rank)`` (a pure expert-parallel mapping: one color, ranks in order),
    which is ``group`` itself; flashinfer's own Split would build a new group, collective
    over the default group, which ranks outside ``group`` never join."""

    class GroupComm(lib.TorchDistBackend):
        def Split(self, color: int, key: int):
            if (color, key) != (0, self.Get_rank()):
                raise ValueError(f"only the identity split of group {group.group_name!r} is "
                                 f"built here: color must be 0 and key this rank "
                                 f"({self.Get_rank()}), got color={color}, key={key}")
            return self

    return GroupComm(group=group)


def _free_bytes(device: torch.device) -> int | None:
    """Free memory on ``device``; None where there is no GPU memory to count."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


@dataclasses.dataclass
class _Received:
    """What the last dispatch left for its combine: where its combine payload goes, how many
    tokens this rank sent, and what its format reads of the arrivals (views of the
    workspace): the token index at each receive position (``[N, 1]``; rows: -1 at padding,
    trainable tokens: padding found from ``recv_counts_P``) and the received global ids
    (``[N, K]``; trainable tokens).
    ``gradient``: the dispatch of a gradient, whose combine autograd may never run."""

    combine_offset: int
    num_tokens: int
    token_N1: torch.Tensor | None = None
    ids_NK: torch.Tensor | None = None
    gradient: bool = False


class FlashInferCommunicator:
    """FlashInfer's MoE all-to-all state for one layer shape on one process group: the
    workspace (``workspace_bytes`` per rank, every peer's mapped), its metainfo and what the
    last dispatch left for its combine (`_Received`). Build it with `communicator` (which
    caches it); ``close()`` frees the workspace (collective: every rank calls it).
    """

    def __init__(self, group_name: str, hidden_size: int, top_k: int, max_tokens_per_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        lib = comm_api.api()
        group = collectives.group_of(group_name)
        self.group_name, self.ep_size, self.rank = group_name, group.size(), group.rank()
        self.hidden_size, self.top_k, self.dtype = hidden_size, top_k, dtype
        self.max_tokens_per_rank, self.device = max_tokens_per_rank, device
        self.num_positions = self.ep_size * max_tokens_per_rank
        comm = _group_comm(lib, group)
        with on(device):
            self.workspace_bytes = int(lib.moe_a2a_get_workspace_size_per_rank(
                self.ep_size, max_tokens_per_rank,
                sizes.dispatch_bytes_per_token(hidden_size, top_k, dtype),
                sizes.combine_bytes_per_token(hidden_size, dtype)))
            # Every rank decides on the least free memory: none allocates (collectively) alone.
            free = [b for b in comm.allgather(_free_bytes(device)) if b is not None]
            reason = sizes.why_not_fits(self.workspace_bytes, min(free), self.ep_size,
                                        max_tokens_per_rank, hidden_size, top_k,
                                        dtype) if free else None
            if reason is not None:
                raise RuntimeError(f"a2a backend 'flashinfer' cannot open on group "
                                   f"{group_name!r}: {reason}")
            mapping = lib.Mapping(world_size=self.ep_size, rank=self.rank,
                                  gpus_per_node=self.ep_size, tp_size=self.ep_size,
                                  moe_ep_size=self.ep_size)
            lib.MnnvlMemory.initialize()
            lib.MnnvlMemory.set_comm_from_config(mapping, lib.MnnvlConfig(comm_backend=comm))
            self.memory = lib.MnnvlMemory(mapping, self.workspace_bytes)
            self.workspace = self.memory.as_torch_strided_tensor(torch.uint8)
            self.metainfo = lib.moe_a2a_initialize(self.workspace, self.rank, self.ep_size,
                                                    max_tokens_per_rank)
            # The tokens each rank sent here in the last dispatch (its kernel writes them).
            counts_at = int(self.metainfo[_metainfo_index(lib, "RECV_COUNTERS_OFFSET_INDEX")])
            self.recv_counts_P = self.workspace[self.rank, counts_at:
                                                counts_at + 4 * self.ep_size].view(torch.int32)
        # No peer writes into a workspace before its owner has zeroed it.
        comm.barrier()
        self.comm = comm
        self.received: _Received | None = None
        self.recv_views: dict = {}
        self.aliases: dict = {}

    def __repr__(self) -> str:
        state = "closed" if self.memory is None else "open"
        return (f"FlashInferCommunicator(group={self.group_name!r}, H={self.hidden_size}, "
                f"K={self.top_k}, max_tokens_per_rank={self.max_tokens_per_rank}, "
                f"{self.dtype}, workspace {self.workspace_bytes / sizes.GIB:.3f} GiB per rank, "
                f"{state})")

    def dispatch(self, ids_TK: torch.Tensor, num_experts: int, payloads: list[torch.Tensor],
                 mark_padding: bool = True) -> list[torch.Tensor]:
        """``payloads`` (each ``[T, X]``; with ``mark_padding`` the last int32, -1 written at
        its padding) to the ranks that hold the experts ``ids_TK`` (int32 of
        ``num_experts``; -1 skips): ``[N, X]`` views of the workspace."""
        if self.received is not None and self.received.gradient:
            # The gradient of combine_tokens dispatched, and that of dispatch_tokens, which
            # combines, never ran (no input of the layer's dispatch needed a gradient): its
            # round is closed here, on every rank alike (they run one model), with a combine
            # of one column of zeros.
            self.combine(self.workspace.new_zeros((self.num_positions, 1), dtype=self.dtype),
                         self.received.num_tokens)
        # A skipped slot (-1) goes to some rank all the same. The kernel's rank of an id is
        # id / E_l, rounded toward zero as C divides: rank 0 for -1 where E_l > 1, as for
        # expert 0; with one expert per rank, rank -1, out of bounds: clamped there alone
        # (a launch: about 2.5 us, an eighth of a round trip of 128 tokens on one H100).
        routing_TK = ids_TK.clamp(min=0) if num_experts == self.ep_size else ids_TK
        views, combine_offset, _ = comm_api.api().moe_a2a_dispatch(
            routing_TK.contiguous(), [p.contiguous() for p in payloads], self.workspace,
            self.metainfo, self.max_tokens_per_rank, self.rank, self.ep_size, self.top_k,
            num_experts, recv_view_cache=self.recv_views)
        if mark_padding:
            comm_api.api().moe_a2a_sanitize_expert_ids(views[-1], self.workspace,
                                                       self.metainfo, self.rank, -1)
        self.received = _Received(combine_offset, ids_TK.shape[0])
        return [view.view(self.num_positions, -1) for view in views]

    def send_tokens(self, hidden_TH: torch.Tensor, topk_weights_TK: torch.Tensor,
                    topk_ids_TK: torch.Tensor, num_experts: int, *extra: torch.Tensor,
                    mark_padding: bool = True) -> list[torch.Tensor]:
        """The forward dispatch of both formats: ``[x [N, H], weights [N, K] fp32, ids [N, K]
        int32, *extra]``, views of the workspace; with ``extra`` and ``mark_padding``, the
        last one has -1 at padding (`local_ids` finds the padding of the ids itself, from
        the receive counters, as a reader of ``recv_counts_P`` may)."""
        ids_TK = topk_ids_TK.to(torch.int32)
        payloads = [hidden_TH, topk_weights_TK.float(), ids_TK, *extra]
        return self.dispatch(ids_TK, num_experts, payloads,
                             mark_padding=mark_padding and bool(extra))

    def local_ids(self, ids_NK: torch.Tensor, num_experts: int) -> torch.Tensor:
        """``[N, K]`` int32: the last dispatch's ids (``ids_NK``, received global ids) of
        this rank's experts made local, -1 for all others and at padding (one kernel)."""
        # Imported here: it needs triton, which supports() asks for, not the package's import.
        from torch_moe_ops.backends.flashinfer import received_ids

        num_local = num_experts // self.ep_size
        return received_ids.local_ids(ids_NK, self.recv_counts_P, self.max_tokens_per_rank,
                                      self.rank * num_local, num_local)

    def combine(self, payload_NX: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """``[T, X]``: each token's rows at its positions on the ranks it went to, summed;
        the last dispatch is then answered."""
        if self.received is None:
            raise RuntimeError(f"a2a backend 'flashinfer': combine without a dispatch to "
                               f"answer on {self!r} (each dispatch is answered by one combine)")
        payload_PMX = payload_NX.contiguous().view(self.ep_size, self.max_tokens_per_rank, -1)
        # Allocated here, by torch's allocator: what a CUDA graph being captured can hold.
        out_TX = payload_NX.new_empty((num_tokens, payload_PMX.shape[2]))
        combine_offset, self.received = self.received.combine_offset, None
        return comm_api.api().moe_a2a_combine(
            payload_PMX, num_tokens, self.workspace, self.metainfo, self.max_tokens_per_rank,
            self.rank, self.ep_size, self.top_k, combine_offset, output=out_TX)

    def alias(self, view: torch.Tensor) -> torch.Tensor:
        """A tensor over ``view``'s memory with storage offset 0, as the op's fake has it
        (a workspace view's offset is where it lies in the workspace); kept per view."""
        key = (view.data_ptr(), view.shape, view.stride(), view.dtype,
               torch.is_inference_mode_enabled())
        if key not in self.aliases:
            self.aliases[key] = torch.from_dlpack(view)
        return self.aliases[key]

    def close(self) -> None:
        """Free the workspace (collective: every rank of the group calls it)."""
        if self.memory is None:
            return
        with on(self.device):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            # No rank frees its part while a peer may still read it.
            self.comm.barrier()
            _KEPT_CAPSULES.append(getattr(self.workspace, "_capsule_wrapper", None))
            self.received, self.recv_views, self.aliases = None, {}, {}
            self.workspace = self.metainfo = self.memory = None
        key = _key(self.group_name, self.hidden_size, self.top_k, self.max_tokens_per_rank,
                   self.dtype)
        _COMMUNICATORS.forget(key, self)


# FlashInfer's workspace tensor holds, as `_capsule_wrapper`, the DLPack struct whose
# deleter its storage calls when the last tensor over it goes; views of the workspace
# (ours, and those a compiled graph or a caller keeps) do not hold the attribute. Freed
# with the workspace tensor on close, the struct was read after its end by the last
# view's free (SIGSEGV on 2x H200). A few hundred bytes per communicator ever opened.
_KEPT_CAPSULES: list = []

# The one cache of this module: open communicators by (group, H, K, M, dtype).
# `communicator` fills it, `FlashInferCommunicator.close` and `close_all` empty it.
_COMMUNICATORS = Communicators()


def _key(group_name, hidden_size, top_k, max_tokens_per_rank, dtype) -> tuple:
    return (group_name, hidden_size, top_k, max_tokens_per_rank, str(dtype))


def communicator(group_name: str, hidden_size: int, top_k: int, max_tokens_per_rank: int,
                 dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None) -> FlashInferCommunicator:
    """The communicator of this layer shape on group ``group_name``, created on first use.

    Creating one is collective (every rank maps every peer's workspace) and cannot happen
    inside CUDA graph capture: every rank calls this, or runs the layer once eagerly,
    before capturing. Raises on every rank where the workspace does not fit.
    """
    key = _key(group_name, hidden_size, top_k, max_tokens_per_rank, dtype)
    if key in _COMMUNICATORS:
        return _COMMUNICATORS[key]
    ep_size = collectives.group_of(group_name).size()
    reason = sizes.why_not_shape(ep_size, top_k, dtype, hidden_size=hidden_size)
    if reason is not None:
        raise ValueError(f"a2a backend 'flashinfer' cannot run on group {group_name!r}: "
                         f"{reason}")
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"the flashinfer communicator of group {group_name!r} (H="
                           f"{hidden_size}, K={top_k}, max_tokens_per_rank="
                           f"{max_tokens_per_rank}, {dtype}) must be created before CUDA graph "
                           "capture: run the layer once eagerly, or call torch_moe_ops.backends."
                           "flashinfer.a2a.communicator(...) on every rank first")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    created = FlashInferCommunicator(group_name, hidden_size, top_k, max_tokens_per_rank,
                                     dtype, torch.device(device))
    _COMMUNICATORS[key] = created
    return created


close_all = _COMMUNICATORS.close_all
open_communicators = _COMMUNICATORS.in_key_order


def opened(group_name, ep_size, hidden_size, top_k, max_tokens_per_rank, dtype
           ) -> FlashInferCommunicator:
    """The communicator a dispatch of this shape opened: combine and the gradients follow one."""
    collectives.rank_in(group_name, ep_size)
    return _COMMUNICATORS.opened(
        _key(group_name, hidden_size, top_k, max_tokens_per_rank, dtype), "flashinfer",
        f"group {group_name!r}, H={hidden_size}, K={top_k}, max_tokens_per_rank="
        f"{max_tokens_per_rank}, {dtype}")


@contextlib.contextmanager
def answering(name: str, x: torch.Tensor, top_k: int, group_name: str, ep_size: int,
              max_tokens_per_rank: int):
    """The open communicator of ``x``'s shape (`opened`; ``x`` checked as the activations
    argument ``name``), with ``x``'s device current: where the ops that answer a dispatch run
    (its combine and the gradients)."""
    check_activations(name, x)
    with on(x.device):
        yield opened(group_name, ep_size, x.shape[1], top_k, max_tokens_per_rank, x.dtype)
