// Regressions in the event recorder and what reads it (found by an audit of recording, snapshots
// and the torch memory_viz glue):
//   - a recording begun while a stream allocated into a graph pool traced that route's pool end and
//     release without its begin: the project's own strict replay refused the trace, while the OOM
//     dump called it complete;
//   - a graph pool block's free (and its pool's mappings) were traced on the pool's internal key,
//     its allocation on the stream: two streams for one block in the trace and the viewers;
//   - a free that waited for other streams (record_stream) was traced as completed when requested;
//   - a snapshot and the recorded events were taken under two locks: another thread's allocations in
//     between made a pair that memory_viz, walking the events back from the snapshot, cannot render;
//   - record_write truncated the file first: a failed write left half a trace (that read back
//     without an error) where the earlier one was;
//   - recorded times wrapped at midnight (covered by the rmm_log format tests: hours may exceed 23).
#include <doctest/doctest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/json.hpp"
#include "driver/sim_driver.hpp"
#include "expseg/allocator.hpp"
#include "expseg/expseg.h"
#include "expseg/oom_dump.hpp"
#include "expseg/trace.hpp"
#include "capi_fixture.hpp"
#include "test_util.hpp"

using namespace testutil;
using expseg::BackendKind;
using expseg::TraceAction;
using expseg::TraceEvent;
namespace fs = std::filesystem;

namespace {

// Every traced block's free (and free completed) names the stream its allocate named.
void check_frees_on_allocation_streams(const std::vector<TraceEvent>& ev) {
  std::map<std::uint64_t, std::uint64_t> stream_of;
  for (const TraceEvent& e : ev) {
    if (e.action == TraceAction::allocate) stream_of[e.pointer] = e.stream;
    if (e.action != TraceAction::free && e.action != TraceAction::free_completed) continue;
    const auto it = stream_of.find(e.pointer);
    REQUIRE(it != stream_of.end());
    CHECK(e.stream == it->second);
  }
}

}  // namespace

TEST_CASE("recorder regression: a recording begun while streams allocate into graph pools traces their begins first and replays strictly") {
  for (BackendKind b : {BackendKind::split_merge, BackendKind::expandable}) {
    CAPTURE(std::string(expseg::to_string(b)));
    auto sa = make_sim_allocator(sim_config(b, 1 * GiB));
    void* s = sa.sim->stream_create();  // allocates into pool 9 outside a capture
    void* c = sa.sim->stream_create();  // captures into pool 3
    sa->begin_pool_allocations(9, s);
    sa.sim->capture_begin(c);
    sa->begin_graph_pool(3, c);
    sa->start_recording();
    void* in9 = sa->allocate(4 * MiB, s);
    void* in3 = sa->allocate(2 * MiB, c);
    sa->deallocate(in9);
    sa->deallocate(in3);
    sa->end_pool_allocations(9, s);
    const auto g = sa.sim->capture_end(c);
    sa->end_graph_pool(3);
    void* plain = sa->allocate(4 * MiB, s);  // not in the pool, which keeps its memory
    sa->deallocate(plain);
    sa.sim->graph_destroy(g);
    sa->release_graph_pool(9);
    sa->release_graph_pool(3);
    const std::vector<TraceEvent> ev = sa->recorded();
    REQUIRE(ev.size() >= 2);
    CHECK(ev[0].action == TraceAction::pool_begin);
    CHECK(ev[0].pointer == 3);
    CHECK(ev[0].stream == addr(c));
    CHECK(ev[1].action == TraceAction::pool_begin);
    CHECK(ev[1].pointer == 9);
    CHECK(ev[1].stream == addr(s));
    check_frees_on_allocation_streams(ev);
    // Replayed strictly (was refused: "pool end of pool 0x9 ... no pool begin"), with the pools'
    // memory apart from the plain allocation's, as in the run.
    const expseg::ReplayResult r = expseg::replay(expseg::Trace{"late", ev}, sim_config(b, 1 * GiB));
    CHECK(r.ooms == 0);
    CHECK(r.allocations == 3);
    CHECK(r.peak_reserved_bytes == sa->stats().reserved_bytes[expseg::kAllPools].peak);
    sa->validate();
  }
}

TEST_CASE("recorder regression: a fork's route underway at the start is traced on its id, begun first and ended at end_graph_pool") {
  for (BackendKind b : {BackendKind::split_merge, BackendKind::expandable}) {
    CAPTURE(std::string(expseg::to_string(b)));
    auto sa = make_sim_allocator(sim_config(b, 1 * GiB));
    void* c = sa.sim->stream_create();
    void* t = sa.sim->stream_create();
    sa.sim->capture_begin(c);
    sa->begin_graph_pool(3, c);
    const expseg::driver::event_t fork = sa.sim->event_create();
    sa.sim->event_record(fork, c);
    sa.sim->stream_wait_event(t, fork);
    sa->deallocate(sa->allocate(1 * MiB, t));  // the fork's route exists before the recording
    sa->start_recording();
    void* f = sa->allocate(1 * MiB, t);
    sa->deallocate(f);
    const auto g = sa.sim->capture_end(c);
    sa->end_graph_pool(3);
    sa.sim->graph_destroy(g);
    sa->release_graph_pool(3);
    sa.sim->event_destroy(fork);
    const std::vector<TraceEvent> ev = sa->recorded();
    REQUIRE(ev.size() >= 3);
    CHECK(ev[0].action == TraceAction::pool_begin);
    CHECK(ev[0].stream == addr(c));
    CHECK(ev[1].action == TraceAction::pool_begin);
    const std::uint64_t fork_id = ev[1].stream;
    CHECK(fork_id != addr(t));
    CHECK(fork_id != addr(c));
    std::size_t fork_ends = 0, fork_allocs = 0;
    for (const TraceEvent& e : ev) {
      fork_ends += e.action == TraceAction::pool_end && e.stream == fork_id;
      fork_allocs += e.action == TraceAction::allocate && e.stream == fork_id;
    }
    CHECK(fork_ends == 1);
    CHECK(fork_allocs == 1);
    check_frees_on_allocation_streams(ev);
    // The memory the fork cached before is not in the trace: lenient, but every pool line pairs.
    expseg::ReplayOptions lenient;
    lenient.lenient = true;
    const expseg::ReplayResult r = expseg::replay(expseg::Trace{"fork", ev}, sim_config(b, 1 * GiB), lenient);
    CHECK(r.ooms == 0);
    CHECK(r.allocations == 1);
    CHECK(r.frees == 1);
  }
}

TEST_CASE("recorder regression: a graph pool in use before the recording makes the OOM dump's trace partial") {
  // Pool 9 was begun and ended before the recording, not released: its release in the trace finds
  // no begin. The dump said trace_complete, and `expseg explain` then failed on the release.
  TempDir dir("recorder-pool-before");
  const std::string path = (dir.path / "oom.json").string();
  for (BackendKind b : {BackendKind::split_merge, BackendKind::expandable}) {
    CAPTURE(std::string(expseg::to_string(b)));
    auto sa = make_sim_allocator(sim_config(b, 1 * GiB, "limit:64MiB,oom_dump:" + path));
    void* s = sa.sim->stream_create();
    sa->begin_pool_allocations(9, s);
    sa->end_pool_allocations(9, s);
    sa->start_recording();
    sa->release_graph_pool(9);
    CHECK_THROWS_AS(sa->allocate(128 * MiB, s), expseg::out_of_memory);
    const expseg::OomDump d = expseg::read_oom_dump(path);
    CHECK_FALSE(d.trace_complete);
    CHECK_THROWS_AS(expseg::replay(expseg::read_trace(d.trace), sim_config(b, 1 * GiB)), expseg::trace_error);
  }
}

TEST_CASE("recorder regression: a free that waits for another stream is traced as requested, and completed when its work is done") {
  for (BackendKind b : {BackendKind::split_merge, BackendKind::expandable}) {
    CAPTURE(std::string(expseg::to_string(b)));
    auto sa = make_sim_allocator(sim_config(b));
    void* other = sa.sim->stream_create();
    sa->start_recording();
    void* plain = sa->allocate(2 * MiB);
    sa->deallocate(plain);  // completes at once: no completion line
    void* p = sa->allocate(8 * MiB);
    sa->record_stream(p, other);
    sa.sim->set_stream_busy(other, true);
    sa->deallocate(p);
    auto count = [&](TraceAction a) {
      std::size_t n = 0;
      for (const TraceEvent& e : sa->recorded()) n += e.action == a;
      return n;
    };
    CHECK(count(TraceAction::free) == 2);
    CHECK(count(TraceAction::free_completed) == 0);  // `other` still works on it
    sa.sim->set_stream_busy(other, false);
    sa->deallocate(sa->allocate(1 * MiB));  // processes completed events first
    const std::vector<TraceEvent> ev = sa->recorded();
    std::size_t free_at = ev.size(), done_at = ev.size();
    for (std::size_t i = 0; i < ev.size(); ++i) {
      if (ev[i].pointer != addr(p)) continue;
      if (ev[i].action == TraceAction::free && free_at == ev.size()) free_at = i;  // the first: p's
      if (ev[i].action == TraceAction::free_completed) done_at = i;
    }
    REQUIRE(done_at < ev.size());
    CHECK(free_at < done_at);
    CHECK(ev[done_at].size == 8 * MiB);
    CHECK(count(TraceAction::free_completed) == 1);
    check_frees_on_allocation_streams(ev);
    // Written and read back; RMM's strict format leaves it out; replay ignores it.
    std::ostringstream full, strict;
    expseg::write_trace(full, ev);
    expseg::write_trace(strict, ev, true);
    CHECK(full.str().find(",free completed,") != std::string::npos);
    CHECK(strict.str().find("free completed") == std::string::npos);
    TempDir dir("recorder-completed");
    const std::string path = (dir.path / "t.csv").string();
    expseg::write_trace_file(path, ev);
    const expseg::Trace back = expseg::read_trace(path);
    REQUIRE(back.events.size() == ev.size());
    CHECK(back.events[done_at].action == TraceAction::free_completed);
    const expseg::ReplayResult r = expseg::replay(back, sim_config(b));
    CHECK(r.allocations == 3);
    CHECK(r.frees == 3);
    sa.alloc.reset();
    sa.sim->stream_destroy(other);
  }
}

TEST_CASE("recorder regression: a free held through a capture and completed by synchronization is traced as completed") {
  // free_held_after_capture's recovery frees at once after synchronizing: a completion too.
  auto sa = make_sim_allocator(sim_config(BackendKind::expandable, 1 * GiB));
  void* other = sa.sim->stream_create();
  void* c = sa.sim->stream_create();
  sa->start_recording();
  void* p = sa->allocate(4 * MiB);
  sa->record_stream(p, other);
  sa.sim->capture_begin(c);
  sa->begin_graph_pool(5, c);
  sa->deallocate(p);  // held until the capture ends
  const auto g = sa.sim->capture_end(c);
  sa->end_graph_pool(5);
  sa->release_cached();
  std::size_t completed = 0;
  for (const TraceEvent& e : sa->recorded()) completed += e.action == TraceAction::free_completed && e.pointer == addr(p);
  CHECK(completed == 1);
  sa.sim->graph_destroy(g);
  sa->release_graph_pool(5);
  sa.alloc.reset();
  sa.sim->stream_destroy(other);
  sa.sim->stream_destroy(c);
}

TEST_CASE("recorder regression: snapshot_with_recorded gives events that end where the snapshot stands, under other threads") {
  // Checked as PyTorch's memory_viz reads a snapshot: walking the events back from the snapshot's
  // blocks, every allocation is held when it happened and every freed block is not held right after.
  for (BackendKind b : {BackendKind::split_merge, BackendKind::expandable}) {
    CAPTURE(std::string(expseg::to_string(b)));
    expseg::Allocator a(sim_config(b, 8 * GiB));
    a.start_recording(4096);  // a window: the churn runs as long as the snapshots need
    std::atomic<bool> stop{false};
    std::atomic<std::uint64_t> steps{0};
    std::thread churn([&] {
      std::vector<void*> live;
      std::uint64_t x = 12345;
      while (!stop.load(std::memory_order_relaxed)) {
        x = x * 6364136223846793005ULL + 1442695040888963407ULL;
        if (live.size() < 64 && (x >> 60) < 9) {
          live.push_back(a.allocate(((x >> 33) % 4096 + 1) * 4096));
        } else if (!live.empty()) {
          const std::size_t i = (x >> 20) % live.size();
          a.deallocate(live[i]);
          live[i] = live.back();
          live.pop_back();
        }
        steps.fetch_add(1, std::memory_order_relaxed);
      }
      for (void* p : live) a.deallocate(p);
    });
    while (steps.load() < 100) std::this_thread::yield();  // the churn is under way
    // Until the other thread has allocated between two snapshots 20 times (on one core that takes
    // time slices, not rounds), at most 20,000 rounds.
    std::size_t mismatched = 0, during = 0, rounds = 0;
    for (; during < 20 && rounds < 20000; ++rounds) {
      std::vector<TraceEvent> ev;
      const std::uint64_t before = steps.load();
      const expseg::Snapshot snap = a.snapshot_with_recorded(ev);
      std::set<std::uint64_t> held;
      for (const auto& seg : snap.segments)
        for (const auto& blk : seg.blocks)
          if (blk.state == expseg::BlockState::allocated) held.insert(blk.address);
      std::size_t problems = 0;
      for (auto e = ev.rbegin(); e != ev.rend(); ++e) {
        if (e->action == TraceAction::allocate) problems += held.erase(e->pointer) == 0;
        if (e->action == TraceAction::free) problems += !held.insert(e->pointer).second;
      }
      mismatched += problems != 0;
      if (rounds % 64 == 0) std::this_thread::yield();
      during += steps.load() != before;
    }
    stop = true;
    churn.join();
    CAPTURE(rounds);
    CHECK(during == 20);  // the other thread allocated while snapshots were taken
    CHECK(mismatched == 0);
  }
}

TEST_CASE_FIXTURE(CApiFixture, "recorder regression: expseg_snapshot_json_with_trace writes the events of the snapshot's moment; errors leave files alone") {
  REQUIRE(expseg_configure("backend:expandable,device:sim,sim_capacity:4GiB") == EXPSEG_SUCCESS);
  REQUIRE(expseg_record_start(0, 0) == EXPSEG_SUCCESS);
  void* p = expseg_malloc(3 * MiB, 0, nullptr);
  REQUIRE(p != nullptr);
  TempDir dir("recorder-capi");
  const std::string path = (dir.path / "t.csv").string();
  const char* json = expseg_snapshot_json_with_trace(0, path.c_str());
  REQUIRE(json != nullptr);
  const auto snap = expseg::core::parse_json(json);
  CHECK(snap["backend"].as_string() == "expandable");
  const expseg::Trace t = expseg::read_trace(path);
  std::size_t allocs = 0;
  for (const TraceEvent& e : t.events) allocs += e.action == TraceAction::allocate && e.pointer == addr(p);
  CHECK(allocs == 1);
  // No path, or a path that cannot be written: NULL with the code, the earlier file unchanged.
  CHECK(expseg_snapshot_json_with_trace(0, nullptr) == nullptr);
  CHECK(expseg_last_error_code() == EXPSEG_ERROR_INVALID_ARGUMENT);
  CHECK(expseg_snapshot_json_with_trace(0, (dir.path / "missing" / "t.csv").string().c_str()) == nullptr);
  CHECK(expseg_last_error_code() == EXPSEG_ERROR_IO);
  CHECK(expseg_snapshot_json_with_trace(-1, path.c_str()) == nullptr);
  CHECK(expseg_last_error_code() == EXPSEG_ERROR_INVALID_DEVICE);
  CHECK(expseg::read_trace(path).events.size() == t.events.size());
  expseg_free(p, 0, 0, nullptr);
}

TEST_CASE("recorder regression: a trace file that cannot be written whole leaves the earlier one, and no temporary") {
  TempDir dir("recorder-fsize");
  const std::string path = (dir.path / "run.csv").string();
  std::vector<TraceEvent> small, large;
  for (std::uint64_t i = 0; i < 5000; ++i) {
    TraceEvent e;
    e.thread = 1;
    e.time = static_cast<double>(i) * 1e-3;
    e.action = i % 2 ? TraceAction::free : TraceAction::allocate;
    e.pointer = 0x7f0000000000ULL + (i / 2) * 0x100000;
    e.size = 1048576;
    e.stream = 0x7f00aa000;
    (i < 10 ? small : large).push_back(e);
  }
  expseg::write_trace_file(path, small);
  const std::string earlier = read_file(path);
  rlimit old{};
  REQUIRE(::getrlimit(RLIMIT_FSIZE, &old) == 0);
  const rlimit tiny{earlier.size() + 1000, old.rlim_max};
  auto* const old_handler = std::signal(SIGXFSZ, SIG_IGN);  // a write past the limit fails with EFBIG instead
  REQUIRE(::setrlimit(RLIMIT_FSIZE, &tiny) == 0);
  std::string what;
  try {
    expseg::write_trace_file(path, large);
  } catch (const expseg::error& e) {
    what = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, old_handler);
  CHECK(what.find("cannot write trace file") != std::string::npos);
  CHECK(read_file(path) == earlier);
  CHECK(dir.files() == std::set<std::string>{"run.csv"});
  // Written whole, it replaces the earlier one.
  expseg::write_trace_file(path, large);
  CHECK(expseg::read_trace(path).events.size() == large.size());
  CHECK(dir.files() == std::set<std::string>{"run.csv"});
}
