// oom_dump: the allocator at an OOM, written to a file so that a job that dies of it leaves the
// evidence behind (a cluster job's stderr is often lost or cut; a PyTorch RuntimeError carries only
// the message). One JSON document per OOM:
//   {"format": "expseg-oom-dump/1", "version", "pid", "device", "oom_number", "config",
//    "report": the OOM report (OomReport::to_json, its own snapshot left out),
//    "snapshot": every segment and block at the OOM, with the stats,
//    "trace": the recorded events' file or null, "trace_events": how many,
//    "trace_complete": whether the trace starts from an empty allocator (else replay it --lenient)}
// When the event recorder is on (record:true, or start_recording()), its events, the failed
// allocation last, go to a second file beside it (PATH without ".json", plus ".trace.csv"), which
// `expseg replay` reads: the OOM can then be replayed on both backends, on the simulated device.
// Both files are written to a temporary name and renamed, so a reader never sees half a dump.
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>

#include "allocator_impl.hpp"
#include "core/json.hpp"
#include "expseg/expseg.h"
#include "expseg/trace.hpp"

namespace expseg {
namespace {

// Writes `text` to `path` through a temporary file and a rename. Returns "" or why it failed.
std::string write_file_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp" + std::to_string(::getpid());
  errno = 0;
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return std::string("cannot create ") + tmp + ": " + (errno ? std::strerror(errno) : "unknown error");
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    out.flush();
    if (!out) {
      const int err = errno;
      std::remove(tmp.c_str());
      return std::string("cannot write ") + tmp + ": " + (err ? std::strerror(err) : "unknown error");
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    return std::string("cannot rename ") + tmp + " to " + path + ": " + std::strerror(err);
  }
  return "";
}

// "oom-7.json" -> "oom-7.trace.csv"; "oom-7" -> "oom-7.trace.csv".
std::string trace_path_for(const std::string& dump_path) {
  constexpr std::string_view kJson = ".json";
  std::string base = dump_path;
  if (base.size() > kJson.size() && base.compare(base.size() - kJson.size(), kJson.size(), kJson) == 0)
    base.resize(base.size() - kJson.size());
  return base + ".trace.csv";
}

}  // namespace

void Allocator::Impl::write_oom_dump(OomReport& report) noexcept {
  std::string path;
  std::string trace_path;
  std::string message_before;
  bool saved = false;
  try {
    message_before = report.message;
    saved = true;
    path = expand_oom_dump_path(config.oom_dump, static_cast<long>(::getpid()), driver->device(),
                                static_cast<std::uint64_t>(stats.num_ooms));
    const Snapshot snap = report.snapshot ? *report.snapshot : snapshot_locked();

    std::size_t trace_events = 0;
    std::string trace_error;
    if (recorder.enabled()) {
      const std::vector<TraceEvent> events = recorder.events();
      trace_events = events.size();
      trace_path = trace_path_for(path);
      const std::string tmp = trace_path + ".tmp" + std::to_string(::getpid());
      try {
        write_trace_file(tmp, events);
        if (std::rename(tmp.c_str(), trace_path.c_str()) != 0) {
          trace_error = std::string("cannot rename ") + tmp + " to " + trace_path + ": " + std::strerror(errno);
          std::remove(tmp.c_str());
        }
      } catch (const std::exception& e) {
        trace_error = e.what();
        std::remove(tmp.c_str());
      }
      if (!trace_error.empty()) trace_path.clear();
    }

    // The message says where the dump is before the dump is written, so that the copy inside it
    // reads like the one the caller gets; on failure both are replaced below.
    std::string sentence = "\nexpseg: this OOM's report, a snapshot of every segment and block, and the config were written to " + path;
    if (!trace_path.empty()) {
      sentence += "; the " + std::to_string(trace_events) + " recorded events to " + trace_path + " (expseg replay " + trace_path;
      if (ctx.limit != 0) sentence += " --conf limit:" + std::to_string(ctx.limit);
      if (recorder.partial())
        sentence += " --lenient replays them on both backends; the recording began while allocations were live, or its"
                    " ring dropped the oldest events, so the replay holds less memory than this run did)";
      else
        sentence += " replays them on both backends)";
    } else if (!trace_error.empty()) {
      sentence += "; the recorded events could not be written: " + trace_error;
    } else {
      sentence += " (with record:true the events that led here are written beside it, for expseg replay)";
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
    w.field("oom_number", static_cast<std::uint64_t>(stats.num_ooms));
    w.field("config", config.to_string());
    w.key("report").raw(report.to_json(false));
    w.key("snapshot").raw(snap.to_json());
    w.key("trace");
    if (trace_path.empty()) w.null();
    else w.value(trace_path);
    w.field("trace_events", static_cast<std::uint64_t>(trace_path.empty() ? 0 : trace_events));
    w.field("trace_complete", !trace_path.empty() && !recorder.partial());  // false: replay with --lenient
    w.end_object();
    std::string text = w.take();
    text += '\n';

    const std::string failure = write_file_atomically(path, text);
    if (!failure.empty()) throw std::runtime_error(failure);
  } catch (...) {
    // Half a dump is no dump: no trace without its JSON, and a message that says so.
    if (!trace_path.empty()) std::remove(trace_path.c_str());
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
