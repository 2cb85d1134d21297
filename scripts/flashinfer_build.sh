#!/usr/bin/env bash
# Builds this package's trimmed copy of FlashInfer's SM90 CUTLASS fused-MoE module (54
# objects; FlashInfer's full one, 248, took about 45 minutes on 16 cores) in a process that
# outlives the command starting it (nohup, a session of its own), logging to $LOG. The
# module lands in FlashInfer's JIT cache, where the flashinfer experts backend finds it
# (torch_moe_ops/backends/flashinfer/cutlass_module.py).
#
#   scripts/flashinfer_build.sh [start]      start the build, return at once
#   scripts/flashinfer_build.sh status       running or not, objects compiled, errors
#   scripts/flashinfer_build.sh wait [SECS]  wait for it to end (default 540 s), then status
#
# Run it from the repository root where flashinfer-python imports (on a GPU machine, after
# `source scripts/install_on_device.sh`), with the FLASHINFER_* settings the backend will
# run with (they are part of the module's build file). MAX_JOBS caps ninja's parallel
# compilations (default: one per core; each nvcc can take several GB).
# status exits 0 once the module is built, 3 while it is not.
set -uo pipefail
LOG=${LOG:-/tmp/flashinfer_fused_moe_build.log}
PID_FILE=$LOG.pid
PYTHON=${PYTHON:-python3}

running() { [ -f "$PID_FILE" ] && kill -0 "$(cat "$PID_FILE")" 2>/dev/null; }

status() {
  if running; then
    echo "build process $(cat "$PID_FILE") is running; log: $LOG"
  elif [ -f "$PID_FILE" ]; then
    echo "build process $(cat "$PID_FILE") has ended; log: $LOG"
  fi
  if [ -f "$LOG" ]; then
    # ninja prints "[done/total] <command>" per step; the commands are long.
    grep -o '^\[[0-9]*/[0-9]*\]' "$LOG" | tail -n 1 | sed 's/^/last ninja step: /'
    grep -m 5 -E 'error|Error|FAILED' "$LOG" | cut -c 1-400
    tail -n 1 "$LOG" | cut -c 1-400
  fi
  "$PYTHON" -m torch_moe_ops.backends.flashinfer status
}

case "${1:-start}" in
  start)
    if running; then
      echo "already building (process $(cat "$PID_FILE")); log: $LOG"
      exit 0
    fi
    # The last line of the log says how long the build took.
    setsid nohup bash -c "start=\$(date +%s); $PYTHON -m torch_moe_ops.backends.flashinfer build; \
      echo \"build exited \$? after \$(( \$(date +%s) - start )) s (MAX_JOBS=\${MAX_JOBS:-all}, \$(nproc) cores)\"" \
      >"$LOG" 2>&1 </dev/null &
    echo $! >"$PID_FILE"
    echo "building FlashInfer's SM90 fused-MoE module in process $(cat "$PID_FILE"); log: $LOG"
    echo "progress: $0 status"
    ;;
  status)
    status
    ;;
  wait)
    deadline=$((SECONDS + ${2:-540}))
    while running && [ "$SECONDS" -lt "$deadline" ]; do sleep 10; done
    status
    ;;
  *)
    sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
