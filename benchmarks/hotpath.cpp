// expseg_hotpath: runs one hot path a fixed number of times on the simulated device, for profilers
// (callgrind counts instructions per operation exactly; perf stat counts cycles), where Google
// Benchmark's adaptive iteration counts get in the way.
//
//   expseg_hotpath pair  <split_merge|expandable> [iterations] [bytes]   cached allocate+free
//   expseg_hotpath churn <split_merge|expandable> [iterations]           torch_anchor's 64-slot churn
//   expseg_hotpath wide  <split_merge|expandable> [iterations] [handles] cached allocate+free of one
//                                                                        block over [handles] (512)
//                                                                        2 MiB handles
//   expseg_hotpath replay <split_merge|expandable> [iterations] [trace]  replay() of a trace (default:
//                                                                        the shipped ResNet-50 trace)
//   expseg_hotpath capi  <split_merge|expandable> [iterations] [bytes]   cached expseg_malloc+expseg_free
//                                                                        (what PyTorch's pluggable allocator calls)
//   expseg_hotpath cupy  <split_merge|expandable> [iterations] [bytes]   cached expseg_cupy_malloc+free
//
// The cache is warmed first (one pair; 20000 churn steps); only hot_loop() runs the measured part:
//   valgrind --tool=callgrind --toggle-collect='*hot_loop*' build/benchmarks/expseg_hotpath churn expandable 200000
// Prints the wall time per operation (meaningless under valgrind) and, for churn, the driver
// allocations inside the measured loop (none on the simulator's cost, tens of µs each on a GPU)
// and the driver calls' time per kind of call.
// Where the kernel lets a process count its own events (perf_event_open), the pair and churn loops
// also print cycles, instructions, branch misses and L1d load misses per operation: what a host
// without a `perf` binary (a GPU machine's container) can still say about where the time goes.
// EXPSEG_ALLOC_CONF is applied first (e.g. device:cuda to time the cached paths over a real
// device's segments; the backend argument still picks the backend; the default device is sim).
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "expseg/expseg.h"
#include "expseg/trace.hpp"

#if defined(__linux__)
#include <linux/perf_event.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#ifndef EXPSEG_BENCH_TRACE_DIR
#define EXPSEG_BENCH_TRACE_DIR "benchmarks/traces"
#endif

namespace {

using expseg::bench::Churn;
using expseg::bench::ExpsegSubject;

[[gnu::noinline]] void hot_loop_pair(ExpsegSubject& s, std::size_t bytes, long iterations) {
  for (long i = 0; i < iterations; ++i) {
    void* p = s.alloc(bytes, nullptr);
    asm volatile("" : : "r"(p) : "memory");
    s.free(p, nullptr);
  }
}

// The C API pairs: what PyTorch's CUDAPluggableAllocator and CuPy's CFunctionAllocator call.
// Return the allocations that failed (NULL): a failed call is no pair, and the run says so.
[[gnu::noinline]] long hot_loop_capi(std::size_t bytes, long iterations) {
  long failed = 0;
  for (long i = 0; i < iterations; ++i) {
    void* p = expseg_malloc(static_cast<ssize_t>(bytes), 0, nullptr);
    asm volatile("" : : "r"(p) : "memory");
    failed += p == nullptr;
    expseg_free(p, static_cast<ssize_t>(bytes), 0, nullptr);
  }
  return failed;
}

[[gnu::noinline]] long hot_loop_cupy(std::size_t bytes, long iterations) {
  long failed = 0;
  for (long i = 0; i < iterations; ++i) {
    void* p = expseg_cupy_malloc(nullptr, bytes, 0);
    asm volatile("" : : "r"(p) : "memory");
    failed += p == nullptr;
    expseg_cupy_free(nullptr, p, 0);
  }
  return failed;
}

[[gnu::noinline]] void hot_loop_churn(Churn<ExpsegSubject>& c, long iterations) {
  for (long i = 0; i < iterations; ++i) c.step();
}

[[gnu::noinline]] double hot_loop_replay(const expseg::Trace& trace, const expseg::Config& cfg, long iterations) {
  double seconds = 0.0;
  for (long i = 0; i < iterations; ++i) seconds += expseg::replay(trace, cfg).seconds;
  return seconds;
}

// Hardware counters of this thread, user space only; silently absent where the kernel or the
// virtual machine does not offer them.
class Counters {
 public:
  Counters() {
#if defined(__linux__)
    const std::pair<std::uint32_t, std::uint64_t> events[kEvents] = {
        {PERF_TYPE_HARDWARE, PERF_COUNT_HW_CPU_CYCLES},
        {PERF_TYPE_HARDWARE, PERF_COUNT_HW_INSTRUCTIONS},
        {PERF_TYPE_HARDWARE, PERF_COUNT_HW_BRANCH_MISSES},
        {PERF_TYPE_HW_CACHE, PERF_COUNT_HW_CACHE_L1D | (PERF_COUNT_HW_CACHE_OP_READ << 8) | (PERF_COUNT_HW_CACHE_RESULT_MISS << 16)},
    };
    for (int i = 0; i < kEvents; ++i) {
      perf_event_attr attr{};
      attr.size = sizeof attr;
      attr.type = events[i].first;
      attr.config = events[i].second;
      attr.disabled = 1;
      attr.exclude_kernel = 1;
      attr.exclude_hv = 1;
      fd_[i] = static_cast<int>(syscall(SYS_perf_event_open, &attr, 0, -1, -1, 0));
    }
#endif
  }
  ~Counters() {
#if defined(__linux__)
    for (int fd : fd_)
      if (fd >= 0) close(fd);
#endif
  }
  Counters(const Counters&) = delete;
  Counters& operator=(const Counters&) = delete;
  void start() {
#if defined(__linux__)
    for (int fd : fd_)
      if (fd >= 0) {
        ioctl(fd, PERF_EVENT_IOC_RESET, 0);
        ioctl(fd, PERF_EVENT_IOC_ENABLE, 0);
      }
#endif
  }
  void stop() {
#if defined(__linux__)
    for (int i = 0; i < kEvents; ++i)
      if (fd_[i] >= 0) {
        ioctl(fd_[i], PERF_EVENT_IOC_DISABLE, 0);
        if (read(fd_[i], &value_[i], sizeof value_[i]) != static_cast<ssize_t>(sizeof value_[i])) value_[i] = -1;
      }
#endif
  }
  // One line per operation, or a line saying why there is none.
  void print(long operations) const {
    static const char* const names[kEvents] = {"cycles", "instructions", "branch misses", "L1d load misses"};
    std::string line;
    for (int i = 0; i < kEvents; ++i) {
      if (fd_[i] < 0 || value_[i] < 0) continue;
      char part[96];
      std::snprintf(part, sizeof part, "%s%.1f %s", line.empty() ? "" : ", ", static_cast<double>(value_[i]) / static_cast<double>(operations ? operations : 1),
                    names[i]);
      line += part;
    }
    if (line.empty()) std::printf("hardware counters: not available here (perf_event_open refused)\n");
    else std::printf("per operation: %s\n", line.c_str());
  }

 private:
  static constexpr int kEvents = 4;
  int fd_[kEvents] = {-1, -1, -1, -1};
  long long value_[kEvents] = {-1, -1, -1, -1};
};

int usage() {
  std::fprintf(stderr, "usage: expseg_hotpath pair|churn|wide|replay|capi|cupy split_merge|expandable [iterations] [bytes|trace]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) return usage();
  const std::string workload = argv[1];
  const std::string backend = argv[2];
  const long iterations = argc > 3 ? std::atol(argv[3]) : 1000000;
  const std::size_t bytes = argc > 4 ? std::strtoull(argv[4], nullptr, 10) : 512;
  expseg::Config cfg = expseg::Config::from_env();
  if (const char* conf = std::getenv("EXPSEG_ALLOC_CONF"); conf == nullptr || std::strstr(conf, "device:") == nullptr)
    cfg.device = expseg::DeviceKind::sim;
  if (backend == "split_merge") cfg.backend = expseg::BackendKind::split_merge;
  else if (backend == "expandable") cfg.backend = expseg::BackendKind::expandable;
  else return usage();

  if (workload == "capi" || workload == "cupy") {
    // The C API's allocators take their configuration from EXPSEG_ALLOC_CONF and expseg_configure.
    const std::string conf = std::string("backend:") + backend + (cfg.device == expseg::DeviceKind::sim ? ",device:sim" : "");
    if (expseg_configure(conf.c_str()) != EXPSEG_SUCCESS) {
      std::fprintf(stderr, "expseg_configure(%s): %s\n", conf.c_str(), expseg_last_error());
      return 1;
    }
    const bool cupy = workload == "cupy";
    void* warm = cupy ? expseg_cupy_malloc(nullptr, bytes, 0) : expseg_malloc(static_cast<ssize_t>(bytes), 0, nullptr);
    if (warm == nullptr) {
      std::fprintf(stderr, "%s: the warm-up allocation of %zu B failed: %s\n", workload.c_str(), bytes, expseg_last_error());
      return 1;
    }
    if (cupy) expseg_cupy_free(nullptr, warm, 0);
    else expseg_free(warm, 0, 0, nullptr);
    Counters counters;
    const auto w = std::chrono::steady_clock::now();
    counters.start();
    const long failed = cupy ? hot_loop_cupy(bytes, iterations) : hot_loop_capi(bytes, iterations);
    counters.stop();
    const auto t1 = std::chrono::steady_clock::now();
    if (failed != 0) {
      std::fprintf(stderr, "%s: %ld of %ld allocations failed (%s): no figure\n", workload.c_str(), failed, iterations, expseg_last_error());
      return 1;
    }
    counters.print(iterations);
    std::printf("%s %s %zu B: %.1f ns/pair over %ld\n", workload.c_str(), backend.c_str(), bytes,
                std::chrono::duration<double, std::nano>(t1 - w).count() / static_cast<double>(iterations ? iterations : 1), iterations);
    return 0;
  }
  if (workload == "wide") cfg.max_handle_size = std::size_t{2} << 20;  // memory that grew in small handles
  ExpsegSubject s(cfg);
  if (workload == "wide") {
    // Grows `handles` blocks of 2 MiB (one handle each on expandable), frees them into one free
    // block, then times a cached pair of one block covering all of them.
    const std::size_t handles = argc > 4 ? std::strtoull(argv[4], nullptr, 10) : 512;
    const std::size_t frame = std::size_t{2} << 20;
    std::vector<void*> ps;
    for (std::size_t i = 0; i < handles; ++i) ps.push_back(s.alloc(frame, nullptr));
    for (void* p : ps) s.free(p, nullptr);
    const std::size_t wide_bytes = handles * frame;
    s.free(s.alloc(wide_bytes, nullptr), nullptr);
    const auto before = s.allocator().stats();
    const auto w = std::chrono::steady_clock::now();
    hot_loop_pair(s, wide_bytes, iterations);
    const auto t1 = std::chrono::steady_clock::now();
    const auto after = s.allocator().stats();
    std::printf("driver calls in the loop: %lld maps, %lld unmaps\n", static_cast<long long>(after.num_device_alloc - before.num_device_alloc),
                static_cast<long long>(after.num_device_free - before.num_device_free));
    std::printf("wide %s %zu x 2 MiB: %.1f ns/pair over %ld\n", backend.c_str(), handles,
                std::chrono::duration<double, std::nano>(t1 - w).count() / static_cast<double>(iterations ? iterations : 1), iterations);
  } else if (workload == "pair") {
    s.free(s.alloc(bytes, nullptr), nullptr);
    Counters counters;
    const auto w = std::chrono::steady_clock::now();
    counters.start();
    hot_loop_pair(s, bytes, iterations);
    counters.stop();
    const auto t1 = std::chrono::steady_clock::now();
    counters.print(iterations);
    std::printf("pair %s %zu B: %.1f ns/pair over %ld\n", backend.c_str(), bytes,
                std::chrono::duration<double, std::nano>(t1 - w).count() / static_cast<double>(iterations ? iterations : 1), iterations);
  } else if (workload == "churn") {
    Churn<ExpsegSubject> c(s, nullptr, 1);
    for (int i = 0; i < 20000; ++i) c.step();
    const auto before = s.allocator().stats();
    const expseg::driver::Driver& drv = expseg::detail::AllocatorAccess::driver(s.allocator());
    const expseg::driver::CallStats calls_before = drv.call_stats();
    Counters counters;
    const auto w = std::chrono::steady_clock::now();
    counters.start();
    hot_loop_churn(c, iterations);
    counters.stop();
    const auto t1 = std::chrono::steady_clock::now();
    counters.print(iterations);
    const auto after = s.allocator().stats();
    // Driver calls in the timed loop: on a GPU each costs tens of microseconds. Their time, per
    // kind, says how much of a step is the driver's and how much the allocator's own.
    std::printf("driver calls in the loop: %lld maps, %lld unmaps\n", static_cast<long long>(after.num_device_alloc - before.num_device_alloc),
                static_cast<long long>(after.num_device_free - before.num_device_free));
    const expseg::driver::CallStats calls = drv.call_stats().since(calls_before);
    for (const expseg::DriverCallTime& t : calls.by_call())
      std::printf("  %-22s %8llu calls %10.3f ms (%.1f ns per step)\n", t.call.c_str(), static_cast<unsigned long long>(t.calls), t.seconds * 1e3,
                  t.seconds * 1e9 / static_cast<double>(iterations ? iterations : 1));
    std::printf("churn %s: %.1f ns/step over %ld\n", backend.c_str(),
                std::chrono::duration<double, std::nano>(t1 - w).count() / static_cast<double>(iterations ? iterations : 1), iterations);
  } else if (workload == "replay") {
    // Under callgrind, also --toggle-collect='expseg::Allocator::allocate*' --toggle-collect='expseg::Allocator::deallocate*'
    // to leave out the trace compilation and the allocator's construction.
    const std::string path = argc > 4 ? argv[4] : std::string(EXPSEG_BENCH_TRACE_DIR) + "/resnet50-train-varsize.rmm.csv.gz";
    const expseg::Trace trace = expseg::read_trace(path);
    const long n = iterations > 0 ? iterations : 1;
    const double seconds = hot_loop_replay(trace, cfg, n);
    std::printf("replay %s %s: %.2f M events/s (%zu events x %ld)\n", backend.c_str(), trace.name.c_str(),
                static_cast<double>(trace.events.size()) * static_cast<double>(n) / seconds / 1e6, trace.events.size(), n);
  } else {
    return usage();
  }
  return 0;
}
