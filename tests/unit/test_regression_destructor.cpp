// Regression (issue 7): a single failing driver call while an allocator is destroyed must not leak
// what that call was to give back, on either backend: the destructors try each call once more.
#include <doctest/doctest.h>

#include "test_util.hpp"

using namespace testutil;
using expseg::driver::Fault;
using expseg::driver::Op;

TEST_CASE("regression: one failing driver call during destruction leaks nothing") {
  struct Case {
    expseg::BackendKind backend;
    Op op;
  };
  for (const Case& c : {Case{expseg::BackendKind::expandable, Op::unmap}, Case{expseg::BackendKind::expandable, Op::release},
                        Case{expseg::BackendKind::expandable, Op::free_reserve}, Case{expseg::BackendKind::split_merge, Op::mem_free}}) {
    INFO("backend: " << std::string(expseg::to_string(c.backend)) << ", failing: " << std::string(expseg::driver::op_name(c.op)));
    auto sa = make_sim_allocator(sim_config(c.backend, 1 * GiB));
    (void)sa->allocate(8 * MiB);  // live at destruction: given back too
    sa.sim->inject_fault(c.op, 1, Fault::error);
    sa.alloc.reset();
    CHECK(sa.sim->calls(c.op) == 2);  // the failure fired in the destructor, and the call was made again
    const auto live = sa.sim->live();
    CHECK(live.reservations == 0);
    CHECK(live.handles == 0);
    CHECK(live.mappings == 0);
    CHECK(live.mem_allocs == 0);
    CHECK(live.physical_bytes == 0);
  }
}
