// The driver contract (tests/common/driver_contract.hpp) on the simulated device.
#include <doctest/doctest.h>

#include "driver/sim_driver.hpp"
#include "driver_contract.hpp"
#include "test_util.hpp"

using expseg::driver::SimDriver;
using expseg::driver::SimOptions;

namespace {

void check_nothing_left(const SimDriver& d) {
  const SimDriver::Live l = d.live();
  CHECK(l.reservations == 0);
  CHECK(l.handles == 0);
  CHECK(l.mappings == 0);
  CHECK(l.mem_allocs == 0);
  CHECK(l.events == 0);
  CHECK(l.streams == 0);
  CHECK(l.physical_bytes == 0);
}

}  // namespace

TEST_SUITE("driver") {
  TEST_CASE("driver: contract on a host-backed SimDriver (2 MiB granularity)") {
    SimOptions o;
    o.host_backed = true;
    o.capacity = std::size_t{256} << 20;
    SimDriver d(o);
    check_driver_contract(d, true);
    check_nothing_left(d);
  }

  TEST_CASE("driver: contract on a host-backed SimDriver (64 KiB granularity, 4 devices)") {
    SimOptions o;
    o.host_backed = true;
    o.capacity = std::size_t{64} << 20;
    o.granularity = std::size_t{64} << 10;
    o.device = 2;
    o.device_count = 4;
    SimDriver d(o);
    check_driver_contract(d, true);
    check_nothing_left(d);
  }

  TEST_CASE("driver: contract on a bookkeeping SimDriver (no data access)") {
    SimDriver d;
    check_driver_contract(d, false);
    check_nothing_left(d);
  }

  TEST_CASE("driver: the address space runs out on a bookkeeping SimDriver") {
    const std::size_t others = SimDriver::address_space_in_use();
    SimDriver d;
    check_address_space_limit(d);
    check_nothing_left(d);
    CHECK(SimDriver::address_space_in_use() == others);
  }

  // The host's own address space (mmap says ENOMEM), as large as a CUDA process's; under
  // ThreadSanitizer, whose shadow holds most of it, no 16 TiB reservation is made at all.
  TEST_CASE("driver: the address space runs out on a host-backed SimDriver" * doctest::skip(testutil::kThreadSanitizer)) {
    SimOptions o;
    o.host_backed = true;
    o.capacity = std::size_t{256} << 20;
    SimDriver d(o);
    check_address_space_limit(d);
    check_nothing_left(d);
  }
}
