// Regressions in scenarios and the event recorder (found by an audit of recording, snapshots,
// scenarios and the HTML report):
//   - a scenario's downsampled series dropped its last sample, so the chart held a bucket's
//     maximum to the end of the run (allocated 835 MB where the story had freed everything);
//   - it kept each bucket's highest reserved sample only, and lost allocated peaks.
#include <doctest/doctest.h>

#include <algorithm>
#include <string>

#include "expseg/config.hpp"
#include "expseg/scenarios.hpp"

namespace {

expseg::Config sim(expseg::BackendKind b) {
  expseg::Config c = expseg::Config::parse("device:sim,sim_capacity:80GiB");
  c.backend = b;
  return c;
}

}  // namespace

TEST_CASE("scenario regression: the downsampled series ends with the run's last step") {
  for (const char* name : {"growing-buffer", "kv-cache-decode", "mixed-lifetimes"}) {
    for (auto b : {expseg::BackendKind::split_merge, expseg::BackendKind::expandable}) {
      CAPTURE(name);
      CAPTURE(std::string(expseg::to_string(b)));
      expseg::ScenarioOptions o;
      o.series_points = 600;
      const expseg::ScenarioResult r = expseg::run_scenario(name, sim(b), o);
      REQUIRE(r.series.size() > 1);
      CHECK(r.series.size() <= o.series_points + 1);
      // Every story frees what it holds at the end.
      CHECK(r.series.back().event == r.steps);
      CHECK(r.series.back().allocated == 0);
      // The peak still survives the downsampling.
      std::int64_t top = 0;
      for (const expseg::SeriesPoint& p : r.series) top = std::max(top, p.reserved);
      CHECK(top == r.peak_reserved_bytes);
    }
  }
}

TEST_CASE("scenario regression: the downsampled series reaches the run's peak allocated as well as its peak reserved") {
  // Each bucket kept only its sample with the most reserved: an allocated peak where reserved was
  // lower (memory cached before) fell out, and the chart shaded live memory as reserved but
  // unallocated.
  for (const expseg::ScenarioInfo& info : expseg::list_scenarios()) {
    for (auto b : {expseg::BackendKind::split_merge, expseg::BackendKind::expandable}) {
      CAPTURE(info.name);
      CAPTURE(std::string(expseg::to_string(b)));
      expseg::ScenarioOptions o;
      o.series_points = 600;  // as expseg's pictures
      o.snapshot_at_peak = true;
      const expseg::ScenarioResult r = expseg::run_scenario(info.name, sim(b), o);
      REQUIRE(r.series.size() > 1);
      CHECK(r.series.size() <= o.series_points + 1);
      std::int64_t allocated = 0, reserved = 0;
      for (const expseg::SeriesPoint& p : r.series) {
        allocated = std::max(allocated, p.allocated);
        reserved = std::max(reserved, p.reserved);
      }
      CHECK(allocated == r.peak_allocated_bytes);
      CHECK(reserved == r.peak_reserved_bytes);
      CHECK(std::is_sorted(r.series.begin(), r.series.end(), [](const auto& x, const auto& y) { return x.event < y.event; }));
      // The snapshot is of the state after the step of peak reserved.
      REQUIRE(r.peak_snapshot);
      std::size_t held = 0;
      for (const auto& seg : r.peak_snapshot->segments) held += b == expseg::BackendKind::expandable ? seg.mapped_bytes : seg.size;
      CHECK(static_cast<std::int64_t>(held) == r.peak_reserved_bytes);
    }
  }
}
