// core::SizeIndex, the binned best-fit index both backends use: checked against a std::set in
// (size, address) order under random inserts, erases, in-place key changes and node hand-overs.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "core/give_back.hpp"
#include "core/size_index.hpp"

using expseg::core::Block;
using expseg::core::SizeIndex;
using expseg::core::StreamIndexes;

namespace {

using Key = std::pair<std::size_t, std::uint64_t>;  // (size, address)

struct Model {
  SizeIndex index;
  std::set<Key> keys;

  void check() const {
    const char* why = index.check();
    REQUIRE_MESSAGE(why == nullptr, (why ? why : ""));
    REQUIRE(index.size() == keys.size());
    std::vector<Key> walked;
    for (const Block* b = index.first(); b != nullptr; b = index.next(*b)) walked.emplace_back(b->size, b->addr);
    REQUIRE(walked == std::vector<Key>(keys.begin(), keys.end()));
  }
  const Block* expected_fit(std::size_t size) const {
    auto it = keys.lower_bound(Key{size, 0});
    return it == keys.end() ? nullptr : reinterpret_cast<const Block*>(it->second);  // address = Block*
  }
};

}  // namespace

TEST_SUITE("core") {

TEST_CASE("size index: size classes are monotonic, 8 per power of two, and a whole 2^k shares the class below it") {
  unsigned prev = 0;
  for (std::size_t s = 1; s < 100000; ++s) {
    const unsigned b = SizeIndex::bin_of(s);
    CHECK(b >= prev);
    prev = b;
  }
  for (unsigned k = 4; k < 63; ++k) {
    const std::size_t p = std::size_t{1} << k;
    CHECK(SizeIndex::bin_of(p) == SizeIndex::bin_of(p - p / 16 + 1));  // (15/16 * 2^k, 2^k] is one class
    CHECK(SizeIndex::bin_of(p - p / 16) == SizeIndex::bin_of(p) - 1);
    CHECK(SizeIndex::bin_of(p + 1) == SizeIndex::bin_of(p) + 1);
  }
  CHECK(SizeIndex::bin_of(~std::size_t{0}) == SizeIndex::kBins - 1);
}

TEST_CASE("size index: best fit, order and neighbours match a sorted set under random operations") {
  // Addresses are the Block objects' own addresses, so the model can name the block it expects.
  std::deque<Block> storage(3000);
  std::vector<Block*> in, out;
  for (Block& b : storage) out.push_back(&b);
  Model m;
  std::mt19937_64 rng(7);
  auto random_size = [&] {
    switch (rng() % 4) {
      case 0: return std::size_t{512} * (1 + rng() % 8);                   // a few equal small sizes
      case 1: return std::size_t{2} << 20;                                 // whole 2 MiB segments
      case 2: return (std::size_t{1} << (9 + rng() % 25)) + rng() % 4096;  // anywhere up to 16 GiB
      default: return std::size_t{1} + rng() % 5000;                       // tiny, unaligned
    }
  };
  auto take = [&](std::vector<Block*>& from) {
    const std::size_t k = rng() % from.size();
    Block* b = from[k];
    from[k] = from.back();
    from.pop_back();
    return b;
  };
  for (int step = 0; step < 40000; ++step) {
    const unsigned op = static_cast<unsigned>(rng() % 10);
    if (op < 4 && !out.empty()) {  // insert
      Block* b = take(out);
      b->size = random_size();
      b->addr = reinterpret_cast<std::uint64_t>(b);
      m.index.insert(*b);
      m.keys.insert({b->size, b->addr});
      in.push_back(b);
    } else if (op < 6 && !in.empty()) {  // erase
      Block* b = take(in);
      m.index.erase(*b);
      m.keys.erase({b->size, b->addr});
      CHECK_FALSE(b->free_hook.is_linked());
      out.push_back(b);
    } else if (op < 8 && !in.empty()) {  // key changes in place (a split remainder, a merge)
      Block* b = in[rng() % in.size()];
      m.keys.erase({b->size, b->addr});
      b->size = rng() % 2 ? std::max<std::size_t>(1, b->size - std::min(b->size - 1, random_size())) : b->size + random_size();
      m.keys.insert({b->size, b->addr});
      m.index.reposition(*b);
    } else if (op < 9 && !in.empty() && !out.empty()) {  // a new block takes a linked block's node
      Block* old = take(in);
      Block* b = take(out);
      m.keys.erase({old->size, old->addr});
      b->size = old->size + random_size();
      b->addr = reinterpret_cast<std::uint64_t>(b);
      m.index.replace(*old, *b);
      m.index.reposition(*b);
      m.keys.insert({b->size, b->addr});
      CHECK_FALSE(old->free_hook.is_linked());
      in.push_back(b);
      out.push_back(old);
    } else {  // lookups
      const std::size_t want = random_size();
      REQUIRE(m.index.lower_bound(want) == m.expected_fit(want));
      if (!in.empty()) {
        Block* b = in[rng() % in.size()];
        auto it = m.keys.find({b->size, b->addr});
        const Block* after = std::next(it) == m.keys.end() ? nullptr : reinterpret_cast<const Block*>(std::next(it)->second);
        const Block* before = it == m.keys.begin() ? nullptr : reinterpret_cast<const Block*>(std::prev(it)->second);
        REQUIRE(m.index.next(*b) == after);
        REQUIRE(m.index.prev(*b) == before);
      }
    }
    if (step % 1000 == 0) m.check();
  }
  m.check();
  REQUIRE(m.index.first() == (m.keys.empty() ? nullptr : reinterpret_cast<Block*>(m.keys.begin()->second)));
  REQUIRE(m.index.last() == (m.keys.empty() ? nullptr : reinterpret_cast<Block*>(m.keys.rbegin()->second)));
  m.index.clear();
  for (Block* b : in) CHECK_FALSE(b->free_hook.is_linked());
  CHECK(m.index.empty());
  CHECK(m.index.first() == nullptr);
  CHECK(m.index.check() == nullptr);
}

TEST_CASE("size index: a lone block moving between empty classes keeps a valid tree (the cached pair's path)") {
  SizeIndex index;
  Block seg, other;
  seg.addr = 0x1000;
  seg.size = std::size_t{2} << 20;
  index.insert(seg);
  for (int i = 0; i < 3; ++i) {
    seg.size = std::size_t{1} << 20;  // a 1 MiB allocation left a 1 MiB remainder
    index.reposition(seg);
    CHECK(index.check() == nullptr);
    CHECK(index.lower_bound(std::size_t{1} << 20) == &seg);
    CHECK(index.lower_bound((std::size_t{1} << 20) + 1) == nullptr);
    seg.size = std::size_t{2} << 20;  // merged back
    index.reposition(seg);
    CHECK(index.check() == nullptr);
    CHECK(index.lower_bound((std::size_t{1} << 20) + 1) == &seg);
  }
  other.addr = 0x100000000;
  other.size = 3 << 20;
  index.insert(other);  // an insert after the lone moves still builds a proper tree
  CHECK(index.check() == nullptr);
  CHECK(index.next(seg) == &other);
  CHECK(index.prev(other) == &seg);
  index.erase(seg);
  CHECK_FALSE(seg.free_hook.is_linked());
  CHECK(index.first() == &other);
  CHECK(index.check() == nullptr);
  index.erase(other);
  CHECK(index.empty());
  CHECK(index.check() == nullptr);
}

TEST_CASE("size index: check() reports a key changed in place without reposition") {
  SizeIndex index;
  Block a, b;
  a.addr = 0x1000;
  a.size = 4096;
  b.addr = 0x2000;
  b.size = 1 << 20;
  index.insert(a);
  index.insert(b);
  REQUIRE(index.check() == nullptr);
  a.size = 2 << 20;  // changed class, not repositioned
  CHECK(index.check() != nullptr);
  index.reposition(a);
  CHECK(index.check() == nullptr);
  CHECK(index.first() == &b);
  index.clear();
}

TEST_CASE("stream indexes: one index per stream, iterated in stream order") {
  StreamIndexes s;
  auto* s2 = reinterpret_cast<expseg::driver::stream_t>(0x200);
  auto* s1 = reinterpret_cast<expseg::driver::stream_t>(0x100);
  CHECK(s.find(s1) == nullptr);
  SizeIndex& i2 = s.of(s2);
  SizeIndex& i1 = s.of(s1);
  CHECK(&s.of(s2) == &i2);
  CHECK(s.find(s1) == &i1);
  Block a, b;
  a.size = b.size = 512;
  a.addr = 1;
  b.addr = 2;
  i2.insert(a);
  i1.insert(b);
  CHECK(s.size() == 2);
  std::vector<expseg::driver::stream_t> order;
  s.for_each_index([&](SizeIndex&, expseg::driver::stream_t st) { order.push_back(st); });
  CHECK(order == std::vector<expseg::driver::stream_t>{s1, s2});
  s.clear();
  CHECK(s.size() == 0);
  CHECK(s.check() == nullptr);
}

TEST_CASE("stream indexes: thousands of streams added and forgotten in random order, checked against a std::set") {
  // A stream per request: streams come and go among thousands that stay. Every step checks the
  // invariants (the scan array stays full while there are streams to fill it), and every stream
  // held is found, every forgotten one not, in stream order.
  StreamIndexes s;
  std::set<std::uintptr_t> model;
  std::mt19937_64 rng(7);
  auto stream = [](std::uintptr_t k) { return reinterpret_cast<expseg::driver::stream_t>(k); };
  auto check_all = [&] {
    const char* why = s.check();
    REQUIRE_MESSAGE(why == nullptr, (why ? why : ""));
    REQUIRE(s.streams() == model.size());
    std::vector<std::uintptr_t> order;
    s.for_each_index([&](SizeIndex&, expseg::driver::stream_t st) { order.push_back(reinterpret_cast<std::uintptr_t>(st)); });
    REQUIRE(order == std::vector<std::uintptr_t>(model.begin(), model.end()));
  };
  for (int step = 0; step < 20000; ++step) {
    const std::uintptr_t k = 16 * (1 + rng() % 6000);
    const int what = static_cast<int>(rng() % 10);
    if (what < 6) {
      SizeIndex& idx = s.of(stream(k));
      CHECK(s.find(stream(k)) == &idx);
      model.insert(k);
    } else if (what < 9) {
      s.erase(stream(k));
      model.erase(k);
      CHECK(s.find(stream(k)) == nullptr);
    } else {
      // Forget every stream in a band of addresses in one pass (release_cached's prune).
      const std::uintptr_t lo = k, hi = k + 16 * 40;
      const std::size_t n = s.erase_if([&](const SizeIndex&, expseg::driver::stream_t st) {
        const auto v = reinterpret_cast<std::uintptr_t>(st);
        return v >= lo && v < hi;
      });
      std::size_t expected = 0;
      for (auto it = model.lower_bound(lo); it != model.end() && *it < hi;) {
        it = model.erase(it);
        ++expected;
      }
      CHECK(n == expected);
    }
    if (step % 997 == 0 || model.size() <= StreamIndexes::kScan + 1) check_all();
  }
  check_all();
  for (std::uintptr_t k = 16; k <= 16 * 6000; k += 16) CHECK((s.find(stream(k)) != nullptr) == model.contains(k));
  // Down to a handful: every stream left is on the scan array (found without the hash table).
  while (model.size() > 3) {
    s.erase(stream(*model.begin()));
    model.erase(model.begin());
  }
  check_all();
  for (std::uintptr_t k : model) CHECK(s.find(stream(k)) != nullptr);
}

}  // TEST_SUITE

// ---- core::pick_give_back (what a lower limit gives back) ----------------------------------------

TEST_CASE("pick_give_back: the least memory beyond the excess, then the fewest pieces") {
  using expseg::core::pick_give_back;
  using V = std::vector<std::size_t>;
  auto total = [](const V& sizes, const V& picked) {
    std::size_t t = 0;
    for (std::size_t i : picked) t += sizes.at(i);
    return t;
  };
  // One piece covers the excess more tightly than packing: 60 of {400, 60, 40} for 50 (packing
  // would take 40, then 60 for the rest: 100).
  CHECK(pick_give_back({400, 60, 40}, 50) == V{1});
  // Packing is tighter: 32 + 16 + 2 for 50, where the one piece that covers is 256.
  const V handles{2, 256, 2, 16, 2, 32, 8};
  const V picked = pick_give_back(handles, 50);
  CHECK(total(handles, picked) == 50);
  CHECK(picked.size() == 3);
  // An exact single piece beats an exact packing of two.
  CHECK(pick_give_back({30, 20, 50}, 50) == V{2});
  // Nothing to give back, and not enough to cover: everything.
  CHECK(pick_give_back({10, 20}, 0).empty());
  const V all = pick_give_back({10, 20, 5}, 100);
  CHECK(all.size() == 3);
  CHECK(pick_give_back({}, 10).empty());
  // Packing leaves a rest that only a large piece covers, and the single is that piece: the single.
  CHECK(pick_give_back({100, 45}, 50) == V{0});
}

TEST_CASE("pick_give_back: among pieces of one size, the earliest listed goes") {
  using V = std::vector<std::size_t>;
  CHECK(expseg::core::pick_give_back({2, 2, 2}, 2) == V{0});
  CHECK(expseg::core::pick_give_back({4, 2, 2, 2}, 3) == V{0});
  CHECK(expseg::core::pick_give_back({8, 2, 8}, 7) == V{0});
}
