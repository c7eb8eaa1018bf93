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
#   bench      the Google Benchmark suite (JSON with every run in bench.json; BENCH_FILTER, and
#              BENCH_REPS=N for N repetitions of the benchmarks that do not set their own (growth,
#              scenario and driver_batching keep theirs), whose median compare.py then takes; the
#              repetitions of all benchmarks run in random order, so a slow stretch of a shared host
#              spreads over all of them instead of falling on a few; BENCH_CPU=N runs the suite on
#              CPU N alone (taskset), away from the scheduler moving it while a busy host settles).
#              The phase fails if a run failed (compare.py --check-bench lists them) or the build
#              of the benchmark failed (bench-build.log)
#   compare    benchmarks/compare.py: PyTorch's caching allocator vs expseg, same workloads, and
#              PyTorch with expseg through its pluggable allocator (pairs, churn64); PyTorch's
#              growth: the median of 3 fresh processes. Fails if compare.py lists an error
#   workloads  benchmarks/workloads.py: GPT-2 / ResNet-50 under 4 allocators (WORKLOADS_ARGS: its options;
#              WORKLOADS_ARGS='--rounds 3 --variants torch-classic,expseg-expandable' for a time check
#              that one slow run of the host does not decide: ~5 min on an H100, ~7 on an H200)
#   cupy       benchmarks/cupy_story.py
#   torch      tests/gpu/torch_oom.py: an OOM inside PyTorch raises torch.cuda.OutOfMemoryError (RuntimeError without libexpseg_torch.so) with the report;
#              tests/gpu/torch_api.py: PyTorch's memory API (memory_stats, empty_cache, ...) under expseg
#              tests/gpu/torch_compile.py: torch.compile(mode="reduce-overhead") (CUDA graph trees) on expseg's pools
#   multi      tests/gpu/run_multi_gpu.sh (two GPUs)
# Each phase prints one summary line; the last lines of the output are the summary table. Logs go
# to a work folder and are packed into $OUT/gpu-session.tgz at the end (one file to fetch).
# Exit status: 0 if every phase passed, 1 if one failed (the others still run, except after a failed
# build), 2 for an unknown phase.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
phases=("$@")
[ ${#phases[@]} -eq 0 ] && phases=(build gpu scenarios bench)
for p in "${phases[@]}"; do
  case "$p" in
    build | gpu | memcheck | scenarios | mixes | bench | compare | workloads | torch | cupy | multi) ;;
    *) echo "unknown phase $p" >&2; exit 2 ;;
  esac
done
DEST="${OUT:-$PWD/gpu-out}"
mkdir -p "$DEST"
OUT="$(mktemp -d /tmp/expseg-gpu.XXXXXX)"
B="${BUILD:-build-gpu}"
case "$B" in /*) LIB="$B/lib/libexpseg.so" ;; *) LIB="$PWD/$B/lib/libexpseg.so" ;; esac
summary=()
failed=()
note() { summary+=("$1"); echo "== $1"; }
run_phase() {  # name, timeout seconds, command...
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  [ $rc -ne 0 ] && failed+=("$name")
  note "$(printf '%-10s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$(tail -n 1 "$OUT/$name.log" | cut -c1-150)")"
  printf '%s\n' "${summary[@]}" >"$OUT/summary.txt"
  tar czf "$DEST/gpu-session.tgz" -C "$OUT" .  # after every phase: a run cut short still returns its logs
  return $rc
}
# The summary table, the logs packed, and the exit status: 1 if any phase failed.
finish() {
  {
    echo "== summary ($(cat "$OUT/gpu.txt"))"
    printf '%s\n' "${summary[@]}"
    if [ ${#failed[@]} -gt 0 ]; then echo "FAILED: ${failed[*]}"; fi
  } | tee "$OUT/summary.txt"
  tar czf "$DEST/gpu-session.tgz" -C "$OUT" . && cp "$OUT/summary.txt" "$DEST/summary.txt"
  [ ${#failed[@]} -eq 0 ] && exit 0
  exit 1
}
# Each phase's commands run under pipefail: `a | tee f` fails when a does.
sh_c=(bash -o pipefail -c)

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$OUT/gpu.txt" 2>&1
for p in "${phases[@]}"; do
  case "$p" in
    build)
      # Only what the GPU phases run (the unit suite is for the CPU machines).
      # libexpseg_torch.so where meson found PyTorch (lib/torch/meson.build).
      targets="lib/libexpseg.so.0.1.0 tools/expseg tests/expseg_gpu tests/expseg_gpu_multi tests/expseg_ipc_child"
      if ! run_phase build 400 "${sh_c[@]}" "meson setup $B -Dbuildtype=release ${MESON_ARGS:-} && { ninja -C $B -t targets all | grep -q '^lib/torch/libexpseg_torch.so:' && t=lib/torch/libexpseg_torch.so; ninja -C $B $targets \${t:-}; }"; then
        tail -n 40 "$OUT/build.log"; finish
      fi ;;
    gpu)
      # The H200 machines allow pidfd_getfd: a refusal there is a failure, not the documented fallback.
      run_phase gpu 300 env EXPSEG_REQUIRE_PIDFD=1 "$B/tests/expseg_gpu" --duration=true ;;
    memcheck)
      # The suite provokes CUDA API errors on purpose (error-path tests): report memory errors only.
      run_phase memcheck 400 compute-sanitizer --tool memcheck --report-api-errors no --leak-check full --error-exitcode 3 "$B/tests/expseg_gpu" --test-suite-exclude=ipc ;;
    scenarios)
      run_phase scenarios 200 "${sh_c[@]}" "$B/tools/expseg scenario --all --device cuda:0 --json > $OUT/scenarios.jsonl && $B/tools/expseg scenario --all --device cuda:0 && $B/tools/expseg replay benchmarks/traces/resnet50-train-varsize.rmm.csv.gz --device cuda:0 --json | tee $OUT/replay.jsonl && $B/tools/expseg study --device cuda:0 --html $OUT/study-gpu.html | tail -n 12" ;;
    mixes)
      # The mixes of the unit test "other size mixes" through the CLI; the lowest fill column is
      # the least (live + request) / limit at which a request failed.
      run_phase mixes 200 "${sh_c[@]}" "for m in 1MiB-64MiB:3GiB 1MiB-32MiB:3GiB 2MiB-16MiB:3GiB 1MiB-4MiB:1GiB 4KiB-1MiB:64MiB; do
          for s in 1 2 3; do $B/tools/expseg scenario random-churn --device cuda:0 --sizes \${m%%:*} --conf limit:\${m##*:} --seed \$s --json || exit 1; done
        done > $OUT/mixes.jsonl && python3 benchmarks/mixes_table.py $OUT/mixes.jsonl" ;;
    bench)
      # Every repetition is reported (no --benchmark_report_aggregates_only: it drops a failed
      # repetition without a word); compare.py --check-bench lists failed runs and fails the phase.
      bargs=(--benchmark_format=console --benchmark_out="$OUT/bench.json" --benchmark_out_format=json)
      [ -n "${BENCH_FILTER:-}" ] && bargs+=(--benchmark_filter="$BENCH_FILTER")
      [ -n "${BENCH_REPS:-}" ] && bargs+=(--benchmark_repetitions="$BENCH_REPS" --benchmark_enable_random_interleaving=true)
      # shellcheck disable=SC2016  # the script's variables expand in the child, from its arguments
      run_phase bench 300 "${sh_c[@]}" '
        B=$1 OUT=$2 CPU=$3
        shift 3
        if ! ninja -C "$B" benchmarks/expseg_bench >"$OUT/bench-build.log" 2>&1; then
          tail -n 30 "$OUT/bench-build.log"
          echo "bench: ninja -C $B benchmarks/expseg_bench failed (bench-build.log)"
          exit 1
        fi
        # On the GPU machine: no silent fall-back to simulator figures when CUDA cannot be used.
        EXPSEG_BENCH_REQUIRE_CUDA=1 ${CPU:+taskset -c "$CPU"} "$B/benchmarks/expseg_bench" "$@"
        rc=$?
        [ $rc -ne 0 ] && echo "bench: expseg_bench exited with $rc"
        python3 benchmarks/compare.py --check-bench "$OUT/bench.json" || rc=1
        exit $rc' bench "$B" "$OUT" "${BENCH_CPU:-}" "${bargs[@]}" ;;
    compare)
      bj=(); [ -f "$OUT/bench.json" ] && bj=(--bench-json "$OUT/bench.json")
      run_phase compare 560 env EXPSEG_BENCH_REQUIRE_CUDA=1 python3 benchmarks/compare.py --bench "$B/benchmarks/expseg_bench" "${bj[@]}" --cli "$B/tools/expseg" \
        --lib "$LIB" --growth-reps 3 --deadline 540 --out "$OUT/compare" ;;
    workloads)
      run_phase workloads 560 env EXPSEG_LIBRARY="$LIB" PYTHONUNBUFFERED=1 python3 benchmarks/workloads.py --out "$OUT/workloads" ${WORKLOADS_ARGS:-} ;;
    torch)
      # Where libexpseg_torch.so was built, the tests take only torch.cuda.OutOfMemoryError for an OOM.
      # (Asked of the build's targets: a library left from an earlier configuration does not count.)
      require=0; ninja -C "$B" -t targets all 2>/dev/null | grep -q '^lib/torch/libexpseg_torch.so:' && require=1
      run_phase torch 900 env EXPSEG_LIBRARY="$LIB" EXPSEG_REQUIRE_TORCH_LIBRARY=$require "${sh_c[@]}" "python3 tests/gpu/torch_oom.py && python3 tests/gpu/torch_api.py && python3 tests/gpu/torch_compile.py" ;;
    cupy)
      run_phase cupy 200 env EXPSEG_LIBRARY="$LIB" python3 benchmarks/cupy_story.py ;;
    multi)
      run_phase multi 500 env BUILD_DIR="$B" EXPSEG_LIBRARY="$LIB" tests/gpu/run_multi_gpu.sh ;;
  esac
done
finish
