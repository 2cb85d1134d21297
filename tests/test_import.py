"""What ``import torch_moe_ops`` costs: no triton until a Triton kernel runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from torch_moe_ops.backends.common import TRITON_INSTALLED

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(not TRITON_INSTALLED, reason="triton is not installed: nothing to defer")
def test_import_does_not_import_triton():
    # A fresh interpreter: this one has imported triton through other tests.
    code = "import sys, torch_moe_ops; print('triton' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=300, check=True)
    assert result.stdout.strip() == "False"
