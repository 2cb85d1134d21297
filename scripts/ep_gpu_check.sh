#!/usr/bin/env bash
# Expert parallelism on 2 GPUs in one call: install, DeepEP built from .peers/DeepEP
# with its own intranode and low-latency tests at the benchmark's sizes (where the
# source is there), the multigpu tests (NCCL, two processes each), then
# benchmarks/bench_ep.py on 2 ranks; each step under `timeout`.
# DEEPEP=0, TESTS=0 or BENCH=0 skips a step (DEEPEP_TESTS=0 only DeepEP's tests); TEST_SECONDS and BENCH_SECONDS bound them,
# PYTEST_ARGS and BENCH_ARGS are passed on. Logs and results go to $OUT when it is
# set; a short summary is printed last. NVLink multicast stays off in every process.
# The default bounds (240 s + 330 s) keep the whole call under 10 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source scripts/install_on_device.sh
python3 -c "import torch; n = torch.cuda.device_count(); print('torch', torch.__version__, 'NCCL', torch.cuda.nccl.version() if n else '-', n, 'x', torch.cuda.get_device_name() if n else 'no GPU')"
status=0
tests="not run"
bench="not run"
deepep="not run"
if [ "${DEEPEP:-1}" = 1 ] && [ -f .peers/DeepEP/setup.py ]; then
  if timeout -k 10 300 bash scripts/build_deepep.sh >"$OUT/deepep_build.log" 2>&1; then
    export PYTHONPATH="$PWD/.peers/DeepEP${PYTHONPATH:+:$PYTHONPATH}"
    deepep="built"
    if [ "${DEEPEP_TESTS:-1}" = 1 ]; then
      # DeepEP's own tests, the yardstick of the deepep backend: normal mode at prefill,
      # low-latency mode at decode sizes, 2 ranks, H=7168, top-8.
      for test in "test_intranode.py --num-tokens 4096" "test_low_latency.py --num-tokens 128"; do
        for experts in ${DEEPEP_EXPERTS:-256}; do
          log="$OUT/deepep_${test%%.py*}_E$experts.log"
          (cd .peers/DeepEP && timeout -k 10 "${DEEPEP_TEST_SECONDS:-120}" python3 tests/$test \
            --num-processes 2 --hidden 7168 --num-topk 8 --num-experts "$experts") >"$log" 2>&1
          deepep="$deepep; ${test%%.py*} E=$experts rc=$?"
          grep -E "Best|passed|bandwidth|GB/s" "$log" | tail -8
        done
      done
    fi
  else
    deepep="build failed: $(tail -3 "$OUT/deepep_build.log" | tr '\n' ' ')"
  fi
fi
if [ "${TESTS:-1}" = 1 ]; then
  timeout -k 30 "${TEST_SECONDS:-240}" python3 -m pytest -q -m multigpu -p no:cacheprovider --durations=10 ${PYTEST_ARGS:-} ${TEST_PATHS:-tests graph_tests} 2>&1 | tee "$OUT/ep_tests.log" | tail -40
  rc=${PIPESTATUS[0]}
  tests="rc=$rc: $(grep -E '(passed|failed|skipped|error)' "$OUT/ep_tests.log" | tail -1)"
  [ "$rc" -eq 0 ] || status=1
fi
if [ "${BENCH:-1}" = 1 ]; then
  timeout -k 30 "${BENCH_SECONDS:-330}" python3 -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bench_ep.py --out "$OUT/ep" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_ep.log" | tail -60
  rc=${PIPESTATUS[0]}
  bench="rc=$rc (timeout gives 124)"
  [ "$rc" -eq 0 ] || status=1
fi
echo
echo "=== summary ==="
echo "DeepEP: $deepep"
echo "multigpu tests: $tests"
echo "bench_ep.py: $bench"
[ -f "$OUT/ep/summary.txt" ] && cat "$OUT/ep/summary.txt"
exit $status
