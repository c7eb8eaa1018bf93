// libFuzzer target over the files expseg reads from users: RMM CSV traces (plain text, and gzip
// through read_trace's streaming decoder), their strict and lenient replays on both backends, and
// OOM dumps (read_oom_dump, then seed_live_before_trace against the dump's snapshot, as `expseg
// explain` does). The first byte picks the reader; the rest is the file. A reader may refuse an
// input only with expseg's own errors (trace_error, error): a crash, a sanitizer report, another
// exception type or an allocation past libFuzzer's -rss_limit_mb is a defect.
//
// Build (clang only): CXX=clang++ meson setup build-fuzz -Dfuzz=true -Db_lundef=false -Dbenchmarks=false
//                     ninja -C build-fuzz tests/fuzz_inputs
// Run:                build-fuzz/tests/fuzz_inputs -max_total_time=600 -rss_limit_mb=2048 CORPUS_DIR
//                     (seeds: benchmarks/traces/*.csv.gz, an oom_dump JSON written by `expseg scenario
//                     cupy-limit --conf oom_dump:...,record:true`)
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <string_view>

#include "expseg/config.hpp"
#include "expseg/errors.hpp"
#include "expseg/oom_dump.hpp"
#include "expseg/trace.hpp"
#include "trace/inflate.hpp"

namespace {

// The file the readers that take a path read; one per process (libFuzzer's -jobs run processes).
const std::string& scratch_path(const char* suffix) {
  static const std::string base = "/tmp/expseg-fuzz-inputs-" + std::to_string(::getpid());
  static std::string path;
  path = base + suffix;
  return path;
}

bool write_file(const std::string& path, std::string_view bytes) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return false;
  const bool ok = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  return std::fclose(f) == 0 && ok;
}

// Both backends, strict and lenient, on a small simulated device under a limit, so that OOMs, the
// other-backend check and the reports run too. Long traces are only parsed: the replays of a few
// hundred events already reach every path of the replay loop, and libFuzzer wants many inputs a second.
void replay_all(const expseg::Trace& t) {
  if (t.events.size() > 400) return;
  for (const char* backend : {"split_merge", "expandable"}) {
    const expseg::Config c =
        expseg::Config::parse(std::string("device:sim,sim_capacity:64MiB,limit:48MiB,backend:") + backend);
    for (const bool lenient : {false, true}) {
      expseg::ReplayOptions o;
      o.lenient = lenient;
      try {
        (void)expseg::replay(t, c, o);
      } catch (const expseg::trace_error&) {  // a strict replay refuses a trace that does not pair up
        if (lenient) std::abort();  // lenient replays take any trace that parsed
      }
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // A few KB of gzip can inflate to hundreds of millions of lines: the cap on events keeps the
  // readers' memory within -rss_limit_mb (the cap itself is tested: the error is expseg's).
  ::setenv("EXPSEG_TRACE_MAX_EVENTS", "200000", 1);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::string_view bytes(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    switch (data[0] % 4) {
      case 0: {  // CSV text in memory
        const expseg::Trace t = expseg::parse_trace(bytes, "fuzz.csv");
        replay_all(t);
        break;
      }
      case 1: {  // a file, gzip-compressed where it starts with gzip's bytes (the streaming decoder)
        const std::string& path = scratch_path(".csv.gz");
        if (!write_file(path, bytes)) return 0;
        const expseg::Trace t = expseg::read_trace(path);
        replay_all(t);
        break;
      }
      case 2: {  // the input as CSV text, gzip-compressed by expseg's own writer: read back the same
        const std::string& path = scratch_path(".csv.gz");
        if (!write_file(path, expseg::trace::gzip_compress(std::string(bytes)))) return 0;
        expseg::Trace from_gz;
        try {
          from_gz = expseg::read_trace(path);
        } catch (const expseg::trace_error&) {
          // Then the text itself must fail to parse too (the gzip layer adds no error of its own).
          try {
            (void)expseg::parse_trace(bytes, "fuzz.csv");
          } catch (const expseg::trace_error&) {
            return 0;
          }
          std::abort();
        }
        const expseg::Trace plain = expseg::parse_trace(bytes, "fuzz.csv");
        if (plain.events.size() != from_gz.events.size()) std::abort();
        break;
      }
      case 3: {  // an OOM dump, and the blocks explain would seed from its snapshot into an empty trace
        const std::string& path = scratch_path(".json");
        if (!write_file(path, bytes)) return 0;
        expseg::OomDump d = expseg::read_oom_dump(path);
        expseg::Trace t;
        t.name = "fuzz";
        (void)expseg::seed_live_before_trace(t, d.snapshot);
        (void)expseg::Config::parse(d.config);
        break;
      }
    }
  } catch (const expseg::error&) {  // trace_error, config_error, out_of_memory: refused with a message
  }
  return 0;
}
