#!/usr/bin/env bash
# The whole GPU check in one call: install, GPU tests, quickstart, then (with
# BENCH=1) the experts benchmark. Logs go to $OUT when it is set.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
status=0
python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider ${PYTEST_ARGS:-} tests graph_tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -40 || status=1
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
python3 examples/quickstart.py --tokens 256 2>&1 | tee "$OUT/quickstart.log" | tail -8
if [ "${BENCH:-0}" = 1 ]; then
  python3 benchmarks/bench_experts.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -60
fi
exit $status
