#include "recorder.hpp"

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>

#include "backends/backend.hpp"

namespace expseg {

namespace {
std::uint64_t thread_id() noexcept {
  static thread_local const auto tid = static_cast<std::uint64_t>(::syscall(SYS_gettid));
  return tid;
}
std::int64_t now_us() noexcept {
  using namespace std::chrono;
  return duration_cast<microseconds>(system_clock::now().time_since_epoch()).count();
}
}  // namespace

void Recorder::start(std::size_t ring, bool live_before) {
  // The buffer grows with the events (add() pushes until the ring is full), so any ring size works:
  // reserve at most kMaxReserve up front, not `ring` (record_ring:SIZE_MAX would be bad_alloc).
  // Built aside and swapped in: if the reservation throws, the recorder is left as it was.
  constexpr std::size_t kMaxReserve = std::size_t{1} << 16;
  std::vector<TraceEvent> buf;
  if (ring > 0) buf.reserve(std::min(ring, kMaxReserve));
  buf_.swap(buf);
  ring_ = ring;
  next_ = 0;
  dropped_ = 0;
  started_partial_ = live_before;
  const std::int64_t now = now_us();
  midnight_us_ = now - now % (86400LL * 1000000LL);
  enabled_ = true;
}

void Recorder::add(TraceAction action, std::uint64_t pointer, std::uint64_t size, driver::stream_t stream) noexcept {
  TraceEvent e;
  e.thread = thread_id();
  e.time = static_cast<double>(now_us() - midnight_us_) / 1e6;
  e.action = action;
  e.pointer = pointer;
  e.size = size;
  e.stream = backends::shown_stream(stream);  // a foreign stream key as its stream
  if (ring_ == 0 || buf_.size() < ring_) {
    try {
      buf_.push_back(e);
    } catch (...) {
      ++dropped_;  // no host memory for it: the trace says it is partial
    }
  } else {
    buf_[next_] = e;
    next_ = (next_ + 1) % ring_;
    ++dropped_;
  }
}

std::vector<TraceEvent> Recorder::events() const {
  if (ring_ == 0 || buf_.size() < ring_) return buf_;
  std::vector<TraceEvent> out;
  out.reserve(buf_.size());
  out.insert(out.end(), buf_.begin() + static_cast<std::ptrdiff_t>(next_), buf_.end());
  out.insert(out.end(), buf_.begin(), buf_.begin() + static_cast<std::ptrdiff_t>(next_));
  return out;
}

}  // namespace expseg
