// RMM allocation-log CSV (lib/trace/rmm_log.cpp): parsing, every malformed-input message, pairing
// checks, writing and reading back, and the shipped ResNet-50 trace.
#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <unordered_map>

#include "expseg/trace.hpp"
#include "trace/inflate.hpp"
#include "trace/rmm_log.hpp"

#ifndef EXPSEG_SOURCE_DIR
#error "EXPSEG_SOURCE_DIR must name the source tree (tests/meson.build passes it)"
#endif

namespace {

using expseg::TraceAction;
using expseg::TraceEvent;

struct Caught {
  bool thrown = false;
  std::string what;
  std::size_t line = 0;
  std::string file;
};

template <class F>
Caught catch_trace_error(F&& f) {
  try {
    f();
  } catch (const expseg::trace_error& e) {
    return {true, e.what(), e.line(), e.file()};
  }
  return {};
}

Caught parse_error(std::string_view text) {
  return catch_trace_error([&] { expseg::parse_trace(text, "t.csv"); });
}

constexpr std::string_view kHeader = "Thread,Time,Action,Pointer,Size,Stream\n";

// One data line after the standard header; the error is then on line 2.
Caught line_error(std::string_view line) { return parse_error(std::string(kHeader) + std::string(line) + "\n"); }

class TempDir {
 public:
  TempDir() {
    std::random_device rd;
    const auto tick = std::chrono::steady_clock::now().time_since_epoch().count();
    path_ = std::filesystem::temp_directory_path() / ("expseg-trace-test-" + std::to_string(rd()) + "-" + std::to_string(tick));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

void write_bytes(const std::string& path, std::string_view bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(bytes.data(), std::streamsize(bytes.size()));
  REQUIRE(f.good());
}
std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

bool same_event(const TraceEvent& a, const TraceEvent& b) {
  return a.thread == b.thread && a.time == b.time && a.action == b.action && a.pointer == b.pointer && a.size == b.size &&
         a.stream == b.stream;
}

void check_same_events(const std::vector<TraceEvent>& a, const std::vector<TraceEvent>& b) {
  REQUIRE(a.size() == b.size());
  std::size_t mismatches = 0;
  for (std::size_t i = 0; i < a.size(); ++i) mismatches += !same_event(a[i], b[i]);
  CHECK(mismatches == 0);
}

constexpr std::string_view kAllActions =
    "Thread,Time,Action,Pointer,Size,Stream\n"
    "7,01:02:03.250000,allocate,0x7f0000000000,4096,0x0\n"
    "7,01:02:03.500000,allocate failure,0x0,1099511627776,0x0\n"
    "8,01:02:04.000001,map,0x7f0000200000,2097152,0x5a\n"
    "8,01:02:04.000002,unmap,0x7f0000200000,2097152,0x5a\n"
    "7,01:02:05.000000,free,0x7f0000000000,4096,0x0\n"
    "7,01:02:05.100000,allocate,0x7f0000000000,512,0x1f\n"
    "7,01:02:06.000000,deallocate,0x7f0000000000,512,0x1f\n";

}  // namespace

TEST_SUITE("trace") {

TEST_CASE("trace: RMM's printf-style logs, where a null pointer reads (nil), replay as with 0x0") {
  // RMM's logging_resource_adaptor formats "%p" since its rapids-logger versions: glibc prints a null
  // pointer as (nil) (every allocate failure, a free of nullptr). Was: "bad Pointer \"(nil)\"".
  const std::string nil =
      "Thread,Time,Action,Pointer,Size,Stream\n"
      "140000,13:43:57.491640,allocate,0x7f8d6c000000,256,0\n"
      "140000,13:43:57.491650,allocate failure,(nil),1099511627776000,0\n"
      "140000,13:43:57.491655,allocate,0x7f8d6e000000,4096,(nil)\n"
      "140000,13:43:57.491660,free,0x7f8d6c000000,256,0\n"
      "140000,13:43:57.491670,free,0x7f8d6e000000,4096,0\n";
  std::string zero = nil;
  for (std::size_t at; (at = zero.find("(nil)")) != std::string::npos;) zero.replace(at, 5, "0x0");
  const auto t = expseg::parse_trace(nil, "rmm25.csv");
  REQUIRE(t.events.size() == 5);
  CHECK(t.events[1].action == TraceAction::allocate_failure);
  CHECK(t.events[1].pointer == 0);
  CHECK(t.events[1].size == 1099511627776000u);
  CHECK(t.events[2].stream == 0);
  expseg::validate_trace(t);
  const auto z = expseg::parse_trace(zero, "rmm-old.csv");
  const expseg::Config c = expseg::Config::parse("device:sim,backend:split_merge,oom_snapshot:false");
  const auto rn = expseg::replay(t, c);
  const auto rz = expseg::replay(z, c);
  CHECK(rn.operations == 5);
  CHECK(rn.ooms == 1);
  CHECK(rn.operations == rz.operations);
  CHECK(rn.ooms == rz.ooms);
  CHECK(rn.peak_allocated_bytes == rz.peak_allocated_bytes);
  CHECK(rn.peak_reserved_bytes == rz.peak_reserved_bytes);
}

TEST_CASE("trace: RMM clock times, both separators") {
  const auto t = expseg::parse_trace(
      "Thread,Time,Action,Pointer,Size,Stream\n"
      "140213434488640,17:05:20.727658,allocate,0x7f8b6c000000,1024,0x0\n"
      "140213434488640,17:05:20:727700,free,0x7f8b6c000000,1024,0x0\n"
      "1,00:00:00.5,allocate,0x10,1,0x0\n"
      "1,23:59:60,free,0x10,1,0x0\n",
      "clock.csv");
  CHECK(t.name == "clock.csv");
  REQUIRE(t.events.size() == 4);
  const auto& e = t.events[0];
  CHECK(e.thread == 140213434488640u);
  CHECK(e.time == 61520.727658);
  CHECK(e.action == TraceAction::allocate);
  CHECK(e.pointer == 0x7f8b6c000000u);
  CHECK(e.size == 1024);
  CHECK(e.stream == 0);
  CHECK(e.line == 2);
  CHECK(t.events[1].time == 61520.7277);
  CHECK(t.events[1].action == TraceAction::free);
  CHECK(t.events[2].time == 0.5);
  CHECK(t.events[3].time == 86400.0);  // a leap second
  CHECK(t.events[3].line == 5);
}

TEST_CASE("trace: plain number times (indexes or seconds)") {
  const auto t = expseg::parse_trace(
      "Thread,Time,Action,Pointer,Size,Stream\n"
      "1,0,allocate,0x10,16,0x0\n"
      "1,41786,allocate,0x20,16,0x0\n"
      "1,1.5,free,0x10,16,0x0\n"
      "1,2e3,free,0x20,16,0x0\n",
      "plain.csv");
  REQUIRE(t.events.size() == 4);
  CHECK(t.events[0].time == 0.0);
  CHECK(t.events[1].time == 41786.0);
  CHECK(t.events[2].time == 1.5);
  CHECK(t.events[3].time == 2000.0);
}

TEST_CASE("trace: every action, and their CSV spellings") {
  const auto t = expseg::parse_trace(kAllActions, "actions.csv");
  REQUIRE(t.events.size() == 7);
  const TraceAction want[] = {TraceAction::allocate, TraceAction::allocate_failure, TraceAction::map, TraceAction::unmap,
                              TraceAction::free,     TraceAction::allocate,         TraceAction::free};
  for (std::size_t i = 0; i < 7; ++i) CHECK(t.events[i].action == want[i]);
  CHECK(t.events[1].size == 1099511627776u);
  CHECK(t.events[2].stream == 0x5a);
  CHECK(t.events[2].time == 3724.000001);
  CHECK(std::string(expseg::to_string(TraceAction::allocate)) == "allocate");
  CHECK(std::string(expseg::to_string(TraceAction::free)) == "free");
  CHECK(std::string(expseg::to_string(TraceAction::allocate_failure)) == "allocate failure");
  CHECK(std::string(expseg::to_string(TraceAction::map)) == "map");
  CHECK(std::string(expseg::to_string(TraceAction::unmap)) == "unmap");
}

TEST_CASE("trace: reordered and extra columns, BOM, CRLF, whitespace, blank lines") {
  const auto t = expseg::parse_trace(
      "\xEF\xBB\xBF Size, Pointer ,Extra,Stream,Action,Time,Thread \r\n"
      "\r\n"
      "64, 0X1F ,whatever,5,allocate,12,3\r\n"
      "   \r\n"
      "\n"
      "64,31,,0x7f00,free,13.25,3\r\n"
      "8,0x40,x,0,allocate,14,4",  // no final newline
      "reordered.csv");
  REQUIRE(t.events.size() == 3);
  CHECK(t.events[0].size == 64);
  CHECK(t.events[0].pointer == 0x1f);
  CHECK(t.events[0].stream == 5);
  CHECK(t.events[0].time == 12.0);
  CHECK(t.events[0].thread == 3);
  CHECK(t.events[0].line == 3);
  CHECK(t.events[1].pointer == 31);  // decimal pointers are accepted
  CHECK(t.events[1].stream == 0x7f00);
  CHECK(t.events[1].action == TraceAction::free);
  CHECK(t.events[1].line == 6);
  CHECK(t.events[2].line == 7);
  CHECK(t.events[2].thread == 4);
  // Non-ASCII (valid UTF-8) extra columns are fine.
  CHECK(expseg::parse_trace("Thread,Time,Action,Pointer,Size,Stream,Gr\xC3\xB6\xC3\x9F" "e\n1,0,free,0x1,1,0x0,x\n", "u.csv")
            .events.size() == 1);
  // A header alone is a valid, empty trace.
  CHECK(expseg::parse_trace(kHeader, "h.csv").events.empty());
}

TEST_CASE("trace: limits of numbers") {
  const auto t = expseg::parse_trace(
      "Thread,Time,Action,Pointer,Size,Stream\n"
      "18446744073709551615,0,allocate,0xffffffffffffffff,18446744073709551615,0x00000000000000000001\n",
      "max.csv");
  REQUIRE(t.events.size() == 1);
  CHECK(t.events[0].thread == std::numeric_limits<std::uint64_t>::max());
  CHECK(t.events[0].pointer == std::numeric_limits<std::uint64_t>::max());
  CHECK(t.events[0].size == std::numeric_limits<std::uint64_t>::max());
  CHECK(t.events[0].stream == 1);  // leading zeros do not count towards 64 bits
}

TEST_CASE("trace: empty input and bad headers") {
  auto c = parse_error("");
  CHECK(c.thrown);
  CHECK(c.what == "t.csv: empty trace: no header");
  CHECK(c.line == 0);
  CHECK(parse_error(" \n\r\n\n").what == "t.csv: empty trace: no header");
  CHECK(parse_error("\xEF\xBB\xBF").what == "t.csv: empty trace: no header");

  c = parse_error("Thread,Time,Action,Size\n1,0,allocate,16\n");
  CHECK(c.line == 1);
  CHECK(c.file == "t.csv");
  CHECK(c.what ==
        "t.csv:1: header is missing column(s) Pointer, Stream: expected Thread,Time,Action,Pointer,Size,Stream (in "
        "any order), found \"Thread,Time,Action,Size\"");

  c = parse_error("1,0,allocate,0x7f5db5e00000,37632,0x0\n");  // no header at all
  CHECK(c.line == 1);
  CHECK(c.what.find("header is missing column(s) Thread, Time, Action, Pointer, Size, Stream") != std::string::npos);

  c = parse_error("\n\nThread,Time,Action,Pointer,Size\n");
  CHECK(c.line == 3);  // leading blank lines are skipped
  CHECK(c.what.find("missing column(s) Stream:") != std::string::npos);

  c = parse_error("Thread,Time,Action,Pointer,Size,Stream,Size\n");
  CHECK(c.what == "t.csv:1: duplicate column Size in the header");
  CHECK(c.line == 1);

  c = parse_error("Thread,Time,Action,Pointer,Size,Stream\r1,0,allocate,0x1,1,0x0\r");
  CHECK(c.what == "t.csv:1: carriage return inside a line: only \\n and \\r\\n line endings are supported");
}

TEST_CASE("trace: wrong number of fields") {
  auto c = line_error("1,0,allocate,0x10,16");
  CHECK(c.line == 2);
  CHECK(c.what == "t.csv:2: expected 6 comma-separated fields (as in the header), found 5: \"1,0,allocate,0x10,16\"");
  c = line_error("1,0,allocate,0x10,16,0x0,extra");
  CHECK(c.what ==
        "t.csv:2: expected 6 comma-separated fields (as in the header), found 7: \"1,0,allocate,0x10,16,0x0,extra\"");
  c = parse_error("Thread,Time,Action,Pointer,Size,Stream,Note\n1,0,allocate,0x10,16,0x0\n");
  CHECK(c.what == "t.csv:2: expected 7 comma-separated fields (as in the header), found 6: \"1,0,allocate,0x10,16,0x0\"");
}

TEST_CASE("trace: a last line cut off mid-write is named as such, in memory and in a file") {
  // A job killed while its RMM log was written: the lines before the last are whole.
  const std::string whole = std::string(kHeader) + "1,0,allocate,0x10,16,0x0\n";
  const std::string hint =
      "; this is the file's last line and it has no newline at its end, as when the process writing the log stopped "
      "mid-line: delete it to read the lines before it";
  auto c = parse_error(whole + "1,1,allocate,0x7f5");
  CHECK(c.line == 3);
  CHECK(c.what == "t.csv:3: expected 6 comma-separated fields (as in the header), found 4: \"1,1,allocate,0x7f5\"" + hint);
  c = parse_error(whole + "1,1,allocate,0x20,16,0x");
  CHECK(c.what == "t.csv:3: bad Stream \"0x\": expected a 0x-prefixed hex or a decimal number" + hint);
  // The same line with its newline is only malformed; so is a bad line before the last.
  c = parse_error(whole + "1,1,allocate,0x7f5\n");
  CHECK(c.what == "t.csv:3: expected 6 comma-separated fields (as in the header), found 4: \"1,1,allocate,0x7f5\"");
  c = parse_error(std::string(kHeader) + "1,1,allocate,0x7f5\n1,0,allocate,0x10,16,0x0");
  CHECK(c.what == "t.csv:2: expected 6 comma-separated fields (as in the header), found 4: \"1,1,allocate,0x7f5\"");
  // Read from a file, in pieces (the line is the feeder's carry at the end).
  TempDir dir;
  const std::string path = dir.file("killed.csv");
  write_bytes(path, whole + "1,1,free,0x1");
  c = catch_trace_error([&] { expseg::read_trace(path); });
  CHECK(c.line == 3);
  CHECK(c.what == path + ":3: expected 6 comma-separated fields (as in the header), found 4: \"1,1,free,0x1\"" + hint);
}

TEST_CASE("trace: bad values name the line, the column and the text") {
  struct Case {
    const char* line;
    const char* message;
  };
  const Case cases[] = {
      {"x,0,allocate,0x10,16,0x0", "bad Thread \"x\": expected a decimal integer"},
      {"-1,0,allocate,0x10,16,0x0", "bad Thread \"-1\": negative"},
      {",0,allocate,0x10,16,0x0", "bad Thread \"\": empty field"},
      {"1,12:3:00.000000,allocate,0x10,16,0x0",
       "bad Time \"12:3:00.000000\": expected HH:MM:SS.ffffff, HH:MM:SS:ffffff or a non-negative number"},
      {"1,12:61:00.0,allocate,0x10,16,0x0",
       "bad Time \"12:61:00.0\": expected HH:MM:SS.ffffff, HH:MM:SS:ffffff or a non-negative number"},
      {"1,-3,allocate,0x10,16,0x0", "bad Time \"-3\": expected HH:MM:SS.ffffff, HH:MM:SS:ffffff or a non-negative number"},
      {"1,nan,allocate,0x10,16,0x0", "bad Time \"nan\": expected HH:MM:SS.ffffff, HH:MM:SS:ffffff or a non-negative number"},
      {"1,0,alloc,0x10,16,0x0", "bad Action \"alloc\": expected allocate, free, free completed, deallocate, allocate failure, map, unmap, pool begin, pool end, pool release or pool restore"},
      {"1,0,Allocate,0x10,16,0x0",
       "bad Action \"Allocate\": expected allocate, free, free completed, deallocate, allocate failure, map, unmap, pool begin, pool end, pool release or pool restore"},
      {"1,0,allocate,0xZZ,16,0x0", "bad Pointer \"0xZZ\": expected a 0x-prefixed hex or a decimal number"},
      {"1,0,allocate,0x,16,0x0", "bad Pointer \"0x\": expected a 0x-prefixed hex or a decimal number"},
      {"1,0,allocate,7f5db5e00000,16,0x0", "bad Pointer \"7f5db5e00000\": expected a 0x-prefixed hex or a decimal number"},
      {"1,0,allocate,0x10000000000000000,16,0x0", "bad Pointer \"0x10000000000000000\": does not fit in 64 bits"},
      {"1,0,allocate,0x10,-12,0x0", "bad Size \"-12\": negative"},
      {"1,0,allocate,0x10,18446744073709551616,0x0", "bad Size \"18446744073709551616\": does not fit in 64 bits"},
      {"1,0,allocate,0x10,99999999999999999999999,0x0", "bad Size \"99999999999999999999999\": does not fit in 64 bits"},
      {"1,0,allocate,0x10,12abc,0x0", "bad Size \"12abc\": expected a decimal integer"},
      {"1,0,allocate,0x10,1.5,0x0", "bad Size \"1.5\": expected a decimal integer"},
      {"1,0,allocate,0x10,0x10,0x0", "bad Size \"0x10\": expected a decimal integer"},
      {"1,0,allocate,0x10,16,stream0", "bad Stream \"stream0\": expected a 0x-prefixed hex or a decimal number"},
      {"1,0,allocate,0x10,16,", "bad Stream \"\": empty field"},
  };
  for (const auto& k : cases) {
    const auto c = line_error(k.line);
    INFO(k.line);
    CHECK(c.thrown);
    CHECK(c.line == 2);
    CHECK(c.what == std::string("t.csv:2: ") + k.message);
  }
  // Long text is cut, control bytes are escaped.
  const auto c = line_error("1,0,allocate,0x" + std::string(100, 'z') + ",16,0x0");
  CHECK(c.what == "t.csv:2: bad Pointer \"0xzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzz...\": expected a 0x-prefixed hex or a decimal number");
  CHECK(line_error(std::string("1,0,alloc\x01te,0x10,16,0x0")).what ==
        "t.csv:2: bad Action \"alloc\\x01te\": expected allocate, free, free completed, deallocate, allocate failure, map, unmap, pool begin, pool end, pool release or pool restore");
  // The first bad line is reported, after good ones.
  const auto later = parse_error(std::string(kHeader) + "1,0,allocate,0x10,16,0x0\n\n1,1,free,0x10,16,0x0\n1,2,free,0x10,sixteen,0x0\n");
  CHECK(later.line == 5);
  CHECK(later.what == "t.csv:5: bad Size \"sixteen\": expected a decimal integer");
}

TEST_CASE("trace: garbage bytes give a clear error at line 1 or 2, not a crash") {
  auto c = parse_error(std::string("\x7f" "ELF\x02\x01\x01\0\0\0\0\0\0\0\0\0\x03\0>\0", 20));
  CHECK(c.line == 1);
  CHECK(c.what == "t.csv:1: not a CSV trace: binary data in the header line (byte 0x7f at column 1)");
  c = parse_error(std::string("\x1f\x8b\x08\0\0\0\0\0\0\x03garbage", 17));
  CHECK(c.what == "t.csv:1: data is gzip-compressed: read the file with read_trace (or gunzip it first)");
  std::mt19937 rng(9);
  for (int round = 0; round < 50; ++round) {
    std::string junk(2000, '\0');
    for (auto& ch : junk) ch = char(rng());
    c = parse_error(junk);
    INFO(c.what);
    CHECK(c.thrown);
    CHECK(c.line >= 1);
    CHECK(c.line <= 2);
  }
  // Garbage after a good header: the first data line says what it found.
  c = parse_error(std::string(kHeader) + std::string("\x01\x02\xff\xfe,\x00\x00", 7) + "\n");
  CHECK(c.line == 2);
  CHECK(c.what == "t.csv:2: expected 6 comma-separated fields (as in the header), found 2: \"\\x01\\x02\\xff\\xfe,\\x00\\x00\"");
}

TEST_CASE("trace: validate_trace pairs frees with live allocations") {
  SUBCASE("a valid trace") {
    const auto t = expseg::parse_trace(kAllActions, "ok.csv");
    CHECK_NOTHROW(expseg::validate_trace(t));
    // RMM writes the size again on free; it may differ. Failures, map and unmap do not pair.
    CHECK_NOTHROW(expseg::validate_trace(expseg::parse_trace(std::string(kHeader) +
                                                             "1,0,allocate,0x10,100,0x0\n"
                                                             "1,1,allocate failure,0x0,1,0x0\n"
                                                             "1,2,allocate failure,0x0,1,0x0\n"
                                                             "1,3,unmap,0x99,2097152,0x0\n"
                                                             "1,4,free,0x10,64,0x0\n",
                                                             "sizes.csv")));
  }
  SUBCASE("free of a pointer never allocated") {
    const auto t = expseg::parse_trace(std::string(kHeader) + "1,0,allocate,0x10,16,0x0\n1,1,free,0x20,16,0x0\n", "u.csv");
    const auto c = catch_trace_error([&] { expseg::validate_trace(t); });
    CHECK(c.line == 3);
    CHECK(c.what == "u.csv:3: free of pointer 0x20 that is not live (never allocated, or already freed)");
  }
  SUBCASE("double free") {
    const auto t = expseg::parse_trace(
        std::string(kHeader) + "1,0,allocate,0x10,16,0x0\n1,1,free,0x10,16,0x0\n\n1,2,free,0x10,16,0x0\n", "d.csv");
    const auto c = catch_trace_error([&] { expseg::validate_trace(t); });
    CHECK(c.line == 5);
    CHECK(c.what == "d.csv:5: free of pointer 0x10 that is not live (never allocated, or already freed)");
  }
  SUBCASE("allocating a live pointer again") {
    const auto t = expseg::parse_trace(std::string(kHeader) +
                                           "1,0,allocate,0x7f5db5e00000,16,0x0\n"
                                           "1,1,allocate,0x7f5db5e00200,16,0x0\n"
                                           "1,2,allocate,0x7f5db5e00000,32,0x0\n",
                                       "a.csv");
    const auto c = catch_trace_error([&] { expseg::validate_trace(t); });
    CHECK(c.line == 4);
    CHECK(c.what == "a.csv:4: pointer 0x7f5db5e00000 allocated again while live (allocated at line 2)");
  }
  SUBCASE("events built in memory are named by index") {
    expseg::Trace t{"mem", {}};
    t.events.push_back({1, 0.0, TraceAction::allocate, 0x5, 8, 0, 0});
    t.events.push_back({1, 0.0, TraceAction::allocate, 0x5, 8, 0, 0});
    auto c = catch_trace_error([&] { expseg::validate_trace(t); });
    CHECK(c.line == 0);
    CHECK(c.what == "mem: event 1: pointer 0x5 allocated again while live (allocated at event 0)");
    t.events[1].action = TraceAction::free;
    t.events.push_back({1, 0.0, TraceAction::free, 0x5, 8, 0, 0});
    c = catch_trace_error([&] { expseg::validate_trace(t); });
    CHECK(c.what == "mem: event 2: free of pointer 0x5 that is not live (never allocated, or already freed)");
  }
}

TEST_CASE("trace: write_trace text and time formatting") {
  const std::vector<TraceEvent> ev = {
      {140213434488640, 61520.727658, TraceAction::allocate, 0x7f8b6c000000, 1024, 0, 0},
      {2, 3, TraceAction::allocate_failure, 0, 1ull << 40, 0x5a, 0},
      {2, 4, TraceAction::map, 0x7f0000200000, 2097152, 0x5a, 0},
      {2, 5, TraceAction::free, 0x7f8b6c000000, 1024, 0, 0},
  };
  std::ostringstream out;
  expseg::write_trace(out, ev);
  CHECK(out.str() ==
        "Thread,Time,Action,Pointer,Size,Stream\n"
        "140213434488640,17:05:20.727658,allocate,0x7f8b6c000000,1024,0x0\n"
        "2,00:00:03.000000,allocate failure,0x0,1099511627776,0x5a\n"
        "2,00:00:04.000000,map,0x7f0000200000,2097152,0x5a\n"
        "2,00:00:05.000000,free,0x7f8b6c000000,1024,0x0\n");
  std::ostringstream strict;
  expseg::write_trace(strict, ev, true);
  CHECK(strict.str() ==
        "Thread,Time,Action,Pointer,Size,Stream\n"
        "140213434488640,17:05:20.727658,allocate,0x7f8b6c000000,1024,0x0\n"
        "2,00:00:05.000000,free,0x7f8b6c000000,1024,0x0\n");

  using expseg::trace::format_time;
  CHECK(format_time(0) == "00:00:00.000000");
  CHECK(format_time(3661.5) == "01:01:01.500000");
  CHECK(format_time(0.0000004) == "00:00:00.000000");
  CHECK(format_time(59.9999996) == "00:01:00.000000");
  CHECK(format_time(360000.25) == "100:00:00.250000");  // hours do not wrap
  CHECK(format_time(-1) == "00:00:00.000000");
  CHECK(format_time(std::nan("")) == "00:00:00.000000");
  double s = 0;
  CHECK(expseg::trace::parse_time("100:00:00.250000", s));
  CHECK(s == 360000.25);
}

TEST_CASE("trace: write then read back, plain and gzip") {
  TempDir dir;
  const auto original = expseg::parse_trace(kAllActions, "actions.csv");
  for (const char* name : {"out.csv", "out.csv.gz"}) {
    const std::string path = dir.file(name);
    expseg::write_trace_file(path, original.events);
    CHECK(expseg::trace::is_gzip(read_bytes(path)) == std::string_view(name).ends_with(".gz"));
    const auto back = expseg::read_trace(path);
    CHECK(back.name == name);
    check_same_events(back.events, original.events);
    for (std::size_t i = 0; i < back.events.size(); ++i) CHECK(back.events[i].line == i + 2);
  }
  SUBCASE("rmm_strict keeps only allocate and free") {
    const std::string path = dir.file("strict.csv.gz");
    expseg::write_trace_file(path, original.events, true);
    const auto back = expseg::read_trace(path);
    REQUIRE(back.events.size() == 4);
    for (const auto& e : back.events) CHECK((e.action == TraceAction::allocate || e.action == TraceAction::free));
    CHECK(same_event(back.events[0], original.events[0]));
    CHECK(same_event(back.events[1], original.events[4]));
    CHECK(same_event(back.events[3], original.events[6]));
  }
  SUBCASE("random events round-trip exactly") {
    std::mt19937_64 rng(11);
    std::vector<TraceEvent> ev(5000);
    const TraceAction acts[] = {TraceAction::allocate, TraceAction::free, TraceAction::allocate_failure, TraceAction::map,
                                TraceAction::unmap};
    for (auto& e : ev) {
      e.thread = rng();
      e.time = double(rng() % 100'000'000'000ull) / 1e6;  // microsecond resolution, as written
      e.action = acts[rng() % 5];
      e.pointer = rng();
      e.size = rng();
      e.stream = rng() % 3 ? 0 : rng();
    }
    const std::string path = dir.file("random.csv.gz");
    expseg::write_trace_file(path, ev);
    check_same_events(expseg::read_trace(path).events, ev);
  }
}

TEST_CASE("trace: file errors") {
  TempDir dir;
  SUBCASE("missing file") {
    const std::string path = dir.file("missing.csv");
    const auto c = catch_trace_error([&] { expseg::read_trace(path); });
    CHECK(c.file == path);
    CHECK(c.line == 0);
    CHECK(c.what == path + ": cannot open trace file: No such file or directory");
  }
  SUBCASE("truncated gzip") {
    const std::string gz = expseg::trace::gzip_compress(std::string(kAllActions));
    const std::string path = dir.file("cut.csv.gz");
    write_bytes(path, std::string_view(gz).substr(0, gz.size() / 2));
    const auto c = catch_trace_error([&] { expseg::read_trace(path); });
    CHECK(c.line == 0);
    CHECK(c.what.rfind(path + ": corrupt gzip: truncated gzip data", 0) == 0);
  }
  SUBCASE("corrupt gzip") {
    std::string gz = expseg::trace::gzip_compress(std::string(kAllActions));
    gz[gz.size() - 6] ^= 0x40;  // CRC-32
    const std::string path = dir.file("crc.csv.gz");
    write_bytes(path, gz);
    const auto c = catch_trace_error([&] { expseg::read_trace(path); });
    CHECK(c.what.rfind(path + ": corrupt gzip: CRC-32 mismatch", 0) == 0);
  }
  SUBCASE("errors inside a file name the path") {
    const std::string path = dir.file("bad.csv.gz");
    write_bytes(path, expseg::trace::gzip_compress(std::string(kHeader) + "1,0,allocate,0x10,-5,0x0\n"));
    const auto c = catch_trace_error([&] { expseg::read_trace(path); });
    CHECK(c.line == 2);
    CHECK(c.what == path + ":2: bad Size \"-5\": negative");
  }
  SUBCASE("binary file that is not gzip") {
    const std::string path = dir.file("garbage.bin");
    write_bytes(path, std::string("\x89PNG\r\n\x1a\n\0\0\0\rIHDR", 16));
    const auto c = catch_trace_error([&] { expseg::read_trace(path); });
    CHECK(c.line == 1);
    CHECK(c.what == path + ":1: not a CSV trace: binary data in the header line (byte 0x89 at column 1)");
  }
  SUBCASE("gzip inside gzip") {
    const std::string path = dir.file("twice.csv.gz");
    write_bytes(path, expseg::trace::gzip_compress(expseg::trace::gzip_compress(std::string(kAllActions))));
    const auto c = catch_trace_error([&] { expseg::read_trace(path); });
    CHECK(c.what == path + ": compressed twice (gzip inside gzip): gunzip it once, then read the result");
  }
  SUBCASE("an endless binary device is refused after its first chunk, not read until memory runs out") {
    const auto c = catch_trace_error([&] { expseg::read_trace("/dev/zero"); });
    CHECK(c.line == 0);
    CHECK(c.what == "/dev/zero: not a CSV trace: binary data (a NUL byte at offset 65536)");
  }
  SUBCASE("unwritable path") {
    const std::string path = dir.file("no-such-dir/out.csv");
    try {
      expseg::write_trace_file(path, {});
      FAIL("write_trace_file did not throw");
    } catch (const expseg::error& e) {
      CHECK(std::string(e.what()) == "cannot write trace file " + path + ": No such file or directory");
    }
  }
}

TEST_CASE("trace: the shipped ResNet-50 trace") {
  const std::string path = EXPSEG_SOURCE_DIR "/benchmarks/traces/resnet50-train-varsize.rmm.csv.gz";
  const auto t = expseg::read_trace(path);
  CHECK(t.name == "resnet50-train-varsize.rmm.csv.gz");
  REQUIRE(t.events.size() == 41787);
  const auto& first = t.events.front();
  CHECK(first.action == TraceAction::allocate);
  CHECK(first.size == 37632);
  CHECK(first.pointer == 0x7f5db5e00000u);
  CHECK(first.line == 2);
  CHECK(t.events.back().line == 41788);
  CHECK_NOTHROW(expseg::validate_trace(t));

  // Peak of live requested bytes; a free releases what its allocation asked for.
  std::unordered_map<std::uint64_t, std::uint64_t> live;
  std::uint64_t current = 0, peak = 0;
  for (const auto& e : t.events) {
    if (e.action == TraceAction::allocate) {
      live[e.pointer] = e.size;
      current += e.size;
      peak = std::max(peak, current);
    } else if (e.action == TraceAction::free) {
      current -= live.at(e.pointer);
      live.erase(e.pointer);
    }
  }
  CHECK(peak == 5'940'124'432u);

  // Written back (gzip) and read again: the same events.
  TempDir dir;
  const std::string copy = dir.file("copy.csv.gz");
  expseg::write_trace_file(copy, t.events);
  check_same_events(expseg::read_trace(copy).events, t.events);
}

TEST_CASE("trace: Time fields whose exact value passes 2^64 are read without wrapping around") {
  // 9 hour and 9 fraction digits: (h * 3600 + ...) * 10^9 + frac overflowed and read as a small number.
  double s = 0;
  REQUIRE(expseg::trace::parse_time("999999999:00:00.999999999", s));
  CHECK(s == 3599999996401.0);  // 3599999996400.999999999, to the nearest double
  REQUIRE(expseg::trace::parse_time("5124095:34:33.709551616", s));  // the first product above 2^64
  CHECK(s == doctest::Approx(18446744073.709551616).epsilon(1e-15));
  // In a file: the event gets the same time, and its neighbours stay exact.
  const auto t = expseg::parse_trace(std::string(kHeader) +
                                         "1,999999999:00:00.999999999,allocate,0x10,1,0\n"
                                         "1,01:00:00.250000,free,0x10,1,0\n",
                                     "t.csv");
  REQUIRE(t.events.size() == 2);
  CHECK(t.events[0].time == 3599999996401.0);
  CHECK(t.events[1].time == 3600.25);
}

TEST_CASE("trace: blank lines do not make the parser reserve an event per newline") {
  // A .csv.gz of a few KB can hold 2^31 blank lines; the events reserved must follow the events.
  const std::string one_event = std::string(kHeader) + "1,1,allocate,0x10,4096,0\n";
  SUBCASE("empty lines") {
    const std::string text = one_event + std::string(3'000'000, '\n') + "1,2,free,0x10,4096,0\n" + std::string(1000, '\n');
    const auto t = expseg::parse_trace(text, "blank.csv");
    REQUIRE(t.events.size() == 2);
    CHECK(t.events[1].line == 3'000'003);
    CHECK(t.events.capacity() < 16);  // was 3,001,002
  }
  SUBCASE("whitespace lines: the reservation is capped") {
    std::string text = one_event;
    for (int i = 0; i < 1'500'000; ++i) text += " \r\n";
    const auto t = expseg::parse_trace(text, "spaces.csv");
    REQUIRE(t.events.size() == 1);
    CHECK(t.events.capacity() <= std::size_t{1} << 20);  // was 1,500,001
  }
  SUBCASE("gzip") {
    TempDir dir;
    const std::string path = dir.file("blank.csv.gz");
    write_bytes(path, expseg::trace::gzip_compress(one_event + std::string(4'000'000, '\n')));
    const auto t = expseg::read_trace(path);
    REQUIRE(t.events.size() == 1);
    CHECK(t.events.capacity() < 16);
  }
  SUBCASE("traces without blank lines still get their whole reservation up front") {
    std::string text(kHeader);
    for (int i = 0; i < 1000; ++i) text += "1," + std::to_string(i) + ",allocate,0x" + std::to_string(i + 1) + "0,512,0\n";
    const auto t = expseg::parse_trace(text, "dense.csv");
    REQUIRE(t.events.size() == 1000);
    CHECK(t.events.capacity() <= 1001);
  }
}

TEST_CASE("trace: a read holds at most EXPSEG_TRACE_MAX_EVENTS events (a small .gz can inflate to billions)") {
  // Was: no cap. A 582 KB .gz of 20 million short lines took 2.2 GB to replay, and a crafted one of
  // a few MB could take a host's whole memory before anything failed.
  struct EnvCap {
    explicit EnvCap(const char* v) { ::setenv("EXPSEG_TRACE_MAX_EVENTS", v, 1); }
    ~EnvCap() { ::unsetenv("EXPSEG_TRACE_MAX_EVENTS"); }
  };
  std::string text(kHeader);
  for (int i = 0; i < 40; ++i) text += "1," + std::to_string(i) + "," + (i % 2 ? "free" : "allocate") + ",0x10,4096,0\n";
  TempDir dir;
  const std::string gz = dir.file("capped.csv.gz");
  write_bytes(gz, expseg::trace::gzip_compress(text));
  {
    EnvCap cap("40");  // exactly the trace's events: read
    CHECK(expseg::parse_trace(text, "t.csv").events.size() == 40);
    CHECK(expseg::read_trace(gz).events.size() == 40);
  }
  {
    EnvCap cap("39");
    const auto c = catch_trace_error([&] { expseg::parse_trace(text, "t.csv"); });
    CHECK(c.line == 41);  // the 40th event's line (the header is line 1)
    CHECK(c.what == "t.csv:41: more than 39 events (EXPSEG_TRACE_MAX_EVENTS)");
    const auto z = catch_trace_error([&] { expseg::read_trace(gz); });
    CHECK(z.what == gz + ":41: more than 39 events (EXPSEG_TRACE_MAX_EVENTS)");
  }
  for (const char* bad : {"0", "-1", "1e6", "ten", "12 "}) {
    CAPTURE(bad);
    EnvCap cap(bad);
    const auto c = catch_trace_error([&] { expseg::parse_trace(text, "t.csv"); });
    CHECK(c.what == "t.csv: EXPSEG_TRACE_MAX_EVENTS=" + std::string(bad) + ": expected a positive number of events");
  }
  // Unset: the default follows the host's memory and reads every shipped trace (a million events or more).
  ::unsetenv("EXPSEG_TRACE_MAX_EVENTS");
  CHECK(expseg::parse_trace(text, "t.csv").events.size() == 40);
}

TEST_CASE("trace: read_trace reads as a stream, with lines across every chunk and piece boundary") {
  // ~9 MiB of text: the plain reader's 64 KiB chunks and the gzip decoder's pieces (a few MiB)
  // both end inside lines; line numbers and blank and CRLF lines must come out as in memory.
  std::string text = "\xEF\xBB\xBF\n" + std::string(kHeader);
  for (int i = 0; text.size() < (std::size_t{9} << 20); ++i) {
    text += std::to_string(i % 7) + "," + std::to_string(i) + ".5,allocate,0x" + std::to_string(1000 + i) + "0," + std::to_string(512 * (i % 97 + 1)) + ",0x0";
    text += i % 11 == 0 ? "\r\n" : "\n";
    if (i % 13 == 0) text += "  \n";
    if (i % 17 == 0) text += std::string(static_cast<std::size_t>(i % 5), '\n');  // runs of empty lines
  }
  text += "1,5,free,0x10000,512,0x0";  // no newline at the end
  const auto in_memory = expseg::parse_trace(text, "t.csv");
  TempDir dir;
  for (const bool gz : {false, true}) {
    CAPTURE(gz);
    const std::string path = dir.file(gz ? "big.csv.gz" : "big.csv");
    write_bytes(path, gz ? expseg::trace::gzip_compress(text) : text);
    const auto t = expseg::read_trace(path);
    check_same_events(t.events, in_memory.events);
    REQUIRE(!t.events.empty());
    CHECK(t.events.back().line == in_memory.events.back().line);
    CHECK(t.events[1000].line == in_memory.events[1000].line);
    CHECK(t.name == (gz ? "big.csv.gz" : "big.csv"));
  }
}

TEST_CASE("trace: read_trace stops at a line longer than 1 MiB instead of buffering it") {
  TempDir dir;
  const std::string long_line = std::string(kHeader) + "1,1,allocate,0x10,4096,0\n" + std::string((1 << 20) + 10, '7');
  // Also a long line that ends with its newline, within one piece of the decoder's output (was:
  // accepted from a .gz, whose pieces are larger than 1 MiB; refused from plain text).
  const std::string padded = std::string(kHeader) + "1,1,allocate,0x10,4096,0\n1,2,free,0x10,4096," +
                             std::string((1 << 20) + 10, ' ') + "0\n1,3,allocate,0x20,512,0\n";
  for (const std::string* text : {&long_line, &padded}) {
    for (const bool gz : {false, true}) {
      CAPTURE(gz);
      CAPTURE(text == &padded);
      const std::string path = dir.file(gz ? "long.csv.gz" : "long.csv");
      write_bytes(path, gz ? expseg::trace::gzip_compress(*text) : *text);
      const auto c = catch_trace_error([&] { expseg::read_trace(path); });
      CHECK(c.line == 3);
      CHECK(c.what == path + ":3: line longer than 1 MiB: not a CSV trace");
    }
  }
}

TEST_CASE("trace: a corrupt .gz is reported as corrupt even where its text also fails to parse") {
  // The decoder hands text on before the member's CRC-32 is checked; the parse error of the text
  // must not hide the corruption behind it.
  TempDir dir;
  const std::string path = dir.file("corrupt.csv.gz");
  std::string gz = expseg::trace::gzip_compress(std::string(kHeader) + "1,0,allocate,0x10,-5,0x0\n");
  gz[gz.size() - 8] = char(gz[gz.size() - 8] ^ 0x40);
  write_bytes(path, gz);
  const auto c = catch_trace_error([&] { expseg::read_trace(path); });
  CHECK(c.what.rfind(path + ": corrupt gzip: CRC-32 mismatch", 0) == 0);
}

TEST_CASE("trace: a .gz that is not gzip says so; a plain CSV named .gz still reads") {
  // Was: "header is missing column(s) ... found \"garbage not gzip\"", as if it were a bad CSV.
  TempDir dir;
  const std::string bad = dir.file("notgz.rmm.csv.gz");
  write_bytes(bad, "garbage not gzip\n");
  const auto c = catch_trace_error([&] { expseg::read_trace(bad); });
  CHECK(c.line == 1);
  CHECK(c.what == bad + ":1: not gzip data, although the name ends in .gz (it does not start with gzip's bytes 1f 8b); read as a CSV "
                         "trace, header is missing column(s) Thread, Time, Action, Pointer, Size, Stream: expected "
                         "Thread,Time,Action,Pointer,Size,Stream (in any order), found \"garbage not gzip\"");
  // (A browser may unpack a download and keep its .gz name.)
  const std::string plain = dir.file("plain.csv.gz");
  write_bytes(plain, kAllActions);
  CHECK(expseg::read_trace(plain).events.size() == expseg::parse_trace(kAllActions, "x.csv").events.size());
}

TEST_CASE("trace: a truncated .gz says how far it got: the bytes decompressed and the last complete line") {
  // Was only "truncated gzip data: the compressed stream ends before its final block".
  TempDir dir;
  std::string csv(kHeader);
  for (int i = 0; i < 3000; ++i) csv += "1," + std::to_string(i) + ",allocate,0x" + std::to_string(100000 + i) + "," + std::to_string(4096 + 7 * i) + ",0x0\n";
  const std::string gz = expseg::trace::gzip_compress(csv);
  const std::string path = dir.file("trunc.rmm.csv.gz");
  write_bytes(path, std::string_view(gz).substr(0, gz.size() / 2));
  const auto c = catch_trace_error([&] { expseg::read_trace(path); });
  CHECK(c.line == 0);
  CHECK(c.what == path + ": corrupt gzip: truncated gzip data: the compressed stream ends before its final block (49949 bytes "
                         "decompressed before the data ran out); the last complete line is line 1482");
  CHECK(std::count(csv.begin(), csv.begin() + 49949, '\n') == 1482);
}

}  // TEST_SUITE
