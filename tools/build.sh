#!/usr/bin/env bash
# Configures (once) and builds expseg in BUILD_DIR (default: build). Extra arguments go to
# `meson setup`, e.g. tools/build.sh build-asan -Db_sanitize=address,undefined -Db_lundef=false
# EXPSEG_BUILD_TARGETS (space-separated ninja targets, e.g. tools/expseg) builds only those and what
# they need; unset, everything (the library, the command, tests, benchmarks) is built.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-build}"
shift || true
if [ ! -f "$dir/build.ninja" ]; then
  # meson prints its ERROR lines on stdout: keep them where a failed setup can show them.
  if ! log="$(meson setup "$dir" "$@" 2>&1)"; then
    printf '%s\n' "$log" >&2
    echo "tools/build.sh: meson setup $dir failed (details: $dir/meson-logs/meson-log.txt)" >&2
    exit 1
  fi
fi
# shellcheck disable=SC2086  # the targets are split on spaces on purpose
ninja -C "$dir" ${EXPSEG_BUILD_TARGETS:-}
