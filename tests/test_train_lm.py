"""benchmarks/train_lm.py on the CPU (``--smoke``): every way trains from the same init on
the same batches, the curves and the results are written, transformers and the patched
model give the same losses, and the bias update balances the experts' load."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
# fp32 on the CPU: the patched block sums the experts' outputs in another order.
FIRST_STEPS, LOSS_RTOL = 5, 1e-4


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """``(the train_lm module, its report, the folder it wrote to)`` of one smoke run."""
    with pytest.MonkeyPatch.context() as patcher:
        patcher.syspath_prepend(str(BENCHMARKS))
        import train_lm
    out = tmp_path_factory.mktemp("train_lm")
    return train_lm, train_lm.main(["--smoke", "--out", str(out)]), out


def test_every_way_trains_and_the_results_are_written(smoke):
    train_lm, report, out = smoke

    assert report["failed"] == {}
    assert list(report["ways"]) == list(train_lm.WAYS)
    steps = report["run"]["steps"]
    for result in report["ways"].values():
        assert len(result["loss"]) == steps == len(result["max_over_mean_worst_layer"])
        assert result["loss"][-1] < result["loss"][0]
        assert [step for step, _ in result["heldout"]] == [0, 8, 16, steps - 1]
    written = json.loads(Path(report["stem"] + ".json").read_text())
    assert written["summary"] == report["summary"]
    table = Path(report["stem"] + ".md").read_text()
    assert all(f"| {way} |" in table for way in train_lm.WAYS)
    assert report["environment"]["torch"] in table
    if importlib.util.find_spec("matplotlib") is not None:
        assert len(report["plots"]) == 3
        assert all((out / name).stat().st_size > 0 for name in report["plots"])


def test_patched_follows_transformers(smoke):
    _, report, _ = smoke
    hf, patched = (report["ways"][way]["loss"] for way in ("transformers", "patched"))
    assert patched[0] == pytest.approx(hf[0], rel=1e-6)  # same weights, same batch
    assert patched[:FIRST_STEPS] == pytest.approx(hf[:FIRST_STEPS], rel=LOSS_RTOL)
    assert (report["ways"]["patched"]["tokens_per_expert"][:FIRST_STEPS]
            == report["ways"]["transformers"]["tokens_per_expert"][:FIRST_STEPS])


def test_bias_update_balances_the_load(smoke):
    _, report, _ = smoke
    half = report["run"]["steps"] // 2

    def late_load(way):
        values = report["ways"][way]["max_over_mean_layer_mean"][half:]
        return sum(values) / len(values)

    assert late_load("balance_bias") < 0.8 * late_load("balance_none")
    assert late_load("balance_all") < 0.8 * late_load("balance_none")


def test_autocast_runs_every_forward_in_bf16(smoke, tmp_path):
    train_lm, _, _ = smoke
    report = train_lm.main(["--smoke", "--steps", "3", "--ways", "transformers,patched",
                            "--autocast", "bfloat16", "--out", str(tmp_path)])
    assert report["failed"] == {}
    assert report["precision"] == "fp32 weights, torch.autocast(bfloat16)"
    hf, patched = (report["ways"][way]["loss"] for way in ("transformers", "patched"))
    # Both ways' experts compute in bf16 from the same weights: close, not equal.
    assert patched[0] == pytest.approx(hf[0], rel=2e-2)
    assert "torch.autocast(bfloat16)" in Path(report["stem"] + ".md").read_text()


def test_resume_keeps_finished_ways_and_refuses_another_run(smoke):
    train_lm, report, out = smoke
    kept = {way: report["ways"][way]["loss"] for way in ("transformers", "balance_bias")}
    again = train_lm.main(["--smoke", "--out", str(out), "--resume",
                           "--ways", "transformers,balance_bias"])
    assert {way: again["ways"][way]["loss"] for way in kept} == kept  # read back, not retrained
    assert list(again["ways"]) == list(train_lm.WAYS)
    command = json.loads(Path(again["stem"] + ".json").read_text())["command"]
    assert "--resume" in command and "--out DIR" in command and str(out) not in command
    with pytest.raises(ValueError, match=r"--resume: .* \(steps 24 there, 3 here\)"):
        train_lm.main(["--smoke", "--out", str(out), "--resume", "--steps", "3"])
