// Multi-threaded stress (see thread_stress.hpp).
#include "thread_stress.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#include "allocator_impl.hpp"
#include "driver/sim_driver.hpp"
#include "expseg/scenarios.hpp"

namespace fuzz {

namespace {

constexpr std::size_t KiB = std::size_t{1} << 10;

std::uint64_t word(std::uint64_t tag, std::size_t i) noexcept {
  std::uint64_t z = tag * 0x9E3779B97F4A7C15ULL + i;
  z = (z ^ (z >> 31)) * 0xBF58476D1CE4E5B9ULL;
  return z ^ (z >> 29);
}

// Every word of the first and last 512 bytes and one word per 4 KiB.
template <class F>
void sample(std::size_t words, F&& f) {
  for (std::size_t i = 0; i < words; i += (i < 64 || i + 64 >= words) ? 1 : 512) f(i);
}

struct Block {
  std::uint64_t* p = nullptr;
  std::size_t size = 0;
  std::uint64_t tag = 0;
  void* stream = nullptr;
};

}  // namespace

std::string ThreadStressResult::to_string() const {
  std::ostringstream os;
  os << allocs << " allocations, " << frees << " frees (" << cross_stream << " after record_stream), " << ooms << " OOMs, "
     << stats_reads << " stats reads, " << snapshots << " snapshots, " << validations << " validations, " << release_cached
     << " release_cached, " << limit_changes << " limit changes";
  return os.str();
}

ThreadStressResult run_thread_stress(const ThreadStressOptions& o) {
  expseg::Config c = expseg::Config::parse(o.extra_config);
  c.backend = o.backend;
  c.device = expseg::DeviceKind::sim;
  c.sim_capacity = o.capacity;
  c.sim_granularity = 64 * KiB;
  c.sim_host_backed = true;
  expseg::driver::SimOptions so;
  so.capacity = o.capacity;
  so.granularity = c.sim_granularity;
  so.host_backed = true;
  auto sim = std::make_shared<expseg::driver::SimDriver>(so);
  auto alloc = expseg::detail::AllocatorAccess::make(c, sim);
  const std::size_t base_limit = alloc->limit();

  std::vector<void*> streams{nullptr};
  for (int i = 0; i < 4; ++i) streams.push_back(sim->stream_create());

  ThreadStressResult total;
  std::mutex mu;
  std::atomic<bool> failed{false};
  auto fail = [&](const std::string& what) {
    std::lock_guard lock(mu);
    if (total.failure.empty()) total.failure = what;
    failed = true;
  };

  // Every live block of every thread, by address: a new block that overlaps one is a failure
  // whatever the patterns say (they are only sampled). Entries leave before their deallocate, so
  // a block handed out again at once never meets its own stale entry.
  std::map<std::uintptr_t, std::size_t> live_ranges;
  std::mutex live_mu;
  auto register_live = [&](const void* p, std::size_t size, unsigned t) {
    const auto addr = reinterpret_cast<std::uintptr_t>(p);
    std::lock_guard lock(live_mu);
    auto next = live_ranges.lower_bound(addr);
    const bool hits_next = next != live_ranges.end() && next->first < addr + size;
    const bool hits_prev = next != live_ranges.begin() && std::prev(next)->first + std::prev(next)->second > addr;
    if (hits_next || hits_prev) {
      const auto& other = hits_next ? *next : *std::prev(next);
      std::ostringstream os;
      os << "thread " << t << ": new block " << p << "+" << size << " overlaps live block " << reinterpret_cast<void*>(other.first)
         << "+" << other.second;
      fail(os.str());
    }
    live_ranges[addr] = size;
  };
  auto unregister_live = [&](const void* p) {
    std::lock_guard lock(live_mu);
    live_ranges.erase(reinterpret_cast<std::uintptr_t>(p));
  };

  auto worker = [&](unsigned t) {
    ThreadStressResult r;
    expseg::ScenarioRng rng(o.seed * 1000003 + t);
    std::vector<Block> mine;
    std::uint64_t next_tag = (static_cast<std::uint64_t>(t) << 40) + 1;
    auto check = [&](const Block& b, const char* when) {
      const std::size_t n = b.size / 8;
      bool ok = true;
      sample(n, [&](std::size_t i) { ok = ok && b.p[i] == word(b.tag, i); });
      if (!ok) {
        std::ostringstream os;
        os << "thread " << t << ": pattern of " << b.p << "+" << b.size << " corrupt " << when;
        fail(os.str());
      }
    };
    auto free_one = [&](std::size_t j) {
      check(mine[j], "at free");
      unregister_live(mine[j].p);
      alloc->deallocate(mine[j].p);
      ++r.frees;
      mine[j] = mine.back();
      mine.pop_back();
    };
    for (std::size_t i = 0; i < o.ops_per_thread && !failed; ++i) {
      try {
        const double u = rng.uniform();
        if (!mine.empty() && (u < 0.42 || mine.size() > 48)) {
          free_one(rng.below(mine.size()));
        } else if (u < 0.85) {
          // Mostly small, some large; sizes not multiples of 8 too.
          const std::size_t size = rng.uniform() < 0.9 ? rng.log_uniform(4, 18) : rng.log_uniform(18, 25);
          void* stream = streams[rng.below(streams.size())];
          void* p = nullptr;
          try {
            p = alloc->allocate(size, stream);
          } catch (const expseg::out_of_memory&) {
            ++r.ooms;
            for (std::size_t k = mine.size() / 2; k > 0; --k) free_one(rng.below(mine.size()));
            continue;
          }
          register_live(p, size, t);
          // Work another stream queued on a block before its free (below) must be done before the
          // block is handed out again: the allocator waits for an event recorded at the free.
          if (sim->queued_use_overlaps(reinterpret_cast<std::uintptr_t>(p), size)) {
            std::ostringstream os;
            os << "thread " << t << ": new block " << p << "+" << size
               << " handed out while another stream's work, queued before a free (record_stream), may still use it";
            fail(os.str());
          }
          Block b{static_cast<std::uint64_t*>(p), size, next_tag++, stream};
          if (!sim->is_accessible(reinterpret_cast<std::uintptr_t>(p), size)) fail("a new allocation is not accessible");
          sample(size / 8, [&](std::size_t k) { b.p[k] = word(b.tag, k); });
          mine.push_back(b);
          ++r.allocs;
        } else if (u < 0.90 && !mine.empty()) {
          // Another stream uses the block (work queued there, busy or not); free it right away, so
          // that it waits for that stream. The allocation stream's own work needs no wait: a block
          // goes back to that stream's cache, whose later requests are ordered after the work.
          const std::size_t j = rng.below(mine.size());
          void* user = streams[rng.below(streams.size())];
          if (user != mine[j].stream) sim->queue_use(user, reinterpret_cast<std::uintptr_t>(mine[j].p), mine[j].size);
          alloc->record_stream(mine[j].p, user);
          ++r.cross_stream;
          free_one(j);
        } else if (u < 0.95) {
          const expseg::Stats s = alloc->stats();
          ++r.stats_reads;
          const std::int64_t allocated = s.allocated_bytes[expseg::kAllPools].current;
          const std::int64_t active = s.active_bytes[expseg::kAllPools].current;
          const std::int64_t reserved = s.reserved_bytes[expseg::kAllPools].current;
          if (!(allocated <= active && active <= reserved && reserved <= static_cast<std::int64_t>(o.capacity)))
            fail("stats identities broken in a concurrent read");
          if (s.total_bytes() != s.used_bytes() + s.free_bytes()) fail("CuPy total != used + free");
          for (const Block& b : mine) check(b, "in a periodic check");
        } else if (u < 0.97) {
          const expseg::Snapshot snap = alloc->snapshot();
          ++r.snapshots;
          for (const auto& seg : snap.segments) {
            std::uint64_t expect = seg.address;
            for (const auto& b : seg.blocks) {
              if (b.address != expect) fail("a concurrent snapshot's blocks do not tile their segment");
              expect = b.address + b.size;
            }
          }
          if (rng.uniform() < 0.1) (void)snap.to_json();
        } else if (u < 0.98) {
          alloc->validate();
          ++r.validations;
        } else if (t == 0) {
          // Thread 0 also plays the other streams' work, release_cached and the limit.
          const double v = rng.uniform();
          if (v < 0.4) {
            for (std::size_t s = 0; s < streams.size(); ++s) sim->set_stream_busy(streams[s], rng.uniform() < 0.3);
          } else if (v < 0.7) {
            alloc->release_cached();
            ++r.release_cached;
          } else {
            alloc->set_limit(rng.uniform() < 0.5 ? base_limit : o.capacity * 3 / 4);
            ++r.limit_changes;
          }
        }
      } catch (const std::exception& e) {
        fail(std::string("thread ") + std::to_string(t) + ": " + e.what());
      }
    }
    if (t == 0)
      for (void* s : streams) sim->set_stream_busy(s, false);
    try {
      while (!mine.empty()) free_one(mine.size() - 1);
    } catch (const std::exception& e) {
      fail(std::string("final free: ") + e.what());
    }
    std::lock_guard lock(mu);
    total.allocs += r.allocs;
    total.frees += r.frees;
    total.ooms += r.ooms;
    total.cross_stream += r.cross_stream;
    total.stats_reads += r.stats_reads;
    total.snapshots += r.snapshots;
    total.validations += r.validations;
    total.release_cached += r.release_cached;
    total.limit_changes += r.limit_changes;
  };

  std::vector<std::thread> threads;
  for (unsigned t = 0; t < o.threads; ++t) threads.emplace_back(worker, t);
  for (auto& th : threads) th.join();
  if (!total.failure.empty()) return total;

  for (void* s : streams) sim->set_stream_busy(s, false);
  try {
    alloc->validate();
    alloc->release_cached();
    alloc->validate();
    const expseg::Stats s = alloc->stats();
    if (s.allocation[expseg::kAllPools].current != 0 || s.active_bytes[expseg::kAllPools].current != 0 ||
        s.reserved_bytes[expseg::kAllPools].current != 0)
      total.failure = "memory held after every thread freed everything and release_cached";
  } catch (const std::exception& e) {
    total.failure = std::string("after the threads: ") + e.what();
  }
  // Memory unmapped while work queued on it (record_stream's) may still have used it.
  if (const auto h = sim->hazards(); total.failure.empty() && !h.empty()) total.failure = "unmapped under queued work: " + h.front();
  alloc.reset();
  for (std::size_t i = 1; i < streams.size(); ++i) sim->stream_destroy(streams[i]);
  const auto live = sim->live();
  if (total.failure.empty() && (live.reservations || live.handles || live.mappings || live.mem_allocs || live.events || live.physical_bytes))
    total.failure = "driver resources leaked after destroying the allocator";
  return total;
}

}  // namespace fuzz
