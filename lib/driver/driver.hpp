// expseg driver layer: the one interface through which the allocator touches a device.
//
// Layer rule: only lib/driver/ includes cuda.h. Everything above sees device addresses as integers,
// physical memory as opaque handles, and streams/events as opaque pointers. Two implementations:
//   - CudaDriver (cuda_driver.cpp): the CUDA driver API, with libcuda.so.1 loaded at run time, so the
//     library builds, links and runs its simulated tests on a machine with no GPU and no driver.
//   - SimDriver (sim_driver.cpp): a simulated device (bookkeeping or host-backed, fault injection,
//     a latency model from measured H200 figures).
//
// Error contract: every call either succeeds or throws expseg::driver_error carrying the call's name
// and the driver's error name and string; driver_error::is_out_of_memory() tells an OOM from the
// rest. A call that throws has no effect (nothing half-created is left behind).
// A Driver object is used under its owner's lock, with one exception: an imported IPC mapping
// (ipc.cpp, ImportedMemory) is released by whichever thread drops it, without the allocator's lock
// (unmap, release, free_reserve, device_synchronize, ipc_close). Both implementations are
// thread-safe (CudaDriver: the CUDA driver API and its atomic call counters; SimDriver: a lock per
// call); a new implementation must be too, or ipc.cpp must take the allocator's lock.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "expseg/errors.hpp"
#include "expseg/stats.hpp"

namespace expseg::driver {

using dev_ptr = std::uint64_t;      // a device virtual address (CUdeviceptr)
using phys_handle = std::uint64_t;  // a physical allocation (CUmemGenericAllocationHandle)
using stream_t = void*;             // a CUstream; nullptr is the legacy default stream
using event_t = void*;              // a CUevent
using graph_t = void*;              // an executable graph made from a stream capture (CUgraphExec)

// The operations the allocator performs; used to count calls, to inject faults and by the latency
// model. Keep op_name() in step.
enum class Op : std::uint8_t {
  reserve,        // cuMemAddressReserve
  free_reserve,   // cuMemAddressFree
  create,         // cuMemCreate
  release,        // cuMemRelease
  map,            // cuMemMap
  unmap,          // cuMemUnmap
  set_access,     // cuMemSetAccess
  mem_alloc,      // cuMemAlloc
  mem_free,       // cuMemFree
  event_record,   // cuEventRecord
  event_query,    // cuEventQuery
  stream_sync,    // cuStreamSynchronize / cuEventSynchronize / cuCtxSynchronize
  export_handle,  // cuMemExportToShareableHandle / cuIpcGetMemHandle
  import_handle,  // cuMemImportFromShareableHandle / cuIpcOpenMemHandle
  stream_query,   // cuStreamGetCaptureInfo / cuStreamGetFlags (stream_capture_id, stream_is_blocking)
  count_
};
inline constexpr std::size_t kOpCount = static_cast<std::size_t>(Op::count_);
const char* op_name(Op op) noexcept;

// Driver calls made so far and the time spent in them, per operation (failed calls included). A
// GPU measures the time around each call; the simulated device reports its latency model's figures
// (zero without sim_latency).
struct CallStats {
  std::array<std::uint64_t, kOpCount> calls{};
  std::array<double, kOpCount> seconds{};
  double total_seconds() const noexcept {
    double t = 0.0;
    for (double s : seconds) t += s;
    return t;
  }
  // What happened since `before` (a run's share of a driver that may outlive it).
  CallStats since(const CallStats& before) const noexcept {
    CallStats d;
    for (std::size_t i = 0; i < kOpCount; ++i) {
      d.calls[i] = calls[i] - before.calls[i];
      d.seconds[i] = seconds[i] - before.seconds[i];
    }
    return d;
  }
  // The operations that were called, by name, for results and reports.
  std::vector<DriverCallTime> by_call() const;
};

struct MemInfo {
  std::size_t free = 0;
  std::size_t total = 0;
};

// How physical memory created by create() may be shared with other processes.
enum class ShareableHandle : std::uint8_t { none, posix_fd, fabric };

// An exported physical handle or driver allocation, as bytes another process can import.
struct ExportedHandle {
  ShareableHandle type = ShareableHandle::none;
  int fd = -1;  // posix_fd: a file descriptor owned by the caller, close-on-exec (a program the process
                // execs, e.g. a compiler or a data loader, does not inherit it and keep the memory alive)
  std::array<std::uint8_t, 64> bytes{};       // fabric handle, or cuIpcGetMemHandle's 64 bytes
};

class Driver {
 public:
  virtual ~Driver() = default;

  virtual const char* kind() const noexcept = 0;  // "cuda" or "sim"
  virtual int device() const noexcept = 0;
  virtual std::string device_name() const = 0;
  // Allocation granularity of physical memory (cuMemGetAllocationGranularity, recommended); 0 on a
  // device without virtual memory management, whose reserve/create/import_handle refuse
  // (driver_error CUDA_ERROR_NOT_SUPPORTED) while mem_alloc and the cuda_ipc calls work.
  virtual std::size_t granularity() const noexcept = 0;
  virtual MemInfo mem_info() = 0;
  // Thread-safe (a stats reader need not hold the allocator's lock).
  virtual CallStats call_stats() const = 0;

  // --- virtual memory management ---
  // Reserve `bytes` (a multiple of granularity()) of virtual address space; no memory behind it.
  virtual dev_ptr reserve(std::size_t bytes) = 0;
  virtual void free_reserve(dev_ptr base, std::size_t bytes) = 0;
  // Create `bytes` (multiple of granularity()) of physical memory. OOM -> driver_error(2).
  virtual phys_handle create(std::size_t bytes) = 0;
  virtual void release(phys_handle handle) = 0;
  // Map a whole handle at `ptr` (inside a reservation, aligned to granularity()).
  virtual void map(dev_ptr ptr, std::size_t bytes, phys_handle handle) = 0;
  virtual void unmap(dev_ptr ptr, std::size_t bytes) = 0;
  // Make [ptr, ptr+bytes) readable and writable by this device and every device added with
  // add_access_device().
  virtual void set_access(dev_ptr ptr, std::size_t bytes) = 0;

  // --- plain allocations (split_merge backend) ---
  virtual dev_ptr mem_alloc(std::size_t bytes) = 0;
  virtual void mem_free(dev_ptr ptr) = 0;
  // Stream-ordered allocations from the driver's default pool (cuMemAllocAsync/cuMemFreeAsync):
  // only the benchmarks use them, as the baseline users would pick instead of a caching allocator.
  virtual dev_ptr mem_alloc_async(std::size_t bytes, stream_t stream);
  virtual void mem_free_async(dev_ptr ptr, stream_t stream);

  // --- streams and events ---
  virtual stream_t stream_create() = 0;  // non-blocking (CU_STREAM_NON_BLOCKING)
  // Tests: a stream created with flags 0, which the legacy stream waits for. The default throws
  // CUDA_ERROR_NOT_SUPPORTED.
  virtual stream_t stream_create_blocking();
  virtual void stream_destroy(stream_t stream) = 0;
  // Whether the legacy stream's work waits for `stream`'s (cuStreamGetFlags: created without
  // CU_STREAM_NON_BLOCKING; the legacy and per-thread default streams). Measured on the H200: a
  // synchronization of the legacy stream waits for such a stream's queued work, also once the
  // stream is destroyed, and for no non-blocking stream's. Refused for a capturing stream (the
  // capture is invalidated): ask only of a stream that does not capture. The default says false.
  virtual bool stream_is_blocking(stream_t stream);
  virtual event_t event_create() = 0;
  virtual void event_destroy(event_t event) = 0;
  virtual void event_record(event_t event, stream_t stream) = 0;
  virtual bool event_query(event_t event) = 0;  // true when the recorded work is complete
  virtual void event_synchronize(event_t event) = 0;
  virtual void stream_synchronize(stream_t stream) = 0;
  virtual void device_synchronize() = 0;

  // --- CUDA graph capture ---
  // The id of the capture `stream` takes part in (cuStreamGetCaptureInfo), 0 when it captures
  // nothing. A stream that captures in global or thread-local mode (PyTorch's torch.cuda.graph
  // uses global) makes "unsafe" calls fail with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and
  // invalidates the capture: measured on the H200, cuStreamSynchronize, cuCtxSynchronize,
  // cuEventQuery, cuEventSynchronize, cuMemAlloc and cuMemFree, made by the capturing thread or,
  // in global mode, by any thread; the virtual memory calls (cuMemCreate, cuMemMap, cuMemSetAccess,
  // cuMemUnmap, cuMemRelease, cuMemAddressReserve) and cuEventRecord on another stream are
  // permitted. The CUDA driver layer makes mem_alloc, mem_free, event_query, event_synchronize and
  // stream_synchronize in relaxed capture mode (as PyTorch makes cudaMalloc), where they are
  // permitted, except what no mode permits (measured, driver 580): cuCtxSynchronize; a
  // synchronization of a capturing stream; a query or synchronization of an event recorded during
  // a capture (CUDA_ERROR_CAPTURED_EVENT); a synchronization of the legacy stream while a blocking
  // stream captures. Those fail and invalidate the capture in any mode. The default (drivers of
  // tests) captures nothing. Asked of the legacy stream while a blocking stream captures, CUDA
  // answers CUDA_ERROR_STREAM_CAPTURE_IMPLICIT (kCaptureImplicitCode), and that capture stays valid:
  // the one question that sees a capture on any blocking stream, untold ones on other threads' too.
  virtual std::uint64_t stream_capture_id(stream_t stream);
  static constexpr int kCaptureImplicitCode = 906;
  // Whether a failed question about a stream says the stream no longer exists (CUDA_ERROR_INVALID_
  // CONTEXT, _INVALID_HANDLE, _CONTEXT_IS_DESTROYED): such a stream captures nothing. Any other
  // failure of stream_capture_id says nothing about a capture either way. (A stream destroyed with
  // cuStreamDestroy gets no such answer: measured on an H100, driver 580.159, cuStreamGetCaptureInfo
  // on it crashed the process. Hence the rule that a stream outlives what is cached for it.)
  static bool stream_gone(const driver_error& e) noexcept { return e.code() == 201 || e.code() == 400 || e.code() == 709; }
  // How a capture restricts "unsafe" calls (CUstreamCaptureMode). cuGraphInstantiate is one
  // (measured on the H200: refused with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED while another capture
  // is underway in global mode), so two captures at once end one after the other only when the
  // one still underway is relaxed, or thread-local on another thread (PyTorch's
  // capture_error_mode).
  enum class CaptureMode : std::uint8_t { global, thread_local_mode, relaxed };
  // Tests and tools: capture `stream`'s work (global mode unless told), end it into an executable
  // graph, launch that graph, destroy it. The default throws CUDA_ERROR_NOT_SUPPORTED.
  virtual void capture_begin(stream_t stream, CaptureMode mode = CaptureMode::global);
  virtual graph_t capture_end(stream_t stream);
  virtual void graph_launch(graph_t graph, stream_t stream);
  virtual void graph_destroy(graph_t graph);
  // Tests: work queued on `stream` from now on waits for `event`'s (cuStreamWaitEvent); an event
  // recorded on a capturing stream makes `stream` join that capture (a fork: its work is captured,
  // stream_capture_id gives the capture's id). The default throws CUDA_ERROR_NOT_SUPPORTED.
  virtual void stream_wait_event(stream_t stream, event_t event);

  // --- data access (tests, the GPU stress test, contract checks) ---
  virtual void memset_d32(dev_ptr ptr, std::uint32_t value, std::size_t count, stream_t stream) = 0;
  virtual void copy_to_host(void* dst, dev_ptr src, std::size_t bytes) = 0;
  virtual void copy_from_host(dev_ptr dst, const void* src, std::size_t bytes) = 0;

  // --- peers ---
  virtual int device_count() = 0;
  virtual bool can_access_peer(int peer) = 0;
  // From now on set_access() also grants `peer`; returns false if it was already granted. This is
  // all that virtual memory management (expandable) needs: no context-level peer access, so none
  // of its limit of 8 peers. Throws driver_error when `peer` is not a device or cannot reach this one.
  virtual bool add_access_device(int peer) = 0;
  virtual std::vector<int> access_devices() const = 0;  // this device first
  // Lets `peer` reach this device's memory that is reached through contexts (mem_alloc, ipc_open):
  // cuCtxEnablePeerAccess from the peer's primary context to this device's. Returns false if it
  // was already enabled by this driver, or `peer` is this device; access already enabled by someone
  // else in the process (CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED) is taken as enabled now. CUDA
  // allows a device at most 8 such peers: past them, driver_error CUDA_ERROR_TOO_MANY_PEERS.
  virtual bool enable_context_peer(int peer) = 0;
  virtual std::vector<int> context_peers() const = 0;  // enabled by enable_context_peer, in order

  // --- sharing with other processes ---
  virtual ShareableHandle shareable_handle_type() const noexcept = 0;  // what create() makes
  // create() makes GPUDirect RDMA capable memory (where the device supports it with virtual memory
  // management, as PyTorch's expandable segments ask for), so NICs can register it (NCCL over
  // InfiniBand, nvidia-peermem, dma-buf).
  virtual bool gpu_direct_rdma() const noexcept { return false; }
  // When the type asked for in the options was not available: why, and what is used instead.
  virtual std::string shareable_fallback_reason() const { return {}; }
  virtual ExportedHandle export_handle(phys_handle handle) = 0;
  virtual phys_handle import_handle(const ExportedHandle& exported) = 0;
  virtual ExportedHandle ipc_export(dev_ptr mem_alloc_ptr) = 0;  // cuIpcGetMemHandle
  virtual dev_ptr ipc_open(const ExportedHandle& exported) = 0;  // cuIpcOpenMemHandle
  // cuMemGetAddressRange: the base and size of the allocation (cuMemAlloc'd, or opened by ipc_open)
  // that `ptr` lies in. An import checks with it that a handle names no more than the memory it opens.
  virtual std::pair<dev_ptr, std::size_t> address_range(dev_ptr ptr) = 0;
  virtual void ipc_close(dev_ptr ptr) = 0;                       // cuIpcCloseMemHandle
};

// ---------------------------------------------------------------------------------------------
// Factories.

struct CudaOptions {
  // Shareable handle type requested from cuMemCreate. fabric falls back to posix_fd, and posix_fd to
  // none, when the device or platform does not allow it (Driver::shareable_fallback_reason() says why).
  ShareableHandle shareable = ShareableHandle::none;
};

// Throws driver_error when libcuda cannot be loaded, cuInit fails or the device does not exist.
std::unique_ptr<Driver> make_cuda_driver(int device, const CudaOptions& options = {});

// Whether a CUDA device is usable (libcuda loads, cuInit succeeds, at least one device). On false,
// `why` (if given) says what failed. Thread-safe; the answer is computed once.
bool cuda_usable(std::string* why = nullptr);
int cuda_device_count();  // 0 when CUDA is not usable

}  // namespace expseg::driver
