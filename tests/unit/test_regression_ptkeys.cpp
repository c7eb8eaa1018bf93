// Memory cached for the per-thread default streams of threads that have exited. cudaStreamPerThread
// (0x2) is the calling thread's own stream (a key never reused): once the thread is gone nothing
// can allocate on that stream again, so memory cached for it must not stay there for good.
#include <doctest/doctest.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "allocator_impl.hpp"
#include "driver/sim_driver.hpp"
#include "test_util.hpp"

using namespace testutil;
using expseg::BackendKind;
using expseg::kAllPools;

namespace {

std::int64_t reserved(expseg::Allocator& a) { return a.stats().reserved_bytes[kAllPools].current; }

}  // namespace

TEST_SUITE("regression-ptkeys") {

TEST_CASE("per-thread stream: short-lived threads do not grow reserved memory without bound") {
  // A pool of short-lived workers, each allocating on cudaStreamPerThread, freeing and exiting.
  void* const per_thread = stream_id(2);
  for (BackendKind kind : {BackendKind::split_merge, BackendKind::expandable}) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    auto sa = make_sim_allocator(sim_config(kind));
    auto worker = [&] {
      std::thread([&] {
        void* p = sa->allocate(8 * MiB, per_thread);
        void* q = sa->allocate(100 * KiB, per_thread);
        sa->deallocate(p);
        sa->deallocate(q);
      }).join();
    };
    worker();
    const std::int64_t one = reserved(*sa);
    REQUIRE(one > 0);
    for (int i = 0; i < 16; ++i) worker();
    // The last worker's memory may still be cached (nothing has looked since it exited); every
    // earlier worker's was given back when the next one needed memory.
    CHECK(reserved(*sa) <= 2 * one);
    sa->validate();
    // release_cached gives back everything cached for exited threads, address ranges included.
    sa->release_cached();
    CHECK(reserved(*sa) == 0);
    CHECK(sa->stats().segment[kAllPools].current == 0);
    CHECK(sa->snapshot().segments.empty());
    sa->validate();
    sa.alloc.reset();
    CHECK(sa.sim->live().reservations == 0);
    CHECK(sa.sim->live().handles == 0);
    CHECK(sa.sim->live().mem_allocs == 0);
  }
}

TEST_CASE("per-thread stream: an exited thread's memory is given back only after its queued work") {
  // The thread queued a kernel on its per-thread stream that uses the block, freed it and exited.
  // That stream cannot be synchronized from another thread: a device synchronization must come
  // before the memory is unmapped (the simulated device records an unmap under queued work).
  void* const per_thread = stream_id(2);
  for (BackendKind kind : {BackendKind::split_merge, BackendKind::expandable}) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    auto sa = make_sim_allocator(sim_config(kind));
    std::thread([&] {
      void* p = sa->allocate(60 * MiB, per_thread);
      sa.sim->set_stream_busy(per_thread, true);
      sa.sim->queue_use(per_thread, addr(p), 60 * MiB);
      sa->deallocate(p);
    }).join();
    void* s1 = sa.sim->stream_create();
    void* q = sa->allocate(60 * MiB, s1);  // a miss: the exited thread's memory goes back first
    CHECK(sa.sim->hazards().empty());
    CHECK(reserved(*sa) <= static_cast<std::int64_t>(64 * MiB));  // the new block's memory only
    sa->deallocate(q);
    sa->validate();
    sa.sim->set_stream_busy(per_thread, false);
    sa.alloc.reset();
    CHECK(sa.sim->hazards().empty());
    sa.sim->stream_destroy(s1);
  }
}

TEST_CASE("per-thread stream: another thread's idle memory is taken back after the legacy stream's synchronization") {
  // The legacy stream's synchronization waits for every thread's per-thread stream (they block),
  // not for non-blocking streams (every stream the program creates here), and is permitted while a
  // non-blocking stream captures: a device synchronization would wait for the bystander's work and
  // invalidate a capture expseg was not told of.
  void* const per_thread = stream_id(2);
  for (const bool capture : {false, true}) {
    CAPTURE(capture);
    auto sa = make_sim_allocator(sim_config(BackendKind::expandable));
    std::thread([&] {
      void* p = sa->allocate(60 * MiB, per_thread);
      sa.sim->set_stream_busy(per_thread, true);  // this thread's kernel still uses p as it exits
      sa.sim->queue_use(per_thread, addr(p), 60 * MiB);
      sa->deallocate(p);
    }).join();
    void* bystander = sa.sim->stream_create();
    auto* event = sa.sim->event_create();
    sa.sim->set_stream_busy(bystander, true);
    sa.sim->event_record(event, bystander);
    void* capturing = sa.sim->stream_create();
    if (capture) sa.sim->capture_begin(capturing);
    void* s1 = sa.sim->stream_create();
    void* q = sa->allocate(60 * MiB, s1);  // a miss: the exited thread's memory goes back first
    CHECK(sa.sim->hazards().empty());
    CHECK(reserved(*sa) <= static_cast<std::int64_t>(64 * MiB));
    CHECK_FALSE(sa.sim->event_query(event));  // the bystander's work was not waited for
    if (capture) CHECK_NOTHROW(sa.sim->graph_destroy(sa.sim->capture_end(capturing)));
    sa->deallocate(q);
    sa->validate();
    sa.sim->set_stream_busy(bystander, false);
    sa.alloc.reset();
    CHECK(sa.sim->hazards().empty());
    sa.sim->event_destroy(event);
    for (void* s : {bystander, capturing, s1}) sa.sim->stream_destroy(s);
  }
}

TEST_CASE("per-thread stream: a thread's own idle memory is taken back after its own stream's synchronization") {
  // Under a limit a thread's request on cudaStreamPerThread unmaps idle memory of its own stream:
  // waiting for that stream is enough, another thread's per-thread stream (which the legacy
  // stream's synchronization would wait for) is not waited for.
  void* const per_thread = stream_id(2);
  auto sa = make_sim_allocator(sim_config(BackendKind::expandable, 80 * GiB, "limit:100MiB"));
  auto* theirs = sa.sim->event_create();
  std::thread([&] {  // another thread's kernel, still queued on its per-thread stream
    sa.sim->set_stream_busy(per_thread, true);
    sa.sim->event_record(theirs, per_thread);
  }).join();
  std::thread([&] {
    void* p = sa->allocate(60 * MiB, per_thread);
    void* q = sa->allocate(30 * MiB, per_thread);
    sa.sim->set_stream_busy(per_thread, true);
    sa.sim->queue_use(per_thread, addr(p), 60 * MiB);
    sa->deallocate(p);
    void* r = sa->allocate(64 * MiB, per_thread);  // fits only with p's pages unmapped
    CHECK(sa.sim->hazards().empty());
    CHECK(reserved(*sa) <= static_cast<std::int64_t>(100 * MiB));
    CHECK_FALSE(sa.sim->event_query(theirs));
    sa->deallocate(q);
    sa->deallocate(r);
    sa->validate();
    sa.sim->set_stream_busy(per_thread, false);
  }).join();
  sa.alloc.reset();
  CHECK(sa.sim->hazards().empty());
  sa.sim->event_destroy(theirs);
}

TEST_CASE("per-thread stream: a block an exited thread allocated is given back once freed elsewhere") {
  // A loader thread allocates on its per-thread stream, hands the memory over and exits; another
  // thread frees it later. It went back to the exited thread's cache, which no one can use.
  void* const per_thread = stream_id(2);
  for (BackendKind kind : {BackendKind::split_merge, BackendKind::expandable}) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    auto sa = make_sim_allocator(sim_config(kind));
    void* p = nullptr;
    std::thread([&] { p = sa->allocate(40 * MiB, per_thread); }).join();
    void* s1 = sa.sim->stream_create();
    void* q = sa->allocate(40 * MiB, s1);  // a miss while p lives: its memory must stay
    sa->validate();
    sa->deallocate(p);
    void* r = sa->allocate(40 * MiB, s1);  // another miss: p's memory goes back first
    CHECK(reserved(*sa) <= static_cast<std::int64_t>(2 * 42 * MiB));
    sa->deallocate(q);
    sa->deallocate(r);
    sa->validate();
    sa->release_cached();
    CHECK(reserved(*sa) == 0);
    sa->validate();
    sa.alloc.reset();
    sa.sim->stream_destroy(s1);
  }
}

TEST_CASE("per-thread stream: allocators destroyed before and after the threads that used them exit") {
  void* const per_thread = stream_id(2);
  for (BackendKind kind : {BackendKind::split_merge, BackendKind::expandable}) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    auto early = make_sim_allocator(sim_config(kind));
    auto late = make_sim_allocator(sim_config(kind));
    bool used = false;
    bool go = false;
    std::mutex mu;
    std::condition_variable cv;
    std::thread t([&] {
      void* p = early->allocate(MiB, per_thread);
      early->deallocate(p);
      void* q = late->allocate(MiB, per_thread);
      late->deallocate(q);
      std::unique_lock lock(mu);
      used = true;
      cv.notify_all();
      cv.wait(lock, [&] { return go; });
    });
    {
      std::unique_lock lock(mu);
      cv.wait(lock, [&] { return used; });
    }
    early.alloc.reset();  // destroyed while the thread lives
    {
      std::lock_guard lock(mu);
      go = true;
    }
    cv.notify_all();
    t.join();
    void* r = late->allocate(MiB, nullptr);  // a miss after the exit
    late->deallocate(r);
    late->release_cached();
    CHECK(reserved(*late) == 0);
    late->validate();
    late.alloc.reset();
    CHECK(early.sim->live().reservations == 0);
    CHECK(late.sim->live().reservations == 0);
  }
}

TEST_CASE("per-thread stream: the event queues of exited threads' streams do not pile up") {
  // Each worker uses a block on its per-thread stream (record_stream) and exits; the block's free
  // waits for that stream's event in a queue of its own. The queues of exited threads must not
  // stay: allocations walk every queue while any free is pending.
  void* const per_thread = stream_id(2);
  for (BackendKind kind : {BackendKind::split_merge, BackendKind::expandable}) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    auto sa = make_sim_allocator(sim_config(kind));
    void* s1 = sa.sim->stream_create();
    for (int i = 0; i < 32; ++i) {
      void* p = sa->allocate(MiB, s1);
      std::thread([&] { sa->record_stream(p, per_thread); }).join();
      sa->deallocate(p);
      sa->deallocate(sa->allocate(MiB, s1));  // the event has completed: the free completes
    }
    CHECK(expseg::detail::AllocatorAccess::pending_streams(*sa) <= 2);
    // Also when the worker's event is still pending at the next look (the legacy stream is busy).
    for (int i = 0; i < 32; ++i) {
      void* p = sa->allocate(MiB, s1);
      std::thread([&] { sa->record_stream(p, per_thread); }).join();
      sa.sim->set_stream_busy(nullptr, i % 2 == 0);
      sa->deallocate(p);
    }
    sa.sim->set_stream_busy(nullptr, false);
    sa->deallocate(sa->allocate(MiB, s1));
    void* q = sa->allocate(MiB, s1);
    std::thread([&] { sa->record_stream(q, per_thread); }).join();
    sa->deallocate(q);
    CHECK(expseg::detail::AllocatorAccess::pending_streams(*sa) <= 2);
    sa->validate();
    sa.alloc.reset();
    sa.sim->stream_destroy(s1);
  }
}

TEST_CASE("per-thread stream: threads come and go while others allocate, free and hand memory over") {
  // Workers on cudaStreamPerThread start and exit while long-lived threads use the allocator; some
  // of a worker's blocks are freed by another thread after it has gone. Under a limit too (reclaim
  // takes an exited thread's idle memory then).
  void* const per_thread = stream_id(2);
  for (const char* extra : {"", "limit:256MiB"}) {
    for (BackendKind kind : {BackendKind::split_merge, BackendKind::expandable}) {
      const std::string backend = expseg::to_string(kind);
      CAPTURE(backend);
      CAPTURE(extra);
      auto sa = make_sim_allocator(sim_config(kind, 80 * GiB, extra));
      std::mutex mu;
      std::vector<void*> handed;  // blocks of exited workers, freed by the long-lived threads
      std::atomic<bool> failed{false};
      auto run = [&](unsigned seed, int rounds) {
        std::uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
        auto next = [&] { x ^= x << 13; x ^= x >> 7; x ^= x << 17; return x; };
        for (int round = 0; round < rounds && !failed; ++round) {
          std::thread([&] {
            try {
              std::vector<void*> mine;
              for (int i = 0; i < 24; ++i) {
                const std::size_t size = std::size_t{1} << (10 + next() % 15);  // 1 KiB - 16 MiB
                try {
                  mine.push_back(sa->allocate(size, per_thread));
                } catch (const expseg::out_of_memory&) {
                }
                if (!mine.empty() && next() % 3 == 0) {
                  sa->deallocate(mine.back());
                  mine.pop_back();
                }
              }
              std::lock_guard lock(mu);
              for (void* p : mine) {
                if (next() % 2 == 0) handed.push_back(p);
                else sa->deallocate(p);
              }
            } catch (...) {
              failed = true;
            }
          }).join();
          std::vector<void*> take;
          {
            std::lock_guard lock(mu);
            if (next() % 2 == 0) take.swap(handed);
          }
          for (void* p : take) sa->deallocate(p);
          if (next() % 8 == 0) sa->release_cached();
          if (next() % 8 == 0) sa->validate();
        }
      };
      std::vector<std::thread> threads;
      for (unsigned t = 0; t < 4; ++t) threads.emplace_back([&, t] { run(t + 1, 24); });
      for (std::thread& t : threads) t.join();
      CHECK_FALSE(failed.load());
      for (void* p : handed) sa->deallocate(p);
      sa->validate();
      sa->release_cached();
      CHECK(reserved(*sa) == 0);
      sa->validate();
      sa.alloc.reset();
      CHECK(sa.sim->live().reservations == 0);
      CHECK(sa.sim->live().handles == 0);
      CHECK(sa.sim->live().mem_allocs == 0);
    }
  }
}

}  // TEST_SUITE

namespace {

// A thread_local whose destructor allocates on cudaStreamPerThread: made before the thread's first
// allocation on that stream, so it is destroyed after the object that retires the thread's key.
struct LateAllocation {
  expseg::Allocator* allocator = nullptr;
  void* got = nullptr;
  std::atomic<bool>* done = nullptr;
  ~LateAllocation() {
    if (allocator == nullptr) return;
    got = allocator->allocate(4 * MiB, stream_id(2));
    if (got != nullptr) allocator->deallocate(got);
    done->store(got != nullptr);
  }
};
thread_local LateAllocation t_late;

}  // namespace

TEST_SUITE("regression-ptkeys") {

TEST_CASE("per-thread stream: a thread_local destructor may still allocate on it after the thread's key is retired") {
  for (BackendKind kind : {BackendKind::split_merge, BackendKind::expandable}) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    auto sa = make_sim_allocator(sim_config(kind));
    std::atomic<bool> late_ok{false};
    std::thread([&] {
      t_late.allocator = sa.alloc.get();  // constructed first: destroyed last
      t_late.done = &late_ok;
      void* p = sa->allocate(8 * MiB, stream_id(2));
      sa->deallocate(p);
    }).join();
    CHECK(late_ok.load());
    sa->validate();
    // The late allocation was made for the retired key: its memory goes back like the rest.
    sa->release_cached();
    CHECK(reserved(*sa) == 0);
    sa->validate();
  }
}

}  // TEST_SUITE
