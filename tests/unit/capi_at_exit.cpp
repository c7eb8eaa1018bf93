// The C API called while the process exits: from a static destructor that runs after the function-
// local statics of libexpseg are destroyed (a C++ program's globals, PyTorch freeing tensors at exit).
// Was: the loaded CUDA driver library's record was such a static; with no usable driver, the
// error of the late call was built from its freed strings (AddressSanitizer: heap-use-after-free in
// make_cuda_driver). Run by meson with EXPSEG_LIBCUDA naming a library that is not there, so the
// driver cannot load on any machine; the sanitizer build of the unit suite runs it too.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <unistd.h>

#include "expseg/expseg.h"

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

}  // namespace

int main() {
  if (std::getenv("EXPSEG_LIBCUDA") == nullptr) {
    std::fprintf(stderr, "EXPSEG_LIBCUDA is not set (meson sets it)\n");
    return 1;
  }
  return says_no_driver("in main") ? 0 : 1;
}
