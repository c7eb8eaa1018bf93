// Regressions found by a review of the day's changes (PyTorch's newer config keys, the C API's
// queries, the OOM path without host memory, the simulator's exported descriptors, expandable's
// search of mapped free blocks). Each case failed on the code before its fix.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "expseg/allocator.hpp"
#include "expseg/config.hpp"
#include "expseg/errors.hpp"
#include "test_util.hpp"

using namespace testutil;
using expseg::BackendKind;
using expseg::Config;

TEST_SUITE("config") {

TEST_CASE("review regression: a Config built in code with a large_segment_size below 10 MiB is refused, not handed out short") {
  // split_merge gives a request of 1-10 MiB a segment of large_segment_size: one smaller than the
  // request would hold less than was asked for. The parser refuses it (> 10 MiB); check_config must
  // too, as it does the other bounds the backends rely on, for a Config built in code.
  for (std::size_t bad : {std::size_t{0}, 2 * MiB, 10 * MiB}) {
    CAPTURE(bad);
    Config c = sim_config(BackendKind::split_merge, 8 * GiB);
    c.large_segment_size = bad;
    try {
      expseg::Allocator a(c);
      void* p = a.allocate(9 * MiB);
      // Was: a 9 MiB block in a segment of `bad` bytes.
      CHECK(a.stats().reserved_bytes[expseg::kAllPools].current >= static_cast<std::int64_t>(9 * MiB));
      a.deallocate(p);
      FAIL("a large_segment_size of " << bad << " bytes was accepted");
    } catch (const expseg::config_error& e) {
      CHECK(e.key() == "large_segment_size_mb");
    }
  }
}

}  // TEST_SUITE
