// expseg::Allocator — one caching allocator for one device.
//
// Stream contract (as RMM's and PyTorch's): memory returned by allocate(bytes, stream) may be used
// by work queued on `stream` without synchronization. After deallocate(p), the block may be handed
// out again to a later allocate() on the same stream at once (stream order makes that safe); it is
// handed to another stream only after the work queued on its stream is known complete. If other
// streams used the memory, call record_stream(p, other) before deallocate(p): the block then
// waits for events recorded on those streams. cudaStreamPerThread (CU_STREAM_PER_THREAD) is the
// calling thread's own stream: each thread's blocks are cached apart, as RMM's pools keep them.
// Once the thread has exited, what is cached for its stream is given back to the device at the
// next allocation that misses the cache, release_cached() or set_limit() (expandable: after a
// synchronization of the legacy stream, which waits for every thread's per-thread stream: work the
// thread queued may still run); its blocks still live (freed by another thread later) go back the
// same way once freed.
// A stream given here must outlive the memory cached for it and every live block that has it
// recorded (record_stream: that block's deallocate() records an event on it): destroy it only after
// release_stream(), which refuses while such a block lives, or after release_cached() once none
// does (the expandable backend synchronizes a block's stream before unmapping its memory, and the driver
// may crash on a destroyed stream), as PyTorch requires of its external streams. The C API's CuPy
// entry point (expseg_cupy_malloc) is the exception: it never synchronizes its streams.
//
// Thread safety: every method may be called from any thread; one lock per allocator, held for the
// cached malloc/free path only as long as the free-block index update takes. (expandable also
// updates the live bytes of each physical handle under the block: one to three for most blocks,
// up to ~100 for a large block reusing memory that grew in small handles; see add_live.)
//
// Errors: allocate() throws expseg::out_of_memory (a std::bad_alloc) with a report saying why;
// deallocate()/record_stream() of a pointer that is not a live allocation throw
// expseg::invalid_pointer; failing driver calls throw expseg::driver_error. After any throw the
// allocator is unchanged and keeps serving, except that release_cached(), set_limit(),
// release_stream() and end_graph_pool() may have done part of their work before a driver error
// (memory given back stays given back; each says what), and so may allocate(): cached memory it
// gave back to make room for the request stays given back when the request then fails. At an
// out_of_memory, split_merge, as PyTorch, has given back every cached segment it could; expandable
// gives back nothing for a request that would not fit even with all its idle memory given back (it
// checks that first: its cache stays mapped for the requests that follow, and the report counts it
// as reserved but unallocated; release_cached() gives it back), and otherwise only what it unmapped
// before the device itself refused. The allocator stays consistent.
//
// Size 0: allocate(0) returns nullptr and deallocate(nullptr) does nothing (PyTorch's behaviour).
#pragma once

#include <cstddef>
#include <functional>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "expseg/config.hpp"
#include "expseg/errors.hpp"
#include "expseg/ipc.hpp"
#include "expseg/snapshot.hpp"
#include "expseg/stats.hpp"
#include "expseg/trace.hpp"

// The public API keeps default visibility; the rest of libexpseg.so is built hidden.
#pragma GCC visibility push(default)

namespace expseg {

using stream_t = void*;  // a cudaStream_t / CUstream; nullptr is the default stream

// Whether a CUDA device is usable here (libcuda loads, cuInit succeeds, at least one device exists).
// On false, `why` (if given) says what failed. Thread-safe; the answer is computed once. Tools use it
// to pick device:cuda when it works and the simulated device otherwise.
bool cuda_available(std::string* why = nullptr);
// How many CUDA devices this process sees (CUDA_VISIBLE_DEVICES applies); 0 when CUDA is not usable.
int cuda_device_count();

struct DeviceInfo {
  int index = 0;
  std::string kind;   // "cuda" or "sim"
  std::string name;
  std::size_t total_bytes = 0;
  std::size_t free_bytes = 0;
  // Physical memory's mapping granularity (cuMemGetAllocationGranularity); 0 on a device without
  // CUDA virtual memory management, where only backend:split_merge can be used.
  std::size_t granularity = 0;
  // The shareable handle type physical memory is created with (expandable IPC), and, when it is not
  // the one the config's ipc_handle asked for, why (e.g. fabric handles refused in a container).
  IpcHandle ipc_handle = IpcHandle::none;
  std::string ipc_fallback_reason;
  bool gpu_direct_rdma = false;     // expandable memory is created GPUDirect RDMA capable (NICs can register it)
  std::vector<int> access_devices;  // devices that can access this allocator's memory: itself first, then peers
};

namespace detail {
struct AllocatorAccess;  // tests and the replay engine reach the driver through this
}

class Allocator {
 public:
  // Builds the allocator for `device` (an index of the config's device kind) from `config`.
  explicit Allocator(const Config& config = Config::from_env(), int device = 0);
  // Gives all device memory back, live allocations included, after a device synchronization (work
  // may still use it). Where that cannot be had (it fails, or a CUDA graph capture expseg was told
  // of is still underway, which it would invalidate), expandable's memory stays mapped (leaked until
  // the process exits) rather than unmapped under running work; during such a capture split_merge's
  // segments likewise stay allocated (the graph writes its pool's memory when launched).
  ~Allocator();
  Allocator(const Allocator&) = delete;
  Allocator& operator=(const Allocator&) = delete;

  void* allocate(std::size_t bytes, stream_t stream = nullptr);
  void deallocate(void* ptr);
  void record_stream(void* ptr, stream_t stream);
  // Gives back to the device every cached byte that can be given back (empty_cache()). Throws
  // expseg::error while a graph capture allocates into a pool (it would have to synchronize);
  // expseg::driver_error when a give-back fails (what went back before stays given back, the
  // allocator stays consistent; a later call gives back the rest).
  void release_cached();
  // Before destroying a stream the program created (a stream per request, say): synchronizes it,
  // completes the frees that waited for it, gives back everything cached for it and forgets it
  // (expandable keeps the address range of the stream's segment, nothing mapped in it, for the next
  // new stream's segment; release_cached gives it back). The stream may then be destroyed; naming it
  // again later starts afresh. Blocks it allocated into a graph pool (a capture, or
  // begin_pool_allocations) belong to the pool and do not hold it: they may be freed after the
  // stream is destroyed, and serve the pool as before. Throws expseg::error,
  // changing nothing else, while blocks allocated on it are live or wait for other streams' work
  // that has not passed (frees whose events have passed complete first, and frees held for a capture
  // that has ended get their events), while a live block or a held free has it recorded
  // (record_stream), while it or a graph pool's capture
  // is capturing, while it allocates into a graph pool (begin_pool_allocations without its
  // end_pool_allocations), and for the default, legacy or per-thread stream; expseg::driver_error when the
  // synchronization or a give-back fails (what went back before stays given back, the allocator
  // stays consistent; a later call gives back the rest).
  void release_stream(stream_t stream);

  // CUDA graphs' private pools, as PyTorch's torch.cuda.graph keeps them. A graph replays the
  // addresses its capture used, so memory it allocated, and freed, during capture must not be
  // handed to anyone else while the graph may run.
  //   begin_graph_pool(pool, s): `s` is capturing (cuStreamBeginCapture); until end_graph_pool(pool),
  //     allocations on every stream of that capture (s and the streams it forked to) come from
  //     private pool `pool` (any nonzero number; a pool that does not exist is made), and their
  //     frees go back to it, for later allocations of the pool only: of captures on the same
  //     stream, as PyTorch's private pools (eager work there may still use a freed block). Each
  //     begin takes one use of the pool (a graph that replays it). Captures may share a pool at
  //     once: each end_graph_pool(pool) ends one of them, the one whose capture has ended (call it
  //     after cuStreamEndCapture: while every capture of the pool still runs, it throws
  //     expseg::error, nothing changed, as the capture's later requests would leave the pool; a
  //     capture on cudaStreamPerThread can be asked about only from its own thread, so from another
  //     thread it counts as running until no blocking stream captures, as the legacy stream's
  //     question tells, or that thread exits).
  //     Unlike other calls, it may throw after its change: when the frees held for the capture
  //     cannot be completed (expseg::driver_error), the end is done all the same, as the error
  //     says; the frees stay held for the next end_graph_pool or release_cached().
  //   release_graph_pool(pool): drops one use; at none, the pool's cached memory is given back:
  //     expandable, at once when no capture is underway (else at the end_graph_pool that ends the
  //     last one); split_merge, as PyTorch's releasePool, at release_cached() or a request's last
  //     retry before an OOM. Blocks of it still allocated go back once freed, at the next of those
  //     points (expandable: or a request that misses the cache).
  // While a capture allocates into a pool, expseg makes no call the capture refuses (a
  // synchronization it forbids, an event query, cuMemFree): it reclaims only idle memory of streams
  // it may synchronize (expandable; see prepare_capture), processes no cross-stream free (those of
  // the capture's streams wait for its end), and fails a request it cannot serve otherwise. The
  // expandable backend may still map new memory (cuMemCreate/Map are permitted while capturing);
  // split_merge's cuMemAlloc runs in relaxed capture mode, as PyTorch's. A capture that expseg is
  // not told of is noticed on the slow path of a request on its stream, and of one on another
  // stream when expseg has an arena for its stream, or the stream was named to prepare_capture and
  // begin_graph_pool has not taken it yet (so the window between cuStreamBeginCapture and
  // begin_graph_pool is safe), or it is the calling thread's per-thread stream; what a
  // synchronization it refuses would take then stays cached. Its blocks are not
  // kept apart: use begin_graph_pool for graphs. Throws expseg::error for a
  // stream that is not capturing, a capture that already has a pool, or pool 0.
  void begin_graph_pool(std::uint64_t pool, stream_t capture_stream);
  // Optional, just before cuStreamBeginCapture(s) and begin_graph_pool(pool, s): asks now whether
  // `s` blocks (cuStreamGetFlags; it cannot be asked once s captures). When every told capture
  // underway is on a stream that does not block, the expandable backend takes back during it the
  // idle memory that the legacy stream's synchronization covers (the legacy stream's, other
  // threads' per-thread streams', blocking CuPy streams'): measured on the H200, that
  // synchronization is permitted while a non-blocking stream captures, and fails and invalidates
  // the capture while a blocking one does. Without it, such memory stays cached during the capture
  // (a request that needs it fails). A request during the capture from another of its streams (a
  // fork) counts as a stream that may block. The answer is taken by the next begin_graph_pool on
  // `s` (the 16 latest are kept). Throws expseg::error for a stream that captures already,
  // driver_error when the driver cannot say.
  void prepare_capture(stream_t s);
  void end_graph_pool(std::uint64_t pool);
  void release_graph_pool(std::uint64_t pool);
  // Allocations into a graph pool outside a capture, as PyTorch's beginAllocateToPool there (its CUDA
  // graph trees, torch.compile(mode="reduce-overhead"), warm a graph up this way, so that the
  // warm-up's outputs live in the pool its recording allocates from): until
  // end_pool_allocations(pool, s), requests on stream `s` come from graph pool `pool` (made if it does
  // not exist) and their frees go back to it, for later requests of `s` into the pool (its
  // captures' among them). Takes one use of the pool, which release_graph_pool drops. Throws
  // expseg::error for pool 0, a stream that captures (begin_graph_pool is for captures) or one that
  // allocates into a pool already; end_pool_allocations for a stream that does not.
  void begin_pool_allocations(std::uint64_t pool, stream_t stream);
  void end_pool_allocations(std::uint64_t pool, stream_t stream);
  // The allocated blocks of graph pool `pool` (address, size), by address: what PyTorch's
  // checkPoolLiveAllocations and getCheckpointState look at. Blocks allocated into the pool before
  // its last release belong to it until freed (a later begin takes the pool up again). Empty for a
  // pool that does not exist. Walks the live blocks: for the trees' checks, not for a hot path.
  std::vector<std::pair<std::uint64_t, std::size_t>> graph_pool_blocks(std::uint64_t pool) const;
  // Allocates exactly [ptr, ptr + size) again in graph pool `pool`, for PyTorch's
  // setCheckpointPoolState, which puts a pool back to the blocks a checkpoint (graph_pool_blocks)
  // listed once replays have written them: the range must lie in free memory the pool holds, as
  // when those blocks were freed and nothing has allocated there since. The block is freed with
  // deallocate(ptr) as any other. Throws expseg::error, nothing changed, otherwise (a pool that does
  // not exist or was released, a range not free in it, a size or address not a multiple of 512 B).
  void restore_graph_pool_block(std::uint64_t pool, void* ptr, std::size_t size);

  Stats stats() const;
  void reset_peak_stats();
  void reset_accumulated_stats();
  // Bytes of device memory this allocator may hold; 0 removes the limit. Lowering it gives back
  // cached memory above the new limit at once, in whole cached pieces (split_merge's unsplit
  // segments, expandable's idle handles), chosen to give back the least beyond the excess. What
  // cannot go (memory live blocks use, split_merge's segments they split) stays held, so reserved
  // may stay above the new limit; then split_merge, as PyTorch's caching allocator, still serves
  // requests from the free blocks it holds (only new device memory must fit under the limit), while
  // expandable maps nothing new until reserved is back under the limit. Expandable's guarantee
  // under a limit (a request fails only when the pages live blocks touch, plus the request, exceed
  // it) covers memory mapped while a limit is set: a block placed without one in part of a larger
  // handle keeps that handle mapped whole until the block is freed (README: "How the expandable
  // backend decides"); `limit:` in the configuration gives the guarantee from the start. A
  // driver_error while giving back cached memory for a lower limit leaves the old limit, and what
  // went back before stays given back (the allocator stays consistent). Throws expseg::error, nothing
  // changed, while a CUDA graph capture allocates into a graph pool (begin_graph_pool): a give-back
  // would synchronize, which invalidates the capture.
  void set_limit(std::size_t bytes);
  std::size_t limit() const;

  Snapshot snapshot() const;
  // The report of the most recent out_of_memory, if any.
  std::optional<OomReport> last_oom() const;
  // Called at every out-of-memory with its report, on the thread whose allocation failed, after
  // the report (and the oom_dump file, if configured) is complete and the allocator's lock is
  // released, right before out_of_memory is thrown. The observer may call this allocator (stats(),
  // snapshot(), release_cached(), even allocate()). If it throws, its exception propagates from
  // allocate() instead of out_of_memory; the allocator is consistent either way. An OOM inside the
  // observer itself (on its thread) is thrown without calling it again. An empty function removes
  // the observer; setting one replaces the previous one. An OOM already being reported on another
  // thread holds its own reference to the previous observer and may still call it after
  // set_oom_observer returns: what an observer captures by reference must outlive such a call.
  // Not called for a request of 1 EiB or more: refused up front (as PyTorch's allocate() refuses
  // it), with out_of_memory and its report, but no OOM of the allocator (nor in num_ooms, oom_dump).
  using OomObserver = std::function<void(const OomReport&)>;
  void set_oom_observer(OomObserver observer);

  // Event recorder: every allocate/free (and map/unmap, allocate failure) with a timestamp. ring > 0
  // keeps only the last `ring` events. recorded() can be written with write_trace_file().
  void start_recording(std::size_t ring = 0);
  void stop_recording();
  bool recording() const;
  std::vector<TraceEvent> recorded() const;
  // Whether recorded() does not start from an empty allocator: the recording began while memory was
  // allocated or cached, or events were dropped (a full ring, or no host memory for one). A replay
  // then starts from another state than the run did; where blocks were live at the start or events
  // were dropped, it frees what it never saw allocated and needs ReplayOptions::lenient (expseg
  // replay --lenient). (Memory only cached at the start replays strictly.)
  bool recorded_partial() const;
  // snapshot() and recorded() of one moment (one lock): the events end where the snapshot stands,
  // as a viewer that walks the events back from the snapshot needs (PyTorch's memory_viz).
  Snapshot snapshot_with_recorded(std::vector<TraceEvent>& events) const;

  // Grants device `peer` access to everything this allocator maps, now and later: expandable memory
  // through cuMemSetAccess alone (once per mapped range now, and on every later growth; any number
  // of peers), cuMemAlloc memory (split_merge, and cuda_ipc imports of either backend) through
  // cuCtxEnablePeerAccess from the peer's primary context, which CUDA allows for at most 8 peers of
  // a device (driver_error CUDA_ERROR_TOO_MANY_PEERS past them). Enabling a peer twice, or the
  // allocator's own device, does nothing. Throws expseg::error when `peer` is not a
  // device or cannot reach this one (no P2P path), driver_error when the driver refuses; when the
  // grant over memory already mapped fails partway, the message says so: memory mapped later is
  // granted, and calling again completes the rest.
  void enable_peer_access(int peer);

  // IPC (expseg/ipc.hpp). export_ipc: `ptr`, the start of a live allocation, as a handle another
  // process can import. Throws invalid_pointer when `ptr` is not one, ipc_error when this allocator
  // cannot export (expandable with ipc_handle:none: set ipc_handle:posix_fd), driver_error.
  IpcMemHandle export_ipc(void* ptr);
  // Maps `handle` into this process through this allocator's device (the memory stays the
  // exporter's; this allocator's stats do not count it). Peers granted with enable_peer_access,
  // before or after the import, may use it too. On the simulated device, in-process
  // round trips work through the exporting allocator itself.
  ImportedMemory import_ipc(const IpcMemHandle& handle);

  // Checks every invariant of the backend and the frontend; throws expseg::error naming the first
  // broken one. Walks all blocks: for tests and debugging, not for hot paths.
  void validate() const;

  // The configuration it was created with, with the limit set_limit set last (in bytes).
  Config config() const;
  BackendKind backend() const noexcept;
  int device() const noexcept;
  DeviceInfo device_info() const;

 private:
  struct Impl;
  friend struct detail::AllocatorAccess;
  explicit Allocator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace expseg

#pragma GCC visibility pop
