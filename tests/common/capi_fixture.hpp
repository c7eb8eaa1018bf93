// Test helpers for the C API and for host-memory faults, shared by the unit test files.
#pragma once

#include <doctest/doctest.h>

#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "c_api_internal.hpp"
#include "expseg/expseg.h"

namespace testutil {

// Clean C API state, EXPSEG_ALLOC_CONF unset, OOM reports not printed; restored afterwards. The C
// API's allocators live as long as the process, so every case using it starts and ends with
// capi::reset_for_tests().
struct CApiFixture {
  std::optional<std::string> saved_env;
  CApiFixture() {
    if (const char* v = std::getenv("EXPSEG_ALLOC_CONF")) saved_env = v;
    ::unsetenv("EXPSEG_ALLOC_CONF");
    expseg::capi::reset_for_tests();
    expseg::capi::set_oom_stderr(false);
  }
  ~CApiFixture() {
    expseg::capi::reset_for_tests();
    expseg::capi::set_oom_stderr(true);
    if (saved_env) ::setenv("EXPSEG_ALLOC_CONF", saved_env->c_str(), 1);
  }
  CApiFixture(const CApiFixture&) = delete;
  CApiFixture& operator=(const CApiFixture&) = delete;
};

// What expseg_ipc_export gives for `ptr`, copied: the C API's buffers last only until its next call.
struct ExportedHandle {
  std::vector<unsigned char> bytes;
  std::vector<int> fds;  // the exporter's own descriptors (expseg_ipc_close closes them)
};

inline ExportedHandle export_handle(void* ptr, int device) {
  const void* handle = nullptr;
  std::size_t handle_size = 0;
  const int* fds = nullptr;
  std::size_t nfds = 0;
  REQUIRE(expseg_ipc_export(ptr, device, &handle, &handle_size, &fds, &nfds) == EXPSEG_SUCCESS);
  const auto* b = static_cast<const unsigned char*>(handle);
  return {std::vector<unsigned char>(b, b + handle_size), std::vector<int>(fds, fds + nfds)};
}

}  // namespace testutil

// test_regression_hotpath.cpp: fails the nth operator new from now on this thread (0: none).
extern thread_local std::uint64_t g_fail_nth_new;

namespace testutil {

// Runs f with the nth operator new failing; true when that allocation happened (f may have caught
// its bad_alloc), false when f made fewer than n.
template <class F>
bool with_nth_new_failing(std::uint64_t n, F&& f) {
  g_fail_nth_new = n;
  f();
  const bool fired = g_fail_nth_new == 0;
  g_fail_nth_new = 0;
  return fired;
}

}  // namespace testutil
