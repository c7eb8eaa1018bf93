// The allocator's lock: one per device allocator, held only for the free-index update on the
// cached path. Uncontended lock+unlock is one compare-exchange and one exchange (a pthread mutex
// costs ~100 instructions per pair, as much as the rest of a cached allocation). Contended, it
// spins briefly (the critical section is tens of nanoseconds) and then sleeps in the kernel
// through C++20 atomic wait/notify (a futex on Linux), so preempted holders do not burn cores.
#pragma once

#include <atomic>

namespace expseg::core {

class Mutex {
 public:
  void lock() noexcept {
    int expected = kUnlocked;
    if (state_.compare_exchange_strong(expected, kLocked, std::memory_order_acquire, std::memory_order_relaxed)) return;
    lock_slow();
  }
  bool try_lock() noexcept {
    int expected = kUnlocked;
    return state_.compare_exchange_strong(expected, kLocked, std::memory_order_acquire, std::memory_order_relaxed);
  }
  void unlock() noexcept {
    if (state_.exchange(kUnlocked, std::memory_order_release) == kContended) state_.notify_one();
  }

 private:
  static constexpr int kUnlocked = 0;
  static constexpr int kLocked = 1;     // held, nobody sleeping
  static constexpr int kContended = 2;  // held, somebody may be sleeping

  void lock_slow() noexcept {
    for (int spin = 0; spin < 128; ++spin) {
      if (state_.load(std::memory_order_relaxed) == kUnlocked) {
        int expected = kUnlocked;
        if (state_.compare_exchange_weak(expected, kLocked, std::memory_order_acquire, std::memory_order_relaxed)) return;
      }
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#elif defined(__aarch64__)
      asm volatile("yield");
#endif
    }
    // Announce a sleeper; whoever unlocks sees kContended and wakes one.
    while (state_.exchange(kContended, std::memory_order_acquire) != kUnlocked) state_.wait(kContended, std::memory_order_relaxed);
  }

  std::atomic<int> state_{kUnlocked};
};

}  // namespace expseg::core
