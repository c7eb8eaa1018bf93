// Stream safety: memory that work queued on a stream may still use is neither handed to another
// stream nor unmapped until that work is known complete. The simulated device records every unmap
// of memory that queued work (SimDriver::queue_use on a busy stream) still uses as a hazard.
#include <doctest/doctest.h>

#include <algorithm>
#include <thread>
#include <tuple>
#include <vector>

#include "allocator_impl.hpp"
#include "c_api_internal.hpp"
#include "capi_fixture.hpp"
#include "driver/sim_driver.hpp"
#include "forwarding_driver.hpp"
#include "expseg/expseg.h"
#include "test_util.hpp"

using namespace testutil;
using expseg::BackendKind;
using expseg::kAllPools;
using expseg::driver::Op;

namespace {
std::int64_t reserved(const expseg::Allocator& a) { return a.stats().reserved_bytes[kAllPools].current; }
}  // namespace

TEST_SUITE("regression-streams") {

TEST_CASE("sim: an unmap of memory that queued work still uses is a hazard; after the stream's sync it is not") {
  expseg::driver::SimDriver d;
  void* s = d.stream_create();
  const std::size_t g = d.granularity();
  const auto va = d.reserve(4 * g);
  const auto h = d.create(g);
  d.map(va, g, h);
  d.set_access(va, g);
  d.set_stream_busy(s, true);
  d.queue_use(s, va + 64, 128);
  d.stream_synchronize(s);  // done: the stream stays busy, but that work is complete
  d.unmap(va, g);
  CHECK(d.hazards().empty());
  d.map(va, g, h);
  d.set_access(va, g);
  d.queue_use(s, va, 4);
  d.queue_use(nullptr, va, 4);  // the default stream is idle: done at once
  d.unmap(va, g);
  REQUIRE(d.hazards().size() == 1);
  CHECK(d.hazards()[0].find("cuMemUnmap") != std::string::npos);
  d.set_stream_busy(s, false);
  d.release(h);
  d.free_reserve(va, 4 * g);
  d.stream_destroy(s);
}

TEST_CASE("C API: CuPy's streams may be destroyed with memory cached for them: expseg never syncs them") {
  // CuPy destroys a Stream when it is collected, and expseg_cupy_malloc caches memory per stream. On
  // CUDA 13 a cuStreamSynchronize of a destroyed stream failed once and crashed the next time; the
  // simulated device refuses it. Reclaiming that stream's idle memory (a non-blocking stream here)
  // must wait with a device sync.
  testutil::CApiFixture fixture;
  REQUIRE(expseg_configure("device:sim,sim_capacity:80GiB,backend:expandable,limit:100MiB") == EXPSEG_SUCCESS);
  void* first = expseg_cupy_malloc(nullptr, MiB, 0);  // creates the allocator
  REQUIRE(first != nullptr);
  expseg::Allocator* a = expseg::capi::allocator_for_tests(0);
  REQUIRE(a != nullptr);
  auto& sim = dynamic_cast<expseg::driver::SimDriver&>(expseg::detail::AllocatorAccess::driver(*a));
  void* gone = sim.stream_create();
  void* p = expseg_cupy_malloc(gone, 60 * MiB, 0);
  REQUIRE(p != nullptr);
  sim.set_stream_busy(gone, true);
  sim.queue_use(gone, addr(p), 60 * MiB);  // a kernel on the stream, then the free, then the destroy
  expseg_cupy_free(nullptr, p, 0);
  sim.stream_destroy(gone);  // CUDA lets the queued work finish
  const auto syncs = sim.calls(Op::stream_sync);
  void* q = expseg_cupy_malloc(nullptr, 60 * MiB, 0);  // needs the destroyed stream's idle memory
  CHECK(q != nullptr);
  CHECK(sim.calls(Op::stream_sync) == syncs + 1);  // one device sync, no sync of the destroyed stream
  CHECK(sim.hazards().empty());
  // Snapshots and reports show the stream itself.
  const std::string snap = expseg_snapshot_json(0);
  CHECK(snap.find("0xfffe") == std::string::npos);
  expseg_cupy_free(nullptr, q, 0);
  expseg_cupy_free(nullptr, first, 0);
  CHECK(expseg_release_cached(0) == EXPSEG_SUCCESS);
  a->validate();
}

TEST_CASE("C API: a blocking CuPy stream's idle memory goes back after the legacy stream's synchronization") {
  // CuPy's streams block by default (cupy.cuda.Stream(non_blocking=False)): the legacy stream's
  // synchronization waits for their work (on the H200 also once the stream is destroyed), not for a
  // non-blocking bystander's, and is permitted while a non-blocking stream captures. Whether the
  // stream blocks is asked when its arena is made, while the stream is alive. A non-blocking CuPy
  // stream still takes the device synchronization.
  for (const bool blocking : {true, false}) {
    for (const bool capture : {false, true}) {
      CAPTURE(blocking);
      CAPTURE(capture);
      testutil::CApiFixture fixture;
      REQUIRE(expseg_configure("device:sim,sim_capacity:80GiB,backend:expandable,limit:100MiB") == EXPSEG_SUCCESS);
      void* first = expseg_cupy_malloc(nullptr, MiB, 0);  // creates the allocator
      REQUIRE(first != nullptr);
      expseg::Allocator* a = expseg::capi::allocator_for_tests(0);
      REQUIRE(a != nullptr);
      auto& sim = dynamic_cast<expseg::driver::SimDriver&>(expseg::detail::AllocatorAccess::driver(*a));
      void* cupy_stream = blocking ? sim.stream_create_blocking() : sim.stream_create();
      void* p = expseg_cupy_malloc(cupy_stream, 60 * MiB, 0);
      REQUIRE(p != nullptr);
      sim.set_stream_busy(cupy_stream, true);
      sim.queue_use(cupy_stream, addr(p), 60 * MiB);  // a kernel on the stream, then the free
      expseg_cupy_free(nullptr, p, 0);
      void* bystander = sim.stream_create();
      auto* event = sim.event_create();
      sim.set_stream_busy(bystander, true);
      sim.event_record(event, bystander);
      void* capturing = sim.stream_create();
      if (capture) sim.capture_begin(capturing);
      void* q = expseg_cupy_malloc(nullptr, 60 * MiB, 0);  // needs the CuPy stream's idle memory
      if (blocking || !capture) {
        CHECK(q != nullptr);
        CHECK(sim.hazards().empty());
      } else {
        CHECK(q == nullptr);  // the device synchronization was refused (the capture is invalidated)
      }
      CHECK(sim.event_query(event) == (!blocking && !capture));  // waited for by a device synchronization only
      if (capture) {
        if (blocking) CHECK_NOTHROW(sim.graph_destroy(sim.capture_end(capturing)));
        else CHECK_THROWS_AS(sim.capture_end(capturing), expseg::driver_error);
      }
      sim.set_stream_busy(bystander, false);
      sim.set_stream_busy(cupy_stream, false);
      if (q != nullptr) expseg_cupy_free(nullptr, q, 0);
      expseg_cupy_free(nullptr, first, 0);
      CHECK(expseg_release_cached(0) == EXPSEG_SUCCESS);
      a->validate();
      sim.event_destroy(event);
      for (void* s : {cupy_stream, bystander, capturing}) sim.stream_destroy(s);
    }
  }
}

TEST_CASE("expandable: reclaim under a limit and release_cached wait for the stream that used the memory") {
  auto sa = make_sim_allocator(sim_config(BackendKind::expandable, 80 * GiB, "limit:100MiB"));
  void* s1 = sa.sim->stream_create();
  void* s2 = sa.sim->stream_create();
  void* p = sa->allocate(60 * MiB, s1);
  sa.sim->set_stream_busy(s1, true);
  sa.sim->queue_use(s1, addr(p), 60 * MiB);  // a kernel on s1, then the free
  sa->deallocate(p);
  void* q = sa->allocate(60 * MiB, s2);  // needs s1's idle memory
  CHECK(sa.sim->hazards().empty());
  // s1 reuses what is left of its idle memory (stream order: no wait), a kernel uses it, then the
  // free: that memory became idle after the synchronization above, so giving it back waits again.
  void* r = sa->allocate(16 * MiB, s1);
  REQUIRE(r != nullptr);
  sa.sim->queue_use(s1, addr(r), 16 * MiB);
  sa->deallocate(r);
  sa->deallocate(q);
  const auto before = sa.sim->call_stats();
  sa->release_cached();
  CHECK(sa.sim->call_stats().since(before).calls[static_cast<std::size_t>(Op::stream_sync)] >= 1);
  CHECK(sa.sim->hazards().empty());
  sa->validate();
  sa.sim->set_stream_busy(s1, false);
  sa.alloc.reset();
  sa.sim->stream_destroy(s1);
  sa.sim->stream_destroy(s2);
}

// The reclaim before a new highest mark (no limit) gives back idle memory of the request's stream.
// Memory idle since before a synchronization of that stream, or before an event recorded there
// (at the previous such reclaim) that has completed, is given back without waiting again; memory
// that became idle later still waits for the stream.
namespace {
struct EpochStory {
  testutil::SimAllocator sa = make_sim_allocator(sim_config(BackendKind::expandable));
  void* s1 = sa.sim->stream_create();
  std::vector<void*> live;
  std::uint64_t calls(Op op) { return sa.sim->call_stats().calls[static_cast<std::size_t>(op)]; }
  std::int64_t device_frees() { return sa->stats().num_device_free; }
  // Four 8 MiB blocks with a 2 MiB block after each, the four freed: four idle runs between live
  // blocks (idle before any synchronization), 40 MiB held, 8 MiB live.
  EpochStory() {
    std::vector<void*> x;
    for (int i = 0; i < 4; ++i) {
      x.push_back(sa->allocate(8 * MiB, s1));
      live.push_back(sa->allocate(2 * MiB, s1));
    }
    for (void* p : x) sa->deallocate(p);
  }
  ~EpochStory() {
    sa.sim->set_stream_busy(s1, false);
    for (void* p : live) sa->deallocate(p);
    sa.alloc.reset();
    sa.sim->stream_destroy(s1);
  }
};
}  // namespace

TEST_CASE("expandable: the reclaim before a new highest mark waits for the stream only for memory idle since its last known completion") {
  EpochStory t;
  auto& sim = *t.sa.sim;
  // 16 MiB fits no hole: it grows the segment past the highest mark, and as much idle memory goes
  // back first, the oldest first (the first two holes), after one synchronization of s1.
  std::uint64_t syncs = t.calls(Op::stream_sync);
  std::int64_t frees = t.device_frees();
  t.live.push_back(t.sa->allocate(16 * MiB, t.s1));
  CHECK(t.device_frees() > frees);
  CHECK(t.calls(Op::stream_sync) == syncs + 1);
  sim.set_stream_busy(t.s1, true);
  SUBCASE("memory idle before that synchronization goes back without another") {
    syncs = t.calls(Op::stream_sync);
    frees = t.device_frees();
    t.live.push_back(t.sa->allocate(16 * MiB, t.s1));  // the third and fourth holes go back
    CHECK(t.device_frees() > frees);
    CHECK(t.calls(Op::stream_sync) == syncs);
  }
  // A kernel on s1 uses a block carved from the third hole, then it is freed: idle after the
  // synchronization. 12 MiB past the highest mark: 12 MiB of the older idle memory go back without
  // waiting, and an event recorded on s1 marks what is idle now (z's memory among it) for the next
  // reclaim. Another 12 MiB past the mark needs the rest of the idle memory, z's included.
  auto idle_since = [&](bool kernel_done) {
    void* z = t.sa->allocate(2 * MiB, t.s1);
    sim.queue_use(t.s1, addr(z), 2 * MiB);
    t.sa->deallocate(z);
    syncs = t.calls(Op::stream_sync);
    frees = t.device_frees();
    const std::uint64_t records = t.calls(Op::event_record);
    t.live.push_back(t.sa->allocate(12 * MiB, t.s1));
    CHECK(t.device_frees() > frees);
    CHECK(t.calls(Op::stream_sync) == syncs);
    CHECK(t.calls(Op::event_record) == records + 1);
    CHECK(sim.hazards().empty());
    t.sa->validate();
    if (kernel_done) sim.set_stream_busy(t.s1, false);  // the event completes
    frees = t.device_frees();
    t.live.push_back(t.sa->allocate(12 * MiB, t.s1));
    CHECK(t.device_frees() > frees);
    CHECK(t.calls(Op::stream_sync) == syncs + (kernel_done ? 0 : 1));
  };
  SUBCASE("memory idle since then, the event recorded after it complete: no wait") { idle_since(true); }
  SUBCASE("memory idle since then, the kernel still queued: the reclaim waits for it") { idle_since(false); }
  SUBCASE("while a blocking stream captures, the reclaim records no event (CUDA may count it unsafe then)") {
    void* z = t.sa->allocate(2 * MiB, t.s1);
    sim.queue_use(t.s1, addr(z), 2 * MiB);
    t.sa->deallocate(z);
    void* capturing = sim.stream_create_blocking();
    sim.capture_begin(capturing);
    const std::uint64_t records = t.calls(Op::event_record);
    frees = t.device_frees();
    t.live.push_back(t.sa->allocate(12 * MiB, t.s1));  // s1 does not capture: its old idle memory goes back
    CHECK(t.device_frees() > frees);
    CHECK(t.calls(Op::event_record) == records);
    CHECK_NOTHROW(sim.graph_destroy(sim.capture_end(capturing)));
    sim.stream_destroy(capturing);
  }
  CHECK(sim.hazards().empty());
  t.sa->validate();
}

TEST_CASE("expandable: without a limit, growth past the highest mark waits for memory the stream may still use only past a slack") {
  // 1.2 GiB live, then a 12 MiB block freed while a kernel on its stream still uses it: idle
  // memory no synchronization or event has covered yet.
  auto sa = make_sim_allocator(sim_config(BackendKind::expandable));
  auto& sim = *sa.sim;
  void* s1 = sim.stream_create();
  auto syncs = [&] { return sim.call_stats().calls[static_cast<std::size_t>(Op::stream_sync)]; };
  auto device_frees = [&] { return sa->stats().num_device_free; };
  std::vector<void*> live{sa->allocate(1024 * MiB, s1)};
  for (int i = 0; i < 3; ++i) live.push_back(sa->allocate(64 * MiB, s1));
  void* a = sa->allocate(12 * MiB, s1);
  live.push_back(sa->allocate(2 * MiB, s1));
  sim.set_stream_busy(s1, true);
  sim.queue_use(s1, addr(a), 12 * MiB);
  sa->deallocate(a);
  std::uint64_t syncs_before = syncs();
  std::int64_t frees_before = device_frees();
  SUBCASE("within 1/128 of the live bytes past the target: no wait; it goes back at a later growth once safe") {
    // 16 MiB grows past the mark: the reclaim wants ~7 MiB of a's memory back, within the slack.
    void* b = sa->allocate(16 * MiB, s1);
    CHECK(syncs() == syncs_before);
    CHECK(device_frees() == frees_before);
    const expseg::Stats st = sa->stats();
    CHECK(st.reserved_bytes[kAllPools].current > st.active_bytes[kAllPools].current * 257 / 256 + 4 * MiB);
    // The kernel completes (the event the reclaim recorded with it). The memory left mapped did not
    // raise the highest mark: with b freed, 20 MiB (more than any hole) passes it again, and a's
    // memory goes back, without waiting, to within the slack over the live bytes (had the mark
    // risen, only what passes it would).
    sim.set_stream_busy(s1, false);
    sa->deallocate(b);
    live.push_back(sa->allocate(20 * MiB, s1));
    CHECK(syncs() == syncs_before);
    CHECK(device_frees() > frees_before);
    const expseg::Stats after = sa->stats();
    CHECK(after.reserved_bytes[kAllPools].current <= after.active_bytes[kAllPools].current * 257 / 256 + 2 * MiB);
  }
  SUBCASE("past it: the reclaim waits for the stream, then gives the memory back") {
    sim.queue_use(s1, addr(live[1]), 64 * MiB);
    sa->deallocate(live[1]);
    live.erase(live.begin() + 1);
    live.push_back(sa->allocate(128 * MiB, s1));  // fits no hole: past the mark by ~76 MiB of idle memory
    CHECK(syncs() == syncs_before + 1);
    CHECK(device_frees() > frees_before);
  }
  CHECK(sim.hazards().empty());
  sa->validate();
  sim.set_stream_busy(s1, false);
  for (void* p : live) sa->deallocate(p);
  sa.alloc.reset();
  sim.stream_destroy(s1);
}

TEST_CASE("expandable: destroying the allocator waits for work still queued on memory freed to its cache") {
  // A block freed while a kernel on its stream still uses it is cached (stream order makes its
  // reuse there safe); giving the memory back must wait for that kernel, as cuMemFree does for
  // split_merge's segments. Also for a cross-stream free still waiting for its event.
  auto sa = make_sim_allocator(sim_config(BackendKind::expandable));
  void* s1 = sa.sim->stream_create();
  void* s2 = sa.sim->stream_create();
  void* p = sa->allocate(8 * MiB, s1);
  void* q = sa->allocate(8 * MiB, s1);
  sa.sim->set_stream_busy(s1, true);
  sa.sim->set_stream_busy(s2, true);
  sa.sim->queue_use(s1, addr(p), 8 * MiB);
  sa->deallocate(p);
  sa->record_stream(q, s2);
  sa.sim->queue_use(s2, addr(q), 8 * MiB);
  sa->deallocate(q);
  sa.alloc.reset();
  CHECK(sa.sim->hazards().empty());
  CHECK(sa.sim->live().mappings == 0);
  CHECK(sa.sim->live().handles == 0);
  sa.sim->stream_destroy(s1);
  sa.sim->stream_destroy(s2);
}

}  // TEST_SUITE

TEST_SUITE("regression-streams") {

TEST_CASE("set_limit gives back the memory of cross-stream frees whose streams are done, on both backends") {
  // A block recorded on another stream (record_stream) and freed waits for that stream's event.
  // Lowering the limit gives back cached memory above it "at once": split_merge completes such
  // frees first (as release_cached and an OOM retry do), and expandable must too.
  for (BackendKind kind : {BackendKind::split_merge, BackendKind::expandable}) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    auto sa = make_sim_allocator(sim_config(kind));
    void* s1 = sa.sim->stream_create();
    void* s2 = sa.sim->stream_create();
    void* p = sa->allocate(60 * MiB, s1);
    sa->record_stream(p, s2);
    sa->deallocate(p);  // s2 is idle: its event completes at once, the free is still queued
    REQUIRE(sa->stats().reserved_bytes[kAllPools].current >= static_cast<std::int64_t>(60 * MiB));
    sa->set_limit(32 * MiB);
    CHECK(sa->stats().reserved_bytes[kAllPools].current <= static_cast<std::int64_t>(32 * MiB));
    CHECK(sa->stats().active_bytes[kAllPools].current == 0);
    sa->validate();
    sa.alloc.reset();
    sa.sim->stream_destroy(s1);
    sa.sim->stream_destroy(s2);
  }
}

}  // TEST_SUITE

TEST_SUITE("regression-streams") {

TEST_CASE("the per-thread default stream: a block freed by one thread is not handed to another thread's stream at once") {
  // cudaStreamPerThread (0x2) names another stream in each host thread (RMM's pools tell them apart
  // too): thread B's kernels do not wait for thread A's, so A's freed block is B's only after A's
  // work is known complete.
  void* const per_thread = stream_id(2);
  for (BackendKind kind : {BackendKind::split_merge, BackendKind::expandable}) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    auto sa = make_sim_allocator(sim_config(kind));
    void* p = nullptr;
    std::thread([&] { p = sa->allocate(8 * MiB, per_thread); sa->deallocate(p); }).join();  // A's kernel may still use p
    const auto syncs = sa.sim->calls(Op::stream_sync);
    const auto records = sa.sim->calls(Op::event_record);
    const auto frees = sa.sim->calls(Op::mem_free);
    void* q = nullptr;
    std::thread([&] { q = sa->allocate(8 * MiB, per_thread); }).join();
    // Another block, or A's after a wait for A's work: expandable synchronizes the stream that
    // covers A's (the legacy stream's synchronization); split_merge gives the segment back with
    // cuMemFree, which waits for the device, and gets its address again. An event recorded without
    // a wait on it would not do. (Another block would be safe too; both backends reuse A's, and
    // the check below keeps this test from passing on a path that checks nothing.)
    CHECK(q == p);
    if (q == p) {
      if (kind == BackendKind::expandable) CHECK(sa.sim->calls(Op::stream_sync) == syncs + 1);
      else CHECK(sa.sim->calls(Op::mem_free) > frees);
    }
    CHECK(sa.sim->calls(Op::event_record) == records);
    // On its own thread, the per-thread stream reuses its block at once (stream order).
    void* r = nullptr;
    void* again = nullptr;
    std::thread([&] {
      r = sa->allocate(8 * MiB, per_thread);
      sa->deallocate(r);
      again = sa->allocate(8 * MiB, per_thread);
      sa->deallocate(again);
    }).join();
    CHECK(again == r);
    sa->deallocate(q);
    sa->validate();
  }
}

TEST_CASE("the per-thread default stream: record_stream from another thread waits for that thread's stream") {
  // Thread B's kernel on its per-thread stream uses p, which this thread frees. The event cannot be
  // recorded on B's per-thread stream from here (0x2 here is this thread's own, idle): it goes to
  // the legacy default stream, which waits for every blocking stream's earlier work, B's included.
  void* const per_thread = stream_id(2);
  for (BackendKind kind : {BackendKind::split_merge, BackendKind::expandable}) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    auto sa = make_sim_allocator(sim_config(kind));
    void* s1 = sa.sim->stream_create();
    void* p = sa->allocate(8 * MiB, s1);
    std::thread([&] { sa->record_stream(p, per_thread); }).join();
    sa.sim->set_stream_busy(nullptr, true);  // B's kernel: the legacy default stream waits for it
    sa->deallocate(p);
    void* q = sa->allocate(8 * MiB, s1);
    CHECK(q != p);
    sa.sim->set_stream_busy(nullptr, false);
    void* r = sa->allocate(8 * MiB, s1);
    CHECK(r == p);
    sa->deallocate(q);
    sa->deallocate(r);
    sa->validate();
    sa.alloc.reset();
    sa.sim->stream_destroy(s1);
  }
}

TEST_CASE("streams a program creates and destroys leave no event queues behind") {
  // A server that makes a stream per request and hands blocks to it (record_stream): each such
  // stream gets an event queue for its frees. Once a queue is empty it need not stay; kept, they
  // would grow without end, and every cross-stream free and pending-free pass walks them all.
  for (BackendKind kind : {BackendKind::split_merge, BackendKind::expandable}) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    auto sa = make_sim_allocator(sim_config(kind));
    void* own = sa.sim->stream_create();
    void* busy = sa.sim->stream_create();  // its queue holds a free throughout: never dropped
    void* held = sa->allocate(MiB, own);
    sa->record_stream(held, busy);
    sa.sim->set_stream_busy(busy, true);
    sa->deallocate(held);
    std::size_t most = 0;
    for (int i = 0; i < 1000; ++i) {
      void* s = sa.sim->stream_create();
      void* p = sa->allocate(MiB, own);
      sa->record_stream(p, s);
      sa->deallocate(p);
      sa->deallocate(sa->allocate(MiB, own));  // s's event has completed: its free completes
      sa.sim->stream_destroy(s);
      most = std::max(most, expseg::detail::AllocatorAccess::pending_streams(*sa));
    }
    CHECK(most <= 64);
    CHECK(expseg::detail::AllocatorAccess::pending_streams(*sa) >= 1);  // busy's
    sa.sim->set_stream_busy(busy, false);
    sa->release_cached();
    CHECK(sa->stats().active_bytes[kAllPools].current == 0);
    sa->validate();
    sa.alloc.reset();
    sa.sim->stream_destroy(own);
    sa.sim->stream_destroy(busy);
  }
}

TEST_CASE("release_stream: what is cached for a stream goes back, the stream is forgotten and may be destroyed") {
  // A program that makes a stream per request destroys each one after its work. release_stream
  // synchronizes it, completes the frees that waited for it, gives back its cached memory and
  // forgets it: no later call touches the destroyed stream (the simulated device refuses a
  // synchronization of one), under a limit too, and nothing of it stays in snapshots.
  for (BackendKind kind : {BackendKind::split_merge, BackendKind::expandable}) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    auto sa = make_sim_allocator(sim_config(kind, 80 * GiB, "limit:256MiB"));
    void* own = sa.sim->stream_create();
    void* keep = sa->allocate(64 * MiB, own);  // another stream's live block: not touched
    const auto reserved_before = reserved(*sa);
    for (int round = 0; round < 20; ++round) {
      void* s = sa.sim->stream_create();
      void* big = sa->allocate(100 * MiB, s);
      void* small = sa->allocate(1000, s);
      void* handed = sa->allocate(8 * MiB, own);
      sa->record_stream(handed, s);  // used on s: its free waits for s
      sa.sim->set_stream_busy(s, true);
      sa.sim->queue_use(s, addr(big), 100 * MiB);
      CHECK_THROWS_AS(sa->release_stream(s), expseg::error);  // big and small are live
      sa->deallocate(big);
      sa->deallocate(small);
      CHECK_THROWS_AS(sa->release_stream(s), expseg::error);  // `handed` has s recorded
      sa->deallocate(handed);
      const auto syncs = sa.sim->calls(Op::stream_sync);
      sa->release_stream(s);
      CHECK(sa.sim->calls(Op::stream_sync) == syncs + 1);  // s itself, never the device
      CHECK(sa.sim->hazards().empty());  // big's pages went back only after s's queued work
      CHECK(sa->stats().active_bytes[kAllPools].current == static_cast<std::int64_t>(64 * MiB));  // handed's free completed
      for (const expseg::SegmentInfo& seg : sa->snapshot().segments) CHECK(seg.stream != addr(s));
      sa->validate();
      sa.sim->set_stream_busy(s, false);
      sa.sim->stream_destroy(s);
      // The limit leaves room only if the released memory is really gone.
      void* next = sa->allocate(180 * MiB, own);
      sa->deallocate(next);
      sa->validate();
    }
    CHECK(expseg::detail::AllocatorAccess::pending_streams(*sa) <= 1);
    sa->deallocate(keep);
    sa->release_cached();
    CHECK(reserved(*sa) == 0);
    CHECK(reserved_before >= static_cast<std::int64_t>(64 * MiB));
    sa->validate();
    sa.alloc.reset();
    CHECK(sa.sim->hazards().empty());
    sa.sim->stream_destroy(own);
  }
}

TEST_CASE("release_stream: refused, with nothing changed, for the default streams, a capturing stream and blocks still in use") {
  for (BackendKind kind : {BackendKind::split_merge, BackendKind::expandable}) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    auto sa = make_sim_allocator(sim_config(kind));
    CHECK_THROWS_AS(sa->release_stream(nullptr), expseg::error);
    CHECK_THROWS_AS(sa->release_stream(stream_id(1)), expseg::error);  // CU_STREAM_LEGACY
    CHECK_THROWS_AS(sa->release_stream(stream_id(2)), expseg::error);  // CU_STREAM_PER_THREAD
    void* s = sa.sim->stream_create();
    void* o = sa.sim->stream_create();
    // A block of s freed but waiting for another stream's work is still in use.
    void* p = sa->allocate(4 * MiB, s);
    sa->record_stream(p, o);
    sa.sim->set_stream_busy(o, true);
    sa->deallocate(p);
    const auto reserved_before = reserved(*sa);
    const auto syncs = sa.sim->calls(Op::stream_sync);
    CHECK_THROWS_AS(sa->release_stream(s), expseg::error);
    CHECK(sa.sim->calls(Op::stream_sync) == syncs);  // refused before any synchronization
    CHECK(reserved(*sa) == reserved_before);
    sa.sim->set_stream_busy(o, false);
    // A capturing stream would be invalidated by its synchronization.
    sa.sim->capture_begin(s);
    CHECK_THROWS_AS(sa->release_stream(s), expseg::error);
    CHECK(sa.sim->stream_capture_id(s) != 0);
    void* g = sa.sim->capture_end(s);
    sa.sim->graph_destroy(g);
    // A failed synchronization: reported, and the stream's memory stays as it was.
    sa->deallocate(sa->allocate(MiB, o));  // completes p's free
    const auto reserved_now = reserved(*sa);
    sa.sim->inject_fault(Op::stream_sync, 1, expseg::driver::Fault::error);
    CHECK_THROWS_AS(sa->release_stream(s), expseg::driver_error);
    CHECK(reserved(*sa) == reserved_now);
    sa->validate();
    sa->release_stream(s);
    CHECK(reserved(*sa) == reserved_now - reserved_before);  // s's memory, all of it
    // Releasing a stream nothing was cached for, or one already released, does nothing.
    sa->release_stream(s);
    sa->validate();
    sa.alloc.reset();
    sa.sim->stream_destroy(s);
    sa.sim->stream_destroy(o);
  }
}

TEST_CASE("C API: expseg_release_stream") {
  testutil::CApiFixture fixture;
  REQUIRE(expseg_configure("device:sim,sim_capacity:80GiB,backend:expandable") == EXPSEG_SUCCESS);
  // No allocator yet: nothing cached for a stream; the default stream is refused all the same.
  CHECK(expseg_release_stream(0, reinterpret_cast<expseg_stream_t>(std::uintptr_t{0x5000})) == EXPSEG_SUCCESS);
  CHECK(expseg_release_stream(0, nullptr) == EXPSEG_ERROR_INVALID_ARGUMENT);
  CHECK(expseg_release_stream(-1, nullptr) == EXPSEG_ERROR_INVALID_DEVICE);
  void* first = expseg_malloc(static_cast<ssize_t>(MiB), 0, nullptr);
  REQUIRE(first != nullptr);
  expseg::Allocator* a = expseg::capi::allocator_for_tests(0);
  auto& sim = dynamic_cast<expseg::driver::SimDriver&>(expseg::detail::AllocatorAccess::driver(*a));
  void* s = sim.stream_create();
  void* p = expseg_malloc(static_cast<ssize_t>(32 * MiB), 0, s);
  REQUIRE(p != nullptr);
  CHECK(expseg_release_stream(0, s) == EXPSEG_ERROR_INVALID_ARGUMENT);
  CHECK(std::string(expseg_last_error()).find("in use") != std::string::npos);
  CHECK(expseg_release_stream(0, nullptr) == EXPSEG_ERROR_INVALID_ARGUMENT);
  expseg_free(p, 0, 0, s);
  CHECK(expseg_release_stream(0, s) == EXPSEG_SUCCESS);
  sim.stream_destroy(s);
  expseg_free(first, 0, 0, nullptr);
  a->validate();
}

}  // TEST_SUITE

TEST_SUITE("regression-streams") {

TEST_CASE("expandable: streams used once do not use up the address range; release_cached gives their ranges back") {
  // Each stream's segment reserves about twice the device's memory of address range. A program that
  // uses many streams over its life (a stream per request, never released) ran out of range: every
  // later new stream failed, even after release_cached, with nothing allocated. Here the process's
  // address space (128 TiB, as a CUDA process's) holds two segments of 16 TiB and, past expseg's
  // 32 TiB budget of full-size segments, about 95 of a sixteenth (1 TiB).
  auto stream = [](int i) { return reinterpret_cast<void*>(static_cast<std::uintptr_t>(0x10000 + 16 * i)); };
  {
    expseg::Allocator a(sim_config(BackendKind::expandable, 80 * GiB, "expandable_va_size:16TiB"));
    for (int i = 0; i < 200; ++i) {  // more streams than the span holds segments: each empty once freed
      void* p = a.allocate(1 * MiB, stream(i));
      a.deallocate(p);
    }
    CHECK(a.stats().num_ooms == 0);
    a.validate();
    a.release_cached();
    const auto s = a.stats();
    CHECK(s.reserved_bytes[kAllPools].current == 0);
    CHECK(s.segment[kAllPools].current == 0);  // every range given back, the first of each stream too
    void* p = a.allocate(1 * MiB, reinterpret_cast<void*>(std::uintptr_t{0xABC000}));
    a.deallocate(p);
    a.validate();
  }
  {
    // Streams whose blocks are live keep their ranges: at 2 TiB a segment, they filled the span at
    // ~60 streams and the next stream failed for the address range. Once the segments hold 32 TiB,
    // new ones reserve a sixteenth (128 GiB): 100 streams fit.
    expseg::Allocator a(sim_config(BackendKind::expandable, 80 * GiB, "expandable_va_size:2TiB"));
    std::vector<void*> live;
    for (int i = 0; i < 100; ++i) live.push_back(a.allocate(1 * MiB, stream(i)));
    CHECK(a.stats().num_ooms == 0);
    CHECK(a.stats().segment[kAllPools].current == 100);
    a.validate();
    for (void* q : live) a.deallocate(q);
    a.release_cached();
    CHECK(a.stats().segment[kAllPools].current == 0);
  }
}

TEST_CASE("expandable: a stream per request reuses the address range of the last stream released") {
  // A server that makes a stream per request and releases it after: each stream's segment reserved
  // its range (cuMemAddressReserve) and gave it back (cuMemAddressFree), 2 of the cycle's 12 driver
  // calls. The range of the last segment given back is kept for the next new segment.
  auto sa = make_sim_allocator(sim_config(BackendKind::expandable, 80 * GiB, ""));
  void* own = sa.sim->stream_create();
  void* keep = sa->allocate(1 * MiB, own);  // the program's own stream keeps its segment
  const auto reserves0 = sa.sim->calls(Op::reserve);
  const auto frees0 = sa.sim->calls(Op::free_reserve);
  for (int round = 0; round < 10; ++round) {
    CAPTURE(round);
    void* s = sa.sim->stream_create();
    void* p = sa->allocate(3 * MiB, s);
    sa.sim->set_stream_busy(s, true);
    sa.sim->queue_use(s, addr(p), 3 * MiB);
    sa->deallocate(p);
    sa->release_stream(s);
    CHECK(sa.sim->hazards().empty());  // the pages went back after s's queued work
    sa.sim->set_stream_busy(s, false);
    sa.sim->stream_destroy(s);
    CHECK(sa.sim->calls(Op::reserve) == reserves0 + 1);  // the first stream's reservation serves every one
    CHECK(sa.sim->calls(Op::free_reserve) == frees0);
    CHECK(sa.sim->live().reservations == 2);  // own's segment and the spare range
    CHECK(sa.sim->live().handles == 1);       // own's: the released stream's memory went back
    CHECK(reserved(*sa) == static_cast<std::int64_t>(sa.sim->granularity()));
    CHECK(sa->stats().segment[kAllPools].current == 1);  // the spare range is no segment
    sa->validate();
  }
  sa->deallocate(keep);
  sa->release_cached();  // gives back the spare range too
  CHECK(sa.sim->live().reservations == 0);
  CHECK(reserved(*sa) == 0);
  sa->validate();
  sa.alloc.reset();
  sa.sim->stream_destroy(own);
  // A request too large for the spare range gives it back and reserves its own (another allocator,
  // made once the first is gone: a spare is kept only by the process's one expandable allocator).
  {
    auto small = make_sim_allocator(sim_config(BackendKind::expandable, 80 * GiB, "expandable_va_size:1GiB"));
    void* a = small.sim->stream_create();
    void* b = small.sim->stream_create();
    small->deallocate(small->allocate(8 * MiB, a));
    small->release_stream(a);
    CHECK(small.sim->live().reservations == 1);  // a's 1 GiB range, spare
    void* big = small->allocate(3 * GiB, b);
    CHECK(small.sim->live().reservations == 1);  // b's 3 GiB segment; the spare went back
    small->validate();
    small->deallocate(big);
    small->release_cached();
    CHECK(small.sim->live().reservations == 0);
    small->validate();
    small.alloc.reset();
    small.sim->stream_destroy(a);
    small.sim->stream_destroy(b);
  }
}

TEST_CASE("expandable: with two allocators in the process, a released stream's range goes back, not kept for one of them") {
  // All expandable allocators of a process share one address space, and each keeps its ranges under
  // its own lock. Was: allocator A kept the range of a released stream as its spare, and allocator B
  // (another device), short of address range, could not take it back: B's request was an OOM for
  // the address range while A mapped nothing; A's release_cached made it succeed.
  const expseg::driver::SimOptions three_gib{.address_space = std::size_t{3} << 30};
  auto a = make_sim_allocator(sim_config(BackendKind::expandable, 80 * GiB, "expandable_va_size:2GiB"), three_gib);
  auto b = make_sim_allocator(sim_config(BackendKind::expandable, 80 * GiB, "expandable_va_size:2GiB"), three_gib);
  void* sa = a.sim->stream_create();
  void* sb = b.sim->stream_create();
  a->deallocate(a->allocate(8 * MiB, sa));
  const auto a_frees = a.sim->calls(Op::free_reserve);
  a->release_stream(sa);
  CHECK(a.sim->calls(Op::free_reserve) == a_frees + 1);  // the range went back
  CHECK(a.sim->live().reservations == 0);
  a->validate();
  void* p = b->allocate(1536 * MiB, sb);
  CHECK(b->stats().num_ooms == 0);
  b->validate();
  b->deallocate(p);
  b.alloc.reset();
  // Alone in the process again, A keeps the next released stream's range.
  a->deallocate(a->allocate(8 * MiB, sa));
  a->release_stream(sa);
  CHECK(a.sim->live().reservations == 1);
  a->validate();
  a->release_cached();
  CHECK(a.sim->live().reservations == 0);
  a.alloc.reset();
  a.sim->stream_destroy(sa);
  b.sim->stream_destroy(sb);
}

TEST_CASE("expandable: a stream per request maps one handle while the process holds gigabytes") {
  // With 4 GiB held, handles may be 16 MiB and a small request growing a segment's tail maps a
  // 16 MiB growth granule: the request's frame and the granule's rest, two handles. A stream that
  // lives for one request made and gave back both (cuMemCreate, cuMemMap, cuMemSetAccess, cuMemUnmap,
  // cuMemRelease twice); its first request now maps its own frame alone.
  auto sa = make_sim_allocator(sim_config(BackendKind::expandable, 80 * GiB, ""));
  void* weights = sa->allocate(4 * GiB);
  for (int round = 0; round < 5; ++round) {
    CAPTURE(round);
    void* s = sa.sim->stream_create();
    const auto before = sa.sim->call_stats();
    void* p = sa->allocate(512, s);
    void* q = sa->allocate(64 * KiB, s);  // packs into the same frame: no growth
    sa->deallocate(q);
    sa->deallocate(p);
    sa->release_stream(s);
    const auto d = sa.sim->call_stats().since(before);
    CHECK(d.calls[static_cast<std::size_t>(Op::create)] == 1);
    CHECK(d.calls[static_cast<std::size_t>(Op::set_access)] == 1);
    CHECK(d.calls[static_cast<std::size_t>(Op::release)] == 1);
    CHECK(reserved(*sa) == static_cast<std::int64_t>(4 * GiB));
    sa->validate();
    sa.sim->stream_destroy(s);
  }
  // A stream that goes on asking grows by the granule from its second growth on.
  void* s = sa.sim->stream_create();
  std::vector<void*> v;
  for (int i = 0; i < 3; ++i) v.push_back(sa->allocate(1 * MiB, s));  // the third needs a second frame
  CHECK(reserved(*sa) == static_cast<std::int64_t>(4 * GiB + 16 * MiB));
  sa->validate();
  for (void* p : v) sa->deallocate(p);
  sa->release_stream(s);
  sa->deallocate(weights);
  sa->release_cached();
  CHECK(reserved(*sa) == 0);
  sa.alloc.reset();
  sa.sim->stream_destroy(s);
}

TEST_CASE("release_stream: a give-back that fails throws driver_error, the allocator stays consistent, a second call ends it") {
  for (BackendKind kind : {BackendKind::split_merge, BackendKind::expandable}) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    auto sa = make_sim_allocator(sim_config(kind, 80 * GiB, ""));
    void* s = sa.sim->stream_create();
    std::vector<void*> ps;
    for (int i = 0; i < 3; ++i) ps.push_back(sa->allocate(64 * MiB, s));
    for (void* p : ps) sa->deallocate(p);
    sa.sim->inject_fault(kind == BackendKind::split_merge ? Op::mem_free : Op::unmap, 1, expseg::driver::Fault::error);
    CHECK_THROWS_AS(sa->release_stream(s), expseg::driver_error);
    sa->validate();
    sa->release_stream(s);
    CHECK(reserved(*sa) == 0);
    sa->validate();
    sa.alloc.reset();
    sa.sim->stream_destroy(s);
  }
}

TEST_CASE("expandable: a cuMemAddressFree of the spare range that fails leaves the allocator consistent") {
  using expseg::driver::Fault;
  auto sa = make_sim_allocator(sim_config(BackendKind::expandable, 80 * GiB, "expandable_va_size:1GiB"));
  void* a = sa.sim->stream_create();
  void* b = sa.sim->stream_create();
  void* c = sa.sim->stream_create();
  sa->deallocate(sa->allocate(3 * GiB, b));
  sa->deallocate(sa->allocate(8 * MiB, a));
  sa->release_stream(a);  // a's 1 GiB range: the spare
  // b's 3 GiB segment is larger: releasing b gives the 1 GiB spare back first, and that fails.
  CHECK(sa.sim->live().reservations == 2);
  sa.sim->inject_fault(Op::free_reserve, 1, Fault::error);
  CHECK_THROWS_AS(sa->release_stream(b), expseg::driver_error);
  sa->validate();
  CHECK(sa.sim->live().reservations == 2);  // b's segment and the spare, both still counted
  sa->release_stream(b);                    // again: served, b's range is the spare now
  CHECK(sa.sim->live().reservations == 1);
  CHECK(sa->stats().reserved_bytes[kAllPools].current == 0);
  sa->validate();
  // A request on c too large for the 3 GiB spare: the spare's give-back fails, the request is
  // served from a reservation of its own, and the spare stays (given back by release_cached).
  sa.sim->inject_fault(Op::free_reserve, 1, Fault::error);
  const auto frees_before = sa.sim->calls(Op::free_reserve);
  void* big = sa->allocate(4 * GiB, c);
  CHECK(sa.sim->calls(Op::free_reserve) == frees_before + 1);  // the spare was offered back, and that failed
  CHECK(sa.sim->live().reservations == 2);
  sa->validate();
  sa->deallocate(big);
  sa->release_cached();
  CHECK(sa.sim->live().reservations == 0);
  sa->validate();
  sa.alloc.reset();
  for (void* s : {a, b, c}) sa.sim->stream_destroy(s);
}

TEST_CASE("expandable: out of address range, the spare range goes back before a segment is made smaller") {
  // 3 GiB of address range: a released stream's 2 GiB range kept spare leaves 1 GiB; a request for
  // 2.5 GiB on another stream needs a larger range than the spare: the spare goes back, and the
  // request gets a range of its own size rather than an OOM for the address range.
  auto sa = make_sim_allocator(sim_config(BackendKind::expandable, 80 * GiB, "expandable_va_size:2GiB"),
                               expseg::driver::SimOptions{.address_space = std::size_t{3} << 30});
  void* a = sa.sim->stream_create();
  void* b = sa.sim->stream_create();
  sa->deallocate(sa->allocate(8 * MiB, a));
  sa->release_stream(a);
  CHECK(sa.sim->live().reservations == 1);
  void* big = sa->allocate(2 * GiB + 512 * MiB, b);
  CHECK(sa->stats().num_ooms == 0);
  CHECK(sa.sim->live().reservations == 1);
  sa->validate();
  sa->deallocate(big);
  sa->release_cached();
  CHECK(sa.sim->live().reservations == 0);
  // Stream a's segment, idle, not released, holds 2 GiB; b's first request finds 1 GiB of range
  // left: a's memory and range go back (kept spare by the give-back, then given back too), and b's
  // segment gets the full 2 GiB, so that b grows in place to 1.9 GiB with no other reservation.
  sa->deallocate(sa->allocate(8 * MiB, a));
  const auto reserves0 = sa.sim->calls(Op::reserve);
  void* first = sa->allocate(8 * MiB, b);
  CHECK(sa.sim->calls(Op::reserve) == reserves0 + 2);  // refused once, then served at full size
  void* more = sa->allocate(1900 * MiB, b);
  CHECK(sa.sim->calls(Op::reserve) == reserves0 + 2);
  CHECK(sa.sim->live().reservations == 1);
  CHECK(sa->stats().num_ooms == 0);
  sa->validate();
  sa->deallocate(first);
  sa->deallocate(more);
  sa.alloc.reset();
  sa.sim->stream_destroy(a);
  sa.sim->stream_destroy(b);
}


namespace {
// An allocator of `kind` on an 8 GiB simulated device reached through test driver D.
template <class D>
auto wrapped_sim_allocator(BackendKind kind) {
  return testutil::wrapped_sim_allocator<D>(sim_config(kind, 8 * GiB));
}

// Counts capture queries and synchronizations of streams the test has destroyed.
class DestroyedStreamSpy final : public testutil::ForwardingDriver {
 public:
  using ForwardingDriver::ForwardingDriver;
  std::vector<stream_t> destroyed;
  int queries_of_destroyed = 0;
  void stream_destroy(stream_t s) override {
    ForwardingDriver::stream_destroy(s);
    destroyed.push_back(s);
  }
  std::uint64_t stream_capture_id(stream_t s) override {
    if (std::find(destroyed.begin(), destroyed.end(), s) != destroyed.end()) ++queries_of_destroyed;
    return ForwardingDriver::stream_capture_id(s);
  }
  void stream_synchronize(stream_t s) override {
    if (std::find(destroyed.begin(), destroyed.end(), s) != destroyed.end()) ++queries_of_destroyed;
    ForwardingDriver::stream_synchronize(s);
  }
};
}  // namespace

TEST_CASE("streams regression: release_stream forgets a prepare_capture answer, and refuses a stream routed into a graph pool") {
  // Was: a prepare_capture(s) whose capture never began stayed listed after release_stream(s), and
  // expandable asked the destroyed stream about captures; and release_stream(s) was accepted while
  // s allocated into a graph pool (begin_pool_allocations), whose route outlived the stream.
  for (BackendKind kind : {BackendKind::split_merge, BackendKind::expandable}) {
    CAPTURE(expseg::to_string(kind));
    auto [sim, spy, a] = wrapped_sim_allocator<DestroyedStreamSpy>(kind);
    void* s = spy->stream_create();
    a->deallocate(a->allocate(4 * MiB, s));
    a->prepare_capture(s);  // the capture never begins (the program raised first)
    a->release_stream(s);
    spy->stream_destroy(s);
    for (int i = 0; i < 4; ++i) a->deallocate(a->allocate((i + 1) * 16 * MiB));
    a->release_cached();
    void* t = spy->stream_create();
    a->deallocate(a->allocate(8 * MiB, t));
    CHECK(spy->queries_of_destroyed == 0);
    // Routed into pool 7: refused, nothing changed; after end_pool_allocations, released.
    a->begin_pool_allocations(7, t);
    void* p = a->allocate(1 * MiB, t);
    a->deallocate(p);
    CHECK_THROWS_WITH_AS(a->release_stream(t), doctest::Contains("allocates into graph pool 7 (begin_pool_allocations)"), expseg::error);
    void* q = a->allocate(1 * MiB, t);
    CHECK(a->graph_pool_blocks(7).size() == 1);  // still routed
    a->deallocate(q);
    a->end_pool_allocations(7, t);
    CHECK_NOTHROW(a->release_stream(t));
    spy->stream_destroy(t);
    a->release_graph_pool(7);
    a->release_cached();
    CHECK(spy->queries_of_destroyed == 0);
    a->validate();
  }
}

namespace {
// Begins a capture on `trigger` right after an event is recorded there, as another thread could
// between a free's capture check and its records.
class CaptureAfterRecord final : public testutil::ForwardingDriver {
 public:
  using ForwardingDriver::ForwardingDriver;
  stream_t trigger = nullptr;
  bool began = false;
  void event_record(event_t e, stream_t s) override {
    ForwardingDriver::event_record(e, s);
    if (s == trigger && !began) {
      began = true;
      sim().capture_begin(s);
    }
  }
};
}  // namespace

TEST_CASE("streams regression: release_stream destroys the events a failed free kept for the stream's capture") {
  // A free that failed midway keeps an event recorded on a stream that began capturing meanwhile
  // (it may be the capture's) until that capture ends; release_stream(s), once s captures no more,
  // destroys it, rather than leave it to name a stream the program then destroys.
  for (BackendKind kind : {BackendKind::split_merge, BackendKind::expandable}) {
    CAPTURE(expseg::to_string(kind));
    auto [sim, drv, a] = wrapped_sim_allocator<CaptureAfterRecord>(kind);
    void* s = sim->stream_create();
    void* t = sim->stream_create();
    void* b = a->allocate(4 * MiB);
    a->record_stream(b, s);
    a->record_stream(b, t);
    drv->trigger = s;
    sim->inject_fault(Op::event_record, 2, expseg::driver::Fault::error);  // t's record, after s's
    CHECK_THROWS_AS(a->deallocate(b), expseg::driver_error);
    REQUIRE(drv->began);
    sim->graph_destroy(sim->capture_end(s));
    a->deallocate(b);  // again: now it queues its events
    const std::size_t events = sim->live().events;
    CHECK_NOTHROW(a->release_stream(s));
    CHECK(sim->live().events == events - 1);  // the kept one: destroyed
    a->validate();
    a->release_cached();
  }
}
}  // TEST_SUITE

namespace {
// Models a CUstream handle value that CUDA gives to a new stream of other flags once the old one is
// destroyed: stream_is_blocking answers as the test sets it.
class ReusedHandleDriver : public ForwardingDriver {
 public:
  using ForwardingDriver::ForwardingDriver;
  bool blocking = true;
  bool stream_is_blocking(stream_t) override { return blocking; }
};
}  // namespace

TEST_CASE("streams: expandable: a CuPy stream's handle reused by a non-blocking stream: its idle memory waits for that stream's work") {
  // The arena of a foreign key remembered that its stream blocked when it was made; a non-blocking
  // stream given the same handle value got its cached memory, and another stream's request then
  // unmapped that memory after only the legacy stream's synchronization, under the new stream's
  // running work.
  auto cfg = sim_config(BackendKind::expandable, 80 * GiB, "limit:100MiB");
  auto [sim, drv, a] = testutil::wrapped_sim_allocator<ReusedHandleDriver>(cfg);
  void* s = sim->stream_create();
  void* key = expseg::backends::foreign_stream_key(s);  // what expseg_cupy_malloc passes for s
  a->deallocate(a->allocate(60 * MiB, key));  // a blocking CuPy stream's cache
  drv->blocking = false;                       // destroyed; the handle now names a non-blocking stream
  void* p = a->allocate(60 * MiB, key);        // served from that cache
  sim->set_stream_busy(s, true);
  sim->queue_use(s, addr(p), 60 * MiB);
  a->deallocate(p);
  void* q = a->allocate(60 * MiB, nullptr);    // needs that idle memory under the limit
  CHECK(sim->hazards().empty());
  for (const std::string& h : sim->hazards()) MESSAGE(h);
  sim->set_stream_busy(s, false);
  a->deallocate(q);
  a->validate();
  a.reset();
  sim->stream_destroy(s);
}

namespace {
// Counts the stream queries the allocator makes (cuStreamGetFlags, cuStreamGetCaptureInfo).
class StreamQueryCounter : public ForwardingDriver {
 public:
  using ForwardingDriver::ForwardingDriver;
  int queries = 0;
  bool stream_is_blocking(stream_t s) override {
    ++queries;
    return ForwardingDriver::stream_is_blocking(s);
  }
  std::uint64_t stream_capture_id(stream_t s) override {
    ++queries;
    return ForwardingDriver::stream_capture_id(s);
  }
};
}  // namespace

TEST_CASE("streams: expandable: a cached pair on a blocking CuPy stream asks the driver nothing") {
  // Was: every request on a foreign key whose stream blocks (CuPy's default streams) asked whether
  // it captures and whether it still blocks, two driver calls on the cached path. Now the arena's
  // slow path asks, and until then its idle memory is reclaimed after the device's synchronization.
  auto cfg = sim_config(BackendKind::expandable, 80 * GiB, "limit:1GiB");
  auto [sim, drv, a] = testutil::wrapped_sim_allocator<StreamQueryCounter>(cfg);
  void* s = sim->stream_create_blocking();  // CuPy's streams block by default
  void* key = expseg::backends::foreign_stream_key(s);
  a->deallocate(a->allocate(1 * MiB, key));
  const int before = drv->queries;
  for (int i = 0; i < 100; ++i) a->deallocate(a->allocate(1 * MiB, key));
  CHECK(drv->queries == before);
  // The arena's slow path asks again (its stream is alive: a request names it).
  void* big = a->allocate(600 * MiB, key);
  CHECK(drv->queries > before);
  a->deallocate(big);
  a->validate();
  a.reset();
  sim->stream_destroy(s);
}

// Graph outputs outlive the stream they were captured (or warmed up) on: blocks a stream allocated
// into a graph pool belong to the pool, so release_stream does not wait for them, and they are
// freed after the stream is destroyed with no call on it (the simulated device refuses work and
// events on a destroyed stream), and serve the pool as before.
TEST_CASE("release_stream: blocks the stream allocated into a graph pool belong to the pool and do not hold it") {
  for (BackendKind kind : {BackendKind::split_merge, BackendKind::expandable}) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    auto sa = make_sim_allocator(sim_config(kind, 1 * GiB));
    void* s = sa.sim->stream_create();
    sa->begin_pool_allocations(9, s);
    void* warm = sa->allocate(1 * MiB, s);
    sa->end_pool_allocations(9, s);
    sa.sim->capture_begin(s);
    sa->begin_graph_pool(9, s);
    void* captured = sa->allocate(2 * MiB, s);
    sa.sim->graph_destroy(sa.sim->capture_end(s));
    sa->end_graph_pool(9);
    CHECK_NOTHROW(sa->release_stream(s));
    sa.sim->stream_destroy(s);
    CHECK(sa->graph_pool_blocks(9).size() == 2);  // still the pool's
    CHECK_NOTHROW(sa->deallocate(warm));
    CHECK_NOTHROW(sa->deallocate(captured));
    sa->validate();
    sa->release_graph_pool(9);  // the two uses: begin_pool_allocations', begin_graph_pool's
    sa->release_graph_pool(9);
    sa->release_cached();
    CHECK(sa->stats().reserved_bytes[kAllPools].current == 0);
    CHECK(sa.sim->hazards().empty());
  }
}
