// CUDA graph capture on the real device, both backends (the unit suite's graph-pools cases model
// the same on the simulated device):
//   - a graph pool keeps what a captured graph wrote, freed during the capture or not, apart from
//     later eager blocks: replays leave those blocks' bytes alone;
//   - requests during a capture that the cache cannot serve grow memory without invalidating the
//     capture (expandable: cuMemCreate/Map/SetAccess; split_merge: cuMemAlloc in relaxed mode);
//   - under a limit, a request during a capture that would need cached memory given back fails
//     with an OOM and leaves the capture valid, told of the capture or not.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "allocator_impl.hpp"
#include "driver/driver.hpp"
#include "expseg/errors.hpp"
#include "gpu_util.hpp"
#include "test_util.hpp"

using namespace testutil;
using gputil::cuda_config;
using gputil::dp;
using gputil::driver_of;
using expseg::Allocator;
using expseg::BackendKind;
using expseg::kAllPools;
using expseg::driver::dev_ptr;
using expseg::driver::Driver;

namespace {

const BackendKind kBackends[] = {BackendKind::split_merge, BackendKind::expandable};

bool overlap(void* a, std::size_t an, void* b, std::size_t bn) { return dp(a) < dp(b) + bn && dp(b) < dp(a) + an; }

// Every word of the first and last 64 KiB of [p, p + bytes) equals `value`.
bool holds(Driver& d, void* p, std::size_t bytes, std::uint32_t value) {
  std::vector<std::uint32_t> buf(64 * KiB / 4);
  for (std::size_t off : {std::size_t{0}, bytes - 64 * KiB}) {
    d.copy_to_host(buf.data(), dp(p) + off, 64 * KiB);
    for (std::uint32_t w : buf)
      if (w != value) return false;
  }
  return true;
}

}  // namespace

TEST_SUITE("gpu_graph_capture") {

TEST_CASE("gpu: a graph pool keeps a captured graph's memory apart: replays leave later eager blocks alone") {
  for (BackendKind kind : kBackends) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    Allocator a(cuda_config(kind));
    Driver& d = driver_of(a);
    void* s = d.stream_create();
    constexpr std::size_t kBytes = 64 * MiB;
    d.capture_begin(s);
    a.begin_graph_pool(1, s);
    void* in = a.allocate(kBytes, s);   // the graph's output, kept
    void* tmp = a.allocate(kBytes, s);  // an intermediate, freed during the capture
    d.memset_d32(dp(tmp), 0xAAAAAAAAu, kBytes / 4, s);
    d.memset_d32(dp(in), 0xBBBBBBBBu, kBytes / 4, s);
    a.deallocate(tmp);
    void* tmp2 = a.allocate(kBytes, s);  // reuses the intermediate's memory inside the graph
    CHECK(dp(tmp2) == dp(tmp));
    d.memset_d32(dp(tmp2), 0xCCCCCCCCu, kBytes / 4, s);
    a.deallocate(tmp2);
    const auto g = d.capture_end(s);
    a.end_graph_pool(1);
    // Eager blocks after the capture, on its stream and on the default stream.
    void* e1 = a.allocate(kBytes, s);
    void* e2 = a.allocate(kBytes, nullptr);
    CHECK_FALSE(overlap(e1, kBytes, tmp, kBytes));
    CHECK_FALSE(overlap(e2, kBytes, tmp, kBytes));
    CHECK_FALSE(overlap(e1, kBytes, in, kBytes));
    d.memset_d32(dp(e1), 0x11111111u, kBytes / 4, s);
    d.memset_d32(dp(e2), 0x22222222u, kBytes / 4, nullptr);
    d.device_synchronize();
    for (int replay = 0; replay < 3; ++replay) d.graph_launch(g, s);
    d.device_synchronize();
    CHECK(holds(d, e1, kBytes, 0x11111111u));
    CHECK(holds(d, e2, kBytes, 0x22222222u));
    CHECK(holds(d, in, kBytes, 0xBBBBBBBBu));
    CHECK(holds(d, tmp, kBytes, 0xCCCCCCCCu));  // still mapped for the graph: the last replay's bytes
    a.validate();
    a.deallocate(e1);
    a.deallocate(e2);
    a.deallocate(in);
    d.graph_destroy(g);
    a.release_graph_pool(1);
    a.release_cached();
    CHECK(a.stats().reserved_bytes[kAllPools].current == 0);
    d.stream_destroy(s);
  }
}

TEST_CASE("gpu: requests during a capture grow memory without invalidating it; under a limit they fail instead of giving memory back") {
  for (BackendKind kind : kBackends) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    for (bool told : {false, true}) {
      CAPTURE(told);
      Allocator a(cuda_config(kind, "limit:1GiB"));
      Driver& d = driver_of(a);
      void* s = d.stream_create();
      void* s2 = d.stream_create();
      void* cached = a.allocate(640 * MiB, s2);
      d.memset_d32(dp(cached), 1u, 640 * MiB / 4, s2);
      a.deallocate(cached);  // idle memory of another stream
      d.capture_begin(s);
      if (told) a.begin_graph_pool(2, s);
      void* grown = a.allocate(256 * MiB, s);  // a cache miss: new memory, mapped during the capture
      d.memset_d32(dp(grown), 0x5eed5eedu, 256 * MiB / 4, s);
      // 640 + 256 + 256 MiB > 1 GiB: only s2's memory given back would make room, which takes a
      // synchronization or cuMemFree, refused during a capture.
      CHECK_THROWS_AS(a.allocate(256 * MiB, s), expseg::out_of_memory);
      expseg::driver::graph_t g = nullptr;
      CHECK_NOTHROW(g = d.capture_end(s));
      if (told) a.end_graph_pool(2);
      REQUIRE(g != nullptr);
      d.graph_launch(g, s);
      d.device_synchronize();
      CHECK(holds(d, grown, 256 * MiB, 0x5eed5eedu));
      a.validate();
      a.deallocate(grown);
      d.graph_destroy(g);
      if (told) a.release_graph_pool(2);
      void* after = a.allocate(512 * MiB, s);  // after the capture, s2's memory is given back as usual
      a.deallocate(after);
      a.validate();
      a.release_cached();
      d.stream_destroy(s);
      d.stream_destroy(s2);
    }
  }
}

}  // TEST_SUITE
