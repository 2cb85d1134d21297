#!/usr/bin/env bash
# FlashInfer's fused-MoE experts on one sm90 GPU, as far as one call gets: install; the
# trimmed SM90 module (a carried copy, else built detached: the build outlives this call
# and the next call on the same machine picks it up); its object count, build minutes and
# unresolved-symbol check; the gpu tests of tests/test_flashinfer_experts.py; then
# benchmarks/bench_experts.py --flashinfer-rows, one process per shape of SHAPES; then the
# tokens format from FlashInfer's all-to-all into these experts (two ranks sharing the GPU,
# tests/test_flashinfer_a2a_gpu.py; it builds the all-to-all's module first, 100-250 s);
# the built module packed into $OUT to carry next time; a short summary table last.
#
# Steps are bounded by what is left of BUDGET_SECONDS (default 570: one call of 10 minutes)
# since the start: BUILD_WAIT (default: all that is left) for the build, TEST_SECONDS
# (default 200) for the tests, SHAPE_SECONDS (default 120) per shape, PAIR_SECONDS (default
# 300) for the tokens pair; none starts with less than a minute left (the pair: 150 s).
# TESTS=0, BENCH=0 or PAIR=0 skips a step; BENCH_ARGS is passed on.
#
# Carrying the module: a call that finds it built by its own build writes
# $OUT/fi_module.tar.xz.partNN (xz, split at 15 MiB, at most MAX_PARTS parts: 2 by default,
# since a call carries 64 MiB in all, FlashInfer's wheels included). Put those files in the
# git-ignored .fi_module/ and name it in the next call's carry: scripts/install_on_device.sh
# installs it as FlashInfer's AOT copy (checked against the sha256 packed beside it), and
# nothing is compiled. FlashInfer itself comes from .peers/flashinfer (scripts/flashinfer_peer.sh).
# FlashInfer's tuned tactics (minutes of profiling per shape and process) go to
# $OUT/tactics.json (TORCH_MOE_OPS_FLASHINFER_TUNE_CACHE); a copy carried as
# .fi_module/tactics.json is read first, so the shapes it holds are not profiled again.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
start=$SECONDS
budget=${BUDGET_SECONDS:-570}
left() { echo $(( budget - (SECONDS - start) )); }
bounded() { local want=$1 rest; rest=$(left); echo $(( want < rest ? want : rest )); }
source scripts/install_on_device.sh
export TORCH_MOE_OPS_FLASHINFER_TUNE_CACHE=${TORCH_MOE_OPS_FLASHINFER_TUNE_CACHE:-/tmp/fi_tactics.json}
if [ -f .fi_module/tactics.json ] && [ ! -f "$TORCH_MOE_OPS_FLASHINFER_TUNE_CACHE" ]; then
  cp .fi_module/tactics.json "$TORCH_MOE_OPS_FLASHINFER_TUNE_CACHE"
fi
work=$(mktemp -d)/fi_experts
mkdir -p "$work"
LOG=${LOG:-/tmp/flashinfer_fused_moe_build.log}
export LOG
py() { python3 -c "$1"; }
py "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(), 'nvcc:', end=' ')"
nvcc --version 2>/dev/null | tail -1
name=$(py "from torch_moe_ops.backends.flashinfer.cutlass_module import module_name
print(module_name())") || { echo "flashinfer does not import: see $OUT/install.log"; exit 1; }
aot_dir=$(py "from flashinfer.jit import env; print(env.FLASHINFER_AOT_DIR)")
jit_dir=$(py "from flashinfer.jit import env; print(env.FLASHINFER_JIT_DIR)")
module=$FI_MODULE  # scripts/install_on_device.sh installs a carried module
build="not needed"
minutes="-"

echo "module $name: $module"

# The build, detached (setsid nohup in flashinfer_build.sh): it outlives this call.
if [ ! -f "$jit_dir/$name/$name.so" ] && [ ! -f "$aot_dir/$name/$name.so" ]; then
  mem_gb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 1024 ))
  # Each nvcc of these CUTLASS kernels can take several GB: one job per 6 GB at most.
  jobs=$(( $(nproc) < mem_gb / 6 ? $(nproc) : mem_gb / 6 ))
  export MAX_JOBS=${MAX_JOBS:-$jobs}
  [ -f "$LOG.started" ] || date +%s >"$LOG.started"
  echo "building with MAX_JOBS=$MAX_JOBS"
  bash scripts/flashinfer_build.sh start
  wait_s=$(bounded "${BUILD_WAIT:-$budget}")
  bash scripts/flashinfer_build.sh wait "$wait_s" | tail -5
  build="started $(( ($(date +%s) - $(cat "$LOG.started")) / 60 )) min ago"
fi
python3 -m torch_moe_ops.backends.flashinfer status >"$work/status.txt" 2>&1
status_rc=$?
cat "$work/status.txt"
objects=$(grep -o '[0-9]* of [0-9]* objects' "$work/status.txt" | head -1)
if [ -f "$jit_dir/$name/build.ninja" ]; then
  total=$(grep -cE '^build [^:]*: (cuda_)?compile ' "$jit_dir/$name/build.ninja")
  objects="${objects:-$total of $total objects}"
fi
if [ -f "$jit_dir/$name/$name.so" ] && [ -f "$LOG.started" ]; then
  minutes=$(( ($(stat -c %Y "$jit_dir/$name/$name.so") - $(cat "$LOG.started")) / 60 ))
  build="built in about $minutes min (from this machine's first build call)"
fi
symbols=$(grep -m 1 '^unresolved symbols\|^symbols not checked' "$work/status.txt" | cut -c 1-200)

# Pack a module this machine built, to carry next time.
packed="not packed"
if [ -f "$jit_dir/$name/$name.so" ] && [ "$status_rc" -ne 3 ]; then
  rm -f "$OUT"/fi_module.tar.xz.part*
  (cd "$jit_dir/$name" && sha256sum "$name.so" >"$name.so.sha256")
  XZ_OPT="-6 -T0" tar -cJf - -C "$jit_dir" "$name/$name.so" "$name/$name.so.sha256" \
    | split -b 15M -d -a 2 - "$OUT/fi_module.tar.xz.part"
  parts=$(ls "$OUT"/fi_module.tar.xz.part* | wc -l)
  size=$(( $(cat "$OUT"/fi_module.tar.xz.part* | wc -c) / 1024 / 1024 ))
  so_size=$(( $(stat -c %s "$jit_dir/$name/$name.so") / 1024 / 1024 ))
  if [ "$parts" -le "${MAX_PARTS:-2}" ]; then
    packed="$so_size MiB .so -> $size MiB xz in $parts part(s): carry them in .fi_module/"
  else
    rm -f "$OUT"/fi_module.tar.xz.part*
    packed="$so_size MiB .so -> $size MiB xz: over ${MAX_PARTS:-2} parts of 15 MiB, not packed"
  fi
fi

status=0
tests="not run"
bench=""
pair="not run"
if [ "$status_rc" -eq 3 ]; then
  tests="not run: the module is not built yet (call again: the build goes on)"
  status=3
else
  [ "$status_rc" -eq 0 ] || status=1
  if [ "${TESTS:-1}" = 1 ] && [ "$(left)" -ge 60 ]; then
    timeout -k 20 "$(bounded "${TEST_SECONDS:-200}")" python3 -m pytest -q -rs -m gpu \
      -p no:cacheprovider --durations=15 tests/test_flashinfer_experts.py 2>&1 \
      | tee "$work/tests.log" \
      | grep -E "FAILED|ERROR|SKIPPED|passed|failed|skipped|slowest|s call" | tail -40
    rc=${PIPESTATUS[0]}
    tests="rc=$rc: $(tail -1 "$work/tests.log")"
    [ "$rc" -eq 0 ] || status=1
  fi
  if [ "${BENCH:-1}" = 1 ]; then
    for shape in ${SHAPES:-gpt-oss-20b gpt-oss-120b deepseek-v3 mixtral-8x7b qwen3-30b-a3b olmoe}; do
      if [ "$(left)" -lt 60 ]; then
        bench+=" $shape: not started ($(left) s of BUDGET_SECONDS left);"
        continue
      fi
      timeout -k 10 "$(bounded "${SHAPE_SECONDS:-120}")" python3 benchmarks/bench_experts.py \
        --out "$work/$shape" --shapes "$shape" --flashinfer-rows ${BENCH_ARGS:-} 2>&1 \
        | tee "$work/bench-$shape.log" | grep -E "skipped|failed|out of memory" | tail -10
      rc=${PIPESTATUS[0]}
      bench+=" $shape: rc=$rc;"
      [ "$rc" -eq 0 ] || status=1
    done
  fi
  if [ "${PAIR:-1}" = 1 ]; then
    if [ "$(left)" -ge 150 ]; then
      timeout -k 20 "$(bounded "${PAIR_SECONDS:-300}")" python3 -m pytest -q -rs \
        -p no:cacheprovider tests/test_flashinfer_a2a_gpu.py \
        -k test_tokens_into_flashinfer_experts 2>&1 | tee "$work/pair.log" | tail -15
      rc=${PIPESTATUS[0]}
      pair="rc=$rc: $(tail -1 "$work/pair.log")"
      [ "$rc" -eq 0 ] || status=1
    else
      pair="not started ($(left) s of BUDGET_SECONDS left; TESTS=0 BENCH=0 runs it alone)"
    fi
  fi
fi
cp "$LOG" "$work/build.log" 2>/dev/null
cp "$TORCH_MOE_OPS_FLASHINFER_TUNE_CACHE" "$OUT/tactics.json" 2>/dev/null
tar czf "$OUT/fi_experts.tgz" -C "$(dirname "$work")" fi_experts
{
  results=$(ls "$work"/*/experts.json 2>/dev/null)
  if [ -n "$results" ]; then
    echo
    echo "=== flashinfer rows (%bytes: fraction of the byte floor, decode rows) ==="
    python3 benchmarks/summarize.py --rows $results | awk 'NR == 1 || $4 == "flashinfer"'
    echo
    python3 benchmarks/summarize.py --short $results
  fi
  echo
  echo "=== summary ($((SECONDS - start)) s) ==="
  printf '%-12s %s\n' "module" "$name: $module" "build" "$build; ${objects:-no build file}" \
    "symbols" "${symbols:-not checked (not built)}" "packed" "$packed" "gpu tests" "$tests" \
    "bench" "${bench:- not run}" "tokens pair" "$pair"
} 2>&1 | tee "$OUT/fi_summary.txt"
exit $status
