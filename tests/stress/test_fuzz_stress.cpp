// Long model-based fuzzing runs (tests/common/fuzz_harness.hpp): millions of operations over every
// option preset of both backends, on the host-backed simulated device, with injected faults.
//
// Environment:
//   EXPSEG_STRESS_SEED=N     base seed (default: from the clock; printed either way)
//   EXPSEG_STRESS_OPS=N      total operations (default 2,000,000)
//   EXPSEG_FUZZ_REPLAY=P:S:N replay one run: preset P, seed S, N operations (as a failure prints)
//   EXPSEG_FUZZ_VERBOSE=1    with EXPSEG_FUZZ_REPLAY: print every operation
#include <doctest/doctest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "fuzz_harness.hpp"

namespace {

std::uint64_t env_u64(const char* name, std::uint64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  return std::strtoull(v, nullptr, 0);
}

std::string replay_hint(std::size_t preset, std::uint64_t seed, std::size_t ops) {
  return "EXPSEG_FUZZ_REPLAY=" + std::to_string(preset) + ":" + std::to_string(seed) + ":" + std::to_string(ops) +
         " EXPSEG_FUZZ_VERBOSE=1 build/tests/expseg_stress -ts=fuzz";
}

}  // namespace

TEST_SUITE("fuzz") {

TEST_CASE("fuzz: millions of randomized operations on both backends") {
  if (const char* replay = std::getenv("EXPSEG_FUZZ_REPLAY"); replay && *replay) {
    unsigned long long preset = 0, seed = 0, ops = 0;
    REQUIRE_MESSAGE(std::sscanf(replay, "%llu:%llu:%llu", &preset, &seed, &ops) == 3, "EXPSEG_FUZZ_REPLAY=PRESET:SEED:OPS");
    fuzz::Options o = fuzz::preset(preset);
    o.verbose = env_u64("EXPSEG_FUZZ_VERBOSE", 0) != 0;
    std::printf("replaying preset %llu (%s), seed %llu, %llu operations\n", preset, o.describe().c_str(), seed, ops);
    try {
      const fuzz::Counters c = fuzz::run_seed(o, seed, ops, replay_hint(preset, seed, ops));
      std::printf("passed: %s\n", c.to_string().c_str());
    } catch (const fuzz::Failure& f) {
      FAIL(std::string(f.what()));
    }
    return;
  }

  const auto clock_seed = static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  const std::uint64_t base = env_u64("EXPSEG_STRESS_SEED", clock_seed % 1000000007ULL);
  const std::uint64_t total_ops = env_u64("EXPSEG_STRESS_OPS", 2000000);
  constexpr std::size_t kOpsPerRun = 20000;
  std::printf("fuzz stress: base seed %llu (EXPSEG_STRESS_SEED=%llu reproduces), %llu operations\n",
              static_cast<unsigned long long>(base), static_cast<unsigned long long>(base), static_cast<unsigned long long>(total_ops));
  std::fflush(stdout);
  const auto t0 = std::chrono::steady_clock::now();
  fuzz::Counters total;
  std::size_t runs = 0;
  while (total.ops < total_ops) {
    const std::size_t preset = runs % fuzz::preset_count();
    const std::uint64_t seed = base * 1000 + runs;
    const std::size_t ops = static_cast<std::size_t>(std::min<std::uint64_t>(kOpsPerRun, total_ops - total.ops));
    try {
      total.add(fuzz::run_seed(fuzz::preset(preset), seed, ops, replay_hint(preset, seed, ops)));
    } catch (const fuzz::Failure& f) {
      FAIL(std::string(f.what()));
      break;
    }
    ++runs;
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("fuzz stress: %zu runs, %.1f s, %.0f ops/s\n  %s\n", runs, secs, static_cast<double>(total.ops) / secs,
              total.to_string().c_str());
  CHECK(total.faults_fired > 0);
  CHECK(total.pending_frees > 0);
}

}  // TEST_SUITE
