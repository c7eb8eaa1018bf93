// SimDriver: the simulated device (see sim_driver.hpp).
//
// Every public method takes Impl::mutex, so tests may call it from several threads. Each method
// checks everything first and changes state last; host system calls that can fail come before the
// bookkeeping, and are undone if a later step of the same call fails, so a call that throws has no
// effect.
#include "driver/sim_driver.hpp"

#include <fcntl.h>
#include <dirent.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <limits>
#include <stdexcept>
#include <thread>
#include <unordered_set>
#include <utility>

#ifndef MAP_FIXED_NOREPLACE
#define MAP_FIXED_NOREPLACE 0x100000  // Linux 4.17; older kernels take the address as a hint
#endif

namespace expseg::driver {
namespace {

constexpr int kInvalidValue = 1;
constexpr int kOutOfMemory = 2;
constexpr int kInvalidDevice = 101;
constexpr int kTooManyPeers = 711;  // CUDA_ERROR_TOO_MANY_PEERS
constexpr int kUnknown = 999;
constexpr dev_ptr kFirstFakeAddress = 0x100000000000;
// Bookkeeping mode: device d hands out addresses from its own span [kFirstFakeAddress + d * kDeviceSpan,
// + kDeviceSpan), so pointers of two simulated devices never coincide (as under CUDA's unified
// addressing) and a pointer of device 0 is foreign to device 1. 64 PiB per device; 255 devices fit.
// The SimDrivers of one device alive at once take slots of its span (kDriverSlot each, lowest free
// first), so that a pointer of one is foreign to the other, as under two CUDA contexts of one
// process, while each driver's addresses still follow from its own calls alone (a replay run
// beside the run it replays gets the same addresses, hence the same address-ordered choices).
// Past kDriverSlots drivers of one device at once, slots are shared (addresses may coincide).
constexpr dev_ptr kDeviceSpan = kSimAddressSpan;
constexpr int kMaxDevices = kSimMaxDevices;
static_assert(kFirstFakeAddress % kSimMaxGranularity == 0 && kDeviceSpan % kSimMaxGranularity == 0,
              "every device's span must start on a granule");
constexpr std::size_t kDriverSlots = 32;
constexpr dev_ptr kDriverSlot = kDeviceSpan / kDriverSlots;  // 2 PiB: an expandable segment's 1 PiB bound fits
static_assert(kDriverSlot % kSimMaxGranularity == 0, "every driver's slot must start on a granule");
// Host-backed mode: each SimDriver carves its reservations and cuMemAllocs from one PROT_NONE arena
// of its own, reserved at first use, so its addresses follow from its calls alone (not from ASLR or
// the process's other mappings) and a fixed-seed run replays exactly. The arena goes to a fixed
// slot of [32 TiB, 64 TiB) (above ASan's shadow, below PIE binaries and mmap's usual area): the
// device's own slot when free, so a driver alone in its process gets the same addresses every time.
// Drivers alive at once take further slots, and where no slot can be had (sanitizers that move
// fixed mappings, an old kernel) the arena goes wherever mmap puts it: still 1 TiB aligned, so
// only a constant offset differs.
constexpr std::uintptr_t kArenaRegion = std::uintptr_t{1} << 45;
constexpr std::size_t kArenaSlot = std::size_t{1} << 40;
constexpr std::size_t kArenaSlots = 32;
static_assert(kArenaSlot % kSimMaxGranularity == 0, "every arena must start on a granule");
constexpr int kFakeFdBase = 1 << 30;  // above any real fd limit: close() on it is a harmless EBADF
constexpr std::uint32_t kHandleMagic = 0x45534831;  // "ESH1": an exported physical handle
constexpr std::uint32_t kIpcMagic = 0x45534931;     // "ESI1": an exported cuMemAlloc pointer

std::atomic<std::uint64_t> g_next_instance{1};  // tells exported handles of two SimDrivers apart
// Bookkeeping mode: address space the SimDrivers of this process hold together (their ranges,
// rounded up to the granularity, guard granules not counted), as CUDA's devices share one address
// space. Invariant: the sum of every live Impl's address_space_held.
std::atomic<std::size_t> g_address_space_in_use{0};

// Bookkeeping mode: bit k of device d's word is set while a SimDriver of d holds slot k of its span.
// Never destroyed: a SimDriver held by a static object may outlive the process's other statics.
std::atomic<std::uint32_t>& driver_slots(int device) {
  static std::atomic<std::uint32_t>* const slots = new std::atomic<std::uint32_t>[kSimMaxDevices]{};
  return slots[device];
}
static_assert(kDriverSlots == 32, "one bit per slot in a 32-bit word");
// The lowest free slot of `device`'s span, taken; or, with every slot taken, one shared (owned: false).
struct DriverSlot {
  std::size_t index = 0;
  bool owned = false;
};
DriverSlot take_driver_slot(int device, std::uint64_t instance) noexcept {
  std::atomic<std::uint32_t>& word = driver_slots(device);
  std::uint32_t taken = word.load(std::memory_order_relaxed);
  while (taken != ~std::uint32_t{0}) {
    const auto k = static_cast<std::size_t>(std::countr_one(taken));
    if (word.compare_exchange_weak(taken, taken | (std::uint32_t{1} << k), std::memory_order_relaxed)) return {k, true};
  }
  return {static_cast<std::size_t>(instance % kDriverSlots), false};
}

std::string hex(std::uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string range(dev_ptr p, std::size_t bytes) {
  std::string s(1, '[');  // appended piecewise: g++ 12 warns falsely (-Wrestrict) on "[" + std::string
  s += hex(p);
  s += ", ";
  s += hex(p + bytes);
  s += ')';
  return s;
}

[[noreturn]] void invalid(const char* call, const std::string& what) {
  throw driver_error(call, kInvalidValue, "CUDA_ERROR_INVALID_VALUE", what);
}

[[noreturn]] void out_of_memory(const char* call, const std::string& what) {
  throw driver_error(call, kOutOfMemory, "CUDA_ERROR_OUT_OF_MEMORY", what);
}

[[noreturn]] void host_failure(const char* call, const char* syscall, int err) {
  const std::string what = std::string("simulated device: ") + syscall + " failed: " + std::strerror(err);
  if (err == ENOMEM) out_of_memory(call, what);
  throw driver_error(call, kUnknown, "CUDA_ERROR_UNKNOWN", what);
}

std::uintptr_t id_of(const void* p) noexcept { return reinterpret_cast<std::uintptr_t>(p); }

// Streams as CUDA tells them apart: CU_STREAM_LEGACY (0x1) is the legacy default stream (0), and
// CU_STREAM_PER_THREAD (0x2) names the calling thread's own per-thread stream, a different one in
// each host thread (ids with kPerThreadStreamBit, never a created stream's).
constexpr std::uintptr_t kPerThreadStreamBit = std::uintptr_t{1} << 62;
std::uintptr_t stream_of(const void* p) noexcept {
  const std::uintptr_t v = id_of(p);
  if (v == 1) return 0;
  if (v != 2) return v;
  static std::atomic<std::uintptr_t> next_thread{1};
  thread_local const std::uintptr_t mine = kPerThreadStreamBit | next_thread.fetch_add(1, std::memory_order_relaxed);
  return mine;
}
void* as_pointer(std::uintptr_t id) noexcept { return reinterpret_cast<void*>(id); }

// --- latency model: H200 medians, µs, interpolated linearly in log(size) ---------------------
// Measured on an H200 (driver 580) with plain memory. expandable creates its memory GPUDirect RDMA
// capable where the device supports it (H100, H200), which costs ~4.4 µs more a map and ~4 µs more
// an unmap there (benchmarks/PERFORMANCE.md, an H100): modelled times are that much lower.
constexpr double kMiB = 1024.0 * 1024.0;
constexpr std::array<double, 5> kTableSizes = {2 * kMiB, 20 * kMiB, 64 * kMiB, 512 * kMiB, 2048 * kMiB};
constexpr std::array<double, 5> kCreateUs = {8.1, 8.1, 8.7, 27.3, 98.9};
constexpr std::array<double, 5> kMapUs = {0.7, 0.7, 0.7, 0.8, 1.1};
constexpr std::array<double, 5> kSetAccessUs = {35.9, 36.0, 36.8, 50.3, 94.6};
constexpr std::array<double, 5> kUnmapUs = {22.0, 22.1, 22.5, 27.1, 42.1};
constexpr std::array<double, 5> kReleaseUs = {10.2, 19.3, 37.7, 168.6, 624.8};
// cuMemAlloc/cuMemFree were measured small (taken at the table's smallest size) and at 1 GiB;
// cuMemAlloc at 16 GiB is split_merge's first 16 GiB on the H200 (694 µs, PERFORMANCE.md; its
// bookkeeping is ~5 µs of it): the 1 GiB figure held beyond 1 GiB modelled a 16 GiB growth as 91 µs.
// The points between them follow a line in bytes (the cost grows with the pages set up), which
// the log interpolation below would bend. cuMemFree beyond 1 GiB is unmeasured and stays at the
// 1 GiB figure (an underestimate).
constexpr std::array<double, 6> kAllocSizes = {2 * kMiB, 1024 * kMiB, 2048 * kMiB, 4096 * kMiB, 8192 * kMiB, 16384 * kMiB};
constexpr std::array<double, 6> kMemAllocUs = {33.0, 91.0, 131.0, 211.0, 370.0, 690.0};
constexpr std::array<double, 6> kMemFreeUs = {29.0, 336.0, 336.0, 336.0, 336.0, 336.0};
constexpr double kReserveUs = 24.0;
constexpr double kEventUs = 0.5;
constexpr double kSyncUs = 5.0;
// cuStreamGetCaptureInfo / cuStreamGetFlags: 15-24 ns measured (the figures in backend.hpp and
// expandable.cpp), against µs for the calls above.
constexpr double kStreamQueryUs = 0.02;

template <std::size_t N>
double interpolate_us(const std::array<double, N>& sizes, const std::array<double, N>& us, std::size_t bytes) {
  const double b = static_cast<double>(bytes);
  if (b <= sizes.front()) return us.front();
  if (b >= sizes.back()) return us.back();
  std::size_t i = 1;
  while (sizes[i] < b) ++i;
  const double t = (std::log(b) - std::log(sizes[i - 1])) / (std::log(sizes[i]) - std::log(sizes[i - 1]));
  return us[i - 1] + t * (us[i] - us[i - 1]);
}

}  // namespace

struct SimDriver::Impl {
  // A physical allocation. Invariant: refs = handles naming it + mappings of it; it (and its bytes
  // in `physical`) lives while refs > 0, as CUDA keeps released-but-mapped memory until unmapped.
  struct Phys {
    std::size_t size = 0;
    int fd = -1;  // host-backed: the memfd holding the data
    std::size_t refs = 0;
    bool exported_fd = false;  // export_handle gave out a POSIX descriptor of it
  };
  // Host-backed: memory exported as a POSIX descriptor whose last handle and mapping are gone. CUDA
  // frees it only once the descriptors are closed too (cuMemRelease): while one is open, the memfd
  // lives with it, its bytes stay in `physical`, and import_handle through it finds the memory
  // again (revive). Dropped (and the bytes freed) once no descriptor of this process names it.
  struct ReleasedExport {
    std::size_t size = 0;
    dev_t dev = 0;
    ino_t ino = 0;
  };
  // One map() call. Invariant: mappings are disjoint, each inside one reservation; access has one
  // flag per granule (set_access may cover part of a mapping).
  struct Mapping {
    std::size_t size = 0;
    std::uint64_t phys = 0;
    std::vector<bool> access;
    std::vector<int> granted;  // devices any set_access over (part of) it granted, in grant order
  };
  struct Alloc {
    std::size_t size = 0;       // as requested (counted in `physical`)
    std::size_t host_size = 0;  // host-backed: the mmap'ed length
    std::size_t ipc_opens = 0;
    // Unique per cuMemAlloc (from next_id), in its IPC export: a new allocation at a freed one's
    // address exports other bytes and the old export opens nothing, as cuIpcGetMemHandle promises.
    std::uint64_t id = 0;
  };
  struct Event {
    bool pending = false;  // !waits_for.empty()
    std::uintptr_t stream = 0;
    // The busy streams whose work up to `seq` it waits for: its own stream, and on the legacy
    // stream every busy blocking stream.
    std::vector<std::uintptr_t> waits_for;
    std::uint64_t seq = 0;  // order of recording, across streams
    bool captured = false;  // last recorded on a capturing stream: no query or sync may wait for it
    std::uint64_t capture_id = 0;  // that capture's id (captured)
  };

  // The host arena's size: room for the expandable backend's default reservations (2x the device
  // each) on several streams and the cuMemAllocs of a full device, with their guard granules.
  static std::size_t arena_bytes(const SimOptions& o) noexcept {
    constexpr std::size_t kMax = kArenaSlots * kArenaSlot;
    if (o.capacity >= kMax / 16 || o.granularity >= kMax / 64) return kMax;
    const std::size_t want = std::max({kArenaSlot, 16 * o.capacity, 64 * o.granularity});
    return (want + kArenaSlot - 1) / kArenaSlot * kArenaSlot;
  }

  explicit Impl(const SimOptions& o)
      : opt(o), instance(g_next_instance.fetch_add(1)),
        slot(o.host_backed ? DriverSlot{} : take_driver_slot(o.device, instance)),
        next_address(kFirstFakeAddress + static_cast<dev_ptr>(o.device) * kDeviceSpan + slot.index * kDriverSlot),
        address_end(next_address + kDriverSlot) {}
  ~Impl() {
    g_address_space_in_use.fetch_sub(address_space_held, std::memory_order_relaxed);  // leaked ranges too
    if (slot.owned) driver_slots(opt.device).fetch_and(~(std::uint32_t{1} << slot.index), std::memory_order_relaxed);
  }

  const SimOptions opt;
  const std::uint64_t instance;
  mutable std::mutex mutex;

  std::array<std::uint64_t, kOpCount> calls{};
  std::map<std::pair<std::size_t, std::uint64_t>, Fault> faults;  // (op, absolute call number)
  double seconds = 0;
  std::array<double, kOpCount> op_seconds{};  // the latency model's time, per operation
  std::size_t last_op = 0;                     // the call being charged (set by enter)

  std::uint64_t next_id = 1;  // handles, physical allocations, cuMemAllocs, events and streams: never reused
  const DriverSlot slot;  // bookkeeping mode: this driver's slot of its device's span
  dev_ptr next_address;  // bookkeeping mode: the next free address of this driver's slot
  const dev_ptr address_end;
  // Bookkeeping mode: ranges given back below next_address (cuMemAddressFree, cuMemFree), start ->
  // length with the guard granule, merged: taken again first fit, as the driver reuses freed
  // address ranges (a process can reserve and free ranges for ever; it would run out otherwise).
  std::map<dev_ptr, std::size_t> freed_addresses;
  // Host-backed mode: the arena (0 until first use) and the ranges taken in it, start -> length
  // with the guard granule. Free parts of the arena are PROT_NONE anonymous memory, never unmapped,
  // so no other mapping of the process can land in it.
  dev_ptr arena = 0;
  std::size_t arena_size = 0;
  std::map<dev_ptr, std::size_t> taken;
  // Host-backed mode: ranges the arena had no room for, each mapped on its own (start -> length).
  std::map<dev_ptr, std::size_t> outside;
  std::size_t foreign = 0;
  std::size_t physical = 0;  // bytes of live Phys + live Allocs + released_exports

  std::map<dev_ptr, std::size_t> reservations;  // base -> size; disjoint
  std::unordered_map<std::uint64_t, Phys> phys;
  std::unordered_map<std::uint64_t, ReleasedExport> released_exports;
  std::unordered_map<phys_handle, std::uint64_t> handles;  // handle -> phys id
  std::map<dev_ptr, Mapping> mappings;                      // start -> mapping
  std::map<dev_ptr, Alloc> allocs;                          // cuMemAlloc pointers
  // Any stream value is accepted where work is queued (the default stream, streams of the program
  // or of a replayed trace); only those from stream_create() count as live and may be destroyed.
  std::unordered_set<std::uintptr_t> created_streams;
  // Ids are never reused: a sync of a destroyed stream fails (on CUDA 13 it failed with
  // CUDA_ERROR_INVALID_CONTEXT once and crashed the next time), so tests see every such call.
  std::unordered_set<std::uintptr_t> destroyed_streams;
  std::unordered_set<std::uintptr_t> busy_streams;
  std::unordered_set<std::uintptr_t> blocking_streams;  // from stream_create_blocking(), live or destroyed
  // Blocking streams: the legacy stream's work waits for theirs (measured on the H200: a
  // synchronization of the legacy stream, or of an event recorded on it, waits for another
  // thread's per-thread stream and for a stream created with flags 0, not for a non-blocking one).
  // stream_create() makes non-blocking streams, as the CUDA driver layer does; other stream values
  // (a replayed trace's) are taken as non-blocking, so that the legacy stream never hides an unmap
  // under their queued work.
  bool is_blocking(std::uintptr_t stream) const noexcept {
    return stream == 0 || (stream & kPerThreadStreamBit) != 0 || blocking_streams.contains(stream);
  }
  std::unordered_map<std::uintptr_t, Event> events;
  std::uint64_t record_seq = 0;
  // Work queued on busy streams that uses device memory (queue_use), until the stream's work up to
  // it completes; an unmap under it is a hazard (on a GPU the work would fault or read other data).
  struct Use {
    std::uintptr_t stream = 0;
    std::uint64_t seq = 0;
    dev_ptr lo = 0;
    dev_ptr hi = 0;
  };
  std::vector<Use> uses;
  std::vector<std::string> hazards;
  // Stream capture: memsets queued on a capturing stream are recorded, not run. The CUDA driver
  // layer makes cuMemAlloc, cuMemFree, event queries and stream synchronizations in relaxed capture
  // mode, where the H200 permits them while another stream captures; what no mode permits fails
  // here as there (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED or CUDA_ERROR_CAPTURED_EVENT) and
  // invalidates every capture: cuCtxSynchronize, a synchronization of a capturing stream or of the
  // legacy stream (CUDA refuses it while a blocking stream captures; the simulator treats every
  // capturing stream as one), a query or synchronization of an event recorded during a capture.
  struct Memset {
    dev_ptr ptr = 0;
    std::uint32_t value = 0;
    std::size_t count = 0;
  };
  struct Capture {
    std::uint64_t id = 0;
    bool invalidated = false;
    std::vector<Memset> work;
    Driver::CaptureMode mode = Driver::CaptureMode::global;
    std::thread::id thread;  // the thread that began it (thread-local mode restricts only that one)
  };
  std::unordered_map<std::uintptr_t, Capture> captures;  // stream -> its capture
  // A stream that joined a capture (stream_wait_event on an event recorded inside it) -> the stream
  // that began the capture; until that capture ends.
  std::unordered_map<std::uintptr_t, std::uintptr_t> forks;
  Capture* capture_of(std::uintptr_t stream) {
    if (auto it = captures.find(stream); it != captures.end()) return &it->second;
    if (auto f = forks.find(stream); f != forks.end()) return &captures.at(f->second);
    return nullptr;
  }
  std::uint64_t next_capture_id = 1;
  std::unordered_map<std::uintptr_t, std::vector<Memset>> graphs;  // executable graphs

  void refuse_while_capturing(const char* call) {
    if (captures.empty()) return;
    invalidate_captures();
    throw driver_error(call, 900, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
                       "operation not permitted when stream is capturing (the capture is invalidated)");
  }
  void invalidate_captures() noexcept {
    for (auto& [stream, c] : captures) c.invalidated = true;
  }
  // An "unsafe" call the capture modes restrict (cuGraphInstantiate): refused while a capture in
  // global mode is underway, or one in thread-local mode that the calling thread began; those
  // captures are invalidated.
  void refuse_unsafe(const char* call) {
    bool refused = false;
    for (auto& [stream, c] : captures) {
      if (c.mode == Driver::CaptureMode::global ||
          (c.mode == Driver::CaptureMode::thread_local_mode && c.thread == std::this_thread::get_id())) {
        c.invalidated = true;
        refused = true;
      }
    }
    if (refused)
      throw driver_error(call, 900, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
                         "operation not permitted when stream is capturing (the capture is invalidated)");
  }
  // A synchronization of `stream`: refused while it captures, and for the legacy stream while a
  // blocking stream captures (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT on the H200).
  void refuse_sync_of_capturing(const char* call, std::uintptr_t stream) {
    if (stream == 0) return refuse_implicit(call);
    if (capture_of(stream) != nullptr) refuse_while_capturing(call);
  }
  // Work on the legacy stream (an event record, a synchronization) while a blocking stream captures:
  // it would join the capture, which no mode permits.
  void refuse_implicit(const char* call) {
    bool blocking = std::any_of(forks.begin(), forks.end(), [&](const auto& f) { return is_blocking(f.first); });
    for (const auto& [stream, c] : captures) blocking = blocking || is_blocking(stream);
    if (!blocking) return;
    invalidate_captures();
    throw driver_error(call, 906, "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
                       "operation would make the legacy stream depend on a capturing blocking stream (the capture is invalidated)");
  }
  // The streams work queued now on `stream` waits for, among the busy ones, into `out` (its
  // capacity kept: an event recorded again takes no memory).
  void busy_dependencies(std::uintptr_t stream, std::vector<std::uintptr_t>& out) const {
    out.clear();
    if (stream != 0) {
      if (busy_streams.contains(stream)) out.push_back(stream);
      return;
    }
    for (std::uintptr_t b : busy_streams)
      if (is_blocking(b)) out.push_back(b);
  }
  // An event last recorded in a capture: while that capture is underway, 907 (and every capture is
  // invalidated); once it has ended (into a graph or invalidated), CUDA_ERROR_INVALID_VALUE, until
  // the event is recorded again outside a capture. Measured on the H200 (driver 580), every mode.
  void refuse_captured_event(const char* call, const Event& ev) {
    if (!ev.captured) return;
    const bool underway = std::any_of(captures.begin(), captures.end(), [&](const auto& c) { return c.second.id == ev.capture_id; });
    if (!underway)
      throw driver_error(call, 1, "CUDA_ERROR_INVALID_VALUE", "the event was last recorded in a capture that has ended");
    invalidate_captures();
    throw driver_error(call, 907, "CUDA_ERROR_CAPTURED_EVENT",
                       "operation not permitted on an event last recorded in a capturing stream");
  }
  std::vector<int> peers;          // add_access_device: what set_access grants
  std::vector<int> context_peers;  // enable_context_peer (cuCtxEnablePeerAccess)

  std::size_t gran() const noexcept { return opt.granularity; }

  // Bookkeeping mode: this driver's share of the process's address space (g_address_space_in_use).
  std::size_t address_space_held = 0;
  // Takes `bytes` of the process's address space, or throws CUDA_ERROR_OUT_OF_MEMORY (nothing taken)
  // when the simulated devices of the process would then hold more than opt.address_space.
  void take_address_space(const char* call, std::size_t bytes) {
    std::size_t used = g_address_space_in_use.load(std::memory_order_relaxed);
    do {
      if (bytes > opt.address_space || used > opt.address_space - bytes)
        out_of_memory(call, "out of address space: " + std::to_string(bytes) + " bytes requested while the simulated devices "
                                "of this process hold " + std::to_string(used) + " of the " + std::to_string(opt.address_space) +
                                " bytes a process may reserve (SimOptions::address_space; a CUDA process has about 2^47)");
    } while (!g_address_space_in_use.compare_exchange_weak(used, used + bytes, std::memory_order_relaxed));
    address_space_held += bytes;
  }
  void give_address_space(std::size_t bytes) noexcept {
    g_address_space_in_use.fetch_sub(bytes, std::memory_order_relaxed);
    address_space_held -= bytes;
  }

  // Bookkeeping mode: the next `bytes` of this device's address span, granularity-aligned and
  // followed by a one-granule guard gap (no two ranges touch), taken from the process's address
  // space. Freed ranges are taken again, first fit.
  dev_ptr take_addresses(const char* call, std::size_t bytes) {
    const std::size_t g = gran();
    const std::size_t span = bytes / g * g + (bytes % g ? g : 0);
    take_address_space(call, span);
    try {
      return take_span(call, span);
    } catch (...) {
      give_address_space(span);
      throw;
    }
  }
  dev_ptr take_span(const char* call, std::size_t span) {
    const std::size_t g = gran();
    for (auto it = freed_addresses.begin(); it != freed_addresses.end(); ++it) {
      if (it->second < span + g) continue;
      const dev_ptr base = it->first;
      const std::size_t rest = it->second - (span + g);
      if (rest != 0) freed_addresses.emplace_hint(std::next(it), base + span + g, rest);  // may throw: nothing changed
      freed_addresses.erase(it);
      return base;
    }
    const dev_ptr base = (next_address + g - 1) & ~static_cast<dev_ptr>(g - 1);
    if (base >= address_end || span > address_end - base || address_end - base - span < g)
      out_of_memory(call, "the address space of simulated device " + std::to_string(opt.device) + " is exhausted");
    next_address = base + span + g;
    return base;
  }

  // Gives back what take_addresses(bytes) returned at `base`. Never throws: a range that cannot be
  // recorded (no memory for the map node) is simply not reused.
  void give_addresses(dev_ptr base, std::size_t bytes) noexcept {
    const std::size_t g = gran();
    give_address_space(bytes / g * g + (bytes % g ? g : 0));
    std::size_t len = (bytes / g * g + (bytes % g ? g : 0)) + g;
    auto next = freed_addresses.lower_bound(base);
    if (next != freed_addresses.end() && next->first == base + len) {  // merge with the range above
      len += next->second;
      next = freed_addresses.erase(next);
    }
    if (next != freed_addresses.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == base) {  // and with the one below
        prev->second += len;
        base = prev->first;
        len = prev->second;
        freed_addresses.erase(prev);
      }
    }
    if (base + len == next_address) {  // the top of what was taken: taken no more
      next_address = base;
      return;
    }
    try {
      freed_addresses.emplace(base, len);
    } catch (...) {
    }
  }

  // Host-backed mode: reserves the arena (once). Throws CUDA_ERROR_OUT_OF_MEMORY if the host has no
  // room for it.
  void make_arena(const char* call) {
    if (arena != 0) return;
    const std::size_t size = arena_bytes(opt);
    const int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
    for (std::size_t k = 0; k < kArenaSlots; ++k) {
      const std::size_t slot = (static_cast<std::size_t>(opt.device) + k) % kArenaSlots;
      if (size > (kArenaSlots - slot) * kArenaSlot) continue;
      void* want = reinterpret_cast<void*>(kArenaRegion + slot * kArenaSlot);
      void* p = ::mmap(want, size, PROT_NONE, flags | MAP_FIXED_NOREPLACE, -1, 0);
      if (p == want) {
        arena = reinterpret_cast<std::uintptr_t>(p);
        arena_size = size;
        return;
      }
      if (p != MAP_FAILED) ::munmap(p, size);  // a kernel before 4.17 took the address as a hint
      else if (errno != EEXIST) break;          // not a slot taken by another driver: look no further
    }
    // Anywhere, aligned like a slot; under an address space limit (ulimit -v), smaller and aligned
    // to the granularity, down to 64 granules. The excess on both sides is trimmed.
    std::size_t want = size, align = kArenaSlot;
    for (;;) {
      void* p = ::mmap(nullptr, want + align, PROT_NONE, flags, -1, 0);
      if (p != MAP_FAILED) {
        const auto raw = reinterpret_cast<std::uintptr_t>(p);
        const std::uintptr_t base = (raw + align - 1) & ~static_cast<std::uintptr_t>(align - 1);
        if (base > raw) ::munmap(p, base - raw);
        ::munmap(reinterpret_cast<void*>(base + want), raw + align - base);
        arena = base;
        arena_size = want;
        return;
      }
      const int err = errno;
      if (err != ENOMEM || want / 2 < 64 * gran()) host_failure(call, "mmap (the simulated device's address arena)", err);
      want = want / 2 / gran() * gran();
      align = gran();
    }
  }
  // Host-backed mode: `bytes` of PROT_NONE address space, granularity-aligned. Normally the lowest
  // range of the arena with room for it and a one-granule guard gap after it (as in bookkeeping
  // mode): freed ranges are reused, lowest first, so the same calls give the same addresses. The
  // caller records it in `taken` once the call succeeds. Only when the arena has no room (a
  // reservation of terabytes) is it mapped on its own, where mmap puts it (`own` is set; the caller
  // records it in `outside`, or unmaps it if the call fails).
  dev_ptr place(const char* call, std::size_t bytes, bool& own) {
    make_arena(call);
    own = false;
    if (bytes <= arena_size - gran()) {
      const std::size_t span = arena_span(bytes);
      dev_ptr cur = arena;
      for (const auto& [start, length] : taken) {
        if (start - cur >= span) break;
        cur = start + length;
      }
      if (arena + arena_size - cur >= span) return cur;
    }
    const std::size_t g = gran();
    if (bytes > std::numeric_limits<std::size_t>::max() - g) out_of_memory(call, "reservation too large");
    void* p = ::mmap(nullptr, bytes + g, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) host_failure(call, "mmap", errno);
    const auto raw = reinterpret_cast<std::uintptr_t>(p);
    const std::uintptr_t base = (raw + g - 1) & ~static_cast<std::uintptr_t>(g - 1);
    if (base > raw) ::munmap(p, base - raw);
    ::munmap(reinterpret_cast<void*>(base + bytes), raw + g - base);
    own = true;
    return base;
  }
  // Host-backed mode: records what place() gave.
  void record(dev_ptr base, std::size_t bytes, bool own) {
    if (!own) {
      taken.emplace(base, arena_span(bytes));
      return;
    }
    try {
      outside.emplace(base, bytes);
    } catch (...) {
      ::munmap(reinterpret_cast<void*>(static_cast<std::uintptr_t>(base)), bytes);
      throw;
    }
  }
  // Host-backed mode: undoes place() and record(); false (errno set) if the host refused.
  bool forget(dev_ptr base) noexcept {
    if (auto o = outside.find(base); o != outside.end()) {
      if (::munmap(reinterpret_cast<void*>(static_cast<std::uintptr_t>(base)), o->second) != 0) return false;
      outside.erase(o);
      return true;
    }
    auto t = taken.find(base);
    if (t == taken.end()) return true;
    if (!clear_host(base, t->second - gran())) return false;
    taken.erase(t);
    return true;
  }
  // Host-backed: [ptr, ptr+bytes) of the arena becomes fresh PROT_NONE anonymous memory again.
  static bool clear_host(dev_ptr ptr, std::size_t bytes) noexcept {
    return ::mmap(reinterpret_cast<void*>(static_cast<std::uintptr_t>(ptr)), bytes, PROT_NONE,
                  MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0) != MAP_FAILED;
  }
  std::size_t arena_span(std::size_t bytes) const noexcept {
    const std::size_t g = gran();
    return (bytes / g * g + (bytes % g ? g : 0)) + g;
  }

  // Counts the call; throws the injected fault if this is the call it was aimed at.
  void enter(Op op, const char* call) {
    const auto index = static_cast<std::size_t>(op);
    const std::uint64_t n = ++calls[index];
    last_op = index;
    if (faults.empty()) return;
    auto it = faults.find({index, n});
    if (it == faults.end()) return;
    const Fault fault = it->second;
    faults.erase(it);
    if (fault == Fault::out_of_memory)
      out_of_memory(call, "out of memory (fault injected by the simulated device)");
    throw driver_error(call, kUnknown, "CUDA_ERROR_UNKNOWN", "fault injected by the simulated device");
  }
  void charge(double us) noexcept {
    if (!opt.latency_model) return;
    seconds += us * 1e-6;
    op_seconds[last_op] += us * 1e-6;
  }
  // charge() of a latency table's figure for `bytes`; the interpolation (three logarithms) runs
  // only when the model is on.
  template <std::size_t N>
  void charge_table(const std::array<double, N>& sizes, const std::array<double, N>& us, std::size_t bytes) noexcept {
    if (opt.latency_model) charge(interpolate_us(sizes, us, bytes));
  }

  void check_granular(const char* call, const char* what, std::uint64_t value) const {
    if (value % gran() != 0)
      invalid(call, std::string(what) + " " + hex(value) + " is not a multiple of the granularity " + hex(gran()));
  }
  void check_range(const char* call, dev_ptr ptr, std::size_t bytes) const {
    if (bytes == 0) invalid(call, "size is 0");
    check_granular(call, "address", ptr);
    check_granular(call, "size", bytes);
    if (bytes > std::numeric_limits<dev_ptr>::max() - ptr) invalid(call, "range " + hex(ptr) + " + " + hex(bytes) + " wraps around");
  }
  void check_capacity(const char* call, std::size_t bytes) const {
    const std::size_t avail = opt.capacity > foreign ? opt.capacity - foreign : 0;
    if (bytes > avail || physical > avail - bytes)
      out_of_memory(call, "out of memory: " + std::to_string(bytes) + " bytes requested, " +
                              std::to_string(avail > physical ? avail - physical : 0) + " of " +
                              std::to_string(opt.capacity) + " bytes free on the simulated device (" +
                              std::to_string(physical) + " in use, " + std::to_string(foreign) +
                              " used by other processes)");
  }

  // The mapping containing addr, or mappings.end().
  std::map<dev_ptr, Mapping>::iterator mapping_at(dev_ptr addr) {
    auto it = mappings.upper_bound(addr);
    if (it == mappings.begin()) return mappings.end();
    --it;
    return addr < it->first + it->second.size ? it : mappings.end();
  }
  std::map<dev_ptr, Mapping>::const_iterator mapping_at(dev_ptr addr) const {
    return const_cast<Impl*>(this)->mapping_at(addr);
  }
  // Whether [ptr, ptr+bytes) is covered by mappings without a gap.
  bool fully_mapped(dev_ptr ptr, std::size_t bytes) const {
    const dev_ptr end = ptr + bytes;
    auto it = mapping_at(ptr);
    dev_ptr cur = ptr;
    while (cur < end) {
      if (it == mappings.end() || it->first > cur) return false;
      cur = it->first + it->second.size;
      ++it;
    }
    return true;
  }
  bool accessible(dev_ptr ptr, std::size_t bytes) const {
    if (bytes == 0) return true;
    if (bytes > std::numeric_limits<dev_ptr>::max() - ptr) return false;
    const dev_ptr end = ptr + bytes;
    auto a = allocs.upper_bound(ptr);
    if (a != allocs.begin()) {
      --a;
      if (end <= a->first + a->second.size) return true;
    }
    auto it = mapping_at(ptr);
    dev_ptr cur = ptr;
    while (cur < end) {
      if (it == mappings.end() || it->first > cur) return false;
      const dev_ptr stop = std::min<dev_ptr>(end, it->first + it->second.size);
      for (dev_ptr g = (cur - it->first) / gran(); it->first + g * gran() < stop; ++g)
        if (!it->second.access[g]) return false;
      cur = stop;
      ++it;
    }
    return true;
  }
  // Host-backed data access: the range as host memory, after checking it like the GPU would fault.
  unsigned char* data(const char* call, dev_ptr ptr, std::size_t bytes) const {
    if (!opt.host_backed)
      invalid(call, "data access needs a host-backed simulated device (sim_host_backed / SimOptions::host_backed)");
    if (!accessible(ptr, bytes))
      invalid(call, "range " + range(ptr, bytes) + " is not mapped and accessible (an illegal access on the GPU)");
    return reinterpret_cast<unsigned char*>(static_cast<std::uintptr_t>(ptr));
  }

  void unref(std::uint64_t id) noexcept {
    auto it = phys.find(id);
    if (--it->second.refs != 0) return;
    bool kept = false;  // still in use through an exported descriptor
    if (it->second.fd >= 0) {
      struct stat st {};
      if (it->second.exported_fd && ::fstat(it->second.fd, &st) == 0) {
        try {
          released_exports[id] = ReleasedExport{it->second.size, st.st_dev, st.st_ino};
          kept = true;
        } catch (...) {
          // No host memory to remember it: the memory goes now, as without an export.
        }
      }
      ::close(it->second.fd);
    }
    if (!kept) physical -= it->second.size;
    phys.erase(it);
  }
  // Frees the released exports no open descriptor of this process names any more (closed without
  // an import): CUDA frees such memory at the last close, which the simulator cannot see happen.
  // Where /proc/self/fd cannot be read, they are kept (counted as in use).
  void drop_closed_exports() noexcept {
    if (released_exports.empty()) return;
    const int dir = ::open("/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir < 0) return;
    DIR* d = ::fdopendir(dir);
    if (d == nullptr) {
      ::close(dir);
      return;
    }
    std::unordered_map<std::uint64_t, bool> open_ids;  // released export -> a descriptor names it
    try {
      for (const auto& [id, r] : released_exports) open_ids.emplace(id, false);
    } catch (...) {
      ::closedir(d);
      return;  // no memory to check: keep them all
    }
    while (const dirent* e = ::readdir(d)) {
      if (e->d_name[0] == '.') continue;
      struct stat st {};
      if (::fstatat(dir, e->d_name, &st, 0) != 0) continue;  // follows the link: the file itself
      for (auto& [id, seen] : open_ids) {
        const ReleasedExport& r = released_exports.at(id);
        if (r.dev == st.st_dev && r.ino == st.st_ino) seen = true;
      }
    }
    ::closedir(d);
    for (const auto& [id, seen] : open_ids) {
      if (seen) continue;
      auto r = released_exports.find(id);
      physical -= r->second.size;
      released_exports.erase(r);
    }
  }
  // The released memory `fd` still names (ReleasedExport), back in `phys` with no reference yet;
  // phys.end() when `fd` does not name it (closed, or another file).
  std::unordered_map<std::uint64_t, Phys>::iterator revive(const char* call, std::uint64_t id, int fd) {
    auto r = released_exports.find(id);
    struct stat got {};
    if (r == released_exports.end() || ::fstat(fd, &got) != 0 || got.st_dev != r->second.dev || got.st_ino != r->second.ino)
      return phys.end();
    const int own = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (own < 0) host_failure(call, "fcntl(F_DUPFD_CLOEXEC)", errno);
    try {
      auto it = phys.emplace(id, Phys{r->second.size, own, 0, true}).first;
      released_exports.erase(r);  // its bytes never left `physical`: on CUDA it never stopped being used
      return it;
    } catch (...) {
      ::close(own);
      throw;
    }
  }
  Event& event(const char* call, event_t e) {
    auto it = events.find(id_of(e));
    if (it == events.end()) invalid(call, "unknown event " + hex(id_of(e)));
    return it->second;
  }
  // Completes the work of `stream` queued up to `seq` (all streams when stream is null): events
  // waiting for it, and its uses.
  void complete(const std::uintptr_t* stream, std::uint64_t seq) noexcept {
    for (auto& [id, ev] : events) {
      if (!ev.pending || ev.seq > seq) continue;
      if (stream == nullptr) ev.waits_for.clear();
      else std::erase(ev.waits_for, *stream);
      ev.pending = !ev.waits_for.empty();
    }
    std::erase_if(uses, [&](const Use& u) { return (stream == nullptr || u.stream == *stream) && u.seq <= seq; });
  }
  // An unmap of [lo, hi) while queued work still uses part of it: recorded, not refused (CUDA does
  // not refuse it either), so that a test sees every one.
  void check_unused(const char* call, dev_ptr lo, dev_ptr hi) {
    for (const Use& u : uses)
      if (u.lo < hi && lo < u.hi)
        hazards.push_back(std::string(call) + " of " + range(lo, hi - lo) + " while work queued on stream " + hex(u.stream) +
                          " still uses " + range(u.lo, u.hi - u.lo));
  }

  // Exported bytes: the magic at 0, the exporting driver's instance at 8, `value` (a physical
  // allocation's id, or a cuMemAlloc pointer) at 16, `alloc_id` (IPC: the allocation's Alloc::id) at 24.
  void encode(ExportedHandle& out, std::uint32_t magic, std::uint64_t value, std::uint64_t alloc_id = 0) const noexcept {
    std::memcpy(out.bytes.data(), &magic, sizeof magic);
    std::memcpy(out.bytes.data() + 8, &instance, sizeof instance);
    std::memcpy(out.bytes.data() + 16, &value, sizeof value);
    std::memcpy(out.bytes.data() + 24, &alloc_id, sizeof alloc_id);
  }
  static std::uint64_t encoded_alloc_id(const ExportedHandle& in) noexcept {
    std::uint64_t id = 0;
    std::memcpy(&id, in.bytes.data() + 24, sizeof id);
    return id;
  }
  std::uint64_t decode(const char* call, const ExportedHandle& in, std::uint32_t magic) const {
    std::uint32_t m = 0;
    std::uint64_t inst = 0, value = 0;
    std::memcpy(&m, in.bytes.data(), sizeof m);
    std::memcpy(&inst, in.bytes.data() + 8, sizeof inst);
    std::memcpy(&value, in.bytes.data() + 16, sizeof value);
    if (m != magic) invalid(call, "not a handle exported by a simulated device");
    if (inst != instance) invalid(call, "the handle was exported by another simulated device (only in-process, same-device import is simulated)");
    return value;
  }

  void release_host_resources() noexcept {
    if (!opt.host_backed) return;
    if (arena != 0) ::munmap(reinterpret_cast<void*>(arena), arena_size);  // reservations, mappings, cuMemAllocs
    for (auto& [base, size] : outside) ::munmap(reinterpret_cast<void*>(base), size);
    for (auto& [id, p] : phys)
      if (p.fd >= 0) ::close(p.fd);
  }
};

SimDriver::SimDriver(const SimOptions& options) : options_(options) {
  const long page = ::sysconf(_SC_PAGESIZE);
  const std::size_t g = options.granularity;
  if (options.capacity == 0) throw std::invalid_argument("SimOptions::capacity must be > 0");
  if (g == 0 || (g & (g - 1)) != 0)
    throw std::invalid_argument("SimOptions::granularity must be a power of two (got " + std::to_string(g) + ")");
  if (g > kSimMaxGranularity)
    throw std::invalid_argument("SimOptions::granularity must be at most " + std::to_string(kSimMaxGranularity) + " (got " +
                                std::to_string(g) + ")");
  if (page > 0 && g % static_cast<std::size_t>(page) != 0)
    throw std::invalid_argument("SimOptions::granularity must be a multiple of the host page size " +
                                std::to_string(page) + " (got " + std::to_string(g) + ")");
  if (options.device_count < 1) throw std::invalid_argument("SimOptions::device_count must be >= 1");
  if (options.device < 0 || options.device >= options.device_count)
    throw std::invalid_argument("SimOptions::device must be in [0, device_count)");
  if (options.device >= kMaxDevices)
    throw std::invalid_argument("SimOptions::device must be below " + std::to_string(kMaxDevices) +
                                " (each simulated device has its own address span)");
  impl_ = std::make_unique<Impl>(options);
}

SimDriver::~SimDriver() { impl_->release_host_resources(); }

std::string SimDriver::device_name() const {
  char buf[96];
  std::snprintf(buf, sizeof buf, "expseg simulated device %d (%.1f GiB, %s)", options_.device,
                static_cast<double>(options_.capacity) / (1024.0 * 1024.0 * 1024.0),
                options_.host_backed ? "host-backed" : "bookkeeping");
  return buf;
}

MemInfo SimDriver::mem_info() {
  std::lock_guard lock(impl_->mutex);
  impl_->drop_closed_exports();
  const std::size_t used = std::min(options_.capacity, impl_->physical + std::min(impl_->foreign, options_.capacity));
  return {options_.capacity - used, options_.capacity};
}

// --- virtual memory management -----------------------------------------------------------------

dev_ptr SimDriver::reserve(std::size_t bytes) {
  static constexpr const char* call = "cuMemAddressReserve";
  std::lock_guard lock(impl_->mutex);
  Impl& s = *impl_;
  s.enter(Op::reserve, call);
  if (bytes == 0) invalid(call, "size is 0");
  s.check_granular(call, "size", bytes);
  dev_ptr base = 0;
  if (options_.host_backed) {
    // The arena's free part is PROT_NONE already: taking a range of it needs no system call.
    bool own = false;
    base = s.place(call, bytes, own);
    try {
      s.record(base, bytes, own);
      s.reservations.emplace(base, bytes);
    } catch (...) {
      s.forget(base);
      throw;
    }
  } else {
    base = s.take_addresses(call, bytes);
    try {
      s.reservations.emplace(base, bytes);
    } catch (...) {
      s.give_addresses(base, bytes);
      throw;
    }
  }
  s.charge(kReserveUs);
  return base;
}

void SimDriver::free_reserve(dev_ptr base, std::size_t bytes) {
  static constexpr const char* call = "cuMemAddressFree";
  std::lock_guard lock(impl_->mutex);
  Impl& s = *impl_;
  s.enter(Op::free_reserve, call);
  auto it = s.reservations.find(base);
  if (it == s.reservations.end()) invalid(call, "no reservation starts at " + hex(base));
  if (it->second != bytes)
    invalid(call, "reservation at " + hex(base) + " has size " + hex(it->second) + ", not " + hex(bytes));
  auto m = s.mappings.lower_bound(base);
  if (m != s.mappings.end() && m->first < base + bytes)
    invalid(call, "reservation " + range(base, bytes) + " still has a mapping at " + hex(m->first));
  // Host-backed: nothing is mapped in it, so a range of the arena is PROT_NONE anonymous memory
  // again (forget() maps it so once more; it stays part of the arena).
  if (options_.host_backed && !s.forget(base)) host_failure(call, "munmap", errno);
  if (!options_.host_backed) s.give_addresses(base, bytes);
  s.reservations.erase(it);
}

phys_handle SimDriver::create(std::size_t bytes) {
  static constexpr const char* call = "cuMemCreate";
  std::lock_guard lock(impl_->mutex);
  Impl& s = *impl_;
  s.enter(Op::create, call);
  if (bytes == 0) invalid(call, "size is 0");
  s.check_granular(call, "size", bytes);
  s.drop_closed_exports();  // memory freed by a close since the last call is free again
  s.check_capacity(call, bytes);
  int fd = -1;
  if (options_.host_backed) {
    fd = ::memfd_create("expseg-sim", MFD_CLOEXEC);
    if (fd < 0) host_failure(call, "memfd_create", errno);
    if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      const int err = errno;
      ::close(fd);
      host_failure(call, "ftruncate", err);
    }
  }
  const std::uint64_t id = s.next_id++;
  const phys_handle h = s.next_id++;
  try {
    s.phys.emplace(id, Impl::Phys{bytes, fd, 1});
    s.handles.emplace(h, id);
  } catch (...) {
    s.phys.erase(id);
    if (fd >= 0) ::close(fd);
    throw;
  }
  s.physical += bytes;
  s.charge_table(kTableSizes, kCreateUs, bytes);
  return h;
}

void SimDriver::release(phys_handle handle) {
  static constexpr const char* call = "cuMemRelease";
  std::lock_guard lock(impl_->mutex);
  Impl& s = *impl_;
  s.enter(Op::release, call);
  auto it = s.handles.find(handle);
  if (it == s.handles.end()) invalid(call, "unknown physical handle " + hex(handle));
  const std::uint64_t id = it->second;
  s.charge_table(kTableSizes, kReleaseUs, s.phys.at(id).size);
  s.handles.erase(it);
  s.unref(id);
}

void SimDriver::map(dev_ptr ptr, std::size_t bytes, phys_handle handle) {
  static constexpr const char* call = "cuMemMap";
  std::lock_guard lock(impl_->mutex);
  Impl& s = *impl_;
  s.enter(Op::map, call);
  s.check_range(call, ptr, bytes);
  auto h = s.handles.find(handle);
  if (h == s.handles.end()) invalid(call, "unknown physical handle " + hex(handle));
  Impl::Phys& p = s.phys.at(h->second);
  if (p.size != bytes)
    invalid(call, "map size " + hex(bytes) + " differs from the handle's size " + hex(p.size) +
                      " (the allocator maps whole handles)");
  auto r = s.reservations.upper_bound(ptr);
  if (r == s.reservations.begin() || (--r, ptr + bytes > r->first + r->second))
    invalid(call, "range " + range(ptr, bytes) + " is not inside a reservation");
  auto next = s.mappings.lower_bound(ptr + bytes);
  if (next != s.mappings.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second.size > ptr)
      invalid(call, "range " + range(ptr, bytes) + " overlaps the mapping " + range(prev->first, prev->second.size));
  }
  Impl::Mapping m{bytes, h->second, std::vector<bool>(bytes / s.gran(), false), {}};
  void* at = reinterpret_cast<void*>(static_cast<std::uintptr_t>(ptr));
  if (options_.host_backed && ::mmap(at, bytes, PROT_NONE, MAP_SHARED | MAP_FIXED, p.fd, 0) == MAP_FAILED)
    host_failure(call, "mmap", errno);
  try {
    s.mappings.emplace(ptr, std::move(m));
  } catch (...) {
    if (options_.host_backed)
      ::mmap(at, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    throw;
  }
  ++p.refs;
  s.charge_table(kTableSizes, kMapUs, bytes);
}

void SimDriver::unmap(dev_ptr ptr, std::size_t bytes) {
  static constexpr const char* call = "cuMemUnmap";
  std::lock_guard lock(impl_->mutex);
  Impl& s = *impl_;
  s.enter(Op::unmap, call);
  s.check_range(call, ptr, bytes);
  const dev_ptr end = ptr + bytes;
  auto first = s.mappings.find(ptr);
  auto it = first;
  for (dev_ptr cur = ptr; cur < end; cur += it->second.size, ++it)
    if (it == s.mappings.end() || it->first != cur || cur + it->second.size > end)
      invalid(call, "range " + range(ptr, bytes) + " does not consist of whole mappings");
  if (options_.host_backed &&
      ::mmap(reinterpret_cast<void*>(static_cast<std::uintptr_t>(ptr)), bytes, PROT_NONE,
             MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0) == MAP_FAILED)
    host_failure(call, "mmap", errno);
  s.check_unused(call, ptr, end);
  for (auto m = first; m != it; ++m) {
    s.charge_table(kTableSizes, kUnmapUs, m->second.size);
    s.unref(m->second.phys);
  }
  s.mappings.erase(first, it);
}

void SimDriver::set_access(dev_ptr ptr, std::size_t bytes) {
  static constexpr const char* call = "cuMemSetAccess";
  std::lock_guard lock(impl_->mutex);
  Impl& s = *impl_;
  s.enter(Op::set_access, call);
  s.check_range(call, ptr, bytes);
  if (!s.fully_mapped(ptr, bytes)) invalid(call, "range " + range(ptr, bytes) + " is not fully mapped");
  if (options_.host_backed &&
      ::mprotect(reinterpret_cast<void*>(static_cast<std::uintptr_t>(ptr)), bytes, PROT_READ | PROT_WRITE) != 0)
    host_failure(call, "mprotect", errno);
  const dev_ptr end = ptr + bytes;
  for (auto it = s.mapping_at(ptr); it != s.mappings.end() && it->first < end; ++it) {
    Impl::Mapping& m = it->second;
    const dev_ptr from = std::max(ptr, it->first), to = std::min<dev_ptr>(end, it->first + m.size);
    for (dev_ptr a = from; a < to; a += s.gran()) m.access[(a - it->first) / s.gran()] = true;
    auto grant = [&m](int d) {
      if (std::find(m.granted.begin(), m.granted.end(), d) == m.granted.end()) m.granted.push_back(d);
    };
    grant(options_.device);
    for (int peer : s.peers) grant(peer);
    s.charge_table(kTableSizes, kSetAccessUs, m.size);  // cost follows handles, not bytes
  }
}

// --- plain allocations ---------------------------------------------------------------------------

dev_ptr SimDriver::mem_alloc(std::size_t bytes) {
  static constexpr const char* call = "cuMemAlloc";
  std::lock_guard lock(impl_->mutex);
  Impl& s = *impl_;
  s.enter(Op::mem_alloc, call);
  if (bytes == 0) invalid(call, "size is 0");
  s.drop_closed_exports();  // memory freed by a close since the last call is free again
  s.check_capacity(call, bytes);
  Impl::Alloc a{bytes, 0, 0, s.next_id++};
  dev_ptr p = 0;
  if (options_.host_backed) {
    const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
    a.host_size = (bytes + page - 1) / page * page;
    bool own = false;
    p = s.place(call, a.host_size, own);
    void* want = reinterpret_cast<void*>(static_cast<std::uintptr_t>(p));
    try {
      s.record(p, a.host_size, own);
      if (::mmap(want, a.host_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0) == MAP_FAILED)
        host_failure(call, "mmap", errno);
      s.allocs.emplace(p, a);
    } catch (...) {
      s.forget(p);
      throw;
    }
  } else {
    p = s.take_addresses(call, bytes);
    try {
      s.allocs.emplace(p, a);
    } catch (...) {
      s.give_addresses(p, bytes);
      throw;
    }
  }
  s.physical += bytes;
  s.charge_table(kAllocSizes, kMemAllocUs, bytes);
  return p;
}

void SimDriver::mem_free(dev_ptr ptr) {
  static constexpr const char* call = "cuMemFree";
  std::lock_guard lock(impl_->mutex);
  Impl& s = *impl_;
  s.enter(Op::mem_free, call);
  auto it = s.allocs.find(ptr);
  if (it == s.allocs.end()) invalid(call, hex(ptr) + " is not a live cuMemAlloc pointer");
  // CUDA: undefined behaviour for the importer (its mapping outlives the memory); refused here so
  // that a test sees it.
  if (it->second.ipc_opens != 0)
    invalid(call, hex(ptr) + " is open in " + std::to_string(it->second.ipc_opens) +
                      " importer(s) (cuIpcOpenMemHandle): freeing it before cuIpcCloseMemHandle is undefined behaviour");
  // Host-backed: back to PROT_NONE (the bytes go), not unmapped: the range stays part of the arena.
  if (options_.host_backed && !s.forget(ptr)) host_failure(call, "mmap", errno);
  if (!options_.host_backed) s.give_addresses(ptr, it->second.size);
  s.physical -= it->second.size;
  s.charge_table(kAllocSizes, kMemFreeUs, it->second.size);
  s.allocs.erase(it);
}

// --- streams and events --------------------------------------------------------------------------

stream_t SimDriver::stream_create() {
  std::lock_guard lock(impl_->mutex);
  // Never 0x1 or 0x2: CUDA's CU_STREAM_LEGACY and CU_STREAM_PER_THREAD, which no created stream is.
  std::uintptr_t id = impl_->next_id++;
  while (id <= 2) id = impl_->next_id++;
  impl_->created_streams.insert(id);
  return as_pointer(id);
}

stream_t SimDriver::stream_create_blocking() {
  const stream_t s = stream_create();
  std::lock_guard lock(impl_->mutex);
  impl_->blocking_streams.insert(id_of(s));
  return s;
}

bool SimDriver::stream_is_blocking(stream_t stream) {
  static constexpr const char* call = "cuStreamGetFlags";
  std::lock_guard lock(impl_->mutex);
  Impl& s = *impl_;
  s.enter(Op::stream_query, call);
  const std::uintptr_t id = stream_of(stream);
  if (s.capture_of(id) != nullptr) s.refuse_while_capturing(call);  // refused in every mode (measured)
  if (s.destroyed_streams.contains(id))
    throw driver_error(call, 201, "CUDA_ERROR_INVALID_CONTEXT", "stream " + hex(id) + " was destroyed");
  s.charge(kStreamQueryUs);
  return s.is_blocking(id);
}

void SimDriver::stream_destroy(stream_t stream) {
  static constexpr const char* call = "cuStreamDestroy";
  std::lock_guard lock(impl_->mutex);
  Impl& s = *impl_;
  if (stream == nullptr) invalid(call, "the default stream cannot be destroyed");
  const std::uintptr_t id = id_of(stream);
  if (!s.created_streams.contains(id)) invalid(call, "unknown stream " + hex(id) + " (not from stream_create)");
  // CUDA lets queued work finish after cuStreamDestroy returns: a busy stream's work (its events,
  // its queued uses) stays pending until set_stream_busy(stream, false) or a synchronization that
  // waits for it (the device's; the legacy stream's for a blocking stream). Only then may memory it
  // used be unmapped.
  s.created_streams.erase(id);
  s.destroyed_streams.insert(id);
}

event_t SimDriver::event_create() {
  std::lock_guard lock(impl_->mutex);
  const std::uintptr_t id = impl_->next_id++;
  impl_->events.emplace(id, Impl::Event{});
  return as_pointer(id);
}

void SimDriver::event_destroy(event_t event) {
  std::lock_guard lock(impl_->mutex);
  impl_->event("cuEventDestroy", event);
  impl_->events.erase(id_of(event));
}

void SimDriver::event_record(event_t event, stream_t stream) {
  static constexpr const char* call = "cuEventRecord";
  std::lock_guard lock(impl_->mutex);
  Impl& s = *impl_;
  s.enter(Op::event_record, call);
  Impl::Event& ev = s.event(call, event);
  ev.stream = stream_of(stream);
  if (s.destroyed_streams.contains(ev.stream))
    throw driver_error(call, 201, "CUDA_ERROR_INVALID_CONTEXT", "stream " + hex(ev.stream) + " was destroyed");
  if (ev.stream == 0) s.refuse_implicit(call);
  s.busy_dependencies(ev.stream, ev.waits_for);
  ev.pending = !ev.waits_for.empty();
  ev.seq = ++s.record_seq;
  const Impl::Capture* c = s.capture_of(ev.stream);
  ev.captured = c != nullptr;
  ev.capture_id = c != nullptr ? c->id : 0;
  s.charge(kEventUs);
}

bool SimDriver::event_query(event_t event) {
  static constexpr const char* call = "cuEventQuery";
  std::lock_guard lock(impl_->mutex);
  Impl& s = *impl_;
  s.enter(Op::event_query, call);
  const Impl::Event& ev = s.event(call, event);
  s.refuse_captured_event(call, ev);
  const bool done = !ev.pending;
  s.charge(kEventUs);
  return done;
}

void SimDriver::event_synchronize(event_t event) {
  static constexpr const char* call = "cuEventSynchronize";
  std::lock_guard lock(impl_->mutex);
  Impl& s = *impl_;
  s.enter(Op::stream_sync, call);
  const Impl::Event& ev = s.event(call, event);
  s.refuse_captured_event(call, ev);
  // Work is done in stream order: earlier events of the same stream complete too.
  while (!ev.waits_for.empty()) {  // each complete() takes its stream off the list
    const std::uintptr_t stream = ev.waits_for.back();
    s.complete(&stream, ev.seq);
  }
  s.charge(kSyncUs);
}

void SimDriver::stream_synchronize(stream_t stream) {
  static constexpr const char* call = "cuStreamSynchronize";
  std::lock_guard lock(impl_->mutex);
  Impl& s = *impl_;
  s.enter(Op::stream_sync, call);
  const std::uintptr_t id = stream_of(stream);
  s.refuse_sync_of_capturing(call, id);
  if (s.destroyed_streams.contains(id))
    throw driver_error(call, 201, "CUDA_ERROR_INVALID_CONTEXT", "stream " + hex(id) + " was destroyed");
  const std::uint64_t upto = s.record_seq;
  if (id == 0)
    for (const std::uintptr_t b : std::vector<std::uintptr_t>(s.busy_streams.begin(), s.busy_streams.end()))
      if (s.is_blocking(b)) s.complete(&b, upto);
  s.complete(&id, upto);
  s.charge(kSyncUs);
}

void SimDriver::device_synchronize() {
  std::lock_guard lock(impl_->mutex);
  Impl& s = *impl_;
  s.enter(Op::stream_sync, "cuCtxSynchronize");
  s.refuse_while_capturing("cuCtxSynchronize");
  s.complete(nullptr, s.record_seq);
  s.charge(kSyncUs);
}

void SimDriver::stream_wait_event(stream_t stream, event_t event) {
  static constexpr const char* call = "cuStreamWaitEvent";
  std::lock_guard lock(impl_->mutex);
  Impl& s = *impl_;
  const Impl::Event& ev = s.event(call, event);
  const std::uintptr_t id = stream_of(stream);
  if (!ev.captured || s.capture_of(ev.stream) == nullptr)
    throw driver_error(call, 801, "CUDA_ERROR_NOT_SUPPORTED", "the simulator models a wait only for an event recorded inside a capture");
  if (id == 0) s.refuse_implicit(call);
  if (s.capture_of(id) != nullptr) return;  // in the capture already
  auto f = s.forks.find(ev.stream);
  s.forks.emplace(id, f != s.forks.end() ? f->second : ev.stream);
}

// --- data access ---------------------------------------------------------------------------------

void SimDriver::memset_d32(dev_ptr ptr, std::uint32_t value, std::size_t count, stream_t stream) {
  static constexpr const char* call = "cuMemsetD32Async";
  std::lock_guard lock(impl_->mutex);
  Impl& s = *impl_;
  if (ptr % 4 != 0) invalid(call, "address " + hex(ptr) + " is not 4-byte aligned");
  if (count > std::numeric_limits<std::size_t>::max() / 4) invalid(call, "count too large");
  if (s.destroyed_streams.contains(stream_of(stream)))
    throw driver_error(call, 201, "CUDA_ERROR_INVALID_CONTEXT", "stream " + hex(stream_of(stream)) + " was destroyed");
  if (Impl::Capture* c = s.capture_of(stream_of(stream)); c != nullptr) {  // recorded into the graph, run by its launches
    c->work.push_back({ptr, value, count});
    return;
  }
  // Otherwise host-backed work completes at once, on any stream.
  // Host memory from mmap has no declared type, so writing it as uint32_t is fine (ptr is 4-aligned).
  std::fill_n(reinterpret_cast<std::uint32_t*>(s.data(call, ptr, count * 4)), count, value);
}

// --- graph capture ----------------------------------------------------------------------------------

std::uint64_t SimDriver::stream_capture_id(stream_t stream) {
  static constexpr const char* call = "cuStreamGetCaptureInfo";
  std::lock_guard lock(impl_->mutex);
  Impl& s = *impl_;
  s.enter(Op::stream_query, call);
  const std::uintptr_t id = stream_of(stream);
  if (id == 0) {
    // CUDA answers the legacy stream's question with CUDA_ERROR_STREAM_CAPTURE_IMPLICIT while a
    // blocking stream captures; that capture stays valid (documented for cuStreamGetCaptureInfo).
    bool blocking = std::any_of(s.forks.begin(), s.forks.end(), [&](const auto& f) { return s.is_blocking(f.first); });
    for (const auto& [st, c] : s.captures) blocking = blocking || s.is_blocking(st);
    if (blocking)
      throw driver_error(call, 906, "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
                         "the legacy stream while a blocking stream captures (the capture stays valid)");
  }
  const Impl::Capture* c = s.capture_of(id);
  s.charge(kStreamQueryUs);
  return c == nullptr ? 0 : c->id;
}

void SimDriver::capture_begin(stream_t stream, CaptureMode mode) {
  static constexpr const char* call = "cuStreamBeginCapture";
  std::lock_guard lock(impl_->mutex);
  Impl& s = *impl_;
  if (stream == nullptr) invalid(call, "the legacy default stream cannot be captured");
  if (s.capture_of(stream_of(stream)) != nullptr) invalid(call, "the stream is capturing already");
  s.captures.emplace(stream_of(stream), Impl::Capture{s.next_capture_id++, false, {}, mode, std::this_thread::get_id()});
}

graph_t SimDriver::capture_end(stream_t stream) {
  static constexpr const char* call = "cuStreamEndCapture";
  std::lock_guard lock(impl_->mutex);
  Impl& s = *impl_;
  auto it = s.captures.find(stream_of(stream));
  if (it == s.captures.end()) throw driver_error(call, 401, "CUDA_ERROR_ILLEGAL_STATE", "the stream is not capturing");
  Impl::Capture c = std::move(it->second);
  s.captures.erase(it);
  std::erase_if(s.forks, [&](const auto& f) { return f.second == stream_of(stream); });  // joined back
  // Measured on the H200: ended on another thread, a capture not begun in relaxed mode is over
  // all the same, its graph lost.
  if (c.mode != CaptureMode::relaxed && c.thread != std::this_thread::get_id())
    throw driver_error(call, 908, "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
                       "a capture not begun in relaxed mode ends on the thread that began it");
  if (c.invalidated)
    throw driver_error(call, 901, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", "the capture was invalidated by an unsupported call");
  // cuGraphInstantiate is an unsafe call: refused while another capture restricts this thread,
  // which that capture does not survive; the ended capture's graph is lost.
  s.refuse_unsafe("cuGraphInstantiateWithFlags");
  const std::uintptr_t id = s.next_id++;
  s.graphs.emplace(id, std::move(c.work));
  return as_pointer(id);
}

void SimDriver::graph_launch(graph_t graph, stream_t stream) {
  static constexpr const char* call = "cuGraphLaunch";
  std::lock_guard lock(impl_->mutex);
  Impl& s = *impl_;
  (void)stream;
  auto it = s.graphs.find(id_of(graph));
  if (it == s.graphs.end()) invalid(call, "unknown graph " + hex(id_of(graph)));
  // A replay writes where the capture's work wrote, whatever lives there now: memory that was
  // unmapped since faults (data() throws), memory handed to someone else is overwritten.
  for (const Impl::Memset& m : it->second)
    std::fill_n(reinterpret_cast<std::uint32_t*>(s.data(call, m.ptr, m.count * 4)), m.count, m.value);
}

void SimDriver::graph_destroy(graph_t graph) {
  std::lock_guard lock(impl_->mutex);
  if (impl_->graphs.erase(id_of(graph)) == 0) invalid("cuGraphExecDestroy", "unknown graph " + hex(id_of(graph)));
}

void SimDriver::copy_to_host(void* dst, dev_ptr src, std::size_t bytes) {
  std::lock_guard lock(impl_->mutex);
  const unsigned char* from = impl_->data("cuMemcpyDtoH", src, bytes);
  if (bytes) std::memcpy(dst, from, bytes);
}

void SimDriver::copy_from_host(dev_ptr dst, const void* src, std::size_t bytes) {
  std::lock_guard lock(impl_->mutex);
  unsigned char* to = impl_->data("cuMemcpyHtoD", dst, bytes);
  if (bytes) std::memcpy(to, src, bytes);
}

// --- peers ---------------------------------------------------------------------------------------

bool SimDriver::can_access_peer(int peer) {
  return peer != options_.device && peer >= 0 && peer < options_.device_count;
}

void SimDriver::check_peer_index(int peer) const {
  if (peer < 0 || peer >= options_.device_count)
    throw driver_error("cuDeviceGet", kInvalidDevice, "CUDA_ERROR_INVALID_DEVICE",
                       "no simulated device " + std::to_string(peer) + " (device_count " +
                           std::to_string(options_.device_count) + ")");
}

bool SimDriver::add_access_device(int peer) {
  std::lock_guard lock(impl_->mutex);
  Impl& s = *impl_;
  check_peer_index(peer);
  if (peer == options_.device || std::find(s.peers.begin(), s.peers.end(), peer) != s.peers.end()) return false;
  s.peers.push_back(peer);
  return true;
}

bool SimDriver::enable_context_peer(int peer) {
  std::lock_guard lock(impl_->mutex);
  Impl& s = *impl_;
  check_peer_index(peer);
  if (peer == options_.device || std::find(s.context_peers.begin(), s.context_peers.end(), peer) != s.context_peers.end())
    return false;
  // As cuCtxEnablePeerAccess: a device has at most kSimMaxContextPeers peers this way.
  if (s.context_peers.size() >= static_cast<std::size_t>(kSimMaxContextPeers))
    throw driver_error("cuCtxEnablePeerAccess", kTooManyPeers, "CUDA_ERROR_TOO_MANY_PEERS",
                       "simulated device " + std::to_string(options_.device) + " already has peer access enabled to " +
                           std::to_string(kSimMaxContextPeers) + " devices, the most CUDA allows (device " +
                           std::to_string(peer) + " asked, for cuMemAlloc memory). Memory of the expandable backend "
                           "needs no context peer access: backend:expandable shares memory with any number of peers");
  s.context_peers.push_back(peer);
  return true;
}

std::vector<int> SimDriver::context_peers() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->context_peers;
}

std::vector<int> SimDriver::access_devices() const {
  std::lock_guard lock(impl_->mutex);
  std::vector<int> out{options_.device};
  out.insert(out.end(), impl_->peers.begin(), impl_->peers.end());
  return out;
}

// --- sharing (in-process only) -------------------------------------------------------------------

ExportedHandle SimDriver::export_handle(phys_handle handle) {
  static constexpr const char* call = "cuMemExportToShareableHandle";
  std::lock_guard lock(impl_->mutex);
  Impl& s = *impl_;
  s.enter(Op::export_handle, call);
  if (options_.shareable == ShareableHandle::none)
    invalid(call, "physical memory is created without a shareable handle type (SimOptions::shareable is none)");
  auto h = s.handles.find(handle);
  if (h == s.handles.end()) invalid(call, "unknown physical handle " + hex(handle));
  ExportedHandle out;
  out.type = options_.shareable;
  // The type is part of the magic: an export read back as another type is refused, as CUDA reads
  // the fabric handle's bytes or the fd, whichever the type says.
  s.encode(out, kHandleMagic + static_cast<std::uint32_t>(options_.shareable), h->second);
  if (options_.shareable == ShareableHandle::posix_fd) {
    if (options_.host_backed) {
      Impl::Phys& p = s.phys.at(h->second);
      out.fd = ::fcntl(p.fd, F_DUPFD_CLOEXEC, 0);
      if (out.fd < 0) host_failure(call, "fcntl(F_DUPFD_CLOEXEC)", errno);
      p.exported_fd = true;
    } else {
      out.fd = kFakeFdBase + static_cast<int>(h->second % (1u << 20));
    }
  }
  return out;
}

phys_handle SimDriver::import_handle(const ExportedHandle& exported) {
  static constexpr const char* call = "cuMemImportFromShareableHandle";
  std::lock_guard lock(impl_->mutex);
  Impl& s = *impl_;
  s.enter(Op::import_handle, call);
  if (exported.type == ShareableHandle::none) invalid(call, "the exported handle has no shareable type");
  if (exported.type == ShareableHandle::posix_fd && exported.fd < 0)
    invalid(call, "the exported file descriptor is negative");
  const std::uint64_t id = s.decode(call, exported, kHandleMagic + static_cast<std::uint32_t>(exported.type));
  auto p = s.phys.find(id);
  bool revived = false;
  if (p == s.phys.end() && exported.type == ShareableHandle::posix_fd && options_.host_backed) {
    p = s.revive(call, id, exported.fd);  // released by its owners, kept by the open descriptor
    revived = p != s.phys.end();
  }
  if (p == s.phys.end()) invalid(call, "the exported physical memory no longer exists");
  if (exported.type == ShareableHandle::posix_fd) {
    // CUDA imports what the descriptor names, not the bytes: it must be the exported one, still open.
    if (options_.host_backed) {
      struct stat got {}, want {};
      if (::fstat(exported.fd, &got) != 0) invalid(call, "the exported file descriptor " + std::to_string(exported.fd) + " is not open");
      if (::fstat(p->second.fd, &want) != 0 || got.st_ino != want.st_ino || got.st_dev != want.st_dev)
        invalid(call, "the file descriptor " + std::to_string(exported.fd) + " does not name the exported memory");
    } else if (exported.fd != kFakeFdBase + static_cast<int>(id % (1u << 20))) {
      invalid(call, "the file descriptor " + std::to_string(exported.fd) + " does not name the exported memory");
    }
  }
  const phys_handle h = s.next_id++;
  try {
    s.handles.emplace(h, id);
  } catch (...) {
    if (revived) {  // released again, as it was before the call
      ++p->second.refs;
      s.unref(id);
    }
    throw;
  }
  ++p->second.refs;
  return h;
}

ExportedHandle SimDriver::ipc_export(dev_ptr mem_alloc_ptr) {
  static constexpr const char* call = "cuIpcGetMemHandle";
  std::lock_guard lock(impl_->mutex);
  Impl& s = *impl_;
  s.enter(Op::export_handle, call);
  auto it = s.allocs.find(mem_alloc_ptr);
  if (it == s.allocs.end()) invalid(call, hex(mem_alloc_ptr) + " is not a live cuMemAlloc pointer");
  ExportedHandle out;
  s.encode(out, kIpcMagic, mem_alloc_ptr, it->second.id);
  return out;
}

dev_ptr SimDriver::ipc_open(const ExportedHandle& exported) {
  static constexpr const char* call = "cuIpcOpenMemHandle";
  std::lock_guard lock(impl_->mutex);
  Impl& s = *impl_;
  s.enter(Op::import_handle, call);
  const dev_ptr p = s.decode(call, exported, kIpcMagic);
  auto it = s.allocs.find(p);
  // Freed, or freed and its address given to a new allocation, which the export does not name.
  if (it == s.allocs.end() || it->second.id != Impl::encoded_alloc_id(exported))
    invalid(call, "the exported allocation " + hex(p) + " no longer exists");
  ++it->second.ipc_opens;  // in-process: the same memory at the same address
  return p;
}

// cuMemGetAddressRange of cuMemAlloc'd memory (what expseg asks it of): the allocation `ptr` lies in.
std::pair<dev_ptr, std::size_t> SimDriver::address_range(dev_ptr ptr) {
  static constexpr const char* call = "cuMemGetAddressRange";
  std::lock_guard lock(impl_->mutex);
  const auto& allocs = impl_->allocs;
  auto it = allocs.upper_bound(ptr);
  if (it == allocs.begin() || ptr - std::prev(it)->first >= std::prev(it)->second.size)
    invalid(call, hex(ptr) + " lies in no allocation of this device");
  --it;
  return {it->first, it->second.size};
}

void SimDriver::ipc_close(dev_ptr ptr) {
  static constexpr const char* call = "cuIpcCloseMemHandle";
  std::lock_guard lock(impl_->mutex);
  auto it = impl_->allocs.find(ptr);
  if (it == impl_->allocs.end() || it->second.ipc_opens == 0)
    invalid(call, hex(ptr) + " is not a pointer returned by cuIpcOpenMemHandle");
  --it->second.ipc_opens;
}

// --- simulation controls -------------------------------------------------------------------------

void SimDriver::inject_fault(Op op, std::uint64_t nth, Fault fault) {
  if (op >= Op::count_) throw std::invalid_argument("inject_fault: invalid Op");
  if (nth == 0) throw std::invalid_argument("inject_fault: nth counts from 1 (the next call)");
  std::lock_guard lock(impl_->mutex);
  const auto index = static_cast<std::size_t>(op);
  impl_->faults.insert_or_assign({index, impl_->calls[index] + nth}, fault);
}

void SimDriver::clear_faults() {
  std::lock_guard lock(impl_->mutex);
  impl_->faults.clear();
}

std::uint64_t SimDriver::calls(Op op) const {
  if (op >= Op::count_) throw std::invalid_argument("calls: invalid Op");
  std::lock_guard lock(impl_->mutex);
  return impl_->calls[static_cast<std::size_t>(op)];
}

SimDriver::Live SimDriver::live() const {
  std::lock_guard lock(impl_->mutex);
  impl_->drop_closed_exports();  // what a close freed is no longer outstanding
  const Impl& s = *impl_;
  Live l;
  l.reservations = s.reservations.size();
  l.handles = s.handles.size();
  l.mappings = s.mappings.size();
  l.mem_allocs = s.allocs.size();
  l.events = s.events.size();
  l.streams = s.created_streams.size();
  l.physical_bytes = s.physical;
  return l;
}

std::size_t SimDriver::address_space_in_use() noexcept { return g_address_space_in_use.load(std::memory_order_relaxed); }

void SimDriver::set_foreign_usage(std::size_t bytes) {
  std::lock_guard lock(impl_->mutex);
  impl_->foreign = bytes;
}

void SimDriver::queue_use(stream_t stream, dev_ptr ptr, std::size_t bytes) {
  std::lock_guard lock(impl_->mutex);
  Impl& s = *impl_;
  const std::uintptr_t id = stream_of(stream);
  if (s.destroyed_streams.contains(id)) invalid("queue_use", "stream " + hex(id) + " was destroyed: no work can be queued on it");
  if (bytes == 0 || !s.busy_streams.contains(id)) return;  // an idle stream's work completes at once
  s.uses.push_back(Impl::Use{id, ++s.record_seq, ptr, ptr + bytes});
}

bool SimDriver::queued_use_overlaps(dev_ptr ptr, std::size_t bytes) const {
  std::lock_guard lock(impl_->mutex);
  return std::any_of(impl_->uses.begin(), impl_->uses.end(), [&](const Impl::Use& u) { return u.lo < ptr + bytes && ptr < u.hi; });
}

std::vector<std::string> SimDriver::hazards() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->hazards;
}

void SimDriver::set_stream_busy(stream_t stream, bool busy) {
  std::lock_guard lock(impl_->mutex);
  Impl& s = *impl_;
  const std::uintptr_t id = stream_of(stream);
  if (busy) {
    s.busy_streams.insert(id);
  } else {
    s.busy_streams.erase(id);
    s.complete(&id, s.record_seq);
  }
}

double SimDriver::simulated_seconds() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->seconds;
}

CallStats SimDriver::call_stats() const {
  std::lock_guard lock(impl_->mutex);
  CallStats c;
  c.calls = impl_->calls;
  c.seconds = impl_->op_seconds;
  return c;
}

std::vector<int> SimDriver::granted_devices(dev_ptr addr) const {
  std::lock_guard lock(impl_->mutex);
  auto it = impl_->mapping_at(addr);
  if (it == impl_->mappings.end()) return {};
  return it->second.granted;
}

bool SimDriver::is_accessible(dev_ptr ptr, std::size_t bytes) const {
  std::lock_guard lock(impl_->mutex);
  return impl_->accessible(ptr, bytes);
}

}  // namespace expseg::driver
