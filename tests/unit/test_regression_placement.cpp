// Regressions in expandable's slow path under a limit: which place a block goes to when the best
// ranked one lacks room, and what a failed handle move counts. Each case failed on the code before
// its fix.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "backends/expandable/expandable.hpp"
#include "driver/sim_driver.hpp"
#include "test_util.hpp"

using namespace testutil;
using expseg::BackendKind;
using expseg::kAllPools;

TEST_SUITE("expandable") {

TEST_CASE("placement regression: a request goes to a place with room when the best ranked place has none") {
  auto s = make_sim_allocator(sim_config(BackendKind::expandable, 1 * GiB, "limit:64MiB"));
  auto* a = static_cast<char*>(s->allocate(2 * MiB));  // page 0
  void* b = s->allocate(2 * MiB);                       // page 1
  void* c = s->allocate(8 * MiB);                       // pages 2-5
  auto* e = static_cast<char*>(s->allocate(1 * MiB));   // page 6, half used
  REQUIRE(e == a + 12 * MiB);
  s->deallocate(c);
  s->release_cached();  // pages 2-5 unmapped
  s->deallocate(b);     // page 1: an idle handle
  s->set_limit(6 * MiB);
  REQUIRE(s->stats().reserved_bytes[kAllPools].current == static_cast<std::int64_t>(6 * MiB));
  // 2.5 MiB fits after e: e's page and one more, 6 MiB touched in all once page 1 moves there. The
  // place after a ranks the same (one new page, one call) and comes first by address, but it covers
  // page 1 itself, so it needs a page the limit does not leave. Was: an OOM with verdict limit.
  char* r = nullptr;
  CHECK_NOTHROW(r = static_cast<char*>(s->allocate(2 * MiB + 512 * KiB)));
  CHECK(r == e + 1 * MiB);
  CHECK(s->stats().reserved_bytes[kAllPools].current <= static_cast<std::int64_t>(6 * MiB));
  s->validate();
  if (r != nullptr) s->deallocate(r);
  s->deallocate(e);
  s->deallocate(a);
  s->validate();
}

TEST_CASE("placement regression: a handle move whose mapping fails counts the handle given back") {
  using expseg::driver::Fault;
  using expseg::driver::Op;
  for (Op op : {Op::map, Op::set_access}) {
    CAPTURE(static_cast<int>(op));
    auto s = make_sim_allocator(sim_config(BackendKind::expandable, 1 * GiB, "limit:64MiB"));
    void* small = s->allocate(4 * MiB);
    void* big = s->allocate(58 * MiB);
    s->deallocate(small);  // a 4 MiB idle handle: the 5 MiB request below moves it (no room for a new one)
    const std::uint64_t calls_before = s.sim->calls(op);
    s.sim->inject_fault(op, 1, Fault::error);
    // The move was tried and its mapping failed (not an OOM without a move).
    try {
      (void)s->allocate(5 * MiB);
      FAIL("the request should fail at the moved handle's mapping");
    } catch (const expseg::driver_error& e) {
      CHECK(e.call() == (op == Op::map ? "cuMemMap" : "cuMemSetAccess"));
    }
    CHECK(s.sim->calls(op) == calls_before + 1);
    s->validate();
    const expseg::Stats st = s->stats();
    // Was: the moved handle was released without a device free (16 allocations, 0 frees, 15 held).
    CHECK(st.num_device_alloc - st.num_device_free == st.physical_handles.current);
    CHECK(static_cast<std::size_t>(st.physical_handles.current) == s.sim->live().handles);
    s->deallocate(big);
    s->release_cached();
    const expseg::Stats end = s->stats();
    CHECK(end.num_device_alloc == end.num_device_free);
    CHECK(s.sim->live().handles == 0);
  }
}

TEST_CASE("placement regression: over a lowered limit, a block does not pin a freed bulk handle") {
  auto s = make_sim_allocator(sim_config(BackendKind::expandable, 1 * GiB, "limit:258MiB"));
  void* a = s->allocate(16 * MiB);   // one 16 MiB handle
  void* d = s->allocate(2 * MiB);    // right after a: nothing placed in a's handle can grow past it
  void* b = s->allocate(240 * MiB);
  s->set_limit(200 * MiB);           // below the 258 MiB held, all of it live
  s->deallocate(a);                  // a's handle idle: what is held is still above the limit
  REQUIRE(s->stats().reserved_bytes[kAllPools].current == static_cast<std::int64_t>(258 * MiB));
  void* small = s->allocate(1 * MiB);
  // Was: carved from a's cached handle, which it then pinned. Now the handle is swapped for the one
  // page the block needs, and what is held falls.
  CHECK(s->stats().reserved_bytes[kAllPools].current == static_cast<std::int64_t>(244 * MiB));
  s->validate();
  s->deallocate(b);
  s->set_limit(64 * MiB);
  // 4 MiB of live pages (d, small) + 60 MiB = the limit. Was: an OOM with verdict fragmentation
  // (a's 16 MiB still held for small).
  void* big = nullptr;
  CHECK_NOTHROW(big = s->allocate(60 * MiB));
  CHECK(s->stats().reserved_bytes[kAllPools].current <= static_cast<std::int64_t>(64 * MiB));
  s->validate();
  if (big != nullptr) s->deallocate(big);
  s->deallocate(small);
  s->deallocate(d);
  s->validate();
}

TEST_CASE("placement regression: random requests, frees and limit changes never fail for fragmentation") {
  // The rule under a limit holds across set_limit, lowered below what is held or raised: every OOM
  // has verdict limit. Was: 33 fragmentation OOMs in 200 seeds of this churn (a cached bulk handle
  // pinned over a lowered limit), 0 since.
  std::size_t ooms = 0;
  std::size_t limit_changes = 0;
  for (unsigned seed = 1; seed <= 60; ++seed) {
    CAPTURE(seed);
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<double> u(0, 1);
    auto s = make_sim_allocator(sim_config(BackendKind::expandable, 1 * GiB, "limit:512MiB"));
    std::vector<void*> live;
    auto free_one = [&] {
      const std::size_t i = rng() % live.size();
      s->deallocate(live[i]);
      live[i] = live.back();
      live.pop_back();
    };
    for (int step = 0; step < 4000; ++step) {
      const double r = u(rng);
      if (r < 0.02) {
        static constexpr std::size_t kLimits[] = {96 * MiB, 192 * MiB, 256 * MiB, 384 * MiB, 512 * MiB, 768 * MiB};
        s->set_limit(kLimits[rng() % 6]);
        ++limit_changes;
      } else if (r < 0.45 && !live.empty()) {
        free_one();
      } else {
        const auto bytes = static_cast<std::size_t>(std::exp(std::log(4096.0) + u(rng) * std::log(128.0 * MiB / 4096.0)));  // 4 KiB - 128 MiB
        try {
          live.push_back(s->allocate(bytes));
        } catch (const expseg::out_of_memory& e) {
          ++ooms;
          CHECK_MESSAGE(e.report().verdict != expseg::OomVerdict::fragmentation, e.what());
          for (std::size_t k = live.size() / 2; k > 0; --k) free_one();
        }
      }
    }
    s->validate();
    for (void* p : live) s->deallocate(p);
    s->validate();
  }
  CHECK(ooms > 1000);  // the churn does reach the limits
  CHECK(limit_changes > 1000);
}
}

TEST_SUITE("expandable") {

TEST_CASE("placement regression: a cached pair that lands inside a long free run does not search the run each time") {
  // n freed 32 MiB blocks, each on a handle of its own, merged into one mapped free block, with an
  // idle 16 MiB handle near its far end. Under a limit a 16 MiB block may cover idle bulk handles
  // only wholly, so neither end of the free block serves it, only that handle. Was: every pair
  // took the slow path, whose search walked all n handles (1.9 M instructions per pair at n =
  // 10,000); the place it found is now remembered for the next request of that size.
  for (const int n : {10, 200}) {
    CAPTURE(n);
    auto sa = make_sim_allocator(sim_config(BackendKind::expandable, 80 * GiB, "limit:64GiB"));
    std::vector<void*> held;
    for (int i = 0; i < n; ++i) held.push_back(sa->allocate(32 * MiB));
    held.push_back(sa->allocate(16 * MiB));
    held.push_back(sa->allocate(32 * MiB));
    for (void* p : held) sa->deallocate(p);
    REQUIRE(sa->stats().physical_handles.current == n + 2);
    const auto& be = dynamic_cast<const expseg::backends::ExpandableBackend&>(expseg::detail::AllocatorAccess::backend(*sa.alloc));
    void* first = sa->allocate(16 * MiB);  // the slow path finds the idle 16 MiB handle
    const auto pinned = sa->stats().physical_handles.current;
    sa->deallocate(first);
    const std::uint64_t slow0 = be.slow_calls();
    const std::uint64_t steps0 = be.search_steps();
    const auto calls0 = sa.sim->call_stats().calls;
    for (int i = 0; i < 100; ++i) {
      void* p = sa->allocate(16 * MiB);
      CHECK(p == first);  // the same place: on the idle 16 MiB handle, pinning no bulk handle
      sa->deallocate(p);
    }
    CHECK(be.slow_calls() == slow0);
    CHECK(be.search_steps() == steps0);
    CHECK(sa.sim->call_stats().calls == calls0);  // no driver call: cached memory
    CHECK(sa->stats().physical_handles.current == pinned);
    sa->validate();
  }
}

TEST_CASE("placement regression: a remembered place that is no longer free or mapped is not used") {
  auto sa = make_sim_allocator(sim_config(BackendKind::expandable, 80 * GiB, "limit:4GiB"));
  std::vector<void*> held;
  for (int i = 0; i < 8; ++i) held.push_back(sa->allocate(32 * MiB));
  held.push_back(sa->allocate(16 * MiB));
  held.push_back(sa->allocate(32 * MiB));
  for (void* p : held) sa->deallocate(p);
  void* first = sa->allocate(16 * MiB);  // remembered: inside the free run, on the 16 MiB handle
  sa->deallocate(first);
  // Taken by another block: the next 16 MiB request must go elsewhere.
  auto* big = static_cast<char*>(sa->allocate(8 * 32 * MiB + 16 * MiB));
  REQUIRE(big != nullptr);
  CHECK(static_cast<char*>(first) >= big);
  CHECK(static_cast<char*>(first) < big + 8 * 32 * MiB + 16 * MiB);
  void* p = sa->allocate(16 * MiB);
  CHECK(p != first);
  sa->validate();
  sa->deallocate(p);
  sa->deallocate(big);
  // Unmapped by release_cached: the remembered place holds no memory; a request maps anew.
  sa->release_cached();
  REQUIRE(sa->stats().reserved_bytes[kAllPools].current == 0);
  void* q = sa->allocate(16 * MiB);
  CHECK(q != nullptr);
  CHECK(sa->stats().reserved_bytes[kAllPools].current == static_cast<std::int64_t>(16 * MiB));
  sa->validate();
  sa->deallocate(q);
}

}  // TEST_SUITE
