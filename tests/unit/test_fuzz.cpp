// Model-based fuzzing, fixed seeds (tests/common/fuzz_harness.hpp): every option preset of both
// backends runs a randomized operation sequence on the host-backed simulated device, with injected
// driver faults, checking validate(), the model, the stats identities and every byte pattern after
// each operation. The long runs are in the stress suite (tests/stress/test_fuzz_stress.cpp).
#include <doctest/doctest.h>

#include <sys/mman.h>

#include <string>
#include <utility>
#include <vector>

#include "driver/sim_driver.hpp"
#include "fuzz_harness.hpp"
#include "test_util.hpp"

TEST_SUITE("fuzz") {

TEST_CASE("fuzz: fixed seeds on every preset of both backends") {
  fuzz::Counters total;
  for (std::size_t i = 0; i < fuzz::preset_count(); ++i) {
    const fuzz::Options o = fuzz::preset(i);
    CAPTURE(o.describe());
    for (std::uint64_t seed : {1u, 2u}) {
      CAPTURE(seed);
      try {
        total.add(fuzz::run_seed(o, seed, 1000,
                                 "EXPSEG_FUZZ_REPLAY=" + std::to_string(i) + ":" + std::to_string(seed) + ":1000 build/tests/expseg_stress -ts=fuzz"));
      } catch (const fuzz::Failure& f) {
        FAIL(std::string(f.what()));
      }
    }
  }
  MESSAGE("fuzz (unit): " << total.to_string());
  // The run reached what it is meant to reach.
  CHECK(total.allocs > 5000);
  CHECK(total.pending_frees > 100);
  CHECK(total.ooms > 50);
  CHECK(total.faults_fired > 20);
  CHECK(total.driver_errors > 5);
  CHECK(total.unmaps > 100);
  CHECK(total.busy_uses > 100);  // the simulated device's own stream-safety check has work to watch
  CHECK(total.invalid_pointer_checks > 100);
}

TEST_CASE("fuzz: graph captures into graph pools, launches and destroys, beside everything else") {
  // CUDA graph capture (Allocator::begin_graph_pool) among the usual operations: a capture's blocks
  // stay apart from everything outside its pool, launches write only the pool's memory, no call of
  // expseg invalidates the capture, and release_cached/set_limit are refused during it.
  fuzz::Counters total;
  for (std::size_t i = 0; i < fuzz::preset_count(); ++i) {
    fuzz::Options o = fuzz::preset(i);
    o.graphs = true;
    CAPTURE(o.describe());
    for (std::uint64_t seed : {1u, 2u}) {
      CAPTURE(seed);
      try {
        total.add(fuzz::run_seed(o, seed, 500,
                                 "EXPSEG_FUZZ_GRAPHS=1 EXPSEG_FUZZ_REPLAY=" + std::to_string(i) + ":" + std::to_string(seed) +
                                     ":500 build/tests/expseg_stress -ts=fuzz"));
      } catch (const fuzz::Failure& f) {
        FAIL(std::string(f.what()));
      }
    }
  }
  MESSAGE("fuzz (graphs): " << total.to_string());
  CHECK(total.captures > 20);
  CHECK(total.capture_allocs > 50);
  CHECK(total.forks > 10);
  CHECK(total.fork_allocs > 20);
  CHECK(total.launches > 20);
  CHECK(total.refused_in_capture > 5);
}

TEST_CASE("fuzz: a seed gives the same run again, whatever else the process mapped in between" * doctest::skip(testutil::kThreadSanitizer)) {
  // Was: the host-backed simulated device handed out the addresses mmap chose, which move with ASLR
  // and with every other mapping of the process, and best fit and the harness's choices follow
  // address order: the replay command a failing run printed could run another operation sequence.
  for (std::size_t i = 0; i < fuzz::preset_count(); ++i) {
    const fuzz::Options o = fuzz::preset(i);
    CAPTURE(o.describe());
    try {
      const fuzz::Counters first = fuzz::run_seed(o, 3, 200);
      // Mappings the run knows nothing of (another test's, the program's) shift where mmap places memory.
      std::vector<std::pair<void*, std::size_t>> held;
      for (std::size_t bytes : {std::size_t{3} << 12, std::size_t{9} << 20, std::size_t{65} << 20}) {
        void* m = ::mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        REQUIRE(m != MAP_FAILED);
        held.emplace_back(m, bytes);
      }
      const fuzz::Counters second = fuzz::run_seed(o, 3, 200);
      for (auto [m, bytes] : held) ::munmap(m, bytes);
      CHECK(second.allocs == first.allocs);
      CHECK(second.ooms == first.ooms);
      CHECK(second.to_string() == first.to_string());  // the digest covers every address allocate returned
    } catch (const fuzz::Failure& f) {
      FAIL(std::string(f.what()));
    }
  }
}

TEST_CASE("fuzz: a seed run beside another simulated device takes the same path") {
  // The stress suite runs harnesses in parallel, each on its own device 0; its replay runs alone.
  // A driver alive at the same time puts the arena elsewhere: every address moves by the same
  // amount and nothing else changes (the digest, which holds the addresses, aside).
  auto without_digest = [](const fuzz::Counters& c) {
    const std::string s = c.to_string();
    return s.substr(0, s.rfind(", digest "));
  };
  for (std::size_t i = 0; i < fuzz::preset_count(); ++i) {
    const fuzz::Options o = fuzz::preset(i);
    CAPTURE(o.describe());
    try {
      const fuzz::Counters alone = fuzz::run_seed(o, 4, 200);
      expseg::driver::SimOptions so;
      so.host_backed = true;
      so.capacity = o.capacity;
      so.granularity = o.granularity;
      expseg::driver::SimDriver other(so);
      const auto held = other.mem_alloc(o.granularity);  // its arena now holds device 0's slot
      const fuzz::Counters beside = fuzz::run_seed(o, 4, 200);
      other.mem_free(held);
      CHECK(without_digest(beside) == without_digest(alone));
      CHECK(beside.digest != alone.digest);  // it did run elsewhere
    } catch (const fuzz::Failure& f) {
      FAIL(std::string(f.what()));
    }
  }
}

TEST_CASE("fuzz: destroying the allocator with live allocations after a run leaks nothing") {
  for (std::size_t i : {0u, 3u, 4u, 6u}) {
    fuzz::Options o = fuzz::preset(i);
    CAPTURE(o.describe());
    try {
      fuzz::Harness h(o);
      fuzz::RngSource src(42 + i);
      h.run(src, 400);
      CHECK(h.counters().ops == 400);
      CHECK(h.live_allocations() > 0);  // else the destruction below frees nothing live
      h.finish(false);
    } catch (const fuzz::Failure& f) {
      FAIL(std::string(f.what()));
    }
  }
}

TEST_CASE("fuzz: the libFuzzer byte decoding drives the same harness") {
  // A few fixed inputs through options_from/ByteSource, as tests/fuzz/fuzz_allocator.cpp reads them.
  fuzz::Counters total;
  int finished_by_freeing = 0;
  int finished_by_destroying = 0;
  for (std::uint64_t seed : {7u, 8u, 9u, 10u, 11u, 12u}) {
    std::string bytes(1500, '\0');
    fuzz::RngSource rng(seed);
    for (char& c : bytes) c = static_cast<char>(rng.next64());
    CAPTURE(seed);
    try {
      fuzz::ByteSource src(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size());
      fuzz::Harness h(fuzz::options_from(src));
      // Read before the operations: past the end every byte reads 0, which would always pick destroy.
      const bool free_all = src.byte() % 4 != 0;
      h.run(src, 2000);
      // The input drives operations until its bytes run out (each takes a few): not none, not all 2000.
      CHECK(h.counters().ops > 100);
      CHECK(h.counters().ops < 2000);
      CHECK(src.exhausted());
      h.finish(free_all);
      ++(free_all ? finished_by_freeing : finished_by_destroying);
      total.add(h.counters());
    } catch (const fuzz::Failure& f) {
      FAIL(std::string(f.what()));
    }
  }
  MESSAGE("fuzz (byte inputs): " << total.to_string());
  CHECK(total.allocs > 100);
  CHECK(total.frees > 20);
  // Both endings ran: free everything + release_cached + leak check, and destroy with blocks live.
  CHECK(finished_by_freeing > 0);
  CHECK(finished_by_destroying > 0);
  // Empty and one-byte inputs are valid too.
  for (std::size_t n : {0u, 1u, 2u}) {
    const std::uint8_t data[2] = {0xff, 0x01};
    fuzz::ByteSource src(data, n);
    fuzz::Harness h(fuzz::options_from(src));
    h.run(src, 10);
    CHECK(h.counters().ops == 0);  // the options took what bytes there were
    h.finish();
  }
}

}  // TEST_SUITE

#include "thread_stress.hpp"

TEST_SUITE("fuzz") {

TEST_CASE("fuzz: 16 threads allocate, free, record streams and read stats and snapshots at once") {
  for (const fuzz::ThreadStressCase& c : fuzz::kThreadStressCases) {
    fuzz::ThreadStressOptions o;
    o.backend = c.backend;
    o.extra_config = c.config;
    o.threads = 16;
    o.ops_per_thread = 200;
    o.seed = 5;
    INFO("backend: " << std::string(expseg::to_string(c.backend)));
    INFO("config: " << std::string(c.config));
    const fuzz::ThreadStressResult r = fuzz::run_thread_stress(o);
    CHECK_MESSAGE(r.failure.empty(), r.failure);
    CHECK(r.allocs > 500);
  }
  // The same under a limit this short run reaches (the cases' own limits bind only in the longer
  // stress runs): OOMs in the middle of the other threads' traffic, the allocator consistent after.
  for (const fuzz::ThreadStressCase& c : fuzz::kThreadStressCases) {
    fuzz::ThreadStressOptions o;
    o.backend = c.backend;
    o.extra_config = std::string(c.config) + (std::string_view(c.config).empty() ? "" : ",") + "limit:24MiB";
    o.threads = 16;
    o.ops_per_thread = 200;
    o.seed = 6;
    INFO("backend: " << std::string(expseg::to_string(c.backend)));
    INFO("config: " << o.extra_config);
    const fuzz::ThreadStressResult r = fuzz::run_thread_stress(o);
    INFO(r.to_string());
    CHECK_MESSAGE(r.failure.empty(), r.failure);
    CHECK(r.ooms > 0);
    // Requests made, served or not: a thread holding one block of nearly the whole limit, descheduled
    // on a 2-core machine while the others' requests fail, leaves some runs with ~100 served (3 of 10).
    CHECK(r.allocs + r.ooms > 500);
    CHECK(r.allocs > 0);
  }
}

}  // TEST_SUITE
