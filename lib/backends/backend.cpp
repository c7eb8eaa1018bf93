#include "backends/backend.hpp"

namespace expseg::backends {

namespace {
inline void both(Stat* arr, int pool, std::int64_t delta) noexcept {
  if (delta >= 0) {
    arr[kAllPools].increase(delta);
    arr[pool].increase(delta);
  } else {
    arr[kAllPools].decrease(-delta);
    arr[pool].decrease(-delta);
  }
}
}  // namespace

void Backend::account_allocated(const core::Block& b) noexcept {
  Stats& s = ctx_.stats;
  const auto size = static_cast<std::int64_t>(b.size);
  both(s.allocation, b.pool, 1);
  both(s.allocated_bytes, b.pool, size);
  both(s.active, b.pool, 1);
  both(s.active_bytes, b.pool, size);
  both(s.requested_bytes, b.pool, static_cast<std::int64_t>(b.requested));
  if (b.size >= ctx_.config.max_split_size) s.oversize_allocations.increase(1);
}

void Backend::account_caller_freed(const core::Block& b) noexcept {
  Stats& s = ctx_.stats;
  both(s.allocation, b.pool, -1);
  both(s.allocated_bytes, b.pool, -static_cast<std::int64_t>(b.size));
  both(s.requested_bytes, b.pool, -static_cast<std::int64_t>(b.requested));
}

void Backend::account_deactivated(const core::Block& b) noexcept {
  Stats& s = ctx_.stats;
  both(s.active, b.pool, -1);
  both(s.active_bytes, b.pool, -static_cast<std::int64_t>(b.size));
  if (b.size >= ctx_.config.max_split_size) s.oversize_allocations.decrease(1);
}

void Backend::begin_pending_free(core::Block* b) noexcept {
  account_caller_freed(*b);
  b->status = core::BlockStatus::pending_free;
}

void Backend::leave_active(core::Block& b) noexcept {
  if (b.status == core::BlockStatus::allocated) account_caller_freed(b);
  account_deactivated(b);
  b.status = core::BlockStatus::free;
  b.requested = 0;
  b.pending_events = 0;
  b.stream_uses.clear();
}

void Backend::account_inactive(int pool, std::int64_t blocks, std::int64_t bytes) noexcept {
  both(ctx_.stats.inactive_split, pool, blocks);
  both(ctx_.stats.inactive_split_bytes, pool, bytes);
}

void Backend::account_reserved(int pool, std::int64_t bytes) noexcept { both(ctx_.stats.reserved_bytes, pool, bytes); }

void Backend::account_segment(int pool, std::int64_t count) noexcept { both(ctx_.stats.segment, pool, count); }

}  // namespace expseg::backends
