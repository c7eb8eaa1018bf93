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
  // Which of the two it was, and never a silent fallback.
  expseg::Allocator a(expseg::Config::parse("backend:expandable,ipc_handle:fabric"), 0);
  void* p = a.allocate(1u << 20);
  const expseg::IpcMemHandle h = a.export_ipc(p);
  CAPTURE(h.fallback_reason);
  if (h.kind == expseg::IpcKind::fabric) {
    CHECK(h.fallback_reason.empty());
    CHECK(a.device_info().ipc_fallback_reason.empty());
  } else {
    CHECK(h.kind == expseg::IpcKind::posix_fd);
    CHECK_FALSE(h.fallback_reason.empty());
    CHECK(h.fallback_reason == a.device_info().ipc_fallback_reason);
  }
  a.deallocate(p);
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

TEST_CASE("ipc: an expandable import closed during a told graph capture is released at the capture's end") {
  // Releasing an import takes a device synchronization, which a capture refuses (it would be
  // invalidated). During a capture the allocator was told of, close() hands the import to the
  // allocator, which releases it when the capture ends.
  expseg::Allocator a(expseg::Config::parse("backend:expandable,ipc_handle:posix_fd"), 0);
  expseg::driver::Driver& d = expseg::detail::AllocatorAccess::driver(a);
  void* p = a.allocate(4u << 20);
  expseg::ImportedMemory m = a.import_ipc(a.export_ipc(p));  // this process's own descriptors
  REQUIRE(m);
  void* cs = d.stream_create();
  a.prepare_capture(cs);
  d.capture_begin(cs);
  a.begin_graph_pool(1, cs);
  void* out = a.allocate(2u << 20, cs);
  d.memset_d32(ipc_test::addr_of(out), 0x5eed5eedu, (2u << 20) / 4, cs);
  CHECK_NOTHROW(m.close());  // was: cuCtxSynchronize failed and invalidated the capture
  CHECK_FALSE(m);
  expseg::driver::graph_t g = nullptr;
  CHECK_NOTHROW(g = d.capture_end(cs));
  a.end_graph_pool(1);  // the import is released here
  if (g != nullptr) {
    d.graph_launch(g, cs);
    d.stream_synchronize(cs);
    std::uint32_t word = 0;
    d.copy_to_host(&word, ipc_test::addr_of(out), sizeof word);
    CHECK(word == 0x5eed5eedu);
    d.graph_destroy(g);
  }
  a.deallocate(out);
  a.release_graph_pool(1);
  d.memset_d32(ipc_test::addr_of(p), 7u, (4u << 20) / 4, nullptr);  // the exported block still works
  d.device_synchronize();
  std::uint32_t word = 0;
  d.copy_to_host(&word, ipc_test::addr_of(p), sizeof word);
  CHECK(word == 7u);
  a.deallocate(p);
  a.validate();
  d.stream_destroy(cs);
}

}  // TEST_SUITE
