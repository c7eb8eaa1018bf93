#!/usr/bin/env bash
# Issue 8 on the GPU machine: IPC between two processes (1 GPU), peer access and cross-GPU IPC
# (2 GPUs), and the PyTorch NCCL all-reduce of tensors allocated through expseg (2 GPUs, both
# backends), with a summary at the end.
#
#   tests/gpu/run_multi_gpu.sh            # BUILD_DIR (default build-ipc) is configured/built if needed
#   BUILD_DIR=build tests/gpu/run_multi_gpu.sh
#
# Each step reports PASS, FAIL or SKIPPED (exit 77: the hardware or PyTorch is missing; the reason is
# printed). Exit status: 1 if any step failed, 77 if every step was skipped, else 0.
# On a 1-GPU machine the two-GPU steps report SKIPPED, never PASS.
set -uo pipefail
cd "$(dirname "$0")/../.."
BUILD_DIR="${BUILD_DIR:-build-ipc}"

# NVLink multicast stays off (it can put a shared host's GPUs out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1

names=()
results=()
record() {  # name, exit code
  local r
  case "$2" in
    0) r=PASS ;;
    77) r=SKIPPED ;;
    124|137) r="FAIL (timed out)" ;;
    *) r="FAIL (exit $2)" ;;
  esac
  names+=("$1")
  results+=("$r")
  echo "=== $1: $r"
}

echo "=== environment"
uname -r
echo "user $(id -u), Yama ptrace_scope $(cat /proc/sys/kernel/yama/ptrace_scope 2>/dev/null || echo absent)"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi -L
  nvidia-smi topo -m 2>/dev/null | head -20
else
  echo "nvidia-smi not found"
fi

echo "=== build ($BUILD_DIR)"
start=$SECONDS
build_rc=0
if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  meson setup "$BUILD_DIR" -Dbenchmarks=false >/dev/null || build_rc=$?
fi
if [ "$build_rc" -eq 0 ]; then
  ninja -C "$BUILD_DIR" tests/expseg_gpu tests/expseg_gpu_multi tests/expseg_ipc_child lib/libexpseg.so.0.1.0 || build_rc=$?
fi
echo "build: $((SECONDS - start)) s"
record "build" "$build_rc"
if [ "$build_rc" -ne 0 ]; then
  echo "=== summary"; echo "build FAILED: nothing ran"; exit 1
fi

run_step() {  # name, timeout seconds, command...
  local name="$1" limit="$2"
  shift 2
  echo "=== $name: $*"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  echo "($((SECONDS - t0)) s)"
  record "$name" "$rc"
}

run_step "ipc: 2 processes on GPU 0, both backends, SCM_RIGHTS and pidfd_getfd" 300 \
  "$BUILD_DIR/tests/expseg_gpu" --test-suite=ipc
run_step "peer access + cross-GPU ipc (2 GPUs)" 600 \
  "$BUILD_DIR/tests/expseg_gpu_multi"
for backend in split_merge expandable; do
  run_step "NCCL all-reduce, backend:$backend (2 GPUs, torch.distributed)" 420 \
    env EXPSEG_LIBRARY="$PWD/$BUILD_DIR/lib/libexpseg.so" python3 tests/gpu/multi_gpu_allreduce.py --backend "$backend" --timeout 360
done

echo "=== summary"
failed=0
ran=0
for i in "${!names[@]}"; do
  printf '%-75s %s\n' "${names[$i]}" "${results[$i]}"
  case "${results[$i]}" in
    FAIL*) failed=1 ;;
    PASS) [ "${names[$i]}" != build ] && ran=1 ;;
  esac
done
if [ "$failed" -ne 0 ]; then exit 1; fi
if [ "$ran" -eq 0 ]; then exit 77; fi
exit 0
