// libexpseg_torch.so: expseg's allocation functions for PyTorch's CUDAPluggableAllocator, with an OOM
// thrown as c10::OutOfMemoryError, the type PyTorch's own allocator throws.
//
// Why a library of its own: PyTorch recognises an OOM by that C++ type only. Python code's
// `except torch.cuda.OutOfMemoryError` and PyTorch's own recoveries (cuDNN's convolutions catch it to
// try another algorithm or half the workspace, then empty the cache) never see a std::bad_alloc,
// which PyTorch turns into a plain RuntimeError (pytorch/pytorch#133280, which RMM's allocator has too).
// Throwing the c10 type needs PyTorch's headers and libc10, which libexpseg must not depend on; this
// adapter is built only where meson finds PyTorch (option torch), for that PyTorch version, and
// tools/expseg.py's install_torch uses it only when the running PyTorch is that version.
//
// It forwards to the C API: one allocator per device, the same as expseg_malloc's and CuPy's.
#include <sys/types.h>

#include <new>
#include <string>

#include <c10/util/Exception.h>

#include "expseg/expseg.h"

#ifndef EXPSEG_TORCH_VERSION
#error "EXPSEG_TORCH_VERSION (torch.__version__ of the headers) is set by lib/torch/meson.build"
#endif

extern "C" {

// expseg_torch_malloc with its OOM rethrown as c10::OutOfMemoryError carrying the same report (its
// first sentence is PyTorch's "CUDA out of memory. Tried to allocate ..."). Other failures keep
// their types (std::invalid_argument, std::runtime_error: a RuntimeError in Python).
EXPSEG_API void* expseg_torch_c10_malloc(ssize_t size, int device, expseg_stream_t stream) {
  try {
    return expseg_torch_malloc(size, device, stream);
  } catch (const std::bad_alloc& e) {  // expseg::out_of_memory: expseg_torch_malloc throws no other bad_alloc
    C10_THROW_ERROR(OutOfMemoryError, std::string(e.what()));
  }
}

// expseg_free, so that both of CUDAPluggableAllocator's functions come from this library.
EXPSEG_API void expseg_torch_c10_free(void* ptr, ssize_t size, int device, expseg_stream_t stream) noexcept {
  expseg_free(ptr, size, device, stream);
}

// torch.__version__ of the PyTorch this was compiled against: c10::OutOfMemoryError's layout and
// libc10's symbols are that version's, so install_torch uses this library only under it.
EXPSEG_API const char* expseg_torch_c10_built_for() noexcept { return EXPSEG_TORCH_VERSION; }

}  // extern "C"
