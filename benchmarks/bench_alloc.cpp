// The expseg benchmark suite: the same workloads over a factory per allocator.
//
// Allocators ("targets"), named `<allocator>:<device>` in benchmark names:
//   split_merge:sim, expandable:sim          always (the simulated device, bookkeeping mode)
//   split_merge:cuda, expandable:cuda        when a CUDA device is usable
//   cuMemAlloc:cuda, cuMemAllocAsync:cuda    baselines, when a CUDA device is usable
//   vmm_1handle:cuda                         growth baseline: one cuMemCreate+cuMemMap+cuMemSetAccess
// GPU benchmarks are not registered at all when expseg::driver::cuda_usable() is false (or when
// EXPSEG_BENCH_NO_CUDA is set), so the suite runs cleanly on a machine without a GPU.
//
// Workloads (benchmark name -> what the counters mean; times are wall-clock: UseRealTime or manual):
//   pair/<target>/<size>                 cached allocate+free of one size; ns_per_pair
//   pair/capi_<backend>:<device>/<size>  the same through expseg_malloc/expseg_free (the C API
//                                        PyTorch's CUDAPluggableAllocator and CuPy call)
//   churn64/<target>                     torch_anchor.py's 64-slot random churn; ns_per_step
//   churn_mt/<target>/<streams>/t<N>     N threads, each with its own 64 slots, on its own stream
//                                        (own_streams) or all on the default stream
//                                        (default_stream); items_per_second = aggregate steps/s,
//                                        ns_per_step = wall time / all threads' steps
//   driver_batching/vmm:cuda/<size>/handles:<N>/<each|range>
//                                        N handles mapped back to back; cuMemSetAccess and
//                                        cuMemUnmap per handle or once over the range; us per
//                                        phase (set_access_us, unmap_us, release_us)
//   growth/<target>/<size>               first allocation on a fresh allocator, only the allocate
//                                        call timed; median of repetitions (…_median), in µs
//   scenario/<name>/<target>             the library's scenario wall time (growing-buffer,
//                                        random-churn; OOM reports without the other-backend
//                                        check), median of repetitions, in ms; on the
//                                        simulator also modelled_driver_ms / estimated_h200_ms
//   replay/<target>/<trace>              replay of benchmarks/traces/*.rmm.csv.gz on the simulator;
//                                        events_per_second
//   slow_path/expandable:sim/frames:<N>/sizes:<range>/phase:<p>
//                                        one allocation that takes expandable's slow path under
//                                        a limit of N 2 MiB frames, CPU time (bench_slow_path.cpp)
//
// Repetitions: growth (20 on the simulator; 10 on the GPU, 5 at 16 GiB), scenario (5; 3 on the
// GPU) and driver_batching (3) set their own (2 each with EXPSEG_BENCH_QUICK=1), which
// --benchmark_repetitions does not change; the others run once unless --benchmark_repetitions=N.
// Every repetition is reported, then Google Benchmark's _mean/_median/_stddev/_cv of the
// successful ones; a failed repetition shows as an error (compare.py takes the median of the
// successful repetitions itself and lists the failed ones under errors), and once a benchmark
// failed its later repetitions fail too (fail_run says why).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <map>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "bench_common.hpp"
#include "bench_fail.hpp"
#include "driver/sim_driver.hpp"
#include "expseg/scenarios.hpp"
#include "expseg/trace.hpp"

#ifndef EXPSEG_BENCH_TRACE_DIR
#define EXPSEG_BENCH_TRACE_DIR "benchmarks/traces"
#endif

namespace expseg::bench {

driver::Driver& cuda_driver() {
  static driver::Driver* d = driver::make_cuda_driver(0).release();  // never destroyed, on purpose
  return *d;
}

namespace {

using Clock = std::chrono::steady_clock;

double seconds_between(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

// A counter that reads "nanoseconds per item": (seconds) / (iterations * items * 1e-9).
benchmark::Counter ns_per(double items_per_iteration) {
  return benchmark::Counter(items_per_iteration * 1e-9, benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}

std::string size_label(std::size_t bytes) {
  if (bytes >= GiB && bytes % GiB == 0) return std::to_string(bytes / GiB) + "GiB";
  if (bytes >= MiB && bytes % MiB == 0) return std::to_string(bytes / MiB) + "MiB";
  if (bytes >= KiB && bytes % KiB == 0) return std::to_string(bytes / KiB) + "KiB";
  return std::to_string(bytes) + "B";
}

// ---------------------------------------------------------------------------------------------
// Targets.

enum class Kind { expseg, cu_mem_alloc, cu_mem_alloc_async };

struct Target {
  std::string label;  // "expandable:sim"
  Kind kind = Kind::expseg;
  Config config;      // Kind::expseg
  bool cuda = false;
};

Config expseg_config(BackendKind backend, DeviceKind device) {
  Config c;  // defaults, not EXPSEG_ALLOC_CONF: the suite measures the documented defaults
  c.backend = backend;
  c.device = device;
  return c;
}

std::vector<Target> make_targets(bool cuda) {
  std::vector<Target> t;
  t.push_back({"split_merge:sim", Kind::expseg, expseg_config(BackendKind::split_merge, DeviceKind::sim), false});
  t.push_back({"expandable:sim", Kind::expseg, expseg_config(BackendKind::expandable, DeviceKind::sim), false});
  if (cuda) {
    t.push_back({"split_merge:cuda", Kind::expseg, expseg_config(BackendKind::split_merge, DeviceKind::cuda), true});
    t.push_back({"expandable:cuda", Kind::expseg, expseg_config(BackendKind::expandable, DeviceKind::cuda), true});
    t.push_back({"cuMemAlloc:cuda", Kind::cu_mem_alloc, Config{}, true});
    t.push_back({"cuMemAllocAsync:cuda", Kind::cu_mem_alloc_async, Config{}, true});
  }
  return t;
}

template <class S>
using Make = std::function<std::unique_ptr<S>()>;

// Calls f.template operator()<S>(target, make) with the subject type of the target.
template <class F>
void with_subject(const Target& t, F&& f) {
  switch (t.kind) {
    case Kind::expseg: {
      const Config cfg = t.config;
      f(t, Make<ExpsegSubject>([cfg] { return std::make_unique<ExpsegSubject>(cfg); }));
      break;
    }
    case Kind::cu_mem_alloc:
      f(t, Make<CuMemAllocSubject>([] { return std::make_unique<CuMemAllocSubject>(); }));
      break;
    case Kind::cu_mem_alloc_async:
      f(t, Make<CuMemAllocAsyncSubject>([] { return std::make_unique<CuMemAllocAsyncSubject>(); }));
      break;
  }
}

// The stream a single-threaded workload uses: the default stream, as PyTorch's raw_alloc does,
// except for cuMemAllocAsync, which runs on a stream of its own (as vmm_probe.cpp measured it).
template <class S>
stream_t single_stream(S& s) {
  if constexpr (std::is_same_v<S, CuMemAllocAsyncSubject>) return s.stream(0);
  else return nullptr;
}

// ---------------------------------------------------------------------------------------------
// Workloads.

// Cached allocate+free of one size: warmed once (the first allocation fills the cache), then each
// iteration is one pair.
template <class S>
void bm_pair(benchmark::State& st, const std::string& key, const Make<S>& make, std::size_t bytes) {
  guarded(st, key, [&] {
    S& s = Holder::instance().subject<S>(key, make);
    const stream_t stream = single_stream(s);
    void* w = s.alloc(bytes, stream);
    s.free(w, stream);
    for (auto _ : st) {
      void* p = s.alloc(bytes, stream);
      benchmark::DoNotOptimize(p);
      s.free(p, stream);
    }
    st.counters["ns_per_pair"] = ns_per(1);
    st.counters["bytes"] = static_cast<double>(bytes);
  });
}

// Cached allocate+free of 1 MiB while N other streams each hold a cross-stream free (record_stream)
// whose work has not finished: simulated device only (it holds a stream's work unfinished on
// demand), with the H200 latency model, so that what the pair asks the driver shows up beside its
// own time. split_merge asks about every stream's free each request, as PyTorch's malloc does;
// expandable about two streams' (its slow path completes all of them before mapping anything).
void bm_pair_pending(benchmark::State& st, const std::string& key, const Config& base, std::size_t nstreams) {
  guarded(st, key, [&] {
    Config cfg = base;
    cfg.sim_latency = true;
    Allocator a(cfg, 0);
    auto& sim = dynamic_cast<driver::SimDriver&>(detail::AllocatorAccess::driver(a));
    std::vector<stream_t> streams;
    for (std::size_t i = 0; i < nstreams; ++i) {
      streams.push_back(sim.stream_create());
      void* p = a.allocate(4096, nullptr);
      a.record_stream(p, streams.back());
      sim.set_stream_busy(streams.back(), true);
      a.deallocate(p);
    }
    a.deallocate(a.allocate(MiB, nullptr));
    const driver::CallStats before = sim.call_stats();
    std::uint64_t pairs = 0;
    for (auto _ : st) {
      void* p = a.allocate(MiB, nullptr);
      benchmark::DoNotOptimize(p);
      a.deallocate(p);
      ++pairs;
    }
    const driver::CallStats d = sim.call_stats().since(before);
    std::uint64_t calls = 0;
    for (std::uint64_t c : d.calls) calls += c;
    const double n = static_cast<double>(std::max<std::uint64_t>(pairs, 1));
    st.counters["ns_per_pair"] = ns_per(1);
    st.counters["driver_calls_per_pair"] = static_cast<double>(calls) / n;
    st.counters["modelled_driver_ns_per_pair"] = d.total_seconds() * 1e9 / n;
    for (stream_t s : streams) sim.set_stream_busy(s, false);
    a.release_cached();
    for (stream_t s : streams) sim.stream_destroy(s);
  });
}

// torch_anchor.py's churn, one step per iteration. The generator and the 64 slots live as long as
// the subject, so the sequence continues across Google Benchmark's calls; the first call warms the
// cache with 200000 untimed steps, as compare.py's PyTorch loop warms with an untimed pass of
// 200000. (With 20000, expandable still mapped and unmapped handles in the timed steps at a rate
// that fell over the first million steps, so the figure hung on the iteration count the host's
// speed chose, and repetitions differed.)
template <class S>
void bm_churn(benchmark::State& st, const std::string& key, const Make<S>& make, std::size_t warm) {
  guarded(st, key, [&] {
    bool fresh = false;
    S& s = Holder::instance().subject<S>(key, make, &fresh);
    // Lvalue arguments only: g++ 13's -Wdangling-reference flags a reference returned by a call
    // that was passed temporaries.
    const stream_t stream = single_stream(s);
    const std::uint64_t seed = 1;
    Churn<S>& churn = Holder::instance().state<Churn<S>>(s, stream, seed);
    if (fresh)
      for (std::size_t i = 0; i < warm; ++i) churn.step();
    std::int64_t maps_before = 0;
    driver::CallStats calls_before;
    if constexpr (std::is_same_v<S, ExpsegSubject>) {
      maps_before = s.allocator().stats().num_device_alloc;
      calls_before = detail::AllocatorAccess::driver(s.allocator()).call_stats();
    }
    std::uint64_t steps = 0;
    for (auto _ : st) {
      churn.step();
      ++steps;
    }
    st.counters["ns_per_step"] = ns_per(1);
    // Driver allocations (handles or segments) inside the timed steps: on a GPU each costs tens
    // of microseconds, so a few per million steps show in ns_per_step. driver_ns_per_step is their
    // share of a step (a GPU times each call; the simulated device gives its latency model's
    // figure, 0 without sim_latency), and the counts per million steps say which calls it is.
    if constexpr (std::is_same_v<S, ExpsegSubject>) {
      st.counters["device_allocs"] = static_cast<double>(s.allocator().stats().num_device_alloc - maps_before);
      const driver::CallStats d = detail::AllocatorAccess::driver(s.allocator()).call_stats().since(calls_before);
      const double n = static_cast<double>(std::max<std::uint64_t>(steps, 1));
      st.counters["driver_ns_per_step"] = d.total_seconds() * 1e9 / n;
      for (const driver::Op op : {driver::Op::create, driver::Op::map, driver::Op::set_access, driver::Op::unmap,
                                  driver::Op::release, driver::Op::event_record, driver::Op::event_query,
                                  driver::Op::stream_sync, driver::Op::mem_alloc, driver::Op::mem_free}) {
        const auto i = static_cast<std::size_t>(op);
        if (d.calls[i] == 0) continue;
        st.counters[std::string(driver::op_name(op)) + "_per_M"] = static_cast<double>(d.calls[i]) * 1e6 / n;
        st.counters[std::string(driver::op_name(op)) + "_us_each"] = d.seconds[i] * 1e6 / static_cast<double>(d.calls[i]);
      }
    }
  });
}

// N threads churn at once, each with its own 64 slots and generator (seed thread+1), each on its
// own stream or all on the default stream. One iteration: every thread warms up (`warm` untimed
// steps), the threads wait at a start line, then each runs `steps` steps; the iteration time is
// from the start signal to the last thread's last step (manual time). Thread start-up, warm-up
// and the final frees are not timed. A fresh subject first runs one untimed round, which fills its
// cache, as compare.py's PyTorch extension runs a cache-filling round before its timed ones (a
// repetition after the first gets a fresh subject and no new iteration count: its first round was
// timed on an empty cache).
template <class S>
double run_mt(S& s, const std::vector<stream_t>& streams, std::size_t steps, std::size_t warm) {
  const std::size_t n = streams.size();
  std::atomic<std::size_t> ready{0};
  std::atomic<bool> go{false};
  std::vector<Clock::time_point> end(n);
  std::vector<std::exception_ptr> errors(n);
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (std::size_t i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      bool counted = false;
      try {
        Churn<S> churn(s, streams[i], i + 1);
        for (std::size_t k = 0; k < warm; ++k) churn.step();
        ready.fetch_add(1, std::memory_order_acq_rel);
        counted = true;
        while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
        for (std::size_t k = 0; k < steps; ++k) churn.step();
        end[i] = Clock::now();
      } catch (...) {
        errors[i] = std::current_exception();
        if (!counted) ready.fetch_add(1, std::memory_order_acq_rel);
        end[i] = Clock::now();
      }
    });
  }
  while (ready.load(std::memory_order_acquire) < n) std::this_thread::yield();
  const Clock::time_point t0 = Clock::now();
  go.store(true, std::memory_order_release);
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
  return seconds_between(t0, *std::max_element(end.begin(), end.end()));
}

template <class S>
void bm_churn_mt(benchmark::State& st, const std::string& key, const Make<S>& make, std::size_t nthreads, bool own_streams,
                 std::size_t steps, std::size_t warm) {
  guarded(st, key, [&] {
    bool fresh = false;
    S& s = Holder::instance().subject<S>(key, make, &fresh);
    std::vector<stream_t> streams(nthreads, nullptr);
    if (own_streams)
      for (std::size_t i = 0; i < nthreads; ++i) streams[i] = s.stream(i);
    if (fresh) (void)run_mt(s, streams, steps, warm);
    for (auto _ : st) st.SetIterationTime(run_mt(s, streams, steps, warm));
    const double items = static_cast<double>(nthreads * steps);
    st.SetItemsProcessed(static_cast<std::int64_t>(st.iterations()) * static_cast<std::int64_t>(nthreads * steps));
    st.counters["ns_per_step"] = ns_per(items);
    st.counters["threads"] = static_cast<double>(nthreads);
  });
}

// First allocation of `bytes` on a fresh expseg allocator: construction and destruction are not
// timed, only allocate(). On the simulator the H200 latency model also says how much driver time
// the allocation would have cost (modelled_driver_us).
void bm_growth_expseg(benchmark::State& st, const std::string& name, const Config& base, std::size_t bytes) {
  guarded(st, name, [&] {
    Holder::instance().reset();  // no earlier benchmark's subject holds memory beside this one
    Config cfg = base;
    if (cfg.device == DeviceKind::sim) cfg.sim_latency = true;
    double modelled = 0.0;
    double handles = 0.0;
    for (auto _ : st) {
      Allocator a(cfg, 0);
      auto* sim = dynamic_cast<driver::SimDriver*>(&detail::AllocatorAccess::driver(a));
      const double m0 = sim ? sim->simulated_seconds() : 0.0;
      const Clock::time_point t0 = Clock::now();
      void* p = a.allocate(bytes);
      const Clock::time_point t1 = Clock::now();
      benchmark::DoNotOptimize(p);
      st.SetIterationTime(seconds_between(t0, t1));
      if (sim) modelled += sim->simulated_seconds() - m0;
      handles += static_cast<double>(a.stats().physical_handles.current);
      a.deallocate(p);
    }
    const double iters = static_cast<double>(std::max<benchmark::IterationCount>(st.iterations(), 1));
    if (cfg.device == DeviceKind::sim) st.counters["modelled_driver_us"] = modelled / iters * 1e6;
    st.counters["handles"] = handles / iters;
  });
}

// Baseline: cuMemAlloc of the same size (cuMemFree untimed).
void bm_growth_cu_mem_alloc(benchmark::State& st, const std::string& name, std::size_t bytes) {
  guarded(st, name, [&] {
    Holder::instance().reset();  // no earlier benchmark's subject holds memory beside this one
    driver::Driver& d = cuda_driver();
    for (auto _ : st) {
      const Clock::time_point t0 = Clock::now();
      driver::dev_ptr p = d.mem_alloc(bytes);
      const Clock::time_point t1 = Clock::now();
      st.SetIterationTime(seconds_between(t0, t1));
      d.mem_free(p);
    }
  });
}

// Baseline: the physical limit of growth, one cuMemCreate + cuMemMap + cuMemSetAccess of the whole
// size into a reservation made beforehand (cuMemUnmap + cuMemRelease untimed). The reservation is
// as large as an expandable segment's by default (2x device memory), mapped at its start: the same
// calls on the same kind of range as expseg's first growth makes (a range of exactly `bytes` was
// aligned differently, and came out slower than expseg's superset of these calls).
void bm_growth_vmm(benchmark::State& st, const std::string& name, std::size_t bytes) {
  guarded(st, name, [&] {
    Holder::instance().reset();  // no earlier benchmark's subject holds memory beside this one
    driver::Driver& d = cuda_driver();
    const std::size_t g = d.granularity();
    const std::size_t sz = (bytes + g - 1) / g * g;
    const std::size_t range = std::max(sz, (2 * d.mem_info().total + g - 1) / g * g);
    const driver::dev_ptr va = d.reserve(range);
    try {
      for (auto _ : st) {
        const Clock::time_point t0 = Clock::now();
        const driver::phys_handle h = d.create(sz);
        d.map(va, sz, h);
        d.set_access(va, sz);
        const Clock::time_point t1 = Clock::now();
        st.SetIterationTime(seconds_between(t0, t1));
        d.unmap(va, sz);
        d.release(h);
      }
    } catch (...) {
      try {
        d.free_reserve(va, range);
      } catch (...) {
      }
      throw;
    }
    d.free_reserve(va, range);
  });
}

// Why the expandable backend unmaps and grants access handle by handle: N handles of `bytes` each,
// mapped back to back, then cuMemSetAccess and cuMemUnmap either once per handle ("each") or once
// over the whole range ("range"), and cuMemRelease per handle; each phase timed alone, in us per
// iteration (counters). If one call over the range cost less than a call per handle, reclaiming
// neighbouring idle handles together would pay; on the H200 it does not (benchmarks/PERFORMANCE.md).
void bm_driver_batching(benchmark::State& st, const std::string& name, std::size_t bytes, int n, bool range) {
  guarded(st, name, [&] {
    Holder::instance().reset();  // no earlier benchmark's subject holds memory beside this one
    driver::Driver& d = cuda_driver();
    const std::size_t g = d.granularity();
    const std::size_t hb = (bytes + g - 1) / g * g;
    const std::size_t total = hb * static_cast<std::size_t>(n);
    const driver::dev_ptr va = d.reserve(total);
    std::vector<driver::phys_handle> handles;
    double set_access_us = 0.0, unmap_us = 0.0, release_us = 0.0;
    auto us_since = [](Clock::time_point t0) { return seconds_between(t0, Clock::now()) * 1e6; };
    try {
      for (auto _ : st) {
        for (int i = 0; i < n; ++i) {
          handles.push_back(d.create(hb));
          d.map(va + hb * static_cast<std::size_t>(i), hb, handles.back());
        }
        Clock::time_point t0 = Clock::now();
        if (range) {
          d.set_access(va, total);
        } else {
          for (int i = 0; i < n; ++i) d.set_access(va + hb * static_cast<std::size_t>(i), hb);
        }
        const double a = us_since(t0);
        t0 = Clock::now();
        if (range) {
          d.unmap(va, total);
        } else {
          for (int i = 0; i < n; ++i) d.unmap(va + hb * static_cast<std::size_t>(i), hb);
        }
        const double u = us_since(t0);
        t0 = Clock::now();
        for (driver::phys_handle h : handles) d.release(h);
        const double r = us_since(t0);
        handles.clear();
        st.SetIterationTime((a + u + r) * 1e-6);
        set_access_us += a;
        unmap_us += u;
        release_us += r;
      }
    } catch (...) {
      try {
        d.free_reserve(va, total);  // after a failure mid-way the handles may still be mapped: best effort
      } catch (...) {
      }
      throw;
    }
    d.free_reserve(va, total);
    const double iters = static_cast<double>(st.iterations());
    st.counters["set_access_us"] = set_access_us / iters;
    st.counters["unmap_us"] = unmap_us / iters;
    st.counters["release_us"] = release_us / iters;
  });
}

// A scenario of the library (run_scenario), timed by its own `seconds` (the story only). On the
// simulator the H200 latency model adds what the driver calls would have cost: the wall time on
// the simulator is the allocator's CPU time alone, which hides the expandable backend's map/unmap
// traffic (modelled_driver_ms; estimated_h200_ms = both).
void bm_scenario(benchmark::State& st, const std::string& key, const std::string& name, const Config& base) {
  guarded(st, key, [&] {
    Holder::instance().reset();  // no earlier benchmark's subject holds memory beside this one
    Config cfg = base;
    if (cfg.device == DeviceKind::sim) cfg.sim_latency = true;
    // The allocator, not its diagnostics: the other-backend check replays the live set on a
    // simulated allocator (at a scenario's first OOM; it took most of split_merge's time when it
    // ran at every one of random-churn's 13-18), which has no counterpart in PyTorch's OOM path
    // that compare.py sets it against.
    cfg.oom_counterfactual = false;
    double ooms = 0.0, peak_reserved = 0.0, device_allocs = 0.0, modelled = 0.0, wall = 0.0;
    for (auto _ : st) {
      const ScenarioResult r = run_scenario(name, cfg);
      st.SetIterationTime(r.seconds);
      ooms = static_cast<double>(r.ooms);
      peak_reserved = static_cast<double>(r.peak_reserved_bytes);
      device_allocs = static_cast<double>(r.device_allocs);
      modelled = r.driver_seconds;
      wall = r.seconds;
    }
    st.counters["ooms"] = ooms;
    st.counters["peak_reserved_MiB"] = peak_reserved / static_cast<double>(MiB);
    st.counters["device_allocs"] = device_allocs;
    if (cfg.device == DeviceKind::sim) {
      st.counters["modelled_driver_ms"] = modelled * 1e3;
      st.counters["estimated_h200_ms"] = (wall + modelled) * 1e3;
    }
  });
}

std::string trace_path() {
  if (const char* p = std::getenv("EXPSEG_BENCH_TRACE"); p && *p) return p;
  return std::string(EXPSEG_BENCH_TRACE_DIR) + "/resnet50-train-varsize.rmm.csv.gz";
}

// The trace, read and parsed once (outside every timed region); nullptr with `why` when unreadable.
const Trace* shared_trace(std::string* why) {
  static std::string error;
  static const std::unique_ptr<Trace> trace = []() -> std::unique_ptr<Trace> {
    try {
      return std::make_unique<Trace>(read_trace(trace_path()));
    } catch (const std::exception& e) {
      error = e.what();
      return nullptr;
    }
  }();
  if (!trace && why) *why = error;
  return trace.get();
}

// Replay of the trace on a fresh allocator per iteration; only replay()'s own loop is timed (its
// `seconds`: trace compilation, allocator construction and destruction are outside).
void bm_replay(benchmark::State& st, const std::string& name, const Config& cfg) {
  std::string why;
  const Trace* trace = shared_trace(&why);
  if (trace == nullptr) {
    fail_run(st, "cannot read the trace " + trace_path() + ": " + why);
    return;
  }
  guarded(st, name, [&] {
    Holder::instance().reset();  // no earlier benchmark's subject holds memory beside this one
    double ooms = 0.0, peak_reserved = 0.0, peak_allocated = 0.0;
    for (auto _ : st) {
      const ReplayResult r = replay(*trace, cfg);
      st.SetIterationTime(r.seconds);
      ooms = static_cast<double>(r.ooms);
      peak_reserved = static_cast<double>(r.peak_reserved_bytes);
      peak_allocated = static_cast<double>(r.peak_allocated_bytes);
    }
    const double events = static_cast<double>(trace->events.size());
    st.counters["events_per_second"] = benchmark::Counter(events, benchmark::Counter::kIsIterationInvariantRate);
    st.counters["events"] = events;
    st.counters["ooms"] = ooms;
    st.counters["reserved_over_allocated"] = peak_allocated > 0 ? peak_reserved / peak_allocated : 0.0;
  });
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Registration.

void register_slow_path(bool quick);  // bench_slow_path.cpp
void register_streams(bool quick, bool cuda);  // bench_streams.cpp

void register_all() {
  std::string why;
  bool cuda = driver::cuda_usable(&why);
  if (const char* off = std::getenv("EXPSEG_BENCH_NO_CUDA"); off && *off && std::string(off) != "0") {
    cuda = false;
    why = "EXPSEG_BENCH_NO_CUDA is set";
  }
  if (cuda) {
    try {
      benchmark::AddCustomContext("expseg_cuda_device", cuda_driver().device_name());
    } catch (const std::exception& e) {
      cuda = false;
      why = e.what();
    }
  }
  if (!cuda) {
    // A GPU session's run must not pass on simulator figures alone (gpu_session.sh sets it).
    if (const char* need = std::getenv("EXPSEG_BENCH_REQUIRE_CUDA"); need && *need && std::string(need) != "0") {
      std::fprintf(stderr, "expseg_bench: EXPSEG_BENCH_REQUIRE_CUDA is set but no CUDA device is usable (%s)\n", why.c_str());
      std::exit(1);
    }
    std::fprintf(stderr, "expseg_bench: no usable CUDA device (%s): GPU benchmarks are not registered\n", why.c_str());
    benchmark::AddCustomContext("expseg_cuda_device", "none (" + why + ")");
  }
  benchmark::AddCustomContext("expseg_trace", trace_path());
  // EXPSEG_BENCH_QUICK=1 (compare.py --quick): short runs that only check every benchmark works.
  const char* quick_env = std::getenv("EXPSEG_BENCH_QUICK");
  const bool quick = quick_env && *quick_env && std::string(quick_env) != "0";
  const double t_short = quick ? 0.02 : 0.25;  // MinTime of the pair and churn loops
  const std::size_t mt_div = quick ? 10 : 1;
  auto reps = [quick](int n) { return quick ? 2 : n; };
  if (quick) benchmark::AddCustomContext("expseg_quick", "1");

  const std::vector<Target> targets = make_targets(cuda);
  const std::size_t pair_sizes[] = {512, 1 * MiB, 16 * MiB, 256 * MiB};

  // Cached pairs.
  for (const Target& t : targets) {
    with_subject(t, [&]<class S>(const Target& tt, const Make<S>& make) {
      for (std::size_t bytes : pair_sizes) {
        const std::string name = "pair/" + tt.label + "/" + size_label(bytes);
        benchmark::RegisterBenchmark(name.c_str(), [name, make, bytes](benchmark::State& st) { bm_pair<S>(st, name, make, bytes); })
            ->MinTime(t_short)
            ->UseRealTime();
      }
    });
  }

  // Cached pairs through the C API.
  for (const Target& t : targets) {
    if (t.kind != Kind::expseg) continue;
    const std::string label = "capi_" + t.label;
    const std::string conf = std::string("backend:") + (t.config.backend == BackendKind::expandable ? "expandable" : "split_merge") +
                             (t.cuda ? ",device:cuda" : ",device:sim");
    const Make<CapiSubject> make([conf] { return std::make_unique<CapiSubject>(conf); });
    for (std::size_t bytes : pair_sizes) {
      const std::string name = "pair/" + label + "/" + size_label(bytes);
      benchmark::RegisterBenchmark(name.c_str(), [name, make, bytes](benchmark::State& st) { bm_pair<CapiSubject>(st, name, make, bytes); })
          ->MinTime(t_short)
          ->UseRealTime();
    }
  }

  // Cached pairs while other streams' frees wait for their work.
  for (const Target& t : targets) {
    if (t.kind != Kind::expseg || t.cuda) continue;
    for (std::size_t n : {std::size_t{1}, std::size_t{8}, std::size_t{64}}) {
      const std::string name = "pair_pending/" + t.label + "/streams:" + std::to_string(n);
      const Config cfg = t.config;
      benchmark::RegisterBenchmark(name.c_str(), [name, cfg, n](benchmark::State& st) { bm_pair_pending(st, name, cfg, n); })
          ->MinTime(t_short)
          ->UseRealTime();
    }
  }

  // 64-slot churn.
  for (const Target& t : targets) {
    with_subject(t, [&]<class S>(const Target& tt, const Make<S>& make) {
      const std::string name = "churn64/" + tt.label;
      const std::size_t warm = tt.kind == Kind::cu_mem_alloc ? 64 : 200000;
      benchmark::RegisterBenchmark(name.c_str(), [name, make, warm](benchmark::State& st) { bm_churn<S>(st, name, make, warm); })
          ->MinTime(t_short)
          ->UseRealTime();
    });
  }

  // Multi-threaded churn. cuMemAlloc serialises in the driver at tens of µs a call: fewer steps.
  for (const Target& t : targets) {
    with_subject(t, [&]<class S>(const Target& tt, const Make<S>& make) {
      const bool slow = tt.kind == Kind::cu_mem_alloc;
      const std::size_t steps = (slow ? 500 : 20000) / mt_div;
      const std::size_t warm = slow ? 64 : 5000 / mt_div;
      for (bool own : {true, false}) {
        for (std::size_t n : {1, 4, 16}) {
          const std::string name = "churn_mt/" + tt.label + (own ? "/own_streams/t" : "/default_stream/t") + std::to_string(n);
          benchmark::RegisterBenchmark(name.c_str(), [name, make, n, own, steps, warm](benchmark::State& st) {
            bm_churn_mt<S>(st, name, make, n, own, steps, warm);
          })
              ->UseManualTime()
              ->Unit(benchmark::kMillisecond)
              ->MinTime(quick ? 0.02 : 0.3);
        }
      }
    });
  }

  // Growth: first allocation on a fresh allocator, median of repetitions.
  const std::size_t growth_sizes[] = {64 * MiB, 1 * GiB, 16 * GiB};
  for (std::size_t bytes : growth_sizes) {
    const int reps_cuda = bytes >= 16 * GiB ? 5 : 10;
    for (const Target& t : targets) {
      if (t.kind != Kind::expseg) continue;
      const std::string name = "growth/" + t.label + "/" + size_label(bytes);
      const Config cfg = t.config;
      benchmark::RegisterBenchmark(name.c_str(), [name, cfg, bytes](benchmark::State& st) { bm_growth_expseg(st, name, cfg, bytes); })
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond)
          ->Iterations(1)
          ->Repetitions(reps(t.cuda ? reps_cuda : 20));
    }
    if (cuda) {
      const std::string cu_name = "growth/cuMemAlloc:cuda/" + size_label(bytes);
      benchmark::RegisterBenchmark(cu_name.c_str(), [cu_name, bytes](benchmark::State& st) { bm_growth_cu_mem_alloc(st, cu_name, bytes); })
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond)
          ->Iterations(1)
          ->Repetitions(reps(reps_cuda));
      const std::string vmm_name = "growth/vmm_1handle:cuda/" + size_label(bytes);
      benchmark::RegisterBenchmark(vmm_name.c_str(), [vmm_name, bytes](benchmark::State& st) { bm_growth_vmm(st, vmm_name, bytes); })
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond)
          ->Iterations(1)
          ->Repetitions(reps(reps_cuda));
    }
  }

  // Driver calls per handle or per range (see bm_driver_batching).
  if (cuda) {
    for (const std::size_t bytes : {2 * MiB, 32 * MiB}) {
      for (const int n : {1, 4, 16}) {
        for (const bool range : {false, true}) {
          if (n == 1 && range) continue;
          const std::string name = "driver_batching/vmm:cuda/" + size_label(bytes) + "/handles:" + std::to_string(n) + "/" +
                                   (range ? "range" : "each");
          benchmark::RegisterBenchmark(name.c_str(), [name, bytes, n, range](benchmark::State& st) { bm_driver_batching(st, name, bytes, n, range); })
              ->UseManualTime()
              ->Unit(benchmark::kMicrosecond)
              ->Iterations(20)
              ->Repetitions(reps(3));
        }
      }
    }
  }

  // The library's scenarios (issue 3: expandable no slower than split_merge there).
  for (const char* scenario : {"growing-buffer", "random-churn"}) {
    for (const Target& t : targets) {
      if (t.kind != Kind::expseg) continue;
      const std::string name = std::string("scenario/") + scenario + "/" + t.label;
      const Config cfg = t.config;
      const std::string sc = scenario;
      benchmark::RegisterBenchmark(name.c_str(), [name, sc, cfg](benchmark::State& st) { bm_scenario(st, name, sc, cfg); })
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond)
          ->Iterations(1)
          ->Repetitions(reps(t.cuda ? 3 : 5));
    }
  }

  // Replay throughput on the simulated device.
  for (const Target& t : targets) {
    if (t.kind != Kind::expseg || t.cuda) continue;
    const std::string name = "replay/" + t.label + "/resnet50-train-varsize";
    const Config cfg = t.config;
    benchmark::RegisterBenchmark(name.c_str(), [name, cfg](benchmark::State& st) { bm_replay(st, name, cfg); })
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond)
        ->MinTime(quick ? 0.02 : 0.5);
  }

  // The slow path at scale, on the simulated device.
  register_slow_path(quick);
  register_streams(quick, cuda);
}

}  // namespace expseg::bench
