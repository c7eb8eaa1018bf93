// Regressions in the statistics that torch.cuda.memory_stats() and CuPy's pool views read from
// expseg (stats.hpp), found by comparing them key by key with PyTorch's. Each case failed on the
// code before its fix.
#include <doctest/doctest.h>

#include "core/json.hpp"
#include "test_util.hpp"

using namespace testutil;
using expseg::Allocator;
using expseg::BackendKind;

TEST_SUITE("stats") {

TEST_CASE("stats regression: device allocations and frees pair up once everything is given back, idle handles moved too") {
  // Under a limit, expandable moves an idle handle of one stream to where another needs memory
  // (unmap and map, no release and create). It counted the unmap as a device free but the mapping
  // as no allocation: after release_cached, 25 allocations against 40 frees here.
  for (BackendKind backend : {BackendKind::split_merge, BackendKind::expandable}) {
    CAPTURE(static_cast<int>(backend));
    Allocator a(sim_config(backend, 8 * GiB, "limit:100MiB"));
    auto* sa = reinterpret_cast<void*>(std::uintptr_t{0x1000});
    auto* sb = reinterpret_cast<void*>(std::uintptr_t{0x2000});
    a.deallocate(a.allocate(80 * MiB, sa));
    a.deallocate(a.allocate(80 * MiB, sb));  // A's idle memory moves (expandable) or goes back (split_merge)
    const expseg::Stats mid = a.stats();
    CHECK(mid.num_device_alloc - mid.num_device_free == mid.physical_handles.current);
    a.release_cached();
    const expseg::Stats s = a.stats();
    CHECK(s.reserved_bytes[expseg::kAllPools].current == 0);
    CHECK(s.physical_handles.current == 0);
    CHECK(s.num_device_alloc > 0);
    CHECK(s.num_device_alloc == s.num_device_free);
  }
}

TEST_CASE("stats regression: both backends report the max_split_size their oversize_allocations count against") {
  // PyTorch reports max_split_size from its configuration whatever the segments are, and counts
  // oversize_allocations against it; expandable counted them but reported -1 (unlimited).
  for (BackendKind backend : {BackendKind::split_merge, BackendKind::expandable}) {
    CAPTURE(static_cast<int>(backend));
    Allocator a(sim_config(backend, 80 * GiB, "max_split_size_mb:20"));
    void* p = a.allocate(32 * MiB);
    const expseg::Stats s = a.stats();
    CHECK(s.oversize_allocations.current == 1);
    CHECK(s.max_split_size == static_cast<std::int64_t>(20 * MiB));
    const auto json = expseg::core::parse_json(s.to_json());
    CHECK(json["max_split_size"].as_int() == static_cast<std::int64_t>(20 * MiB));
    a.deallocate(p);
  }
}

}  // TEST_SUITE

TEST_SUITE("stats") {

TEST_CASE("stats regression: a device free that fails is counted when a retry succeeds, not before") {
  // num_device_free counts memory given back to the device (PyTorch counts a cudaFree that
  // succeeded). Was: expandable counted a cuMemRelease that failed, and again nothing when the
  // handle, kept as an orphan, was released later; split_merge counts only a cuMemFree that worked.
  for (BackendKind kind : {BackendKind::split_merge, BackendKind::expandable}) {
    CAPTURE(std::string(expseg::to_string(kind)));
    auto sa = make_sim_allocator(sim_config(kind, 1 * GiB));
    sa->deallocate(sa->allocate(64 * MiB));
    REQUIRE(sa->stats().num_device_alloc == 1);
    const auto op = kind == BackendKind::expandable ? expseg::driver::Op::release : expseg::driver::Op::mem_free;
    sa.sim->inject_fault(op, 1, expseg::driver::Fault::error);
    CHECK_THROWS_AS(sa->release_cached(), expseg::driver_error);
    CHECK(sa.sim->live().physical_bytes == 64 * MiB);  // still held
    CHECK(sa->stats().num_device_free == 0);
    sa->release_cached();  // the retry succeeds
    CHECK(sa.sim->live().physical_bytes == 0);
    CHECK(sa->stats().num_device_free == 1);
    sa->validate();
  }
}

}  // TEST_SUITE
