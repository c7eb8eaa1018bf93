// Bad input: each gets an error that names the problem, and the allocator is left as it was (stats,
// snapshot and the simulated device compared before and after). This covers what test_allocator.cpp,
// test_config.cpp and test_trace.cpp do not: the state comparison, sizes at the internal
// boundaries, pending and long-ago frees, pointers into cached and unmapped memory, another
// device's allocator for record_stream too, numeric overflow in config values, and malformed traces
// at the file and replay level (directories, empty files, gzip headers, pointers allocated twice).
#include <doctest/doctest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "expseg/trace.hpp"
#include "test_util.hpp"
#include "trace/inflate.hpp"

using namespace testutil;
using expseg::BackendKind;
using expseg::kAllPools;

namespace {

const BackendKind kBackends[] = {BackendKind::split_merge, BackendKind::expandable};

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Everything observable about an allocator: the snapshot's segments and blocks, the stats (with
// the counters an OOM is meant to change taken out, when asked), and the device's resources.
struct State {
  std::string segments;
  std::string stats;
  expseg::driver::SimDriver::Live live;
};

State capture(SimAllocator& sa, bool ignore_oom_counters = false) {
  expseg::Snapshot snap = sa->snapshot();
  expseg::Stats stats = snap.stats;
  snap.stats = expseg::Stats{};
  if (ignore_oom_counters) {
    stats.num_ooms = 0;
    stats.num_alloc_retries = 0;
    stats.num_sync_all_streams = 0;  // the retry's release_cached_blocks synchronizes, as PyTorch's does
  }
  return State{snap.to_json(), stats.to_json(), sa.sim->live()};
}

void check_same(const State& a, const State& b) {
  CHECK(a.segments == b.segments);
  CHECK(a.stats == b.stats);
  CHECK(a.live.reservations == b.live.reservations);
  CHECK(a.live.handles == b.live.handles);
  CHECK(a.live.mappings == b.live.mappings);
  CHECK(a.live.mem_allocs == b.live.mem_allocs);
  CHECK(a.live.events == b.live.events);
  CHECK(a.live.physical_bytes == b.live.physical_bytes);
}

template <class E, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("<wrong exception type: ") + e.what() + ">";
  }
  return "<no exception>";
}

void* at(void* p, std::ptrdiff_t offset) { return static_cast<char*>(p) + offset; }
std::string hex(const void* p) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(reinterpret_cast<std::uintptr_t>(p)));
  return buf;
}

struct ScratchDir {
  std::filesystem::path path;
  ScratchDir() {
    char tmpl[] = "/tmp/expseg_bad_input_XXXXXX";
    path = ::mkdtemp(tmpl);
  }
  ~ScratchDir() { std::filesystem::remove_all(path); }
  std::string file(const std::string& name, std::string_view bytes) const {
    const std::string p = (path / name).string();
    std::ofstream(p, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return p;
  }
};

std::string trace_error_of(const std::string& path) {
  return error_of<expseg::trace_error>([&] { (void)expseg::read_trace(path); });
}

constexpr const char* kHeader = "Thread,Time,Action,Pointer,Size,Stream\n";

}  // namespace

TEST_SUITE("bad_input") {

TEST_CASE("bad input: size 0 is nullptr, changes nothing and records nothing, on any stream") {
  for (BackendKind b : kBackends) {
    INFO("backend: " << std::string(expseg::to_string(b)));
    auto sa = make_sim_allocator(sim_config(b, 8 * GiB, "record:true"));
    void* keep = sa->allocate(3 * MiB);
    const auto events = sa->recorded().size();
    const State before = capture(sa);
    for (void* stream : {static_cast<void*>(nullptr), stream_id(7)}) {
      CHECK(sa->allocate(0, stream) == nullptr);
      sa->deallocate(nullptr);
    }
    check_same(before, capture(sa));
    CHECK(sa->recorded().size() == events);
    CHECK_FALSE(sa->last_oom().has_value());
    sa->validate();
    sa->deallocate(keep);
  }
}

TEST_CASE("bad input: absurd and oversized requests fail with a report that names them, and change nothing") {
  for (BackendKind b : kBackends) {
    INFO("backend: " << std::string(expseg::to_string(b)));
    auto sa = make_sim_allocator(sim_config(b, 8 * GiB, "record:true"));
    void* keep = sa->allocate(5 * MiB);
    sa->release_cached();  // no cache: split_merge's free-the-cache-and-retry has nothing to change
    // Sizes at the internal boundaries: rounding overflow (SIZE_MAX/2), the frontend's largest
    // request (2^60), and just above the device.
    const std::size_t cases[] = {SIZE_MAX, SIZE_MAX - 1, SIZE_MAX / 2 + 1, (std::size_t{1} << 60) + 1, std::size_t{1} << 60,
                                 SIZE_MAX / 4, 8 * GiB + 1,
                                 8 * GiB - 2 * MiB};  // fits the device, not next to the live block
    std::int64_t ooms = 0;
    for (const std::size_t size : cases) {
      CAPTURE(size);
      const State before = capture(sa, true);
      const auto held = sa->stats();
      std::string msg;
      try {
        void* p = sa->allocate(size);
        // 8 GiB - 2 MiB with 5 MiB live: must not fit.
        FAIL("allocate(" << size << ") succeeded at " << hex(p));
      } catch (const expseg::out_of_memory& e) {
        if (size < (std::size_t{1} << 60)) ++ooms;  // 1 EiB and more is refused up front: no OOM of the allocator
        msg = e.what();
        CHECK(e.report().requested_bytes == size);
        CHECK(e.report().verdict == expseg::OomVerdict::capacity);
        CHECK(e.report().allocated_bytes == static_cast<std::size_t>(held.allocated_bytes[kAllPools].current));
      }
      CAPTURE(msg);
      CHECK(msg.rfind("CUDA out of memory. Tried to allocate " + expseg::format_bytes(size) + ".", 0) == 0);
      CHECK(contains(msg, "expseg verdict: capacity"));
      CHECK(contains(msg, "exceed what the device can give this process"));
      REQUIRE(sa->last_oom().has_value());
      CHECK(sa->last_oom()->requested_bytes == size);
      const auto ev = sa->recorded();
      REQUIRE(!ev.empty());
      CHECK(ev.back().action == expseg::TraceAction::allocate_failure);
      CHECK(ev.back().size == size);
      // Nothing allocated, no memory held beyond what was held.
      const auto after = sa->stats();
      CHECK(after.num_ooms == ooms);
      CHECK(after.allocation[kAllPools].current == held.allocation[kAllPools].current);
      CHECK(after.allocated_bytes[kAllPools].current == held.allocated_bytes[kAllPools].current);
      CHECK(after.reserved_bytes[kAllPools].current <= held.reserved_bytes[kAllPools].current);
      CHECK(sa.sim->live().physical_bytes <= before.live.physical_bytes);
      check_same(before, capture(sa, true));  // no reservation, handle or mapping is kept either
      sa->validate();
    }
    sa->deallocate(keep);
    void* big = sa->allocate(8 * GiB);  // the whole device still works
    sa->deallocate(big);
  }
}

TEST_CASE("bad input: requests above a limit name the limit, on split_merge, cupy and expandable") {
  struct Variant {
    BackendKind backend;
    const char* config;
    const char* prefix;
  };
  for (const Variant& v : {Variant{BackendKind::split_merge, "limit:1GiB", "CUDA out of memory. Tried to allocate 1.00 GiB."},
                           Variant{BackendKind::split_merge, "limit:1GiB,policy:cupy", "Out of memory allocating 1,073,742,336 bytes"},
                           Variant{BackendKind::expandable, "limit:1GiB", "CUDA out of memory. Tried to allocate 1.00 GiB."}}) {
    INFO("config: " << std::string(v.config));
    auto sa = make_sim_allocator(sim_config(v.backend, 8 * GiB, v.config));
    const State before = capture(sa, true);
    const std::string msg = error_of<expseg::out_of_memory>([&] { (void)sa->allocate(1 * GiB + 1); });
    CAPTURE(msg);
    CHECK(msg.rfind(v.prefix, 0) == 0);
    CHECK(contains(msg, "expseg verdict: limit"));
    CHECK(sa->last_oom()->verdict == expseg::OomVerdict::limit);
    CHECK(sa->last_oom()->limit_bytes == 1 * GiB);
    CHECK(sa->stats().reserved_bytes[kAllPools].current == 0);
    CHECK(sa.sim->live().physical_bytes == 0);
    if (v.backend == BackendKind::split_merge) check_same(before, capture(sa, true));
    void* p = sa->allocate(1 * GiB);  // exactly the limit fits
    sa->deallocate(p);
    sa->validate();
  }
}

TEST_CASE("bad input: double frees, also of pending and long-ago frees, are named and change nothing") {
  for (BackendKind b : kBackends) {
    INFO("backend: " << std::string(expseg::to_string(b)));
    auto sa = make_sim_allocator(sim_config(b));
    void* s1 = sa.sim->stream_create();
    void* keep = sa->allocate(4 * MiB);
    // A free still pending on another stream's work.
    void* pending = sa->allocate(2 * MiB);
    sa->record_stream(pending, s1);
    sa.sim->set_stream_busy(s1, true);
    sa->deallocate(pending);
    State before = capture(sa);
    std::string msg = error_of<expseg::invalid_pointer>([&] { sa->deallocate(pending); });
    CHECK(msg == "expseg: free of pointer " + hex(pending) + ": double free (this allocation was already freed)");
    msg = error_of<expseg::invalid_pointer>([&] { sa->record_stream(pending, s1); });
    CHECK(msg == "expseg: record_stream of pointer " + hex(pending) + ": record_stream after free (this allocation was already freed)");
    check_same(before, capture(sa));
    sa.sim->set_stream_busy(s1, false);

    // A free long ago (more frees since than the allocator remembers): still rejected, still says why.
    void* old = sa->allocate(6 * MiB);
    sa->deallocate(old);
    for (int i = 0; i < 100; ++i) sa->deallocate(sa->allocate(512 * static_cast<std::size_t>(i + 1), stream_id(9)));
    before = capture(sa);
    msg = error_of<expseg::invalid_pointer>([&] { sa->deallocate(old); });
    CAPTURE(msg);
    CHECK(msg.rfind("expseg: free of pointer " + hex(old) + ": ", 0) == 0);
    CHECK((contains(msg, "already freed") || contains(msg, "not allocated by this expseg allocator")));
    check_same(before, capture(sa));
    sa->validate();
    sa->deallocate(keep);
    sa.alloc.reset();
    sa.sim->stream_destroy(s1);
  }
}

TEST_CASE("bad input: interior pointers and pointers into cached or unmapped memory are not freed") {
  for (BackendKind b : kBackends) {
    INFO("backend: " << std::string(expseg::to_string(b)));
    auto sa = make_sim_allocator(sim_config(b, 8 * GiB, "expandable_va_size:1GiB"));
    void* p = sa->allocate(3 * MiB + 100);
    void* cached = sa->allocate(1 * MiB);
    void* q = sa->allocate(64 * MiB);
    sa->deallocate(cached);  // now a free block in the cache
    const State before = capture(sa);
    for (std::ptrdiff_t off : {std::ptrdiff_t{1}, std::ptrdiff_t{8}, std::ptrdiff_t{511}, std::ptrdiff_t{512}, std::ptrdiff_t{3 * MiB + 99}}) {
      CAPTURE(off);
      const std::string msg = error_of<expseg::invalid_pointer>([&] { sa->deallocate(at(p, off)); });
      CHECK(msg == "expseg: free of pointer " + hex(at(p, off)) +
                       ": not the start of a live allocation (an interior pointer, or memory already freed)");
      CHECK(contains(error_of<expseg::invalid_pointer>([&] { sa->record_stream(at(p, off), stream_id(3)); }),
                     "record_stream of pointer " + hex(at(p, off)) + ": not the start of a live allocation"));
    }
    // Inside a cached free block, and (expandable) far into the segment's unmapped address range.
    CHECK(contains(error_of<expseg::invalid_pointer>([&] { sa->deallocate(at(cached, 4096)); }), "not the start of a live allocation"));
    if (b == BackendKind::expandable)
      CHECK(contains(error_of<expseg::invalid_pointer>([&] { sa->deallocate(at(q, 512 * MiB)); }), "not the start of a live allocation"));
    check_same(before, capture(sa));
    sa->validate();
    sa->deallocate(p);
    sa->deallocate(q);
  }
}

TEST_CASE("bad input: foreign pointers of every kind are named as foreign") {
  for (BackendKind b : kBackends) {
    INFO("backend: " << std::string(expseg::to_string(b)));
    auto sa = make_sim_allocator(sim_config(b));
    void* keep = sa->allocate(1 * MiB);
    const State before = capture(sa);
    auto heap = std::make_unique<int>(1);
    int stack = 0;
    for (void* foreign : {static_cast<void*>(heap.get()), static_cast<void*>(&stack), reinterpret_cast<void*>(std::uintptr_t{1}),
                          reinterpret_cast<void*>(~std::uintptr_t{0}), reinterpret_cast<void*>(~std::uintptr_t{0} - 4095)}) {
      CAPTURE(hex(foreign));
      CHECK(error_of<expseg::invalid_pointer>([&] { sa->deallocate(foreign); }) ==
            "expseg: free of pointer " + hex(foreign) +
                ": not allocated by this expseg allocator (device 0): a foreign pointer, or one from another device's allocator");
      CHECK(error_of<expseg::invalid_pointer>([&] { sa->record_stream(foreign, nullptr); }) ==
            "expseg: record_stream of pointer " + hex(foreign) +
                ": not allocated by this expseg allocator (device 0): a foreign pointer, or one from another device's allocator");
    }
    check_same(before, capture(sa));
    sa->deallocate(keep);
  }
}

TEST_CASE("bad input: another device's pointer, freed or recorded on the wrong allocator") {
  for (BackendKind b : kBackends) {
    INFO("backend: " << std::string(expseg::to_string(b)));
    expseg::driver::SimOptions o0, o1;
    o0.device_count = o1.device_count = 2;
    o1.device = 1;
    auto d0 = make_sim_allocator(sim_config(b), o0);
    auto d1 = make_sim_allocator(sim_config(b), o1);
    void* p = d0->allocate(2 * MiB);
    void* q = d1->allocate(2 * MiB);
    const State b0 = capture(d0), b1 = capture(d1);
    CHECK(contains(error_of<expseg::invalid_pointer>([&] { d1->deallocate(p); }), "not allocated by this expseg allocator (device 1)"));
    CHECK(contains(error_of<expseg::invalid_pointer>([&] { d1->record_stream(p, nullptr); }), "not allocated by this expseg allocator (device 1)"));
    CHECK(contains(error_of<expseg::invalid_pointer>([&] { d0->deallocate(q); }), "not allocated by this expseg allocator (device 0)"));
    check_same(b0, capture(d0));
    check_same(b1, capture(d1));
    d0->deallocate(p);  // the right allocator still frees it
    d1->deallocate(q);
    d0->validate();
    d1->validate();
  }
}

TEST_CASE("bad input: config values that overflow or make no sense name the key and the value") {
  struct Bad {
    const char* text;
    const char* key;
    const char* part;
  };
  const Bad bad[] = {
      {"sim_capacity:16777216TiB", "sim_capacity", "larger than 18446744073709551615 bytes"},
      {"limit:18446744073709551616", "limit", "larger than 18446744073709551615 bytes"},
      {"limit:99999999999999999999999999GiB", "limit", "'99999999999999999999999999GiB'"},
      {"expandable_va_size:18446744073709551616", "expandable_va_size", "larger than"},
      {"max_split_size_mb:18446744073709551616", "max_split_size_mb", "too large"},
      {"max_non_split_rounding_mb:18446744073709551616", "max_non_split_rounding_mb", "'18446744073709551616'"},
      {"sim_granularity:3MiB", "sim_granularity", "power of two"},
      {"sim_granularity:2KiB", "sim_granularity", "multiple of 4KiB"},
      {"sim_capacity:0", "sim_capacity", "larger than 0"},
      {"expandable_max_handle:3MiB", "expandable_max_handle", "multiple of 2MiB"},
      {"limit:100.0000000000001%", "limit", "[0%, 100%]"},
      {"device:SIM", "device", "cuda, sim"},
  };
  for (const Bad& x : bad) {
    INFO("text: " << std::string(x.text));
    try {
      (void)expseg::Config::parse(x.text);
      FAIL("parsed");
    } catch (const expseg::config_error& e) {
      CHECK(e.key() == x.key);
      CAPTURE(std::string(e.what()));
      CHECK(contains(e.what(), x.key));
      CHECK(contains(e.what(), x.part));
    }
  }
  // Through the environment, the Allocator's default configuration says where the text came from.
  ::setenv("EXPSEG_ALLOC_CONF", "device:sim,backend:expandable,limit:12XB", 1);
  const std::string msg = error_of<expseg::config_error>([] { expseg::Allocator a; });
  ::unsetenv("EXPSEG_ALLOC_CONF");
  CHECK(contains(msg, "EXPSEG_ALLOC_CONF"));
  CHECK(contains(msg, "limit"));
  CHECK(contains(msg, "'12XB'"));
}

TEST_CASE("bad input: malformed trace files name the file and the problem") {
  ScratchDir dir;
  // A directory, an empty file, a gzip header cut short, gzip magic followed by garbage.
  CHECK(trace_error_of(dir.path.string()) == dir.path.string() + ": cannot read trace file: Is a directory");
  const std::string empty = dir.file("empty.csv", "");
  CHECK(trace_error_of(empty) == empty + ": empty trace: no header");
  const std::string head = dir.file("head.csv.gz", std::string("\x1f\x8b\x08\x00", 4));
  CHECK(trace_error_of(head).rfind(head + ": corrupt gzip: truncated gzip data", 0) == 0);
  std::string junk("\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03", 10);
  for (int i = 0; i < 64; ++i) junk += static_cast<char>(i * 37 + 11);
  const std::string garbage = dir.file("junk.csv.gz", junk);
  CHECK(trace_error_of(garbage).rfind(garbage + ": corrupt gzip: ", 0) == 0);
  // Compressed text that is cut in the middle of a line: the gzip error, not a half line.
  std::string csv = kHeader;
  for (int i = 0; i < 2000; ++i) csv += "1," + std::to_string(i) + ",allocate,0x" + std::to_string(1000 + i) + ",4096,0x0\n";
  const std::string gz = expseg::trace::gzip_compress(csv);
  const std::string cut = dir.file("cut.csv.gz", std::string_view(gz).substr(0, gz.size() - 9));
  CHECK(trace_error_of(cut).rfind(cut + ": corrupt gzip: ", 0) == 0);
  // Missing columns, inside gzip: the line number is the CSV's.
  const std::string cols = dir.file("cols.csv.gz", expseg::trace::gzip_compress("Thread,Time,Action,Pointer,Stream\n1,0,allocate,0x10,0x0\n"));
  const std::string m = trace_error_of(cols);
  CAPTURE(m);
  CHECK(m.rfind(cols + ":1: ", 0) == 0);
  CHECK(contains(m, "Size"));
}

TEST_CASE("bad input: replay of traces that allocate a live pointer again, or ask for absurd sizes") {
  const std::string again = std::string(kHeader) + "1,0,allocate,0x1000,512,0x0\n1,1,allocate,0x1000,1024,0x0\n1,2,free,0x1000,1024,0x0\n";
  const expseg::Trace t = expseg::parse_trace(again, "again.csv");
  const std::string msg = error_of<expseg::trace_error>([&] { (void)expseg::replay(t, sim_config(BackendKind::expandable)); });
  CHECK(msg == "again.csv:3: pointer 0x1000 allocated again while live (allocated at line 2); a partial trace (a recorder ring, a late start) replays leniently (expseg replay --lenient, ReplayOptions::lenient)");
  expseg::ReplayOptions lenient;
  lenient.lenient = true;
  const auto r = expseg::replay(t, sim_config(BackendKind::expandable), lenient);
  CHECK(r.allocations == 2);
  CHECK(r.ooms == 0);

  // Sizes no device has (16 EiB - 1 B, 1 EiB + 1 B): refused up front, no OOM of the allocator (as
  // num_ooms; was: counted as OOMs), their frees skipped, the replay goes on.
  const std::string absurd = std::string(kHeader) + "1,0,allocate,0x10,18446744073709551615,0x0\n1,1,allocate,0x20,4096,0x0\n" +
                             "1,2,free,0x10,18446744073709551615,0x0\n1,3,allocate,0x30,1152921504606846977,0x5\n1,4,free,0x20,4096,0x0\n";
  for (BackendKind b : kBackends) {
    INFO("backend: " << std::string(expseg::to_string(b)));
    const auto rr = expseg::replay(expseg::parse_trace(absurd, "absurd.csv"), sim_config(b));
    CHECK(rr.ooms == 0);
    CHECK(rr.refused_requests == 2);
    CHECK(rr.frees == 1);
    CHECK(rr.skipped_frees == 1);
    CHECK(rr.peak_allocated_bytes == 4096);
    CHECK_FALSE(rr.first_oom.has_value());
    CHECK(rr.to_json().find("\"refused_requests\":2") != std::string::npos);
  }
}

}  // TEST_SUITE
