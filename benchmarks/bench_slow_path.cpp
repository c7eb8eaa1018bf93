// The expandable backend's slow path at scale: CPU time of one allocation that finds no cached
// place, under a limit of N frames of 2 MiB on the simulated device (no latency model: expseg's own
// cost, not the driver's).
//
//   slow_path/expandable:sim/frames:<N>/sizes:<lo>-<hi>MiB/phase:<after_oom|near_limit>
//
// The churn: 45% of the steps free a random live block, the others allocate a log-uniform size in
// [lo, hi] MiB; an out_of_memory frees half the live blocks. Setup (untimed, once per repetition,
// on a fresh allocator): allocate until the first out_of_memory (which frees half), then
//   after_oom   5000 churn steps: the live blocks fill about half the limit and grow from there
//               (at 50,000 frames the next OOM is tens of thousands of steps away: the timed slow
//               allocations are searches of mapped free memory, no driver call);
//   near_limit  churn steps until the live blocks' bytes reach 95% of the limit; from then on,
//               55% of the steps free while they are at 95% or more, holding the churn there:
//               more of the slow allocations map, and give back idle handles to make room.
// One iteration runs churn steps until an allocation succeeds on the slow path (it reached
// allocate_slow: a placement search, mapping or reclaim; ExpandableBackend::slow_calls()), and its
// time is that allocation's thread CPU time (manual time). The frees, the cached allocations and the
// failed ones between are not timed, so Google Benchmark's CPU column (which counts all of them) is
// not the figure. Fixed seed and iteration count: every repetition replays the same sequence.
// Counters, per slow allocation: steps (churn steps, timed or not), search_steps and slow_path_steps
// (the backend's lookup counters, expandable.hpp), device_allocs / device_frees (driver calls, tens
// of µs each on a GPU); at the end: handles, live_blocks; and ooms in the timed part.
//
// No split_merge counterpart: under this churn its slow path (cudaMalloc) hardly ever succeeds once
// the limit is reached: a cache miss ends in out_of_memory, releasing the fully free cached
// segments rarely makes room (10,000 frames, 2-16 MiB: 2 successful driver allocations in 200,000
// steps after the fill; at 1,000 frames, none in the million steps after this file's warm-up).
#include <benchmark/benchmark.h>

#include <time.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "backends/expandable/expandable.hpp"
#include "bench_common.hpp"
#include "bench_fail.hpp"
#include "expseg/errors.hpp"

namespace expseg::bench {

namespace {

double thread_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

// The churn, over one allocator of the expandable backend; frees what it holds when destroyed.
class SlowPathChurn {
 public:
  SlowPathChurn(Allocator& a, double min_bytes, double max_bytes, std::uint64_t seed)
      : a_(a),
        be_(dynamic_cast<const backends::ExpandableBackend&>(detail::AllocatorAccess::backend(a))),
        log_min_(std::log(min_bytes)),
        log_max_(std::log(max_bytes)),
        x_(seed * 0x9E3779B97F4A7C15ULL + 1) {}
  SlowPathChurn(const SlowPathChurn&) = delete;
  SlowPathChurn& operator=(const SlowPathChurn&) = delete;
  ~SlowPathChurn() {
    for (const Live& l : live_) {
      try {
        a_.deallocate(l.p);
      } catch (...) {
      }
    }
  }

  enum class Outcome { freed, cached, slow, oom };

  // One step: an allocation only when `fill`; a free with probability `p_free` otherwise. `seconds`
  // gets a slow allocation's CPU time.
  Outcome step(bool fill, double p_free, double* seconds) {
    if (!fill && !live_.empty() && uniform() < p_free) {
      free_at(next() % live_.size());
      return Outcome::freed;
    }
    const auto bytes = static_cast<std::size_t>(std::exp(log_min_ + uniform() * (log_max_ - log_min_)));
    const std::uint64_t before = be_.slow_calls();
    void* p = nullptr;
    const double t0 = thread_cpu_seconds();
    try {
      p = a_.allocate(bytes);
    } catch (const out_of_memory&) {
    }
    const double t1 = thread_cpu_seconds();
    if (p == nullptr) {
      for (std::size_t k = live_.size() / 2; k > 0; --k) free_at(next() % live_.size());
      return Outcome::oom;
    }
    live_.push_back({p, bytes});
    live_bytes_ += bytes;
    if (be_.slow_calls() == before) return Outcome::cached;
    *seconds = t1 - t0;
    return Outcome::slow;
  }

  const backends::ExpandableBackend& backend() const { return be_; }
  std::size_t live() const { return live_.size(); }
  std::size_t live_bytes() const { return live_bytes_; }  // as requested

 private:
  struct Live {
    void* p;
    std::size_t bytes;
  };
  // LCG (Knuth's MMIX constants), 53-bit uniform doubles.
  std::uint64_t next() {
    x_ = x_ * 6364136223846793005ULL + 1442695040888963407ULL;
    return x_ >> 11;
  }
  double uniform() { return static_cast<double>(next()) * (1.0 / 9007199254740992.0); }
  void free_at(std::size_t i) {
    a_.deallocate(live_[i].p);
    live_bytes_ -= live_[i].bytes;
    live_[i] = live_.back();
    live_.pop_back();
  }

  Allocator& a_;
  const backends::ExpandableBackend& be_;
  double log_min_, log_max_;
  std::uint64_t x_;
  std::vector<Live> live_;
  std::size_t live_bytes_ = 0;
};

void bm_slow_path(benchmark::State& st, std::size_t frames, std::size_t min_mib, std::size_t max_mib, bool near_limit) {
  constexpr std::size_t kFrame = 2 * MiB;  // the simulated device's granularity
  constexpr double kFree = 0.45;
  constexpr double kHoldFree = 0.55;   // near_limit, at kHold of the limit or more
  constexpr double kHold = 0.95;
  constexpr int kWarmSteps = 5000;     // after_oom
  constexpr int kMaxSteps = 10000000;  // a setup or an iteration that never gets there fails, not hangs
  try {
    Config cfg;  // defaults, not EXPSEG_ALLOC_CONF
    cfg.backend = BackendKind::expandable;
    cfg.device = DeviceKind::sim;
    cfg.sim_capacity = std::size_t{1} << 40;  // above every limit here: the limit is what runs out
    cfg.limit.bytes = frames * kFrame;
    cfg.oom_counterfactual = false;  // the OOMs' diagnostic, untimed anyway, would dominate the setup
    Allocator a(cfg, 0);
    SlowPathChurn churn(a, static_cast<double>(min_mib * MiB), static_cast<double>(max_mib * MiB), 1);
    const auto hold = static_cast<std::size_t>(kHold * static_cast<double>(cfg.limit.bytes));
    double seconds = 0.0;
    int n = 0;
    while (churn.step(true, kFree, &seconds) != SlowPathChurn::Outcome::oom) {
      if (++n == kMaxSteps) throw std::runtime_error("no out_of_memory in the fill");
    }
    if (near_limit) {
      for (n = 0; churn.live_bytes() < hold; ++n) {
        if (n == kMaxSteps) throw std::runtime_error("the churn never reached 95% of the limit");
        churn.step(false, kFree, &seconds);
      }
    } else {
      for (n = 0; n < kWarmSteps; ++n) churn.step(false, kFree, &seconds);
    }

    const Stats s0 = a.stats();
    const backends::ExpandableBackend& be = churn.backend();
    const std::uint64_t search0 = be.search_steps();
    const std::uint64_t walk0 = be.slow_path_steps();
    std::uint64_t steps = 0, ooms = 0;
    for (auto _ : st) {
      for (n = 0;; ++n) {
        if (n == kMaxSteps) throw std::runtime_error("no slow allocation in ten million churn steps");
        ++steps;
        const double p_free = near_limit && churn.live_bytes() >= hold ? kHoldFree : kFree;
        const SlowPathChurn::Outcome o = churn.step(false, p_free, &seconds);
        if (o == SlowPathChurn::Outcome::oom) ++ooms;
        if (o == SlowPathChurn::Outcome::slow) break;
      }
      st.SetIterationTime(seconds);
    }
    const Stats s1 = a.stats();
    const auto per_slow = [](double v) { return benchmark::Counter(v, benchmark::Counter::kAvgIterations); };
    st.counters["steps"] = per_slow(static_cast<double>(steps));
    st.counters["search_steps"] = per_slow(static_cast<double>(be.search_steps() - search0));
    st.counters["slow_path_steps"] = per_slow(static_cast<double>(be.slow_path_steps() - walk0));
    st.counters["device_allocs"] = per_slow(static_cast<double>(s1.num_device_alloc - s0.num_device_alloc));
    st.counters["device_frees"] = per_slow(static_cast<double>(s1.num_device_free - s0.num_device_free));
    st.counters["ooms"] = static_cast<double>(ooms);
    st.counters["handles"] = static_cast<double>(s1.physical_handles.current);
    st.counters["live_blocks"] = static_cast<double>(churn.live());
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("slow path: ") + e.what());  // guarded() fails the run
  }
}

}  // namespace

void register_slow_path(bool quick) {
  struct Sizes {
    std::size_t min_mib, max_mib;
  };
  for (bool near_limit : {false, true}) {
    for (std::size_t frames : {1000, 10000, 50000}) {
      for (Sizes sz : {Sizes{1, 64}, Sizes{2, 16}}) {
        const std::string name = "slow_path/expandable:sim/frames:" + std::to_string(frames) + "/sizes:" + std::to_string(sz.min_mib) +
                                 "-" + std::to_string(sz.max_mib) + "MiB/phase:" + (near_limit ? "near_limit" : "after_oom");
        benchmark::RegisterBenchmark(name.c_str(), [name, frames, sz, near_limit](benchmark::State& st) {
          guarded(st, name, [&] { bm_slow_path(st, frames, sz.min_mib, sz.max_mib, near_limit); });
        })
            ->UseManualTime()
            ->Unit(benchmark::kMicrosecond)
            ->Iterations(quick ? 100 : 2000);
      }
    }
  }
}

}  // namespace expseg::bench
