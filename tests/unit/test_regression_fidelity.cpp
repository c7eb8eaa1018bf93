// PyTorch fidelity of the configuration and of the OOM message, checked against PyTorch's own code
// (c10/core/AllocatorConfig.cpp, c10/cuda/CUDAAllocatorConfig.cpp, c10/cuda/CUDACachingAllocator.cpp).
#include <doctest/doctest.h>

#include <string>

#include "expseg/errors.hpp"
#include "test_util.hpp"

using namespace testutil;
using expseg::Allocator;
using expseg::BackendKind;
using expseg::Config;
using expseg::Limit;

namespace {

constexpr BackendKind kBoth[] = {BackendKind::split_merge, BackendKind::expandable};

// The message of the OOM a 2 GiB request gets on a 1 GiB device.
std::string oom_message(BackendKind b, const std::string& conf, std::size_t set_limit = 0) {
  Allocator a(sim_config(b, 1 * GiB, conf));
  if (set_limit != 0) a.set_limit(set_limit);
  try {
    (void)a.allocate(2 * GiB);
  } catch (const expseg::out_of_memory& e) {
    return e.what();
  }
  FAIL("a 2 GiB request on a 1 GiB device did not fail");
  return "";
}

}  // namespace

TEST_CASE("fidelity regression: no 'allowed' figure in the OOM message at a memory fraction of 1 or a limit of the whole device") {
  // PyTorch 2.9+ setMemoryFraction: `allowed_memory_maximum = std::nullopt; if (fraction < 1.0)
  // allowed_memory_maximum = ...`, and the OOM message adds "N allowed; " only
  // `if (allowed_memory_maximum.has_value())`.
  for (BackendKind b : kBoth) {
    CAPTURE(expseg::to_string(b));
    for (const char* conf : {"", "per_process_memory_fraction:1", "limit:100%", "limit:1GiB", "limit:2GiB"}) {
      CAPTURE(conf);
      const std::string msg = oom_message(b, conf);
      CAPTURE(msg);
      CHECK(msg.find(" allowed; ") == std::string::npos);  // was: "1.00 GiB allowed; " (2.00 GiB for limit:2GiB)
      CHECK(msg.find("is free. Of the allocated memory") != std::string::npos);
    }
    const std::string set = oom_message(b, "", 1 * GiB);  // Allocator::set_limit (expseg_set_limit) to the device
    CHECK(set.find(" allowed; ") == std::string::npos);
    // A limit below the device's memory is PyTorch's fraction below 1: the figure is there.
    for (const char* conf : {"per_process_memory_fraction:0.5", "limit:50%", "limit:512MiB"}) {
      CAPTURE(conf);
      const std::string msg = oom_message(b, conf);
      CAPTURE(msg);
      CHECK(msg.find("is free. 512.00 MiB allowed; Of the allocated memory") != std::string::npos);
    }
  }
}
