// expseg_ipc_echo: the C++ end of the Python glue's IPC interop test (tests/python/test_glue.py).
//   expseg_ipc_echo <socket fd> <handle|fds>
// Receives one message with expseg::recv_ipc_handle (handle: the message must hold a valid handle
// and its descriptors) or expseg::recv_fds (fds: any bytes and descriptors), sends it back with
// send_ipc_handle / send_fds, and exits 0; on an error prints it and exits 1.
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "expseg/ipc.hpp"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s <socket fd> <handle|fds>\n", argv[0]);
    return 2;
  }
  const int sock = std::atoi(argv[1]);
  const std::string mode = argv[2];
  try {
    if (mode == "handle") {
      const expseg::IpcMemHandle h = expseg::recv_ipc_handle(sock);
      expseg::send_ipc_handle(sock, h);
    } else if (mode == "fds") {
      std::vector<expseg::OwnedFd> fds;
      const std::vector<std::uint8_t> bytes = expseg::recv_fds(sock, fds);
      std::vector<int> raw;
      for (const expseg::OwnedFd& fd : fds) raw.push_back(fd.get());
      expseg::send_fds(sock, bytes, raw);
    } else {
      std::fprintf(stderr, "unknown mode '%s' (handle or fds)\n", mode.c_str());
      return 2;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
