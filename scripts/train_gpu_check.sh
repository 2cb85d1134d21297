#!/usr/bin/env bash
# Training on one GPU in one call: install, the GPU tests of the experts' gradients
# and of compiled training steps (TEST_SECONDS bounds them, TESTS=0 skips them),
# then benchmarks/bench_train.py (BENCH_SECONDS bounds it, BENCH_ARGS are passed on,
# BENCH=0 skips it). Logs and results go to $OUT when it is set; a summary is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
source scripts/install_on_device.sh
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
status=0
tests="not run"
bench="not run"
if [ "${TESTS:-1}" = 1 ]; then
  timeout -k 20 "${TEST_SECONDS:-150}" python3 -m pytest -v -m gpu -p no:cacheprovider \
    tests/test_experts_backward.py graph_tests/test_backward_graph.py graph_tests/test_training.py \
    "graph_tests/test_decompose.py::test_traced_experts_keep_their_backward" \
    tests/test_backends.py -k "backward or train or grad or determin" 2>&1 \
    | tee "$OUT/train_tests.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" | tail -40
  rc=${PIPESTATUS[0]}
  tests="rc=$rc: $(grep -E '(passed|failed|error)' "$OUT/train_tests.log" | tail -1)"
  [ "$rc" -eq 0 ] || status=1
fi
if [ "${BENCH:-1}" = 1 ]; then
  timeout -k 20 "${BENCH_SECONDS:-300}" python3 benchmarks/bench_train.py --out "$OUT/train" \
    ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_train.log" | grep -v Warning | tail -30
  rc=${PIPESTATUS[0]}
  bench="rc=$rc (timeout gives 124)"
  [ "$rc" -eq 0 ] || status=1
fi
echo
echo "=== summary ==="
echo "training GPU tests: $tests"
echo "bench_train.py: $bench"
[ -f "$OUT/train/train.md" ] && tail -20 "$OUT/train/train.md"
exit $status
