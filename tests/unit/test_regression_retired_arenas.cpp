// Retired arenas (released graph pools, exited threads' per-thread streams) that keep live blocks:
// every slow path gave each of them back again (a walk of its free blocks and segments), so a long
// run with thousands of kept graph outputs paid O(retired arenas) per slow allocation though nothing
// in them had changed. Now an arena is looked at again only once something in it may have come free.
// The scale cases failed on the code before the fix.
#include <doctest/doctest.h>

#include <cstdint>
#include <thread>
#include <vector>

#include "allocator_impl.hpp"
#include "backends/expandable/expandable.hpp"
#include "driver/sim_driver.hpp"
#include "test_util.hpp"

using namespace testutil;
using expseg::Allocator;
using expseg::BackendKind;
using expseg::kAllPools;

namespace {

const expseg::backends::ExpandableBackend& backend_of(Allocator& a) {
  return dynamic_cast<const expseg::backends::ExpandableBackend&>(expseg::detail::AllocatorAccess::backend(a));
}

void* stream_no(int i) { return reinterpret_cast<void*>(static_cast<std::uintptr_t>(0x10000 + 16 * i)); }
void* const kPerThread = stream_id(2);

std::int64_t reserved(Allocator& a) { return a.stats().reserved_bytes[kAllPools].current; }
std::int64_t segments(Allocator& a) { return a.stats().segment[kAllPools].current; }

// n graph pools, each released with one block still allocated (a graph's output): n retired arenas.
std::vector<void*> retire_pools_with_outputs(Allocator& a, int n, std::size_t bytes = 512, int first_pool = 1) {
  void* s = stream_no(0);
  std::vector<void*> outputs;
  for (int i = first_pool; i < first_pool + n; ++i) {
    a.begin_pool_allocations(static_cast<std::uint64_t>(i), s);
    outputs.push_back(a.allocate(bytes, s));
    a.end_pool_allocations(static_cast<std::uint64_t>(i), s);
    a.release_graph_pool(static_cast<std::uint64_t>(i));
  }
  return outputs;
}

// n threads, each leaving a block allocated on its per-thread stream as it exits: n retired arenas
// once a slow path has noticed the exits.
std::vector<void*> retire_threads_with_blocks(Allocator& a, int n) {
  std::vector<void*> blocks(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) std::thread([&] { blocks[static_cast<std::size_t>(i)] = a.allocate(512, kPerThread); }).join();
  return blocks;
}

// Slow-path steps per slow allocation on a stream of its own: 32 live 64 MiB blocks, each a growth.
double steps_per_slow_allocation(Allocator& a) {
  const auto& be = backend_of(a);
  void* t = stream_no(1);
  std::vector<void*> held{a.allocate(64 * MiB, t)};  // notices the retired keys (one walk of the arenas)
  const std::uint64_t steps0 = be.slow_path_steps();
  const std::uint64_t calls0 = be.slow_calls();
  for (int i = 0; i < 32; ++i) held.push_back(a.allocate(64 * MiB, t));
  const std::uint64_t calls = be.slow_calls() - calls0;
  REQUIRE(calls >= 16);
  const double per_call = static_cast<double>(be.slow_path_steps() - steps0) / static_cast<double>(calls);
  for (void* p : held) a.deallocate(p);
  return per_call;
}

}  // namespace

TEST_SUITE("expandable") {

TEST_CASE("retired arenas: a slow allocation does not look again at every released graph pool that keeps a live block") {
  // 2000 released pools with an output each: the old code walked each pool's free blocks and
  // segments on every slow allocation (2 steps a pool counted, per call: 4000 with 2000 pools).
  double per_call[2] = {};
  const int counts[2] = {100, 2000};
  for (int k = 0; k < 2; ++k) {
    const int n = counts[k];
    CAPTURE(n);
    Allocator a(sim_config(BackendKind::expandable, 1024 * GiB, "expandable_va_size:1GiB"));
    const std::vector<void*> outputs = retire_pools_with_outputs(a, n);
    REQUIRE(segments(a) == n);  // each pool's arena stays for its output
    per_call[k] = steps_per_slow_allocation(a);
    CAPTURE(per_call[k]);
    CHECK(segments(a) >= n);
    a.validate();
    for (void* p : outputs) a.deallocate(p);
    a.release_cached();
    CHECK(reserved(a) == 0);
    CHECK(segments(a) == 0);
    a.validate();
  }
  MESSAGE("slow-path steps per slow allocation: " << per_call[0] << " with 100 retired pools, " << per_call[1] << " with 2000");
  CHECK(per_call[1] <= per_call[0] + 4);  // flat in the number of retired arenas
  CHECK(per_call[1] < 100);               // the old code: 4000
}

TEST_CASE("retired arenas: a slow allocation does not look again at every exited thread's stream that keeps a live block") {
  double per_call[2] = {};
  const int counts[2] = {20, 400};
  for (int k = 0; k < 2; ++k) {
    const int n = counts[k];
    CAPTURE(n);
    Allocator a(sim_config(BackendKind::expandable, 1024 * GiB, "expandable_va_size:1GiB"));
    const std::vector<void*> blocks = retire_threads_with_blocks(a, n);
    REQUIRE(segments(a) == n);
    per_call[k] = steps_per_slow_allocation(a);
    CAPTURE(per_call[k]);
    CHECK(segments(a) >= n);
    a.validate();
    for (void* p : blocks) a.deallocate(p);  // from another thread: the owners have exited
    a.release_cached();
    CHECK(reserved(a) == 0);
    CHECK(segments(a) == 0);
    a.validate();
  }
  MESSAGE("slow-path steps per slow allocation: " << per_call[0] << " with 20 exited threads, " << per_call[1] << " with 400");
  CHECK(per_call[1] <= per_call[0] + 4);
  CHECK(per_call[1] < 100);  // the old code: 800
}

TEST_CASE("retired arenas: freeing a retired arena's last live block gives its memory back at the next slow path") {
  for (const bool threads : {false, true}) {
    CAPTURE(threads);
    auto sa = make_sim_allocator(sim_config(BackendKind::expandable, 1024 * GiB, "expandable_va_size:1GiB"));
    Allocator& a = *sa;
    // Many retired arenas with live blocks; one of them holds 64 MiB more, in a second block.
    std::vector<void*> kept = threads ? retire_threads_with_blocks(a, 50) : retire_pools_with_outputs(a, 50);
    void* big = nullptr;
    void* small = nullptr;
    if (threads) {
      std::thread([&] {
        big = a.allocate(64 * MiB, kPerThread);
        small = a.allocate(512, kPerThread);
      }).join();
    } else {
      a.begin_pool_allocations(1000, stream_no(0));
      big = a.allocate(64 * MiB, stream_no(0));
      small = a.allocate(512, stream_no(0));
      a.end_pool_allocations(1000, stream_no(0));
      a.release_graph_pool(1000);
    }
    void* t = stream_no(1);
    a.deallocate(a.allocate(2 * MiB, t));  // a slow path: notices the exits, gives back what is idle
    const std::int64_t held = reserved(a);
    const std::int64_t segs = segments(a);
    REQUIRE(segs == 52);  // 51 retired arenas, each with a live block, and t's
    a.validate();

    a.deallocate(big);  // its arena keeps `small`: 64 MiB of it is idle now
    CHECK(reserved(a) == held);  // a free gives nothing back by itself
    a.validate();
    a.allocate(128 * MiB, t);  // the next slow path takes it back, then maps 128 MiB for t
    CHECK(reserved(a) <= held - static_cast<std::int64_t>(64 * MiB) + static_cast<std::int64_t>(128 * MiB));
    CHECK(segments(a) == segs);
    a.validate();

    a.deallocate(small);  // the arena's last block: the arena and its range go at the next slow path
    a.allocate(256 * MiB, t);
    CHECK(segments(a) == segs - 1);
    a.validate();

    for (void* p : kept) a.deallocate(p);  // the others' last blocks: release_cached takes them all
    a.release_cached();
    CHECK(segments(a) == 1);  // t's, with its two live blocks
    a.validate();
    sa.alloc.reset();
    CHECK(sa.sim->hazards().empty());
  }
}

TEST_CASE("retired arenas: a look refused while a capture is underway is taken again once the capture ends") {
  // The freed block's idle memory cannot be given back while an untold capture is underway on u (the
  // device synchronization first would invalidate it): the arena must be looked at again after it,
  // though nothing in it changes meanwhile.
  auto sa = make_sim_allocator(sim_config(BackendKind::expandable, 1024 * GiB, "expandable_va_size:1GiB"));
  Allocator& a = *sa;
  void* u = sa.sim->stream_create();
  void* w = sa.sim->stream_create();
  a.deallocate(a.allocate(2 * MiB, u));  // an arena for u: an untold capture there is seen
  const std::vector<void*> kept = retire_pools_with_outputs(a, 20);
  a.begin_pool_allocations(1000, stream_no(0));
  void* big = a.allocate(64 * MiB, stream_no(0));
  void* small = a.allocate(512, stream_no(0));
  a.end_pool_allocations(1000, stream_no(0));
  a.release_graph_pool(1000);
  a.deallocate(a.allocate(2 * MiB, w));
  sa.sim->capture_begin(u);
  a.deallocate(big);
  const std::int64_t held = reserved(a);
  a.deallocate(a.allocate(32 * MiB, w));  // refused: the capture on u
  CHECK(reserved(a) >= held);
  a.validate();
  expseg::driver::graph_t g = nullptr;
  CHECK_NOTHROW(g = sa.sim->capture_end(u));  // not invalidated by a synchronization
  a.deallocate(a.allocate(48 * MiB, w));  // the capture has ended: the 64 MiB go back now
  CHECK(reserved(a) <= held + static_cast<std::int64_t>(48 * MiB) - static_cast<std::int64_t>(64 * MiB));
  a.validate();
  if (g != nullptr) sa.sim->graph_destroy(g);
  a.deallocate(small);
  for (void* p : kept) a.deallocate(p);
  a.release_cached();
  CHECK(reserved(a) == 0);
  sa.alloc.reset();
  CHECK(sa.sim->hazards().empty());
  sa.sim->stream_destroy(u);
  sa.sim->stream_destroy(w);
}

}  // TEST_SUITE
