// gpu suite entry point: runs the doctest cases on the real device, or reports SKIP (exit code 77,
// which meson counts as skipped) when no CUDA device is usable. It never passes without a GPU.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <string>

#include "driver/driver.hpp"

int main(int argc, char** argv) {
  std::string why;
  if (!expseg::driver::cuda_usable(&why)) {
    std::printf("SKIPPED: no usable CUDA device (%s)\n", why.c_str());
    return 77;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
