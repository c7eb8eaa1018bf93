// The other process of the GPU IPC tests: tests/gpu/ipc_child.cpp (the executable expseg_ipc_child)
// and how the tests start it and talk to it.
//
// Protocol over a Unix socketpair: the parent sends one send_fds message holding the handle (mode
// scm: serialize() bytes + the descriptors as SCM_RIGHTS; mode pidfd: the bytes only, and the child
// takes the descriptors with pidfd_getfd). The child imports it on its device with a CudaDriver of
// its own (no Allocator), checks that it reads kParentWord everywhere, writes kChildWord everywhere
// with cuMemsetD32, synchronizes, closes the import and answers one send_fds message:
//   "OK <details>"              exit 0
//   "REFUSED <errno> <message>" exit 3 (pidfd mode: the platform refused pidfd_getfd)
//   "ERROR <message>"           exit 1
// The parent then reads kChildWord back on its own device.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "expseg/ipc.hpp"

namespace ipc_test {

inline constexpr std::uint32_t kParentWord = 0x5EED0001u;
inline constexpr std::uint32_t kChildWord = 0xC41D0002u;
inline constexpr std::uint32_t kPadWord = 0x0BAD0003u;
inline constexpr int kRefusedExit = 3;

inline void send_text(int socket, const std::string& text) {
  expseg::send_fds(socket, std::span(reinterpret_cast<const std::uint8_t*>(text.data()), text.size()), {});
}

// The child process: started with fork + exec before it touches CUDA (the parent's CUDA state is
// never used after fork).
class Child {
 public:
  // `exe`: the expseg_ipc_child executable; `mode`: "scm" or "pidfd"; `device`: where it imports.
  Child(const std::string& exe, const std::string& mode, int device) {
    int sv[2] = {-1, -1};
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) throw std::runtime_error("socketpair failed");
    parent_.reset(sv[0]);
    expseg::OwnedFd child_end(sv[1]);
    // Everything the child needs is built before fork: after it, only async-signal-safe calls.
    const std::string fd_arg = std::to_string(sv[1]);
    const std::string dev_arg = std::to_string(device);
    std::vector<char*> argv = {const_cast<char*>(exe.c_str()), const_cast<char*>(fd_arg.c_str()),
                               const_cast<char*>(mode.c_str()), const_cast<char*>(dev_arg.c_str()), nullptr};
    long max_fd = ::sysconf(_SC_OPEN_MAX);
    if (max_fd < 0 || max_fd > 65536) max_fd = 65536;
    pid_ = ::fork();
    if (pid_ < 0) throw std::runtime_error(std::string("fork failed: ") + std::strerror(errno));
    if (pid_ == 0) {
      // Only the socket travels: descriptors the parent exported must come through the protocol.
      for (int fd = 3; fd < max_fd; ++fd)
        if (fd != sv[1]) ::close(fd);
      ::fcntl(sv[1], F_SETFD, 0);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
  }
  ~Child() {
    if (pid_ > 0 && !reaped_) {
      ::kill(pid_, SIGKILL);
      int status = 0;
      ::waitpid(pid_, &status, 0);
    }
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  int socket() const noexcept { return parent_.get(); }
  pid_t pid() const noexcept { return pid_; }

  // The child's answer, or a description of why none came (timeout, the child died).
  std::string reply(int timeout_s = 180) {
    pollfd p{parent_.get(), POLLIN, 0};
    const int r = ::poll(&p, 1, timeout_s * 1000);
    if (r == 0) return "ERROR no answer from the child within " + std::to_string(timeout_s) + " s";
    if (r < 0) return std::string("ERROR poll failed: ") + std::strerror(errno);
    try {
      std::vector<expseg::OwnedFd> none;
      const std::vector<std::uint8_t> bytes = expseg::recv_fds(parent_.get(), none);
      return std::string(bytes.begin(), bytes.end());
    } catch (const std::exception& e) {
      return std::string("ERROR ") + e.what();
    }
  }
  // The child's exit code (waits for it); 128 + signal when it was killed; -1 on failure.
  int wait() {
    int status = 0;
    pid_t r;
    do {
      r = ::waitpid(pid_, &status, 0);
    } while (r < 0 && errno == EINTR);
    reaped_ = true;
    if (r < 0) return -1;
    if (WIFEXITED(status)) return WEXITSTATUS(status);
    if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
    return -1;
  }

 private:
  expseg::OwnedFd parent_;
  pid_t pid_ = -1;
  bool reaped_ = false;
};

}  // namespace ipc_test
