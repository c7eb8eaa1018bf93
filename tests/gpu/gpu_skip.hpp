// When the gpu suites skip (exit 77) and when they fail. Skipped only where there is no GPU to test:
// no CUDA driver library, or a driver that reports no device (cuInit's CUDA_ERROR_NO_DEVICE, the
// toolkit's stub library, CUDA_VISIBLE_DEVICES empty). A driver that is there but that expseg
// cannot use (an entry point it asks for missing, cuInit failing otherwise) is a failure: as a skip
// it would pass unseen on the GPU machines these suites are for.
#pragma once

#include <string>

namespace gpu_test {

// `why`: what expseg::driver::cuda_usable() said ("<call> failed: <CUDA error name> (<code>): ...").
inline bool no_gpu_to_test(const std::string& why) {
  // The toolkit's stub libcuda answers every call with CUDA_ERROR_STUB_LIBRARY (34), cuGetProcAddress
  // too, before expseg can name the error.
  return why.rfind("dlopen failed", 0) == 0 || why == "the CUDA driver reports no device" ||
         why.rfind("cuInit failed: CUDA_ERROR_NO_DEVICE ", 0) == 0 || why.find(" (34): ") != std::string::npos;
}

}  // namespace gpu_test
