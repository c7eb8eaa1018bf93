// Best-fit index of free blocks: binned by size class, exact (size, address) order.
//
// A single red-black tree over every free block costs a descent of ~log2(n) levels per lookup,
// insert and erase, and with the random sizes of a real workload every level is a branch the CPU
// cannot predict (callgrind's branch simulation of the 64-slot churn: 10 of 22 mispredictions per
// step were the tree). SizeIndex splits the blocks into size classes (8 per power of two, TLSF's
// mapping) with a small tree per class and a bitmap of the non-empty classes: a lookup is one
// descent of a tree that usually holds 0-2 blocks, plus a find-first-set over the bitmap.
//
// The order is exactly (size, address), as PyTorch's BlockComparatorSize within one stream: the
// smallest block of size >= s is in bin_of(s) (if any there is >= s) or it is the first block of
// the next non-empty bin, because bin_of is monotonic in size. Callers with several streams keep
// one SizeIndex per stream (StreamIndexes), which is PyTorch's (stream, size, address) order.
//
// Invariants (check()):
//   - a block in bin i has bin_of(size) == i and Block::bin == i; each bin's tree is in
//     (size, address) order
//   - bit i of bits_ is set iff bin i is non-empty; bit w of summary_ iff bits_[w] != 0
//   - count_ is the number of blocks in all bins
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <boost/intrusive/rbtree.hpp>
#include <boost/intrusive/set.hpp>
#include <boost/intrusive/rbtree_algorithms.hpp>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "core/block.hpp"

namespace expseg::core {

class SizeIndex {
  struct SizeAddrOrder {
    bool operator()(const Block& a, const Block& b) const noexcept {
      return a.size != b.size ? a.size < b.size : a.addr < b.addr;
    }
  };
  struct SizeKeyOrder {  // lower_bound by size alone (address 0)
    bool operator()(std::size_t s, const Block& b) const noexcept { return s < b.size; }
    bool operator()(const Block& b, std::size_t s) const noexcept { return b.size < s; }
  };
  using Tree = bi::rbtree<Block, bi::member_hook<Block, FreeHook, &Block::free_hook>, bi::compare<SizeAddrOrder>,
                          bi::constant_time_size<false>>;

  using NT = Tree::node_traits;

 public:
  static constexpr unsigned kSubBits = 3;  // 8 classes per power of two (each 1/8 of its octave)
  static constexpr unsigned kSub = 1u << kSubBits;
  static constexpr unsigned kBins = (64 - kSubBits + 1) * kSub;  // sizes up to 2^64 - 1
  static constexpr unsigned kWords = (kBins + 63) / 64;
  static_assert(kWords <= 64, "summary_ has one bit per word");

  // Size class of `size`: monotonic. Classes are closed at the top: a block of exactly 2^k bytes
  // (a whole 2 MiB or 1 GiB segment) shares its class with the slightly smaller remainder left when
  // a small allocation is cut from it, so the common cached pair does not move it between classes.
  static constexpr unsigned bin_of(std::size_t size) noexcept {
    const std::size_t v = size == 0 ? 0 : size - 1;
    if (v < kSub) return static_cast<unsigned>(v);
    const unsigned top = 63u - static_cast<unsigned>(std::countl_zero(v));  // >= kSubBits
    return ((top - kSubBits + 1) << kSubBits) | static_cast<unsigned>((v >> (top - kSubBits)) & (kSub - 1));
  }

  SizeIndex() = default;
  SizeIndex(const SizeIndex&) = delete;
  SizeIndex& operator=(const SizeIndex&) = delete;

  std::size_t size() const noexcept { return count_; }
  bool empty() const noexcept { return count_ == 0; }

  void insert(Block& b) noexcept {
    link(b, bin_of(b.size));
    ++count_;
  }
  void erase(Block& b) noexcept {
    unlink(b);
    --count_;
  }
  // `b` takes the place of linked block `old` (no rebalancing); call reposition(b) after.
  void replace(Block& old, Block& b) noexcept {
    Tree& t = bins_[old.bin];
    t.replace_node(t.iterator_to(old), b);
    b.bin = old.bin;
  }
  // Puts `b`, whose key changed while it stayed linked, where it belongs. The cached paths usually
  // change a key without changing its class or its rank there (a split remainder, a merged block
  // taking its neighbour's node): then nothing moves.
  void reposition(Block& b) noexcept {
    const unsigned i = bin_of(b.size);
    Tree& t = bins_[b.bin];
    if (alone(t, b)) {  // classes hold 0-2 blocks
      if (i == b.bin) return;
      if (bins_[i].empty()) {
        // To an empty class (a whole segment split and merged back by a cached pair): the root
        // moves from one tree header to the other, no search, no rebalancing.
        make_empty(t);
        clear_bit(b.bin);
        make_root(bins_[i], b);
        set_bit(i);
        b.bin = static_cast<std::uint16_t>(i);
        return;
      }
    }
    reposition_moved(b, i);
  }

  // The smallest block (by size, then address) with size >= `size`, or nullptr: best fit.
  Block* lower_bound(std::size_t size) noexcept {
    const unsigned i = bin_of(size);
    if (has_bit(i)) {
      Tree& t = bins_[i];
      auto it = t.lower_bound(size, SizeKeyOrder{});
      if (it != t.end()) return &*it;
    }
    const int j = next_bin(i + 1);
    return j < 0 ? nullptr : &*bins_[static_cast<unsigned>(j)].begin();
  }
  Block* first() noexcept {
    const int j = next_bin(0);
    return j < 0 ? nullptr : &*bins_[static_cast<unsigned>(j)].begin();
  }
  Block* last() noexcept {
    const int j = prev_bin(static_cast<int>(kBins) - 1);
    return j < 0 ? nullptr : &*bins_[static_cast<unsigned>(j)].rbegin();
  }
  // Neighbours of linked block `b` in (size, address) order, or nullptr.
  Block* next(Block& b) noexcept {
    Tree& t = bins_[b.bin];
    auto it = std::next(t.iterator_to(b));
    if (it != t.end()) return &*it;
    const int j = next_bin(b.bin + 1u);
    return j < 0 ? nullptr : &*bins_[static_cast<unsigned>(j)].begin();
  }
  Block* prev(Block& b) noexcept {
    Tree& t = bins_[b.bin];
    auto it = t.iterator_to(b);
    if (it != t.begin()) return &*std::prev(it);
    const int j = prev_bin(static_cast<int>(b.bin) - 1);
    return j < 0 ? nullptr : &*bins_[static_cast<unsigned>(j)].rbegin();
  }
  const Block* first() const noexcept { return const_cast<SizeIndex*>(this)->first(); }
  const Block* next(const Block& b) const noexcept { return const_cast<SizeIndex*>(this)->next(const_cast<Block&>(b)); }

  // Calls f(Block&) for every block in (size, address) order; f may erase the block it is given.
  template <class F>
  void for_each(F&& f) {
    for (Block* b = first(); b != nullptr;) {
      Block* n = next(*b);
      f(*b);
      b = n;
    }
  }
  template <class F>
  void for_each(F&& f) const {
    for (const Block* b = first(); b != nullptr; b = next(*b)) f(*b);
  }

  void clear() noexcept {
    for (Tree& t : bins_) t.clear();
    bits_.fill(0);
    summary_ = 0;
    count_ = 0;
  }

  // nullptr when the invariants above hold, else what is broken.
  const char* check() const noexcept {
    std::size_t n = 0;
    for (unsigned i = 0; i < kBins; ++i) {
      const Tree& t = bins_[i];
      if (t.empty() == has_bit(i)) return "size index: a bin's bit disagrees with its contents";
      const Block* prev = nullptr;
      for (const Block& b : t) {
        if (b.bin != i || bin_of(b.size) != i) return "size index: a block is in the wrong size class";
        if (prev != nullptr && !SizeAddrOrder{}(*prev, b)) return "size index: a bin is out of (size, address) order";
        prev = &b;
        ++n;
      }
    }
    for (unsigned w = 0; w < kWords; ++w)
      if (((summary_ >> w) & 1u) != (bits_[w] != 0 ? 1u : 0u)) return "size index: summary bit disagrees with its word";
    if (n != count_) return "size index: count is wrong";
    return nullptr;
  }

 private:
  [[gnu::noinline]] void reposition_moved(Block& b, unsigned i) noexcept {
    Tree& t = bins_[b.bin];
    auto it = t.iterator_to(b);
    if (i == b.bin) {
      const SizeAddrOrder less;
      const bool after_prev = it == t.begin() || less(*std::prev(it), b);
      const bool before_next = std::next(it) == t.end() || less(b, *std::next(it));
      if (after_prev && before_next) return;
      t.erase(it);
      t.insert_equal(b);
      return;
    }
    unlink(b);
    link(b, i);
  }
  // A class usually holds 0-2 blocks: the lone block is taken out without the general erase, and
  // an empty class's tree gets its root without a search.
  void link(Block& b, unsigned i) noexcept {
    b.bin = static_cast<std::uint16_t>(i);
    Tree& t = bins_[i];
    if (t.empty()) {
      make_root(t, b);
      set_bit(i);
    } else {
      t.insert_equal(b);
    }
  }
  void unlink(Block& b) noexcept {
    Tree& t = bins_[b.bin];
    if (alone(t, b)) {
      make_empty(t);
      bi::rbtree_algorithms<NT>::init(Tree::value_traits::to_node_ptr(b));  // unlinked, as the safe-mode hook expects
      clear_bit(b.bin);
    } else {
      t.erase(t.iterator_to(b));
    }
  }
  // Direct header surgery for the one-node tree (boost::intrusive's layout: the header's parent is
  // the root, its left and right the leftmost and rightmost nodes; an empty tree's header points
  // left and right at itself).
  static bool alone(Tree& t, const Block& b) noexcept { return &*t.begin() == &b && &*t.rbegin() == &b; }
  static void make_empty(Tree& t) noexcept {
    const auto h = t.end().pointed_node();
    NT::set_parent(h, nullptr);
    NT::set_left(h, h);
    NT::set_right(h, h);
  }
  static void make_root(Tree& t, Block& b) noexcept {  // t is empty
    const auto h = t.end().pointed_node();
    const auto n = Tree::value_traits::to_node_ptr(b);
    NT::set_parent(h, n);
    NT::set_left(h, n);
    NT::set_right(h, n);
    NT::set_parent(n, h);
    NT::set_left(n, nullptr);
    NT::set_right(n, nullptr);
    NT::set_color(n, NT::black());
  }

  bool has_bit(unsigned i) const noexcept { return (bits_[i >> 6] >> (i & 63)) & 1u; }
  void set_bit(unsigned i) noexcept {
    bits_[i >> 6] |= std::uint64_t{1} << (i & 63);
    summary_ |= std::uint64_t{1} << (i >> 6);
  }
  void clear_bit(unsigned i) noexcept {
    const unsigned w = i >> 6;
    bits_[w] &= ~(std::uint64_t{1} << (i & 63));
    if (bits_[w] == 0) summary_ &= ~(std::uint64_t{1} << w);
  }
  // First non-empty bin >= i, or -1.
  int next_bin(unsigned i) const noexcept {
    if (i >= kBins) return -1;
    unsigned w = i >> 6;
    const std::uint64_t m = bits_[w] & (~std::uint64_t{0} << (i & 63));
    if (m != 0) return static_cast<int>((w << 6) | static_cast<unsigned>(std::countr_zero(m)));
    const std::uint64_t s = summary_ & (~std::uint64_t{0} << (w + 1));  // w + 1 <= kWords <= 64
    if (s == 0) return -1;
    w = static_cast<unsigned>(std::countr_zero(s));
    return static_cast<int>((w << 6) | static_cast<unsigned>(std::countr_zero(bits_[w])));
  }
  // Last non-empty bin <= i, or -1.
  int prev_bin(int i) const noexcept {
    if (i < 0) return -1;
    unsigned w = static_cast<unsigned>(i) >> 6;
    const std::uint64_t m = bits_[w] & (~std::uint64_t{0} >> (63 - (static_cast<unsigned>(i) & 63)));
    if (m != 0) return static_cast<int>((w << 6) | (63u - static_cast<unsigned>(std::countl_zero(m))));
    const std::uint64_t s = summary_ & ((std::uint64_t{1} << w) - 1);
    if (s == 0) return -1;
    w = 63u - static_cast<unsigned>(std::countl_zero(s));
    return static_cast<int>((w << 6) | (63u - static_cast<unsigned>(std::countl_zero(bits_[w]))));
  }

  std::array<std::uint64_t, kWords> bits_{};
  std::uint64_t summary_ = 0;
  std::size_t count_ = 0;
  std::array<Tree, kBins> bins_;
};

// One SizeIndex per stream, in stream order: PyTorch's (stream, size, address) pool order.
// Streams are few in most programs (one per thread or per CUDA stream in use), so a lookup scans an
// inline array of up to kScan of them and writes nothing. A program with many more (a stream per
// request) finds the rest through a hash table of all entries: a cached allocation on the last of
// 4,000 streams took 1.2 us scanning them all, 0.05 us on the first. The stream order is an
// intrusive tree, so that adding or forgetting one stream among thousands costs O(log streams), not
// a move of every entry after it (a sorted vector: 7.5 us per release_stream among 16,000 streams).
//
// Invariants (check()):
//   - every entry is in `all_` under its stream and in `order_`, which is in strictly increasing
//     stream order
//   - scan_[0, scan_count_) are distinct entries with in_scan set, and no other entry has it;
//     scan_count_ == min(kScan, entries): a program with at most kScan streams finds each by the scan
class StreamIndexes {
  struct Entry {
    driver::stream_t stream = nullptr;
    SizeIndex index;
    bool in_scan = false;
    bi::set_member_hook<bi::link_mode<bi::normal_link>> hook;
  };
  static std::uintptr_t key(driver::stream_t s) noexcept { return reinterpret_cast<std::uintptr_t>(s); }
  struct StreamOrder {
    bool operator()(const Entry& a, const Entry& b) const noexcept { return key(a.stream) < key(b.stream); }
  };
  using Order = bi::set<Entry, bi::member_hook<Entry, bi::set_member_hook<bi::link_mode<bi::normal_link>>, &Entry::hook>,
                        bi::compare<StreamOrder>, bi::constant_time_size<true>>;
  struct ScanSlot {
    driver::stream_t stream;
    Entry* entry;
  };

 public:
  static constexpr std::size_t kScan = 8;
  StreamIndexes() = default;
  StreamIndexes(const StreamIndexes&) = delete;
  StreamIndexes& operator=(const StreamIndexes&) = delete;
  ~StreamIndexes() { order_.clear(); }  // unlinks the entries before all_ deletes them

  // The stream's index, created on first use (may throw std::bad_alloc; nothing else changes).
  SizeIndex& of(driver::stream_t stream) {
    if (SizeIndex* s = find(stream)) return *s;
    return add(stream);
  }
  SizeIndex* find(driver::stream_t stream) noexcept {
    for (std::size_t i = 0; i < scan_count_; ++i)
      if (scan_[i].stream == stream) return &scan_[i].entry->index;
    if (order_.size() == scan_count_) return nullptr;
    const auto it = all_.find(stream);
    return it == all_.end() ? nullptr : &it->second->index;
  }
  std::size_t size() const noexcept {
    std::size_t n = 0;
    for (const Entry& e : order_) n += e.index.size();
    return n;
  }
  // Calls f(SizeIndex&, stream) for every stream in stream order.
  template <class F>
  void for_each_index(F&& f) {
    for (Entry& e : order_) f(e.index, e.stream);
  }
  template <class F>
  void for_each_index(F&& f) const {
    for (const Entry& e : order_) f(static_cast<const SizeIndex&>(e.index), e.stream);
  }
  // Calls f(Block&) for every block, stream by stream, each in (size, address) order; f may erase
  // the block it is given.
  template <class F>
  void for_each_block(F&& f) {
    for (Entry& e : order_) e.index.for_each(f);
  }
  template <class F>
  void for_each_block(F&& f) const {
    for (const Entry& e : order_) static_cast<const SizeIndex&>(e.index).for_each(f);
  }
  void clear() noexcept {
    for (Entry& e : order_) e.index.clear();
  }
  // Forgets the stream's index, which must be empty and named by no segment. O(log streams).
  void erase(driver::stream_t stream) noexcept {
    const auto it = all_.find(stream);
    if (it == all_.end()) return;
    order_.erase(order_.iterator_to(*it->second));
    leave_scan(*it->second);
    all_.erase(it);
  }
  // Forgets, in one pass, every index for which pred(const SizeIndex&, stream) holds (each must be
  // empty and named by no segment). Returns how many.
  template <class P>
  std::size_t erase_if(P&& pred) noexcept {
    std::size_t n = 0;
    for (auto it = order_.begin(); it != order_.end();) {
      Entry& e = *it;
      if (!pred(static_cast<const SizeIndex&>(e.index), e.stream)) {
        ++it;
        continue;
      }
      it = order_.erase(it);
      leave_scan(e);
      all_.erase(e.stream);
      ++n;
    }
    return n;
  }
  std::size_t streams() const noexcept { return order_.size(); }  // indexes held (tests)
  // The invariants above; nullptr when they hold, else what is broken.
  const char* check() const noexcept {
    if (all_.size() != order_.size()) return "stream indexes: the hash table and the stream order disagree";
    const Entry* prev = nullptr;
    std::size_t flagged = 0;
    for (const Entry& e : order_) {
      if (prev != nullptr && key(prev->stream) >= key(e.stream)) return "stream indexes: not in stream order";
      const auto it = all_.find(e.stream);
      if (it == all_.end() || it->second.get() != &e) return "stream indexes: an entry missing from the hash table";
      flagged += e.in_scan ? 1 : 0;
      prev = &e;
    }
    if (scan_count_ != std::min(kScan, order_.size()) || flagged != scan_count_) return "stream indexes: the scan array is not full";
    for (std::size_t i = 0; i < scan_count_; ++i) {
      const auto it = all_.find(scan_[i].stream);
      if (it == all_.end() || it->second.get() != scan_[i].entry || !scan_[i].entry->in_scan)
        return "stream indexes: a scan slot names no entry";
      // Distinct: with a slot twice, a flagged entry in no slot is found by neither the scan nor,
      // once its stream is asked again, anything but a second add.
      for (std::size_t j = 0; j < i; ++j)
        if (scan_[j].entry == scan_[i].entry) return "stream indexes: an entry is in two scan slots";
    }
    return nullptr;
  }

 private:
  [[gnu::noinline]] SizeIndex& add(driver::stream_t stream) {
    auto owned = std::make_unique<Entry>();
    Entry* e = owned.get();
    e->stream = stream;
    all_.emplace(stream, std::move(owned));  // may throw: nothing changed
    order_.insert(*e);
    if (scan_count_ < kScan) {
      e->in_scan = true;
      scan_[scan_count_++] = ScanSlot{stream, e};
    }
    return e->index;
  }
  // Takes `e` (already out of order_) off the scan array, if there, and moves an entry that is not
  // on it into its slot: at most kScan + 1 entries of the stream order are looked at.
  void leave_scan(Entry& e) noexcept {
    if (!e.in_scan) return;
    std::size_t i = 0;
    while (scan_[i].entry != &e) ++i;
    scan_[i] = scan_[--scan_count_];
    e.in_scan = false;
    for (Entry& other : order_) {
      if (other.in_scan) continue;
      other.in_scan = true;
      scan_[scan_count_++] = ScanSlot{other.stream, &other};
      break;
    }
  }

  // all_ owns the entries and outlives order_'s links (the destructor clears order_ first).
  std::unordered_map<driver::stream_t, std::unique_ptr<Entry>> all_;
  Order order_;
  std::array<ScanSlot, kScan> scan_{};
  std::size_t scan_count_ = 0;
};

}  // namespace expseg::core
