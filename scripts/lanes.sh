#!/usr/bin/env bash
# Several GPU checks side by side on one machine, each on its own GPUs, so that one call
# of a multi-GPU machine does what would take several calls one after the other:
#
#   bash scripts/lanes.sh "0,1:TESTS=1 BENCH=0 bash scripts/ep_gpu_check.sh" \
#                         "2,3:MULTIGPU=0 bash scripts/gpu_check.sh"
#
# Each argument is "<GPU ids>:<command>": the command runs with CUDA_VISIBLE_DEVICES set to
# those GPUs, OUT and LOGS set to a folder of its own, its output in that folder's lane.log.
# The project is installed once before the lanes start (scripts/install_on_device.sh).
# FI_A2A_PREBUILD=1 first starts FlashInfer's all-to-all module build in the background
# (niced): the tests that need it wait on FlashInfer's own build lock instead of each paying
# the 100-250 s build in turn. Everything the lanes wrote comes back as one archive,
# $OUT/lanes.tgz (a call returns few files); each lane's exit status and the end of its
# output are printed last. Exits non-zero if a lane did.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
LANES=/tmp/lanes
rm -rf "$LANES"
mkdir -p "$OUT" "$LANES"
LOGS=$LANES source scripts/install_on_device.sh
if [ "${FI_A2A_PREBUILD:-0}" = 1 ]; then
  nice -n 19 python3 -c "from flashinfer.comm import trtllm_moe_alltoall as a2a
a2a.get_moe_alltoall_module()" >"$LANES/fi_a2a_build.log" 2>&1 &
fi
i=0
for lane in "$@"; do
  dir="$LANES/lane$i"
  mkdir -p "$dir"
  echo "${lane}" >"$dir/command"
  (CUDA_VISIBLE_DEVICES=${lane%%:*} OUT=$dir LOGS=$dir/logs bash -c "${lane#*:}" \
    >"$dir/lane.log" 2>&1; echo $? >"$dir/rc") &
  i=$((i + 1))
done
wait
tar czf "$OUT/lanes.tgz" -C "$LANES" .
status=0
for dir in "$LANES"/lane*; do
  rc=$(cat "$dir/rc")
  echo
  echo "=== $(basename "$dir") rc=$rc: $(cat "$dir/command")"
  tail -n "${TAIL_LINES:-30}" "$dir/lane.log"
  [ "$rc" = 0 ] || status=1
done
exit $status
