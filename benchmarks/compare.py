#!/usr/bin/env python3
"""expseg against the allocators users would pick instead, measured on one GPU machine in one run.

What it runs, in this order (each stage is optional and a failing stage never stops the others):
  1. expseg_bench (Google Benchmark, path in --bench, or its JSON from --bench-json): expseg
     split_merge / expandable on the simulator and on the GPU through the C++ API (Allocator) and
     the C API (expseg_malloc/expseg_free: pair/capi_*), cuMemAlloc and cuMemAllocAsync baselines, a
     single-handle cuMemCreate+cuMemMap+cuMemSetAccess for growth. JSON to <out>/expseg_bench.json.
     Every figure is the median of the benchmark's successful repetitions, computed here from the
     individual runs; a failed run is listed under errors.
  2. PyTorch's caching allocator, classic and expandable_segments:True, one subprocess each, on the
     same workloads through a small C++ extension (torch.utils.cpp_extension.load_inline, built once
     into --ext-dir and reused by every mode): raw_alloc/raw_delete for the cached pairs and the
     64-slot churn (the code of the PyTorch anchor measurement the issue figures come from), std::threads with
     raw_alloc_with_stream for the multi-threaded churn, and the growing-buffer and random-churn
     scenarios ported step for step from lib/scenarios.cpp under the same 3 GiB limit.
     Then the same extension's cached pairs and 64-slot churn (only those) in a process where
     tools/expseg.py install_torch() made expseg PyTorch's allocator first
     (torch.cuda.memory.CUDAPluggableAllocator over libexpseg.so's expseg_torch_malloc/expseg_free,
     backend from EXPSEG_ALLOC_CONF): raw_alloc/raw_delete then go through PyTorch's pluggable
     wrapper into expseg, the path a PyTorch user of expseg takes. One mode per backend (--lib,
     --skip-pluggable).
  3. PyTorch's first allocation of 64 MiB / 1 GiB / 16 GiB, one fresh process per measurement
     (as the PyTorch anchor measurement did), median of --growth-reps (the mean of two when 2).
  4. `expseg scenario growing-buffer random-churn --json` if the CLI exists (--cli).
Then prints one table: every workload, every allocator's figure, and ratios expseg / other
(< 1 means expseg is faster; for events/s it is the other way round and marked so), and writes
everything to JSON (--out: a directory, or a file name ending in .json). The last line is the
number of errors; the exit status is 1 when there was any.

Usage on the GPU machine (after `meson setup build-bench && ninja -C build-bench`):
  python3 benchmarks/compare.py --bench build-bench/benchmarks/expseg_bench \
      --cli build-bench/tools/expseg --lib build-bench/lib/libexpseg.so --out bench-results
Quick check that everything works (about a minute after the extension is built):
  python3 benchmarks/compare.py --quick ...
Check an expseg_bench JSON for failed runs (exit status 1 if any, or if it is unreadable):
  python3 benchmarks/compare.py --check-bench expseg_bench.json
Needs: python3 with torch (CUDA build) for stages 2-3; nothing else beyond the standard library.
"""
import argparse
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20
GiB = 1 << 30
PAIR_SIZES = [512, 1 * MiB, 16 * MiB, 256 * MiB]
GROWTH_SIZES = [64 * MiB, 1 * GiB, 16 * GiB]
MT_THREADS = [1, 4, 16]
MT_STEPS = 20000   # per thread per round, as expseg_bench's churn_mt
MT_WARM = 5000     # untimed steps per thread before each round, as expseg_bench
SCENARIO_LIMIT = 3 * GiB

# ------------------------------------------------------------------------------------------------
# The PyTorch extension. pair_ns and churn_ns are torch_anchor.py's alloc_free_ns and churn_ns.

EXT_NAME = "expseg_compare_ext"
EXT_FUNCTIONS = ["pair_ns", "churn_ns", "mt_churn_s", "growing_buffer", "random_churn"]
EXT_CPP = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <exception>
#include <thread>
#include <vector>

namespace {
using Clock = std::chrono::steady_clock;
c10::cuda::CUDACachingAllocator::CUDAAllocator* A() { return c10::cuda::CUDACachingAllocator::get(); }

struct AnchorRng {  // torch_anchor.py churn_ns
  uint64_t x;
  explicit AnchorRng(uint64_t seed) : x(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint64_t next() { x ^= x << 13; x ^= x >> 7; x ^= x << 17; return x; }
};

struct Churn {  // 64 slots; each step frees a slot's block and allocates 256 B .. 8 MiB
  AnchorRng rng;
  cudaStream_t stream;
  bool with_stream;
  void* slot[64] = {};
  Churn(uint64_t seed, cudaStream_t s, bool ws) : rng(seed), stream(s), with_stream(ws) {}
  ~Churn() { drain(); }
  void step() {
    int k = rng.next() % 64;
    if (slot[k]) { A()->raw_delete(slot[k]); slot[k] = nullptr; }
    size_t sz = size_t(256) << (rng.next() % 15);
    sz += rng.next() % sz;
    slot[k] = with_stream ? A()->raw_alloc_with_stream(sz, stream) : A()->raw_alloc(sz);
  }
  void drain() { for (auto& p : slot) if (p) { A()->raw_delete(p); p = nullptr; } }
};

struct ScenarioRng {  // expseg::ScenarioRng (splitmix64)
  uint64_t s;
  explicit ScenarioRng(uint64_t seed) : s(seed) {}
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  uint64_t below(uint64_t n) { return n ? next() % n : 0; }
  size_t log_uniform(double lo, double hi) { return static_cast<size_t>(std::exp2(lo + (hi - lo) * uniform())); }
};

void* try_alloc(size_t n) {
  try { return A()->raw_alloc(n); } catch (const c10::OutOfMemoryError&) { return nullptr; }
}
}  // namespace

// ns per cached raw_alloc+raw_delete pair, one value per repetition.
std::vector<double> pair_ns(int64_t size, int64_t iters, int64_t reps) {
  auto* a = A();
  void* w = a->raw_alloc(size); a->raw_delete(w);
  std::vector<double> out;
  for (int64_t r = 0; r < reps; r++) {
    auto t0 = Clock::now();
    for (int64_t i = 0; i < iters; i++) { void* p = a->raw_alloc(size); a->raw_delete(p); }
    auto t1 = Clock::now();
    out.push_back(std::chrono::duration<double, std::nano>(t1 - t0).count() / iters);
  }
  return out;
}

// torch_anchor.py churn_ns: an untimed pass, then a timed pass of `iters` steps; ns per step.
double churn_ns(int64_t iters, int64_t seed) {
  Churn c(seed, nullptr, false);
  for (int64_t i = 0; i < iters; i++) c.step();
  auto t0 = Clock::now();
  for (int64_t i = 0; i < iters; i++) c.step();
  auto t1 = Clock::now();
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / iters;
}

// The streams of the own-streams rounds: taken from PyTorch's pool once and reused by every round,
// as expseg_bench's threads reuse their subject's streams. getStreamFromPool hands out its 32
// streams round-robin: taken anew per round, every timed round ran on streams the cache-filling
// round had never used (only the round's own untimed steps had warmed their cache).
const std::vector<cudaStream_t>& pool_streams(size_t n) {
  static std::vector<cudaStream_t> s;
  while (s.size() < n) s.push_back(c10::cuda::getStreamFromPool(false).stream());
  return s;
}

// `threads` threads, each with its own 64 slots (seed thread+1), on its own stream from PyTorch's
// pool or all on the default stream: `warm` untimed steps each, a start line, then `steps` steps
// each. Seconds from the start signal to the last thread's last step (expseg_bench's run_mt).
double mt_churn_s(int64_t threads, int64_t steps, int64_t warm, bool own_streams) {
  const size_t n = static_cast<size_t>(threads);
  std::vector<cudaStream_t> streams(n, nullptr);
  if (own_streams)
    for (size_t i = 0; i < n; i++) streams[i] = pool_streams(n)[i];
  std::atomic<size_t> ready{0};
  std::atomic<bool> go{false};
  std::vector<Clock::time_point> end(n);
  std::vector<std::exception_ptr> errors(n);
  std::vector<std::thread> th;
  for (size_t i = 0; i < n; i++) {
    th.emplace_back([&, i] {
      bool counted = false;
      try {
        Churn c(i + 1, streams[i], true);
        for (int64_t k = 0; k < warm; k++) c.step();
        ready.fetch_add(1); counted = true;
        while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
        for (int64_t k = 0; k < steps; k++) c.step();
        end[i] = Clock::now();
      } catch (...) {
        errors[i] = std::current_exception();
        if (!counted) ready.fetch_add(1);
        end[i] = Clock::now();
      }
    });
  }
  while (ready.load(std::memory_order_acquire) < n) std::this_thread::yield();
  auto t0 = Clock::now();
  go.store(true, std::memory_order_release);
  for (auto& t : th) t.join();
  for (auto& e : errors) if (e) std::rethrow_exception(e);
  return std::chrono::duration<double>(*std::max_element(end.begin(), end.end()) - t0).count();
}

// lib/scenarios.cpp growing_buffer: {seconds, ooms}. The caller sets the memory fraction.
std::vector<double> growing_buffer() {
  const size_t MiB = size_t(1) << 20;
  double ooms = 0;
  auto t0 = Clock::now();
  void* x = try_alloc(64 * MiB);
  if (!x) ooms++;
  for (size_t i = 0; i < 400; ++i) {
    void* y = try_alloc(64 * MiB + (i + 1) * 3 * MiB + 12345);
    if (!y) { ooms++; break; }
    if (x) A()->raw_delete(x);
    x = y;
  }
  if (x) A()->raw_delete(x);
  auto t1 = Clock::now();
  return {std::chrono::duration<double>(t1 - t0).count(), ooms};
}

// lib/scenarios.cpp random_churn (seed 1): {seconds, ooms}.
std::vector<double> random_churn(int64_t seed) {
  ScenarioRng rng(seed);
  std::vector<void*> live;
  double ooms = 0;
  auto t0 = Clock::now();
  for (int step = 0; step < 6000; ++step) {
    if (!live.empty() && rng.uniform() < 0.45) {
      const size_t j = rng.below(live.size());
      A()->raw_delete(live[j]);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(j));
      continue;
    }
    const size_t size = rng.log_uniform(12, 29);
    void* p = try_alloc(size);
    if (p) { live.push_back(p); continue; }
    ooms++;
    for (size_t i = live.size(); i > 1; --i) std::swap(live[i - 1], live[rng.below(i)]);
    const size_t keep = live.size() / 2;
    for (size_t i = keep; i < live.size(); ++i) A()->raw_delete(live[i]);
    live.resize(keep);
  }
  for (void* p : live) A()->raw_delete(p);
  auto t1 = Clock::now();
  return {std::chrono::duration<double>(t1 - t0).count(), ooms};
}
"""


def cuda_include_dirs():
    dirs = []
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.path.isfile(os.path.join(root, "include", "cuda_runtime_api.h")):
            d = os.path.join(root, "include")
            if d not in dirs:
                dirs.append(d)
    return dirs


def load_extension(ext_dir, verbose=False):
    from torch.utils.cpp_extension import load_inline
    os.makedirs(ext_dir, exist_ok=True)
    return load_inline(EXT_NAME, cpp_sources=[EXT_CPP], functions=EXT_FUNCTIONS, verbose=verbose,
                       extra_cflags=["-O2"], extra_include_paths=cuda_include_dirs(), build_directory=ext_dir)


def median(v):
    return statistics.median(v) if v else None


# ------------------------------------------------------------------------------------------------
# Child processes (run by the parent with PYTORCH_CUDA_ALLOC_CONF set for the mode).

def torch_child(args):
    expseg = None
    if args.pluggable:
        # PyTorch's pluggable allocator over libexpseg.so, installed the way users do it
        # (tools/expseg.py install_torch: CUDAPluggableAllocator + change_current_allocator), before
        # anything touches CUDA; the library from $EXPSEG_LIBRARY and the backend from
        # $EXPSEG_ALLOC_CONF, both set by the parent. Every raw_alloc/raw_delete of the extension
        # then goes through PyTorch's wrapper (current device and stream, its mutex and pointer map)
        # into expseg_torch_malloc/expseg_free.
        sys.path.insert(0, os.path.join(REPO, "tools"))
        import expseg
        expseg.install_torch()
    import torch
    torch.cuda.init()
    torch.empty(1, device="cuda")
    t0 = time.perf_counter()
    m = load_extension(args.ext_dir, verbose=args.verbose)
    res = {"torch": torch.__version__, "ext_load_s": round(time.perf_counter() - t0, 1),
           "conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "errors": {}}
    tag = res["conf"] or "classic"
    if expseg is not None:
        res["pluggable"] = {"library": expseg.library_path(), "malloc": "expseg_torch_malloc", "free": "expseg_free",
                            "EXPSEG_ALLOC_CONF": os.environ.get("EXPSEG_ALLOC_CONF", ""), "expseg_config": expseg.config()}
        tag = "pluggable " + res["pluggable"]["EXPSEG_ALLOC_CONF"]
        want = "backend:" + args.pluggable
        if want not in res["pluggable"]["expseg_config"].split(","):
            res["errors"]["config"] = f"expseg's configuration is {res['pluggable']['expseg_config']!r}, not {want}"
    q = args.quick

    def allocations():  # expseg's count of allocations: the loops must have gone through it
        return expseg.stats().get("allocation.all.allocated", 0) if expseg is not None else 0

    def stage(name, fn):
        before = allocations()
        try:
            res[name] = fn()
            if expseg is not None and allocations() - before < (20000 if q else 200000):
                raise RuntimeError(f"expseg counted {allocations() - before} allocations in {name}: raw_alloc did "
                                   "not go through the pluggable allocator")
        except Exception as e:  # keep going: one failing workload must not hide the others
            res.pop(name, None)
            res["errors"][name] = repr(e)[:800]
        print(f"  [{tag}] {name}: {json.dumps(res.get(name))[:200]}", file=sys.stderr, flush=True)

    stage("pair_ns", lambda: {str(sz): median(m.pair_ns(sz, 20000 if q else 200000, 3)) for sz in PAIR_SIZES})
    stage("churn64_ns", lambda: median([m.churn_ns(20000 if q else 200000, 1) for _ in range(3)]))
    if expseg is not None:
        res["not_measured"] = ("churn_mt and the scenarios: only the cached pairs and the 64-slot churn run "
                               "through the pluggable allocator")
        print("RESULT " + json.dumps(res), flush=True)
        return

    def mt():
        out = {}
        steps, warm = (2000, 500) if q else (MT_STEPS, MT_WARM)
        for own in (True, False):
            for n in MT_THREADS:
                m.mt_churn_s(n, steps, warm, own)  # a first round fills the cache (cudaMalloc)
                secs = median([m.mt_churn_s(n, steps, warm, own) for _ in range(3)])
                out[f"{'own_streams' if own else 'default_stream'}/t{n}"] = {
                    "ns_per_step": secs / (n * steps) * 1e9, "items_per_second": n * steps / secs}
        return out
    stage("churn_mt", mt)

    def scenarios():
        out = {}
        total = torch.cuda.get_device_properties(0).total_memory
        for name, fn in (("growing-buffer", lambda: m.growing_buffer()), ("random-churn", lambda: m.random_churn(1))):
            runs = []
            for _ in range(1 if q else 3):
                torch.cuda.synchronize()
                torch.cuda.empty_cache()  # cached memory of earlier workloads would count against the limit
                torch.cuda.set_per_process_memory_fraction(SCENARIO_LIMIT / total)
                try:
                    runs.append(fn())
                finally:
                    torch.cuda.set_per_process_memory_fraction(1.0)
            out[name] = {"seconds": median([r[0] for r in runs]), "ooms": runs[-1][1]}
        torch.cuda.empty_cache()
        return out
    stage("scenario", scenarios)
    print("RESULT " + json.dumps(res), flush=True)


def growth_child(nbytes):
    import torch
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    del x
    t2 = time.perf_counter()
    y = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    t3 = time.perf_counter()
    del y
    s = torch.cuda.memory_stats()
    print("RESULT " + json.dumps(dict(bytes=nbytes, first_us=(t1 - t0) * 1e6, cached_us=(t3 - t2) * 1e6,
                                      device_allocs=s.get("num_device_alloc"))), flush=True)


# ------------------------------------------------------------------------------------------------
# Parent: stages.

TORCH_MODES = [("torch classic", ""), ("torch expandable", "expandable_segments:True")]
# PyTorch with expseg as its allocator through CUDAPluggableAllocator: (label, expseg backend).
PLUGGABLE_MODES = [("PyTorch pluggable + expseg split_merge", "split_merge"),
                   ("PyTorch pluggable + expseg expandable", "expandable")]


# time.monotonic() by which every child has ended (--deadline), or None: a caller that kills this
# script at its own limit (gpu_session.sh's phases) still gets the table of the stages that ran.
DEADLINE = None
DEADLINE_MARGIN_S = 15  # left for the table and compare.json after the last child


def run(cmd, env=None, timeout=None, capture=True):
    """subprocess.run, with its timeout cut to what --deadline leaves (TimeoutExpired carries the
    timeout it ran under; past the deadline a child is not started and times out at once)."""
    if DEADLINE is not None:
        left = DEADLINE - time.monotonic() - DEADLINE_MARGIN_S
        if left < 1:
            print("$ (not run: --deadline reached) " + " ".join(cmd), file=sys.stderr, flush=True)
            raise subprocess.TimeoutExpired(cmd, 0)
        timeout = left if timeout is None else min(timeout, left)
        timeout = int(timeout)
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd, env=env, timeout=timeout, text=True,
                          stdout=subprocess.PIPE if capture else None, stderr=subprocess.PIPE if capture else None)


def result_line(stdout):
    for line in reversed((stdout or "").splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return None


def is_bench_doc(doc):
    """Whether `doc` has the shape of Google Benchmark's JSON: an object whose "benchmarks" is a list
    of runs, each an object with a name."""
    return (isinstance(doc, dict) and isinstance(doc.get("benchmarks"), list)
            and all(isinstance(b, dict) and isinstance(b.get("name"), str) for b in doc["benchmarks"]))


def load_bench_json(path):
    """(document, problem): Google Benchmark's JSON from `path`. A file cut short (the benchmark
    killed while writing it) keeps the benchmarks written completely, and `problem` says so; an
    unreadable file gives (None, problem)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        return None, f"cannot read {path}: {e}"
    try:
        doc = json.loads(text)
    except ValueError as e:
        err = e
    else:
        return (doc, None) if is_bench_doc(doc) else (None, f"{path} is not Google Benchmark's JSON output (no "
                                                             f"\"benchmarks\" list of runs): was it written by expseg_bench "
                                                             f"--benchmark_out=FILE --benchmark_out_format=json?")
    # The JSON reporter writes one benchmark object after the other, each closed by "\n    }".
    cut = text.rfind("\n    }")
    if '"benchmarks": [' in text and cut > text.find('"benchmarks": ['):
        try:
            doc = json.loads(text[:cut] + "\n    }\n  ]\n}\n")
            if not is_bench_doc(doc):
                raise ValueError("not Google Benchmark's shape")
            runs = [b for b in doc.get("benchmarks", []) if b.get("run_type") != "aggregate"]
            return doc, (f"{path} is not valid JSON ({err}): cut short? kept the "
                         f"{len(runs)} runs written completely")
        except ValueError:
            pass
    if not text.strip():
        return None, f"{path} is empty"
    return None, f"{path} is not valid JSON: {err}"


def stage_bench(args, out_dir, report):
    if args.bench_json:
        doc, problem = load_bench_json(args.bench_json)
        if problem:
            report["errors"]["expseg_bench_json"] = problem
        return doc
    if not args.bench or not os.path.isfile(args.bench):
        report["errors"]["expseg_bench"] = f"expseg_bench not found at {args.bench!r} (build it, or pass --bench)"
        return None
    path = os.path.join(out_dir, "expseg_bench.json")
    try:
        os.remove(path)  # not a previous run's figures if this one writes none
    except OSError:
        pass
    cmd = [args.bench, "--benchmark_format=json", f"--benchmark_out={path}", "--benchmark_out_format=json"]
    if args.bench_filter:
        cmd.append(f"--benchmark_filter={args.bench_filter}")
    env = dict(os.environ, EXPSEG_BENCH_QUICK="1") if args.quick else None
    t0 = time.time()
    try:
        p = run(cmd, env=env, timeout=args.timeout)
    except subprocess.TimeoutExpired as e:
        report["timings"]["expseg_bench_s"] = round(time.time() - t0, 1)
        tail = e.stderr[-1500:] if isinstance(e.stderr, str) else (e.stderr or b"")[-1500:].decode(errors="replace")
        doc, problem = load_bench_json(path)
        report["errors"]["expseg_bench"] = (f"timed out after {e.timeout} s (--timeout or --deadline)"
                                            + (f"; {problem}" if doc else "") + (f"; stderr: {tail}" if tail else ""))
        return doc
    except OSError as e:
        report["errors"]["expseg_bench"] = f"cannot run {args.bench}: {e}"
        return None
    report["timings"]["expseg_bench_s"] = round(time.time() - t0, 1)
    sys.stderr.write(p.stderr[-4000:])
    doc, problem = load_bench_json(path)
    if doc is None:
        try:
            doc = json.loads(p.stdout)
            problem = None
        except ValueError:
            pass
    if problem:
        report["errors"]["expseg_bench"] = f"rc={p.returncode}: {problem}; stderr: {p.stderr[-1500:]}"
    if p.returncode != 0:
        report["errors"]["expseg_bench_rc"] = f"expseg_bench exited with {p.returncode}: {p.stderr[-1500:]}"
    return doc


def torch_available(args, report):
    """Whether --python (the interpreter of the PyTorch stages) has torch; once per run."""
    if getattr(args, "_torch_ok", None) is None:
        check = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('torch') else 3)"
        try:
            p = run([args.python, "-c", check], timeout=120)
            args._torch_ok = p.returncode == 0
            if p.returncode == 3:
                report["errors"]["torch"] = (f"torch is not installed for {args.python} (--python picks the interpreter; "
                                             "--skip-torch leaves PyTorch out)")
            elif p.returncode != 0:
                report["errors"]["torch"] = f"{args.python} -c '{check}': rc={p.returncode}: {p.stderr[-1500:]}"
        except (OSError, subprocess.TimeoutExpired) as e:
            args._torch_ok = False
            report["errors"]["torch"] = f"cannot run {args.python}: {e!r}"
    return args._torch_ok


def torch_modes(args, report):
    """(label, environment, extra child arguments) of every PyTorch child process to run."""
    modes = [(label, {"PYTORCH_CUDA_ALLOC_CONF": conf}, []) for label, conf in TORCH_MODES]
    if args.skip_pluggable:
        return modes
    if not args.lib or not os.path.isfile(args.lib):
        report["errors"]["PyTorch pluggable"] = (f"libexpseg.so not found at {args.lib!r} (build it, pass --lib or set "
                                                 "EXPSEG_LIBRARY; --skip-pluggable leaves these modes out)")
        return modes
    for label, backend in PLUGGABLE_MODES:
        # PYTORCH_CUDA_ALLOC_CONF is PyTorch's caching allocator's, which the pluggable one replaces.
        env = {"PYTORCH_CUDA_ALLOC_CONF": "", "EXPSEG_LIBRARY": os.path.abspath(args.lib),
               "EXPSEG_ALLOC_CONF": f"backend:{backend}"}
        modes.append((label, env, ["--pluggable", backend]))
    return modes


def stage_torch(args, report):
    out = {}
    if not torch_available(args, report):
        return out
    for i, (label, extra_env, extra_args) in enumerate(torch_modes(args, report)):
        env = dict(os.environ, **extra_env)
        cmd = [args.python, os.path.abspath(__file__), "--torch-child", "--ext-dir", args.ext_dir] + extra_args
        if args.quick:
            cmd.append("--quick")
        if args.verbose:
            cmd.append("--verbose")
        t0 = time.time()
        try:
            p = run(cmd, env=env, timeout=args.timeout)
        except subprocess.TimeoutExpired as e:
            report["errors"][label] = f"timed out after {e.timeout} s (--timeout or --deadline)"
            continue
        report["timings"][label + "_s"] = round(time.time() - t0, 1)
        sys.stderr.write(p.stderr[-3000:] if p.returncode == 0 else "")
        r = result_line(p.stdout)
        if r is None:
            report["errors"][label] = f"rc={p.returncode}: {p.stderr[-3000:]}"
            if i == 0 and "Error building extension" in (p.stderr or ""):
                report["errors"][label] += " (the extension did not build: the other modes are skipped)"
                break
            continue
        for k, v in r.get("errors", {}).items():
            report["errors"][f"{label}: {k}"] = v
        out[label] = r
    return out


def stage_growth(args, report):
    out = {}
    if not torch_available(args, report):
        return out
    for label, conf in TORCH_MODES:
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf)
        for nbytes in GROWTH_SIZES:
            runs = []
            for _ in range(args.growth_reps):
                try:
                    p = run([args.python, os.path.abspath(__file__), "--growth-child", str(nbytes)], env=env, timeout=300)
                except subprocess.TimeoutExpired as e:
                    report["errors"][f"{label} growth {nbytes}"] = f"timed out after {e.timeout} s"
                    continue
                r = result_line(p.stdout)
                if r is None:
                    report["errors"][f"{label} growth {nbytes}"] = f"rc={p.returncode}: {p.stderr[-1500:]}"
                    break
                runs.append(r)
            if runs:
                out.setdefault(label, {})[str(nbytes)] = {
                    "first_us": median([r["first_us"] for r in runs]),
                    "first_us_min": min(r["first_us"] for r in runs),
                    "cached_us": median([r["cached_us"] for r in runs]),
                    "device_allocs": runs[-1].get("device_allocs"), "reps": len(runs)}
    return out


def json_objects(text):
    """Every JSON object in `text`: a whole JSON document (object or list), or one per line."""
    text = (text or "").strip()
    try:
        doc = json.loads(text)
        return doc if isinstance(doc, list) else [doc]
    except Exception:
        pass
    objs = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                objs.append(json.loads(line))
            except Exception:
                pass
    return objs


def stage_cli(args, report):
    if not args.cli or not os.path.isfile(args.cli) or not os.access(args.cli, os.X_OK):
        report["notes"].append(f"expseg CLI not found at {args.cli!r}: CLI scenario wall times skipped")
        return None
    results = []
    base = [args.cli, "scenario", "growing-buffer", "random-churn", "--json"]
    try:
        p = run(base, env={k: v for k, v in os.environ.items() if k != "EXPSEG_ALLOC_CONF"}, timeout=args.timeout)
        results = [o for o in json_objects(p.stdout) if isinstance(o, dict)]
        if p.returncode != 0 and not results:
            report["errors"]["cli"] = f"rc={p.returncode}: {(p.stderr or p.stdout)[-1500:]}"
            return None
        # A CLI that runs one backend per call: run the other one through the documented variable.
        seen = {o.get("backend") for o in results}
        for backend in ("split_merge", "expandable"):
            if backend not in seen and seen:
                q = run(base, env=dict(os.environ, EXPSEG_ALLOC_CONF=f"backend:{backend}"), timeout=args.timeout)
                results += [o for o in json_objects(q.stdout) if isinstance(o, dict)]
    except Exception as e:
        report["errors"]["cli"] = repr(e)
    return results


# ------------------------------------------------------------------------------------------------
# Parsing Google Benchmark's JSON.

_DROP = re.compile(r"^(min_time|min_warmup_time|iterations|repeats|threads):")


def normalize(name):
    parts = [p for p in name.split("/") if p not in ("manual_time", "real_time") and not _DROP.match(p)]
    return "/".join(parts)


def to_unit(value, unit, want):
    scale = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
    return value * scale[unit] / scale[want]


# The fields of a run that say which run it is, not what it measured.
_RUN_META = {"family_index", "per_family_instance_index", "repetitions", "repetition_index", "threads", "iterations"}


def parse_bench(doc):
    """({normalized name: entry}, {what failed: error message}).

    An entry is the median of the benchmark's successful runs (repetitions), field by field
    (real_time, cpu_time and every counter), computed here from the individual runs, with
    "repetitions_used" and "repetitions_failed"; every failed run is an error, so a failed
    repetition never just thins out a median. A document with Google Benchmark's aggregates only
    (--benchmark_report_aggregates_only, ReportAggregatesOnly) gives its _median, which silently
    leaves failed repetitions out: "note" says so."""
    groups, aggregates, errors = {}, {}, {}
    for b in (doc or {}).get("benchmarks", []):
        key = normalize(b.get("run_name") or b["name"])
        if b.get("run_type") == "aggregate":
            if b.get("aggregate_name") == "median":
                aggregates[key] = b
            continue
        groups.setdefault(key, []).append(b)
    runs = {}
    for key, group in groups.items():
        ok = [b for b in group if not b.get("error_occurred")]
        for b in group:
            if b.get("error_occurred"):
                what = key if len(group) == 1 else f"{key} repetition {b.get('repetition_index', '?')}"
                errors[what] = b.get("error_message", "error")
        if not ok:
            continue
        entry = dict(ok[0])
        for field, value in ok[0].items():
            if field in _RUN_META or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            values = [b[field] for b in ok if isinstance(b.get(field), (int, float))]
            entry[field] = statistics.median(values)
        entry["repetitions_used"] = len(ok)
        entry["repetitions_failed"] = len(group) - len(ok)
        runs[key] = entry
    for key, b in aggregates.items():
        if key not in runs and key not in groups:
            runs[key] = dict(b, note="Google Benchmark's _median only: a failed repetition would not show")
    return runs, errors


# ------------------------------------------------------------------------------------------------
# The table.

# The columns: expseg through its C++ API (Allocator::allocate/deallocate) and, for the cached pairs,
# its C API (expseg_malloc/expseg_free, what PyTorch's and CuPy's hooks call); PyTorch with expseg
# through CUDAPluggableAllocator (pairs and churn64); PyTorch's own allocator; the CUDA baselines.
COLS = ["expseg split_merge", "expseg expandable", "expseg C API split_merge", "expseg C API expandable",
        PLUGGABLE_MODES[0][0], PLUGGABLE_MODES[1][0], "torch classic", "torch expandable", "cuMemAlloc",
        "cuMemAllocAsync", "vmm 1 handle"]
SHORT = {"expseg split_merge": "sm", "expseg expandable": "exp", "expseg C API split_merge": "capi sm",
         "expseg C API expandable": "capi exp", PLUGGABLE_MODES[0][0]: "plug sm", PLUGGABLE_MODES[1][0]: "plug exp",
         "torch classic": "torch cls", "torch expandable": "torch exp", "cuMemAlloc": "cuMemAlloc",
         "cuMemAllocAsync": "async", "vmm 1 handle": "vmm1"}
RATIOS = [("sm/torch cls", "expseg split_merge", "torch classic"),
          ("exp/torch exp", "expseg expandable", "torch expandable"),
          ("exp/torch cls", "expseg expandable", "torch classic"),
          ("plug sm/torch cls", PLUGGABLE_MODES[0][0], "torch classic"),
          ("plug exp/torch exp", PLUGGABLE_MODES[1][0], "torch expandable"),
          ("sm/async", "expseg split_merge", "cuMemAllocAsync"),
          ("exp/async", "expseg expandable", "cuMemAllocAsync"),
          ("exp/vmm1", "expseg expandable", "vmm 1 handle"),
          ("exp/sm", "expseg expandable", "expseg split_merge")]


def size_label(n):
    for unit, s in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= s and n % s == 0:
            return f"{n // s}{unit}"
    return f"{n}B"


def build_rows(runs, torch_res, growth_res, device):
    """Rows: (workload, unit, higher_is_better, {column: value}, target_fn). expseg on `device`."""
    rows = []

    def bench(name, field=None, unit=None):
        b = runs.get(name)
        if b is None:
            return None
        if field:
            return b.get(field)
        return to_unit(b["real_time"], b.get("time_unit", "ns"), unit)

    def cuda_bench(name, field=None, unit=None):
        # The CUDA baselines (cuMemAlloc, cuMemAllocAsync, one VMM handle) stand beside expseg on the
        # GPU only: beside the simulated device they would compare a model with a driver call.
        return bench(name, field, unit) if device == "cuda" else None

    def tget(label, *path):
        # PyTorch's figures are the GPU's: beside expseg on the simulated device they would compare a
        # model with a GPU run (a --bench-json made elsewhere, a filter without :cuda rows, no libcuda).
        if device != "cuda":
            return None
        v = torch_res.get(label)
        for p in path:
            if not isinstance(v, dict):
                return None
            v = v.get(p)
        return v

    for sz in PAIR_SIZES:
        lab = size_label(sz)
        vals = {"expseg split_merge": bench(f"pair/split_merge:{device}/{lab}", "ns_per_pair"),
                "expseg expandable": bench(f"pair/expandable:{device}/{lab}", "ns_per_pair"),
                "expseg C API split_merge": bench(f"pair/capi_split_merge:{device}/{lab}", "ns_per_pair"),
                "expseg C API expandable": bench(f"pair/capi_expandable:{device}/{lab}", "ns_per_pair"),
                "cuMemAlloc": cuda_bench(f"pair/cuMemAlloc:cuda/{lab}", "ns_per_pair"),
                "cuMemAllocAsync": cuda_bench(f"pair/cuMemAllocAsync:cuda/{lab}", "ns_per_pair")}
        for label, _ in TORCH_MODES + PLUGGABLE_MODES:
            vals[label] = tget(label, "pair_ns", str(sz))
        rows.append((f"pair {lab}", "ns/pair", False, vals, ("lt", 100)))
    vals = {"expseg split_merge": bench(f"churn64/split_merge:{device}", "ns_per_step"),
            "expseg expandable": bench(f"churn64/expandable:{device}", "ns_per_step"),
            "cuMemAlloc": cuda_bench("churn64/cuMemAlloc:cuda", "ns_per_step"),
            "cuMemAllocAsync": cuda_bench("churn64/cuMemAllocAsync:cuda", "ns_per_step")}
    for label, _ in TORCH_MODES + PLUGGABLE_MODES:
        vals[label] = tget(label, "churn64_ns")
    rows.append(("churn64", "ns/step", False, vals, ("lt", 250)))
    for streams in ("own_streams", "default_stream"):
        for n in MT_THREADS:
            key = f"{streams}/t{n}"
            vals = {"expseg split_merge": bench(f"churn_mt/split_merge:{device}/{key}", "ns_per_step"),
                    "expseg expandable": bench(f"churn_mt/expandable:{device}/{key}", "ns_per_step"),
                    "cuMemAlloc": cuda_bench(f"churn_mt/cuMemAlloc:cuda/{key}", "ns_per_step"),
                    "cuMemAllocAsync": cuda_bench(f"churn_mt/cuMemAllocAsync:cuda/{key}", "ns_per_step")}
            for label, _ in TORCH_MODES:
                vals[label] = tget(label, "churn_mt", key, "ns_per_step")
            target = ("mt", 0.25) if (n == 16 and streams == "own_streams") else None
            rows.append((f"churn_mt {streams} t{n}", "ns/step (all threads)", False, vals, target))
    for sz in GROWTH_SIZES:
        lab = size_label(sz)
        vals = {"expseg split_merge": bench(f"growth/split_merge:{device}/{lab}", unit="us"),
                "expseg expandable": bench(f"growth/expandable:{device}/{lab}", unit="us"),
                "cuMemAlloc": cuda_bench(f"growth/cuMemAlloc:cuda/{lab}", unit="us"),
                "vmm 1 handle": cuda_bench(f"growth/vmm_1handle:cuda/{lab}", unit="us")}
        for label, _ in TORCH_MODES:
            vals[label] = (growth_res.get(label) or {}).get(str(sz), {}).get("first_us") if device == "cuda" else None
        rows.append((f"growth {lab} (first alloc)", "µs", False, vals, ("vmm", 2.0) if sz == GiB and device == "cuda" else None))
    for sc in ("growing-buffer", "random-churn"):
        vals = {"expseg split_merge": bench(f"scenario/{sc}/split_merge:{device}", unit="ms"),
                "expseg expandable": bench(f"scenario/{sc}/expandable:{device}", unit="ms")}
        for label, _ in TORCH_MODES:
            s = tget(label, "scenario", sc, "seconds")
            vals[label] = s * 1e3 if s is not None else None
        rows.append((f"scenario {sc}", "ms", False, vals, ("sm", 1.0)))
        if device == "sim":  # the simulator's wall time has no driver time in it: add the H200 model's
            vals = {"expseg split_merge": bench(f"scenario/{sc}/split_merge:sim", "estimated_h200_ms"),
                    "expseg expandable": bench(f"scenario/{sc}/expandable:sim", "estimated_h200_ms")}
            rows.append((f"scenario {sc} + modelled driver", "ms", False, vals, ("sm", 1.0)))
    vals = {"expseg split_merge": bench("replay/split_merge:sim/resnet50-train-varsize", "events_per_second"),
            "expseg expandable": bench("replay/expandable:sim/resnet50-train-varsize", "events_per_second")}
    vals = {k: (v / 1e6 if v is not None else None) for k, v in vals.items()}
    rows.append(("replay resnet50 (sim)", "Mevents/s", True, vals, ("ge", 5.0)))
    return rows


def fmt(v):
    if v is None:
        return "-"
    if abs(v) >= 100000:
        return f"{v:,.0f}"
    if abs(v) >= 100:
        return f"{v:.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def target_text(vals, target, higher):
    if not target:
        return ""
    kind, x = target
    sm, ex = vals.get("expseg split_merge"), vals.get("expseg expandable")
    marks = []
    if kind in ("lt", "ge"):
        for name, v in (("sm", sm), ("exp", ex)):
            if v is not None:
                ok = v < x if kind == "lt" else v >= x
                marks.append(f"{name} {'ok' if ok else 'MISS'}")
        return f"{'<' if kind == 'lt' else '>='}{x:g}: " + ", ".join(marks)
    if kind == "mt":  # throughput >= 4x PyTorch's (its faster mode), i.e. ns/step <= 0.25x
        torch_vals = [vals.get(k) for k, _ in TORCH_MODES if vals.get(k)]
        if not torch_vals:
            return "throughput >=4x torch: no torch figure"
        torch_best = min(torch_vals)
        for name, v in (("sm", sm), ("exp", ex)):
            if v:
                marks.append(f"{name} {torch_best / v:.1f}x {'ok' if v <= x * torch_best else 'MISS'}")
        return "throughput >=4x torch: " + ", ".join(marks)
    if kind == "vmm":
        vmm = vals.get("vmm 1 handle")
        if vmm is None or ex is None:
            return "exp <= 2x vmm1: no figure"
        return f"exp <= 2x vmm1: {ex / vmm:.2f}x {'ok' if ex <= x * vmm else 'MISS'}"
    if kind == "sm":
        if sm is None or ex is None:
            return ""
        return f"exp <= sm: {'ok' if ex <= sm else 'MISS'}"
    return ""


def render(rows, title):
    # Columns and ratios without a figure in any row are left out (e.g. PyTorch's on a machine without it).
    cols = [c for c in COLS if any(vals.get(c) is not None for _, _, _, vals, _ in rows)]
    ratios = [r for r in RATIOS if any(vals.get(r[1]) is not None and vals.get(r[2]) for _, _, _, vals, _ in rows)]
    head = ["workload", "unit"] + [SHORT[c] for c in cols] + [r[0] for r in ratios] + ["target"]
    table = [head]
    for workload, unit, higher, vals, target in rows:
        line = [workload, unit] + [fmt(vals.get(c)) for c in cols]
        for _, a, b in ratios:
            va, vb = vals.get(a), vals.get(b)
            line.append(f"{va / vb:.2f}" if va is not None and vb else "-")
        line.append(target_text(vals, target, higher))
        table.append(line)
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    out = [title, ""]
    for i, r in enumerate(table):
        out.append(" | ".join(c.ljust(widths[j]) if j < 2 or j == len(head) - 1 else c.rjust(widths[j])
                              for j, c in enumerate(r)))
        if i == 0:
            out.append("-+-".join("-" * w for w in widths))
    return "\n".join(out)


def default_lib(bench):
    """libexpseg.so: $EXPSEG_LIBRARY, else the one in --bench's build folder, else <repo>/build/lib."""
    if os.environ.get("EXPSEG_LIBRARY"):
        return os.environ["EXPSEG_LIBRARY"]
    candidates = []
    if bench:
        candidates.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(bench))), "lib", "libexpseg.so"))
    candidates.append(os.path.join(REPO, "build", "lib", "libexpseg.so"))
    return next((c for c in candidates if os.path.isfile(c)), candidates[0])


def check_bench(path):
    """--check-bench: the failed runs of an expseg_bench JSON; 1 if any, or if the file is unreadable or cut short."""
    doc, problem = load_bench_json(path)
    runs, errors = parse_bench(doc)
    entries = (doc or {}).get("benchmarks", [])
    n_runs = sum(1 for b in entries if b.get("run_type") != "aggregate")
    for k, v in errors.items():
        print(f"failed: {k}: {v}")
    if problem:
        print(f"problem: {problem}")
    if any("note" in r for r in runs.values()):
        print("note: aggregates only (a failed repetition would not show): run without --benchmark_report_aggregates_only")
    print(f"{os.path.basename(path)}: {len(runs)} benchmarks, {n_runs} runs, {len(errors)} failed"
          + ("" if doc is not None and not problem else ", unreadable or cut short"))
    return 1 if errors or problem or doc is None else 0


def machine_info(bench_doc):
    info = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
            "python": sys.version.split()[0]}
    ctx = (bench_doc or {}).get("context", {})
    for k in ("host_name", "num_cpus", "mhz_per_cpu", "library_build_type", "expseg_cuda_device"):
        if k in ctx:
            info[k] = ctx[k]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    if shutil.which("nvidia-smi"):
        try:
            q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30)
            info["gpu"] = q.stdout.strip()
        except Exception:
            pass
    return info


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    default_bench = next((p for p in (os.path.join(root, d, "benchmarks", "expseg_bench") for d in ("build-bench", "build"))
                          if os.path.isfile(p)), os.path.join(root, "build-bench", "benchmarks", "expseg_bench"))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 1)[1])
    ap.add_argument("--bench", default=default_bench, help="expseg_bench binary (default: %(default)s)")
    ap.add_argument("--bench-json", help="use this expseg_bench JSON instead of running the benchmark")
    ap.add_argument("--bench-filter", help="passed to expseg_bench as --benchmark_filter")
    ap.add_argument("--cli", default=os.path.join(root, "build", "tools", "expseg"), help="expseg CLI (default: %(default)s)")
    ap.add_argument("--out", default="compare-out", help="directory for the results, or a .json file name (default: %(default)s)")
    ap.add_argument("--ext-dir", help="build directory of the PyTorch extension, reused by both modes and later runs "
                    "(default: $TMPDIR or /tmp, /expseg_torch_ext)")
    ap.add_argument("--python", default=sys.executable, help="python with torch, for the child processes")
    ap.add_argument("--lib", help="libexpseg.so for the PyTorch pluggable modes (default: $EXPSEG_LIBRARY, else "
                    "lib/libexpseg.so in --bench's build folder, else <repo>/build/lib/libexpseg.so)")
    ap.add_argument("--growth-reps", type=int, default=3,
                    help="fresh processes per PyTorch growth figure (their median; of 2, the mean) (default: %(default)s)")
    ap.add_argument("--skip-torch", action="store_true", help="no PyTorch workloads")
    ap.add_argument("--skip-pluggable", action="store_true",
                    help="no PyTorch pluggable modes (PyTorch with expseg through CUDAPluggableAllocator)")
    ap.add_argument("--check-bench", metavar="JSON", help="only check an expseg_bench JSON file: lists its failed runs; "
                    "exit status 1 if there is one, or if the file is unreadable or cut short")
    ap.add_argument("--skip-growth", action="store_true", help="no PyTorch growth processes")
    ap.add_argument("--skip-cli", action="store_true")
    ap.add_argument("--quick", action="store_true", help="short runs everywhere: checks that every stage works")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per child process")
    ap.add_argument("--deadline", type=int, help="seconds for the whole run: every child ends by then "
                    f"(less {DEADLINE_MARGIN_S} s to write the table), so a caller's limit of this many seconds "
                    "does not lose the stages that ran")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--torch-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--growth-child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--pluggable", choices=[b for _, b in PLUGGABLE_MODES], help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.check_bench:
        return check_bench(args.check_bench)
    if not args.lib:
        args.lib = default_lib(args.bench)

    if args.out.endswith(".json"):
        out_dir = os.path.dirname(os.path.abspath(args.out)) or "."
        out_json = os.path.abspath(args.out)
    else:
        out_dir = os.path.abspath(args.out)
        out_json = os.path.join(out_dir, "compare.json")
    if not args.ext_dir:
        # Not under --out: on the GPU machine --out is $OUT, whose files all travel back (8 at most).
        args.ext_dir = os.path.join(os.environ.get("TMPDIR", "/tmp"), "expseg_torch_ext")
    args.ext_dir = os.path.abspath(args.ext_dir)

    if args.torch_child:
        return torch_child(args)
    if args.growth_child:
        return growth_child(args.growth_child)

    os.makedirs(out_dir, exist_ok=True)
    global DEADLINE
    if args.deadline is not None:
        DEADLINE = time.monotonic() + args.deadline
    report = {"errors": {}, "notes": [], "timings": {}}
    t_start = time.time()
    bench_doc = stage_bench(args, out_dir, report)
    torch_res = {} if args.skip_torch else stage_torch(args, report)
    growth_res = {} if (args.skip_torch or args.skip_growth) else stage_growth(args, report)
    cli_res = None if args.skip_cli else stage_cli(args, report)
    report["timings"]["total_s"] = round(time.time() - t_start, 1)

    runs, bench_errors = parse_bench(bench_doc)
    for k, v in bench_errors.items():
        report["errors"][f"expseg_bench {k}"] = v
    if any("note" in r for r in runs.values()):
        report["notes"].append("the expseg_bench JSON has Google Benchmark's aggregates only for some benchmarks "
                               "(--benchmark_report_aggregates_only or ReportAggregatesOnly): their medians would "
                               "leave a failed repetition out without a word")
    has_cuda = any(k.split("/")[1].endswith(":cuda") for k in runs if k.count("/") >= 1)
    device = "cuda" if has_cuda else "sim"
    if not has_cuda and (torch_res or growth_res):
        report["errors"]["mixed_devices"] = ("PyTorch ran on the GPU but expseg_bench has no :cuda runs (no usable "
                                             "libcuda, EXPSEG_BENCH_NO_CUDA, a --bench-filter or a --bench-json "
                                             "without them): PyTorch's columns are left out of the simulated table")
    if bench_doc is not None and args.bench_json:
        made_on = (bench_doc.get("context") or {}).get("host_name")
        if made_on and made_on != platform.node():
            report["errors"]["bench_json_host"] = (f"{args.bench_json} was made on {made_on!r}, this is "
                                                   f"{platform.node()!r}: its figures and this machine's are "
                                                   "not one comparison")
    rows = build_rows(runs, torch_res, growth_res, device)
    info = machine_info(bench_doc)

    gpu = info.get("gpu") or ("" if str(info.get("expseg_cuda_device", "none")).startswith("none") else info["expseg_cuda_device"])
    when = info["date"]
    if args.bench_json:  # its figures were taken then, perhaps elsewhere
        ctx = (bench_doc or {}).get("context") or {}
        when += f" (expseg_bench JSON of {ctx.get('date', '?')}, host {ctx.get('host_name', '?')})"
    text = [render(rows, f"expseg ({'GPU' if has_cuda else 'SIMULATED device: no GPU figures'}) vs the others — "
                   f"{gpu or 'no GPU'}, {info.get('cpu', '')}, {when}")]
    text.append("ratios are expseg / other: < 1 means expseg is faster (replay: Mevents/s, higher is better). "
                "sm = expseg split_merge, exp = expseg expandable (C++ API: Allocator::allocate/deallocate), "
                "capi = the same through the C API (expseg_malloc/expseg_free), plug = PyTorch with expseg as its "
                "allocator (CUDAPluggableAllocator, tools/expseg.py install_torch: raw_alloc/raw_delete through "
                "PyTorch's wrapper into expseg), torch cls/exp = PyTorch's caching allocator, async = cuMemAllocAsync, "
                "vmm1 = one cuMemCreate+cuMemMap+cuMemSetAccess of the whole size. Figures: the median of the "
                "repetitions (expseg_bench: of the successful ones).")
    if has_cuda:
        sim_rows = build_rows(runs, {}, {}, "sim")
        text.append("")
        text.append(render([r for r in sim_rows if not r[0].startswith("growth")] +
                           [r for r in sim_rows if r[0].startswith("growth")],
                           "expseg on the simulated device (this CPU, no driver calls)"))
    if cli_res:
        text.append("")
        text.append("expseg CLI scenarios (wall seconds):")
        for o in cli_res:
            text.append(f"  {o.get('scenario', '?'):16} {o.get('backend', '?'):12} {o.get('device', '?'):8} "
                        f"seconds={o.get('seconds')} ooms={o.get('ooms')} peak_reserved={o.get('peak_reserved_bytes')}")
    if report["errors"]:
        text.append("")
        text.append("errors:")
        for k, v in report["errors"].items():
            v = str(v).rstrip()
            text.append(f"  {k}: {v if len(v) <= 700 else v[:200] + ' [...] ' + v[-500:]}")  # a traceback ends with its error
    for n in report["notes"]:
        text.append("note: " + n)
    text.append(f"timings: {json.dumps(report['timings'])}")
    printed = "\n".join(text)
    print("\n" + printed)

    doc = {"machine": info, "device": device, "rows": [
        {"workload": w, "unit": u, "higher_is_better": h, "values": v, "target": target_text(v, t, h)}
        for w, u, h, v, t in rows], "torch": torch_res, "torch_growth": growth_res, "cli": cli_res,
        "expseg_bench_json": os.path.join(out_dir, "expseg_bench.json") if bench_doc and not args.bench_json else args.bench_json,
        "errors": report["errors"], "notes": report["notes"], "timings": report["timings"], "table": printed}
    with open(out_json, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"\nwritten: {out_json}")
    n = len(report["errors"])
    print(f"errors: {n}" + (' (under "errors:" above and in compare.json)' if n else ""))
    return 1 if n else 0


if __name__ == "__main__":
    sys.exit(main() or 0)
