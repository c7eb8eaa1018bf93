// Regression tests of the simulated device: its addresses depend only on the calls it was given, not
// on ASLR or on what else the process mapped, so a fixed-seed run replays exactly
// (tests/common/fuzz_harness.hpp); and the simulated host looks the same from every device.
#include <doctest/doctest.h>
#include <sys/mman.h>

#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "driver/sim_driver.hpp"
#include "expseg/allocator.hpp"
#include "expseg/config.hpp"
#include "expseg/errors.hpp"
#include "test_util.hpp"

using namespace expseg::driver;

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;

SimOptions options(bool host, int device = 0) {
  SimOptions o;
  o.host_backed = host;
  o.capacity = 256 * MiB;
  o.granularity = 64 * 1024;
  o.device = device;
  o.device_count = 8;
  return o;
}

// A fixed sequence of reservations and cuMemAllocs, with frees in between; what each returned.
std::vector<dev_ptr> addresses_of_a_fixed_run(const SimOptions& o) {
  SimDriver d(o);
  const std::size_t g = d.granularity();
  std::vector<dev_ptr> out;
  const dev_ptr a = d.reserve(8 * g);
  out.push_back(a);
  const dev_ptr p = d.mem_alloc(3 * g + 100);
  out.push_back(p);
  out.push_back(d.reserve(2 * g));
  d.free_reserve(a, 8 * g);
  out.push_back(d.reserve(4 * g));
  d.mem_free(p);
  out.push_back(d.mem_alloc(g));
  out.push_back(d.reserve(16 * g));
  out.push_back(d.mem_alloc(100));
  return out;  // the destructor takes back what is left
}

// Mappings the driver knows nothing of: they move where mmap places new memory.
struct Perturbation {
  std::vector<std::pair<void*, std::size_t>> held;
  Perturbation() {
    for (std::size_t bytes : {std::size_t{3} << 12, std::size_t{9} << 20, std::size_t{65} << 20}) {
      void* m = ::mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      REQUIRE(m != MAP_FAILED);
      held.emplace_back(m, bytes);
    }
  }
  ~Perturbation() {
    for (auto [m, bytes] : held) ::munmap(m, bytes);
  }
};

}  // namespace

TEST_SUITE("regression") {

TEST_CASE("regression: a fresh simulated device fed the same calls hands out the same addresses" * doctest::skip(testutil::kThreadSanitizer)) {
  // Was: host-backed addresses came from mmap(nullptr, ...), so they moved with ASLR and with every
  // other mapping of the process, and a fuzz failure's replay could take another path.
  for (const bool host : {false, true}) {
    for (const int device : {0, 3}) {
      CAPTURE(host);
      CAPTURE(device);
      const std::vector<dev_ptr> first = addresses_of_a_fixed_run(options(host, device));
      Perturbation perturb;
      const std::vector<dev_ptr> second = addresses_of_a_fixed_run(options(host, device));
      CHECK(first == second);
    }
  }
}

TEST_CASE("regression: host-backed address ranges are reused once freed, the same way every time") {
  SimDriver d(options(true));
  const std::size_t g = d.granularity();
  // Far more address space than any one arena holds, in reserve/free rounds: freed ranges come back.
  const dev_ptr first = d.reserve(GiB);
  d.free_reserve(first, GiB);
  for (int i = 0; i < 20000; ++i) {
    const dev_ptr b = d.reserve(GiB);
    REQUIRE(b == first);
    d.free_reserve(b, GiB);
  }
  // A freed cuMemAlloc range too; its old bytes are gone (fresh memory, like a new allocation).
  const dev_ptr p = d.mem_alloc(g);
  d.memset_d32(p, 0xABCDEF01u, g / 4, nullptr);
  d.mem_free(p);
  CHECK_FALSE(d.is_accessible(p, 4));
  const dev_ptr q = d.mem_alloc(g);
  CHECK(q == p);
  std::uint32_t word = 1;
  d.copy_to_host(&word, q, 4);
  CHECK(word == 0u);
  d.mem_free(q);
}

TEST_CASE("regression: a host-backed reservation larger than the address arena is still made" * doctest::skip(testutil::kThreadSanitizer)) {
  // The arena (1 TiB here) bounds which addresses are reproducible, not what may be reserved: CUDA
  // reserves terabytes of virtual address space, and expandable_va_size may ask for up to 1 PiB.
  SimDriver d(options(true));
  const std::size_t g = d.granularity();
  const std::size_t huge = std::size_t{3} << 40;
  const dev_ptr small = d.reserve(4 * g);
  const dev_ptr big = d.reserve(huge);
  CHECK(big % g == 0);
  CHECK((big + huge <= small || small + 4 * g <= big));
  const dev_ptr last = big + huge - g;
  const phys_handle h = d.create(g);
  d.map(last, g, h);
  d.set_access(last, g);
  d.memset_d32(last, 0x1234u, g / 4, nullptr);
  std::uint32_t word = 0;
  d.copy_to_host(&word, big + huge - 4, 4);
  CHECK(word == 0x1234u);
  d.unmap(last, g);
  d.release(h);
  d.free_reserve(big, huge);
  d.free_reserve(small, 4 * g);
  // Given back each time: it can be made again and again.
  for (int i = 0; i < 3; ++i) {
    const dev_ptr again = d.reserve(huge);
    d.free_reserve(again, huge);
  }
  CHECK(d.live().reservations == 0);
}

TEST_CASE("regression: simulated devices alive at once hand out disjoint addresses") {
  for (const bool host : {false, true}) {
    CAPTURE(host);
    SimDriver a(options(host, 0)), b(options(host, 0)), c(options(host, 1));
    const std::size_t g = a.granularity();
    std::vector<std::pair<dev_ptr, std::size_t>> ranges;
    for (SimDriver* d : {&a, &b, &c}) {
      ranges.emplace_back(d->reserve(32 * g), 32 * g);
      ranges.emplace_back(d->mem_alloc(5 * g), 5 * g);
    }
    // Two drivers of the same device are two processes' views: disjoint, like two devices'.
    if (host) {
      for (std::size_t i = 0; i < ranges.size(); ++i)
        for (std::size_t j = i + 1; j < ranges.size(); ++j) {
          CAPTURE(i);
          CAPTURE(j);
          CHECK((ranges[i].first + ranges[i].second <= ranges[j].first || ranges[j].first + ranges[j].second <= ranges[i].first));
        }
    } else {
      // Bookkeeping: a device's span is its own; two devices never share an address.
      CHECK(ranges[4].first != ranges[0].first);
    }
  }
}

TEST_CASE("regression: every simulated device of a process counts the same devices, so any two may be peers") {
  // Was: the driver of device d counted max(d + 1, 8) devices, so device 9 could grant device 0
  // access but device 0 refused device 9 ("no device 9 (8 sim devices visible)"); CUDA's device
  // count is one number for the whole process.
  const expseg::Config c = expseg::Config::parse("device:sim,sim_capacity:1GiB,backend:expandable");
  expseg::Allocator a0(c, 0), a9(c, 9);
  CHECK_NOTHROW(a9.enable_peer_access(0));
  CHECK_NOTHROW(a0.enable_peer_access(9));
  CHECK(a0.device_info().access_devices == std::vector<int>{0, 9});
  CHECK(a9.device_info().access_devices == std::vector<int>{9, 0});
  // The highest device index an allocator may have is a peer too; one past it is not a device.
  const int last = kSimMaxDevices - 1;
  CHECK_NOTHROW(a0.enable_peer_access(last));
  CHECK_THROWS_AS(a0.enable_peer_access(last + 1), expseg::error);
  CHECK_THROWS_AS(expseg::Allocator(c, last + 1), expseg::error);
}

}  // TEST_SUITE
