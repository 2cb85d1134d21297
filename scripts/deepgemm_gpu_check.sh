#!/usr/bin/env bash
# The deepgemm experts backend on one sm90 GPU in one call: install, build DeepGEMM
# (scripts/build_deepgemm.sh), compile its kernels for SHAPES x TOKENS in parallel processes
# (benchmarks/deepgemm_gemms.py --compile-only), its GPU tests (tests/test_deepgemm.py),
# DeepGEMM's two GEMMs alone (benchmarks/deepgemm_gemms.py), then bench_experts.py per shape
# with --formats $FORMATS --backends $BACKENDS --peers $PEERS, each run bounded by what is left
# of BUDGET_SECONDS; DeepGEMM's compiled kernels come back as $OUT/deepgemm-cache.tgz (carry it
# as .peers/deepgemm-cache.tgz next time), every log and result as $OUT/deepgemm.tgz, the
# summary (and the short table) last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
start=$SECONDS
source scripts/install_on_device.sh
source scripts/build_deepgemm.sh || exit 1
work=$(mktemp -d)/deepgemm
mkdir -p "$work"
SHAPES="${SHAPES:-deepseek-v3 mixtral-8x7b qwen3-30b-a3b olmoe}"
TOKENS="${TOKENS:-1,16,4096,16384}"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
compile_start=$SECONDS
for shape in $SHAPES; do
  python3 benchmarks/deepgemm_gemms.py --compile-only --shapes "$shape" --tokens "$TOKENS" \
    >"$work/compile-$shape.log" 2>&1 &
done
timeout -k 10 "${TEST_SECONDS:-240}" python3 -m pytest -q -rs -m gpu \
  -p no:cacheprovider tests/test_deepgemm.py >"$work/tests.log" 2>&1
tests_rc=$?
wait
echo "DeepGEMM kernels compiled in $((SECONDS - compile_start)) s (tests beside them)"
for shape in $SHAPES; do tail -3 "$work/compile-$shape.log"; done
grep -E "FAILED|ERROR|passed|failed" "$work/tests.log" | tail -15
timeout -k 10 "${ANCHOR_SECONDS:-120}" python3 benchmarks/deepgemm_gemms.py \
  --shapes "$(echo $SHAPES | tr ' ' ,)" --tokens "$TOKENS" 2>&1 | tee "$work/anchor.log"
bench=""
for shape in $SHAPES; do
  left=$(( ${BUDGET_SECONDS:-540} - (SECONDS - start) ))
  if [ "$left" -lt 45 ]; then bench+=" $shape: not started;"; continue; fi
  timeout -k 10 "$left" python3 benchmarks/bench_experts.py --out "$work/$shape" \
    --shapes "$shape" --formats "${FORMATS:-bf16,fp8_block}" --tokens "$TOKENS" \
    --backends "${BACKENDS:-deepgemm,triton,grouped_mm}" --peers "${PEERS:-vllm}" \
    >"$work/bench-$shape.log" 2>&1
  bench+=" $shape: rc=$?;"
done
(cd "$DG_JIT_CACHE_DIR" && tar czf "$OUT/deepgemm-cache.tgz" .)
tar czf "$OUT/deepgemm.tgz" -C "$(dirname "$work")" deepgemm
echo
echo "=== summary ($((SECONDS - start)) s) ==="
echo "tests/test_deepgemm.py (gpu): rc=$tests_rc: $(tail -1 "$work/tests.log")"
echo "bench_experts.py:$bench"
results=$(ls "$work"/*/experts.json 2>/dev/null)
[ -n "$results" ] && python3 benchmarks/summarize.py --short $results
