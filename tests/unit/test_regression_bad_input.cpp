// Regressions of bad-input findings of the reliability work (issue 7), fixed; kept as tests.
#include <doctest/doctest.h>

#include "test_util.hpp"

using namespace testutil;
using expseg::BackendKind;

// 1. record_stream(nullptr, s) is a no-op, as deallocate(nullptr) and PyTorch's recordStream of an
//    empty tensor are (it used to throw a "double free" error for address 0).
TEST_CASE("regression: record_stream(nullptr) is a no-op like deallocate(nullptr)") {
  for (BackendKind b : {BackendKind::split_merge, BackendKind::expandable}) {
    INFO("backend: " << std::string(expseg::to_string(b)));
    expseg::Allocator a(sim_config(b));
    CHECK(a.allocate(0) == nullptr);
    a.deallocate(nullptr);
    try {
      a.record_stream(nullptr, stream_id(3));
    } catch (const std::exception& e) {
      FAIL_CHECK("record_stream(nullptr) threw: " << std::string(e.what()));
    }
    // Nothing recorded: the stream is no block's recorded use, so release_stream accepts it (a
    // recorded use refuses it), and the counts are unchanged.
    const expseg::Stats before = a.stats();
    CHECK_NOTHROW(a.release_stream(stream_id(3)));
    CHECK(a.stats().num_alloc_retries == before.num_alloc_retries);
    CHECK(a.stats().allocation[expseg::kAllPools].current == 0);
    a.validate();
  }
}

// 2. expandable: a request that can never be served (more than the device) fails before any
//    address range is reserved, and a segment reserved for a request that then fails is given back:
//    the allocator is unchanged after the out_of_memory (it used to keep an empty segment).
TEST_CASE("regression: expandable keeps no segment for a request larger than the device") {
  auto sa = make_sim_allocator(sim_config(BackendKind::expandable, 8 * GiB));
  void* keep = sa->allocate(1 * MiB);
  const auto segments = sa->stats().segment[expseg::kAllPools].current;
  const auto reservations = sa.sim->live().reservations;
  for (void* stream : {static_cast<void*>(nullptr), stream_id(9)}) {
    CHECK_THROWS_AS((void)sa->allocate(std::size_t{1} << 40, stream), expseg::out_of_memory);
    CHECK(sa->stats().segment[expseg::kAllPools].current == segments);
    CHECK(sa.sim->live().reservations == reservations);
  }
  sa->deallocate(keep);
}
