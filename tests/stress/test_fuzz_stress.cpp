// Long model-based fuzzing runs (tests/common/fuzz_harness.hpp): millions of operations over every
// option preset of both backends, on the host-backed simulated device, with injected faults.
//
// Environment:
//   EXPSEG_STRESS_SEED=N     base seed (default: from the clock; printed either way)
//   EXPSEG_STRESS_OPS=N      total operations (default 2,000,000)
//   EXPSEG_STRESS_THREADS=N  runs in parallel, each on its own allocator (default 2)
//   EXPSEG_FUZZ_MULTI_FAULTS=1  arm several faults at once in every run (without it, every fourth
//                               run does; finds double-failure bugs, e.g. those of
//                               tests/unit/test_regression_mapped_orphan.cpp and _growth_failures.cpp)
//   EXPSEG_FUZZ_GRAPHS=1     CUDA graph captures and graph pools in every run (without it, every
//                            other run has them)
//   EXPSEG_FUZZ_REPLAY=P:S:N replay one run: preset P, seed S, N operations (as a failure prints)
//   EXPSEG_FUZZ_VERBOSE=1    with EXPSEG_FUZZ_REPLAY: print every operation
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "fuzz_harness.hpp"

namespace {

std::uint64_t env_u64(const char* name, std::uint64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  return std::strtoull(v, nullptr, 0);
}

bool multi_faults() { return env_u64("EXPSEG_FUZZ_MULTI_FAULTS", 0) != 0; }
// Every fourth run arms several faults at once even without the variable: double failures (a call
// fails, then the call that undoes it) are where the expandable backend's last bugs were.
bool run_multi_faults(std::uint64_t run) { return multi_faults() || run % 4 == 3; }
bool graphs() { return env_u64("EXPSEG_FUZZ_GRAPHS", 0) != 0; }
bool run_graphs(std::uint64_t run) { return graphs() || run % 2 == 1; }

std::string replay_hint(std::size_t preset, std::uint64_t seed, std::size_t ops, bool multi, bool graphs) {
  return std::string(multi ? "EXPSEG_FUZZ_MULTI_FAULTS=1 " : "") + (graphs ? "EXPSEG_FUZZ_GRAPHS=1 " : "") + "EXPSEG_FUZZ_REPLAY=" + std::to_string(preset) + ":" +
         std::to_string(seed) + ":" + std::to_string(ops) + " EXPSEG_FUZZ_VERBOSE=1 build/tests/expseg_stress -ts=fuzz";
}

fuzz::Options stress_preset(std::size_t i, bool multi, bool graphs) {
  fuzz::Options o = fuzz::preset(i);
  o.multi_faults = multi;
  o.graphs = graphs;
  return o;
}

}  // namespace

TEST_SUITE("fuzz") {

TEST_CASE("fuzz: millions of randomized operations on both backends") {
  if (const char* replay = std::getenv("EXPSEG_FUZZ_REPLAY"); replay && *replay) {
    unsigned long long preset = 0, seed = 0, ops = 0;
    REQUIRE_MESSAGE(std::sscanf(replay, "%llu:%llu:%llu", &preset, &seed, &ops) == 3, "EXPSEG_FUZZ_REPLAY=PRESET:SEED:OPS");
    fuzz::Options o = stress_preset(preset, multi_faults(), graphs());
    o.verbose = env_u64("EXPSEG_FUZZ_VERBOSE", 0) != 0;
    std::printf("replaying preset %llu (%s), seed %llu, %llu operations\n", preset, o.describe().c_str(), seed, ops);
    try {
      const fuzz::Counters c = fuzz::run_seed(o, seed, ops, replay_hint(preset, seed, ops, multi_faults(), graphs()));
      std::printf("passed: %s\n", c.to_string().c_str());
    } catch (const fuzz::Failure& f) {
      FAIL(std::string(f.what()));
    }
    return;
  }

  const auto clock_seed = static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  const std::uint64_t base = env_u64("EXPSEG_STRESS_SEED", clock_seed % 1000000007ULL);
  const std::uint64_t total_ops = env_u64("EXPSEG_STRESS_OPS", 2000000);
  // Runs of 20,000 operations, shorter when the total is small, so that every preset (both
  // backends, graphs, multiple faults) runs: 20,000 operations in all ran preset 0 alone.
  const std::uint64_t ops_per_run = std::clamp<std::uint64_t>(total_ops / fuzz::preset_count(), 1, 20000);
  std::printf("fuzz stress: base seed %llu (EXPSEG_STRESS_SEED=%llu reproduces), %llu operations\n",
              static_cast<unsigned long long>(base), static_cast<unsigned long long>(base), static_cast<unsigned long long>(total_ops));
  std::fflush(stdout);
  const auto t0 = std::chrono::steady_clock::now();
  const auto threads = static_cast<unsigned>(std::max<std::uint64_t>(env_u64("EXPSEG_STRESS_THREADS", 2), 1));
  std::atomic<std::uint64_t> next_run{0};
  std::atomic<std::uint64_t> ops_started{0};
  std::atomic<bool> stop{false};
  std::mutex mu;
  fuzz::Counters total;
  std::string failure;
  std::vector<std::thread> workers;
  for (unsigned t = 0; t < threads; ++t) {
    workers.emplace_back([&] {
      while (!stop.load()) {
        const std::uint64_t started = ops_started.fetch_add(ops_per_run);
        if (started >= total_ops) break;
        const std::uint64_t run = next_run.fetch_add(1);
        const std::size_t preset = run % fuzz::preset_count();
        const std::uint64_t seed = base * 1000 + run;
        const auto ops = static_cast<std::size_t>(std::min<std::uint64_t>(ops_per_run, total_ops - started));
        try {
          const bool multi = run_multi_faults(run);
          const bool with_graphs = run_graphs(run);
          const fuzz::Counters c =
              fuzz::run_seed(stress_preset(preset, multi, with_graphs), seed, ops, replay_hint(preset, seed, ops, multi, with_graphs));
          std::lock_guard lock(mu);
          total.add(c);
        } catch (const std::exception& f) {
          std::lock_guard lock(mu);
          if (failure.empty()) failure = f.what();
          stop = true;
        }
      }
    });
  }
  for (auto& w : workers) w.join();
  if (!failure.empty()) FAIL(failure);
  const std::size_t runs = next_run.load();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("fuzz stress: %zu runs, %.1f s, %.0f ops/s\n  %s\n", runs, secs, static_cast<double>(total.ops) / secs,
              total.to_string().c_str());
  CHECK(total.faults_fired > 0);
  CHECK(total.pending_frees > 0);
}

}  // TEST_SUITE
