// expseg_gpu_multi entry point (suite gpu): the cases that need two GPUs. Reports SKIP (exit code 77,
// which meson counts as skipped) with the reason when fewer than two CUDA devices are usable; it
// never passes without them.
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
      std::printf("FAILED: two-GPU tests: a CUDA driver is there, but expseg cannot use it: %s\n", why.c_str());
      return 1;
    }
    std::printf("SKIPPED: two-GPU tests: no usable CUDA device (%s)\n", why.c_str());
    return 77;
  }
  const int count = expseg::driver::cuda_device_count();
  if (count < 2) {
    std::printf("SKIPPED: two-GPU tests need 2 CUDA devices, %d visible (check CUDA_VISIBLE_DEVICES)\n", count);
    return 77;
  }
  std::printf("expseg_gpu_multi: %d CUDA devices visible, using devices 0 and 1\n", count);
  doctest::Context context(argc, argv);
  return context.run();
}
