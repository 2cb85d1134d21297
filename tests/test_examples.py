"""Every example runs: each is also a smoke test of the public API."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.slow
def test_quickstart_runs():
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "quickstart.py"), "--device", "cpu", "--tokens", "16",
         "--layers", "1", "--repeats", "1"],
        capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr
    assert "largest |eager - compiled|" in result.stdout
    assert "reference" in result.stdout


@pytest.mark.slow
def test_hf_generate_runs():
    pytest.importorskip("transformers")
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "hf_generate.py"), "--family", "qwen2_moe"],
        capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr
    assert "new tokens equal to the original's, patched eager: 100%" in result.stdout


def test_hf_generate_rejects_a_missing_checkpoint(tmp_path):
    pytest.importorskip("transformers")
    missing = tmp_path / "Qwen3-30B-A3B"
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "hf_generate.py"), "--model", str(missing)],
        capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        "hf_generate.py: error: --model must be a local directory with a transformers "
        f"checkpoint (config.json and *.safetensors or *.bin weights), got {str(missing)!r}: "
        "no such directory")


@pytest.mark.parametrize("a2a, extra", [("all_to_all", []), ("allgather", ["--idle-last-rank"])])
def test_ep_torchrun_runs(a2a, extra):
    """Two gloo processes on the CPU (the example picks NCCL only with CUDA: forced to CPU)."""
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--standalone", str(EXAMPLES / "ep_torchrun.py"), "--device", "cpu",
         "--a2a", a2a, "--tokens", "16", "--repeats", "2", "--timeout-s", "30", *extra],
        capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "matches the single-process reference on every rank" in result.stdout
    assert f"compiled a2a {a2a}" in result.stdout
    assert "ms per forward step" in result.stdout
