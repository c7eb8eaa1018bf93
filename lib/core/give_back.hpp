// Which cached pieces (split_merge's unsplit segments, expandable's idle handles) to give back when
// a lower limit leaves `excess` bytes too many. Pieces go back only whole, so the choice trades the
// memory given back beyond the excess (cache the job loses for nothing) against driver calls.
#pragma once

#include <algorithm>
#include <cstddef>
#include <numeric>
#include <vector>

namespace expseg::core {

// Indexes into `sizes` whose sizes add up to at least `excess`, from the better of two
// plans: the smallest single piece that covers the excess; or the pieces that fit in what is left
// of it, largest first, then the smallest piece that covers the rest. Better: less given back
// beyond the excess, then fewer pieces. Among pieces of one size, the earlier in `sizes` goes first
// (callers list them in the order they prefer to lose them). All indexes when all pieces together
// do not cover it.
inline std::vector<std::size_t> pick_give_back(const std::vector<std::size_t>& sizes, std::size_t excess) {
  std::vector<std::size_t> order(sizes.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return sizes[a] > sizes[b]; });
  if (excess == 0) return {};
  // The smallest piece >= need among those not taken, the first in `sizes` among equals, or none.
  auto smallest_covering = [&](std::size_t need, const std::vector<bool>& taken) -> std::ptrdiff_t {
    std::ptrdiff_t best = -1;
    for (std::size_t i : order)
      if (!taken[i] && sizes[i] >= need && (best < 0 || sizes[i] < sizes[static_cast<std::size_t>(best)])) best = static_cast<std::ptrdiff_t>(i);
    return best;
  };
  const std::vector<bool> none(sizes.size(), false);
  std::vector<std::size_t> single;
  std::size_t single_bytes = 0;
  if (const std::ptrdiff_t i = smallest_covering(excess, none); i >= 0) {
    single = {static_cast<std::size_t>(i)};
    single_bytes = sizes[single[0]];
  }
  std::vector<std::size_t> packed;
  std::size_t packed_bytes = 0;
  std::vector<bool> taken(sizes.size(), false);
  std::size_t left = excess;
  for (std::size_t i : order) {
    if (left == 0) break;
    if (sizes[i] <= left) {
      packed.push_back(i);
      taken[i] = true;
      packed_bytes += sizes[i];
      left -= sizes[i];
    }
  }
  if (left != 0) {
    if (const std::ptrdiff_t i = smallest_covering(left, taken); i >= 0) {
      packed.push_back(static_cast<std::size_t>(i));
      packed_bytes += sizes[static_cast<std::size_t>(i)];
      left = 0;
    }
  }
  if (left != 0) return single.empty() ? order : single;  // the packing cannot cover: the single (or all)
  if (single.empty()) return packed;
  if (packed_bytes != single_bytes) return packed_bytes < single_bytes ? packed : single;
  return packed.size() < single.size() ? packed : single;
}

}  // namespace expseg::core
