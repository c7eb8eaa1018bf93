// Streams at scale: a program with a stream per request (a server's request streams, a pipeline's
// short-lived streams) among thousands of others that hold memory. One iteration is the life of a
// short stream: an allocation on a stream expseg has not seen, its free, and release_stream() of it,
// with `held` other streams each keeping one 512 B block live. Simulated device (expseg's own cost,
// not the driver's: the first allocation on a stream maps memory, which the GPU pays per handle).
//
//   streams/<backend>:sim/held:<N>/new_stream_cycle
//   streams/<backend>:cuda/held:16/new_stream_cycle   when a CUDA device is usable: the driver's
//                                                      cost of a short stream's life (real streams;
//                                                      the short one is the same CUstream each
//                                                      time, new to expseg after release_stream)
//   streams/<backend>:<sim|cuda>/held:16/weights:4GiB/new_stream_cycle   the same while the program
//                                                      holds 4 GiB on its default stream (a model's
//                                                      weights): expandable's handles may then be
//                                                      16 MiB, and a small request growing a
//                                                      segment maps a growth granule
//
// Counters: driver_calls per cycle, and per driver call (calls_<name>); on the GPU also the time in
// the driver per cycle (driver_us) and per call (us_<name>). What grew with N before the
// fixes this guards: expandable's sweep of every arena per release, split_merge's sorted vector of
// per-stream indexes, whose insert and erase moved every entry after the stream's. And what it
// showed with few streams held: expandable's first 512 B on a new stream mapped a 20 MiB growth
// granule in ten one-frame handles (57 driver calls a cycle; now 12); with gigabytes held, in two
// handles (the request's frame and the granule's rest), where a stream's first growth now maps its
// frame alone.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "bench_fail.hpp"

namespace expseg::bench {

namespace {

stream_t fake_stream(std::size_t i) { return reinterpret_cast<stream_t>(static_cast<std::uintptr_t>(0x10000 + 16 * i)); }

void bm_new_stream_cycle(benchmark::State& st, BackendKind backend, std::size_t held, std::size_t weights, bool cuda) {
  // The only allocator of the process, as a server's: the previous benchmark's subject would be a
  // second expandable allocator, with which none keeps a released stream's range spare.
  Holder::instance().reset();
  Config cfg;
  cfg.backend = backend;
  cfg.device = cuda ? DeviceKind::cuda : DeviceKind::sim;
  if (!cuda) {
    cfg.sim_capacity = std::size_t{1} << 40;
    cfg.va_size = GiB;  // a segment per stream: 1 GiB of range each, not 2x the device
  }
  Allocator a(cfg);
  driver::Driver& drv = detail::AllocatorAccess::driver(a);
  // Real streams on the GPU (the held ones, and one short-lived stream used over and over: after
  // release_stream, expseg has forgotten it); numbers that are never synchronized on the simulator.
  std::vector<stream_t> real;
  auto stream_at = [&](std::size_t i) {
    if (!cuda) return fake_stream(i);
    while (real.size() <= i) real.push_back(drv.stream_create());
    return real[i];
  };
  std::vector<void*> kept;
  kept.reserve(held + 1);
  if (weights != 0) kept.push_back(a.allocate(weights, nullptr));
  for (std::size_t i = 0; i < held; ++i) kept.push_back(a.allocate(512, stream_at(i)));
  std::size_t next = held;
  const driver::CallStats calls0 = drv.call_stats();
  for (auto _ : st) {
    const stream_t s = cuda ? stream_at(held) : fake_stream(next++);
    a.deallocate(a.allocate(512, s));
    a.release_stream(s);
  }
  const driver::CallStats d = drv.call_stats().since(calls0);
  std::uint64_t calls = 0;
  for (std::uint64_t c : d.calls) calls += c;
  for (std::size_t op = 0; op < driver::kOpCount; ++op)
    if (d.calls[op] != 0) {
      const std::string op_name = driver::op_name(static_cast<driver::Op>(op));
      st.counters["calls_" + op_name] = benchmark::Counter(static_cast<double>(d.calls[op]), benchmark::Counter::kAvgIterations);
      if (cuda) st.counters["us_" + op_name] = benchmark::Counter(d.seconds[op] * 1e6, benchmark::Counter::kAvgIterations);
    }
  if (cuda) st.counters["driver_us"] = benchmark::Counter(d.total_seconds() * 1e6, benchmark::Counter::kAvgIterations);
  for (void* p : kept) a.deallocate(p);
  a.release_cached();
  for (stream_t s : real) drv.stream_destroy(s);
  st.counters["streams_held"] = static_cast<double>(held);
  st.counters["driver_calls"] = benchmark::Counter(static_cast<double>(calls), benchmark::Counter::kAvgIterations);
}

}  // namespace

void register_streams(bool quick, bool cuda) {
  for (const bool on_gpu : {false, true}) {
    if (on_gpu && !cuda) continue;
    for (BackendKind backend : {BackendKind::split_merge, BackendKind::expandable}) {
      for (std::size_t held : {std::size_t{16}, std::size_t{4000}, std::size_t{16000}}) {
        if (on_gpu && held != 16) continue;  // thousands of real streams: the simulator's figures say it
        for (std::size_t weights : {std::size_t{0}, std::size_t{4} * GiB}) {
          if (weights != 0 && held != 16) continue;
          const std::string name = std::string("streams/") + (backend == BackendKind::expandable ? "expandable" : "split_merge") +
                                   (on_gpu ? ":cuda" : ":sim") + "/held:" + std::to_string(held) +
                                   (weights != 0 ? "/weights:4GiB" : "") + "/new_stream_cycle";
          benchmark::RegisterBenchmark(name.c_str(), [name, backend, held, weights, on_gpu](benchmark::State& st) {
            guarded(st, name, [&] { bm_new_stream_cycle(st, backend, held, weights, on_gpu); });
          })
              ->Unit(benchmark::kMicrosecond)
              ->MinTime(quick ? 0.02 : 0.25)
              ->UseRealTime();
        }
      }
    }
  }
}

}  // namespace expseg::bench
