// LiveMap: address -> Block* of every live allocation, for deallocate(ptr).
//
// Open addressing with linear probing and backward-shift deletion: a lookup touches one or two cache
// lines and never allocates. The table doubles when it is a quarter full (at half full, erase's
// backward shift walks clusters of several entries: ~90 instructions per free in the 64-slot churn
// against ~50), so the heap is touched only when the number of live allocations reaches a new
// high-water mark, never in a steady state. 16 bytes per entry: 64 bytes per live allocation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

#include "core/block.hpp"

namespace expseg::core {

class LiveMap {
 public:
  LiveMap() { rehash(64); }

  // Makes room for one more entry, so that the next insert cannot fail. May throw std::bad_alloc,
  // with nothing changed.
  void reserve_one() {
    if ((size_ + 1) * 4 > capacity_) rehash(capacity_ * 2);
  }
  // Inserts; the address must not be present.
  void insert(Block* b) {
    reserve_one();
    insert_reserved(b);
  }
  // Inserts after reserve_one (or right after an erase): cannot fail, and the hot path checks the
  // room once.
  void insert_reserved(Block* b) noexcept {
    place(b);
    ++size_;
  }
  Block* find(std::uint64_t addr) const noexcept {
    for (std::size_t i = slot(addr);; i = (i + 1) & mask_) {
      const Entry& e = table_[i];
      if (e.block == nullptr) return nullptr;
      if (e.addr == addr) return e.block;
    }
  }
  // Removes and returns the block at `addr`, or nullptr.
  Block* erase(std::uint64_t addr) noexcept {
    std::size_t i = slot(addr);
    for (;; i = (i + 1) & mask_) {
      if (table_[i].block == nullptr) return nullptr;
      if (table_[i].addr == addr) break;
    }
    Block* found = table_[i].block;
    // Backward-shift: pull later entries of the probe run into the hole so lookups need no tombstones.
    std::size_t hole = i;
    for (std::size_t j = (i + 1) & mask_; table_[j].block != nullptr; j = (j + 1) & mask_) {
      std::size_t home = slot(table_[j].addr);
      // Move entry j into the hole if its home is not in the cyclic range (hole, j].
      bool in_range = hole <= j ? (home > hole && home <= j) : (home > hole || home <= j);
      if (!in_range) {
        table_[hole] = table_[j];
        hole = j;
      }
    }
    table_[hole] = Entry{};
    --size_;
    return found;
  }
  std::size_t size() const noexcept { return size_; }
  std::uint64_t walks() const noexcept { return walks_; }  // for_each calls so far (tests: who walks every block)

  template <class F>
  void for_each(F&& f) const {
    ++walks_;
    for (std::size_t i = 0; i < capacity_; ++i)
      if (table_[i].block) f(table_[i].block);
  }

 private:
  struct Entry {
    std::uint64_t addr = 0;
    Block* block = nullptr;
  };
  std::size_t slot(std::uint64_t addr) const noexcept {
    // Allocations are at least 512-byte aligned: mix the bits so they spread over the table.
    std::uint64_t x = addr >> 9;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return static_cast<std::size_t>(x) & mask_;
  }
  void place(Block* b) noexcept {
    std::size_t i = slot(b->addr);
    while (table_[i].block != nullptr) i = (i + 1) & mask_;
    table_[i] = Entry{b->addr, b};
  }
  [[gnu::noinline]] void rehash(std::size_t capacity) {
    // The new table first: a bad_alloc must leave the old one in place.
    std::unique_ptr<Entry[]> next = std::make_unique<Entry[]>(capacity);
    std::unique_ptr<Entry[]> old = std::exchange(table_, std::move(next));
    std::size_t old_capacity = capacity_;
    capacity_ = capacity;
    mask_ = capacity - 1;
    for (std::size_t i = 0; i < old_capacity; ++i)
      if (old[i].block) place(old[i].block);
  }

  std::unique_ptr<Entry[]> table_;
  std::size_t capacity_ = 0;
  std::size_t mask_ = 0;
  // Written on every insert and erase: on its own line, so the fields every lookup reads stay
  // shared in the caches of threads that take turns at the allocator.
  alignas(64) std::size_t size_ = 0;
  mutable std::uint64_t walks_ = 0;  // written by walks only, under the same lock as the table
};

}  // namespace expseg::core
