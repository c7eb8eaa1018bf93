// Graph pool lifetimes in traces: the recorder writes `pool begin` / `pool end` / `pool release`
// lines and a pool's allocations on the stream that began it; replay routes them into a pool again,
// so that a replayed pool holds its memory as the recorded one did; bad pool lines are refused with
// their line (or skipped, --lenient).
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "driver/sim_driver.hpp"
#include "expseg/allocator.hpp"
#include "expseg/trace.hpp"
#include "test_util.hpp"

using namespace testutil;
using expseg::BackendKind;
using expseg::TraceAction;

namespace {

constexpr const char* kHdr = "Thread,Time,Action,Pointer,Size,Stream\n";

// 64 MiB allocated into pool 7 on the default stream and freed there, then 64 MiB more on the same
// stream outside the pool: with the pool live, the second cannot take the first one's memory.
const std::string kPoolThenPlain = std::string(kHdr) +
                                   "1,0,pool begin,0x7,0,0x0\n"
                                   "1,1,allocate,0x1000,67108864,0x0\n"
                                   "1,2,pool end,0x7,0,0x0\n"
                                   "1,3,free,0x1000,67108864,0x0\n"
                                   "1,4,allocate,0x2000,67108864,0x0\n"
                                   "1,5,free,0x2000,67108864,0x0\n";

std::string without_pool_lines(const std::string& csv) {
  std::istringstream in(csv);
  std::string out, line;
  while (std::getline(in, line))
    if (line.find(",pool ") == std::string::npos) out += line + "\n";
  return out;
}

}  // namespace

TEST_SUITE("trace") {

TEST_CASE("trace pools: the pool actions' CSV spellings, written and read back; RMM's strict format leaves them out") {
  const auto t = expseg::parse_trace(std::string(kHdr) + "1,0,pool begin,0x2a,0,0x5\n1,1,pool end,0x2a,0,0x5\n1,2,pool release,42,0,0\n", "p.csv");
  REQUIRE(t.events.size() == 3);
  CHECK(t.events[0].action == TraceAction::pool_begin);
  CHECK(t.events[1].action == TraceAction::pool_end);
  CHECK(t.events[2].action == TraceAction::pool_release);
  for (const auto& e : t.events) CHECK(e.pointer == 42);
  CHECK(t.events[0].stream == 5);
  CHECK(std::string(expseg::to_string(TraceAction::pool_begin)) == "pool begin");
  CHECK(std::string(expseg::to_string(TraceAction::pool_end)) == "pool end");
  CHECK(std::string(expseg::to_string(TraceAction::pool_release)) == "pool release");

  std::ostringstream full, strict;
  expseg::write_trace(full, t.events);
  expseg::write_trace(strict, t.events, true);
  const auto back = expseg::parse_trace(full.str(), "back.csv");
  REQUIRE(back.events.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) {
    CHECK(back.events[i].action == t.events[i].action);
    CHECK(back.events[i].pointer == 42);
    CHECK(back.events[i].stream == t.events[i].stream);
  }
  CHECK(expseg::parse_trace(strict.str(), "strict.csv").events.empty());
  CHECK_NOTHROW(expseg::validate_trace(t));
}

TEST_CASE("trace pools: replay keeps a live pool's memory to the pool, as the recorded run did") {
  const auto with = expseg::parse_trace(kPoolThenPlain, "pool.csv");
  const auto without = expseg::parse_trace(without_pool_lines(kPoolThenPlain), "plain.csv");
  REQUIRE(without.events.size() == 4);
  for (BackendKind b : {BackendKind::split_merge, BackendKind::expandable}) {
    CAPTURE(std::string(expseg::to_string(b)));
    const auto r_with = expseg::replay(with, sim_config(b));
    const auto r_without = expseg::replay(without, sim_config(b));
    CHECK(r_with.allocations == 2);
    CHECK(r_with.frees == 2);
    CHECK(r_with.ooms == 0);
    // Without the pool the second request reuses the first one's cached memory; with it, the pool
    // keeps that memory and the second maps its own.
    CHECK(r_without.peak_reserved_bytes == 64 * MiB);
    CHECK(r_with.peak_reserved_bytes == 128 * MiB);
    CHECK(r_with.stats.num_device_alloc > r_without.stats.num_device_alloc);
  }
  // Released before the second request: the pool's memory serves it again, as without a pool, on
  // expandable (split_merge keeps a released pool's segment out of other streams' reach until it is
  // given back; PyTorch's private pools do the same).
  std::string released = kPoolThenPlain;
  released.insert(released.find("1,4,allocate"), "1,3,pool release,0x7,0,0x0\n");
  const auto r = expseg::replay(expseg::parse_trace(released, "released.csv"), sim_config(BackendKind::expandable));
  CHECK(r.peak_reserved_bytes == 64 * MiB);
}

TEST_CASE("trace pools: the recorder writes pool lifetimes, and a pool's allocations on the stream that began it") {
  for (BackendKind b : {BackendKind::split_merge, BackendKind::expandable}) {
    CAPTURE(std::string(expseg::to_string(b)));
    expseg::Allocator a(sim_config(b));
    const auto s = reinterpret_cast<expseg::stream_t>(std::uintptr_t{0x5});
    a.start_recording();
    a.begin_pool_allocations(9, s);
    void* in_pool = a.allocate(4 * MiB, s);
    a.end_pool_allocations(9, s);
    void* plain = a.allocate(4 * MiB, s);
    a.deallocate(in_pool);
    a.deallocate(plain);
    a.begin_pool_allocations(9, s);  // a second use of the pool
    a.end_pool_allocations(9, s);
    a.release_graph_pool(9);
    a.release_graph_pool(9);
    const auto ev = a.recorded();
    std::vector<TraceAction> actions;
    for (const auto& e : ev) actions.push_back(e.action);
    // Map events come from the backend (split_merge's cuMemAlloc, expandable's mappings): the rest
    // in order, and some of those.
    const std::vector<TraceAction> want = {TraceAction::pool_begin, TraceAction::allocate,   TraceAction::pool_end,     TraceAction::allocate,
                                           TraceAction::free,       TraceAction::free,       TraceAction::pool_begin,   TraceAction::pool_end,
                                           TraceAction::pool_release, TraceAction::pool_release};
    std::vector<TraceAction> got;
    for (TraceAction x : actions)
      if (x != TraceAction::map && x != TraceAction::unmap) got.push_back(x);
    CHECK(got == want);
    CHECK(std::count(actions.begin(), actions.end(), TraceAction::map) >= 2);
    for (const auto& e : ev) {
      if (e.action == TraceAction::pool_begin || e.action == TraceAction::pool_end) {
        CHECK(e.pointer == 9);
        CHECK(e.stream == 0x5);
      } else if (e.action == TraceAction::pool_release) {
        CHECK(e.pointer == 9);
        CHECK(e.stream == 0);
      } else if (e.action == TraceAction::allocate) {
        CHECK(e.stream == 0x5);  // the pool's allocation too: not the pool's internal key
      }
    }
    // The recording replays with the pool: the plain allocation could not use the pool's memory.
    const auto r = expseg::replay(expseg::Trace{"recorded", ev}, sim_config(b));
    CHECK(r.ooms == 0);
    CHECK(r.peak_allocated_bytes == 8 * MiB);
  }
}

TEST_CASE("trace pools: a capture's allocations are traced on its stream, a forked stream's on an id of its own with a pool begin and end") {
  for (BackendKind b : {BackendKind::split_merge, BackendKind::expandable}) {
    CAPTURE(std::string(expseg::to_string(b)));
    auto sa = make_sim_allocator(sim_config(b, 1 * GiB));
    void* s = sa.sim->stream_create();
    void* t = sa.sim->stream_create();
    sa->start_recording();
    sa.sim->capture_begin(s);
    sa->begin_graph_pool(3, s);
    void* c = sa->allocate(2 * MiB, s);
    const expseg::driver::event_t fork = sa.sim->event_create();
    sa.sim->event_record(fork, s);
    sa.sim->stream_wait_event(t, fork);  // t joins the capture: its requests go into the pool too
    void* f = sa->allocate(1 * MiB, t);
    sa->deallocate(f);
    sa->deallocate(c);
    const auto g = sa.sim->capture_end(s);
    sa->end_graph_pool(3);
    void* after = sa->allocate(2 * MiB, s);  // not in the pool: the pool keeps the capture's memory
    sa->deallocate(after);
    sa.sim->graph_destroy(g);
    sa->release_graph_pool(3);
    sa.sim->event_destroy(fork);
    const auto ev = sa->recorded();
    const auto stream_of = [](void* p) { return static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(p)); };
    std::vector<std::pair<TraceAction, std::uint64_t>> seq;  // the pool lines and allocations, in order
    for (const auto& e : ev)
      if (e.action != TraceAction::free && e.action != TraceAction::map && e.action != TraceAction::unmap) seq.emplace_back(e.action, e.stream);
    // The fork is traced on a stream id of its own (its key in the pool), not on t: t may allocate
    // into a pool by itself or begin a capture of its own, whose pool lines must not pair with these.
    REQUIRE(seq.size() == 9);
    const std::uint64_t fork_id = seq[2].second;
    CHECK(fork_id != stream_of(s));
    CHECK(fork_id != stream_of(t));
    const std::vector<std::pair<TraceAction, std::uint64_t>> expected{
        {TraceAction::pool_begin, stream_of(s)}, {TraceAction::allocate, stream_of(s)},
        {TraceAction::pool_begin, fork_id},      {TraceAction::allocate, fork_id},
        {TraceAction::pool_end, fork_id},        {TraceAction::pool_release, 0},
        {TraceAction::pool_end, stream_of(s)},   {TraceAction::allocate, stream_of(s)},
        {TraceAction::pool_release, 0}};
    CHECK(seq == expected);
    // Replayed, the fork's block comes from the pool's memory for t, and the allocation after the
    // capture does not reuse the pool's memory, as in the run.
    const auto r = expseg::replay(expseg::Trace{"captured", ev}, sim_config(b, 1 * GiB));
    CHECK(r.ooms == 0);
    CHECK(r.allocations == 3);
    CHECK(r.peak_reserved_bytes == sa->stats().reserved_bytes[expseg::kAllPools].peak);
  }
}

TEST_CASE("trace pools: a fork onto a stream with a pool route of its own, or that begins its own capture, replays strictly to the run's peak") {
  // Was (fork lines traced on the fork's stream): a second pool begin on that stream, refused by the
  // strict replay ("allocates into pool 0x3 already"), and a lenient replay that ended the stream's
  // own route early.
  for (BackendKind b : {BackendKind::split_merge, BackendKind::expandable}) {
    CAPTURE(std::string(expseg::to_string(b)));
    for (const std::uint64_t eager_pool : {std::uint64_t{3}, std::uint64_t{5}, std::uint64_t{0}}) {
      CAPTURE(eager_pool);
      auto sa = make_sim_allocator(sim_config(b, 1 * GiB));
      void* s = sa.sim->stream_create();
      void* t = sa.sim->stream_create();
      sa->start_recording();
      void* e1 = nullptr;
      if (eager_pool != 0) {  // t allocates into a pool by itself
        sa->begin_pool_allocations(eager_pool, t);
        e1 = sa->allocate(1 * MiB, t);
      }
      sa.sim->capture_begin(s);
      sa->begin_graph_pool(3, s);
      void* c = sa->allocate(2 * MiB, s);
      const auto fork = sa.sim->event_create();
      sa.sim->event_record(fork, s);
      sa.sim->stream_wait_event(t, fork);
      void* f = sa->allocate(1 * MiB, t);
      sa->deallocate(f);
      sa->deallocate(c);
      const auto join = sa.sim->event_create();
      sa.sim->event_record(join, t);
      sa.sim->stream_wait_event(s, join);
      const auto g = sa.sim->capture_end(s);
      expseg::driver::graph_t g2 = nullptr;
      if (eager_pool == 0) {  // t begins its own capture into the pool before the first one's end
        sa.sim->capture_begin(t);
        sa->begin_graph_pool(3, t);
        sa->end_graph_pool(3);  // the first capture's
        void* x = sa->allocate(4 * MiB, t);
        sa->deallocate(x);
        g2 = sa.sim->capture_end(t);
        sa->end_graph_pool(3);
      } else {
        sa->end_graph_pool(3);
        void* e2 = sa->allocate(6 * MiB, t);  // t still allocates into its pool
        sa->deallocate(e2);
        sa->deallocate(e1);
        sa->end_pool_allocations(eager_pool, t);
      }
      sa.sim->graph_destroy(g);
      if (g2 != nullptr) sa.sim->graph_destroy(g2);
      sa->release_graph_pool(3);
      sa->release_graph_pool(eager_pool == 5 ? 5 : 3);
      const auto ev = sa->recorded();
      expseg::ReplayResult r;
      CHECK_NOTHROW(r = expseg::replay(expseg::Trace{"fork", ev}, sim_config(b, 1 * GiB)));
      CHECK(r.ooms == 0);
      CHECK(r.peak_reserved_bytes == sa->stats().reserved_bytes[expseg::kAllPools].peak);
      CHECK(r.peak_allocated_bytes == sa->stats().allocated_bytes[expseg::kAllPools].peak);
    }
  }
}

TEST_CASE("trace pools: a block restored into a live pool is traced as a pool restore and replays inside its pool") {
  // Spelling: Pointer the pool id, Size 0, then the block's allocate on the same stream. RMM's strict
  // format keeps the allocate and leaves the marker out, as the other pool lines.
  const auto t = expseg::parse_trace(std::string(kHdr) + "1,0,pool restore,0x9,0,0x5\n1,1,allocate,0x4000,512,0x5\n", "r.csv");
  REQUIRE(t.events.size() == 2);
  CHECK(t.events[0].action == TraceAction::pool_restore);
  CHECK(t.events[0].pointer == 9);
  CHECK(t.events[0].stream == 5);
  CHECK(std::string(expseg::to_string(TraceAction::pool_restore)) == "pool restore");
  std::ostringstream full, strict;
  expseg::write_trace(full, t.events);
  expseg::write_trace(strict, t.events, true);
  CHECK(full.str().find(",pool restore,0x9,0,0x5\n") != std::string::npos);
  const auto plain = expseg::parse_trace(strict.str(), "strict.csv");
  REQUIRE(plain.events.size() == 1);
  CHECK(plain.events[0].action == TraceAction::allocate);
  CHECK(plain.events[0].pointer == 0x4000);

  for (BackendKind b : {BackendKind::split_merge, BackendKind::expandable}) {
    CAPTURE(std::string(expseg::to_string(b)));
    expseg::Allocator a(sim_config(b));
    const auto s = reinterpret_cast<expseg::stream_t>(std::uintptr_t{0x5});
    a.start_recording();
    a.begin_pool_allocations(9, s);
    void* p = a.allocate(64 * MiB, s);
    a.end_pool_allocations(9, s);
    a.deallocate(p);                                // the live pool keeps its memory
    a.restore_graph_pool_block(9, p, 64 * MiB);    // a checkpoint puts the block back there
    void* q = a.allocate(64 * MiB, s);             // outside the pool: memory of its own
    a.deallocate(p);
    a.deallocate(q);
    a.release_graph_pool(9);
    const std::int64_t recorded_peak = a.stats().reserved_bytes[expseg::kAllPools].peak;
    CHECK(recorded_peak == 128 * MiB);
    const auto ev = a.recorded();
    int restores = 0;
    for (std::size_t i = 0; i < ev.size(); ++i) {
      if (ev[i].action != TraceAction::pool_restore) continue;
      ++restores;
      CHECK(ev[i].pointer == 9);
      CHECK(ev[i].stream == 0x5);
      REQUIRE(i + 1 < ev.size());
      CHECK(ev[i + 1].action == TraceAction::allocate);
      CHECK(ev[i + 1].pointer == reinterpret_cast<std::uintptr_t>(p));
      CHECK(ev[i + 1].size == 64 * MiB);
      CHECK(ev[i + 1].stream == 0x5);
    }
    CHECK(restores == 1);
    // Replayed, the restored block takes the pool's memory again, as it did when recorded: the
    // peak is the run's. As a plain allocation (without the marker) it would not use the pool's
    // memory, and the next one would map 64 MiB more.
    const auto r = expseg::replay(expseg::Trace{"restored", ev}, sim_config(b));
    CHECK(r.ooms == 0);
    CHECK(r.allocations == 3);
    CHECK(r.frees == 3);
    CHECK(r.peak_reserved_bytes == recorded_peak);
    std::vector<expseg::TraceEvent> unmarked;
    for (const auto& e : ev)
      if (e.action != TraceAction::pool_restore) unmarked.push_back(e);
    CHECK(expseg::replay(expseg::Trace{"unmarked", unmarked}, sim_config(b)).peak_reserved_bytes == recorded_peak + 64 * MiB);
    // The replay's route into the pool for the restore leaves the pool's uses as recorded: its one
    // recorded release ends the pool (a second one would be refused).
    auto released_twice = ev;
    released_twice.push_back(expseg::TraceEvent{1, 0.0, TraceAction::pool_release, 9, 0, 0, 0});
    CHECK_THROWS_AS(expseg::replay(expseg::Trace{"twice", released_twice}, sim_config(b)), expseg::trace_error);
  }
  // A restore on a stream routed into the pool already is an allocation into it as any other.
  const auto routed = expseg::parse_trace(std::string(kHdr) +
                                              "1,0,pool begin,0x7,0,0x0\n1,1,allocate,0x1000,67108864,0x0\n1,2,free,0x1000,67108864,0x0\n"
                                              "1,3,pool restore,0x7,0,0x0\n1,4,allocate,0x1000,67108864,0x0\n1,5,pool end,0x7,0,0x0\n"
                                              "1,6,allocate,0x2000,67108864,0x0\n",
                                          "routed.csv");
  CHECK(expseg::replay(routed, sim_config(BackendKind::expandable)).peak_reserved_bytes == 128 * MiB);
}

TEST_CASE("trace pools: pool lines the allocator would refuse are refused with their line, or skipped with lenient") {
  struct Bad {
    std::string body;
    const char* message;
  };
  const Bad bad[] = {
      {"1,0,pool end,0x7,0,0x0\n", "bad.csv:2: pool end of pool 0x7 on stream 0x0, which does not allocate into it (no pool begin)"},
      {"1,0,pool begin,0x0,0,0x0\n", "bad.csv:2: pool begin of pool 0 (not a pool id)"},
      {"1,0,pool begin,0x7,0,0x0\n1,1,pool begin,0x8,0,0x0\n",
       "bad.csv:3: pool begin of pool 0x8 on stream 0x0, which allocates into pool 0x7 already (no pool end)"},
      {"1,0,pool begin,0x7,0,0x1\n1,1,pool end,0x8,0,0x1\n", "bad.csv:3: pool end of pool 0x8 on stream 0x1, which does not allocate into it (no pool begin)"},
      {"1,0,pool release,0x7,0,0\n", "bad.csv:2: pool release of pool 0x7, begun no more often than released"},
      {"1,0,pool begin,0x7,0,0x0\n1,1,pool release,0x7,0,0\n",
       "bad.csv:3: pool release of pool 0x7 while a stream still allocates into it (no pool end)"},
      {"1,0,pool restore,0x7,0,0x0\n", "bad.csv:2: pool restore into pool 0x7, which is not live (begun no more often than released)"},
      {"1,0,pool begin,0x7,0,0x0\n1,1,pool end,0x7,0,0x0\n1,2,pool release,0x7,0,0\n1,3,pool restore,0x7,0,0x0\n",
       "bad.csv:5: pool restore into pool 0x7, which is not live (begun no more often than released)"},
      {"1,0,pool begin,0x7,0,0x1\n1,1,pool begin,0x8,0,0x0\n1,2,pool restore,0x7,0,0x0\n",
       "bad.csv:4: pool restore into pool 0x7 on stream 0x0, which allocates into pool 0x8"},
      {"1,0,pool begin,0x7,0,0x1\n1,1,pool end,0x7,0,0x1\n1,2,pool restore,0x7,0,0x0\n1,3,free,0x3000,4096,0x0\n",
       "bad.csv:4: pool restore into pool 0x7 on stream 0x0 not followed by its block's allocate on that stream"},
  };
  for (const Bad& c : bad) {
    CAPTURE(c.body);
    const auto t = expseg::parse_trace(std::string(kHdr) + c.body + "1,9,allocate,0x1000,4096,0x0\n1,10,free,0x1000,4096,0x0\n", "bad.csv");
    for (BackendKind b : {BackendKind::split_merge, BackendKind::expandable}) {
      try {
        expseg::replay(t, sim_config(b));
        FAIL("replay accepted a pool line the allocator would refuse");
      } catch (const expseg::trace_error& e) {
        const std::string what = e.what();
        CHECK(what.rfind(c.message, 0) == 0);
        CHECK(what.find("--lenient") != std::string::npos);
      }
      expseg::ReplayOptions lenient;
      lenient.lenient = true;
      const auto r = expseg::replay(t, sim_config(b), lenient);
      CHECK(r.allocations == 1);
      CHECK(r.frees == 1);
      CHECK(r.ooms == 0);
    }
  }
}

}  // TEST_SUITE

TEST_CASE("trace pools: a replayed restore goes back where the block it restores lay, so the hole beside it stays as recorded") {
  // Was: the replay allocated a restored block anywhere in its pool. Blocks A..E in pool 7, B, C and
  // D freed, D restored where it lay, then 5 MiB more into the pool. Expandable lays them out A B D C
  // E (D packs into B's partly used page), so the recorded run has holes of 1 and 4 MiB left and maps
  // new memory for the 5 MiB (peak reserved 20 MiB). Replayed, D landed elsewhere in the pool, the
  // 5 MiB fit in B+D+C, and the peaks were not the run's (14 MiB).
  for (BackendKind b : {BackendKind::split_merge, BackendKind::expandable}) {
    CAPTURE(std::string(expseg::to_string(b)));
    const expseg::Config conf = sim_config(b, 80 * GiB, "limit:64MiB");
    expseg::Allocator a(conf);
    const auto s = reinterpret_cast<expseg::stream_t>(std::uintptr_t{0x5});
    a.start_recording();
    a.begin_pool_allocations(7, s);
    std::vector<void*> blocks;
    for (std::size_t mib : {4, 1, 4, 1, 4}) blocks.push_back(a.allocate(mib * MiB, s));
    a.end_pool_allocations(7, s);
    for (int i : {1, 2, 3}) a.deallocate(blocks[i]);
    a.restore_graph_pool_block(7, blocks[3], MiB);
    a.begin_pool_allocations(7, s);
    void* f = a.allocate(5 * MiB, s);
    a.end_pool_allocations(7, s);
    for (void* p : {blocks[0], blocks[3], blocks[4], f}) a.deallocate(p);
    a.release_graph_pool(7);
    const auto st = a.stats();
    if (b == BackendKind::expandable) CHECK(st.reserved_bytes[expseg::kAllPools].peak == static_cast<std::int64_t>(20 * MiB));
    const auto r = expseg::replay(expseg::Trace{"restored", a.recorded()}, conf);
    CHECK(r.ooms == 0);
    CHECK(r.peak_reserved_bytes == st.reserved_bytes[expseg::kAllPools].peak);
    CHECK(r.peak_allocated_bytes == st.allocated_bytes[expseg::kAllPools].peak);
  }
}

TEST_CASE("trace pools: a random run with graph pools and restores, routed and not, replays to its own OOMs at the same events") {
  // Was (a review's round-trip probe): on expandable, 989 OOMs replayed where the run had 1,599. A
  // restore made while its stream was routed into the pool replayed as a plain allocation, placed
  // by the backend instead of where the block lay; the layouts then parted.
  for (BackendKind b : {BackendKind::split_merge, BackendKind::expandable}) {
    for (std::uint64_t seed : {1u, 2u, 3u}) {
      CAPTURE(std::string(expseg::to_string(b)));
      CAPTURE(seed);
      const expseg::Config conf = sim_config(b, 80 * GiB, "limit:768MiB");
      expseg::Allocator a(conf);
      a.start_recording();
      std::mt19937_64 rng(seed);
      const auto s = reinterpret_cast<expseg::stream_t>(std::uintptr_t{0x1234});
      std::vector<void*> live;
      std::uint64_t routed = 0;         // the pool s allocates into now
      std::vector<std::uint64_t> held;  // a use of each pool begun and not released
      std::uint64_t next_pool = 1;
      int restores = 0, routed_restores = 0;
      for (int i = 0; i < 6000; ++i) {
        const unsigned r = static_cast<unsigned>(rng() % 1000);
        try {
          if (r < 8 && routed == 0) {
            routed = held.empty() || rng() % 2 ? next_pool++ : held[rng() % held.size()];
            a.begin_pool_allocations(routed, s);
            held.push_back(routed);
          } else if (r < 16 && routed != 0) {
            a.end_pool_allocations(routed, s);
            routed = 0;
          } else if (r < 22 && !held.empty()) {
            const std::size_t k = rng() % held.size();
            if (held[k] == routed && std::count(held.begin(), held.end(), routed) == 1) continue;  // its last use
            a.release_graph_pool(held[k]);
            held.erase(held.begin() + static_cast<std::ptrdiff_t>(k));
          } else if (r < 30 && !held.empty()) {  // a checkpoint's block freed and put back where it was
            const std::uint64_t pool = held[rng() % held.size()];
            if (routed != 0 && routed != pool) continue;
            if (routed == 0) a.begin_pool_allocations(pool, s);
            void* p = nullptr;
            try {
              p = a.allocate(MiB, s);
            } catch (const expseg::out_of_memory&) {
            }
            if (routed == 0) {
              a.end_pool_allocations(pool, s);
              a.release_graph_pool(pool);
            }
            if (p == nullptr) continue;
            a.deallocate(p);
            a.restore_graph_pool_block(pool, p, MiB);
            live.push_back(p);
            ++restores;
            routed_restores += routed != 0;
          } else if (live.empty() || r < 600) {
            std::size_t size = std::size_t{1} << (rng() % 26);
            size += rng() % size;
            live.push_back(a.allocate(size, rng() % 3 == 0 ? s : nullptr));
          } else {
            const std::size_t k = rng() % live.size();
            a.deallocate(live[k]);
            live[k] = live.back();
            live.pop_back();
          }
        } catch (const expseg::out_of_memory&) {
        }
      }
      CHECK(routed_restores > 5);
      CHECK(restores > routed_restores + 5);
      const auto st = a.stats();
      const expseg::Trace t{"random pools", a.recorded()};
      std::vector<std::uint64_t> failed;
      for (std::size_t i = 0; i < t.events.size(); ++i)
        if (t.events[i].action == TraceAction::allocate_failure) failed.push_back(i);
      REQUIRE(failed.size() > 100);
      const auto r = expseg::replay(t, conf);
      CHECK(r.oom_events == failed);
      CHECK(r.peak_allocated_bytes == st.allocated_bytes[expseg::kAllPools].peak);
      CHECK(r.peak_reserved_bytes == st.reserved_bytes[expseg::kAllPools].peak);
    }
  }
}
