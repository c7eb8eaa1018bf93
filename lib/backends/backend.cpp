// The backend interface is header-only (its stat bookkeeping is inline, on the cached path), but for
// the size rounding both backends share.
#include "backends/backend.hpp"

#include <algorithm>
#include <atomic>
#include <bit>
#include <mutex>
#include <new>
#include <unordered_set>

namespace expseg::backends {

namespace {

struct KeyRegistry {
  std::mutex mu;
  // Live threads' keys and graph pools' keys not yet retired: is_retired_key is asked once per
  // cached stream whenever a key retires, so a walk of every thread's key would cost O(threads^2).
  std::unordered_set<std::uintptr_t> live_keys;
  // Live threads' keys live_keys found no host memory for, a list through the keys (walked).
  PerThreadKey* unlisted = nullptr;
  std::uintptr_t next = 1;  // the next key's number (never reused)
  std::atomic<std::uint64_t> generation{0};
  std::uint64_t lookup_steps = 0;  // retired_key_lookup_steps()
};

// Never destroyed: threads may exit, and retire their keys, during static destruction.
KeyRegistry& key_registry() noexcept {
  alignas(KeyRegistry) static unsigned char storage[sizeof(KeyRegistry)];
  static KeyRegistry* const r = ::new (storage) KeyRegistry;
  return *r;
}

}  // namespace

PerThreadKey::PerThreadKey() noexcept {
  KeyRegistry& r = key_registry();
  std::lock_guard lock(r.mu);
  key_ = kPerThreadKeyTag | r.next++;
  try {
    r.live_keys.insert(key_);
  } catch (...) {  // no host memory: listed where no allocation is needed
    next_ = r.unlisted;
    if (next_) next_->prev_ = this;
    r.unlisted = this;
  }
}

PerThreadKey::~PerThreadKey() {
  KeyRegistry& r = key_registry();
  std::lock_guard lock(r.mu);
  if (r.live_keys.erase(key_) == 0) {  // on the unlisted list
    if (prev_) prev_->next_ = next_;
    else r.unlisted = next_;
    if (next_) next_->prev_ = prev_;
  }
  r.generation.fetch_add(1, std::memory_order_release);
}

// The key of the calling thread's per-thread default stream (see kPerThreadStream), never
// reused: a later thread does not inherit cached memory another thread's stream may still use. The
// thread's exit retires it (PerThreadKey), and the backends give back its cached memory.
// The value lives apart from the object that retires it: a trivially destructible thread_local stays
// readable after the thread's other thread_local objects are destroyed, so a user's thread_local
// destructor that allocates on cudaStreamPerThread after `retire`'s destructor ran gets the (now
// retired) key instead of reading a destroyed object; the backends give back that memory once free.
namespace {
thread_local std::uintptr_t t_per_thread_key = 0;
}  // namespace

[[gnu::noinline, gnu::cold]] driver::stream_t per_thread_key() noexcept {
  if (t_per_thread_key == 0) {
    thread_local const PerThreadKey retire;
    t_per_thread_key = reinterpret_cast<std::uintptr_t>(retire.stream());
  }
  return reinterpret_cast<driver::stream_t>(t_per_thread_key);
}

driver::stream_t calling_thread_key() noexcept { return reinterpret_cast<driver::stream_t>(t_per_thread_key); }

std::uint64_t retired_keys_generation() noexcept { return key_registry().generation.load(std::memory_order_acquire); }

driver::stream_t new_graph_pool_key() {
  KeyRegistry& r = key_registry();
  std::lock_guard lock(r.mu);
  const std::uintptr_t key = kPerThreadKeyTag | kGraphPoolBit | r.next;
  r.live_keys.insert(key);  // may throw bad_alloc: nothing handed out
  ++r.next;
  return reinterpret_cast<driver::stream_t>(key);
}

void retire_graph_pool_key(driver::stream_t key) noexcept {
  KeyRegistry& r = key_registry();
  std::lock_guard lock(r.mu);
  r.live_keys.erase(reinterpret_cast<std::uintptr_t>(key));
  r.generation.fetch_add(1, std::memory_order_release);
}

bool is_retired_key(driver::stream_t key) noexcept {
  const auto v = reinterpret_cast<std::uintptr_t>(key);
  KeyRegistry& r = key_registry();
  std::lock_guard lock(r.mu);
  if ((v & ~(kPerThreadKeyTag | kGraphPoolBit)) >= r.next) return false;  // not handed out yet
  ++r.lookup_steps;
  if (r.live_keys.contains(v)) return false;
  if ((v & kGraphPoolBit) != 0) return true;
  for (const PerThreadKey* k = r.unlisted; k != nullptr; k = k->next_) {
    ++r.lookup_steps;
    if (k->key_ == v) return false;
  }
  return true;
}

std::uint64_t retired_key_lookup_steps() noexcept {
  KeyRegistry& r = key_registry();
  std::lock_guard lock(r.mu);
  return r.lookup_steps;
}

namespace {

// PyTorch's roundup_power2_next_division: split [2^k, 2^(k+1)) into `divisions` equal steps.
std::size_t roundup_power2_next_division(std::size_t size, std::size_t divisions) noexcept {
  if (std::has_single_bit(size)) return size;
  const std::size_t power2_floor = std::bit_floor(size);
  const std::size_t power2_division = power2_floor >> (std::bit_width(divisions) - 1);
  if (power2_division == 0) return power2_floor << 1;
  const std::size_t round_size_floor = size & ~(power2_division - 1);
  return round_size_floor == size ? size : round_size_floor + power2_division;
}

// PyTorch's CUDAAllocatorConfig::roundup_power2_divisions(size): intervals start at 1 MiB.
std::size_t divisions_for(const Config& c, std::size_t size) noexcept {
  const int log_size = std::bit_width(size) - 1;
  int index = log_size - 20;
  if (index < 0) index = 0;
  if (index > static_cast<int>(kRoundupIntervals) - 1) index = kRoundupIntervals - 1;
  return c.roundup_power2_divisions[static_cast<std::size_t>(index)];
}

}  // namespace

std::size_t roundup_power2_divisions_size(const Config& c, std::size_t size, std::size_t min_block) noexcept {
  const std::size_t divisions = divisions_for(c, size);
  if (divisions <= 1) return 0;
  // PyTorch's test, its wrap included: the config accepts any power of two up to 2^63, as PyTorch
  // does, and from 2^55 divisions the product wraps to 0, so that PyTorch rounds every size up to
  // the next power of two (roundup_power2_next_division's power2_division is 0 then).
  if (size > min_block * divisions) return roundup_power2_next_division(size, divisions);
  return 0;
}

bool has_roundup_power2_divisions(const Config& c) noexcept {
  for (std::size_t d : c.roundup_power2_divisions)
    if (d > 1) return true;
  return false;
}

}  // namespace expseg::backends
