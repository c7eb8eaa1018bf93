// Core block metadata shared by both backends.
//
// A Block is a contiguous address range inside one segment. Blocks of a segment form an
// address-ordered doubly linked list (prev/next) that tiles the segment exactly.
//
// Invariants (checked by each backend's validate()):
//   - the blocks of a segment tile it: first->addr == segment base, b->addr + b->size == b->next->addr,
//     last block ends at the segment end; prev/next never cross into another segment
//   - a free block is in exactly one free index (free_hook linked), an allocated or pending block in
//     none (expandable also keeps its unmapped free blocks by run_hook and dirty_hook)
//   - no two adjacent free blocks share a mapped state (they are merged on free)
//   - allocated and pending blocks are mapped; requested <= size for allocated blocks
#pragma once

#include <algorithm>
#include <boost/intrusive/list.hpp>
#include <boost/intrusive/set.hpp>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "driver/driver.hpp"

namespace expseg::core {

namespace bi = boost::intrusive;

enum class BlockStatus : std::uint8_t {
  free,          // in a free index
  allocated,     // handed out to a caller
  pending_free,  // freed by the caller, waiting for events on streams that used it
};

using FreeHook = bi::set_member_hook<bi::link_mode<bi::safe_link>>;
using PendingHook = bi::list_member_hook<bi::link_mode<bi::safe_link>>;

// Laid out for the cached paths: everything they read or write sits in the first two cache lines
// of a 64-byte aligned block; record_stream's list and the pending-free hook come after.
struct alignas(64) Block {
  std::uint64_t addr = 0;
  std::size_t size = 0;
  Block* prev = nullptr;      // address-ordered neighbours in the same segment
  Block* next = nullptr;
  void* segment = nullptr;    // the backend's segment record
  driver::stream_t stream = nullptr;
  FreeHook free_hook;
  std::size_t requested = 0;  // what the caller asked for; meaningful while allocated/pending
  BlockStatus status = BlockStatus::free;
  bool mapped = true;         // expandable: backed by physical memory; split_merge: always true
  std::uint8_t pool = 2;      // StatPool: kSmallPool (1) or kLargePool (2)
  std::uint16_t bin = 0;      // size class while in a SizeIndex (core/size_index.hpp)
  std::uint32_t pending_events = 0;         // events still to complete before a pending free ends
  union {
    std::uint64_t gc_base = 0;  // split_merge garbage collection: call count at insertion
    std::uint64_t run_bytes;    // expandable, an unmapped free block: a bound on its run of free blocks (ExpArena::holes)
  };
  std::vector<driver::stream_t> stream_uses;  // record_stream(); empty on the hot path (no heap)
  PendingHook pending_hook;
  // expandable, unmapped free blocks only: its arena's holes by run_bytes, and its dirty holes
  // (ExpArena::holes). They fill what was padding: the Block stays 192 bytes.
  bi::set_member_hook<bi::optimize_size<true>> run_hook;
  bi::list_member_hook<> dirty_hook;

  bool is_free() const noexcept { return status == BlockStatus::free; }
  bool is_split() const noexcept { return prev != nullptr || next != nullptr; }
  std::uint64_t end() const noexcept { return addr + size; }
};

static_assert(offsetof(Block, gc_base) + sizeof(std::uint64_t) <= 128, "the cached paths' fields span two cache lines");

// Recycles Block objects so the cached allocation path never touches the heap: blocks come from
// chunks that are only allocated when the number of blocks alive reaches a new high-water mark.
class BlockPool {
 public:
  BlockPool() = default;
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  Block* make() {
    if (free_ == nullptr) grow();
    Block* b = free_;
    free_ = b->next;
    b->next = nullptr;
    ++live_;
    return b;
  }
  void recycle(Block* b) noexcept {
    // Reset field by field (keeping stream_uses' capacity): no heap traffic, no hook re-construction.
    b->addr = 0;
    b->size = 0;
    b->requested = 0;
    b->stream = nullptr;
    b->prev = nullptr;
    b->segment = nullptr;
    b->status = BlockStatus::free;
    b->mapped = true;
    b->pool = 2;
    b->pending_events = 0;
    b->gc_base = 0;
    b->stream_uses.clear();
    b->next = free_;
    free_ = b;
    --live_;
  }
  std::size_t live() const noexcept { return live_; }
  // Makes sure the next two make() calls cannot throw: a slow path that creates a segment and
  // splits it calls this before changing anything.
  void reserve_two() {
    if (free_ == nullptr || free_->next == nullptr) grow();
  }

 private:
  // Chunks of 8, 16, ... up to 256 blocks: a pool per stream (expandable's arenas) that holds a
  // few blocks, as most do, costs 1.5 KiB instead of 48 KiB (page faults on a new stream's first
  // allocation: 184 -> 57-72 us on the simulated device with 8,000 streams).
  void grow() {
    const std::size_t n = std::size_t{8} << std::min<std::size_t>(chunks_.size(), 5);
    chunks_.push_back(std::make_unique<Block[]>(n));
    Block* chunk = chunks_.back().get();
    for (std::size_t i = n; i-- > 0;) {
      chunk[i].next = free_;
      free_ = &chunk[i];
    }
  }
  std::vector<std::unique_ptr<Block[]>> chunks_;
  Block* free_ = nullptr;
  std::size_t live_ = 0;
};

}  // namespace expseg::core
