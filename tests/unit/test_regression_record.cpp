// Regressions in scenarios and the event recorder (found by an audit of recording, snapshots,
// scenarios and the HTML report):
//   - a scenario's downsampled series dropped its last sample, so the chart held a bucket's
//     maximum to the end of the run (allocated 835 MB where the story had freed everything).
#include <doctest/doctest.h>

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
      CAPTURE(expseg::to_string(b));
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
