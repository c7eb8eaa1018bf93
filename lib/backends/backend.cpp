// The backend interface is header-only (its stat bookkeeping is inline, on the cached path), but for
// the size rounding both backends share.
#include "backends/backend.hpp"

#include <bit>

namespace expseg::backends {

namespace {

// PyTorch's roundup_power2_next_division: split [2^k, 2^(k+1)) into `divisions` equal steps.
std::size_t roundup_power2_next_division(std::size_t size, std::size_t divisions) noexcept {
  if (std::has_single_bit(size)) return size;
  const std::size_t power2_floor = std::bit_floor(size);
  const std::size_t power2_division = power2_floor >> (std::bit_width(divisions) - 1);
  if (power2_division == 0) return power2_floor << 1;
  const std::size_t round_size_floor = size & ~(power2_division - 1);
  return round_size_floor == size ? size : round_size_floor + power2_division;
}

// PyTorch's CUDAAllocatorConfig::roundup_power2_divisions(size): intervals start at 1 MiB.
std::size_t divisions_for(const Config& c, std::size_t size) noexcept {
  const int log_size = std::bit_width(size) - 1;
  int index = log_size - 20;
  if (index < 0) index = 0;
  if (index > static_cast<int>(kRoundupIntervals) - 1) index = kRoundupIntervals - 1;
  return c.roundup_power2_divisions[static_cast<std::size_t>(index)];
}

}  // namespace

std::size_t roundup_power2_divisions_size(const Config& c, std::size_t size, std::size_t min_block) noexcept {
  const std::size_t divisions = divisions_for(c, size);
  if (divisions <= 1) return 0;
  // PyTorch's size > min_block * divisions; the division first keeps the product from overflowing
  // (the config accepts any power of two up to 2^63, as PyTorch does).
  if (size / divisions >= min_block && size > min_block * divisions) return roundup_power2_next_division(size, divisions);
  return 0;
}

bool has_roundup_power2_divisions(const Config& c) noexcept {
  for (std::size_t d : c.roundup_power2_divisions)
    if (d > 1) return true;
  return false;
}

}  // namespace expseg::backends
