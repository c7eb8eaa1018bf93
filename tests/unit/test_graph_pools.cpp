// CUDA graph capture: graph pools (Allocator::begin_graph_pool) and the calls a capture refuses.
// A graph replays the addresses its capture used, so memory a capture allocated, freed or not, must
// stay mapped and go to no one else while the graph may run; and some calls while a stream captures
// fail and invalidate the capture, even in the relaxed capture mode the CUDA driver layer uses: a
// synchronization of the capturing stream or the device, a query of an event recorded inside the
// capture (measured on the H200; the simulated device refuses them the same way and records
// captured memsets, which graph_launch replays into whatever the addresses hold then).
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <memory>
#include <cstdint>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "allocator_impl.hpp"
#include "driver/sim_driver.hpp"
#include "expseg/errors.hpp"
#include "capi_fixture.hpp"
#include "forwarding_driver.hpp"
#include "expseg/expseg.h"
#include "test_util.hpp"

using namespace testutil;
using expseg::BackendKind;
using expseg::kAllPools;

namespace {

constexpr BackendKind kBoth[] = {BackendKind::split_merge, BackendKind::expandable};

SimAllocator host_backed(BackendKind kind, std::size_t capacity = 1 * GiB) {
  return make_sim_allocator(sim_config(kind, capacity, "sim_host_backed:true"));
}

std::uint32_t word(SimAllocator& sa, void* p, std::size_t offset = 0) {
  std::uint32_t v = 0;
  sa.sim->copy_to_host(&v, addr(p) + offset, sizeof v);
  return v;
}

void fill(SimAllocator& sa, void* p, std::size_t bytes, std::uint32_t value, void* stream) {
  sa.sim->memset_d32(addr(p), value, bytes / 4, stream);
}

bool overlap(void* a, std::size_t an, void* b, std::size_t bn) { return addr(a) < addr(b) + bn && addr(b) < addr(a) + an; }

std::int64_t reserved(expseg::Allocator& a) { return a.stats().reserved_bytes[kAllPools].current; }

std::size_t pending_frees(expseg::Allocator& a) {
  std::size_t n = 0;
  for (const expseg::SegmentInfo& seg : a.snapshot().segments)
    for (const expseg::BlockInfo& b : seg.blocks) n += b.state == expseg::BlockState::pending_free;
  return n;
}

// A capture on `s` that writes `value` into a 4 MiB block it allocates and frees (an intermediate).
// Returns the graph; `*block` the block's address.
expseg::driver::graph_t capture_intermediate(SimAllocator& sa, void* s, std::uint64_t pool, void** block,
                                             std::uint32_t value = 0xAAAAAAAAu) {
  sa.sim->capture_begin(s);
  if (pool != 0) sa->begin_graph_pool(pool, s);
  void* a = sa->allocate(4 * MiB, s);
  fill(sa, a, 4 * MiB, value, s);  // recorded, run by the graph's launches
  sa->deallocate(a);
  *block = a;
  expseg::driver::graph_t g = sa.sim->capture_end(s);
  if (pool != 0) sa->end_graph_pool(pool);
  return g;
}

// Under a 100 MiB limit: 60 MiB idle on `key` while the work queued on `work` (its stream) still
// uses them, and 30 MiB live there (returned). A request of 64 MiB fits only with the 60 MiB unmapped.
void* idle_60_of_90(SimAllocator& sa, void* key, void* work) {
  void* p = sa->allocate(60 * MiB, key);
  void* q = sa->allocate(30 * MiB, key);
  sa.sim->set_stream_busy(work, true);
  sa.sim->queue_use(work, addr(p), 60 * MiB);
  sa->deallocate(p);
  return q;
}

}  // namespace

TEST_SUITE("graph-pools") {

TEST_CASE("graph pool: memory a capture freed is handed to no one else while its graph may run") {
  for (BackendKind kind : kBoth) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    for (bool pooled : {false, true}) {
      CAPTURE(pooled);
      auto sa = host_backed(kind);
      void* s = sa.sim->stream_create();
      void* a = nullptr;
      const auto g = capture_intermediate(sa, s, pooled ? 1 : 0, &a);
      // Eager work after the capture, on the capture's stream and on the default stream.
      void* c = sa->allocate(4 * MiB, s);
      void* d = sa->allocate(4 * MiB, nullptr);
      fill(sa, c, 4 * MiB, 0x11111111u, s);
      fill(sa, d, 4 * MiB, 0x22222222u, nullptr);
      sa.sim->graph_launch(g, s);  // writes the intermediate's addresses, whatever they hold now
      if (!pooled) {
        // Without a pool the cache hands the intermediate's memory to the next request of its
        // stream, and the replay overwrites it: the corruption graph pools exist to prevent.
        CHECK(addr(c) == addr(a));
        CHECK(word(sa, c) == 0xAAAAAAAAu);
      } else {
        CHECK_FALSE(overlap(c, 4 * MiB, a, 4 * MiB));
        CHECK_FALSE(overlap(d, 4 * MiB, a, 4 * MiB));
        CHECK(word(sa, c) == 0x11111111u);
        CHECK(word(sa, c, 4 * MiB - 4) == 0x11111111u);
        CHECK(word(sa, d) == 0x22222222u);
        CHECK(word(sa, a) == 0xAAAAAAAAu);  // the pool's memory is still mapped: the replay wrote it
      }
      sa->validate();
      sa->deallocate(c);
      sa->deallocate(d);
      sa.sim->graph_destroy(g);
      if (pooled) sa->release_graph_pool(1);
      sa->release_cached();
      CHECK(reserved(*sa) == 0);
      sa->validate();
      sa.alloc.reset();
      CHECK(sa.sim->live().handles == 0);
      CHECK(sa.sim->live().mem_allocs == 0);
      CHECK(sa.sim->hazards().empty());
    }
  }
}

TEST_CASE("graph pool: a capture reuses what it freed; a later capture into the same pool reuses it too") {
  for (BackendKind kind : kBoth) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    auto sa = host_backed(kind);
    void* s = sa.sim->stream_create();
    sa.sim->capture_begin(s);
    sa->begin_graph_pool(7, s);
    void* a = sa->allocate(4 * MiB, s);
    sa->deallocate(a);
    void* b = sa->allocate(4 * MiB, s);  // stream order inside the graph makes the reuse safe
    CHECK(addr(b) == addr(a));
    sa->deallocate(b);
    const auto g1 = sa.sim->capture_end(s);
    sa->end_graph_pool(7);
    const std::int64_t after_first = reserved(*sa);
    // A second graph shares the pool (PyTorch's pool= argument): it gets the same memory back.
    sa.sim->capture_begin(s);
    sa->begin_graph_pool(7, s);
    void* c = sa->allocate(4 * MiB, s);
    CHECK(addr(c) == addr(a));
    sa->deallocate(c);
    const auto g2 = sa.sim->capture_end(s);
    sa->end_graph_pool(7);
    CHECK(reserved(*sa) == after_first);
    // One release per begin: the first leaves the pool to the other graph.
    sa->release_graph_pool(7);
    sa->release_cached();
    CHECK(reserved(*sa) == after_first);
    sa->release_graph_pool(7);
    sa->release_cached();
    CHECK(reserved(*sa) == 0);
    sa->validate();
    sa.sim->graph_destroy(g1);
    sa.sim->graph_destroy(g2);
  }
}

TEST_CASE("graph pool: under a limit, a live pool's memory is not reclaimed; released, it is given back") {
  for (BackendKind kind : kBoth) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    auto sa = host_backed(kind);
    sa->set_limit(64 * MiB);
    void* s = sa.sim->stream_create();
    void* s2 = sa.sim->stream_create();
    sa.sim->capture_begin(s);
    sa->begin_graph_pool(1, s);
    void* a = sa->allocate(24 * MiB, s);
    fill(sa, a, 24 * MiB, 0xAAAAAAAAu, s);
    sa->deallocate(a);
    const auto g = sa.sim->capture_end(s);
    sa->end_graph_pool(1);
    // Eager memory of another stream: 24 MiB of the pool's + 32 MiB fit under 64 MiB...
    void* e = sa->allocate(32 * MiB, s2);
    fill(sa, e, 32 * MiB, 0x33333333u, s2);
    // ...16 MiB more would need the pool's memory, which its graph still uses: an OOM.
    CHECK_THROWS_AS(sa->allocate(16 * MiB, s2), expseg::out_of_memory);
    sa->validate();
    sa.sim->graph_launch(g, s);  // the pool's memory is mapped where the graph wrote it
    CHECK(word(sa, a) == 0xAAAAAAAAu);
    CHECK(word(sa, e) == 0x33333333u);
    CHECK(sa.sim->hazards().empty());
    // Once released, the next request that misses the cache gets the pool's memory back.
    sa.sim->graph_destroy(g);
    sa->release_graph_pool(1);
    void* f = sa->allocate(16 * MiB, s2);
    CHECK(reserved(*sa) <= 48 * MiB + 4 * MiB);
    sa->validate();
    sa->deallocate(e);
    sa->deallocate(f);
    sa->release_cached();
    CHECK(reserved(*sa) == 0);
    sa.alloc.reset();
    CHECK(sa.sim->live().handles == 0);
    CHECK(sa.sim->live().mem_allocs == 0);
    CHECK(sa.sim->live().reservations == 0);
  }
}

TEST_CASE("graph pool regression: end_graph_pool from another thread refuses while a per-thread stream's capture runs") {
  // cudaStreamPerThread names the calling thread's stream: asked from the main thread, the capturing
  // thread's capture read as ended, the end committed, and the capture's next request left the pool.
  void* const per_thread = reinterpret_cast<void*>(std::uintptr_t{2});
  for (BackendKind kind : kBoth) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    auto sa = host_backed(kind);
    std::atomic<int> phase{0};
    std::thread t([&] {
      sa.sim->capture_begin(per_thread);
      sa->begin_graph_pool(1, per_thread);
      void* a = sa->allocate(2 * MiB, per_thread);
      phase = 1;
      while (phase != 2) std::this_thread::yield();
      void* b = sa->allocate(2 * MiB, per_thread);  // the capture's later request: still the pool's
      CHECK(sa->graph_pool_blocks(1).size() == 2);
      const auto g = sa.sim->capture_end(per_thread);
      CHECK_NOTHROW(sa->end_graph_pool(1));  // from its own thread, after the capture's end
      sa->deallocate(a);
      sa->deallocate(b);
      sa.sim->graph_destroy(g);
    });
    while (phase != 1) std::this_thread::yield();
    CHECK_THROWS_WITH_AS(sa->end_graph_pool(1), doctest::Contains("runs on another thread's per-thread stream"), expseg::error);
    phase = 2;
    t.join();
    sa->release_graph_pool(1);
    sa->validate();
    // A thread that exits without the end: its capture cannot be running, and another thread ends it.
    std::thread([&] {
      sa.sim->capture_begin(per_thread);
      sa->begin_graph_pool(2, per_thread);
      sa->deallocate(sa->allocate(2 * MiB, per_thread));
      sa.sim->graph_destroy(sa.sim->capture_end(per_thread));
    }).join();
    CHECK_NOTHROW(sa->end_graph_pool(2));
    sa->release_graph_pool(2);
    sa->validate();
    // A thread that lives on after its capture ended without the end: no blocking stream captures,
    // as the legacy stream's question tells, so another thread ends it. Was: refused until the
    // capturing thread exited.
    std::atomic<int> step{0};
    std::thread u([&] {
      sa.sim->capture_begin(per_thread);
      sa->begin_graph_pool(3, per_thread);
      sa->deallocate(sa->allocate(2 * MiB, per_thread));
      sa.sim->graph_destroy(sa.sim->capture_end(per_thread));
      step = 1;
      while (step != 2) std::this_thread::yield();
    });
    while (step != 1) std::this_thread::yield();
    CHECK_NOTHROW(sa->end_graph_pool(3));
    step = 2;
    u.join();
    sa->release_graph_pool(3);
    sa->validate();
  }
}

TEST_CASE("graph capture: during a told capture, a thread takes back its own per-thread stream's idle memory") {
  // The calling thread's per-thread stream may be synchronized while another stream captures
  // (measured on the H200, blocking capture stream or not): its idle memory serves a request
  // instead of an OOM, with its queued work waited for, and the capture stays valid.
  void* const per_thread = reinterpret_cast<void*>(std::uintptr_t{2});
  auto sa = host_backed(BackendKind::expandable);
  sa->set_limit(100 * MiB);
  void* s = sa.sim->stream_create();
  sa.sim->capture_begin(s);
  sa->begin_graph_pool(1, s);
  void* c = sa->allocate(2 * MiB, s);
  fill(sa, c, 2 * MiB, 0xAAAAAAAAu, s);
  std::thread([&] {
    void* p = sa->allocate(60 * MiB, per_thread);
    void* q = sa->allocate(30 * MiB, per_thread);
    sa.sim->set_stream_busy(per_thread, true);
    sa.sim->queue_use(per_thread, addr(p), 60 * MiB);
    sa->deallocate(p);
    void* r = nullptr;
    CHECK_NOTHROW(r = sa->allocate(64 * MiB, per_thread));  // fits only with p's pages unmapped
    CHECK(sa.sim->hazards().empty());
    CHECK(reserved(*sa) <= 100 * MiB);
    sa.sim->set_stream_busy(per_thread, false);
    sa->deallocate(q);
    if (r != nullptr) sa->deallocate(r);
  }).join();
  sa->validate();
  expseg::driver::graph_t g = nullptr;
  CHECK_NOTHROW(g = sa.sim->capture_end(s));
  sa->end_graph_pool(1);
  REQUIRE(g != nullptr);
  sa.sim->graph_launch(g, s);
  CHECK(word(sa, c) == 0xAAAAAAAAu);
  sa.sim->graph_destroy(g);
  sa->deallocate(c);
  sa->release_graph_pool(1);
  sa->release_cached();
  CHECK(reserved(*sa) == 0);
  sa.alloc.reset();
  CHECK(sa.sim->hazards().empty());
  sa.sim->stream_destroy(s);
}

TEST_CASE("graph capture: expandable: during a told capture on a stream that does not block, the legacy stream's idle memory is taken back") {
  // The legacy stream's synchronization is permitted while a non-blocking stream captures and
  // invalidates the capture while a blocking one does (measured on the H200; the simulated device
  // refuses it the same way). Whether the capture's stream blocks can be asked only before the
  // capture (prepare_capture). Memory the legacy stream's synchronization covers (the legacy
  // stream's own, an exited thread's per-thread stream's) then serves a request of the capture
  // instead of an OOM; unknown, a blocking capture stream, or a fork of the capture to another
  // stream (which may block) leave it cached, and the capture valid.
  struct Case {
    const char* name;
    bool prepare;
    bool blocking_capture;
    bool fork;
    bool served;
  };
  constexpr Case kCases[] = {
      {"prepared, non-blocking", true, false, false, true},
      {"not prepared", false, false, false, false},
      {"prepared, blocking", true, true, false, false},
      {"prepared, non-blocking, forked to a blocking stream", true, false, true, false},
  };
  void* const per_thread = reinterpret_cast<void*>(std::uintptr_t{2});
  for (const bool other_thread : {false, true}) {
    for (const Case& k : kCases) {
      const std::string name = k.name;
      CAPTURE(other_thread);
      CAPTURE(name);
      auto sa = host_backed(BackendKind::expandable);
      sa->set_limit(100 * MiB);
      void* q = nullptr;
      if (other_thread) std::thread([&] { q = idle_60_of_90(sa, per_thread, per_thread); }).join();  // exited, its work queued
      else q = idle_60_of_90(sa, nullptr, nullptr);
      void* s = k.blocking_capture ? sa.sim->stream_create_blocking() : sa.sim->stream_create();
      void* t = sa.sim->stream_create_blocking();
      if (k.prepare) sa->prepare_capture(s);
      sa.sim->capture_begin(s);
      sa->begin_graph_pool(1, s);
      void* c = sa->allocate(2 * MiB, s);
      fill(sa, c, 2 * MiB, 0xAAAAAAAAu, s);
      expseg::driver::event_t fork = sa.sim->event_create();
      expseg::driver::event_t join = sa.sim->event_create();
      if (k.fork) {
        sa.sim->event_record(fork, s);
        sa.sim->stream_wait_event(t, fork);
        CHECK(sa.sim->stream_capture_id(t) == sa.sim->stream_capture_id(s));
        void* f = sa->allocate(1 * MiB, t);  // routed into the capture's pool
        sa->deallocate(f);
      }
      void* big = nullptr;
      if (k.served) {
        CHECK_NOTHROW(big = sa->allocate(64 * MiB, s));  // fits only with the idle 60 MiB unmapped
        CHECK(reserved(*sa) <= 100 * MiB);
      } else {
        CHECK_THROWS_AS(big = sa->allocate(64 * MiB, s), expseg::out_of_memory);
      }
      CHECK(sa.sim->hazards().empty());  // what was unmapped, its stream's work was waited for
      sa->validate();
      if (k.fork) {
        sa.sim->event_record(join, t);
        sa.sim->stream_wait_event(s, join);
      }
      expseg::driver::graph_t g = nullptr;
      CHECK_NOTHROW(g = sa.sim->capture_end(s));
      CHECK(sa.sim->stream_capture_id(t) == 0);
      sa->end_graph_pool(1);
      REQUIRE(g != nullptr);
      sa.sim->graph_launch(g, s);
      CHECK(word(sa, c) == 0xAAAAAAAAu);
      sa.sim->graph_destroy(g);
      sa.sim->set_stream_busy(nullptr, false);
      sa->deallocate(q);
      if (big != nullptr) sa->deallocate(big);
      sa->deallocate(c);
      sa->release_graph_pool(1);
      sa->release_cached();
      CHECK(reserved(*sa) == 0);
      sa.alloc.reset();
      CHECK(sa.sim->hazards().empty());
      sa.sim->event_destroy(fork);
      sa.sim->event_destroy(join);
      sa.sim->stream_destroy(s);
      sa.sim->stream_destroy(t);
    }
  }
}

TEST_CASE("graph capture: expandable: a request on a stream that captures untold, during a told capture, leaves the legacy stream's memory alone") {
  // The told capture's stream does not block, but the request's own stream captures a graph expseg
  // was not told of, on a blocking stream: the legacy stream's synchronization would invalidate
  // both captures. The request fails instead, and both captures stay valid.
  auto sa = host_backed(BackendKind::expandable);
  sa->set_limit(100 * MiB);
  void* p = sa->allocate(60 * MiB, nullptr);
  void* q = sa->allocate(30 * MiB, nullptr);
  sa->deallocate(p);
  void* s = sa.sim->stream_create();
  void* u = sa.sim->stream_create_blocking();
  sa->prepare_capture(s);
  // Relaxed: u's capture ends (and its graph is instantiated) while this one is underway.
  sa.sim->capture_begin(s, expseg::driver::Driver::CaptureMode::relaxed);
  sa->begin_graph_pool(1, s);
  void* c = sa->allocate(2 * MiB, s);
  sa.sim->capture_begin(u);
  CHECK_THROWS_AS(sa->allocate(64 * MiB, u), expseg::out_of_memory);
  expseg::driver::graph_t gu = nullptr;
  CHECK_NOTHROW(gu = sa.sim->capture_end(u));
  CHECK_NOTHROW(sa->deallocate(sa->allocate(64 * MiB, s)));  // the told capture alone: served
  expseg::driver::graph_t gs = nullptr;
  CHECK_NOTHROW(gs = sa.sim->capture_end(s));
  sa->end_graph_pool(1);
  sa->validate();
  if (gu != nullptr) sa.sim->graph_destroy(gu);
  if (gs != nullptr) sa.sim->graph_destroy(gs);
  sa->deallocate(c);
  sa->deallocate(q);
  sa->release_graph_pool(1);
  sa->release_cached();
  CHECK(reserved(*sa) == 0);
  sa.sim->stream_destroy(s);
  sa.sim->stream_destroy(u);
}

TEST_CASE("graph capture: expandable: a capture expseg is not told of, on a stream it has memory for, keeps what a synchronization it refuses would take") {
  // No begin_graph_pool, and the request comes from another stream: expseg sees the capture through
  // the arena of its stream (asked once per operation; whether that stream blocks was asked when
  // the arena was made). The legacy stream's synchronization is refused while a blocking stream
  // captures, the device's while any does: the memory they would take stays cached until the
  // capture ends, and the capture stays valid. Not refused, it is taken.
  struct Case {
    const char* name;
    bool cupy_idle;  // the idle memory is a non-blocking CuPy stream's (the device's synchronization), else the legacy stream's
    bool blocking_capture;
    bool served_during;
  };
  constexpr Case kCases[] = {
      {"legacy stream's memory, blocking capture stream", false, true, false},
      {"legacy stream's memory, non-blocking capture stream", false, false, true},
      {"non-blocking CuPy stream's memory, non-blocking capture stream", true, false, false},
  };
  for (const Case& k : kCases) {
    const std::string name = k.name;
    CAPTURE(name);
    auto sa = host_backed(BackendKind::expandable);
    sa->set_limit(100 * MiB);
    void* cupy = sa.sim->stream_create();
    void* const work = k.cupy_idle ? cupy : nullptr;
    void* const key = k.cupy_idle ? expseg::backends::foreign_stream_key(cupy) : nullptr;
    void* q = idle_60_of_90(sa, key, work);
    void* u = k.blocking_capture ? sa.sim->stream_create_blocking() : sa.sim->stream_create();
    void* m = sa.sim->stream_create();
    void* c = sa->allocate(2 * MiB, u);  // u's arena: expseg knows u
    sa.sim->capture_begin(u);
    fill(sa, c, 2 * MiB, 0xAAAAAAAAu, u);
    void* big = nullptr;
    if (k.served_during) CHECK_NOTHROW(big = sa->allocate(64 * MiB, m));
    else CHECK_THROWS_AS(big = sa->allocate(64 * MiB, m), expseg::out_of_memory);
    CHECK(sa.sim->hazards().empty());
    sa->validate();
    expseg::driver::graph_t g = nullptr;
    CHECK_NOTHROW(g = sa.sim->capture_end(u));
    REQUIRE(g != nullptr);
    sa.sim->graph_launch(g, u);
    CHECK(word(sa, c) == 0xAAAAAAAAu);
    sa.sim->graph_destroy(g);
    if (big == nullptr) CHECK_NOTHROW(big = sa->allocate(64 * MiB, m));  // the capture over: taken now
    CHECK(sa.sim->hazards().empty());
    sa.sim->set_stream_busy(work, false);
    if (big != nullptr) sa->deallocate(big);
    sa->deallocate(q);
    sa->deallocate(c);
    sa->release_cached();
    CHECK(reserved(*sa) == 0);
    sa.alloc.reset();
    sa.sim->stream_destroy(u);
    sa.sim->stream_destroy(m);
    sa.sim->stream_destroy(cupy);
  }
}

TEST_CASE("graph capture: expandable: a released graph pool's memory waits while a capture expseg sees is underway") {
  // A released pool's memory goes back after a device synchronization (its graphs may have been
  // launched on any stream), which any capture refuses: during a capture on a stream with an arena,
  // told or not, it stays cached; afterwards it serves the request.
  auto sa = host_backed(BackendKind::expandable);
  sa->set_limit(100 * MiB);
  void* s = sa.sim->stream_create();
  sa.sim->capture_begin(s);
  sa->begin_graph_pool(1, s);
  void* pooled = sa->allocate(60 * MiB, s);
  sa->deallocate(pooled);
  expseg::driver::graph_t g = sa.sim->capture_end(s);
  sa->end_graph_pool(1);
  sa.sim->graph_destroy(g);
  void* u = sa.sim->stream_create();
  void* m = sa.sim->stream_create();
  void* q = sa->allocate(30 * MiB, m);
  void* c = sa->allocate(2 * MiB, u);
  sa.sim->capture_begin(u);
  sa->release_graph_pool(1);  // its 60 MiB go back once no capture expseg sees is underway
  void* early = nullptr;
  CHECK_THROWS_AS(early = sa->allocate(64 * MiB, m), expseg::out_of_memory);
  if (early != nullptr) sa->deallocate(early);
  sa->validate();
  expseg::driver::graph_t gu = nullptr;
  CHECK_NOTHROW(gu = sa.sim->capture_end(u));
  void* big = nullptr;
  CHECK_NOTHROW(big = sa->allocate(64 * MiB, m));
  if (gu != nullptr) sa.sim->graph_destroy(gu);
  if (big != nullptr) sa->deallocate(big);
  sa->deallocate(q);
  sa->deallocate(c);
  sa->release_cached();
  CHECK(reserved(*sa) == 0);
  sa.alloc.reset();
  CHECK(sa.sim->hazards().empty());
  sa.sim->stream_destroy(s);
  sa.sim->stream_destroy(u);
  sa.sim->stream_destroy(m);
}

TEST_CASE("graph capture: between cuStreamBeginCapture and begin_graph_pool, a prepared capture is not broken by another stream's request") {
  // The documented order: prepare_capture(s), cuStreamBeginCapture(s), begin_graph_pool(pool, s).
  // In between, expseg is not told of the capture yet, and s (a new side stream, as
  // torch.cuda.graph's) has no memory cached. Was: a request on another stream that missed the
  // cache gave back a released graph pool's memory, whose synchronization is the device's: it
  // failed, and it invalidated the capture (expandable; split_merge gives back nothing there).
  for (BackendKind kind : kBoth) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    auto sa = host_backed(kind, 2 * GiB);
    void* cap1 = sa.sim->stream_create();
    void* cap2 = sa.sim->stream_create();
    void* other = sa.sim->stream_create();
    // An earlier graph, captured and released: its pool's memory waits to be given back.
    sa.sim->capture_begin(cap1);
    sa->begin_graph_pool(1, cap1);
    sa->deallocate(sa->allocate(64 * MiB, cap1));
    (void)sa.sim->capture_end(cap1);
    sa->end_graph_pool(1);
    sa->release_graph_pool(1);

    sa->prepare_capture(cap2);
    sa.sim->capture_begin(cap2);
    void* q = nullptr;
    CHECK_NOTHROW(q = sa->allocate(8 * MiB, other));  // misses the cache
    sa->begin_graph_pool(2, cap2);
    void* p = sa->allocate(4 * MiB, cap2);
    CHECK_NOTHROW((void)sa.sim->capture_end(cap2));  // was: CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
    sa->end_graph_pool(2);
    sa->deallocate(p);
    sa->release_graph_pool(2);
    if (q != nullptr) sa->deallocate(q);
    sa->validate();
    sa->release_cached();  // no capture now: the released pools' memory goes back
    CHECK(sa->stats().reserved_bytes[kAllPools].current == 0);
    for (void* st : {cap1, cap2, other}) sa.sim->stream_destroy(st);
  }
}

TEST_CASE("graph capture: prepare_capture asks before the capture, and refuses a stream that captures already") {
  for (BackendKind kind : kBoth) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    auto sa = host_backed(kind);
    void* s = sa.sim->stream_create();
    sa.sim->capture_begin(s);
    // Asking a capturing stream's flags would invalidate its capture: refused before any driver call.
    CHECK_THROWS_WITH_AS(sa->prepare_capture(s), doctest::Contains("captures already"), expseg::error);
    CHECK_NOTHROW(sa.sim->capture_end(s));
    sa->prepare_capture(s);
    sa->prepare_capture(nullptr);  // the default streams block; nothing to ask
    sa->prepare_capture(reinterpret_cast<void*>(std::uintptr_t{2}));
    void* gone = sa.sim->stream_create();
    sa.sim->stream_destroy(gone);
    CHECK_THROWS_AS(sa->prepare_capture(gone), expseg::driver_error);
    sa->validate();
    sa.sim->stream_destroy(s);
  }
  CApiFixture fixture;
  REQUIRE(expseg_configure("device:sim,sim_host_backed:true,sim_capacity:1GiB,backend:expandable") == EXPSEG_SUCCESS);
  CHECK(expseg_prepare_capture(-1, nullptr) == EXPSEG_ERROR_INVALID_DEVICE);
  CHECK(expseg_prepare_capture(0, nullptr) == EXPSEG_SUCCESS);
  expseg::Allocator* a = expseg::capi::allocator_for_tests(0);
  REQUIRE(a != nullptr);
  auto& sim = dynamic_cast<expseg::driver::SimDriver&>(expseg::detail::AllocatorAccess::driver(*a));
  void* s = sim.stream_create();
  CHECK(expseg_prepare_capture(0, s) == EXPSEG_SUCCESS);
  sim.capture_begin(s);
  CHECK(expseg_prepare_capture(0, s) == EXPSEG_ERROR_INVALID_ARGUMENT);
  CHECK(std::string(expseg_last_error()).find("captures already") != std::string::npos);
  CHECK_NOTHROW(sim.capture_end(s));
  sim.stream_destroy(s);
  CHECK(expseg_prepare_capture(0, s) == EXPSEG_ERROR_DRIVER);  // destroyed
}

TEST_CASE("graph capture: no allocation during a capture invalidates it, told of the capture or not") {
  // Under a limit, with idle memory cached for another stream, the capturing stream itself, or the
  // legacy stream: a request on the capturing stream that needs it given back. expandable takes the
  // other stream's (cuStreamSynchronize of a stream that does not capture is permitted in relaxed
  // capture mode); a synchronization of the capturing stream or the legacy stream would fail and
  // invalidate the capture, so that memory stays and the request fails with an OOM. split_merge
  // gives back nothing during a capture, as PyTorch. A capture expseg was not told of takes its
  // stream's own cache as any request does (a told one allocates into its pool). The capture stays
  // valid in every case.
  enum class Owner { other_stream, capturing_stream, legacy_stream };
  for (BackendKind kind : kBoth) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    for (Owner owner : {Owner::other_stream, Owner::capturing_stream, Owner::legacy_stream}) {
      CAPTURE(static_cast<int>(owner));
      for (bool told : {false, true}) {
        CAPTURE(told);
        auto sa = host_backed(kind);
        sa->set_limit(64 * MiB);
        void* s = sa.sim->stream_create();
        void* s2 = sa.sim->stream_create();
        void* cached_on = owner == Owner::other_stream ? s2 : owner == Owner::capturing_stream ? s : nullptr;
        sa->deallocate(sa->allocate(44 * MiB, cached_on));
        const std::int64_t reserved_before = reserved(*sa);
        sa.sim->capture_begin(s);
        if (told) sa->begin_graph_pool(3, s);
        const bool takes_other = kind == BackendKind::expandable && owner == Owner::other_stream;
        const bool from_own_cache = !told && owner == Owner::capturing_stream;
        if (takes_other || from_own_cache) {
          void* p = sa->allocate(24 * MiB, s);
          CHECK(reserved(*sa) <= 64 * static_cast<std::int64_t>(MiB));
          if (takes_other) CHECK(reserved(*sa) < reserved_before + 24 * static_cast<std::int64_t>(MiB));  // s2's memory went
          else CHECK(reserved(*sa) == reserved_before);  // no driver call
          sa->deallocate(p);
        } else {
          CHECK_THROWS_AS(sa->allocate(24 * MiB, s), expseg::out_of_memory);
          CHECK(reserved(*sa) == reserved_before);
        }
        // A request that fits beside the cache maps new memory (split_merge: a 20 MiB segment):
        // permitted while capturing.
        void* small = sa->allocate(2 * MiB, s);
        sa->deallocate(small);
        expseg::driver::graph_t g = nullptr;
        CHECK_NOTHROW(g = sa.sim->capture_end(s));
        if (told) sa->end_graph_pool(3);
        sa->validate();
        // After the capture the same request reclaims the cached memory as usual.
        if (told) sa->release_graph_pool(3);
        void* p = sa->allocate(24 * MiB, s);
        sa->deallocate(p);
        sa->validate();
        if (g != nullptr) sa.sim->graph_destroy(g);
      }
    }
  }
}

TEST_CASE("graph capture: a capture expseg was not told of, on another stream, survives requests elsewhere") {
  // Stream a captures (a CuPy Stream.begin_capture, say); requests come on stream b. Idle memory
  // cached for a is neither unmapped (expandable would synchronize a) nor freed (split_merge's
  // cuMemFree need not wait for work a queued before its capture); b's own requests go on.
  for (BackendKind kind : kBoth) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    auto sa = host_backed(kind);
    sa->set_limit(64 * MiB);
    void* a = sa.sim->stream_create();
    void* b = sa.sim->stream_create();
    sa->deallocate(sa->allocate(44 * MiB, a));  // cached for a
    sa.sim->capture_begin(a);
    CHECK_THROWS_AS(sa->allocate(24 * MiB, b), expseg::out_of_memory);  // would need a's memory
    void* q = sa->allocate(8 * MiB, b);
    sa->deallocate(q);
    expseg::driver::graph_t g = nullptr;
    CHECK_NOTHROW(g = sa.sim->capture_end(a));
    sa->validate();
    void* p = sa->allocate(24 * MiB, b);  // a's memory is given back now
    sa->deallocate(p);
    sa->validate();
    sa.sim->graph_destroy(g);
  }
}

TEST_CASE("graph capture: a cross-stream free whose stream captures untold waits for that capture's end") {
  // An event recorded on a capturing stream belongs to the capture: no query can wait for it
  // (CUDA_ERROR_CAPTURED_EVENT, and the query invalidates the capture). Such a free is held; frees
  // behind events of other streams are processed meanwhile (event queries are permitted in relaxed
  // capture mode). The held one completes before an OOM after the capture, or on release_cached.
  for (BackendKind kind : kBoth) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    for (bool by_release_cached : {false, true}) {
      CAPTURE(by_release_cached);
      auto sa = host_backed(kind);
      sa->set_limit(64 * MiB);
      void* a = sa.sim->stream_create();
      void* b = sa.sim->stream_create();
      void* c = sa.sim->stream_create();
      void* held = sa->allocate(40 * MiB, b);
      sa->record_stream(held, a);
      void* other = sa->allocate(2 * MiB, b);
      sa->record_stream(other, c);
      sa.sim->set_stream_busy(c, true);
      sa->deallocate(other);  // pending behind an event on c
      sa.sim->set_stream_busy(c, false);
      sa.sim->capture_begin(a);
      sa->deallocate(held);  // a captures: held, no event recorded there
      // Both frees pending: active until their streams are done, as PyTorch counts them.
      CHECK(sa->stats().active_bytes[kAllPools].current == 42 * static_cast<std::int64_t>(MiB));
      CHECK(pending_frees(*sa) == 2);
      void* r = sa->allocate(1 * MiB, b);  // queries c's event: permitted, the free of `other` completes
      sa->deallocate(r);
      CHECK(pending_frees(*sa) == 1);  // `held` only
      CHECK(sa->stats().active_bytes[kAllPools].current == 40 * static_cast<std::int64_t>(MiB));
      // An OOM meanwhile: the retry before it finds the held free still waiting, and stops there
      // (it once retried without end, the stack overflowing).
      CHECK_THROWS_AS(sa->allocate(40 * MiB, b), expseg::out_of_memory);
      CHECK(pending_frees(*sa) == 1);
      expseg::driver::graph_t g = nullptr;
      CHECK_NOTHROW(g = sa.sim->capture_end(a));
      sa->validate();
      if (by_release_cached) {
        sa->release_cached();
        sa->deallocate(sa->allocate(512, b));  // processes the event now recorded on a
      } else {
        // 40 MiB are held: a 30 MiB request fails first, completes the held free and retries.
        sa->deallocate(sa->allocate(30 * MiB, b));
      }
      CHECK(pending_frees(*sa) == 0);
      sa->validate();
      sa.sim->graph_destroy(g);
    }
  }
}

TEST_CASE("graph capture: pending cross-stream frees are not processed while a stream captures") {
  // cuEventQuery is refused during a capture: the frees queued behind events wait for its end.
  for (BackendKind kind : kBoth) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    for (bool told : {false, true}) {
      CAPTURE(told);
      auto sa = host_backed(kind);
      void* s = sa.sim->stream_create();
      void* side = sa.sim->stream_create();
      void* p = sa->allocate(2 * MiB, nullptr);
      sa->record_stream(p, side);
      sa.sim->set_stream_busy(side, true);
      sa->deallocate(p);  // pending behind an event on `side`
      sa.sim->set_stream_busy(side, false);
      sa.sim->capture_begin(s);
      if (told) sa->begin_graph_pool(4, s);
      void* q = sa->allocate(1 * MiB, s);  // would query the pending free's event
      expseg::driver::graph_t g = nullptr;
      CHECK_NOTHROW(g = sa.sim->capture_end(s));
      if (told) sa->end_graph_pool(4);
      sa->deallocate(q);
      sa->validate();
      if (told) sa->release_graph_pool(4);
      if (g != nullptr) sa.sim->graph_destroy(g);
    }
  }
}

TEST_CASE("graph pool: a block other streams used, freed during the capture, is freed after it") {
  for (BackendKind kind : kBoth) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    auto sa = host_backed(kind);
    void* s = sa.sim->stream_create();
    void* side = sa.sim->stream_create();
    sa.sim->capture_begin(s);
    sa->begin_graph_pool(5, s);
    void* p = sa->allocate(4 * MiB, s);
    sa->record_stream(p, side);
    const std::int64_t active = sa->stats().active_bytes[kAllPools].current;
    sa->deallocate(p);  // no event can be recorded and queried now: held until the capture ends
    CHECK(sa->stats().active_bytes[kAllPools].current == active);
    void* q = sa->allocate(4 * MiB, s);
    CHECK_FALSE(overlap(p, 4 * MiB, q, 4 * MiB));
    sa->deallocate(q);
    const auto g = sa.sim->capture_end(s);
    sa->end_graph_pool(5);
    // Freed now, behind an event on `side`; done once that event has passed.
    sa->deallocate(sa->allocate(512, nullptr));  // processes completed events
    CHECK(sa->stats().active_bytes[kAllPools].current == 0);
    sa->validate();
    // The next capture into the pool gets p's memory back.
    sa.sim->capture_begin(s);
    sa->begin_graph_pool(5, s);
    void* r = sa->allocate(4 * MiB, s);
    CHECK((addr(r) == addr(p) || addr(r) == addr(q)));
    sa->deallocate(r);
    const auto g2 = sa.sim->capture_end(s);
    sa->end_graph_pool(5);
    sa->release_graph_pool(5);
    sa->release_graph_pool(5);
    sa->release_cached();
    CHECK(reserved(*sa) == 0);
    sa.sim->graph_destroy(g);
    sa.sim->graph_destroy(g2);
  }
}

TEST_CASE("graph pool: a free held until the capture's end counts as freed, as a pending free does") {
  // Was: the block left the live map but stayed allocated in the backend until the capture ended:
  // allocation and allocated_bytes still counted it (PyTorch's free drops them at once, deferred
  // events or not), the snapshot showed a pointer the caller had freed as allocated, and validate()
  // failed (live map size != allocation.all.current). Found by the fuzz harness's graph operations.
  for (BackendKind kind : kBoth) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    auto sa = host_backed(kind);
    void* s = sa.sim->stream_create();
    void* side = sa.sim->stream_create();
    sa.sim->capture_begin(s);
    sa->begin_graph_pool(6, s);
    void* p = sa->allocate(4 * MiB, s);
    sa->record_stream(p, side);
    const expseg::Stats before = sa->stats();
    sa->deallocate(p);
    CHECK_NOTHROW(sa->validate());
    const expseg::Stats held = sa->stats();
    CHECK(held.allocation[kAllPools].current == before.allocation[kAllPools].current - 1);
    CHECK(held.allocated_bytes[kAllPools].current == 0);
    CHECK(held.active_bytes[kAllPools].current == before.active_bytes[kAllPools].current);  // other streams may use it
    int pending = 0;
    for (const auto& seg : sa->snapshot().segments)
      for (const auto& b : seg.blocks) {
        CHECK(b.state != expseg::BlockState::allocated);
        if (b.state == expseg::BlockState::pending_free) ++pending;
      }
    CHECK(pending == 1);
    const auto g = sa.sim->capture_end(s);
    sa->end_graph_pool(6);
    CHECK_NOTHROW(sa->validate());
    sa->deallocate(sa->allocate(512, nullptr));  // processes completed events
    const expseg::Stats after = sa->stats();
    CHECK(after.allocated_bytes[kAllPools].current == 0);
    CHECK(after.active_bytes[kAllPools].current == 0);
    CHECK(after.allocation[kAllPools].freed == before.allocation[kAllPools].freed + 2);  // p's free counted once
    CHECK_NOTHROW(sa->validate());
    sa.sim->graph_destroy(g);
    sa->release_graph_pool(6);
    sa->release_cached();
    CHECK(reserved(*sa) == 0);
  }
}

TEST_CASE("graph pool: record_stream on the capture's own stream is no use of another stream") {
  // Was: a capture's block carries its pool's key as its stream, so record_stream on the capturing
  // stream (torch: t.record_stream(torch.cuda.current_stream()) inside torch.cuda.graph) counted as
  // a use by another stream: its free was held until the capture's end and the capture could not
  // reuse the memory, as it does when the stream is the allocation stream (PyTorch ignores it).
  for (BackendKind kind : kBoth) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    auto sa = host_backed(kind);
    void* s = sa.sim->stream_create();
    sa.sim->capture_begin(s);
    sa->begin_graph_pool(8, s);
    void* p = sa->allocate(4 * MiB, s);
    sa->record_stream(p, s);
    sa->deallocate(p);
    CHECK(sa->stats().active_bytes[kAllPools].current == 0);
    void* q = sa->allocate(4 * MiB, s);
    CHECK(addr(q) == addr(p));
    sa->deallocate(q);
    const auto g = sa.sim->capture_end(s);
    sa->end_graph_pool(8);
    sa->validate();
    sa.sim->graph_destroy(g);
    sa->release_graph_pool(8);
    sa->release_cached();
    CHECK(reserved(*sa) == 0);
  }
}

TEST_CASE("graph pool: frees held past a failed end_graph_pool go back at release_cached") {
  // Was: when end_graph_pool could neither record the held frees' events nor synchronize (two
  // driver errors), the frees stayed held "until the next end": with no further capture never, and
  // release_cached gave their memory back neither. Found by the fuzz harness (multiple faults).
  using expseg::driver::Fault;
  using expseg::driver::Op;
  for (BackendKind kind : kBoth) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    auto sa = host_backed(kind);
    void* s = sa.sim->stream_create();
    void* side = sa.sim->stream_create();
    void* p = sa->allocate(4 * MiB, nullptr);  // eager memory, used on `side` too
    sa->record_stream(p, side);
    sa.sim->capture_begin(s);
    sa->begin_graph_pool(9, s);
    sa->deallocate(p);  // held until the capture's end
    const auto g = sa.sim->capture_end(s);
    sa.sim->inject_fault(Op::event_record, 1, Fault::error);
    // Both synchronizations fail: of the stream that used the block, then the device's.
    sa.sim->inject_fault(Op::stream_sync, 1, Fault::error);
    sa.sim->inject_fault(Op::stream_sync, 2, Fault::error);
    CHECK_THROWS_AS(sa->end_graph_pool(9), expseg::driver_error);
    sa.sim->clear_faults();
    sa->validate();
    sa.sim->graph_destroy(g);
    sa->release_graph_pool(9);
    sa->release_cached();
    CHECK(sa->stats().active_bytes[kAllPools].current == 0);
    CHECK(reserved(*sa) == 0);
    sa->validate();
    sa.alloc.reset();
    CHECK(sa.sim->live().physical_bytes == 0);
  }
}

TEST_CASE("graph pool: a block freed on one capture stream goes to no capture of the pool on another stream") {
  // Was: a pool's memory had one key whatever stream captured into it, so a graph's output freed on
  // its stream, while eager work there still read it, went to the next capture into the pool on
  // another stream, whose launches could overwrite it under that work. PyTorch's private pools
  // serve a freed block to captures on its own stream only. Found by the fuzz harness's stream model.
  for (BackendKind kind : kBoth) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    auto sa = host_backed(kind);
    void* s1 = sa.sim->stream_create();
    void* s2 = sa.sim->stream_create();
    sa.sim->capture_begin(s1);
    sa->begin_graph_pool(1, s1);
    void* b = sa->allocate(4 * MiB, s1);  // the graph's output
    fill(sa, b, 4 * MiB, 0xAAAAAAAAu, s1);
    const auto g1 = sa.sim->capture_end(s1);
    sa->end_graph_pool(1);
    sa.sim->graph_launch(g1, s1);
    sa.sim->set_stream_busy(s1, true);  // eager work on s1 still reads the output
    sa->deallocate(b);                  // freed on its stream: no record_stream needed
    sa.sim->capture_begin(s2);
    sa->begin_graph_pool(1, s2);        // a second graph sharing the pool, captured on s2
    void* c = sa->allocate(4 * MiB, s2);
    CHECK_FALSE(overlap(b, 4 * MiB, c, 4 * MiB));
    sa->deallocate(c);
    const auto g2 = sa.sim->capture_end(s2);
    sa->end_graph_pool(1);
    // A capture on s1 into the pool still gets its memory back.
    sa.sim->set_stream_busy(s1, false);
    sa.sim->capture_begin(s1);
    sa->begin_graph_pool(1, s1);
    void* d = sa->allocate(4 * MiB, s1);
    CHECK(addr(d) == addr(b));
    sa->deallocate(d);
    const auto g3 = sa.sim->capture_end(s1);
    sa->end_graph_pool(1);
    sa->validate();
    for (auto g : {g1, g2, g3}) sa.sim->graph_destroy(g);
    for (int i = 0; i < 3; ++i) sa->release_graph_pool(1);
    sa->release_cached();
    CHECK(reserved(*sa) == 0);
  }
}

TEST_CASE("graph pool: a block freed on one stream of a capture goes to no other stream the capture forked to") {
  // Was: a stream the capture forked to allocated under the capture's one key, so a block freed on
  // the capturing stream went to the fork at once; replayed, the graph runs the two branches side
  // by side, and the fork's kernels could write the block under the other branch's. PyTorch keys a
  // private pool's blocks by stream (get_free_block), so the fork gets memory of its own.
  for (BackendKind kind : kBoth) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    auto sa = host_backed(kind);
    void* s = sa.sim->stream_create();
    void* t = sa.sim->stream_create();
    sa.sim->capture_begin(s);
    sa->begin_graph_pool(4, s);
    const auto fork = sa.sim->event_create();
    sa.sim->event_record(fork, s);
    sa.sim->stream_wait_event(t, fork);  // t joins the capture
    for (const std::size_t size : {std::size_t{30} * MiB, std::size_t{512} * KiB}) {
      CAPTURE(size);
      void* a = sa->allocate(size, s);
      sa->deallocate(a);  // freed on s during the capture
      void* b = sa->allocate(size, t);
      CHECK_FALSE(overlap(a, size, b, size));
      void* again = sa->allocate(size, s);  // s still gets its own block back
      CHECK(addr(again) == addr(a));
      sa->deallocate(again);
      sa->deallocate(b);
    }
    const auto join = sa.sim->event_create();
    sa.sim->event_record(join, t);
    sa.sim->stream_wait_event(s, join);
    const auto g = sa.sim->capture_end(s);
    sa->end_graph_pool(4);
    // The fork's memory is the pool's: an eager request on t does not get it, and a later capture
    // begun on t allocates in the pool (under t's own key: the fork's stays for later forks to t).
    void* eager = sa->allocate(30 * MiB, t);
    int pool_segments = 0;
    for (const expseg::SegmentInfo& seg : sa->snapshot().segments) {
      if (seg.graph_pool != 4) continue;
      ++pool_segments;
      CHECK_FALSE(overlap(eager, 30 * MiB, reinterpret_cast<void*>(seg.address), seg.size));
    }
    CHECK(pool_segments > 0);  // the pool holds memory the request could have taken
    sa->deallocate(eager);
    sa.sim->capture_begin(t);
    sa->begin_graph_pool(4, t);
    void* c = sa->allocate(30 * MiB, t);
    bool in_pool = false;
    for (const expseg::SegmentInfo& seg : sa->snapshot().segments)
      in_pool = in_pool || (seg.graph_pool == 4 && addr(c) >= seg.address && addr(c) < seg.address + seg.size);
    CHECK(in_pool);
    sa->deallocate(c);
    const auto g2 = sa.sim->capture_end(t);
    sa->end_graph_pool(4);
    sa->validate();
    for (auto x : {g, g2}) sa.sim->graph_destroy(x);
    sa.sim->event_destroy(fork);
    sa.sim->event_destroy(join);
    sa->release_graph_pool(4);
    sa->release_graph_pool(4);
    sa->release_cached();
    CHECK(reserved(*sa) == 0);
  }
}

TEST_CASE("graph pool: record_stream of the stream that allocated a block as a fork, capturing into the pool again, adds no use") {
  // A stream has two keys in a pool: one as a capture's own stream, one as a stream a capture forked
  // to. Was: record_stream compared the block's key with the stream's key of the moment only, so a
  // block t allocated as a fork, recorded on t while t captured into the pool itself (or the other
  // way round), took t as one more use: its free waited for an event on t, where PyTorch's
  // record_stream of a block's own stream does nothing.
  for (BackendKind kind : kBoth) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    auto sa = host_backed(kind);
    void* s = sa.sim->stream_create();
    void* t = sa.sim->stream_create();
    void* u = sa.sim->stream_create();
    std::vector<expseg::driver::graph_t> graphs;
    std::vector<expseg::driver::event_t> events;
    auto requested = [&] { return sa->stats().requested_bytes[kAllPools].current; };
    auto fork_to_t = [&] {
      events.push_back(sa.sim->event_create());
      sa.sim->event_record(events.back(), s);
      sa.sim->stream_wait_event(t, events.back());
    };
    auto begin = [&](void* stream) {
      sa.sim->capture_begin(stream);
      sa->begin_graph_pool(4, stream);
    };
    auto end = [&](void* stream) {
      graphs.push_back(sa.sim->capture_end(stream));
      sa->end_graph_pool(4);
    };
    begin(s);
    fork_to_t();
    void* as_fork = sa->allocate(MiB, t);  // under t's fork key
    end(s);
    begin(t);
    void* as_own = sa->allocate(MiB, t);  // under t's own key
    sa->record_stream(as_fork, t);
    sa->deallocate(as_fork);
    CHECK(requested() == static_cast<std::int64_t>(MiB));  // freed at once: only as_own is in use
    end(t);
    begin(s);
    fork_to_t();
    sa->record_stream(as_own, t);
    sa->deallocate(as_own);
    CHECK(requested() == 0);
    // Another stream is a use: the free waits for it.
    void* other = sa->allocate(MiB, s);
    sa->record_stream(other, u);
    sa->deallocate(other);
    CHECK(requested() == static_cast<std::int64_t>(MiB));
    end(s);
    sa.sim->device_synchronize();
    sa->validate();
    for (auto g : graphs) sa.sim->graph_destroy(g);
    for (auto e : events) sa.sim->event_destroy(e);
    for (int i = 0; i < 3; ++i) sa->release_graph_pool(4);
    sa->release_cached();
    CHECK(requested() == 0);
    CHECK(reserved(*sa) == 0);
  }
}

TEST_CASE("graph pool: split_merge keeps a released pool's memory cached until release_cached or a request's last retry, as PyTorch") {
  // PyTorch's releasePool only marks the private pool freeable: its blocks go back in
  // release_cached_blocks (empty_cache, or malloc's last step before an OOM). Was: split_merge gave
  // them back on the next request that missed the cache, on any stream (reserved 400 -> 2 MiB where
  // PyTorch holds 402 MiB).
  auto sa = make_sim_allocator(sim_config(BackendKind::split_merge, 1 * GiB));
  void* s = sa.sim->stream_create();
  auto release_a_pool = [&](std::uint64_t pool) {
    sa.sim->capture_begin(s);
    sa->begin_graph_pool(pool, s);
    sa->deallocate(sa->allocate(400 * MiB, s));
    const auto g = sa.sim->capture_end(s);
    sa->end_graph_pool(pool);
    sa.sim->graph_destroy(g);
    sa->release_graph_pool(pool);
  };
  release_a_pool(1);
  REQUIRE(reserved(*sa) == static_cast<std::int64_t>(400 * MiB));
  void* small = sa->allocate(512, nullptr);  // a new 2 MiB segment: the pool's memory stays
  CHECK(reserved(*sa) == static_cast<std::int64_t>(402 * MiB));
  sa->deallocate(small);
  sa->release_cached();
  CHECK(reserved(*sa) == 0);
  // Under a limit the pool's memory goes back at the request's last retry, not before an OOM.
  release_a_pool(2);
  sa->set_limit(512 * MiB);  // nothing to give back: 400 MiB held
  CHECK(reserved(*sa) == static_cast<std::int64_t>(400 * MiB));
  void* big = nullptr;
  CHECK_NOTHROW(big = sa->allocate(300 * MiB, nullptr));
  CHECK(reserved(*sa) == static_cast<std::int64_t>(300 * MiB));
  CHECK(sa->stats().num_alloc_retries == 1);
  sa->validate();
  sa->deallocate(big);
  sa->release_cached();
  CHECK(reserved(*sa) == 0);
  sa.sim->stream_destroy(s);
}

TEST_CASE("graph pool: misuse gets a clear error and changes nothing") {
  for (BackendKind kind : kBoth) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    auto sa = host_backed(kind);
    void* s = sa.sim->stream_create();
    CHECK_THROWS_WITH_AS(sa->begin_graph_pool(1, s), doctest::Contains("not capturing"), expseg::error);
    sa.sim->capture_begin(s);
    CHECK_THROWS_WITH_AS(sa->begin_graph_pool(0, s), doctest::Contains("pool 0"), expseg::error);
    sa->begin_graph_pool(1, s);
    CHECK_THROWS_WITH_AS(sa->begin_graph_pool(2, s), doctest::Contains("graph pool 1 already"), expseg::error);
    CHECK_THROWS_WITH_AS(sa->release_cached(), doctest::Contains("capture"), expseg::error);
    CHECK_THROWS_WITH_AS(sa->set_limit(1 * GiB), doctest::Contains("capture"), expseg::error);
    CHECK(sa->limit() == 0);
    CHECK_THROWS_WITH_AS(sa->release_graph_pool(1), doctest::Contains("end_graph_pool first"), expseg::error);
    CHECK_THROWS_WITH_AS(sa->end_graph_pool(2), doctest::Contains("no capture allocates into graph pool 2"), expseg::error);
    CHECK_THROWS_WITH_AS(sa->release_graph_pool(9), doctest::Contains("no graph pool 9"), expseg::error);
    void* p = sa->allocate(1 * MiB, s);  // still routed into pool 1
    sa->deallocate(p);
    expseg::driver::graph_t g = nullptr;
    CHECK_NOTHROW(g = sa.sim->capture_end(s));
    sa->end_graph_pool(1);
    CHECK_THROWS_AS(sa->end_graph_pool(1), expseg::error);
    sa->release_graph_pool(1);
    CHECK_THROWS_AS(sa->release_graph_pool(1), expseg::error);
    sa->release_cached();
    CHECK(reserved(*sa) == 0);
    sa->validate();
    sa.sim->graph_destroy(g);
  }
}

TEST_CASE("graph pool: the C API") {
  CApiFixture fixture;
  REQUIRE(expseg_configure("device:sim,sim_host_backed:true,sim_capacity:1GiB,backend:expandable") == EXPSEG_SUCCESS);
  CHECK(expseg_begin_graph_pool(-1, 1, nullptr) == EXPSEG_ERROR_INVALID_DEVICE);
  CHECK(expseg_end_graph_pool(-1, 1) == EXPSEG_ERROR_INVALID_DEVICE);
  CHECK(expseg_release_graph_pool(-1, 1) == EXPSEG_ERROR_INVALID_DEVICE);
  void* warm = expseg_malloc(1024, 0, nullptr);  // creates device 0's allocator
  REQUIRE(warm != nullptr);
  expseg::Allocator* a = expseg::capi::allocator_for_tests(0);
  REQUIRE(a != nullptr);
  auto& sim = dynamic_cast<expseg::driver::SimDriver&>(expseg::detail::AllocatorAccess::driver(*a));
  void* s = sim.stream_create();
  CHECK(expseg_begin_graph_pool(0, 1, s) == EXPSEG_ERROR_INVALID_ARGUMENT);  // not capturing
  CHECK(std::string(expseg_last_error()).find("not capturing") != std::string::npos);
  sim.capture_begin(s);
  REQUIRE(expseg_begin_graph_pool(0, 1, s) == EXPSEG_SUCCESS);
  void* p = expseg_malloc(4 * MiB, 0, s);
  REQUIRE(p != nullptr);
  expseg_free(p, 4 * MiB, 0, s);
  const auto g = sim.capture_end(s);
  REQUIRE(expseg_end_graph_pool(0, 1) == EXPSEG_SUCCESS);
  void* q = expseg_malloc(4 * MiB, 0, s);  // not the graph's memory
  CHECK_FALSE(overlap(p, 4 * MiB, q, 4 * MiB));
  expseg_free(q, 4 * MiB, 0, s);
  CHECK(expseg_release_graph_pool(0, 1) == EXPSEG_SUCCESS);
  CHECK(expseg_release_graph_pool(0, 1) == EXPSEG_ERROR_INVALID_ARGUMENT);  // released already
  CHECK(std::string(expseg_last_error()).find("no graph pool 1") != std::string::npos);
  CHECK(expseg_end_graph_pool(0, 1) == EXPSEG_ERROR_INVALID_ARGUMENT);  // no capture allocates into it
  expseg_free(warm, 1024, 0, nullptr);
  sim.graph_destroy(g);
}

TEST_CASE("graph pool: validate() holds while a cross-stream free waits for the capture's end") {
  // The free is the caller's: it is no longer allocated (as a pending free, PyTorch's accounting),
  // only its memory stays active until the capture has ended and the other stream has passed.
  for (BackendKind kind : kBoth) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    auto sa = host_backed(kind);
    void* s = sa.sim->stream_create();
    void* side = sa.sim->stream_create();
    sa.sim->capture_begin(s);
    sa->begin_graph_pool(5, s);
    void* p = sa->allocate(4 * MiB, s);
    sa->record_stream(p, side);
    sa->deallocate(p);
    CHECK_NOTHROW(sa->validate());
    CHECK(sa->stats().allocation[kAllPools].current == 0);
    CHECK(sa->stats().allocated_bytes[kAllPools].current == 0);
    CHECK(sa->stats().active_bytes[kAllPools].current > 0);
    const auto g = sa.sim->capture_end(s);
    sa->end_graph_pool(5);
    CHECK_NOTHROW(sa->validate());
    sa->deallocate(sa->allocate(512, nullptr));  // processes completed events
    CHECK(sa->stats().active_bytes[kAllPools].current == 0);
    CHECK(sa->stats().allocated_bytes[kAllPools].current == 0);
    CHECK_NOTHROW(sa->validate());
    sa.sim->graph_destroy(g);
    sa->release_graph_pool(5);
    sa->release_cached();
    CHECK(reserved(*sa) == 0);
    sa.alloc.reset();
    CHECK(sa.sim->live().handles == 0);
    CHECK(sa.sim->live().mem_allocs == 0);
  }
}

TEST_CASE("graph pool: two captures into one pool at once; the first one's end leaves the other's routing") {
  // torch.cuda.graph(pool=...) may share a pool between captures; each end_graph_pool ends one of
  // them (as PyTorch's endAllocateToPool), the one whose capture has ended.
  for (BackendKind kind : kBoth) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    for (bool first_ends_first : {true, false}) {
      CAPTURE(first_ends_first);
      auto sa = host_backed(kind);
      void* s1 = sa.sim->stream_create();
      void* s2 = sa.sim->stream_create();
      // Relaxed (PyTorch's capture_error_mode="relaxed"): in global mode the second capture would
      // refuse the first one's cuGraphInstantiate.
      sa.sim->capture_begin(s1, expseg::driver::Driver::CaptureMode::relaxed);
      sa->begin_graph_pool(1, s1);
      sa.sim->capture_begin(s2, expseg::driver::Driver::CaptureMode::relaxed);
      sa->begin_graph_pool(1, s2);
      void* ended = first_ends_first ? s1 : s2;
      void* going = first_ends_first ? s2 : s1;
      void* a = sa->allocate(4 * MiB, ended);
      sa->deallocate(a);
      const auto g1 = sa.sim->capture_end(ended);
      sa->end_graph_pool(1);
      // The other capture still allocates into pool 1 (its stream's part: memory the first capture
      // freed serves captures on the first one's stream only).
      void* b = sa->allocate(4 * MiB, going);
      CHECK(addr(b) != addr(a));
      sa->deallocate(b);
      CHECK_THROWS_AS(sa->release_cached(), expseg::error);  // a capture is still underway
      expseg::driver::graph_t g2 = nullptr;
      CHECK_NOTHROW(g2 = sa.sim->capture_end(going));
      CHECK_NOTHROW(sa->end_graph_pool(1));
      // b's memory is the pool's, not the stream's: eager work on that stream gets other memory.
      void* e = sa->allocate(4 * MiB, going);
      CHECK_FALSE(overlap(e, 4 * MiB, b, 4 * MiB));
      CHECK_FALSE(overlap(e, 4 * MiB, a, 4 * MiB));
      sa->deallocate(e);
      sa->validate();
      sa->release_graph_pool(1);
      sa->release_graph_pool(1);
      sa->release_cached();
      CHECK(reserved(*sa) == 0);
      sa.sim->graph_destroy(g1);
      if (g2 != nullptr) sa.sim->graph_destroy(g2);
    }
  }
}

TEST_CASE("graph pool: no give-back path of either backend touches a live pool's memory") {
  // Eager churn beside a live pool, under a limit that forces reclaims, with the configurations that
  // add give-back paths (garbage collection, oversize blocks, expandable's handles), set_limit,
  // release_cached and exited threads' memory: the graph's replay still finds its memory mapped and
  // no eager block overlaps it.
  const char* extras[] = {"", "garbage_collection_threshold:0.5", "max_split_size_mb:40", "policy:cupy"};
  for (BackendKind kind : kBoth) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    for (const char* extra : extras) {
      CAPTURE(std::string(extra));
      if (kind == BackendKind::expandable && std::string(extra) == "policy:cupy") continue;
      std::string conf = "sim_host_backed:true";
      if (*extra != '\0') conf += std::string(",") + extra;
      auto sa = make_sim_allocator(sim_config(kind, 1 * GiB, conf));
      void* s = sa.sim->stream_create();
      void* s2 = sa.sim->stream_create();
      void* s3 = sa.sim->stream_create();
      sa.sim->capture_begin(s);
      sa->begin_graph_pool(1, s);
      void* big = sa->allocate(48 * MiB, s);
      fill(sa, big, 48 * MiB, 0xAAAAAAAAu, s);
      void* small = sa->allocate(64 * 1024, s);
      fill(sa, small, 64 * 1024, 0xBBBBBBBBu, s);
      sa->deallocate(big);
      sa->deallocate(small);
      const auto g = sa.sim->capture_end(s);
      sa->end_graph_pool(1);
      auto clear_of_pool = [&](void* p, std::size_t n) {
        return !overlap(p, n, big, 48 * MiB) && !overlap(p, n, small, 64 * 1024);
      };
      sa->set_limit(160 * MiB);
      std::vector<std::pair<void*, std::size_t>> held;
      for (int round = 0; round < 6; ++round) {
        for (void* st : {s2, s3, static_cast<void*>(nullptr)}) {
          for (std::size_t n : {std::size_t{1} << 20, std::size_t{30} << 20, std::size_t{512} << 10, std::size_t{45} << 20}) {
            void* p = nullptr;
            try {
              p = sa->allocate(n, st);
            } catch (const expseg::out_of_memory&) {
              continue;
            }
            CHECK(clear_of_pool(p, n));
            fill(sa, p, n, 0x11111111u, st);
            held.emplace_back(p, n);
          }
          // Free most of it again: idle memory on every stream for the next round to reclaim.
          while (held.size() > 2) {
            sa->deallocate(held.back().first);
            held.pop_back();
          }
        }
        if (round == 2) sa->set_limit(120 * MiB);
        if (round == 3) {
          sa->release_cached();
          sa->set_limit(200 * MiB);
        }
        if (round == 4) {  // a thread's per-thread stream: its memory is given back once it exits
          std::thread t([&] { sa->deallocate(sa->allocate(20 * MiB, reinterpret_cast<void*>(expseg::backends::kPerThreadStream))); });
          t.join();
        }
        sa->validate();
      }
      CHECK_NOTHROW(sa.sim->graph_launch(g, s));
      CHECK(word(sa, big) == 0xAAAAAAAAu);
      CHECK(word(sa, small) == 0xBBBBBBBBu);
      for (auto& [p, n] : held) {
        CHECK(word(sa, p) == 0x11111111u);
        sa->deallocate(p);
      }
      CHECK(sa.sim->hazards().empty());
      sa.sim->graph_destroy(g);
      sa->release_graph_pool(1);
      sa->release_cached();
      CHECK(reserved(*sa) == 0);
      sa->validate();
      sa.alloc.reset();
      CHECK(sa.sim->live().handles == 0);
      CHECK(sa.sim->live().mem_allocs == 0);
      CHECK(sa.sim->live().reservations == 0);
    }
  }
}

TEST_CASE("graph pool: released with graph outputs still allocated, its memory is given back once they are freed") {
  for (BackendKind kind : kBoth) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    auto sa = host_backed(kind);
    void* s = sa.sim->stream_create();
    sa.sim->capture_begin(s);
    sa->begin_graph_pool(1, s);
    void* out = sa->allocate(4 * MiB, s);  // the graph's output, held by the user
    void* tmp = sa->allocate(8 * MiB, s);
    sa->deallocate(tmp);
    const auto g = sa.sim->capture_end(s);
    sa->end_graph_pool(1);
    sa.sim->graph_destroy(g);
    sa->release_graph_pool(1);
    sa->release_cached();
    sa->validate();
    // Pool id 1 again: a new pool, which does not get the released one's memory while `out` lives.
    sa.sim->capture_begin(s);
    sa->begin_graph_pool(1, s);
    void* x = sa->allocate(4 * MiB, s);
    CHECK_FALSE(overlap(x, 4 * MiB, out, 4 * MiB));
    sa->deallocate(x);
    const auto g2 = sa.sim->capture_end(s);
    sa->end_graph_pool(1);
    sa.sim->graph_destroy(g2);
    sa->release_graph_pool(1);
    sa->deallocate(out);
    sa->validate();
    sa->release_cached();
    CHECK(reserved(*sa) == 0);
    CHECK(sa->stats().active_bytes[kAllPools].current == 0);
    sa->validate();
    sa.alloc.reset();
    CHECK(sa.sim->live().handles == 0);
    CHECK(sa.sim->live().mem_allocs == 0);
    CHECK(sa.sim->live().reservations == 0);
  }
}

TEST_CASE("graph pool: an OOM report counts a live pool's cached memory as held, not as fragmentation") {
  // The pool's 24 MiB is free but kept for its graph: the request does not fit beside it under the
  // limit in either backend, so neither the fragmentation verdict (and its advice) nor the claim that
  // the other backend would have served the request holds.
  for (BackendKind kind : kBoth) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    auto sa = host_backed(kind);
    sa->set_limit(64 * MiB);
    void* s = sa.sim->stream_create();
    void* s2 = sa.sim->stream_create();
    sa.sim->capture_begin(s);
    sa->begin_graph_pool(1, s);
    sa->deallocate(sa->allocate(24 * MiB, s));
    const auto g = sa.sim->capture_end(s);
    sa->end_graph_pool(1);
    void* e = sa->allocate(32 * MiB, s2);
    try {
      sa->allocate(16 * MiB, s2);
      FAIL("the request should not fit");
    } catch (const expseg::out_of_memory& x) {
      const expseg::OomReport& r = x.report();
      CHECK(r.verdict == expseg::OomVerdict::limit);
      CHECK(r.counterfactual != expseg::Counterfactual::would_succeed);
      CHECK(r.message.find("24.00 MiB cached for CUDA graph pools") != std::string::npos);
      // PyTorch's sentence: the pool's cached memory counts as allocated, not as reserved but unallocated.
      CHECK(r.message.find("Of the allocated memory 56.00 MiB is allocated by expseg, with 24.00 MiB allocated in private pools "
                           "(e.g., CUDA Graphs), and 0 bytes is reserved by expseg but unallocated.") != std::string::npos);
      CHECK(r.message.find("would have served") == std::string::npos);
      CHECK(r.message.find("to avoid fragmentation") == std::string::npos);
    }
    // Released, the same request gets the pool's memory.
    sa.sim->graph_destroy(g);
    sa->release_graph_pool(1);
    sa->deallocate(sa->allocate(16 * MiB, s2));
    sa->deallocate(e);
    sa->validate();
  }
}

}  // TEST_SUITE

// PyTorch's CUDA graph trees (torch.compile(mode="reduce-overhead")) warm each graph up with its
// allocations routed into the pool its recording uses (beginAllocateToPool outside a capture),
// check the pool's allocated blocks against the storages they track, and put the pool back to a
// checkpoint of those blocks when they record again after replays (setCheckpointPoolState).
TEST_SUITE("graph-trees") {

using Blocks = std::vector<std::pair<std::uint64_t, std::size_t>>;

bool listed(const Blocks& blocks, void* p) {
  return std::any_of(blocks.begin(), blocks.end(), [&](const auto& b) { return b.first == addr(p); });
}

TEST_CASE("graph pool: allocations outside a capture go into the pool, and the pool's captures reuse what they freed") {
  for (BackendKind kind : kBoth) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    auto sa = host_backed(kind);
    void* s = sa.sim->stream_create();
    sa->begin_pool_allocations(5, s);
    void* w = sa->allocate(3 * MiB, s);          // a warm-up output, kept
    void* x = sa->allocate(4 * MiB, s);          // a warm-up intermediate, freed
    void* other = sa->allocate(4 * MiB, nullptr);  // another stream: not routed
    sa->deallocate(x);
    CHECK(sa->graph_pool_blocks(5) == Blocks{{addr(w), 3 * MiB}});
    sa->end_pool_allocations(5, s);
    // The stream's own requests no longer come from the pool: x's memory is the pool's.
    void* y = sa->allocate(4 * MiB, s);
    CHECK_FALSE(overlap(y, 4 * MiB, x, 4 * MiB));
    CHECK_FALSE(listed(sa->graph_pool_blocks(5), y));
    // A capture on the stream into the pool gets x's memory back (expandable may place it up to a
    // frame further, so as not to leave a handle under it partly used), mapping nothing.
    sa.sim->capture_begin(s);
    sa->begin_graph_pool(5, s);
    const auto maps0 = sa.sim->calls(expseg::driver::Op::map);
    void* c = sa->allocate(4 * MiB, s);
    CHECK(sa.sim->calls(expseg::driver::Op::map) == maps0);
    if (kind == BackendKind::split_merge) CHECK(addr(c) == addr(x));
    else CHECK(overlap(c, 4 * MiB, x, 4 * MiB));
    const auto g = sa.sim->capture_end(s);
    sa->end_graph_pool(5);
    Blocks expected{{addr(w), 3 * MiB}, {addr(c), 4 * MiB}};
    std::sort(expected.begin(), expected.end());
    CHECK(sa->graph_pool_blocks(5) == expected);
    sa->validate();
    auto pool_of = [&](void* p) {  // the snapshot's graph pool of the segment holding p
      for (const expseg::SegmentInfo& seg : sa->snapshot().segments)
        if (seg.address <= addr(p) && addr(p) < seg.address + seg.size) return seg.graph_pool;
      FAIL("no segment holds the pointer");
      return std::uint64_t{99};
    };
    CHECK(pool_of(w) == 5);
    CHECK(pool_of(c) == 5);
    CHECK(pool_of(y) == 0);
    CHECK(pool_of(other) == 0);
    // Two uses (the warm-up's, the capture's). Released with w and c still allocated, the pool's
    // blocks stay listed until freed; a later begin takes the pool up again.
    sa->release_graph_pool(5);
    sa->release_graph_pool(5);
    CHECK_THROWS_WITH_AS(sa->release_graph_pool(5), doctest::Contains("no graph pool 5"), expseg::error);
    CHECK(sa->graph_pool_blocks(5) == expected);
    CHECK(pool_of(w) == 5);  // released: its segments still say whose they were while w lives
    sa->begin_pool_allocations(5, s);
    void* z = sa->allocate(1 * MiB, s);
    sa->end_pool_allocations(5, s);
    CHECK(listed(sa->graph_pool_blocks(5), z));
    CHECK(listed(sa->graph_pool_blocks(5), w));
    sa->deallocate(w);
    sa->deallocate(c);
    CHECK(sa->graph_pool_blocks(5) == Blocks{{addr(z), 1 * MiB}});
    sa->deallocate(z);
    sa->release_graph_pool(5);
    CHECK(sa->graph_pool_blocks(5).empty());
    CHECK_THROWS_AS(sa->release_graph_pool(5), expseg::error);
    sa->deallocate(y);
    sa->deallocate(other);
    sa->validate();
    sa->release_cached();
    CHECK(reserved(*sa) == 0);
    sa.sim->graph_destroy(g);
    sa.alloc.reset();
    CHECK(sa.sim->live().handles == 0);
    CHECK(sa.sim->live().mem_allocs == 0);
  }
}

TEST_CASE("graph pool: restore_graph_pool_block puts freed blocks back exactly where they were") {
  for (BackendKind kind : kBoth) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    auto sa = host_backed(kind);
    void* s = sa.sim->stream_create();
    sa->begin_pool_allocations(3, s);
    const std::size_t sizes[] = {3 * MiB, 5 * MiB + 512, 700 * KiB, 2 * MiB, 512, 12 * MiB};
    std::vector<void*> ptrs;
    for (std::size_t n : sizes) ptrs.push_back(sa->allocate(n, s));
    sa->end_pool_allocations(3, s);
    for (std::size_t i = 0; i < ptrs.size(); ++i) fill(sa, ptrs[i], sizes[i] / 4 * 4, 0x1000u + static_cast<std::uint32_t>(i), s);
    const Blocks checkpoint = sa->graph_pool_blocks(3);
    REQUIRE(checkpoint.size() == ptrs.size());
    auto block_size = [&](void* p) {  // the pool's size of the block at p (rounded)
      for (const auto& [a, n] : checkpoint)
        if (a == addr(p)) return n;
      FAIL("not in the checkpoint");
      return std::size_t{0};
    };
    const auto allocated = sa->stats().allocated_bytes[kAllPools].current;
    const auto reserved_before = reserved(*sa);
    // Every block freed (neighbours merge), then put back in another order.
    for (void* p : ptrs) sa->deallocate(p);
    CHECK(sa->graph_pool_blocks(3).empty());
    for (std::size_t i : {3, 0, 5, 1, 4, 2})
      sa->restore_graph_pool_block(3, reinterpret_cast<void*>(checkpoint[i].first), checkpoint[i].second);
    CHECK(sa->graph_pool_blocks(3) == checkpoint);
    CHECK(sa->stats().allocated_bytes[kAllPools].current == allocated);
    CHECK(reserved(*sa) == reserved_before);  // nothing was mapped or allocated anew
    sa->validate();
    for (std::size_t i = 0; i < ptrs.size(); ++i) CHECK(word(sa, ptrs[i]) == 0x1000u + static_cast<std::uint32_t>(i));
    // One block freed between two live ones, and put back.
    sa->deallocate(ptrs[2]);
    sa->restore_graph_pool_block(3, ptrs[2], block_size(ptrs[2]));
    CHECK(sa->graph_pool_blocks(3) == checkpoint);
    sa->validate();
    // Misuse: nothing changes.
    CHECK_THROWS_WITH_AS(sa->restore_graph_pool_block(3, ptrs[1], block_size(ptrs[1])), doctest::Contains("allocated already"),
                         expseg::error);
    sa->deallocate(ptrs[1]);
    // Overlapping a live block, misaligned, in no pool, released pool.
    CHECK_THROWS_WITH_AS(sa->restore_graph_pool_block(3, ptrs[1], block_size(ptrs[1]) + 3 * MiB), doctest::Contains("not free memory"),
                         expseg::error);
    CHECK_THROWS_WITH_AS(sa->restore_graph_pool_block(3, reinterpret_cast<char*>(ptrs[1]) + 100, 512), doctest::Contains("multiples of 512"),
                         expseg::error);
    CHECK_THROWS_WITH_AS(sa->restore_graph_pool_block(4, ptrs[1], 512), doctest::Contains("no graph pool 4"), expseg::error);
    void* elsewhere = sa->allocate(1 * MiB, s);
    sa->deallocate(elsewhere);
    CHECK_THROWS_WITH_AS(sa->restore_graph_pool_block(3, elsewhere, 1 * MiB), doctest::Contains("not free memory"), expseg::error);
    // Past the pool's memory: at the end of its segment and deep in its range. On expandable both lie
    // in the reserved range, never mapped. Was: a crash (the walk for the block there ran off the list).
    std::uint64_t seg_end = 0;
    for (const auto& seg : sa->snapshot().segments)
      if (seg.address <= addr(ptrs[0]) && addr(ptrs[0]) < seg.address + seg.size) seg_end = seg.address + seg.size;
    REQUIRE(seg_end != 0);
    for (const std::uint64_t at : {seg_end, seg_end + 64 * MiB}) {
      CAPTURE(at);
      CHECK_THROWS_WITH_AS(sa->restore_graph_pool_block(3, reinterpret_cast<void*>(at), 512), doctest::Contains("not free memory"),
                           expseg::error);
    }
    CHECK(sa->graph_pool_blocks(3).size() == checkpoint.size() - 1);
    sa->validate();
    for (std::size_t i = 0; i < ptrs.size(); ++i)
      if (i != 1) sa->deallocate(ptrs[i]);
    sa->release_graph_pool(3);
    CHECK_THROWS_WITH_AS(sa->restore_graph_pool_block(3, ptrs[0], block_size(ptrs[0])), doctest::Contains("no graph pool 3"), expseg::error);
    sa->release_cached();
    CHECK(reserved(*sa) == 0);
    CHECK(sa->stats().allocated_bytes[kAllPools].current == 0);
    sa->validate();
    sa.alloc.reset();
    CHECK(sa.sim->live().handles == 0);
    CHECK(sa.sim->live().mem_allocs == 0);
  }
}

TEST_CASE("graph pool: misuse of allocations outside a capture gets a clear error and changes nothing") {
  for (BackendKind kind : kBoth) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    auto sa = host_backed(kind);
    void* s = sa.sim->stream_create();
    void* t = sa.sim->stream_create();
    CHECK_THROWS_WITH_AS(sa->begin_pool_allocations(0, s), doctest::Contains("pool 0"), expseg::error);
    CHECK_THROWS_WITH_AS(sa->end_pool_allocations(1, s), doctest::Contains("does not allocate into graph pool 1"), expseg::error);
    sa->begin_pool_allocations(1, s);
    CHECK_THROWS_WITH_AS(sa->begin_pool_allocations(2, s), doctest::Contains("graph pool 1 already"), expseg::error);
    CHECK_THROWS_WITH_AS(sa->end_pool_allocations(1, t), doctest::Contains("does not allocate"), expseg::error);
    CHECK_THROWS_WITH_AS(sa->release_graph_pool(1), doctest::Contains("end_pool_allocations first"), expseg::error);
    sa.sim->capture_begin(t);
    CHECK_THROWS_WITH_AS(sa->begin_pool_allocations(1, t), doctest::Contains("capturing"), expseg::error);
    const auto g = sa.sim->capture_end(t);
    void* p = sa->allocate(1 * MiB, s);  // still routed into pool 1
    CHECK(listed(sa->graph_pool_blocks(1), p));
    sa->deallocate(p);
    sa->end_pool_allocations(1, s);
    sa->release_graph_pool(1);
    sa->release_cached();
    CHECK(reserved(*sa) == 0);
    sa->validate();
    sa.sim->graph_destroy(g);
  }
}

TEST_CASE("graph pool: the C API of allocations outside a capture, pool blocks and their restoring") {
  CApiFixture fixture;
  REQUIRE(expseg_configure("device:sim,sim_host_backed:true,sim_capacity:1GiB,backend:split_merge") == EXPSEG_SUCCESS);
  CHECK(expseg_begin_pool_allocations(-1, 1, nullptr) == EXPSEG_ERROR_INVALID_DEVICE);
  std::size_t count = 99;
  CHECK(expseg_graph_pool_blocks(0, 1, nullptr, nullptr, 0, nullptr) == EXPSEG_ERROR_INVALID_ARGUMENT);
  CHECK(expseg_graph_pool_blocks(0, 1, nullptr, nullptr, 4, &count) == EXPSEG_ERROR_INVALID_ARGUMENT);
  REQUIRE(expseg_graph_pool_blocks(0, 1, nullptr, nullptr, 0, &count) == EXPSEG_SUCCESS);
  CHECK(count == 0);
  CHECK(expseg_begin_pool_allocations(0, 0, nullptr) == EXPSEG_ERROR_INVALID_ARGUMENT);
  REQUIRE(expseg_begin_pool_allocations(0, 1, nullptr) == EXPSEG_SUCCESS);
  void* p = expseg_malloc(4 * MiB, 0, nullptr);
  void* q = expseg_malloc(1 * MiB, 0, nullptr);
  REQUIRE(p != nullptr);
  REQUIRE(q != nullptr);
  REQUIRE(expseg_end_pool_allocations(0, 1, nullptr) == EXPSEG_SUCCESS);
  CHECK(expseg_end_pool_allocations(0, 1, nullptr) == EXPSEG_ERROR_INVALID_ARGUMENT);
  unsigned long long addrs[2] = {};
  std::size_t sizes[2] = {};
  REQUIRE(expseg_graph_pool_blocks(0, 1, addrs, sizes, 1, &count) == EXPSEG_SUCCESS);
  CHECK(count == 2);  // more than the room given: the first only
  CHECK(addrs[0] == std::min(addr(p), addr(q)));
  REQUIRE(expseg_graph_pool_blocks(0, 1, addrs, sizes, 2, &count) == EXPSEG_SUCCESS);
  CHECK(count == 2);
  const std::size_t p_size = addrs[0] == addr(p) ? sizes[0] : sizes[1];
  expseg_free(p, 4 * MiB, 0, nullptr);
  CHECK(expseg_restore_graph_pool_block(0, 1, q, 1 * MiB) == EXPSEG_ERROR_INVALID_ARGUMENT);  // allocated already
  CHECK(std::string(expseg_last_error()).find("allocated already") != std::string::npos);
  REQUIRE(expseg_restore_graph_pool_block(0, 1, p, p_size) == EXPSEG_SUCCESS);
  REQUIRE(expseg_graph_pool_blocks(0, 1, addrs, sizes, 2, &count) == EXPSEG_SUCCESS);
  CHECK(count == 2);
  expseg_free(p, 4 * MiB, 0, nullptr);
  expseg_free(q, 1 * MiB, 0, nullptr);
  REQUIRE(expseg_release_graph_pool(0, 1) == EXPSEG_SUCCESS);
  CHECK(expseg_restore_graph_pool_block(0, 1, p, p_size) == EXPSEG_ERROR_INVALID_ARGUMENT);
}


// Random warm-ups (routed allocations and frees), checkpoints and restores in a pool, beside other
// streams' work under a limit: after each step validate() holds, the pool lists exactly the blocks
// the test holds there, and every live block keeps the pattern written into it.
TEST_CASE("graph pool: random checkpoints and restores keep every block's data and the backends' invariants") {
  for (BackendKind kind : kBoth) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    for (std::uint64_t seed : {1, 2, 3}) {
      CAPTURE(seed);
      auto sa = host_backed(kind, 1 * GiB);
      sa->set_limit(512 * MiB);
      void* s = sa.sim->stream_create();
      void* other = sa.sim->stream_create();
      std::uint64_t x = seed * 0x9E3779B97F4A7C15ull;
      auto next = [&] {  // splitmix64
        x += 0x9E3779B97F4A7C15ull;
        std::uint64_t z = x;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
      };
      auto size_of = [&] {  // 512 B - 32 MiB, log-uniform
        const unsigned bits = 9 + static_cast<unsigned>(next() % 17);
        return std::size_t{1} << bits | (next() % (std::size_t{1} << bits)) / 512 * 512;
      };
      struct Live {
        void* p;
        std::size_t size;
        std::uint32_t value;
      };
      std::vector<Live> pool, elsewhere;
      std::uint32_t values = 0;
      auto check = [&](const std::vector<Live>& blocks) {
        for (const Live& l : blocks) {
          REQUIRE(word(sa, l.p) == l.value);
          REQUIRE(word(sa, l.p, l.size / 4 * 4 - 4) == l.value);
        }
      };
      sa->begin_pool_allocations(9, s);
      sa->end_pool_allocations(9, s);  // the pool's use stays (a recorded graph's)
      Blocks checkpoint;
      std::size_t restores = 0;
      for (int step = 0; step < 400; ++step) {
        const std::uint64_t r = next() % 100;
        if (r < 35) {  // a warm-up allocation into the pool
          sa->begin_pool_allocations(9, s);
          const std::size_t n = size_of();
          void* p = nullptr;
          try {
            p = sa->allocate(n, s);
          } catch (const expseg::out_of_memory&) {
          }
          sa->end_pool_allocations(9, s);
          sa->release_graph_pool(9);  // each begin's use, as the trees' releasePool
          if (p != nullptr) {
            pool.push_back({p, n, ++values});
            fill(sa, p, n / 4 * 4, values, s);
          }
        } else if (r < 55 && !pool.empty()) {  // a pool block freed
          const std::size_t i = next() % pool.size();
          sa->deallocate(pool[i].p);
          pool.erase(pool.begin() + static_cast<std::ptrdiff_t>(i));
        } else if (r < 75) {  // other streams' work, competing for the limit
          if (!elsewhere.empty() && next() % 2 == 0) {
            const std::size_t i = next() % elsewhere.size();
            sa->deallocate(elsewhere[i].p);
            elsewhere.erase(elsewhere.begin() + static_cast<std::ptrdiff_t>(i));
          } else {
            const std::size_t n = size_of();
            try {
              void* p = sa->allocate(n, next() % 2 ? other : nullptr);
              elsewhere.push_back({p, n, ++values});
              fill(sa, p, n / 4 * 4, values, nullptr);
            } catch (const expseg::out_of_memory&) {
            }
          }
        } else if (r < 85) {  // a checkpoint of the pool's blocks
          checkpoint = sa->graph_pool_blocks(9);
        } else {
          // Back to the checkpoint: blocks it lacks are freed, blocks it lists and the pool lacks are
          // allocated again where they were (their old contents are the graph's to rewrite).
          // Kept: a block the checkpoint lists at its address with its size (the pool's, rounded).
          const Blocks now = sa->graph_pool_blocks(9);
          std::vector<Live> kept;
          for (const Live& l : pool) {
            const auto listed_size = std::find_if(now.begin(), now.end(), [&](const auto& c) { return c.first == addr(l.p); })->second;
            if (std::find(checkpoint.begin(), checkpoint.end(), std::make_pair(addr(l.p), listed_size)) != checkpoint.end()) {
              kept.push_back(l);
            } else {
              sa->deallocate(l.p);
            }
          }
          pool = kept;
          for (const auto& entry : checkpoint) {
            const auto a = entry.first;  // not a structured binding: clang 14 cannot capture one
            const auto n = entry.second;
            if (std::any_of(pool.begin(), pool.end(), [&](const Live& l) { return addr(l.p) == a; })) continue;
            void* p = reinterpret_cast<void*>(a);
            sa->restore_graph_pool_block(9, p, n);
            ++restores;
            pool.push_back({p, n, ++values});
            fill(sa, p, n / 4 * 4, values, s);
          }
          CHECK(sa->graph_pool_blocks(9) == checkpoint);
        }
        sa->validate();
        Blocks held;
        for (const Live& l : pool) held.emplace_back(addr(l.p), 0);
        std::sort(held.begin(), held.end());
        const Blocks listed_now = sa->graph_pool_blocks(9);
        REQUIRE(listed_now.size() == held.size());
        for (std::size_t i = 0; i < held.size(); ++i) REQUIRE(listed_now[i].first == held[i].first);
        if (step % 20 == 0) {
          check(pool);
          check(elsewhere);
        }
      }
      CHECK(restores > 10);
      check(pool);
      check(elsewhere);
      for (const Live& l : pool) sa->deallocate(l.p);
      for (const Live& l : elsewhere) sa->deallocate(l.p);
      sa->release_graph_pool(9);
      sa->release_cached();
      CHECK(reserved(*sa) == 0);
      sa->validate();
      sa.alloc.reset();
      CHECK(sa.sim->live().handles == 0);
      CHECK(sa.sim->live().mem_allocs == 0);
    }
  }
}

}  // TEST_SUITE("graph-trees")

// Was: an arena whose segments had all gone back was forgotten while its stream captured untold
// (release_cached, or a request elsewhere out of address range giving back unused arenas); nothing
// noticed the capture then, and a later request on another stream gave back a released graph
// pool's idle memory with a device synchronization, which invalidated the capture.
TEST_CASE("graph capture: expandable: an untold capture's stream stays watched after its arena's ranges go back") {
  for (const bool out_of_address_range : {false, true}) {
    CAPTURE(out_of_address_range);
    expseg::driver::SimOptions o;
    if (out_of_address_range) o.address_space = 3 * 256 * MiB + 16 * MiB;  // room for three segments
    auto sa = make_sim_allocator(sim_config(BackendKind::expandable, 1 * GiB, "limit:72MiB,expandable_va_size:256MiB"), o);
    void* A = sa.sim->stream_create();
    void* B = sa.sim->stream_create();
    void* S = sa.sim->stream_create();
    void* a = sa->allocate(40 * MiB, A);
    sa->deallocate(a);
    void* b = sa->allocate(66 * MiB, B);  // takes A's idle memory: A keeps an empty segment and its arena
    // A graph pool's block kept live past the pool's release: its idle memory later needs a sync.
    sa.sim->capture_begin(S);
    sa->begin_graph_pool(1, S);
    void* x = sa->allocate(4 * MiB, S);
    expseg::driver::graph_t g = sa.sim->capture_end(S);
    sa->end_graph_pool(1);
    sa.sim->graph_destroy(g);
    sa->release_graph_pool(1);
    sa.sim->capture_begin(A);  // untold, on a stream expseg has an arena for
    if (!out_of_address_range) CHECK_NOTHROW(sa->release_cached());
    sa->deallocate(x);
    sa->deallocate(b);
    void* C = sa.sim->stream_create();
    void* D = sa.sim->stream_create();
    void* c = nullptr;
    void* d = nullptr;
    CHECK_NOTHROW(c = sa->allocate(2 * MiB, C));  // out of address range: unused arenas go back
    CHECK_NOTHROW(d = sa->allocate(2 * MiB, D));
    sa->validate();
    expseg::driver::graph_t ga = nullptr;
    CHECK_NOTHROW(ga = sa.sim->capture_end(A));  // the capture survived
    CHECK(ga != nullptr);
    if (ga != nullptr) sa.sim->graph_destroy(ga);
    CHECK(sa.sim->hazards().empty());
    if (c != nullptr) sa->deallocate(c);
    if (d != nullptr) sa->deallocate(d);
    sa->release_cached();
    sa->validate();
    CHECK(reserved(*sa) == 0);
  }
}

// Was: the legacy stream's capture question, asked while a blocking stream captured, answered
// CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, which came out of these calls as a driver_error (the
// legacy stream itself never captures).
TEST_CASE("graph capture: pool calls naming the legacy stream while a blocking stream captures") {
  for (const BackendKind kind : kBoth) {
    CAPTURE(kind);
    auto sa = make_sim_allocator(sim_config(kind, 1 * GiB));
    void* s = sa.sim->stream_create_blocking();
    sa.sim->capture_begin(s);
    sa->begin_graph_pool(1, s);
    CHECK_NOTHROW(sa->begin_pool_allocations(2, nullptr));  // the legacy stream does not capture
    try {
      sa->begin_graph_pool(3, nullptr);
      FAIL("begin_graph_pool accepted the legacy stream");
    } catch (const expseg::driver_error& e) {
      FAIL("a driver error: " << std::string(e.what()));
    } catch (const expseg::error& e) {
      CHECK(std::string(e.what()).find("the stream is not capturing") != std::string::npos);
    }
    sa->end_pool_allocations(2, nullptr);
    expseg::driver::graph_t g = nullptr;
    CHECK_NOTHROW(g = sa.sim->capture_end(s));  // still valid
    REQUIRE(g != nullptr);
    sa->end_graph_pool(1);
    sa.sim->graph_destroy(g);
    sa->release_graph_pool(1);
    sa->release_graph_pool(2);
    sa->validate();
  }
}

// Was: a stream routed into a graph pool by begin_pool_allocations that then captured without
// expseg being told (no capture route asked the driver) was seen by nothing: the slow path asked
// the pool's key (never capturing), and no arena of expandable's watched the stream (its memory is
// the pool's). Giving back a released pool's idle memory then synchronized the device
// (cuCtxSynchronize), which the capture refuses: the call failed with the driver's 900 and the
// capture was invalidated. Now the request asks the stream itself, and so does expandable before a
// device synchronization.
TEST_CASE("graph pool: an untold capture on a begin_pool_allocations stream survives what requests and reclaim do") {
  for (const char* what : {"request on the stream", "release_cached", "request on another stream", "set_limit"}) {
    for (BackendKind kind : kBoth) {
      const std::string backend = expseg::to_string(kind);
      CAPTURE(backend);
      CAPTURE(what);
      auto sa = make_sim_allocator(sim_config(kind, 1 * GiB));
      // A released graph pool whose output lives on (graph outputs outlive their graph): once freed,
      // its idle memory goes back only after a device synchronization.
      void* c = sa.sim->stream_create();
      sa.sim->capture_begin(c);
      sa->begin_graph_pool(1, c);
      void* out = sa->allocate(8 * MiB, c);
      sa.sim->graph_destroy(sa.sim->capture_end(c));
      sa->end_graph_pool(1);
      sa->release_graph_pool(1);
      void* s = sa.sim->stream_create();
      void* other = sa.sim->stream_create();
      sa->begin_pool_allocations(2, s);  // e.g. a graph tree's warm-up stream
      void* held = sa->allocate(4 * MiB, s);
      sa->deallocate(out);
      sa.sim->capture_begin(s);  // untold
      const std::string w = what;
      void* got = nullptr;
      if (w == "request on the stream") CHECK_NOTHROW(got = sa->allocate(16 * MiB, s));
      else if (w == "release_cached") CHECK_NOTHROW(sa->release_cached());
      else if (w == "request on another stream") CHECK_NOTHROW(got = sa->allocate(16 * MiB, other));
      else CHECK_NOTHROW(sa->set_limit(64 * MiB));
      expseg::driver::graph_t g = nullptr;
      CHECK_NOTHROW(g = sa.sim->capture_end(s));  // was (expandable): invalidated, 901
      if (g != nullptr) sa.sim->graph_destroy(g);
      sa->deallocate(got);
      sa->deallocate(held);
      sa->end_pool_allocations(2, s);
      sa->validate();
      CHECK(sa.sim->hazards().empty());
    }
  }
}

// Was: route_to_pool looked at begin_pool_allocations routes only for a stream that did not capture,
// so one that captured untold left its pool while a told capture ran elsewhere (its blocks came from
// the stream's own cache, free for eager requests once freed while the graph may replay), and
// stayed in it otherwise. It stays in its pool either way now.
TEST_CASE("graph pool: a begin_pool_allocations stream that captures untold stays in its pool while a told capture runs elsewhere") {
  using CaptureMode = expseg::driver::Driver::CaptureMode;
  for (BackendKind kind : kBoth) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    auto sa = make_sim_allocator(sim_config(kind, 1 * GiB));
    void* c = sa.sim->stream_create();
    void* s = sa.sim->stream_create();
    sa->begin_pool_allocations(2, s);
    sa.sim->capture_begin(c, CaptureMode::relaxed);
    sa->begin_graph_pool(1, c);
    void* in_told = sa->allocate(2 * MiB, c);
    sa.sim->capture_begin(s, CaptureMode::relaxed);  // untold
    void* p = nullptr;
    CHECK_NOTHROW(p = sa->allocate(4 * MiB, s));
    auto in_pool = [&](std::uint64_t pool) {
      for (const auto& [at, bytes] : sa->graph_pool_blocks(pool))
        if (at == addr(p)) return true;
      return false;
    };
    CHECK(in_pool(2));  // was: not in pool 2
    CHECK_FALSE(in_pool(1));
    expseg::driver::graph_t gs = nullptr, gc = nullptr;
    CHECK_NOTHROW(gs = sa.sim->capture_end(s));
    CHECK_NOTHROW(gc = sa.sim->capture_end(c));
    sa->end_graph_pool(1);
    for (auto g : {gs, gc})
      if (g != nullptr) sa.sim->graph_destroy(g);
    sa->deallocate(p);
    sa->deallocate(in_told);
    sa->end_pool_allocations(2, s);
    sa->release_graph_pool(1);
    sa->release_graph_pool(2);
    sa->validate();
    sa->release_cached();
    CHECK(sa->stats().reserved_bytes[kAllPools].current == 0);
  }
}

// The capture question for a begin_pool_allocations stream is the slow path's: a request the cache
// serves asks the driver nothing (was, for a while: one cuStreamGetCaptureInfo per request).
TEST_CASE("graph pool: cached requests on a begin_pool_allocations stream ask the driver nothing") {
  for (BackendKind kind : kBoth) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    auto sa = make_sim_allocator(sim_config(kind, 1 * GiB));
    void* s = sa.sim->stream_create();
    sa->begin_pool_allocations(2, s);
    sa->deallocate(sa->allocate(1 * MiB, s));  // cached in the pool
    const auto queries = sa.sim->calls(expseg::driver::Op::stream_query);
    const auto slow = sa->stats().num_device_alloc;
    for (int i = 0; i < 1000; ++i) sa->deallocate(sa->allocate(1 * MiB, s));
    CHECK(sa->stats().num_device_alloc == slow);
    CHECK(sa.sim->calls(expseg::driver::Op::stream_query) == queries);
    sa->end_pool_allocations(2, s);
    sa->release_graph_pool(2);
    sa->validate();
  }
}

// The legacy stream routed into a pool (begin_pool_allocations(pool, nullptr)): its key is null, as
// "no routed request" was for a while, so a request of it asked the pool's key (never capturing)
// and, while a blocking stream captured untold, split_merge gave cached memory back (cuMemFree, a
// synchronization) under that capture. Now it asks the legacy stream, as for its other spelling
// (0x1): a capture on a blocking stream counts, and split_merge gives nothing back.
TEST_CASE("graph pool: a legacy-stream begin_pool_allocations request sees an untold capture on a blocking stream") {
  using expseg::driver::Op;
  for (void* legacy : {static_cast<void*>(nullptr), reinterpret_cast<void*>(std::uintptr_t{1})}) {
    CAPTURE(legacy);
    auto sa = make_sim_allocator(sim_config(BackendKind::split_merge, 1 * GiB));
    void* other = sa.sim->stream_create();
    void* bs = sa.sim->stream_create_blocking();
    sa->deallocate(sa->allocate(300 * MiB, other));  // cached: given back only outside a capture
    sa->begin_pool_allocations(2, legacy);
    sa.sim->capture_begin(bs);  // untold
    const auto frees = sa.sim->calls(Op::mem_free);
    const auto syncs = sa.sim->calls(Op::stream_sync);
    CHECK_THROWS_AS(sa->allocate(900 * MiB, legacy), expseg::out_of_memory);  // nothing given back
    CHECK(sa.sim->calls(Op::mem_free) == frees);
    CHECK(sa.sim->calls(Op::stream_sync) == syncs);
    expseg::driver::graph_t g = nullptr;
    CHECK_NOTHROW(g = sa.sim->capture_end(bs));
    if (g != nullptr) sa.sim->graph_destroy(g);
    sa->end_pool_allocations(2, legacy);
    sa->release_graph_pool(2);
    sa->validate();
  }
}

namespace {
// Runs `on_hook` once, the first time the thread `armed_for` asks a stream's capture.
struct CaptureQueryHook final : ForwardingDriver {
  using ForwardingDriver::ForwardingDriver;
  std::atomic<bool> armed{false};
  std::thread::id armed_for;
  std::function<void()> on_hook;
  std::uint64_t stream_capture_id(stream_t s) override {
    if (armed.load() && std::this_thread::get_id() == armed_for) {
      armed = false;
      on_hook();
    }
    return ForwardingDriver::stream_capture_id(s);
  }
};
}  // namespace

// Was: the routed request's stream stayed set in the shared context for all of Impl::allocate, so
// through its OOM path, where the lock is let go (the OOM observer runs unlocked). Thread A's routed
// request failed; meanwhile thread B's routed request on a stream that captures untold took the
// lock and set its stream; then A's scope ended and cleared it under B, whose slow path then asked
// the pool's key (never capturing): split_merge gave cached memory back (cuMemFree) during B's
// stream's capture. The stream is now set around the backend call only, under the lock.
TEST_CASE("graph pool: a routed request's OOM path leaves another thread's routed request its capture question") {
  using expseg::driver::Op;
  for (BackendKind kind : kBoth) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    auto [sim, drv, a] = wrapped_sim_allocator<CaptureQueryHook>(sim_config(kind, 1 * GiB));
    std::atomic<int> step{0};
    std::atomic<bool> observed{false};
    a->set_oom_observer([&](const expseg::OomReport&) {
      if (observed.exchange(true)) return;
      step = 1;  // A in its OOM path, the lock let go
      while (step != 2) std::this_thread::yield();
    });
    void* sa = sim->stream_create();
    a->begin_pool_allocations(3, sa);
    std::thread thread_a([&] {
      CHECK_THROWS_AS(a->allocate(4 * GiB, sa), expseg::out_of_memory);
      step = 3;
    });
    while (step != 1) std::this_thread::yield();
    void* other = sim->stream_create();
    a->deallocate(a->allocate(300 * MiB, other));  // cached: given back only outside a capture
    void* s = sim->stream_create();
    a->begin_pool_allocations(2, s);
    void* held = a->allocate(4 * MiB, s);
    void* o2 = sim->stream_create();
    void* x = a->allocate(1 * MiB, other);  // a free waiting for another stream: B's request asks its
    a->record_stream(x, o2);                // own stream's capture before the backend runs
    a->deallocate(x);
    sim->capture_begin(s);  // untold
    const auto frees = sim->calls(Op::mem_free);
    void* got = nullptr;
    std::thread thread_b([&] {
      drv->armed_for = std::this_thread::get_id();
      drv->on_hook = [&] {  // B holds the lock here: let A's request finish meanwhile
        step = 2;
        while (step != 3) std::this_thread::yield();
      };
      drv->armed = true;
      try {
        got = a->allocate(1000 * MiB, s);
      } catch (const expseg::out_of_memory&) {
      }
    });
    thread_b.join();
    if (step != 3) step = 2;  // the hook did not fire: let A go
    thread_a.join();
    if (kind == BackendKind::split_merge) CHECK(sim->calls(Op::mem_free) == frees);  // nothing given back under the capture
    expseg::driver::graph_t g = nullptr;
    CHECK_NOTHROW(g = sim->capture_end(s));
    if (g != nullptr) sim->graph_destroy(g);
    CHECK(sim->hazards().empty());
    a->deallocate(got);
    a->deallocate(held);
    a->end_pool_allocations(2, s);
    a->end_pool_allocations(3, sa);
    a->validate();
  }
}
