// Regressions in expandable at scale: costs that grew with the number of streams, unmapped holes or
// idle handles (counted in lookup steps, not timed), and graph pools that a loop of captures never
// gave back. Each case failed on the code before its fix.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
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

}  // namespace

TEST_SUITE("expandable") {

TEST_CASE("scale regression: a loop of graph captures, each into a pool released after it, gives the pools back") {
  // Each capture allocates (and frees) 4 MiB in a new pool, which is released once the capture has
  // ended. Every allocation happens during a capture, whose slow path may not give back a released
  // pool's memory (the device synchronization first would invalidate the capture): each pool kept
  // its memory and its reservation (2x the device), and the loop ran out of memory at graph 241
  // (1 GiB device) and of address range at graph 819 (80 GiB).
  for (const std::size_t capacity : {1 * GiB, 80 * GiB}) {
    CAPTURE(capacity);
    auto sa = make_sim_allocator(sim_config(BackendKind::expandable, capacity));
    void* s = sa.sim->stream_create();
    std::int64_t peak = 0;
    std::int64_t peak_segments = 0;
    for (int i = 0; i < 2000; ++i) {
      CAPTURE(i);
      sa.sim->capture_begin(s);
      sa->begin_graph_pool(1, s);
      void* p = sa->allocate(4 * MiB, s);
      sa->deallocate(p);
      const auto g = sa.sim->capture_end(s);
      sa->end_graph_pool(1);
      sa.sim->graph_launch(g, s);
      sa.sim->graph_destroy(g);
      sa->release_graph_pool(1);  // no capture underway: the pool's memory goes back now
      peak = std::max(peak, sa->stats().reserved_bytes[kAllPools].current);
      peak_segments = std::max(peak_segments, sa->stats().segment[kAllPools].current);
      REQUIRE(peak <= 32 * MiB);  // a pool or two held at once, not one per graph
      REQUIRE(peak_segments <= 2);
    }
    sa->validate();
    CHECK(sa->stats().reserved_bytes[kAllPools].current == 0);  // the last pool went back at its release
    sa.alloc.reset();
    CHECK(sa.sim->hazards().empty());  // no memory a replay could still use was unmapped under it
    sa.sim->stream_destroy(s);
  }
}

TEST_CASE("scale regression: a released pool's memory waits for the capture underway, told or not, and goes back after it") {
  for (const bool told : {true, false}) {
    CAPTURE(told);
    auto sa = make_sim_allocator(sim_config(BackendKind::expandable, 1 * GiB));
    void* s = sa.sim->stream_create();
    void* u = sa.sim->stream_create();
    sa->deallocate(sa->allocate(2 * MiB, u));  // an arena for u: an untold capture there is seen
    sa.sim->capture_begin(s);
    sa->begin_graph_pool(1, s);
    sa->deallocate(sa->allocate(64 * MiB, s));
    sa.sim->graph_destroy(sa.sim->capture_end(s));
    sa->end_graph_pool(1);
    const std::int64_t held = sa->stats().reserved_bytes[kAllPools].current;
    sa.sim->capture_begin(u);
    if (told) sa->begin_graph_pool(2, u);
    sa->release_graph_pool(1);  // untold: the backend sees the capture on u and keeps the memory
    CHECK(sa->stats().reserved_bytes[kAllPools].current == held);
    expseg::driver::graph_t g = nullptr;
    CHECK_NOTHROW(g = sa.sim->capture_end(u));  // not invalidated by a synchronization
    if (told) sa->end_graph_pool(2);  // the last told capture ended: the released pool goes back
    void* w = sa.sim->stream_create();
    std::int64_t new_stream_cost = 0;  // what a 512 B request on a new stream maps by itself
    if (!told) {
      auto control = make_sim_allocator(sim_config(BackendKind::expandable, 1 * GiB));
      control->deallocate(control->allocate(512, w));
      new_stream_cost = control->stats().reserved_bytes[kAllPools].current;
      sa->deallocate(sa->allocate(512, w));  // untold: at the next request that misses the cache
    }
    CHECK(sa->stats().reserved_bytes[kAllPools].current <= held - 64 * static_cast<std::int64_t>(MiB) + new_stream_cost);
    sa->validate();
    if (g != nullptr) sa.sim->graph_destroy(g);
    if (told) sa->release_graph_pool(2);
    sa->release_cached();
    CHECK(sa->stats().reserved_bytes[kAllPools].current == 0);
    sa.alloc.reset();
    CHECK(sa.sim->hazards().empty());
    sa.sim->stream_destroy(s);
    sa.sim->stream_destroy(u);
    sa.sim->stream_destroy(w);
  }
}

TEST_CASE("scale regression: release_cached forgets thousands of streams in one pass, not one search of them each") {
  // A stream per request: n streams, each with an idle handle and a reservation. release_cached
  // gives back their memory and ranges and forgets every stream: each forget searched and erased
  // the stream's arena in the list of all of them (O(n^2): 128k streams took 1.9 s).
  constexpr int n = 8000;
  Allocator a(sim_config(BackendKind::expandable, 1024 * GiB, "expandable_va_size:1GiB"));
  for (int i = 0; i < n; ++i) a.deallocate(a.allocate(512, stream_no(i)));
  const auto& be = backend_of(a);
  const std::uint64_t steps0 = be.slow_path_steps();
  a.release_cached();
  const std::uint64_t steps = be.slow_path_steps() - steps0;
  CAPTURE(steps);
  CHECK(steps <= 16 * n);  // the old searches, counted: 32 million
  CHECK(a.stats().reserved_bytes[kAllPools].current == 0);
  CHECK(a.stats().segment[kAllPools].current == 0);
  a.validate();
  a.deallocate(a.allocate(512, stream_no(n / 2)));  // a forgotten stream starts afresh
  a.validate();
}

TEST_CASE("scale regression: release_stream of one stream among thousands costs steps of its own, not a walk of them all") {
  // A stream per request with many others holding blocks: each release_stream forgot its arena and
  // the sweep at its end walked every arena (and every retired one) to take it out: a cache miss an
  // arena (16,000 streams: ~350 us a call). The arenas are lists now, and a sweep unlinks each
  // forgotten arena alone.
  constexpr int held = 4000;
  constexpr int released = 200;
  Allocator a(sim_config(BackendKind::expandable, 1024 * GiB, "expandable_va_size:1GiB"));
  std::vector<void*> kept;
  for (int i = 0; i < held; ++i) kept.push_back(a.allocate(512, stream_no(i)));
  const auto& be = backend_of(a);
  std::uint64_t most = 0;
  for (int i = 0; i < released; ++i) {
    void* s = stream_no(held + i);
    a.deallocate(a.allocate(512, s));
    const std::uint64_t steps0 = be.slow_path_steps();
    a.release_stream(s);
    most = std::max(most, be.slow_path_steps() - steps0);
  }
  CAPTURE(most);
  CHECK(most <= 8);  // the old sweep, counted: 4,000 and more a call
  CHECK(a.stats().segment[kAllPools].current == held);
  a.validate();
  for (void* p : kept) a.deallocate(p);
  a.release_cached();
  CHECK(a.stats().segment[kAllPools].current == 0);
  a.validate();
}

TEST_CASE("scale regression: unmapping the legacy stream's idle memory asks one capture question, not one per stream") {
  // PyTorch's default stream is the legacy stream. Before its idle memory is unmapped, its
  // synchronization must not break a capture; a capture on any blocking stream refuses it, and the
  // legacy stream's own question reveals every such capture. seen_capture also asked every plain
  // stream's arena, one driver query each: O(streams) per operation that unmapped that memory.
  constexpr int held = 300;
  Allocator a(sim_config(BackendKind::expandable, 1024 * GiB, "expandable_va_size:4GiB,limit:2GiB"));
  expseg::driver::Driver& drv = expseg::detail::AllocatorAccess::driver(a);
  std::vector<void*> kept;
  for (int i = 0; i < held; ++i) kept.push_back(a.allocate(512, stream_no(i)));  // 300 frames: 600 MiB
  void* big = a.allocate(1 * GiB, nullptr);
  void* pin = a.allocate(2 * MiB, nullptr);  // after `big`: the next request cannot grow it in place
  a.deallocate(big);
  const auto& be = backend_of(a);
  const std::uint64_t steps0 = be.slow_path_steps();
  const auto calls0 = drv.call_stats();
  // 1.25 GiB on the legacy stream: room only once `big`'s idle memory is unmapped (or moved), which
  // synchronizes the legacy stream first.
  void* next = a.allocate(1280 * MiB, nullptr);
  const auto d = drv.call_stats().since(calls0);
  const std::uint64_t queries = d.calls[static_cast<std::size_t>(expseg::driver::Op::stream_query)];
  const std::uint64_t syncs = d.calls[static_cast<std::size_t>(expseg::driver::Op::stream_sync)];
  CAPTURE(queries);
  CAPTURE(be.slow_path_steps() - steps0);
  CHECK(syncs >= 1);  // the idle memory was unmapped, after a synchronization
  CHECK(queries <= 4);  // the old question per arena, counted: 300 and more
  a.validate();
  a.deallocate(next);
  a.deallocate(pin);
  for (void* p : kept) a.deallocate(p);
  a.validate();
}

TEST_CASE("scale regression: streams that keep memory past the address space get smaller segments, not an OOM") {
  // Each stream's segment reserved 2x the device (160 GiB here); the process has 128 TiB of address
  // space, so about 800 streams holding a block each used it up, and the next stream's first request
  // was an OOM for the address range while the device had nearly all its memory free (the H200:
  // 112 TiB, ~400 streams). Once the segments hold 32 TiB, new ones reserve a sixteenth.
  constexpr int streams = 3000;
  auto sa = make_sim_allocator(sim_config(BackendKind::expandable, 80 * GiB));
  std::vector<void*> kept;
  for (int i = 0; i < streams; ++i) {
    CAPTURE(i);
    kept.push_back(sa->allocate(512, stream_no(i)));
  }
  CHECK(sa->stats().num_ooms == 0);
  CHECK(sa->stats().segment[kAllPools].current == streams);
  CHECK(sa.sim->calls(expseg::driver::Op::reserve) == streams);  // no reservation refused
  // A request larger than the smaller segments gets a segment of its own size.
  void* big = sa->allocate(60 * GiB, stream_no(streams - 1));
  sa->validate();
  sa->deallocate(big);
  for (void* p : kept) sa->deallocate(p);
  sa->release_cached();
  CHECK(sa->stats().segment[kAllPools].current == 0);
  sa->validate();
}

TEST_CASE("regression: the 32 TiB budget of full-size segments is the process's, shared by every device's allocator") {
  // The devices of a process share one address space: an allocator for device 1 counts the ranges
  // device 0's allocator holds. 20 segments of 1 TiB on device 0; device 1's first segment would
  // take the process past 32 TiB at 16 TiB, so it reserves a sixteenth (1 TiB).
  expseg::Config c0 = sim_config(BackendKind::expandable, 80 * GiB, "expandable_va_size:1TiB");
  expseg::Config c1 = sim_config(BackendKind::expandable, 80 * GiB, "expandable_va_size:16TiB");
  Allocator a0(c0, 0);
  std::vector<void*> kept;
  for (int i = 0; i < 20; ++i) kept.push_back(a0.allocate(512, stream_no(i)));
  {
    Allocator a1(c1, 1);
    void* p = a1.allocate(512);
    const auto& be1 = backend_of(a1);
    CHECK(be1.contains(reinterpret_cast<std::uint64_t>(p) + 512 * GiB));
    CHECK_FALSE(be1.contains(reinterpret_cast<std::uint64_t>(p) + 2048 * GiB));  // not 16 TiB
    a1.deallocate(p);
  }
  for (void* p : kept) a0.deallocate(p);
  a0.release_cached();
  {
    // Device 0's ranges went back: device 1's segment is full size again.
    Allocator a1(c1, 1);
    void* p = a1.allocate(512);
    CHECK(backend_of(a1).contains(reinterpret_cast<std::uint64_t>(p) + 8192 * GiB));
    a1.deallocate(p);
  }
}

TEST_CASE("regression: when the address space runs short, a new segment reserves less, down to the request's own size") {
  // Other reservations of the process (another library, other devices) can use up the address
  // space whatever expseg's budget: a refused reservation is tried again smaller, and the sizes
  // that served are where later segments start, until release_cached gives ranges back.
  auto sa = make_sim_allocator(sim_config(BackendKind::expandable, 80 * GiB));
  for (std::uint64_t i = 1; i <= 3; ++i) sa.sim->inject_fault(expseg::driver::Op::reserve, i, expseg::driver::Fault::out_of_memory);
  void* p = sa->allocate(4 * MiB, stream_no(1));  // 160 GiB, 40 GiB, 10 GiB refused; 2.5 GiB serves
  CHECK(sa.sim->calls(expseg::driver::Op::reserve) == 4);
  CHECK(sa->stats().num_ooms == 0);
  // The next stream starts at 2.5 GiB: one reservation, no refused attempt first.
  void* q = sa->allocate(4 * MiB, stream_no(2));
  CHECK(sa.sim->calls(expseg::driver::Op::reserve) == 5);
  // A request above that size still gets a segment of its own size.
  void* big = sa->allocate(8 * GiB, stream_no(3));
  CHECK(sa.sim->calls(expseg::driver::Op::reserve) == 6);
  sa->validate();
  for (void* x : {p, q, big}) sa->deallocate(x);
  sa->validate();
}

TEST_CASE("scale regression: out of address range, the unused streams' ranges go back in one pass") {
  // 4 TiB of address range, 1 GiB reserved a stream: ~4000 streams with an idle handle each fill
  // it. The next stream's reservation fails, and every other stream (none holds a block in use)
  // gives its memory and range back, each forgotten with a search of all of them.
  auto sa = make_sim_allocator(sim_config(BackendKind::expandable, 1024 * GiB, "expandable_va_size:1GiB"),
                               expseg::driver::SimOptions{.address_space = std::size_t{4} << 40});
  Allocator& a = *sa;
  int n = 0;
  std::int64_t before = 0;
  for (;; ++n) {
    before = a.stats().segment[kAllPools].current;
    const auto& be = backend_of(a);
    const std::uint64_t steps0 = be.slow_path_steps();
    a.deallocate(a.allocate(512, stream_no(n)));
    if (a.stats().segment[kAllPools].current > before) continue;
    // This request's range came from the others' (one segment left, its own).
    const std::uint64_t steps = be.slow_path_steps() - steps0;
    CAPTURE(n);
    CAPTURE(steps);
    CHECK(n > 3000);
    CHECK(steps <= 16 * static_cast<std::uint64_t>(n));  // the old searches, counted: 8.4 million
    break;
  }
  CHECK(a.stats().segment[kAllPools].current == 1);
  a.validate();
}

TEST_CASE("scale regression: thousands of released graph pools are found and forgotten without a search per pool") {
  // n graph pools, each given a block outside a capture (begin_pool_allocations) and released with
  // the block still allocated (a graph's output): n retired arenas, given back once the blocks are
  // freed. Finding them searched the list of retired arenas for each arena (O(n^2)), and forgetting
  // each searched the list of all arenas and that of the retired ones.
  constexpr int n = 2000;
  Allocator a(sim_config(BackendKind::expandable, 1024 * GiB, "expandable_va_size:1GiB"));
  void* s = stream_no(0);
  std::vector<void*> outputs;
  for (int i = 1; i <= n; ++i) {
    a.begin_pool_allocations(static_cast<std::uint64_t>(i), s);
    outputs.push_back(a.allocate(512, s));
    a.end_pool_allocations(static_cast<std::uint64_t>(i), s);
    a.release_graph_pool(static_cast<std::uint64_t>(i));
  }
  for (void* p : outputs) a.deallocate(p);
  CHECK(a.stats().segment[kAllPools].current == n);
  const auto& be = backend_of(a);
  const std::uint64_t steps0 = be.slow_path_steps();
  a.release_cached();
  const std::uint64_t steps = be.slow_path_steps() - steps0;
  CAPTURE(steps);
  CHECK(steps <= 16 * n);  // the old searches, counted: 8 million
  CHECK(a.stats().reserved_bytes[kAllPools].current == 0);
  CHECK(a.stats().segment[kAllPools].current == 0);
  a.validate();
}

TEST_CASE("scale regression: under a limit, a handle move looks at a window of idle handles, not at every one") {
  // 4096 blocks of one 2 MiB handle fill the 8 GiB limit; every other one is freed: 2048 idle
  // single-frame handles. A 4 MiB request maps a 2-frame handle at the limit: a move wants an idle
  // handle of 2 frames (at least 3/4 of them), there is none, and the search looked at all 2048
  // before the request reclaimed two of them and created its handle.
  constexpr int n = 4096;
  Allocator a(sim_config(BackendKind::expandable, 80 * GiB, "limit:8GiB"));
  std::vector<void*> ps;
  for (int i = 0; i < n; ++i) ps.push_back(a.allocate(2 * MiB));
  for (int i = 0; i < n; i += 2) a.deallocate(ps[static_cast<std::size_t>(i)]);
  const auto& be = backend_of(a);
  const std::uint64_t steps0 = be.search_steps();
  const auto allocs0 = a.stats().num_device_alloc;
  void* big = a.allocate(4 * MiB);
  const std::uint64_t steps = be.search_steps() - steps0;
  CAPTURE(steps);
  CHECK(a.stats().num_device_alloc == allocs0 + 1);  // no handle moved: a new one
  CHECK(steps <= 64);  // was ~2,050
  a.validate();
  a.deallocate(big);
  for (int i = 1; i < n; i += 2) a.deallocate(ps[static_cast<std::size_t>(i)]);
  a.release_cached();
  CHECK(a.stats().reserved_bytes[kAllPools].current == 0);
}

TEST_CASE("scale regression: the placement search looks at the runs that can hold the request, not at every unmapped hole") {
  // Without a limit and under one: 2 MiB blocks, every other one freed and given back
  // (release_cached): thousands of unmapped 2 MiB holes between live blocks. Each request of 6 MiB
  // fits no cached block and no hole's run, only the segment's unmapped tail; the search walked
  // every hole to get there (100,000 holes: 11.7 ms a request).
  for (const char* conf : {"", "limit:16GiB"}) {
    CAPTURE(conf);
    constexpr int n = 8192;
    Allocator a(sim_config(BackendKind::expandable, 80 * GiB, conf));
    std::vector<void*> ps;
    for (int i = 0; i < n; ++i) ps.push_back(a.allocate(2 * MiB));
    for (int i = 0; i < n; i += 2) a.deallocate(ps[static_cast<std::size_t>(i)]);
    a.release_cached();
    a.validate();
    const auto& be = backend_of(a);
    // The first search brings the run bytes of the holes release_cached made up to date: a walk of
    // them once, which the unmaps that made them paid for already. 20 MiB: no growth past it.
    std::vector<void*> big{a.allocate(20 * MiB)};
    // A run that a free grew beside holes (hole, ps[1], hole: 6 MiB, where each hole's run was
    // 2 MiB) is found: 4 MiB there maps one frame, at the tail two.
    a.deallocate(ps[1]);
    ps[1] = nullptr;
    big.push_back(a.allocate(4 * MiB));
    CHECK(addr(big.back()) == addr(ps[0]));
    a.validate();
    const std::uint64_t calls0 = be.slow_calls();
    const std::uint64_t steps0 = be.search_steps();
    constexpr int r = 64;
    for (int i = 0; i < r; ++i) {
      big.push_back(a.allocate(6 * MiB));
      if (i % 2 == 1) {  // frees beside the tail's run: its hole goes dirty, and its run grows back
        a.deallocate(big.back());
        big.pop_back();
      }
    }
    const std::uint64_t steps = be.search_steps() - steps0;
    CAPTURE(steps);
    CHECK(be.slow_calls() - calls0 >= r / 2);
    CHECK(steps <= 16 * r);  // was 108,000 (no limit) and 135,000: every hole, each slow request
    a.validate();
    for (void* p : big) a.deallocate(p);
    for (int i = 3; i < n; i += 2) a.deallocate(ps[static_cast<std::size_t>(i)]);
    a.release_cached();
    CHECK(a.stats().reserved_bytes[kAllPools].current == 0);
  }
}

}  // TEST_SUITE
