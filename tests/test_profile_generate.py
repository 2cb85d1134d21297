"""benchmarks/profile_generate.py end to end on the CPU (``--smoke``): both ways are
profiled, prefill and decode, and the side-by-side table comes last."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent


def test_smoke_profiles_prefill_and_decode_of_both_ways(tmp_path):
    out = tmp_path / "profile.txt"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "profile_generate.py"), "--smoke",
         "--top", "5", "--out", str(out)],
        capture_output=True, text=True, timeout=600, check=False,
        # This checkout's torch_moe_ops, whatever the environment has installed.
        env={**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    text = out.read_text()
    for way in ("hf-grouped_mm", "tmo-patch"):
        assert f"## {way}: prefill" in text and f"## {way}: decode" in text
    assert "| per call | hf-grouped_mm | tmo-patch |" in text
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:]
            for line in text.splitlines() if line.startswith("| ")}
    for label in ("prefill wall ms", "decode step ms", "decode kernels"):
        assert all(float(cell.rstrip(" |")) > 0 for cell in rows[label]), rows[label]
    assert result.stdout.strip().endswith(text.strip().splitlines()[-1])
