"""Group routed slots by expert and pad each group to whole GEMM blocks.

Legend: T tokens, K experts per token, S = T * K slots (slot ``s`` is token
``s // K``'s ``s % K``-th choice), E experts, M rows per GEMM block
(``block_m``), P padded capacity, B = P // M blocks.

    order = stable sort of the slots s with topk_ids[s] >= 0 by expert
    for e in experts: its slots fill [start_e, start_e + count_e), then
                      the sentinel S up to start_e + round_up(count_e, M)
    block_expert[b] = e if block b lies in e's range, -1 past the last range
    slot_row[s] = the row slot s fills, -1 for a slot with no row (on request)

P is a static bound (``padded_capacity``), so every size depends only on input
sizes and nothing waits on the host: the real number of padded rows stays on
the device (``num_padded_rows``) and the GEMM kernels skip blocks past it.

Three Triton launches: count each tile's slots per expert, scan those counts
(one program), then scatter each slot to its place and write the padding and
``block_expert``; one launch of the three steps in one program for an eager call of
few slots times experts (`ONE_PROGRAM_MAX_WORK`). No float math and no atomics, so the result is
exact and the same on every run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torch_moe_ops.backends.common.kernels.launch import (
    cdiv,
    in_traced_body,
    launcher,
    next_power_of_2,
    unread_slot,
)

# Slots per program of the count and scatter kernels. With EXPERT_CHUNK the
# one-hot tile [SLOT_TILE, EXPERT_CHUNK] stays at 8K elements whatever E is.
SLOT_TILE = 256
EXPERT_CHUNK = 32
# The scan program walks the [tiles, E] count table in [TILE_CHUNK, SCAN_EXPERT_CHUNK] pieces.
TILE_CHUNK = 64
SCAN_EXPERT_CHUNK = 64
# An eager call (one not traced into a compiled graph) of up to this many slots times
# experts runs the three steps in one program: each eager launch costs 30-50 us on the host
# (H200 hosts, 2026-11-26), and up to here the one program's GPU time is no more than the
# three launches' (2.5 against 11.4 us at 8 slots and 128 experts, 9.9 against 11.8 at 128;
# at 512 slots and 256 experts 55.9 against 21.8: its work grows as slots times experts on
# one SM; H200, 2026-11-29). Compiled graphs launch from Inductor's code and keep the three
# kernels.
ONE_PROGRAM_MAX_WORK = 256 * 256
# The one program's tiles hold at most this many elements; its tiles are sized to the call
# (a token's 8 slots are not a 256-slot tile), so few slots take few steps.
ONE_PROGRAM_TILE_ELEMENTS = 8192


def padded_capacity(num_slots: int, num_experts: int, block_m: int) -> int:
    """Worst-case padded rows: each expert that gets a slot adds at most
    ``block_m - 1`` rows of padding, and at most ``min(E, S)`` experts get one."""
    worst = num_slots + min(num_experts, num_slots) * (block_m - 1)
    return cdiv(worst, block_m) * block_m


@triton.jit
def _count_tile(ids_ptr, tile_counts_ptr, tile, num_slots, num_experts,
                SLOT_TILE: tl.constexpr, EXPERT_CHUNK: tl.constexpr):
    """Tile ``tile``'s slots per expert into row ``tile`` of the ``[tiles, E]`` table."""
    slots = tile * SLOT_TILE + tl.arange(0, SLOT_TILE)
    ids = tl.load(ids_ptr + slots, mask=slots < num_slots, other=-1).to(tl.int32)
    for first in range(0, num_experts, EXPERT_CHUNK):
        experts = first + tl.arange(0, EXPERT_CHUNK)
        hits = (ids[:, None] == experts[None, :]).to(tl.int32)
        tl.store(tile_counts_ptr + tile * num_experts + experts, tl.sum(hits, axis=0),
                 mask=experts < num_experts)


@triton.jit
def _scan(tile_counts_ptr, tile_offsets_ptr, expert_count_ptr, expert_start_ptr,
          num_padded_ptr, num_tiles, num_experts, BLOCK_M: tl.constexpr,
          TILE_CHUNK: tl.constexpr, EXPERT_CHUNK: tl.constexpr):
    """Each tile's offset among each expert's slots, each expert's count and padded start,
    and the padded rows in use, from the count table."""
    total = 0
    for first in range(0, num_experts, EXPERT_CHUNK):
        experts = first + tl.arange(0, EXPERT_CHUNK)
        expert_ok = experts < num_experts
        seen = tl.zeros((EXPERT_CHUNK,), dtype=tl.int32)
        for first_tile in range(0, num_tiles, TILE_CHUNK):
            tiles = first_tile + tl.arange(0, TILE_CHUNK)
            where = tiles[:, None] * num_experts + experts[None, :]
            ok = (tiles[:, None] < num_tiles) & expert_ok[None, :]
            counts = tl.load(tile_counts_ptr + where, mask=ok, other=0)
            # Exclusive prefix over tiles: a slot's place among its expert's slots
            # is this plus its rank inside its own tile, which keeps the sort stable.
            tl.store(tile_offsets_ptr + where, tl.cumsum(counts, axis=0) - counts + seen[None, :],
                     mask=ok)
            seen += tl.sum(counts, axis=0)
        padded = (seen + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        end = total + tl.cumsum(padded, axis=0)
        tl.store(expert_count_ptr + experts, seen, mask=expert_ok)
        tl.store(expert_start_ptr + experts, end - padded, mask=expert_ok)
        total += tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, total)


@triton.jit
def _place_tile(ids_ptr, tile_offsets_ptr, expert_start_ptr, sorted_row_ids_ptr, slot_row_ptr,
                tile, num_slots, num_experts, SLOT_TILE: tl.constexpr,
                EXPERT_CHUNK: tl.constexpr, SLOT_ROWS: tl.constexpr):
    """Tile ``tile``'s routed slots to their rows (and, given ``SLOT_ROWS``, each slot's row,
    -1 where it has none, to ``slot_row``)."""
    slots = tile * SLOT_TILE + tl.arange(0, SLOT_TILE)
    ids = tl.load(ids_ptr + slots, mask=slots < num_slots, other=-1).to(tl.int32)
    routed = (ids >= 0) & (ids < num_experts)
    rank = tl.zeros((SLOT_TILE,), dtype=tl.int32)
    for first in range(0, num_experts, EXPERT_CHUNK):
        experts = first + tl.arange(0, EXPERT_CHUNK)
        hits = (ids[:, None] == experts[None, :]).to(tl.int32)
        rank += tl.sum((tl.cumsum(hits, axis=0) - hits) * hits, axis=1)
    earlier = tl.load(tile_offsets_ptr + tile * num_experts + ids, mask=routed, other=0)
    start = tl.load(expert_start_ptr + ids, mask=routed, other=0)
    tl.store(sorted_row_ids_ptr + start + earlier + rank, slots, mask=routed)
    if SLOT_ROWS:
        tl.store(slot_row_ptr + slots, tl.where(routed, start + earlier + rank, -1),
                 mask=slots < num_slots)


@triton.jit
def _write_blocks(expert_count_ptr, expert_start_ptr, num_padded_ptr, sorted_row_ids_ptr,
                  block_expert_ptr, first_block, num_blocks, num_slots, num_experts,
                  BLOCK_M: tl.constexpr, BLOCKS: tl.constexpr, EXPERT_CHUNK: tl.constexpr):
    """Blocks ``[first_block, first_block + BLOCKS)``' experts (-1 past the rows in use)
    and the sentinel in their padding."""
    blocks = first_block + tl.arange(0, BLOCKS)
    block_ok = blocks < num_blocks
    block_start = blocks * BLOCK_M
    # A block's expert is the number of experts whose padded range ends at
    # or before the block's first row.
    expert = tl.zeros((BLOCKS,), dtype=tl.int32)
    for first in range(0, num_experts, EXPERT_CHUNK):
        experts = first + tl.arange(0, EXPERT_CHUNK)
        expert_ok = experts < num_experts
        count = tl.load(expert_count_ptr + experts, mask=expert_ok, other=0)
        end = (tl.load(expert_start_ptr + experts, mask=expert_ok, other=0)
               + (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M)
        expert += tl.sum(((end[None, :] <= block_start[:, None]) & expert_ok[None, :])
                         .to(tl.int32), axis=1)
    num_padded = tl.load(num_padded_ptr)
    in_use = block_start < num_padded
    safe_expert = tl.where(in_use, expert, 0)
    rows = block_start[:, None] + tl.arange(0, BLOCK_M)[None, :]
    padding = ((rows >= num_padded)
               | (rows - tl.load(expert_start_ptr + safe_expert)[:, None]
                  >= tl.load(expert_count_ptr + safe_expert)[:, None]))
    tl.store(sorted_row_ids_ptr + rows, tl.zeros((BLOCKS, BLOCK_M), dtype=tl.int32) + num_slots,
             mask=padding & block_ok[:, None])
    tl.store(block_expert_ptr + blocks, tl.where(in_use, expert, -1), mask=block_ok)


@triton.jit
def moe_align_count_kernel(ids_ptr, tile_counts_ptr, num_slots, num_experts,
                           SLOT_TILE: tl.constexpr, EXPERT_CHUNK: tl.constexpr):
    _count_tile(ids_ptr, tile_counts_ptr, tl.program_id(0), num_slots, num_experts, SLOT_TILE,
                EXPERT_CHUNK)


@triton.jit
def moe_align_scan_kernel(tile_counts_ptr, tile_offsets_ptr, expert_count_ptr,
                          expert_start_ptr, num_padded_ptr, num_tiles, num_experts,
                          BLOCK_M: tl.constexpr, TILE_CHUNK: tl.constexpr,
                          EXPERT_CHUNK: tl.constexpr):
    _scan(tile_counts_ptr, tile_offsets_ptr, expert_count_ptr, expert_start_ptr, num_padded_ptr,
          num_tiles, num_experts, BLOCK_M, TILE_CHUNK, EXPERT_CHUNK)


@triton.jit
def moe_align_scatter_kernel(ids_ptr, tile_offsets_ptr, expert_count_ptr, expert_start_ptr,
                             num_padded_ptr, sorted_row_ids_ptr, block_expert_ptr, slot_row_ptr,
                             num_slots, num_tiles, num_blocks, num_experts,
                             BLOCK_M: tl.constexpr, SLOT_TILE: tl.constexpr,
                             EXPERT_CHUNK: tl.constexpr, SLOT_ROWS: tl.constexpr):
    pid = tl.program_id(0)
    # Programs [0, num_tiles) place slots and programs [0, num_blocks) write one
    # block's padding and expert; the two sets of rows written never overlap.
    if pid < num_tiles:
        _place_tile(ids_ptr, tile_offsets_ptr, expert_start_ptr, sorted_row_ids_ptr,
                    slot_row_ptr, pid, num_slots, num_experts, SLOT_TILE, EXPERT_CHUNK,
                    SLOT_ROWS)
    if pid < num_blocks:
        _write_blocks(expert_count_ptr, expert_start_ptr, num_padded_ptr, sorted_row_ids_ptr,
                      block_expert_ptr, pid, num_blocks, num_slots, num_experts, BLOCK_M, 1,
                      EXPERT_CHUNK)


@triton.jit
def moe_align_one_program_kernel(ids_ptr, tile_counts_ptr, tile_offsets_ptr, expert_count_ptr,
                                  expert_start_ptr, num_padded_ptr, sorted_row_ids_ptr,
                                  block_expert_ptr, slot_row_ptr, num_slots, num_tiles,
                                  num_blocks, num_experts, BLOCK_M: tl.constexpr,
                                  SLOT_TILE: tl.constexpr, EXPERT_CHUNK: tl.constexpr,
                                  TILE_CHUNK: tl.constexpr, SCAN_EXPERT_CHUNK: tl.constexpr,
                                  BLOCKS: tl.constexpr, BLOCK_EXPERT_CHUNK: tl.constexpr,
                                  SLOT_ROWS: tl.constexpr):
    # The three kernels' work in one program; a barrier between the steps makes
    # each step's stores visible to the program's other threads.
    for tile in range(num_tiles):
        _count_tile(ids_ptr, tile_counts_ptr, tile, num_slots, num_experts, SLOT_TILE,
                    EXPERT_CHUNK)
    tl.debug_barrier()
    _scan(tile_counts_ptr, tile_offsets_ptr, expert_count_ptr, expert_start_ptr, num_padded_ptr,
          num_tiles, num_experts, BLOCK_M, TILE_CHUNK, SCAN_EXPERT_CHUNK)
    tl.debug_barrier()
    for tile in range(num_tiles):
        _place_tile(ids_ptr, tile_offsets_ptr, expert_start_ptr, sorted_row_ids_ptr,
                    slot_row_ptr, tile, num_slots, num_experts, SLOT_TILE, EXPERT_CHUNK,
                    SLOT_ROWS)
    # Many blocks a step: one at a time, the step's chain of loads made this loop
    # most of the call (46.6 of 230 us at 16 tokens of Qwen3-30B-A3B, H200, 2026-11-29).
    for first_block in range(0, num_blocks, BLOCKS):
        _write_blocks(expert_count_ptr, expert_start_ptr, num_padded_ptr, sorted_row_ids_ptr,
                      block_expert_ptr, first_block, num_blocks, num_slots, num_experts,
                      BLOCK_M, BLOCKS, BLOCK_EXPERT_CHUNK)


def _int32_views(sizes: tuple[int, ...], device: torch.device) -> list[torch.Tensor]:
    """Uninitialised int32 tensors of ``sizes``, views of one allocation, each starting a
    multiple of 16 bytes into it (Triton specializes a pointer on that alignment)."""
    starts, end = [], 0
    for size in sizes:
        starts.append(end)
        end += cdiv(size, 4) * 4
    workspace = torch.empty((end,), dtype=torch.int32, device=device)
    return [workspace[start:start + size] for start, size in zip(starts, sizes)]


def _one_program_tiles(num_slots: int, num_experts: int, num_blocks: int,
                       block_m: int) -> dict[str, int]:
    """The one program's tile sizes for this call: as few steps as tiles of
    `ONE_PROGRAM_TILE_ELEMENTS` allow, none wider than what it covers."""
    experts = next_power_of_2(num_experts)
    slot_tile = min(SLOT_TILE, max(16, next_power_of_2(num_slots)))
    tile_chunk = min(TILE_CHUNK, max(1, next_power_of_2(cdiv(num_slots, slot_tile))))
    blocks = min(ONE_PROGRAM_TILE_ELEMENTS // block_m, max(1, next_power_of_2(num_blocks)))
    return {"SLOT_TILE": slot_tile,
            "EXPERT_CHUNK": min(experts, ONE_PROGRAM_TILE_ELEMENTS // slot_tile),
            "TILE_CHUNK": tile_chunk,
            "SCAN_EXPERT_CHUNK": min(experts, ONE_PROGRAM_TILE_ELEMENTS // tile_chunk),
            "BLOCKS": blocks,
            "BLOCK_EXPERT_CHUNK": min(experts, ONE_PROGRAM_TILE_ELEMENTS // blocks)}


def align_rows(topk_ids_TK: torch.Tensor, num_experts: int, block_m: int,
               slot_rows: bool = False):
    """Sort the ``S = T * K`` routed slots by expert into blocks of ``block_m`` rows.

    Args:
        topk_ids_TK: ``[T, K]`` int32 or int64, expert of each slot; -1 skips it
            (so does any id outside ``[0, num_experts)``: it gets no row).
        num_experts: E.
        block_m: rows per GEMM block, a power of two >= 16.

    Returns:
        ``sorted_row_ids_P`` int32 ``[P]``, ``P = padded_capacity(S, E, block_m)``:
        slot indices grouped by expert (ascending), in slot order inside a
        group, each group padded with the sentinel ``S`` to a multiple of
        ``block_m``; every row from ``num_padded_rows`` on holds ``S`` too.
        ``block_expert_B`` int32 ``[P // block_m]``: each block's expert, -1 for
        blocks from ``num_padded_rows`` on.
        ``num_padded_rows_1`` int32 ``[1]``: rows in use, a multiple of ``block_m``.
        Given ``slot_rows``, also ``slot_row_S`` int32 ``[S]``: the row each slot fills
        (the inverse of ``sorted_row_ids_P``), -1 for a slot that gets none.
    """
    if topk_ids_TK.dim() != 2 or topk_ids_TK.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be a 2-D int32 or int64 tensor, got shape "
                         f"{tuple(topk_ids_TK.shape)} and dtype {topk_ids_TK.dtype}")
    if num_experts <= 0:
        raise ValueError(f"num_experts must be > 0, got {num_experts}")
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    num_slots = topk_ids_TK.numel()
    if num_slots >= 2**31 - 1:
        raise ValueError(f"topk_ids must have fewer than 2**31 - 1 slots (int32 row ids), "
                         f"got {num_slots}")
    device = topk_ids_TK.device
    capacity = padded_capacity(num_slots, num_experts, block_m)
    num_blocks = capacity // block_m
    traced = in_traced_body()
    one_program = not traced and num_slots * num_experts <= ONE_PROGRAM_MAX_WORK
    tiles = _one_program_tiles(num_slots, num_experts, num_blocks, block_m) if one_program \
        else {"SLOT_TILE": SLOT_TILE}
    num_tiles = cdiv(num_slots, tiles["SLOT_TILE"])
    table = num_tiles * num_experts
    # The outputs, per-tile counts and offsets [tiles, E], per-expert counts and padded
    # starts [E].
    sizes = (capacity, num_blocks, 1, table, table, num_experts, num_experts) + (
        (num_slots,) if slot_rows else ())
    if traced:
        # Separate tensors, not views of one workspace. Traced into a training graph,
        # Inductor (torch 2.11) copied views of one workspace that the kernels mutate
        # with the whole workspace's length from a [E] buffer: a read out of bounds,
        # an illegal memory access on the H100 when that buffer ended an allocation.
        buffers = [torch.empty((size,), dtype=torch.int32, device=device) for size in sizes]
    else:
        # Eagerly, one allocation (each costs a few us of host time).
        buffers = _int32_views(sizes, device)
    (sorted_row_ids_P, block_expert_B, num_padded_rows_1, tile_counts, tile_offsets,
     expert_count, expert_start) = buffers[:7]
    outputs = (sorted_row_ids_P, block_expert_B, num_padded_rows_1, *buffers[7:])
    slot_row_out = buffers[7] if slot_rows else unread_slot(sorted_row_ids_P, torch.int32)
    ids_S = topk_ids_TK.reshape(-1)
    if one_program:
        launcher(moe_align_one_program_kernel)[(1,)](
            ids_S, tile_counts, tile_offsets, expert_count, expert_start, num_padded_rows_1,
            sorted_row_ids_P, block_expert_B, slot_row_out, num_slots, num_tiles, num_blocks,
            num_experts, BLOCK_M=block_m, SLOT_ROWS=slot_rows, **tiles)
        return outputs
    if num_tiles:
        launcher(moe_align_count_kernel)[(num_tiles,)](ids_S, tile_counts, num_slots, num_experts,
                                             SLOT_TILE=SLOT_TILE, EXPERT_CHUNK=EXPERT_CHUNK)
    launcher(moe_align_scan_kernel)[(1,)](tile_counts, tile_offsets, expert_count, expert_start,
                                num_padded_rows_1, num_tiles, num_experts, BLOCK_M=block_m,
                                TILE_CHUNK=TILE_CHUNK, EXPERT_CHUNK=SCAN_EXPERT_CHUNK)
    if max(num_tiles, num_blocks):
        launcher(moe_align_scatter_kernel)[(max(num_tiles, num_blocks),)](
            ids_S, tile_offsets, expert_count, expert_start, num_padded_rows_1,
            sorted_row_ids_P, block_expert_B, slot_row_out, num_slots, num_tiles, num_blocks,
            num_experts, BLOCK_M=block_m, SLOT_TILE=SLOT_TILE, EXPERT_CHUNK=EXPERT_CHUNK,
            SLOT_ROWS=slot_rows)
    return outputs
