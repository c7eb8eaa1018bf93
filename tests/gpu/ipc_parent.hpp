// The exporting side of the GPU IPC tests (tests/gpu/test_ipc.cpp, test_peer.cpp): allocate on
// device 0 through an expseg::Allocator, fill, export, hand the handle to expseg_ipc_child, and read
// back what the child wrote.
#pragma once

#include <doctest/doctest.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>

#include "allocator_impl.hpp"
#include "driver_contract.hpp"
#include "expseg/allocator.hpp"
#include "ipc_child.hpp"

#ifndef EXPSEG_IPC_CHILD
#error "EXPSEG_IPC_CHILD (the path of expseg_ipc_child) must be defined by the build"
#endif

namespace ipc_test {

inline std::uint64_t addr_of(const void* p) { return static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(p)); }

// One round trip. `conf`: the exporting allocator's config (device 0); `mode`: "scm" or "pidfd";
// `child_device`: where the child imports (1: across GPUs).
inline void round_trip(const std::string& conf, const std::string& mode, int child_device = 0) {
  INFO("conf " << conf << ", mode " << mode << ", child on device " << child_device);
  expseg::Allocator a(expseg::Config::parse(conf), 0);
  expseg::driver::Driver& d = expseg::detail::AllocatorAccess::driver(a);
  const expseg::DeviceInfo info = a.device_info();
  if (!info.ipc_fallback_reason.empty())
    MESSAGE("ipc_handle asked for in '" << conf << "' fell back to " << std::string(expseg::to_string(info.ipc_handle)) << ": "
                                        << info.ipc_fallback_reason);
  const std::size_t pad_bytes = 3u << 20;
  const std::size_t size = (5u << 20) + 1024;  // a multiple of 4, not of the granularity
  void* pad = a.allocate(pad_bytes);
  void* p = a.allocate(size);
  d.memset_d32(addr_of(pad), kPadWord, pad_bytes / 4, nullptr);
  d.memset_d32(addr_of(p), kParentWord, size / 4, nullptr);
  d.device_synchronize();

  expseg::IpcMemHandle h = a.export_ipc(p);
  CHECK(h.size == size);
  CHECK(h.offset > 0);  // the pad lies before it in the same exported range
  if (!h.fallback_reason.empty()) MESSAGE("exported as " << std::string(expseg::to_string(h.kind)) << ": " << h.fallback_reason);
  MESSAGE("exported " << std::string(expseg::to_string(h.kind)) << ": " << h.pieces.size() << " pieces, " << h.range_bytes
                      << " bytes, offset " << h.offset);

  Child child(EXPSEG_IPC_CHILD, mode, child_device);
  if (mode == "pidfd") {
    expseg::allow_fd_fetch_by(child.pid());  // Yama ptrace_scope 1: let the child take our descriptors
    const std::vector<std::uint8_t> bytes = h.serialize();
    expseg::send_fds(child.socket(), bytes, {});
  } else {
    expseg::send_ipc_handle(child.socket(), h);
  }
  const std::string reply = child.reply();
  const int code = child.wait();
  INFO("child: " << reply << " (exit " << code << ")");
  if (reply.rfind("REFUSED", 0) == 0) {
    // The platform refused pidfd_getfd: the error must name the restriction and the fallback. The
    // import itself is then untested here: EXPSEG_REQUIRE_PIDFD=1 (gpu_session.sh) makes that a failure.
    if (const char* need = std::getenv("EXPSEG_REQUIRE_PIDFD"); need && *need && std::string(need) != "0")
      FAIL("pidfd_getfd refused, and EXPSEG_REQUIRE_PIDFD is set: " << reply);
    WARN_MESSAGE(false, "pidfd_getfd refused on this platform (where ptrace is restricted): the import through it is NOT tested here, only the refusal's message: " << reply);
    CHECK(mode == "pidfd");
    CHECK(code == kRefusedExit);
    CHECK(reply.find("SCM_RIGHTS") != std::string::npos);
    const bool named = reply.rfind("REFUSED " + std::to_string(EPERM) + " ", 0) == 0 ||
                       reply.rfind("REFUSED " + std::to_string(ENOSYS) + " ", 0) == 0;
    CHECK(named);
    expseg::test::check_words(d, addr_of(p), size / 4, kParentWord);  // untouched
  } else {
    CHECK(reply.rfind("OK", 0) == 0);
    CHECK(code == 0);
    MESSAGE(reply);
    expseg::test::check_words(d, addr_of(p), size / 4, kChildWord);  // written by the other process
  }
  expseg::test::check_words(d, addr_of(pad), pad_bytes / 4, kPadWord);  // the neighbour is untouched
  a.deallocate(p);
  a.deallocate(pad);
  a.validate();
}

}  // namespace ipc_test
