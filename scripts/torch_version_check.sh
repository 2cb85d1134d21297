#!/usr/bin/env bash
# Usage: scripts/torch_version_check.sh VERSION (a torch release: 2.11.0)
#
# What torch_moe_ops/torch_compat.py claims for a torch version, checked on the CPU:
# a virtualenv with torch VERSION ($VENV, else one per version under $TMPDIR, kept and
# reused), this checkout editable in it with its test and hf extras, then one pytest run of
# the tests its docstring names: each private torch API's own test and the library's tests
# over its uses (PYTEST_ARGS passed on). The counts print last; the exit status is pytest's.
set -euo pipefail
VERSION="${1:?usage: scripts/torch_version_check.sh VERSION (a torch release: 2.11.0)}"
cd "$(dirname "$0")/.."
VENV="${VENV:-${TMPDIR:-/tmp}/torch-moe-ops-torch-$VERSION}"
TESTS=(
  tests/test_torch_compat.py
  tests/test_import.py
  tests/test_import_cycles.py
  tests/test_opcheck.py
  tests/test_tokens_transport.py
  tests/test_expert_parallel.py::test_inductor_keeps_every_collective_on_an_idle_rank
  tests/test_cpu_backend.py
  tests/test_experts_backward.py
  tests/test_explain.py
  tests/test_chunked_tokens.py::test_independent_work_splits_between_dispatch_and_combine
  tests/test_deepep_emulated.py::test_tokens_in_flight_match_single_process
  tests/test_eager_call.py
  tests/test_grouped_mm_quant.py
  tests/test_flashinfer_experts.py::test_weights_are_prepared_once_per_version
  tests/test_flashinfer_experts.py::test_mxfp4_is_prepared_once_per_version
  tests/test_fsdp_ep.py::test_fsdp2_with_expert_parallelism_on_cpu
  graph_tests/test_compile.py
  graph_tests/test_decompose.py
)

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
installed=$("$PY" -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null || true)
if [ "$installed" != "$VERSION" ]; then
  # The CPU build where PyTorch's index answers; else PyPI's, on Linux x86_64 the CUDA
  # build (the GPU machines' own), which runs on the CPU as well.
  "$PY" -m pip install -q --retries 1 --timeout 30 "torch==$VERSION" \
      --index-url https://download.pytorch.org/whl/cpu \
    || "$PY" -m pip install -q "torch==$VERSION"
fi
# torch is installed: the extras leave it, and the triton a CUDA build pins.
"$PY" -m pip install -q -e ".[test,hf]"
# Triton's interpreter (the Triton tests on the CPU) turns one-element arrays into Python
# ints, which numpy 2.4 refuses: 3.6 does (torch 2.11's), 3.8 squeezes them first.
if "$PY" -c "import sys, triton
sys.exit(tuple(map(int, triton.__version__.split('.')[:2])) >= (3, 8))" 2>/dev/null; then
  "$PY" -m pip install -q "numpy<2.4"
fi

log=$(mktemp)
status=0
"$PY" -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-} "${TESTS[@]}" 2>&1 | tee "$log" || status=$?
versions=$("$PY" -c "
import numpy, torch
try:
    import triton
    triton_version = triton.__version__
except ImportError:
    triton_version = 'none'
print(f'torch {torch.__version__}, triton {triton_version}, numpy {numpy.__version__}')")
echo "$versions: $(grep -E '^[0-9]+ (passed|failed|skipped|error)|no tests ran' "$log" | tail -1)"
rm -f "$log"
exit "$status"
