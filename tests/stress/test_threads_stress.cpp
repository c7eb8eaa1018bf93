// 16 threads hammering one allocator per backend (tests/common/thread_stress.hpp): allocate, write
// and check patterns, record_stream + free, stats and snapshot reads, validate(), release_cached and
// limit changes, all at once. Meant to run under ThreadSanitizer too (tests/SANITIZERS.md).
//
// Environment: EXPSEG_STRESS_THREAD_OPS=N operations per thread (default 6000),
//              EXPSEG_STRESS_SEED=N (default 1).
#include <doctest/doctest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "thread_stress.hpp"

namespace {
std::uint64_t env_or(const char* name, std::uint64_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::strtoull(v, nullptr, 0) : fallback;
}
}  // namespace

TEST_SUITE("threads") {

TEST_CASE("threads: 16 threads on each backend keep every invariant and every byte") {
  for (const fuzz::ThreadStressCase& c : fuzz::kThreadStressCases) {
    fuzz::ThreadStressOptions o;
    o.backend = c.backend;
    o.extra_config = c.config;
    o.threads = 16;
    o.ops_per_thread = env_or("EXPSEG_STRESS_THREAD_OPS", 6000);
    o.seed = env_or("EXPSEG_STRESS_SEED", 1);
    INFO("backend: " << std::string(expseg::to_string(c.backend)));
    INFO("config: " << std::string(c.config));
    const auto t0 = std::chrono::steady_clock::now();
    const fuzz::ThreadStressResult r = fuzz::run_thread_stress(o);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("threads: %s %s: %.1f s, %s\n", expseg::to_string(c.backend), c.config, secs, r.to_string().c_str());
    CHECK_MESSAGE(r.failure.empty(), r.failure);
    // The run did what it stands for: allocations, frees on other streams, validations, cache
    // releases and limit changes from the threads, while others allocate.
    CHECK(r.allocs > 0);
    CHECK(r.frees > 0);
    CHECK(r.cross_stream > 0);
    CHECK(r.validations > 0);
    CHECK(r.release_cached > 0);
    CHECK(r.limit_changes > 0);
  }
}

}  // TEST_SUITE
