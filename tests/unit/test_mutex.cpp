// core::Mutex, the allocator's lock: mutual exclusion under contention, including the path where
// waiters give up spinning and sleep (held across a long call, as during a driver call).
#include <doctest/doctest.h>

#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "core/mutex.hpp"

TEST_SUITE("core") {

TEST_CASE("mutex: threads that spin and threads that sleep all get the lock, one at a time") {
  expseg::core::Mutex mu;
  long counter = 0;       // plain: a lost update means two holders at once
  int inside = 0;         // holders right now
  int max_inside = 0;
  constexpr int kThreads = 8;
  constexpr int kRounds = 2000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kRounds; ++i) {
        std::lock_guard<expseg::core::Mutex> lock(mu);
        ++inside;
        if (inside > max_inside) max_inside = inside;
        ++counter;
        // Now and then hold it for long enough (2 ms) that waiters exhaust their spins (~0.5 ms) and sleep.
        if (i % 500 == t) std::this_thread::sleep_for(std::chrono::milliseconds(2));
        --inside;
      }
    });
  }
  for (std::thread& th : threads) th.join();
  CHECK(counter == long{kThreads} * kRounds);
  CHECK(max_inside == 1);
  CHECK(mu.try_lock());
  CHECK_FALSE(mu.try_lock());
  mu.unlock();
}

}  // TEST_SUITE
