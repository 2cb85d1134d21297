#!/usr/bin/env bash
# Expert parallelism on the GPUs of one host in one call: install, DeepEP built from
# .peers/DeepEP (where the source is there; with its own intranode and low-latency tests
# at the benchmark's sizes if DEEPEP_TESTS=1), the multigpu tests (NCCL), then
# benchmarks/bench_ep.py at each world size in NPROCS; each step under `timeout`.
#
#   DEEPEP=0, TESTS=0, BENCH=0        skip a step
#   PACK=1                            also $OUT/deep_ep_build.tgz, DeepEP's built extension:
#                                     unpacked into .peers/DeepEP and carried, a later
#                                     call skips the build (70-90 s on 2 H200s)
#   TRAIN_BENCH=1                     also benchmarks/bench_ep_train.py at each world size
#                                     (one layer trained per a2a backend, and flashinfer's
#                                     trainable transport against MoeAlltoAll's round trip)
#   DEEPEP_TESTS=1                    also DeepEP's own tests (default off: bench_ep times
#                                     DeepEP's own round trip in the same run)
#   NPROCS="2 4"                      world sizes of the benchmark (default: 2)
#   TEST_SPLIT=1                      the 4-rank tests ([P4]) in a second pytest process
#                                     beside the others (both bounded by TEST_SECONDS)
#   TEST_LANES=N                      the multigpu tests dealt round-robin to N pytest
#                                     processes side by side on the same GPUs (each
#                                     bounded by TEST_SECONDS; Inductor's compile threads
#                                     shared out), so that the suite fits one call
#   TEST_SECONDS, BENCH_SECONDS,      bounds (the benchmarks' are per world size)
#   TRAIN_BENCH_SECONDS
#   PYTEST_ARGS, TEST_PATHS, BENCH_ARGS, TRAIN_BENCH_ARGS  passed on
#   FI_BUILD=1                        start the flashinfer experts module's build detached
#                                     first (scripts/flashinfer_build.sh), report it last
#
# Logs go to $LOGS (default /tmp/ep_logs); $OUT gets only the results (ep_P<n>.md, .json)
# and the tests' log, so that what comes back stays within a few files. A short summary
# is printed last. NVLink multicast stays off in every process.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
LOGS="${LOGS:-/tmp/ep_logs}"
mkdir -p "$OUT" "$LOGS"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source scripts/install_on_device.sh
python3 -c "import torch; n = torch.cuda.device_count(); print('torch', torch.__version__, 'NCCL', torch.cuda.nccl.version() if n else '-', n, 'x', torch.cuda.get_device_name() if n else 'no GPU')"
if [ "${FI_BUILD:-0}" = 1 ]; then
  # Niced: the tests and benchmarks beside it keep the cores they ask for.
  LOG="$LOGS/flashinfer_build.log" nice -n 19 bash scripts/flashinfer_build.sh start
fi
status=0
tests="not run"
bench=""
deepep="not run"
if [ "${DEEPEP:-1}" = 1 ] && [ -f .peers/DeepEP/setup.py ]; then
  if timeout -k 10 300 bash scripts/build_deepep.sh >"$LOGS/deepep_build.log" 2>&1; then
    export PYTHONPATH="$PWD/.peers/DeepEP${PYTHONPATH:+:$PYTHONPATH}"
    deepep="built ($(grep -o 'built in [0-9]* s' "$LOGS/deepep_build.log" | tail -1))"
    if [ "${DEEPEP_TESTS:-0}" = 1 ]; then
      for nproc in ${NPROCS:-2}; do
        for test in "test_intranode.py --num-tokens 4096" "test_low_latency.py --num-tokens 128"; do
          log="$LOGS/deepep_${test%%.py*}_P$nproc.log"
          (cd .peers/DeepEP && timeout -k 10 "${DEEPEP_TEST_SECONDS:-120}" python3 tests/$test \
            --num-processes "$nproc" --hidden 7168 --num-topk 8 --num-experts 256) >"$log" 2>&1
          deepep="$deepep; ${test%%.py*} P=$nproc rc=$?"
          grep -E "Best|passed|bandwidth|GB/s" "$log" | tail -4
        done
      done
    fi
  else
    deepep="build failed: $(tail -3 "$LOGS/deepep_build.log" | tr '\n' ' ')"
  fi
fi
run_tests() {  # name, extra pytest args
  timeout -s INT -k 30 "${TEST_SECONDS:-240}" python3 -m pytest -q -m multigpu -p no:cacheprovider \
    --durations=15 ${PYTEST_ARGS:-} "${@:2}" ${TEST_PATHS:-tests graph_tests} >"$LOGS/tests_$1.log" 2>&1
  echo "$1 rc=$?: $(grep -E '(passed|failed|skipped|error)' "$LOGS/tests_$1.log" | tail -1)" \
    >"$LOGS/tests_$1.status"
}
if [ "${TESTS:-1}" = 1 ]; then
  if [ "${TEST_LANES:-1}" -gt 1 ]; then
    python3 -m pytest -q --co -m multigpu -p no:cacheprovider ${PYTEST_ARGS:-} \
      ${TEST_PATHS:-tests graph_tests} 2>/dev/null | grep '::' >"$LOGS/test_ids"
    # The 2-rank cases dealt first, then the 4-rank ones: every lane gets some of each
    # (ids alternate P2 / P4, so a plain deal gave some lanes only P4, skipped on 2 GPUs).
    { grep -v 'P4\]' "$LOGS/test_ids"; grep 'P4\]' "$LOGS/test_ids"; } \
      | awk -v n="$TEST_LANES" -v dir="$LOGS" '{ print > (dir "/test_ids_" (NR - 1) % n) }'
    echo "multigpu tests: $(wc -l <"$LOGS/test_ids") in $TEST_LANES lanes"
    export TORCHINDUCTOR_COMPILE_THREADS=$(( $(nproc) / TEST_LANES > 1 ? $(nproc) / TEST_LANES : 1 ))
    for ids in "$LOGS"/test_ids_*; do
      TEST_PATHS="$(tr '\n' ' ' <"$ids")" run_tests "lane${ids##*_}" &
    done
    wait
    tests="$(cat "$LOGS"/tests_lane*.status | tr '\n' ';')"
  elif [ "${TEST_SPLIT:-0}" = 1 ]; then
    run_tests P4 -k P4 & run_tests rest -k "not P4" & wait
    tests="$(cat "$LOGS"/tests_P4.status "$LOGS"/tests_rest.status | tr '\n' ';')"
  else
    run_tests all
    tests="$(cat "$LOGS"/tests_all.status)"
  fi
  cat "$LOGS"/tests_*.log >"$OUT/ep_tests.log"
  grep -E "^(FAILED|ERROR)|[0-9.]+s (call|setup)" "$OUT/ep_tests.log" | head -40
  case "$tests" in *rc=[1-9]*) status=1 ;; esac
fi
if [ "${BENCH:-1}" = 1 ]; then
  for nproc in ${NPROCS:-2}; do
    timeout -k 30 "${BENCH_SECONDS:-330}" python3 -m torch.distributed.run --standalone \
      --nproc-per-node "$nproc" benchmarks/bench_ep.py --out "$LOGS/ep_P$nproc" ${BENCH_ARGS:-} \
      >"$LOGS/bench_ep_P$nproc.log" 2>&1
    rc=$?
    grep -E "^\[|Error|error" "$LOGS/bench_ep_P$nproc.log" | tail -30
    for f in ep.md ep.json; do
      [ -f "$LOGS/ep_P$nproc/$f" ] && cp "$LOGS/ep_P$nproc/$f" "$OUT/ep_P$nproc.${f#ep.}"
    done
    bench="$bench P=$nproc rc=$rc;"
    [ "$rc" -eq 0 ] || status=1
  done
fi
train_bench=""
if [ "${TRAIN_BENCH:-0}" = 1 ]; then
  for nproc in ${NPROCS:-2}; do
    timeout -k 30 "${TRAIN_BENCH_SECONDS:-420}" python3 -m torch.distributed.run --standalone \
      --nproc-per-node "$nproc" benchmarks/bench_ep_train.py --out "$LOGS/ep_train_P$nproc" \
      ${TRAIN_BENCH_ARGS:-} >"$LOGS/bench_ep_train_P$nproc.log" 2>&1
    rc=$?
    grep -E "^\[|Error|error" "$LOGS/bench_ep_train_P$nproc.log" | tail -30
    for f in ep_train.md ep_train.json; do
      [ -f "$LOGS/ep_train_P$nproc/$f" ] && cp "$LOGS/ep_train_P$nproc/$f" \
        "$OUT/ep_train_P$nproc.${f#ep_train.}"
    done
    train_bench="$train_bench P=$nproc rc=$rc;"
    [ "$rc" -eq 0 ] || status=1
  done
fi
echo
echo "=== summary ==="
echo "DeepEP: $deepep"
echo "multigpu tests: $tests"
echo "bench_ep.py (timeout gives 124):${bench:- not run}"
echo "bench_ep_train.py:${train_bench:- not run}"
for nproc in ${NPROCS:-2}; do
  [ -f "$LOGS/ep_P$nproc/summary.txt" ] && { echo "--- P=$nproc"; tail -n +8 "$LOGS/ep_P$nproc/summary.txt"; }
done
for nproc in ${NPROCS:-2}; do
  summary="$LOGS/ep_train_P$nproc/summary.txt"
  [ -f "$summary" ] && { echo "--- train P=$nproc"; cat "$summary"; }
done
if [ "${FI_BUILD:-0}" = 1 ]; then
  echo "--- flashinfer experts module"
  LOG="$LOGS/flashinfer_build.log" bash scripts/flashinfer_build.sh status | tail -4
fi
exit $status
