#include "backends/split_merge/split_merge.hpp"

#include <algorithm>
#include <bit>
#include <limits>
#include <memory>
#include <sstream>
#include <utility>

#include "core/give_back.hpp"
#include "core/try_twice.hpp"
#include "expseg/errors.hpp"

namespace expseg::backends {

using core::Block;
using core::BlockStatus;

namespace {

[[noreturn]] void broken(const std::string& what) { throw expseg::error("split_merge invariant broken: " + what); }

}  // namespace

SplitMergeBackend::SplitMergeBackend(Context& ctx) : Backend(ctx) {
  has_divisions_ = has_roundup_power2_divisions(ctx_.config) && !cupy();
  small_.is_small = true;
  small_.stat_pool = kSmallPool;
  large_.stat_pool = kLargePool;
}

SplitMergeBackend::~SplitMergeBackend() {
  thread_looks_.clear();  // before the segments they link go
  pool_looks_.clear();
  small_.blocks.clear();
  large_.blocks.clear();
  by_stream_.clear();  // unlinks the segments it lists while they still exist
  // During a capture expseg was told of (the frontend has asked that it still runs), the graph being
  // captured writes its pool's memory when launched, and cuMemFree does not wait for work it has
  // not seen yet: every segment stays allocated (leaked until process exit), as expandable leaves
  // its memory mapped then.
  const bool free_safe = !ctx_.capturing;
  while (!segments_.empty()) {
    SmSegment& seg = segments_.front();
    segments_.pop_front();
    if (free_safe) core::try_twice([&] { ctx_.driver.mem_free(seg.base); });
    delete &seg;
  }
}

std::size_t SplitMergeBackend::round_size(std::size_t size) const noexcept {
  if (size < kMinBlockSize) return kMinBlockSize;
  if (size > std::numeric_limits<std::size_t>::max() / 2) return size;  // absurd: the caller reports OOM
  if (has_divisions_)
    if (const std::size_t rounded = roundup_power2_divisions_size(ctx_.config, size, kMinBlockSize)) return rounded;
  return kMinBlockSize * ((size + kMinBlockSize - 1) / kMinBlockSize);
}

SplitMergeBackend::Pool& SplitMergeBackend::pool_for(std::size_t size) noexcept {
  if (cupy()) return large_;
  return size <= kSmallSize ? small_ : large_;
}

std::size_t SplitMergeBackend::allocation_size(std::size_t size) const noexcept {
  if (cupy()) return size;
  if (size <= kSmallSize) return kSmallBuffer;
  if (size < kMinLargeAlloc) return ctx_.config.large_segment_size;  // kLargeBuffer, 20 MiB, unless configured
  return kRoundLarge * ((size + kRoundLarge - 1) / kRoundLarge);
}

bool SplitMergeBackend::should_split(const Block& block, std::size_t size) const noexcept {
  const std::size_t remaining = block.size - size;
  if (cupy()) return remaining > 0;
  if (pool_of(block).is_small) return remaining >= kMinBlockSize;
  return size < ctx_.config.max_split_size && remaining > kSmallSize;
}

void SplitMergeBackend::insert_free(const Pool& pool, core::SizeIndex& index, Block* block) noexcept {
  block->gc_base = pool.get_free_blocks_calls;
  index.insert(*block);
}

// PyTorch collects garbage only under a memory fraction below 1 (setMemoryFraction leaves
// allowed_memory_maximum unset at 1.0): a limit of all the device's memory is none.
bool SplitMergeBackend::gc_enabled() const noexcept {
  return ctx_.limit != 0 && ctx_.limit < ctx_.device_total && ctx_.config.garbage_collection_threshold > 0.0;
}

bool SplitMergeBackend::get_free_block(Params& p) {
  Pool& pool = *p.pool;
  // The age clock of the blocks garbage collection looks at: PyTorch counts each private pool's
  // requests on that pool's own clock, which no collection reads.
  if (gc_enabled() && !is_graph_pool_key(p.stream)) ++pool.get_free_blocks_calls;
  Block* b = p.index->lower_bound(p.size);
  if (b == nullptr) return false;
  if (!cupy()) {
    const std::size_t max_split = ctx_.config.max_split_size;
    // Do not hand an oversize block to a request below the oversize class...
    if (p.size < max_split && b->size >= max_split) return false;
    // ...and round oversize requests up by at most max_non_split_rounding.
    // (b->size >= p.size here: the difference cannot wrap where PyTorch's sum could, at a huge
    // max_non_split_rounding_mb.)
    if (p.size >= max_split && b->size - p.size >= ctx_.config.max_non_split_rounding) return false;
  }
  p.block = b;  // still in the index: alloc_found_block reuses its node when it can
  return true;
}

bool SplitMergeBackend::alloc_block(Params& p, bool is_retry) {
  Stats& stats = ctx_.stats;
  if (is_retry) stats.num_alloc_retries += 1;
  const std::size_t size = p.alloc_size;
  if (ctx_.limit != 0 && (size > ctx_.limit || total_allocated_memory_ > ctx_.limit - size)) return false;
  auto owned = std::make_unique<SmSegment>();  // before the driver call: a bad_alloc leaks nothing
  const auto [mine, fresh] = by_stream_.try_emplace(p.stream);  // so is the stream's segment list
  driver::dev_ptr ptr = 0;
  try {
    ptr = ctx_.driver.mem_alloc(size);
  } catch (const driver_error& e) {
    if (fresh) by_stream_.erase(mine);
    if (!e.is_out_of_memory()) throw;
    ctx_.refused = Context::Refusal::memory;
    return false;
  } catch (...) {
    if (fresh) by_stream_.erase(mine);
    throw;
  }
  SmSegment* seg = owned.release();
  Block* b = blocks_.make();  // cannot throw: allocate() reserved two blocks
  seg->base = ptr;
  seg->size = size;
  seg->stream = p.stream;
  seg->pool = p.pool->stat_pool;
  // A late request on an exited thread's key (a thread_local destructor): its segment is retired
  // too. It holds the block handed out now: no look list until it comes wholly free.
  seg->retired = is_per_thread_key(p.stream) && retired_.contains(p.stream);
  seg->index = p.index;
  seg->first = b;
  segments_.push_back(*seg);
  mine->second.push_back(*seg);
  b->addr = ptr;
  b->size = size;
  b->stream = p.stream;
  b->segment = seg;
  b->pool = p.pool->stat_pool;
  total_allocated_memory_ += size;
  account_segment(seg->pool, 1);
  account_reserved(seg->pool, static_cast<std::int64_t>(size));
  stats.physical_handles.increase(1);
  if (size >= ctx_.config.max_split_size) stats.oversize_segments.increase(1);
  stats.num_device_alloc += 1;
  if (ctx_.hooks) ctx_.hooks->on_map(ptr, size, p.stream);
  p.block = b;
  return true;
}

void SplitMergeBackend::release_block(Block* block) {
  auto* seg = static_cast<SmSegment*>(block->segment);
  ctx_.driver.mem_free(seg->base);  // throws before any state changes
  index_of(*block).erase(*block);
  ctx_.stats.num_free_blocks -= 1;
  total_allocated_memory_ -= seg->size;
  account_segment(seg->pool, -1);
  account_reserved(seg->pool, -static_cast<std::int64_t>(seg->size));
  ctx_.stats.physical_handles.decrease(1);
  if (seg->size >= ctx_.config.max_split_size) ctx_.stats.oversize_segments.decrease(1);
  ctx_.stats.num_device_free += 1;
  if (ctx_.hooks) ctx_.hooks->on_unmap(seg->base, seg->size, seg->stream);
  segments_.erase(segments_.iterator_to(*seg));
  if (seg->look_hook.is_linked()) {
    LookList& looks = looks_of(seg->stream);
    looks.erase(looks.iterator_to(*seg));
  }
  const auto mine = by_stream_.find(seg->stream);
  mine->second.erase(mine->second.iterator_to(*seg));
  if (mine->second.empty()) {
    by_stream_.erase(mine);
    if (seg->retired) retired_emptied_ = true;  // its indexes go at the next reap_retired
  }
  delete seg;
  blocks_.recycle(block);
}

bool SplitMergeBackend::release_available_cached_blocks(const Params& p) {
  const std::size_t max_split = ctx_.config.max_split_size;
  if (cupy() || max_split == SIZE_MAX) return false;
  core::SizeIndex& index = *p.index;
  const std::size_t key_size = p.size < max_split ? max_split : p.size;
  // Oversize blocks are whole segments, except where restore_graph_pool_block split one
  // (allocate_at): those, as any split or otherwise unreleasable block, are passed over (PyTorch
  // frees such a block's whole segment, live neighbours included).
  Block* b = index.lower_bound(key_size);
  while (b != nullptr && !releasable(*b)) b = index.next(*b);
  if (b == nullptr) {
    // No single block is large enough: free oversize blocks of this stream, largest first.
    std::size_t released = 0;
    for (Block* cur = index.last(); cur != nullptr && released < key_size && cur->size >= max_split;) {
      Block* below = index.prev(*cur);
      if (releasable(*cur)) {
        const std::size_t size = cur->size;
        release_block(cur);
        released += size;
      }
      cur = below;
    }
    if (released < key_size) return false;
  } else {
    release_block(b);
  }
  return true;
}

bool SplitMergeBackend::release_cached_blocks(const core::SizeIndex* keep) {
  if (ctx_.hooks) ctx_.hooks->synchronize_pending_frees();
  for (Pool* pool : {&large_, &small_}) {
    pool->blocks.for_each_block([&](Block& b) {
      if (releasable(b)) release_block(&b);
    });
  }
  prune_indexes(keep);
  return true;
}

// Forgets the indexes of streams that have no segment left (a released graph pool's once its
// memory is given back), but `keep`. Such a stream's next request makes a new one.
void SplitMergeBackend::prune_indexes(const core::SizeIndex* keep) noexcept {
  for (Pool* pool : {&large_, &small_}) {
    Pool& other = pool == &large_ ? small_ : large_;
    pool->blocks.erase_if([&](const core::SizeIndex& index, driver::stream_t s) {
      if (&index == keep || !index.empty() || by_stream_.contains(s)) return false;
      if (other.blocks.find(s) == nullptr) {  // its last index: nothing left to reap
        keyed_.erase(s);
        retired_.erase(s);
      }
      return true;
    });
  }
}

// The segments cached for the per-thread stream of a thread that has exited: no request can name
// that stream again, so they would stay cached for good (a pool of short-lived threads grew without
// bound). Their unsplit free blocks (whole free segments) are given back (cuMemFree waits for the
// work the thread queued); a segment that holds live blocks is looked at again once they are all
// freed (free puts it on its key's look list), not on every slow path. Given back, not handed to
// another stream: the next thread's first requests map their own, but no stream's cache fills with
// memory it never asked for. Runs on the slow path and in release_cached/trim only; `keep`: the
// stream of the request at hand.
// A released graph pool's memory is given back here only when `graph_pools` (release_cached, trim),
// not on a request's slow path or at a new limit: as PyTorch's releasePool, which only marks the
// private pool freeable for release_cached_blocks (empty_cache, or a request's last retry before an
// OOM, where this backend's release_cached_blocks gives it back too).
void SplitMergeBackend::reap_retired(driver::stream_t keep, bool graph_pools) {
  if (const std::uint64_t gen = retired_keys_generation(); gen != retired_seen_) {
    // Only the keys not known retired (keyed_): not the retired ones that keep live blocks.
    for (auto it = keyed_.begin(); it != keyed_.end();) {
      const driver::stream_t s = *it;
      ++slow_path_steps_;
      if (s == keep || !is_retired_key(s)) {
        ++it;
        continue;
      }
      retired_.insert(s);  // may throw bad_alloc: nothing changed, the next look finds it again
      it = keyed_.erase(it);
      const auto mine = by_stream_.find(s);
      if (mine == by_stream_.end()) {  // an index, no segment
        forget_key(s);
        continue;
      }
      for (SmSegment& seg : mine->second) {
        ++slow_path_steps_;
        seg.retired = true;
        if (seg.first->is_free() && seg.first->next == nullptr) looks_of(s).push_back(seg);
      }
    }
    retired_seen_ = gen;
  }
  if (retired_emptied_) {
    retired_emptied_ = false;
    for (auto it = retired_.begin(); it != retired_.end();) {
      const driver::stream_t s = *it++;
      ++slow_path_steps_;
      if (s != keep && !by_stream_.contains(s)) forget_key(s);  // erases s alone: `it` stays valid
    }
  }
  auto reap = [&](LookList& looks) {
    for (auto it = looks.begin(); it != looks.end();) {
      SmSegment& seg = *it++;
      if (seg.stream == keep) continue;
      ++slow_path_steps_;
      if (!seg.first->is_free() || seg.first->next != nullptr) {  // allocated from since (a late request)
        looks.erase(looks.iterator_to(seg));
        continue;
      }
      const driver::stream_t s = seg.stream;
      release_block(seg.first);  // takes it off the list; throws with nothing changed (it stays on)
      if (!by_stream_.contains(s)) forget_key(s);
    }
  };
  reap(thread_looks_);
  if (graph_pools) reap(pool_looks_);
  retired_emptied_ = false;  // set above only by keys forgotten right after
}

core::SizeIndex& SplitMergeBackend::add_index(Pool& pool, driver::stream_t stream) {
  const bool fresh = is_per_thread_key(stream) && !retired_.contains(stream) && keyed_.insert(stream).second;  // may throw: nothing changed
  try {
    return pool.blocks.of(stream);
  } catch (...) {
    if (fresh) keyed_.erase(stream);
    throw;
  }
}

void SplitMergeBackend::forget_key(driver::stream_t s) noexcept {
  large_.blocks.erase(s);
  small_.blocks.erase(s);
  retired_.erase(s);
}

void SplitMergeBackend::look_again(SmSegment& seg) noexcept {
  if (!seg.look_hook.is_linked()) looks_of(seg.stream).push_back(seg);
}

void SplitMergeBackend::garbage_collect_cached_blocks() {
  const auto gc_threshold =
      static_cast<std::size_t>(ctx_.config.garbage_collection_threshold * static_cast<double>(ctx_.limit));
  if (total_allocated_memory_ <= gc_threshold) return;
  const std::size_t target_size = total_allocated_memory_ - gc_threshold;
  std::size_t gc_reclaimed = 0;
  auto age = [&](const Block& b) { return large_.get_free_blocks_calls - b.gc_base; };
  // As PyTorch, the default pool's large blocks only: a private pool's memory, released or not,
  // goes back at release_cached_blocks.
  auto collectable = [&](const Block& b) { return !is_graph_pool_key(b.stream) && releasable(b); };
  std::uint64_t total_age = 0;
  std::int64_t freeable = 0;
  std::as_const(large_.blocks).for_each_block([&](const Block& b) {
    if (collectable(b)) {
      total_age += age(b);
      ++freeable;
    }
  });
  if (freeable == 0) return;
  bool block_freed = true;
  while (gc_reclaimed < target_size && block_freed && freeable > 0) {
    const double age_threshold = static_cast<double>(total_age) / static_cast<double>(freeable);
    block_freed = false;
    large_.blocks.for_each_block([&](Block& b) {
      if (collectable(b) && static_cast<double>(age(b)) >= age_threshold) {
        block_freed = true;
        gc_reclaimed += b.size;
        total_age -= age(b);
        --freeable;
        release_block(&b);
      }
    });
  }
}

// Puts `b`, whose key changed while it stayed linked in `index`, where it belongs (see
// SizeIndex::reposition), and restarts its garbage-collection age as PyTorch's re-insertion does.
void SplitMergeBackend::reposition(const Pool& pool, core::SizeIndex& index, Block* b) noexcept {
  b->gc_base = pool.get_free_blocks_calls;
  index.reposition(*b);
}

Block* SplitMergeBackend::alloc_found_block(Params& p, std::size_t requested, bool exact) {
  Block* block = p.block;
  Pool& pool = *p.pool;
  const int sp = pool.stat_pool;
  const bool already_split = block->is_split();
  const bool indexed = block->free_hook.is_linked();  // found in the pool, not a new segment
  if (exact ? block->size > p.size : should_split(*block, p.size)) {
    // The allocation takes the front; the remainder stays free behind it.
    Block* remaining = block;
    block = blocks_.make();
    block->addr = remaining->addr;
    block->size = p.size;
    block->stream = p.stream;
    block->segment = remaining->segment;
    block->pool = remaining->pool;
    block->prev = remaining->prev;
    if (block->prev) block->prev->next = block;
    else static_cast<SmSegment*>(block->segment)->first = block;
    block->next = remaining;
    remaining->prev = block;
    remaining->addr += p.size;
    remaining->size -= p.size;
    if (indexed) reposition(pool, *p.index, remaining);
    else insert_free(pool, *p.index, remaining);
    ctx_.stats.num_free_blocks += 1;
    if (already_split) {
      account_inactive(sp, 0, -static_cast<std::int64_t>(p.size));  // a split free block shrank
    } else {
      account_inactive(sp, 1, static_cast<std::int64_t>(remaining->size));  // a new split remainder
    }
  } else {
    if (indexed) p.index->erase(*block);
    if (already_split) account_inactive(sp, -1, -static_cast<std::int64_t>(block->size));  // a split block becomes active
  }
  block->status = BlockStatus::allocated;
  block->requested = requested;
  account_allocated(*block);
  return block;
}

Block* SplitMergeBackend::allocate(std::size_t requested, driver::stream_t stream) {
  Params p;
  p.size = round_size(requested);
  if (p.size > std::numeric_limits<std::size_t>::max() / 2) return nullptr;
  p.pool = &pool_for(p.size);
  p.index = p.pool->blocks.find(stream);
  if (p.index == nullptr) [[unlikely]] p.index = &add_index(*p.pool, stream);  // a stream's first allocation (may throw; nothing changed yet)
  p.alloc_size = allocation_size(p.size);
  p.stream = stream;

  bool found = get_free_block(p);
  const bool cached = found;
  // CuPy refuses a request larger than its limit before it frees anything (_try_block_total_bytes).
  if (!found && cupy() && ctx_.limit != 0 && p.size > ctx_.limit) return nullptr;
  if (!found) {
    ctx_.refused = Context::Refusal::none;
    blocks_.reserve_two();  // the new segment's block and its split: nothing below may throw bad_alloc midway
    const CaptureScope capture(ctx_, stream);
    if (ctx_.capturing) {
      // During a capture: a new segment (cuMemAlloc, relaxed capture mode), but nothing given back
      // first. PyTorch skips only release_cached_blocks (it waits for no captures underway) and
      // still runs garbage collection and the oversize release; expseg skips those too (a
      // deliberate difference): each cuMemFree is one more call that a capture may refuse.
      found = alloc_block(p, false);
    } else {
      // Optional clean-up first (an exited thread's cache, garbage collection): a cuMemFree refused
      // there stops the clean-up, not the request, which may fit without it (was: the request failed
      // with that driver_error on a device with room). The segment it could not free stays cached.
      try {
        reap_retired(stream, false);
        if (gc_enabled() && !cupy()) garbage_collect_cached_blocks();
      } catch (const driver_error&) {
      }
      // CuPy (_try_malloc, since cupy/cupy#7679) has no oversize blocks to release first
      // (release_available_cached_blocks does nothing for it): over the limit or out of device memory,
      // it frees all unsplit cached blocks (free_all_blocks) and retries, as PyTorch's last step does.
      found = alloc_block(p, false) || (release_available_cached_blocks(p) && alloc_block(p, false)) ||
              (release_cached_blocks(p.index) && alloc_block(p, true));
    }
  }
  if (!found) return nullptr;
  // A cached block's split may throw bad_alloc (a new Block chunk) before anything changed: count the
  // block out of the free blocks only once it is handed out.
  Block* b = alloc_found_block(p, requested);
  if (cached) ctx_.stats.num_free_blocks -= 1;
  return b;
}

Block* SplitMergeBackend::allocate_at(driver::stream_t stream, std::uint64_t addr, std::size_t size) {
  if (size == 0 || addr % kMinBlockSize != 0 || size % kMinBlockSize != 0) return nullptr;
  Block* b = nullptr;
  if (const auto mine = by_stream_.find(stream); mine != by_stream_.end())
    for (SmSegment& seg : mine->second) {
      if (addr < seg.base || addr - seg.base >= seg.size) continue;
      for (b = seg.first; b->end() <= addr; b = b->next) {
      }
      break;
    }
  if (b == nullptr || !b->is_free() || b->end() - addr < size) return nullptr;
  Pool& pool = pool_of(*b);
  core::SizeIndex& index = index_of(*b);
  blocks_.reserve_two();  // the front's Block and the split's: nothing below may throw
  if (b->addr < addr) {
    // [b->addr, addr) stays free as a block of its own; b becomes [addr, end).
    const bool was_split = b->is_split();
    Block* front = blocks_.make();
    front->addr = b->addr;
    front->size = addr - b->addr;
    front->stream = b->stream;
    front->segment = b->segment;
    front->pool = b->pool;
    front->prev = b->prev;
    if (front->prev) front->prev->next = front;
    else static_cast<SmSegment*>(b->segment)->first = front;
    front->next = b;
    b->prev = front;
    b->addr = addr;
    b->size -= front->size;
    reposition(pool, index, b);
    insert_free(pool, index, front);
    ctx_.stats.num_free_blocks += 1;
    // Free split blocks count as inactive: one more now (or both, when b was whole), the bytes as before.
    if (was_split) account_inactive(b->pool, 1, 0);
    else account_inactive(b->pool, 2, static_cast<std::int64_t>(front->size + b->size));
  }
  Params p;
  p.size = size;
  p.stream = stream;
  p.pool = &pool;
  p.index = &index;
  p.block = b;
  Block* got = alloc_found_block(p, size, true);
  ctx_.stats.num_free_blocks -= 1;
  return got;
}

// Merges free neighbour `src` into `dst` (the list links only; `src` stays in the index for the
// caller, who may hand its node to `dst`). Returns the bytes subsumed, 0 when `src` is not free.
std::size_t SplitMergeBackend::try_merge_blocks(Block* dst, Block* src) noexcept {
  if (src == nullptr || !src->is_free()) return 0;
  if (dst->prev == src) {
    dst->addr = src->addr;
    dst->prev = src->prev;
    if (dst->prev) dst->prev->next = dst;
    else static_cast<SmSegment*>(dst->segment)->first = dst;
  } else {
    dst->next = src->next;
    if (dst->next) dst->next->prev = dst;
  }
  dst->size += src->size;
  return src->size;
}

void SplitMergeBackend::free(Block* block) noexcept {
  leave_active(*block);
  Pool& pool = pool_of(*block);
  core::SizeIndex& index = index_of(*block);
  std::int64_t inactive_blocks = 0;
  std::int64_t inactive_bytes = 0;
  Block* absorbed[2] = {nullptr, nullptr};
  int n = 0;
  for (Block* candidate : {block->prev, block->next}) {
    const std::size_t subsumed = try_merge_blocks(block, candidate);
    if (subsumed > 0) {
      absorbed[n++] = candidate;
      inactive_blocks -= 1;
      inactive_bytes -= static_cast<std::int64_t>(subsumed);
    }
  }
  // The merged block takes the index node of a neighbour it absorbed (no rebalancing when the
  // order allows), else it is inserted.
  if (n == 0) {
    insert_free(pool, index, block);
    ctx_.stats.num_free_blocks += 1;
  } else {
    if (n == 2) {
      index.erase(*absorbed[0]);
      ctx_.stats.num_free_blocks -= 1;
      blocks_.recycle(absorbed[0]);
    }
    Block* last = absorbed[n - 1];
    index.replace(*last, *block);
    blocks_.recycle(last);
    reposition(pool, index, block);
  }
  if (block->is_split()) {
    inactive_blocks += 1;
    inactive_bytes += static_cast<std::int64_t>(block->size);
  } else if (static_cast<SmSegment*>(block->segment)->retired) [[unlikely]] {
    look_again(*static_cast<SmSegment*>(block->segment));  // wholly free: reap_retired may give it back
  }
  account_inactive(block->pool, inactive_blocks, inactive_bytes);
}

void SplitMergeBackend::release_cached() {
  release_cached_blocks();
  reap_retired(nullptr);
}

std::size_t SplitMergeBackend::stream_bytes_in_use(driver::stream_t stream) const {
  std::size_t in_use = 0;
  if (const auto mine = by_stream_.find(stream); mine != by_stream_.end())
    for (const SmSegment& seg : mine->second)
      for (const Block* b = seg.first; b != nullptr; b = b->next)
        if (!b->is_free()) in_use += b->size;
  return in_use;
}

void SplitMergeBackend::release_stream(driver::stream_t stream) {
  // Every block of the stream is free, so each of its segments is one unsplit free block. Only
  // the stream's own segments are looked at.
  if (const auto mine = by_stream_.find(stream); mine != by_stream_.end()) {
    for (const SmSegment& seg : mine->second)
      if (!seg.first->is_free() || seg.first->next != nullptr) broken("release_stream: a segment of the stream holds a block in use");
    // The last release_block forgets the list: counted, not asked for emptiness.
    for (std::size_t n = mine->second.size(); n-- > 0;) release_block(mine->second.front().first);
  }
  large_.blocks.erase(stream);
  small_.blocks.erase(stream);
  keyed_.erase(stream);  // (plain streams: on neither)
  retired_.erase(stream);
}

// Gives back just the cached memory above the new limit, in whole unsplit segments
// (core::pick_give_back: the least memory beyond the excess, then the fewest cuMemFree calls; the
// expandable backend follows the same rule with its idle handles). PyTorch's setMemoryFraction and
// CuPy's set_limit give back nothing; expseg documents the give-back. Throws with the allocator
// consistent when a cuMemFree fails.
void SplitMergeBackend::on_limit_changed() {
  reap_retired(nullptr, false);  // a released pool's memory counts among the cached memory below
  if (ctx_.limit == 0 || total_allocated_memory_ <= ctx_.limit) return;
  if (ctx_.hooks) ctx_.hooks->synchronize_pending_frees();
  std::vector<Block*> unsplit;
  for (Pool* pool : {&large_, &small_})
    pool->blocks.for_each_block([&](Block& b) {
      if (releasable(b)) unsplit.push_back(&b);
    });
  std::vector<std::size_t> sizes(unsplit.size());
  for (std::size_t i = 0; i < unsplit.size(); ++i) sizes[i] = unsplit[i]->size;
  for (std::size_t i : core::pick_give_back(sizes, total_allocated_memory_ - ctx_.limit)) release_block(unsplit[i]);
}

void SplitMergeBackend::validate() const {
  std::int64_t reserved[kStatPools] = {};
  std::int64_t allocated[kStatPools] = {};
  std::int64_t active[kStatPools] = {};
  std::int64_t inactive[kStatPools] = {};
  std::int64_t requested[kStatPools] = {};
  std::size_t free_blocks = 0;
  std::size_t total = 0;
  for (const SmSegment& seg : segments_) {
    total += seg.size;
    reserved[seg.pool] += static_cast<std::int64_t>(seg.size);
    if (seg.first == nullptr || seg.first->prev != nullptr) broken("segment has no first block");
    std::uint64_t expect = seg.base;
    const Block* prev = nullptr;
    for (const Block* b = seg.first; b; prev = b, b = b->next) {
      if (b->addr != expect) broken("blocks do not tile segment 0x" + std::to_string(seg.base));
      if (b->prev != prev) broken("prev link mismatch");
      if (b->segment != &seg) broken("block points to another segment");
      if (b->size == 0) broken("empty block");
      if (b->pool != seg.pool) broken("block pool differs from its segment's");
      expect = b->end();
      if (b->is_free()) {
        ++free_blocks;
        if (!b->free_hook.is_linked()) broken("free block not in a free index");
        if (b->stream != seg.stream) broken("free block on another stream than its segment");
        if (prev && prev->is_free()) broken("two adjacent free blocks were not merged");
        if (b->is_split()) inactive[b->pool] += static_cast<std::int64_t>(b->size);
      } else {
        if (b->free_hook.is_linked()) broken("allocated block is in a free index");
        if (b->requested > b->size) broken("requested size larger than block");
        active[b->pool] += static_cast<std::int64_t>(b->size);
        requested[b->pool] += static_cast<std::int64_t>(b->requested);  // pending blocks too, as PyTorch counts them
        if (b->status == BlockStatus::allocated) allocated[b->pool] += static_cast<std::int64_t>(b->size);
      }
    }
    if (expect != seg.base + seg.size) broken("blocks do not cover their segment");
  }
  if (total != total_allocated_memory_) broken("total_allocated_memory differs from the sum of segments");
  std::size_t listed = 0;
  for (const auto& [stream, list] : by_stream_) {
    if (list.empty()) broken("a stream with no segment has a segment list");
    for (const SmSegment& seg : list) {
      if (seg.stream != stream) broken("segment listed under another stream");
      // An index forgotten while a segment names it would dangle.
      if (const_cast<Pool&>(pool_of(*seg.first)).blocks.find(stream) != seg.index) broken("segment's index is not its stream's");
    }
    listed += list.size();
  }
  if (listed != segments_.size()) broken("a segment is missing from its stream's list");
  for (const SmSegment& seg : segments_)
    if (!seg.stream_hook.is_linked()) broken("a segment is on no stream's list");  // and so another is listed that is no segment
  if (free_blocks != small_.blocks.size() + large_.blocks.size()) broken("free index holds blocks not in any segment");
  // Each stream's index holds that stream's blocks in (size, address) order (keys change in place
  // on the cached path: reposition).
  for (const Pool* pool : {&small_, &large_}) {
    if (const char* why = pool->blocks.check()) broken(why);
    pool->blocks.for_each_index([&](const core::SizeIndex& index, driver::stream_t stream) {
      if (const char* why = index.check()) broken(why);
      index.for_each([&](const Block& b) {
        if (b.stream != stream) broken("free block indexed under another stream");
        if (&pool_of(b) != pool) broken("free block indexed in another pool");
      });
    });
  }
  if (static_cast<std::int64_t>(free_blocks) != ctx_.stats.num_free_blocks) broken("num_free_blocks stat is wrong");
  // Keys: each per-thread or graph pool key with an index on exactly one of keyed_ and retired_.
  auto has_index = [&](driver::stream_t s) {
    return const_cast<Pool&>(small_).blocks.find(s) != nullptr || const_cast<Pool&>(large_).blocks.find(s) != nullptr;
  };
  for (const Pool* pool : {&small_, &large_})
    pool->blocks.for_each_index([&](const core::SizeIndex&, driver::stream_t s) {
      if (is_per_thread_key(s) && keyed_.contains(s) == retired_.contains(s)) broken("a key with an index is on neither or both of keyed_ and retired_");
    });
  for (const auto* keys : {&keyed_, &retired_})
    for (driver::stream_t s : *keys)
      if (!is_per_thread_key(s) || !has_index(s)) broken("keyed_ or retired_ holds a key with no index");
  // Retired segments: flagged iff their key is retired; one wholly free is on its look list.
  std::size_t looking = 0;
  for (const SmSegment& seg : segments_) {
    if (seg.retired != retired_.contains(seg.stream)) broken("a segment's retired flag disagrees with retired_");
    if (seg.look_hook.is_linked()) ++looking;
    else if (seg.retired && seg.first->is_free() && seg.first->next == nullptr) broken("a wholly free retired segment is on no look list");
  }
  std::size_t listed_looks = 0;
  for (const LookList* looks : {&thread_looks_, &pool_looks_})
    for (const SmSegment& seg : *looks) {
      ++listed_looks;
      if (!seg.retired || !seg.hook.is_linked()) broken("a look list holds a segment that is not retired");
      if (&const_cast<SplitMergeBackend*>(this)->looks_of(seg.stream) != looks) broken("a segment is on the other look list");
    }
  if (listed_looks != looking) broken("a look list holds a segment twice, or one not among the segments");
  const Stats& s = ctx_.stats;
  for (int pool : {kSmallPool, kLargePool}) {
    reserved[kAllPools] += reserved[pool];
    allocated[kAllPools] += allocated[pool];
    active[kAllPools] += active[pool];
    inactive[kAllPools] += inactive[pool];
    requested[kAllPools] += requested[pool];
  }
  for (int pool = 0; pool < kStatPools; ++pool) {
    const std::string where = std::string(" (") + stat_pool_name(pool) + ")";
    if (s.reserved_bytes[pool].current != reserved[pool]) broken("reserved_bytes stat is wrong" + where);
    if (s.allocated_bytes[pool].current != allocated[pool]) broken("allocated_bytes stat is wrong" + where);
    if (s.active_bytes[pool].current != active[pool]) broken("active_bytes stat is wrong" + where);
    if (s.inactive_split_bytes[pool].current != inactive[pool]) broken("inactive_split_bytes stat is wrong" + where);
    if (s.requested_bytes[pool].current != requested[pool]) broken("requested_bytes stat is wrong" + where);
  }
  if (s.allocated_bytes[kAllPools].current > s.reserved_bytes[kAllPools].current) broken("allocated > reserved");
}

void SplitMergeBackend::snapshot(std::vector<SegmentInfo>& out) const {
  for (const SmSegment& seg : segments_) {
    SegmentInfo info;
    info.address = seg.base;
    info.size = seg.size;
    info.mapped_bytes = seg.size;
    info.stream = shown_stream(seg.stream);
    info.small_pool = seg.pool == kSmallPool;
    info.physical_handles = 1;
    info.mapped_ranges.push_back({seg.base, seg.size});
    for (const Block* b = seg.first; b; b = b->next) {
      BlockInfo bi;
      bi.address = b->addr;
      bi.size = b->size;
      bi.requested = b->is_free() ? 0 : b->requested;
      bi.state = b->status == BlockStatus::allocated      ? BlockState::allocated
                 : b->status == BlockStatus::pending_free ? BlockState::pending_free
                                                          : BlockState::free_mapped;
      bi.stream = shown_stream(b->stream);
      info.blocks.push_back(bi);
    }
    out.push_back(std::move(info));
  }
}

FreeSummary SplitMergeBackend::free_summary(std::size_t request, driver::stream_t stream) const {
  FreeSummary s;
  s.live_footprint = static_cast<std::size_t>(ctx_.stats.active_bytes[kAllPools].current);
  // A request no cached block serves needs a new segment: 2 MiB, 20 MiB or its size rounded to
  // 2 MiB (PyTorch's get_allocation_size, which its OOM message reports as "Tried to allocate").
  s.request_footprint = request == 0 ? 0 : std::max(request, allocation_size(request));
  const Pool* request_pool = cupy() || request > kSmallSize ? &large_ : &small_;  // pool_for's choice
  // get_free_block's oversize rules: whether they keep `b` from the request.
  const std::size_t max_split = ctx_.config.max_split_size;
  auto oversize_refuses = [&](const Block& b) {
    if (cupy()) return false;
    if (request < max_split) return b.size >= max_split;
    return b.size >= request && b.size - request >= ctx_.config.max_non_split_rounding;
  };
  // Whether a block's stream captures, asked once per run of blocks of one stream.
  driver::stream_t asked = nullptr;
  bool asked_captures = false;
  bool asked_any = false;
  for (const Pool* pool : {&small_, &large_}) {
    pool->blocks.for_each_block([&](const Block& b) {
      s.free_blocks += 1;
      if (b.size > s.largest_free_block) s.largest_free_block = b.size;
      if (request != 0 && pool == request_pool && b.stream == stream) {
        if (!oversize_refuses(b))
          s.largest_usable_block = std::max(s.largest_usable_block, b.size);
        else if (b.size >= request)
          s.oversize_block = std::max(s.oversize_block, b.size);
      }
      if (!b.is_split()) s.releasable_bytes += b.size;
      // (The request's own pool's blocks as large as the request may serve it: not kept from it.)
      if (is_graph_pool_key(b.stream) && is_live_graph_pool_key(b.stream) && (b.stream != stream || b.size < request)) {
        s.graph_pool_bytes += b.size;
        s.graph_pool_free_bytes += b.size;
        s.graph_pool_free_blocks += 1;
        s.largest_graph_pool_block = std::max(s.largest_graph_pool_block, b.size);
      } else {
        s.largest_free_outside_pools = std::max(s.largest_free_outside_pools, b.size);
      }
      if (b.stream == stream) return;
      if (!asked_any || b.stream != asked) {
        asked_any = true;
        asked = b.stream;
        asked_captures = stream_captures(ctx_, b.stream);
      }
      if (asked_captures) s.capture_kept_bytes += b.size;
    });
  }
  // get_free_block's choice for the request, without its clock.
  if (request != 0 && request <= std::numeric_limits<std::size_t>::max() / 2) {
    if (core::SizeIndex* index = const_cast<Pool*>(request_pool)->blocks.find(stream)) {
      if (const Block* b = index->lower_bound(request)) s.cache_serves = !oversize_refuses(*b);
    }
  }
  return s;
}

bool SplitMergeBackend::contains(std::uint64_t addr) const noexcept {
  for (const SmSegment& seg : segments_)
    if (addr >= seg.base && addr < seg.base + seg.size) return true;
  return false;
}

ExportPlan SplitMergeBackend::export_plan(const Block& block) const {
  // The whole driver allocation: cuIpcGetMemHandle names a cuMemAlloc allocation by its base, and
  // the importer adds the block's offset to what cuIpcOpenMemHandle maps.
  const auto& seg = *static_cast<const SmSegment*>(block.segment);
  ExportPlan plan;
  plan.kind = ExportPlan::Kind::driver_allocation;
  plan.base = seg.base;
  plan.bytes = seg.size;
  return plan;
}

std::unique_ptr<Backend> make_split_merge(Context& ctx) { return std::make_unique<SplitMergeBackend>(ctx); }

}  // namespace expseg::backends
