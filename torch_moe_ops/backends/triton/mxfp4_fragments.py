"""MXFP4 weights in the layout the GEMM kernels' tensor cores read them in: each thread's
share of a wgmma left operand in 16 contiguous bytes, its nibbles placed so that the decode
is a shift and a mask per bf16 pair (`quant_tiles.MXFP4_FRAGMENT_PTX`). Prepared once per
(tensor, version) from the canonical packed weights and kept (`fragments`).

Legend: E experts, N rows and K columns of one weight matrix (``w13``: N = 2 * I, K = H;
``w2``: N = H, K = I), P = K / 2 packed bytes and G = K / 32 scale groups a row; NB = N / 64
row blocks and KB = K / 64 column blocks.

One block of 64 rows by 64 columns is 2048 bytes: 128 threads (a Hopper warpgroup, four
warps ``w`` of 32 lanes ``g * 4 + t``) times 16 bytes, four 32-bit words a thread, one per
16-column step ``s`` of the MMA. Word ``s`` of thread ``(w, g, t)`` holds the four bf16 pairs
its fragment takes at that step: pair ``(o, q)`` is canonical byte ``8 s + 4 o + t`` of row
``16 w + 8 q + g`` (a byte's low nibble is the even column, its high nibble the odd one), its
nibbles' sign, exponent and mantissa bits at `PAIR_BITS` (the low nibble; the high one 16
bits up). So

    words [E, NB, KB * 2048]  uint8, block (nb, kb) of 64 rows x 64 columns at kb * 2048
    scales [E, NB, KB * 128]  uint8, 4 bytes per (w, g): the groups s // 2 of rows q = 0, 1

and a scale byte is the e8m0 byte ``s`` plus 126, so that ``scale_byte << 7`` is the bf16 of
``2 ** (s - 1)``: the one product that turns a decoded pair (its value times 2 ** -126) into
the weights. It holds for ``s <= 128`` (scales up to 2, weights up to 12 in magnitude). 0
stays 0 (the group reads as 0, as the kernels' other decodes read it, where the oracle gives
2 ** -127) and 255 (OCP MX's NaN) stays 255 (the group reads as Inf or NaN). A layer with a
scale in 129..254, or with N or K not a multiple of 64, is not prepared (`fragments` gives
None) and runs the canonical tiles.

The copy takes as many bytes again as the packed weights and their scales, made on the
layer's first call that reads it (`layer_fragments`: both matrices of a layer or neither);
`clear_prepared_weights` drops it. It is made only from memory the GPU has to spare: a
layer whose copy would leave less than `RESERVE_FRACTION` of the GPU's memory free keeps
reading its packed weights, and a warning says so once. GPT-OSS-120B's experts are about
61 GB packed, so on an 80 GB GPU the first layers get copies and the rest do not, where
copying them all would run out of memory. ``TORCH_MOE_OPS_MXFP4_FRAGMENTS=0`` makes no
copy at all (`enabled`): the packed weights as stored, 0.52-0.58x the speed from 16
tokens on (H200, 2026-11-29). The layout is made a few experts at a time
(`CHUNK_BYTES`), so that making it needs little memory beyond the copy itself.
"""

from __future__ import annotations

import os
import warnings

import torch

from torch_moe_ops.backends.common.weight_cache import RESERVE_FRACTION, WeightCache, spare_bytes

# Rows and columns of one block, and its bytes: 128 threads x 16 bytes.
BLOCK_ROWS = 64
BLOCK_COLS = 64
BLOCK_BYTES = 2048
# Scale bytes of one block: 32 (warp, lane group) x 2 groups x 2 rows.
BLOCK_SCALES = 128
# Bit of the low nibble's (sign, exponent high, exponent low, mantissa) in the word, for the
# pair (o, q) at index 2 * o + q; the high nibble's are 16 bits up. Pairs 0-2 are the bits
# of 0x81C081C0 shifted right by 0, 3 and 6 (one mask a pair); pair 3 takes the other eight.
PAIR_BITS = ((15, 8, 7, 6), (12, 5, 4, 3), (9, 2, 1, 0), (11, 14, 13, 10))
# e8m0 bytes the one bf16 product decodes exactly: 2 ** (s - 1) is a bf16 up to s = 128.
LARGEST_SCALE_BYTE = 128
SCALE_BYTE_SHIFT = 126
NAN_SCALE_BYTE = 255


# Set to 0, the GEMM kernels read MXFP4 weights as stored and no fragments are made.
ENABLE_ENV = "TORCH_MOE_OPS_MXFP4_FRAGMENTS"
# Packed bytes made into fragments at a time, and what making them takes beside the copy:
# `prepare`'s int32 intermediates (measured on an H200, 2026-11-29: 0.56 GiB for three
# experts of GPT-OSS-120B's w13, 25 MB; the whole layer at once took 8.96 GiB).
CHUNK_BYTES = 32 << 20
WORKSPACE_BYTES = 24 * CHUNK_BYTES


def enabled() -> bool:
    """Whether the kernels read MXFP4 weights as fragments (`ENABLE_ENV` not 0)."""
    return os.environ.get(ENABLE_ENV, "1") != "0"


def preparable(num_rows: int, num_cols: int) -> bool:
    """Whether ``[E, num_rows, num_cols]`` weights have the layout's whole blocks."""
    return num_rows % BLOCK_ROWS == 0 and num_cols % BLOCK_COLS == 0


def prepare(q_ENP: torch.Tensor, scale_ENG: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(words, scales)`` of canonical MXFP4 weights ``q_ENP [E, N, K / 2]`` uint8 with
    their e8m0 ``scale_ENG [E, N, K / 32]``, as the module docstring lays them out, on their
    device; None where the layout cannot hold them (a scale byte in 129..254, or N or K not
    a multiple of 64). Reads the largest scale on the host: run once per weights."""
    num_experts, num_rows, num_packed = q_ENP.shape
    if not preparable(num_rows, 2 * num_packed):
        return None
    finite = scale_ENG[scale_ENG != NAN_SCALE_BYTE]
    if finite.numel() and int(finite.max()) > LARGEST_SCALE_BYTE:
        return None
    row_blocks, col_blocks = num_rows // BLOCK_ROWS, 2 * num_packed // BLOCK_COLS
    words = torch.empty((num_experts, row_blocks, col_blocks * BLOCK_BYTES), dtype=torch.uint8,
                        device=q_ENP.device)
    scales = torch.empty((num_experts, row_blocks, col_blocks * BLOCK_SCALES),
                         dtype=torch.uint8, device=q_ENP.device)
    step = max(1, CHUNK_BYTES // (num_rows * num_packed))
    for first in range(0, num_experts, step):
        chunk = slice(first, first + step)
        words[chunk], scales[chunk] = _laid_out(q_ENP[chunk], scale_ENG[chunk])
    return words, scales


def _laid_out(q_ENP: torch.Tensor, scale_ENG: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """`prepare`'s ``(words, scales)`` of weights the layout holds."""
    num_experts, num_rows, num_packed = q_ENP.shape
    row_blocks, col_blocks = num_rows // BLOCK_ROWS, 2 * num_packed // BLOCK_COLS
    # Rows 16 w + 8 q + g and bytes 8 s + 4 o + t of each block, to [.., w, g, t, s, o, q].
    q = q_ENP.view(num_experts, row_blocks, 4, 2, 8, col_blocks, 4, 2, 4).to(torch.int32)
    q = q.permute(0, 1, 5, 2, 4, 8, 6, 7, 3)
    word = torch.zeros(q.shape[:-2], dtype=torch.int32, device=q.device)
    for pair, bits in enumerate(PAIR_BITS):
        byte = q[..., pair // 2, pair % 2]
        for half, nibble in ((0, byte & 0xF), (16, byte >> 4)):
            for field, position in enumerate(bits):
                word |= ((nibble >> (3 - field)) & 1) << (position + half)
    words = word.view(torch.uint8).reshape(num_experts, row_blocks, col_blocks * BLOCK_BYTES)
    s = scale_ENG.to(torch.int32)
    s = torch.where((s == 0) | (s == NAN_SCALE_BYTE), s, s + SCALE_BYTE_SHIFT)
    # Rows 16 w + 8 q + g, groups 2 kb + sg, to [.., kb, w, g, sg, q].
    s = s.view(num_experts, row_blocks, 4, 2, 8, col_blocks, 2).permute(0, 1, 5, 2, 4, 6, 3)
    scales = s.to(torch.uint8).reshape(num_experts, row_blocks, col_blocks * BLOCK_SCALES)
    return words, scales


def _layer_copy(w13, w13_scale, w2, w2_scale):
    size = sum(t.numel() * t.element_size() for t in (w13, w13_scale, w2, w2_scale))
    spare = spare_bytes(w13.device)
    if spare is not None and size + WORKSPACE_BYTES > spare:
        warnings.warn(
            f"MXFP4 layers whose copy in the faster layout (mxfp4_fragments) would leave less "
            f"than {RESERVE_FRACTION:.2%} of the GPU's memory free read their packed weights "
            f"instead: slower, no copy. {ENABLE_ENV}=0 makes no copy of any layer.",
            stacklevel=2)
        return None
    pair = prepare(w13, w13_scale), prepare(w2, w2_scale)
    return None if None in pair else pair


# The one cache of this module: the fragments of the layers that ran here.
_FRAGMENTS = WeightCache()


def layer_fragments(w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                    w2_scale: torch.Tensor):
    """``((w13 words, scales), (w2 words, scales))`` of one layer, `prepare`'s layout, made
    on its first call and kept by (tensor, version); None where the layout cannot hold
    either matrix or the GPU has not the memory to spare (`spare_bytes`): the decision is
    kept with the layer, as the copy would be."""
    return _FRAGMENTS.get((w13, w13_scale, w2, w2_scale),
                          lambda: _layer_copy(w13, w13_scale, w2, w2_scale))


def clear_prepared_weights() -> None:
    """Drop every prepared copy (each is made again on its layer's next tiled call)."""
    _FRAGMENTS.clear()
