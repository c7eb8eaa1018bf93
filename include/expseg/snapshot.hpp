// expseg snapshots: the allocator's memory as segments -> blocks, for OOM studies and pictures.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "expseg/stats.hpp"

// The public API keeps default visibility; the rest of libexpseg.so is built hidden.
#pragma GCC visibility push(default)

namespace expseg {

enum class BlockState : std::uint8_t {
  allocated,      // live allocation
  pending_free,   // freed by the caller, waiting for streams that used it (record_stream)
  free_mapped,    // free, backed by device memory (reusable without a driver call)
  free_unmapped,  // free virtual address range with no memory behind it (expandable only)
};
const char* to_string(BlockState) noexcept;

struct BlockInfo {
  std::uint64_t address = 0;
  std::size_t size = 0;
  std::size_t requested = 0;  // requested size of an allocated or pending_free block, 0 otherwise
  BlockState state = BlockState::free_mapped;
  std::uint64_t stream = 0;
  bool operator==(const BlockInfo&) const = default;
};

struct AddressRange {
  std::uint64_t address = 0;
  std::size_t size = 0;
  bool operator==(const AddressRange&) const = default;
};

struct SegmentInfo {
  std::uint64_t address = 0;
  std::size_t size = 0;          // split_merge: the driver allocation; expandable: VA in use (up to the high-water mark)
  std::size_t mapped_bytes = 0;  // device memory behind the segment
  std::uint64_t stream = 0;
  bool small_pool = false;
  std::size_t physical_handles = 0;
  // The graph pool (Allocator::begin_graph_pool's id) whose memory this is, released or not; 0: none.
  std::uint64_t graph_pool = 0;
  std::vector<BlockInfo> blocks;            // address order, tiling [address, address+size)
  std::vector<AddressRange> mapped_ranges;  // expandable: maximal mapped runs
  bool operator==(const SegmentInfo&) const = default;
};

struct Snapshot {
  std::string backend;
  int device = 0;
  std::size_t limit_bytes = 0;
  std::size_t device_total_bytes = 0;
  std::vector<SegmentInfo> segments;
  Stats stats;
  std::string to_json() const;
  bool operator==(const Snapshot&) const = default;
};

}  // namespace expseg

#pragma GCC visibility pop
