"""benchmarks/bench_ep_train.py end to end on two CPU processes over gloo (``--smoke``):
our rows (flashinfer's listed as skipped: it needs GPUs), and torchtitan's compiled row
where torchtitan imports (in CI it does not: its absence is listed with the reason); a
row that fails on one rank fails on every rank, at once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distributed import run_on_ranks

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
# bf16 rounding of a compiled graph against the same layer eager, at the smoke widths.
EAGER_ERROR_BOUND = 2e-2


def torchtitan_reason() -> str | None:
    """Why torchtitan does not import here (run in a child, as the benchmark imports it)."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import peer_torchtitan; "
            "print(peer_torchtitan.missing_reason() or '')")
    result = subprocess.run([sys.executable, "-c", code, str(BENCHMARKS)], capture_output=True,
                            text=True, timeout=120, check=True)
    return result.stdout.strip() or None


def test_smoke_runs_ours_and_the_peer(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(BENCHMARKS / "bench_ep_train.py"), "--out", str(tmp_path), "--smoke"],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    with open(tmp_path / "ep_train.json") as f:
        data = json.load(f)
    rows = {row["way"]: row for row in data["rows"]}
    for way in ("tmo allgather", "tmo all_to_all"):
        assert rows[way]["ms"] > 0 and "error" not in rows[way], rows[way]
        assert rows[way]["rel_err_vs_eager"] < EAGER_ERROR_BOUND, rows[way]
    # FlashInfer's all-to-all runs on GPUs only: its layer row and its transport listed as
    # skipped, with the reason.
    assert "tmo flashinfer" not in rows and not data["flashinfer_transport"]
    assert "tmo flashinfer: needs a CUDA device, got cpu" in data["skipped"], data["skipped"]
    reason = torchtitan_reason()
    if reason is None:
        assert rows["torchtitan compiled"]["ms"] > 0, rows["torchtitan compiled"]
        assert rows["torchtitan eager"]["error"].startswith("not run: its eager all-to-all")
    else:
        assert not any(way.startswith("torchtitan") for way in rows)
        assert any(s.startswith("torchtitan: ") for s in data["skipped"]), data["skipped"]
    # The short table comes last: a header, one line per row, the legend of "vs titan".
    lines = result.stdout.strip().splitlines()
    assert lines[-1].startswith("vs titan:")
    assert lines[-2 - len(rows)].startswith("case ")
    assert (tmp_path / "ep_train.md").is_file() and (tmp_path / "summary.txt").is_file()


def _fail_on_rank_0_inside_a_collective(rank, world_size):
    sys.path.insert(0, str(BENCHMARKS))
    import bench_ep

    every_rank = bench_ep.EveryRank(rank, world_size)
    assert every_rank.run("a row that runs", lambda: rank) == rank
    started = time.monotonic()

    def peer_row():
        if rank == 0:
            raise RuntimeError("Eq(u0 + u1, 32768)")
        # Rank 1 waits for a collective that rank 0 never joins.
        torch.distributed.all_reduce(torch.ones(1))

    with pytest.raises(RuntimeError):
        every_rank.run("torchtitan compiled", peer_row)
    # Long before the group's timeout.
    assert time.monotonic() - started < 30
    assert every_rank.aborted == ("torchtitan compiled failed on rank 0 (RuntimeError: "
                                  "Eq(u0 + u1, 32768))")


def test_a_row_that_fails_on_one_rank_fails_on_all():
    run_on_ranks(2, _fail_on_rank_0_inside_a_collective)
