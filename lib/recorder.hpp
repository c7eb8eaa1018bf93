// Event recorder: allocate/free/map/unmap/allocate-failure events with timestamps, kept in memory
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
  void start(std::size_t ring);
  void stop() noexcept { enabled_ = false; }
  bool enabled() const noexcept { return enabled_; }
  void add(TraceAction action, std::uint64_t pointer, std::uint64_t size, driver::stream_t stream);
  std::vector<TraceEvent> events() const;  // oldest first

 private:
  bool enabled_ = false;
  std::size_t ring_ = 0;  // 0: unbounded
  std::vector<TraceEvent> buf_;
  std::size_t next_ = 0;  // ring: where the next event goes once the buffer is full
};

}  // namespace expseg
