// REPRODUCERS (failing) of bad-input findings (issue 7). Run: build/tests/expseg_repro
#include <doctest/doctest.h>

#include "test_util.hpp"

using namespace testutil;
using expseg::BackendKind;

// 1. record_stream(nullptr, s) throws invalid_pointer "record_stream of pointer 0x0: double free
//    (this allocation was already freed)". allocate(0) returns nullptr and deallocate(nullptr) is a
//    no-op (PyTorch's behaviour); PyTorch's recordStream of a null data pointer (an empty tensor) is
//    a no-op too, so code that records every tensor's stream breaks on empty tensors. The message is
//    also wrong: nothing was freed. Its cause: Allocator::Impl::recent_frees starts zero-filled, so
//    address 0 always looks "recently freed".
TEST_CASE("repro: record_stream(nullptr) is a no-op like deallocate(nullptr)") {
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
  }
}

// 2. expandable: a request that can never be served (more than the device) first reserves a new
//    segment's virtual address range sized for it (cuMemAddressReserve of 1 TiB here; 2^60 bytes
//    for the largest accepted request), then fails with out_of_memory -- and keeps the segment:
//    stats().segment grows, the snapshot shows a new empty segment and the device one more
//    reservation, one per stream that asked. "After any throw the allocator is unchanged" does not
//    hold, and on a real GPU such a reservation can itself fail or take VA space for nothing.
//    split_merge leaves everything as it was. Expected: check the request against the device and
//    the limit before reserving, or give the fresh segment back when the allocation fails.
TEST_CASE("repro: expandable keeps no segment for a request larger than the device") {
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
