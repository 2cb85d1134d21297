#!/usr/bin/env bash
# The whole GPU check in one call: install, GPU tests and quickstart (TESTS=0 skips
# them). SHARDS=N (default: one per GPU) runs the single-GPU tests as N pytest processes
# of whole files, each on its own GPU of CUDA_VISIBLE_DEVICES, round robin
# (scripts/gpu_shards.py; DURATIONS_LOG, a log of an earlier run, balances them: the
# durations_<shard>.log files it writes to $OUT, one after the other, or pytest's --durations
# lines; by default scripts/gpu_durations.log, the per-test times of the whole suite on
# one H200, 2026-11-29: four shards there took 130-279 s); then the multigpu tests on all
# of them (MULTIGPU=0 skips them); TEST_SECONDS bounds each part. Then with TUNE=<shapes>
# the config tuning of those benchmark shapes (BENCH=1 then benchmarks on them), and with
# BENCH=1 the bf16 experts benchmark, one shape at a time (BENCH_ARGS="--formats ..." for
# others; quantized formats: scripts/quant_gpu_check.sh); with MODEL=<shapes> the
# whole-model benchmark (bench_model.py, MODEL_ARGS passed on). Logs go to $OUT when it is
# set.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
source scripts/install_on_device.sh
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
status=0
if [ "${TESTS:-1}" = 1 ]; then
  shards=${SHARDS:-$(python3 -c "import torch; print(max(torch.cuda.device_count(), 1))")}
  # Shard i runs on the i-th GPU this script may use (CUDA_VISIBLE_DEVICES as it came in).
  read -r -a gpus <<<"$(python3 -c "import os, torch
ids = os.environ.get('CUDA_VISIBLE_DEVICES') or ','.join(map(str, range(torch.cuda.device_count())))
print(' '.join(ids.split(',')))")"
  python3 scripts/gpu_shards.py "$shards" ${TEST_PATHS:-tests graph_tests} \
    --durations-log "${DURATIONS_LOG:-scripts/gpu_durations.log}" >"$OUT/shards.txt"
  shard=0
  while read -r files; do
    gpu=${gpus[$((shard % ${#gpus[@]}))]}
    # SIGINT at the bound: pytest then reports what failed so far and the durations.
    # Each test's time is logged as it ends: a shard cut short still balances the next run.
    # OMP_NUM_THREADS: the tests' fp64 references on the CPU run small matrices one slot at
    # a time; with a thread per core in each of several processes beside Inductor's
    # compile workers, one (T=333) took 35-41 s on a 64-core host against 1 s on 2 cores.
    [ -n "$files" ] && (CUDA_VISIBLE_DEVICES=$gpu OMP_NUM_THREADS=${SHARD_THREADS:-4} \
      TORCH_MOE_OPS_DURATIONS_LOG="$OUT/durations_$shard.log" \
      timeout -s INT -k 30 "${TEST_SECONDS:-540}" \
      python3 -m pytest -q -m gpu -p no:cacheprovider --durations=25 ${PYTEST_ARGS:-} $files \
      >"$OUT/gpu_tests_$shard.log" 2>&1; echo $? >"$OUT/gpu_tests_$shard.rc") &
    shard=$((shard + 1))
  done <"$OUT/shards.txt"
  wait
  for log in "$OUT"/gpu_tests_*.log; do
    rc=$(cat "${log%.log}.rc")
    echo "$log: rc=$rc $(tail -1 "$log")"
    [ "$rc" = 0 ] || status=1
  done
  if [ "${MULTIGPU:-1}" = 1 ] && [ "${#gpus[@]}" -ge 2 ]; then
    timeout -s INT -k 30 "${TEST_SECONDS:-540}" python3 -m pytest -q -m multigpu \
      -p no:cacheprovider --durations=15 ${PYTEST_ARGS:-} ${TEST_PATHS:-tests graph_tests} \
      >"$OUT/multigpu_tests.log" 2>&1 || status=1
    echo "multigpu: $(tail -1 "$OUT/multigpu_tests.log")"
  fi
  python3 examples/quickstart.py --tokens 256 2>&1 | tee "$OUT/quickstart.log" | tail -8
fi
if [ -n "${TUNE:-}" ]; then
  tuned=$(mktemp -d)
  timeout "${TUNE_SECONDS:-86400}" python3 benchmarks/tune_shapes.py --out "$tuned" --shapes "$TUNE" ${TUNE_ARGS:-} 2>&1 | tee "$OUT/tune.log"
  # One archive: few files come back from a call, and none whose name holds '=' or ','.
  tar czf "$OUT/tuned.tgz" -C "$tuned" .
  # So that a benchmark in the same call runs on the new configs.
  [ "${BENCH:-0}" = 1 ] && cp "$tuned"/*.json torch_moe_ops/backends/triton/configs/
fi
if [ "${BENCH:-0}" = 1 ]; then
  # One run per shape, each written as it ends, so a time limit keeps the shapes done.
  for shape in ${BENCH_SHAPES:-mixtral-8x7b qwen3-30b-a3b olmoe gpt-oss-20b deepseek-v3}; do
    python3 benchmarks/bench_experts.py --out "$OUT/bench/$shape" --shapes "$shape" --formats bf16 ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench-$shape.log" | tail -12
    tar czf "$OUT/bench.tgz" -C "$OUT" bench
  done
fi
if [ -n "${MODEL:-}" ]; then
  # One process per shape: each builds its models at real widths.
  for shape in ${MODEL//,/ }; do
    python3 benchmarks/bench_model.py --shapes "$shape" --out "$OUT/model/$shape" ${MODEL_ARGS:-} 2>&1 | tee "$OUT/model-$shape.log" | tail -30
    tar czf "$OUT/model.tgz" -C "$OUT" model
  done
fi
exit $status
