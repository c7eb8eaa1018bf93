// The scenario library: each story is a deterministic sequence of allocations and frees driven
// through the public Allocator API, so the same story runs A/B on both backends and on either
// device. Numbers are scaled so that every story runs in well under a second on the simulator.
#include "expseg/scenarios.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <optional>

#include "allocator_impl.hpp"
#include "core/json.hpp"
#include "driver/sim_driver.hpp"
#include "expseg/allocator.hpp"
#include "series_sampler.hpp"

namespace expseg {

namespace {

constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;
constexpr std::size_t kMaxChurnSize = std::size_t{1} << 40;  // 1 TiB: a range past any device is a typo
constexpr int kChurnMinLog2 = 12, kChurnMaxLog2 = 29;  // random-churn's own sizes: 4 KiB-512 MiB

struct StopRun {};  // unwinds a story once the snapshot step is reached

// Drives one story: slots of live allocations, OOM accounting, series, snapshot at a given step.
class Runner {
 public:
  Runner(Allocator& a, ScenarioResult& r, const ScenarioOptions& o, std::uint64_t seed, std::int64_t stop_at)
      : rng(seed), a_(a), r_(r), o_(o), stop_at_(stop_at) {}

  // Returns a slot, or -1 when the allocation failed (an OOM, recorded in the result).
  int alloc(std::size_t bytes, stream_t stream = nullptr) {
    ++r_.allocations;
    void* p = nullptr;
    try {
      p = a_.allocate(bytes, stream);
    } catch (const out_of_memory& e) {
      on_oom(e.report(), bytes);
      step();
      return -1;
    }
    int slot;
    if (!free_slots_.empty()) {
      slot = free_slots_.back();
      free_slots_.pop_back();
      ptrs_[static_cast<std::size_t>(slot)] = p;
      sizes_[static_cast<std::size_t>(slot)] = bytes;
    } else {
      slot = static_cast<int>(ptrs_.size());
      ptrs_.push_back(p);
      sizes_.push_back(bytes);
    }
    live_requested_ += bytes;
    r_.peak_requested_bytes = std::max<std::int64_t>(r_.peak_requested_bytes, static_cast<std::int64_t>(live_requested_));
    step();
    return slot;
  }
  void free(int slot) {
    if (slot < 0) return;
    const auto i = static_cast<std::size_t>(slot);
    a_.deallocate(ptrs_[i]);
    live_requested_ -= sizes_[i];
    ptrs_[i] = nullptr;
    free_slots_.push_back(slot);
    step();
  }
  std::size_t live_requested() const { return live_requested_; }
  const ScenarioOptions& options() const { return o_; }
  ScenarioRng rng;

 private:
  void on_oom(const OomReport& rep, std::size_t bytes) {
    ++r_.ooms;
    r_.ok = false;
    r_.oom_steps.push_back(r_.steps);
    if (rep.verdict == OomVerdict::fragmentation) ++r_.fragmentation_ooms;
    if (r_.limit_bytes != 0 && static_cast<double>(live_requested_ + bytes) <= 0.98 * static_cast<double>(r_.limit_bytes)) ++r_.ooms_below_98;
    const double fill = r_.limit_bytes != 0 ? static_cast<double>(live_requested_ + bytes) / static_cast<double>(r_.limit_bytes) : 0.0;
    if (!r_.verdict) {
      r_.verdict = rep.verdict;
      r_.first_oom = rep;
      // Only the first report is kept: the other-backend check, a replay of the live set, is not
      // repeated at every OOM of a long run.
      detail::AllocatorAccess::set_oom_counterfactual(a_, false);
      r_.first_oom_fill = fill;
      r_.lowest_oom_fill = fill;
      r_.lowest_oom_page_slack = rep.page_slack_bytes;
    }
    if (fill < r_.lowest_oom_fill) {
      r_.lowest_oom_fill = fill;
      r_.lowest_oom_page_slack = rep.page_slack_bytes;
    }
  }
  void step() {
    ++r_.steps;
    if (o_.validate_each_step) a_.validate();
    if (o_.series_points != 0 || o_.snapshot_at_peak) {
      const Stats s = a_.stats();
      if (const auto inside = inside_peaks_.check(r_.steps, s)) samples_.push_back(*inside);
      samples_.push_back({r_.steps, s.allocated_bytes[kAllPools].current, s.reserved_bytes[kAllPools].current});
    }
    if (stop_at_ >= 0 && static_cast<std::int64_t>(r_.steps) == stop_at_) {
      r_.peak_snapshot = a_.snapshot();
      throw StopRun{};
    }
  }

 public:
  // One sample after each step, and a peak reached inside a step just before it (at the same step).
  std::vector<SeriesPoint> samples_;

 private:
  Allocator& a_;
  ScenarioResult& r_;
  const ScenarioOptions& o_;
  std::int64_t stop_at_;
  detail::InsidePeaks inside_peaks_;
  std::vector<void*> ptrs_;
  std::vector<std::size_t> sizes_;
  std::vector<int> free_slots_;
  std::size_t live_requested_ = 0;
};

// --- the stories -------------------------------------------------------------------------------

void split_800_500_300(Runner& r) {
  r.free(r.alloc(2000 * MiB));
  int a = r.alloc(800 * MiB);
  int b = r.alloc(500 * MiB);
  int c = r.alloc(300 * MiB);
  r.free(b);
  int d = r.alloc(800 * MiB);
  for (int s : {a, c, d}) r.free(s);
}

void cupy_limit(Runner& r) {
  // y = cp.arange(n).astype(cp.float32), n = 16M: an 8-byte int64 temporary, then the 4-byte
  // result; the temporary is freed once the copy is done. Keep the results, as a loop would.
  const std::size_t n = 16 * 1024 * 1024;
  std::vector<int> results;
  for (int i = 0; i < 20; ++i) {
    const int tmp = r.alloc(n * 8);
    if (tmp < 0) break;
    const int res = r.alloc(n * 4);
    r.free(tmp);
    if (res < 0) break;
    results.push_back(res);
  }
  for (int s : results) r.free(s);
}

void growing_buffer(Runner& r) {
  int x = r.alloc(64 * MiB);
  for (std::size_t i = 0; i < 400; ++i) {
    const int y = r.alloc(64 * MiB + (i + 1) * 3 * MiB + 12345);
    if (y < 0) break;
    r.free(x);
    x = y;
  }
  r.free(x);
}

// The anchors' random trace: 6000 steps, 45% free a random live block, sizes log-uniform
// 4 KiB..512 MiB; after an OOM a random half of the live blocks is freed.
void random_churn(Runner& r) {
  // Sizes 2^uniform(lo, hi): 4 KiB-512 MiB, or the caller's range (clamped: exp2 of log2 may round).
  const ScenarioOptions& o = r.options();
  const std::size_t min_size = o.min_size ? o.min_size : std::size_t{1} << kChurnMinLog2;
  const std::size_t max_size = o.max_size ? o.max_size : std::size_t{1} << kChurnMaxLog2;
  const double lo = o.min_size ? std::log2(static_cast<double>(min_size)) : kChurnMinLog2;
  const double hi = o.max_size ? std::log2(static_cast<double>(max_size)) : kChurnMaxLog2;
  std::vector<int> live;
  for (int step = 0; step < 6000; ++step) {
    if (!live.empty() && r.rng.uniform() < 0.45) {
      const std::size_t j = r.rng.below(live.size());
      r.free(live[j]);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(j));
      continue;
    }
    const std::size_t size = std::clamp(r.rng.log_uniform(lo, hi), min_size, max_size);
    const int s = r.alloc(size);
    if (s >= 0) {
      live.push_back(s);
      continue;
    }
    for (std::size_t i = live.size(); i > 1; --i) std::swap(live[i - 1], live[r.rng.below(i)]);
    const std::size_t keep = live.size() / 2;
    for (std::size_t i = keep; i < live.size(); ++i) r.free(live[i]);
    live.resize(keep);
  }
  for (int s : live) r.free(s);
}

// An LLM serving loop: sequences start with a prompt, then grow their KV caches by one token per
// step (torch.cat: a new, slightly larger block, then the old one is freed), and finish at
// different times; a finished sequence is replaced by a new one. A sequence whose cache cannot
// grow is evicted (its caches are freed) and the server goes on.
void kv_cache_decode(Runner& r) {
  constexpr int kConcurrent = 6;
  constexpr int kCachesPerSeq = 4;  // 2 layers x (K, V)
  constexpr std::size_t kTokenBytes = 32 * KiB;
  constexpr int kSequences = 24;
  struct Seq {
    int caches[kCachesPerSeq];
    std::size_t tokens = 0;
    std::size_t end = 0;
    bool active = false;
  };
  Seq seqs[kConcurrent];
  int started = 0;
  auto start = [&](Seq& s) {
    s.tokens = 16 + r.rng.below(241);       // prompt 16..256
    s.end = s.tokens + 32 + r.rng.below(481);  // generate 32..512
    s.active = true;
    ++started;
    for (int& c : s.caches) c = r.alloc(s.tokens * kTokenBytes);
    for (int c : s.caches)
      if (c < 0) {
        for (int& d : s.caches) r.free(d), d = -1;
        s.active = false;
        return;
      }
  };
  for (Seq& s : seqs) start(s);
  for (;;) {
    bool any = false;
    for (Seq& s : seqs) {
      if (!s.active) {
        if (started < kSequences) start(s);
        continue;
      }
      any = true;
      const int logits = r.alloc(4 * 50257 * 2);  // per-step temporary
      for (int& c : s.caches) {
        const int grown = r.alloc((s.tokens + 1) * kTokenBytes);
        if (grown < 0) {
          s.active = false;
          break;
        }
        r.free(c);
        c = grown;
      }
      r.free(logits);
      ++s.tokens;
      if (!s.active || s.tokens >= s.end) {
        for (int& c : s.caches) r.free(c), c = -1;
        s.active = false;
      }
    }
    if (!any && started >= kSequences) break;
  }
}

// Long-lived large blocks (weights, caches: 32..128 MiB, alive for 40 rounds) interleaved with
// short-lived small ones (activations: 1..8 MiB, most freed at once, some kept for 3 rounds).
void mixed_lifetimes(Runner& r) {
  constexpr int kRounds = 300;
  std::vector<int> large(40, -1);
  std::vector<std::vector<int>> kept(3);
  for (int round = 0; round < kRounds; ++round) {
    const std::size_t li = static_cast<std::size_t>(round) % large.size();
    r.free(large[li]);
    large[li] = r.alloc(32 * MiB + r.rng.below(97) * MiB);
    std::vector<int>& survivors = kept[static_cast<std::size_t>(round) % kept.size()];
    for (int s : survivors) r.free(s);
    survivors.clear();
    for (int i = 0; i < 20; ++i) {
      const int s = r.alloc(1 * MiB + r.rng.below(7 * 1024) * KiB);
      if (r.rng.uniform() < 0.2) survivors.push_back(s);
      else r.free(s);
    }
  }
  for (int s : large) r.free(s);
  for (auto& v : kept)
    for (int s : v) r.free(s);
}

struct Story {
  ScenarioInfo info;
  std::uint64_t seed;
  void (*run)(Runner&);
};

// How the random stories end with their own seed: the end of their descriptions (ScenarioInfo::outcome).
#define CHURN_OUTCOME                                                                                        \
  "A split pool fails while much of the limit is free but scattered; expandable segments should fail only " \
  "when live bytes plus the request really approach the limit."
#define KV_OUTCOME                                                                                          \
  "In a split pool the many slightly different sizes fragment the cache until sequences are evicted for " \
  "lack of memory at about half the 384 MiB limit; expandable segments keep serving them."
#define MIXED_OUTCOME                                                                                         \
  "Small survivors land in the room freed large blocks leave and split it, so under the 4 GiB limit a split " \
  "pool fails a large request while much of the limit is free in pieces too small for it (fragmentation); "   \
  "expandable segments give back the pages around the survivors, map them where the large block goes, and "   \
  "serve every request."

const Story kStories[] = {
    {{"split-800-500-300", "The split-pool OOM",
      "A 2000 MiB block is allocated and freed, then 800, 500 and 300 MiB are carved from the cached segment and "
      "the 500 is freed. A request for 800 MiB fails in a split pool although 900 MiB is reserved but "
      "unallocated: no contiguous 800 MiB exists and the 2064 MiB limit forbids a new segment. This is "
      "PyTorch's 'reserved but unallocated' OOM (and CuPy's with set_limit). Expandable segments unmap the free "
      "pages and map them again where the request fits.",
      2064 * MiB, false, 0, 0, 0, {}},
     3, split_800_500_300},
    {{"cupy-limit", "CuPy's pool limit and arange().astype() temporaries",
      "A loop builds float32 arrays with arange(n).astype(float32), n = 16M: each step first allocates the 128 MiB "
      "int64 temporary, then the 64 MiB result, then frees the temporary. The pool limit (1 GiB here, CuPy's "
      "set_limit) counts everything the pool holds; with 14 results kept, the temporary plus the next result "
      "exceed the limit although the results alone are 896 MiB. The verdict is 'limit' on every backend: the "
      "fix is a higher limit or fewer live arrays, not a different allocator.",
      1 * GiB, false, 0, 0, 0, {}},
     5, cupy_limit},
    {{"growing-buffer", "A buffer that grows each step",
      "A buffer grows by 3 MiB a step for 400 steps (64 MiB to 1.2 GiB, plus 12345 odd bytes): the new, larger "
      "copy is allocated before the old one is freed, as a KV cache or a growing batch does. A split pool cannot "
      "reuse the freed, slightly smaller blocks and must flush its cache again and again under the 3 GiB "
      "limit; expandable segments reuse the freed pages in place.",
      3 * GiB, false, 0, 0, 0, {}},
     1, growing_buffer},
    // (ScenarioInfo::seed: the Story's, filled in by infos().)
    {{"random-churn", "Random sizes and lifetimes under a limit",
      "6000 steps: 45% free a random live block, the rest allocate a log-uniform size between 4 KiB and 512 MiB, "
      "under a 3 GiB limit; after an OOM a random half of the live blocks is freed. " CHURN_OUTCOME,
      3 * GiB, true, std::size_t{1} << kChurnMinLog2, std::size_t{1} << kChurnMaxLog2, 0, CHURN_OUTCOME},
     1, random_churn},
    {{"kv-cache-decode", "LLM decoding with growing KV caches",
      "Six sequences decode at once; each holds four KV caches (2 layers x K,V, 32 KiB per token) that grow by "
      "one token per step through torch.cat (a new, larger block, then the old one freed), and sequences "
      "start and finish at different times (24 in all, prompts of 16-256 tokens, 32-512 new tokens). " KV_OUTCOME,
      384 * MiB, true, 0, 0, 0, KV_OUTCOME},
     7, kv_cache_decode},
    {{"mixed-lifetimes", "Long-lived large blocks among short-lived small ones",
      "Each round allocates a large block (32-128 MiB) that lives for 40 rounds, and twenty small ones "
      "(1-8 MiB), about four in five freed at once and the others kept for three rounds. " MIXED_OUTCOME,
      4 * GiB, true, 0, 0, 0, MIXED_OUTCOME},
     11, mixed_lifetimes},
};
#undef CHURN_OUTCOME
#undef KV_OUTCOME
#undef MIXED_OUTCOME

std::string unknown_scenario(std::string_view name) {
  std::string s = "expseg: unknown scenario '" + std::string(name) + "'; valid scenarios:";
  for (const Story& st : kStories) s += " " + std::string(st.info.name);
  return s;
}

std::vector<ScenarioInfo> infos() {
  std::vector<ScenarioInfo> v;
  for (const Story& s : kStories) {
    v.push_back(s.info);
    v.back().seed = s.seed;
  }
  return v;
}

// Resamples per-step samples to about `points` points (at most one more), keeping each bucket's
// highest allocated and highest reserved sample, and the last sample: the run's end state (stories
// free everything), held to the end of the chart.
std::vector<SeriesPoint> downsample(const std::vector<SeriesPoint>& in, std::size_t points) {
  if (points == 0 || in.size() <= points) return in;
  detail::SeriesSampler sampler(detail::SeriesSampler::bucket_for(in.size(), points));
  for (const SeriesPoint& p : in) sampler.push(p);
  return sampler.finish();
}

}  // namespace

std::size_t ScenarioRng::log_uniform(double lo_exp, double hi_exp) noexcept {
  return static_cast<std::size_t>(std::exp2(lo_exp + (hi_exp - lo_exp) * uniform()));
}

std::span<const ScenarioInfo> list_scenarios() {
  static const std::vector<ScenarioInfo> v = infos();
  return v;
}

const ScenarioInfo* find_scenario(std::string_view name) {
  for (const ScenarioInfo& i : list_scenarios())
    if (i.name == name) return &i;
  return nullptr;
}

ScenarioResult run_scenario(std::string_view name, const Config& config, const ScenarioOptions& options, int device) {
  const Story* story = nullptr;
  for (const Story& s : kStories)
    if (s.info.name == name) story = &s;
  if (story == nullptr) throw error(unknown_scenario(name));
  if (options.min_size != 0 || options.max_size != 0) {
    if (name != "random-churn")
      throw error("expseg: scenario '" + std::string(name) + "' has its own sizes; a size range applies to random-churn only");
    if (options.min_size == 0 || options.max_size == 0 || options.min_size > options.max_size)
      throw error("expseg: the size range needs 0 < min <= max (got " + std::to_string(options.min_size) + "-" +
                  std::to_string(options.max_size) + " bytes)");
    if (options.max_size > kMaxChurnSize)
      throw error("expseg: random-churn sizes go up to 1 TiB (got " + std::to_string(options.max_size) + " bytes)");
  }
  Config c = config;
  if (!c.limit.is_set()) c.limit = Limit{story->info.limit_bytes, 0.0};
  const std::uint64_t seed = options.seed ? options.seed : story->seed;

  auto run_once = [&](std::int64_t stop_at, ScenarioResult& r, std::vector<SeriesPoint>* samples, const ScenarioOptions& opts) {
    Allocator a(c, device);
    r.scenario = std::string(name);
    r.backend = to_string(c.backend);
    r.device = device_label(c, device);
    r.limit_bytes = a.limit();
    r.seed = seed;
    if (story->info.max_size != 0) {
      r.min_size = options.min_size ? options.min_size : story->info.min_size;
      r.max_size = options.max_size ? options.max_size : story->info.max_size;
    }
    Runner runner(a, r, opts, seed, stop_at);
    const driver::Driver& drv = detail::AllocatorAccess::driver(a);
    const driver::CallStats calls_before = drv.call_stats();
    const auto t0 = std::chrono::steady_clock::now();
    try {
      story->run(runner);
    } catch (const StopRun&) {
    }
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const driver::CallStats calls = drv.call_stats().since(calls_before);
    r.driver_seconds = calls.total_seconds();
    r.driver_calls = calls.by_call();
    const Stats s = a.stats();
    r.peak_allocated_bytes = s.allocated_bytes[kAllPools].peak;
    r.peak_reserved_bytes = s.reserved_bytes[kAllPools].peak;
    r.device_allocs = s.num_device_alloc;
    r.alloc_retries = s.num_alloc_retries;
    if (samples) *samples = std::move(runner.samples_);
  };

  ScenarioResult result;
  std::vector<SeriesPoint> samples;
  run_once(-1, result, &samples, options);
  if (options.series_points || options.snapshot_at_peak) {
    // A stats() sample after every step tripled the time: the time is of a run of its own without
    // samples (the same story; no dump written again).
    ScenarioOptions timed = options;
    timed.series_points = 0;
    timed.snapshot_at_peak = false;
    const Config keep = c;
    c.oom_dump.clear();
    ScenarioResult t;
    run_once(-1, t, nullptr, timed);
    c = keep;
    result.seconds = t.seconds;
    result.driver_seconds = t.driver_seconds;
    result.driver_calls = std::move(t.driver_calls);
  }
  if (options.series_points) result.series = downsample(samples, options.series_points);
  if (options.snapshot_at_peak && !samples.empty()) {
    // A state after a step, not a peak inside one (the sample before its step's own): the
    // snapshot is taken after a step.
    std::optional<std::size_t> peak;  // (the last sample is a step's own)
    for (std::size_t i = 0; i < samples.size(); ++i) {
      const bool inside = i + 1 < samples.size() && samples[i + 1].event == samples[i].event;
      if (!inside && (!peak || samples[i].reserved > samples[*peak].reserved)) peak = i;
    }
    ScenarioOptions quiet = options;
    quiet.series_points = 0;
    quiet.snapshot_at_peak = false;
    // Same config and seed: the story replays identically up to the peak step. Only quieter: the
    // OOMs before the peak happened already, in the run the user asked for; written again, a dump
    // would replace the one of the run's last OOM with an earlier one (and a recording, the
    // counterfactual and OOM snapshots are work no one reads).
    Config cc = c;
    cc.oom_dump.clear();
    cc.record = false;
    cc.oom_snapshot = false;
    cc.oom_counterfactual = false;
    {
      Allocator a(cc, device);
      ScenarioResult r2;
      r2.limit_bytes = a.limit();
      Runner runner(a, r2, quiet, seed, static_cast<std::int64_t>(samples[*peak].event));
      try {
        story->run(runner);
      } catch (const StopRun&) {
      }
      result.peak_snapshot = std::move(r2.peak_snapshot);
    }
  }
  return result;
}

std::string ScenarioResult::to_json() const {
  core::JsonWriter w;
  w.begin_object();
  w.field("scenario", scenario).field("backend", backend).field("device", device).field("ok", ok);
  w.key("verdict");
  if (verdict) w.value(to_string(*verdict));
  else w.null();
  w.field("seed", seed);
  w.field("ooms", static_cast<std::uint64_t>(ooms));
  w.field("fragmentation_ooms", static_cast<std::uint64_t>(fragmentation_ooms));
  w.field("ooms_below_98pct", static_cast<std::uint64_t>(ooms_below_98));
  w.field("first_oom_fill", first_oom_fill).field("lowest_oom_fill", lowest_oom_fill);
  w.field("lowest_oom_page_slack_bytes", static_cast<std::uint64_t>(lowest_oom_page_slack));
  if (max_size != 0) w.field("min_size", static_cast<std::uint64_t>(min_size)).field("max_size", static_cast<std::uint64_t>(max_size));
  w.field("peak_allocated_bytes", peak_allocated_bytes).field("peak_reserved_bytes", peak_reserved_bytes);
  w.field("peak_requested_bytes", peak_requested_bytes);
  w.field("limit_bytes", static_cast<std::uint64_t>(limit_bytes));
  w.field("steps", static_cast<std::uint64_t>(steps)).field("allocations", static_cast<std::uint64_t>(allocations));
  w.field("device_allocs", device_allocs).field("alloc_retries", alloc_retries);
  w.field("seconds", seconds).field("driver_seconds", driver_seconds);
  w.key("driver_calls").raw(driver_calls_json(driver_calls));
  w.end_object();
  return w.take();
}

}  // namespace expseg
