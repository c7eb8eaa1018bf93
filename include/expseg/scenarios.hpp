// expseg scenarios: named, deterministic allocation stories that reproduce the OOMs users hit,
// run on either backend (A/B) on the simulated device or the GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "expseg/config.hpp"
#include "expseg/errors.hpp"
#include "expseg/snapshot.hpp"
#include "expseg/trace.hpp"

// The public API keeps default visibility; the rest of libexpseg.so is built hidden.
#pragma GCC visibility push(default)

namespace expseg {

struct ScenarioInfo {
  std::string_view name;
  std::string_view title;
  std::string_view description;  // one paragraph: the OOM it demonstrates
  std::size_t limit_bytes;       // the limit the story runs under (0: none)
  bool random = false;           // drawn from a seed (ScenarioOptions::seed); the others are fixed
  // The size range the story draws from when ScenarioOptions gives none (random-churn; 0: fixed sizes).
  std::size_t min_size = 0;
  std::size_t max_size = 0;
  std::uint64_t seed = 0;         // the seed the story runs with when ScenarioOptions gives none
  // The end of the description that tells how the runs end with that seed (random stories; empty
  // for the others): another seed may end otherwise.
  std::string_view outcome;
};

// Every scenario, in the order `expseg scenario --list` prints them.
std::span<const ScenarioInfo> list_scenarios();
const ScenarioInfo* find_scenario(std::string_view name);

struct ScenarioOptions {
  std::size_t series_points = 0;  // >0: allocated/reserved over time at about this many points
  bool snapshot_at_peak = false;  // snapshot at the moment of peak reserved (runs the story twice)
  std::uint64_t seed = 0;         // 0: the scenario's own seed
  bool validate_each_step = false;  // tests: Allocator::validate() after every operation
  // random-churn only: draw sizes log-uniform in [min_size, max_size] instead of 4 KiB-512 MiB,
  // to see whether a result holds for other size mixes (both 0: the scenario's own range).
  std::size_t min_size = 0;
  std::size_t max_size = 0;
};

struct ScenarioResult {
  std::string scenario;
  std::string backend;
  std::string device;
  bool ok = true;                   // no allocation failed
  std::size_t steps = 0;            // allocations + frees performed
  std::size_t allocations = 0;
  std::size_t ooms = 0;
  std::size_t fragmentation_ooms = 0;  // OOMs with verdict fragmentation
  std::size_t ooms_below_98 = 0;       // OOMs while live requested bytes + request <= 98% of the limit
  std::optional<OomVerdict> verdict;   // of the first OOM
  double first_oom_fill = 0.0;         // (live requested + request) / limit at the first OOM
  double lowest_oom_fill = 0.0;        // the same, lowest over all OOMs (0 when none)
  // The page_slack_bytes of that lowest-fill OOM's report: expandable's free bytes inside pages that
  // live blocks use partly, most of what keeps its fill below 100% (0 for split_merge).
  std::size_t lowest_oom_page_slack = 0;
  std::uint64_t seed = 0;              // the seed the story ran with (ScenarioOptions::seed or its own)
  std::size_t min_size = 0;            // random-churn: the size range drawn from (ScenarioOptions)
  std::size_t max_size = 0;
  std::optional<OomReport> first_oom;
  std::int64_t peak_allocated_bytes = 0;
  std::int64_t peak_reserved_bytes = 0;
  std::int64_t peak_requested_bytes = 0;
  std::size_t limit_bytes = 0;
  std::int64_t device_allocs = 0;      // num_device_alloc at the end
  std::int64_t alloc_retries = 0;      // num_alloc_retries at the end
  double seconds = 0.0;                // wall time of the story (a run of its own when series or snapshot are asked for)
  double driver_seconds = 0.0;  // in driver calls during the run: measured on a GPU, modelled on the
                                // simulated device with sim_latency:true (0 without)
  std::vector<DriverCallTime> driver_calls;  // the same, per kind of call
  std::vector<SeriesPoint> series;     // event = step index
  std::vector<std::uint64_t> oom_steps;
  std::optional<Snapshot> peak_snapshot;
  std::string to_json() const;  // one line with at least scenario, backend, ok, verdict, ooms, peaks
};

// Runs scenario `name` with `config` (its backend and device). The scenario's limit applies unless
// the config sets one. Throws expseg::error for an unknown name (listing the valid ones).
ScenarioResult run_scenario(std::string_view name, const Config& config, const ScenarioOptions& options = {}, int device = 0);

// The deterministic generator the scenarios use (splitmix64), exposed so tests can drive the same
// random streams.
class ScenarioRng {
 public:
  explicit ScenarioRng(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() noexcept {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  double uniform() noexcept { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  std::uint64_t below(std::uint64_t n) noexcept { return n ? next() % n : 0; }
  // 2^uniform(lo_exp, hi_exp), as the anchors' log-uniform sizes.
  std::size_t log_uniform(double lo_exp, double hi_exp) noexcept;

 private:
  std::uint64_t state_;
};

}  // namespace expseg

#pragma GCC visibility pop
