#include "backends/expandable/expandable.hpp"

#include <algorithm>
#include <bit>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <type_traits>

#include "core/give_back.hpp"
#include "core/try_twice.hpp"
#include "expseg/errors.hpp"

namespace expseg::backends {

using core::Block;
using core::BlockStatus;

namespace {

[[noreturn]] void broken(const std::string& what) { throw expseg::error("expandable invariant broken: " + what); }

std::string hex(std::uint64_t v) {
  std::ostringstream os;
  os << "0x" << std::hex << v;
  return os.str();
}

constexpr std::uint8_t pool_of_size(std::size_t size) noexcept {
  return size <= ExpandableBackend::kSmallSize ? kSmallPool : kLargePool;
}

constexpr std::size_t round_up(std::size_t v, std::size_t m) noexcept { return (v + m - 1) / m * m; }

// Frames of the handle map_range maps at frame `f` of a run of unmapped frames [f, run_end): at
// most max_frames, and alone a frame that the block (frames [first, block_end)) covers only partly.
constexpr std::size_t next_handle_frames(std::size_t f, std::size_t run_end, std::size_t max_frames, std::size_t first,
                                         bool first_partial, std::size_t block_end, bool last_partial) noexcept {
  std::size_t n = std::min(run_end - f, max_frames);
  if (first_partial && f == first) n = 1;
  if (last_partial && run_end == block_end && f + n == run_end && n > 1) --n;
  return n;
}

// The first frame in [f, limit) with a handle mapped (limit if none; limit <= seg.frames.size()).
std::size_t next_mapped_frame(const ExpSegment& seg, std::size_t f, std::size_t limit) noexcept {
  while (f < limit) {
    const std::uint64_t word = seg.mapped_words[f / 64] >> (f % 64);
    if (word != 0) return std::min(limit, f + static_cast<std::size_t>(std::countr_zero(word)));
    f = (f / 64 + 1) * 64;
  }
  return limit;
}

// Splits free block `b` at `at` (inside it): `b` keeps [addr, at), the returned new block holds
// [at, end) with the same segment, stream and mapped state. Indexes are the caller's business.
Block* split_after(core::BlockPool& pool, Block* b, std::uint64_t at) {
  Block* n = pool.make();
  n->addr = at;
  n->size = b->end() - at;
  n->stream = b->stream;
  n->segment = b->segment;
  n->mapped = b->mapped;
  n->status = BlockStatus::free;
  n->prev = b;
  n->next = b->next;
  if (b->next) b->next->prev = n;
  b->next = n;
  b->size = at - b->addr;
  return n;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Handle policy.
//
// Driver calls cost per physical handle, not per byte (H200: cuMemSetAccess ~36 us and cuMemCreate
// ~8 us per handle whatever its size), so growth wants few, large handles: 1 GiB in one handle maps
// in ~0.1 ms, in 2 MiB handles in ~23 ms. But a handle can only be mapped and unmapped whole (the
// H200 with CUDA 13.0 refuses cuMemMap of part of a handle, CUDA_ERROR_NOT_SUPPORTED, and cuMemUnmap
// of part of a mapping; the driver contract test checks both): once a block smaller than the handle
// reuses part of it, the rest can neither be given back nor moved while that block lives ("pinned"
// free memory), and pinned memory is what keeps reserved above allocated and, under a
// limit, what turns into a fragmentation OOM. The policy ties the handle size to what is at stake:
//   - without a limit, a handle is at most 1/256 of the memory already held (so what one handle can
//     pin stays within ~0.4% of the working set; at 1/64, GPT-2 generation's growing KV caches kept
//     6% of reserved memory pinned, at 1/256 1.7%, for twice the driver calls), except that a
//     request larger than everything held gets handles of its own size: a fresh 1 GiB tensor maps
//     as one 1 GiB handle. Applying the one-block rule below without a limit too was measured and left out: it kept
//     the guarantee up to the device's capacity (a random churn to the capacity of 1 GiB and 80 GiB
//     simulated devices, 1-4 streams: 978 of 5,568 OOMs had the pages live blocks touch plus the
//     request within the device; none with it), but each bulk handle unmapped under a new block
//     takes a stream synchronization, and with the reclaim before a new highest mark the shipped
//     GPT-2 training trace replayed twice made 221 instead of 39 (H200 latency model: 165 instead
//     of 100 ms of driver time); on the H200 its training steps took 1.57x PyTorch classic's (that
//     host: PyTorch expandable 1.33x). limit:100% gives the guarantee against the whole device;
//   - under a configured limit, where pinned memory turns into fragmentation OOMs, a block's whole
//     frames get handles of up to its own size (at most 1/16 of the limit), and such a bulk handle
//     is used by one block at a time or not at all: a block never covers an idle bulk handle only
//     partly (the fast path skips such places; the slow path unmaps the bulk handle first and maps
//     frames of its own), and a block's partly covered first and last frames get handles of their
//     own. So only single-frame handles are ever shared, pinned memory stays below one frame per
//     hole, and a request fails only when the frames live blocks touch plus the request exceed the
//     limit. Random churn of 4 KiB-512 MiB blocks under 3 GiB (seeds 1-3) maps 1,071-1,298
//     handles instead of ~9,700 with 2 MiB handles (H200 latency model: 79-98 ms instead of
//     0.7 s; with the room check before any unmap and the search of mapped free blocks below).
//     This rule is what the guarantee costs in driver calls: letting blocks share idle bulk
//     handles, that churn maps 108-202 handles (10-20 ms of modelled driver time; measured against
//     2,029-2,363 handles and 180-211 ms before the placement and reclaim order below) but 11-16
//     of its 13-20 OOMs become fragmentation OOMs (first at 91-94% of the limit). Of that churn's
//     803-892 slow allocations (seeds 1-3), 79-83% came with a mapped free block large enough:
//     each of the fast path's candidates would have covered an idle bulk handle partly;
//   - under a limit, the slow path places a block where it costs the fewest driver calls (idle
//     bulk handles it would cover only partly, each unmapped first, plus the handles it maps), then
//     where it maps the fewest frames; besides both ends of each free run it tries every place in
//     the run where an idle handle or an unmapped stretch begins, so that a block lands on whole
//     idle handles instead of cutting through them. Placed against a neighbour only, the churn
//     above unmapped a bulk handle it had just cut in two of every three slow paths and mapped its
//     frames again: 2,029-2,363 handles (180-211 ms) instead of 1,244-1,425 (110-126 ms) with
//     this placement alone. Mid-sized mixes touch a few more edge frames: 1-64 MiB blocks under
//     the limit first fail at 96.8% of it instead of 97.3% (still for the limit, not fragments);
//   - under a limit, where the room for a new handle would come from idle memory, an idle handle of
//     (nearly) the frames needed moves instead: unmapped where it lies and mapped where the block
//     needs it, without the cuMemRelease and cuMemCreate of giving it back and making a new one
//     (move_idle_handle; on the H200, 14% less driver time in that churn);
//   - reclaim under a limit takes the largest idle handles first (of the least recently idle ones
//     that hold 8 times the room needed; see reclaim_idle): the room costs the fewest unmap and
//     release calls (with the placement above, 15% fewer handles in that churn than oldest first,
//     over 16 seeds 19,455 instead of 22,848; 35,555 before both);
//   - under a limit, a request that cannot fit fails before it gives back anything
//     (room_for_placement), and the slow path first looks for a place inside a mapped free block
//     that needs no driver call (find_mapped_place): random churn seeds 1-6 640 -> 532 ms of
//     modelled driver time, the same OOMs (one more at 99.1% of the limit), mixes no worse;
//   - never more than 1 GiB;
//   - without a limit, a small request growing a segment's untouched tail maps past itself up to a
//     growth granule (20 MiB, PyTorch's large page), in one handle of at most the size above
//     (growth_granule): while little is held, one frame. Ten one-frame handles for that granule made
//     the first 512 B on a fresh allocator or a new stream cost ~0.45 ms of driver calls on the
//     H200, and left 20 MiB reserved per stream (4,000 streams: 80 GiB for 2 MiB of blocks each).
//     Not at a segment's first growth: a new stream's first small request maps its frame alone,
//     one handle where the request's frame and the granule's rest were two (a stream per request
//     while the process held 1-8.8 GB of the H200: two handles made and given back per stream);
//   - the frames a new block covers only partly (at its start and end) get handles of their own,
//     so neighbours that later pack into them never keep a bulk handle mapped;
//   - allocations from cached memory prefer, among the few best-fitting free blocks, the place that
//     leaves no idle handle partly used;
//   - expandable_max_handle overrides the size.
// Reclaim (see allocate_slow and make_room) gives back idle handles: under a limit when a request
// needs room (largest first), and without one when memory would grow past its highest mark while
// idle memory sits elsewhere (least recently idle first).
// What remains between the live bytes and the limit at an OOM is page slack: free bytes inside
// frames that live blocks use partly (free_summary counts it; OOM reports and scenario results give
// it). With mid-sized blocks it is 3-6% of the limit, and the fill at an OOM plus the slack is ~100%.
// Measured and left out (benchmarks/PERFORMANCE.md): mapping a partly used frame a second time so a
// block elsewhere uses its free part (+0.2-0.4 points of fill where it helped, -2.3 for 1-4 MiB
// blocks, 4-31% more maps), placement by fewest frames under pressure (no change), whole frames for
// large blocks' edges (mixed), one cuMemSetAccess per run of handles (fewer calls, same time),
// placing blocks so as not to leave a gap smaller than a page beside a live block (most slack sits
// in such gaps, but the ranking lowered the fill by up to 0.5 points), and letting the cached path
// cover an idle bulk handle partly when the part left over is small (random churn seeds 1-6: at most
// 1 MiB left over, 3% less modelled driver time and the first OOM at or under 98% of the limit; at
// most 8 MiB, 29% less and 22 such OOMs: the rest joins other blocks and the handle stays pinned).
// ---------------------------------------------------------------------------------------------
// Tail growth for a request of `size` maps at least this much (see grow_and_carve): 20 MiB like
// PyTorch's large pages, at most 1/64 of the device, and at most one handle of the handle policy's
// size, so that the extension costs one handle more, never several: while little memory is held
// (handles of one frame), a 512 B request on a fresh allocator or a new stream mapped 20 MiB in 10
// handles (~0.45 ms of driver calls on the H200 where one costs ~45 us), most of them for blocks
// that may never come. One frame under a limit or when memory is short, where every mapped byte
// counts.
std::size_t ExpandableBackend::growth_granule(std::size_t size) const noexcept {
  const std::size_t limit = ctx_.effective_limit();
  if (ctx_.limit != 0 || reserved_ > limit / 16) return frame_;
  const std::size_t g = std::min<std::size_t>({std::size_t{20} << 20, limit / 64, max_handle_bytes(size)}) / frame_ * frame_;
  return std::max(g, frame_);
}

std::size_t ExpandableBackend::max_handle_bytes(std::size_t request) const noexcept {
  std::size_t bytes = ctx_.config.max_handle_size;
  if (bytes == 0) {
    if (ctx_.limit != 0) {
      const std::size_t bulk = std::min<std::size_t>(request, ctx_.limit / 16);
      bytes = std::bit_floor(std::max<std::size_t>({ctx_.limit / 1536, bulk, 1}));
    } else {
      bytes = std::bit_floor(std::max<std::size_t>(reserved_ / 256, 1));
      if (reserved_ < request) bytes = std::max(bytes, std::bit_floor(request));
    }
    bytes = std::min<std::size_t>(bytes, std::size_t{1} << 30);
  }
  bytes = bytes / frame_ * frame_;
  return std::max(bytes, frame_);
}

ExpandableBackend::ExpandableBackend(Context& ctx)
    : Backend(ctx),
      frame_(ctx.driver.granularity()),
      frame_shift_(static_cast<unsigned>(std::countr_zero(frame_))),
      has_divisions_(has_roundup_power2_divisions(ctx.config)) {
  if (frame_ == 0)  // the driver's sign of a device without virtual memory management
    throw expseg::error("expandable: device " + std::to_string(ctx.driver.device()) + " (" + ctx.driver.device_name() +
                        ") does not support CUDA virtual memory management (cuMemCreate, cuMemMap), which the expandable "
                        "backend maps its memory with: use backend:split_merge");
  if (!std::has_single_bit(frame_)) throw expseg::error("expandable: allocation granularity is not a power of two");
  // The config bounds an explicit expandable_va_size; the default and a share of device memory
  // depend on the device, so the same bound is applied to them here (and again to an explicit one,
  // for a backend built directly).
  const std::size_t va = ctx.config.expandable_va_bytes(ctx.device_total);
  if (va > kMaxExpandableVaSize) {
    const std::string what = ctx.config.va_size != 0       ? std::to_string(va) + " bytes"
                             : ctx.config.va_fraction != 0 ? "that share of device memory (" + std::to_string(ctx.device_total) + " bytes)"
                                                           : "the default, 2x device memory (" + std::to_string(ctx.device_total) + " bytes),";
    throw config_error("expandable_va_size", "expandable_va_size: " + what + " is more than one segment may reserve: at most 1024TiB (1 PiB); set a smaller expandable_va_size");
  }
  va_bytes_ = std::max(round_up(va, frame_), frame_);
  va_hint_ = va_bytes_;
  process_instances_.fetch_add(1, std::memory_order_relaxed);  // last: a throw above counts nothing
}

ExpandableBackend::~ExpandableBackend() {
  process_instances_.fetch_sub(1, std::memory_order_relaxed);
  // Give everything back; errors cannot be reported from a destructor (core::try_twice).
  auto quietly = [](auto&& f) { return core::try_twice(f); };
  // Work queued before may still use cached memory (freed on its stream, or waiting for a recorded
  // stream's event) and cuMemUnmap does not wait for it, as cuMemFree does: wait for the whole
  // device (the streams themselves may already be destroyed, e.g. by a replay). Where that wait
  // cannot be had (it failed twice, or a capture expseg was told of is underway, which it would
  // invalidate), the mappings stay: memory unmapped under queued work faults on a GPU and loses the
  // context, a leak lasts until process exit (as ImportedMemory does).
  bool unmap_safe = true;
  if (handles_ != 0) unmap_safe = !ctx_.capturing && quietly([&] { ctx_.driver.device_synchronize(); });
  // Orphans first: one may still be mapped inside a reservation freed below.
  while (!orphans_.empty()) {
    ExpHandle* h = &orphans_.front();
    orphans_.pop_front();
    if (h->mapped) quietly([&] { ctx_.driver.unmap(h->orphan_addr, h->bytes); });
    quietly([&] { ctx_.driver.release(h->handle); });
    delete h;
  }
  retired_looks_.clear();  // before the arenas they link go
  keyed_.clear();
  retired_.clear();
  while (!arenas_.empty()) {
    ExpArena* arena = &arenas_.front();
    arenas_.pop_front();
    arena->mapped_free.clear();
    arena->unmapped.clear();
    for (ExpSegment* seg : arena->segments) {
      for (std::size_t f = 0; f < seg->frames.size();) {
        ExpHandle* h = seg->frames[f];
        if (h == nullptr) {
          ++f;
          continue;
        }
        f = h->first_frame + h->nframes;
        if (unmap_safe) {
          quietly([&] { ctx_.driver.unmap(frame_addr(*seg, h->first_frame), h->bytes); });
          quietly([&] { ctx_.driver.release(h->handle); });
        }
        delete h;
      }
      if (unmap_safe) quietly([&] { ctx_.driver.free_reserve(seg->base, seg->va_bytes); });
      delete seg;
    }
    destroy_epoch_event(*arena);
    delete arena;
  }
  if (spare_range_.bytes != 0) quietly([&] { ctx_.driver.free_reserve(spare_range_.base, spare_range_.bytes); });
  process_va_reserved_.fetch_sub(va_reserved_, std::memory_order_relaxed);
  idle_runs_.clear_and_dispose([](IdleRun* r) { delete r; });
  while (IdleRun* r = spare_runs_) {
    spare_runs_ = r->next_spare;
    delete r;
  }
}

std::size_t ExpandableBackend::round_size(std::size_t size) const noexcept {
  if (size < kMinBlockSize) return kMinBlockSize;
  if (size > std::numeric_limits<std::size_t>::max() / 2) return size;
  if (has_divisions_)  // PyTorch rounds this way with expandable segments too
    if (const std::size_t rounded = roundup_power2_divisions_size(ctx_.config, size, kMinBlockSize)) return rounded;
  return round_up(size, kMinBlockSize);
}

ExpArena& ExpandableBackend::arena_past_scan(driver::stream_t stream) {
  if (ExpArena* a = find_arena(stream)) return *a;
  return new_arena(stream);
}

// A foreign key's stream may be destroyed and its handle value given by CUDA to a new stream of
// other flags, which then gets the old stream's cached memory. A stream that does not block makes
// the legacy stream's synchronization no wait for the arena's memory: the device synchronization
// then (as for a non-blocking stream from the start). The cached path asks nothing (two driver
// calls per CuPy request on its default blocking streams were a third of the pair's time): it marks
// the arena unasked, which synchronize_once does not trust, and the arena's slow path, whose
// request names the key (so its stream is alive), asks again.
void ExpandableBackend::recheck_legacy_waits(ExpArena& a) noexcept {
  if (stream_captures(ctx_, a.stream)) return;  // the question would invalidate the capture
  try {
    if (!ctx_.driver.stream_is_blocking(capture_query_stream(a.stream))) a.legacy_waits = false;
  } catch (const driver_error&) {
    a.legacy_waits = false;
  }
  a.legacy_unasked = false;
}

ExpArena& ExpandableBackend::new_arena(driver::stream_t stream) {
  auto* a = new ExpArena;
  a->stream = stream;
  // A foreign key's stream (CuPy's) is alive now, while a request names it: ask whether it blocks
  // (~24 ns), unless it captures (the question is refused then and would invalidate the capture).
  if (is_stream_key(stream) && !is_per_thread_key(stream) && !stream_captures(ctx_, stream)) {
    try {
      a->legacy_waits = ctx_.driver.stream_is_blocking(capture_query_stream(stream));
    } catch (const driver_error&) {  // stays false: the device synchronization, as before
    }
  }
  // A plain stream: whether a capture on it would refuse the legacy stream's synchronization.
  if (!is_stream_key(stream) && !is_legacy_stream(stream)) {
    a->stream_blocks = true;  // unless the driver says otherwise
    if (!stream_captures(ctx_, stream)) {
      try {
        a->stream_blocks = ctx_.driver.stream_is_blocking(stream);
      } catch (const driver_error&) {
      }
    }
  }
  try {
    arenas_.push_back(*a);
    try {
      arena_by_stream_.emplace(stream, a);
      try {
        if (arena_index_.size() < kScanArenas) arena_index_.push_back(ArenaEntry{stream, a});
      } catch (...) {
        arena_by_stream_.erase(stream);
        throw;
      }
    } catch (...) {
      arenas_.pop_back();
      throw;
    }
  } catch (...) {
    delete a;
    throw;
  }
  if (is_per_thread_key(stream)) keyed_.push_back(*a);  // after the last throw: reap_retired may retire it
  return *a;
}

void ExpandableBackend::insert_free(ExpArena& arena, Block* b) noexcept {
  b->status = BlockStatus::free;
  if (b->mapped) {
    arena.mapped_free.insert(*b);
    ctx_.stats.num_free_blocks += 1;
  } else {
    arena.unmapped.insert(*b);
    mark_dirty(arena, b);  // a new or changed hole: refresh_runs gives it its run's bytes
  }
}

void ExpandableBackend::erase_free(ExpArena& arena, Block* b) noexcept {
  if (b->mapped) {
    arena.mapped_free.erase(*b);
    ctx_.stats.num_free_blocks -= 1;
  } else {
    arena.unmapped.erase(arena.unmapped.iterator_to(*b));
    if (b->run_hook.is_linked()) arena.holes.erase(arena.holes.iterator_to(*b));
    if (b->dirty_hook.is_linked()) arena.dirty_holes.erase(arena.dirty_holes.iterator_to(*b));
  }
}

// Gives each hole of the run of free blocks [first, end) the run's bytes; none is dirty then.
void ExpandableBackend::set_run_bytes(ExpArena& arena, Block* first, const Block* end, std::size_t bytes) noexcept {
  for (Block* b = first; b != end; b = b->next) {
    if (b->mapped) continue;
    if (b->dirty_hook.is_linked()) arena.dirty_holes.erase(arena.dirty_holes.iterator_to(*b));
    if (b->run_hook.is_linked()) {
      if (b->run_bytes == bytes) continue;
      arena.holes.erase(arena.holes.iterator_to(*b));
    }
    b->run_bytes = bytes;
    arena.holes.insert(*b);
  }
}

// Walks the runs of the dirty holes and gives each hole there the run's bytes (ExpArena::holes).
void ExpandableBackend::refresh_runs(ExpArena& arena) noexcept {
  while (!arena.dirty_holes.empty()) {
    Block* first = &arena.dirty_holes.front();
    for (; first->prev && first->prev->is_free(); first = first->prev) ++search_steps_;
    const Block* last = first;
    for (; last->next && last->next->is_free(); last = last->next) ++search_steps_;
    set_run_bytes(arena, first, last->next, last->end() - first->addr);
  }
}

// Merges free block `b` (not in an index) with free neighbours of the same mapped state; the lower
// block object survives. Returns the merged block (still not in an index).
Block* ExpandableBackend::merge_free(ExpArena& arena, Block* b) noexcept {
  if (Block* p = b->prev; p && p->is_free() && p->mapped == b->mapped) {
    erase_free(arena, p);
    p->size += b->size;
    p->next = b->next;
    if (b->next) b->next->prev = p;
    arena.blocks.recycle(b);
    b = p;
  }
  if (Block* n = b->next; n && n->is_free() && n->mapped == b->mapped) {
    erase_free(arena, n);
    b->size += n->size;
    b->next = n->next;
    if (n->next) n->next->prev = b;
    arena.blocks.recycle(n);
  }
  return b;
}

// Idle handles without a walk of the handles under a block. A handle maps whole and adjacent
// mapped free blocks merge, so a mapped handle holding no byte of a live block is one lying wholly
// inside a mapped free block: the cached paths never count live bytes per handle (that walk cost
// ~19 ns per handle per pair: 19.5 us for a 1 GiB block over 512 handles). What remains is the
// order reclaim takes idle handles in, least recently idle first: the handles a free makes idle
// (those under the block that now lie wholly inside the merged free block: all but perhaps the two
// end ones) form one IdleRun, appended to idle_runs_; an allocation removes the handles under it
// from the runs of its free block, at the block's front or back (make_busy). Handles go in and out
// of the runs exactly where they went in and out of a list of handles, so the order is the same,
// and each call does a constant amount of work: two end handles, and the runs it removes whole,
// each of which a free or a mapping added (amortized, one per call). Measured (callgrind,
// expseg_hotpath): a pair over 512 handles of 2 MiB 28,988 -> 930 instructions, the 1 MiB pair on
// one handle 873 -> 919, the 64-slot churn 996 -> 1,011 per step. Ordering idle handles by their
// free block instead (a list of mapped free blocks, least recently freed first) cost fewer
// instructions (746 a pair) but took other handles: every scenario's driver calls changed, the
// 1-32 MiB mix's lowest fill fell from 96.6% to 96.0%, GPT-2 under 6 GiB had 553 OOMs instead of
// 550, and every reclaim walked all mapped free blocks. With the runs all of those are unchanged.

inline void ExpandableBackend::whole_handles(const ExpSegment& seg, const Block& b, std::uint64_t& lo, std::uint64_t& hi) const noexcept {
  const ExpHandle* first = handle_at(seg, b.addr);
  lo = frame_addr(seg, first->first_frame);
  if (lo < b.addr) lo += first->bytes;
  const ExpHandle* last = handle_at(seg, b.end() - 1);
  hi = frame_addr(seg, last->first_frame) + last->bytes;
  if (hi > b.end()) hi -= last->bytes;
}

// Makes sure `n` idle runs are at hand, so that the changes that follow cannot fail for one.
void ExpandableBackend::reserve_runs(std::size_t n) {
  for (const IdleRun* r = spare_runs_; r != nullptr && n != 0; r = r->next_spare) --n;
  add_spare_runs(n);
}

void ExpandableBackend::add_spare_runs(std::size_t n) {
  for (; n != 0; --n) {
    auto* r = new IdleRun;
    r->next_spare = spare_runs_;
    spare_runs_ = r;
    ++run_objects_;
  }
}

inline void ExpandableBackend::set_run_edges(IdleRun* r) noexcept {
  handle_at(*r->seg, r->lo)->run_first = r;
  handle_at(*r->seg, r->hi - 1)->run_last = r;
}

// Adds the idle handles of [lo, hi) as a run: last in idle_runs_, or right after `after` (the rest
// of a run that was split). Takes a spare run (reserve_runs).
inline void ExpandableBackend::add_idle_run(ExpSegment& seg, std::uint64_t lo, std::uint64_t hi, std::uint64_t seq,
                                             IdleRun* after) noexcept {
  IdleRun* r = spare_runs_;
  spare_runs_ = r->next_spare;
  r->seg = &seg;
  r->lo = lo;
  r->hi = hi;
  r->seq = seq;
  idle_runs_.insert(after ? std::next(idle_runs_.iterator_to(*after)) : idle_runs_.end(), *r);
  ArenaRunList& own = seg.arena->idle_runs;  // `after` lies in the same segment: the same relative order
  own.insert(after ? std::next(own.iterator_to(*after)) : own.end(), *r);
  set_run_edges(r);
}

inline void ExpandableBackend::drop_idle_run(IdleRun* r) noexcept {
  idle_runs_.erase(idle_runs_.iterator_to(*r));
  r->seg->arena->idle_runs.erase(r->seg->arena->idle_runs.iterator_to(*r));
  r->next_spare = spare_runs_;
  spare_runs_ = r;
}

// The handles of [lo, hi) stop being idle: a block is carved over them, or one is unmapped. [wlo,
// whi) are the whole handles of their free block, which the runs there tile; lo and hi lie on
// handle boundaries inside it. The cached paths take them from the front or the back, where runs
// are trimmed or dropped; the slow paths' other ranges go to make_busy_inside.
inline void ExpandableBackend::make_busy(ExpSegment& seg, std::uint64_t wlo, std::uint64_t whi, std::uint64_t lo,
                                         std::uint64_t hi) noexcept {
  if (lo >= hi) return;
  if (lo == wlo) make_busy_front(seg, lo, hi);
  else if (hi == whi) make_busy_back(seg, lo, hi);
  else make_busy_inside(seg, wlo, whi, lo, hi);
}

// [lo, hi) at the front of the whole handles of a free block: the runs there begin at lo.
inline void ExpandableBackend::make_busy_front(ExpSegment& seg, std::uint64_t lo, std::uint64_t hi) noexcept {
  for (std::uint64_t at = lo; at < hi;) {
    IdleRun* r = handle_at(seg, at)->run_first;
    ++cached_path_handles_;
    at = r->hi;
    if (r->hi <= hi) {
      drop_idle_run(r);
    } else {
      r->lo = hi;
      handle_at(seg, hi)->run_first = r;
    }
  }
}

// [lo, hi) at the back of the whole handles of a free block: the runs there end at hi.
inline void ExpandableBackend::make_busy_back(ExpSegment& seg, std::uint64_t lo, std::uint64_t hi) noexcept {
  for (std::uint64_t at = hi; at > lo;) {
    IdleRun* r = handle_at(seg, at - 1)->run_last;
    ++cached_path_handles_;
    at = r->lo;
    if (r->lo >= lo) {
      drop_idle_run(r);
    } else {
      r->hi = lo;
      handle_at(seg, lo - 1)->run_last = r;
    }
  }
}

// make_busy of a range with handles of the block on both sides (slow paths): finds the run that
// holds lo walking the runs from the front, or the one that holds hi - 1 from the back, whichever
// comes first, then takes the range out from there; one that holds the range strictly inside
// splits (a spare run, see reserve_runs). From both ends, unmaps that split a free block cost the
// runs of its smaller part: from the front alone, reclaim unmapping handle after handle near the
// end of a block of n runs walked ~n each time.
[[gnu::noinline]] void ExpandableBackend::make_busy_inside(ExpSegment& seg, std::uint64_t wlo, std::uint64_t whi, std::uint64_t lo,
                                                           std::uint64_t hi) noexcept {
  auto take = [&](IdleRun* r) {  // r holds part of [lo, hi)
    if (r->lo >= lo && r->hi <= hi) {
      drop_idle_run(r);
    } else if (r->lo < lo && r->hi > hi) {
      const std::uint64_t end = r->hi;
      r->hi = lo;
      handle_at(seg, lo - 1)->run_last = r;
      add_idle_run(seg, hi, end, r->seq, r);
    } else if (r->lo < lo) {
      r->hi = lo;
      handle_at(seg, lo - 1)->run_last = r;
    } else {
      r->lo = hi;
      handle_at(seg, hi)->run_first = r;
    }
  };
  IdleRun* front = handle_at(seg, wlo)->run_first;
  IdleRun* back = handle_at(seg, whi - 1)->run_last;
  cached_path_handles_ += 2;
  while (front->hi <= lo && back->lo >= hi) {
    front = handle_at(seg, front->hi)->run_first;
    back = handle_at(seg, back->lo - 1)->run_last;
    cached_path_handles_ += 2;
  }
  if (front->hi > lo) {  // the runs from front on, up to hi
    for (IdleRun* r = front;;) {
      const std::uint64_t next = r->hi;
      take(r);
      if (next >= hi) break;
      r = handle_at(seg, next)->run_first;
      ++cached_path_handles_;
    }
  } else {  // the runs from back down, to lo
    for (IdleRun* r = back;;) {
      const std::uint64_t prev = r->lo;
      take(r);
      if (prev <= lo) break;
      r = handle_at(seg, prev - 1)->run_last;
      ++cached_path_handles_;
    }
  }
}

// Least recently idle first. An `f` that returns bool stops the walk by returning false.
// Every reclaim, move and give-back takes its handles from here, so none is offered from a live
// graph pool (its graphs' replays use that memory) nor where the synchronization that must come
// before unmapping would break a capture (may_unmap_in).
template <class F>
void ExpandableBackend::for_each_idle(F&& f) const {
  for (const IdleRun& r : idle_runs_) {
    if (!may_unmap_in(*r.seg->arena)) continue;
    for (std::uint64_t a = r.lo; a < r.hi;) {
      ExpHandle* h = handle_at(*r.seg, a);
      a += h->bytes;
      if constexpr (std::is_invocable_v<F&, ExpHandle&, const IdleRun&>) {  // the handle and its run
        if constexpr (std::is_same_v<std::invoke_result_t<F&, ExpHandle&, const IdleRun&>, bool>) {
          if (!f(*h, r)) return;
        } else {
          f(*h, r);
        }
      } else if constexpr (std::is_same_v<decltype(f(*h)), bool>) {
        if (!f(*h)) return;
      } else {
        f(*h);
      }
    }
  }
}

// Bytes of idle handles that a block at [lo, hi) would use only partly: memory that could not be
// given back while the block lives.
// Only the handles under the first and the last byte can be covered partly: every handle between
// them lies wholly inside [lo, hi). A handle under [lo, hi) is idle iff it lies wholly inside the
// free block `free` that holds [lo, hi).
inline std::size_t ExpandableBackend::new_pin_bytes(const ExpSegment& seg, const Block& free, std::uint64_t lo, std::uint64_t hi,
                                                    std::size_t max_shared_frames) const noexcept {
  auto pin_of = [&](const ExpHandle* h) -> std::size_t {
    ++cached_path_handles_;
    const std::uint64_t hlo = frame_addr(seg, h->first_frame);
    const std::uint64_t hhi = hlo + h->bytes;
    if (hlo < free.addr || hhi > free.end()) return 0;  // a live block uses it already
    const std::size_t pin = h->bytes - (std::min(hhi, hi) - std::max(hlo, lo));
    return pin != 0 && h->nframes > max_shared_frames ? kNoPlace : pin;
  };
  const ExpHandle* first = seg.frames[frame_of(seg, lo)];
  const ExpHandle* last = seg.frames[frame_of(seg, hi - 1)];
  const std::size_t a = pin_of(first);
  if (first == last || a == kNoPlace) return a;
  const std::size_t b = pin_of(last);
  return b == kNoPlace ? kNoPlace : a + b;
}

// Under a limit: unmaps the idle bulk (multi-frame) handles that a block at [lo, hi) would cover
// only partly, so that the block maps frames of its own there instead of sharing them. [lo, hi)
// lies in the run of free blocks after `anchor` (the first block when nullptr).
void ExpandableBackend::unmap_bulk_handles_under(ExpSegment& seg, const Block* anchor, std::uint64_t lo, std::uint64_t hi) {
  // A handle under [lo, hi) is idle iff it lies wholly inside the run of free blocks (unmapping
  // changes only the mapped state of the run's blocks, not the run).
  const Block* r = anchor ? anchor->next : seg.first;
  const std::uint64_t run_lo = r->addr;
  while (r->next && r->next->is_free()) r = r->next;
  const std::uint64_t run_hi = r->end();
  for (std::size_t f = frame_of(seg, lo), last = frame_of(seg, hi - 1); f <= last;) {
    ExpHandle* h = frame_handle(seg, f);
    if (h == nullptr) {
      ++f;
      continue;
    }
    f = h->first_frame + h->nframes;
    const std::uint64_t hlo = frame_addr(seg, h->first_frame);
    const std::uint64_t hhi = hlo + h->bytes;
    if (hlo < run_lo || hhi > run_hi) continue;  // not idle
    if (h->nframes == 1 || (hlo >= lo && hhi <= hi)) continue;
    synchronize_once(*seg.arena);  // work queued there may still use the memory
    unmap_handle(h);
  }
}

// Hands out `size` bytes of free mapped block `b`, at its front or (back) at its end. The
// remainder keeps b's index node (repositioned only when its new size changes its rank), so a
// cached allocation usually costs no tree rebalancing.
Block* ExpandableBackend::carve(ExpArena& arena, Block* b, std::size_t size, std::size_t requested, bool back, bool runs_done) {
  auto& seg = *static_cast<ExpSegment*>(b->segment);
  // The Block first, the idle runs after it: a bad_alloc for the Block must leave them whole.
  Block* c = b;
  if (b->size == size) {
    erase_free(arena, b);
  } else {
    c = arena.blocks.make();
    c->size = size;
    c->stream = b->stream;
    c->segment = b->segment;
    c->mapped = true;
    if (back) {  // c = [end - size, end) after b
      c->addr = b->end() - size;
      c->prev = b;
      c->next = b->next;
      if (b->next) b->next->prev = c;
      b->next = c;
    } else {  // c = [addr, addr + size) before b
      c->addr = b->addr;
      c->prev = b->prev;
      c->next = b;
      if (b->prev) b->prev->next = c;
      else seg.first = c;
      b->prev = c;
      b->addr += size;
    }
    b->size -= size;
    arena.mapped_free.reposition(*b);
  }
  if (!runs_done) {
    // The idle handles the new block covers: those wholly inside the free block it was carved
    // from (c and what is left of b), from c's far end to the handle under its last (first) byte.
    // Two handles to look at.
    cached_path_handles_ += 2;
    if (back) {
      const ExpHandle* l = handle_at(seg, c->end() - 1);
      std::uint64_t hi = frame_addr(seg, l->first_frame) + l->bytes;
      if (hi > c->end()) hi -= l->bytes;
      const ExpHandle* h = handle_at(seg, c->addr);
      std::uint64_t lo = frame_addr(seg, h->first_frame);
      if (lo < (c == b ? c->addr : b->addr)) lo += h->bytes;
      if (lo < hi) make_busy_back(seg, lo, hi);
    } else {
      const ExpHandle* f = handle_at(seg, c->addr);
      std::uint64_t lo = frame_addr(seg, f->first_frame);
      if (lo < c->addr) lo += f->bytes;
      const ExpHandle* h = handle_at(seg, c->end() - 1);
      std::uint64_t hi = frame_addr(seg, h->first_frame) + h->bytes;
      if (hi > b->end()) hi -= h->bytes;
      if (lo < hi) make_busy_front(seg, lo, hi);
    }
  }
  c->status = BlockStatus::allocated;
  c->requested = requested;
  c->pool = pool_of_size(size);
  account_allocated(*c);
  return c;
}

Block* ExpandableBackend::allocate(std::size_t requested, driver::stream_t stream) {
  const std::size_t size = round_size(requested);
  if (size > std::numeric_limits<std::size_t>::max() / 2) return nullptr;
  ExpArena& arena = arena_for(stream);
  if (arena.legacy_waits) [[unlikely]] arena.legacy_unasked = true;
  if (Block* b = allocate_cached(arena, size, requested)) return b;
  return allocate_slow(arena, size, requested);
}

// The cached path: a mapped free block of the arena, or nullptr. No driver call.
[[gnu::always_inline]] inline Block* ExpandableBackend::allocate_cached(ExpArena& arena, std::size_t size, std::size_t requested) {
  // Best fit among mapped free blocks; among the few smallest that fit, prefer a place that does
  // not leave an idle handle partly used (it could not be given back while the block lives).
  Block* best = nullptr;
  bool best_back = false;
  std::size_t best_pin = std::numeric_limits<std::size_t>::max();
  const std::size_t max_shared_frames = ctx_.limit != 0 ? 1 : std::numeric_limits<std::size_t>::max();
  Block* b = arena.mapped_free.lower_bound(size);
  for (int k = 0; b != nullptr && k < kPlacementCandidates; b = arena.mapped_free.next(*b), ++k) {
    const auto& seg = *static_cast<const ExpSegment*>(b->segment);
    const std::size_t front = new_pin_bytes(seg, *b, b->addr, b->addr + size, max_shared_frames);
    const std::size_t back = b->size > size && front != 0 ? new_pin_bytes(seg, *b, b->end() - size, b->end(), max_shared_frames) : front;
    if (front < best_pin || back < best_pin) {
      best = b;
      best_back = back < front;
      best_pin = std::min(front, back);
    }
    if (best_pin == 0) break;
  }
  if (best != nullptr) return carve(arena, best, size, requested, best_back);
  if (max_shared_frames == 1) return allocate_at_memo(arena, size, requested);
  return nullptr;
}

// Under a limit, a place the slow path found for this size before (ExpArena::PlaceMemo), when a
// free mapped block still holds it and a block there leaves no idle bulk handle partly used.
Block* ExpandableBackend::allocate_at_memo(ExpArena& arena, std::size_t size, std::size_t requested) {
  for (const ExpArena::PlaceMemo& m : arena.place_memos) {
    Block* h = m.host;
    if (m.size != size || h == nullptr || h->segment == nullptr || !h->is_free() || !h->mapped || h->addr > m.addr ||
        h->end() < m.addr + size)
      continue;
    auto& seg = *static_cast<ExpSegment*>(h->segment);
    if (new_pin_bytes(seg, *h, m.addr, m.addr + size, 1) == kNoPlace) continue;
    reserve_runs(1);
    arena.blocks.reserve_two();  // nothing may fail once the runs change
    return carve_at(arena, seg, h, m.addr, size, requested);
  }
  return nullptr;
}

std::size_t ExpandableBackend::frames_needed(const ExpSegment& seg, std::uint64_t lo, std::uint64_t hi) const noexcept {
  std::size_t n = 0;
  for (std::size_t f = frame_of(seg, lo), last = frame_of(seg, hi - 1); f <= last; ++f)
    if (frame_handle(seg, f) == nullptr) ++n;
  return n;
}

// Under a limit, the driver calls that placing a block at [lo, hi) costs: the idle bulk handles it
// covers only partly (grow_and_carve unmaps them first) and the handles map_range then maps, at most
// `max_frames` each (their frames, and the unmapped ones, go to `frames`). Idle handles it covers
// wholly cost nothing. [lo, hi) lies in the run of free blocks [run_lo, run_hi): a handle is idle
// iff it lies wholly inside the run. The count stops early (frames then partial) once it exceeds
// `bound`.
std::size_t ExpandableBackend::placement_calls(const ExpSegment& seg, std::uint64_t run_lo, std::uint64_t run_hi, std::uint64_t lo,
                                               std::uint64_t hi, std::size_t max_frames, std::size_t& frames,
                                               std::size_t bound) const noexcept {
  const std::size_t first = frame_of(seg, lo);
  const std::size_t end = frame_of(seg, hi - 1) + 1;
  const bool first_partial = (lo - seg.base) % frame_ != 0;
  const bool last_partial = (hi - seg.base) % frame_ != 0;
  std::size_t calls = 0;
  std::size_t run = 0;  // frames to map just before f
  auto map_run = [&](std::size_t run_end) {
    for (std::size_t f = run_end - run; f < run_end; ++calls)
      f += next_handle_frames(f, run_end, max_frames, first, first_partial, end, last_partial);
    frames += run;
    run = 0;
  };
  frames = 0;
  // Frames past the table's end were never mapped; unmapped stretches inside it are skipped in one
  // tight loop (a 512 MiB candidate spans 256 frames, and the slow path tries many candidates).
  const std::size_t table_end = std::min(end, seg.frames.size());
  for (std::size_t f = first; f < end;) {
    const ExpHandle* h = f < table_end ? seg.frames[f] : nullptr;
    if (h == nullptr) {
      std::size_t e = next_mapped_frame(seg, f + 1, table_end);
      if (e >= table_end) e = std::max(e, end);
      run += e - f;
      f = e;
      continue;
    }
    const std::size_t n = std::min(h->first_frame + h->nframes, end) - f;
    const std::uint64_t hlo = frame_addr(seg, h->first_frame);
    const bool idle = hlo >= run_lo && hlo + h->bytes <= run_hi;
    if (h->nframes > 1 && idle && (hlo < lo || hlo + h->bytes > hi)) {
      run += n;
      if (++calls > bound) return calls;  // already worse than a place found
    } else if (run != 0) {
      map_run(f);
      if (calls > bound) return calls;
    }
    f += n;
  }
  if (run != 0) map_run(end);
  return calls;
}

// A place for `size` bytes: a run of free blocks (mapped or not) of at least `size` bytes that
// contains unmapped space; of these, the run that needs the fewest new frames (it reuses the most
// cached memory), the lowest address on ties (packs memory low, as PyTorch's first fit does).
// Under a limit, the place that costs the fewest driver calls comes first (the fewest new frames on
// ties), and the block may also start where an idle handle or an unmapped stretch begins inside a
// run: a block that lands on idle bulk handles covers them wholly there, where one placed against
// its neighbour would cover them partly and unmap and map them again.
// with_room: only places with room under the limit once idle handles elsewhere are given back
// (room_for_placement), for when the best place has none: its own idle handles cannot make it.
bool ExpandableBackend::find_placement(ExpArena& arena, std::size_t size, Placement& out, bool with_room) {
  bool found = false;
  const bool limited = ctx_.limit != 0;
  const std::size_t max_frames = max_handle_bytes(size) / frame_;  // as map_range will cut
  std::uint64_t seen_hi = 0;  // the end of the last run looked at (each run once)
  // One hole (unmapped block) of the arena, in address order; false: stop, the place is found.
  auto visit = [&](Block& u) {
    ++search_steps_;
    if (u.addr < seen_hi) return true;
    // The maximal run of free blocks around u; the block may sit at either end of it, against the
    // live neighbour whose partly used frame it can share.
    Block* first = &u;
    while (first->prev && first->prev->is_free()) first = first->prev;
    Block* last = &u;
    while (last->next && last->next->is_free()) last = last->next;
    const std::uint64_t lo = first->addr;
    const std::uint64_t hi = last->end();
    seen_hi = hi;
    // Carving shrinks runs under their holes' run_bytes: exact again, such holes are not looked at
    // again for sizes their run cannot hold.
    if (u.run_bytes != hi - lo) set_run_bytes(arena, first, last->next, hi - lo);
    if (hi - lo < size) return true;
    auto* seg = static_cast<ExpSegment*>(u.segment);
    const bool tail = hi == seg->base + seg->va_bytes;  // never place at the far end of a segment's tail
    if (!limited) {
      for (const std::uint64_t start : {lo, hi - size}) {
        const std::size_t need = frames_needed(*seg, start, start + size);
        if (!found || need < out.new_frames) {
          out = Placement{seg, first->prev, start, need};
          found = true;
        }
        if (need == 0 || tail) break;
      }
      return out.new_frames != 0;
    }
    auto consider = [&](std::uint64_t start) {
      std::size_t frames = 0;
      const std::size_t calls = placement_calls(*seg, lo, hi, start, start + size, max_frames, frames, found ? out.calls : kNoPlace);
      if (!found || calls < out.calls || (calls == out.calls && frames < out.new_frames)) {
        const Placement pl{seg, first->prev, start, frames, calls};
        if (with_room && !room_for_placement(pl, size)) return;
        out = pl;
        found = true;
      }
    };
    consider(lo);
    if (out.calls == 0) return false;
    if (!tail) consider(hi - size);
    // Where an unmapped block or an idle handle begins (an unmapped block starts on a frame).
    for (Block* b = first; b != last->next && b->addr + size <= hi && out.calls != 0; b = b->next) {
      if (!b->mapped) {
        if (b->addr > lo) consider(b->addr);
        continue;
      }
      for (std::size_t f = frame_of(*seg, b->addr); f <= frame_of(*seg, b->end() - 1) && out.calls != 0;) {
        const ExpHandle* h = seg->frames[f];
        const std::uint64_t at = frame_addr(*seg, f);
        // Idle: wholly inside the run.
        if (h->first_frame == f && at + h->bytes <= hi && at > lo && at >= b->addr && at + size <= hi) consider(at);
        f = h->first_frame + h->nframes;
      }
    }
    return out.calls != 0;
  };
  // Only runs of at least `size` bytes can hold the block: the holes whose run_bytes say their run
  // may (ExpArena::holes), visited in address order as the whole walk would, so the place is the
  // one it found. Walking every hole cost 11.7 ms a slow allocation with 100,000 holes too small for
  // the request. Where most holes qualify, the walk itself is cheaper than sorting them.
  refresh_runs(arena);
  std::vector<Block*>& holes = hole_scratch_;
  holes.clear();
  const std::size_t most = arena.unmapped.size() / 4;
  for (auto it = arena.holes.lower_bound(size, RunBytesKey{}); it != arena.holes.end() && holes.size() <= most; ++it) holes.push_back(&*it);
  if (holes.size() <= most) {
    std::sort(holes.begin(), holes.end(), [](const Block* a, const Block* b) { return a->addr < b->addr; });
    for (Block* u : holes)
      if (!visit(*u)) break;
  } else {
    for (Block& u : arena.unmapped)
      if (!visit(u)) break;
  }
  // Under a limit, rather than map and unmap, a place that costs nothing inside a mapped free
  // block (those runs hold no unmapped block, so the search above never sees them): in the slow
  // paths of random churn under 3 GiB, a third had such a place. Seeds 1-16, H200 latency model:
  // 1,523 -> 1,437 ms of driver time (-5.6%); the size mixes 12-15% less (1-64 MiB, seeds 1-3:
  // 152 -> 128 ms), kv-cache-decode 31 -> 25 ms, growing-buffer 16 -> 14 ms; the lowest fill at an
  // OOM over seeds 1-16 the same or higher in every mix (1-64 MiB 96.89 -> 96.90%, 1-32 MiB 96.57
  // -> 96.63%, 2-16 MiB 94.93 -> 95.27%, 1-4 MiB 92.96%), no fragmentation OOM.
  if (limited && (!found || out.calls != 0)) {
    Placement m;
    if (find_mapped_place(arena, size, m)) {
      out = m;
      found = true;
    }
  }
  return found;
}

// Under a limit: a place inside one mapped free block that costs no driver call: it covers idle
// bulk handles only wholly (single-frame handles may be shared), as the fast path requires, which
// tries only both ends of the few best-fitting blocks. Here every mapped free block that fits is
// tried at both ends and where each of its idle handles begins or ends; the place that leaves the
// fewest bytes of idle handles partly used wins, the smallest block on ties (best fit).
//
// Every place but those below leaves exactly `slack` (the bytes of its last frame a block of `size`
// leaves unused) or is no place (kNoPlace): a place that starts where an idle handle begins ends
// `slack` before a frame boundary (inside a single-frame idle handle: slack; a bulk one: kNoPlace),
// and one that ends where an idle handle ends starts `slack` past one. Less is possible only where
// the block's first or last handle is shared with a live neighbour (not idle, it leaves nothing),
// and at the block's two ends. Once a place of `slack` or less is found, a block's other handles
// cannot win (ties keep the first) and are not looked at: the result is the full search's.
bool ExpandableBackend::find_mapped_place(ExpArena& arena, std::size_t size, Placement& out) {
  const std::size_t slack = (frame_ - size % frame_) % frame_;
  Block* best = nullptr;
  std::uint64_t best_start = 0;
  std::size_t best_pin = kNoPlace;
  for (Block* b = arena.mapped_free.lower_bound(size); b != nullptr && best_pin != 0; b = arena.mapped_free.next(*b)) {
    ++search_steps_;
    const auto& seg = *static_cast<const ExpSegment*>(b->segment);
    auto consider = [&](std::uint64_t start) {
      if (start < b->addr || start + size > b->end()) return;
      const std::size_t pin = new_pin_bytes(seg, *b, start, start + size, 1);
      if (pin < best_pin) {
        best = b;
        best_start = start;
        best_pin = pin;
      }
    };
    consider(b->addr);
    consider(b->end() - size);
    const std::size_t bf0 = frame_of(seg, b->addr);
    const std::size_t bf1 = frame_of(seg, b->end() - 1);
    auto walk = [&](std::size_t from, std::size_t to, std::size_t& next) {  // the handles over frames [from, to], from `next` on
      for (std::size_t f = std::max(from, next); f <= to && best_pin != 0;) {
        ++search_steps_;
        const ExpHandle* h = seg.frames[f];
        const std::uint64_t hlo = frame_addr(seg, h->first_frame);
        consider(hlo);
        if (hlo + h->bytes >= size) consider(hlo + h->bytes - size);
        f = h->first_frame + h->nframes;
        next = f;
      }
    };
    std::size_t next = bf0;
    if (best_pin > slack) {
      walk(bf0, bf1, next);
      continue;
    }
    // Only places near a handle that a live neighbour shares (the one under b's first or last
    // byte) can leave less than `slack` (see above); the handles whose places reach into one, in
    // address order as the whole walk would visit them. Searching every handle of every block was
    // 97% of the slow path's instructions in a churn of 2-16 MiB blocks at a 100 GB limit (50,000
    // frames): 239,000 -> 106,000 a slow call, ~108 -> ~30 us; what is left walks the blocks.
    std::pair<std::size_t, std::size_t> win[6];  // frames
    int nwin = 0;
    for (const ExpHandle* x : {seg.frames[bf0], seg.frames[bf1]}) {
      const std::uint64_t xlo = frame_addr(seg, x->first_frame);
      const std::uint64_t xhi = xlo + x->bytes;
      if (xlo >= b->addr && xhi <= b->end()) continue;  // idle
      win[nwin++] = {x->first_frame, x->first_frame + x->nframes - 1};  // x itself
      if (xhi >= b->addr + size)  // places ending inside x: starting in [xlo - size + 1, xhi - size]
        win[nwin++] = {frame_of(seg, std::max(xlo + 1, b->addr + size) - size), frame_of(seg, xhi - size)};
      if (std::max(xlo, b->addr) + size <= b->end())  // places starting inside x: ending in [xlo + size, xhi + size)
        win[nwin++] = {frame_of(seg, std::max(xlo, b->addr) + size - 1), frame_of(seg, std::min(xhi + size, b->end()) - 1)};
    }
    // At most six: an insertion sort (std::sort's on a 6-element array trips GCC's -Warray-bounds).
    for (int i = 1; i < nwin; ++i)
      for (int j = i; j > 0 && win[j] < win[j - 1]; --j) std::swap(win[j], win[j - 1]);
    for (int i = 0; i < nwin; ++i) walk(std::max(win[i].first, bf0), std::min(win[i].second, bf1), next);
  }
  if (best == nullptr) return false;
  Block* anchor = best->prev;  // the block before the run of free blocks around best
  while (anchor != nullptr && anchor->is_free()) anchor = anchor->prev;
  out = Placement{static_cast<ExpSegment*>(best->segment), anchor, best_start, 0, 0};
  return true;
}

ExpSegment* ExpandableBackend::new_segment(ExpArena& arena, std::size_t min_bytes) {
  // A segment reserves va_bytes_ (2x the device by default, so that it grows in place to any size)
  // while the segments of all devices' allocators of the process (one address space) reserve less
  // than kFullRangeBudget; past it, a sixteenth. A process has ~112 TiB of address space on the
  // H200, which ~400 streams holding memory used up at 2x its memory each, and the next stream's
  // first request was an OOM for the address range with the device's memory free. Past the budget,
  // thousands of streams fit; a request larger than a segment gets one of its own size.
  const std::size_t least = std::max(round_up(min_bytes, frame_), frame_);
  std::size_t base_va = va_hint_;
  if (process_va_reserved_.load(std::memory_order_relaxed) + base_va > kFullRangeBudget)
    base_va = std::min(base_va, std::max(round_up(va_bytes_ / 16, frame_), frame_));
  std::size_t va = std::max(base_va, least);
  // Host memory first: a bad_alloc once the range is reserved would leak the reservation.
  auto seg = std::make_unique<ExpSegment>();
  seg->frames.reserve(64);  // grows with the mapped high-water mark, not with the reservation
  arena.segments.reserve(arena.segments.size() + 1);
  arena.blocks.reserve_two();  // the segment's free block
  driver::dev_ptr base = 0;
  bool gave_back = false;
  bool shrunk = false;
  const bool spare = spare_range_.bytes >= va;  // the range of a segment given back serves
  if (spare) {
    base = spare_range_.base;
    va = spare_range_.bytes;
    spare_range_ = {};
  } else if (spare_range_.bytes != 0) {
    // Too small for this segment: a new range takes its place (if it cannot go back now, it
    // stays spare and the reservation below is made all the same).
    try {
      free_spare_range();
    } catch (const driver_error&) {
    }
  }
  for (; !spare;) {
    try {
      base = ctx_.driver.reserve(va);
      break;
    } catch (const driver_error& e) {
      if (!e.is_out_of_memory()) throw;
      // Out of address range: give back the memory and ranges of other streams that hold no
      // block in use, once (and the spare range that one of them may have left).
      if (!gave_back) {
        gave_back = true;
        const bool given = give_back_unused_arenas(&arena) != 0;
        const bool spare_given = spare_range_.bytes != 0;
        if (spare_given) free_spare_range();
        if (given || spare_given) continue;
      }
      // Then a smaller range, down to the request's own size: the address space ran out, not the
      // memory (the H200 gives a process 112 TiB: ~400 streams holding memory at 2x its memory a
      // segment). The segment can no longer grow in place past it; a later request that does not
      // fit makes another segment.
      if (va > least) {
        va = std::max(least, round_up(va / 4, frame_));
        shrunk = true;
        continue;
      }
      ctx_.refused = Context::Refusal::address_range;
      return nullptr;
    }
  }
  // The next segments start at the size that served (not at failed attempts for each new stream),
  // until ranges go back (drop_segment, release_cached).
  if (shrunk) va_hint_ = std::min(va_hint_, va);
  if (!spare) {  // the spare range is counted already
    va_reserved_ += va;
    process_va_reserved_.fetch_add(va, std::memory_order_relaxed);
  }
  seg->base = base;
  seg->va_bytes = va;
  seg->arena = &arena;
  Block* b = arena.blocks.make();
  b->addr = base;
  b->size = va;
  b->stream = arena.stream;
  b->segment = seg.get();
  b->mapped = false;
  seg->first = b;
  insert_free(arena, b);
  arena.segments.push_back(seg.get());
  account_segment(kLargePool, 1);
  return seg.release();
}

Block* ExpandableBackend::allocate_slow(ExpArena& arena, std::size_t size, std::size_t requested) {
  // Cross-stream frees whose events have completed: the cached path completes two streams' a
  // request (process_events_of_next_queues), here all of them, before any memory is mapped or given
  // back (PyTorch's malloc completes them first). Their blocks may serve this request.
  if (!retrying_pending_ && ctx_.hooks != nullptr && ctx_.hooks->process_pending_frees())
    if (Block* b = allocate_cached(arena, size, requested)) return b;
  ++slow_calls_;
  if (arena.legacy_unasked) recheck_legacy_waits(arena);
  // A late request on an exited thread's key: its growth may leave idle handles (reap_retired skips it now).
  if (arena.retired) [[unlikely]] look_again(arena);
  const CaptureScope capture(ctx_, arena.stream);
  ctx_.refused = Context::Refusal::none;
  // A request that could not fit even in an empty allocator fails before anything is reserved or
  // mapped (a limit above the device's memory does not make room the device lacks).
  const bool never_fits = round_up(size, frame_) > std::min(ctx_.effective_limit(), ctx_.device_total);
  Block* b = never_fits ? nullptr : place_or_grow(arena, size, requested);
  if (b != nullptr || retrying_pending_ || ctx_.hooks == nullptr || !ctx_.hooks->has_pending_frees() || ctx_.capturing) return b;
  // As PyTorch's retry before an OOM: wait for the streams of pending cross-stream frees
  // (record_stream), complete them, and try once more, the cached memory included. Also for a
  // request that can never fit, as PyTorch (and split_merge) do: the OOM then finds the same live
  // set on both backends.
  ctx_.hooks->synchronize_pending_frees();
  ctx_.stats.num_alloc_retries += 1;
  // Once: a free whose event a capture took stays pending through the synchronization (it waits
  // for the capture's end), and a retry for each retry recursed until the stack ran out.
  retrying_pending_ = true;
  struct Reset {
    bool& flag;
    ~Reset() { flag = false; }
  } reset{retrying_pending_};
  return allocate(requested, arena.stream);
}

Block* ExpandableBackend::place_or_grow(ExpArena& arena, std::size_t size, std::size_t requested) {
  begin_operation();
  // Optional clean-up (exited threads' caches; it synchronizes): a driver call refused there stops
  // the clean-up, not the request, which may fit without it, as in split_merge (was: the request
  // failed with that driver_error on a device with room). What it could not give back stays cached.
  if (!ctx_.capturing) {
    try {
      reap_retired(&arena);
    } catch (const driver_error&) {
    }
  }
  // Handles whose cleanup failed earlier may sit on frames we are about to use: retry them first.
  if (!orphans_.empty()) retry_orphans();
  Placement pl;
  ExpSegment* fresh = nullptr;  // a segment reserved for this request, given back if it fails
  if (!find_placement(arena, size, pl)) {
    fresh = new_segment(arena, size);
    if (fresh == nullptr) return nullptr;
    pl = Placement{fresh, nullptr, fresh->base, frames_needed(*fresh, fresh->base, fresh->base + size)};
  }
  // A request that cannot fit fails before anything is given back. The best place may lack room
  // that another place has: the idle handles under a block are not given back for it, so a place
  // over an idle frame can need a frame that a place beside a live block's partly used frame,
  // ranked the same, does not (limit 6 MiB, 6 MiB held: a 2.5 MiB request failed though the other
  // place touched 6 MiB in all).
  bool room = ctx_.limit == 0 || !orphans_.empty() || room_for_placement(pl, size);
  if (!room && fresh == nullptr) room = find_placement(arena, size, pl, true);
  // Held above the limit (set_limit lowered below what is held): no place has room under it, and
  // the cached block the fallback below carves may lie on an idle bulk handle, pinned by the new
  // block for as long as it lives, so that a later, lower limit fails with a fragmentation OOM
  // (limit 200 MiB, 256 held: a 1 MiB block on a freed 16 MiB handle; then limit 64 MiB and 62 MiB
  // failed with 2 MiB of live pages). A place whose mapping, once idle handles are given back,
  // holds no more than now is taken instead: it swaps the bulk handle for the frames the block
  // needs.
  struct CeilingScope {
    std::size_t& ceiling;
    ~CeilingScope() { ceiling = 0; }
  } ceiling_scope{held_ceiling_};
  if (!room && ctx_.limit != 0 && reserved_ > ctx_.limit && may_unmap_in(arena)) {
    held_ceiling_ = reserved_;
    room = room_for_placement(pl, size) || (fresh == nullptr && find_placement(arena, size, pl, true));
  }
  Block* b = nullptr;
  try {
    if (room) b = grow_and_carve(arena, pl, size, requested);
  } catch (...) {
    if (fresh != nullptr) {
      try {
        drop_segment(arena, fresh, false);  // a failed request gives back the range it took
      } catch (...) {  // the segment stays, consistent; the first error is the one to report
      }
    }
    throw;
  }
  if (b == nullptr && fresh != nullptr) {
    try {
      drop_segment(arena, fresh, false);
    } catch (...) {  // the segment stays, empty and consistent; the OOM is what to report
    }
  }
  // Under a limit, bulk idle handles serve one block at a time, so that they can be given back;
  // when no room can be made (a capture forbids the synchronization unmapping takes, or there is
  // no idle memory to take), a mapped free block that fits serves the request sharing them rather
  // than an OOM. Best fit; no driver call.
  if (b == nullptr && ctx_.limit != 0)
    if (Block* f = arena.mapped_free.lower_bound(size); f != nullptr) b = carve(arena, f, size, requested, false);
  return b;
}

// What the room checks hold mapped memory to: the limit, or while place_or_grow swaps a mapping
// over it, what is held now.
std::size_t ExpandableBackend::room_limit() const noexcept {
  return std::max(ctx_.effective_limit(), held_ceiling_);
}

// Gives back the address range of an empty segment (one free unmapped block), or keeps it as the
// spare range when it is larger than the spare range held (keep_range), and forgets the segment.
void ExpandableBackend::drop_segment(ExpArena& arena, ExpSegment* seg, bool keep_range) {
  Block* b = seg->first;
  if (seg->mapped_bytes != 0 || b->next != nullptr || !b->is_free()) return;
  unmap_orphans_in(seg->base, seg->va_bytes);  // throws: the reservation stays while a mapping is in it
  // Kept only by the process's one expandable allocator: all share one address space, and another
  // allocator (another device's) could not take this one's spare back when it runs out of range.
  const bool sole = process_instances_.load(std::memory_order_relaxed) == 1;
  if (keep_range && seg->va_bytes > spare_range_.bytes && sole) {
    if (spare_range_.bytes != 0) free_spare_range();  // throws with nothing changed
    spare_range_ = {seg->base, seg->va_bytes};
  } else {
    if (!sole && spare_range_.bytes != 0) {  // kept before another allocator came: best effort
      try {
        free_spare_range();
      } catch (const driver_error&) {
      }
    }
    ctx_.driver.free_reserve(seg->base, seg->va_bytes);
    va_reserved_ -= seg->va_bytes;
    process_va_reserved_.fetch_sub(seg->va_bytes, std::memory_order_relaxed);
  }
  erase_free(arena, b);
  arena.blocks.recycle(b);
  arena.segments.erase(std::find(arena.segments.begin(), arena.segments.end(), seg));
  account_segment(kLargePool, -1);
  // A range of its size is free again: a new segment that large would fit (the hint goes back to
  // va_bytes_ once no segment is left).
  va_hint_ = ctx_.stats.segment[kLargePool].current == 0 ? va_bytes_ : std::max(va_hint_, std::min(seg->va_bytes, va_bytes_));
  delete seg;
}

void ExpandableBackend::free_spare_range() {
  if (spare_range_.bytes == 0) return;
  ctx_.driver.free_reserve(spare_range_.base, spare_range_.bytes);  // throws with nothing changed
  va_reserved_ -= spare_range_.bytes;
  process_va_reserved_.fetch_sub(spare_range_.bytes, std::memory_order_relaxed);
  spare_range_ = {};
}

Block* ExpandableBackend::grow_and_carve(ExpArena& arena, const Placement& pl, std::size_t size, std::size_t requested) {
  // A small request growing into a segment's untouched tail maps up to a whole growth granule, as
  // PyTorch maps 20 MiB pages, so that a run of small requests costs one growth instead of one each.
  // Not the segment's first growth: a new stream's first request maps only its own frame, so a
  // stream that lives for one request (a stream per request, a short-lived thread's per-thread
  // stream) maps and gives back one handle, not two (the request's frame and the granule's rest,
  // as handles apart: see the handle policy); a stream that goes on asking pays that one handle
  // once, at its second growth.
  std::uint64_t map_hi = pl.start + size;
  if (const std::size_t granule = growth_granule(size); granule > frame_ && size < granule && pl.seg->high_water != 0) {
    Block* b = pl.anchor ? pl.anchor->next : pl.seg->first;
    while (b->end() < map_hi) b = b->next;
    if (b->next == nullptr && b->is_free() && !b->mapped) {
      const std::uint64_t rounded = pl.seg->base + round_up(map_hi - pl.seg->base, granule);
      map_hi = std::min<std::uint64_t>(rounded, pl.seg->base + pl.seg->va_bytes);
    }
  }
  // Without a limit, keep the peak of what is held close to what is in use: before growing past
  // the highest reservation so far, give back idle memory beyond a small slack over the live bytes
  // (best effort; the slack is 1/256 of the live bytes, without the growth granule: an extension
  // mapped past a block is for later, not part of the working set). It costs driver calls, so it
  // only runs when a new peak would be set — rarely, once a workload has warmed up, but at almost
  // every token of a generation whose KV caches grow. Memory idle since before the last
  // synchronization of the stream, or before the event the previous such reclaim recorded there
  // once that event completed, goes back without waiting (ExpArena::safe_seq). Newer idle memory
  // waits for the stream only where the growth would pass the target by more than 1/128 of the
  // live bytes: a synchronization drains the queue the host had run ahead by. Within that, it
  // stays mapped (deferred_idle_, left out of high_water_) until a later reclaim finds it safe.
  // Replays (sim_latency), synchronizations before -> after: GPT-2 generation 344 -> 119, GPT-2
  // training 38 -> 15, ResNet-50 16 -> 9 (1/256: 197, 34, 9; 1/64: 32, 8, 8); peak reserved over
  // allocated the same but for GPT-2 training, 1.0067 -> 1.0081 (as on the H100). Under a limit,
  // make_room below reclaims when the limit requires it.
  struct DeferredForThisGrowth {
    std::size_t& bytes;
    ~DeferredForThisGrowth() { bytes = 0; }
  } deferred_guard{deferred_idle_};
  if (ctx_.limit == 0 && !idle_runs_.empty()) {
    const std::size_t need = frames_needed(*pl.seg, pl.start, map_hi) * frame_;
    if (reserved_ + need > high_water_) {
      const auto in_use = static_cast<std::size_t>(ctx_.stats.active_bytes[kAllPools].current) + size;
      const std::size_t soft = std::max(high_water_, in_use + in_use / 256);
      const std::size_t hard = soft + in_use / 128;
      // Only this stream's idle memory: taking another stream's would make streams that churn side
      // by side hand memory back and forth (an unmap, a map and a synchronization each time),
      // where each stream's cache would settle at its own working set.
      // Best effort: a refused unmap or synchronization ends the reclaim, not the growth, which has
      // room without it (no limit); what it gave back before stays given back.
      if (reserved_ + need > soft) {
        try {
          reclaim_idle(reserved_ + need - soft, Exclusion{pl.seg, pl.start, map_hi}, &arena, false,
                       reserved_ + need > hard ? reserved_ + need - hard : 0, &deferred_idle_);
        } catch (const driver_error&) {
        }
      }
    }
  }
  if (ctx_.limit != 0 && may_unmap_in(arena)) unmap_bulk_handles_under(*pl.seg, pl.anchor, pl.start, pl.start + size);
  if (map_hi > pl.start + size &&
      !make_room(frames_needed(*pl.seg, pl.start, map_hi) * frame_, Exclusion{pl.seg, pl.start, map_hi}))
    map_hi = pl.start + size;  // no room for the extra: map just what the request needs
  const std::size_t need = frames_needed(*pl.seg, pl.start, map_hi) * frame_;
  const Exclusion ex{pl.seg, pl.start, map_hi};
  // Under a limit, room that idle handles must give is taken handle by handle while mapping
  // (map_range moves idle handles here, or reclaims for a new one); only check here that it exists.
  if (!(ctx_.limit != 0 && room_after_reclaim(need, ex)) && !make_room(need, ex)) return nullptr;
  // A growth that fails midway (the device is short of memory: other processes, or a request the
  // device cannot hold) gives back what it mapped, as PyTorch's expandable segments do, instead of
  // keeping it as cache the failed request never used.
  std::vector<ExpHandle*> mapped_now;
  bool mapped = false;
  try {
    mapped = map_range(*pl.seg, pl.start, pl.start + size, map_hi, pl.anchor, &mapped_now);
    // The idle runs' spare and the two Blocks the split below and carve need: a bad_alloc for
    // them must give back the new handles too, as any other failure of this growth does.
    if (mapped) {
      reserve_runs(1);
      arena.blocks.reserve_two();  // nothing may fail once the runs change
    }
  } catch (...) {
    unmap_new_handles(mapped_now);
    throw;
  }
  if (!mapped) {
    unmap_new_handles(mapped_now);
    return nullptr;
  }
  // [start, start + size) now lies in one free mapped block (adjacent mapped free blocks merge).
  Block* b = pl.anchor ? pl.anchor->next : pl.seg->first;
  while (b->end() <= pl.start) b = b->next;
  if (!b->is_free() || !b->mapped || b->end() < pl.start + size) broken("mapped run at " + hex(pl.start) + " is not one free block");
  const bool below = b->addr < pl.start;
  Block* c = carve_at(arena, *pl.seg, b, pl.start, size, requested);
  if (ctx_.limit != 0) remember_place(arena, below ? b : c, pl.start, size);
  return c;
}

// The fast path may not find this place again (ExpArena::PlaceMemo). `host` holds it again once the
// block there is freed: the free block below it, which absorbs it, or the block itself.
void ExpandableBackend::remember_place(ExpArena& arena, Block* host, std::uint64_t addr, std::size_t size) noexcept {
  for (ExpArena::PlaceMemo& m : arena.place_memos)
    if (m.addr == addr && m.size == size) {
      m.host = host;
      return;
    }
  arena.place_memos[arena.next_place_memo] = ExpArena::PlaceMemo{host, addr, size};
  arena.next_place_memo = static_cast<std::uint8_t>((arena.next_place_memo + 1) % arena.place_memos.size());
}

Block* ExpandableBackend::carve_at(ExpArena& arena, ExpSegment& seg, Block* b, std::uint64_t start, std::size_t size,
                                   std::size_t requested) noexcept {
  // The idle handles under the new block leave their runs here, against b as a whole: once b is
  // split, a handle across start would lie wholly inside neither part.
  std::uint64_t wlo = 0;
  std::uint64_t whi = 0;
  whole_handles(seg, *b, wlo, whi);
  if (wlo < whi) {
    const ExpHandle* first = handle_at(seg, start);
    const ExpHandle* last = handle_at(seg, start + size - 1);
    make_busy(seg, wlo, whi, std::max(frame_addr(seg, first->first_frame), wlo), std::min(frame_addr(seg, last->first_frame) + last->bytes, whi));
  }
  if (b->addr < start) {
    erase_free(arena, b);
    Block* upper = split_after(arena.blocks, b, start);
    insert_free(arena, b);
    insert_free(arena, upper);
    b = upper;
  }
  return carve(arena, b, size, requested, false, true);
}

Block* ExpandableBackend::allocate_at(driver::stream_t stream, std::uint64_t addr, std::size_t size) {
  if (size == 0 || addr % kMinBlockSize != 0 || size % kMinBlockSize != 0) return nullptr;
  ExpArena* const arena = find_arena(stream);
  if (arena == nullptr) return nullptr;
  for (ExpSegment* seg : arena->segments) {
    if (addr < seg->base || addr - seg->base >= seg->va_bytes || seg->va_bytes - (addr - seg->base) < size) continue;
    // Reserved but never mapped (or unmapped since): no free memory of the pool there.
    if (frame_handle(*seg, frame_of(*seg, addr)) == nullptr) return nullptr;
    Block* b = mapped_block_at(*seg, addr);
    if (!b->is_free() || !b->mapped || b->end() - addr < size) return nullptr;
    reserve_runs(1);
    arena->blocks.reserve_two();  // nothing may fail once the runs change
    return carve_at(*arena, *seg, b, addr, size, size);
  }
  return nullptr;
}

// Maps every unmapped frame of [lo, map_hi). [lo, hi) is the block being allocated: the frames it
// covers only partly at its start and end get handles of their own, and the frames beyond it (growth
// granule) get their own handles, so that neither keeps the block's handles mapped or vice versa.
bool ExpandableBackend::map_range(ExpSegment& seg, std::uint64_t lo, std::uint64_t hi, std::uint64_t map_hi, Block* anchor,
                                  std::vector<ExpHandle*>* mapped_now) {
  const Exclusion ex{&seg, lo, map_hi};
  const std::size_t max_frames = max_handle_bytes(hi - lo) / frame_;
  const std::size_t block_end = frame_of(seg, hi - 1) + 1;  // frames [.., block_end) hold the block
  const std::size_t map_end = frame_of(seg, map_hi - 1) + 1;
  const bool last_partial = (hi - seg.base) % frame_ != 0;
  const std::size_t first_frame = frame_of(seg, lo);
  const bool first_partial = (lo - seg.base) % frame_ != 0;
  for (std::size_t f = first_frame; f < map_end;) {
    if (frame_handle(seg, f) != nullptr) {
      ++f;
      continue;
    }
    // A run of unmapped frames, cut where the block ends.
    const std::size_t limit = f < block_end ? block_end : map_end;
    std::size_t run_end = f;
    while (run_end < limit && frame_handle(seg, run_end) == nullptr) ++run_end;
    while (f < run_end) {
      const std::size_t n = next_handle_frames(f, run_end, max_frames, first_frame, first_partial, block_end, last_partial);
      // The handle's slot in mapped_now first (nullptr until mapped): a bad_alloc after the
      // mapping would leave a handle the caller cannot give back.
      if (mapped_now != nullptr) mapped_now->push_back(nullptr);
      if (ctx_.limit != 0 && reserved_ + n * frame_ > room_limit()) {
        if (const std::size_t moved = move_idle_handle(seg, f, n, anchor, ex); moved != 0) {
          if (mapped_now != nullptr) mapped_now->back() = seg.frames[f];
          f += moved;
          continue;
        }
      }
      if (!map_one(seg, f, n, anchor, ex)) return false;
      if (mapped_now != nullptr) mapped_now->back() = seg.frames[f];
      f += n;
    }
  }
  return true;
}

// Creates, maps and grants access to one handle of `nframes` at `frame`. Returns false when memory
// cannot be found; throws driver_error for other failures. Either way nothing is leaked: a handle
// whose cleanup also fails is kept as an orphan (still counted as reserved) and retried later.
// The device itself may be short (other processes, less memory than the limit says, or the driver's
// own memory for a mapping): an out-of-memory cuMemCreate, cuMemMap or cuMemSetAccess gives idle
// memory back and tries once more. (Without that second try for the mapping calls, the caller fell
// back to carving the request out of an idle bulk handle, which pinned that handle for as long as
// the block lived and broke the guarantee under the limit.)
bool ExpandableBackend::map_one(ExpSegment& seg, std::size_t frame, std::size_t nframes, Block* anchor, const Exclusion& ex) {
  const std::size_t bytes = nframes * frame_;
  driver::Driver& drv = ctx_.driver;
  bool reclaimed = false;  // idle memory given back for this handle: no third try
  auto short_of_memory = [&] {
    ctx_.refused = Context::Refusal::memory;
    if (reclaimed) return false;
    reclaimed = true;
    return reclaim_idle(bytes, ex) != 0;
  };
  for (;;) {
    if (!make_room(bytes, ex)) return false;
    auto h = std::make_unique<ExpHandle>();  // before the memory: a bad_alloc after create would leak it
    driver::phys_handle ph = 0;
    try {
      ph = drv.create(bytes);
    } catch (const driver_error& e) {
      if (!e.is_out_of_memory()) throw;
      if (!short_of_memory()) return false;
      continue;
    }
    h->handle = ph;
    h->bytes = bytes;
    h->nframes = nframes;
    ExpHandle* const mapped_handle = h.release();
    if (map_handle(seg, frame, mapped_handle, anchor)) {
      ctx_.stats.num_device_alloc += 1;
      mapped_handle->counted = true;
      return true;
    }
    // cuMemMap or cuMemSetAccess ran out of memory; the handle went back, or is kept as an orphan.
    // One still mapped there (its cleanup unmap failed too) would have to be unmapped first, and a
    // failure of that would replace this OOM: the OOM stands instead.
    if (mapped_orphan_in(frame_addr(seg, frame), bytes) || !short_of_memory()) return false;
  }
}

// Under a limit, when the frames at `frame` need memory the limit only leaves by giving back idle
// memory: takes the largest idle handle of at most `nframes` frames (and at least 3/4 of them, so
// the run does not break into many handles), unmaps it where it lies and maps it here. A move costs
// cuMemUnmap + cuMemMap + cuMemSetAccess where giving the handle back and creating a new one costs
// cuMemUnmap + cuMemRelease + cuMemCreate + cuMemMap + cuMemSetAccess. On the H200 the release and
// create of the random churn's handles took 47% of its driver time; moves cut that churn's driver
// time by 14% (seeds 1-3: 309 -> 266 ms; exact fits only: 269 ms, down to 1/2 of the frames:
// 267 ms, to 1/4: 293 ms, where the extra handles cost more cuMemSetAccess than they save).
// Returns the frames mapped, 0 when no idle handle fits (the caller creates one instead).
// The handle is sought, as reclaim_idle's largest ones, among the least recently idle handles that
// hold kMoveWindow times the frames needed (at least kMoveWindow handles), not among all: with
// 100,000 idle handles, none of the right size, each move looked at every one of them before the
// caller created a handle anyway. Random churn, seeds 1-16, its own sizes and the 1-64, 1-32 and
// 2-16 MiB mixes: 4.22 -> 4.07 s of modelled driver time (moves of handles far down the order
// were not the cheaper choice), 4% more handles created, 402 OOMs instead of 403, none for
// fragmentation, each mix's lowest fill at an OOM the same or higher on average.
std::size_t ExpandableBackend::move_idle_handle(ExpSegment& seg, std::size_t frame, std::size_t nframes, Block* anchor,
                                                const Exclusion& ex) {
  constexpr std::size_t kMoveWindow = 8;
  const std::size_t window_frames = nframes * kMoveWindow;
  std::size_t seen = 0;
  std::size_t seen_frames = 0;
  ExpHandle* best = nullptr;
  std::uint64_t best_seq = 0;
  for_each_idle([&](ExpHandle& h, const IdleRun& r) {
    ++search_steps_;
    if (++seen > kMoveWindow && seen_frames >= window_frames) return false;
    seen_frames += h.nframes;
    if (h.nframes > nframes || 4 * h.nframes < 3 * nframes || (best != nullptr && h.nframes <= best->nframes)) return true;
    if (excluded(h, ex)) return true;
    best = &h;
    best_seq = r.seq;
    return best->nframes != nframes;  // an exact fit, the least recently idle: no other can win
  });
  if (best == nullptr) return 0;
  // The memory was freed on its arena's stream: work queued there may still use it.
  synchronize_for_run(*best->seg->arena, best_seq);
  const std::size_t moved = best->nframes;
  unmap_mapping(best);  // the handle stays held: neither a device free nor, mapped again, an allocation
  // A failed mapping gives the handle back, a device free (map_handle counts it), or keeps it as an
  // orphan, counted when a retry releases it.
  if (!map_handle(seg, frame, best, anchor)) return 0;
  return moved;
}

// Maps unmapped handle `h` (h->bytes, h->nframes set) at `frame` and grants access; on success the
// handle is registered there, idle. On failure the handle is released (or kept as an orphan): false
// for out of memory, driver_error otherwise.
bool ExpandableBackend::map_handle(ExpSegment& seg, std::size_t frame, ExpHandle* hp, Block* anchor) {
  std::unique_ptr<ExpHandle> h(hp);
  driver::Driver& drv = ctx_.driver;
  h->first_frame = frame;
  const std::size_t bytes = h->bytes;
  const std::uint64_t addr = frame_addr(seg, frame);
  auto give_up = [&](bool still_mapped) {
    // Undo this handle; what cannot be undone now becomes an orphan.
    try {
      if (still_mapped) drv.unmap(addr, bytes);
      still_mapped = false;
      drv.release(h->handle);
      if (h->counted) ctx_.stats.num_device_free += 1;  // a moved handle: given back
      return;
    } catch (...) {
    }
    keep_as_orphan(h.release(), still_mapped, addr);
  };
  try {
    // register_mapping's run, and one run object per handle held: a run holds whole idle handles,
    // so the runs never outnumber the handles, and free() and run splits always find a spare
    // (free must not fail: the caller has already forgotten the pointer).
    if (run_objects_ < handles_ + 1) add_spare_runs(handles_ + 1 - run_objects_);
    seg.arena->blocks.reserve_two();  // set_range_mapped's splits, so that they cannot fail once mapped
    // register_mapping's frames (past the table's end: unmapped, as nullptr says)
    if (seg.frames.size() < frame + h->nframes) {
      seg.mapped_words.resize(std::max(seg.mapped_words.size(), (frame + h->nframes + 63) / 64), 0);
      seg.frames.resize(frame + h->nframes, nullptr);
    }
    unmap_orphans_in(addr, bytes);  // throws: the frames still hold that mapping, the error says why
  } catch (...) {
    give_up(false);
    throw;
  }
  // Any exception is undone, std::bad_alloc included (the driver's bookkeeping, or the message of
  // its error): else the handle would stay created and mapped with nothing holding it.
  try {
    drv.map(addr, bytes, h->handle);
  } catch (const driver_error& e) {
    give_up(false);
    if (!e.is_out_of_memory()) throw;
    ctx_.refused = Context::Refusal::memory;
    return false;
  } catch (...) {
    give_up(false);
    throw;
  }
  try {
    drv.set_access(addr, bytes);
  } catch (const driver_error& e) {
    give_up(true);
    if (!e.is_out_of_memory()) throw;
    ctx_.refused = Context::Refusal::memory;
    return false;
  } catch (...) {
    give_up(true);
    throw;
  }
  register_mapping(seg, h.release(), anchor);
  return true;
}

void ExpandableBackend::register_mapping(ExpSegment& seg, ExpHandle* h, Block* anchor) {
  ExpArena& arena = *seg.arena;
  h->seg = &seg;
  h->mapped = true;
  for (std::size_t f = h->first_frame; f < h->first_frame + h->nframes; ++f) {
    seg.frames[f] = h;
    seg.mapped_words[f / 64] |= std::uint64_t{1} << (f % 64);
  }
  seg.mapped_bytes += h->bytes;
  seg.high_water = std::max(seg.high_water, (h->first_frame + h->nframes) * frame_);
  reserved_ += h->bytes;
  high_water_ = std::max(high_water_, reserved_ - std::min(reserved_, deferred_idle_));
  ++handles_;
  account_reserved(kLargePool, static_cast<std::int64_t>(h->bytes));
  ctx_.stats.physical_handles.increase(1);
  const std::uint64_t lo = frame_addr(seg, h->first_frame);
  const std::uint64_t hi = lo + h->bytes;
  if (ctx_.hooks) ctx_.hooks->on_map(lo, h->bytes, arena.stream);

  set_range_mapped(seg, anchor ? anchor->next : seg.first, lo, hi, true);
  // Idle since now (map_handle reserved the run). Never handed out at this address, so no queued
  // work uses it: seq 0 (a moved handle's work at its old address was known complete before its unmap).
  add_idle_run(seg, lo, hi, 0);
}

// The free block holding [lo, hi) (in the other mapped state) becomes up to three: the parts
// before lo and after hi keep their state; [lo, hi) takes `mapped` and merges with free neighbours
// of that state. `from` is a block at or before lo.
void ExpandableBackend::set_range_mapped(ExpSegment& seg, Block* from, std::uint64_t lo, std::uint64_t hi, bool mapped) {
  ExpArena& arena = *seg.arena;
  Block* b = from;
  while (b->end() <= lo) b = b->next;
  if (!b->is_free() || b->mapped == mapped || b->addr > lo || b->end() < hi)
    broken("frames at " + hex(lo) + " are not inside one free " + (mapped ? "unmapped" : "mapped") + " block");
  erase_free(arena, b);
  Block* mid = b;
  if (b->addr < lo) {
    mid = split_after(arena.blocks, b, lo);
    insert_free(arena, b);
  }
  if (mid->end() > hi) insert_free(arena, split_after(arena.blocks, mid, hi));
  mid->mapped = mapped;
  Block* merged = merge_free(arena, mid);
  insert_free(arena, merged);
  // Mapped: the holes left in its run keep their run_bytes, but the hole mapped may have been the
  // run's dirty one (ExpArena::holes).
  if (mapped) {
    if (Block* q = merged->prev; q != nullptr && q->is_free()) mark_dirty(arena, q);
    if (Block* q = merged->next; q != nullptr && q->is_free()) mark_dirty(arena, q);
  }
}

// Under a limit: whether the block at [pl.start, pl.start + size) fits once every idle handle it
// does not use is given back (the idle bulk handles it would cover only partly included), the
// check grow_and_carve makes after unmapping those. Checked first, a request that fails gives back
// nothing: giving back every idle handle before failing anyway cost the random churn's 13-23 OOMs
// 389-529 unmaps and as many releases (seeds 1-3: 13-18 ms of 90-109 ms on the H200 latency model),
// and the creates and maps of that memory again after the OOM. Seeds 1-6: 640 -> 564 ms modelled
// (-12%), the same OOMs (one more for seed 4, at 99.1% of the limit), none for fragmentation; the
// size mixes' lowest fill the same or higher. Only the handles under the block's first and last
// byte can be covered partly; the walk of the other idle handles stops once they cover the room.
bool ExpandableBackend::room_for_placement(const Placement& pl, std::size_t size) const noexcept {
  const ExpSegment& seg = *pl.seg;
  const std::uint64_t lo = pl.start;
  const std::uint64_t hi = pl.start + size;
  const Exclusion ex{&seg, lo, hi};
  std::size_t frames = frames_needed(seg, lo, hi);
  std::size_t freeable = 0;
  const ExpHandle* edges[2] = {frame_handle(seg, frame_of(seg, lo)), frame_handle(seg, frame_of(seg, hi - 1))};
  for (int i = 0; i < 2 && may_unmap_in(*seg.arena); ++i) {
    const ExpHandle* h = edges[i];
    if (h == nullptr || h->nframes == 1 || (i == 1 && h == edges[0])) continue;
    const std::uint64_t hlo = frame_addr(seg, h->first_frame);
    if (hlo >= lo && hlo + h->bytes <= hi) continue;  // stays mapped for the block
    const Block* b = mapped_block_at(seg, hlo);
    if (!b->is_free() || b->end() < hlo + h->bytes) continue;  // not idle: a live block holds part of it
    freeable += h->bytes;  // unmapped first (unmap_bulk_handles_under): its frames under the block map anew
    frames += frame_of(seg, std::min(hlo + h->bytes, hi) - 1) - frame_of(seg, std::max(hlo, lo)) + 1;
  }
  if (frames == 0) return true;  // mapping nothing needs no room
  const std::size_t limit = room_limit();
  const std::size_t need = frames * frame_;
  if (reserved_ - freeable + need <= limit) return true;
  for_each_idle([&](const ExpHandle& h) {
    ++slow_path_steps_;
    if (!excluded(h, ex)) freeable += h.bytes;
    return reserved_ - freeable + need > limit;  // false: enough, stop
  });
  return reserved_ - freeable + need <= limit;
}

// Whether `bytes` more could be mapped under the limit once the idle handles outside `ex` are
// given back. The walk stops once the idle handles cover what the limit lacks (the mapping that
// follows unmaps about as many): summing them all cost every slow allocation under a limit a walk
// of every idle handle, a fifth to a quarter of the CPU time of a churn at the limit with
// 3,000-27,000 handles.
bool ExpandableBackend::room_after_reclaim(std::size_t bytes, const Exclusion& ex) const noexcept {
  const std::size_t limit = room_limit();
  if (bytes == 0 || reserved_ + bytes <= limit) return true;
  const std::size_t lacking = reserved_ + bytes - limit;
  std::size_t idle = 0;
  for_each_idle([&](const ExpHandle& h) {
    ++slow_path_steps_;
    if (!excluded(h, ex)) idle += h.bytes;
    return idle < lacking;
  });
  return idle >= lacking;
}

bool ExpandableBackend::make_room(std::size_t bytes, const Exclusion& ex) {
  const std::size_t limit = room_limit();
  if (bytes > limit) return false;
  if (reserved_ + bytes <= limit) return true;
  if (!orphans_.empty()) retry_orphans();
  if (reserved_ + bytes > limit) reclaim_idle(reserved_ + bytes - limit, ex, nullptr, ctx_.limit != 0);
  return reserved_ + bytes <= limit;
}

// Unmaps idle handles, least recently idle first, until at least `bytes` are given back (or none
// is left outside the exclusion; `only`: of that arena alone). Returns the bytes given back. A
// handle whose stream's work is not known complete (it would synchronize first) is taken only while
// less than `must` came back; `deferred` gets the bytes left mapped that way, as far as `bytes`
// fell short.
// largest_first (room under the limit): the largest handles first, least recently idle first among
// equals, so that the room costs the fewest unmap and release calls (see the handle policy). No
// index orders idle handles by size (its upkeep would fall on the cached path, where handles turn
// idle and busy), so the largest are sought among the least recently idle ones holding
// kReclaimWindow times the bytes needed (at least kReclaimWindow handles), not among all: walking
// every idle handle made each allocation under a limit cost O(idle handles) (2,048 idle handles:
// ~1,800 steps a request instead of ~50). Random churn, 64 seeds, modelled driver time: 5,904 ms
// with every idle handle, 5,902 with the window of 8 (4: 5,921; 2: 6,081); mixes no worse.
std::size_t ExpandableBackend::reclaim_idle(std::size_t bytes, const Exclusion& ex, ExpArena* only, bool largest_first, std::size_t must,
                                            std::size_t* deferred) {
  constexpr std::size_t kReclaimWindow = 8;
  const std::size_t wanted = !largest_first ? bytes : bytes > SIZE_MAX / kReclaimWindow ? SIZE_MAX : bytes * kReclaimWindow;
  std::size_t freed = 0;
  std::size_t seen = 0;
  struct Candidate {
    ExpHandle* h;
    std::uint64_t seq;  // its run's (synchronize_for_run)
  };
  std::vector<Candidate> order;
  auto take = [&](ExpHandle& h, const IdleRun& r) {  // false: enough candidates
    ++slow_path_steps_;
    if (excluded(h, ex)) return true;
    order.push_back(Candidate{&h, r.seq});
    seen += h.bytes;
    return seen < wanted || (largest_first && order.size() < kReclaimWindow);
  };
  if (only != nullptr) {  // that arena's runs only, in the same order for_each_idle would give them
    if (!may_unmap_in(*only)) return 0;
    poll_epoch(*only);
    bool more = true;
    for (auto r = only->idle_runs.begin(); more && r != only->idle_runs.end(); ++r)
      for (std::uint64_t a = r->lo; more && a < r->hi;) {
        ExpHandle* h = handle_at(*r->seg, a);
        a += h->bytes;
        more = take(*h, *r);
      }
  } else {
    for_each_idle(take);
  }
  if (largest_first)
    std::stable_sort(order.begin(), order.end(), [](const Candidate& a, const Candidate& b) { return a.h->bytes > b.h->bytes; });
  std::size_t skipped = 0;
  for (const Candidate& c : order) {
    if (freed >= bytes) break;
    const ExpArena& arena = *c.h->seg->arena;
    const std::size_t hb = c.h->bytes;
    if (freed >= must && c.seq > arena.safe_seq) {  // it would wait, and need not
      skipped += hb;
      continue;
    }
    // The memory was freed on the arena's stream: work queued there may still use it.
    synchronize_for_run(arena, c.seq);
    unmap_handle(c.h);
    freed += hb;
  }
  if (deferred != nullptr) *deferred = freed < bytes ? std::min(skipped, bytes - freed) : 0;
  // The reclaim before a new highest mark comes again at the next one: an event recorded now lets
  // that one unmap what is idle now without waiting, once the work queued before it is done (in
  // generation with growing KV caches, a reclaim at almost every token synchronized the stream
  // each time, draining the queue the host had run ahead by).
  if (only != nullptr) record_epoch(*only);
  return freed;
}

void ExpandableBackend::poll_epoch(ExpArena& arena) noexcept {
  if (!arena.epoch_pending) return;
  bool done = false;
  try {
    done = ctx_.driver.event_query(arena.epoch_event);
  } catch (...) {
    arena.epoch_pending = false;  // recorded again next time; safe_seq stays
    return;
  }
  if (!done) return;
  arena.epoch_pending = false;
  arena.safe_seq = std::max(arena.safe_seq, arena.epoch_seq);
}

void ExpandableBackend::record_epoch(ExpArena& arena) noexcept {
  if (arena.epoch_pending || arena.safe_seq >= idle_seq_ || arena.idle_runs.empty()) return;
  // The stream whose synchronization would cover the arena's work; a key's (the device's
  // synchronization) has no stream to record on. Not while a capture is seen, though the caller's
  // may_unmap_in says this stream does not capture: in global capture mode CUDA refuses calls it
  // counts unsafe from any thread while another captures (PyTorch records no event then), and a
  // record left out costs only a synchronization at the next reclaim. The captures expseg is told
  // of and those on blocking streams (one question of the legacy stream); not every stream's
  // arena asked, which thousands of streams made O(streams) per reclaim.
  const driver::stream_t stream = stream_to_synchronize(arena);
  if (is_stream_key(stream) || ctx_.capturing || seen_capture(true)) return;
  try {
    if (arena.epoch_event == nullptr) arena.epoch_event = ctx_.driver.event_create();
    ctx_.driver.event_record(arena.epoch_event, stream);
  } catch (...) {
    return;  // no epoch: the next reclaim synchronizes, as without events
  }
  arena.epoch_seq = idle_seq_;
  arena.epoch_pending = true;
}

void ExpandableBackend::destroy_epoch_event(ExpArena& arena) noexcept {
  if (arena.epoch_event == nullptr) return;
  core::try_twice([&] { ctx_.driver.event_destroy(arena.epoch_event); });
  arena.epoch_event = nullptr;
  arena.epoch_pending = false;
}

// Unmaps idle handle `h` from its frames (which become a free unmapped range) and forgets it as
// memory held: reserved, handle count. The caller releases h->handle (unmap_handle) or maps it
// again elsewhere (move_idle_handle). Throws with nothing changed when the unmap fails.
void ExpandableBackend::unmap_mapping(ExpHandle* h) {
  ExpSegment& seg = *h->seg;
  ExpArena& arena = *seg.arena;
  const std::uint64_t lo = frame_addr(seg, h->first_frame);
  const std::uint64_t hi = lo + h->bytes;
  reserve_runs(1);                  // make_busy's, when h splits its run
  arena.blocks.reserve_two();       // set_range_mapped's splits, so that they cannot fail once unmapped
  ctx_.driver.unmap(lo, h->bytes);  // throws with nothing changed
  Block* b = nullptr;
  {
    // h leaves its run; it lies wholly inside one free mapped block.
    b = mapped_block_at(seg, lo);
    std::uint64_t wlo = 0;
    std::uint64_t whi = 0;
    whole_handles(seg, *b, wlo, whi);
    make_busy(seg, wlo, whi, lo, hi);
  }
  for (std::size_t f = h->first_frame; f < h->first_frame + h->nframes; ++f) {
    seg.frames[f] = nullptr;
    seg.mapped_words[f / 64] &= ~(std::uint64_t{1} << (f % 64));
  }
  seg.mapped_bytes -= h->bytes;
  if (ctx_.hooks) ctx_.hooks->on_unmap(lo, h->bytes, arena.stream);

  // An idle handle lies inside exactly one free mapped block (adjacent free mapped blocks merge).
  set_range_mapped(seg, b, lo, hi, false);

  h->seg = nullptr;
  h->mapped = false;
  reserved_ -= h->bytes;
  --handles_;
  account_reserved(kLargePool, -static_cast<std::int64_t>(h->bytes));
  ctx_.stats.physical_handles.decrease(1);
}

// The block of `seg` that holds `addr`, a mapped address. Found by walking from the nearest unmapped
// free blocks around it (the arena's unmapped index is in address order), both ways at once. A walk
// from the segment's first block (twice) cost each unmap O(blocks), and reclaim and moves unmap
// handle after handle: a quarter to two fifths of the CPU time of a churn at the limit with
// 3,000-27,000 handles. Unmaps leave unmapped blocks behind, so the walks between them shorten.
Block* ExpandableBackend::mapped_block_at(const ExpSegment& seg, std::uint64_t addr) const noexcept {
  struct AddrKey {
    bool operator()(std::uint64_t a, const Block& b) const noexcept { return a < b.addr; }
    bool operator()(const Block& b, std::uint64_t a) const noexcept { return b.addr < a; }
  };
  UnmappedIndex& unmapped = seg.arena->unmapped;
  auto it = unmapped.upper_bound(addr, AddrKey{});  // the first unmapped block above addr
  Block* up = it != unmapped.end() && it->segment == &seg ? it->prev : nullptr;  // walks down, its end above addr
  Block* down = seg.first;  // walks up, starting at or below addr
  if (it != unmapped.begin())
    if (Block& below = *std::prev(it); below.segment == &seg) down = below.next;
  for (;; ++slow_path_steps_) {
    if (down->end() > addr) return down;
    down = down->next;
    if (up != nullptr) {
      if (up->addr <= addr) return up;
      up = up->prev;
    }
  }
}

// Holds an unmapped handle's memory as reserved again, on the orphan list, when releasing it failed.
void ExpandableBackend::keep_as_orphan(ExpHandle* h, bool still_mapped, std::uint64_t addr) {
  h->mapped = still_mapped;
  h->orphan_addr = addr;
  h->seg = nullptr;
  orphans_.push_back(*h);
  reserved_ += h->bytes;
  ++handles_;
  account_reserved(kLargePool, static_cast<std::int64_t>(h->bytes));
  ctx_.stats.physical_handles.increase(1);
}

// Whether unmapping `arena`'s idle memory now would break a CUDA graph capture. Measured on the
// H200 (driver 580): while a stream captures, in any capture mode, cuStreamSynchronize of that
// stream and cuCtxSynchronize fail and invalidate the capture; cuStreamSynchronize of a stream that
// does not capture is permitted (the CUDA driver layer makes it in relaxed capture mode), from the
// capturing thread or another. So an arena on a plain stream is off limits only while its stream
// captures, and so is one on the calling thread's per-thread stream (its synchronization is
// permitted while another stream captures, blocking or not: measured on the H200); one on another
// key (another thread's per-thread stream, which synchronize_once covers with the legacy stream's
// synchronization; a graph pool or a foreign stream, with cuCtxSynchronize) or on the legacy
// stream, whose synchronization is refused while a blocking stream captures, while any capture
// expseg knows of is underway (a told capture's stream may block: whether it does cannot be asked
// while it captures), unless every such capture's stream is known not to block
// (ctx_.capture_spares_legacy) and the arena's synchronization is the legacy stream's. Otherwise
// those synchronizations wait while a capture expseg can see from here is underway (seen_capture:
// on a plain stream of an arena, the calling thread's per-thread stream, or any blocking stream,
// which the legacy stream's question reveals). A capture expseg is not told of on another thread's
// non-blocking foreign stream is not seen.
bool ExpandableBackend::arena_captures(const ExpArena& arena) const noexcept {
  const bool own_per_thread = is_per_thread_key(arena.stream) && !is_graph_pool_key(arena.stream) &&
                              arena.stream == calling_thread_key();
  if (!own_per_thread && (is_stream_key(arena.stream) || is_legacy_stream(arena.stream))) {
    const bool via_legacy = is_legacy_stream(stream_to_synchronize(arena));
    if (ctx_.capturing && !(ctx_.capture_spares_legacy && via_legacy)) return true;
    return seen_capture(via_legacy);  // the device's synchronization: any capture refuses it
  }
  if (arena.capture_seen_op != operation_) {
    arena.capture_seen_op = operation_;
    arena.captures = stream_captures(ctx_, arena.stream);
  }
  return arena.captures;
}

bool ExpandableBackend::seen_capture(bool blocking_only) const noexcept {
  if (seen_capture_op_ != operation_) {
    seen_capture_op_ = operation_;
    seen_capture_any_ = seen_capture_blocking_ = false;
    if (const driver::stream_t own = calling_thread_key(); own != nullptr && stream_captures(ctx_, own))
      seen_capture_any_ = seen_capture_blocking_ = true;
    // A capture on any blocking stream, untold and on another thread's per-thread stream included:
    // the legacy stream's question says so (Driver::stream_capture_id), one query.
    if (!seen_capture_blocking_ && stream_captures(ctx_, nullptr)) seen_capture_any_ = seen_capture_blocking_ = true;
    // Streams about to capture (prepare_capture), which may have no arena yet: between
    // cuStreamBeginCapture and begin_graph_pool another thread's synchronization would invalidate
    // the capture (measured on the simulated device's capture rules: a device synchronization on
    // another thread's slow path broke torch.cuda.graph-style captures on a new side stream).
    for (const auto& [key, blocks] : ctx_.prepared_captures) {
      if (seen_capture_blocking_) break;
      // Another thread's per-thread stream cannot be named here; its capture stays unseen.
      if (is_legacy_stream(key) || (is_per_thread_key(key) && key != calling_thread_key()) || (seen_capture_any_ && !blocks)) continue;
      if (stream_captures(ctx_, key)) {
        seen_capture_any_ = true;
        seen_capture_blocking_ = blocks;
      }
    }
    // The arenas' streams are asked below only for a synchronization of the device (blocking_only
    // false): a capture on a blocking one is the legacy stream's answer above already, so the legacy
    // stream's synchronization (PyTorch's default stream) asks one question, not one per stream.
    seen_capture_arenas_asked_ = seen_capture_blocking_;
  }
  if (!blocking_only && !seen_capture_any_ && !seen_capture_arenas_asked_) {
    seen_capture_arenas_asked_ = true;
    // A capture on a stream routed into a graph pool (its memory is the pool's arena's): a blocking
    // one is the legacy stream's answer above already.
    if (ctx_.hooks != nullptr && ctx_.hooks->routed_stream_captures()) seen_capture_any_ = true;
    // A capture on a non-blocking stream: each plain stream's arena asked (once per operation). A
    // stream whose flags could not be asked counts as blocking and is asked too.
    for (const ExpArena& arena : arenas_) {
      const ExpArena* a = &arena;
      if (a->forgotten || is_stream_key(a->stream) || is_legacy_stream(a->stream)) continue;
      ++slow_path_steps_;
      if (a->capture_seen_op != operation_) {
        a->capture_seen_op = operation_;
        a->captures = stream_captures(ctx_, a->stream);
      }
      if (a->captures) {
        seen_capture_any_ = true;
        seen_capture_blocking_ = seen_capture_blocking_ || a->stream_blocks;
        break;
      }
    }
  }
  return blocking_only ? seen_capture_blocking_ : seen_capture_any_;
}

driver::stream_t ExpandableBackend::stream_to_synchronize(const ExpArena& arena) noexcept {
  const driver::stream_t stream = arena.stream;
  if (is_per_thread_key(stream) && !is_graph_pool_key(stream))
    return stream == calling_thread_key() ? reinterpret_cast<driver::stream_t>(kPerThreadStream) : nullptr;
  return arena.legacy_waits && !arena.legacy_unasked ? nullptr : stream;
}

// A stream is synchronized by itself however many streams an operation touches: a device
// synchronization would wait for every other stream's work too, and invalidate a capture on any of
// them (one expseg was not told of included). Past the remembered streams a stream may be
// synchronized twice in one operation (~1.4 us when its work is done). A per-thread key names the
// calling thread's own per-thread stream, or another thread's, which no call made here can name:
// the legacy stream's synchronization covers it (measured on the H200: it waits for every blocking
// stream's work, every thread's per-thread stream included, not for non-blocking streams', and is
// permitted while a non-blocking stream captures), and so it does a foreign key's stream that was
// blocking when its arena was made (it waits for such a stream's work also once it is destroyed).
// Only a foreign key of a non-blocking stream (which may be destroyed) and a graph pool's (its
// replays may run on any stream) take the device synchronization.
void ExpandableBackend::synchronize_once(const ExpArena& arena) {
  SyncedStreams& s = synced_;
  const driver::stream_t stream = stream_to_synchronize(arena);
  if (!s.all && std::find(s.streams, s.streams + s.count, stream) == s.streams + s.count) {
    if (!is_stream_key(stream)) {
      ctx_.driver.stream_synchronize(stream);  // throws with nothing recorded: the next call tries again
      if (s.count < std::size(s.streams)) s.streams[s.count++] = stream;
    } else {
      ctx_.driver.device_synchronize();
      s.all = true;
    }
  }
  // Synchronized in this operation, after every free so far (none comes while it runs).
  arena.safe_seq = idle_seq_;
}

void ExpandableBackend::unmap_handle(ExpHandle* h) {
  unmap_mapping(h);
  try {
    ctx_.driver.release(h->handle);
  } catch (...) {
    keep_as_orphan(h, false, 0);  // still holds memory: reserved, and a device free once a retry releases it
    throw;
  }
  if (h->counted) ctx_.stats.num_device_free += 1;
  delete h;
}

// A handle whose access grant and unmap both failed (a mapped orphan) still holds its frames, which
// the segment counts as unmapped: before anything is mapped there or the reservation is freed, its
// unmap must succeed. Throws driver_error when it fails again (nothing changed).
void ExpandableBackend::unmap_orphans_in(std::uint64_t lo, std::size_t bytes) {
  for (ExpHandle& o : orphans_) {
    if (!o.mapped || o.orphan_addr >= lo + bytes || o.orphan_addr + o.bytes <= lo) continue;
    ctx_.driver.unmap(o.orphan_addr, o.bytes);
    o.mapped = false;  // still held (reserved) until retry_orphans releases it
  }
}

// Whether such an orphan overlaps [lo, lo + bytes) (map_one's retry stops there).
bool ExpandableBackend::mapped_orphan_in(std::uint64_t lo, std::size_t bytes) const noexcept {
  for (const ExpHandle& o : orphans_)
    if (o.mapped && o.orphan_addr < lo + bytes && o.orphan_addr + o.bytes > lo) return true;
  return false;
}

// Gives back the handles a failed growth mapped (idle: nothing was carved from them yet), best
// effort: one whose unmap fails stays mapped and idle, one whose release fails becomes an orphan.
void ExpandableBackend::unmap_new_handles(const std::vector<ExpHandle*>& handles) noexcept {
  for (ExpHandle* h : handles) {
    if (h == nullptr) continue;  // its mapping failed (map_range)
    try {
      unmap_handle(h);
    } catch (...) {
    }
  }
}

void ExpandableBackend::retry_orphans() {
  for (auto it = orphans_.begin(); it != orphans_.end();) {
    ExpHandle* h = &*it;
    ++it;
    try {
      if (h->mapped) {
        // Only a handle whose set_access and unmap both failed stays mapped; nothing uses its range.
        ctx_.driver.unmap(h->orphan_addr, h->bytes);
        h->mapped = false;
      }
      ctx_.driver.release(h->handle);
    } catch (...) {
      continue;
    }
    if (h->counted) ctx_.stats.num_device_free += 1;
    orphans_.erase(orphans_.iterator_to(*h));
    reserved_ -= h->bytes;
    --handles_;
    account_reserved(kLargePool, -static_cast<std::int64_t>(h->bytes));
    ctx_.stats.physical_handles.decrease(1);
    delete h;
  }
}

void ExpandableBackend::free(Block* b) noexcept {
  leave_active(*b);
  auto& seg = *static_cast<ExpSegment*>(b->segment);
  ExpArena& arena = *seg.arena;
  if (arena.retired) [[unlikely]] look_again(arena);  // it may hold memory to give back now
  const std::uint64_t lo = b->addr;
  const std::uint64_t hi = b->end();
  // An allocated block is mapped: it merges with mapped free neighbours, and the merged block takes
  // the index node of a neighbour it absorbs (no rebalancing when the rank allows).
  Block* p = b->prev;
  Block* n = b->next;
  const bool merge_prev = p && p->is_free() && p->mapped;
  const bool merge_next = n && n->is_free() && n->mapped;
  Block* keep = b;
  if (!merge_prev && !merge_next) {
    insert_free(arena, b);
  } else {
    b->status = BlockStatus::free;
    if (merge_next) {  // b absorbs n, and takes n's node
      b->size += n->size;
      b->next = n->next;
      if (n->next) n->next->prev = b;
      arena.mapped_free.replace(*n, *b);
      arena.blocks.recycle(n);
    }
    if (merge_prev) {  // p absorbs b (and n): p keeps its node
      p->size += b->size;
      p->next = b->next;
      if (b->next) b->next->prev = p;
      if (merge_next) {
        arena.mapped_free.erase(*b);
        ctx_.stats.num_free_blocks -= 1;
      }
      arena.blocks.recycle(b);
      keep = p;
    }
    arena.mapped_free.reposition(*keep);
  }
  // A free neighbour of the merged block is a hole whose run has grown (ExpArena::holes): two
  // loads and, once per hole between searches, a list push.
  if (Block* q = keep->prev; q != nullptr && q->is_free()) mark_dirty(arena, q);
  if (Block* q = keep->next; q != nullptr && q->is_free()) mark_dirty(arena, q);
  // Idle since now: the handles under the block that lie wholly inside the merged free block (all
  // but perhaps the two end ones, which may hold bytes of live neighbours).
  const ExpHandle* first = handle_at(seg, lo);
  const ExpHandle* last = handle_at(seg, hi - 1);
  cached_path_handles_ += 2;
  std::uint64_t run_lo = frame_addr(seg, first->first_frame);
  if (run_lo < keep->addr) run_lo += first->bytes;
  std::uint64_t run_hi = frame_addr(seg, last->first_frame) + last->bytes;
  if (run_hi > keep->end()) run_hi -= last->bytes;
  if (run_lo < run_hi) add_idle_run(seg, run_lo, run_hi, ++idle_seq_);
}

// The arena of the per-thread stream of a thread that has exited: no request can name that stream
// again, so its memory would stay cached for good (a pool of short-lived threads grew without
// bound, each thread's arena also holding a reservation of its own). Its idle handles are given
// back after one synchronization of the legacy stream (work the thread queued may still run, and
// its stream cannot be named from another thread; the legacy stream's synchronization waits for it:
// synchronize_once), or of the device for a released graph pool's arena, then
// its empty segments; the arena goes with its last segment. One whose live blocks hold memory stays
// on retired_, and is looked at again only once something in it may have come free
// (retired_looks_), not on every slow path. Given back, not handed to another
// stream: the next thread's first requests map their own, but no stream's cache fills with memory
// it never asked for. Runs within an operation (begin_operation), on the slow path and in
// release_cached/trim only; `keep`: the arena of the request at hand.
void ExpandableBackend::reap_retired(const ExpArena* keep) {
  const SweepForgotten sweep{*this};
  if (const std::uint64_t gen = retired_keys_generation(); gen != retired_seen_) {
    // Only the keys' arenas not retired yet (keyed_), in arenas_'s order: not the retired ones.
    for (auto it = keyed_.begin(); it != keyed_.end();) {
      ExpArena* a = &*it;
      ++it;
      ++slow_path_steps_;
      if (a == keep || !is_retired_key(a->stream)) continue;
      retired_.push_back(*a);
      keyed_.erase(keyed_.iterator_to(*a));
      a->retired = true;
      retired_looks_.push_back(*a);
    }
    retired_seen_ = gen;
  }
  // Only the arenas where something may have changed since their last look (retired_looks_): one
  // that throws stays on the list, and so does one refused (a capture underway) or skipped (`keep`).
  for (auto it = retired_looks_.begin(); it != retired_looks_.end();) {
    ExpArena* a = &*it;
    ++it;  // a forgotten one leaves the list (forget_arena)
    if (a == keep) continue;
    ++slow_path_steps_;
    bool refused = false;
    if (!give_back_arena(a, false, &refused) && !refused) retired_looks_.erase(retired_looks_.iterator_to(*a));
  }
}

// The memory of released graph pools and exited threads, now that no told capture is underway
// (the frontend's end_graph_pool and release_graph_pool). give_back_arena still asks may_unmap_in,
// so an untold capture expseg sees keeps what its synchronization would take.
void ExpandableBackend::reap_released() noexcept {
  if (ctx_.capturing) return;
  try {
    begin_operation();
    reap_retired(nullptr);
  } catch (...) {  // what is left stays on retired_: the next look gives it back
  }
}

// Gives back the idle memory and the empty segments of an arena no request will name again, and,
// once it holds nothing, the arena itself (deleted: true).
bool ExpandableBackend::give_back_arena(ExpArena* a, bool synchronized, bool* refused) {
  // The idle handles: those lying wholly inside one of its mapped free blocks.
  std::vector<ExpHandle*> idle;
  const bool had_segments = !a->segments.empty();
  slow_path_steps_ += a->segments.size();  // drop_segment's look at each
  a->mapped_free.for_each([&](Block& b) {
    ++slow_path_steps_;
    const auto& seg = *static_cast<const ExpSegment*>(b.segment);
    std::uint64_t lo = 0;
    std::uint64_t hi = 0;
    whole_handles(seg, b, lo, hi);
    for (std::uint64_t at = lo; at < hi; at += handle_at(seg, at)->bytes) idle.push_back(handle_at(seg, at));
  });
  // A capture would refuse its synchronization: later. None is needed when the caller has
  // synchronized the arena's work (release_stream), so no capture elsewhere is at stake.
  if (!idle.empty() && !synchronized && !may_unmap_in(*a)) {
    if (refused != nullptr) *refused = true;
    return false;
  }
  for (ExpHandle* h : idle) {
    synchronize_once(*a);
    unmap_handle(h);
  }
  for (std::size_t j = a->segments.size(); j-- > 0;) drop_segment(*a, a->segments[j]);
  if (!a->segments.empty()) return false;  // live blocks: looked at again later
  // Its ranges went back; kept to watch its stream's capture (given back again: nothing more).
  if (!synchronized && watches_capture(*a)) return had_segments;
  forget_arena(a);
  return true;
}

void ExpandableBackend::forget_arena(ExpArena* a) noexcept {
  if (a->forgotten) return;  // chained once: a second link would make forgotten_ a cycle
  std::erase_if(arena_index_, [&](const ArenaEntry& e) { return e.arena == a; });  // at most kScanArenas
  arena_by_stream_.erase(a->stream);
  if (a->look_hook.is_linked()) retired_looks_.erase(retired_looks_.iterator_to(*a));
  if (a->keyed_hook.is_linked()) keyed_.erase(keyed_.iterator_to(*a));
  a->forgotten = true;
  a->next_forgotten = forgotten_;
  forgotten_ = a;
}

void ExpandableBackend::sweep_forgotten() noexcept {
  while (ExpArena* a = forgotten_) {
    forgotten_ = a->next_forgotten;
    ++slow_path_steps_;
    arenas_.erase(arenas_.iterator_to(*a));
    if (a->retired_hook.is_linked()) retired_.erase(retired_.iterator_to(*a));
    destroy_epoch_event(*a);
    delete a;
  }
}

std::size_t ExpandableBackend::give_back_unused_arenas(const ExpArena* keep) {
  const SweepForgotten sweep{*this};
  std::vector<ExpArena*> unused;
  for (ExpArena& arena : arenas_) {
    ExpArena* a = &arena;
    if (a == keep || a->forgotten) continue;
    bool in_use = false;
    for (const ExpSegment* seg : a->segments)
      for (const Block* b = seg->first; b != nullptr && !in_use; b = b->next) in_use = !b->is_free();
    if (!in_use) unused.push_back(a);
  }
  std::size_t given = 0;
  for (ExpArena* a : unused) given += give_back_arena(a) ? 1 : 0;
  return given;
}

// Gives back the address range of every segment that holds nothing (one free unmapped block), and
// forgets the arenas left without a segment (a later request on their stream makes a new one). Each
// stream's segment reserves about twice the device's memory, so a process that has used a few
// hundred streams would otherwise run out of address range for the next one (PyTorch's empty_cache
// gives back an expandable segment's range the same way).
void ExpandableBackend::drop_empty_segments() {
  const SweepForgotten sweep{*this};
  for (auto it = arenas_.rbegin(); it != arenas_.rend(); ++it) {  // forgetting one keeps it linked till the sweep
    ExpArena* a = &*it;
    if (a->forgotten) continue;
    for (std::size_t j = a->segments.size(); j-- > 0;) drop_segment(*a, a->segments[j], false);  // the empty ones
    if (a->segments.empty() && !watches_capture(*a)) forget_arena(a);
  }
}

std::size_t ExpandableBackend::stream_bytes_in_use(driver::stream_t stream) const {
  std::size_t in_use = 0;
  if (const ExpArena* arena = find_arena(stream))
    for (const ExpSegment* seg : arena->segments)
      for (const Block* b = seg->first; b != nullptr; b = b->next)
        if (!b->is_free()) in_use += b->size;
  return in_use;
}

void ExpandableBackend::release_stream(driver::stream_t stream) {
  ExpArena* const arena = find_arena(stream);
  if (arena == nullptr) return;
  begin_operation();
  // By the frontend, just now; so is what stream_to_synchronize would name for it (the legacy
  // stream for a blocking CuPy stream's key, the device for a non-blocking one's): not again.
  synced_.streams[synced_.count++] = stream;
  if (const driver::stream_t target = stream_to_synchronize(*arena); target != stream) synced_.streams[synced_.count++] = target;
  const SweepForgotten sweep{*this};
  if (!give_back_arena(arena, true)) broken("release_stream: an arena with no block in use kept a segment");
}

void ExpandableBackend::release_cached() {
  if (ctx_.hooks) ctx_.hooks->synchronize_pending_frees();
  begin_operation();
  reap_retired(nullptr);
  reclaim_idle(std::numeric_limits<std::size_t>::max(), Exclusion{});
  retry_orphans();
  drop_empty_segments();
  free_spare_range();
  va_hint_ = va_bytes_;  // ranges went back: new segments try the configured size again
}

// Gives back just the idle memory above the new limit, in whole handles (core::pick_give_back:
// the least memory beyond the excess; the same rule as split_merge's with its segments).
void ExpandableBackend::on_limit_changed() {
  const std::size_t limit = ctx_.effective_limit();
  begin_operation();
  reap_retired(nullptr);
  // A handle whose release failed earlier counts in reserved_ and holds its memory for nothing:
  // given back first, before any idle handle.
  if (!orphans_.empty()) retry_orphans();
  if (reserved_ <= limit) return;
  // Cross-stream frees still waiting for their events hold memory the limit may need back: complete
  // them first, as split_merge does (their blocks become idle here).
  if (ctx_.hooks) ctx_.hooks->synchronize_pending_frees();
  std::vector<ExpHandle*> idle;
  for_each_idle([&](ExpHandle& h) { idle.push_back(&h); });
  std::vector<std::size_t> sizes(idle.size());
  for (std::size_t i = 0; i < idle.size(); ++i) sizes[i] = idle[i]->bytes;
  for (std::size_t i : core::pick_give_back(sizes, reserved_ - limit)) {
    synchronize_once(*idle[i]->seg->arena);  // work queued there may still use the memory
    unmap_handle(idle[i]);
  }
}

void ExpandableBackend::on_peer_added(int) {
  // One cuMemSetAccess per mapped run grants the new peer (the driver's access list has it now).
  for (ExpArena& arena : arenas_) {
    for (ExpSegment* seg : arena.segments) {
      for (std::size_t f = 0; f < seg->frames.size();) {
        if (seg->frames[f] == nullptr) {
          ++f;
          continue;
        }
        std::size_t e = f;
        while (e < seg->frames.size() && seg->frames[e] != nullptr) e = seg->frames[e]->first_frame + seg->frames[e]->nframes;
        ctx_.driver.set_access(frame_addr(*seg, f), (e - f) * frame_);
        f = e;
      }
    }
  }
}

ExportPlan ExpandableBackend::export_plan(const Block& block) const {
  // A live block lies on mapped frames only, so the handles under it are mapped back to back; the
  // importer maps the same handles, in the same order, and finds the block at the same offset.
  const auto& seg = *static_cast<const ExpSegment*>(block.segment);
  ExportPlan plan;
  plan.kind = ExportPlan::Kind::physical_handles;
  const std::size_t first = frame_of(seg, block.addr);
  const std::size_t last = frame_of(seg, block.end() - 1);
  for (std::size_t f = first; f <= last;) {
    const ExpHandle* h = seg.frames[f];
    if (h == nullptr) broken("block at " + hex(block.addr) + " lies on an unmapped frame");
    if (plan.pieces.empty()) plan.base = frame_addr(seg, h->first_frame);
    plan.pieces.push_back({h->handle, h->bytes});
    plan.bytes += h->bytes;
    f = h->first_frame + h->nframes;
  }
  return plan;
}

void ExpandableBackend::validate() const {
  std::int64_t allocated[kStatPools] = {};
  std::int64_t active[kStatPools] = {};
  std::int64_t requested[kStatPools] = {};
  std::size_t mapped_free_blocks = 0;
  std::size_t unmapped_blocks = 0;
  std::size_t reserved = 0;
  std::size_t handles = 0;
  std::size_t idle = 0;
  std::size_t segments = 0;
  std::map<const ExpSegment*, std::vector<char>> idle_of;  // per segment, by first frame: 1 idle, 2 seen in a run
  // Arenas: each found by its stream, none forgotten, retired iff on retired_ (once).
  if (forgotten_ != nullptr) broken("forgotten arenas outlived the call that forgot them");
  if (deferred_idle_ != 0) broken("deferred_idle_ outlived the growth that set it");
  if (arena_by_stream_.size() != arenas_.size()) broken("arenas and the stream table disagree");
  std::set<const ExpArena*> on_retired;
  for (const ExpArena& a : retired_) on_retired.insert(&a);
  if (on_retired.size() != retired_.size()) broken("an arena is on retired_ twice");
  std::size_t retired_arenas = 0;
  std::size_t keyed_arenas = 0;
  for (const ExpArena* arena : arena_pointers()) {
    if (arena->forgotten) broken("a forgotten arena is still among the arenas");
    if (arena->retired != on_retired.contains(arena)) broken("an arena's retired flag disagrees with retired_");
    retired_arenas += arena->retired;
    if (find_arena(arena->stream) != arena) broken("an arena is not found by its stream");
    if (arena->look_hook.is_linked() && !arena->retired) broken("an arena that is not retired is on retired_looks_");
    if (arena->keyed_hook.is_linked() != (is_per_thread_key(arena->stream) && !arena->retired))
      broken("keyed_ does not hold exactly the keys' arenas that are not retired");
    keyed_arenas += arena->keyed_hook.is_linked() ? 1 : 0;
    const bool looked = arena->retired && !arena->look_hook.is_linked();  // nothing to give back (retired_looks_)
    const std::size_t idle_before = idle;
    for (const ExpSegment* seg : arena->segments) {
      ++segments;
      if (looked && seg->mapped_bytes == 0 && seg->first != nullptr && seg->first->next == nullptr && seg->first->is_free())
        broken("a retired arena off retired_looks_ keeps an empty segment");
      if (seg->arena != arena) broken("segment points to another arena");
      if (seg->frames.size() * frame_ > seg->va_bytes) broken("frame table is larger than the segment");
      if (seg->va_bytes % frame_ != 0 || (seg->base % frame_) != 0) broken("segment is not a whole number of frames");
      // Handles: frames -> handle consistency; live bytes and idleness recomputed below.
      std::size_t mapped = 0;
      std::vector<std::size_t> live(seg->frames.size(), 0);  // live bytes per handle, by first frame
      std::vector<char> in_free(seg->frames.size(), 0);      // lies wholly inside a mapped free block
      // (It may be longer than the table: grown first, so that the table never outruns it.)
      if (seg->mapped_words.size() < (seg->frames.size() + 63) / 64) broken("the mapped-frame bitmap is shorter than the frame table");
      for (std::size_t w = 0; w < seg->mapped_words.size(); ++w) {
        std::uint64_t want = 0;
        for (std::size_t f = w * 64; f < std::min(seg->frames.size(), w * 64 + 64); ++f)  // none set past the table
          if (seg->frames[f] != nullptr) want |= std::uint64_t{1} << (f % 64);
        if (seg->mapped_words[w] != want) broken("the mapped-frame bitmap disagrees with the frame table at word " + std::to_string(w));
      }
      for (std::size_t f = 0; f < seg->frames.size();) {
        const ExpHandle* h = seg->frames[f];
        if (h == nullptr) {
          ++f;
          continue;
        }
        if (h->first_frame != f || h->seg != seg || !h->mapped || h->bytes != h->nframes * frame_)
          broken("handle at frame " + std::to_string(f) + " does not describe its own mapping");
        for (std::size_t g = f; g < f + h->nframes; ++g)
          if (seg->frames[g] != h) broken("frames of one handle point elsewhere");
        mapped += h->bytes;
        reserved += h->bytes;
        ++handles;

        if (h->hook.is_linked()) broken("a mapped handle is on the orphan list");
        if ((f + h->nframes) * frame_ > seg->high_water) broken("high-water mark below a mapping");
        f += h->nframes;
      }
      if (mapped != seg->mapped_bytes) broken("segment mapped_bytes is wrong");
      // Blocks tile the segment.
      if (seg->first == nullptr || seg->first->prev != nullptr) broken("segment has no first block");
      std::uint64_t expect = seg->base;
      const Block* prev = nullptr;
      for (const Block* b = seg->first; b; prev = b, b = b->next) {
        if (b->addr != expect) broken("blocks do not tile segment " + hex(seg->base) + " at " + hex(expect));
        if (b->prev != prev) broken("prev link mismatch at " + hex(b->addr));
        if (b->segment != seg || b->stream != arena->stream) broken("block belongs to another segment or stream");
        if (b->size == 0 || b->size % kMinBlockSize) broken("block size is not a multiple of 512");
        expect = b->end();
        const std::size_t f0 = frame_of(*seg, b->addr);
        const std::size_t f1 = frame_of(*seg, b->end() - 1);
        if (b->is_free() && b->mapped) {
          for (std::size_t f = f0; f <= f1;) {
            const ExpHandle* h = seg->frames[f];
            const std::uint64_t lo = frame_addr(*seg, h->first_frame);
            if (lo >= b->addr && lo + h->bytes <= b->end()) in_free[h->first_frame] = 1;
            f = h->first_frame + h->nframes;
          }
        }
        if (b->is_free()) {
          if (!b->free_hook.is_linked()) broken("free block not in an index");
          if (prev && prev->is_free() && prev->mapped == b->mapped) broken("adjacent free blocks of one state not merged at " + hex(b->addr));
          if (b->mapped) ++mapped_free_blocks;
          else ++unmapped_blocks;
        } else if (b->free_hook.is_linked()) {
          broken("allocated block is in a free index");
        }
        if (b->mapped) {
          for (std::size_t f = f0; f <= f1; ++f)
            if (frame_handle(*seg, f) == nullptr) broken("block at " + hex(b->addr) + " lies on an unmapped frame");
        } else {
          if ((b->addr - seg->base) % frame_ != 0 || (b->end() - seg->base) % frame_ != 0)
            broken("unmapped block at " + hex(b->addr) + " is not frame aligned");
          for (std::size_t f = f0; f <= f1; ++f)
            if (frame_handle(*seg, f) != nullptr) broken("unmapped block at " + hex(b->addr) + " covers a mapped frame");
        }
        if (!b->is_free()) {
          if (!b->mapped) broken("allocated block is not mapped");
          if (b->requested > b->size) broken("requested size larger than block");
          // The stats' pool index: <= kSmallSize counts in small_pool (carve sets it).
          if (b->pool != pool_of_size(b->size)) broken("allocated block at " + hex(b->addr) + " counts in the wrong pool");
          active[b->pool] += static_cast<std::int64_t>(b->size);
          requested[b->pool] += static_cast<std::int64_t>(b->requested);  // pending blocks too, as PyTorch counts them
          if (b->status == BlockStatus::allocated) allocated[b->pool] += static_cast<std::int64_t>(b->size);
          for (std::size_t f = f0; f <= f1;) {
            const ExpHandle* h = seg->frames[f];
            const std::uint64_t lo = frame_addr(*seg, h->first_frame);
            live[h->first_frame] += std::min(lo + h->bytes, b->end()) - std::max(lo, b->addr);
            f = h->first_frame + h->nframes;
          }
        }
      }
      if (expect != seg->base + seg->va_bytes) broken("blocks do not cover segment " + hex(seg->base));
      // Holes: each indexed or dirty; a run without a dirty hole has run_bytes covering it in each.
      for (const Block* r = seg->first; r != nullptr;) {
        if (!r->is_free()) {
          r = r->next;
          continue;
        }
        const Block* end = r;
        bool dirty = false;
        while (end != nullptr && end->is_free()) {
          if (!end->mapped && !end->run_hook.is_linked() && !end->dirty_hook.is_linked()) broken("hole at " + hex(end->addr) + " is neither indexed nor dirty");
          dirty = dirty || end->dirty_hook.is_linked();
          end = end->next;
        }
        const std::uint64_t bytes = (end ? end->addr : seg->base + seg->va_bytes) - r->addr;
        for (; r != end; r = r->next) {
          if (r->mapped && (r->run_hook.is_linked() || r->dirty_hook.is_linked())) broken("a mapped block is among the holes");
          if (!r->mapped && !dirty && (!r->run_hook.is_linked() || r->run_bytes < bytes))
            broken("hole at " + hex(r->addr) + " has run_bytes short of its run and no dirty hole there");
        }
      }
      std::vector<char>& idle_here = idle_of[seg];
      idle_here.assign(seg->frames.size(), 0);
      for (std::size_t f = 0; f < seg->frames.size();) {
        const ExpHandle* h = seg->frames[f];
        if (h == nullptr) {
          ++f;
          continue;
        }
        // What the idle runs rely on: a handle without live bytes lies inside one mapped free block.
        if ((live[f] == 0) != (in_free[f] != 0)) broken("handle at frame " + std::to_string(f) + " is idle but not inside one free block");
        if (live[f] == 0) {
          ++idle;
          idle_here[f] = 1;
        }
        f += h->nframes;
      }
    }
    if (looked && idle != idle_before) broken("a retired arena off retired_looks_ keeps an idle handle");
  }
  if (retired_arenas != retired_.size()) broken("retired_ holds an arena that is not one of the arenas");
  for (const ExpArena& a : retired_looks_)
    if (!on_retired.contains(&a)) broken("retired_looks_ holds an arena not on retired_");
  // keyed_ in arenas_'s order (reap_retired retires in it, as the walk of arenas_ did), and only
  // the arenas counted above.
  auto keyed_at = arenas_.begin();
  std::size_t keyed_listed = 0;
  for (const ExpArena& a : keyed_) {
    while (keyed_at != arenas_.end() && &*keyed_at != &a) ++keyed_at;
    if (keyed_at == arenas_.end()) broken("keyed_ holds an arena out of arenas_'s order, or none of them");
    ++keyed_listed;
  }
  if (keyed_listed != keyed_arenas) broken("keyed_ holds an arena twice");
  std::size_t indexed_mapped = 0;
  std::size_t indexed_unmapped = 0;
  for (const ExpArena* arena : arena_pointers()) {
    indexed_mapped += arena->mapped_free.size();
    indexed_unmapped += arena->unmapped.size();
    // In order: a key changed in place (carve, free) and not repositioned would break best fit.
    if (const char* why = arena->mapped_free.check()) broken(why);
    arena->mapped_free.for_each([&](const Block& b) {
      if (!b.mapped || b.stream != arena->stream || !b.is_free()) broken("mapped index holds a foreign block");
    });
    const Block* prev = nullptr;
    for (const Block& b : arena->unmapped) {
      if (b.mapped) broken("unmapped index holds a mapped block");
      if (!b.is_free() || static_cast<const ExpSegment*>(b.segment)->arena != arena) broken("unmapped index holds a block that is not a hole of the arena");
      if (prev && prev->addr >= b.addr) broken("unmapped index out of address order at " + hex(b.addr));
      prev = &b;
    }
    std::size_t holes = 0;
    const Block* prev_hole = nullptr;
    for (const Block& b : arena->holes) {
      if (b.mapped || !b.is_free() || static_cast<const ExpSegment*>(b.segment)->arena != arena) broken("holes index holds a block that is not a hole of the arena");
      // By (run_bytes, address): a key changed in place and not repositioned would hide a run.
      if (prev_hole != nullptr && !RunBytesOrder{}(*prev_hole, b)) broken("holes index out of (run_bytes, address) order at " + hex(b.addr));
      prev_hole = &b;
      ++holes;
    }
    for (const Block& b : arena->dirty_holes) {
      if (b.mapped || !b.is_free() || static_cast<const ExpSegment*>(b.segment)->arena != arena) broken("dirty holes hold a block that is not a hole of the arena");
      holes += !b.run_hook.is_linked();
    }
    if (holes != arena->unmapped.size()) broken("holes index and dirty holes do not hold every hole once");
  }
  if (indexed_mapped != mapped_free_blocks || indexed_unmapped != unmapped_blocks) broken("free indexes hold blocks not in any segment");
  // The idle runs partition the idle handles, and the handles at their ends point to them.
  std::size_t in_runs = 0;
  for (const IdleRun& r : idle_runs_) {
    auto it = idle_of.find(r.seg);
    if (it == idle_of.end() || r.lo >= r.hi || r.lo < r.seg->base || r.hi > r.seg->base + r.seg->frames.size() * frame_)
      broken("an idle run lies outside the mapped frames of its segment");
    for (std::uint64_t a = r.lo; a < r.hi;) {
      const ExpHandle* h = frame_handle(*r.seg, frame_of(*r.seg, a));
      if (h == nullptr || frame_addr(*r.seg, h->first_frame) != a || a + h->bytes > r.hi) broken("idle run at " + hex(r.lo) + " does not hold whole handles");
      if (it->second[h->first_frame] != 1) broken("idle run at " + hex(r.lo) + " holds a busy handle, or one twice, at " + hex(a));
      it->second[h->first_frame] = 2;
      ++in_runs;
      a += h->bytes;
    }
    if (handle_at(*r.seg, r.lo)->run_first != &r || handle_at(*r.seg, r.hi - 1)->run_last != &r)
      broken("the end handles of the idle run at " + hex(r.lo) + " do not point to it");
    if (r.seq > idle_seq_) broken("the idle run at " + hex(r.lo) + " became idle after the last free");
  }
  // What is known complete, and the epoch events, count frees that happened.
  for (const ExpArena* arena : arena_pointers()) {
    if (arena->safe_seq > idle_seq_ || arena->epoch_seq > idle_seq_) broken("an arena's safe_seq or epoch_seq is past the last free");
    if (arena->epoch_pending && arena->epoch_event == nullptr) broken("an arena waits for an epoch event it does not hold");
  }
  if (in_runs != idle) broken("idle handles missing from the idle runs");
  // IdleRun objects: each in a run or spare, at least one per handle (a free takes one without a
  // check: map_handle makes sure of it).
  std::size_t run_objects = static_cast<std::size_t>(std::distance(idle_runs_.begin(), idle_runs_.end()));
  for (const IdleRun* r = spare_runs_; r != nullptr; r = r->next_spare) ++run_objects;
  if (run_objects != run_objects_) broken("IdleRun objects in runs and spare (" + std::to_string(run_objects) + ") are not run_objects_");
  if (run_objects_ < handles_) broken("fewer IdleRun objects than handles: a free could find none");
  // The cached path's scan of streams: at most kScanArenas entries, each naming its stream's arena.
  if (arena_index_.size() > kScanArenas) broken("arena_index_ holds more than kScanArenas entries");
  for (const ArenaEntry& e : arena_index_)
    if (find_arena(e.stream) != e.arena || e.arena->forgotten) broken("arena_index_ names an arena that is not its stream's");
  // Each arena's list holds exactly its runs, in the backend's order.
  for (const ExpArena* arena : arena_pointers()) {
    auto own = arena->idle_runs.begin();
    for (const IdleRun& r : idle_runs_) {
      if (r.seg->arena != arena) continue;
      if (own == arena->idle_runs.end() || &*own != &r) broken("an arena's idle runs differ from its runs in the backend's order");
      ++own;
    }
    if (own != arena->idle_runs.end()) broken("an arena's idle runs hold a run of another arena, or one no more idle");
  }
  for (const ExpHandle& h : orphans_) {
    reserved += h.bytes;
    ++handles;
    if (h.seg != nullptr) broken("an orphan still names a segment");
    if (!h.mapped) continue;
    // A mapped orphan lies in a reservation that is still held, and nothing is mapped over it.
    bool in_reservation = false;
    for (const ExpArena* arena : arena_pointers())
      for (const ExpSegment* seg : arena->segments) {
        if (h.orphan_addr < seg->base || h.orphan_addr + h.bytes > seg->base + seg->va_bytes) continue;
        in_reservation = true;
        for (std::size_t f = frame_of(*seg, h.orphan_addr); f < frame_of(*seg, h.orphan_addr + h.bytes); ++f)
          if (frame_handle(*seg, f) != nullptr) broken("a handle is mapped over a mapped orphan at " + hex(h.orphan_addr));
      }
    if (!in_reservation) broken("a mapped orphan at " + hex(h.orphan_addr) + " lies outside every reservation");
  }
  if (reserved != reserved_ || handles != handles_) broken("reserved bytes or handle count is wrong");
  const Stats& s = ctx_.stats;
  if (s.reserved_bytes[kAllPools].current != static_cast<std::int64_t>(reserved_)) broken("reserved_bytes stat is wrong");
  if (s.physical_handles.current != static_cast<std::int64_t>(handles_)) broken("physical_handles stat is wrong");
  if (s.segment[kAllPools].current != static_cast<std::int64_t>(segments)) broken("segment stat is wrong");
  std::size_t va_reserved = 0;
  const std::uint64_t spare_lo = spare_range_.base;
  const std::uint64_t spare_hi = spare_range_.base + spare_range_.bytes;
  for (const ExpArena* arena : arena_pointers())
    for (const ExpSegment* seg : arena->segments) {
      va_reserved += seg->va_bytes;
      if (seg->base < spare_hi && seg->base + seg->va_bytes > spare_lo) broken("a segment overlaps the spare range");
    }
  if (va_reserved + spare_range_.bytes != va_reserved_) broken("va_reserved_ is not the address range of the segments and the spare range");
  for (const ExpHandle& h : orphans_)
    if (h.mapped && h.orphan_addr < spare_hi && h.orphan_addr + h.bytes > spare_lo) broken("a mapped orphan lies in the spare range");
  if (s.num_free_blocks != static_cast<std::int64_t>(mapped_free_blocks)) broken("num_free_blocks stat is wrong");
  for (int pool : {kSmallPool, kLargePool}) {
    allocated[kAllPools] += allocated[pool];
    active[kAllPools] += active[pool];
    requested[kAllPools] += requested[pool];
  }
  for (int pool = 0; pool < kStatPools; ++pool) {
    const std::string where = std::string(" (") + stat_pool_name(pool) + ")";
    if (s.allocated_bytes[pool].current != allocated[pool]) broken("allocated_bytes stat is wrong" + where);
    if (s.active_bytes[pool].current != active[pool]) broken("active_bytes stat is wrong" + where);
    if (s.requested_bytes[pool].current != requested[pool]) broken("requested_bytes stat is wrong" + where);
  }
  if (allocated[kAllPools] > static_cast<std::int64_t>(reserved_)) broken("allocated > reserved");
}

void ExpandableBackend::snapshot(std::vector<SegmentInfo>& out) const {
  for (const ExpArena* arena : arena_pointers()) {
    for (const ExpSegment* seg : arena->segments) {
      SegmentInfo info;
      info.address = seg->base;
      info.size = seg->high_water;
      info.mapped_bytes = seg->mapped_bytes;
      info.stream = shown_stream(arena->stream);
      const std::uint64_t end = seg->base + seg->high_water;
      for (const Block* b = seg->first; b && b->addr < end; b = b->next) {
        BlockInfo bi;
        bi.address = b->addr;
        bi.size = std::min(b->end(), end) - b->addr;
        bi.requested = b->is_free() ? 0 : b->requested;
        bi.state = b->status == BlockStatus::allocated      ? BlockState::allocated
                   : b->status == BlockStatus::pending_free ? BlockState::pending_free
                   : b->mapped                              ? BlockState::free_mapped
                                                            : BlockState::free_unmapped;
        bi.stream = info.stream;
        info.blocks.push_back(bi);
      }
      for (std::size_t f = 0; f < seg->frames.size();) {
        if (seg->frames[f] == nullptr) {
          ++f;
          continue;
        }
        std::size_t e = f;
        while (e < seg->frames.size() && seg->frames[e] != nullptr) {
          ++info.physical_handles;
          e = seg->frames[e]->first_frame + seg->frames[e]->nframes;
        }
        info.mapped_ranges.push_back({frame_addr(*seg, f), (e - f) * frame_});
        f = e;
      }
      out.push_back(std::move(info));
    }
  }
}

FreeSummary ExpandableBackend::free_summary(std::size_t request, driver::stream_t stream) const {
  FreeSummary s;
  s.request_footprint = round_up(request, frame_);
  for (const ExpArena* arena : arena_pointers()) {
    for (const ExpSegment* seg : arena->segments) {
      // Blocks are address-ordered: a frame is shared only by consecutive live blocks, so the live
      // bytes of the frame being counted add up until a block starts past it.
      std::size_t open_frame = SIZE_MAX;  // the last frame counted, still open to more live bytes
      std::size_t open_used = 0;
      auto close_frame = [&] {
        if (open_frame != SIZE_MAX && open_used < frame_) {
          s.live_page_slack += frame_ - open_used;
          ++s.live_partial_pages;
        }
      };
      for (const Block* b = seg->first; b; b = b->next) {
        if (b->is_free()) continue;
        const std::size_t f0 = frame_of(*seg, b->addr);
        const std::size_t f1 = frame_of(*seg, b->end() - 1);
        if (f0 != open_frame) {
          close_frame();
          s.live_footprint += frame_;
          open_frame = f0;
          open_used = 0;
        }
        if (f0 == f1) {
          open_used += b->size;
          continue;
        }
        open_used += frame_addr(*seg, f0 + 1) - b->addr;  // the block runs to f0's end
        close_frame();
        s.live_footprint += (f1 - f0) * frame_;  // frames f0+1 .. f1; those before f1 are whole
        open_frame = f1;
        open_used = b->end() - frame_addr(*seg, f1);
      }
      close_frame();
    }
  }
  // A mapped free block's bytes but those in frames a live neighbour shares: those are counted in
  // live_footprint (as page slack) already.
  auto outside_live_frames = [&](const Block& b) -> std::size_t {
    const auto& seg = *static_cast<const ExpSegment*>(b.segment);
    const std::size_t f0 = frame_of(seg, b.addr);
    const std::size_t f1 = frame_of(seg, b.end() - 1);
    const bool head = b.addr != frame_addr(seg, f0) && b.prev != nullptr && !b.prev->is_free();
    const bool tail = b.end() != frame_addr(seg, f1 + 1) && b.next != nullptr && !b.next->is_free();
    if (f0 == f1) return head || tail ? 0 : b.size;
    return b.size - (head ? frame_addr(seg, f0 + 1) - b.addr : 0) - (tail ? b.end() - frame_addr(seg, f1) : 0);
  };
  for (const ExpArena* arena : arena_pointers()) {
    const bool pool = is_graph_pool_key(arena->stream) && is_live_graph_pool_key(arena->stream);
    // Idle memory of a stream that captures cannot be unmapped: its synchronization would break the capture.
    const bool kept = arena->stream != stream && !arena->mapped_free.empty() && stream_captures(ctx_, arena->stream);
    arena->mapped_free.for_each([&](const Block& b) {
      s.free_blocks += 1;
      s.largest_free_block = std::max(s.largest_free_block, b.size);
      if (request != 0 && arena->stream == stream) s.largest_usable_block = std::max(s.largest_usable_block, b.size);
      if (pool && (arena->stream != stream || b.size < request)) {  // the own pool's larger blocks may serve it
        s.graph_pool_bytes += outside_live_frames(b);
        s.graph_pool_free_bytes += b.size;
        s.graph_pool_free_blocks += 1;
        s.largest_graph_pool_block = std::max(s.largest_graph_pool_block, b.size);
      } else {
        s.largest_free_outside_pools = std::max(s.largest_free_outside_pools, b.size);
      }
      if (kept) s.capture_kept_bytes += outside_live_frames(b);
      // The whole frames of b under handles that reach past it (a handle wholly inside b is idle).
      const auto& seg = *static_cast<const ExpSegment*>(b.segment);
      const std::uint64_t lo = round_up(b.addr - seg.base, frame_) + seg.base;
      const std::uint64_t hi = (b.end() - seg.base) / frame_ * frame_ + seg.base;
      for (std::uint64_t a = lo; a < hi;) {
        const ExpHandle* h = handle_at(seg, a);
        const std::uint64_t hlo = frame_addr(seg, h->first_frame);
        const std::uint64_t hhi = hlo + h->bytes;
        if (hlo < b.addr || hhi > b.end()) s.handle_pinned_bytes += std::min(hhi, hi) - a;
        a = std::min(hhi, hi);
      }
    });
  }
  for_each_idle([&](const ExpHandle& h) { s.releasable_bytes += h.bytes; });
  return s;
}

bool ExpandableBackend::contains(std::uint64_t addr) const noexcept {
  for (const ExpArena* arena : arena_pointers())
    for (const ExpSegment* seg : arena->segments)
      if (addr >= seg->base && addr < seg->base + seg->va_bytes) return true;
  return false;
}

std::unique_ptr<Backend> make_expandable(Context& ctx) { return std::make_unique<ExpandableBackend>(ctx); }

}  // namespace expseg::backends
