#!/usr/bin/env bash
# Installs what expseg needs to build and test, from Debian packages. Idempotent: installs only what
# is missing, and does nothing when everything is there. The CUDA toolkit (for cuda.h) is expected
# at /usr/local/cuda, $CUDA_PATH, or wherever nvcc is; libcuda is loaded at run time and optional.
set -euo pipefail

packages=(meson ninja-build g++ pkg-config libboost-dev doctest-dev libbenchmark-dev python3)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "expseg setup: installing ${missing[*]}"
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq || echo "expseg setup: apt-get update failed; trying the install anyway" >&2
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# meson.build's meson_version (e.g. '>=0.63.0'): an older meson stops with a less direct message.
root="$(cd "$(dirname "$0")/.." && pwd)"
need_meson="$(sed -n "s/^ *meson_version *: *'>= *\([0-9.]*\)'.*/\1/p" "$root/meson.build" | head -n 1)"
have_meson="$(meson --version 2>/dev/null || true)"
if [ -n "$need_meson" ] && { [ -z "$have_meson" ] ||
     [ "$(printf '%s\n%s\n' "$need_meson" "$have_meson" | sort -V | head -n 1)" != "$need_meson" ]; }; then
  echo "expseg setup: meson ${have_meson:-(not found)} is older than $need_meson, which meson.build requires." >&2
  echo "  Install a newer one: python3 -m pip install --user 'meson>=$need_meson' (then put ~/.local/bin first in PATH)," >&2
  echo "  or the meson package of a newer release (Debian 12 and Ubuntu 24.04 have one)." >&2
  exit 1
fi

cuda_root="${CUDA_PATH:-}"
if [ -z "$cuda_root" ]; then
  if [ -f /usr/local/cuda/include/cuda.h ]; then cuda_root=/usr/local/cuda
  elif command -v nvcc >/dev/null 2>&1; then cuda_root="$(dirname "$(dirname "$(command -v nvcc)")")"
  fi
fi
if [ -z "$cuda_root" ] || [ ! -f "$cuda_root/include/cuda.h" ]; then
  echo "expseg setup: cuda.h not found${cuda_root:+ in $cuda_root/include}. With cudaTypedefs.h (CUDA 12.3 or newer) it is all of CUDA the build needs; the smallest packages with them:" >&2
  echo "  - NVIDIA's CUDA apt repository: cuda-cudart-dev-13-0 (or cuda-cudart-dev-12-N, N >= 3), in /usr/local/cuda-13.0" >&2
  echo "    (set CUDA_PATH=/usr/local/cuda-13.0 if /usr/local/cuda does not point there);" >&2
  echo "  - Debian 13 (non-free): nvidia-cuda-dev (CUDA 12.4), which puts it in /usr/include: then CUDA_PATH=/usr" >&2
  echo "    (Ubuntu 24.04's nvidia-cuda-dev is CUDA 12.0 and Debian 12's 11.8: too old; expseg needs CUDA 12.3 or newer headers)." >&2
  echo "  Or set CUDA_PATH to the CUDA toolkit's directory (the one with include/cuda.h)." >&2
  exit 1
fi
echo "expseg setup: ready (CUDA headers in $cuda_root/include)"
