#!/usr/bin/env bash
# Sets up, builds and runs expseg's tests:
#   1. the unit suite (simulated device) and the gpu suite (the real device; it reports SKIP when no
#      GPU is usable, it never passes without one);
#   2. the unit suite again, built with AddressSanitizer + UndefinedBehaviorSanitizer.
# `tools/test.sh --quick` stops after step 1. The stress suite and ThreadSanitizer runs are in
# tests/SANITIZERS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
tools/build.sh build
# A build/ configured earlier without tests (-Dtests=false) would "pass" with none run.
if [ "$(meson configure build 2>/dev/null | awk '$1 == "tests" {print $2}')" != "true" ]; then
  if ! log="$(meson configure build -Dtests=true 2>&1)"; then  # meson prints its errors on stdout
    printf '%s\n' "$log" >&2
    echo "tools/test.sh: meson configure build -Dtests=true failed" >&2
    exit 1
  fi
fi
meson test -C build --suite unit --suite gpu --print-errorlogs
if [ "${1:-}" = "--quick" ]; then exit 0; fi
tools/build.sh build-asan -Db_sanitize=address,undefined -Db_lundef=false -Dbuildtype=debugoptimized -Dbenchmarks=false
# build.sh applies its options only when it sets a directory up: a build-asan made earlier without
# the sanitizers would run the unit suite uninstrumented here.
if [ "$(meson configure build-asan 2>/dev/null | awk '$1 == "b_sanitize" {print $2}')" != "address,undefined" ]; then
  echo "tools/test.sh: build-asan is not configured with -Db_sanitize=address,undefined (remove it: rm -rf build-asan)" >&2
  exit 1
fi
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  meson test -C build-asan --suite unit --print-errorlogs
