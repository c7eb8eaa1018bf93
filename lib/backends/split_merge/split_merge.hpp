// split_merge: the classic caching pool, reproduced faithfully so that A/B numbers mean something.
//
// policy:pytorch (default) follows PyTorch's CUDACachingAllocator (c10/cuda/CUDACachingAllocator.cpp):
//   - sizes round up to 512 B (or to power-of-two divisions, roundup_power2_divisions);
//   - requests <= 1 MiB come from 2 MiB segments (small pool), requests < 10 MiB from 20 MiB
//     segments, larger ones get a segment of their size rounded to 2 MiB (large pool);
//   - best fit by (stream, size, address); a block is split if the remainder is >= 512 B (small
//     pool) or > 1 MiB (large pool, and only for requests below max_split_size);
//   - blocks of max_split_size or more are only handed to requests of that size class, and only
//     if less than max_non_split_rounding larger;
//   - on a miss: garbage collection (if configured), a new segment, then freeing cached oversize
//     blocks, then freeing every cached unsplit segment and retrying once; then OOM;
//   - freed blocks merge with free neighbours, never across two driver allocations.
// Left out of PyTorch's: the free-memory callbacks a miss runs first (trigger_free_memory_callbacks:
// torch.multiprocessing's CUDA IPC collection, which expseg's glue does not serve) and MemPool's
// use_on_oom pools (try_mempool_fallback). A pool a stream allocates into outside a capture
// (Allocator::begin_pool_allocations; PyTorch's MemPool and graph trees' warm-ups) takes the
// allocator's full path: PyTorch counts such a route as a capture underway, which skips
// process_events and the last retry's release of the cache (an OOM there where expseg frees the
// cache and succeeds), and routes every stream of the calling thread, where expseg routes the stream
// it is told of. Such a pool's cached blocks are never given back while the pool lives, not even
// its oversize blocks on its own slow path (PyTorch's release_available_cached_blocks frees those
// of the request's private pool): a graph captured into the pool may replay into that memory, and
// expseg cannot tell whether one did (with max_split_size_mb, an OOM in the pool where PyTorch
// frees an oversize block and succeeds). graph_capture_record_stream_reuse is accepted and ignored:
// a free of a block other streams used during a capture waits for the capture's end (PyTorch with
// the option reuses it in the capture after its free markers). cudaStreamPerThread is a cache per
// thread, given back when the thread exits, where PyTorch keys all threads' blocks by its one
// handle value (backend.hpp, stream keys).
// policy:cupy follows CuPy's SingleDeviceMemoryPool: 512 B rounding, one pool, segments of exactly
// the rounded size, best fit with split and merge, and a limit that counts everything the pool
// holds (total_bytes); a miss over the limit or beyond the device frees all unsplit cached
// segments and retries once (CuPy's _try_malloc since cupy/cupy#7679, July 2023). CuPy's pool also
// runs Python's gc.collect() and retries before the OOM (a reference cycle may hold blocks): no
// Python runs inside expseg's allocation, so through install_cupy a cycle's memory comes back only
// at the program's own gc.collect(). Among free blocks of one size, the lowest address is taken
// (CuPy takes whichever its set yields).
#pragma once

#include <boost/intrusive/list.hpp>
#include <unordered_map>
#include <unordered_set>

#include "backends/backend.hpp"
#include "core/size_index.hpp"

namespace expseg::backends {

// One driver allocation (cuMemAlloc). Its blocks tile [base, base + size).
struct SmSegment {
  driver::dev_ptr base = 0;
  std::size_t size = 0;
  driver::stream_t stream = nullptr;
  std::uint8_t pool = kLargePool;
  // Its stream is a retired key (SplitMergeBackend::retired_): free() looks here, next to `index`,
  // on the line it loads anyway, to put the segment on a look list once wholly free.
  bool retired = false;
  core::SizeIndex* index = nullptr;  // the free index of this segment's pool and stream
  core::Block* first = nullptr;
  core::bi::list_member_hook<> hook;         // SplitMergeBackend::segments_
  core::bi::list_member_hook<> stream_hook;  // its stream's list in SplitMergeBackend::by_stream_
  core::bi::list_member_hook<> look_hook;    // SplitMergeBackend::thread_looks_ or pool_looks_
};
using SmStreamSegments = core::bi::list<SmSegment, core::bi::member_hook<SmSegment, core::bi::list_member_hook<>, &SmSegment::stream_hook>>;

class SplitMergeBackend final : public Backend {
 public:
  explicit SplitMergeBackend(Context& ctx);
  ~SplitMergeBackend() override;  // gives every segment back to the device, live blocks included

  BackendKind kind() const noexcept override { return BackendKind::split_merge; }
  std::size_t round_size(std::size_t requested) const noexcept override;
  core::Block* allocate(std::size_t requested, driver::stream_t stream) override;
  void free(core::Block* block) noexcept override;
  core::Block* allocate_at(driver::stream_t stream, std::uint64_t addr, std::size_t size) override;
  void release_cached() override;
  std::size_t stream_bytes_in_use(driver::stream_t stream) const override;
  void release_stream(driver::stream_t stream) override;
  void on_limit_changed() override;
  void on_peer_added(int) override {}  // cuMemAlloc memory: peers are enabled per context by the driver
  ExportPlan export_plan(const core::Block& block) const override;  // the segment holding the block
  void validate() const override;
  void snapshot(std::vector<SegmentInfo>& out) const override;
  FreeSummary free_summary(std::size_t request = 0, driver::stream_t stream = nullptr) const override;
  bool contains(std::uint64_t addr) const noexcept override;
  // The free indexes held, both pools together (tests: they must not outlive their streams' segments).
  std::size_t stream_indexes() const noexcept { return small_.blocks.streams() + large_.blocks.streams(); }
  // What reap_retired has looked at (tests: it must stay near the work done, not grow with the
  // retired keys that keep live blocks): the keys its generation walk asks, the segments of the
  // keys it finds retired and of the look lists, the retired keys of a walk after retired_emptied_.
  std::uint64_t slow_path_steps() const noexcept { return slow_path_steps_; }

  // PyTorch's constants.
  static constexpr std::size_t kMinBlockSize = 512;
  static constexpr std::size_t kSmallSize = std::size_t{1} << 20;
  static constexpr std::size_t kSmallBuffer = std::size_t{2} << 20;
  static constexpr std::size_t kLargeBuffer = std::size_t{20} << 20;  // large_segment_size_mb's default
  static constexpr std::size_t kMinLargeAlloc = std::size_t{10} << 20;
  static constexpr std::size_t kRoundLarge = std::size_t{2} << 20;

 private:
  struct Pool {
    core::StreamIndexes blocks;  // free blocks: a best-fit index per stream
    bool is_small = false;
    std::uint8_t stat_pool = kLargePool;
    std::uint64_t get_free_blocks_calls = 0;  // garbage collection ages blocks by this count
  };
  struct Params {
    std::size_t size = 0;        // rounded request
    std::size_t alloc_size = 0;  // segment size if a new one is needed
    driver::stream_t stream = nullptr;
    Pool* pool = nullptr;
    core::SizeIndex* index = nullptr;  // the pool's index for `stream`
    core::Block* block = nullptr;
  };

  bool cupy() const noexcept { return ctx_.config.policy == PoolPolicy::cupy; }
  Pool& pool_for(std::size_t size) noexcept;
  std::size_t allocation_size(std::size_t size) const noexcept;
  bool should_split(const core::Block& block, std::size_t size) const noexcept;
  bool gc_enabled() const noexcept;
  bool get_free_block(Params& p);
  bool alloc_block(Params& p, bool is_retry);
  bool release_available_cached_blocks(const Params& p);
  // A cached block that may be given back: unsplit, not of a live graph pool (its graphs' replays
  // use that memory; PyTorch frees a private pool's blocks only once the pool is released), and
  // not of a stream that captures a graph expseg was not told of. cuMemFree (in relaxed capture
  // mode) waits for the work of streams that do not capture, as outside a capture (measured on the
  // H200); nothing says it would wait for work a capturing stream queued before its capture.
  bool releasable(const core::Block& b) const noexcept {
    return !b.is_split() && !(is_graph_pool_key(b.stream) && is_live_graph_pool_key(b.stream)) &&
           !stream_captures(ctx_, b.stream);
  }
  // `keep`: an index the caller holds (the request's), which prune_indexes leaves.
  bool release_cached_blocks(const core::SizeIndex* keep = nullptr);
  void release_block(core::Block* block);
  void prune_indexes(const core::SizeIndex* keep) noexcept;
  void reap_retired(driver::stream_t keep, bool graph_pools = true);
  // A stream's first index in `pool` (allocate's rare branch): a per-thread or graph pool key goes
  // on keyed_ too.
  [[gnu::noinline]] core::SizeIndex& add_index(Pool& pool, driver::stream_t stream);
  // Retired key `s` holds no segment: its indexes go (and the key with them).
  void forget_key(driver::stream_t s) noexcept;
  // free(): a retired segment that came wholly free goes on its look list.
  [[gnu::noinline, gnu::cold]] void look_again(SmSegment& seg) noexcept;
  using LookList = core::bi::list<SmSegment, core::bi::member_hook<SmSegment, core::bi::list_member_hook<>, &SmSegment::look_hook>,
                                  core::bi::constant_time_size<false>>;
  LookList& looks_of(driver::stream_t s) noexcept { return is_graph_pool_key(s) ? pool_looks_ : thread_looks_; }
  void garbage_collect_cached_blocks();
  // exact: split whenever the block is larger than p.size (allocate_at), not by should_split.
  core::Block* alloc_found_block(Params& p, std::size_t requested, bool exact = false);
  std::size_t try_merge_blocks(core::Block* dst, core::Block* src) noexcept;
  void reposition(const Pool& pool, core::SizeIndex& index, core::Block* b) noexcept;
  void insert_free(const Pool& pool, core::SizeIndex& index, core::Block* block) noexcept;
  static core::SizeIndex& index_of(const core::Block& b) noexcept { return *static_cast<SmSegment*>(b.segment)->index; }
  Pool& pool_of(const core::Block& b) noexcept { return b.pool == kSmallPool && !cupy() ? small_ : large_; }
  const Pool& pool_of(const core::Block& b) const noexcept { return b.pool == kSmallPool && !cupy() ? small_ : large_; }

  using SegmentList = core::bi::list<SmSegment, core::bi::member_hook<SmSegment, core::bi::list_member_hook<>, &SmSegment::hook>>;

  // Invariants (validate()):
  //   - by_stream_ lists every segment under its stream, and only streams that have one: releasing
  //     or sizing up one stream walks its segments, not all of them
  //   - a segment's index is its pool's index for its stream (an index is forgotten only when no
  //     segment names it: prune_indexes, release_stream, reap_retired)
  //   - every per-thread or graph pool key with an index in either pool is on exactly one of keyed_
  //     and retired_, and neither holds another key
  //   - a segment is retired iff its stream is on retired_; a segment on thread_looks_ is a retired
  //     thread's, on pool_looks_ a released pool's; a retired segment on neither holds a block in
  //     use (free() puts it on its list when it comes wholly free)
  // An index (~16 KB) of a stream with no segment left goes at release_cached and at the slow
  // path's last retry: a stream per request would otherwise keep one per stream ever used.
  Pool small_;
  Pool large_;
  core::BlockPool blocks_;
  SegmentList segments_;
  std::unordered_map<driver::stream_t, SmStreamSegments> by_stream_;  // nodes never move: lists stay put
  std::size_t total_allocated_memory_ = 0;  // PyTorch's name: bytes of all segments (reserved)
  bool has_divisions_ = false;              // roundup_power2_divisions configured
  // Per-thread and graph pool keys that have an index and are not known retired: what a change of
  // retired_keys_generation() may retire. The generation moves at every thread exit and graph pool
  // release; a walk of every index then asked the retired keys too (thousands of graph outputs
  // kept past their pool's release: O(graphs) per release).
  std::unordered_set<driver::stream_t> keyed_;
  // Retired keys that still have an index: exited threads' per-thread keys, released graph pools'
  // keys. Sets: O(1) to ask and to drop.
  std::unordered_set<driver::stream_t> retired_;
  // The retired segments reap_retired looks at: those wholly free since their key retired or their
  // last look (free), threads' and pools' apart (a request's slow path looks only at the first, as
  // PyTorch's releasePool leaves a pool's memory to release_cached and the last retry). A look at
  // every retired key on every slow path walked each one's free index: O(retired keys that keep
  // live blocks) per slow allocation.
  LookList thread_looks_;
  LookList pool_looks_;
  // A retired key lost its last segment outside reap_retired (another give-back): the next
  // reap_retired forgets such keys' indexes, one walk of retired_.
  bool retired_emptied_ = false;
  std::uint64_t retired_seen_ = 0;  // retired_keys_generation() when keyed_ and retired_ were last brought up to date
  mutable std::uint64_t slow_path_steps_ = 0;
};

}  // namespace expseg::backends
