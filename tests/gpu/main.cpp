// gpu suite entry point: runs the doctest cases on the real device, or reports SKIP (exit code 77,
// which meson counts as skipped) when there is no GPU to test (tests/gpu/gpu_skip.hpp says when). It never passes without a GPU.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <string>

#include "driver/driver.hpp"
#include "gpu_skip.hpp"

int main(int argc, char** argv) {
  std::string why;
  if (!expseg::driver::cuda_usable(&why)) {
    if (!gpu_test::no_gpu_to_test(why)) {
      std::printf("FAILED: a CUDA driver is there, but expseg cannot use it: %s\n", why.c_str());
      return 1;
    }
    std::printf("SKIPPED: no usable CUDA device (%s)\n", why.c_str());
    return 77;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
