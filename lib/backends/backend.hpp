// The backend interface: how the frontend (Allocator) asks a caching pool for blocks.
//
// Contract (both backends):
//   - Everything runs under the frontend's lock; a backend is single-threaded.
//   - allocate() returns an allocated, mapped block of at least round_size(requested) bytes on
//     `stream`, or nullptr when no memory can be found after the backend's own retries (the
//     frontend then builds the OOM report). A driver failure other than OOM throws driver_error;
//     either way the backend is left consistent and leaks nothing.
//   - A block freed on one stream is handed out again only on that stream; memory moves between
//     streams only after the work queued on its old stream is known complete.
//   - The backend owns the per-pool stats (allocation, segment, active, inactive_split, *_bytes,
//     num_alloc_retries, num_device_alloc/free, physical_handles, num_free_blocks). The frontend
//     owns num_ooms and num_sync_all_streams.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/block.hpp"
#include "driver/driver.hpp"
#include "expseg/config.hpp"
#include "expseg/snapshot.hpp"
#include "expseg/stats.hpp"

namespace expseg::backends {

// PyTorch's size rounding with roundup_power2_divisions (CUDACachingAllocator's round_size), which
// PyTorch applies with and without expandable segments, so both backends do: a size in an interval
// (powers of two from 1 MiB up) configured with N > 1 divisions rounds up to the next 1/N step
// between powers of two. Returns 0 when no division applies to `size` (the backend's own 512 B
// rounding then holds). Out of line: backends call it only when divisions are configured.
std::size_t roundup_power2_divisions_size(const Config& c, std::size_t size, std::size_t min_block) noexcept;
bool has_roundup_power2_divisions(const Config& c) noexcept;

// Stream keys: what the frontend hands the backends instead of a CUstream that the driver may be
// called with. Their top bits are set, which no CUstream (a user-space pointer) has; a backend never
// synchronizes the stream a key stands for: it waits for the calling thread's own per-thread stream
// through CU_STREAM_PER_THREAD, for another thread's and for a blocking foreign stream through the
// legacy stream, and for anything else with a device synchronization (expandable's synchronize_once).
//   - cudaStreamPerThread (CU_STREAM_PER_THREAD) names another stream in each host thread: the
//     calling thread's key (kPerThreadKeyTag | a number never reused), so that each thread's
//     per-thread stream caches its own blocks. No other thread can name that stream. A deliberate
//     difference from PyTorch's caching allocator (policy:pytorch too), which keys blocks by the
//     stream value, so that threads passing cudaStreamPerThread share one cache: a block freed on
//     one thread's per-thread stream would go to another's with no synchronization between the two
//     streams. A key's cache goes back when its thread has exited (CuPy keeps a dead thread's arena).
//   - A stream its owner may destroy while memory stays cached for it (CuPy destroys a Stream when
//     it is collected): kForeignStreamTag | the stream (expseg_cupy_malloc's). On CUDA 13 a
//     cuStreamSynchronize of a destroyed stream failed once and crashed the process the next time.
inline constexpr std::uintptr_t kPerThreadStream = 0x2;
inline constexpr std::uintptr_t kLegacyStream = 0x1;  // CU_STREAM_LEGACY: the default stream, as nullptr
inline bool is_legacy_stream(driver::stream_t s) noexcept {
  return s == nullptr || reinterpret_cast<std::uintptr_t>(s) == kLegacyStream;
}
inline constexpr std::uintptr_t kPerThreadKeyTag = std::uintptr_t{0xFFFF} << 48;
inline constexpr std::uintptr_t kForeignStreamTag = std::uintptr_t{0xFFFE} << 48;
inline bool is_stream_key(driver::stream_t s) noexcept {  // either kind
  return (reinterpret_cast<std::uintptr_t>(s) & kForeignStreamTag) == kForeignStreamTag;
}
//   - A CUDA graph's private pool (Allocator::begin_graph_pool): kPerThreadKeyTag | kGraphPoolBit |
//     a number never reused. It is a per-thread key in all but name: no stream but its own capture
//     allocates on it, and it retires (is_retired_key) when the pool is released.
inline constexpr std::uintptr_t kGraphPoolBit = std::uintptr_t{1} << 47;
inline bool is_per_thread_key(driver::stream_t s) noexcept {  // graph pools' keys included
  return (reinterpret_cast<std::uintptr_t>(s) & kPerThreadKeyTag) == kPerThreadKeyTag;
}
inline bool is_graph_pool_key(driver::stream_t s) noexcept {
  return (reinterpret_cast<std::uintptr_t>(s) & (kPerThreadKeyTag | kGraphPoolBit)) == (kPerThreadKeyTag | kGraphPoolBit);
}
// A new graph pool's key (live until retire_graph_pool_key), and its release.
driver::stream_t new_graph_pool_key();
void retire_graph_pool_key(driver::stream_t key) noexcept;
// Memory cached for a live graph pool: its graphs' replays use it, freed or not, so no backend may
// unmap, free or hand it to another stream until the pool is released (retired).
inline bool is_live_graph_pool_key(driver::stream_t s) noexcept;
// The stream a capture-status query for allocations on key `s` names (the calling thread's
// per-thread stream for its key, a foreign key's stream); nullptr for a graph pool's key.
inline driver::stream_t capture_query_stream(driver::stream_t s) noexcept {
  const auto v = reinterpret_cast<std::uintptr_t>(s);
  if (!is_stream_key(s)) return s;
  if (is_graph_pool_key(s)) return nullptr;
  if (is_per_thread_key(s)) return reinterpret_cast<driver::stream_t>(kPerThreadStream);
  return reinterpret_cast<driver::stream_t>(v & ~kPerThreadKeyTag);
}
// Per-thread keys of threads that have exited ("retired"): no one can allocate on such a stream
// again, so a backend gives back the memory cached for it (see the backends' reap_retired). A thread
// holds its key in a PerThreadKey (the frontend's thread_local); its exit only marks the key retired
// in a process-wide registry, never destroyed, and calls no driver (CUDA may be torn down by then,
// and another thread may have to wait for work still queued on the stream). Backends look on their
// slow paths and in release_cached/trim, when the generation has moved: never on the cached path.
class PerThreadKey {
 public:
  PerThreadKey() noexcept;   // takes a number never used before
  ~PerThreadKey();           // marks it retired
  PerThreadKey(const PerThreadKey&) = delete;
  PerThreadKey& operator=(const PerThreadKey&) = delete;
  driver::stream_t stream() const noexcept { return reinterpret_cast<driver::stream_t>(key_); }

 private:
  friend bool is_retired_key(driver::stream_t key) noexcept;
  std::uintptr_t key_;
  PerThreadKey* prev_ = nullptr;  // the registry's list of keys its set found no memory for
  PerThreadKey* next_ = nullptr;
};
// The calling thread's key (made at its first call; the thread's exit retires it). Out of line and
// cold: the cached paths call it only for cudaStreamPerThread.
driver::stream_t per_thread_key() noexcept;
// The calling thread's key if it has one yet, else nullptr (makes none: for comparisons).
driver::stream_t calling_thread_key() noexcept;
// Changes whenever a thread's key or a graph pool's key is retired.
std::uint64_t retired_keys_generation() noexcept;
// Whether per-thread key `key` belongs to a thread that has exited, or graph pool key `key` to a
// released pool (a hashed lookup).
bool is_retired_key(driver::stream_t key) noexcept;
std::uint64_t retired_key_lookup_steps() noexcept;  // tests: entries is_retired_key has looked at
inline bool is_live_graph_pool_key(driver::stream_t s) noexcept { return is_graph_pool_key(s) && !is_retired_key(s); }
// The key of a stream the caller may destroy; the default streams (NULL, legacy, per-thread) as they are.
inline driver::stream_t foreign_stream_key(driver::stream_t s) noexcept {
  const auto v = reinterpret_cast<std::uintptr_t>(s);
  return v <= kPerThreadStream ? s : reinterpret_cast<driver::stream_t>(kForeignStreamTag | v);
}
// The stream as users see it in snapshots, OOM reports and traces: a foreign key as its stream.
inline std::uintptr_t shown_stream(driver::stream_t s) noexcept {
  const auto v = reinterpret_cast<std::uintptr_t>(s);
  return (v & kPerThreadKeyTag) == kForeignStreamTag ? v & ~kPerThreadKeyTag : v;
}

// What a backend tells the frontend while it works.
class FrontendHooks {
 public:
  virtual ~FrontendHooks() = default;
  // Driver-level happenings the event recorder logs next to allocations.
  virtual void on_map(std::uint64_t addr, std::size_t bytes, driver::stream_t stream) = 0;
  virtual void on_unmap(std::uint64_t addr, std::size_t bytes, driver::stream_t stream) = 0;
  // Wait for the events of every pending cross-stream free and complete those frees (PyTorch's
  // synchronize_and_free_events), before cached memory is given back to the device.
  virtual void synchronize_pending_frees() = 0;
  // Whether any cross-stream free is still waiting for its events.
  virtual bool has_pending_frees() const noexcept = 0;
  // Complete the cross-stream frees whose events have completed, without waiting (PyTorch's
  // process_events); true if any was. A backend that asks this before its slow path maps memory or
  // gives any back (expandable) lets the cached path poll two streams' queues a request instead of
  // every one.
  virtual bool process_pending_frees() = 0;
  // Whether a stream begin_pool_allocations routes into a graph pool captures (untold): its memory
  // lives under the pool's key, so no arena of the backend watches that stream.
  virtual bool routed_stream_captures() const noexcept { return false; }
};

// State shared between the frontend and its backend; guarded by the frontend's lock.
struct Context {
  driver::Driver& driver;
  const Config& config;
  Stats& stats;
  std::size_t limit = 0;         // bytes of device memory the backend may hold; 0 = no limit
  std::size_t device_total = 0;  // device capacity in bytes
  FrontendHooks* hooks = nullptr;
  // What the driver last refused with out of memory in an allocation's slow path (the backend
  // clears it there first): the OOM report tells the device saying no from a want of room.
  enum class Refusal : std::uint8_t { none, memory, address_range };
  Refusal refused = Refusal::none;
  // A CUDA graph capture is underway that the backend must not break (driver.hpp says which calls
  // would fail and invalidate it): split_merge gives back nothing while it is set (as PyTorch during
  // a capture), expandable only idle memory of streams it may synchronize (its arena_captures);
  // both may still map new memory. Set by the frontend while a capture allocates into a graph
  // pool, and by CaptureScope for a request on a capturing stream.
  bool capturing = false;
  // While `capturing`: every capture underway is one the frontend was told of, on a stream that
  // does not block (Allocator::prepare_capture asked it before the capture began), and no request's
  // stream of this operation captures untold. The legacy stream's synchronization is then permitted
  // (measured on the H200: while a non-blocking stream captures it waits and the capture stays
  // valid; while a blocking one does, it fails and invalidates the capture), so expandable may take
  // back idle memory it covers: the legacy stream's, other threads' per-thread streams', blocking
  // foreign streams'. A capture that forks to a blocking stream that allocates nothing is not seen.
  bool capture_spares_legacy = false;
  // Allocator::prepare_capture's answers (a stream's key, whether it blocks), each taken by the next
  // begin_graph_pool of its stream (the 16 latest kept). Until then the capture may have begun
  // untold, on a stream the backend may never have seen: expandable asks these streams too before
  // a synchronization that a capture would refuse (seen_capture).
  std::vector<std::pair<driver::stream_t, bool>> prepared_captures = {};
  // For the span of a backend request that begin_pool_allocations routed into a graph pool
  // (RoutedFrom): `routed`, and the stream it was made on (the legacy stream's is null), whose
  // capture the slow path asks instead of the pool's key's.
  bool routed = false;
  driver::stream_t routed_from = nullptr;
  std::size_t effective_limit() const noexcept { return limit ? limit : device_total; }
};

// Whether `key`'s stream captures a CUDA graph now: one driver query (~15-20 ns on the H200), for
// slow paths only. A per-thread key is asked of the calling thread's per-thread stream, a graph
// pool's key of nothing (false). The legacy stream counts as capturing while a blocking stream
// captures (CUDA refuses its work then, and the question says so without harm: Driver::
// stream_capture_id).
// Whether `stream` (a driver stream, not a key) captures a CUDA graph. A failed question says
// nothing about a capture, but that a stream the driver no longer knows (Driver::stream_gone)
// captures nothing, and 906 (the legacy stream while a blocking stream captures) that it counts as
// capturing. Any other failure is asked again once (a refusal of the moment); failing twice reads as
// capturing, so that nothing synchronizes the stream or unmaps its idle memory, which would
// invalidate a capture underway (was: read as not capturing at the first failure).
inline bool capture_question(driver::Driver& driver, driver::stream_t stream) noexcept {
  for (int tries = 1;; ++tries) {
    try {
      return driver.stream_capture_id(stream) != 0;
    } catch (const driver_error& e) {
      if (e.code() == driver::Driver::kCaptureImplicitCode) return true;
      if (driver::Driver::stream_gone(e)) return false;
    } catch (...) {
    }
    if (tries == 2) return true;
  }
}

inline bool stream_captures(Context& ctx, driver::stream_t key) noexcept {
  if (is_graph_pool_key(key)) return false;
  return capture_question(ctx.driver, capture_query_stream(key));
}

// For the span of a slow path: sets ctx.capturing when the request's stream (key) is capturing
// although no one said so (a capture the frontend was not told of: PyTorch's CUDAPluggableAllocator
// passes no begin/end of a graph's pool on), and then clears ctx.capture_spares_legacy (that
// capture's stream may block). One query (~15-20 ns on the H200), slow paths only.
class CaptureScope {
 public:
  CaptureScope(Context& ctx, driver::stream_t key) noexcept
      : ctx_(ctx), was_(ctx.capturing), spared_(ctx.capture_spares_legacy) {
    if (!was_ || spared_) {
      const bool untold = stream_captures(ctx, is_graph_pool_key(key) && ctx.routed ? ctx.routed_from : key);
      ctx.capturing = was_ || untold;
      ctx.capture_spares_legacy = spared_ && !untold;
    }
  }
  ~CaptureScope() {
    ctx_.capturing = was_;
    ctx_.capture_spares_legacy = spared_;
  }
  CaptureScope(const CaptureScope&) = delete;
  CaptureScope& operator=(const CaptureScope&) = delete;

 private:
  Context& ctx_;
  bool was_;
  bool spared_;
};

// Sets Context::routed / routed_from for its span when `routed` (otherwise nothing: one test on the
// cached path), and puts back what was there.
class RoutedFrom {
 public:
  RoutedFrom(Context& ctx, bool routed, driver::stream_t stream) noexcept : ctx_(routed ? &ctx : nullptr) {
    if (ctx_ != nullptr) [[unlikely]] {
      was_routed_ = ctx.routed;
      was_from_ = ctx.routed_from;
      ctx.routed = true;
      ctx.routed_from = stream;
    }
  }
  ~RoutedFrom() {
    if (ctx_ != nullptr) [[unlikely]] {
      ctx_->routed = was_routed_;
      ctx_->routed_from = was_from_;
    }
  }
  RoutedFrom(const RoutedFrom&) = delete;
  RoutedFrom& operator=(const RoutedFrom&) = delete;

 private:
  Context* ctx_;
  bool was_routed_ = false;
  driver::stream_t was_from_ = nullptr;
};

struct FreeSummary {
  std::size_t largest_free_block = 0;  // largest free block backed by memory
  // Of those, the largest the request could be served from: a free block serves only its own
  // stream (split_merge: and only requests of its pool, small or large, and as oversize_block
  // says). 0 without a request.
  std::size_t largest_usable_block = 0;
  // split_merge: the largest free block of the request's stream and pool, large enough for it, that
  // the oversize rules keep from it (one of max_split_size or more serves only requests of at least
  // that size, and only those it exceeds by less than max_non_split_rounding). 0 if none.
  std::size_t oversize_block = 0;
  // split_merge: a cached block would serve the request now, by the cached path's rules (stream,
  // pool, oversize blocks). The OOM path's last retry can make one (see the OOM report).
  bool cache_serves = false;
  std::size_t free_blocks = 0;         // free blocks backed by memory
  std::size_t releasable_bytes = 0;    // cached bytes that release_cached() would give back
  // Free bytes cached for live graph pools: no request but their captures' can use them. Of the
  // request's own pool (a request routed to a pool), only the free blocks smaller than the request:
  // those cannot serve it, nor can any backend give them back while the pool lives; a larger one
  // may serve it. Expandable: but those in frames live blocks touch, which live_footprint counts.
  std::size_t graph_pool_bytes = 0;
  // The free blocks that hold those bytes (counted in free_blocks and largest_free_block too): their
  // bytes (whole, for the message's figures), how many, the largest, and the largest free block
  // outside them, which the OOM report's fragmentation verdict names apart (as PyTorch's message
  // counts pool memory as allocated).
  std::size_t graph_pool_free_bytes = 0;
  std::size_t graph_pool_free_blocks = 0;
  std::size_t largest_graph_pool_block = 0;
  std::size_t largest_free_outside_pools = 0;
  // Free bytes cached for other streams that capture a CUDA graph now (the legacy stream while a
  // blocking stream captures): no backend gives them back before the capture ends (expandable: but
  // those in frames live blocks touch).
  std::size_t capture_kept_bytes = 0;
  // Device memory the live (allocated and pending) blocks occupy at the least: their bytes in a
  // split pool; the frames they touch in expandable segments.
  std::size_t live_footprint = 0;
  // expandable: the free bytes inside the frames live blocks touch (live_footprint = live bytes +
  // this), and the number of such partly used frames.
  std::size_t live_page_slack = 0;
  std::size_t live_partial_pages = 0;
  // What the request itself needs at the least (its rounded size; whole frames when expandable).
  std::size_t request_footprint = 0;
  // expandable: free bytes in whole frames of physical handles that live (or pending) blocks use in
  // part. A handle is unmapped only whole, so no request of another stream can get them while
  // those blocks live (a block placed without a limit in part of a free handle).
  std::size_t handle_pinned_bytes = 0;
};

// What another process must import to map an allocated block (Allocator::export_ipc, lib/ipc.cpp):
// the range [base, base + bytes) that holds the block, as one driver allocation (split_merge: the
// cuMemAlloc segment, exported with cuIpcGetMemHandle) or as physical handles mapped back to back
// from base (expandable: exported as shareable handles). The block starts at its addr - base.
struct ExportPlan {
  enum class Kind : std::uint8_t { driver_allocation, physical_handles };
  struct Piece {
    driver::phys_handle handle = 0;
    std::size_t bytes = 0;
  };
  Kind kind = Kind::driver_allocation;
  std::uint64_t base = 0;
  std::size_t bytes = 0;
  std::vector<Piece> pieces;  // physical_handles: in address order, their bytes sum to `bytes`
};

class Backend {
 public:
  // Both backends count oversize_allocations against max_split_size, so both report it (PyTorch
  // reports its configuration, -1 for unlimited, with expandable segments too).
  explicit Backend(Context& ctx) : ctx_(ctx) {
    ctx_.stats.max_split_size =
        ctx_.config.max_split_size == SIZE_MAX ? -1 : static_cast<std::int64_t>(ctx_.config.max_split_size);
  }
  virtual ~Backend() = default;
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  virtual BackendKind kind() const noexcept = 0;
  // The block size a request of `requested` bytes gets (rounding only; no state).
  virtual std::size_t round_size(std::size_t requested) const noexcept = 0;
  virtual core::Block* allocate(std::size_t requested, driver::stream_t stream) = 0;
  // allocated -> pending_free: the caller freed it but streams recorded with record_stream() may
  // still use it. Stats: no longer allocated, still active.
  void begin_pending_free(core::Block* block) noexcept {
    account_caller_freed(*block);
    block->status = core::BlockStatus::pending_free;
  }
  // allocated or pending_free -> free (cached for reuse, merged with free neighbours). Never
  // fails: the caller has already forgotten the pointer (the live table, a pending queue).
  virtual void free(core::Block* block) noexcept = 0;
  // Allocates exactly [addr, addr + size) (512 B aligned) out of free memory cached for `stream`
  // (a graph pool's key: PyTorch's setCheckpointPoolState puts a pool's blocks back where a
  // checkpoint had them). nullptr, nothing changed, when that range is not such free memory.
  virtual core::Block* allocate_at(driver::stream_t stream, std::uint64_t addr, std::size_t size) = 0;
  // Give every cached byte that can be given back to the device.
  virtual void release_cached() = 0;
  // No told capture is underway: the frontend's end_graph_pool has ended the last one, or
  // release_graph_pool released a pool while none ran. Gives back now what released graph pools
  // and exited threads hold, which a slow path during a capture may not (the synchronization it
  // takes first would invalidate the capture): a loop of capture, end and release allocates only
  // while capturing, and never gave its pools back. Best effort, never throws: what cannot go now
  // waits for the next look (a slow path, release_cached).
  virtual void reap_released() noexcept { }
  // Bytes of blocks allocated on `stream` that are live or freed and waiting for other streams.
  virtual std::size_t stream_bytes_in_use(driver::stream_t stream) const = 0;
  // Gives back everything cached for plain stream `stream` and forgets the stream, so that its
  // owner may destroy it (Allocator::release_stream: the frontend has synchronized it, and none of
  // its blocks is in use).
  virtual void release_stream(driver::stream_t stream) = 0;
  // The limit changed (ctx.limit already updated): give back cached memory above it if possible.
  virtual void on_limit_changed() { }
  // A peer device was granted access: extend it to everything already mapped.
  virtual void on_peer_added(int peer) = 0;
  // What to export so another process can map `block` (allocated or pending; see ExportPlan).
  virtual ExportPlan export_plan(const core::Block& block) const = 0;
  // Throws expseg::error naming the first broken invariant.
  virtual void validate() const = 0;
  virtual void snapshot(std::vector<SegmentInfo>& out) const = 0;
  // `request`: the rounded size of a request, on `stream`, whose footprint is asked for (0: none).
  virtual FreeSummary free_summary(std::size_t request = 0, driver::stream_t stream = nullptr) const = 0;
  // Whether `addr` lies inside memory this backend manages (for invalid_pointer messages).
  virtual bool contains(std::uint64_t addr) const noexcept = 0;

 protected:
  // Stat bookkeeping shared by both backends (PyTorch's accounting rules). Inline: this is the
  // cached malloc/free path.
  static void up(Stat* arr, int pool, std::int64_t v) noexcept {
    arr[kAllPools].increase(v);
    arr[pool].increase(v);
  }
  static void down(Stat* arr, int pool, std::int64_t v) noexcept {
    arr[kAllPools].decrease(v);
    arr[pool].decrease(v);
  }
  void account_allocated(const core::Block& b) noexcept {  // free -> allocated (and active)
    Stats& s = ctx_.stats;
    const auto size = static_cast<std::int64_t>(b.size);
    up(s.allocation, b.pool, 1);
    up(s.allocated_bytes, b.pool, size);
    up(s.active, b.pool, 1);
    up(s.active_bytes, b.pool, size);
    up(s.requested_bytes, b.pool, static_cast<std::int64_t>(b.requested));
    if (b.size >= ctx_.config.max_split_size) s.oversize_allocations.increase(1);
  }
  // As PyTorch splits them: free() takes down allocation, allocated bytes and oversize allocations
  // at once; requested and active bytes go down only once the block is free (after the events of a
  // recorded stream), in free_block().
  void account_caller_freed(const core::Block& b) noexcept {  // allocated -> pending or free
    Stats& s = ctx_.stats;
    down(s.allocation, b.pool, 1);
    down(s.allocated_bytes, b.pool, static_cast<std::int64_t>(b.size));
    if (b.size >= ctx_.config.max_split_size) s.oversize_allocations.decrease(1);
  }
  void account_deactivated(const core::Block& b) noexcept {  // allocated/pending -> free
    Stats& s = ctx_.stats;
    down(s.active, b.pool, 1);
    down(s.active_bytes, b.pool, static_cast<std::int64_t>(b.size));
    down(s.requested_bytes, b.pool, static_cast<std::int64_t>(b.requested));
  }
  // free(): the shared first half. Accounts the transition and marks the block free.
  void leave_active(core::Block& b) noexcept {
    if (b.status == core::BlockStatus::allocated) account_caller_freed(b);
    account_deactivated(b);
    b.status = core::BlockStatus::free;
    b.requested = 0;
    b.pending_events = 0;
    if (!b.stream_uses.empty()) b.stream_uses.clear();
  }
  void account_inactive(int pool, std::int64_t blocks, std::int64_t bytes) noexcept {
    Stats& s = ctx_.stats;
    if (blocks >= 0) up(s.inactive_split, pool, blocks);
    else down(s.inactive_split, pool, -blocks);
    if (bytes >= 0) up(s.inactive_split_bytes, pool, bytes);
    else down(s.inactive_split_bytes, pool, -bytes);
  }
  void account_reserved(int pool, std::int64_t bytes) noexcept {  // + grows, - shrinks
    if (bytes >= 0) up(ctx_.stats.reserved_bytes, pool, bytes);
    else down(ctx_.stats.reserved_bytes, pool, -bytes);
  }
  void account_segment(int pool, std::int64_t count) noexcept {
    if (count >= 0) up(ctx_.stats.segment, pool, count);
    else down(ctx_.stats.segment, pool, -count);
  }

  Context& ctx_;
};

std::unique_ptr<Backend> make_split_merge(Context& ctx);
std::unique_ptr<Backend> make_expandable(Context& ctx);

}  // namespace expseg::backends
