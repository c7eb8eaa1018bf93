// Two GPUs (issue 8; expseg_gpu_multi): peer access to memory allocated through expseg on device 0,
// written from device 1's context with cuMemsetD32 and read back on device 0, for both backends
// (expandable without cuCtxEnablePeerAccess, split_merge with it),
// for memory mapped before enable_peer_access (re-granted) and after it (growth); the same from
// device 1 to device 0; and IPC to a process that imports on the other GPU.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "ipc_parent.hpp"

namespace {

using expseg::driver::Driver;
using expseg::driver::make_cuda_driver;
using ipc_test::addr_of;

constexpr std::uint32_t kOwnWord = 0x11110000u;

// Allocates on `a`'s device, enables `peer`, and has `peer` write into memory allocated before
// and after the grant; each is read back on the owning device.
void peer_writes(const std::string& conf, int owner, int peer) {
  INFO(conf << ": device " << peer << " writes memory of device " << owner);
  expseg::Allocator a(expseg::Config::parse(conf), owner);
  Driver& own = expseg::detail::AllocatorAccess::driver(a);
  REQUIRE_MESSAGE(own.can_access_peer(peer), "no peer-to-peer path from device " << peer << " to device " << owner
                                                                                 << " (cuDeviceCanAccessPeer = 0): this "
                                                                                    "machine cannot run the peer test");
  const std::size_t before_bytes = (64u << 20) + 4096;
  const std::size_t after_bytes = 200u << 20;
  void* pad = a.allocate(1u << 20);
  void* before = a.allocate(before_bytes);  // mapped before the grant: re-granted by enable_peer_access
  own.memset_d32(addr_of(before), kOwnWord, before_bytes / 4, nullptr);
  own.device_synchronize();

  a.enable_peer_access(peer);
  const expseg::DeviceInfo info = a.device_info();
  CHECK(info.access_devices.size() == 2);
  CHECK(info.access_devices.back() == peer);
  a.enable_peer_access(peer);  // twice: nothing to do
  // Only cuMemAlloc memory needs cuCtxEnablePeerAccess (at most 8 peers per device); expandable
  // memory is reached through cuMemSetAccess alone, which the writes below prove.
  if (a.backend() == expseg::BackendKind::split_merge)
    CHECK(own.context_peers() == std::vector<int>{peer});
  else
    CHECK(own.context_peers().empty());

  void* after = a.allocate(after_bytes);  // growth after the grant
  auto other = make_cuda_driver(peer);     // device `peer`'s primary context, no allocator
  other->memset_d32(addr_of(before), 0xB0000000u | static_cast<std::uint32_t>(peer), before_bytes / 4, nullptr);
  other->memset_d32(addr_of(after), 0xA0000000u | static_cast<std::uint32_t>(peer), after_bytes / 4, nullptr);
  other->device_synchronize();
  expseg::test::check_words(own, addr_of(before), before_bytes / 4, 0xB0000000u | static_cast<std::uint32_t>(peer));
  expseg::test::check_words(own, addr_of(after), after_bytes / 4, 0xA0000000u | static_cast<std::uint32_t>(peer));
  a.deallocate(before);
  a.deallocate(after);
  a.deallocate(pad);
  a.validate();
}

}  // namespace

TEST_SUITE("multi_gpu") {

TEST_CASE("peer: device 1 writes split_merge memory of device 0 (cuCtxEnablePeerAccess)") {
  peer_writes("backend:split_merge", 0, 1);
}

TEST_CASE("peer: device 1 writes expandable memory of device 0 (cuMemSetAccess re-grant and growth)") {
  peer_writes("backend:expandable", 0, 1);
  // Several mapped runs and 2 MiB handles: the re-grant covers each run.
  peer_writes("backend:expandable,expandable_max_handle:2MiB", 0, 1);
}

TEST_CASE("peer: device 0 writes memory of device 1, both backends") {
  peer_writes("backend:split_merge", 1, 0);
  peer_writes("backend:expandable", 1, 0);
}

TEST_CASE("peer: errors name the devices") {
  expseg::Allocator a(expseg::Config::parse("backend:expandable"), 0);
  const int count = expseg::driver::cuda_device_count();
  try {
    a.enable_peer_access(count);
    FAIL("enable_peer_access of a device that does not exist succeeded");
  } catch (const expseg::error& e) {
    CHECK(std::string(e.what()).find("no device " + std::to_string(count)) != std::string::npos);
  }
  a.enable_peer_access(0);  // its own device: nothing to do
  CHECK(a.device_info().access_devices == std::vector<int>{0});
}

TEST_CASE("ipc: a process on device 1 imports memory of device 0, both backends") {
  ipc_test::round_trip("backend:split_merge", "scm", 1);
  ipc_test::round_trip("backend:expandable,ipc_handle:posix_fd,expandable_max_handle:2MiB", "scm", 1);
}

}  // TEST_SUITE
