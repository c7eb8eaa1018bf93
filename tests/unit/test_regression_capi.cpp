// Regressions found by an audit of the C API's side effects: calls that refuse must not create a
// device's allocator first (after which expseg_configure is refused for good), and a query must not
// create one. Each case failed on the code before its fix.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdlib>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include "c_api_internal.hpp"
#include "expseg/allocator.hpp"
#include "expseg/errors.hpp"
#include "expseg/expseg.h"
#include "test_util.hpp"

using namespace testutil;
using expseg::BackendKind;

namespace {

// Clean C API state, EXPSEG_ALLOC_CONF unset, OOM reports not printed; restored afterwards.
struct CApiState {
  std::optional<std::string> saved_env;
  CApiState() {
    if (const char* v = std::getenv("EXPSEG_ALLOC_CONF")) saved_env = v;
    ::unsetenv("EXPSEG_ALLOC_CONF");
    expseg::capi::reset_for_tests();
    expseg::capi::set_oom_stderr(false);
  }
  ~CApiState() {
    expseg::capi::reset_for_tests();
    expseg::capi::set_oom_stderr(true);
    if (saved_env) ::setenv("EXPSEG_ALLOC_CONF", saved_env->c_str(), 1);
  }
  CApiState(const CApiState&) = delete;
  CApiState& operator=(const CApiState&) = delete;
};

std::string last_error() { return expseg_last_error(); }

}  // namespace

TEST_SUITE("c_api") {

TEST_CASE_FIXTURE(CApiState, "capi regression: expseg_get_limit is a query: it creates no allocator, and answers as the allocator will") {
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

}  // TEST_SUITE
