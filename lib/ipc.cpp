// IPC: exporting live allocations (Allocator::export_ipc), importing them (ImportedMemory), the
// handle's wire format, and passing file descriptors (SCM_RIGHTS, pidfd_getfd). See expseg/ipc.hpp.
#include <pthread.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <limits>
#include <type_traits>
#include <utility>

#include "allocator_impl.hpp"
#include "core/try_twice.hpp"
#include "ipc_internal.hpp"

// pidfd_open (Linux 5.3) and pidfd_getfd (5.6) have the same numbers on every architecture that
// uses the generic syscall table, x86-64 included; older headers may not name them.
#if !defined(SYS_pidfd_open) && (defined(__x86_64__) || defined(__aarch64__))
#define SYS_pidfd_open 434
#endif
#if !defined(SYS_pidfd_getfd) && (defined(__x86_64__) || defined(__aarch64__))
#define SYS_pidfd_getfd 438
#endif

namespace expseg {

static_assert(std::endian::native == std::endian::little, "the IPC wire format assumes a little-endian host");

namespace {

std::string hex(std::uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string errno_text(int err) { return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")"; }

[[noreturn]] void sys_fail(const std::string& what, int err) { throw ipc_error("expseg: " + what + ": " + errno_text(err), err); }

constexpr char kMagic[8] = {'E', 'X', 'P', 'S', 'G', 'I', 'P', 'C'};
// 2: the exporter's nonce after its pid; 3: then its PID namespace.
constexpr std::uint32_t kVersion = 4;  // 4: each piece carries its descriptor's file identity

// --- which process exported a handle ------------------------------------------------------------------
// A pid does not say: processes in different PID namespaces (containers) may have the same one. A
// random 64-bit number made once per process does; a fork child makes its own (pthread_atfork),
// since it is another process with a copy of this one's memory.
std::atomic<std::uint64_t> g_process_nonce{0};

std::uint64_t fresh_nonce() noexcept {  // async-signal-safe: also runs in a fork child
  std::uint64_t v = 0;
  if (::getrandom(&v, sizeof v, GRND_NONBLOCK) != static_cast<ssize_t>(sizeof v)) {
    // No entropy yet (early boot) or no getrandom: the clock and the pid, mixed (splitmix64).
    v = static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
        (static_cast<std::uint64_t>(::getpid()) << 32) ^ reinterpret_cast<std::uintptr_t>(&v);
    v += 0x9e3779b97f4a7c15ull;
    v = (v ^ (v >> 30)) * 0xbf58476d1ce4e5b9ull;
    v = (v ^ (v >> 27)) * 0x94d049bb133111ebull;
    v ^= v >> 31;
  }
  return v != 0 ? v : 1;  // 0 means "unknown exporter"
}

void renew_nonce_in_child() noexcept { g_process_nonce.store(fresh_nonce(), std::memory_order_relaxed); }

std::uint64_t process_nonce() noexcept {
  static const bool ready = [] {
    g_process_nonce.store(fresh_nonce(), std::memory_order_relaxed);
    ::pthread_atfork(nullptr, nullptr, renew_nonce_in_child);
    return true;
  }();
  (void)ready;
  return g_process_nonce.load(std::memory_order_relaxed);
}

// --- which PID namespace numbers the exporter's pid ---------------------------------------------------
// The inode of /proc/self/ns/pid names this process's PID namespace (what `lsns` shows). Read at
// each export and import, not once: a process never changes its own PID namespace, but a child
// forked after unshare(CLONE_NEWPID) lives in a new one with its parent's memory, and a cached value
// would name the parent's (its pid 1 then passed the namespace check of an importer in the parent's
// namespace). 0 when /proc is not mounted or hides it: then nothing can be told and the pid is trusted.
std::uint64_t pid_namespace() noexcept {
  struct stat st {};
  return ::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<std::uint64_t>(st.st_ino) : std::uint64_t{0};
}

class Writer {
 public:
  template <class T>
  void put(const T& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto* p = reinterpret_cast<const std::uint8_t*>(&v);
    out_.insert(out_.end(), p, p + sizeof v);
  }
  void bytes(const void* p, std::size_t n) {
    const auto* b = static_cast<const std::uint8_t*>(p);
    out_.insert(out_.end(), b, b + n);
  }
  void str(const std::string& s) {
    put(static_cast<std::uint32_t>(s.size()));
    bytes(s.data(), s.size());
  }
  std::vector<std::uint8_t> take() { return std::move(out_); }

 private:
  std::vector<std::uint8_t> out_;
};

class Reader {
 public:
  explicit Reader(std::span<const std::uint8_t> in) : in_(in) {}
  template <class T>
  T get(const char* field) {
    static_assert(std::is_trivially_copyable_v<T>);
    T v{};
    std::memcpy(&v, take(sizeof v, field), sizeof v);
    return v;
  }
  const std::uint8_t* take(std::size_t n, const char* field) {
    if (n > in_.size() - pos_) bad(std::string("truncated at ") + field);
    const std::uint8_t* p = in_.data() + pos_;
    pos_ += n;
    return p;
  }
  std::string str(const char* field) {
    const auto n = get<std::uint32_t>(field);
    const auto* p = take(n, field);
    return std::string(reinterpret_cast<const char*>(p), n);
  }
  std::size_t left() const noexcept { return in_.size() - pos_; }
  [[noreturn]] static void bad(const std::string& why) {
    throw ipc_error("expseg: malformed IPC handle bytes (" + why + "); they must be exactly what IpcMemHandle::serialize() wrote");
  }

 private:
  std::span<const std::uint8_t> in_;
  std::size_t pos_ = 0;
};

// Consistency of a handle, whether deserialized or built by hand.
void check_handle(const IpcMemHandle& h, const char* who) {
  auto bad = [&](const std::string& why) { throw ipc_error(std::string("expseg: ") + who + ": invalid IPC handle: " + why); };
  if (h.pieces.empty()) bad("no pieces");
  if (h.kind == IpcKind::cuda_ipc && h.pieces.size() != 1) bad("a cuda_ipc handle has exactly one piece");
  std::size_t sum = 0;
  for (const IpcPiece& p : h.pieces) {
    if (p.bytes == 0 || p.bytes > std::numeric_limits<std::size_t>::max() - sum) bad("a piece has a bad size");
    sum += p.bytes;
  }
  if (sum != h.range_bytes) bad("the pieces' sizes do not add up to range_bytes");
  if (h.offset > h.range_bytes || h.size > h.range_bytes - h.offset) bad("the allocation does not lie inside the exported range");
  if (h.device_kind != "cuda" && h.device_kind != "sim") bad("unknown device kind '" + h.device_kind + "'");
}

std::string pidfd_fallback() {
  return "Fallback: pass the descriptors over a Unix socket with SCM_RIGHTS (expseg::send_ipc_handle / "
         "expseg::recv_ipc_handle, or send_fds / recv_fds), or export with ipc_handle:fabric, whose handles need no "
         "descriptor (where the platform allows fabric handles).";
}

std::string yama_scope() {
  std::ifstream f("/proc/sys/kernel/yama/ptrace_scope");
  std::string v;
  if (f >> v) return v;
  return {};
}

[[noreturn]] void pidfd_fail(const char* call, std::int64_t pid, int target_fd, int err) {
  std::string why;
  switch (err) {
    case ENOSYS:
      why = std::string(call) + " is not available: the kernel is older than Linux 5.6 (pidfd_open needs 5.3, "
            "pidfd_getfd 5.6), or a seccomp filter hides the call";
      break;
    case EPERM: {
      const std::string scope = yama_scope();
      why = "the kernel denied this process ptrace access to process " + std::to_string(pid) +
            " (pidfd_getfd needs PTRACE_MODE_ATTACH_REALCREDS): ";
      if (!scope.empty() && scope != "0")
        why += "Yama ptrace_scope is " + scope +
               (scope == "1" ? " (only ancestors may attach, unless the exporter calls expseg::allow_fd_fetch_by(<importer pid>))"
                             : " (2: only with CAP_SYS_PTRACE; 3: never)") +
               "; ";
      why += "or the processes run as different users, or a container's seccomp profile refuses pidfd_getfd without "
             "CAP_SYS_PTRACE (Docker's default does)";
      break;
    }
    case ESRCH: why = "there is no process " + std::to_string(pid) + " (has the exporter exited?)"; break;
    case EBADF:
      why = "process " + std::to_string(pid) + " has no open descriptor " + std::to_string(target_fd) +
            " (did the exporter destroy its IpcMemHandle before the importer took the descriptors?)";
      break;
    case EMFILE: why = "this process is at its open-file limit (RLIMIT_NOFILE)"; break;
    default: why = "unexpected failure"; break;
  }
  throw ipc_error("expseg: " + std::string(call) + "(pid " + std::to_string(pid) + (target_fd >= 0 ? ", fd " + std::to_string(target_fd) : std::string()) +
                      ") failed: " + errno_text(err) + ": " + why + ". " + pidfd_fallback(),
                  err);
}

// --- SCM_RIGHTS framing ---------------------------------------------------------------------------
// A message of send_fds: header {magic, nfds, nbytes}, carrying the first batch of descriptors; one
// byte per further batch (SCM_RIGHTS takes at most 253 descriptors a message); then the bytes.
constexpr std::uint32_t kFdMagic = 0x44465845;  // "EXFD"
constexpr std::size_t kFdBatch = 250;
constexpr std::uint64_t kMaxMessageBytes = std::uint64_t{1} << 30;
constexpr std::uint32_t kMaxFds = 1u << 20;

struct FdHeader {
  std::uint32_t magic;
  std::uint32_t nfds;
  std::uint64_t nbytes;
};
static_assert(sizeof(FdHeader) == 16);

// A non-blocking socket (O_NONBLOCK: an event loop's, one whose owner set a timeout) says EAGAIN
// where a blocking one waits: wait as the blocking one would (was: the message failed midway,
// and the stream could carry no other). Returns false when the call must fail with errno as it is.
bool wait_ready(int socket, short events) {
  if (errno != EAGAIN && errno != EWOULDBLOCK) return false;
  pollfd p{socket, events, 0};
  int r;
  do {
    r = ::poll(&p, 1, -1);
  } while (r < 0 && errno == EINTR);
  return r >= 0;  // ready, or an error or hang-up the next call reports
}

void send_with_fds(int socket, const void* data, std::size_t len, std::span<const int> fds) {
  const auto* p = static_cast<const char*>(data);
  std::size_t sent = 0;
  if (!fds.empty()) {
    std::vector<char> control(CMSG_SPACE(fds.size() * sizeof(int)), 0);
    iovec iov{const_cast<char*>(p), len};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(fds.size() * sizeof(int));
    std::memcpy(CMSG_DATA(c), fds.data(), fds.size() * sizeof(int));
    ssize_t r;
    do {
      r = ::sendmsg(socket, &msg, MSG_NOSIGNAL);
    } while (r < 0 && (errno == EINTR || wait_ready(socket, POLLOUT)));
    if (r < 0)
      sys_fail("send_fds: sendmsg with " + std::to_string(fds.size()) + " descriptors (SCM_RIGHTS) on socket " +
                   std::to_string(socket) + " (a connected Unix stream socket is needed)",
               errno);
    sent = static_cast<std::size_t>(r);
  }
  while (sent < len) {
    const ssize_t r = ::send(socket, p + sent, len - sent, MSG_NOSIGNAL);
    if (r < 0) {
      if (errno == EINTR || wait_ready(socket, POLLOUT)) continue;
      sys_fail("send_fds: send on socket " + std::to_string(socket), errno);
    }
    sent += static_cast<std::size_t>(r);
  }
}

void recv_collecting(int socket, void* data, std::size_t len, std::vector<OwnedFd>& fds) {
  auto* p = static_cast<char*>(data);
  std::size_t got = 0;
  alignas(cmsghdr) char control[CMSG_SPACE(256 * sizeof(int))];
  while (got < len) {
    iovec iov{p + got, len - got};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    const ssize_t r = ::recvmsg(socket, &msg, MSG_CMSG_CLOEXEC);
    if (r < 0) {
      if (errno == EINTR || wait_ready(socket, POLLIN)) continue;
      sys_fail("recv_fds: recvmsg on socket " + std::to_string(socket), errno);
    }
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      const std::size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (std::size_t i = 0; i < n; ++i) {
        int fd = -1;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
        fds.emplace_back(fd);
      }
    }
    if (msg.msg_flags & MSG_CTRUNC)
      throw ipc_error("expseg: recv_fds: descriptors were dropped (MSG_CTRUNC): this process is at its open-file "
                      "limit (RLIMIT_NOFILE), or the sender attached more than one batch to a byte");
    if (r == 0)
      throw ipc_error("expseg: recv_fds: the peer closed socket " + std::to_string(socket) + " after " +
                      std::to_string(got) + " of " + std::to_string(len) + " bytes of a message");
    got += static_cast<std::size_t>(r);
  }
}

}  // namespace

// --- small types ------------------------------------------------------------------------------------

void OwnedFd::reset(int fd) noexcept {
  if (fd_ >= 0 && fd_ != fd) ::close(fd_);
  fd_ = fd;
}

const char* to_string(IpcKind k) noexcept {
  switch (k) {
    case IpcKind::cuda_ipc: return "cuda_ipc";
    case IpcKind::posix_fd: return "posix_fd";
    case IpcKind::fabric: return "fabric";
  }
  return "unknown";
}

bool IpcMemHandle::has_fds() const noexcept {
  if (!needs_fds()) return true;
  return std::all_of(pieces.begin(), pieces.end(), [](const IpcPiece& p) { return static_cast<bool>(p.fd); });
}

std::vector<int> IpcMemHandle::fds() const {
  std::vector<int> out;
  if (!needs_fds()) return out;
  out.reserve(pieces.size());
  for (const IpcPiece& p : pieces) {
    if (!p.fd) throw ipc_error("expseg: IpcMemHandle::fds: piece " + std::to_string(out.size()) + " has no descriptor in this process");
    out.push_back(p.fd.get());
  }
  return out;
}

std::vector<std::uint8_t> IpcMemHandle::serialize() const {
  Writer w;
  w.bytes(kMagic, sizeof kMagic);
  w.put(kVersion);
  w.put(static_cast<std::uint8_t>(kind));
  w.str(device_kind);
  w.put(static_cast<std::int32_t>(device));
  w.put(exporter_pid);
  w.put(exporter_nonce);
  w.put(exporter_pid_namespace);
  w.put(static_cast<std::uint64_t>(offset));
  w.put(static_cast<std::uint64_t>(size));
  w.put(static_cast<std::uint64_t>(range_bytes));
  w.put(static_cast<std::uint32_t>(pieces.size()));
  for (const IpcPiece& p : pieces) {
    w.put(static_cast<std::uint64_t>(p.bytes));
    w.bytes(p.handle.data(), p.handle.size());
    // The descriptor's number in the exporter, whose pid travels with it (pidfd_getfd takes it from
    // there): a handle received and passed on names the exporter's descriptor, not the one it got.
    w.put(static_cast<std::int32_t>(p.remote_fd >= 0 ? p.remote_fd : p.fd ? p.fd.get() : -1));
    w.put(p.file_dev);  // the exporter's file (export_ipc), which a handle passed on keeps
    w.put(p.file_ino);
  }
  w.str(fallback_reason);
  return w.take();
}

IpcMemHandle IpcMemHandle::deserialize(std::span<const std::uint8_t> bytes) {
  Reader r(bytes);
  if (std::memcmp(r.take(sizeof kMagic, "magic"), kMagic, sizeof kMagic) != 0) Reader::bad("not an expseg IPC handle: wrong magic");
  const auto version = r.get<std::uint32_t>("version");
  if (version != kVersion)
    Reader::bad("format version " + std::to_string(version) + ", this expseg reads version " + std::to_string(kVersion) +
                ": the exporting and the importing process must use the same expseg version");
  IpcMemHandle h;
  const auto kind = r.get<std::uint8_t>("kind");
  if (kind > static_cast<std::uint8_t>(IpcKind::fabric)) Reader::bad("unknown kind " + std::to_string(kind));
  h.kind = static_cast<IpcKind>(kind);
  h.device_kind = r.str("device kind");
  h.device = r.get<std::int32_t>("device");
  h.exporter_pid = r.get<std::int64_t>("pid");
  h.exporter_nonce = r.get<std::uint64_t>("exporter nonce");
  h.exporter_pid_namespace = r.get<std::uint64_t>("exporter PID namespace");
  h.offset = r.get<std::uint64_t>("offset");
  h.size = static_cast<std::size_t>(r.get<std::uint64_t>("size"));
  h.range_bytes = static_cast<std::size_t>(r.get<std::uint64_t>("range"));
  const auto n = r.get<std::uint32_t>("piece count");
  constexpr std::size_t kPieceBytes = 8 + 64 + 4 + 16;
  if (n > r.left() / kPieceBytes) Reader::bad("piece count " + std::to_string(n) + " larger than the bytes hold");
  h.pieces.resize(n);
  for (IpcPiece& p : h.pieces) {
    p.bytes = static_cast<std::size_t>(r.get<std::uint64_t>("piece size"));
    std::memcpy(p.handle.data(), r.take(p.handle.size(), "piece handle"), p.handle.size());
    p.remote_fd = r.get<std::int32_t>("piece descriptor");
    p.file_dev = r.get<std::uint64_t>("piece file device");
    p.file_ino = r.get<std::uint64_t>("piece file inode");
  }
  h.fallback_reason = r.str("fallback reason");
  if (r.left() != 0) Reader::bad(std::to_string(r.left()) + " trailing bytes");
  try {
    check_handle(h, "IpcMemHandle::deserialize");
  } catch (const ipc_error& e) {
    Reader::bad(e.what());
  }
  return h;
}

void IpcMemHandle::adopt_fds(std::vector<OwnedFd> received) {
  const std::size_t want = needs_fds() ? pieces.size() : 0;
  if (received.size() != want)
    throw ipc_error("expseg: IpcMemHandle::adopt_fds: " + std::to_string(received.size()) + " descriptors for a " +
                    to_string(kind) + " handle that needs " + std::to_string(want));
  std::vector<int> numbers;
  numbers.reserve(want);
  for (const OwnedFd& fd : received) numbers.push_back(fd.get());
  check_fd_files(numbers);  // all checked before any is taken: a refusal changes nothing
  for (std::size_t i = 0; i < want; ++i) pieces[i].fd = std::move(received[i]);
}

void IpcMemHandle::check_fd_files(std::span<const int> fds) const {
  for (std::size_t i = 0; i < fds.size() && i < pieces.size(); ++i) {
    const IpcPiece& p = pieces[i];
    if (p.file_dev == 0 && p.file_ino == 0) continue;  // not known (a handle built by hand, a placeholder descriptor)
    struct stat st {};
    if (::fstat(fds[i], &st) != 0) sys_fail("IpcMemHandle: fstat of descriptor " + std::to_string(fds[i]), errno);
    if (static_cast<std::uint64_t>(st.st_dev) != p.file_dev || static_cast<std::uint64_t>(st.st_ino) != p.file_ino)
      throw ipc_error("expseg: IpcMemHandle: descriptor " + std::to_string(fds[i]) + " for piece " + std::to_string(i) +
                      " names another file than the exporter's descriptor " +
                      (p.remote_fd >= 0 ? std::to_string(p.remote_fd) + " " : std::string()) +
                      "did: a descriptor of another handle, or one taken with pidfd_getfd after the exporter destroyed "
                      "its IpcMemHandle (its descriptor's number then names whatever the exporter opened next). The "
                      "exporter must keep the handle until the importer has its descriptors");
  }
}

void IpcMemHandle::fetch_fds_from_exporter() {
  if (!needs_fds()) return;
  const std::uint64_t here = pid_namespace();
  if (exporter_pid_namespace != 0 && here != 0 && exporter_pid_namespace != here)
    throw ipc_error("expseg: fetch_fds_from_exporter: the exporter (pid " + std::to_string(exporter_pid) +
                    " in its PID namespace " + std::to_string(exporter_pid_namespace) +
                    ") runs in another PID namespace than this process (" + std::to_string(here) +
                    "), e.g. another container: that pid names another process here, or none, so its descriptors "
                    "cannot be taken with pidfd_getfd. " + pidfd_fallback());
  std::vector<int> remote;
  remote.reserve(pieces.size());
  for (const IpcPiece& p : pieces) {
    if (p.remote_fd < 0) throw ipc_error("expseg: fetch_fds_from_exporter: the handle does not name the exporter's descriptors");
    remote.push_back(p.remote_fd);
  }
  adopt_fds(pidfd_get_fds(exporter_pid, remote));
}

// --- ImportedMemory -----------------------------------------------------------------------------------

struct ImportedMemory::State {
  std::shared_ptr<driver::Driver> drv;
  IpcKind kind = IpcKind::cuda_ipc;
  int device = -1;
  driver::dev_ptr base = 0;          // cuda_ipc: what cuIpcOpenMemHandle returned; else the reservation
  bool opened = false;               // cuda_ipc: base needs cuIpcCloseMemHandle
  std::size_t reserved = 0;          // bytes reserved at base (0: none)
  std::vector<std::size_t> mapped;   // sizes of the mappings made, back to back from base
  std::vector<driver::phys_handle> handles;  // imported, not yet released
  std::uint64_t offset = 0;
  std::size_t size = 0;
  std::shared_ptr<detail::ImportRegistry> registry;  // Allocator::import_ipc: its captures' deferrals
  // `base` is in registry->ranges (posix_fd and fabric imports, which map here). A cuda_ipc import's
  // base is the driver's and never registered: once cuIpcCloseMemHandle returns, another import may
  // be reserved at that address and register it, and that entry is not this import's to erase.
  bool registered = false;
  bool handed_out = false;  // the caller got it: work it queued may use the mappings

  // Undoes everything, in reverse order; remembers the first failure and goes on, except that the
  // mappings stay (and the state says so: a later release tries again) when the synchronization
  // before the unmap fails: unmapped, memory that queued work still uses makes it fault.
  // Each call on the import's own resources is tried once more before it counts as failed, as the
  // backends' destructors do: a transient failure then leaks nothing.
  void release(std::exception_ptr& first) noexcept {
    auto attempt = [&](auto&& f, int tries = 2) { return core::try_twice(f, &first, tries); };
    // A failed close leaves the import open (the state says so): a later close() tries again, where
    // dropping it lost the only way to unmap it. Tried once: opens of one handle share the mapping
    // with a reference count, so a close that took effect and still reported an error (an earlier
    // asynchronous one) would, tried again, drop another import's reference.
    if (opened && !attempt([&] { drv->ipc_close(base); }, 1)) return;
    opened = false;
    // cuIpcCloseMemHandle waits for the work queued on the memory (measured on the H200); cuMemUnmap
    // does not, and that work then faults (CUDA_ERROR_ILLEGAL_ADDRESS, the context lost): wait for
    // this device's work first, as PyTorch does before unmapping an imported expandable segment.
    // An import that failed midway was never handed out: no work can use it, and no synchronization
    // (which a capture underway would refuse, invalidating it) comes first.
    if (!mapped.empty() && handed_out && !attempt([&] { drv->device_synchronize(); })) return;
    if (registered) {
      // Before the unmap: a peer granted from now on must not set access over a range being unmapped.
      std::lock_guard<std::mutex> lock(registry->mu);
      registry->ranges.erase(base);
      registered = false;
    }
    registry.reset();
    std::uint64_t at = base;
    for (std::size_t bytes : mapped) {
      attempt([&] { drv->unmap(at, bytes); });
      at += bytes;
    }
    mapped.clear();
    for (driver::phys_handle h : handles) attempt([&] { drv->release(h); });
    handles.clear();
    if (reserved != 0) attempt([&] { drv->free_reserve(base, reserved); });
    reserved = 0;
  }
  // Forgets what the import holds in the driver, with no driver call (ImportRegistry::
  // abandon_deferred): the release then only takes its range off the registry.
  void abandon() noexcept {
    opened = false;
    mapped.clear();
    handles.clear();
    reserved = 0;
  }
  // Hands `s` to its allocator's registry when a capture it knows of is underway (the release
  // waits for the capture's end); true if it did.
  static bool defer(std::unique_ptr<State>& s) noexcept {
    if (!s || !s->registry) return false;
    const std::shared_ptr<detail::ImportRegistry> registry = s->registry;
    {
      std::lock_guard<std::mutex> lock(registry->mu);
      if (!registry->abandoned) {
        if (!registry->capturing) return false;
        try {
          registry->deferred.reserve(registry->deferred.size() + 1);
        } catch (...) {
          return false;  // no memory to keep it: released now
        }
        registry->deferred.emplace_back(s.release(), [](void* p) { delete static_cast<State*>(p); });
        return true;
      }
    }
    // Its allocator went while a told capture ran, which no one can ask about now: left mapped, as
    // the imports deferred then (ImportRegistry::abandon_deferred). Its state goes (it takes mu).
    s->abandon();
    s.reset();
    return true;
  }
  ~State() {
    std::exception_ptr ignored;
    release(ignored);
    if (opened) {  // its close failed and nothing will retry it now: the rest is undone all the same
      opened = false;
      release(ignored);
    }
    // A synchronization that failed leaves the mappings: kept (leaked) rather than unmapped under
    // work that may still use them.
  }
};

void detail::ImportRegistry::set_capturing(bool now) noexcept {
  std::vector<std::unique_ptr<void, void (*)(void*)>> ready;
  {
    std::lock_guard<std::mutex> lock(mu);
    capturing = now;
    if (!now) ready.swap(deferred);
  }
  ready.clear();  // each State releases (it takes mu itself)
}

void detail::ImportRegistry::abandon_deferred() noexcept {
  std::vector<std::unique_ptr<void, void (*)(void*)>> left;
  {
    std::lock_guard<std::mutex> lock(mu);
    capturing = false;
    abandoned = true;
    left.swap(deferred);
  }
  // Their memory stays mapped (leaked in the driver, no call made); the states go, and with them
  // their hold on the driver and on this registry (each State takes mu itself).
  for (auto& state : left) static_cast<ImportedMemory::State*>(state.get())->abandon();
  left.clear();
}

ImportedMemory::ImportedMemory() noexcept = default;
ImportedMemory::~ImportedMemory() { State::defer(s_); }
ImportedMemory::ImportedMemory(ImportedMemory&&) noexcept = default;
ImportedMemory& ImportedMemory::operator=(ImportedMemory&& other) noexcept {
  if (this != &other) {
    State::defer(s_);
    s_ = std::move(other.s_);
  }
  return *this;
}

void* ImportedMemory::get() const noexcept {
  return s_ ? reinterpret_cast<void*>(static_cast<std::uintptr_t>(s_->base + s_->offset)) : nullptr;
}
std::size_t ImportedMemory::size() const noexcept { return s_ ? s_->size : 0; }
int ImportedMemory::device() const noexcept { return s_ ? s_->device : -1; }
IpcKind ImportedMemory::kind() const noexcept { return s_ ? s_->kind : IpcKind::cuda_ipc; }

void ImportedMemory::close() {
  if (!s_ || State::defer(s_)) return;
  std::unique_ptr<State> s = std::move(s_);
  std::exception_ptr first;
  s->release(first);
  if (!s->mapped.empty() || s->opened) s_ = std::move(s);  // a synchronization or close failed: still open, close() again later
  if (first) std::rethrow_exception(first);
}

bool detail::exported_here(const IpcMemHandle& handle) noexcept {
  return handle.exporter_nonce != 0 && handle.exporter_nonce == process_nonce();
}

void detail::ImportRegistry::grant_all(driver::Driver& driver) {
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& [base, bytes] : ranges) driver.set_access(base, bytes);
}

ImportedMemory detail::IpcAccess::import_with(std::shared_ptr<driver::Driver> drv, const IpcMemHandle& h,
                                              std::shared_ptr<ImportRegistry> registry) {
  check_handle(h, "import_ipc");
  if (h.device_kind != drv->kind())
    throw ipc_error("expseg: import_ipc: the handle was exported by a " + h.device_kind + " device; this is a " +
                    drv->kind() + " device");
  auto s = std::make_unique<ImportedMemory::State>();
  s->drv = drv;
  s->kind = h.kind;
  s->device = drv->device();
  s->offset = h.offset;
  s->size = h.size;
  if (h.kind == IpcKind::cuda_ipc) {
    if (h.device_kind == "cuda" && exported_here(h))
      throw ipc_error("expseg: import_ipc: a cuda_ipc handle (split_merge) cannot be opened in the process that "
                      "exported it (cuIpcOpenMemHandle refuses): use the allocation's own pointer there");
    driver::ExportedHandle ex;
    ex.bytes = h.pieces[0].handle;
    s->base = drv->ipc_open(ex);
    s->opened = true;
    // The handle's sizes are the exporter's word: a damaged or edited one that names more than the
    // allocation it opens would hand out memory past its end (on a GPU: faults, a lost context).
    const auto [alloc_base, alloc_bytes] = drv->address_range(s->base);
    if (alloc_base != s->base || h.range_bytes > alloc_bytes)
      throw ipc_error("expseg: import_ipc: the handle names a range of " + std::to_string(h.range_bytes) + " bytes, but the "
                      "allocation it opens holds " + std::to_string(alloc_bytes) + " bytes from " + hex(alloc_base) +
                      ": a damaged or edited handle (it must be exactly what IpcMemHandle::serialize() wrote)");
    s->registry = std::move(registry);  // for its captures only: nothing mapped here to grant peers
  } else {
    if (!h.has_fds())
      throw ipc_error("expseg: import_ipc: the posix_fd handle's file descriptors are not in this process: receive "
                      "them with expseg::recv_ipc_handle (SCM_RIGHTS over a Unix socket) or take them with "
                      "IpcMemHandle::fetch_fds_from_exporter (pidfd_getfd)");
    const std::size_t g = drv->granularity();
    if (g == 0)
      throw ipc_error("expseg: import_ipc: this device does not support CUDA virtual memory management, which maps the "
                      "exported physical handles (an expandable allocator's export); a split_merge export (cuda_ipc) can be imported");
    for (const IpcPiece& p : h.pieces)
      if (p.bytes % g != 0)
        throw ipc_error("expseg: import_ipc: an exported physical handle of " + std::to_string(p.bytes) +
                        " bytes is not a multiple of this device's granularity " + std::to_string(g) +
                        " (exported from another kind of device?)");
    s->base = drv->reserve(h.range_bytes);
    s->reserved = h.range_bytes;
    s->handles.reserve(h.pieces.size());
    s->mapped.reserve(h.pieces.size());
    const driver::ShareableHandle type =
        h.kind == IpcKind::posix_fd ? driver::ShareableHandle::posix_fd : driver::ShareableHandle::fabric;
    std::uint64_t at = s->base;
    for (const IpcPiece& p : h.pieces) {
      driver::ExportedHandle ex;
      ex.type = type;
      ex.fd = p.fd.get();
      ex.bytes = p.handle;
      s->handles.push_back(drv->import_handle(ex));  // capacity reserved: only the import can throw
      drv->map(at, p.bytes, s->handles.back());
      s->mapped.push_back(p.bytes);
      at += p.bytes;
    }
    // This device and every peer the driver grants (Allocator::enable_peer_access) may use it;
    // a peer enabled later is granted through the registry.
    drv->set_access(s->base, h.range_bytes);
    if (registry) {
      std::lock_guard<std::mutex> lock(registry->mu);
      registry->ranges.emplace(s->base, h.range_bytes);  // may throw: s releases without the registry
      s->registry = std::move(registry);
      s->registered = true;
    }
  }
  ImportedMemory m;
  s->handed_out = true;
  m.s_ = std::move(s);
  return m;
}

ImportedMemory import_ipc(const IpcMemHandle& handle, int device, const Config& config) {
  if (handle.device_kind == "sim" && config.device == DeviceKind::sim)
    throw ipc_error("expseg: import_ipc: the simulated device imports in-process only, through the exporting "
                    "allocator (Allocator::import_ipc)");
  Config c = config;
  c.ipc_handle = IpcHandle::none;  // importing needs no shareable type (and CUDA then skips probing one)
  std::shared_ptr<driver::Driver> drv = make_driver(c, device);
  return detail::IpcAccess::import_with(std::move(drv), handle);
}

// --- Allocator ------------------------------------------------------------------------------------------

IpcMemHandle Allocator::export_ipc(void* ptr) {
  const auto addr = static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(ptr));
  std::lock_guard<core::Mutex> lock(impl_->mu);
  core::Block* b = impl_->live.find(addr);
  if (b == nullptr) impl_->throw_invalid_pointer("export_ipc", addr);
  driver::Driver& d = *impl_->driver;
  IpcMemHandle h;
  h.device_kind = d.kind();
  h.device = d.device();
  h.exporter_pid = ::getpid();
  h.exporter_nonce = process_nonce();
  h.exporter_pid_namespace = pid_namespace();
  h.size = b->requested;
  const backends::ExportPlan plan = impl_->backend->export_plan(*b);
  h.offset = addr - plan.base;
  h.range_bytes = plan.bytes;
  if (plan.kind == backends::ExportPlan::Kind::driver_allocation) {
    h.kind = IpcKind::cuda_ipc;
    IpcPiece piece;
    piece.bytes = plan.bytes;
    piece.handle = d.ipc_export(plan.base).bytes;
    h.pieces.push_back(std::move(piece));
    return h;
  }
  const driver::ShareableHandle type = d.shareable_handle_type();
  if (type == driver::ShareableHandle::none) {
    std::string msg = "expseg: export_ipc of " + hex(addr) + ": this expandable allocator creates physical memory "
                      "without a shareable handle type (ipc_handle:" + to_string(impl_->config.ipc_handle) +
                      "), so it cannot be exported. Create the allocator with ipc_handle:posix_fd (e.g. "
                      "EXPSEG_ALLOC_CONF=backend:expandable,ipc_handle:posix_fd), or ipc_handle:fabric where the "
                      "platform allows fabric handles";
    if (const std::string why = d.shareable_fallback_reason(); !why.empty()) msg += " (the type asked for fell back: " + why + ")";
    throw ipc_error(msg);
  }
  h.kind = type == driver::ShareableHandle::posix_fd ? IpcKind::posix_fd : IpcKind::fabric;
  h.fallback_reason = d.shareable_fallback_reason();
  h.pieces.reserve(plan.pieces.size());
  for (const backends::ExportPlan::Piece& p : plan.pieces) {
    const driver::ExportedHandle ex = d.export_handle(p.handle);
    IpcPiece piece;
    piece.fd.reset(ex.fd);  // owned from here on: closed if a later piece fails
    piece.remote_fd = ex.fd;
    if (struct stat st {}; ::fstat(ex.fd, &st) == 0) {  // not for the simulator's numbers that name no file
      piece.file_dev = static_cast<std::uint64_t>(st.st_dev);
      piece.file_ino = static_cast<std::uint64_t>(st.st_ino);
    }
    piece.bytes = p.bytes;
    piece.handle = ex.bytes;
    h.pieces.push_back(std::move(piece));  // capacity reserved: cannot throw
  }
  return h;
}

ImportedMemory Allocator::import_ipc(const IpcMemHandle& handle) {
  // Under the lock: set_access reads the driver's access list, which enable_peer_access changes.
  std::lock_guard<core::Mutex> lock(impl_->mu);
  if (handle.kind == IpcKind::cuda_ipc) {
    // cuIpcOpenMemHandle'd memory is reached through contexts: the peers granted so far (by an
    // expandable allocator, through cuMemSetAccess alone) need context peer access for it, and so
    // do peers granted later. First, so that a refusal leaves nothing open.
    for (int peer : impl_->peers) impl_->enable_context_peer_for_imports(peer);
  }
  ImportedMemory m = detail::IpcAccess::import_with(impl_->driver, handle, impl_->imports);
  // Only once such memory is mapped: a failed import (a stale handle) must not cap an expandable
  // allocator at CUDA's 8 context peers from then on.
  if (handle.kind == IpcKind::cuda_ipc) impl_->context_imports = true;
  return m;
}

// --- passing descriptors ----------------------------------------------------------------------------------

void send_fds(int socket, std::span<const std::uint8_t> bytes, std::span<const int> fds) {
  if (fds.size() > kMaxFds) throw ipc_error("expseg: send_fds: " + std::to_string(fds.size()) + " descriptors is too many");
  if (bytes.size() > kMaxMessageBytes) throw ipc_error("expseg: send_fds: a message of " + std::to_string(bytes.size()) + " bytes is too large");
  const FdHeader header{kFdMagic, static_cast<std::uint32_t>(fds.size()), bytes.size()};
  const std::size_t first = std::min(fds.size(), kFdBatch);
  send_with_fds(socket, &header, sizeof header, fds.subspan(0, first));
  for (std::size_t i = first; i < fds.size(); i += kFdBatch) {
    const char marker = 0;
    send_with_fds(socket, &marker, 1, fds.subspan(i, std::min(kFdBatch, fds.size() - i)));
  }
  if (!bytes.empty()) send_with_fds(socket, bytes.data(), bytes.size(), {});
}

std::vector<std::uint8_t> recv_fds(int socket, std::vector<OwnedFd>& fds) {
  std::vector<OwnedFd> got;
  FdHeader header{};
  recv_collecting(socket, &header, sizeof header, got);
  if (header.magic != kFdMagic)
    throw ipc_error("expseg: recv_fds: the message on socket " + std::to_string(socket) + " was not sent by send_fds (magic " +
                    hex(header.magic) + ")");
  if (header.nfds > kMaxFds || header.nbytes > kMaxMessageBytes)
    throw ipc_error("expseg: recv_fds: implausible message header (" + std::to_string(header.nfds) + " descriptors, " +
                    std::to_string(header.nbytes) + " bytes)");
  const std::size_t batches = header.nfds == 0 ? 0 : (header.nfds + kFdBatch - 1) / kFdBatch;
  for (std::size_t i = 1; i < batches; ++i) {
    char marker = 0;
    recv_collecting(socket, &marker, 1, got);
  }
  // Grown as the bytes arrive, 1 MiB at a time: a header that claims a large message (up to
  // kMaxMessageBytes) costs no memory before the sender has sent it.
  constexpr std::size_t kChunk = std::size_t{1} << 20;
  std::vector<std::uint8_t> bytes;
  while (bytes.size() < header.nbytes) {
    const std::size_t at = bytes.size();
    const std::size_t n = std::min<std::size_t>(kChunk, static_cast<std::size_t>(header.nbytes) - at);
    bytes.resize(at + n);
    recv_collecting(socket, bytes.data() + at, n, got);
  }
  if (got.size() != header.nfds)
    throw ipc_error("expseg: recv_fds: received " + std::to_string(got.size()) + " descriptors, the sender sent " +
                    std::to_string(header.nfds));
  for (OwnedFd& fd : got) fds.push_back(std::move(fd));
  return bytes;
}

void send_ipc_handle(int socket, const IpcMemHandle& handle) {
  const std::vector<std::uint8_t> bytes = handle.serialize();
  const std::vector<int> fds = handle.fds();
  send_fds(socket, bytes, fds);
}

IpcMemHandle recv_ipc_handle(int socket) {
  std::vector<OwnedFd> fds;
  const std::vector<std::uint8_t> bytes = recv_fds(socket, fds);
  IpcMemHandle h = IpcMemHandle::deserialize(bytes);
  h.adopt_fds(std::move(fds));
  return h;
}

std::vector<OwnedFd> pidfd_get_fds(std::int64_t pid, std::span<const int> remote_fds) {
  std::vector<OwnedFd> out;
  if (remote_fds.empty()) return out;
  if (pid <= 0 || pid > std::numeric_limits<pid_t>::max())
    throw ipc_error("expseg: pidfd_get_fds: invalid process id " + std::to_string(pid));
#if defined(SYS_pidfd_open) && defined(SYS_pidfd_getfd)
  const long pidfd = ::syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0);
  if (pidfd < 0) pidfd_fail("pidfd_open", pid, -1, errno);
  OwnedFd owner(static_cast<int>(pidfd));
  out.reserve(remote_fds.size());
  for (int target : remote_fds) {
    const long fd = ::syscall(SYS_pidfd_getfd, static_cast<int>(pidfd), target, 0);  // the new fd is close-on-exec
    if (fd < 0) pidfd_fail("pidfd_getfd", pid, target, errno);
    out.emplace_back(static_cast<int>(fd));
  }
  return out;
#else
  pidfd_fail("pidfd_getfd", pid, -1, ENOSYS);
#endif
}

void allow_fd_fetch_by(std::int64_t pid) {
#if defined(PR_SET_PTRACER)
  const unsigned long who = pid == -1 ? static_cast<unsigned long>(PR_SET_PTRACER_ANY) : static_cast<unsigned long>(pid);
  if (pid != -1 && (pid <= 0 || pid > std::numeric_limits<pid_t>::max()))
    throw ipc_error("expseg: allow_fd_fetch_by: invalid process id " + std::to_string(pid));
  if (::prctl(PR_SET_PTRACER, who, 0, 0, 0) != 0) {
    const int err = errno;
    if (err == EINVAL && yama_scope().empty()) return;  // no Yama: nothing to allow
    sys_fail("allow_fd_fetch_by: prctl(PR_SET_PTRACER, " + std::to_string(pid) + ")", err);
  }
#else
  (void)pid;
#endif
}

}  // namespace expseg
