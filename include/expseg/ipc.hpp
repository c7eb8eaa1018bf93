// expseg IPC: hand a live allocation to another process, and the file descriptors that carry it.
//
//   exporter                                        importer
//   IpcMemHandle h = alloc.export_ipc(p);           IpcMemHandle h = expseg::recv_ipc_handle(sock);
//   expseg::send_ipc_handle(sock, h);               expseg::ImportedMemory m = expseg::import_ipc(h, device);
//   ... keep p allocated while the importer         use m.get() (m.size() bytes) on the device;
//       uses it ...                                 ~ImportedMemory unmaps and releases it
//
// What travels, per backend:
//   - split_merge: cuIpcGetMemHandle of the driver allocation (segment) that holds the block, and
//     the block's offset in it (64 bytes, no file descriptor). The importer opens it with
//     cuIpcOpenMemHandle and adds the offset.
//   - expandable: the shareable handles of the physical handles under the block (ipc_handle:posix_fd:
//     one file descriptor each; ipc_handle:fabric: 64 bytes each, no descriptor), their sizes, and
//     the block's offset inside the range they cover. The importer reserves address space, imports
//     each handle, maps them back to back, grants access, and adds the offset. Physical memory must
//     have been created shareable: an allocator whose config leaves ipc_handle:none cannot export.
//     The importer maps whole handles, so bytes of neighbouring allocations in the same handles are
//     reachable too; only [get(), get() + size()) is the exported allocation.
//
// Lifetime: the exporter must keep the allocation live (not deallocate it) until every importer has
// closed its ImportedMemory: expseg, like CUDA, does not count remote users. An exported expandable
// handle stays alive in the importer even if the exporter releases its own mapping, but the
// exporter may hand its bytes to a new allocation once the block is freed.
//
// File descriptors (posix_fd) travel in one of two ways:
//   - SCM_RIGHTS over a connected Unix stream socket: send_ipc_handle/recv_ipc_handle (or send_fds/
//     recv_fds for your own framing). Works everywhere, containers included; needs a socket.
//   - pidfd_open + pidfd_getfd (Linux >= 5.6): the importer takes the descriptors straight out of the
//     exporter, knowing only its pid and their numbers (both are in serialize()'s bytes), so the bytes
//     can travel any way. Both processes must share a PID namespace (a pid means nothing in another
//     one: fetch_fds_from_exporter refuses a handle from another namespace, naming the fallback). The kernel checks ptrace access to the exporter: it fails with EPERM under
//     Yama ptrace_scope >= 1 unless the exporter called allow_fd_fetch_by(importer pid), when the
//     importer runs as another user, or in containers whose seccomp profile refuses pidfd_getfd
//     without CAP_SYS_PTRACE (Docker's default); ENOSYS on older kernels. The ipc_error then names
//     the restriction and the fallback (SCM_RIGHTS, or ipc_handle:fabric, which needs no descriptor).
#pragma once

#include <sys/types.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "expseg/config.hpp"
#include "expseg/errors.hpp"

// The public API keeps default visibility; the rest of libexpseg.so is built hidden.
#pragma GCC visibility push(default)

namespace expseg {

// An IPC operation failed for a reason of the platform or of the handle: a system call refused
// (pidfd_getfd denied, a socket closed), a malformed or mismatched handle, an allocation that cannot
// be exported as configured. Driver failures are driver_error; pointers that are not live
// allocations are invalid_pointer.
class ipc_error : public error {
 public:
  explicit ipc_error(const std::string& message, int sys_errno = 0) : error(message), errno_(sys_errno) {}
  int sys_errno() const noexcept { return errno_; }  // errno of the failed system call; 0 if none

 private:
  int errno_;
};

// A file descriptor, closed when the object is destroyed (move-only).
class OwnedFd {
 public:
  OwnedFd() noexcept = default;
  explicit OwnedFd(int fd) noexcept : fd_(fd) {}
  ~OwnedFd() { reset(); }
  OwnedFd(OwnedFd&& other) noexcept : fd_(other.release()) {}
  OwnedFd& operator=(OwnedFd&& other) noexcept {
    if (this != &other) reset(other.release());
    return *this;
  }
  OwnedFd(const OwnedFd&) = delete;
  OwnedFd& operator=(const OwnedFd&) = delete;

  int get() const noexcept { return fd_; }
  explicit operator bool() const noexcept { return fd_ >= 0; }
  int release() noexcept {  // gives up ownership; returns the descriptor
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset(int fd = -1) noexcept;  // closes the descriptor held, if any, and holds `fd`

 private:
  int fd_ = -1;
};

// How an exported allocation travels.
enum class IpcKind : std::uint8_t {
  cuda_ipc,  // split_merge: cuIpcGetMemHandle of the driver allocation holding the block
  posix_fd,  // expandable: one POSIX file descriptor per physical handle
  fabric,    // expandable: one 64-byte fabric handle per physical handle (no descriptor)
};
const char* to_string(IpcKind) noexcept;

// One exported driver allocation (cuda_ipc) or physical handle (posix_fd, fabric).
struct IpcPiece {
  std::size_t bytes = 0;                  // its size
  std::array<std::uint8_t, 64> handle{};  // cuIpcMemHandle or fabric handle bytes (or the simulator's)
  OwnedFd fd;                             // posix_fd: the descriptor in this process, once here
  int remote_fd = -1;                     // posix_fd: its number in the exporting process
  // posix_fd: the file the exporter's descriptor names (fstat's st_dev, st_ino; both 0: unknown). A
  // descriptor fetched (pidfd_getfd) or received for this piece must name the same file: a number
  // the exporter closed and reused, or another handle's descriptor, is refused.
  std::uint64_t file_dev = 0;
  std::uint64_t file_ino = 0;
};

// An exported allocation. Move-only: it owns the file descriptors of its pieces (closed when it is
// destroyed; the exporter may destroy it once the importer has the descriptors).
struct IpcMemHandle {
  IpcKind kind = IpcKind::cuda_ipc;
  std::string device_kind;      // "cuda" or "sim": the driver that exported it
  int device = 0;               // the exporting device, as the exporter numbers it
  std::int64_t exporter_pid = 0;  // as the exporter's PID namespace numbers it: what pidfd_getfd needs
  // Which process exported it: random, made once per process (afresh in a fork child). Unlike the
  // pid, it tells processes of different PID namespaces apart (two containers' processes may both
  // be pid 1). 0 (a handle built by hand): an unknown exporter, never this process.
  std::uint64_t exporter_nonce = 0;
  // The exporter's PID namespace (the inode of its /proc/self/ns/pid; 0: unknown, e.g. no /proc).
  // exporter_pid means that process only in this namespace: fetch_fds_from_exporter refuses a
  // handle from another one rather than take descriptors from whatever process has that pid here.
  std::uint64_t exporter_pid_namespace = 0;
  std::uint64_t offset = 0;     // where the allocation starts inside the exported range
  std::size_t size = 0;         // the allocation's size, as requested from allocate()
  std::size_t range_bytes = 0;  // the exported range: the pieces' bytes, back to back
  std::vector<IpcPiece> pieces;
  // The expandable exporter's physical memory uses another handle type than its config asked for
  // (ipc_handle:fabric where fabric handles are refused, e.g. in a container without IMEX
  // channels): why, and what is used instead. Empty otherwise.
  std::string fallback_reason;

  // Whether the pieces' file descriptors must travel too (posix_fd).
  bool needs_fds() const noexcept { return kind == IpcKind::posix_fd; }
  // Whether every descriptor that must travel is here (always true when none must).
  bool has_fds() const noexcept;
  // The pieces' descriptors in this process, in order (posix_fd; empty otherwise): what send_fds sends.
  std::vector<int> fds() const;

  // Everything but the descriptors themselves (their numbers in this process and its pid are
  // included, for pidfd_getfd): bytes that can travel any way. Versioned; little-endian hosts of
  // one machine.
  std::vector<std::uint8_t> serialize() const;
  // The handle serialize() wrote, without descriptors: give them with adopt_fds() (received with
  // recv_fds) or take them with fetch_fds_from_exporter(). Throws ipc_error on malformed bytes.
  static IpcMemHandle deserialize(std::span<const std::uint8_t> bytes);
  // Takes ownership of `fds`, one per piece in order (posix_fd); throws ipc_error, taking none, if
  // the count is wrong or check_fd_files refuses them.
  void adopt_fds(std::vector<OwnedFd> fds);
  // Throws ipc_error if a descriptor names another file than the exporter's for its piece (where
  // the handle knows that file: IpcPiece::file_dev/file_ino). `fds`: one per piece, in order.
  void check_fd_files(std::span<const int> fds) const;
  // pidfd_open(exporter_pid) + pidfd_getfd of each piece's remote_fd (Linux >= 5.6). Throws
  // ipc_error naming the restriction and the fallback when the platform refuses, and before any
  // system call when the exporter runs in another PID namespace than this process (another
  // container, or a container and its host): its pid names another process here, or none.
  void fetch_fds_from_exporter();
};

namespace detail {
struct IpcAccess;
struct ImportRegistry;
}

// An exported allocation mapped into this process. Releases its mappings and handles (cuIpcClose-
// MemHandle, or unmap + cuMemRelease + cuMemAddressFree) on destruction. Move-only.
// Releasing waits for the work queued on this device first, as cuIpcCloseMemHandle itself does
// (expandable imports: a device synchronization before the unmap, which alone would not wait, so
// that work would fault). Work queued on other devices (peers reaching the memory) is not waited
// for: finish it before releasing. Memory imported through Allocator::import_ipc and released while
// a CUDA graph capture that allocator was told of is underway (begin_graph_pool) is released when
// the last such capture ends: the synchronization would invalidate the capture.
class ImportedMemory {
 public:
  ImportedMemory() noexcept;
  ~ImportedMemory();
  ImportedMemory(ImportedMemory&&) noexcept;
  ImportedMemory& operator=(ImportedMemory&&) noexcept;
  ImportedMemory(const ImportedMemory&) = delete;
  ImportedMemory& operator=(const ImportedMemory&) = delete;

  void* get() const noexcept;            // the allocation's start in this process; nullptr when empty
  std::size_t size() const noexcept;     // the allocation's size
  int device() const noexcept;           // the device it is mapped for (-1 when empty)
  IpcKind kind() const noexcept;
  explicit operator bool() const noexcept { return get() != nullptr; }
  // Releases now, once this device's queued work is done (see above), or at the end of a capture
  // underway (see above); empty after. The unmaps and releases are tried twice, cuIpcCloseMemHandle
  // once (opens of one handle share a reference count). If the allocator it came from was destroyed
  // while a capture it was told of ran, it is left mapped (leaked, no driver call): whether that
  // capture still runs can no longer be asked. Throws driver_error if the driver refuses: when it refuses
  // the synchronization, nothing is unmapped (work still queued would fault) and the memory stays
  // open, to close again later; other failures are reported after the rest is released. The
  // destructor ignores errors, and leaves the mappings in place when the synchronization fails.
  void close();

 private:
  struct State;
  friend struct detail::IpcAccess;
  friend struct detail::ImportRegistry;  // abandons the states left to it when its allocator goes mid-capture
  std::unique_ptr<State> s_;
};

// Imports `handle` on `device` of the config's device kind, through a driver of its own (no
// Allocator needed). The simulated device imports in-process only, through the exporting allocator
// (Allocator::import_ipc). Throws ipc_error (bad handle, descriptors missing) or driver_error.
ImportedMemory import_ipc(const IpcMemHandle& handle, int device = 0, const Config& config = Config::from_env());

// --- passing file descriptors ---------------------------------------------------------------------

// Sends `bytes` and `fds` as one message over a connected Unix stream socket; the descriptors go as
// SCM_RIGHTS (in batches, any number of them). The caller keeps its own descriptors (the receiver
// gets duplicates). A non-blocking socket is waited on (poll) as a blocking one would wait. Throws
// ipc_error on a system call failure.
void send_fds(int socket, std::span<const std::uint8_t> bytes, std::span<const int> fds);
// Receives one message of send_fds: returns its bytes and appends its descriptors (close-on-exec,
// owned) to `fds`, waiting for them on a non-blocking socket too. Throws ipc_error when the socket
// closes early or the message is malformed.
std::vector<std::uint8_t> recv_fds(int socket, std::vector<OwnedFd>& fds);

// send_fds(handle.serialize(), handle.fds()) / recv_fds + deserialize + adopt_fds.
void send_ipc_handle(int socket, const IpcMemHandle& handle);
IpcMemHandle recv_ipc_handle(int socket);

// Duplicates descriptors `remote_fds` of process `pid` into this process with pidfd_open +
// pidfd_getfd (Linux >= 5.6; needs ptrace access to `pid`). Throws ipc_error naming the restriction
// (EPERM: Yama ptrace_scope, another user, a container's seccomp profile; ENOSYS: kernel too old or
// the call filtered) and the fallback (SCM_RIGHTS over a Unix socket: send_ipc_handle/recv_ipc_handle).
std::vector<OwnedFd> pidfd_get_fds(std::int64_t pid, std::span<const int> remote_fds);
// Lets process `pid` (any process: -1) take descriptors of this one with pidfd_getfd under Yama
// ptrace_scope 1 (prctl(PR_SET_PTRACER)). Does nothing where Yama is absent. Throws ipc_error.
void allow_fd_fetch_by(std::int64_t pid);

}  // namespace expseg

#pragma GCC visibility pop
