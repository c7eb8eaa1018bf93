// oom_dump: the allocator at an OOM, written to a file so that a job that dies of it leaves the
// evidence behind (a cluster job's stderr is often lost or cut; a PyTorch RuntimeError carries only
// the message). One JSON document per OOM:
//   {"format": "expseg-oom-dump/1", "version", "pid", "device", "oom_number", "config",
//    "report": the OOM report (OomReport::to_json, its own snapshot left out),
//    "snapshot": every segment and block at the OOM, with the stats,
//    "trace": the recorded events' file or null, "trace_events": how many,
//    "trace_complete": whether the trace starts from an empty allocator (else replay it --lenient),
//    "limit_changed": whether set_limit changed the limit while the trace was recorded}
// When the event recorder is on (record:true, or start_recording()), its events, the failed
// allocation last, go to a second file beside it (PATH without ".json", plus ".trace.csv"), which
// `expseg explain PATH` (and `expseg replay`) replays on both backends on the simulated device.
// Both files are written to a temporary name and renamed, so a reader never sees half a dump.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <vector>

#include "allocator_impl.hpp"
#include "core/json.hpp"
#include "core/text.hpp"
#include "expseg/expseg.h"
#include "expseg/oom_dump.hpp"
#include "expseg/trace.hpp"

namespace expseg {
namespace {

// A temporary name beside `path`, unique in this process: allocators of different devices dump
// under their own locks and may be given the same path.
std::string temporary_name(const std::string& path) {
  static std::atomic<std::uint64_t> counter{0};
  return path + ".tmp" + std::to_string(::getpid()) + "." + std::to_string(counter.fetch_add(1, std::memory_order_relaxed));
}

// Writes `text` to temporary file `tmp`. Returns "" or why it failed (then no file is left).
std::string write_temporary(const std::string& tmp, const std::string& text) {
  errno = 0;
  std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
  if (!out) return std::string("cannot create ") + tmp + ": " + (errno ? std::strerror(errno) : "unknown error");
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  out.close();  // checked: on NFS or under a quota, a write can fail only when the file is closed
  if (!out) {
    const int err = errno;
    std::remove(tmp.c_str());
    return std::string("cannot write ") + tmp + ": " + (err ? std::strerror(err) : "unknown error");
  }
  return "";
}

// Renames `tmp` to `path`. Returns "" or why it failed (then `tmp` is removed).
std::string rename_into_place(const std::string& tmp, const std::string& path) {
  if (std::rename(tmp.c_str(), path.c_str()) == 0) return "";
  const int err = errno;
  std::remove(tmp.c_str());
  return std::string("cannot rename ") + tmp + " to " + path + ": " + std::strerror(err);
}

// The dump replaces a file at its path by a rename: a symlink, a device such as /dev/stderr or a FIFO
// there would be replaced, for the whole machine when run as root. Throws when `path` exists and is
// one of those (a directory stays: the rename onto it fails, and says so).
void require_regular_or_absent(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return;  // absent (or unreadable: the write says why)
  if (S_ISREG(st.st_mode) || S_ISDIR(st.st_mode)) return;
  const char* what = S_ISLNK(st.st_mode)    ? "a symbolic link"
                     : S_ISFIFO(st.st_mode) ? "a FIFO"
                     : (S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode)) ? "a device"
                                                                     : "not a regular file";
  throw std::runtime_error(path + " is " + std::string(what) +
                           ": a dump replaces a regular file only (name a file path in oom_dump, e.g. /tmp/oom-%p.json)");
}

// Held from a dump's first rename to its last: allocators of different devices dump under their
// own locks, and a path without %d (or %n) is shared by their OOMs; without it one OOM's JSON could
// land beside another's trace (two allocators on one path: 19 mixed pairs of 3,000).
std::mutex& rename_mutex() {
  static std::mutex m;
  return m;
}

}  // namespace

std::string oom_dump_trace_path(const std::string& dump_path) {
  constexpr std::string_view kJson = ".json";
  std::string base = dump_path;
  if (base.size() > kJson.size() && base.compare(base.size() - kJson.size(), kJson.size(), kJson) == 0)
    base.resize(base.size() - kJson.size());
  return base + ".trace.csv";
}

void Allocator::Impl::write_oom_dump(OomReport& report) noexcept {
  std::string path;
  std::string trace_path;
  std::string trace_tmp;  // the trace, written, not yet renamed to trace_path
  std::string message_before;
  bool saved = false;
  try {
    message_before = report.message;
    saved = true;
    path = expand_oom_dump_path(config.oom_dump, static_cast<long>(::getpid()), driver->device(),
                                oom_count);
    require_regular_or_absent(path);
    // The report's own snapshot (oom_snapshot:true) when it has one: no second walk, no copy.
    std::optional<Snapshot> taken;
    if (!report.snapshot) taken = snapshot_locked();
    const Snapshot& snap = report.snapshot ? *report.snapshot : *taken;

    std::size_t trace_events = 0;
    std::string trace_error;
    if (recorder.enabled()) {
      const std::vector<TraceEvent> events = recorder.events();
      trace_events = events.size();
      trace_path = oom_dump_trace_path(path);
      trace_tmp = temporary_name(trace_path);
      try {
        require_regular_or_absent(trace_path);
        write_trace_file(trace_tmp, events);
      } catch (const std::exception& e) {
        trace_error = e.what();
        std::remove(trace_tmp.c_str());
        trace_tmp.clear();
        trace_path.clear();
      }
    }

    // The message says where the dump is before the dump is written, so that the copy inside it
    // reads like the one the caller gets; on failure both are replaced below.
    std::string sentence = "\nexpseg: this OOM's report, a snapshot of every segment and block, and the config were written to " + path;
    if (!trace_path.empty()) {
      sentence += "; the " + std::to_string(trace_events) + " recorded events to " + trace_path + " ('expseg explain " + path +
                  "' prints the dump and replays them on both backends";
      if (recorder.partial())
        sentence += "; the recording began while memory was allocated or cached, or its ring dropped the oldest events, so a"
                    " replay starts with less memory than this run held: explain first allocates the blocks live before them";
      sentence += ")";
    } else if (!trace_error.empty()) {
      sentence += "; the recorded events could not be written: " + trace_error;
    } else {
      sentence += " (with record:true the events that led here are written beside it, and 'expseg explain' replays them)";
    }
    sentence += ".";
    report.message += sentence;
    report.dump_path = path;

    core::JsonWriter w;
    w.begin_object();
    w.field("format", "expseg-oom-dump/1");
    w.field("version", EXPSEG_VERSION_STRING);
    w.field("pid", static_cast<std::int64_t>(::getpid()));
    w.field("device", driver->device());
    w.field("oom_number", oom_count);
    w.field("config", config.to_string());
    w.key("report").raw(report.to_json(false));
    w.key("snapshot").raw(snap.to_json());
    w.key("trace");
    if (trace_path.empty()) w.null();
    else w.value(trace_path);
    w.field("trace_events", static_cast<std::uint64_t>(trace_path.empty() ? 0 : trace_events));
    w.field("trace_complete", !trace_path.empty() && !recorder.partial());  // false: replay with --lenient
    w.field("limit_changed", !trace_path.empty() && limit_changed_while_recording);  // the replay's one limit is not the run's
    w.end_object();
    std::string text = w.take();
    text += '\n';

    // Both files are complete under temporary names before either is renamed, so a failed write
    // leaves an earlier dump at the same path (a path without %n) whole, with its own trace.
    const std::string json_tmp = temporary_name(path);
    std::string failure = write_temporary(json_tmp, text);
    if (!failure.empty()) throw std::runtime_error(failure);
    const std::lock_guard<std::mutex> renaming(rename_mutex());
    // A trace renamed into place whose JSON then fails (rare) is removed, still under the lock, so
    // that no other dump's trace at that path can be the one removed.
    struct RenamedTrace {
      const std::string& path;
      bool kept = false;
      bool renamed = false;
      ~RenamedTrace() {
        if (renamed && !kept) std::remove(path.c_str());
      }
    } renamed_trace{trace_path};
    if (!trace_tmp.empty()) {
      failure = rename_into_place(trace_tmp, trace_path);
      trace_tmp.clear();
      if (!failure.empty()) {
        std::remove(json_tmp.c_str());
        throw std::runtime_error(failure);
      }
      renamed_trace.renamed = true;
    }
    failure = rename_into_place(json_tmp, path);
    if (!failure.empty()) throw std::runtime_error(failure);
    renamed_trace.kept = true;
  } catch (...) {
    // Half a dump is no dump: no trace without its JSON, and a message that says so.
    if (!trace_tmp.empty()) std::remove(trace_tmp.c_str());
    report.dump_path.clear();
    try {
      std::string why = "unknown error";
      try {
        throw;
      } catch (const std::exception& e) {
        why = e.what();
      } catch (...) {
      }
      if (saved)
        report.message = message_before + "\nexpseg: oom_dump: the dump of this OOM could not be written" +
                       (path.empty() ? std::string() : " to " + path) + ": " + why + ".";
    } catch (...) {
      // No memory even for the message: the report stays as it was built.
    }
  }
}

}  // namespace expseg

// ---- reading a dump back -------------------------------------------------------------------------

namespace expseg {
namespace {

using core::JsonValue;
using core::hex;

// Member access that says which member of which object was missing or of the wrong type.
struct Reader {
  std::string where;  // "report", "snapshot.segments[3]", ...

  const JsonValue& at(const JsonValue& obj, const char* key) const {
    if (!obj.is_object()) throw std::runtime_error((where.empty() ? "the document" : where) + " is not an object");
    if (!obj.has(key)) throw std::runtime_error("member '" + name(key) + "' is missing");
    return obj[key];
  }
  std::string name(const char* key) const { return where.empty() ? key : where + "." + key; }

  template <class F>
  auto typed(const JsonValue& obj, const char* key, F get) const {
    const JsonValue& v = at(obj, key);
    try {
      return get(v);
    } catch (const std::exception& e) {
      throw std::runtime_error("member '" + name(key) + "': " + e.what());
    }
  }
  std::string str(const JsonValue& o, const char* k) const { return typed(o, k, [](const JsonValue& v) { return v.as_string(); }); }
  bool boolean(const JsonValue& o, const char* k) const { return typed(o, k, [](const JsonValue& v) { return v.as_bool(); }); }
  std::int64_t i64(const JsonValue& o, const char* k) const { return typed(o, k, [](const JsonValue& v) { return v.as_int(); }); }
  std::uint64_t u64(const JsonValue& o, const char* k) const { return typed(o, k, [](const JsonValue& v) { return v.as_uint(); }); }
  // "0x1f" (addresses and streams are written as hex strings).
  std::uint64_t hex(const JsonValue& o, const char* k) const {
    const std::string s = str(o, k);
    std::uint64_t v = 0;
    const auto r = s.size() > 2 && s[0] == '0' && s[1] == 'x' ? std::from_chars(s.data() + 2, s.data() + s.size(), v, 16)
                                                              : std::from_chars_result{s.data(), std::errc::invalid_argument};
    if (r.ec != std::errc() || r.ptr != s.data() + s.size()) throw std::runtime_error("member '" + name(k) + "' is not a hex number");
    return v;
  }
  Reader in(const std::string& sub) const { return Reader{where.empty() ? sub : where + "." + sub}; }
};

template <class E, std::size_t N>
E enum_value(const Reader& r, const JsonValue& o, const char* key, const std::array<E, N>& values, const char* (*name)(E) noexcept) {
  const std::string s = r.str(o, key);
  for (E e : values)
    if (s == name(e)) return e;
  throw std::runtime_error("member '" + r.name(key) + "' has an unknown value '" + core::clip(s) + "'");
}

Stat read_stat(const Reader& r, const JsonValue& o, const std::string& prefix) {
  Stat s;
  s.current = r.i64(o, (prefix + ".current").c_str());
  s.peak = r.i64(o, (prefix + ".peak").c_str());
  s.allocated = r.i64(o, (prefix + ".allocated").c_str());
  s.freed = r.i64(o, (prefix + ".freed").c_str());
  return s;
}

Stats read_stats(const Reader& r, const JsonValue& o) {
  Stats s;
#define EXPSEG_READ_POOL_STAT(name, help) \
  for (int p = 0; p < kStatPools; ++p) s.name[p] = read_stat(r, o, std::string(#name ".") + stat_pool_name(p));
  EXPSEG_POOL_STATS(EXPSEG_READ_POOL_STAT)
#undef EXPSEG_READ_POOL_STAT
  s.oversize_allocations = read_stat(r, o, "oversize_allocations");
  s.oversize_segments = read_stat(r, o, "oversize_segments");
#define EXPSEG_READ_COUNTER(name, help) s.name = r.i64(o, #name);
  EXPSEG_COUNTERS(EXPSEG_READ_COUNTER)
#undef EXPSEG_READ_COUNTER
  s.max_split_size = r.i64(o, "max_split_size");
  s.physical_handles = read_stat(r, o, "physical_handles");
  s.num_free_blocks = r.i64(o, "num_free_blocks");
  return s;
}

Snapshot read_snapshot(const Reader& r, const JsonValue& o) {
  static constexpr std::array kStates = {BlockState::allocated, BlockState::pending_free, BlockState::free_mapped, BlockState::free_unmapped};
  Snapshot s;
  s.backend = r.str(o, "backend");
  s.device = static_cast<int>(r.i64(o, "device"));
  s.limit_bytes = r.u64(o, "limit_bytes");
  s.device_total_bytes = r.u64(o, "device_total_bytes");
  s.stats = read_stats(r.in("stats"), r.at(o, "stats"));
  const JsonValue& segs = r.at(o, "segments");
  if (!segs.is_array()) throw std::runtime_error("member '" + r.name("segments") + "' is not an array");
  for (std::size_t i = 0; i < segs.as_array().size(); ++i) {
    const Reader rs = r.in("segments[" + std::to_string(i) + "]");
    const JsonValue& so = segs[i];
    SegmentInfo seg;
    seg.address = rs.hex(so, "address");
    seg.size = rs.u64(so, "size");
    seg.mapped_bytes = rs.u64(so, "mapped_bytes");
    seg.stream = rs.hex(so, "stream");
    const std::string pool = rs.str(so, "pool");
    if (pool != "small" && pool != "large") throw std::runtime_error("member '" + rs.name("pool") + "' is neither small nor large");
    seg.small_pool = pool == "small";
    seg.physical_handles = rs.u64(so, "physical_handles");
    if (so.has("graph_pool")) seg.graph_pool = rs.u64(so, "graph_pool");  // written for graph pools' segments only
    const JsonValue& blocks = rs.at(so, "blocks");
    if (!blocks.is_array()) throw std::runtime_error("member '" + rs.name("blocks") + "' is not an array");
    // What a snapshot holds by construction (snapshot.hpp), checked so that an edited or damaged dump
    // is refused by name rather than summed with wraparound or replayed as a 16 EiB allocation: the
    // segments in address order, apart; each one's blocks tiling it in order; a block's requested
    // size within its size; the mapped ranges and bytes inside the segment.
    auto bad = [](const Reader& at, const std::string& what) { throw std::runtime_error(at.where + ": " + what); };
    // (Size 0: an expandable segment whose growth failed and whose range could not be given back.)
    if (seg.address > std::numeric_limits<std::uint64_t>::max() - seg.size)
      bad(rs, "size " + std::to_string(seg.size) + " at " + hex(seg.address) + " is no range of addresses");
    if (!s.segments.empty() && seg.address < s.segments.back().address + s.segments.back().size)
      bad(rs, "begins at " + hex(seg.address) + ", inside or before the segment listed before it");
    if (seg.mapped_bytes > seg.size) bad(rs, "mapped_bytes " + std::to_string(seg.mapped_bytes) + " exceed its size " + std::to_string(seg.size));
    std::uint64_t next = seg.address;  // where the next block must begin
    for (std::size_t j = 0; j < blocks.as_array().size(); ++j) {
      const Reader rb = rs.in("blocks[" + std::to_string(j) + "]");
      BlockInfo b;
      b.address = rb.hex(blocks[j], "address");
      b.size = rb.u64(blocks[j], "size");
      b.requested = rb.u64(blocks[j], "requested");
      b.state = enum_value(rb, blocks[j], "state", kStates, &to_string);
      b.stream = rb.hex(blocks[j], "stream");
      if (b.address != next) bad(rb, "begins at " + hex(b.address) + " where the segment's blocks continue at " + hex(next));
      if (b.size == 0 || b.size > seg.address + seg.size - b.address) bad(rb, "size " + std::to_string(b.size) + " does not fit in its segment");
      if (b.requested > b.size) bad(rb, "requested " + std::to_string(b.requested) + " exceeds its size " + std::to_string(b.size));
      next = b.address + b.size;
      seg.blocks.push_back(b);
    }
    if (next != seg.address + seg.size) bad(rs, "its blocks end at " + hex(next) + ", not at its end " + hex(seg.address + seg.size));
    const JsonValue& ranges = rs.at(so, "mapped_ranges");
    if (!ranges.is_array()) throw std::runtime_error("member '" + rs.name("mapped_ranges") + "' is not an array");
    for (std::size_t j = 0; j < ranges.as_array().size(); ++j) {
      const Reader rm = rs.in("mapped_ranges[" + std::to_string(j) + "]");
      const AddressRange m{rm.hex(ranges[j], "address"), rm.u64(ranges[j], "size")};
      if (m.address < seg.address || m.size > seg.address + seg.size - std::min(m.address, seg.address + seg.size))
        bad(rm, "[" + hex(m.address) + ", +" + std::to_string(m.size) + ") lies outside its segment");
      seg.mapped_ranges.push_back(m);
    }
    s.segments.push_back(std::move(seg));
  }
  return s;
}

OomReport read_report(const Reader& r, const JsonValue& o) {
  static constexpr std::array kVerdicts = {OomVerdict::capacity, OomVerdict::limit, OomVerdict::fragmentation, OomVerdict::unknown};
  static constexpr std::array kCounterfactuals = {Counterfactual::not_evaluated, Counterfactual::would_succeed, Counterfactual::would_fail};
  OomReport p;
  p.backend = r.str(o, "backend");
  p.device = static_cast<int>(r.i64(o, "device"));
  p.stream = r.hex(o, "stream");
  p.requested_bytes = r.u64(o, "requested_bytes");
  p.rounded_bytes = r.u64(o, "rounded_bytes");
  p.device_total_bytes = r.u64(o, "device_total_bytes");
  // null: the free memory could not be read when the report was built.
  p.device_free_known = !r.at(o, "device_free_bytes").is_null();
  p.device_free_bytes = p.device_free_known ? r.u64(o, "device_free_bytes") : 0;
  p.limit_bytes = r.u64(o, "limit_bytes");
  p.allocated_bytes = r.u64(o, "allocated_bytes");
  p.reserved_bytes = r.u64(o, "reserved_bytes");
  p.live_requested_bytes = r.u64(o, "live_requested_bytes");
  p.live_footprint_bytes = r.u64(o, "live_footprint_bytes");
  p.page_slack_bytes = r.u64(o, "page_slack_bytes");
  p.partial_pages = r.u64(o, "partial_pages");
  p.largest_free_block_bytes = r.u64(o, "largest_free_block_bytes");
  p.free_blocks = r.u64(o, "free_blocks");
  p.verdict = enum_value(r, o, "verdict", kVerdicts, &to_string);
  p.other_backend = r.str(o, "other_backend");
  p.counterfactual = enum_value(r, o, "counterfactual", kCounterfactuals, &to_string);
  p.message = r.str(o, "message");
  p.dump_path = r.str(o, "dump_path");
  return p;
}

}  // namespace

OomDump read_oom_dump(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw error(path + ": cannot open the OOM dump: " + std::strerror(errno));
  // Read in chunks, up to a bound: a dump of 100,000 blocks is ~9.4 MB, and a device or a large
  // file named by mistake (/dev/zero, a core file) must end in an error, not in all host memory.
  // The parsed tree takes up to ~60 bytes per byte of text ("0,0,0,..."): the values are bounded
  // too (a dump of 100,000 blocks holds ~1.5 million), so that a damaged file costs ~2 GB at most.
  constexpr std::size_t kMaxDumpBytes = std::size_t{256} << 20;
  constexpr std::size_t kMaxDumpValues = std::size_t{16} << 20;
  std::string text;
  errno = 0;
  try {
    std::array<char, 1 << 16> chunk{};
    while (in.read(chunk.data(), chunk.size()) || in.gcount() > 0) {
      const auto n = static_cast<std::size_t>(in.gcount());
      if (text.empty()) {
        // JSON begins with '{' after white space: anything else is no dump, said at once.
        const std::string_view head(chunk.data(), n);
        const std::size_t first = head.find_first_not_of(" \t\r\n");
        if (first != std::string_view::npos && head[first] != '{')
          throw error(path + ": not an expseg OOM dump: it does not begin with a JSON object ('{')" +
                      (head.find('\0') != std::string_view::npos ? " (binary data: a NUL byte)" : ""));
      }
      if (text.size() + n > kMaxDumpBytes)
        throw error(path + ": not an expseg OOM dump: larger than " + std::to_string(kMaxDumpBytes >> 20) + " MiB");
      text.append(chunk.data(), n);
      if (in.eof()) break;
    }
  } catch (const std::ios_base::failure&) {
    in.setstate(std::ios::badbit);  // a read error (a directory opens, then reads fail): say so with the file's name
  }
  if (in.bad()) throw error(path + ": cannot read the OOM dump: " + std::strerror(errno ? errno : EIO));
  try {
    const JsonValue doc = core::parse_json(text, kMaxDumpValues);
    const Reader r;
    OomDump d;
    d.format = r.str(doc, "format");
    if (d.format != "expseg-oom-dump/1")
      throw std::runtime_error("format '" + core::clip(d.format) + "' is not one this version reads (expseg-oom-dump/1)");
    d.version = r.str(doc, "version");
    d.pid = r.i64(doc, "pid");
    const std::int64_t device = r.i64(doc, "device");
    if (device < 0 || device > std::numeric_limits<int>::max()) throw std::runtime_error("member 'device' is out of range: " + std::to_string(device));
    d.device = static_cast<int>(device);
    d.oom_number = r.u64(doc, "oom_number");
    d.config = r.str(doc, "config");
    d.report = read_report(r.in("report"), r.at(doc, "report"));
    d.snapshot = read_snapshot(r.in("snapshot"), r.at(doc, "snapshot"));
    const JsonValue& trace = r.at(doc, "trace");
    if (!trace.is_null()) d.trace = r.str(doc, "trace");
    d.trace_events = r.u64(doc, "trace_events");
    d.trace_complete = r.boolean(doc, "trace_complete");
    d.limit_changed = doc.has("limit_changed") && r.boolean(doc, "limit_changed");  // absent in older dumps
    // The device's size sizes explain's simulated device: one that cannot hold what the run held
    // replays to OOMs that say nothing about it (an edited or damaged dump).
    const std::size_t total = d.report.device_total_bytes;
    if (total == 0) throw std::runtime_error("member 'report.device_total_bytes' is 0: no device size to replay on");
    // No device is larger than the simulated one explain replays on can be (64 PiB of address span).
    if (total > (std::size_t{1} << 56))
      throw std::runtime_error("member 'report.device_total_bytes' (" + std::to_string(total) +
                               ") is more than any device's memory (64 PiB at most): an edited or damaged dump");
    if (d.report.reserved_bytes > total)
      throw std::runtime_error("member 'report.reserved_bytes' (" + std::to_string(d.report.reserved_bytes) +
                               ") is more than the device's memory, 'report.device_total_bytes' (" + std::to_string(total) + ")");
    std::uint64_t mapped = 0;
    for (const SegmentInfo& seg : d.snapshot.segments) mapped += std::min<std::uint64_t>(seg.mapped_bytes, total);
    if (mapped > total)
      throw std::runtime_error("the snapshot's segments hold " + std::to_string(mapped) + " bytes of memory, more than the device's " +
                               std::to_string(total) + " ('report.device_total_bytes')");
    return d;
  } catch (const std::exception& e) {
    throw error(path + ": not an expseg OOM dump: " + e.what());
  }
}

SeededBlocks seed_live_before_trace(Trace& trace, const Snapshot& at_oom) {
  struct Seed {
    std::uint64_t address, size, stream;
  };
  std::vector<Seed> seeds;
  std::unordered_set<std::uint64_t> seen;  // pointers the trace mentions
  for (const TraceEvent& e : trace.events) {
    if (e.pointer == 0 || (e.action != TraceAction::allocate && e.action != TraceAction::free)) continue;
    if (e.action == TraceAction::free && !seen.count(e.pointer))
      seeds.push_back(Seed{e.pointer, e.size, e.stream});  // its first appearance is its free
    seen.insert(e.pointer);
  }
  for (const SegmentInfo& seg : at_oom.segments)
    for (const BlockInfo& b : seg.blocks)
      if ((b.state == BlockState::allocated || b.state == BlockState::pending_free) && b.address != 0 && !seen.count(b.address))
        seeds.push_back(Seed{b.address, b.requested ? b.requested : b.size, b.stream});
  SeededBlocks out;
  if (seeds.empty()) return out;
  // In address order: a caching allocator hands out a segment's blocks from its start, so this is
  // the likeliest order they were allocated in. Stamped with the first event's thread and time.
  std::sort(seeds.begin(), seeds.end(), [](const Seed& a, const Seed& b) { return a.address < b.address; });
  const TraceEvent first = trace.events.empty() ? TraceEvent{} : trace.events.front();
  std::vector<TraceEvent> events;
  events.reserve(seeds.size() + trace.events.size());
  for (const Seed& s : seeds) {
    TraceEvent e;
    e.thread = first.thread;
    e.time = first.time;
    e.action = TraceAction::allocate;
    e.pointer = s.address;
    e.size = s.size;
    e.stream = s.stream;
    events.push_back(e);  // line 0: not a line of the file
    out.bytes += s.size;
  }
  out.blocks = seeds.size();
  events.insert(events.end(), trace.events.begin(), trace.events.end());
  trace.events = std::move(events);
  return out;
}

}  // namespace expseg
