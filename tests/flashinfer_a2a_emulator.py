"""A CPU stand-in for the part of flashinfer-python 0.7.2's ``flashinfer.comm`` that the
``flashinfer`` a2a backend calls, written from its documented behaviour (the docstrings of
flashinfer/comm/trtllm_moe_alltoall.py and mnnvl.py, the checks of
csrc/trtllm_moe_alltoall.cu), so that the backend's bookkeeping runs on gloo.

It keeps what the backend relies on and nothing of how FlashInfer gets there: the same
calls, argument checks and result layouts; exchanges are ``all_gather_object`` over the
group. What it cannot tell is whether FlashInfer's kernels behave as documented:
tests/test_flashinfer_a2a_gpu.py runs the real ones.

- ``MnnvlMemory``: one ``[P, S]`` uint8 workspace per allocation (only row ``rank`` is
  used: the real one maps every peer's there), freed when the object is collected
  (``live`` counts those not yet freed). Its communicator is what ``Split(0, rank)`` of the
  configured one returns; this ``TorchDistBackend`` builds no process group, so its own
  ``Split`` raises.
- ``moe_a2a_dispatch``: each token goes once to each rank that holds one of its experts
  (``token_selected_experts / (E / P)``, rounded toward zero as C divides: -1 goes to rank 0
  where E / P > 1); rank p's tokens land in block p of each
  payload's ``[P, M, X]`` view of the workspace, at positions in a random order (the
  kernel's atomic counters); every other position of a block holds garbage (what earlier
  calls left there). The tokens each rank sent go to the receive counters (``[P]`` int32 in
  the workspace, at the offset the metainfo keeps under the index that
  ``moe_a2a_get_metainfo_index_pairs`` names). Returns the views, the offset of the combine
  region and no EPLB stats.
- ``moe_a2a_sanitize_expert_ids``: the given id in every column of the positions no token
  came to in the last dispatch.
- ``moe_a2a_combine``: the payload is staged into the combine region; each token's rows at
  its positions on the ranks it went to are summed in fp32, returned in the payload's dtype
  (or written into ``output``).
- Dispatch and combine alternate on a workspace (the kernels' completion flags assume it):
  a second dispatch before the combine, or a combine without a dispatch, raises.

`install` makes it the backend's ``flashinfer.comm`` in the calling process.
"""

from __future__ import annotations

import dataclasses
import random
import sys
import weakref
from typing import Any, ClassVar

import torch
import torch.distributed as dist

TOP_K_VALUES = (1, 2, 4, 6, 8, 10, 12, 14, 16, 18, 22)
MAX_TOP_K = 22
MAX_RANKS = 64
MAX_PAYLOADS = 6
ALIGNMENT = 128
COMBINE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
METAINFO_FIELDS = 10
# Where the metainfo keeps the receive counters' offset, and that offset (in the region
# before the payloads, after room for the flags).
RECV_COUNTERS_INDEX = 3
RECV_COUNTERS_AT = 1024


def _pad(num_bytes: int) -> int:
    return -(-num_bytes // ALIGNMENT) * ALIGNMENT


def _aux_bytes(ep_size: int, max_num_tokens: int) -> int:
    """The region before the payloads: counters, flags, and per token its K send slots twice."""
    return _pad(1024 + 16 * ep_size) + 2 * _pad(max_num_tokens * MAX_TOP_K * 4)


def _check(condition: bool, message: str) -> None:
    """What TVM_FFI_ICHECK raises."""
    if not condition:
        raise RuntimeError(message)


class Mapping:
    def __init__(self, world_size=1, rank=0, gpus_per_node=8, tp_size=1, moe_ep_size=1, **_):
        self.world_size, self.rank, self.gpus_per_node = world_size, rank, gpus_per_node
        self.tp_size, self.tp_rank = tp_size, rank % tp_size
        self.pp_rank, self.cp_rank, self.cp_size = 0, 0, 1
        self.moe_ep_size, self.moe_ep_rank = moe_ep_size, rank % moe_ep_size


@dataclasses.dataclass
class MnnvlConfig:
    comm_backend: Any = None
    allocation_granularity: int = 0
    fabric_page_size: int = 1 << 29


class TorchDistBackend:
    """The ``CommBackend`` interface over torch.distributed's object collectives."""

    def __init__(self, group=None):
        assert dist.is_initialized()
        self._group = group

    def Get_rank(self) -> int:
        return dist.get_rank(self._group)

    def Get_size(self) -> int:
        return dist.get_world_size(self._group)

    def allgather(self, data):
        out = [None] * self.Get_size()
        dist.all_gather_object(out, data, group=self._group)
        return tuple(out)

    def bcast(self, data, root):
        out = [data]
        dist.broadcast_object_list(out, src=dist.get_global_rank(self._group, root),
                                   group=self._group)
        return out[0]

    def barrier(self) -> None:
        dist.barrier(group=self._group)

    def Split(self, color, key):
        raise AssertionError("the emulated TorchDistBackend builds no process group: the "
                             "communicator given to MnnvlMemory must split itself")


class CapsuleWrapper:
    """What FlashInfer's storage deleter reads: freed while a view of the workspace
    lives, the view's free reads freed memory. `made`: a weak reference to each."""

    made: ClassVar[list] = []

    @classmethod
    def all_alive(cls) -> bool:
        return all(ref() is not None for ref in cls.made)


class MnnvlMemory:
    comm = None
    live = 0

    def __init__(self, mapping: Mapping, size: int):
        comm = MnnvlMemory.comm
        assert comm is not None, "set_comm_from_config first"
        sizes = comm.allgather(size)
        assert all(s == size for s in sizes), f"Not all rank allocating same size: {sizes}"
        self.segment = torch.zeros(comm.Get_size(), size, dtype=torch.uint8)
        MnnvlMemory.live += 1

    def __del__(self):
        MnnvlMemory.live -= 1

    def as_torch_strided_tensor(self, dtype):
        # As FlashInfer's: a tensor of its own each call, holding the struct its storage's
        # deleter reads (there `flashinfer.comm.dlpack_utils.CapsuleWrapper`), which
        # its views do not hold.
        assert dtype == torch.uint8
        tensor = self.segment.view(self.segment.shape)
        tensor._capsule_wrapper = CapsuleWrapper()
        CapsuleWrapper.made.append(weakref.ref(tensor._capsule_wrapper))
        return tensor

    @staticmethod
    def initialize():
        pass

    @staticmethod
    def set_comm_from_config(mapping: Mapping, config: MnnvlConfig):
        MnnvlMemory.comm = config.comm_backend.Split(
            mapping.pp_rank * mapping.cp_size + mapping.cp_rank, mapping.tp_rank)

    @staticmethod
    def supports_mnnvl() -> bool:
        return True


@dataclasses.dataclass
class _Workspace:
    """What the kernels keep in one workspace between calls."""

    comm: TorchDistBackend
    rank: int
    ep_size: int
    max_num_tokens: int
    arrival: random.Random
    phase: str = "idle"
    sends: list | None = None
    recv_counts: list | None = None
    num_tokens: int = 0
    combine_offset: int = -1


_WORKSPACES: dict[int, _Workspace] = {}


def _state(workspace: torch.Tensor) -> _Workspace:
    _check(workspace.data_ptr() in _WORKSPACES, "workspace was not initialized")
    return _WORKSPACES[workspace.data_ptr()]


def _exchange(state: _Workspace, per_rank: list) -> list:
    """``per_rank[q]`` goes to rank ``q``; returns what each rank sent here, by source."""
    return [sent[state.rank] for sent in state.comm.allgather(per_rank)]


def _view(workspace, rank, start, num_bytes, dtype, leading) -> torch.Tensor:
    return workspace[rank, start:start + num_bytes].view(dtype).view(*leading, -1)


def moe_a2a_get_workspace_size_per_rank(ep_size, max_num_tokens,
                                        total_dispatch_payload_size_per_token,
                                        combine_payload_size_per_token,
                                        eplb_stats_num_experts=0, *, backend="trtllm"):
    assert eplb_stats_num_experts == 0 and backend == "trtllm"
    positions = ep_size * max_num_tokens
    return (_aux_bytes(ep_size, max_num_tokens)
            + _pad(positions * total_dispatch_payload_size_per_token)
            + _pad(positions * combine_payload_size_per_token))


def moe_a2a_initialize(workspace, ep_rank, ep_size, max_num_tokens, eplb_stats_num_experts=0,
                       *, backend="trtllm"):
    _check(workspace.dtype == torch.uint8 and workspace.dim() == 2, "workspace must be 2D uint8")
    _check(workspace.shape[0] == ep_size, "workspace first dim must equal ep_size")
    _check(0 <= ep_rank < ep_size, "epRank out of range")
    workspace[ep_rank].zero_()
    _WORKSPACES[workspace.data_ptr()] = _Workspace(MnnvlMemory.comm, ep_rank, ep_size,
                                                   max_num_tokens, random.Random(1234 + ep_rank))
    metainfo = torch.zeros(METAINFO_FIELDS, dtype=torch.int64)
    metainfo[RECV_COUNTERS_INDEX] = RECV_COUNTERS_AT
    metainfo[-1] = _aux_bytes(ep_size, max_num_tokens)
    return metainfo


def moe_a2a_get_metainfo_index_pairs():
    return (["MOE_A2A_RECV_COUNTERS_OFFSET_INDEX", "MOE_A2A_PAYLOAD_DATA_OFFSET_INDEX"],
            [RECV_COUNTERS_INDEX, METAINFO_FIELDS - 1])


def _check_dispatch(state, routing, payloads, workspace, metainfo, max_tokens, ep_rank, ep_size,
                    top_k, num_experts):
    _check(routing.dtype == torch.int32 and routing.dim() == 2 and routing.is_contiguous(),
           "token_selected_experts must be a contiguous 2D int32 tensor")
    _check(routing.shape[1] == top_k, "token_selected_experts shape mismatch")
    _check(0 < len(payloads) <= MAX_PAYLOADS, f"need 1 to {MAX_PAYLOADS} payloads")
    for i, payload in enumerate(payloads):
        _check(payload.dim() == 2 and payload.is_contiguous(), f"payload {i} must be 2D")
        _check(payload.shape[0] == routing.shape[0],
               f"payload {i} first dimension must match local_num_tokens")
    _check(workspace.dim() == 2 and workspace.shape[0] == ep_size, "workspace shape")
    _check(0 < ep_size <= MAX_RANKS and 0 <= ep_rank < ep_size, "ep_size / ep_rank")
    _check(max_tokens > 0 and num_experts >= ep_size, "max tokens / num_experts")
    _check(top_k in TOP_K_VALUES, f"Unsupported top_k {top_k}")
    _check((ep_size, max_tokens) == (state.ep_size, state.max_num_tokens),
           "the workspace was initialized for another ep_size / max_num_tokens")
    # Past M a block would overflow into the next one (the kernel does not check).
    _check(routing.shape[0] <= max_tokens, "more tokens than runtime_max_tokens_per_rank")
    # The kernel's rank of an expert (compute_target_rank_id): C division, toward zero.
    ranks = torch.div(routing, num_experts // ep_size, rounding_mode="trunc")
    _check(bool(((ranks >= 0) & (ranks < ep_size)).all()),
           "an expert id of token_selected_experts falls on no rank (the kernel would write "
           "out of bounds)")
    _check(num_experts % ep_size == 0, "the emulator partitions experts evenly only")
    total = 0
    for i, payload in enumerate(payloads):
        total += ep_size * max_tokens * payload.shape[1] * payload.element_size()
        _check(total % payload.element_size() == 0, f"Misaligned payload buffer {i}")
    needed = int(metainfo[-1]) + total
    _check(workspace.shape[1] >= needed, f"workspace size per rank insufficient, need {needed}")


def moe_a2a_dispatch(token_selected_experts, input_payloads, workspace, metainfo,
                     runtime_max_tokens_per_rank, ep_rank, ep_size, top_k, num_experts,
                     enable_pdl=None, eplb_local_stats=None, enable_rank_mask=False,
                     active_rank_mask=None, *, backend="trtllm", recv_view_cache=None):
    state = _state(workspace)
    max_tokens = runtime_max_tokens_per_rank
    _check_dispatch(state, token_selected_experts, input_payloads, workspace, metainfo,
                    max_tokens, ep_rank, ep_size, top_k, num_experts)
    assert eplb_local_stats is None and not enable_rank_mask
    _check(state.phase == "idle", "dispatch before the last dispatch's combine")
    num_local = num_experts // ep_size
    to_rank: list[list[int]] = [[] for _ in range(ep_size)]
    sends = []
    for t, ids in enumerate(token_selected_experts.tolist()):
        seen, slots = set(), []
        for expert in ids:
            target = int(expert / num_local)
            if target in seen:
                slots.append(None)
                continue
            seen.add(target)
            slots.append((target, len(to_rank[target])))
            to_rank[target].append(t)
        sends.append(slots)
    # The atomic counters: each target's tokens in some order.
    position_of = []
    for tokens in to_rank:
        order = list(range(len(tokens)))
        state.arrival.shuffle(order)
        position_of.append(order)
    sends = [[None if s is None else (s[0], position_of[s[0]][s[1]]) for s in slots]
             for slots in sends]
    outgoing = []
    for q, tokens in enumerate(to_rank):
        index = torch.tensor(tokens, dtype=torch.int64)
        outgoing.append((torch.tensor(position_of[q], dtype=torch.int64),
                         [p[index].clone() for p in input_payloads]))
    received = _exchange(state, outgoing)
    start = int(metainfo[-1])
    views = []
    for i, payload in enumerate(input_payloads):
        num_bytes = ep_size * max_tokens * payload.shape[1] * payload.element_size()
        view = _view(workspace, ep_rank, start, num_bytes, payload.dtype, (ep_size, max_tokens))
        # Positions no token comes to keep what earlier calls left: garbage.
        view.view(torch.uint8).copy_(torch.randint(0, 256, view.view(torch.uint8).shape,
                                                   dtype=torch.uint8))
        for p, (positions, rows) in enumerate(received):
            view[p, positions] = rows[i]
        views.append(view)
        start += num_bytes
    state.phase, state.sends = "dispatched", sends
    state.recv_counts = [positions.shape[0] for positions, _ in received]
    counters_at = int(metainfo[RECV_COUNTERS_INDEX])
    workspace[ep_rank, counters_at:counters_at + 4 * ep_size].view(torch.int32).copy_(
        torch.tensor(state.recv_counts, dtype=torch.int32))
    state.num_tokens, state.combine_offset = token_selected_experts.shape[0], _pad(start)
    return views, state.combine_offset, None


def moe_a2a_sanitize_expert_ids(expert_ids, workspace, metainfo, ep_rank, invalid_expert_id,
                                enable_pdl=None, *, backend="trtllm"):
    state = _state(workspace)
    _check(expert_ids.dtype == torch.int32 and expert_ids.dim() == 3
           and expert_ids.is_contiguous(), "expert_ids must be a contiguous 3D int32 tensor")
    _check(state.phase == "dispatched", "sanitize reads the last dispatch's counters")
    for p, count in enumerate(state.recv_counts):
        expert_ids[p, count:] = invalid_expert_id


def moe_a2a_combine(payload, local_num_tokens, workspace, metainfo, runtime_max_tokens_per_rank,
                    ep_rank, ep_size, top_k, combine_payload_offset, payload_in_workspace=False,
                    output_dtype=None, output_scales=None, output_scalar_scale=1.0,
                    sf_layout=None, output=None, *, use_low_precision=False, enable_pdl=None,
                    enable_rank_mask=False, active_rank_mask=None, backend="trtllm"):
    state = _state(workspace)
    max_tokens = runtime_max_tokens_per_rank
    _check(payload.dim() == 3 and payload.is_contiguous(),
           "payload must be [ep_size, runtime_max_tokens_per_rank, hidden]")
    _check(tuple(payload.shape[:2]) == (ep_size, max_tokens), "payload shape")
    _check(payload.dtype in COMBINE_DTYPES, "Unsupported dtype for MoE combine")
    _check(top_k in TOP_K_VALUES, f"Unsupported top_k {top_k}")
    assert output_dtype is None and output_scales is None
    if output is not None:
        _check(output.is_contiguous() and output.dtype == payload.dtype
               and tuple(output.shape) == (local_num_tokens, payload.shape[2]),
               "output must be a contiguous [local_num_tokens, hidden] tensor of payload's dtype")
    assert not use_low_precision and not enable_rank_mask
    _check(state.phase == "dispatched", "combine without a dispatch before it")
    _check(local_num_tokens == state.num_tokens, "local_num_tokens is not the dispatch's")
    _check(combine_payload_offset == state.combine_offset, "combine_payload_offset is not the "
           "one the dispatch returned")
    num_bytes = payload.numel() * payload.element_size()
    _check(combine_payload_offset + num_bytes <= workspace.shape[1],
           "workspace insufficient for combine payload region")
    region = _view(workspace, ep_rank, combine_payload_offset, num_bytes, payload.dtype,
                   (ep_size, max_tokens))
    if payload_in_workspace:
        _check(payload.data_ptr() == region.data_ptr(), "payload_in_workspace pointer mismatch")
    else:
        region.copy_(payload)
    # Rank q reads, for its tokens, block q of every rank's region.
    back = _exchange(state, [region[q].clone() for q in range(ep_size)])
    out = torch.zeros((local_num_tokens, payload.shape[2]), dtype=torch.float32)
    for t, slots in enumerate(state.sends):
        for slot in slots:
            if slot is not None:
                target, position = slot
                out[t] += back[target][position].float()
    state.phase = "idle"
    if output is None:
        return out.to(payload.dtype)
    return output.copy_(out)


def install():
    """In this process: ``flashinfer.comm`` is this emulator for the ``flashinfer`` a2a
    backend, which lets CPU tensors through and runs here (its `supports` says yes).
    Returns the backend's package."""
    from torch_moe_ops.backends.flashinfer import a2a
    from torch_moe_ops.backends.registry import REGISTRY

    a2a.comm_api.api = lambda: sys.modules[__name__]
    a2a.comm_api.DEVICE_TYPE = "cpu"
    REGISTRY.a2a["flashinfer"] = dataclasses.replace(REGISTRY.a2a["flashinfer"],
                                                     supports=lambda *_: None)
    return a2a
