// expseg allocation traces: RMM's allocation-log CSV (plain or gzip) and their replay.
//
// Format (RMM logging_resource_adaptor): header `Thread,Time,Action,Pointer,Size,Stream`, then one
// event per line:
//   Thread  decimal thread id
//   Time    RMM's "HH:MM:SS.ffffff" (also "HH:MM:SS:ffffff"), or a plain number (seconds, or an index)
//   Action  allocate | free | deallocate (= free) | allocate failure | map | unmap |
//           pool begin | pool end | pool release | pool restore | free completed
//   Pointer hex (0x...) address, or "(nil)" for 0 (RMM's printf-style logs); only an identity for
//           replay, never dereferenced
//   Size    decimal bytes as requested
//   Stream  hex (0x...) or decimal stream id; 0 is the default stream
// `allocate failure` (an allocation that failed when recorded): replay asks the allocator for the
// same size on the same stream again (it may change the cache, as it did then) and, if that succeeds
// now, frees it at once; it counts in ReplayResult::allocations and, if it fails again, in ooms (with
// its OOM report, as any failed allocation). map/unmap (driver events written by expseg's recorder)
// are kept in the trace but ignored by replay: the replayed allocator makes its own driver calls.
// free completed (expseg's recorder; Pointer, Size and Stream as the free's): a free that waited for
// other streams' work (record_stream) has completed, its memory reusable from here; the `free` line
// is written when the caller freed. Only such deferred frees get one (PyTorch's free_completed, which
// tools/expseg.py's torch_snapshot() gives them). Replay ignores it: its frees complete at once.
// pool begin/end/release (graph pool lifetimes written by expseg's recorder; Pointer is the pool id,
// Size 0): from `pool begin` to `pool end`, the Stream's allocations go into that CUDA graph pool (a
// capture's, or one a stream allocates into outside a capture, as CUDA graph trees do), and the pool's
// memory serves only the pool until as many `pool release` as `pool begin` (Stream 0). Replay does the
// same through Allocator::begin_pool_allocations / end_pool_allocations / release_graph_pool, so a
// replayed pool holds its memory as the recorded one did. The recorder writes a pool's allocations on
// the stream that began it; a stream a capture forked to gets a stream id of its own in the trace,
// with its own pool begin, end and release, so its memory stays apart as it did.
// pool restore (Pointer the pool id, Size 0) is followed by an `allocate` on the same Stream: a block
// put back into that live pool's memory for that stream (Allocator::restore_graph_pool_block, as CUDA
// graph trees restore a checkpoint). Replay puts it back where the replay placed the earlier block at
// that recorded address (restore_graph_pool_block again); where that range is not free memory of the
// pool in the replay, it allocates it in the pool (routing the stream into the pool for that one
// allocation when it is not routed there already). RMM's strict format leaves the pool lines (and
// free completed) out;
// the allocations stay.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "expseg/config.hpp"
#include "expseg/errors.hpp"
#include "expseg/snapshot.hpp"
#include "expseg/stats.hpp"

// The public API keeps default visibility; the rest of libexpseg.so is built hidden.
#pragma GCC visibility push(default)

namespace expseg {

enum class TraceAction : std::uint8_t {
  allocate, free, allocate_failure, map, unmap, pool_begin, pool_end, pool_release, pool_restore, free_completed
};
const char* to_string(TraceAction) noexcept;  // the CSV spelling

struct TraceEvent {
  std::uint64_t thread = 0;
  double time = 0.0;  // seconds (RMM clock times become seconds since midnight)
  TraceAction action = TraceAction::allocate;
  std::uint64_t pointer = 0;
  std::uint64_t size = 0;
  std::uint64_t stream = 0;
  std::uint64_t line = 0;  // 1-based line in the source file (0 when built in memory)
};

struct Trace {
  std::string name;  // file name (without directories), or a label
  std::vector<TraceEvent> events;
};

// Reads a trace from a file; gzip is recognised by its magic bytes. The text is parsed as it is read
// or decompressed, so memory holds the events (and a .gz file's compressed bytes), not the text.
// Throws trace_error naming the file and line for: unreadable or truncated/corrupt gzip, bad header,
// missing columns, bad numbers, unknown actions, binary data, a line over 1 MiB, more events than a
// quarter of the host's memory holds (or than EXPSEG_TRACE_MAX_EVENTS, where set). (Frees of unknown
// pointers are found by validate_trace/replay, see below.)
Trace read_trace(const std::string& path);
// Parses CSV text already in memory; `name` is used in error messages.
Trace parse_trace(std::string_view csv_text, const std::string& name);
// Writes RMM's CSV (header included). Time is written as "HH:MM:SS.ffffff" of the event's seconds.
// rmm_strict: write only allocate/free lines (what RMM's own replay benchmark accepts).
void write_trace(std::ostream& out, const std::vector<TraceEvent>& events, bool rmm_strict = false);
// Writes to `path`; gzip-compressed when the path ends in ".gz".
void write_trace_file(const std::string& path, const std::vector<TraceEvent>& events, bool rmm_strict = false);

// Checks pairing: every free matches a live allocation of the same pointer, no pointer is
// allocated twice while live. Throws trace_error (with the line) on the first violation.
void validate_trace(const Trace& trace);

// ---------------------------------------------------------------------------------------------
// Replay: run a trace's allocations and frees against one allocator configuration.

struct SeriesPoint {
  std::uint64_t event = 0;       // index of the event after which the sample was taken
  std::int64_t allocated = 0;    // allocated_bytes.all.current
  std::int64_t reserved = 0;     // reserved_bytes.all.current
};

struct ReplayOptions {
  bool progress = false;          // progress on stderr (only drawn when stderr is a terminal)
  std::size_t series_points = 0;  // >0: sample allocated/reserved over time at about this many points
  bool snapshot_at_peak = false;  // take a snapshot at the moment of peak reserved (replays twice)
  // A partial trace (a recorder ring, a late start): instead of failing, skip frees of unknown
  // pointers, allocations at pointer 0 and pool lines that do not pair up, and free a pointer that
  // is allocated again while live first.
  bool lenient = false;
};

struct ReplayResult {
  std::string trace;
  std::string backend;            // "split_merge" or "expandable"
  std::string device;             // "sim:80GiB" or "cuda:0"
  std::size_t events = 0;         // events in the trace
  std::size_t operations = 0;     // of them replayed: allocations, frees, pool events (not map/unmap)
  std::size_t driver_events = 0;  // of them the recorded run's map/unmap events, not replayed
  std::size_t allocations = 0;    // allocations attempted
  std::size_t frees = 0;          // frees performed
  std::size_t ooms = 0;           // allocations that failed: OOMs of the allocator (as num_ooms)
  // Requests of 1 EiB or more: refused up front, before any allocator runs (no OOM: not in `ooms`,
  // no first_oom), as the allocator's num_ooms does not count them either.
  std::size_t refused_requests = 0;
  // Frees of allocations that had failed; lenient, also frees of unknown pointers, and each free
  // the trace lacks where a pointer is allocated again while live (that one is made, so it counts
  // in `frees` too).
  std::size_t skipped_frees = 0;
  std::size_t limit_bytes = 0;    // the limit the replay ran under (0: none)
  std::int64_t peak_allocated_bytes = 0;
  std::int64_t peak_reserved_bytes = 0;
  std::int64_t peak_requested_bytes = 0;  // peak of live requested bytes
  double seconds = 0.0;           // wall time of the replay loop (parsing excluded; a run of its own
                                  // when series or snapshot are asked for)
  double driver_seconds = 0.0;  // in driver calls during the run: measured on a GPU, modelled on the
                                // simulated device with sim_latency:true (0 without)
  std::vector<DriverCallTime> driver_calls;  // the same, per kind of call
  Stats stats;                    // at the end of the replay, before the allocator is destroyed
  std::vector<SeriesPoint> series;
  std::vector<std::uint64_t> oom_events;  // indexes in trace.events of the failed allocations
  std::optional<OomReport> first_oom;
  std::optional<Snapshot> peak_snapshot;
  std::string to_json() const;    // one line: trace, backend, device, events, peaks, ooms, seconds, ...
};

// Replays `trace` on a fresh allocator built from `config` for `device` (the config's device kind
// decides sim or cuda). Allocations that fail count as OOMs and their frees are skipped.
ReplayResult replay(const Trace& trace, const Config& config, const ReplayOptions& options = {}, int device = 0);
// Checks what a strict replay refuses before it runs anything: validate_trace's pairing and the pool
// lines (a pool end without its begin, a restore into a pool not live, ...). Throws trace_error with
// the line on the first violation. Cheap next to a replay: for a tool that replays later (study).
void validate_for_replay(const Trace& trace);

}  // namespace expseg

#pragma GCC visibility pop
