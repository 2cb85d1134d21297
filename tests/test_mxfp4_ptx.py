"""The MXFP4 decodes written in PTX (`quant_tiles`), run on the CPU by a small
interpreter of the instructions they use, against the format's own table
(`quant.E2M1_VALUES`): every byte value in every byte of the packed register (and, for the
fragments' decode, in every pair of a word). On
the GPU the kernels' tests cover them too; here a wrong table entry, selector or shift
fails without one."""

from __future__ import annotations

import struct

import pytest
import torch

from torch_moe_ops import quant
from torch_moe_ops.backends.common import TRITON_INSTALLED
from torch_moe_ops.config import QuantSpec

pytestmark = pytest.mark.skipif(not TRITON_INSTALLED, reason="needs Triton")

MASK = 0xFFFFFFFF


def _prmt(a: int, b: int, selectors: int) -> int:
    """prmt.b32 (default mode): byte k of the result is byte ``c[4k+2:4k]`` of {b, a},
    or that byte's sign bit replicated where ``c``'s bit 4k+3 is set."""
    source = (b << 32) | a
    out = 0
    for k in range(4):
        selector = (selectors >> (4 * k)) & 0xF
        byte = (source >> (8 * (selector & 7))) & 0xFF
        if selector & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * k)
    return out


def _bf16x2_fma(a: int, b: int, c: int) -> int:
    """fma.rn.bf16x2, half-word by half-word, for the decodes' products: exact in bf16
    (which this checks), so no rounding to emulate."""
    out = 0
    for shift in (0, 16):
        x, y, z = (_fp32(((v >> shift) & 0xFFFF) << 16) for v in (a, b, c))
        bits = struct.unpack("<I", struct.pack("<f", x * y + z))[0]
        assert bits & 0xFFFF == 0, "a product bf16 does not hold"
        out |= (bits >> 16) << shift
    return out


OPS = {"mov.b32": lambda a: a, "and.b32": lambda a, b: a & b, "or.b32": lambda a, b: a | b,
       "shl.b32": lambda a, b: (a << b) & MASK, "shr.b32": lambda a, b: a >> b,
       "prmt.b32": _prmt, "fma.rn.bf16x2": _bf16x2_fma,
       # a * b + (-0): the product, exactly as mul.rn.bf16x2 gives it.
       "mul.rn.bf16x2": lambda a, b: _bf16x2_fma(a, b, 0x80008000)}


def run_ptx(ptx: str, inputs: dict[str, int], outputs: int) -> list[int]:
    """The values of ``$0 .. $(outputs - 1)`` after ``ptx``, with ``inputs`` (``"$4"``: value)."""
    registers = dict(inputs)
    body = ptx.strip().removeprefix("{").removesuffix("}")
    for statement in filter(None, (s.strip() for s in body.split(";"))):
        opcode, _, operands = statement.partition(" ")
        if opcode == ".reg":
            continue
        target, *sources = (o.strip() for o in operands.split(","))
        values = [registers[o] if o in registers else int(o, 0) for o in sources]
        registers[target] = OPS[opcode](*values)
    return [registers[f"${i}"] for i in range(outputs)]


def _fp32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _bf16_pair(bits: int) -> tuple[float, float]:
    return _fp32((bits & 0xFFFF) << 16), _fp32(bits & 0xFFFF0000)


def e2m1(nibble: int) -> float:
    return (-1.0 if nibble & 8 else 1.0) * quant.E2M1_VALUES[nibble & 7]


def packed_registers():
    """Four bytes a register, every byte value in every place."""
    return [[(v + 67 * place) % 256 for place in range(4)] for v in range(256)]


def test_e2m1_fp32_decode():
    from torch_moe_ops.backends.triton.quant_tiles import E2M1_FP32_PTX

    for packed in packed_registers():
        register = int.from_bytes(bytes(packed), "little")
        out = [_fp32(bits) for bits in run_ptx(E2M1_FP32_PTX.value, {"$8": register}, 8)]
        assert out[:4] == [e2m1(b & 0xF) for b in packed], packed
        assert out[4:] == [e2m1(b >> 4) for b in packed], packed


@pytest.mark.parametrize("scale_byte", [1, 100, 127, 130, 200])
def test_mxfp4_bf16_pairs_decode(scale_byte):
    from torch_moe_ops.backends.triton.quant_tiles import MXFP4_BF16_PAIRS_PTX

    scale = 2.0 ** (scale_byte - 127)
    for packed in packed_registers():
        register = int.from_bytes(bytes(packed), "little")
        out = run_ptx(MXFP4_BF16_PAIRS_PTX.value,
                      {"$4": register, "$5": int.from_bytes(bytes([scale_byte] * 4), "little")},
                      4)
        even = [*_bf16_pair(out[0]), *_bf16_pair(out[1])]
        odd = [*_bf16_pair(out[2]), *_bf16_pair(out[3])]
        assert even == [e2m1(b & 0xF) * scale for b in packed], packed
        assert odd == [e2m1(b >> 4) * scale for b in packed], packed


def test_mxfp4_fragment_decode():
    """Each word of one 64 x 64 block of fragments (`mxfp4_fragments.prepare`) through
    `MXFP4_FRAGMENT_PTX` gives its thread's pairs of the canonical weights, scaled: the
    layout's rows, columns and bits, and the factor of each group's scale byte."""
    from torch_moe_ops.backends.triton import mxfp4_fragments
    from torch_moe_ops.backends.triton.quant_tiles import MXFP4_FRAGMENT_PTX

    rows, packed_cols = torch.arange(64)[:, None], torch.arange(32)[None, :]
    q_1NP = ((rows + packed_cols * 8) % 256).to(torch.uint8)[None]
    # Row by row and group by group: a scale of 2 ** -126, 2 ** -63, 1 and 2 (the largest
    # the layout holds).
    scale_1NG = torch.tensor([1, 64, 127, 128], dtype=torch.uint8)[
        (rows * 3 + torch.arange(2)[None, :]) % 4][None]
    words, scales = mxfp4_fragments.prepare(q_1NP, scale_1NG)
    expected = quant.dequantize_weights(q_1NP, scale_1NG, QuantSpec("mxfp4"))[0]
    thread_words = words.view(128, 4, 4).tolist()
    thread_scales = scales.view(32, 2, 2).tolist()
    seen = set()
    for thread in range(128):
        warp, lane_group, lane = thread // 32, thread // 4 % 8, thread % 4
        for step in range(4):
            row_scales = thread_scales[thread // 4][step // 2]
            out = run_ptx(MXFP4_FRAGMENT_PTX.value,
                          {"$4": int.from_bytes(bytes(thread_words[thread][step]), "little"),
                           "$5": int.from_bytes(bytes(row_scales * 2), "little")}, 4)
            for pair, bits in enumerate(out):
                row = 16 * warp + 8 * (pair % 2) + lane_group
                col = 16 * step + 8 * (pair // 2) + 2 * lane
                assert _bf16_pair(bits) == tuple(expected[row, col:col + 2].tolist()), (
                    thread, step, pair)
                seen.add((pair, int(q_1NP[0, row, col // 2])))
    assert len(seen) == 4 * 256  # every byte value in every pair of a word
