# Sourced by the GPU check scripts: the wheels carried in the ignored .whl/ (the
# device machine reaches no registry), then this project, editable; logs to $OUT.
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
if [ -f .peers/flashinfer/flashinfer-trim.tar.xz ]; then  # scripts/flashinfer_peer.sh
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    .peers/flashinfer/*.whl
  tar -xJf .peers/flashinfer/flashinfer-trim.tar.xz -C /tmp/site
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
