// Internals of the C API (c_api.cpp) for tests: not part of the public headers.
#pragma once

namespace expseg {
class Allocator;
}

namespace expseg::capi {

// Destroys every device's allocator, forgets expseg_configure()'s string and clears the calling
// thread's error. No other thread may be inside the C API meanwhile, and pointers from the
// destroyed allocators become invalid. Unit tests call it between cases: the C API's per-device
// state otherwise persists for the whole process.
void reset_for_tests() noexcept;

// The device's allocator, or nullptr when it has none (or the index is out of range): what the C API
// cannot show, e.g. the peers expseg_enable_peer_access granted.
Allocator* allocator_for_tests(int device) noexcept;

// Whether expseg_malloc (the PyTorch entry point) prints the OOM report on stderr (default: true).
void set_oom_stderr(bool on) noexcept;

}  // namespace expseg::capi

extern "C" {
// The same as expseg::capi::reset_for_tests(), reachable through dlsym/ctypes (tests/python).
// Exported although the library is built hidden: the Python glue's tests load it from libexpseg.so.
__attribute__((visibility("default"))) void expseg_reset_for_tests(void) noexcept;
}
