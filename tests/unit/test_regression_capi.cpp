// Regressions found by an audit of the C API's side effects and the OOM path: calls that refuse
// must not create a device's allocator first (after which expseg_configure is refused for good), a
// query must not create one, and an OOM must reach the caller as an OOM even when host memory runs
// out while its report is built. Each case failed on the code before its fix.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdlib>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include <unistd.h>

#include "allocator_impl.hpp"
#include "c_api_internal.hpp"
#include "core/json.hpp"
#include "driver/sim_driver.hpp"
#include "capi_fixture.hpp"
#include "expseg/allocator.hpp"
#include "expseg/errors.hpp"
#include "expseg/expseg.h"
#include "test_util.hpp"

using namespace testutil;
using expseg::BackendKind;


namespace {


std::string last_error() { return expseg_last_error(); }


}  // namespace

TEST_SUITE("c_api") {

TEST_CASE_FIXTURE(CApiFixture, "capi regression: expseg_get_limit is a query: it creates no allocator, and answers as the allocator will") {
  REQUIRE(expseg_configure("device:sim,sim_capacity:4GiB,limit:50%") == EXPSEG_SUCCESS);
  std::size_t limit = 7, total = 7;
  REQUIRE(expseg_get_limit(3, &limit, &total) == EXPSEG_SUCCESS);
  CHECK(limit == 2 * GiB);  // the fraction, of the device's memory
  CHECK(total == 4 * GiB);
  // Was: device 3's allocator was created, and the configuration could no longer be set (PyTorch's
  // get_per_process_memory_fraction before the first tensor locked the configuration).
  CHECK(expseg_device_initialized(3) == 0);
  CHECK(expseg_get_limit(3, nullptr, nullptr) == EXPSEG_SUCCESS);
  CHECK(expseg_get_limit(3, &limit, nullptr) == EXPSEG_SUCCESS);
  CHECK(expseg_device_initialized(3) == 0);
  REQUIRE(expseg_configure("device:sim,sim_capacity:8GiB,limit:25%") == EXPSEG_SUCCESS);
  REQUIRE(expseg_get_limit(3, &limit, &total) == EXPSEG_SUCCESS);
  CHECK(limit == 2 * GiB);
  CHECK(total == 8 * GiB);
  // Once the allocator exists: the same answers, from it.
  void* p = expseg_malloc(static_cast<ssize_t>(MiB), 3, nullptr);
  REQUIRE(p != nullptr);
  std::size_t limit2 = 0, total2 = 0;
  REQUIRE(expseg_get_limit(3, &limit2, &total2) == EXPSEG_SUCCESS);
  CHECK(limit2 == limit);
  CHECK(total2 == total);
  expseg_free(p, 0, 3, nullptr);
  // A bad configuration is still reported by the query, as it was when it created the allocator.
  expseg::capi::reset_for_tests();
  ::setenv("EXPSEG_ALLOC_CONF", "backend:nonsense", 1);
  CHECK(expseg_get_limit(0, &limit, &total) == EXPSEG_ERROR_CONFIG);
  ::unsetenv("EXPSEG_ALLOC_CONF");
  CHECK(expseg_get_limit(EXPSEG_MAX_DEVICES, &limit, &total) == EXPSEG_ERROR_INVALID_DEVICE);
}

TEST_CASE_FIXTURE(CApiFixture, "capi regression: a refused expseg_ipc_import creates no allocator") {
  REQUIRE(expseg_configure("device:sim,sim_host_backed:true,sim_capacity:1GiB,backend:expandable,ipc_handle:posix_fd,"
                           "expandable_max_handle:2MiB") == EXPSEG_SUCCESS);
  void* p = expseg_malloc(static_cast<ssize_t>(4 * MiB), 0, nullptr);
  REQUIRE(p != nullptr);
  const ExportedHandle exported = export_handle(p, 0);
  const std::vector<unsigned char>& bytes = exported.bytes;
  const std::vector<int>& own = exported.fds;
  REQUIRE(own.size() == 2);

  void* q = nullptr;
  std::size_t size = 0;
  // Malformed bytes and the wrong number of descriptors were refused before (guards).
  const std::vector<unsigned char> garbage(64, 0xab);
  CHECK(expseg_ipc_import(garbage.data(), garbage.size(), nullptr, 0, 2, &q, &size) == EXPSEG_ERROR_IPC);
  CHECK(expseg_ipc_import(bytes.data(), bytes.size() - 1, own.data(), own.size(), 2, &q, &size) == EXPSEG_ERROR_IPC);
  CHECK(expseg_ipc_import(bytes.data(), bytes.size(), own.data(), 1, 2, &q, &size) == EXPSEG_ERROR_IPC);
  CHECK(expseg_device_initialized(2) == 0);
  // A descriptor that is not open: refused before the allocator is created, as a bad argument.
  const int closed_fd = ::dup(own[0]);
  REQUIRE(closed_fd >= 0);
  ::close(closed_fd);
  const int with_closed[2] = {own[0], closed_fd};
  CHECK(expseg_ipc_import(bytes.data(), bytes.size(), with_closed, 2, 2, &q, &size) == EXPSEG_ERROR_INVALID_ARGUMENT);
  CHECK(last_error().find("descriptor 1") != std::string::npos);
  CHECK(last_error().find("not open") != std::string::npos);
  // Was: device 2's allocator was created, then the driver refused the descriptor.
  CHECK(expseg_device_initialized(2) == 0);
  // A simulated device's handle on a device that did not export it: the simulator imports it only
  // through the exporting allocator (device 0 here).
  CHECK(expseg_ipc_import(bytes.data(), bytes.size(), own.data(), own.size(), 2, &q, &size) == EXPSEG_ERROR_IPC);
  CHECK(last_error().find("device 0") != std::string::npos);
  CHECK(q == nullptr);
  CHECK(size == 0);
  // Was: device 2's allocator was created for an import that could not succeed.
  CHECK(expseg_device_initialized(2) == 0);
  // The exporting device imports it (the checks refuse nothing that works).
  REQUIRE(expseg_ipc_import(bytes.data(), bytes.size(), own.data(), own.size(), 0, &q, &size) == EXPSEG_SUCCESS);
  CHECK(size == 4 * MiB);
  CHECK(expseg_ipc_close(q, 0) == EXPSEG_SUCCESS);
  expseg_free(p, 0, 0, nullptr);

  // A handle of a simulated device where allocators are created on CUDA: refused as a handle of
  // another device kind (EXPSEG_ERROR_IPC, expseg.h), before any allocator is created. Was: the
  // CUDA allocator was created first (or, without a GPU, its creation failed with a driver error).
  expseg::capi::reset_for_tests();
  REQUIRE(expseg_configure("device:cuda") == EXPSEG_SUCCESS);
  CHECK(expseg_ipc_import(bytes.data(), bytes.size(), own.data(), own.size(), 0, &q, &size) == EXPSEG_ERROR_IPC);
  CHECK(last_error().find("sim") != std::string::npos);
  CHECK(expseg_device_initialized(0) == 0);
  for (int fd : own) ::close(fd);
}

}  // TEST_SUITE

TEST_SUITE("robust") {

TEST_CASE("capi regression: host memory running out while the OOM report is built still gives an out-of-memory error") {
  for (BackendKind b : {BackendKind::split_merge, BackendKind::expandable}) {
    CAPTURE(static_cast<int>(b));
    auto sa = make_sim_allocator(sim_config(b, 8 * GiB, "oom_snapshot:true"));
    void* keep = sa->allocate(4 * MiB);
    // 1 EiB and more never reaches the backend: every allocation the call makes is the report's.
    const std::size_t huge = std::size_t{1} << 60;
    int shorts = 0;
    std::uint64_t n = 1;
    for (;; ++n) {
      CAPTURE(n);
      const std::size_t request = huge + n;
      std::optional<expseg::out_of_memory> oom;  // copied without the heap: nothing here may allocate
      const bool fired = with_nth_new_failing(n, [&] {
        try {
          (void)sa->allocate(request);
        } catch (const expseg::out_of_memory& e) {
          oom.emplace(e);
        } catch (const std::bad_alloc&) {
          // Was: a plain std::bad_alloc (PyTorch's RuntimeError, not its OutOfMemoryError).
        }
      });
      REQUIRE(oom.has_value());
      CHECK(std::string(oom->what()).find("out of memory") != std::string::npos);
      // A short report says its verdict is not known (was: capacity, a guess), a full one gives it.
      const bool short_report = std::string(oom->what()).find("host memory also ran out") != std::string::npos;
      CHECK(oom->report().verdict == (short_report ? expseg::OomVerdict::unknown : expseg::OomVerdict::capacity));
      shorts += short_report ? 1 : 0;
      if (short_report) CHECK(expseg::to_string(oom->report().verdict) == std::string("unknown"));
      // No limit is set: the short report says so (was: "limit 0").
      if (short_report) CHECK(std::string(oom->what()).find(" reserved, no limit).") != std::string::npos);
      CHECK(oom->report().requested_bytes == request);
      // last_oom() is this request; num_ooms does not count it (refused up front, as PyTorch does).
      const std::optional<expseg::OomReport> last = sa->last_oom();
      REQUIRE(last.has_value());
      CHECK(last->requested_bytes == request);
      CHECK(sa->stats().num_ooms == 0);
      CHECK_NOTHROW(sa->validate());
      if (!fired) break;
    }
    CHECK(n > 3);
    CHECK(shorts > 0);
    sa->deallocate(keep);
    sa->validate();
  }
}

TEST_CASE("capi regression: host memory running out in the OOM report's counterfactual is not 'would have failed too'") {
  // The 800/500/300 story: split_merge's fragmentation OOM, which expandable would have served.
  auto sa = make_sim_allocator(sim_config(BackendKind::split_merge, 80 * GiB, "limit:2064MiB"));
  sa->deallocate(sa->allocate(2000 * MiB));
  void* p800 = sa->allocate(800 * MiB);
  void* p500 = sa->allocate(500 * MiB);
  void* p300 = sa->allocate(300 * MiB);
  sa->deallocate(p500);
  std::uint64_t n = 1;
  int evaluated = 0;
  for (;; ++n) {
    CAPTURE(n);
    std::optional<expseg::out_of_memory> oom;
    const bool fired = with_nth_new_failing(n, [&] {
      try {
        (void)sa->allocate(800 * MiB);
      } catch (const expseg::out_of_memory& e) {
        oom.emplace(e);
      } catch (const std::bad_alloc&) {
      }
    });
    REQUIRE(oom.has_value());
    // Would succeed, or (no memory to find out) not evaluated. Was: would_fail, and the message
    // said "The expandable backend would have failed too."
    CHECK(oom->report().counterfactual != expseg::Counterfactual::would_fail);
    CHECK(std::string(oom->what()).find("would have failed too") == std::string::npos);
    if (oom->report().counterfactual == expseg::Counterfactual::would_succeed) ++evaluated;
    CHECK_NOTHROW(sa->validate());
    if (!fired) break;
  }
  CHECK(evaluated > 0);
  sa->deallocate(p800);
  sa->deallocate(p300);
  sa->validate();
}

TEST_CASE_FIXTURE(CApiFixture, "capi regression: expseg_enable_peer_access with a peer out of range and no host memory returns, not terminates") {
  // Was: the message for the out-of-range peer was built outside any try: a bad_alloc there left the
  // noexcept function, std::terminate.
  for (std::uint64_t n = 1; n <= 4; ++n) {
    CAPTURE(n);
    int rc = EXPSEG_SUCCESS;
    const bool fired = with_nth_new_failing(n, [&] { rc = expseg_enable_peer_access(0, 99); });
    CHECK(rc == EXPSEG_ERROR_INVALID_DEVICE);
    CHECK(expseg_last_error_code() == EXPSEG_ERROR_INVALID_DEVICE);
    if (!fired) {
      CHECK(n > 1);  // the first host allocation of the call failed, at least
      CHECK(std::string(expseg_last_error()).find("peer device 99 is out of range") != std::string::npos);
      break;
    }
  }
  CHECK(expseg_device_initialized(0) == 0);
}

TEST_CASE_FIXTURE(CApiFixture, "capi regression: expseg_torch_malloc throws out_of_memory when the OOM report finds no host memory") {
  REQUIRE(expseg_configure("device:sim,sim_capacity:1GiB") == EXPSEG_SUCCESS);
  void* p = expseg_malloc(static_cast<ssize_t>(MiB), 0, nullptr);
  REQUIRE(p != nullptr);
  const ssize_t huge = static_cast<ssize_t>(std::size_t{1} << 60);
  bool oom = false;
  g_fail_nth_new = 1;  // the report's first allocation
  try {
    (void)expseg_torch_malloc(huge, 0, nullptr);
  } catch (const expseg::out_of_memory&) {
    oom = true;
  } catch (...) {
    // Was: std::runtime_error("host memory exhausted (std::bad_alloc)"), which PyTorch cannot tell from other errors.
  }
  CHECK(g_fail_nth_new == 0);  // the failure fired: else this was an ordinary OOM
  g_fail_nth_new = 0;
  CHECK(oom);
  CHECK(expseg_last_error_code() == EXPSEG_ERROR_OUT_OF_MEMORY);
  // The report is retrievable as after any OOM. Was: "" (no OOM recorded).
  CHECK(std::string(expseg_last_oom_report(0)).find("out of memory") != std::string::npos);
  expseg_free(p, 0, 0, nullptr);
}


TEST_CASE_FIXTURE(CApiFixture, "capi regression: graph pool calls that refuse create no allocator, so the configuration may still be set") {
  // Was: each of these created device 0's allocator before refusing, after which expseg_configure
  // was refused for good (a glue probing pools before the first tensor locked the configuration).
  REQUIRE(expseg_configure("device:sim,sim_capacity:1GiB") == EXPSEG_SUCCESS);
  int block = 0;
  CHECK(expseg_end_graph_pool(0, 7) == EXPSEG_ERROR_INVALID_ARGUMENT);
  CHECK(last_error().find("no allocator yet") != std::string::npos);
  CHECK(expseg_release_graph_pool(0, 7) == EXPSEG_ERROR_INVALID_ARGUMENT);
  CHECK(expseg_end_pool_allocations(0, 7, nullptr) == EXPSEG_ERROR_INVALID_ARGUMENT);
  CHECK(expseg_restore_graph_pool_block(0, 7, &block, 512) == EXPSEG_ERROR_INVALID_ARGUMENT);
  CHECK(expseg_begin_graph_pool(0, 0, nullptr) == EXPSEG_ERROR_INVALID_ARGUMENT);
  CHECK(last_error().find("pool 0") != std::string::npos);
  CHECK(expseg_begin_pool_allocations(0, 0, nullptr) == EXPSEG_ERROR_INVALID_ARGUMENT);
  unsigned long long addresses[1] = {};
  std::size_t sizes[1] = {};
  std::size_t count = 9;
  CHECK(expseg_graph_pool_blocks(0, 7, addresses, sizes, 1, &count) == EXPSEG_SUCCESS);  // a query
  CHECK(count == 0);
  CHECK(expseg_end_graph_pool(EXPSEG_MAX_DEVICES, 7) == EXPSEG_ERROR_INVALID_DEVICE);
  CHECK(expseg_graph_pool_blocks(-1, 7, addresses, sizes, 1, &count) == EXPSEG_ERROR_INVALID_DEVICE);
  CHECK(expseg_device_initialized(0) == 0);
  CHECK(expseg_configure("device:sim,sim_capacity:2GiB") == EXPSEG_SUCCESS);
  // Once the allocator exists, misuse is refused by it as before.
  void* p = expseg_malloc(static_cast<ssize_t>(MiB), 0, nullptr);
  REQUIRE(p != nullptr);
  CHECK(expseg_end_graph_pool(0, 7) == EXPSEG_ERROR_INVALID_ARGUMENT);
  CHECK(last_error().find("no capture allocates into graph pool 7") != std::string::npos);
  CHECK(expseg_begin_pool_allocations(0, 7, nullptr) == EXPSEG_SUCCESS);
  CHECK(expseg_end_pool_allocations(0, 7, nullptr) == EXPSEG_SUCCESS);
  CHECK(expseg_release_graph_pool(0, 7) == EXPSEG_SUCCESS);
  expseg_free(p, 0, 0, nullptr);
}

namespace {
struct CallbackAllocation {
  ssize_t size = 0;
  void* got = nullptr;
  int calls = 0;
};
void allocate_in_callback(int device, const char*, void* user_data) {
  auto* c = static_cast<CallbackAllocation*>(user_data);
  ++c->calls;
  c->got = expseg_malloc(c->size, device, nullptr);  // fails too: its own OOM, not reported to us again
}
}  // namespace

TEST_CASE_FIXTURE(CApiFixture, "capi regression: the thread's OOM report is the failed call's, not that of an allocation its OOM callback made") {
  REQUIRE(expseg_configure("device:sim,sim_capacity:1GiB") == EXPSEG_SUCCESS);
  CallbackAllocation c{static_cast<ssize_t>(2 * GiB)};
  REQUIRE(expseg_set_oom_callback(allocate_in_callback, &c) == EXPSEG_SUCCESS);
  CHECK(expseg_malloc(static_cast<ssize_t>(GiB + GiB / 2), 0, nullptr) == nullptr);
  CHECK(c.calls == 1);
  CHECK(c.got == nullptr);
  const std::string thread_report = expseg_thread_oom_report_json(0);
  CHECK(thread_report.find("\"requested_bytes\":" + std::to_string(GiB + GiB / 2)) != std::string::npos);
  CHECK(thread_report.find("\"requested_bytes\":" + std::to_string(2 * GiB)) == std::string::npos);
  CHECK(last_error().find("1.50 GiB") != std::string::npos);
  // Through expseg_torch_malloc too.
  CHECK_THROWS(expseg_torch_malloc(static_cast<ssize_t>(GiB + GiB / 4), 0, nullptr));
  CHECK(c.calls == 2);
  CHECK(std::string(expseg_thread_oom_report_json(0)).find("\"requested_bytes\":" + std::to_string(GiB + GiB / 4)) != std::string::npos);
  REQUIRE(expseg_set_oom_callback(nullptr, nullptr) == EXPSEG_SUCCESS);
  // A failed call without a report (a negative size) leaves no earlier OOM's report behind.
  CHECK(expseg_malloc(-1, 0, nullptr) == nullptr);
  CHECK(std::string(expseg_thread_oom_report(0)).empty());
  CHECK(std::string(expseg_thread_oom_report_json(0)) == "null");
}

TEST_CASE_FIXTURE(CApiFixture, "capi regression: release_cached and set_limit during a graph capture are refused as misuse, nothing changed") {
  for (const char* backend : {"split_merge", "expandable"}) {
    CAPTURE(backend);
    expseg::capi::reset_for_tests();
    REQUIRE(expseg_configure((std::string("device:sim,sim_capacity:1GiB,backend:") + backend).c_str()) == EXPSEG_SUCCESS);
    void* p = expseg_malloc(static_cast<ssize_t>(MiB), 0, nullptr);
    REQUIRE(p != nullptr);
    auto& sim = dynamic_cast<expseg::driver::SimDriver&>(expseg::detail::AllocatorAccess::driver(*expseg::capi::allocator_for_tests(0)));
    void* s = sim.stream_create();
    sim.capture_begin(s);
    REQUIRE(expseg_begin_graph_pool(0, 5, s) == EXPSEG_SUCCESS);
    std::size_t limit = 1;
    REQUIRE(expseg_get_limit(0, &limit, nullptr) == EXPSEG_SUCCESS);
    CHECK(expseg_release_cached(0) == EXPSEG_ERROR_INVALID_ARGUMENT);  // was EXPSEG_ERROR_INTERNAL
    CHECK(last_error().find("capture") != std::string::npos);
    CHECK(expseg_set_limit(0, 512 * MiB) == EXPSEG_ERROR_INVALID_ARGUMENT);
    std::size_t after = 1;
    REQUIRE(expseg_get_limit(0, &after, nullptr) == EXPSEG_SUCCESS);
    CHECK(after == limit);
    // Ending the pool before the capture ends is refused too: the capture's later requests would
    // leave the pool (was: accepted, and an eager block could then get the graph's memory).
    CHECK(expseg_end_graph_pool(0, 5) == EXPSEG_ERROR_INVALID_ARGUMENT);
    CHECK(last_error().find("still running") != std::string::npos);
    void* in_pool = expseg_malloc(static_cast<ssize_t>(MiB), 0, s);
    REQUIRE(in_pool != nullptr);
    expseg_free(in_pool, 0, 0, s);
    const auto g = sim.capture_end(s);
    CHECK(expseg_end_graph_pool(0, 5) == EXPSEG_SUCCESS);
    void* eager = expseg_malloc(static_cast<ssize_t>(MiB), 0, s);
    CHECK(eager != in_pool);  // the pool kept the captured block's memory
    expseg_free(eager, 0, 0, s);
    sim.graph_destroy(g);
    CHECK(expseg_release_graph_pool(0, 5) == EXPSEG_SUCCESS);
    CHECK(expseg_release_cached(0) == EXPSEG_SUCCESS);
    expseg_free(p, 0, 0, nullptr);
    sim.stream_destroy(s);
  }
}

}  // TEST_SUITE

TEST_CASE("c api: a free whose event for another stream's use cannot be recorded synchronizes and frees, for a caller that cannot retry") {
  // PyTorch's and CuPy's frees return nothing and are never retried: the block stayed allocated for
  // good (C++'s deallocate keeps it live so that its caller may retry).
  for (const char* backend : {"expandable", "split_merge"}) {
    CAPTURE(backend);
    expseg_reset_for_tests();
    REQUIRE(expseg_configure((std::string("device:sim,sim_capacity:8GiB,backend:") + backend).c_str()) == EXPSEG_SUCCESS);
    void* p = expseg_malloc(64 * MiB, 0, nullptr);
    REQUIRE(p != nullptr);
    expseg::Allocator* a = expseg::capi::allocator_for_tests(0);
    auto& sim = dynamic_cast<expseg::driver::SimDriver&>(expseg::detail::AllocatorAccess::driver(*a));
    void* s = sim.stream_create();
    REQUIRE(expseg_record_stream(p, 0, s) == EXPSEG_SUCCESS);
    sim.inject_fault(expseg::driver::Op::event_record, 1, expseg::driver::Fault::error);
    const auto sync_op = static_cast<std::size_t>(expseg::driver::Op::stream_sync);
    const auto syncs = sim.call_stats().calls[sync_op];
    expseg_free(p, 64 * MiB, 0, nullptr);
    CHECK(a->stats().allocation[expseg::kAllPools].current == 0);
    CHECK(a->stats().allocated_bytes[expseg::kAllPools].current == 0);
    CHECK(sim.call_stats().calls[sync_op] > syncs);  // the streams' synchronization stands for the event
    a->validate();
    // The memory is reused, and freeing it again is a double free.
    void* q = expseg_malloc(64 * MiB, 0, nullptr);
    CHECK(q == p);
    expseg_free(q, 64 * MiB, 0, nullptr);
    expseg_free(p, 64 * MiB, 0, nullptr);
    CHECK(expseg_last_error_code() == EXPSEG_ERROR_INVALID_POINTER);
    sim.stream_destroy(s);
    expseg_reset_for_tests();
  }
}

TEST_CASE("c api: an expseg_ipc_close whose synchronization fails leaves the import open, to close again") {
  // The entry was taken out of the table before the close: a failed close made the pointer unknown
  // ("already closed"), and the import was unmapped anyway when it went out of scope (after a
  // one-off failure) or stayed mapped for good (a lasting one).
  expseg_reset_for_tests();
  REQUIRE(expseg_configure("device:sim,sim_host_backed:true,sim_capacity:1GiB,backend:expandable,ipc_handle:posix_fd") == EXPSEG_SUCCESS);
  void* p = expseg_malloc(4 * MiB, 0, nullptr);
  REQUIRE(p != nullptr);
  const void* handle = nullptr;
  std::size_t handle_size = 0;
  const int* fds = nullptr;
  std::size_t nfds = 0;
  REQUIRE(expseg_ipc_export(p, 0, &handle, &handle_size, &fds, &nfds) == EXPSEG_SUCCESS);
  const std::vector<std::uint8_t> bytes(static_cast<const std::uint8_t*>(handle), static_cast<const std::uint8_t*>(handle) + handle_size);
  const std::vector<int> own(fds, fds + nfds);
  void* q = nullptr;
  std::size_t size = 0;
  REQUIRE(expseg_ipc_import(bytes.data(), bytes.size(), own.data(), own.size(), 0, &q, &size) == EXPSEG_SUCCESS);
  auto& sim = dynamic_cast<expseg::driver::SimDriver&>(expseg::detail::AllocatorAccess::driver(*expseg::capi::allocator_for_tests(0)));
  const std::size_t mapped = sim.live().mappings;
  sim.set_stream_busy(nullptr, true);
  sim.queue_use(nullptr, static_cast<expseg::driver::dev_ptr>(reinterpret_cast<std::uintptr_t>(q)), size);
  sim.inject_fault(expseg::driver::Op::stream_sync, 1, expseg::driver::Fault::error);
  sim.inject_fault(expseg::driver::Op::stream_sync, 2, expseg::driver::Fault::error);  // tried twice
  CHECK(expseg_ipc_close(q, 0) == EXPSEG_ERROR_DRIVER);
  CHECK(sim.live().mappings == mapped);  // still open
  CHECK(sim.hazards().empty());
  sim.set_stream_busy(nullptr, false);
  CHECK(expseg_ipc_close(q, 0) == EXPSEG_SUCCESS);
  CHECK(sim.live().mappings < mapped);
  CHECK(expseg_ipc_close(q, 0) == EXPSEG_ERROR_INVALID_POINTER);
  for (int fd : own) ::close(fd);
  expseg_free(p, 4 * MiB, 0, nullptr);
  expseg_reset_for_tests();
}

TEST_CASE_FIXTURE(CApiFixture, "capi regression: a request of 1 EiB or more is refused up front on every entry point, without the OOM callback") {
  // As the C++ observer (and PyTorch's OOM observers) the callback sees only OOMs of the allocator.
  // Was: expseg_malloc, expseg_cupy_malloc and expseg_torch_malloc called it for these requests,
  // with num_ooms still 0.
  std::vector<std::int64_t> requested;
  const auto record = [](int, const char* json, void* user) {
    const auto j = expseg::core::parse_json(json);
    static_cast<std::vector<std::int64_t>*>(user)->push_back(j["requested_bytes"].as_int());
  };
  REQUIRE(expseg_configure("device:sim,sim_capacity:1GiB,limit:256MiB") == EXPSEG_SUCCESS);
  REQUIRE(expseg_set_oom_callback(record, &requested) == EXPSEG_SUCCESS);
  const std::size_t huge = std::size_t{1} << 60;
  CHECK(expseg_malloc(static_cast<ssize_t>(huge), 0, nullptr) == nullptr);
  CHECK(expseg_last_error_code() == EXPSEG_ERROR_OUT_OF_MEMORY);
  CHECK(expseg_cupy_malloc(nullptr, SIZE_MAX, 0) == nullptr);
  CHECK_THROWS_AS(expseg_torch_malloc(static_cast<ssize_t>(huge), 0, nullptr), expseg::out_of_memory);
  CHECK(requested.empty());
  // The report is still there to read.
  CHECK(std::string(expseg_last_oom_report(0)).find("out of memory") != std::string::npos);
  // Just under 1 EiB is an OOM of the allocator: the callback hears of it.
  CHECK(expseg_malloc(static_cast<ssize_t>(huge - 1), 0, nullptr) == nullptr);
  CHECK(requested == std::vector<std::int64_t>{static_cast<std::int64_t>(huge - 1)});
  REQUIRE(expseg_set_oom_callback(nullptr, nullptr) == EXPSEG_SUCCESS);
}
