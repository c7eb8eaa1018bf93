// expseg reports: one self-contained HTML page (inline CSS, inline SVG, a few lines of optional
// inline JavaScript for hover values; nothing is fetched from the network) that shows A/B results.
//
// The page has one section per run group (a scenario, or a replayed trace):
//   - the title and one-paragraph description;
//   - one chart of allocated and reserved bytes over time, every backend on the same axes (one
//     colour per backend, reserved solid, allocated dashed), the limit as a horizontal line, and a
//     red marker on the backend's series wherever an allocation failed (its <title> says the verdict;
//     a run of many OOMs gets one marker per pixel column, whose <title> says how many);
//   - a segment map per backend at the moment of peak reserved (and at the first OOM when the run
//     kept that snapshot): every segment a bar scaled to its size, its blocks coloured by state;
//   - a summary table: outcome, verdict, peak allocated, peak reserved, reserved/allocated, OOMs, time
//     (and the time in driver calls, when a run knows it); under it, a replay's requests refused up
//     front and frees skipped or supplied, as the command line notes them.
//
// The markup is XHTML-compatible (every element closed, attributes quoted, text escaped), so it can
// be checked with an XML parser. Stable hooks for tests and scripts:
//   <section class="card group" data-name=...>   one per group (the class list holds "group")
//   <svg class="chart">                     one per group
//   <polyline class="series" data-backend=B data-kind="reserved|allocated">
//   <g class="oom" data-backend=B>          one per failed allocation, up to 200 per run; past that one
//                                           per pixel column with OOMs, data-ooms=K when it stands for K
//   <svg class="segmap" data-backend=B data-moment="peak|first-oom">
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "expseg/errors.hpp"
#include "expseg/scenarios.hpp"
#include "expseg/snapshot.hpp"
#include "expseg/trace.hpp"

// The public API keeps default visibility; the rest of libexpseg.so is built hidden.
#pragma GCC visibility push(default)

namespace expseg {

// One backend's run, in the form the report draws. x is a step (scenarios) or an event index
// (replays): SeriesPoint::event and oom_at use the same axis.
struct ReportRun {
  std::string backend;                 // "split_merge", "expandable"
  std::string device;                  // "sim:80GiB", "cuda:0"
  std::size_t ooms = 0;
  // Replays: requests of 1 EiB or more refused up front (no OOM of the allocator), and frees skipped
  // or supplied (ReplayResult's fields of the same names).
  std::size_t refused_requests = 0;
  std::size_t skipped_frees = 0;
  std::size_t fragmentation_ooms = 0;  // OOMs whose report's verdict was fragmentation, when known
  bool fragmentation_known = false;
  // expseg's test of a fragmentation OOM: live requested bytes + the request <= 98% of the limit
  // (scenarios under a limit; see fill_known). The report's verdict weighs whole pages instead.
  std::size_t ooms_below_98 = 0;
  bool fill_known = false;
  std::optional<OomReport> first_oom;  // its snapshot, if any, is drawn as a second segment map
  std::int64_t peak_allocated_bytes = 0;
  std::int64_t peak_reserved_bytes = 0;
  double seconds = 0.0;
  double driver_seconds = 0.0;         // in driver calls: measured on a GPU, the latency model's on the
                                       // simulated device (sim_latency:true); 0: not known (no column)
  std::uint64_t length = 0;            // steps or events in the run (the x range)
  std::vector<SeriesPoint> series;     // allocated/reserved over time
  std::vector<std::uint64_t> oom_at;   // x of every failed allocation
  std::optional<Snapshot> peak_snapshot;
};

struct ReportGroup {
  std::string name;          // scenario name or trace file name
  std::string title;         // headline; the name when empty
  std::string description;   // one paragraph
  std::string x_label = "step";
  std::size_t limit_bytes = 0;           // drawn as a horizontal line (0: none)
  std::size_t device_total_bytes = 0;    // drawn (or noted) when there is no limit (0: unknown)
  std::vector<ReportRun> runs;           // one per backend, in legend order
};

// Groups from the library's results. A scenario's title and description come from
// list_scenarios(); a trace's description is `description` (or a default sentence).
ReportGroup report_group(std::span<const ScenarioResult> runs);
ReportGroup report_group(std::span<const ReplayResult> runs, std::string description = {});

struct ReportOptions {
  std::string title = "expseg A/B study";
  std::string subtitle;  // one line under the title: device, version, command
  std::string note;      // a paragraph under the subtitle (e.g. what the times mean on the simulated device)
};

// The whole page as one string.
std::string render_html_report(std::span<const ReportGroup> groups, const ReportOptions& options = {});
// Writes the page to `path`; throws expseg::error naming the path when it cannot be written.
void write_html_report(const std::string& path, std::span<const ReportGroup> groups, const ReportOptions& options = {});

}  // namespace expseg

#pragma GCC visibility pop
