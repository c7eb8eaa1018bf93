// Regressions in the cost of expandable's slow paths with many blocks and idle handles: lookups
// that walked every block of the segment or every idle handle on each call. Each case failed on the
// code before its fix.
#include <doctest/doctest.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "allocator_impl.hpp"
#include "backends/expandable/expandable.hpp"
#include "test_util.hpp"

using namespace testutil;
using expseg::Allocator;
using expseg::BackendKind;
using expseg::kAllPools;

TEST_SUITE("expandable") {

TEST_CASE("slow path regression: reclaim under a limit does not walk every block and idle handle for each allocation") {
  // 4096 blocks of one 2 MiB handle fill the 8 GiB limit; every other one is freed, in a scrambled
  // order: 2048 idle handles between live blocks. Each 4 MiB request then fits no cached block and
  // needs two of them given back (the least recently idle), at scattered addresses.
  constexpr int n = 4096;
  Allocator a(sim_config(BackendKind::expandable, 80 * GiB, "limit:8GiB"));
  std::vector<void*> ps;
  for (int i = 0; i < n; ++i) ps.push_back(a.allocate(2 * MiB));
  std::vector<int> order;
  for (int i = 0; i < n; i += 2) order.push_back(i);
  std::uint64_t x = 12345;
  for (std::size_t i = order.size(); i > 1; --i) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    std::swap(order[i - 1], order[static_cast<std::size_t>((x >> 33) % i)]);
  }
  for (int i : order) a.deallocate(ps[static_cast<std::size_t>(i)]);
  a.validate();
  const auto& be = dynamic_cast<const expseg::backends::ExpandableBackend&>(expseg::detail::AllocatorAccess::backend(a));
  const std::uint64_t steps0 = be.slow_path_steps();
  constexpr int k = 256;
  std::vector<void*> big;
  for (int i = 0; i < k; ++i) big.push_back(a.allocate(4 * MiB));
  const std::uint64_t steps = be.slow_path_steps() - steps0;
  CAPTURE(steps);
  // Was 2.5 million (~9,800 a request; now ~70): room_after_reclaim summed all 2048 idle handles,
  // and each unmap walked the blocks from the segment's first to its handle, twice. Then 472,000
  // (~1,850 a request): reclaim's largest-first order walked every idle handle to sort them.
  CHECK(steps <= 128 * k);
  a.validate();
  // release_cached unmaps the 1536 idle handles left, at scattered addresses.
  const std::uint64_t steps1 = be.slow_path_steps();
  a.release_cached();
  CAPTURE(be.slow_path_steps() - steps1);
  CHECK(be.slow_path_steps() - steps1 <= 32 * n);  // was 6.3 million (now ~2,400)
  a.validate();
  for (void* p : big) a.deallocate(p);
  for (int i = 1; i < n; i += 2) a.deallocate(ps[static_cast<std::size_t>(i)]);
  a.release_cached();
  CHECK(a.stats().reserved_bytes[kAllPools].current == 0);
  a.validate();
}

TEST_CASE("slow path regression: the search of mapped free blocks does not walk every handle of every block") {
  // Under a limit, m free blocks of k single-frame idle handles each (between live 2 MiB fences),
  // and four free 8 MiB blocks of one bulk handle, the best fits for 3 MiB: the fast path would cut
  // the bulk handles, so each 3 MiB request takes the slow path, whose search of mapped free blocks
  // finds a place leaving 1 MiB (the least any block allows) in the first large block.
  constexpr int m = 64;
  constexpr int k = 64;
  Allocator a(sim_config(BackendKind::expandable, 80 * GiB, "limit:16GiB"));
  std::vector<void*> fences;
  std::vector<void*> idle;
  for (int i = 0; i < 4; ++i) {
    idle.push_back(a.allocate(8 * MiB));
    fences.push_back(a.allocate(2 * MiB));
  }
  for (int j = 0; j < m; ++j) {
    for (int i = 0; i < k; ++i) idle.push_back(a.allocate(2 * MiB));
    fences.push_back(a.allocate(2 * MiB));
  }
  for (void* p : idle) a.deallocate(p);
  a.validate();
  const auto& be = dynamic_cast<const expseg::backends::ExpandableBackend&>(expseg::detail::AllocatorAccess::backend(a));
  const std::uint64_t calls0 = be.slow_calls();
  const std::uint64_t steps0 = be.search_steps();
  constexpr int r = 32;
  std::vector<void*> small;
  for (int i = 0; i < r; ++i) small.push_back(a.allocate(3 * MiB));
  const std::uint64_t steps = be.search_steps() - steps0;
  CAPTURE(steps);
  CHECK(be.slow_calls() - calls0 == r);
  CHECK(steps <= 4 * m * r);
  MESSAGE(steps);  // was ~4,200 a request (every handle of every block), now ~70
  a.validate();
  for (void* p : small) a.deallocate(p);
  for (void* p : fences) a.deallocate(p);
  a.release_cached();
  CHECK(a.stats().reserved_bytes[kAllPools].current == 0);
}


TEST_CASE("slow path regression: thousands of streams: a cached allocation does not scan every stream, nor a growth every stream's idle memory") {
  // A program with a stream per request: 3000 streams, each with an idle handle cached. Finding the
  // stream's arena scanned every stream on each cached allocation (the last stream's cached pair
  // took 1.2 us instead of 0.05 at 4000 streams, both backends), and the reclaim before memory grows
  // past its highest mark, which gives back only the growing stream's idle memory, walked every
  // stream's idle handles to find it (625 us a growth at 8000 streams).
  constexpr int n = 3000;
  // 16 GiB of address range a stream: 3000 streams' segments fit the process's 128 TiB (the default,
  // 2x the device, would not: streams would then give each other's idle memory back).
  Allocator a(sim_config(BackendKind::expandable, 1024 * GiB, "expandable_va_size:16GiB"));
  auto stream = [](int i) { return reinterpret_cast<void*>(static_cast<std::uintptr_t>(0x10000 + 16 * i)); };
  for (int i = 0; i < n; ++i) a.deallocate(a.allocate(512, stream(i)));
  const auto& be = dynamic_cast<const expseg::backends::ExpandableBackend&>(expseg::detail::AllocatorAccess::backend(a));
  // The last stream grows past the highest mark again and again: each time its own idle memory
  // (one handle) is looked at, not the other streams' 2999.
  const std::uint64_t steps0 = be.slow_path_steps();
  std::vector<void*> big;
  for (int i = 0; i < 50; ++i) {
    big.push_back(a.allocate(64 * MiB, stream(n - 1)));
    a.deallocate(big.back());
    big.back() = a.allocate(65 * MiB + static_cast<std::size_t>(i) * MiB, stream(n - 1));
  }
  const std::uint64_t steps = be.slow_path_steps() - steps0;
  CAPTURE(steps);
  CHECK(steps <= 50 * 16);  // the walk of every stream's idle handles (~3,000 a growth) would count here
  for (void* p : big) a.deallocate(p);
  a.validate();
  // Every stream still finds its own cached memory (the table past the first streams scanned).
  for (int i = 0; i < n; i += 97) {
    const auto before = a.stats().num_device_alloc;
    a.deallocate(a.allocate(512, stream(i)));
    CHECK(a.stats().num_device_alloc == before);
  }
  a.validate();
  a.release_cached();
  CHECK(a.stats().reserved_bytes[kAllPools].current == 0);
  CHECK(a.stats().segment[kAllPools].current == 0);
}

}  // TEST_SUITE
