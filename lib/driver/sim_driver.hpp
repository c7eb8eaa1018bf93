// SimDriver: a simulated device behind the same Driver interface, so that every test, scenario and
// replay runs deterministically on a machine without a GPU.
//
// Modes:
//   - bookkeeping (default): addresses and handles are numbers; capacity may be 141 GB on a laptop.
//   - host-backed: reserve = a range of the driver's PROT_NONE address arena, physical handle = memfd,
//     map = mmap(MAP_FIXED|MAP_SHARED), set_access = mprotect(READ|WRITE), unmap = mmap(PROT_NONE)
//     over the range again. Device addresses are host addresses, so tests write patterns into
//     allocations and prove that no two live blocks overlap and that no data moves when segments
//     grow or pages are remapped. Memory touched before set_access, or after unmap, faults like it
//     would on the GPU.
//
// Addresses follow from the calls made alone, in both modes: a fresh SimDriver fed the same calls
// returns the same addresses whatever ASLR or the rest of the process did, so a fixed-seed fuzz run
// or a trace replay is reproducible. Bookkeeping mode takes them from the device's own span, never
// reusing any; host-backed mode from one arena per driver, reserved at first use at a fixed address
// (the device's slot; drivers alive at once take further slots, and where none can be had, e.g.
// under a sanitizer that moves fixed mappings, the arena lies elsewhere, 1 TiB aligned, or smaller
// under an address space limit such as ulimit -v), lowest free range first, reusing freed ranges.
// Both leave a one-granule gap after every range. A reservation larger than the arena's free room
// (terabytes) is still made, mapped on its own where mmap puts it: that address is not reproducible.
// As on CUDA, where a process's devices share one address space of about 128 TiB, bookkeeping
// mode's reservations and cuMemAllocs, of all SimDrivers of the process together, run out at
// SimOptions::address_space (CUDA_ERROR_OUT_OF_MEMORY); host-backed mode's at the host's limit.
//
// It enforces the CUDA rules the allocator must respect (map only inside a reservation, on
// granularity boundaries, never over a mapping; unmap whole mappings; free a reservation only when
// nothing is mapped in it; free only live allocations) and throws driver_error with CUDA's error
// names when they are broken, so a backend bug shows up as an error, not as silent success.
//
// Sharing is in-process. As on CUDA, memory exported as a POSIX descriptor stays importable through
// it after its last handle and mapping are released, until the descriptor is closed, and stays in
// use meanwhile (held to the capacity, in mem_info and live().physical_bytes): in host-backed mode,
// where the descriptor is a real one. What it cannot see: a close itself (it finds the memory's
// descriptors gone from /proc/self/fd at its next create, mem_alloc, mem_info or live, and frees the
// memory then; where /proc/self/fd cannot be read, such memory stays in use until the driver is
// destroyed), and descriptors passed to other processes, which do not keep it (another process
// cannot import from the simulator anyway). Bookkeeping mode's descriptors are numbers whose close
// it cannot see: there the memory goes with its last handle and mapping.
//
// Stream capture as measured on the H200: memsets queued on a capturing stream are recorded into
// the graph and run by graph_launch, into whatever the addresses hold then. The calls the CUDA
// driver layer makes in relaxed capture mode (mem_alloc, mem_free, event queries, stream
// synchronizations) are permitted while another stream captures; what no mode permits fails with
// CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (or CUDA_ERROR_CAPTURED_EVENT) and invalidates the capture:
// device_synchronize, a synchronization of a capturing stream, a query or synchronization of an
// event recorded during a capture; and work on the legacy stream (a synchronization, an event
// record) while a blocking stream captures (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT). A stream that waits
// for an event recorded inside a capture joins it (a fork), as on a GPU, until the capture ends.
// Capture modes as measured there: capture_end instantiates the graph, which is refused while
// another capture is underway in global mode (that capture is invalidated) or in thread-local mode
// begun by the calling thread; a capture not begun relaxed ended on another thread fails
// (CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD) and is over.
//
// Streams as on the H200: CU_STREAM_PER_THREAD (0x2) is the calling thread's own per-thread stream,
// another in each host thread. The legacy stream (nullptr or 0x1) and the per-thread streams
// block, and so do streams from stream_create_blocking(): a synchronization of the legacy stream,
// or of an event recorded on it, waits for their queued work too. stream_create() makes
// non-blocking streams, as the CUDA driver layer does.
//
// Fault injection makes the n-th future call of an operation fail with OOM or another error; the
// failing call has no effect. live() counts what is outstanding, for leak checks.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "driver/driver.hpp"

namespace expseg::driver {

// Bookkeeping mode: each simulated device hands out addresses from a span of its own of this many
// bytes (64 PiB), never reusing them, with a one-granule guard gap after every range; so one
// reservation or cuMemAlloc takes at most kSimAddressSpan - granularity bytes. What all devices
// of the process hold at once is bounded lower, by SimOptions::address_space.
inline constexpr std::size_t kSimAddressSpan = std::size_t{1} << 56;
// A CUDA process has one unified virtual address space for all its devices, of about 2^47 bytes
// (128 TiB): cuMemAddressReserve past it fails with CUDA_ERROR_OUT_OF_MEMORY. The default of
// SimOptions::address_space.
inline constexpr std::size_t kSimDefaultAddressSpace = std::size_t{1} << 47;
// Largest granularity (1 TiB): every device's span starts on a multiple of it.
inline constexpr std::size_t kSimMaxGranularity = std::size_t{1} << 40;
// Devices 0 .. kSimMaxDevices-1 (each has its own span).
inline constexpr int kSimMaxDevices = 255;
// Peers enable_context_peer accepts per device, as CUDA's cuCtxEnablePeerAccess (then CUDA_ERROR_TOO_MANY_PEERS).
inline constexpr int kSimMaxContextPeers = 8;

struct SimOptions {
  std::size_t capacity = std::size_t{80} << 30;   // bytes of simulated device memory
  std::size_t granularity = std::size_t{2} << 20;  // power of two, multiple of the host page size, <= kSimMaxGranularity
  bool host_backed = false;
  bool latency_model = false;  // accumulate the H200's measured driver-call latencies
  int device = 0;
  int device_count = 1;        // simulated devices visible (for peer bookkeeping)
  ShareableHandle shareable = ShareableHandle::none;
  // Bookkeeping mode: bytes of address space (reservations and cuMemAllocs, rounded up to the
  // granularity) that the bookkeeping SimDrivers of this process may hold together, as CUDA's
  // devices share one address space. A call that would take the process's total past this
  // driver's figure fails with CUDA_ERROR_OUT_OF_MEMORY. Tests lower it to reach that path.
  // (Host-backed mode takes host address space, which the host's own limit bounds.)
  std::size_t address_space = kSimDefaultAddressSpace;
};

enum class Fault : std::uint8_t { out_of_memory, error };

class SimDriver final : public Driver {
 public:
  explicit SimDriver(const SimOptions& options = {});
  ~SimDriver() override;
  SimDriver(const SimDriver&) = delete;
  SimDriver& operator=(const SimDriver&) = delete;

  // --- Driver ---
  const char* kind() const noexcept override { return "sim"; }
  int device() const noexcept override { return options_.device; }
  std::string device_name() const override;
  std::size_t granularity() const noexcept override { return options_.granularity; }
  MemInfo mem_info() override;
  CallStats call_stats() const override;  // the latency model's seconds (0 without it)
  dev_ptr reserve(std::size_t bytes) override;
  void free_reserve(dev_ptr base, std::size_t bytes) override;
  phys_handle create(std::size_t bytes) override;
  void release(phys_handle handle) override;
  void map(dev_ptr ptr, std::size_t bytes, phys_handle handle) override;
  void unmap(dev_ptr ptr, std::size_t bytes) override;
  void set_access(dev_ptr ptr, std::size_t bytes) override;
  dev_ptr mem_alloc(std::size_t bytes) override;
  void mem_free(dev_ptr ptr) override;
  stream_t stream_create() override;
  stream_t stream_create_blocking() override;
  void stream_destroy(stream_t stream) override;
  bool stream_is_blocking(stream_t stream) override;
  event_t event_create() override;
  void event_destroy(event_t event) override;
  void event_record(event_t event, stream_t stream) override;
  bool event_query(event_t event) override;
  void event_synchronize(event_t event) override;
  void stream_synchronize(stream_t stream) override;
  void device_synchronize() override;
  std::uint64_t stream_capture_id(stream_t stream) override;
  void capture_begin(stream_t stream, CaptureMode mode = CaptureMode::global) override;
  graph_t capture_end(stream_t stream) override;
  void graph_launch(graph_t graph, stream_t stream) override;
  void graph_destroy(graph_t graph) override;
  // Only the fork into a capture (an event recorded on a capturing stream): ordering between
  // streams outside captures is not modelled, and such a wait throws CUDA_ERROR_NOT_SUPPORTED.
  void stream_wait_event(stream_t stream, event_t event) override;
  void memset_d32(dev_ptr ptr, std::uint32_t value, std::size_t count, stream_t stream) override;
  void copy_to_host(void* dst, dev_ptr src, std::size_t bytes) override;
  void copy_from_host(dev_ptr dst, const void* src, std::size_t bytes) override;
  int device_count() override { return options_.device_count; }
  bool can_access_peer(int peer) override;
  bool add_access_device(int peer) override;
  std::vector<int> access_devices() const override;
  bool enable_context_peer(int peer) override;
  std::vector<int> context_peers() const override;
  ShareableHandle shareable_handle_type() const noexcept override { return options_.shareable; }
  ExportedHandle export_handle(phys_handle handle) override;
  phys_handle import_handle(const ExportedHandle& exported) override;
  ExportedHandle ipc_export(dev_ptr mem_alloc_ptr) override;
  dev_ptr ipc_open(const ExportedHandle& exported) override;
  void ipc_close(dev_ptr ptr) override;
  std::pair<dev_ptr, std::size_t> address_range(dev_ptr ptr) override;

  // --- simulation controls (tests) ---
  const SimOptions& options() const noexcept { return options_; }
  // The nth call (1 = the next one) of `op` from now on fails with `fault` and has no effect.
  // Several faults may be pending at once.
  void inject_fault(Op op, std::uint64_t nth, Fault fault);
  void clear_faults();
  std::uint64_t calls(Op op) const;  // calls made so far, failed ones included
  // Outstanding driver resources; all zero once an allocator has been destroyed.
  struct Live {
    std::size_t reservations = 0;
    std::size_t handles = 0;        // created/imported and not released
    std::size_t mappings = 0;       // map() calls not yet undone by unmap()
    std::size_t mem_allocs = 0;     // mem_alloc() not yet freed
    std::size_t events = 0;
    std::size_t streams = 0;
    std::size_t physical_bytes = 0; // device memory in use (handles + mem_allocs)
  };
  Live live() const;
  // Bookkeeping mode: bytes of address space the SimDrivers of this process hold together (what
  // SimOptions::address_space bounds). Thread-safe.
  static std::size_t address_space_in_use() noexcept;
  // Simulated device memory used by someone else (another process): reduces what create() and
  // mem_alloc() can get and what mem_info() reports as free.
  void set_foreign_usage(std::size_t bytes);
  // A busy stream keeps events recorded on it incomplete until it is made idle or synchronized
  // (0x2 here is the calling thread's per-thread stream); destroying it does not complete its work,
  // as on a GPU (made idle here, or the device synchronized, it completes).
  void set_stream_busy(stream_t stream, bool busy);
  // Work queued on `stream` that uses [ptr, ptr + bytes): on a busy stream it stays queued until the
  // stream's work completes (synchronized or made idle, destroyed or not); on an idle one it is done
  // at once. Refused on a destroyed stream.
  void queue_use(stream_t stream, dev_ptr ptr, std::size_t bytes);
  // Unmaps of memory that queued work (queue_use) still used, in order: each is what a GPU would
  // fault on (or silently corrupt). The driver does not refuse them, as CUDA does not.
  std::vector<std::string> hazards() const;
  // Whether queued work (queue_use) not yet complete uses any of [ptr, ptr + bytes): memory handed
  // out again under it is what a stream-ordered allocator must never do (tests check allocations).
  bool queued_use_overlaps(dev_ptr ptr, std::size_t bytes) const;
  // Total simulated driver time (seconds) under the latency model; 0 when the model is off.
  double simulated_seconds() const;

  // Access checks used by tests: whether [ptr, ptr+bytes) is mapped and accessible.
  bool is_accessible(dev_ptr ptr, std::size_t bytes) const;
  // The devices set_access() granted on the mapping holding `addr` (this device, then the peers it
  // had at the time; empty when unmapped or never granted): what a peer may reach on a real device.
  std::vector<int> granted_devices(dev_ptr addr) const;

 private:
  void check_peer_index(int peer) const;  // throws CUDA_ERROR_INVALID_DEVICE past the device count
  struct Impl;
  SimOptions options_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace expseg::driver
