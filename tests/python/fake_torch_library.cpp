// A stand-in for libexpseg_torch.so (lib/torch/) where PyTorch is not installed, for the glue's test of
// which library install_torch hands PyTorch: the same three functions, "built for" the version the
// test's FakeTorch claims. Its malloc is expseg_malloc (no c10 here to throw); the real library is
// checked under PyTorch on the GPU (tests/gpu/torch_oom.py).
#include <sys/types.h>

#include "expseg/expseg.h"

extern "C" {
EXPSEG_API void* expseg_torch_c10_malloc(ssize_t size, int device, expseg_stream_t stream) noexcept {
  return expseg_malloc(size, device, stream);
}
EXPSEG_API void expseg_torch_c10_free(void* ptr, ssize_t size, int device, expseg_stream_t stream) noexcept {
  expseg_free(ptr, size, device, stream);
}
EXPSEG_API const char* expseg_torch_c10_built_for() noexcept { return "0.0.0+expseg.test"; }
}
