// Multi-threaded stress of one Allocator on the host-backed simulated device: N threads allocate,
// write a pattern, record streams, free (checking the pattern), and read stats and snapshots, while
// one of them also toggles stream work, calls release_cached() and moves the limit. Any two live
// blocks that overlap (checked against a registry of every live block), a pattern that changes, a
// stats identity that breaks, a validate() failure, an unexpected exception or a leak after
// destruction is a failure. Run under ThreadSanitizer it also checks the locking
// (tests/SANITIZERS.md). Used by the unit suite (short) and the stress suite.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "expseg/config.hpp"

namespace fuzz {

struct ThreadStressOptions {
  expseg::BackendKind backend = expseg::BackendKind::expandable;
  std::string extra_config;            // e.g. "policy:cupy" or "limit:384MiB"
  unsigned threads = 16;
  std::size_t ops_per_thread = 2000;
  std::uint64_t seed = 1;
  std::size_t capacity = std::size_t{512} << 20;
};

// The backend configurations both thread-stress tests (unit: short, stress: long) run.
struct ThreadStressCase {
  expseg::BackendKind backend;
  const char* config;
};
inline constexpr ThreadStressCase kThreadStressCases[] = {
    {expseg::BackendKind::split_merge, ""},
    {expseg::BackendKind::split_merge, "policy:cupy,limit:384MiB"},
    {expseg::BackendKind::expandable, ""},
    {expseg::BackendKind::expandable, "limit:320MiB"},
};

struct ThreadStressResult {
  std::uint64_t allocs = 0, frees = 0, ooms = 0, cross_stream = 0, stats_reads = 0, snapshots = 0, validations = 0;
  std::uint64_t release_cached = 0, limit_changes = 0;
  std::string failure;  // empty when everything held
  std::string to_string() const;
};

ThreadStressResult run_thread_stress(const ThreadStressOptions& options);

}  // namespace fuzz
