// expandable: segments that grow in place on CUDA virtual memory.
//
// Each stream has an arena of segments. A segment reserves a large virtual range (2x device memory
// by default) with cuMemAddressReserve; physical memory is created with cuMemCreate and mapped with
// cuMemMap + cuMemSetAccess only where blocks need it, in frames of the allocation granularity
// (2 MiB on the H200). Blocks split and merge inside the segment like in a caching pool, but a free
// range can be unmapped and its memory mapped again anywhere, so fragmentation of free memory never
// blocks a request: any request succeeds while the frames touched by live blocks plus the request
// fit under the limit (up to handles that a live block keeps partly mapped, see the handle policy
// in expandable.cpp).
//
// One arena per stream, holding all sizes: small blocks pack into the partly used frames at the
// ends of large blocks instead of pinning frames of their own. Stats attribute allocations of
// <= 1 MiB to small_pool (PyTorch's split) and all reserved memory to large_pool.
//
// Invariants (validate() checks each):
//   - blocks of a segment tile [base, base + va_bytes), address-ordered, no gaps
//   - frames[f] is the handle mapped at frame f, or nullptr; a handle covers exactly
//     frames [first_frame, first_frame + nframes) of its segment; mapped_words has one bit per
//     frame of the table, set iff frames[f] is not nullptr
//   - allocated, pending and mapped free blocks lie on mapped frames only; an unmapped free block
//     starts and ends on frame boundaries and covers unmapped frames only
//   - no two adjacent free blocks have the same mapped state
//   - a mapped free block is in its arena's mapped_free index, an unmapped one in unmapped, no other
//     block is in an index
//   - an unmapped free block (a hole) is in its arena's holes index or dirty_holes list or both, no
//     other block is; a run of free blocks holding holes holds a dirty one, or each of its holes
//     has run_bytes at least the run's bytes (the placement search skips the holes of short runs)
//   - a mapped handle is idle (holds no byte of an allocated or pending block) iff it lies wholly
//     inside one mapped free block (a handle maps whole; the free blocks over it are mapped and
//     merged); not stored per handle
//   - the idle runs partition the idle handles: each run is a range of whole handles inside one
//     mapped free block, its first handle's run_first and its last handle's run_last point to it;
//     an arena's idle_runs are the runs in its segments, in the backend's order
//   - a run's seq, an arena's safe_seq and epoch_seq are at most idle_seq_ (frees so far); an arena
//     waiting for its epoch event holds one
//   - reserved_ = bytes of every handle held (mapped or waiting for a retried release);
//     va_reserved_ = bytes of address range the segments and the spare range hold; the spare
//     range overlaps no segment and no mapped orphan
//   - a mapped orphan (its access grant and its unmap failed) lies inside a reservation still held,
//     and no handle is mapped over its frames until its unmap succeeds
//   - an arena on retired_looks_ is retired; a retired arena off it holds no idle handle and no
//     empty segment (its last look gave back all it could, and nothing in it changed since)
//   - keyed_ holds exactly the arenas of per-thread and graph pool keys that are not retired, in
//     the order they were made (the order of arenas_)
#pragma once

#include <atomic>
#include <boost/intrusive/list.hpp>
#include <boost/intrusive/set.hpp>
#include <limits>
#include <unordered_map>
#include <vector>

#include "backends/backend.hpp"
#include "core/size_index.hpp"

namespace expseg::backends {

struct ExpSegment;
struct ExpArena;

// Idle handles that became idle together (one free, one mapping), by address: the handles of
// [lo, hi) in `seg`. The runs, least recently idle first, order reclaim as a list of handles would,
// but a free adds one run and an allocation trims the runs at its ends: O(1) whatever the number
// of handles under the block (see expandable.cpp).
struct IdleRun {
  ExpSegment* seg = nullptr;
  std::uint64_t lo = 0;
  std::uint64_t hi = 0;
  // When its handles became idle: the backend's idle_seq_ at the free that made them idle (a run
  // split in two keeps it in both halves); 0 for handles mapped and never handed out, which no
  // queued work can use. Work queued before that free may still use them until the arena's
  // safe_seq reaches it (ExpArena::safe_seq).
  std::uint64_t seq = 0;
  IdleRun* next_spare = nullptr;  // the backend's spare runs
  core::bi::list_member_hook<core::bi::link_mode<core::bi::normal_link>> hook;  // the backend's idle_runs_
  core::bi::list_member_hook<core::bi::link_mode<core::bi::normal_link>> arena_hook;  // its arena's idle_runs
};
// An arena's idle runs, in the backend's order (least recently idle first): a reclaim of one
// stream's idle memory walks these, not every stream's (thousands of streams: O(that stream's runs)).
using ArenaRunList = core::bi::list<IdleRun,
                                    core::bi::member_hook<IdleRun, core::bi::list_member_hook<core::bi::link_mode<core::bi::normal_link>>,
                                                          &IdleRun::arena_hook>,
                                    core::bi::constant_time_size<false>>;

// One physical allocation (cuMemCreate), mapped as a whole at a run of frames of one segment.
struct ExpHandle {
  driver::phys_handle handle = 0;
  std::size_t bytes = 0;
  ExpSegment* seg = nullptr;   // nullptr once unmapped (orphans)
  std::size_t first_frame = 0;
  std::size_t nframes = 0;
  bool mapped = false;         // orphans: whether the mapping still exists
  bool counted = false;        // counted in num_device_alloc: its release counts in num_device_free
  std::uint64_t orphan_addr = 0;  // orphans that are still mapped: where
  IdleRun* run_first = nullptr;  // the idle run this handle begins (meaningful only there)
  IdleRun* run_last = nullptr;   // the idle run this handle ends (meaningful only there)
  core::bi::list_member_hook<> hook;  // orphan list
};

struct ExpSegment {
  driver::dev_ptr base = 0;
  std::size_t va_bytes = 0;
  std::vector<ExpHandle*> frames;  // frame -> handle mapped there, or nullptr; frames past the end are unmapped
  // Bit f (word f / 64) set iff frames[f] != nullptr: the slow path's placement search skips
  // unmapped stretches 64 frames a step (frame by frame it was a fifth of random churn's CPU time).
  std::vector<std::uint64_t> mapped_words;
  core::Block* first = nullptr;
  ExpArena* arena = nullptr;
  std::size_t mapped_bytes = 0;
  std::size_t high_water = 0;      // bytes from base that have ever been mapped
};

struct BlockAddressOrder {
  bool operator()(const core::Block& a, const core::Block& b) const noexcept { return a.addr < b.addr; }
};
using UnmappedIndex = core::bi::set<core::Block, core::bi::member_hook<core::Block, core::FreeHook, &core::Block::free_hook>,
                                    core::bi::compare<BlockAddressOrder>, core::bi::constant_time_size<true>>;

// An arena's unmapped free blocks ("holes") by run_bytes, then address; and the holes whose
// run_bytes may be short of their run (see ExpArena::holes).
struct RunBytesOrder {
  bool operator()(const core::Block& a, const core::Block& b) const noexcept {
    return a.run_bytes != b.run_bytes ? a.run_bytes < b.run_bytes : a.addr < b.addr;
  }
};
struct RunBytesKey {  // lower_bound by run_bytes alone
  bool operator()(std::size_t s, const core::Block& b) const noexcept { return s < b.run_bytes; }
  bool operator()(const core::Block& b, std::size_t s) const noexcept { return b.run_bytes < s; }
};
using HoleIndex = core::bi::set<core::Block,
                                core::bi::member_hook<core::Block, core::bi::set_member_hook<core::bi::optimize_size<true>>, &core::Block::run_hook>,
                                core::bi::compare<RunBytesOrder>, core::bi::constant_time_size<false>>;
using DirtyHoles = core::bi::list<core::Block, core::bi::member_hook<core::Block, core::bi::list_member_hook<>, &core::Block::dirty_hook>,
                                  core::bi::constant_time_size<false>>;

struct ExpArena {
  core::BlockPool blocks;       // this arena's Block objects (per stream: threads share no free list)
  driver::stream_t stream = nullptr;
  // On the backend's retired_ list: a flag, so that finding the retired arenas is not a search of
  // that list per arena (thousands of exited threads or released graph pools: O(n^2)). Next to
  // `stream`, on a line free() loads anyway: free() tests it to mark the arena for another look.
  bool retired = false;
  core::SizeIndex mapped_free;  // free blocks backed by memory: best fit by (size, address)
  ArenaRunList idle_runs;       // the backend's idle runs that lie in this arena's segments, in its order
  UnmappedIndex unmapped;       // free address ranges without memory: first fit by address
  // The placement search's index of holes (unmapped free blocks) by the bytes of the run of free
  // blocks around them (run_bytes), which only runs of at least the request's size are worth a
  // look: a run holding a dirty hole may have grown past its holes' run_bytes; every other run's
  // holes are in `holes` with run_bytes at least the run's bytes. Runs grow only in free(), which
  // marks the holes beside the merged block dirty (O(1), no walk); carving only shrinks runs, and
  // the slow paths mark the holes they make or whose run loses its dirty hole (insert_free,
  // set_range_mapped). refresh_runs walks the dirty holes' runs before a search.
  HoleIndex holes;
  DirtyHoles dirty_holes;     // not in `holes`, or run_bytes there may be short
  std::vector<ExpSegment*> segments;
  // Whether the stream captures a CUDA graph, as asked in operation `capture_seen_op` (see
  // ExpandableBackend::arena_captures): asked once per arena per operation, on slow paths only.
  mutable std::uint64_t capture_seen_op = 0;
  mutable bool captures = false;
  // A foreign key's arena (a CuPy stream) whose stream was blocking when the arena was made, and
  // when asked again since (recheck_legacy_waits, in the arena's slow paths): a synchronization of
  // the legacy stream waits for its work, destroyed or not (synchronize_once). Once false, false
  // for good.
  bool legacy_waits = false;
  // A request named the key since its stream was last asked (the cached path asks nothing): the
  // stream may have been destroyed and its handle value given to one that does not block, so
  // legacy_waits is not trusted until the arena's next slow path asks again.
  bool legacy_unasked = false;
  // Places the slow path found for a request under a limit away from both ends of the free block
  // that held them (a block there covers idle bulk handles only wholly, where the fast path tries
  // only both ends of a few blocks): the fast path tries them for a request of the same size before
  // the slow path, which otherwise searched the whole run again at each pair that landed mid-run.
  // `host` is a Block of this arena's pool (its memory lives as long as the arena) that held the
  // place, or holds it again once the block there is freed and merged; it is checked to hold it
  // still, free and mapped, before use, so a memo goes stale harmlessly.
  struct PlaceMemo {
    core::Block* host = nullptr;
    std::uint64_t addr = 0;
    std::size_t size = 0;
  };
  std::array<PlaceMemo, 4> place_memos{};
  std::uint8_t next_place_memo = 0;
  // A plain stream's arena whose stream blocks (asked when the arena was made; true when it could
  // not be asked): while it captures, the legacy stream's synchronization would invalidate the
  // capture (ExpandableBackend::seen_capture).
  bool stream_blocks = false;
  // The work queued on this arena's stream that may use its idle runs with seq <= safe_seq is
  // known complete: its stream was synchronized after they became idle (synchronize_once), or an
  // event recorded after that completed (epoch_event). Their handles are unmapped without a
  // synchronization; the others take one first.
  mutable std::uint64_t safe_seq = 0;
  // Recorded on the stream that synchronize_once would synchronize, by the reclaim before a new
  // highest mark (reclaim_idle), when idle_seq_ was epoch_seq; while epoch_pending, not yet seen
  // complete. A later reclaim that finds it complete raises safe_seq to epoch_seq without waiting.
  driver::event_t epoch_event = nullptr;
  std::uint64_t epoch_seq = 0;
  bool epoch_pending = false;
  // On the backend's retired_looks_: a retired arena whose memory the next reap_retired must look
  // at (ExpandableBackend::retired_looks_ says when).
  core::bi::list_member_hook<> look_hook;
  // On the backend's keyed_: a per-thread or graph pool key's arena not yet retired.
  core::bi::list_member_hook<> keyed_hook;
  // On the backend's arenas_ (every arena not yet swept), and on its retired_ once retired: lists,
  // so that a forgotten arena leaves both in O(1) (see sweep_forgotten).
  core::bi::list_member_hook<> arenas_hook;
  core::bi::list_member_hook<> retired_hook;
  ExpArena* next_forgotten = nullptr;  // the backend's forgotten_ chain
  // Forgotten (forget_arena): no segment, no longer found by its stream; taken out of arenas_ and
  // retired_ and deleted by the sweep at the end of the operation (sweep_forgotten), so that the
  // walks of arenas_ that forget arenas (drop_empty_segments, give_back_unused_arenas) keep their
  // place.
  bool forgotten = false;
};

class ExpandableBackend final : public Backend {
 public:
  explicit ExpandableBackend(Context& ctx);
  ~ExpandableBackend() override;  // unmaps and releases everything, live blocks included

  BackendKind kind() const noexcept override { return BackendKind::expandable; }
  std::size_t round_size(std::size_t requested) const noexcept override;
  core::Block* allocate(std::size_t requested, driver::stream_t stream) override;
  void free(core::Block* block) noexcept override;
  core::Block* allocate_at(driver::stream_t stream, std::uint64_t addr, std::size_t size) override;
  void release_cached() override;
  void reap_released() noexcept override;
  std::size_t stream_bytes_in_use(driver::stream_t stream) const override;
  void release_stream(driver::stream_t stream) override;
  void on_limit_changed() override;
  void on_peer_added(int peer) override;
  ExportPlan export_plan(const core::Block& block) const override;  // the handles under the block
  void validate() const override;
  void snapshot(std::vector<SegmentInfo>& out) const override;
  FreeSummary free_summary(std::size_t request = 0, driver::stream_t stream = nullptr) const override;
  bool contains(std::uint64_t addr) const noexcept override;

  static constexpr std::size_t kMinBlockSize = 512;
  static constexpr std::size_t kSmallSize = std::size_t{1} << 20;

  // The largest physical handle growth creates (the handle policy, see expandable.cpp).
  std::size_t max_handle_bytes(std::size_t request = 0) const noexcept;
  std::size_t growth_granule(std::size_t size) const noexcept;
  // Physical handles the cached paths (an allocation from cached memory, a free) have looked at:
  // a few per call, however many handles lie under the block (tests check it). Also counts the
  // idle runs an unmap looks at (reclaim).
  std::uint64_t cached_path_handles() const noexcept { return cached_path_handles_; }
  // Blocks and idle handles that the slow paths' lookups have looked at: the block an unmap takes
  // its handle from, room_after_reclaim's idle handles, and those of one stream's reclaim before
  // memory grows past its highest mark (tests check they stay near the work done, not the number
  // of blocks, idle handles or streams). Also counts the arenas that forgetting streams walks, and
  // those reap_retired asks whether their key retired (keyed_) and looks at (retired_looks_), and the
  // arenas seen_capture asks whether their stream captures.
  std::uint64_t slow_path_steps() const noexcept { return slow_path_steps_; }
  // What the slow paths' searches have looked at: the unmapped blocks of find_placement and the
  // blocks of the runs it brings up to date (refresh_runs), the mapped free blocks and handles of
  // find_mapped_place, the idle handles of move_idle_handle.
  std::uint64_t search_steps() const noexcept { return search_steps_; }
  // Allocations that took the slow path (no cached place: mapping, reclaim or a place search).
  std::uint64_t slow_calls() const noexcept { return slow_calls_; }

 private:
  struct Placement {
    ExpSegment* seg = nullptr;
    core::Block* anchor = nullptr;  // the block just before the run (not free), or nullptr
    std::uint64_t start = 0;
    std::size_t new_frames = 0;
    std::size_t calls = 0;  // under a limit: handles to map and idle bulk handles to unmap first
  };
  struct Exclusion {  // a range whose idle handles reclaim must not take (the one being allocated)
    const ExpSegment* seg = nullptr;
    std::uint64_t lo = 0;
    std::uint64_t hi = 0;
  };
  bool excluded(const ExpHandle& h, const Exclusion& ex) const noexcept {
    if (h.seg != ex.seg) return false;
    const std::uint64_t lo = frame_addr(*h.seg, h.first_frame);
    return lo < ex.hi && lo + h.bytes > ex.lo;
  }

  ExpArena& arena_for(driver::stream_t stream) {
    // A read-only scan of at most kScanArenas arenas (the first made; a forgotten one's slot goes to
    // the next new arena) (streams are few): threads on different
    // streams then share no written line here, where a "last arena" cache would be rewritten on
    // every switch. The others through a hash table (a program with thousands of streams: O(1), not
    // a scan of them all on every cached allocation).
    for (const ArenaEntry& e : arena_index_)
      if (e.stream == stream) return *e.arena;
    return arena_past_scan(stream);
  }
  [[gnu::noinline]] ExpArena& arena_past_scan(driver::stream_t stream);
  ExpArena* find_arena(driver::stream_t stream) const noexcept {
    const auto it = arena_by_stream_.find(stream);
    return it == arena_by_stream_.end() ? nullptr : it->second;
  }
  static constexpr std::size_t kScanArenas = 8;
  [[gnu::noinline]] ExpArena& new_arena(driver::stream_t stream);
  [[gnu::returns_nonnull]] core::Block* carve(ExpArena& arena, core::Block* b, std::size_t size, std::size_t requested, bool back, bool runs_done = false);
  static constexpr std::size_t kNoPlace = std::numeric_limits<std::size_t>::max();
  // Bytes of idle handles a block at [lo, hi), inside free block `free`, would use only partly;
  // kNoPlace when it would use only part of an idle handle of more than `max_shared_frames` frames
  // (under a limit: 1, so that bulk handles serve one block at a time).
  std::size_t new_pin_bytes(const ExpSegment& seg, const core::Block& free, std::uint64_t lo, std::uint64_t hi,
                            std::size_t max_shared_frames) const noexcept;
  void unmap_bulk_handles_under(ExpSegment& seg, const core::Block* anchor, std::uint64_t lo, std::uint64_t hi);
  // Whether idle memory of `arena` may be unmapped now: not from a live graph pool (its graphs'
  // replays use that memory), nor when the synchronization it takes first would break a capture
  // (arena_captures). for_each_idle skips the same arenas.
  bool may_unmap_in(const ExpArena& arena) const noexcept {
    return !(is_graph_pool_key(arena.stream) && is_live_graph_pool_key(arena.stream)) && !arena_captures(arena);
  }
  bool arena_captures(const ExpArena& arena) const noexcept;
  // A plain stream's arena is how seen_capture notices a capture expseg was not told of on that
  // stream: while its stream captures, an arena whose segments all went back is kept (without
  // segments), not forgotten, so that other streams' synchronizations still see the capture.
  bool watches_capture(const ExpArena& arena) const noexcept {
    if (is_stream_key(arena.stream) || is_legacy_stream(arena.stream)) return false;
    if (arena.capture_seen_op != operation_) {
      arena.capture_seen_op = operation_;
      arena.captures = stream_captures(ctx_, arena.stream);
    }
    return arena.captures;
  }
  // What synchronize_once synchronizes for `arena`'s work: a stream (nullptr: the legacy stream), or
  // a key (is_stream_key: a graph pool's, a non-blocking foreign stream's) for the device.
  static driver::stream_t stream_to_synchronize(const ExpArena& arena) noexcept;
  // Whether a stream expseg can ask captures now, where no capture was told or noticed on the
  // request's stream: a plain stream of an arena (blocking_only: one that blocks) or the calling
  // thread's per-thread stream (which blocks). Asked once per operation.
  bool seen_capture(bool blocking_only) const noexcept;
  mutable std::uint64_t seen_capture_op_ = 0;
  mutable bool seen_capture_any_ = false;
  mutable bool seen_capture_blocking_ = false;
  mutable bool seen_capture_arenas_asked_ = false;  // this operation's seen_capture asked the arenas' streams
  static constexpr int kPlacementCandidates = 4;
  core::Block* allocate_at_memo(ExpArena& arena, std::size_t size, std::size_t requested);
  void remember_place(ExpArena& arena, core::Block* host, std::uint64_t addr, std::size_t size) noexcept;
  core::Block* allocate_cached(ExpArena& arena, std::size_t size, std::size_t requested);
  core::Block* allocate_slow(ExpArena& arena, std::size_t size, std::size_t requested);
  core::Block* place_or_grow(ExpArena& arena, std::size_t size, std::size_t requested);
  core::Block* grow_and_carve(ExpArena& arena, const Placement& pl, std::size_t size, std::size_t requested);
  // Allocates [start, start + size) out of free mapped block `b`, which holds it; the caller has
  // reserved one idle run and two Blocks (nothing here throws).
  core::Block* carve_at(ExpArena& arena, ExpSegment& seg, core::Block* b, std::uint64_t start, std::size_t size, std::size_t requested) noexcept;
  // keep_range: the range may become the spare range (not when ranges must go back now).
  void drop_segment(ExpArena& arena, ExpSegment* seg, bool keep_range = true);
  bool find_placement(ExpArena& arena, std::size_t size, Placement& out, bool with_room = false);
  bool find_mapped_place(ExpArena& arena, std::size_t size, Placement& out);
  std::size_t frames_needed(const ExpSegment& seg, std::uint64_t lo, std::uint64_t hi) const noexcept;
  std::size_t placement_calls(const ExpSegment& seg, std::uint64_t run_lo, std::uint64_t run_hi, std::uint64_t lo, std::uint64_t hi,
                              std::size_t max_frames, std::size_t& frames, std::size_t bound) const noexcept;
  bool map_range(ExpSegment& seg, std::uint64_t lo, std::uint64_t hi, std::uint64_t map_hi, core::Block* anchor,
                 std::vector<ExpHandle*>* mapped_now = nullptr);
  void unmap_new_handles(const std::vector<ExpHandle*>& handles) noexcept;
  void unmap_orphans_in(std::uint64_t lo, std::size_t bytes);
  bool mapped_orphan_in(std::uint64_t lo, std::size_t bytes) const noexcept;  // a mapped orphan overlaps [lo, lo + bytes)
  bool map_one(ExpSegment& seg, std::size_t frame, std::size_t nframes, core::Block* anchor, const Exclusion& ex);
  std::size_t move_idle_handle(ExpSegment& seg, std::size_t frame, std::size_t nframes, core::Block* anchor, const Exclusion& ex);
  bool map_handle(ExpSegment& seg, std::size_t frame, ExpHandle* h, core::Block* anchor);
  void register_mapping(ExpSegment& seg, ExpHandle* h, core::Block* anchor);
  void set_range_mapped(ExpSegment& seg, core::Block* from, std::uint64_t lo, std::uint64_t hi, bool mapped);
  bool make_room(std::size_t bytes, const Exclusion& ex);
  bool room_after_reclaim(std::size_t bytes, const Exclusion& ex) const noexcept;
  bool room_for_placement(const Placement& pl, std::size_t size) const noexcept;
  std::size_t room_limit() const noexcept;
  std::size_t reclaim_idle(std::size_t bytes, const Exclusion& ex, ExpArena* only = nullptr, bool largest_first = false,
                           std::size_t must = SIZE_MAX, std::size_t* deferred = nullptr);
  void unmap_handle(ExpHandle* h);
  void unmap_mapping(ExpHandle* h);
  // The block holding addr, which must lie in a mapped frame of seg (found by walking from the
  // nearest unmapped blocks: nothing else bounds the walk).
  core::Block* mapped_block_at(const ExpSegment& seg, std::uint64_t addr) const noexcept;
  void keep_as_orphan(ExpHandle* h, bool still_mapped, std::uint64_t addr);
  void retry_orphans();
  // Waits until work queued on `stream` before now is done, at most once per operation (a slow
  // allocation, release_cached, a limit change; begin_operation starts one): idle memory freed on a
  // stream may still be used by that work until then. Once is enough because nothing can be freed
  // while an operation runs (the caller holds the allocator's lock).
  void synchronize_once(const ExpArena& arena);
  // Before unmapping an idle handle of `arena` whose run has `seq`: synchronize_once unless the
  // arena's work up to that run is known complete (ExpArena::safe_seq).
  void synchronize_for_run(const ExpArena& arena, std::uint64_t seq) {
    if (seq > arena.safe_seq) synchronize_once(arena);
  }
  // The reclaim before a new highest mark's events (ExpArena::epoch_event): poll_epoch raises
  // safe_seq when the pending one completed; record_epoch records one when none is pending and
  // some idle run may be unsafe. Best effort: a driver error leaves safe_seq as it was.
  void poll_epoch(ExpArena& arena) noexcept;
  void record_epoch(ExpArena& arena) noexcept;
  void destroy_epoch_event(ExpArena& arena) noexcept;
  void begin_operation() noexcept {
    synced_.count = 0;
    synced_.all = false;
    ++operation_;
  }
  void reap_retired(const ExpArena* keep);
  void recheck_legacy_waits(ExpArena& a) noexcept;
  // synchronized: the caller synchronized its stream; *refused set when may_unmap_in kept its idle memory.
  bool give_back_arena(ExpArena* a, bool synchronized = false, bool* refused = nullptr);
  // Something in retired arena `a` may have come free (a free, its own slow path): look again.
  void look_again(ExpArena& a) noexcept {
    if (!a.look_hook.is_linked()) retired_looks_.push_back(a);
  }
  void forget_arena(ExpArena* a) noexcept;  // an arena without segments: marked, deleted by sweep_forgotten
  // Deletes the forgotten arenas and unlinks them from arenas_ and retired_: O(forgotten arenas),
  // whatever the number of others (a walk of arenas_ per sweep made each release_stream cost a cache
  // miss per arena: 16,000 streams holding blocks, ~350 us a call). Every path that may forget an
  // arena ends with it (SweepForgotten), so no forgotten arena outlives the call that forgot it
  // (validate() checks none is left).
  void sweep_forgotten() noexcept;
  struct SweepForgotten {
    ExpandableBackend& be;
    ~SweepForgotten() { be.sweep_forgotten(); }
  };
  ExpArena* forgotten_ = nullptr;  // arenas forgotten and not yet swept (next_forgotten)
  void drop_empty_segments();
  // Out of address range: the idle memory, ranges and arenas of the streams (but `keep`'s) that
  // hold no block in use, given back (give_back_arena). Walks their blocks: that rare path only.
  std::size_t give_back_unused_arenas(const ExpArena* keep);
  ExpSegment* new_segment(ExpArena& arena, std::size_t min_bytes);
  // Idle runs (see IdleRun).
  ExpHandle* handle_at(const ExpSegment& seg, std::uint64_t addr) const noexcept { return seg.frames[frame_of(seg, addr)]; }
  // [lo, hi): the whole handles of mapped free block `b` (lo >= hi: none).
  void whole_handles(const ExpSegment& seg, const core::Block& b, std::uint64_t& lo, std::uint64_t& hi) const noexcept;
  void reserve_runs(std::size_t n);
  void add_spare_runs(std::size_t n);
  // seq: the run's IdleRun::seq (a split's second half: `after`'s).
  void add_idle_run(ExpSegment& seg, std::uint64_t lo, std::uint64_t hi, std::uint64_t seq, IdleRun* after = nullptr) noexcept;
  void drop_idle_run(IdleRun* r) noexcept;
  void set_run_edges(IdleRun* r) noexcept;
  void make_busy(ExpSegment& seg, std::uint64_t wlo, std::uint64_t whi, std::uint64_t lo, std::uint64_t hi) noexcept;
  void make_busy_front(ExpSegment& seg, std::uint64_t lo, std::uint64_t hi) noexcept;
  void make_busy_back(ExpSegment& seg, std::uint64_t lo, std::uint64_t hi) noexcept;
  void make_busy_inside(ExpSegment& seg, std::uint64_t wlo, std::uint64_t whi, std::uint64_t lo, std::uint64_t hi) noexcept;
  template <class F>
  void for_each_idle(F&& f) const;
  // A hole whose run may have grown past its run_bytes (ExpArena::holes).
  static void mark_dirty(ExpArena& arena, core::Block* hole) noexcept {
    if (!hole->dirty_hook.is_linked()) arena.dirty_holes.push_back(*hole);
  }
  void refresh_runs(ExpArena& arena) noexcept;
  void set_run_bytes(ExpArena& arena, core::Block* first, const core::Block* end, std::size_t bytes) noexcept;
  std::vector<core::Block*> hole_scratch_;  // find_placement's holes to visit
  void insert_free(ExpArena& arena, core::Block* b) noexcept;
  void erase_free(ExpArena& arena, core::Block* b) noexcept;
  core::Block* merge_free(ExpArena& arena, core::Block* b) noexcept;
  static ExpHandle* frame_handle(const ExpSegment& seg, std::size_t f) noexcept { return f < seg.frames.size() ? seg.frames[f] : nullptr; }
  std::uint64_t frame_addr(const ExpSegment& seg, std::size_t f) const noexcept { return seg.base + (f << frame_shift_); }
  std::size_t frame_of(const ExpSegment& seg, std::uint64_t addr) const noexcept { return (addr - seg.base) >> frame_shift_; }

  using HandleList = core::bi::list<ExpHandle, core::bi::member_hook<ExpHandle, core::bi::list_member_hook<>, &ExpHandle::hook>>;
  using RunList = core::bi::list<IdleRun,
                                 core::bi::member_hook<IdleRun, core::bi::list_member_hook<core::bi::link_mode<core::bi::normal_link>>, &IdleRun::hook>,
                                 core::bi::constant_time_size<false>>;

  std::size_t frame_;        // allocation granularity, a power of two
  unsigned frame_shift_;     // log2(frame_)
  bool has_divisions_;       // roundup_power2_divisions configured (round_size)
  std::size_t va_bytes_;
  // What a new segment reserves: va_bytes_, or less once the address space ran short
  // (new_segment); at least the range of a segment given back since (drop_segment), va_bytes_ again
  // after release_cached or once no segment is left.
  std::size_t va_hint_;
  std::size_t va_reserved_ = 0;  // address range the segments and the spare range hold
  // The address range of the last segment given back, kept reserved for the next new segment: a
  // stream that lives for a few requests (a stream per request in a server) cost a
  // cuMemAddressReserve and a cuMemAddressFree per life. Nothing is mapped in it. At most one, given
  // back by release_cached, when a new segment needs more, when the address space runs short, and by
  // the destructor. Made only while this is the process's one expandable allocator
  // (process_instances_): another device's allocator that runs out of address range cannot take it
  // back (each allocator's ranges are its own, under its own lock); one made before another
  // allocator came goes back at the next segment given back (best effort, not an invariant).
  struct SpareRange {
    driver::dev_ptr base = 0;
    std::size_t bytes = 0;  // 0: none
  } spare_range_;
  void free_spare_range();
  // Address range the segments of every expandable allocator of the process hold: all devices share
  // one address space (new_segment's budget). Relaxed: a budget, read under this allocator's lock only.
  static inline std::atomic<std::size_t> process_va_reserved_{0};
  static constexpr std::size_t kFullRangeBudget = std::size_t{32} << 40;  // 32 TiB (new_segment)
  // Expandable allocators alive in the process (the spare range's condition).
  static inline std::atomic<int> process_instances_{0};
  // Every arena, in the order they were made; the retired ones (per-thread keys of exited threads,
  // released graph pools' keys: reap_retired) in the order they retired.
  using ArenaList = core::bi::list<ExpArena, core::bi::member_hook<ExpArena, core::bi::list_member_hook<>, &ExpArena::arenas_hook>,
                                   core::bi::constant_time_size<true>>;
  using RetiredList = core::bi::list<ExpArena, core::bi::member_hook<ExpArena, core::bi::list_member_hook<>, &ExpArena::retired_hook>,
                                     core::bi::constant_time_size<true>>;
  ArenaList arenas_;
  // arenas_ as pointers, for the read-only walks (validate, snapshot, contains).
  struct ArenaPointers {
    const ArenaList& list;
    struct Iter {
      ArenaList::const_iterator it;
      const ExpArena* operator*() const noexcept { return &*it; }
      Iter& operator++() noexcept {
        ++it;
        return *this;
      }
      bool operator!=(const Iter& o) const noexcept { return it != o.it; }
    };
    Iter begin() const noexcept { return {list.begin()}; }
    Iter end() const noexcept { return {list.end()}; }
  };
  ArenaPointers arena_pointers() const noexcept { return {arenas_}; }
  struct ArenaEntry {
    driver::stream_t stream;
    ExpArena* arena;
  };
  std::vector<ArenaEntry> arena_index_;  // stream -> arena for at most kScanArenas of them, scanned by arena_for()
  std::unordered_map<driver::stream_t, ExpArena*> arena_by_stream_;  // every arena, by stream
  RetiredList retired_;
  // The retired arenas reap_retired looks at: a look walks the arena's free blocks and segments, and
  // thousands of retired arenas may hold live blocks (graph outputs kept past their pool's release),
  // so only those where something may have changed since their last look are here: newly retired,
  // a block freed (free) or an allocation's slow path there since, or the last look refused by
  // may_unmap_in (a capture underway: it may have ended). Nothing else makes memory of a retired
  // arena idle or a segment of it empty (others' reclaims only unmap idle handles).
  using LookList = core::bi::list<ExpArena, core::bi::member_hook<ExpArena, core::bi::list_member_hook<>, &ExpArena::look_hook>,
                                  core::bi::constant_time_size<false>>;
  LookList retired_looks_;
  // The arenas a change of retired_keys_generation() may retire (a key's arena not retired yet): the
  // generation moves at every release_graph_pool and thread exit, and a walk of arenas_ then asked
  // every arena, the thousands of retired ones that keep live blocks too (a capture loop keeping one
  // output per graph: O(graphs) per release, O(graphs^2) overall). Linked in new_arena, unlinked
  // when retired or forgotten: nothing on the cached paths.
  using KeyedList = core::bi::list<ExpArena, core::bi::member_hook<ExpArena, core::bi::list_member_hook<>, &ExpArena::keyed_hook>,
                                   core::bi::constant_time_size<false>>;
  KeyedList keyed_;
  std::uint64_t retired_seen_ = 0;  // retired_keys_generation() when retired_ was last brought up to date
  RunList idle_runs_;   // the idle handles, in runs, least recently idle first
  std::uint64_t idle_seq_ = 0;  // frees that made handles idle so far (IdleRun::seq)
  bool retrying_pending_ = false;  // allocate_slow's retry after completing pending frees is under way
  IdleRun* spare_runs_ = nullptr;  // recycled: the cached paths never allocate one
  std::size_t run_objects_ = 0;    // IdleRun objects, in runs or spare: at least handles_ (map_handle)
  HandleList orphans_;  // handles whose unmap or release failed; retried by release_cached()
  std::size_t reserved_ = 0;
  std::size_t handles_ = 0;
  std::size_t high_water_ = 0;   // highest reserved_ so far, less deferred_idle_ (soft reclaim runs only above it)
  // While grow_and_carve runs: the idle memory its reclaim left mapped rather than wait for the
  // stream. It is not part of high_water_, so that a later reclaim gives it back once it is safe
  // instead of holding the target that much higher.
  std::size_t deferred_idle_ = 0;
  std::size_t held_ceiling_ = 0;  // nonzero while place_or_grow swaps a mapping over the limit (room_limit)
  mutable std::uint64_t cached_path_handles_ = 0;
  mutable std::uint64_t slow_path_steps_ = 0;
  std::uint64_t search_steps_ = 0;
  std::uint64_t slow_calls_ = 0;
  struct SyncedStreams {         // synchronize_once's streams in the current operation
    driver::stream_t streams[32];
    std::size_t count = 0;
    bool all = false;  // a key's memory was reached: the whole device was synchronized
  } synced_;
  std::uint64_t operation_ = 1;  // begin_operation's count: arena_captures asks once per operation
};

}  // namespace expseg::backends
