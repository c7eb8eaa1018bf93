// What the allocator keeps per stream must go when the stream's memory does: split_merge's free
// indexes (~16 KB each, per pool and stream) of streams and released graph pools, and what
// expseg_cupy_malloc cached for a stream when expseg_release_stream names it. Each case failed on
// the code before its fix.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>

#include "allocator_impl.hpp"
#include "backends/split_merge/split_merge.hpp"
#include "capi_fixture.hpp"
#include "driver/sim_driver.hpp"
#include "expseg/allocator.hpp"
#include "expseg/expseg.h"
#include "test_util.hpp"

using namespace testutil;
using expseg::BackendKind;
using expseg::kAllPools;

namespace {

std::int64_t reserved(expseg::Allocator& a) { return a.stats().reserved_bytes[kAllPools].current; }

std::size_t stream_indexes(expseg::Allocator& a) {
  auto& sm = dynamic_cast<expseg::backends::SplitMergeBackend&>(expseg::detail::AllocatorAccess::backend(a));
  return sm.stream_indexes();
}

}  // namespace

TEST_SUITE("regression-growth") {

TEST_CASE("split_merge: a stream per request leaves no free index behind once its memory is given back") {
  auto sa = make_sim_allocator(sim_config(BackendKind::split_merge));
  void* held = sa.sim->stream_create();
  void* live = sa->allocate(4 * MiB, held);  // a live block: its stream's index stays
  for (int i = 0; i < 300; ++i) {
    void* s = sa.sim->stream_create();
    sa->deallocate(sa->allocate(1000, s));      // small pool
    sa->deallocate(sa->allocate(30 * MiB, s));  // large pool
  }
  sa->validate();
  sa->release_cached();
  // Was: 601, an index per pool for every stream ever used (~10 MB here).
  CHECK(stream_indexes(*sa) == 1);
  CHECK(reserved(*sa) == static_cast<std::int64_t>(20 * MiB));
  sa->validate();
  sa->deallocate(live);
  sa->release_cached();
  CHECK(stream_indexes(*sa) == 0);
  CHECK(reserved(*sa) == 0);
  // A stream used again gets a new index.
  sa->deallocate(sa->allocate(1000, held));
  CHECK(stream_indexes(*sa) == 1);
  sa->validate();
}

TEST_CASE("split_merge: under a limit, the last retry before an OOM forgets the indexes of the streams it emptied") {
  // Each new stream's request fits only once the previous stream's cached segment is given back
  // (release_cached_blocks), which leaves that stream with no segment.
  auto sa = make_sim_allocator(sim_config(BackendKind::split_merge, 80 * GiB, "limit:64MiB"));
  for (int i = 0; i < 100; ++i) {
    void* s = sa.sim->stream_create();
    sa->deallocate(sa->allocate(40 * MiB, s));
  }
  CHECK(sa->stats().num_ooms == 0);
  CHECK(reserved(*sa) == static_cast<std::int64_t>(40 * MiB));
  // Was: 100 (no release_cached ran).
  CHECK(stream_indexes(*sa) == 1);  // the last stream's, whose segment stays cached
  sa->validate();
}

TEST_CASE("split_merge: released graph pools leave no free index behind once their memory is given back") {
  // A graph per step, each with its own private pool, released when the graph is destroyed. Under
  // a limit, the next eager request that needs the released pool's memory takes it back at its
  // last retry (PyTorch's release_cached_blocks); the pool's index went only at release_cached.
  auto sa = make_sim_allocator(sim_config(BackendKind::split_merge, 1 * GiB, "limit:40MiB"));
  void* s = sa.sim->stream_create();
  for (std::uint64_t pool = 1; pool <= 50; ++pool) {
    sa.sim->capture_begin(s);
    sa->begin_graph_pool(pool, s);
    sa->deallocate(sa->allocate(1000, s));  // a 2 MiB segment of the pool
    const auto g = sa.sim->capture_end(s);
    sa->end_graph_pool(pool);
    sa.sim->graph_destroy(g);
    sa->release_graph_pool(pool);
    void* eager = sa.sim->stream_create();
    sa->deallocate(sa->allocate(39 * MiB, eager));  // 40 MiB: only with the pool's 2 MiB given back
    sa->release_stream(eager);
    CHECK(reserved(*sa) == 0);
  }
  CHECK(sa->stats().num_ooms == 0);
  // Was: 50, one per released pool, until release_cached.
  CHECK(stream_indexes(*sa) == 0);
  sa->validate();
}

TEST_CASE("C API: expseg_release_stream gives back what expseg_cupy_malloc cached for the stream") {
  // expseg_cupy_malloc caches a stream's memory under its foreign key; expseg_release_stream
  // looked only at the stream itself, returned success, and the memory stayed cached for good
  // (the stream may be destroyed next).
  for (BackendKind kind : {BackendKind::split_merge, BackendKind::expandable}) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    CApiFixture fixture;
    REQUIRE(expseg_configure(("device:sim,sim_capacity:80GiB,backend:" + backend).c_str()) == EXPSEG_SUCCESS);
    void* first = expseg_cupy_malloc(nullptr, MiB, 0);  // creates the allocator
    REQUIRE(first != nullptr);
    expseg::Allocator* a = expseg::capi::allocator_for_tests(0);
    REQUIRE(a != nullptr);
    auto& sim = dynamic_cast<expseg::driver::SimDriver&>(expseg::detail::AllocatorAccess::driver(*a));
    const std::int64_t before = reserved(*a);
    void* s = sim.stream_create();
    void* p = expseg_cupy_malloc(s, 60 * MiB, 0);
    void* q = expseg_malloc(static_cast<ssize_t>(8 * MiB), 0, s);  // the PyTorch entry point's, on the same stream
    REQUIRE(p != nullptr);
    REQUIRE(q != nullptr);
    expseg_free(q, 0, 0, s);
    const std::int64_t with = reserved(*a);
    // A live block of the stream's CuPy allocations: refused, nothing changed (was: success).
    CHECK(expseg_release_stream(0, s) == EXPSEG_ERROR_INVALID_ARGUMENT);
    CHECK(std::string(expseg_last_error()).find("in use") != std::string::npos);
    CHECK(reserved(*a) == with);
    expseg_cupy_free(s, p, 0);
    CHECK(expseg_release_stream(0, s) == EXPSEG_SUCCESS);
    CHECK(reserved(*a) == before);  // was: the 60 MiB stayed
    for (const expseg::SegmentInfo& seg : a->snapshot().segments) CHECK(seg.stream != addr(s));
    a->validate();
    sim.stream_destroy(s);
    expseg_cupy_free(nullptr, first, 0);
    a->validate();
  }
}

TEST_CASE("C API: expseg_release_stream of a CuPy stream while another stream captures") {
  // The stream is synchronized by the call itself, so giving back its CuPy memory takes no other
  // synchronization, which a capture elsewhere would refuse. Was (expandable): the stream's own
  // memory given back, then "invariant broken: release_stream: an arena with no block in use kept
  // a segment", as the foreign key's memory waited for a device synchronization.
  for (BackendKind kind : {BackendKind::split_merge, BackendKind::expandable}) {
    for (const bool blocking : {false, true}) {
      const std::string backend = expseg::to_string(kind);
      CAPTURE(backend);
      CAPTURE(blocking);
      CApiFixture fixture;
      REQUIRE(expseg_configure(("device:sim,sim_capacity:80GiB,backend:" + backend).c_str()) == EXPSEG_SUCCESS);
      void* first = expseg_cupy_malloc(nullptr, MiB, 0);  // creates the allocator
      REQUIRE(first != nullptr);
      expseg::Allocator* a = expseg::capi::allocator_for_tests(0);
      REQUIRE(a != nullptr);
      auto& sim = dynamic_cast<expseg::driver::SimDriver&>(expseg::detail::AllocatorAccess::driver(*a));
      const std::int64_t before = reserved(*a);
      void* s = blocking ? sim.stream_create_blocking() : sim.stream_create();
      void* p = expseg_cupy_malloc(s, 60 * MiB, 0);
      REQUIRE(p != nullptr);
      expseg_cupy_free(s, p, 0);
      void* x = sim.stream_create_blocking();  // a blocking stream's capture: the legacy stream's and the device's synchronizations invalidate it
      sim.capture_begin(x);
      CHECK(expseg_release_stream(0, s) == EXPSEG_SUCCESS);
      CHECK(reserved(*a) == before);
      a->validate();
      expseg::driver::graph_t g = nullptr;
      CHECK_NOTHROW(g = sim.capture_end(x));  // still valid: nothing synchronized but s
      if (g != nullptr) sim.graph_destroy(g);
      sim.stream_destroy(x);
      sim.stream_destroy(s);
      expseg_cupy_free(nullptr, first, 0);
      a->validate();
    }
  }
}

}  // TEST_SUITE
