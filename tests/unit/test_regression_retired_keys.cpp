// Retired keys (released graph pools, exited threads' per-thread streams) that keep live blocks:
//   - expandable: every change of the retired-keys generation (each release_graph_pool, each thread
//     exit) walked all arenas, the thousands of retired ones that keep live blocks too: a capture
//     loop keeping one output per graph paid O(graphs) per release. Now only the keys' arenas that
//     are not retired yet are walked.
//   - split_merge: the same walk over every stream's index at each generation change, and on every
//     slow path a walk of every exited thread's free index. Now a retired segment is looked at again
//     only once it has come wholly free.
// The scale cases failed on the code before the fix.
#include <doctest/doctest.h>

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "allocator_impl.hpp"
#include "backends/expandable/expandable.hpp"
#include "backends/split_merge/split_merge.hpp"
#include "driver/sim_driver.hpp"
#include "test_util.hpp"

using namespace testutil;
using expseg::Allocator;
using expseg::BackendKind;
using expseg::kAllPools;

namespace {

std::uint64_t steps(Allocator& a) {
  const auto& be = expseg::detail::AllocatorAccess::backend(a);
  if (const auto* e = dynamic_cast<const expseg::backends::ExpandableBackend*>(&be)) return e->slow_path_steps();
  return dynamic_cast<const expseg::backends::SplitMergeBackend&>(be).slow_path_steps();
}
std::size_t stream_indexes(Allocator& a) {
  return dynamic_cast<const expseg::backends::SplitMergeBackend&>(expseg::detail::AllocatorAccess::backend(a)).stream_indexes();
}

void* stream_no(int i) { return reinterpret_cast<void*>(static_cast<std::uintptr_t>(0x10000 + 16 * i)); }
void* const kPerThread = stream_id(2);

std::int64_t reserved(Allocator& a) { return a.stats().reserved_bytes[kAllPools].current; }
std::int64_t segments(Allocator& a) { return a.stats().segment[kAllPools].current; }

// Graph pool `id`, released with one block of `bytes` still allocated (a graph's output).
void* release_pool_with_output(Allocator& a, int id, std::size_t bytes = 512) {
  void* s = stream_no(0);
  a.begin_pool_allocations(static_cast<std::uint64_t>(id), s);
  void* out = a.allocate(bytes, s);
  a.end_pool_allocations(static_cast<std::uint64_t>(id), s);
  a.release_graph_pool(static_cast<std::uint64_t>(id));
  return out;
}

std::vector<void*> retire_pools_with_outputs(Allocator& a, int n, int first_pool = 1) {
  std::vector<void*> outputs;
  for (int i = first_pool; i < first_pool + n; ++i) outputs.push_back(release_pool_with_output(a, i));
  return outputs;
}

// A thread that leaves a block allocated on its per-thread stream as it exits.
void* exit_thread_with_block(Allocator& a, std::size_t bytes = 512) {
  void* p = nullptr;
  std::thread([&] { p = a.allocate(bytes, kPerThread); }).join();
  return p;
}

// A thread_local whose destructor allocates 64 MiB on cudaStreamPerThread once told to, after the
// thread's key has retired (made before the thread's first allocation there, so destroyed after).
void* t_late_got = nullptr;
struct LateRequest {
  Allocator* allocator = nullptr;
  std::atomic<int>* phase = nullptr;
  ~LateRequest() {
    if (allocator == nullptr) return;
    phase->store(1);
    while (phase->load() != 2) std::this_thread::yield();
    t_late_got = allocator->allocate(64 * MiB, kPerThread);
    phase->store(3);
  }
};
thread_local LateRequest t_late;

std::vector<void*> retire_threads_with_blocks(Allocator& a, int n) {
  std::vector<void*> blocks;
  for (int i = 0; i < n; ++i) blocks.push_back(exit_thread_with_block(a));
  return blocks;
}

// Frees `ptrs` and checks that release_cached then gives back everything but `left` segments.
void free_all_and_release(Allocator& a, const std::vector<void*>& ptrs, std::int64_t left = 0) {
  for (void* p : ptrs) a.deallocate(p);
  a.release_cached();
  CHECK(segments(a) == left);
  if (left == 0) CHECK(reserved(a) == 0);
  a.validate();
}

}  // namespace

TEST_SUITE("regression-retired-keys") {

TEST_CASE("expandable: a graph pool's release does not walk every released pool that keeps a live block") {
  // The old code: one step per arena at each release (2000 retired pools: 2000 steps a release).
  double per_release[2] = {};
  const int counts[2] = {100, 2000};
  for (int k = 0; k < 2; ++k) {
    const int n = counts[k];
    CAPTURE(n);
    Allocator a(sim_config(BackendKind::expandable, 1024 * GiB, "expandable_va_size:1GiB"));
    std::vector<void*> outputs = retire_pools_with_outputs(a, n);
    REQUIRE(segments(a) == n);
    const std::uint64_t steps0 = steps(a);
    for (int i = 0; i < 32; ++i) outputs.push_back(release_pool_with_output(a, n + 1 + i));
    per_release[k] = static_cast<double>(steps(a) - steps0) / 32.0;
    CAPTURE(per_release[k]);
    CHECK(segments(a) == n + 32);
    a.validate();
    free_all_and_release(a, outputs);
  }
  MESSAGE("expandable slow-path steps per release_graph_pool: " << per_release[0] << " with 100 released pools keeping an output, "
                                                                << per_release[1] << " with 2000");
  CHECK(per_release[1] <= per_release[0] + 4);  // flat in the number of retired arenas
  CHECK(per_release[1] < 100);
}

TEST_CASE("expandable: a thread's exit does not make the next slow allocation walk every exited thread's arena") {
  double per_exit[2] = {};
  const int counts[2] = {20, 400};
  for (int k = 0; k < 2; ++k) {
    const int n = counts[k];
    CAPTURE(n);
    Allocator a(sim_config(BackendKind::expandable, 1024 * GiB, "expandable_va_size:1GiB"));
    std::vector<void*> blocks = retire_threads_with_blocks(a, n);
    void* t = stream_no(1);
    std::vector<void*> held{a.allocate(64 * MiB, t)};  // notices the exits
    REQUIRE(segments(a) == n + 1);
    const std::uint64_t steps0 = steps(a);
    for (int i = 0; i < 32; ++i) {
      blocks.push_back(exit_thread_with_block(a));
      held.push_back(a.allocate(64 * MiB, t));  // a slow path: the generation has moved
    }
    per_exit[k] = static_cast<double>(steps(a) - steps0) / 32.0;
    CAPTURE(per_exit[k]);
    CHECK(segments(a) >= n + 33);  // t's 2 GiB span 1 GiB segments
    a.validate();
    for (void* p : held) a.deallocate(p);
    free_all_and_release(a, blocks);
  }
  MESSAGE("expandable slow-path steps per thread exit and slow allocation: " << per_exit[0] << " with 20 exited threads keeping a block, "
                                                                             << per_exit[1] << " with 400");
  CHECK(per_exit[1] <= per_exit[0] + 4);
  CHECK(per_exit[1] < 100);  // the old code: over 400
}

TEST_CASE("expandable: newly retired arenas are still found among thousands kept by live blocks") {
  Allocator a(sim_config(BackendKind::expandable, 1024 * GiB, "expandable_va_size:1GiB"));
  const std::vector<void*> outputs = retire_pools_with_outputs(a, 500);
  const std::vector<void*> blocks = retire_threads_with_blocks(a, 50);
  void* t = stream_no(1);
  void* held = a.allocate(2 * MiB, t);  // notices the exits
  REQUIRE(segments(a) == 551);
  a.validate();
  // A pool that keeps nothing: its arena goes at its release.
  void* s = stream_no(0);
  a.begin_pool_allocations(5000, s);
  a.deallocate(a.allocate(64 * MiB, s));
  a.end_pool_allocations(5000, s);
  CHECK(segments(a) == 552);
  a.release_graph_pool(5000);
  CHECK(segments(a) == 551);
  a.validate();
  // A thread that frees all it allocated: its arena goes at the next slow path.
  std::thread([&] { a.deallocate(a.allocate(64 * MiB, kPerThread)); }).join();
  CHECK(segments(a) == 552);
  a.deallocate(a.allocate(128 * MiB, t));
  CHECK(segments(a) == 551);
  a.validate();
  a.deallocate(held);
  std::vector<void*> all = outputs;
  all.insert(all.end(), blocks.begin(), blocks.end());
  free_all_and_release(a, all);
}

TEST_CASE("split_merge: a slow allocation does not look again at every exited thread that keeps a live block") {
  // The old code walked every exited thread's free index on every slow path: 400 threads, over 400
  // steps per slow allocation.
  double per_call[2] = {};
  const int counts[2] = {20, 400};
  for (int k = 0; k < 2; ++k) {
    const int n = counts[k];
    CAPTURE(n);
    Allocator a(sim_config(BackendKind::split_merge, 1024 * GiB));
    const std::vector<void*> blocks = retire_threads_with_blocks(a, n);
    REQUIRE(segments(a) == n);
    void* t = stream_no(1);
    std::vector<void*> held{a.allocate(64 * MiB, t)};  // notices the exits (one walk of the keys)
    const std::uint64_t steps0 = steps(a);
    const std::int64_t allocs0 = a.stats().num_device_alloc;
    for (int i = 0; i < 32; ++i) held.push_back(a.allocate(64 * MiB, t));
    REQUIRE(a.stats().num_device_alloc - allocs0 == 32);  // each a slow path
    per_call[k] = static_cast<double>(steps(a) - steps0) / 32.0;
    CAPTURE(per_call[k]);
    CHECK(segments(a) == n + 33);
    a.validate();
    for (void* p : held) a.deallocate(p);
    free_all_and_release(a, blocks);
  }
  MESSAGE("split_merge slow-path steps per slow allocation: " << per_call[0] << " with 20 exited threads keeping a block, " << per_call[1]
                                                              << " with 400");
  CHECK(per_call[1] <= per_call[0] + 4);  // flat in the number of retired keys
  CHECK(per_call[1] < 100);
}

TEST_CASE("split_merge: a slow allocation after a graph pool's release does not walk every released pool's index") {
  // The old code walked every stream's index at each generation change: 2000 released pools, over
  // 2000 steps at the first slow path after each release.
  double per_release[2] = {};
  const int counts[2] = {100, 2000};
  for (int k = 0; k < 2; ++k) {
    const int n = counts[k];
    CAPTURE(n);
    Allocator a(sim_config(BackendKind::split_merge, 1024 * GiB));
    std::vector<void*> outputs = retire_pools_with_outputs(a, n);
    void* t = stream_no(1);
    std::vector<void*> held{a.allocate(64 * MiB, t)};  // notices the releases
    REQUIRE(segments(a) == n + 1);
    const std::uint64_t steps0 = steps(a);
    const std::int64_t allocs0 = a.stats().num_device_alloc;
    for (int i = 0; i < 32; ++i) {
      outputs.push_back(release_pool_with_output(a, n + 1 + i));
      held.push_back(a.allocate(64 * MiB, t));  // a slow path: the generation has moved
    }
    REQUIRE(a.stats().num_device_alloc - allocs0 == 64);  // each output's segment, each 64 MiB's
    per_release[k] = static_cast<double>(steps(a) - steps0) / 32.0;
    CAPTURE(per_release[k]);
    CHECK(segments(a) == n + 65);
    a.validate();
    for (void* p : held) a.deallocate(p);
    free_all_and_release(a, outputs);
  }
  MESSAGE("split_merge slow-path steps per release and slow allocation: " << per_release[0] << " with 100 released pools keeping an output, "
                                                                          << per_release[1] << " with 2000");
  CHECK(per_release[1] <= per_release[0] + 4);
  CHECK(per_release[1] < 100);
}

TEST_CASE("split_merge: freeing an exited thread's last block gives its memory back at the next slow path") {
  auto sa = make_sim_allocator(sim_config(BackendKind::split_merge, 1024 * GiB));
  Allocator& a = *sa;
  const std::vector<void*> kept = retire_threads_with_blocks(a, 50);
  // One more thread leaves a 64 MiB block (a large segment of its own) and two small ones (one
  // small segment).
  void* big = nullptr;
  void* small1 = nullptr;
  void* small2 = nullptr;
  std::thread([&] {
    big = a.allocate(64 * MiB, kPerThread);
    small1 = a.allocate(512, kPerThread);
    small2 = a.allocate(512, kPerThread);
  }).join();
  void* t = stream_no(1);
  std::vector<void*> held{a.allocate(64 * MiB, t)};  // a slow path: notices the exits
  const std::int64_t segs = segments(a);
  REQUIRE(segs == 53);
  const std::size_t indexes = stream_indexes(a);
  a.validate();

  a.deallocate(big);  // its segment is wholly free now
  CHECK(reserved(a) == static_cast<std::int64_t>(51 * 2 * MiB + 128 * MiB));  // a free gives nothing back by itself
  a.validate();
  held.push_back(a.allocate(64 * MiB, t));  // the next slow path gives it back
  CHECK(segments(a) == segs);                // one gone, one made
  CHECK(reserved(a) == static_cast<std::int64_t>(51 * 2 * MiB + 128 * MiB));
  CHECK(stream_indexes(a) == indexes);  // the thread's small index keeps its key
  a.validate();

  a.deallocate(small1);  // its segment still holds small2: nothing to give back
  held.push_back(a.allocate(64 * MiB, t));
  CHECK(segments(a) == segs + 1);
  a.validate();

  a.deallocate(small2);  // the thread's last block
  held.push_back(a.allocate(64 * MiB, t));
  CHECK(segments(a) == segs + 1);  // its small segment gone, one made
  CHECK(reserved(a) == static_cast<std::int64_t>(50 * 2 * MiB + 256 * MiB));
  CHECK(stream_indexes(a) == indexes - 2);  // and its indexes, both pools'
  a.validate();

  for (void* p : held) a.deallocate(p);
  free_all_and_release(a, kept);
  CHECK(stream_indexes(a) == 0);
  sa.alloc.reset();
  CHECK(sa.sim->live().mem_allocs == 0);
}

TEST_CASE("split_merge: a released pool's freed output goes back at release_cached or the last retry, not at a slow path") {
  // PyTorch's releasePool: a released private pool's memory is given back by release_cached_blocks
  // (empty_cache, or the last retry before an OOM), not by a request's earlier steps.
  auto sa = make_sim_allocator(sim_config(BackendKind::split_merge, 1024 * GiB));
  Allocator& a = *sa;
  const std::vector<void*> kept = retire_pools_with_outputs(a, 50);
  void* big = release_pool_with_output(a, 1000, 64 * MiB);
  void* t = stream_no(1);
  std::vector<void*> held{a.allocate(64 * MiB, t)};  // a slow path: notices the releases
  REQUIRE(segments(a) == 52);
  a.validate();
  a.deallocate(big);
  held.push_back(a.allocate(64 * MiB, t));  // a slow path: the pool's 64 MiB stay
  CHECK(segments(a) == 53);
  CHECK(reserved(a) == static_cast<std::int64_t>(50 * 2 * MiB + 192 * MiB));
  a.validate();
  a.release_cached();  // they go now; the pools that keep an output stay
  CHECK(segments(a) == 52);
  CHECK(reserved(a) == static_cast<std::int64_t>(50 * 2 * MiB + 128 * MiB));
  a.validate();

  // Under a limit: the last retry before an OOM takes a released pool's freed memory back.
  void* big2 = release_pool_with_output(a, 1001, 64 * MiB);
  held.push_back(a.allocate(64 * MiB, t));  // notices the release
  a.deallocate(big2);
  const std::int64_t now = reserved(a);
  a.set_limit(static_cast<std::size_t>(now));
  CHECK(reserved(a) == now);  // a new limit gives back no released pool's memory
  const std::int64_t retries = a.stats().num_alloc_retries;
  void* fits = nullptr;
  CHECK_NOTHROW(fits = a.allocate(64 * MiB, t));
  CHECK(a.stats().num_alloc_retries == retries + 1);
  CHECK(a.stats().num_ooms == 0);
  CHECK(reserved(a) == now);
  a.validate();
  a.deallocate(fits);
  for (void* p : held) a.deallocate(p);
  a.set_limit(0);
  free_all_and_release(a, kept);
  CHECK(stream_indexes(a) == 0);
  sa.alloc.reset();
  CHECK(sa.sim->live().mem_allocs == 0);
}

TEST_CASE("split_merge: a late request on an exited thread's key makes a retired segment, given back once freed") {
  // A thread_local destructor may allocate on the thread's key after it retired (see
  // test_regression_ptkeys.cpp). Here the key is known retired before that request: its new
  // segment is a retired one, looked at once freed like the others.
  auto sa = make_sim_allocator(sim_config(BackendKind::split_merge, 1024 * GiB));
  Allocator& a = *sa;
  const std::vector<void*> kept = retire_threads_with_blocks(a, 20);
  void* t = stream_no(1);
  void* held = a.allocate(64 * MiB, t);
  std::atomic<int> phase{0};  // 1: the key is retired; 2: go on; 3: the late request is done
  void* small = nullptr;
  std::thread th([&] {
    t_late.allocator = &a;  // made first: destroyed after the object that retires the key
    t_late.phase = &phase;
    small = a.allocate(512, kPerThread);
  });
  while (phase.load() != 1) std::this_thread::yield();
  const std::int64_t segs = segments(a);
  a.deallocate(a.allocate(32 * MiB, t));  // a slow path: finds the key retired
  a.validate();
  phase.store(2);
  th.join();
  REQUIRE(phase.load() == 3);
  void* late = t_late_got;
  REQUIRE(late != nullptr);
  CHECK(segments(a) == segs + 2);  // t's 32 MiB, cached, and the late request's
  a.validate();
  // Each request below is larger than any block cached for t: a slow path, one segment made.
  a.deallocate(late);
  a.deallocate(a.allocate(48 * MiB, t));  // the late segment goes
  CHECK(segments(a) == segs + 2);         // one gone, one made
  a.validate();
  a.deallocate(small);
  a.deallocate(a.allocate(80 * MiB, t));
  CHECK(segments(a) == segs + 2);  // the thread's small segment gone, one made
  CHECK(stream_indexes(a) == 21);  // the 20 kept threads' and t's: the key's went with its memory
  a.validate();
  a.deallocate(held);
  free_all_and_release(a, kept);
  CHECK(stream_indexes(a) == 0);
}

}  // TEST_SUITE
