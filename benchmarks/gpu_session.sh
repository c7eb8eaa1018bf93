#!/usr/bin/env bash
# Everything expseg proves on a GPU machine, in phases, with logs under $OUT (default ./gpu-out).
#
#   benchmarks/gpu_session.sh                 # build gpu scenarios bench (the core proof)
#   benchmarks/gpu_session.sh build memcheck  # any subset, in order
#
# Phases:
#   build      meson release build (tests + benchmarks) in build-gpu/
#   gpu        the gpu suite: driver contract, both backends on the device, data integrity, stress, IPC
#   memcheck   the gpu suite under compute-sanitizer --tool memcheck
#   scenarios  expseg scenario --all and the shipped ResNet-50 trace on cuda:0 (JSON + HTML)
#   mixes      random-churn with other size mixes (--sizes), seeds 1-3, on cuda:0 (JSON lines)
#   bench      the Google Benchmark suite (JSON; BENCH_FILTER, BENCH_MIN_TIME, and BENCH_REPS=N for
#              the median of N repetitions, which compare.py then reads; the repetitions of all
#              benchmarks run in random order, so a slow stretch of a shared host spreads over
#              all of them instead of falling on a few; BENCH_CPU=N runs the suite on CPU N alone
#              (taskset), away from the scheduler moving it while a busy host settles)
#   compare    benchmarks/compare.py: PyTorch's caching allocator vs expseg, same workloads
#   workloads  benchmarks/workloads.py: GPT-2 / ResNet-50 under 4 allocators (WORKLOADS_ARGS: its options)
#   cupy       benchmarks/cupy_story.py
#   torch      tests/gpu/torch_oom.py: an OOM inside PyTorch raises RuntimeError with the report;
#              tests/gpu/torch_api.py: PyTorch's memory API (memory_stats, empty_cache, ...) under expseg
#              tests/gpu/torch_compile.py: torch.compile(mode="reduce-overhead") (CUDA graph trees) on expseg's pools
#   multi      tests/gpu/run_multi_gpu.sh (two GPUs)
# Each phase prints one summary line; the last lines of the output are the summary table. Logs go
# to a work folder and are packed into $OUT/gpu-session.tgz at the end (one file to fetch).
set -uo pipefail
cd "$(dirname "$0")/.."
DEST="${OUT:-$PWD/gpu-out}"
mkdir -p "$DEST"
OUT="$(mktemp -d /tmp/expseg-gpu.XXXXXX)"
B="${BUILD:-build-gpu}"
phases=("$@")
[ ${#phases[@]} -eq 0 ] && phases=(build gpu scenarios bench)
summary=()
note() { summary+=("$1"); echo "== $1"; }
run_phase() {  # name, timeout seconds, command...
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  note "$(printf '%-10s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$(tail -n 1 "$OUT/$name.log" | cut -c1-150)")"
  printf '%s\n' "${summary[@]}" >"$OUT/summary.txt"
  tar czf "$DEST/gpu-session.tgz" -C "$OUT" .  # after every phase: a run cut short still returns its logs
  return $rc
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$OUT/gpu.txt" 2>&1
for p in "${phases[@]}"; do
  case "$p" in
    build)
      # Only what the GPU phases run (the unit suite is for the CPU machines).
      targets="lib/libexpseg.so.0.1.0 tools/expseg tests/expseg_gpu tests/expseg_gpu_multi tests/expseg_ipc_child"
      if ! run_phase build 400 bash -c "meson setup $B -Dbuildtype=release ${MESON_ARGS:-} && ninja -C $B $targets"; then
        tail -n 40 "$OUT/build.log"; tar czf "$DEST/gpu-session.tgz" -C "$OUT" .; exit 1
      fi ;;
    gpu)
      run_phase gpu 300 "$B/tests/expseg_gpu" --duration=true ;;
    memcheck)
      # The suite provokes CUDA API errors on purpose (error-path tests): report memory errors only.
      run_phase memcheck 400 compute-sanitizer --tool memcheck --report-api-errors no --leak-check full --error-exitcode 3 "$B/tests/expseg_gpu" --test-suite-exclude=ipc ;;
    scenarios)
      run_phase scenarios 200 bash -c "$B/tools/expseg scenario --all --device cuda:0 --json > $OUT/scenarios.jsonl && $B/tools/expseg scenario --all --device cuda:0 && $B/tools/expseg replay benchmarks/traces/resnet50-train-varsize.rmm.csv.gz --device cuda:0 --json | tee $OUT/replay.jsonl && $B/tools/expseg study --device cuda:0 --html $OUT/study-h200.html | tail -n 12" ;;
    mixes)
      # The mixes of the unit test "other size mixes" through the CLI; the lowest fill column is
      # the least (live + request) / limit at which a request failed.
      run_phase mixes 200 bash -c "for m in 1MiB-64MiB:3GiB 1MiB-32MiB:3GiB 2MiB-16MiB:3GiB 1MiB-4MiB:1GiB 4KiB-1MiB:64MiB; do
          for s in 1 2 3; do $B/tools/expseg scenario random-churn --device cuda:0 --sizes \${m%%:*} --conf limit:\${m##*:} --seed \$s --json || exit 1; done
        done > $OUT/mixes.jsonl && python3 benchmarks/mixes_table.py $OUT/mixes.jsonl" ;;
    bench)
      run_phase bench 300 bash -c "ninja -C $B benchmarks/expseg_bench >/dev/null && exec ${BENCH_CPU:+taskset -c $BENCH_CPU} $B/benchmarks/expseg_bench \"\$@\"" bench --benchmark_format=console --benchmark_out="$OUT/bench.json" --benchmark_out_format=json \
        --benchmark_min_time="${BENCH_MIN_TIME:-0.2}" ${BENCH_FILTER:+--benchmark_filter="$BENCH_FILTER"} \
        ${BENCH_REPS:+--benchmark_repetitions=$BENCH_REPS --benchmark_enable_random_interleaving=true --benchmark_report_aggregates_only=true} ;;
    compare)
      bj=(); [ -f "$OUT/bench.json" ] && bj=(--bench-json "$OUT/bench.json")
      run_phase compare 500 python3 benchmarks/compare.py --bench "$B/benchmarks/expseg_bench" "${bj[@]}" --cli "$B/tools/expseg" --growth-reps 2 --out "$OUT/compare" ;;
    workloads)
      run_phase workloads 560 env EXPSEG_LIBRARY="$PWD/$B/lib/libexpseg.so" PYTHONUNBUFFERED=1 python3 benchmarks/workloads.py --out "$OUT/workloads" ${WORKLOADS_ARGS:-} ;;
    torch)
      run_phase torch 900 env EXPSEG_LIBRARY="$PWD/$B/lib/libexpseg.so" bash -c "python3 tests/gpu/torch_oom.py && python3 tests/gpu/torch_api.py && python3 tests/gpu/torch_compile.py" ;;
    cupy)
      run_phase cupy 200 env EXPSEG_LIBRARY="$PWD/$B/lib/libexpseg.so" python3 benchmarks/cupy_story.py ;;
    multi)
      run_phase multi 500 env BUILD_DIR="$B" EXPSEG_LIBRARY="$PWD/$B/lib/libexpseg.so" tests/gpu/run_multi_gpu.sh ;;
    *) echo "unknown phase $p" >&2; exit 2 ;;
  esac
done
{
  echo "== summary ($(cat "$OUT/gpu.txt"))"
  printf '%s\n' "${summary[@]}"
} | tee "$OUT/summary.txt"
tar czf "$DEST/gpu-session.tgz" -C "$OUT" . && cp "$OUT/summary.txt" "$DEST/summary.txt"
