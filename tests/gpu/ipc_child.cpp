// expseg_ipc_child: the importing process of the GPU IPC tests (protocol in ipc_child.hpp).
//   expseg_ipc_child <socket fd> <scm|pidfd> <device>
// Imports through a CudaDriver of its own (detail::IpcAccess::import_with): no expseg::Allocator.
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "driver/driver.hpp"
#include "ipc_child.hpp"
#include "ipc_internal.hpp"

namespace {

using namespace expseg;

// First index in [0, count) whose word differs from `value`, or count.
std::size_t first_mismatch(driver::Driver& d, driver::dev_ptr ptr, std::size_t count, std::uint32_t value) {
  std::vector<std::uint32_t> words(count);
  d.copy_to_host(words.data(), ptr, count * sizeof(std::uint32_t));
  std::size_t i = 0;
  while (i < count && words[i] == value) ++i;
  return i;
}

int run(int sock, const std::string& mode, int device) {
  std::vector<OwnedFd> fds;
  const std::vector<std::uint8_t> bytes = recv_fds(sock, fds);
  IpcMemHandle h = IpcMemHandle::deserialize(bytes);
  if (mode == "scm") {
    h.adopt_fds(std::move(fds));
  } else if (mode == "pidfd") {
    if (!fds.empty()) throw ipc_error("pidfd mode: the parent sent descriptors");
    try {
      h.fetch_fds_from_exporter();
    } catch (const ipc_error& e) {
      ipc_test::send_text(sock, "REFUSED " + std::to_string(e.sys_errno()) + " " + e.what());
      return ipc_test::kRefusedExit;
    }
  } else {
    throw ipc_error("unknown mode '" + mode + "' (scm or pidfd)");
  }
  if (h.size % 4 != 0) throw ipc_error("the test allocation's size is not a multiple of 4");

  std::shared_ptr<driver::Driver> drv = driver::make_cuda_driver(device);
  ImportedMemory m = detail::IpcAccess::import_with(drv, h);
  const auto ptr = static_cast<driver::dev_ptr>(reinterpret_cast<std::uintptr_t>(m.get()));
  const std::size_t words = h.size / 4;
  if (const std::size_t bad = first_mismatch(*drv, ptr, words, ipc_test::kParentWord); bad != words)
    throw ipc_error("the imported memory does not hold the exporter's pattern at word " + std::to_string(bad) + " of " +
                    std::to_string(words));
  drv->memset_d32(ptr, ipc_test::kChildWord, words, nullptr);
  drv->device_synchronize();
  if (const std::size_t bad = first_mismatch(*drv, ptr, words, ipc_test::kChildWord); bad != words)
    throw ipc_error("the child's own write did not stick at word " + std::to_string(bad));
  m.close();
  ipc_test::send_text(sock, "OK pid " + std::to_string(::getpid()) + " imported " + to_string(h.kind) + " (" +
                                std::to_string(h.pieces.size()) + " pieces, " + std::to_string(h.range_bytes) +
                                " bytes, offset " + std::to_string(h.offset) + ") on device " + std::to_string(device) +
                                " via " + mode);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s <socket fd> <scm|pidfd> <device>\n", argv[0]);
    return 2;
  }
  const int sock = std::atoi(argv[1]);
  try {
    return run(sock, argv[2], std::atoi(argv[3]));
  } catch (const std::exception& e) {
    try {
      ipc_test::send_text(sock, std::string("ERROR ") + e.what());
    } catch (...) {
    }
    std::fprintf(stderr, "expseg_ipc_child: %s\n", e.what());
    return 1;
  }
}
