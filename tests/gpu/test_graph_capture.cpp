// CUDA graph capture on the real device, both backends (the unit suite's graph-pools cases model
// the same on the simulated device):
//   - a graph pool keeps what a captured graph wrote, freed during the capture or not, apart from
//     later eager blocks: replays leave those blocks' bytes alone;
//   - the recorder writes the pool's lifetime and the capture's allocations on its stream, and the
//     recording replays on the simulated device to the same peak reserved;
//   - requests during a capture that the cache cannot serve grow memory without invalidating the
//     capture (expandable: cuMemCreate/Map/SetAccess; split_merge: cuMemAlloc in relaxed mode);
//   - under a limit, a request during a capture that needs another stream's cached memory given
//     back gets it on expandable (cuStreamSynchronize of a stream that does not capture is
//     permitted in relaxed capture mode) and fails with an OOM on split_merge (as PyTorch, nothing
//     is given back during a capture); the capture stays valid, told of it or not;
//   - a capture expseg is not told of survives what requests on other streams do meanwhile: event
//     queries of pending frees, a free whose stream captures (held until the capture has ended),
//     a request that would need the capturing stream's cached memory (an OOM), a request that needs
//     the cached memory of a dozen other streams (each synchronized by itself), a request that
//     needs the memory of an exited thread's per-thread stream (the legacy stream's synchronization
//     waits for it) or of its own thread's (that stream's synchronization), the latter also during a
//     told capture; or of a destroyed blocking CuPy stream (the legacy stream's synchronization);
//   - during a told capture on a stream prepare_capture found non-blocking, expandable takes back
//     the legacy stream's idle memory (its synchronization is permitted then); not prepared, on a
//     blocking stream, or with a fork to a blocking stream, it fails the request instead;
//   - a capture expseg is not told of, on a stream it has an arena for, seen from a request on
//     another stream: the memory the legacy stream's synchronization (while a blocking stream
//     captures) or the device's (while any does) would take stays cached until the capture ends.
#include <doctest/doctest.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <string>
#include <vector>

#include "allocator_impl.hpp"
#include "backends/backend.hpp"
#include "driver/driver.hpp"
#include "expseg/errors.hpp"
#include "expseg/trace.hpp"
#include "gpu_util.hpp"
#include "test_util.hpp"

using namespace testutil;
using gputil::cuda_config;
using gputil::dp;
using gputil::driver_of;
using expseg::Allocator;
using expseg::BackendKind;
using expseg::kAllPools;
using expseg::driver::dev_ptr;
using expseg::driver::Driver;

namespace {

const BackendKind kBackends[] = {BackendKind::split_merge, BackendKind::expandable};

bool overlap(void* a, std::size_t an, void* b, std::size_t bn) { return dp(a) < dp(b) + bn && dp(b) < dp(a) + an; }

// Every word of the first and last 64 KiB of [p, p + bytes) equals `value`.
bool holds(Driver& d, void* p, std::size_t bytes, std::uint32_t value) {
  std::vector<std::uint32_t> buf(64 * KiB / 4);
  for (std::size_t off : {std::size_t{0}, bytes - 64 * KiB}) {
    d.copy_to_host(buf.data(), dp(p) + off, 64 * KiB);
    for (std::uint32_t w : buf)
      if (w != value) return false;
  }
  return true;
}

// Captures on `cs`, in global mode and untold, a memset of the 2 MiB at `out`, with `during()` run
// while it captures; the capture must end valid and its graph write `out` when launched.
template <class F>
void capture_around(Driver& d, void* cs, void* out, F&& during) {
  d.capture_begin(cs);
  d.memset_d32(dp(out), 0x5eed5eedu, 2 * MiB / 4, cs);
  during();
  expseg::driver::graph_t g = nullptr;
  CHECK_NOTHROW(g = d.capture_end(cs));
  REQUIRE(g != nullptr);
  d.graph_launch(g, cs);
  d.stream_synchronize(cs);
  CHECK(holds(d, out, 2 * MiB, 0x5eed5eedu));
  d.graph_destroy(g);
}

// Writes `bytes` at `p` on stream `s`, reads them back and frees p (nothing when p is null).
void write_read_free(Allocator& a, Driver& d, void* p, std::size_t bytes, void* s) {
  if (p == nullptr) return;
  d.memset_d32(dp(p), 7u, bytes / 4, s);
  d.stream_synchronize(s);
  CHECK(holds(d, p, bytes, 7u));
  a.deallocate(p);
}

// Ends a told capture on `cs` (into pool 1) whose work wrote 0x5eed5eed into the 2 MiB at `out`: the
// capture must end valid, and its graph write `out` when launched.
void end_told_capture(Allocator& a, Driver& d, void* cs, void* out) {
  expseg::driver::graph_t g = nullptr;
  CHECK_NOTHROW(g = d.capture_end(cs));
  a.end_graph_pool(1);
  REQUIRE(g != nullptr);
  d.graph_launch(g, cs);
  d.stream_synchronize(cs);
  CHECK(holds(d, out, 2 * MiB, 0x5eed5eedu));
  d.graph_destroy(g);
}

// Under a 1 GiB limit: 600 MiB idle on `key` after a memset queued on `work` (its stream), and
// 100 MiB live there (returned). A request of 800 MiB fits only with the 600 MiB unmapped.
void* idle_600_of_700(Allocator& a, Driver& d, void* key, void* work) {
  void* p = a.allocate(600 * MiB, key);
  void* kept = a.allocate(100 * MiB, key);
  d.memset_d32(dp(p), 3u, 600 * MiB / 4, work);
  a.deallocate(p);
  return kept;
}

}  // namespace

TEST_SUITE("gpu_graph_capture") {

TEST_CASE("gpu: a graph pool keeps a captured graph's memory apart: replays leave later eager blocks alone") {
  for (BackendKind kind : kBackends) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    Allocator a(cuda_config(kind));
    Driver& d = driver_of(a);
    void* s = d.stream_create();
    constexpr std::size_t kBytes = 64 * MiB;
    a.start_recording();  // the trace must carry the pool's lifetime (checked at the end)
    d.capture_begin(s);
    a.begin_graph_pool(1, s);
    void* in = a.allocate(kBytes, s);   // the graph's output, kept
    void* tmp = a.allocate(kBytes, s);  // an intermediate, freed during the capture
    d.memset_d32(dp(tmp), 0xAAAAAAAAu, kBytes / 4, s);
    d.memset_d32(dp(in), 0xBBBBBBBBu, kBytes / 4, s);
    a.deallocate(tmp);
    void* tmp2 = a.allocate(kBytes, s);  // reuses the intermediate's memory inside the graph
    CHECK(dp(tmp2) == dp(tmp));
    d.memset_d32(dp(tmp2), 0xCCCCCCCCu, kBytes / 4, s);
    a.deallocate(tmp2);
    const auto g = d.capture_end(s);
    a.end_graph_pool(1);
    // Eager blocks after the capture, on its stream and on the default stream.
    void* e1 = a.allocate(kBytes, s);
    void* e2 = a.allocate(kBytes, nullptr);
    CHECK_FALSE(overlap(e1, kBytes, tmp, kBytes));
    CHECK_FALSE(overlap(e2, kBytes, tmp, kBytes));
    CHECK_FALSE(overlap(e1, kBytes, in, kBytes));
    d.memset_d32(dp(e1), 0x11111111u, kBytes / 4, s);
    d.memset_d32(dp(e2), 0x22222222u, kBytes / 4, nullptr);
    d.device_synchronize();
    for (int replay = 0; replay < 3; ++replay) d.graph_launch(g, s);
    d.device_synchronize();
    CHECK(holds(d, e1, kBytes, 0x11111111u));
    CHECK(holds(d, e2, kBytes, 0x22222222u));
    CHECK(holds(d, in, kBytes, 0xBBBBBBBBu));
    CHECK(holds(d, tmp, kBytes, 0xCCCCCCCCu));  // still mapped for the graph: the last replay's bytes
    a.validate();
    a.deallocate(e1);
    a.deallocate(e2);
    a.deallocate(in);
    d.graph_destroy(g);
    a.release_graph_pool(1);
    // The recording names the pool's begin, end and release, the capture's allocations on its
    // stream, and replays on the simulated device to the same peak: the eager blocks after the
    // capture do not take the pool's memory there either.
    const std::vector<expseg::TraceEvent> ev = a.recorded();
    int begins = 0, ends = 0, releases = 0, on_s = 0;
    for (const expseg::TraceEvent& e : ev) {
      begins += e.action == expseg::TraceAction::pool_begin && e.pointer == 1 && e.stream == dp(s);
      ends += e.action == expseg::TraceAction::pool_end && e.pointer == 1 && e.stream == dp(s);
      releases += e.action == expseg::TraceAction::pool_release && e.pointer == 1;
      on_s += e.action == expseg::TraceAction::allocate && e.stream == dp(s);
    }
    CHECK(begins == 1);
    CHECK(ends == 1);
    CHECK(releases == 1);
    CHECK(on_s == 4);  // in, tmp, tmp2 (the pool's) and e1
    const auto r = expseg::replay(expseg::Trace{"capture", ev}, sim_config(kind));
    CHECK(r.ooms == 0);
    CHECK(r.peak_reserved_bytes == a.stats().reserved_bytes[kAllPools].peak);
    a.release_cached();
    CHECK(a.stats().reserved_bytes[kAllPools].current == 0);
    d.stream_destroy(s);
  }
}

TEST_CASE("gpu: a capture forked to a second stream: a block freed on one branch does not go to the other") {
  // As PyTorch's private pools (blocks keyed by stream): the graph runs the branches side by side.
  for (BackendKind kind : kBackends) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    Allocator a(cuda_config(kind));
    Driver& d = driver_of(a);
    void* s = d.stream_create();
    void* t = d.stream_create();
    constexpr std::size_t kBytes = 32 * MiB;
    a.start_recording();
    d.capture_begin(s);
    a.begin_graph_pool(1, s);
    const auto fork = d.event_create();
    d.event_record(fork, s);
    d.stream_wait_event(t, fork);  // t joins the capture
    void* on_s = a.allocate(kBytes, s);
    d.memset_d32(dp(on_s), 0xAAAAAAAAu, kBytes / 4, s);
    a.deallocate(on_s);
    void* on_t = a.allocate(kBytes, t);  // the other branch
    d.memset_d32(dp(on_t), 0xBBBBBBBBu, kBytes / 4, t);
    CHECK_FALSE(overlap(on_s, kBytes, on_t, kBytes));
    const auto join = d.event_create();
    d.event_record(join, t);
    d.stream_wait_event(s, join);
    expseg::driver::graph_t g = nullptr;
    CHECK_NOTHROW(g = d.capture_end(s));
    a.end_graph_pool(1);
    REQUIRE(g != nullptr);
    d.graph_launch(g, s);
    d.stream_synchronize(s);
    CHECK(holds(d, on_s, kBytes, 0xAAAAAAAAu));
    CHECK(holds(d, on_t, kBytes, 0xBBBBBBBBu));
    a.deallocate(on_t);
    d.graph_destroy(g);
    a.release_graph_pool(1);
    // The recording gives the fork a pool begin and end of its own (on an id other than s) and
    // replays to the same peak.
    const std::vector<expseg::TraceEvent> ev = a.recorded();
    int begins_fork = 0, ends_fork = 0;
    for (const expseg::TraceEvent& e : ev) {
      begins_fork += e.action == expseg::TraceAction::pool_begin && e.stream != dp(s);
      ends_fork += e.action == expseg::TraceAction::pool_end && e.stream != dp(s);
    }
    CHECK(begins_fork == 1);
    CHECK(ends_fork == 1);
    const auto r = expseg::replay(expseg::Trace{"fork", ev}, sim_config(kind));
    CHECK(r.ooms == 0);
    CHECK(r.peak_reserved_bytes == a.stats().reserved_bytes[kAllPools].peak);
    a.release_cached();
    CHECK(a.stats().reserved_bytes[kAllPools].current == 0);
    d.event_destroy(fork);
    d.event_destroy(join);
    d.stream_destroy(t);
    d.stream_destroy(s);
  }
}

TEST_CASE("gpu: requests during a capture grow memory without invalidating it; under a limit they fail instead of giving memory back") {
  for (BackendKind kind : kBackends) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    for (bool told : {false, true}) {
      CAPTURE(told);
      Allocator a(cuda_config(kind, "limit:1GiB"));
      Driver& d = driver_of(a);
      void* s = d.stream_create();
      void* s2 = d.stream_create();
      void* cached = a.allocate(640 * MiB, s2);
      d.memset_d32(dp(cached), 1u, 640 * MiB / 4, s2);
      a.deallocate(cached);  // idle memory of another stream
      d.capture_begin(s);
      if (told) a.begin_graph_pool(2, s);
      void* grown = a.allocate(256 * MiB, s);  // a cache miss: new memory, mapped during the capture
      d.memset_d32(dp(grown), 0x5eed5eedu, 256 * MiB / 4, s);
      // 640 + 256 + 256 MiB > 1 GiB: only s2's memory given back makes room. expandable
      // synchronizes s2 (it does not capture) and unmaps it; split_merge gives back nothing.
      void* more = nullptr;
      if (kind == BackendKind::expandable) {
        more = a.allocate(256 * MiB, s);
        d.memset_d32(dp(more), 0x77777777u, 256 * MiB / 4, s);
        CHECK(a.stats().reserved_bytes[kAllPools].current <= static_cast<std::int64_t>(GiB));
      } else {
        CHECK_THROWS_AS(a.allocate(256 * MiB, s), expseg::out_of_memory);
      }
      expseg::driver::graph_t g = nullptr;
      CHECK_NOTHROW(g = d.capture_end(s));
      if (told) a.end_graph_pool(2);
      REQUIRE(g != nullptr);
      d.graph_launch(g, s);
      d.device_synchronize();
      CHECK(holds(d, grown, 256 * MiB, 0x5eed5eedu));
      if (more != nullptr) CHECK(holds(d, more, 256 * MiB, 0x77777777u));
      a.validate();
      a.deallocate(grown);
      a.deallocate(more);
      d.graph_destroy(g);
      if (told) a.release_graph_pool(2);
      void* after = a.allocate(512 * MiB, s);  // after the capture, s2's memory is given back as usual
      a.deallocate(after);
      a.validate();
      a.release_cached();
      d.stream_destroy(s);
      d.stream_destroy(s2);
    }
  }
}

TEST_CASE("gpu: a capture expseg is not told of survives requests, event queries and frees on other streams") {
  for (BackendKind kind : kBackends) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    Allocator a(cuda_config(kind, "limit:1GiB"));
    Driver& d = driver_of(a);
    void* cs = d.stream_create();  // captures, in global mode (CUDA's default), untold
    void* b = d.stream_create();
    void* c = d.stream_create();
    void* cached = a.allocate(640 * MiB, cs);
    d.memset_d32(dp(cached), 1u, 640 * MiB / 4, cs);
    a.deallocate(cached);  // idle memory of the capturing stream
    void* used_on_c = a.allocate(2 * MiB, b);
    a.record_stream(used_on_c, c);
    d.memset_d32(dp(used_on_c), 2u, 2 * MiB / 4, c);
    a.deallocate(used_on_c);  // pending behind an event recorded on c before the capture
    void* used_on_cs = a.allocate(64 * MiB, b);
    a.record_stream(used_on_cs, cs);
    d.capture_begin(cs);
    void* out = a.allocate(128 * MiB, cs);  // from the stream's own cache
    d.memset_d32(dp(out), 0x33333333u, 128 * MiB / 4, cs);
    a.deallocate(used_on_cs);  // cs captures: held, no event recorded there
    void* r = a.allocate(1 * MiB, b);  // queries c's event (relaxed capture mode)
    // 640 + 64 + 2 + 1 + 512 MiB > 1 GiB: only the capturing stream's idle memory would make room.
    CHECK_THROWS_AS(a.allocate(512 * MiB, b), expseg::out_of_memory);
    expseg::driver::graph_t g = nullptr;
    CHECK_NOTHROW(g = d.capture_end(cs));
    REQUIRE(g != nullptr);
    d.memset_d32(dp(out), 0u, 128 * MiB / 4, cs);
    d.graph_launch(g, cs);
    d.device_synchronize();
    CHECK(holds(d, out, 128 * MiB, 0x33333333u));
    a.validate();
    a.deallocate(r);
    a.deallocate(out);
    a.release_cached();  // the held free gets its event on cs now, and completes
    a.deallocate(a.allocate(512, b));
    std::size_t pending = 0;
    for (const expseg::SegmentInfo& seg : a.snapshot().segments)
      for (const expseg::BlockInfo& blk : seg.blocks) pending += blk.state == expseg::BlockState::pending_free;
    CHECK(pending == 0);
    CHECK(a.stats().active_bytes[kAllPools].current == 0);
    void* big = a.allocate(768 * MiB, b);  // the capturing stream's memory is given back now
    a.deallocate(big);
    a.validate();
    d.graph_destroy(g);
    a.release_cached();
    d.stream_destroy(cs);
    d.stream_destroy(b);
    d.stream_destroy(c);
  }
}

TEST_CASE("gpu: memory cached for a dozen streams is taken back during a capture expseg is not told of") {
  // A request needs the idle memory of twelve streams while another stream captures in global
  // mode. Each of the twelve is synchronized by itself (relaxed capture mode); a device
  // synchronization, refused during any capture, would fail the request and invalidate the capture.
  constexpr int kStreams = 12;
  for (BackendKind kind : kBackends) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    Allocator a(cuda_config(kind, "limit:1GiB"));
    Driver& d = driver_of(a);
    std::vector<void*> streams;
    for (int i = 0; i < kStreams; ++i) {
      void* s = d.stream_create();
      void* p = a.allocate(64 * MiB, s);
      d.memset_d32(dp(p), static_cast<std::uint32_t>(i), 64 * MiB / 4, s);
      a.deallocate(p);  // 768 MiB idle, spread over twelve streams
      streams.push_back(s);
    }
    void* cs = d.stream_create();
    void* m = d.stream_create();
    void* out = a.allocate(2 * MiB, cs);
    void* big = nullptr;
    capture_around(d, cs, out, [&] {
      CHECK_NOTHROW(big = a.allocate(900 * MiB, m));  // 2 + 900 MiB: at least eleven streams' memory
    });
    a.validate();
    write_read_free(a, d, big, 900 * MiB, m);
    a.deallocate(out);
    a.release_cached();
    CHECK(a.stats().reserved_bytes[kAllPools].current == 0);
    for (void* s : streams) d.stream_destroy(s);
    d.stream_destroy(cs);
    d.stream_destroy(m);
  }
}

TEST_CASE("gpu: per-thread streams' memory is taken back during a capture expseg is not told of") {
  // Another stream captures in global mode, untold. The idle memory of an exited thread's
  // per-thread stream goes back after a synchronization of the legacy stream (it waits for every
  // thread's per-thread stream, and is permitted while a non-blocking stream captures); a thread's
  // own after its own stream's. A device synchronization would fail the request and invalidate the
  // capture.
  void* const per_thread = reinterpret_cast<void*>(std::uintptr_t{2});
  for (BackendKind kind : kBackends) {
    for (const bool own : {false, true}) {
      const std::string backend = expseg::to_string(kind);
      CAPTURE(backend);
      CAPTURE(own);
      Allocator a(cuda_config(kind, "limit:1GiB"));
      Driver& d = driver_of(a);
      void* cs = d.stream_create();
      void* m = d.stream_create();
      void* out = a.allocate(2 * MiB, cs);
      std::uint64_t reserved_before = 0;
      void* big = nullptr;
      void* kept = nullptr;
      auto fill = [&] {  // 600 MiB written on this thread's per-thread stream, then freed (idle)
        void* p = a.allocate(600 * MiB, per_thread);
        kept = a.allocate(100 * MiB, per_thread);  // lives on, apart from p: p's room is idle
        d.memset_d32(dp(p), 3u, 600 * MiB / 4, per_thread);
        a.deallocate(p);
        reserved_before = static_cast<std::uint64_t>(a.stats().reserved_bytes[kAllPools].current);
      };
      auto request = [&] {
        capture_around(d, cs, out, [&] {
          CHECK_NOTHROW(big = a.allocate(800 * MiB, own ? per_thread : m));  // needs the 600 MiB back
        });
      };
      if (own) {
        std::thread([&] {
          fill();
          request();
          a.deallocate(kept);
        }).join();
      } else {
        std::thread([&] { fill(); }).join();  // the thread exits; `kept` stays live
        request();
        a.deallocate(kept);
      }
      CHECK(reserved_before >= 700 * MiB);
      a.validate();
      write_read_free(a, d, big, 800 * MiB, cs);
      a.deallocate(out);
      a.release_cached();
      a.validate();
      d.stream_destroy(cs);
      d.stream_destroy(m);
    }
  }
}

TEST_CASE("gpu: expandable: during a told capture, a thread takes back its own per-thread stream's idle memory") {
  // The calling thread's per-thread stream's synchronization is permitted while another stream
  // captures: under a limit its idle memory serves the thread's request instead of an OOM, and the
  // capture (into a graph pool) stays valid. split_merge gives nothing back during a told capture.
  void* const per_thread = reinterpret_cast<void*>(std::uintptr_t{2});
  Allocator a(cuda_config(BackendKind::expandable, "limit:1GiB"));
  Driver& d = driver_of(a);
  void* cs = d.stream_create();
  d.capture_begin(cs);
  a.begin_graph_pool(1, cs);
  void* out = a.allocate(2 * MiB, cs);
  d.memset_d32(dp(out), 0x5eed5eedu, 2 * MiB / 4, cs);
  void* big = nullptr;
  void* kept = nullptr;
  std::uint64_t reserved_before = 0;
  std::thread([&] {
    void* p = a.allocate(600 * MiB, per_thread);
    kept = a.allocate(100 * MiB, per_thread);
    d.memset_d32(dp(p), 3u, 600 * MiB / 4, per_thread);
    a.deallocate(p);
    reserved_before = static_cast<std::uint64_t>(a.stats().reserved_bytes[kAllPools].current);
    CHECK_NOTHROW(big = a.allocate(800 * MiB, per_thread));  // needs p's 600 MiB back
  }).join();
  CHECK(reserved_before >= 700 * MiB);
  end_told_capture(a, d, cs, out);
  a.validate();
  write_read_free(a, d, big, 800 * MiB, cs);
  a.deallocate(kept);
  a.deallocate(out);
  a.release_graph_pool(1);
  a.release_cached();
  CHECK(a.stats().reserved_bytes[kAllPools].current == 0);
  d.stream_destroy(cs);
}

TEST_CASE("gpu: expandable: during a told capture on a stream that does not block, the legacy stream's idle memory is taken back") {
  // Whether the capture's stream blocks is asked before the capture (prepare_capture). When it does
  // not, the legacy stream's synchronization is permitted during the capture and waits for the
  // memset queued there: the legacy stream's 600 MiB serve the capture's request under the limit.
  // Not prepared, a blocking capture stream, or a fork of the capture to a blocking stream: the
  // request is an OOM, and the capture stays valid (the synchronization would invalidate it).
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
  for (const Case& k : kCases) {
    const std::string name = k.name;
    CAPTURE(name);
    Allocator a(cuda_config(BackendKind::expandable, "limit:1GiB"));
    Driver& d = driver_of(a);
    void* kept = idle_600_of_700(a, d, nullptr, nullptr);
    CHECK(a.stats().reserved_bytes[kAllPools].current >= static_cast<std::int64_t>(700 * MiB));
    void* cs = k.blocking_capture ? d.stream_create_blocking() : d.stream_create();
    void* t = d.stream_create_blocking();
    expseg::driver::event_t fork = d.event_create();
    expseg::driver::event_t join = d.event_create();
    if (k.prepare) a.prepare_capture(cs);
    d.capture_begin(cs);
    a.begin_graph_pool(1, cs);
    void* out = a.allocate(2 * MiB, cs);
    d.memset_d32(dp(out), 0x5eed5eedu, 2 * MiB / 4, cs);
    if (k.fork) {
      d.event_record(fork, cs);
      d.stream_wait_event(t, fork);
      CHECK(d.stream_capture_id(t) == d.stream_capture_id(cs));
      a.deallocate(a.allocate(1 * MiB, t));  // routed into the capture's pool
    }
    void* big = nullptr;
    if (k.served) {
      CHECK_NOTHROW(big = a.allocate(800 * MiB, cs));  // needs p's 600 MiB back
      CHECK(a.stats().reserved_bytes[kAllPools].current <= static_cast<std::int64_t>(1 * GiB));
    } else {
      CHECK_THROWS_AS(big = a.allocate(800 * MiB, cs), expseg::out_of_memory);
    }
    if (k.fork) {
      d.event_record(join, t);
      d.stream_wait_event(cs, join);
    }
    end_told_capture(a, d, cs, out);
    a.validate();
    write_read_free(a, d, big, 800 * MiB, cs);
    a.deallocate(kept);
    a.deallocate(out);
    a.release_graph_pool(1);
    a.release_cached();
    CHECK(a.stats().reserved_bytes[kAllPools].current == 0);
    d.event_destroy(fork);
    d.event_destroy(join);
    d.stream_destroy(cs);
    d.stream_destroy(t);
  }
}

TEST_CASE("gpu: expandable: a capture expseg is not told of, on a stream it has memory for, keeps what a synchronization it refuses would take") {
  // The request comes from another stream; expseg sees the capture through the capture stream's
  // arena. The legacy stream's synchronization is refused while a blocking stream captures, the
  // device's while any does (and they invalidate the capture): that memory stays cached until the
  // capture ends. While a non-blocking stream captures, the legacy stream's is permitted.
  struct Case {
    const char* name;
    bool cupy_idle;  // a non-blocking CuPy stream's idle memory (the device's synchronization), else the legacy stream's
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
    Allocator a(cuda_config(BackendKind::expandable, "limit:1GiB"));
    Driver& d = driver_of(a);
    void* cupy = d.stream_create();
    void* const work = k.cupy_idle ? cupy : nullptr;
    void* const key = k.cupy_idle ? expseg::backends::foreign_stream_key(cupy) : nullptr;
    void* kept = idle_600_of_700(a, d, key, work);
    void* cs = k.blocking_capture ? d.stream_create_blocking() : d.stream_create();
    void* m = d.stream_create();
    void* out = a.allocate(2 * MiB, cs);  // cs's arena: expseg knows cs
    void* big = nullptr;
    capture_around(d, cs, out, [&] {
      if (k.served_during) CHECK_NOTHROW(big = a.allocate(800 * MiB, m));
      else CHECK_THROWS_AS(big = a.allocate(800 * MiB, m), expseg::out_of_memory);
    });
    a.validate();
    if (big == nullptr) CHECK_NOTHROW(big = a.allocate(800 * MiB, m));  // the capture over: taken now
    write_read_free(a, d, big, 800 * MiB, m);
    a.deallocate(kept);
    a.deallocate(out);
    a.release_cached();
    CHECK(a.stats().reserved_bytes[kAllPools].current == 0);
    d.stream_destroy(cs);
    d.stream_destroy(m);
    d.stream_destroy(cupy);
  }
}

TEST_CASE("gpu: expandable: a destroyed blocking CuPy stream's memory is taken back during a capture expseg is not told of") {
  // CuPy's streams block by default and may be destroyed with memory cached for them (expseg never
  // names them to the driver again). Whether the stream blocks is asked while its arena is made;
  // the legacy stream's synchronization then waits for its work, destroyed or not, and is permitted
  // while a non-blocking stream captures. A device synchronization would fail the request and
  // invalidate the capture.
  Allocator a(cuda_config(BackendKind::expandable, "limit:1GiB"));
  Driver& d = driver_of(a);
  void* cupy_stream = d.stream_create_blocking();
  void* key = expseg::backends::foreign_stream_key(cupy_stream);
  void* kept = idle_600_of_700(a, d, key, cupy_stream);
  d.stream_destroy(cupy_stream);  // collected by CuPy; its memset may still run
  CHECK(a.stats().reserved_bytes[kAllPools].current >= static_cast<std::int64_t>(700 * MiB));
  void* cs = d.stream_create();
  void* m = d.stream_create();
  void* out = a.allocate(2 * MiB, cs);
  void* big = nullptr;
  capture_around(d, cs, out, [&] {
    CHECK_NOTHROW(big = a.allocate(800 * MiB, m));  // needs the CuPy stream's 600 MiB back
  });
  a.validate();
  write_read_free(a, d, big, 800 * MiB, m);
  a.deallocate(kept);
  a.deallocate(out);
  a.release_cached();
  CHECK(a.stats().reserved_bytes[kAllPools].current == 0);
  d.stream_destroy(cs);
  d.stream_destroy(m);
}

}  // TEST_SUITE

TEST_CASE("gpu: between cuStreamBeginCapture and begin_graph_pool, another stream's request does not break a prepared capture") {
  // The documented order: prepare_capture(s), cuStreamBeginCapture(s), begin_graph_pool(pool, s), on
  // a stream new to expseg (torch.cuda.graph's side stream). A request on another stream that
  // misses the cache meanwhile would give back a released graph pool's memory, whose
  // synchronization is the device's: expandable now sees the prepared stream capture and leaves it.
  for (BackendKind b : kBackends) {
    CAPTURE(std::string(expseg::to_string(b)));
    Allocator a(cuda_config(b));
    Driver& d = driver_of(a);
    void* cap1 = d.stream_create();
    void* cs = d.stream_create();
    void* m = d.stream_create();
    // An earlier graph's pool, released: its memory waits to be given back.
    d.capture_begin(cap1);
    a.begin_graph_pool(1, cap1);
    a.deallocate(a.allocate(64 * MiB, cap1));
    expseg::driver::graph_t g1 = nullptr;
    CHECK_NOTHROW(g1 = d.capture_end(cap1));
    a.end_graph_pool(1);
    d.graph_destroy(g1);
    a.release_graph_pool(1);

    a.prepare_capture(cs);
    d.capture_begin(cs);
    void* q = nullptr;
    CHECK_NOTHROW(q = a.allocate(8 * MiB, m));  // misses the cache; was: cuCtxSynchronize failed, capture invalidated
    a.begin_graph_pool(2, cs);
    void* out = a.allocate(2 * MiB, cs);
    d.memset_d32(dp(out), 0x5eed5eedu, 2 * MiB / 4, cs);
    expseg::driver::graph_t g = nullptr;
    CHECK_NOTHROW(g = d.capture_end(cs));
    a.end_graph_pool(2);
    if (g != nullptr) {
      d.graph_launch(g, cs);
      d.stream_synchronize(cs);
      CHECK(holds(d, out, 2 * MiB, 0x5eed5eedu));
      d.graph_destroy(g);
    }
    a.deallocate(out);
    a.release_graph_pool(2);
    write_read_free(a, d, q, 8 * MiB, m);
    a.validate();
    a.release_cached();
    CHECK(a.stats().reserved_bytes[kAllPools].current == 0);
    for (void* s : {cap1, cs, m}) d.stream_destroy(s);
  }
}

TEST_CASE("gpu: the legacy stream's capture question while a blocking stream captures is refused, and the capture stays valid") {
  // What expseg relies on to see a capture on any blocking stream, untold ones on other threads'
  // per-thread streams included (Driver::stream_capture_id): CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,
  // documented as leaving the capture valid. A non-blocking stream's capture leaves the question alone.
  Allocator a(cuda_config(BackendKind::expandable));
  Driver& d = driver_of(a);
  void* out = a.allocate(2 * MiB);
  for (const bool blocking : {false, true}) {
    CAPTURE(blocking);
    void* cs = blocking ? d.stream_create_blocking() : d.stream_create();
    capture_around(d, cs, out, [&] {
      if (!blocking) {
        CHECK(d.stream_capture_id(nullptr) == 0);
        return;
      }
      try {
        (void)d.stream_capture_id(nullptr);
        FAIL("answered");
      } catch (const expseg::driver_error& e) {
        CHECK(e.code() == Driver::kCaptureImplicitCode);
      }
    });
    d.stream_destroy(cs);
  }
  a.deallocate(out);
}

TEST_CASE("gpu: a held free with a use on the legacy stream waits while an untold capture on a blocking stream lasts") {
  // A block the legacy stream used, freed during a told capture, is held until that capture's
  // end_graph_pool. With a capture expseg was not told of underway on a blocking stream, its event
  // on the legacy stream would be refused and invalidate that capture: the free stays held instead.
  for (BackendKind b : {BackendKind::split_merge, BackendKind::expandable}) {
    CAPTURE(std::string(expseg::to_string(b)));
    Allocator a(cuda_config(b));
    Driver& d = driver_of(a);
    void* s3 = d.stream_create();
    void* s5 = d.stream_create_blocking();
    void* s6 = d.stream_create();
    void* blk = a.allocate(4 * MiB, s3);
    void* out5 = a.allocate(2 * MiB, s5);
    void* out6 = a.allocate(2 * MiB, s6);
    a.record_stream(blk, nullptr);
    d.capture_begin(s6);
    a.begin_graph_pool(2, s6);
    d.memset_d32(dp(out6), 6u, 2 * MiB / 4, s6);
    a.deallocate(blk);  // held until the told capture's end
    expseg::driver::graph_t g6 = nullptr, g5 = nullptr;
    // (Ended before the other begins: cuGraphInstantiate is refused while a capture is underway.)
    CHECK_NOTHROW(g6 = d.capture_end(s6));
    d.capture_begin(s5);  // untold
    d.memset_d32(dp(out5), 5u, 2 * MiB / 4, s5);
    CHECK_NOTHROW(a.end_graph_pool(2));
    CHECK(a.stats().requested_bytes[kAllPools].current == static_cast<std::int64_t>(8 * MiB));  // still held
    CHECK_NOTHROW(g5 = d.capture_end(s5));  // not invalidated
    REQUIRE(g5 != nullptr);
    d.graph_launch(g5, s5);
    d.stream_synchronize(s5);
    CHECK(holds(d, out5, 2 * MiB, 5u));
    CHECK_NOTHROW(a.release_cached());  // the free completes now
    CHECK(a.stats().requested_bytes[kAllPools].current == static_cast<std::int64_t>(4 * MiB));
    a.validate();
    for (auto g : {g6, g5})
      if (g != nullptr) d.graph_destroy(g);
    a.deallocate(out5);
    a.deallocate(out6);
    a.release_graph_pool(2);
    a.release_cached();
    CHECK(a.stats().reserved_bytes[kAllPools].current == 0);
    for (void* s : {s3, s5, s6}) d.stream_destroy(s);
  }
}

// An allocator destroyed while a capture it was told of runs (a program that raised mid-capture):
// the graph still writes its pool's memory when launched, so neither backend gives that memory back
// then (expandable leaves it mapped, split_merge skips cuMemFree; leaked until process exit, 20 MiB
// here). Was, on split_merge: the segments were freed, and the graph could not even be
// instantiated (cuStreamEndCapture's cuGraphInstantiate: CUDA_ERROR_INVALID_VALUE, on an H100).
TEST_CASE("gpu: an allocator destroyed during a told capture leaves the captured graph's memory in place") {
  for (BackendKind kind : kBackends) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    std::shared_ptr<Driver> d = expseg::driver::make_cuda_driver(0);
    void* s = d->stream_create();
    void* out = nullptr;
    {
      auto a = expseg::detail::AllocatorAccess::make(cuda_config(kind), d);
      void* eager = a->allocate(4 * MiB, s);  // live before the capture: stays too
      d->capture_begin(s);
      a->begin_graph_pool(1, s);
      out = a->allocate(2 * MiB, s);
      d->memset_d32(dp(out), 0x5eed5eedu, 2 * MiB / 4, s);
      (void)eager;
    }  // destroyed mid-capture
    expseg::driver::graph_t g = nullptr;
    CHECK_NOTHROW(g = d->capture_end(s));  // the destruction did not invalidate the capture
    REQUIRE(g != nullptr);
    d->graph_launch(g, s);
    CHECK_NOTHROW(d->stream_synchronize(s));
    CHECK(holds(*d, out, 2 * MiB, 0x5eed5eedu));
    d->graph_destroy(g);
    d->stream_destroy(s);
  }
}

// A stream routed into a graph pool (begin_pool_allocations: a graph tree's warm-up) that then
// captures without expseg being told: a request on it that cannot be served from the cache must not
// give back a released pool's idle memory with cuCtxSynchronize, which the capture refuses. Was (on
// expandable): the request failed with the driver's 900 and the capture was invalidated.
TEST_CASE("gpu: an untold capture on a begin_pool_allocations stream survives a request that needs new memory") {
  for (BackendKind kind : kBackends) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    Allocator a(cuda_config(kind));
    Driver& d = driver_of(a);
    void* c = d.stream_create();
    d.capture_begin(c);
    a.begin_graph_pool(1, c);
    void* out1 = a.allocate(8 * MiB, c);  // a graph output that outlives its pool
    expseg::driver::graph_t g1 = d.capture_end(c);
    a.end_graph_pool(1);
    a.release_graph_pool(1);
    d.graph_destroy(g1);
    void* s = d.stream_create();
    a.begin_pool_allocations(2, s);
    void* held = a.allocate(4 * MiB, s);
    void* out = a.allocate(2 * MiB, s);
    a.deallocate(out1);  // the released pool's memory is idle now (given back at the next slow path)
    void* more = nullptr;
    capture_around(d, s, out, [&] { CHECK_NOTHROW(more = a.allocate(64 * MiB, s)); });  // a cache miss during the capture
    a.deallocate(more);
    a.deallocate(out);
    a.deallocate(held);
    a.end_pool_allocations(2, s);
    a.release_graph_pool(2);
    a.validate();
    a.release_cached();
    d.stream_destroy(s);
    d.stream_destroy(c);
  }
}

// A told capture on a worker thread's per-thread stream, seen from another thread, which cannot
// name that stream: while it captures, end_graph_pool refuses (the legacy stream's question is
// refused while a blocking stream captures, and the capture stays valid); once it has ended, with
// the worker alive, end_graph_pool from the other thread ends it, and destroying the allocator gives
// its memory back. Was: refused, and all memory leaked, until the worker exited.
TEST_CASE("gpu: another thread's per-thread capture: end_graph_pool refuses while it runs, ends it once it has ended") {
  void* const per_thread = reinterpret_cast<void*>(std::uintptr_t{2});
  for (BackendKind kind : kBackends) {
    const std::string backend = expseg::to_string(kind);
    CAPTURE(backend);
    std::shared_ptr<Driver> d = expseg::driver::make_cuda_driver(0);
    auto a = expseg::detail::AllocatorAccess::make(cuda_config(kind), d);
    std::atomic<int> step{0};
    void* out = nullptr;
    expseg::driver::graph_t g = nullptr;
    std::thread worker([&] {
      d->capture_begin(per_thread);
      a->begin_graph_pool(1, per_thread);
      out = a->allocate(2 * MiB, per_thread);
      d->memset_d32(dp(out), 0x5eed5eedu, 2 * MiB / 4, per_thread);
      step = 1;
      while (step != 2) std::this_thread::yield();
      CHECK_NOTHROW(g = d->capture_end(per_thread));
      step = 3;
      while (step != 4) std::this_thread::yield();
    });
    while (step != 1) std::this_thread::yield();
    CHECK_THROWS_WITH_AS(a->end_graph_pool(1), doctest::Contains("does not show it ended (a blocking stream may capture"), expseg::error);
    step = 2;
    while (step != 3) std::this_thread::yield();
    CHECK_NOTHROW(a->end_graph_pool(1));  // the worker lives on
    step = 4;
    worker.join();
    REQUIRE(g != nullptr);  // the question from here left the capture valid
    void* s = d->stream_create();
    d->graph_launch(g, s);
    d->stream_synchronize(s);
    CHECK(holds(*d, out, 2 * MiB, 0x5eed5eedu));
    d->graph_destroy(g);
    a->deallocate(out);
    a->release_graph_pool(1);
    a->validate();
    a.reset();
    d->stream_destroy(s);
  }
}
