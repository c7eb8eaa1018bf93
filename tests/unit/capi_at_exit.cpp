// The C API called while the process exits: from a static destructor that runs after the function-
// local statics of libexpseg are destroyed (a C++ program's globals, PyTorch freeing tensors at exit).
// Was: the loaded CUDA driver library's record was such a static; with no usable driver, the
// error of the late call was built from its freed strings (AddressSanitizer: heap-use-after-free in
// make_cuda_driver). Run by meson with EXPSEG_LIBCUDA naming a library that is not there, so the
// driver cannot load on any machine; the sanitizer build of the unit suite runs it too.
// Also a late call on an exiting thread while host memory is exhausted: was `new` in a noexcept
// function (std::terminate); now the thread's own storage.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <thread>
#include <unistd.h>

#include "expseg/expseg.h"

// Every allocation fails on a thread while it sets this (host memory exhausted).
thread_local bool t_no_memory = false;

void* operator new(std::size_t n) {
  if (t_no_memory) throw std::bad_alloc();
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new(std::size_t n, const std::nothrow_t&) noexcept { return t_no_memory ? nullptr : std::malloc(n == 0 ? 1 : n); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

namespace {

bool says_no_driver(const char* when) {
  std::size_t limit = 0;
  std::size_t total = 0;
  const int rc = expseg_get_limit(0, &limit, &total);
  const char* msg = expseg_last_error();
  const bool ok = rc == EXPSEG_ERROR_DRIVER && msg != nullptr && std::strstr(msg, "cannot load the CUDA driver library") != nullptr;
  if (!ok) std::fprintf(stderr, "%s: expseg_get_limit gave %d: %s\n", when, rc, msg ? msg : "(null)");
  return ok;
}

// Constructed before main, so destroyed after every static main's calls made.
struct CallsAtExit {
  ~CallsAtExit() {
    if (!says_no_driver("at exit")) _exit(1);
    std::puts("at exit: the driver's error, as in main");
  }
} calls_at_exit;

// Made on a thread before its first C API call, so destroyed after the C API's state of the thread.
struct LateCallWithoutMemory {
  int rc = -1;
  int* out = nullptr;
  ~LateCallWithoutMemory() {
    t_no_memory = true;
    std::size_t limit = 0, total = 0;
    rc = expseg_get_limit(0, &limit, &total);
    const char* msg = expseg_last_error();  // readable, perhaps empty: no memory for the message
    t_no_memory = false;
    *out = msg != nullptr ? rc : -2;
  }
};

}  // namespace

int main() {
  if (std::getenv("EXPSEG_LIBCUDA") == nullptr) {
    std::fprintf(stderr, "EXPSEG_LIBCUDA is not set (meson sets it)\n");
    return 1;
  }
  if (!says_no_driver("in main")) return 1;
  int late_rc = -1;
  std::thread([&late_rc] {
    thread_local LateCallWithoutMemory late;
    late.out = &late_rc;
    (void)says_no_driver("on a thread");  // the thread's C API state, destroyed before `late`
  }).join();
  if (late_rc == -1 || late_rc == -2 || late_rc == EXPSEG_SUCCESS) {
    std::fprintf(stderr, "a late call without host memory gave %d\n", late_rc);
    return 1;
  }
  std::printf("a late call on an exiting thread without host memory: error %d, no termination\n", late_rc);
  return 0;
}
