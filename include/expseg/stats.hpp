// expseg statistics, with PyTorch's names and meanings (torch.cuda.memory_stats()), so numbers can
// be compared line by line, and CuPy's pool views (used/total/free bytes, free blocks) of the same
// numbers.
//
// Each Stat is {current, peak, allocated, freed}: `allocated`/`freed` are running totals of
// increases/decreases since the last reset_accumulated_stats() (which sets both to 0, as PyTorch's
// does: allocated then counts what a region of a program allocated), so current = allocated - freed
// + current at that reset; peak = max current since the last reset_peak_stats(). Arrays are indexed by StatPool: all, small_pool, large_pool. Blocks of <= 1 MiB
// count in small_pool on both backends; split_merge's small segments (2 MiB) do too, but expandable's
// arenas hold all sizes in one segment per stream, so it counts all reserved memory and segments in
// large_pool (its small_pool reserved is 0 while small blocks are allocated). One exception:
// split_merge with policy:cupy keeps CuPy's single pool, whose blocks and segments all count in
// large_pool (a 4 KiB block too), where expandable still counts that block in small_pool; the all
// figures agree.
//
// Identities of the `all` figures (checked by tests after every step of randomized runs; per pool
// they hold on split_merge only, as expandable's small_pool reserves nothing, see above):
//   allocated_bytes.current <= active_bytes.current (a block freed while a stream still uses it is
//     no longer allocated but still active; it stops being active when the allocator sees the
//     stream's event complete: split_merge, as PyTorch, looks at every such stream at each request,
//     expandable at two a request in turn, so with three or more such streams its active and
//     requested figures can lag a few requests behind, and all are looked at before it maps memory)
//   active_bytes.current <= reserved_bytes.current <= limit (when a limit is set; after set_limit
//     lowered it below what was held, reserved may stay above it: on expandable until the live
//     blocks in that memory are freed; on split_merge, as on PyTorch, also after they are, since its
//     cache keeps serving requests, until release_cached() or a request that needs a new segment
//     gives cached segments back)
//   CuPy: total_bytes == used_bytes + free_bytes
//   every peak >= its current
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

// The public API keeps default visibility; the rest of libexpseg.so is built hidden.
#pragma GCC visibility push(default)

namespace expseg {

struct Stat {
  std::int64_t current = 0;
  std::int64_t peak = 0;
  std::int64_t allocated = 0;
  std::int64_t freed = 0;

  void increase(std::int64_t amount) noexcept {
    current += amount;
    allocated += amount;
    if (current > peak) peak = current;
  }
  void decrease(std::int64_t amount) noexcept {
    current -= amount;
    freed += amount;
  }
  void reset_peak() noexcept { peak = current; }
  // As PyTorch's reset_accumulated_stat: the totals restart at 0, the gauges (current, peak) stay.
  void reset_accumulated() noexcept {
    allocated = 0;
    freed = 0;
  }
  bool operator==(const Stat&) const = default;
};

enum StatPool : std::uint8_t { kAllPools = 0, kSmallPool = 1, kLargePool = 2, kStatPools = 3 };
const char* stat_pool_name(int pool) noexcept;  // "all", "small_pool", "large_pool"

// X-macro: each per-pool statistic, PyTorch's name first. Keep in the order memory_stats() uses.
// inactive_split(_bytes) is split_merge's: expandable gives free memory back by pages, and the free
// bytes it cannot give back are those inside pages live blocks use partly; free_summary() and every
// OOM report give them (page_slack_bytes), so expandable leaves these two stats at 0.
#define EXPSEG_POOL_STATS(X)                                                                        \
  X(allocation, "allocations requested by client code (count)")                                    \
  X(segment, "segments held from the device: driver allocations, or expandable segments (count; PyTorch's expandable mode counts 0)") \
  X(active, "active blocks: allocated, or freed while a stream still uses them (count)")           \
  X(inactive_split, "split_merge: free blocks that cannot be given back to the device (count); expandable: 0, see below") \
  X(allocated_bytes, "bytes in allocated blocks (after rounding)")                                 \
  X(reserved_bytes, "bytes of device memory held (free or not)")                                   \
  X(active_bytes, "bytes in active blocks")                                                        \
  X(inactive_split_bytes, "bytes in free blocks that cannot be given back to the device")          \
  X(requested_bytes, "bytes requested by client code (before rounding)")

// X-macro: plain counters. num_alloc_retries on expandable: it gives back idle memory inside the
// allocation that needs it, not by a retry, so it counts only retries after waiting for frees pending
// on other streams (PyTorch's expandable segments count 1 before a limit OOM). Likewise
// num_sync_all_streams counts synchronizations that happened: expandable synchronizes only where
// frees are pending on other streams (PyTorch's expandable segments count one at every OOM).
#define EXPSEG_COUNTERS(X)                                                                          \
  X(num_alloc_retries, "allocations that failed at the driver or limit and were retried after freeing cache") \
  X(num_ooms, "allocations that ended in out_of_memory")                                            \
  X(num_sync_all_streams, "times all pending cross-stream frees were synchronized")                 \
  X(num_device_alloc, "driver allocation calls (cuMemAlloc, cuMemCreate+cuMemMap)")                 \
  X(num_device_free, "driver free calls (cuMemFree, cuMemUnmap+cuMemRelease; a handle moved counts in neither)")

struct Stats {
#define EXPSEG_DECLARE_POOL_STAT(name, help) Stat name[kStatPools];
  EXPSEG_POOL_STATS(EXPSEG_DECLARE_POOL_STAT)
#undef EXPSEG_DECLARE_POOL_STAT
#define EXPSEG_DECLARE_COUNTER(name, help) std::int64_t name = 0;
  EXPSEG_COUNTERS(EXPSEG_DECLARE_COUNTER)
#undef EXPSEG_DECLARE_COUNTER
  Stat oversize_allocations;  // allocations of max_split_size or more served from the pool
  Stat oversize_segments;     // driver allocations for oversize requests
  std::int64_t max_split_size = -1;  // -1: unlimited (PyTorch reports SIZE_MAX as -1 too)

  // expseg's own, beyond PyTorch's:
  // expandable: physical handles mapped (current: cuMemCreate handles held; allocated/freed count
  // every map and unmap, so a handle moved under a limit, unmapped and mapped elsewhere, counts in
  // both); split_merge: driver allocations.
  Stat physical_handles;
  std::int64_t num_free_blocks = 0;  // free blocks holding device memory (expandable: mapped ones), CuPy's n_free_blocks

  // --- CuPy's views of the same numbers ---
  std::int64_t used_bytes() const noexcept { return allocated_bytes[kAllPools].current; }
  std::int64_t total_bytes() const noexcept { return reserved_bytes[kAllPools].current; }
  std::int64_t free_bytes() const noexcept { return total_bytes() - used_bytes(); }
  std::int64_t n_free_blocks() const noexcept { return num_free_blocks; }

  void reset_peaks() noexcept;
  void reset_accumulated() noexcept;
  // Flat JSON object with PyTorch's keys ("allocated_bytes.all.current": ...), the counters, and a
  // "cupy" object {used_bytes, total_bytes, free_bytes, n_free_blocks}.
  std::string to_json() const;
  bool operator==(const Stats&) const = default;
};

// Time spent in one kind of driver call during a run (scenario, replay): measured around each call
// on a GPU, the latency model's figure on the simulated device (0 without sim_latency:true).
struct DriverCallTime {
  std::string call;  // "cuMemCreate", ...; "cuStreamSynchronize" also counts event and context syncs
  std::uint64_t calls = 0;
  double seconds = 0.0;
};
// {"cuMemCreate":{"calls":N,"seconds":S},...}: the driver_calls field of scenario and replay JSON.
std::string driver_calls_json(const std::vector<DriverCallTime>& calls);

}  // namespace expseg

#pragma GCC visibility pop
