#!/usr/bin/env bash
# Packs the built flashinfer experts module (its library only) into $OUT as xz parts of at
# most 15 MiB, to carry to the next GPU machine in the ignored .peers/fi_module/, where
# scripts/install_on_device.sh puts it into FlashInfer's AOT folder (loaded without a
# build). Run where flashinfer imports, after the build; prints the parts and sizes.
set -euo pipefail
cd "$(dirname "$0")/.."
so=$(python3 -c "from torch_moe_ops.backends.flashinfer import cutlass_module as m; p = m.built_path(); print(p or '')")
[ -n "$so" ] || { echo "the flashinfer experts module is not built"; exit 3; }
name=$(basename "$so" .so)
ls -la "$so"
xz -T0 -6 -c "$so" | split -b 15M -d - "$OUT/$name.so.xz.part"
ls -la "$OUT/$name".so.xz.part*
