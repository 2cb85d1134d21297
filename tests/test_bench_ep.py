"""benchmarks/bench_ep.py end to end on two CPU processes over gloo (``--smoke``): the layer
phase times the layer (with a shared expert) moved whole and, beside it, in the chunks
``--chunks`` asks for; ``--profile`` adds each row's ops per step by class (the CPU's ops
standing in for kernels). And `kernel_profile`'s tables on synthetic kernels: classes,
streams, and the transport's overlap with the other kernels."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
# bf16 rounding of a compiled graph against the same layer eager, at the smoke widths.
EAGER_ERROR_BOUND = 2e-2


@pytest.mark.parametrize("flag, value, error", [
    ("--chunks", "''", ("argument --chunks: takes comma-separated positive ints or 'auto', "
                       "got \"''\"")),
    ("--deepep-sms", "7", "argument --deepep-sms: num_sms must be an even int >= 2"),
])
def test_bad_arguments_fail_before_any_case_runs(tmp_path, flag, value, error):
    # A wrong --chunks used to be read at the layer phase, after the transport phase ran.
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_ep.py"), "--out", str(tmp_path),
         flag, value], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2, result.stdout + result.stderr
    assert error in result.stderr, result.stderr


def test_smoke_times_the_layer_whole_and_in_chunks(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(REPO / "benchmarks" / "bench_ep.py"), "--out", str(tmp_path), "--smoke",
         "--a2a", "all_to_all", "--chunks", "2", "--shared", "16", "--overlap", "--budget-s", "400",
         "--profile", "--profile-steps", "2", "--profile-traces"],
        capture_output=True, text=True, timeout=480, check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1",
             "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO),
                                                         os.environ.get("PYTHONPATH"))))})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    with open(tmp_path / "ep.json") as f:
        results = json.load(f)
    layers = results["layer"]
    # Chunks at the prefill size only (the largest of the run's token counts).
    assert sorted((row["tokens"], row["chunks"]) for row in layers) == [
        (4, 1), (16, 1), (16, 2)], layers
    for row in layers:
        assert row["layer_us"] > 0 and "errors" not in row, row
        assert row["rel_err_vs_eager"] < EAGER_ERROR_BOUND, row
        assert row["vs_local_plus_raw"] > 0 and row["shared"] == 16, row
    assert "x2 (smoke: aot_eager, overlap)" in (tmp_path / "summary.txt").read_text()

    # --profile: every timed row of the transport, raw and layer phases has its table (a
    # capacity the routing does not fit times nothing).
    timed = [r for r in [*results["transport"], *results["raw"], *layers] if "error" not in r]
    for row in timed:
        profile = row["profile"]
        assert profile["steps"] == 2 and "error" not in profile, profile
        # (The CPU's ops run back to back: the span is the busy time, up to float rounding.)
        assert profile["busy_us"] > 0 and profile["span_us"] >= profile["busy_us"] - 1e-6, profile
        assert len(profile["by_rank"]) == 2 and profile["rank"] in (0, 1), profile
        collectives = [c for c in profile["classes"] if c["class"].startswith("NCCL ")]
        # gloo's collectives run on its own threads, beside the caller's ops.
        assert sum(c["count"] for c in collectives) > 0, profile["classes"]
        assert len({s for c in collectives for s in c["streams"]}) > 1, collectives
        assert 0 <= profile["overlap_us"] <= profile["transport_us"], profile
    assert layers[0]["local_profile"]["label"].startswith("local experts")
    text = (tmp_path / "ep.md").read_text()
    assert "## profile: kernels per step by class" in text
    assert "### transport all_to_all tokens, compiled E=8 T=16 C=16" in text
    assert "### layer all_to_all T=16 x2 shared=16" in text
    assert "| NCCL gloo:" in text and "overlap" in text
    traces = sorted(p.name for p in (tmp_path / "traces").iterdir())
    # One per row, and one per token count of the local experts.
    assert len(traces) == len({r["profile"]["label"] for r in timed}) + 2, traces


@pytest.fixture
def kernel_profile(benchmarks_importable):
    import kernel_profile

    return kernel_profile


def test_overlap_of_two_streams(kernel_profile):
    """NCCL on stream 7 over [0, 10) and [100, 110); on stream 0 a GEMM over [4, 8) and
    [104, 108), a Triton kernel over [9, 12) and [109, 112), a copy over [20, 22) and
    [120, 122): per step 5 us of the 10 us transport run beside other kernels."""
    def step(offset):
        return [kernel_profile.Kernel("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage)", 7,
                                      ((offset, offset + 10.0),)),
                kernel_profile.Kernel("nvjet_tst_128x256_64x4_1x2_h_bz_coopB_TNT", 0,
                                      ((offset + 4.0, offset + 8.0),)),
                kernel_profile.Kernel("triton_poi_fused_add_0", 0,
                                      ((offset + 9.0, offset + 12.0),)),
                kernel_profile.Kernel("Memcpy DtoD (Device -> Device)", 0,
                                      ((offset + 20.0, offset + 22.0),))]

    found = step(0.0) + step(100.0)
    assert kernel_profile.overlap_us(found) == pytest.approx(10.0)
    profile = kernel_profile.step_profile(found, steps=2, wall_us=60.0)
    assert profile["transport_us"] == pytest.approx(10.0)
    assert profile["overlap_us"] == pytest.approx(5.0)
    assert profile["exposed_transport_us"] == pytest.approx(5.0)
    assert profile["busy_us"] == pytest.approx(14.0)  # [0, 12) and [20, 22)
    assert profile["span_us"] == pytest.approx(61.0)  # [0, 122) over two steps
    assert profile["kernels"] == 4 and profile["wall_us"] == 60.0
    classes = {c["class"]: c for c in profile["classes"]}
    nccl = "NCCL ncclDevKernel_SendRecv"
    assert list(classes) == [nccl, "GEMM", "Triton triton_poi_fused_add_0",
                             "copy/pack/gather/index"]  # most time first
    assert classes[nccl]["streams"] == [7] and classes[nccl]["with_transport_us"] is None
    assert classes["GEMM"]["count"] == 1 and classes["GEMM"]["us"] == pytest.approx(4.0)
    assert classes["GEMM"]["with_transport_us"] == pytest.approx(4.0)
    assert classes["Triton triton_poi_fused_add_0"]["with_transport_us"] == pytest.approx(1.0)
    assert classes["copy/pack/gather/index"]["with_transport_us"] == 0.0
    table = kernel_profile.step_table(profile)
    assert "overlap) 5.0 us, exposed 5.0 us" in table and "| GEMM | 1.0 | 4.0 | 0 | 4.0 |" in table
    # Without a transport kernel: no overlap figures.
    assert "transport_us" not in kernel_profile.step_profile(found[1:4], steps=1)


def test_kernel_classes(kernel_profile):
    classes = {
        "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)": "NCCL ncclDevKernel_SendRecv",
        "void deep_ep::intranode::dispatch<8, 768, 6144>(int4*)": "DeepEP intranode::dispatch",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "GEMM",
        "triton_red_fused_sum_3": "Triton triton_red_fused_sum_3",
        "moe_grouped_gemm_kernel": "Triton moe_grouped_gemm_kernel",
        "moe_all_to_all::dispatch": "other",  # an op's name on the CPU, not a kernel
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>": "reduction/sum",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<float>": (
            "copy/pack/gather/index"),
        "void at::native::index_elementwise_kernel<128, 4>": "copy/pack/gather/index",
        "Memset (Device)": "copy/pack/gather/index",
        "void at::native::radixSortKVInPlace<-2, -1, 32>": "sort/topk",
        "void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>": "other",
        "gloo:all_to_all": "NCCL gloo:all_to_all", "aten::mm": "GEMM", "aten::index_select": (
            "copy/pack/gather/index"),
    }
    for name, label in classes.items():
        assert kernel_profile.kernel_class(name) == label, name


def test_kernels_of_profile_events(kernel_profile):
    """Device events: the kernels with their streams, without the profiler's mirrors of
    record_function ranges (by activity, else by their CPU twin's name); CPU events: each
    op's own time, its children's left out."""
    def event(name, device, start, end, stream=0, activity=None, children=()):
        return types.SimpleNamespace(
            name=name, device_type=device, time_range=types.SimpleNamespace(start=start, end=end),
            device_resource_id=stream, thread=stream, activity_type=activity,
            cpu_children=list(children))

    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    child = event("aten::copy_", cpu, 2.0, 5.0, stream=1)
    events = [event("## Call CompiledFxGraph ##", cpu, 0.0, 50.0, stream=1, children=[child]),
              child,
              event("## Call CompiledFxGraph ##", cuda, 10.0, 40.0, 7, "gpu_user_annotation"),
              event("ncclDevKernel_SendRecv", cuda, 10.0, 20.0, 13, "kernel"),
              event("## Call CompiledFxGraph ##", cuda, 10.0, 40.0, 7),
              event("triton_poi_fused_0", cuda, 12.0, 18.0, 7)]
    prof = types.SimpleNamespace(events=lambda: events)
    found, notes = kernel_profile.kernels(prof, device=True)
    assert [(k.name, k.stream, k.intervals) for k in found] == [
        ("ncclDevKernel_SendRecv", 13, ((10.0, 20.0),)),
        ("triton_poi_fused_0", 7, ((12.0, 18.0),))] and notes == []
    found, _ = kernel_profile.kernels(prof, device=False)
    assert [(k.name, k.intervals) for k in found] == [
        ("## Call CompiledFxGraph ##", ((0.0, 2.0), (5.0, 50.0))), ("aten::copy_", ((2.0, 5.0),))]
    assert found[0].us == pytest.approx(47.0)
