"""benchmarks/kernel_sass.py on a machine without a GPU: Triton compiles the experts'
kernels for sm90 with its bundled ptxas, and the loop the tool counts is the K loop."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import BENCHMARKS
from torch_moe_ops.backends.common import TRITON_INSTALLED

pytestmark = [pytest.mark.usefixtures("benchmarks_importable"),
              pytest.mark.skipif(not TRITON_INSTALLED, reason="needs Triton")]


def test_counts_the_mxfp4_decode_loop():
    """The direct MXFP4 gate-up kernel at GPT-OSS-20B's widths, compiled for sm90 from the
    arguments the backend's call passes (64-column tiles: the tensor-core route, on
    fragments): its K loop holds the PTX decode, one bf16x2 product for each register of two
    weights, and its shifts and masks, so more than 2.5 instructions per weight. Compiled in
    a process of its own: under the interpreter (as the tests run on the CPU) Triton
    compiles nothing for a GPU."""
    import kernel_sass

    if not os.path.exists(os.path.join(kernel_sass.TOOLS, "nvdisasm")):
        pytest.skip("this Triton has no CUDA tools (ptxas, nvdisasm)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(BENCHMARKS / "kernel_sass.py"), "--tiles",
                          "64x128x4"], env=env, check=True, capture_output=True, text=True,
                         timeout=600).stdout
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| moe_direct")]
    assert [row[1].strip() for row in rows] == ["moe_direct_gate_up_kernel",
                                                "moe_direct_down_kernel"]
    _, _, tile, length, per_weight, _spills, common, _ = rows[0]
    weights_per_lane = 2 * 64 * 128 / (4 * 32)
    assert tile.strip() == "64x128x4"
    assert float(per_weight) == pytest.approx(int(length) / weights_per_lane, abs=0.05)
    assert float(per_weight) > 2.5
    opcodes = dict(item.split() for item in common.split(", "))
    assert int(opcodes["HMUL2"]) == weights_per_lane / 2


def test_main_loop_is_the_longest_backward_branch():
    import kernel_sass

    text = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
  .L_x_0:
        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0020*/              @P0  BRA `(.L_x_0) ;
  .L_x_1:
        /*0030*/                   HMUL2 R4, R4, R5 ;
        /*0040*/                   LDG.E R6, desc[UR4][R2.64] ;
        /*0050*/                   HMUL2 R4, R4, R5 ;
        /*0060*/              @!P1 BRA `(.L_x_1) ;
        /*0070*/                   EXIT ;
"""
    assert kernel_sass.main_loop(text) == {"HMUL2": 2, "LDG": 1, "BRA": 1}
