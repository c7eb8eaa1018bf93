#!/usr/bin/env bash
# Configures (once) and builds expseg in BUILD_DIR (default: build). Extra arguments go to
# `meson setup`, e.g. tools/build.sh build-asan -Db_sanitize=address,undefined -Db_lundef=false
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-build}"
shift || true
if [ ! -f "$dir/build.ninja" ]; then
  meson setup "$dir" "$@" >/dev/null
fi
ninja -C "$dir"
