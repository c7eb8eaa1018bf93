// Streams at scale: a program with a stream per request (a server's request streams, a pipeline's
// short-lived streams) among thousands of others that hold memory. One iteration is the life of a
// short stream: an allocation on a stream expseg has not seen, its free, and release_stream() of it,
// with `held` other streams each keeping one 512 B block live. Simulated device (expseg's own cost,
// not the driver's: the first allocation on a stream maps memory, which the GPU pays per handle).
//
//   streams/<backend>:sim/held:<N>/new_stream_cycle
//
// Counters: driver_calls per cycle, and per driver call (calls_<name>). What grew with N before the
// fixes this guards: expandable's sweep of every arena per release, split_merge's sorted vector of
// per-stream indexes, whose insert and erase moved every entry after the stream's. And what it
// showed with few streams held: expandable's first 512 B on a new stream mapped a 20 MiB growth
// granule in ten one-frame handles (57 driver calls a cycle; now 12).
#include <benchmark/benchmark.h>

#include <cstdint>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "bench_fail.hpp"

namespace expseg::bench {

namespace {

stream_t fake_stream(std::size_t i) { return reinterpret_cast<stream_t>(static_cast<std::uintptr_t>(0x10000 + 16 * i)); }

void bm_new_stream_cycle(benchmark::State& st, BackendKind backend, std::size_t held) {
  Config cfg;
  cfg.backend = backend;
  cfg.device = DeviceKind::sim;
  cfg.sim_capacity = std::size_t{1} << 40;
  cfg.va_size = GiB;  // a segment per stream: 1 GiB of range each, not 2x the device
  Allocator a(cfg);
  std::vector<void*> kept;
  kept.reserve(held);
  for (std::size_t i = 0; i < held; ++i) kept.push_back(a.allocate(512, fake_stream(i)));
  std::size_t next = held;
  const driver::CallStats calls0 = detail::AllocatorAccess::driver(a).call_stats();
  for (auto _ : st) {
    const stream_t s = fake_stream(next++);
    a.deallocate(a.allocate(512, s));
    a.release_stream(s);
  }
  const driver::CallStats d = detail::AllocatorAccess::driver(a).call_stats().since(calls0);
  std::uint64_t calls = 0;
  for (std::uint64_t c : d.calls) calls += c;
  for (std::size_t op = 0; op < driver::kOpCount; ++op)
    if (d.calls[op] != 0) st.counters[std::string("calls_") + driver::op_name(static_cast<driver::Op>(op))] = benchmark::Counter(static_cast<double>(d.calls[op]), benchmark::Counter::kAvgIterations);
  for (void* p : kept) a.deallocate(p);
  st.counters["streams_held"] = static_cast<double>(held);
  st.counters["driver_calls"] = benchmark::Counter(static_cast<double>(calls), benchmark::Counter::kAvgIterations);
}

}  // namespace

void register_streams(bool quick) {
  for (BackendKind backend : {BackendKind::split_merge, BackendKind::expandable}) {
    for (std::size_t held : {std::size_t{16}, std::size_t{4000}, std::size_t{16000}}) {
      const std::string name = std::string("streams/") + (backend == BackendKind::expandable ? "expandable" : "split_merge") +
                               ":sim/held:" + std::to_string(held) + "/new_stream_cycle";
      benchmark::RegisterBenchmark(name.c_str(), [name, backend, held](benchmark::State& st) {
        guarded(st, name, [&] { bm_new_stream_cycle(st, backend, held); });
      })
          ->Unit(benchmark::kMicrosecond)
          ->MinTime(quick ? 0.02 : 0.25)
          ->UseRealTime();
    }
  }
}

}  // namespace expseg::bench
