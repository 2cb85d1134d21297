"""benchmarks/bench_ep.py end to end on two CPU processes over gloo (``--smoke``): the layer
phase times the layer (with a shared expert) moved whole and, beside it, in the chunks
``--chunks`` asks for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# bf16 rounding of a compiled graph against the same layer eager, at the smoke widths.
EAGER_ERROR_BOUND = 2e-2


def test_smoke_times_the_layer_whole_and_in_chunks(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(REPO / "benchmarks" / "bench_ep.py"), "--out", str(tmp_path), "--smoke",
         "--a2a", "all_to_all", "--chunks", "2", "--shared", "16", "--budget-s", "400"],
        capture_output=True, text=True, timeout=480, check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1",
             "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO),
                                                         os.environ.get("PYTHONPATH"))))})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    with open(tmp_path / "ep.json") as f:
        layers = json.load(f)["layer"]
    # Chunks at the prefill size only (the largest of the run's token counts).
    assert sorted((row["tokens"], row["chunks"]) for row in layers) == [
        (4, 1), (16, 1), (16, 2)], layers
    for row in layers:
        assert row["layer_us"] > 0 and "errors" not in row, row
        assert row["rel_err_vs_eager"] < EAGER_ERROR_BOUND, row
        assert row["vs_local_plus_raw"] > 0 and row["shared"] == 16, row
    assert "x2 (smoke: aot_eager)" in (tmp_path / "summary.txt").read_text()
