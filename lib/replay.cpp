// Trace replay: a trace's allocations and frees against one allocator configuration.
//
// The trace is first compiled into a flat list of operations on dense slots (pointer identities
// become slot numbers), so the timed loop does no hashing and no parsing: it measures the
// allocator, not the reader.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <unordered_map>

#include "allocator_impl.hpp"
#include "core/json.hpp"
#include "driver/sim_driver.hpp"
#include "expseg/trace.hpp"
#include "core/text.hpp"
#include "series_sampler.hpp"

namespace expseg {

namespace {

enum class OpKind : std::uint8_t { alloc, free, failed_alloc, pool_begin, pool_end, pool_release, pool_restore };

constexpr std::uint32_t kNoLink = UINT32_MAX;

struct Op {
  OpKind kind;
  std::uint32_t stream;  // index into the stream table
  std::uint32_t slot;
  std::uint64_t size;    // the pool id of pool_begin, pool_end and pool_release
  std::uint64_t pool = 0;  // pool_restore's pool
  // A restore puts a block back where an earlier block at the same recorded address lay: that
  // allocation keeps its replayed address under `remember`, the restore finds it under `source`
  // (kNoLink: none).
  std::uint32_t remember = kNoLink;
  std::uint32_t source = kNoLink;
  bool routed = false;  // pool_restore: its stream allocates into the pool already (a pool begin)
};

// The slot of size-0 allocations at pointer 0 (allocate(0) gives nullptr, in RMM and CUDA alike) and
// of frees of pointer 0: no pairing, as many may be live at once.
constexpr std::uint32_t kNullSlot = UINT32_MAX;

struct Program {
  std::vector<Op> ops;
  std::vector<std::uint64_t> event_of;  // ops[i] replays trace event event_of[i] (map/unmap are skipped)
  std::vector<std::uint64_t> stream_ids;  // trace stream ids, by index
  std::size_t slots = 0;
  std::size_t remembered = 0;  // replayed addresses restores look up (Op::remember)
  std::size_t unknown_frees = 0;
  std::size_t driver_events = 0;  // map/unmap: not replayed
};

using core::hex;

// What the strict replay's refusals suggest: most such traces are partial, not corrupt.
constexpr const char* kPartialHint =
    "; a partial trace (a recorder ring, a late start) replays leniently (expseg replay --lenient, ReplayOptions::lenient)";

Program compile(const Trace& trace, bool lenient) {
  Program p;
  p.ops.reserve(trace.events.size());
  p.event_of.reserve(trace.events.size());
  std::unordered_map<std::uint64_t, std::uint32_t> streams;
  std::unordered_map<std::uint64_t, std::uint32_t> live;        // pointer -> slot
  std::unordered_map<std::uint64_t, std::uint64_t> live_line;   // pointer -> line of its allocation
  std::vector<std::uint32_t> free_slots;
  std::unordered_map<std::uint64_t, std::size_t> last_alloc;  // pointer -> the op of its last allocation
  // Graph pools as the allocator will see them, so that a trace that would misuse them is refused
  // here with its line (or, lenient, the event skipped: a ring may have dropped a pool's begin).
  std::unordered_map<std::uint64_t, std::uint64_t> routed;  // stream id -> pool it allocates into
  std::unordered_map<std::uint64_t, std::uint64_t> uses;    // pool id -> begins not yet released
  auto pool_misuse = [&](std::uint64_t line, const std::string& what) {
    if (!lenient) throw trace_error(trace.name, line, what + kPartialHint);
  };
  auto stream_index = [&](std::uint64_t id) {
    auto [it, inserted] = streams.try_emplace(id, static_cast<std::uint32_t>(p.stream_ids.size()));
    if (inserted) p.stream_ids.push_back(id);
    return it->second;
  };
  // A `pool restore` waiting for its block's allocate (the next line).
  struct PendingRestore {
    std::uint64_t pool = 0;
    std::uint64_t stream = 0;
    std::uint64_t line = 0;
  };
  std::optional<PendingRestore> restore;
  auto restore_misuse = [&](const PendingRestore& r) {
    pool_misuse(r.line, "pool restore into pool " + hex(r.pool) + " on stream " + hex(r.stream) + " not followed by its block's allocate on that stream");
  };
  for (std::size_t i = 0; i < trace.events.size(); ++i) {
    const TraceEvent& e = trace.events[i];
    const std::uint64_t line = e.line ? e.line : i + 2;
    // The block a `pool restore` announced: this allocate, or the marker was not followed by it.
    std::uint64_t restore_pool = 0;
    if (restore) {
      if (e.action == TraceAction::allocate && e.stream == restore->stream && e.pointer != 0 && e.size != 0)
        restore_pool = restore->pool;
      else
        restore_misuse(*restore);
      restore.reset();
    }
    if (e.pointer == 0 && (e.action == TraceAction::free || (e.action == TraceAction::allocate && e.size == 0))) {
      p.ops.push_back(Op{e.action == TraceAction::free ? OpKind::free : OpKind::alloc, stream_index(e.stream), kNullSlot, 0});
      p.event_of.push_back(i);
      continue;
    }
    switch (e.action) {
      case TraceAction::pool_restore: {
        // Only into a live pool (the allocator refuses others), and from a stream that is not
        // routed into another pool (the replay routes it into this one for the block).
        auto u = uses.find(e.pointer);
        if (e.pointer == 0 || u == uses.end() || u->second == 0) {
          pool_misuse(line, "pool restore into pool " + hex(e.pointer) + ", which is not live (begun no more often than released)");
          break;
        }
        if (auto r = routed.find(e.stream); r != routed.end() && r->second != e.pointer) {
          pool_misuse(line, "pool restore into pool " + hex(e.pointer) + " on stream " + hex(e.stream) + ", which allocates into pool " + hex(r->second));
          break;
        }
        restore = PendingRestore{e.pointer, e.stream, line};
        break;
      }
      case TraceAction::allocate: {
        if (e.pointer == 0) {  // nonzero size (size 0 is handled above): its free(0) could never pair with it
          if (!lenient)
            throw trace_error(trace.name, line,
                              "allocation of " + std::to_string(e.size) + " bytes at pointer 0x0 (only a size-0 allocation gives a null pointer)" +
                                  kPartialHint);
          break;  // skipped, as a free of an unknown pointer is
        }
        const std::uint32_t stream = stream_index(e.stream);
        if (live.count(e.pointer)) {
          if (!lenient)
            throw trace_error(trace.name, line,
                              "pointer " + hex(e.pointer) + " allocated again while live (allocated at line " + std::to_string(live_line[e.pointer]) + ")" +
                                  kPartialHint);
          // The allocator handed the pointer out again, so the earlier block had been freed: its
          // free is missing (dropped, or logged late by another thread). Free it here, or the
          // replay holds it to the end.
          ++p.unknown_frees;
          const std::uint32_t old = live[e.pointer];
          p.ops.push_back(Op{OpKind::free, stream, old, 0});
          p.event_of.push_back(i);
          free_slots.push_back(old);
          live.erase(e.pointer);
        }
        std::uint32_t slot;
        if (!free_slots.empty()) {
          slot = free_slots.back();
          free_slots.pop_back();
        } else {
          slot = static_cast<std::uint32_t>(p.slots++);
        }
        live[e.pointer] = slot;
        live_line[e.pointer] = line;
        if (restore_pool != 0) {
          Op op{OpKind::pool_restore, stream, slot, e.size, restore_pool};
          op.routed = routed.count(e.stream) != 0;  // (routed into this pool: the marker's check)
          // The block restored where it lay: the replay puts it where its earlier allocation went.
          if (auto earlier = last_alloc.find(e.pointer); earlier != last_alloc.end()) {
            Op& src = p.ops[earlier->second];
            if (src.remember == kNoLink) src.remember = static_cast<std::uint32_t>(p.remembered++);
            op.source = src.remember;
          }
          p.ops.push_back(op);
        } else {
          p.ops.push_back(Op{OpKind::alloc, stream, slot, e.size});
        }
        last_alloc[e.pointer] = p.ops.size() - 1;
        p.event_of.push_back(i);
        break;
      }
      case TraceAction::free: {
        auto it = live.find(e.pointer);
        if (it == live.end()) {
          if (!lenient)
            throw trace_error(trace.name, line,
                              "free of pointer " + hex(e.pointer) + " that is not live (never allocated, or already freed)" + kPartialHint);
          ++p.unknown_frees;
          break;
        }
        p.ops.push_back(Op{OpKind::free, stream_index(e.stream), it->second, 0});
        p.event_of.push_back(i);
        free_slots.push_back(it->second);
        live.erase(it);
        live_line.erase(e.pointer);
        break;
      }
      case TraceAction::allocate_failure:
        p.ops.push_back(Op{OpKind::failed_alloc, stream_index(e.stream), 0, e.size});
        p.event_of.push_back(i);
        break;
      case TraceAction::map:
      case TraceAction::unmap:
        ++p.driver_events;
        break;  // driver events of the recorded run: the replayed allocator makes its own
      case TraceAction::free_completed:
        break;  // a deferred free's end: the replay has no stream work to wait for
      case TraceAction::pool_begin: {
        if (e.pointer == 0) {
          pool_misuse(line, "pool begin of pool 0 (not a pool id)");
          break;
        }
        const auto [it, inserted] = routed.try_emplace(e.stream, e.pointer);
        if (!inserted) {
          pool_misuse(line, "pool begin of pool " + hex(e.pointer) + " on stream " + hex(e.stream) + ", which allocates into pool " + hex(it->second) +
                                " already (no pool end)");
          break;
        }
        ++uses[e.pointer];
        p.ops.push_back(Op{OpKind::pool_begin, stream_index(e.stream), 0, e.pointer});
        p.event_of.push_back(i);
        break;
      }
      case TraceAction::pool_end: {
        auto it = routed.find(e.stream);
        if (it == routed.end() || it->second != e.pointer) {
          pool_misuse(line, "pool end of pool " + hex(e.pointer) + " on stream " + hex(e.stream) + ", which does not allocate into it (no pool begin)");
          break;
        }
        routed.erase(it);
        p.ops.push_back(Op{OpKind::pool_end, stream_index(e.stream), 0, e.pointer});
        p.event_of.push_back(i);
        break;
      }
      case TraceAction::pool_release: {
        auto it = uses.find(e.pointer);
        if (it == uses.end() || it->second == 0) {
          pool_misuse(line, "pool release of pool " + hex(e.pointer) + ", begun no more often than released");
          break;
        }
        if (it->second == 1 && std::any_of(routed.begin(), routed.end(), [&](const auto& r) { return r.second == e.pointer; })) {
          pool_misuse(line, "pool release of pool " + hex(e.pointer) + " while a stream still allocates into it (no pool end)");
          break;
        }
        --it->second;
        p.ops.push_back(Op{OpKind::pool_release, stream_index(e.stream), 0, e.pointer});
        p.event_of.push_back(i);
        break;
      }
    }
  }
  if (restore) restore_misuse(*restore);  // the trace ends after the marker
  return p;
}

struct RunOutput {
  std::vector<std::int64_t> reserved_after;  // per op, when asked for
};

}  // namespace

namespace {

// The streams a replay on the simulated device allocates on: the trace's ids as they are, except the
// keys expseg records for per-thread streams, CuPy's streams and graph pools (backends/backend.hpp).
// Those would name a thread, stream or pool of this process: a per-thread key of an exited thread
// gets its memory given back once freed, and a graph pool's key that this process never released
// counts as a live graph's memory, never reclaimed. Each becomes a plain stream id of its own, one
// the trace does not use. (On CUDA every stream of the trace is a stream_create of its own.)
std::vector<stream_t> sim_streams(const std::vector<std::uint64_t>& ids) {
  std::vector<stream_t> out(ids.size(), nullptr);
  std::uint64_t next = std::uint64_t{0x7e57} << 32;  // far from the small ids and the pointers traces hold
  // Sorted, for the search of a free id: a trace of many graph-pool or per-thread streams made a
  // linear search per id quadratic (80k streams: seconds).
  std::vector<std::uint64_t> taken(ids);
  std::sort(taken.begin(), taken.end());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (!backends::is_stream_key(reinterpret_cast<driver::stream_t>(static_cast<std::uintptr_t>(ids[i])))) {
      out[i] = reinterpret_cast<stream_t>(static_cast<std::uintptr_t>(ids[i]));
      continue;
    }
    while (std::binary_search(taken.begin(), taken.end(), next)) ++next;
    out[i] = reinterpret_cast<stream_t>(static_cast<std::uintptr_t>(next++));
  }
  return out;
}

}  // namespace

void validate_for_replay(const Trace& trace) { (void)compile(trace, false); }

ReplayResult replay(const Trace& trace, const Config& config, const ReplayOptions& options, int device) {
  const Program prog = compile(trace, options.lenient);
  ReplayResult r;
  r.trace = trace.name;
  r.backend = to_string(config.backend);
  r.device = device_label(config, device);
  r.events = trace.events.size();
  r.operations = prog.ops.size();
  r.skipped_frees = prog.unknown_frees;
  r.driver_events = prog.driver_events;

  const bool progress = options.progress && ::isatty(2);
  const std::size_t nops = prog.ops.size();

  // Runs the program up to `stop` ops (all when stop == nops) with `cfg`; fills the result on the
  // first run, its times on the timed run (the first, when no other is asked for).
  auto run = [&](const Config& cfg, std::size_t stop, bool first_pass, bool timed,
                 std::vector<std::int64_t>* reserved_after) -> std::optional<Snapshot> {
    Allocator a(cfg, device);
    driver::Driver& drv = detail::AllocatorAccess::driver(a);
    std::vector<stream_t> streams = config.device == DeviceKind::cuda ? std::vector<stream_t>(prog.stream_ids.size(), nullptr)
                                                                      : sim_streams(prog.stream_ids);
    if (config.device == DeviceKind::cuda)
      for (std::size_t i = 0; i < streams.size(); ++i)
        if (prog.stream_ids[i] != 0) streams[i] = drv.stream_create();
    std::vector<void*> ptr(prog.slots, nullptr);
    std::vector<std::uint64_t> size(prog.slots, 0);
    std::vector<bool> zero(prog.slots, false);  // slots holding a size-0 allocation
    std::vector<void*> remembered(prog.remembered, nullptr);  // Op::remember -> replayed address
    std::int64_t live_requested = 0;
    // The chart's series: the state after every op, sampled down (series_sampler.hpp).
    const bool sampled = first_pass && options.series_points != 0;
    detail::SeriesSampler sampler(detail::SeriesSampler::bucket_for(stop, options.series_points));
    detail::InsidePeaks inside_peaks;
    // A request of 1 EiB or more is refused up front, before any allocator runs: no OOM of the
    // allocator (num_ooms does not count it), so none of the replay's either.
    auto count_oom = [&](const out_of_memory& e, std::uint64_t bytes, std::size_t i) {
      if (!first_pass) return;
      if (bytes >= kMaxRequest) {
        ++r.refused_requests;
        return;
      }
      ++r.ooms;
      r.oom_events.push_back(prog.event_of[i]);
      if (!r.first_oom) {
        r.first_oom = e.report();
        detail::AllocatorAccess::set_oom_counterfactual(a, false);  // only the first report is kept
      }
    };
    const driver::CallStats calls_before = drv.call_stats();
    const auto t0 = std::chrono::steady_clock::now();
    for (std::size_t i = 0; i < stop; ++i) {
      const Op& op = prog.ops[i];
      switch (op.kind) {
        case OpKind::alloc:
        case OpKind::pool_restore: {
          if (first_pass) ++r.allocations;
          if (op.size == 0) {  // allocate(0) is nullptr by contract: not a failure, its free is a no-op
            if (op.slot != kNullSlot) zero[op.slot] = true;
            break;
          }
          // A restored block goes back where the replay put the block it restores (the earlier
          // allocation at its recorded address), as restore_graph_pool_block put it when recorded:
          // the hole it fills stays filled. Where that range is not free memory of the pool in this
          // replay (its own backend laid the pool out), it goes into the pool's memory for its
          // stream instead: the stream is routed into the pool for this one allocation; that begin
          // is a use the recorded run did not have, so the release after the end takes it back (the
          // pool is live, so that release only counts its uses down).
          bool restore = op.kind == OpKind::pool_restore;
          if (restore && op.source != kNoLink && remembered[op.source] != nullptr) {
            try {
              a.restore_graph_pool_block(op.pool, remembered[op.source], op.size);
              ptr[op.slot] = remembered[op.source];
              size[op.slot] = op.size;
              live_requested += static_cast<std::int64_t>(op.size);
              if (first_pass && live_requested > r.peak_requested_bytes) r.peak_requested_bytes = live_requested;
              if (op.remember != kNoLink) remembered[op.remember] = ptr[op.slot];
              break;
            } catch (const out_of_memory&) {
              throw;
            } catch (const driver_error&) {
              throw;
            } catch (const error&) {  // not free memory of the pool here: placed by the backend below
            }
          }
          // (Another exception ends the replay, and the allocator with it: no route is left behind.)
          restore = restore && !op.routed;  // a stream routed into the pool already allocates there
          if (restore) a.begin_pool_allocations(op.pool, streams[op.stream]);
          try {
            ptr[op.slot] = a.allocate(op.size, streams[op.stream]);
            if (op.remember != kNoLink) remembered[op.remember] = ptr[op.slot];
            size[op.slot] = op.size;
            live_requested += static_cast<std::int64_t>(op.size);
            if (first_pass && live_requested > r.peak_requested_bytes) r.peak_requested_bytes = live_requested;
          } catch (const out_of_memory& e) {
            ptr[op.slot] = nullptr;
            count_oom(e, op.size, i);
          }
          if (restore) {
            a.end_pool_allocations(op.pool, streams[op.stream]);
            a.release_graph_pool(op.pool);
          }
          break;
        }
        case OpKind::free:
          if (op.slot == kNullSlot) {  // free(nullptr): a no-op
            if (first_pass) ++r.frees;
          } else if (zero[op.slot]) {
            zero[op.slot] = false;
            if (first_pass) ++r.frees;
          } else if (ptr[op.slot] != nullptr) {
            a.deallocate(ptr[op.slot]);
            ptr[op.slot] = nullptr;
            live_requested -= static_cast<std::int64_t>(size[op.slot]);
            if (first_pass) ++r.frees;
          } else if (first_pass) {
            ++r.skipped_frees;
          }
          break;
        case OpKind::failed_alloc:
          // Failed when recorded: ask again (it may change the cache, as it did then); if it
          // succeeds now, give it straight back.
          if (first_pass) ++r.allocations;
          try {
            a.deallocate(a.allocate(op.size, streams[op.stream]));
            // It was live for a moment: part of the peak of live requested bytes, as of allocated.
            const std::int64_t with = live_requested + static_cast<std::int64_t>(op.size);
            if (first_pass && with > r.peak_requested_bytes) r.peak_requested_bytes = with;
          } catch (const out_of_memory& e) {
            count_oom(e, op.size, i);
          }
          break;
        case OpKind::pool_begin:  // as CUDA graph trees route a stream into a pool outside a capture
          a.begin_pool_allocations(op.size, streams[op.stream]);
          break;
        case OpKind::pool_end:
          a.end_pool_allocations(op.size, streams[op.stream]);
          break;
        case OpKind::pool_release:
          a.release_graph_pool(op.size);
          break;
      }
      if (first_pass) {
        if (sampled || reserved_after) {
          const Stats s = a.stats();
          if (sampled) {
            if (const auto inside = inside_peaks.check(prog.event_of[i], s)) sampler.push(*inside);
            sampler.push({prog.event_of[i], s.allocated_bytes[kAllPools].current, s.reserved_bytes[kAllPools].current});
          }
          if (reserved_after) reserved_after->push_back(s.reserved_bytes[kAllPools].current);
        }
        if (progress && (i & 0xFFFF) == 0) std::fprintf(stderr, "\r  replay %s on %s: %3zu%%", trace.name.c_str(), r.backend.c_str(), i * 100 / std::max<std::size_t>(nops, 1));
      }
    }
    std::optional<Snapshot> snap;
    if (timed) {
      r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const driver::CallStats calls = drv.call_stats().since(calls_before);
      r.driver_seconds = calls.total_seconds();
      r.driver_calls = calls.by_call();
    }
    if (first_pass) {
      if (sampled) r.series = sampler.finish();
      r.stats = a.stats();
      r.limit_bytes = a.limit();
      r.peak_allocated_bytes = r.stats.allocated_bytes[kAllPools].peak;
      r.peak_reserved_bytes = r.stats.reserved_bytes[kAllPools].peak;
      if (progress) std::fprintf(stderr, "\r  replay %s on %s: done \n", trace.name.c_str(), r.backend.c_str());
    } else if (!timed) {
      snap = a.snapshot();
    }
    for (void*& p : ptr)
      if (p) a.deallocate(p), p = nullptr;
    if (config.device == DeviceKind::cuda) {
      drv.device_synchronize();
      for (stream_t s : streams)
        if (s) drv.stream_destroy(s);
    }
    return snap;
  };

  std::vector<std::int64_t> reserved_after;
  // A stats() sample after every op tripled the time (ResNet-50: 2.75 ms to 8.1 ms): with samples,
  // the time is of a run of its own without them (no dump written again).
  const bool sampling = options.series_points != 0 || options.snapshot_at_peak;
  run(config, nops, true, !sampling, options.snapshot_at_peak ? &reserved_after : nullptr);
  if (sampling) {
    Config timed = config;
    timed.oom_dump.clear();
    run(timed, nops, false, true, nullptr);
  }
  if (options.snapshot_at_peak && !reserved_after.empty()) {
    std::size_t peak = 0;
    for (std::size_t i = 0; i < reserved_after.size(); ++i)
      if (reserved_after[i] > reserved_after[peak]) peak = i;
    // The same ops up to the peak, quieter: the OOMs before it happened already, in the replay the
    // user asked for; written again, a dump would replace the one of the last OOM with an earlier
    // one (and a recording, the counterfactual and OOM snapshots are work no one reads).
    Config quiet = config;
    quiet.oom_dump.clear();
    quiet.record = false;
    quiet.oom_snapshot = false;
    quiet.oom_counterfactual = false;
    r.peak_snapshot = run(quiet, peak + 1, false, false, nullptr);
  }
  return r;
}

std::string ReplayResult::to_json() const {
  core::JsonWriter w;
  w.begin_object();
  w.field("trace", trace).field("backend", backend).field("device", device);
  w.field("events", static_cast<std::uint64_t>(events)).field("limit_bytes", static_cast<std::uint64_t>(limit_bytes));
  w.field("allocations", static_cast<std::uint64_t>(allocations)).field("frees", static_cast<std::uint64_t>(frees));
  w.field("ooms", static_cast<std::uint64_t>(ooms)).field("refused_requests", static_cast<std::uint64_t>(refused_requests));
  w.field("skipped_frees", static_cast<std::uint64_t>(skipped_frees));
  w.field("peak_allocated_bytes", peak_allocated_bytes).field("peak_reserved_bytes", peak_reserved_bytes);
  w.field("peak_requested_bytes", peak_requested_bytes);
  w.field("reserved_over_allocated", peak_allocated_bytes ? static_cast<double>(peak_reserved_bytes) / static_cast<double>(peak_allocated_bytes) : 0.0);
  w.field("seconds", seconds).field("driver_seconds", driver_seconds);
  w.key("driver_calls").raw(driver_calls_json(driver_calls));
  w.field("events_per_second", seconds > 0 ? static_cast<double>(events) / seconds : 0.0);
  w.field("operations", static_cast<std::uint64_t>(operations));
  w.field("operations_per_second", seconds > 0 ? static_cast<double>(operations) / seconds : 0.0);
  w.field("num_device_alloc", stats.num_device_alloc).field("num_device_free", stats.num_device_free);
  w.field("num_alloc_retries", stats.num_alloc_retries);
  w.key("first_oom_verdict");
  if (first_oom) w.value(to_string(first_oom->verdict));
  else w.null();
  w.end_object();
  return w.take();
}

}  // namespace expseg
