// expseg OOM dumps: what the oom_dump:PATH config key writes at every out-of-memory, read back.
//
// A dump is one JSON document (format "expseg-oom-dump/1"): the OOM report, a snapshot of every
// segment and block at that moment (with the stats), the configuration, the process and device,
// and, when the event recorder was on, the path of the recorded events (an RMM CSV trace that
// `expseg replay` and read_trace() read; it ends with the failed allocation). `expseg explain
// DUMP.json` prints a dump and replays its trace on both backends.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "expseg/errors.hpp"
#include "expseg/snapshot.hpp"
#include "expseg/trace.hpp"

// The public API keeps default visibility; the rest of libexpseg.so is built hidden.
#pragma GCC visibility push(default)

namespace expseg {

struct OomDump {
  std::string format;        // "expseg-oom-dump/1"
  std::string version;       // expseg's version that wrote it
  std::int64_t pid = 0;
  int device = 0;
  std::uint64_t oom_number = 0;  // this OOM's number in the allocator's life (%n); unlike stats' num_ooms, never reset
  std::string config;        // the allocator's configuration, canonical key:value form
  OomReport report;          // report.snapshot is left empty: the snapshot is below
  Snapshot snapshot;         // the allocator at the OOM
  std::string trace;         // the recorded events' file ("" when the recorder was off)
  std::size_t trace_events = 0;
  bool trace_complete = false;  // the trace starts from an empty allocator (else replay it leniently)
  bool limit_changed = false;   // the limit changed while the trace was recorded (the replay uses the last one)
};

// Where the recorded events of the dump at `dump_path` are written: "oom-7.json" -> "oom-7.trace.csv",
// "oom-7" -> "oom-7.trace.csv".
std::string oom_dump_trace_path(const std::string& dump_path);

// Reads a dump. Throws expseg::error naming the file and what is wrong: unreadable, not JSON, not a
// dump of a format this version reads, a member missing or of the wrong type.
OomDump read_oom_dump(const std::string& path);

// A trace that does not start from an empty allocator (record_ring dropped its oldest events, or
// start_recording came while memory was allocated or cached) lacks the allocations of blocks live when
// its first event happened, e.g. a model's weights; replayed alone it holds less than the run held
// and may not run out of memory where the run did. This puts their allocations first: the blocks
// the trace frees before it allocates them (their sizes are in the frees), and the blocks the dump's
// snapshot shows held at the OOM (allocated, or freed and waiting for a stream) that the trace never
// mentions. Returns how many were seeded and their requested bytes (0 for a complete trace).
struct SeededBlocks {
  std::size_t blocks = 0;
  std::size_t bytes = 0;
};
SeededBlocks seed_live_before_trace(Trace& trace, const Snapshot& at_oom);

}  // namespace expseg

#pragma GCC visibility pop
