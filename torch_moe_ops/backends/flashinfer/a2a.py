"""The ``flashinfer`` a2a backend: FlashInfer's MoE all-to-all (the NVLink one-sided kernels
of ``flashinfer.comm.MoeAlltoAll``, from TensorRT-LLM) behind ``moe::dispatch``,
``moe::combine`` and their gradients (the rows format), and behind the tokens format of
layers without gradients (`ops.tokens`).

Legend: T tokens on this rank, M = max_tokens_per_rank, P ranks, N = P * M receive
positions, G = P * M keys (token t of rank p has the key p * M + t), H hidden size, K
experts per token, E experts, E_l = E / P experts per rank, C rows one rank takes from each
rank (the capacity), R = P * C rows.

Transport. ``moe_a2a_dispatch`` writes each token once into the workspace of every rank
that holds one of its experts: rank p's tokens land in block p of ``[P, M, ...]`` (one
buffer per payload), at positions an atomic counter hands out, so their order changes from
call to call, and the kernel leaves in the receiver's workspace how many came from each
rank; the rest of a block is padding, left as earlier calls wrote it, whose last int32
payload ``moe_a2a_sanitize_expert_ids`` sets to -1 (rows). ``moe_a2a_combine`` reads, for each
token, the ``[H]`` row at its position on each rank it went to and sums them in fp32: a
receiving rank hands back one row per position, already weighted and summed over its own
experts. The payloads are the activations ``[T, H]``, the routing weights ``[T, K]`` fp32,
the expert ids ``[T, K]`` int32 (-1 kept for skipped slots) and, for rows, each token's
index ``[T, 1]`` int32. The kernels route by expert id; a skipped slot goes to rank 0 (they
have no "nowhere"), and the token finds none of its experts there.

Dispatch and combine must alternate on a workspace: dispatch writes into its peers' memory
without waiting for them, and only combine's completion flags tell a rank that its peers are
done with what the last dispatch left (and where each token went, which combine reads
from the workspace). Every op here is one whole round or keeps that order: forward dispatch,
then its combine; each gradient is a dispatch and a combine of its own.

Rows (``moe::dispatch``): the received (position, slot) pairs whose expert is local are laid
out by key, ``key * K + k`` (the allgather backend's gathered slot), and sorted by expert:
rows of expert e in key order, whatever order the tokens arrived in. ``src_R`` is that slot
and ``slot_map_TK`` the rank of each of this rank's slots (-1: skipped), what the gradients
route by (as ids of ``P`` one-expert ranks). Combine sums each received token's weighted
rows in slot order (fp32) into its position and hands ``[N, H]`` to ``moe_a2a_combine``.
The gradient of combine sends ``grad_out`` with each token's index and gathers each row's
token gradient by key; the gradient of dispatch sends the token indices, sums the rows'
gradients into their positions and combines them; the routing weights' gradients go home
by one ``all_to_all`` of ``[G, K]`` fp32 over the group (each slot is nonzero on the rank of
its expert only). What runs between FlashInfer's kernels there is compiled by Inductor on
the GPU (`_compiled_on_gpu`).

Tokens (`ops.tokens`, for layers without gradients): the same dispatch without the token index, the
receive buffers handed over as they are (``[N, H]`` and ``[N, K]`` tensors over the
workspace, no copy) with the ids made local to this rank's experts (-1 at padding) by one
kernel (`received_ids`) in place of FlashInfer's id sanitizer, and ``combine_tokens`` hands
the experts' ``[N, H]`` to ``moe_a2a_combine``: beside FlashInfer's own round trip (dispatch,
its sanitizer, combine), nothing (but for one expert per rank, where the routing's -1 is
made 0 first). The buffers are the next dispatch's: inference only.

State: one `FlashInferCommunicator` per (group, H, K, M, dtype) holds the workspace, sized
once from the shape (`a2a_sizes`: ``moe_a2a_get_workspace_size_per_rank``), checked against
every rank's free GPU memory (all ranks refuse together, before allocating), allocated by
flashinfer's ``MnnvlMemory`` (each peer's part mapped by unicast: no multicast object) with
the handles exchanged over the group through flashinfer's torch.distributed communicator
(never MPI), created outside CUDA graph capture (the first eager call creates it,
collectively), kept in this module's one keyed cache and freed by ``close()`` / `close_all()`
(collective). ``MoeAlltoAll`` itself is not used: it caches one workspace per geometry for
the process and never frees it (and is deprecated in 0.7.2); its kernels are, through
flashinfer's functional API. Static shapes, no host sync (unless ``ep_capacity`` is below the
worst case: then dispatch checks on every rank, with an all-reduce and a host read, that no
rank takes more than ``C`` rows from one rank), ordered effects on every op: idle ranks
(T = 0) join every round and get ``[0, H]``, and a layer captures in a CUDA graph.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types

import torch
import torch.distributed as dist

from torch_moe_ops.backends.common import TRITON_INSTALLED, collectives
from torch_moe_ops.backends.common.communicators import Communicators
from torch_moe_ops.backends.common.rows import (
    block_of,
    combine_grads,
    gather_index,
    gather_rows,
    scatter_index,
    scatter_rows,
    sum_slots,
    weighted_rows,
)
from torch_moe_ops.backends.common.sorting import sort_rows
from torch_moe_ops.backends.flashinfer import a2a_sizes as sizes
from torch_moe_ops.backends.flashinfer import library
from torch_moe_ops.backends.registry import REGISTRY, A2ABackend
from torch_moe_ops.config import worst_case_capacity
from torch_moe_ops.ops import define_backend_ops

NAME = "flashinfer"
NAMESPACE = "moe_flashinfer_a2a"
# Where the activations must be (the CPU stand-in of tests/flashinfer_a2a_emulator.py sets "cpu").
DEVICE_TYPE = "cuda"


@functools.cache
def api() -> types.SimpleNamespace:
    """The names of ``flashinfer.comm`` this backend calls, imported on first use."""
    from flashinfer.comm import comm_backend, mapping, mnnvl
    from flashinfer.comm import trtllm_moe_alltoall as alltoall

    return types.SimpleNamespace(
        Mapping=mapping.Mapping, MnnvlConfig=mnnvl.MnnvlConfig, MnnvlMemory=mnnvl.MnnvlMemory,
        TorchDistBackend=comm_backend.TorchDistBackend,
        moe_a2a_get_workspace_size_per_rank=alltoall.moe_a2a_get_workspace_size_per_rank,
        moe_a2a_initialize=alltoall.moe_a2a_initialize,
        moe_a2a_dispatch=alltoall.moe_a2a_dispatch,
        moe_a2a_sanitize_expert_ids=alltoall.moe_a2a_sanitize_expert_ids,
        moe_a2a_combine=alltoall.moe_a2a_combine,
        moe_a2a_get_metainfo_index_pairs=(
            lambda: alltoall.get_moe_alltoall_module().moe_a2a_get_metainfo_index_pairs()))


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


def _on(device: torch.device):
    """``device`` current (flashinfer allocates and launches on the current CUDA device)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _free_bytes(device: torch.device) -> int | None:
    """Free memory on ``device``; None where there is no GPU memory to count."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


@dataclasses.dataclass
class _Received:
    """What the last dispatch left for its combine: where its combine payload goes, and
    (rows) the token index at each receive position (``[N, 1]``, -1 at padding)."""

    combine_offset: int
    token_N1: torch.Tensor | None = None


class FlashInferCommunicator:
    """FlashInfer's MoE all-to-all state for one layer shape on one process group: the
    workspace (``workspace_bytes`` per rank, every peer's mapped), its metainfo and what the
    last dispatch left for its combine (`_Received`). Build it with `communicator` (which
    caches it); ``close()`` frees the workspace (collective: every rank calls it).
    """

    def __init__(self, group_name: str, hidden_size: int, top_k: int, max_tokens_per_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        lib = api()
        group = collectives.group_of(group_name)
        self.group_name, self.ep_size, self.rank = group_name, group.size(), group.rank()
        self.hidden_size, self.top_k, self.dtype = hidden_size, top_k, dtype
        self.max_tokens_per_rank, self.device = max_tokens_per_rank, device
        self.num_positions = self.ep_size * max_tokens_per_rank
        comm = _group_comm(lib, group)
        with _on(device):
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
        # A skipped slot (-1) goes to some rank all the same. The kernel's rank of an id is
        # id / E_l, rounded toward zero as C divides: rank 0 for -1 where E_l > 1, as for
        # expert 0; with one expert per rank, rank -1, out of bounds: clamped there alone
        # (a launch: about 2.5 us, an eighth of a round trip of 128 tokens on one H100).
        routing_TK = ids_TK.clamp(min=0) if num_experts == self.ep_size else ids_TK
        views, combine_offset, _ = api().moe_a2a_dispatch(
            routing_TK.contiguous(), [p.contiguous() for p in payloads], self.workspace,
            self.metainfo, self.max_tokens_per_rank, self.rank, self.ep_size, self.top_k,
            num_experts, recv_view_cache=self.recv_views)
        if mark_padding:
            api().moe_a2a_sanitize_expert_ids(views[-1], self.workspace, self.metainfo,
                                              self.rank, -1)
        self.received = _Received(combine_offset)
        return [view.view(self.num_positions, -1) for view in views]

    def local_ids(self, ids_NK: torch.Tensor, num_experts: int) -> torch.Tensor:
        """``[N, K]`` int32: the last dispatch's ids (``ids_NK``, received global ids) of
        this rank's experts made local, -1 for all others and at padding (one kernel)."""
        # Imported here: it needs triton, which supports() asks for, not the package's import.
        from torch_moe_ops.backends.flashinfer import received_ids

        num_local = num_experts // self.ep_size
        return received_ids.local_ids(ids_NK, self.recv_counts_P, self.max_tokens_per_rank,
                                      self.rank * num_local, num_local)

    def combine(self, payload_NX: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """``[T, X]``: each token's rows at its positions on the ranks it went to, summed."""
        if self.received is None:
            raise RuntimeError(f"a2a backend 'flashinfer': combine before any dispatch on "
                               f"{self!r}")
        payload_PMX = payload_NX.contiguous().view(self.ep_size, self.max_tokens_per_rank, -1)
        # Allocated here, by torch's allocator: what a CUDA graph being captured can hold.
        out_TX = payload_NX.new_empty((num_tokens, payload_PMX.shape[2]))
        return api().moe_a2a_combine(payload_PMX, num_tokens, self.workspace, self.metainfo,
                                     self.max_tokens_per_rank, self.rank, self.ep_size,
                                     self.top_k, self.received.combine_offset, output=out_TX)

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
        with _on(self.device):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            # No rank frees its part while a peer may still read it.
            self.comm.barrier()
            self.received, self.recv_views, self.aliases = None, {}, {}
            self.workspace = self.metainfo = self.memory = None
        key = _key(self.group_name, self.hidden_size, self.top_k, self.max_tokens_per_rank,
                   self.dtype)
        _COMMUNICATORS.forget(key, self)


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


def _opened(group_name, ep_size, hidden_size, top_k, max_tokens_per_rank, dtype
            ) -> FlashInferCommunicator:
    """The communicator a dispatch of this shape opened: combine and the gradients follow one."""
    collectives.rank_in(group_name, ep_size)
    key = _key(group_name, hidden_size, top_k, max_tokens_per_rank, dtype)
    if key not in _COMMUNICATORS:
        raise RuntimeError(f"a2a backend 'flashinfer': no communicator is open for group "
                           f"{group_name!r}, H={hidden_size}, K={top_k}, max_tokens_per_rank="
                           f"{max_tokens_per_rank}, {dtype}: combine and the gradients follow "
                           "this backend's dispatch of the same layer")
    return _COMMUNICATORS[key]


def _check_activations(name: str, t: torch.Tensor) -> None:
    if t.device.type != DEVICE_TYPE:
        raise ValueError(f"{name} must be on a CUDA device for a2a backend 'flashinfer', got "
                         f"{t.device}")
    if t.dtype not in sizes.DTYPES:
        raise ValueError(f"{name} must have dtype in ({', '.join(map(str, sizes.DTYPES))}) for "
                         f"a2a backend 'flashinfer', got {t.dtype}")


def _ranks_of(topk_ids_TK: torch.Tensor, num_local: int) -> torch.Tensor:
    """``[T, K]`` int32: the rank of each slot's expert, -1 for a skipped slot."""
    ids_TK = topk_ids_TK.long()
    return torch.where(ids_TK < 0, -1, ids_TK // num_local).to(torch.int32)


def _keys(token_N: torch.Tensor, max_tokens: int) -> torch.Tensor:
    """``[N]`` int64: the key of the token at each receive position, -1 at padding."""
    source_N = torch.arange(token_N.shape[0], device=token_N.device) // max_tokens
    return torch.where(token_N < 0, -1, source_N * max_tokens + token_N.long())


def _token_index(num_tokens: int, device: torch.device) -> torch.Tensor:
    return torch.arange(num_tokens, dtype=torch.int32, device=device).unsqueeze(1)


def _send_tokens(comm, hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, *extra):
    """The forward dispatch of both formats: ``[x [N, H], weights [N, K] fp32, ids [N, K]
    int32, *extra]``, views of the workspace; with ``extra``, the last one has -1 at
    padding (`FlashInferCommunicator.local_ids` finds the padding of the ids itself)."""
    ids_TK = topk_ids_TK.to(torch.int32)
    return comm.dispatch(ids_TK, num_experts, [hidden_TH, topk_weights_TK.float(), ids_TK,
                                               *extra], mark_padding=bool(extra))


def _compiled_on_gpu(body):
    """``body`` (tensors, then ints fixed per layer shape) compiled by Inductor with static
    shapes where its first input is on a GPU, as it is elsewhere (the CPU stand-in of the
    tests). The rows bookkeeping around FlashInfer's kernels is some 150 small torch ops a
    round trip: eagerly, launch-bound. It stays whole (opaque) in a compiled model, like
    the kernels, so it is compiled on its own; its sizes are the layer's (N, R), not T's.
    ``run.compiled()`` is the compiled form (whatever the device: tests compare the two)."""

    @functools.cache
    def compiled():
        # On first use: importing the package does not load the compiler. Casts to bf16
        # rounded where the eager ops round (as `weighted_rows` documents).
        return torch.compile(body, dynamic=False, fullgraph=True,
                             options={"emulate_precision_casts": True})

    @functools.wraps(body)
    def run(*args):
        return (compiled() if args[0].is_cuda else body)(*args)

    run.compiled = compiled
    return run


def _sum_received(rows_RH, src_R, key_N, top_k) -> torch.Tensor:
    """``[N, H]``: at each receive position the rows of its token summed in slot order."""
    num_slots = key_N.shape[0] * top_k
    rows = torch.arange(src_R.shape[0], device=src_R.device)
    row_of_slot_GK = scatter_index(rows, src_R, num_slots).view(-1, top_k)
    return sum_slots(rows_RH, gather_rows(row_of_slot_GK + 1, key_N) - 1)


def _positions(key_N: torch.Tensor) -> torch.Tensor:
    """``[G]``: the receive position of each key, -1 where its token did not come."""
    return scatter_index(torch.arange(key_N.shape[0], device=key_N.device), key_N,
                         key_N.shape[0])


@_compiled_on_gpu
def _in_key_order(local_NK, token_N1, max_tokens):
    """``(position_G, local_GK)``: where each key's token was received, and its local ids
    (-1 where it did not come)."""
    position_G = _positions(_keys(token_N1[:, 0], max_tokens))
    return position_G, gather_rows(local_NK + 1, position_G) - 1


@_compiled_on_gpu
def _received_rows(x_NH, weights_NK, local_GK, position_G, num_local, num_rows, top_k):
    """The rows format's outputs but the slot map: ``(x_RH, expert_R, weight_R, src_R,
    count_E)``; the slots of this rank's experts sort first, in key order."""
    order_S, expert_S, count_E = sort_rows(local_GK, num_local)
    expert_R = expert_S[:num_rows]
    src_R = order_S[:num_rows].masked_fill(expert_R < 0, -1).to(torch.int32)
    position_R = gather_index(position_G, block_of(src_R, top_k))
    slot_R = torch.where(position_R < 0, -1, position_R * top_k + src_R % top_k)
    weight_R = gather_rows(weights_NK.reshape(-1, 1), slot_R)[:, 0]
    return (gather_rows(x_NH, position_R), expert_R.to(torch.int32), weight_R, src_R,
            count_E.clone())


@_compiled_on_gpu
def _summed_rows(rows_RH, src_R, token_N1, weight_R, max_tokens, top_k):
    """``[N, H]``: at each receive position its token's rows (times ``weight_R`` where
    given) summed in slot order."""
    if weight_R is not None:
        rows_RH = weighted_rows(rows_RH, weight_R, src_R)
    return _sum_received(rows_RH, src_R, _keys(token_N1[:, 0], max_tokens), top_k)


@_compiled_on_gpu
def _rows_of_grad(grad_NH, y_RH, weight_R, src_R, token_N1, max_tokens, top_k):
    """The gradients of the rows (`combine_grads`) from the received gradient of each
    position, ``grad_NH``."""
    position_R = gather_index(_positions(_keys(token_N1[:, 0], max_tokens)),
                              block_of(src_R, top_k))
    return combine_grads(gather_rows(grad_NH, position_R), y_RH, weight_R, src_R)


# The ops of the rows format.

def dispatch(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, ep_size, group_name,
             max_tokens_per_rank, capacity):
    _check_activations("hidden", hidden_TH)
    top_k = topk_ids_TK.shape[1]
    num_local = num_experts // ep_size
    collectives.rank_in(group_name, ep_size)
    with _on(hidden_TH.device):
        comm = communicator(group_name, hidden_TH.shape[1], top_k, max_tokens_per_rank,
                            hidden_TH.dtype, hidden_TH.device)
        index_T1 = _token_index(topk_ids_TK.shape[0], topk_ids_TK.device)
        x_NH, weights_NK, ids_NK, token_N1 = _send_tokens(
            comm, hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, index_T1)
        comm.received.token_N1 = token_N1
        position_G, local_GK = _in_key_order(comm.local_ids(ids_NK, num_experts), token_N1,
                                             max_tokens_per_rank)
        if capacity < worst_case_capacity(max_tokens_per_rank, top_k):
            collectives.check_capacity((local_GK >= 0).view(ep_size, -1).sum(1), capacity,
                                       group_name, "a rank holds the experts of more of "
                                       "another rank's slots than the capacity")
        return (*_received_rows(x_NH, weights_NK, local_GK, position_G, num_local,
                                ep_size * capacity, top_k),
                _ranks_of(topk_ids_TK, num_local))


def combine(y_RH, weight_R, src_R, slot_map_TK, ep_size, group_name, max_tokens_per_rank):
    _check_activations("y_rows", y_RH)
    num_tokens, top_k = slot_map_TK.shape
    with _on(y_RH.device):
        comm = _opened(group_name, ep_size, y_RH.shape[1], top_k, max_tokens_per_rank,
                       y_RH.dtype)
        token_N1 = comm.received.token_N1 if comm.received is not None else None
        if token_N1 is None:
            raise RuntimeError(f"a2a backend 'flashinfer': combine must follow the dispatch "
                               f"of its layer on {comm!r}")
        summed_NH = _summed_rows(y_RH, src_R, token_N1, weight_R, max_tokens_per_rank, top_k)
        return comm.combine(summed_NH, num_tokens)


def _send_back_tokens(comm, slot_map_TK, payloads=()) -> tuple[torch.Tensor, list]:
    """A dispatch of each token's index (and ``payloads``) along ``slot_map_TK``: the token
    index at each receive position of this round (``[N, 1]``, -1 at padding) and the
    received payloads."""
    index_T1 = _token_index(slot_map_TK.shape[0], slot_map_TK.device)
    *received, token_N1 = comm.dispatch(slot_map_TK, comm.ep_size, [*payloads, index_T1])
    return token_N1, received


def dispatch_backward(grad_x_RH, grad_weight_R, src_R, slot_map_TK, ep_size, group_name,
                      max_tokens_per_rank):
    _check_activations("grad_x_rows", grad_x_RH)
    num_tokens, top_k = slot_map_TK.shape
    with _on(grad_x_RH.device):
        comm = _opened(group_name, ep_size, grad_x_RH.shape[1], top_k, max_tokens_per_rank,
                       grad_x_RH.dtype)
        token_N1, _ = _send_back_tokens(comm, slot_map_TK)
        grad_hidden_TH = comm.combine(
            _summed_rows(grad_x_RH, src_R, token_N1, None, max_tokens_per_rank, top_k),
            num_tokens)
        per_key_GK = scatter_rows(grad_weight_R.float().unsqueeze(1), src_R,
                                  comm.num_positions * top_k).view(-1, top_k)
        # Block p of the keys is rank p's tokens; what comes back from rank q holds q's slots.
        mine_PMK = collectives.all_to_all(per_key_GK, group_name, ep_size).view(
            ep_size, max_tokens_per_rank, top_k)
        return grad_hidden_TH, mine_PMK.sum(0)[:num_tokens]


def combine_backward(grad_out_TH, y_RH, weight_R, src_R, slot_map_TK, ep_size, group_name,
                     max_tokens_per_rank):
    _check_activations("y_rows", y_RH)
    top_k = slot_map_TK.shape[1]
    with _on(y_RH.device):
        comm = _opened(group_name, ep_size, y_RH.shape[1], top_k, max_tokens_per_rank,
                       y_RH.dtype)
        token_N1, (grad_NH,) = _send_back_tokens(comm, slot_map_TK,
                                                 [grad_out_TH.to(y_RH.dtype)])
        grads = _rows_of_grad(grad_NH, y_RH, weight_R, src_R, token_N1, max_tokens_per_rank,
                              top_k)
        # The round's combine: peers learn this rank is done with what it received.
        comm.combine(y_RH.new_zeros((comm.num_positions, 1)), slot_map_TK.shape[0])
        return grads


# The ops of the tokens format (`ops.tokens`): the fused pairs' transport.

def dispatch_tokens(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, ep_size, group_name,
                    max_tokens_per_rank):
    _check_activations("hidden", hidden_TH)
    collectives.rank_in(group_name, ep_size)
    with _on(hidden_TH.device):
        comm = communicator(group_name, hidden_TH.shape[1], topk_ids_TK.shape[1],
                            max_tokens_per_rank, hidden_TH.dtype, hidden_TH.device)
        x_NH, weights_NK, ids_NK = _send_tokens(comm, hidden_TH, topk_weights_TK, topk_ids_TK,
                                                num_experts)
        return comm.alias(x_NH), comm.alias(weights_NK), comm.local_ids(ids_NK, num_experts)


def combine_tokens(y_NH, topk_ids_TK, num_experts, ep_size, group_name, max_tokens_per_rank):
    _check_activations("y_tokens", y_NH)
    num_tokens, top_k = topk_ids_TK.shape
    with _on(y_NH.device):
        comm = _opened(group_name, ep_size, y_NH.shape[1], top_k, max_tokens_per_rank,
                       y_NH.dtype)
        return comm.combine(y_NH, num_tokens)


@functools.cache
def _nvlink_reason(index: int) -> str | None:
    """Why GPU ``index`` cannot take part (flashinfer's check: NVLinks, every one up)."""
    try:
        with torch.cuda.device(index):
            linked = api().MnnvlMemory.supports_mnnvl()
    except Exception as error:  # noqa: BLE001 (NVML's failure is the reason, reported)
        return f"NVML could not tell whether GPU {index} has NVLink: {error}"
    if not linked:
        return (f"needs GPUs joined by NVLink with every link up, and GPU {index} is not "
                "(flashinfer's MnnvlMemory.supports_mnnvl())")
    return None


def supports(spec, problem, device) -> str | None:
    if not dist.is_available():
        return "this torch has no torch.distributed"
    if problem.ep_size is not None and problem.ep_size < 2:
        return "needs expert parallelism (ep_size > 1); a2a 'none' runs one device"
    if not TRITON_INSTALLED:
        return "triton is not installed (pip install triton): it marks the received ids"
    reason = sizes.why_not_shape(problem.ep_size, problem.top_k, problem.dtype,
                                 problem.num_experts, problem.hidden_size)
    if reason is not None:
        return reason
    reason = library.device_reason(device)
    if reason is not None:
        return reason
    index = device.index if device.index is not None else torch.cuda.current_device()
    reason = _nvlink_reason(index)
    if reason is not None:
        return reason
    shape = (problem.ep_size, problem.max_tokens_per_rank, problem.hidden_size, problem.top_k)
    if None in shape:
        return None
    # The exact size (with flashinfer's own region) and the free memory are checked when the
    # workspace is allocated; here, what no GPU of this kind could hold.
    return sizes.why_not_fits(sizes.payload_bytes(*shape, problem.dtype),
                              torch.cuda.get_device_properties(index).total_memory, *shape,
                              problem.dtype, available="in all")


# The tokens ops have no gradient ops: their buffers are the workspace's, which the next
# dispatch overwrites, so a layer that trains takes the rows format here.
define_backend_ops(NAMESPACE, {"dispatch": dispatch, "combine": combine,
                               "dispatch_backward": dispatch_backward,
                               "combine_backward": combine_backward,
                               "dispatch_tokens": dispatch_tokens,
                               "combine_tokens": combine_tokens})

def prepare(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, ep_size, group_name,
            max_tokens_per_rank) -> None:
    """The layer's communicator, opened when the layer is compiled: made in a warm-up run of
    ``mode="reduce-overhead"``, its tensors would stay in the CUDA graphs' memory pool."""
    communicator(group_name, hidden_TH.shape[1], topk_ids_TK.shape[1], max_tokens_per_rank,
                 hidden_TH.dtype, hidden_TH.device)


REGISTRY.register_a2a(A2ABackend(
    name=NAME, namespace=NAMESPACE, supports=supports, prepare=prepare,
    description="FlashInfer's MoE all-to-all (NVLink one-sided, static per-rank capacity)"))
