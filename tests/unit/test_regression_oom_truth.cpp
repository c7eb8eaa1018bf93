// Regressions (found by an audit of the OOM report against the allocator's own figures):
//   - an OOM where the driver refused memory (or expandable's address range for a new segment)
//     that the limit and the device's free memory left room for was called fragmentation, and the
//     message said the device left no room while it reported all its memory free.
#include <doctest/doctest.h>

#include <optional>
#include <string>
#include <vector>

#include "test_util.hpp"

using namespace testutil;
using expseg::BackendKind;
using expseg::kAllPools;
using expseg::driver::Fault;
using expseg::driver::Op;

namespace {
template <class F>
std::optional<expseg::OomReport> oom_of(F&& f) {
  try {
    f();
  } catch (const expseg::out_of_memory& e) {
    return e.report();
  }
  return std::nullopt;
}
}  // namespace

TEST_CASE("oom truth: a driver that refuses room the figures leave is no fragmentation (memory, and expandable's address range)") {
  // Nothing live, nothing held, the device all free: the report said "fragmentation ... 0 bytes is
  // reserved but unallocated in 0 free blocks ... and the device leaves no room for more".
  struct Case {
    BackendKind backend;
    Op op;
    int faults;
    const char* says;
  };
  for (const Case& c : {Case{BackendKind::split_merge, Op::mem_alloc, 3,
                             "The driver refused the memory the request needs (20.00 MiB) with out of memory, although the device reports 1024.00 MiB free"},
                        Case{BackendKind::expandable, Op::create, 1,
                             "The driver refused the memory the request needs (4.00 MiB) with out of memory, although the device reports 1024.00 MiB free"},
                        Case{BackendKind::expandable, Op::reserve, 1,
                             "No address range could be reserved for a new segment (cuMemAddressReserve: out of memory), although the device has "
                             "1024.00 MiB of memory free"}}) {
    CAPTURE(expseg::to_string(c.backend));
    CAPTURE(static_cast<int>(c.op));
    auto sa = make_sim_allocator(sim_config(c.backend, 1 * GiB));
    for (int i = 1; i <= c.faults; ++i) sa.sim->inject_fault(c.op, static_cast<std::uint64_t>(i), Fault::out_of_memory);
    const auto r = oom_of([&] { sa->allocate(4 * MiB); });
    REQUIRE(r.has_value());
    CAPTURE(r->message);
    CHECK(r->verdict == expseg::OomVerdict::capacity);
    CHECK(r->message.find("leaves no room") == std::string::npos);
    CHECK(r->message.find(c.says) != std::string::npos);
    sa->validate();
    void* p = sa->allocate(4 * MiB);  // the fault has passed
    sa->deallocate(p);
  }
}
