// The C API (include/expseg/expseg.h): one Allocator per device index behind extern "C" functions
// that never throw. Every entry point catches everything and turns it into a status code plus a
// thread-local message (see "Errors" in expseg.h).
//
// State: g_alloc[device] is created once under g_mu (double-checked, acquire/release) and never
// destroyed except by reset_for_tests(), so the malloc/free hot path is one atomic load plus the
// allocator's own lock. The configuration string and the per-thread string buffers live in
// objects that are never destroyed either, so calls that arrive during static destruction (PyTorch
// freeing tensors at exit) still find them.
#include "expseg/expseg.h"

#include <array>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

#include "allocator_impl.hpp"
#include "c_api_internal.hpp"
#include "expseg/allocator.hpp"
#include "expseg/config.hpp"
#include "expseg/errors.hpp"
#include "expseg/ipc.hpp"
#include "expseg/snapshot.hpp"
#include "expseg/stats.hpp"
#include "expseg/trace.hpp"
#include "ipc_internal.hpp"

namespace expseg::capi {
namespace {

constexpr int kMaxDevices = EXPSEG_MAX_DEVICES;

// Constant-initialized (all null) and trivially destructible: usable at any time of the process.
std::atomic<Allocator*> g_alloc[kMaxDevices];
// expseg_get_limit's answers for CUDA devices without an allocator: the device's memory, read once
// (0: not yet). A driver made for the query retains the primary context and releases it again, which
// creates and destroys the context when nothing else holds it: too slow to do on every query.
std::atomic<std::size_t> g_cuda_total[kMaxDevices];
std::atomic<bool> g_oom_stderr{true};

struct Shared {
  std::mutex mu;           // allocator creation, expseg_configure, reset_for_tests
  std::string conf;        // expseg_configure's string; guarded by mu
  // expseg_set_record_default: overrides record/record_ring of allocators created later; guarded by mu.
  std::optional<std::pair<bool, std::size_t>> record_default;
  // The configuration (EXPSEG_ALLOC_CONF, then conf) the first allocator was created with; every
  // later one gets it too, so that a variable set after the first use cannot give the devices of one
  // process different configurations (expseg_configure is refused by then; PyTorch reads its own
  // variable once). Guarded by mu.
  std::optional<Config> created_with;
};
Shared& shared() {
  static Shared* s = new Shared();  // never destroyed (see the file comment)
  return *s;
}

// expseg_set_oom_callback's function and argument; read on the OOM path only.
struct OomCallback {
  std::mutex mu;
  expseg_oom_callback fn = nullptr;
  void* user_data = nullptr;
};
OomCallback& oom_callback() {
  static OomCallback* c = new OomCallback();  // never destroyed (see the file comment)
  return *c;
}

// What expseg_ipc_import mapped, by (device, pointer), until expseg_ipc_close. A multimap: CUDA may
// hand out the same address for a handle opened twice.
struct Imports {
  std::mutex mu;
  std::multimap<std::pair<int, std::uintptr_t>, ImportedMemory> open;
};
Imports& imports() {
  static Imports* i = new Imports();  // never destroyed (see the file comment)
  return *i;
}

// Calls the OOM callback, if one is set, with the report as JSON. Never throws: the caller is on
// its way to report the OOM itself.
void notify_oom(int device, const OomReport& report) noexcept {
  expseg_oom_callback fn = nullptr;
  void* user_data = nullptr;
  {
    OomCallback& c = oom_callback();
    std::lock_guard<std::mutex> lock(c.mu);
    fn = c.fn;
    user_data = c.user_data;
  }
  // An OOM of an allocation the callback makes is not reported to it again: no recursion.
  thread_local bool in_callback = false;
  if (fn == nullptr || in_callback) return;
  in_callback = true;
  try {
    const std::string json = report.to_json();
    fn(device, json.c_str(), user_data);
  } catch (...) {
    // No memory for the JSON: the OOM is still reported through the status and the message.
  }
  in_callback = false;
}

// One buffer per string-returning function (see "Strings" in expseg.h).
enum Buffer : int {
  kConfigBuf, kStatsBuf, kSnapshotBuf, kOomTextBuf, kOomJsonBuf, kThreadOomTextBuf, kThreadOomJsonBuf, kLastErrorBuf, kIpcHandleBuf,
  kBufferCount
};

// Trivially destructible: still readable after the thread's thread_local objects are destroyed.
thread_local bool t_state_destroyed = false;

struct ThreadState {
  int code = EXPSEG_SUCCESS;
  std::string message;
  std::array<std::string, kBufferCount> buffers;
  std::vector<int> ipc_fds;  // expseg_ipc_export's descriptors
  // Per device, the report of this thread's last failed allocation (expseg_thread_oom_report): the
  // device's last report may be another thread's by the time this one reads it.
  std::array<std::shared_ptr<const OomReport>, kMaxDevices> ooms;
  ThreadState* next_late = nullptr;  // the list of states made for late calls
  ThreadState() = default;
  ThreadState(const ThreadState&) = delete;
  ThreadState& operator=(const ThreadState&) = delete;
  ~ThreadState() { t_state_destroyed = true; }
};
static_assert(std::is_nothrow_default_constructible_v<ThreadState>, "tls()'s fallback constructs one without host memory");
ThreadState& tls() noexcept {
  if (t_state_destroyed) [[unlikely]] {
    // Called after this thread's thread_local objects were destroyed: from a static destructor at
    // process exit (PyTorch freeing tensors) or another thread_local's destructor. The thread gets
    // a state of its own that is never destroyed (see the file comment): a pointer, trivially
    // destructible, stays usable through the thread's exit. Threads exiting together do not share
    // it (a shared one raced, and handed out strings another thread was rewriting). The cost is
    // one small state left behind per thread that calls in this late.
    thread_local ThreadState* late = nullptr;
    if (late == nullptr) {
      late = new (std::nothrow) ThreadState();
      if (late == nullptr) {
        // No host memory for it: the thread's own storage, which lasts as long as the thread (the
        // state's constructor allocates nothing; what its strings take later is not given back).
        alignas(ThreadState) thread_local unsigned char storage[sizeof(ThreadState)];
        late = ::new (static_cast<void*>(storage)) ThreadState();
        return *late;
      }
      // Kept reachable (leak checkers see a live list, not a lost block): a lock-free push.
      static std::atomic<ThreadState*> kept{nullptr};
      late->next_late = kept.load(std::memory_order_relaxed);
      while (!kept.compare_exchange_weak(late->next_late, late, std::memory_order_release, std::memory_order_relaxed)) {
      }
    }
    return *late;
  }
  thread_local ThreadState state;
  return state;
}

void set_error(int code, std::string_view fn, std::string_view message) noexcept {
  ThreadState& t = tls();
  t.code = code;
  try {
    t.message.assign(fn);
    t.message += ": ";
    t.message += message;
  } catch (...) {
    t.message.clear();  // no memory for the message: the code still tells what happened
  }
}

// A pointer passed with a device that has no allocator: it may well be expseg's, of another
// device, so the message says what that device's allocator would. `what`: "free", "export", ...
int no_allocator_for_pointer(const char* fn, const char* what, const void* ptr, int device) noexcept {
  char text[200];
  std::snprintf(text, sizeof text,
                "%s of pointer %p on device %d, which has no expseg allocator: a foreign pointer, or one from another "
                "device's allocator", what, ptr, device);
  set_error(EXPSEG_ERROR_INVALID_POINTER, fn, text);
  return EXPSEG_ERROR_INVALID_POINTER;
}

// Translates the exception being handled into a status code and the thread's error message.
int fail_current(const char* fn) noexcept {
  try {
    throw;
  } catch (const out_of_memory& e) {
    set_error(EXPSEG_ERROR_OUT_OF_MEMORY, fn, e.what());
    return EXPSEG_ERROR_OUT_OF_MEMORY;
  } catch (const config_error& e) {
    set_error(EXPSEG_ERROR_CONFIG, fn, e.what());
    return EXPSEG_ERROR_CONFIG;
  } catch (const invalid_pointer& e) {
    set_error(EXPSEG_ERROR_INVALID_POINTER, fn, e.what());
    return EXPSEG_ERROR_INVALID_POINTER;
  } catch (const ipc_error& e) {
    set_error(EXPSEG_ERROR_IPC, fn, e.what());
    return EXPSEG_ERROR_IPC;
  } catch (const driver_error& e) {
    const int code = e.is_out_of_memory() ? EXPSEG_ERROR_OUT_OF_MEMORY : EXPSEG_ERROR_DRIVER;
    set_error(code, fn, e.what());
    return code;
  } catch (const std::bad_alloc&) {
    set_error(EXPSEG_ERROR_OUT_OF_MEMORY, fn, "host memory exhausted (std::bad_alloc)");
    return EXPSEG_ERROR_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    set_error(EXPSEG_ERROR_INTERNAL, fn, e.what());
    return EXPSEG_ERROR_INTERNAL;
  } catch (...) {
    set_error(EXPSEG_ERROR_INTERNAL, fn, "unknown exception");
    return EXPSEG_ERROR_INTERNAL;
  }
}

// As fail_current, but an expseg::error that is the caller's misuse (a call refused now, nothing
// changed: a pool not begun, a stream in use, a capture underway) is EXPSEG_ERROR_INVALID_ARGUMENT
// with the reason; driver and configuration errors are reported as every other call reports them.
int fail_as_misuse(const char* fn) noexcept {
  try {
    throw;
  } catch (const driver_error&) {
    return fail_current(fn);
  } catch (const config_error&) {
    return fail_current(fn);
  } catch (const error& e) {
    set_error(EXPSEG_ERROR_INVALID_ARGUMENT, fn, e.what());
    return EXPSEG_ERROR_INVALID_ARGUMENT;
  } catch (...) {
    return fail_current(fn);
  }
}

[[gnu::cold, gnu::noinline]] void report_invalid_device(int device, const char* fn) noexcept {
  try {
    set_error(EXPSEG_ERROR_INVALID_DEVICE, fn,
              "device " + std::to_string(device) + " is out of range (0 .. " + std::to_string(kMaxDevices - 1) + ")");
  } catch (...) {
    set_error(EXPSEG_ERROR_INVALID_DEVICE, fn, "device index out of range");
  }
}

// Inline, with its error out of line: every malloc and free asks.
inline bool valid_device(int device, const char* fn) noexcept {
  if (device >= 0 && device < kMaxDevices) [[likely]] return true;
  report_invalid_device(device, fn);
  return false;
}

// The device's allocator, or nullptr when it has none yet (queries never create one).
Allocator* existing(int device) noexcept { return g_alloc[device].load(std::memory_order_acquire); }

// The configuration new allocators get: defaults <- EXPSEG_ALLOC_CONF <- expseg_configure's string.
// Caller holds shared().mu.
Config effective_config_locked() {
  if (shared().created_with) return *shared().created_with;
  Config c = Config::from_env();  // a bad EXPSEG_ALLOC_CONF throws config_error naming it
  if (!shared().conf.empty()) c.apply(shared().conf);
  return c;
}

// The stats of a device with no allocator yet: zeros, and the max_split_size its allocator will
// report (PyTorch reports the configured one on every device). Caller holds shared().mu.
Stats unused_device_stats_locked() {
  Stats s;
  const std::size_t max_split = effective_config_locked().max_split_size;
  s.max_split_size = max_split == SIZE_MAX ? -1 : static_cast<std::int64_t>(max_split);
  return s;
}

// What an allocator created now gets: the configuration and expseg_set_record_default's override.
Config new_allocator_config_locked(Config c = effective_config_locked()) {
  if (shared().record_default) std::tie(c.record, c.record_ring) = *shared().record_default;
  return c;
}

// Creates the device's allocator unless another thread did first. nullptr (with the error set) on failure.
// peer_access:auto: `grantor` (expandable) lets `peer` reach its memory where the two have a P2P
// path. Best effort: a pair without one, or a driver that refuses, is left as it was (a copy between
// them then goes through the host, or fails as it would under PyTorch's own allocator).
void grant_peer(Allocator& grantor, int peer) noexcept {
  try {
    if (grantor.config().backend != BackendKind::expandable) return;  // cuMemAlloc: the frameworks' own call covers it
    grantor.enable_peer_access(peer);
  } catch (...) {
  }
}

[[gnu::cold, gnu::noinline]] Allocator* create_allocator(int device, const char* fn) noexcept {
  try {
    Shared& s = shared();
    std::lock_guard<std::mutex> lock(s.mu);
    Allocator* a = g_alloc[device].load(std::memory_order_relaxed);
    if (a == nullptr) {
      Config base = effective_config_locked();
      auto made = std::make_unique<Allocator>(new_allocator_config_locked(base), device);
      if (!s.created_with) s.created_with = std::move(base);
      a = made.release();
      g_alloc[device].store(a, std::memory_order_release);
      // A process that uses two devices copies between them (PyTorch's .to("cuda:1"), CuPy's peer
      // copies): their cudaDeviceEnablePeerAccess does not reach cuMemMap memory, so the expandable
      // allocators grant one another here, as PyTorch's expandable segments are granted by its own
      // enablePeerAccess. Processes that use one device (one per GPU, as DDP) pay nothing.
      if (a->config().peer_access == PeerAccess::automatic)
        for (int other = 0; other < kMaxDevices; ++other) {
          Allocator* b = other != device ? g_alloc[other].load(std::memory_order_relaxed) : nullptr;
          if (b == nullptr) continue;
          grant_peer(*b, device);
          grant_peer(*a, other);
        }
    }
    return a;
  } catch (...) {
    fail_current(fn);
    return nullptr;
  }
}

// The device's allocator, created on first use. nullptr (with the error set) on failure. Inline,
// with the creation out of line: every malloc asks.
inline Allocator* get_or_create(int device, const char* fn) noexcept {
  if (!valid_device(device, fn)) return nullptr;
  if (Allocator* a = existing(device)) [[likely]] return a;
  return create_allocator(device, fn);
}

// Remembers the report of the calling thread's failed allocation on `device`; nullptr: it failed
// without one (host memory, a driver error), so an earlier OOM's report is not taken for it.
void set_thread_oom(int device, const OomReport* report) noexcept {
  if (device < 0 || device >= kMaxDevices) return;
  std::shared_ptr<const OomReport>& slot = tls().ooms[static_cast<std::size_t>(device)];
  try {
    slot = report != nullptr ? std::make_shared<const OomReport>(*report) : nullptr;
  } catch (...) {
    slot.reset();  // no memory for the copy: no report rather than another one
  }
}

const char* put(Buffer b, std::string&& text) noexcept {
  std::string& buf = tls().buffers[static_cast<std::size_t>(b)];
  buf = std::move(text);  // move assignment: no allocation, cannot throw
  return buf.c_str();
}

void* allocate(std::size_t size, int device, expseg_stream_t stream, const char* fn, bool print_oom) noexcept {
  if (size == 0) return nullptr;
  Allocator* a = get_or_create(device, fn);
  if (a == nullptr) {
    set_thread_oom(device, nullptr);
    return nullptr;
  }
  try {
    return a->allocate(size, stream);
  } catch (const out_of_memory& e) {
    set_thread_oom(device, &e.report());
    if (size < kMaxRequest) {  // a request refused up front is no OOM of the allocator: no callback
      notify_oom(device, e.report());
      set_thread_oom(device, &e.report());  // again: an allocation the callback made may have failed too
    }
    set_error(EXPSEG_ERROR_OUT_OF_MEMORY, fn, e.what());
    if (print_oom && g_oom_stderr.load(std::memory_order_relaxed))
      std::fprintf(stderr, "expseg: %s returns NULL (out of memory):\n%s\n", fn, e.what());
    return nullptr;
  } catch (...) {
    set_thread_oom(device, nullptr);
    fail_current(fn);
    return nullptr;
  }
}

void deallocate(void* ptr, int device, const char* fn) noexcept {
  if (ptr == nullptr) return;
  if (!valid_device(device, fn)) return;
  Allocator* a = existing(device);
  if (a == nullptr) {
    no_allocator_for_pointer(fn, "free", ptr, device);
    return;
  }
  try {
    detail::AllocatorAccess::deallocate_for_good(*a, ptr);
  } catch (...) {
    fail_current(fn);
  }
}

// The calls whose misuse (an expseg::error: a pool not begun, a stream already capturing, ...)
// changes nothing and is the caller's mistake: EXPSEG_ERROR_INVALID_ARGUMENT with the reason;
// a driver error or anything else is reported as every other call reports it. Only the calls that
// begin something create the allocator (Creates::yes); the others name a pool or a capture that
// cannot exist on a device without one, and refuse that without creating it.
enum class Creates : bool { no, yes };
template <class F>
int with_allocator(int device, const char* fn, Creates creates, F&& call) noexcept {
  if (!valid_device(device, fn)) return EXPSEG_ERROR_INVALID_DEVICE;
  Allocator* a = creates == Creates::yes ? get_or_create(device, fn) : existing(device);
  if (a == nullptr && creates == Creates::yes) return tls().code;
  if (a == nullptr) {
    set_error(EXPSEG_ERROR_INVALID_ARGUMENT, fn, "the device has no allocator yet, so no graph pool or capture");
    return EXPSEG_ERROR_INVALID_ARGUMENT;
  }
  try {
    call(a);
    return EXPSEG_SUCCESS;
  } catch (...) {
    return fail_as_misuse(fn);
  }
}

}  // namespace

void reset_for_tests() noexcept {
  Shared& s = shared();
  std::lock_guard<std::mutex> lock(s.mu);
  {
    // Imports first: they were mapped through the allocators. Closed outside the registry's lock.
    decltype(Imports::open) open;
    {
      std::lock_guard<std::mutex> ilock(imports().mu);
      open.swap(imports().open);
    }
    open.clear();  // ~ImportedMemory ignores errors
  }
  for (auto& slot : g_alloc) delete slot.exchange(nullptr, std::memory_order_acq_rel);
  s.conf.clear();
  s.record_default.reset();
  s.created_with.reset();
  expseg_set_oom_callback(nullptr, nullptr);
  ThreadState& t = tls();
  t.code = EXPSEG_SUCCESS;
  t.message.clear();
  for (auto& r : t.ooms) r.reset();
}

Allocator* allocator_for_tests(int device) noexcept {
  return device >= 0 && device < kMaxDevices ? existing(device) : nullptr;
}

void set_oom_stderr(bool on) noexcept { g_oom_stderr.store(on, std::memory_order_relaxed); }

}  // namespace expseg::capi

using namespace expseg;
using namespace expseg::capi;

extern "C" {

void expseg_reset_for_tests(void) noexcept { reset_for_tests(); }

void* expseg_malloc(ssize_t size, int device, expseg_stream_t stream) noexcept {
  if (size < 0) {
    set_thread_oom(device, nullptr);  // a failed allocation without a report: no earlier OOM's stands for it
    set_error(EXPSEG_ERROR_INVALID_ARGUMENT, "expseg_malloc", "negative size (2^63 bytes or more read as size_t)");
    return nullptr;
  }
  return allocate(static_cast<std::size_t>(size), device, stream, "expseg_malloc", true);
}

void* expseg_torch_malloc(ssize_t size, int device, expseg_stream_t stream) {
  constexpr const char* fn = "expseg_torch_malloc";
  if (size < 0) {
    set_thread_oom(device, nullptr);  // a failed allocation without a report: no earlier OOM's stands for it
    set_error(EXPSEG_ERROR_INVALID_ARGUMENT, fn, "negative size (2^63 bytes or more read as size_t)");
    throw std::invalid_argument(std::string(fn) + ": negative size (2^63 bytes or more read as size_t)");
  }
  if (size == 0) return nullptr;
  // The exceptions carry the thread's message itself, not expseg_last_error(): that would replace
  // the string an earlier expseg_last_error handed out, which stays valid until the caller calls it again.
  Allocator* a = get_or_create(device, fn);
  if (a == nullptr) {
    set_thread_oom(device, nullptr);
    throw std::runtime_error(tls().message);
  }
  try {
    return a->allocate(static_cast<std::size_t>(size), stream);
  } catch (const out_of_memory& e) {
    set_thread_oom(device, &e.report());
    if (static_cast<std::size_t>(size) < kMaxRequest) {  // a request refused up front is no OOM of the allocator: no callback
      notify_oom(device, e.report());
      set_thread_oom(device, &e.report());  // again: an allocation the callback made may have failed too
    }
    set_error(EXPSEG_ERROR_OUT_OF_MEMORY, fn, e.what());
    throw;
  } catch (...) {
    set_thread_oom(device, nullptr);
    fail_current(fn);
    throw std::runtime_error(tls().message);
  }
}

int expseg_set_oom_callback(expseg_oom_callback callback, void* user_data) noexcept {
  OomCallback& c = oom_callback();
  std::lock_guard<std::mutex> lock(c.mu);
  c.fn = callback;
  c.user_data = callback ? user_data : nullptr;
  return EXPSEG_SUCCESS;
}

void expseg_free(void* ptr, ssize_t /*size*/, int device, expseg_stream_t /*stream*/) noexcept {
  deallocate(ptr, device, "expseg_free");
}

void* expseg_cupy_malloc(void* param, size_t size, int device_id) noexcept {
  // `param`: the stream of the CFunctionAllocator that calls (CuPy itself passes none). CuPy destroys
  // a Stream when it is collected, maybe with memory still cached for it: a key whose stream expseg
  // never synchronizes (only asks, while a request names it, whether it blocks; the legacy stream's
  // synchronization or a device one waits for its work), see backends::foreign_stream_key.
  return allocate(size, device_id, static_cast<expseg_stream_t>(backends::foreign_stream_key(static_cast<driver::stream_t>(param))),
                  "expseg_cupy_malloc", false);
}

void expseg_cupy_free(void* /*param*/, void* ptr, int device_id) noexcept {
  deallocate(ptr, device_id, "expseg_cupy_free");
}

int expseg_record_stream(void* ptr, int device, expseg_stream_t stream) noexcept {
  constexpr const char* fn = "expseg_record_stream";
  // As expseg_free(NULL): PyTorch records streams of empty tensors, also on a device with no allocator yet.
  if (ptr == nullptr) return EXPSEG_SUCCESS;
  if (!valid_device(device, fn)) return EXPSEG_ERROR_INVALID_DEVICE;
  Allocator* a = existing(device);
  if (a == nullptr) return no_allocator_for_pointer(fn, "record_stream", ptr, device);
  try {
    a->record_stream(ptr, stream);
    return EXPSEG_SUCCESS;
  } catch (...) {
    return fail_current(fn);
  }
}

int expseg_configure(const char* conf) noexcept {
  constexpr const char* fn = "expseg_configure";
  try {
    Shared& s = shared();
    std::lock_guard<std::mutex> lock(s.mu);
    std::string devices;
    for (int d = 0; d < kMaxDevices; ++d) {
      if (g_alloc[d].load(std::memory_order_relaxed) == nullptr) continue;
      if (!devices.empty()) devices += ", ";
      devices += std::to_string(d);
    }
    if (!devices.empty()) {
      set_error(EXPSEG_ERROR_ALREADY_INITIALIZED, fn,
                "an allocator already exists for device(s) " + devices +
                    "; the configuration can only be set before the first allocation (call expseg_configure "
                    "first, or set EXPSEG_ALLOC_CONF)");
      return EXPSEG_ERROR_ALREADY_INITIALIZED;
    }
    std::string text = conf != nullptr ? std::string(conf) : std::string();
    Config c = Config::from_env();
    c.apply(text);  // checks the string now; throws config_error naming the key
    check_config(c);  // and the values together (device:sim), not at the first malloc
    s.conf = std::move(text);
    return EXPSEG_SUCCESS;
  } catch (...) {
    return fail_current(fn);
  }
}

const char* expseg_config(int device) noexcept {
  constexpr const char* fn = "expseg_config";
  if (!valid_device(device, fn)) return nullptr;
  try {
    if (Allocator* a = existing(device)) return put(kConfigBuf, a->config().to_string());
    Shared& s = shared();
    std::lock_guard<std::mutex> lock(s.mu);
    if (Allocator* a = existing(device)) return put(kConfigBuf, a->config().to_string());
    return put(kConfigBuf, new_allocator_config_locked().to_string());  // the one it would be created with
  } catch (...) {
    fail_current(fn);
    return nullptr;
  }
}

int expseg_device_initialized(int device) noexcept {
  if (!valid_device(device, "expseg_device_initialized")) return -1;
  return existing(device) != nullptr ? 1 : 0;
}

int expseg_release_cached(int device) noexcept {
  constexpr const char* fn = "expseg_release_cached";
  if (!valid_device(device, fn)) return EXPSEG_ERROR_INVALID_DEVICE;
  Allocator* a = existing(device);
  if (a == nullptr) return EXPSEG_SUCCESS;  // nothing cached
  try {
    a->release_cached();
    return EXPSEG_SUCCESS;
  } catch (...) {  // refused while a capture allocates into a graph pool
    return fail_as_misuse(fn);
  }
}

int expseg_release_stream(int device, expseg_stream_t stream) noexcept {
  constexpr const char* fn = "expseg_release_stream";
  if (!valid_device(device, fn)) return EXPSEG_ERROR_INVALID_DEVICE;
  Allocator* a = existing(device);
  try {
    if (a == nullptr) {  // nothing cached; a stream no program made is refused all the same
      refuse_unreleasable_stream(static_cast<expseg::stream_t>(stream));
      return EXPSEG_SUCCESS;
    }
    // expseg_cupy_malloc caches the stream's memory under its foreign key: given back with the rest.
    detail::AllocatorAccess::release_stream_with_foreign_key(*a, static_cast<expseg::stream_t>(stream));
    return EXPSEG_SUCCESS;
  } catch (...) {  // refused: blocks use the stream, or it is not one's own
    return fail_as_misuse(fn);
  }
}

namespace {
// Pool 0 is refused before the allocator is created for it (nothing changed).
int refuse_pool_zero(const char* fn) noexcept {
  set_error(EXPSEG_ERROR_INVALID_ARGUMENT, fn, "pool 0 is not a pool id (use any other number)");
  return EXPSEG_ERROR_INVALID_ARGUMENT;
}
}  // namespace

int expseg_begin_graph_pool(int device, unsigned long long pool, expseg_stream_t stream) noexcept {
  constexpr const char* fn = "expseg_begin_graph_pool";
  if (pool == 0 && valid_device(device, fn)) return refuse_pool_zero(fn);
  return with_allocator(device, fn, Creates::yes, [&](Allocator* a) { a->begin_graph_pool(pool, static_cast<expseg::stream_t>(stream)); });
}

int expseg_prepare_capture(int device, expseg_stream_t stream) noexcept {
  return with_allocator(device, "expseg_prepare_capture", Creates::yes, [&](Allocator* a) { a->prepare_capture(static_cast<expseg::stream_t>(stream)); });
}

int expseg_end_graph_pool(int device, unsigned long long pool) noexcept {
  return with_allocator(device, "expseg_end_graph_pool", Creates::no, [&](Allocator* a) { a->end_graph_pool(pool); });
}

int expseg_release_graph_pool(int device, unsigned long long pool) noexcept {
  return with_allocator(device, "expseg_release_graph_pool", Creates::no, [&](Allocator* a) { a->release_graph_pool(pool); });
}

int expseg_begin_pool_allocations(int device, unsigned long long pool, expseg_stream_t stream) noexcept {
  constexpr const char* fn = "expseg_begin_pool_allocations";
  if (pool == 0 && valid_device(device, fn)) return refuse_pool_zero(fn);
  return with_allocator(device, fn, Creates::yes, [&](Allocator* a) { a->begin_pool_allocations(pool, static_cast<expseg::stream_t>(stream)); });
}

int expseg_end_pool_allocations(int device, unsigned long long pool, expseg_stream_t stream) noexcept {
  return with_allocator(device, "expseg_end_pool_allocations", Creates::no, [&](Allocator* a) { a->end_pool_allocations(pool, static_cast<expseg::stream_t>(stream)); });
}

int expseg_restore_graph_pool_block(int device, unsigned long long pool, void* ptr, size_t size) noexcept {
  return with_allocator(device, "expseg_restore_graph_pool_block", Creates::no, [&](Allocator* a) { a->restore_graph_pool_block(pool, ptr, size); });
}

int expseg_graph_pool_blocks(int device, unsigned long long pool, unsigned long long* addresses, size_t* sizes, size_t capacity,
                             size_t* count) noexcept {
  constexpr const char* fn = "expseg_graph_pool_blocks";
  if (count == nullptr || (capacity > 0 && (addresses == nullptr || sizes == nullptr)))
  {
    set_error(EXPSEG_ERROR_INVALID_ARGUMENT, fn, "count is NULL, or addresses or sizes is NULL with a capacity above 0");
    return EXPSEG_ERROR_INVALID_ARGUMENT;
  }
  if (!valid_device(device, fn)) return EXPSEG_ERROR_INVALID_DEVICE;
  Allocator* a = existing(device);  // a query: a device without an allocator has no pool
  if (a == nullptr) {
    *count = 0;
    return EXPSEG_SUCCESS;
  }
  try {
    const auto blocks = a->graph_pool_blocks(pool);
    for (std::size_t i = 0; i < blocks.size() && i < capacity; ++i) {
      addresses[i] = blocks[i].first;
      sizes[i] = blocks[i].second;
    }
    *count = blocks.size();
    return EXPSEG_SUCCESS;
  } catch (...) {
    return fail_current(fn);
  }
}

int expseg_set_limit(int device, size_t bytes) noexcept {
  constexpr const char* fn = "expseg_set_limit";
  Allocator* a = get_or_create(device, fn);
  if (a == nullptr) return tls().code;
  try {
    a->set_limit(bytes);
    return EXPSEG_SUCCESS;
  } catch (...) {  // refused while a capture allocates into a graph pool
    return fail_as_misuse(fn);
  }
}

int expseg_reset_peak_stats(int device) noexcept {
  constexpr const char* fn = "expseg_reset_peak_stats";
  if (!valid_device(device, fn)) return EXPSEG_ERROR_INVALID_DEVICE;
  Allocator* a = existing(device);
  if (a == nullptr) return EXPSEG_SUCCESS;  // no peaks yet
  try {
    a->reset_peak_stats();
    return EXPSEG_SUCCESS;
  } catch (...) {
    return fail_current(fn);
  }
}

extern "C++" {  // inside the extern "C" block: a C++ helper, not a C function (clang refuses its pair)
namespace {

// expseg_get_limit's answer (device valid; throws): the allocator's, or, without one, what the
// allocator created now would answer. `want_total` false: the total is not asked of an allocator.
std::pair<std::size_t, std::size_t> limit_and_total(int device, bool want_total) {
  std::size_t limit = 0;
  std::size_t total = 0;
  Allocator* a = existing(device);
  std::optional<Config> c;
  if (a == nullptr) {
    Shared& s = shared();
    std::lock_guard<std::mutex> lock(s.mu);
    a = existing(device);
    if (a == nullptr) c = new_allocator_config_locked();
  }
  if (a != nullptr) {
    limit = a->limit();
    total = want_total ? a->device_info().total_bytes : 0;
  } else {
    // A query creates no allocator (PyTorch reads the memory fraction before the first tensor, when
    // the configuration may still be set): what the allocator created now would answer, its limit
    // resolved against the device's memory as it resolves it, read from a driver of its own.
    c->ipc_handle = IpcHandle::none;  // no shareable handle type to probe for a query
    const bool cuda = c->device == DeviceKind::cuda;
    total = cuda ? g_cuda_total[device].load(std::memory_order_relaxed) : 0;
    if (total == 0) {
      total = make_driver(*c, device)->mem_info().total;
      if (cuda) g_cuda_total[device].store(total, std::memory_order_relaxed);
    }
    limit = c->limit.resolve(total);
  }
  return {limit, total};
}

}  // namespace
}  // extern "C++"

int expseg_get_limit(int device, size_t* limit_bytes, size_t* device_total_bytes) noexcept {
  constexpr const char* fn = "expseg_get_limit";
  if (!valid_device(device, fn)) return EXPSEG_ERROR_INVALID_DEVICE;
  try {
    const auto [limit, total] = limit_and_total(device, device_total_bytes != nullptr);
    if (limit_bytes != nullptr) *limit_bytes = limit;
    if (device_total_bytes != nullptr) *device_total_bytes = total;
    return EXPSEG_SUCCESS;
  } catch (...) {
    return fail_current(fn);
  }
}

int expseg_reset_accumulated_stats(int device) noexcept {
  constexpr const char* fn = "expseg_reset_accumulated_stats";
  if (!valid_device(device, fn)) return EXPSEG_ERROR_INVALID_DEVICE;
  Allocator* a = existing(device);
  if (a == nullptr) return EXPSEG_SUCCESS;  // nothing accumulated yet
  try {
    a->reset_accumulated_stats();
    return EXPSEG_SUCCESS;
  } catch (...) {
    return fail_current(fn);
  }
}

const char* expseg_stats_json(int device) noexcept {
  constexpr const char* fn = "expseg_stats_json";
  if (!valid_device(device, fn)) return nullptr;
  try {
    if (Allocator* a = existing(device)) return put(kStatsBuf, a->stats().to_json());
    Stats s;
    {
      Shared& sh = shared();
      std::lock_guard<std::mutex> lock(sh.mu);
      if (Allocator* a = existing(device)) return put(kStatsBuf, a->stats().to_json());
      s = unused_device_stats_locked();
    }
    return put(kStatsBuf, s.to_json());
  } catch (...) {
    fail_current(fn);
    return nullptr;
  }
}

extern "C++" {  // C++ helpers inside the extern "C" block (clang refuses a C function returning Snapshot)
namespace {
// The device's snapshot and, when `events` is given, its recorded events of the same moment.
Snapshot snapshot_of(int device, std::vector<TraceEvent>* events) {
  auto take = [events](const Allocator& a) { return events ? a.snapshot_with_recorded(*events) : a.snapshot(); };
  if (Allocator* a = existing(device)) return take(*a);
  Snapshot s;  // no allocator yet: no segments, zero stats, no events
  {
    Shared& sh = shared();
    std::lock_guard<std::mutex> lock(sh.mu);
    if (Allocator* a = existing(device)) return take(*a);
    s.backend = to_string(effective_config_locked().backend);
    s.stats = unused_device_stats_locked();
  }
  s.device = device;
  // The limit and the device's memory, as expseg_get_limit answers them (a limit of 0 would read
  // as "no limit" where one is configured).
  std::tie(s.limit_bytes, s.device_total_bytes) = limit_and_total(device, true);
  return s;
}

// record_write's file: an I/O failure is EXPSEG_ERROR_IO (recorded), host memory EXPSEG_ERROR_OUT_OF_MEMORY (thrown).
int write_recorded(const char* fn, const char* path, const std::vector<TraceEvent>& events) {
  try {
    write_trace_file(path, events);
  } catch (const out_of_memory&) {
    throw;
  } catch (const std::bad_alloc&) {
    throw;
  } catch (const std::exception& e) {
    set_error(EXPSEG_ERROR_IO, fn, e.what());
    return EXPSEG_ERROR_IO;
  }
  return EXPSEG_SUCCESS;
}
}  // namespace
}  // extern "C++"

const char* expseg_snapshot_json(int device) noexcept {
  constexpr const char* fn = "expseg_snapshot_json";
  if (!valid_device(device, fn)) return nullptr;
  try {
    return put(kSnapshotBuf, snapshot_of(device, nullptr).to_json());
  } catch (...) {
    fail_current(fn);
    return nullptr;
  }
}

const char* expseg_snapshot_json_with_trace(int device, const char* trace_path) noexcept {
  constexpr const char* fn = "expseg_snapshot_json_with_trace";
  if (!valid_device(device, fn)) return nullptr;
  if (trace_path == nullptr || *trace_path == '\0') {
    set_error(EXPSEG_ERROR_INVALID_ARGUMENT, fn, "no trace path given");
    return nullptr;
  }
  try {
    std::vector<TraceEvent> events;
    const Snapshot snap = snapshot_of(device, &events);
    if (write_recorded(fn, trace_path, events) != EXPSEG_SUCCESS) return nullptr;
    return put(kSnapshotBuf, snap.to_json());
  } catch (...) {
    fail_current(fn);
    return nullptr;
  }
}

const char* expseg_last_oom_report(int device) noexcept {
  constexpr const char* fn = "expseg_last_oom_report";
  if (!valid_device(device, fn)) return nullptr;
  try {
    Allocator* a = existing(device);
    std::optional<OomReport> r = a != nullptr ? a->last_oom() : std::nullopt;
    return put(kOomTextBuf, r ? std::move(r->message) : std::string());
  } catch (...) {
    fail_current(fn);
    return nullptr;
  }
}

const char* expseg_last_oom_report_json(int device) noexcept {
  constexpr const char* fn = "expseg_last_oom_report_json";
  if (!valid_device(device, fn)) return nullptr;
  try {
    Allocator* a = existing(device);
    std::optional<OomReport> r = a != nullptr ? a->last_oom() : std::nullopt;
    return put(kOomJsonBuf, r ? r->to_json() : std::string("null"));
  } catch (...) {
    fail_current(fn);
    return nullptr;
  }
}

const char* expseg_thread_oom_report(int device) noexcept {
  constexpr const char* fn = "expseg_thread_oom_report";
  if (!valid_device(device, fn)) return nullptr;
  try {
    const std::shared_ptr<const OomReport>& r = tls().ooms[static_cast<std::size_t>(device)];
    return put(kThreadOomTextBuf, r ? std::string(r->message) : std::string());
  } catch (...) {
    fail_current(fn);
    return nullptr;
  }
}

const char* expseg_thread_oom_report_json(int device) noexcept {
  constexpr const char* fn = "expseg_thread_oom_report_json";
  if (!valid_device(device, fn)) return nullptr;
  try {
    const std::shared_ptr<const OomReport>& r = tls().ooms[static_cast<std::size_t>(device)];
    return put(kThreadOomJsonBuf, r ? r->to_json() : std::string("null"));
  } catch (...) {
    fail_current(fn);
    return nullptr;
  }
}

int expseg_record_start(int device, size_t ring) noexcept {
  constexpr const char* fn = "expseg_record_start";
  Allocator* a = get_or_create(device, fn);
  if (a == nullptr) return tls().code;
  try {
    a->start_recording(ring);
    return EXPSEG_SUCCESS;
  } catch (...) {
    return fail_current(fn);
  }
}

int expseg_set_record_default(int on, size_t ring) noexcept {
  try {
    Shared& s = shared();
    std::lock_guard<std::mutex> lock(s.mu);
    s.record_default = std::make_pair(on != 0, static_cast<std::size_t>(ring));
    return EXPSEG_SUCCESS;
  } catch (...) {
    return fail_current("expseg_set_record_default");
  }
}

int expseg_record_stop(int device) noexcept {
  constexpr const char* fn = "expseg_record_stop";
  if (!valid_device(device, fn)) return EXPSEG_ERROR_INVALID_DEVICE;
  Allocator* a = existing(device);
  if (a == nullptr) return EXPSEG_SUCCESS;  // was not recording
  try {
    a->stop_recording();
    return EXPSEG_SUCCESS;
  } catch (...) {
    return fail_current(fn);
  }
}

int expseg_record_write(int device, const char* path) noexcept {
  constexpr const char* fn = "expseg_record_write";
  if (!valid_device(device, fn)) return EXPSEG_ERROR_INVALID_DEVICE;
  if (path == nullptr || *path == '\0') {
    set_error(EXPSEG_ERROR_INVALID_ARGUMENT, fn, "no path given");
    return EXPSEG_ERROR_INVALID_ARGUMENT;
  }
  try {
    Allocator* a = existing(device);
    return write_recorded(fn, path, a != nullptr ? a->recorded() : std::vector<TraceEvent>{});
  } catch (...) {
    return fail_current(fn);
  }
}

int expseg_record_partial(int device, int* partial) noexcept {
  constexpr const char* fn = "expseg_record_partial";
  if (!valid_device(device, fn)) return EXPSEG_ERROR_INVALID_DEVICE;
  if (partial == nullptr) {
    set_error(EXPSEG_ERROR_INVALID_ARGUMENT, fn, "partial is NULL");
    return EXPSEG_ERROR_INVALID_ARGUMENT;
  }
  try {
    const Allocator* a = existing(device);
    *partial = a != nullptr && a->recorded_partial() ? 1 : 0;
    return EXPSEG_SUCCESS;
  } catch (...) {
    return fail_current(fn);
  }
}

int expseg_enable_peer_access(int device, int peer) noexcept {
  constexpr const char* fn = "expseg_enable_peer_access";
  if (!valid_device(device, fn)) return EXPSEG_ERROR_INVALID_DEVICE;
  if (peer < 0 || peer >= kMaxDevices) {  // checked before the allocator is created
    try {  // building the message may throw bad_alloc, which must not leave a noexcept function
      set_error(EXPSEG_ERROR_INVALID_DEVICE, fn,
                "peer device " + std::to_string(peer) + " is out of range (0 .. " + std::to_string(kMaxDevices - 1) + ")");
    } catch (...) {
      set_error(EXPSEG_ERROR_INVALID_DEVICE, fn, "peer device index out of range");
    }
    return EXPSEG_ERROR_INVALID_DEVICE;
  }
  // A device is its own peer already: nothing to grant, so no allocator to create (expseg.h).
  if (peer == device) return EXPSEG_SUCCESS;
  if (existing(device) == nullptr) {
    // A peer the machine does not have is refused before the allocator is created, in the words of
    // Allocator::enable_peer_access. (0 devices: CUDA is not usable; creating the allocator says why.)
    try {
      int count = 0;
      const char* kind = "";
      {
        Shared& s = shared();
        std::lock_guard<std::mutex> lock(s.mu);
        if (existing(device) == nullptr) {
          const Config c = effective_config_locked();
          count = visible_device_count(c);
          kind = to_string(c.device);
        }
      }
      if (count > 0 && peer >= count) {
        set_error(EXPSEG_ERROR_INVALID_DEVICE, fn,
                  "expseg: enable_peer_access(" + std::to_string(peer) + ") on device " + std::to_string(device) +
                      ": no device " + std::to_string(peer) + " (" + std::to_string(count) + " " + kind +
                      " devices visible)");
        return EXPSEG_ERROR_INVALID_DEVICE;
      }
    } catch (...) {
      return fail_current(fn);
    }
  }
  Allocator* a = get_or_create(device, fn);
  if (a == nullptr) return tls().code;
  try {
    a->enable_peer_access(peer);
    return EXPSEG_SUCCESS;
  } catch (const driver_error&) {
    return fail_current(fn);
  } catch (const error& e) {  // the allocator's own checks: `peer` is not a device, or cannot reach this one
    set_error(EXPSEG_ERROR_INVALID_DEVICE, fn, e.what());
    return EXPSEG_ERROR_INVALID_DEVICE;
  } catch (...) {
    return fail_current(fn);
  }
}

int expseg_ipc_export(void* ptr, int device, const void** handle, size_t* handle_size, const int** fds,
                      size_t* nfds) noexcept {
  constexpr const char* fn = "expseg_ipc_export";
  if (handle == nullptr || handle_size == nullptr || fds == nullptr || nfds == nullptr) {
    set_error(EXPSEG_ERROR_INVALID_ARGUMENT, fn, "handle, handle_size, fds and nfds must not be NULL");
    return EXPSEG_ERROR_INVALID_ARGUMENT;
  }
  *handle = nullptr;
  *handle_size = 0;
  *fds = nullptr;
  *nfds = 0;
  if (!valid_device(device, fn)) return EXPSEG_ERROR_INVALID_DEVICE;
  Allocator* a = existing(device);
  if (a == nullptr) return no_allocator_for_pointer(fn, "export", ptr, device);
  try {
    IpcMemHandle h = a->export_ipc(ptr);
    const std::vector<std::uint8_t> bytes = h.serialize();
    std::vector<int> out = h.fds();  // until they are handed over, `h` owns (and on a throw closes) them
    ThreadState& t = tls();
    std::string& buf = t.buffers[kIpcHandleBuf];
    buf.assign(bytes.begin(), bytes.end());
    t.ipc_fds = std::move(out);
    for (IpcPiece& piece : h.pieces) (void)piece.fd.release();  // the caller's now
    *handle = buf.data();
    *handle_size = buf.size();
    *fds = t.ipc_fds.empty() ? nullptr : t.ipc_fds.data();
    *nfds = t.ipc_fds.size();
    return EXPSEG_SUCCESS;
  } catch (...) {
    return fail_current(fn);
  }
}

int expseg_ipc_import(const void* handle, size_t handle_size, const int* fds, size_t nfds, int device, void** ptr,
                      size_t* size) noexcept {
  constexpr const char* fn = "expseg_ipc_import";
  auto invalid = [](const std::string& what) {
    set_error(EXPSEG_ERROR_INVALID_ARGUMENT, "expseg_ipc_import", what);
    return EXPSEG_ERROR_INVALID_ARGUMENT;
  };
  try {
    if (size != nullptr) *size = 0;  // first: also when ptr is NULL (expseg.h: 0 on every error)
    if (ptr == nullptr) return invalid("ptr must not be NULL");
    *ptr = nullptr;
    if (!valid_device(device, fn)) return EXPSEG_ERROR_INVALID_DEVICE;
    if (handle == nullptr || handle_size == 0) return invalid("no handle given (NULL, or 0 bytes)");
    if (nfds > 0 && fds == nullptr) return invalid(std::to_string(nfds) + " descriptors announced, but fds is NULL");
    IpcMemHandle h = IpcMemHandle::deserialize({static_cast<const std::uint8_t*>(handle), handle_size});
    // Where it is imported: the device's allocator's configuration, or the one it will be created with.
    const Config conf = [&] {
      if (Allocator* a = existing(device)) return a->config();
      Shared& s = shared();
      std::lock_guard<std::mutex> lock(s.mu);
      return effective_config_locked();
    }();
    // The simulated device's descriptors without sim_host_backed are numbers it hands out, not open
    // files: the simulator checks those itself.
    const bool real_fds = conf.device != DeviceKind::sim || conf.sim_host_backed;
    if (nfds > 0) {
      if (!h.needs_fds())
        return invalid(std::string("the handle (") + to_string(h.kind) + ") takes no file descriptors, but " +
                       std::to_string(nfds) + " were given");
      if (nfds != h.pieces.size()) {
        set_error(EXPSEG_ERROR_IPC, fn,
                  "the handle has " + std::to_string(h.pieces.size()) + " file descriptors, " + std::to_string(nfds) +
                      " were given (all of them travel, in the order expseg_ipc_export gave them)");
        return EXPSEG_ERROR_IPC;
      }
      for (std::size_t i = 0; i < nfds; ++i) {
        if (fds[i] < 0) return invalid("file descriptor " + std::to_string(i) + " is negative");
        if (real_fds && ::fcntl(fds[i], F_GETFD) == -1 && errno == EBADF)
          return invalid("file descriptor " + std::to_string(i) + " (" + std::to_string(fds[i]) + ") is not open");
      }
    }
    // What the handle says against where it is imported, before the device's allocator is created
    // for an import that cannot succeed (import_ipc checks these too, in the same words).
    const std::string kind = to_string(conf.device);
    if (h.device_kind != kind) {
      set_error(EXPSEG_ERROR_IPC, fn, "expseg: import_ipc: the handle was exported by a " + h.device_kind +
                                          " device; this is a " + kind + " device");
      return EXPSEG_ERROR_IPC;
    }
    // The nonce, not the pid: another container's process may have our pid.
    const bool this_process = detail::exported_here(h);
    if (h.device_kind == "sim" && (!this_process || h.device != device || existing(device) == nullptr)) {
      set_error(EXPSEG_ERROR_IPC, fn,
                "expseg: import_ipc: the simulated device imports in-process only, through the allocator that exported "
                "the handle (device " + std::to_string(h.device) + " of process " + std::to_string(h.exporter_pid) +
                    "), while it exists; this is device " + std::to_string(device) + " of process " +
                    std::to_string(::getpid()) +
                    (this_process || h.exporter_pid != static_cast<std::int64_t>(::getpid())
                         ? std::string()
                         : std::string(" (another process with the same pid: another PID namespace, or a fork child)")));
      return EXPSEG_ERROR_IPC;
    }
    if (h.kind == IpcKind::cuda_ipc && h.device_kind == "cuda" && this_process) {
      set_error(EXPSEG_ERROR_IPC, fn,
                "expseg: import_ipc: a cuda_ipc handle (split_merge) cannot be opened in the process that exported "
                "it (cuIpcOpenMemHandle refuses): use the allocation's own pointer there");
      return EXPSEG_ERROR_IPC;
    }
    // The caller's descriptors are lent to the handle for the import, never closed by it.
    struct Lent {
      IpcMemHandle& h;
      bool on = false;
      ~Lent() {
        if (on)
          for (IpcPiece& piece : h.pieces) (void)piece.fd.release();
      }
    } lent{h};
    if (nfds > 0) {
      if (real_fds) h.check_fd_files(std::span<const int>(fds, nfds));
      lent.on = true;
      for (std::size_t i = 0; i < nfds; ++i) h.pieces[i].fd.reset(fds[i]);
    } else if (h.needs_fds()) {
      h.fetch_fds_from_exporter();  // pidfd_getfd: these are `h`'s own, closed with it
    }
    Allocator* a = get_or_create(device, fn);
    if (a == nullptr) return tls().code;
    ImportedMemory m = a->import_ipc(h);
    void* const p = m.get();
    const std::size_t n = m.size();
    {
      Imports& im = imports();
      std::lock_guard<std::mutex> lock(im.mu);
      im.open.emplace(std::make_pair(device, reinterpret_cast<std::uintptr_t>(p)), std::move(m));
    }
    *ptr = p;
    if (size != nullptr) *size = n;
    return EXPSEG_SUCCESS;
  } catch (...) {
    return fail_current(fn);
  }
}

int expseg_ipc_close(void* ptr, int device) noexcept {
  constexpr const char* fn = "expseg_ipc_close";
  if (ptr == nullptr) return EXPSEG_SUCCESS;
  if (!valid_device(device, fn)) return EXPSEG_ERROR_INVALID_DEVICE;
  try {
    ImportedMemory m;
    {
      Imports& im = imports();
      std::lock_guard<std::mutex> lock(im.mu);
      auto it = im.open.find(std::make_pair(device, reinterpret_cast<std::uintptr_t>(ptr)));
      if (it == im.open.end()) {
        char text[200];
        std::snprintf(text, sizeof text,
                      "pointer %p is not memory expseg_ipc_import mapped on device %d (not imported there, or "
                      "already closed)", ptr, device);
        set_error(EXPSEG_ERROR_INVALID_POINTER, fn, text);
        return EXPSEG_ERROR_INVALID_POINTER;
      }
      m = std::move(it->second);
      im.open.erase(it);
    }
    try {
      m.close();  // outside the lock: driver calls
    } catch (...) {
      // The synchronization before the unmap failed: the memory stays open (ImportedMemory::close)
      // and goes back to the table, for a later expseg_ipc_close.
      if (m.get() != nullptr) {
        Imports& im = imports();
        std::lock_guard<std::mutex> lock(im.mu);
        im.open.emplace(std::make_pair(device, reinterpret_cast<std::uintptr_t>(ptr)), std::move(m));
      }
      throw;
    }
    return EXPSEG_SUCCESS;
  } catch (...) {
    return fail_current(fn);
  }
}

const char* expseg_last_error(void) noexcept {
  // A copy in its own buffer: the message itself changes at the next failing call, the string
  // returned here only at the next expseg_last_error (see "Strings" in expseg.h).
  ThreadState& t = tls();
  try {
    return put(kLastErrorBuf, std::string(t.message));
  } catch (...) {
    return "";  // no memory for the copy
  }
}

int expseg_last_error_code(void) noexcept { return tls().code; }

void expseg_clear_error(void) noexcept {
  ThreadState& t = tls();
  t.code = EXPSEG_SUCCESS;
  t.message.clear();
}

const char* expseg_version(void) noexcept { return EXPSEG_VERSION_STRING; }

}  // extern "C"
