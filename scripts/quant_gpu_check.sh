#!/usr/bin/env bash
# Quantized experts on one GPU in one call: install, the quantized GPU tests (of
# tests/test_triton_quant.py, tests/test_grouped_mm_quant.py, tests/test_quant.py,
# tests/test_dispatch_quant.py, tests/test_checkpoints.py, tests/test_hf_quant.py,
# tests/test_bench_experts.py and tests/test_peer_triton_kernels.py, those that exist;
# TESTS=0 skips them, TEST_SECONDS bounds them), with TUNE=1 the Triton configs of
# SHAPES x FORMATS tuned at TUNE_TOKENS (default TOKENS; benchmarks/tune_shapes.py,
# bounded by TUNE_SECONDS) and used by the benchmark ($OUT/tuned.tgz brings them back),
# then benchmarks/bench_experts.py once
# per shape of SHAPES (default the five) with --formats $FORMATS --tokens $TOKENS
# --peers $PEERS $BENCH_ARGS (BENCH=0 skips it), each run bounded by SHAPE_SECONDS and
# by what is left of BUDGET_SECONDS since the start (none started with less than a
# minute left: a run keeps the formats it finished); then the targets and the short
# table of every shape run (benchmarks/summarize.py --short), last.
#
# vLLM's source travels in the git-ignored .peers/vllm (name it in the call's carry;
# benchmarks/peer_vllm.py says how to fill it): without it the vllm-triton rows are
# left out, with the reason. OpenAI's triton_kernels (the triton-kernels rows: mxfp4 on
# GPT-OSS shapes, with PEERS=vllm,triton_kernels or PEERS=triton_kernels) travels in
# .peers/triton_kernels the same way (benchmarks/peer_triton_kernels.py); the folder that
# holds its package goes on PYTHONPATH. $OUT gets install.log, quant.tgz (every log, and
# each shape's experts.json/.csv/.png) and quant_summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
start=$SECONDS
source scripts/install_on_device.sh
work=$(mktemp -d)/quant
mkdir -p "$work"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import peer_vllm, peer_triton_kernels as tk; print('vLLM source:', peer_vllm.source_version()); print('triton_kernels source:', tk.source_version())"
# triton_kernels' modules import triton_kernels.* absolutely: the folder that holds it goes
# on PYTHONPATH (the peer puts it on sys.path too).
tk_parent=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import peer_triton_kernels; print(peer_triton_kernels.package_parent())")
if [ -d "$tk_parent/triton_kernels" ]; then export PYTHONPATH="$tk_parent${PYTHONPATH:+:$PYTHONPATH}"; fi
shapes=${SHAPES:-mixtral-8x7b deepseek-v3 qwen3-30b-a3b olmoe gpt-oss-20b}
formats=${FORMATS:-bf16,fp8_block,fp8_channel,mxfp4}
tokens=${TOKENS:-1,16,4096,16384}
status=0
tests="not run"
if [ "${TESTS:-1}" = 1 ]; then
  files=()
  for f in tests/test_triton_quant.py tests/test_grouped_mm_quant.py tests/test_quant.py \
      tests/test_dispatch_quant.py tests/test_checkpoints.py tests/test_hf_quant.py \
      tests/test_bench_experts.py tests/test_peer_triton_kernels.py; do
    if [ -f "$f" ]; then files+=("$f"); else echo "not here (yet): $f"; fi
  done
  timeout -k 20 "${TEST_SECONDS:-180}" python3 -m pytest -q -rs -m gpu -p no:cacheprovider "${files[@]}" 2>&1 \
    | tee "$work/quant_tests.log" | grep -E "FAILED|ERROR|SKIPPED|passed|failed|skipped|no tests ran" | tail -30
  rc=${PIPESTATUS[0]}
  tests="rc=$rc: $(tail -1 "$work/quant_tests.log")"
  # 5: no GPU test collected in the files that exist.
  [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ] || status=1
fi
if [ "${TUNE:-0}" = 1 ]; then
  tuned=$(mktemp -d)
  timeout -k 10 "${TUNE_SECONDS:-300}" python3 benchmarks/tune_shapes.py --out "$tuned" \
    --shapes "${shapes// /,}" --formats "$formats" --tokens "${TUNE_TOKENS:-$tokens}" 2>&1 \
    | tee "$work/tune.log" \
    | grep -E "^(==|M=)" | tail -60
  # One archive: few files come back from a call, and none whose name holds '=' or ','.
  tar czf "$OUT/tuned.tgz" -C "$tuned" .
  # Into the config folder of the package that runs (PYTHONPATH may name another tree).
  cp "$tuned"/*.json "$(python3 -c "from torch_moe_ops.backends.triton import configs
print(configs.CONFIG_DIR)")" 2>/dev/null
fi
bench=""
if [ "${BENCH:-1}" = 1 ]; then
  for shape in $shapes; do
    left=$(( ${BUDGET_SECONDS:-540} - (SECONDS - start) ))
    if [ "$left" -lt 60 ]; then
      bench+=" $shape: not started (${left} s of BUDGET_SECONDS left);"
      continue
    fi
    limit=$(( left < ${SHAPE_SECONDS:-240} ? left : ${SHAPE_SECONDS:-240} ))
    timeout -k 10 "$limit" python3 benchmarks/bench_experts.py --out "$work/$shape" \
      --shapes "$shape" --formats "$formats" --tokens "$tokens" --peers "${PEERS:-vllm}" ${BENCH_ARGS:-} 2>&1 \
      | tee "$work/bench-$shape.log" | grep -E "skipped|failed|out of memory" | tail -20
    rc=${PIPESTATUS[0]}
    bench+=" $shape: rc=$rc;"
    [ "$rc" -eq 0 ] || { status=1; tail -5 "$work/bench-$shape.log"; }
    tar czf "$OUT/quant.tgz" -C "$(dirname "$work")" quant
  done
fi
tar czf "$OUT/quant.tgz" -C "$(dirname "$work")" quant
{
  echo
  echo "=== summary ($((SECONDS - start)) s) ==="
  echo "quantized GPU tests: $tests"
  echo "bench_experts.py (timeout gives 124):${bench:- not run}"
  results=$(ls "$work"/*/experts.json 2>/dev/null)
  if [ -n "$results" ]; then
    python3 benchmarks/summarize.py --short $results
  else
    echo "no experts.json written"
  fi
} 2>&1 | tee "$OUT/quant_summary.txt"
exit $status
