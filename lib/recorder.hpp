// Event recorder: allocate/free/free-completed/map/unmap/allocate-failure events with timestamps, kept in memory
// (all of them, or the last N in a ring) and written as RMM's CSV log by write_trace_file().
// Used under the allocator's lock; costs one branch per operation when off.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "driver/driver.hpp"
#include "expseg/trace.hpp"

namespace expseg {

class Recorder {
 public:
  // `live_before`: memory was allocated or cached when recording started.
  void start(std::size_t ring, bool live_before = false);
  void stop() noexcept { enabled_ = false; }
  bool enabled() const noexcept { return enabled_; }
  bool empty() const noexcept { return buf_.empty(); }  // no event recorded since start()
  // Never throws: an event there is no host memory for is dropped (the trace is then partial), so
  // that recording cannot make an allocation or a free fail after it took effect.
  void add(TraceAction action, std::uint64_t pointer, std::uint64_t size, driver::stream_t stream) noexcept;
  std::vector<TraceEvent> events() const;  // oldest first
  // True when events() does not start from an empty allocator: the recording began while
  // memory was allocated or cached (start(ring, true)), or events were dropped (a full ring, or no memory). Replaying such a
  // trace needs --lenient (frees of allocations it never saw) and holds less memory than the run did.
  bool partial() const noexcept { return started_partial_ || dropped_ != 0; }

 private:
  bool enabled_ = false;
  std::size_t ring_ = 0;  // 0: unbounded
  std::vector<TraceEvent> buf_;
  std::size_t next_ = 0;  // ring: where the next event goes once the buffer is full
  std::uint64_t dropped_ = 0;  // events a full ring overwrote, or that found no memory
  bool started_partial_ = false;
  // RMM logs the time of day (UTC here); counted from the midnight before start(), so that a
  // recording past midnight goes on at 24:00:00 instead of wrapping (times stay monotonic).
  std::int64_t midnight_us_ = 0;
};

}  // namespace expseg
