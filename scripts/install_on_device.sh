# Sourced by the GPU check scripts: the wheels carried in the ignored .whl/ (the
# device machine reaches no registry) and FlashInfer's trimmed package from .peers/flashinfer
# (scripts/flashinfer_peer.sh), then this project, editable; its log goes to $LOGS (else
# $OUT). A flashinfer experts module built earlier: scripts/flashinfer_experts_check.sh.
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
if [ -f .peers/flashinfer/flashinfer-trim.tar.xz ]; then  # scripts/flashinfer_peer.sh
  # Unpacked once per machine: a JIT build of an earlier call may be reading its sources.
  if [ ! -f /tmp/site/.flashinfer-unpacked ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
      .peers/flashinfer/*.whl
    tar -xJf .peers/flashinfer/flashinfer-trim.tar.xz -C /tmp/site
    touch /tmp/site/.flashinfer-unpacked
  fi
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"${LOGS:-$OUT}/install.log" 2>&1 \
  || { cat "${LOGS:-$OUT}/install.log"; exit 1; }
