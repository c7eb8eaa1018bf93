// IPC between two processes on one GPU (issue 8): the parent allocates through expseg (both
// backends), exports, and a child process (expseg_ipc_child, started with fork + exec) imports,
// checks the parent's bytes, writes its own with cuMemsetD32; the parent reads them back.
#include <doctest/doctest.h>

#include "ipc_parent.hpp"

TEST_SUITE("ipc") {

TEST_CASE("ipc: split_merge allocation to another process (cuIpcGetMemHandle + offset)") {
  ipc_test::round_trip("backend:split_merge", "scm");
}

TEST_CASE("ipc: expandable allocation to another process (posix_fd handles over SCM_RIGHTS)") {
  // 2 MiB handles: the 5 MiB allocation spans several physical handles, mapped back to back there.
  ipc_test::round_trip("backend:expandable,ipc_handle:posix_fd,expandable_max_handle:2MiB", "scm");
  // The default handle policy (one large handle).
  ipc_test::round_trip("backend:expandable,ipc_handle:posix_fd", "scm");
}

TEST_CASE("ipc: expandable descriptors taken with pidfd_getfd, or a clear refusal naming the fallback") {
  ipc_test::round_trip("backend:expandable,ipc_handle:posix_fd,expandable_max_handle:2MiB", "pidfd");
}

TEST_CASE("ipc: expandable with ipc_handle:fabric (fabric handles, or posix_fd with the fallback reason)") {
  // Fabric handles need IMEX channels; where they are refused, the driver falls back to posix_fd
  // and says why (device_info().ipc_fallback_reason, IpcMemHandle::fallback_reason).
  ipc_test::round_trip("backend:expandable,ipc_handle:fabric,expandable_max_handle:2MiB", "scm");
}

TEST_CASE("ipc: export errors on the real device") {
  expseg::Allocator a(expseg::Config::parse("backend:expandable"), 0);  // ipc_handle:none
  void* p = a.allocate(1u << 20);
  try {
    (void)a.export_ipc(p);
    FAIL("export_ipc of memory without a shareable handle type succeeded");
  } catch (const expseg::ipc_error& e) {
    CHECK(std::string(e.what()).find("ipc_handle:posix_fd") != std::string::npos);
  }
  a.deallocate(p);
  CHECK_THROWS_AS((void)a.export_ipc(p), expseg::invalid_pointer);

  // split_merge memory cannot be opened by its own process (cuIpcOpenMemHandle refuses): named.
  expseg::Allocator s(expseg::Config::parse("backend:split_merge"), 0);
  void* q = s.allocate(1u << 20);
  const expseg::IpcMemHandle h = s.export_ipc(q);
  try {
    (void)expseg::import_ipc(h, 0, expseg::Config::parse(""));
    FAIL("import of a cuda_ipc handle in the exporting process succeeded");
  } catch (const expseg::ipc_error& e) {
    CHECK(std::string(e.what()).find("process that exported it") != std::string::npos);
  }
  s.deallocate(q);
}

}  // TEST_SUITE
