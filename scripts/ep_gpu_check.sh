#!/usr/bin/env bash
# Expert parallelism on 2 GPUs in one call: install, the multigpu tests (NCCL, two
# processes each), then benchmarks/bench_ep.py on 2 ranks; each step under `timeout`.
# TESTS=0 or BENCH=0 skips a step; TEST_SECONDS and BENCH_SECONDS bound them,
# PYTEST_ARGS and BENCH_ARGS are passed on. Logs and results go to $OUT when it is
# set; a short summary is printed last. NVLink multicast stays off in every process.
# The default bounds (240 s + 330 s) keep the whole call under 10 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
python3 -c "import torch; n = torch.cuda.device_count(); print('torch', torch.__version__, 'NCCL', torch.cuda.nccl.version() if n else '-', n, 'x', torch.cuda.get_device_name() if n else 'no GPU')"
status=0
tests="not run"
bench="not run"
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
echo "multigpu tests: $tests"
echo "bench_ep.py: $bench"
[ -f "$OUT/ep/summary.txt" ] && cat "$OUT/ep/summary.txt"
exit $status
