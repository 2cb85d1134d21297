"""benchmarks/bench_eager_block.py end to end on the CPU (``--smoke``): every part is timed
and the table comes last."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent


def test_smoke_times_both_blocks_and_the_parts(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_eager_block.py"), "--smoke",
         "--profile", str(tmp_path)],
        capture_output=True, text=True, timeout=600, check=False,
        # This checkout's torch_moe_ops, whatever the environment has installed.
        env={**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = [line.split(" | ") for line in result.stdout.splitlines()
            if line.startswith(("| qwen3", "| olmoe"))]
    calls = ["transformers block", "patched block", "  its router", "  run_experts",
             "  moe::experts", "  call(moe::experts)"]
    assert [(r[0], r[2]) for r in rows] == [(f"| {model}", call) for model in
                                            ("qwen3-30b-a3b", "olmoe") for call in calls]
    assert all(float(r[3]) > 0 and float(r[4].rstrip(" |")) >= float(r[3]) for r in rows)
    for model in ("qwen3-30b-a3b", "olmoe"):  # the patched block's profile, per model
        profile = (tmp_path / f"profile-{model}-8.txt").read_text()
        assert "Ordered by: internal time" in profile and "block.py:" in profile
        assert str(ROOT) not in profile
