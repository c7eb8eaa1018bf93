// Regressions (found by an audit of the frontend and split_merge error paths):
//   - a deallocate that throws (cuEventRecord fails for a recorded stream) left a free in the
//     recorded trace, which then did not validate or replay;
//   - oom_dump's %n came from num_ooms, which reset_accumulated_stats zeroes: a later dump
//     overwrote an earlier one;
//   - an OOM of allocator B inside allocator A's observer was not reported to B's observer (one
//     recursion guard for all allocators);
//   - a huge max_non_split_rounding_mb wrapped size + rounding around and stopped every reuse of a
//     cached oversize block;
//   - (a stats review) a request of 1 EiB or more counted in num_ooms, which PyTorch refuses before
//     its allocator; expandable failed a request that could never fit without completing pending
//     frees first; an OOM report counted waiting frees' bytes beside the live allocations only.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <future>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "expseg/trace.hpp"
#include "test_util.hpp"

using namespace testutil;
using expseg::BackendKind;
using expseg::kAllPools;
using expseg::driver::Fault;
using expseg::driver::Op;

TEST_CASE("regression: a deallocate that fails records no free; the trace of the real free validates") {
  for (BackendKind b : {BackendKind::split_merge, BackendKind::expandable}) {
    CAPTURE(std::string(expseg::to_string(b)));
    auto sa = make_sim_allocator(sim_config(b, 512 * MiB));
    void* s1 = sa.sim->stream_create();
    void* s2 = sa.sim->stream_create();
    sa->start_recording();
    void* p = sa->allocate(4096);
    sa->record_stream(p, s1);
    sa->record_stream(p, s2);
    sa.sim->inject_fault(Op::event_record, 2, Fault::error);  // the second stream's event
    CHECK_THROWS_AS(sa->deallocate(p), expseg::driver_error);
    sa->validate();
    CHECK(sa->stats().allocation[kAllPools].current == 1);  // still live
    sa->deallocate(p);
    const expseg::Trace t{"recorded", sa->recorded()};
    int frees = 0;
    for (const auto& e : t.events) frees += e.action == expseg::TraceAction::free;
    CHECK(frees == 1);
    CHECK_NOTHROW(expseg::validate_trace(t));
    sa->validate();
    sa.alloc.reset();
    sa.sim->stream_destroy(s1);
    sa.sim->stream_destroy(s2);
  }
}

TEST_CASE("regression: oom_dump numbers OOMs over the allocator's life, whatever reset_accumulated_stats does") {
  const auto dir = std::filesystem::temp_directory_path() / ("expseg_regression_dump_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  {
    expseg::Allocator a(sim_config(BackendKind::split_merge, 80 * GiB, "limit:64MiB,oom_dump:" + (dir / "oom-%n.json").string()));
    CHECK_THROWS_AS((void)a.allocate(128 * MiB), expseg::out_of_memory);
    a.reset_accumulated_stats();
    CHECK_THROWS_AS((void)a.allocate(256 * MiB), expseg::out_of_memory);
    CHECK(a.stats().num_ooms == 1);  // the counter restarted...
  }
  CHECK(std::filesystem::exists(dir / "oom-1.json"));  // ...the dumps' numbers did not
  CHECK(std::filesystem::exists(dir / "oom-2.json"));
  std::filesystem::remove_all(dir);
}

TEST_CASE("regression: an OOM of another allocator inside an OOM observer reaches that allocator's observer") {
  expseg::Allocator a(sim_config(BackendKind::split_merge, 80 * GiB, "limit:64MiB"));
  expseg::Allocator b(sim_config(BackendKind::expandable, 80 * GiB, "limit:64MiB"));
  int a_calls = 0, b_calls = 0;
  b.set_oom_observer([&](const expseg::OomReport&) {
    ++b_calls;
    CHECK_THROWS_AS((void)a.allocate(512 * MiB), expseg::out_of_memory);  // A is inside its own observer: not again
  });
  a.set_oom_observer([&](const expseg::OomReport&) {
    ++a_calls;
    CHECK_THROWS_AS((void)b.allocate(128 * MiB), expseg::out_of_memory);
  });
  CHECK_THROWS_AS((void)a.allocate(128 * MiB), expseg::out_of_memory);
  CHECK(a_calls == 1);
  CHECK(b_calls == 1);
  CHECK(a.stats().num_ooms == 2);
  // Outside any observer, both are observed again.
  CHECK_THROWS_AS((void)b.allocate(128 * MiB), expseg::out_of_memory);
  CHECK(b_calls == 2);
}

TEST_CASE("regression: a huge max_non_split_rounding_mb lets a cached oversize block serve its own size again") {
  // 17592186044415 MiB = 2^64 - 1 MiB, which the config accepts.
  expseg::Allocator a(sim_config(BackendKind::split_merge, 80 * GiB, "max_split_size_mb:32,max_non_split_rounding_mb:17592186044415"));
  a.deallocate(a.allocate(64 * MiB));
  void* q = a.allocate(64 * MiB);
  CHECK(a.stats().num_device_alloc == 1);  // was 2: the cached block was never reused
  CHECK(a.stats().reserved_bytes[kAllPools].current == static_cast<std::int64_t>(64 * MiB));
  a.deallocate(q);
}

TEST_CASE("regression: an OOM observer that owns memory of its allocator is destroyed outside the lock, and before the backend") {
  // A "rainy-day reserve" released by the observer's destructor frees memory of the same
  // allocator. Was: set_oom_observer destroyed the old observer under the allocator lock (the
  // free re-took it: a self-deadlock), and ~Allocator destroyed it after the backend (a use after
  // free).
  for (BackendKind b : {BackendKind::split_merge, BackendKind::expandable}) {
    CAPTURE(std::string(expseg::to_string(b)));
    auto a = std::make_unique<expseg::Allocator>(sim_config(b, 1 * GiB));
    expseg::Allocator* raw = a.get();
    std::atomic<int> released{0};
    auto owning_observer = [&] {
      std::shared_ptr<void> reserve(raw->allocate(64 * MiB), [raw, &released](void* p) {
        raw->deallocate(p);
        released.fetch_add(1);
      });
      return [reserve](const expseg::OomReport&) {};
    };
    for (const bool replace : {false, true}) {
      a->set_oom_observer(owning_observer());
      CHECK(a->stats().allocation[kAllPools].current == 1);
      std::packaged_task<void()> task([&] {
        if (replace) a->set_oom_observer([](const expseg::OomReport&) {});
        else a->set_oom_observer(nullptr);
      });
      auto done = task.get_future();
      std::thread t(std::move(task));
      if (done.wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
        std::fprintf(stderr, "set_oom_observer deadlocked (the old observer freed memory under the lock)\n");
        std::_Exit(1);  // a hung thread cannot be joined: fail the suite rather than hang it
      }
      t.join();
      CHECK(a->stats().allocation[kAllPools].current == 0);
      a->validate();
    }
    CHECK(released.load() == 2);
    a->set_oom_observer(owning_observer());
    a.reset();  // the observer's reserve is freed while the allocator still works
    CHECK(released.load() == 3);
  }
}

TEST_CASE("regression: an expandable limit OOM asks split_merge before saying it would have failed too") {
  // Two live 1 MiB blocks on pages 0 and 6 of a 14 MiB limit: expandable holds 4 MiB of whole
  // pages and cannot map 12 MiB more; split_merge packs both into one 2 MiB small segment and
  // serves the 12 MiB. Was: "would have failed too", without asking.
  expseg::Allocator a(sim_config(BackendKind::expandable, 80 * GiB, "limit:14MiB"));
  void* x0 = a.allocate(1 * MiB);
  void* f = a.allocate(11 * MiB);
  void* x1 = a.allocate(1 * MiB);
  a.deallocate(f);
  std::optional<expseg::OomReport> rep;
  try {
    a.deallocate(a.allocate(12 * MiB));
  } catch (const expseg::out_of_memory& e) {
    rep = e.report();
  }
  REQUIRE(rep.has_value());
  CHECK(rep->verdict == expseg::OomVerdict::limit);
  CHECK(rep->counterfactual == expseg::Counterfactual::would_succeed);
  CHECK(rep->message.find("The split_merge backend, given the same 2 live allocations and limit in a fresh pool, would have served this request.") != std::string::npos);
  // The same live set and request, on split_merge, indeed succeed.
  expseg::Allocator s(sim_config(BackendKind::split_merge, 80 * GiB, "limit:14MiB"));
  void* y0 = s.allocate(1 * MiB);
  void* y1 = s.allocate(1 * MiB);
  void* y2 = nullptr;
  CHECK_NOTHROW(y2 = s.allocate(12 * MiB));
  for (void* p : {y0, y1, y2}) s.deallocate(p);
  a.deallocate(x0);
  a.deallocate(x1);
}

TEST_CASE("regression: split_merge OOM reports name the segment a miss needs, as PyTorch's message does") {
  // 84 MiB live on a 100 MiB device, then 5 MiB: PyTorch would ask for a 20 MiB segment and say
  // "Tried to allocate 20.00 MiB". Was: "5.00 MiB" and a fragmentation verdict with 0 free blocks.
  expseg::Allocator a(sim_config(BackendKind::split_merge, 100 * MiB));
  void* big = a.allocate(84 * MiB);
  std::optional<expseg::OomReport> rep;
  try {
    a.deallocate(a.allocate(5 * MiB));
  } catch (const expseg::out_of_memory& e) {
    rep = e.report();
  }
  REQUIRE(rep.has_value());
  CHECK(rep->message.rfind("CUDA out of memory. Tried to allocate 20.00 MiB.", 0) == 0);
  CHECK(rep->verdict == expseg::OomVerdict::capacity);
  CHECK(rep->message.find("plus the request (5.00 MiB, needing 20.00 MiB as a new segment) exceed what the device can give") != std::string::npos);
  CHECK(rep->counterfactual == expseg::Counterfactual::would_succeed);  // expandable maps 6 MiB of pages
  a.deallocate(big);
}

TEST_CASE("regression: a split_merge limit OOM asks expandable before saying it would have failed too") {
  // Five 19.5 MiB blocks stay whole 20 MiB blocks under PyTorch's rules; expandable packs them.
  expseg::Allocator a(sim_config(BackendKind::split_merge, 1 * GiB, "limit:100MiB"));
  std::vector<void*> live;
  for (int i = 0; i < 5; ++i) live.push_back(a.allocate(19 * MiB + MiB / 2));
  std::optional<expseg::OomReport> rep;
  try {
    a.deallocate(a.allocate(2 * MiB));
  } catch (const expseg::out_of_memory& e) {
    rep = e.report();
  }
  REQUIRE(rep.has_value());
  CHECK(rep->verdict == expseg::OomVerdict::limit);
  CHECK(rep->counterfactual == expseg::Counterfactual::would_succeed);  // was would_fail, unasked
  expseg::Allocator e(sim_config(BackendKind::expandable, 1 * GiB, "limit:100MiB"));
  std::vector<void*> elive;
  for (int i = 0; i < 5; ++i) elive.push_back(e.allocate(19 * MiB + MiB / 2));
  CHECK_NOTHROW(elive.push_back(e.allocate(2 * MiB)));
  for (void* p : elive) e.deallocate(p);
  for (void* p : live) a.deallocate(p);
}

TEST_CASE("regression: a request of 1 EiB or more is refused up front: out_of_memory, but no num_ooms, observer or dump") {
  // PyTorch's allocate() refuses such a size before its allocator runs (its num_ooms and OOM
  // observers never see it). Was: expseg counted it as an OOM of the allocator.
  const auto dir = std::filesystem::temp_directory_path() / ("expseg_regression_eib_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  for (BackendKind b : {BackendKind::split_merge, BackendKind::expandable}) {
    CAPTURE(std::string(expseg::to_string(b)));
    auto sa = make_sim_allocator(sim_config(b, 1 * GiB, "limit:256MiB,oom_dump:" + (dir / "oom-%n.json").string()));
    int observed = 0;
    sa->set_oom_observer([&](const expseg::OomReport&) { ++observed; });
    for (const std::size_t size : {std::size_t{1} << 60, SIZE_MAX}) {
      CAPTURE(size);
      try {
        (void)sa->allocate(size);
        FAIL("allocate succeeded");
      } catch (const expseg::out_of_memory& e) {
        CHECK(e.report().requested_bytes == size);
        CHECK(e.report().verdict == expseg::OomVerdict::capacity);
      }
      REQUIRE(sa->last_oom().has_value());  // the report is still there to read
      CHECK(sa->last_oom()->requested_bytes == size);
    }
    CHECK(sa->stats().num_ooms == 0);
    CHECK(observed == 0);
    CHECK(std::filesystem::is_empty(dir));
    // Just under 1 EiB is an OOM of the allocator, as any other request over the limit.
    CHECK_THROWS_AS((void)sa->allocate((std::size_t{1} << 60) - 1), expseg::out_of_memory);
    CHECK(sa->stats().num_ooms == 1);
    CHECK(observed == 1);
    CHECK_FALSE(std::filesystem::is_empty(dir));
    sa->set_oom_observer(nullptr);
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    sa->validate();
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("regression: a request that can never fit waits for pending frees first on both backends, as PyTorch") {
  // PyTorch completes pending frees (synchronize_and_free_events) before every OOM. Was: expandable
  // failed a request larger than the device or the limit at once, so after the same sequence its
  // stats still counted a free waiting for another stream that split_merge had completed.
  std::int64_t active[2] = {}, requested[2] = {}, syncs[2] = {};
  for (BackendKind b : {BackendKind::split_merge, BackendKind::expandable}) {
    CAPTURE(std::string(expseg::to_string(b)));
    auto sa = make_sim_allocator(sim_config(b, 2 * GiB));
    void* other = sa.sim->stream_create();
    void* keep = sa->allocate(10 * MiB);
    void* p = sa->allocate(100 * MiB);
    sa->record_stream(p, other);
    sa.sim->set_stream_busy(other, true);
    sa->deallocate(p);  // pending: `other` may still use it
    CHECK(sa->stats().requested_bytes[kAllPools].current == static_cast<std::int64_t>(110 * MiB));
    CHECK_THROWS_AS((void)sa->allocate(3 * GiB), expseg::out_of_memory);  // its synchronization waits for `other`
    sa.sim->set_stream_busy(other, false);
    const auto s = sa->stats();
    const int i = b == BackendKind::expandable;
    active[i] = s.active[kAllPools].current;
    requested[i] = s.requested_bytes[kAllPools].current;
    syncs[i] = s.num_sync_all_streams;
    CHECK(requested[i] == static_cast<std::int64_t>(10 * MiB));
    CHECK(active[i] == 1);
    sa->deallocate(keep);
    sa->validate();
    sa.alloc.reset();
    sa.sim->stream_destroy(other);
  }
  CHECK(active[0] == active[1]);
  CHECK(requested[0] == requested[1]);
  CHECK(syncs[0] == syncs[1]);
}

TEST_CASE("regression: an OOM report names the frees still waiting for other streams, which its requested bytes count") {
  // Was: "1 live allocation (140.00 MiB requested)", the requested bytes of a free waiting for
  // another stream's work counted beside one live allocation.
  for (BackendKind b : {BackendKind::split_merge, BackendKind::expandable}) {
    CAPTURE(std::string(expseg::to_string(b)));
    auto sa = make_sim_allocator(sim_config(b, 1 * GiB, "limit:160MiB"));
    void* other = sa.sim->stream_create();
    void* c = sa.sim->stream_create();
    void* keep = sa->allocate(40 * MiB);
    void* p = sa->allocate(100 * MiB);
    sa->record_stream(p, other);
    sa.sim->set_stream_busy(other, true);
    sa->deallocate(p);
    // A capture underway: no synchronization may complete the free before the OOM.
    sa.sim->capture_begin(c);
    sa->begin_graph_pool(1, c);
    std::string msg;
    try {
      (void)sa->allocate(100 * MiB, c);
      FAIL("allocate succeeded");
    } catch (const expseg::out_of_memory& e) {
      msg = e.what();
      CHECK(e.report().live_requested_bytes == 140 * MiB);
    }
    CAPTURE(msg);
    CHECK(msg.find("1 live allocation and 1 free waiting for other streams' work (140.00 MiB requested)") != std::string::npos);
    const auto g = sa.sim->capture_end(c);
    sa->end_graph_pool(1);
    sa.sim->graph_destroy(g);
    sa->release_graph_pool(1);
    sa.sim->set_stream_busy(other, false);
    sa->deallocate(keep);
    sa->release_cached();
    sa->validate();
    sa.alloc.reset();
    sa.sim->stream_destroy(other);
    sa.sim->stream_destroy(c);
  }
}
