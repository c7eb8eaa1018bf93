// Stats: peaks, resets and the memory_stats()-style JSON (see stats.hpp).
#include "expseg/stats.hpp"

#include <string_view>

#include "core/json.hpp"

namespace expseg {

const char* stat_pool_name(int pool) noexcept {
  switch (pool) {
    case kAllPools: return "all";
    case kSmallPool: return "small_pool";
    case kLargePool: return "large_pool";
    default: return "unknown";
  }
}

namespace {

// Every Stat of a Stats, per-pool arrays included; X-macros keep this list in step with the header.
template <class S, class F>
void for_each_stat(S& s, F&& f) {
#define EXPSEG_VISIT_POOL_STAT(name, help) \
  for (auto& st : s.name) f(st);
  EXPSEG_POOL_STATS(EXPSEG_VISIT_POOL_STAT)
#undef EXPSEG_VISIT_POOL_STAT
  f(s.oversize_allocations);
  f(s.oversize_segments);
  f(s.physical_handles);
}

void write_stat(core::JsonWriter& w, std::string_view prefix, const Stat& st) {
  std::string k(prefix);
  const std::size_t n = k.size();
  k += ".current";
  w.field(k, st.current);
  k.resize(n);
  k += ".peak";
  w.field(k, st.peak);
  k.resize(n);
  k += ".allocated";
  w.field(k, st.allocated);
  k.resize(n);
  k += ".freed";
  w.field(k, st.freed);
}

}  // namespace

void Stats::reset_peaks() noexcept {
  for_each_stat(*this, [](Stat& st) { st.reset_peak(); });
}

// PyTorch's resetAccumulatedStats: the running totals and the event counters, not the gauges
// (current values, num_free_blocks) nor the configuration (max_split_size).
void Stats::reset_accumulated() noexcept {
  for_each_stat(*this, [](Stat& st) { st.reset_accumulated(); });
#define EXPSEG_RESET_COUNTER(name, help) name = 0;
  EXPSEG_COUNTERS(EXPSEG_RESET_COUNTER)
#undef EXPSEG_RESET_COUNTER
}

std::string Stats::to_json() const {
  core::JsonWriter w;
  w.begin_object();
#define EXPSEG_WRITE_POOL_STAT(name, help)                                        \
  for (int p = 0; p < kStatPools; ++p)                                            \
    write_stat(w, std::string(#name ".") + stat_pool_name(p), name[p]);
  EXPSEG_POOL_STATS(EXPSEG_WRITE_POOL_STAT)
#undef EXPSEG_WRITE_POOL_STAT
  write_stat(w, "oversize_allocations", oversize_allocations);
  write_stat(w, "oversize_segments", oversize_segments);
#define EXPSEG_WRITE_COUNTER(name, help) w.field(#name, name);
  EXPSEG_COUNTERS(EXPSEG_WRITE_COUNTER)
#undef EXPSEG_WRITE_COUNTER
  w.field("max_split_size", max_split_size);
  write_stat(w, "physical_handles", physical_handles);
  w.field("num_free_blocks", num_free_blocks);
  w.key("cupy").begin_object();
  w.field("used_bytes", used_bytes());
  w.field("total_bytes", total_bytes());
  w.field("free_bytes", free_bytes());
  w.field("n_free_blocks", n_free_blocks());
  w.end_object();
  w.end_object();
  return w.take();
}

std::string driver_calls_json(const std::vector<DriverCallTime>& calls) {
  core::JsonWriter w;
  w.begin_object();
  for (const DriverCallTime& c : calls) {
    w.key(c.call);
    w.begin_object().field("calls", c.calls).field("seconds", c.seconds).end_object();
  }
  w.end_object();
  return w.take();
}

}  // namespace expseg
