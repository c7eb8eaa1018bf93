// The charts' series of allocated and reserved bytes over time (replays and scenarios), sampled down
// from the state after every operation to about the number of points asked for.
//
// A sample every N operations misses every peak shorter than N: a 13 GiB allocated peak lasting 58
// events of a replay sampled every 84 was drawn at 10 GiB, next to a table that said 13 GiB. So each
// bucket of operations keeps both its sample with the most allocated and its sample with the most
// reserved (in event order), and a peak reached inside an operation (an allocation given straight
// back, memory held for a request that then fails) becomes a sample of its own: the series reaches
// the run's peak allocated and peak reserved bytes.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "expseg/stats.hpp"
#include "expseg/trace.hpp"

namespace expseg::detail {

// Finds the peaks the state after an operation does not show: fed the stats after each operation,
// in order, it returns a sample of the peak reached inside the operation when it passed everything
// seen after the operations before it and after this one. That sample goes just before the
// operation's own, at the same event.
class InsidePeaks {
 public:
  std::optional<SeriesPoint> check(std::uint64_t event, const Stats& s) {
    const Stat& al = s.allocated_bytes[kAllPools];
    const Stat& re = s.reserved_bytes[kAllPools];
    const bool allocated_inside = al.peak > std::max(allocated_, al.current);
    const bool reserved_inside = re.peak > std::max(reserved_, re.current);
    allocated_ = std::max(allocated_, al.peak);
    reserved_ = std::max(reserved_, re.peak);
    if (!allocated_inside && !reserved_inside) return std::nullopt;
    // Reserved memory holds the allocated blocks: at the allocated peak it was at least that much.
    SeriesPoint p{event, allocated_inside ? al.peak : al.current, 0};
    p.reserved = reserved_inside ? re.peak : std::max(re.current, p.allocated);
    return p;
  }

 private:
  std::int64_t allocated_ = 0;  // the highest peak seen so far
  std::int64_t reserved_ = 0;
};

// Keeps, of each bucket of `bucket` samples, the one with the most allocated and the one with the
// most reserved, in the order they came; and the last sample, the run's end state.
class SeriesSampler {
 public:
  explicit SeriesSampler(std::size_t bucket) : bucket_(std::max<std::size_t>(bucket, 1)) {}

  // The bucket size that keeps about `points` points (two per bucket) of `samples` samples.
  static std::size_t bucket_for(std::size_t samples, std::size_t points) {
    return points == 0 ? samples : std::max<std::size_t>(1, (2 * samples + points - 1) / points);
  }

  void push(const SeriesPoint& p) {
    const Kept k{p, seq_++};
    if (in_bucket_ == 0) {
      most_allocated_ = most_reserved_ = k;
    } else {
      const SeriesPoint& a = most_allocated_.point;
      const SeriesPoint& r = most_reserved_.point;
      if (p.allocated > a.allocated || (p.allocated == a.allocated && p.reserved > a.reserved)) most_allocated_ = k;
      if (p.reserved > r.reserved || (p.reserved == r.reserved && p.allocated > r.allocated)) most_reserved_ = k;
    }
    last_ = k;
    if (++in_bucket_ == bucket_) flush();
  }

  std::vector<SeriesPoint> finish() {
    flush();
    if (seq_ != 0 && last_emitted_ != last_.seq) out_.push_back(last_.point);
    return std::move(out_);
  }

 private:
  struct Kept {
    SeriesPoint point;
    std::uint64_t seq = 0;  // order of arrival: a peak inside an operation shares its event
  };
  void flush() {
    if (in_bucket_ == 0) return;
    const Kept& first = most_allocated_.seq <= most_reserved_.seq ? most_allocated_ : most_reserved_;
    const Kept& second = most_allocated_.seq <= most_reserved_.seq ? most_reserved_ : most_allocated_;
    out_.push_back(first.point);
    if (second.seq != first.seq) out_.push_back(second.point);
    last_emitted_ = second.seq;
    in_bucket_ = 0;
  }

  std::size_t bucket_;
  std::size_t in_bucket_ = 0;
  std::uint64_t seq_ = 0;
  std::uint64_t last_emitted_ = UINT64_MAX;
  Kept most_allocated_, most_reserved_, last_;
  std::vector<SeriesPoint> out_;
};

}  // namespace expseg::detail
