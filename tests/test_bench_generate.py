"""benchmarks/bench_generate.py end to end on the CPU (``--smoke``, prefill and decode
compiled): transformers and the patched model generate with a static cache under
torch.compile, the same tokens, and the patched model's compiled forward has no graph
break. Qwen3-MoE stands for the families
whose experts are used in place, GPT-OSS for the converted one (and its sliding-window
cache).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
MODELS = ("qwen3-30b-a3b", "gpt-oss-20b")
WAYS = ("hf-grouped_mm", "tmo-patch")


def test_smoke_generates_the_same_tokens_without_graph_breaks(tmp_path):
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_generate.py"), "--smoke", "--out",
         str(tmp_path), "--shapes", ",".join(MODELS), "--compiled-prefill"],
        capture_output=True, text=True, timeout=600, check=False,
        # This checkout's torch_moe_ops, whatever the environment has installed.
        env={**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    with open(tmp_path / "generate.json") as f:
        data = json.load(f)
    assert data["failed"] == [] and data["skipped"] == []
    assert all(data["meta"][key] for key in ("torch", "transformers", "device", "date"))
    assert data["meta"]["compiled_prefill"]
    rows = {(r["shape"], r["way"]): r for r in data["rows"]}
    assert set(rows) == {(model, way) for model in MODELS for way in WAYS}
    for row in rows.values():
        assert row["prefill_ms"] > 0 and row["decode_tok_s"] > 0, row
        assert row["tokens_equal_reference"] and row["first_mismatch"] is None, row
        assert row["same_tokens_every_call"], row
    compiled = {(c["shape"], c["way"]): c for c in data["compiled"]}
    for model in MODELS:
        patched = compiled[(model, "tmo-patch")]
        assert patched["graph_breaks"] == 0, patched["break_reasons"]
        assert patched["graphs"] >= 2, patched  # the prefill and the decode steps
    # The table comes last: the rows' table, then the compile counts of each way.
    lines = result.stdout.strip().splitlines()
    assert lines[-1].startswith(f"| {MODELS[-1]} | tmo-patch |")
    assert (tmp_path / "generate.md").read_text().strip().endswith(lines[-1])


def test_bad_shapes_name_the_flag(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_generate

    with pytest.raises(SystemExit):
        bench_generate.parse_args(["--smoke", "--shapes", "qwen3", "--out", str(tmp_path)])
    assert "--shapes must be comma-separated names from qwen3-30b-a3b, " in capsys.readouterr().err


def test_first_token_agreement(monkeypatch):
    """A greedy token that changes within rounding of the row's largest logit is not a
    disagreement, one beyond it is; a score both ways mask with -inf (the end-of-text
    token under ``min_new_tokens``) agrees (it made every difference NaN), -inf in one way
    only does not."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_generate
    import torch

    want_BV = torch.tensor([[1.0, 5.0, 4.9, -math.inf], [0.0, 5.0, 1.0, -math.inf]])
    got_BV = want_BV.clone()
    got_BV[0, 2] = 5.1  # the top two are 0.02 of the largest logit apart
    agreement = bench_generate.first_token_agreement(got_BV, want_BV)
    assert agreement == {"logits_rel_diff": pytest.approx(0.2 / 5.0, rel=1e-5),
                         "first_token_differs": 1, "first_token_differs_beyond_rounding": 0}
    got_BV[1, 2] = 5.5  # the reference put this token 0.8 of the largest logit below
    assert bench_generate.first_token_agreement(got_BV, want_BV)[
        "first_token_differs_beyond_rounding"] == 1
    got_BV[0, 3] = 0.0  # masked in one way only
    assert bench_generate.first_token_agreement(got_BV, want_BV)["logits_rel_diff"] == math.inf


@pytest.mark.usefixtures("benchmarks_importable")
@pytest.mark.parametrize("name", MODELS)
def test_quantized_ways_run_the_same_weights(name):
    """``--quant mxfp4``: the patched model stores its experts in MXFP4 and transformers runs
    the same values rounded back to float (GPT-OSS's experts store their inputs first,
    Qwen3-MoE's last), so the two agree as closely as float rounding lets them, and neither
    agrees with the model left in float."""
    import dataclasses

    import bench_generate
    import bench_model
    import torch

    from torch_moe_ops.config import QuantSpec

    shape = bench_generate.SMOKE_SHAPES[name]
    # 2I != H, so that the experts' input dimension is told by its size; both multiples of
    # 32 (MXFP4's group).
    widths = {"moe_intermediate_size" if name == "qwen3-30b-a3b" else "intermediate_size": 64}
    shape = dataclasses.replace(shape, kwargs={**shape.kwargs, **widths})
    spec = QuantSpec("mxfp4")
    ids_BS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))

    def logits(way, quant):
        model = bench_model.build(shape, way, None, device="cpu", dtype=torch.float32,
                                  quant=quant)
        with torch.no_grad():
            return model(ids_BS).logits

    hf, ours = logits("hf-grouped_mm", spec), logits("tmo-patch", spec)
    unquantized = logits("hf-grouped_mm", None)
    scale = hf.abs().max()
    assert (hf - ours).abs().max() < 1e-4 * scale
    assert (hf - unquantized).abs().max() > 1e-2 * scale


@pytest.mark.gpu
@pytest.mark.usefixtures("benchmarks_importable")
@pytest.mark.parametrize("batch", [1, 16])
def test_quantized_ways_agree_on_gpu_prefill(batch):
    """The same agreement on a GPU in bf16, at prefills of 512 tokens a sequence, on the
    tiled MXFP4 kernels (16 sequences took ``dequant_grouped_mm`` until the tiled kernels
    read fragments; on an H200, 2026-11-29, GPT-OSS-20B's first token at batch 16 then
    differed from transformers' by about MXFP4's rounding error, 0.22-0.27 of the largest
    logit, against 0.01 at batch 1)."""
    import dataclasses

    import bench_generate
    import bench_model
    import torch

    from torch_moe_ops.backends.triton import fused
    from torch_moe_ops.config import QuantSpec

    shape = bench_generate.SMOKE_SHAPES["gpt-oss-20b"]
    # GPT-OSS-20B's 32 experts and top-4: without tuned configs, 512 and 8192 tokens take
    # the tiled kernels (`configs.default_path`), as the tuned ones do.
    shape = dataclasses.replace(shape, kwargs={
        **shape.kwargs, "hidden_size": 256, "intermediate_size": 512, "num_local_experts": 32,
        "num_experts_per_tok": 4})
    spec = QuantSpec("mxfp4")
    ids_BS = torch.randint(0, 128, (batch, 512), generator=torch.Generator().manual_seed(0))
    models = {way: bench_model.build(shape, way, None, device="cuda", dtype=torch.bfloat16,
                                     quant=spec) for way in ("hf-grouped_mm", "tmo-patch")}
    experts = next(m for m in models["tmo-patch"].modules() if hasattr(m, "w13_scale"))
    x_TH = torch.zeros(batch * 512, 256, dtype=torch.bfloat16, device="cuda")
    ids_TK = torch.zeros(batch * 512, shape.kwargs["num_experts_per_tok"], dtype=torch.int32,
                         device="cuda")
    path = fused._plan(x_TH, ids_TK, experts.w13, spec).path
    assert path == "tiled", path
    with torch.no_grad():
        hf, ours = (models[way](ids_BS.cuda()).logits[:, -1].float() for way in models)
    rel = ((hf - ours).abs().amax(dim=1) / hf.abs().amax(dim=1)).max().item()
    assert rel < 5e-2, rel
