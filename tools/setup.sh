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

cuda_root="${CUDA_PATH:-}"
if [ -z "$cuda_root" ]; then
  if [ -f /usr/local/cuda/include/cuda.h ]; then cuda_root=/usr/local/cuda
  elif command -v nvcc >/dev/null 2>&1; then cuda_root="$(dirname "$(dirname "$(command -v nvcc)")")"
  fi
fi
if [ -z "$cuda_root" ] || [ ! -f "$cuda_root/include/cuda.h" ]; then
  echo "expseg setup: cuda.h not found. Install the CUDA toolkit (/usr/local/cuda) or set CUDA_PATH." >&2
  exit 1
fi
echo "expseg setup: ready (CUDA headers in $cuda_root/include)"
