// The allocator's lock: one per device allocator, held only for the free-index update on the
// cached path. Uncontended lock+unlock is one compare-exchange and one plain store (a pthread
// mutex costs ~100 instructions per pair, as much as the rest of a cached allocation).
//
// Contended, it spins (the critical section is a few hundred nanoseconds, so the holder is usually
// done long before a sleep and a wake-up would be) and only then sleeps in the kernel (a futex on
// Linux), so preempted holders do not burn cores. Sleepers are counted apart from the lock word:
// unlock() makes a system call only when a thread is actually asleep. (A lock word that also means
// "somebody may sleep" makes every unlock under contention pay a futex wake, and the threads then
// queue on the kernel instead of the lock.)
//
// unlock() is a release store, not a locked instruction: it then reads the sleeper count without
// a fence, so it can miss a thread that is just falling asleep. Sleepers therefore sleep at most
// kSleepSlice and look again: a missed wake-up costs that much latency, never progress. (A
// sequentially consistent unlock, an exchange, costs ~2.5 ns more per lock+unlock on every call,
// contended or not, to save a rare wait.)
#pragma once

#include <atomic>
#include <chrono>
#include <thread>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <ctime>
#endif

namespace expseg::core {

class Mutex {
 public:
  // Always inlined: the cached path's lock+unlock are a few instructions here, and GCC at times
  // leaves unlock() out of line (a call and return per free and per allocation).
  [[gnu::always_inline]] void lock() noexcept {
    int expected = 0;
    if (locked_.compare_exchange_strong(expected, 1, std::memory_order_acquire, std::memory_order_relaxed)) return;
    lock_slow();
  }
  bool try_lock() noexcept {
    int expected = 0;
    return locked_.compare_exchange_strong(expected, 1, std::memory_order_acquire, std::memory_order_relaxed);
  }
  [[gnu::always_inline]] void unlock() noexcept {
    locked_.store(0, std::memory_order_release);
    if (sleepers_.load(std::memory_order_relaxed) != 0) wake_one();
  }

 private:
  // Pause iterations before sleeping (~0.5 ms on the H200 host's Xeon). Measured there, 16 threads
  // churning on their own streams, split_merge: 128 -> 2,632 ns per step (all threads), 1024 ->
  // 2,403, 16384 -> 1,740; the threads rarely sleep, so unlock rarely wakes anyone.
  static constexpr int kSpinLimit = 16384;
  // The longest wait between two looks at the lock (~40 us on the H200 host). Measured there, 16
  // threads on their own streams, all threads' ns per churn step (split_merge / expandable): one
  // pause between looks 1,644 / 1,650; backoff up to 64 pauses 1,154 / 1,245; 256: 1,106 / 1,063;
  // 1,024: 1,010 / 1,030, and with the lock and the live map's size on lines of their own 804 / 782.
  // Waiting threads see a longer tail, as with a sleeping mutex's wake-up latency.
  static constexpr int kMaxBackoff = 1024;
  // The longest sleep before a sleeper looks at the lock again (bounds a missed wake-up).
  static constexpr long kSleepSliceNs = 200'000;

  static void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }

  void lock_slow() noexcept {
    // Test-and-test-and-set with exponential backoff: after each failed look, wait twice as long
    // (up to kMaxBackoff pauses) before looking again, so that a released lock is not stormed by
    // every waiter at once and its last holder often takes it again with the data still in its
    // cache.
    int backoff = 1;
    for (int spin = 0; spin < kSpinLimit; spin += backoff) {
      if (locked_.load(std::memory_order_relaxed) == 0) {
        int expected = 0;
        if (locked_.compare_exchange_weak(expected, 1, std::memory_order_acquire, std::memory_order_relaxed)) return;
      }
      for (int i = 0; i < backoff; ++i) cpu_relax();
      if (backoff < kMaxBackoff) backoff *= 2;
    }
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    for (;;) {
      int expected = 0;
      if (locked_.compare_exchange_strong(expected, 1, std::memory_order_seq_cst, std::memory_order_relaxed)) break;
      sleep_while_locked();
    }
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
  }

#if defined(__linux__)
  // std::atomic<int> is a plain int in memory (the futex word), as C++20 atomic wait relies on too.
  int* word() noexcept { return reinterpret_cast<int*>(&locked_); }
  void sleep_while_locked() noexcept {  // returns at once if the lock word is no longer 1
    const timespec slice{0, kSleepSliceNs};
    syscall(SYS_futex, word(), FUTEX_WAIT_PRIVATE, 1, &slice, nullptr, 0);
  }
  void wake_one() noexcept { syscall(SYS_futex, word(), FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0); }
#else
  void sleep_while_locked() noexcept {
    if (locked_.load(std::memory_order_relaxed) != 0) std::this_thread::sleep_for(std::chrono::nanoseconds(kSleepSliceNs));
  }
  void wake_one() noexcept {}
#endif

  static_assert(sizeof(std::atomic<int>) == sizeof(int) && std::atomic<int>::is_always_lock_free);
  std::atomic<int> locked_{0};
  std::atomic<int> sleepers_{0};
};

// std::lock_guard for the cached paths: GCC at times leaves lock_guard's destructor out of line
// (callgrind: 6 more instructions per free).
class LockGuard {
 public:
  [[gnu::always_inline]] explicit LockGuard(Mutex& m) noexcept : m_(m) { m_.lock(); }
  [[gnu::always_inline]] ~LockGuard() { m_.unlock(); }
  LockGuard(const LockGuard&) = delete;
  LockGuard& operator=(const LockGuard&) = delete;

 private:
  Mutex& m_;
};

}  // namespace expseg::core
