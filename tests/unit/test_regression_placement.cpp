// Regressions in expandable's slow path under a limit: which place a block goes to when the best
// ranked one lacks room, and what a failed handle move counts. Each case failed on the code before
// its fix.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

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
    s.sim->inject_fault(op, 1, Fault::error);
    CHECK_THROWS(s->allocate(5 * MiB));
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
