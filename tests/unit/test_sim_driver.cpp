// SimDriver specifics: capacity, foreign usage, fault injection, leak counters, CUDA rule
// enforcement, host-backed data, stream/event semantics, latency model, peers, sharing, threads.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "driver/sim_driver.hpp"
#include "driver_contract.hpp"

using namespace expseg::driver;
using expseg::driver_error;
using expseg::test::catch_driver_error;

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;

SimOptions host_backed(std::size_t capacity = 64 * MiB) {
  SimOptions o;
  o.host_backed = true;
  o.capacity = capacity;
  return o;
}

void check_same(const SimDriver::Live& a, const SimDriver::Live& b) {
  CHECK(a.reservations == b.reservations);
  CHECK(a.handles == b.handles);
  CHECK(a.mappings == b.mappings);
  CHECK(a.mem_allocs == b.mem_allocs);
  CHECK(a.events == b.events);
  CHECK(a.streams == b.streams);
  CHECK(a.physical_bytes == b.physical_bytes);
}

void check_nothing_left(const SimDriver& d) { check_same(d.live(), SimDriver::Live{}); }

// `f` must throw driver_error(code 1, CUDA_ERROR_INVALID_VALUE) from `call` and change nothing.
template <class F>
void check_invalid(SimDriver& d, const char* call, F&& f) {
  const SimDriver::Live before = d.live();
  const double seconds = d.simulated_seconds();
  auto err = catch_driver_error(f);
  REQUIRE_MESSAGE(err.has_value(), "expected a driver_error from " << call);
  CHECK(err->call() == call);
  CHECK(err->code() == 1);
  CHECK(err->code_name() == "CUDA_ERROR_INVALID_VALUE");
  CHECK_FALSE(err->is_out_of_memory());
  check_same(d.live(), before);
  CHECK(d.simulated_seconds() == seconds);
}

std::size_t open_fds() {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

// The process's memory mappings (/proc/self/maps): how many, and their bytes in all.
struct Mappings {
  std::size_t count = 0;
  std::uint64_t bytes = 0;
};
Mappings process_mappings() {
  Mappings m;
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    std::uint64_t lo = 0;
    std::uint64_t hi = 0;
    const auto dash = line.find('-');
    const auto space = line.find(' ');
    if (dash == std::string::npos || space == std::string::npos) continue;
    lo = std::stoull(line.substr(0, dash), nullptr, 16);
    hi = std::stoull(line.substr(dash + 1, space - dash - 1), nullptr, 16);
    ++m.count;
    m.bytes += hi - lo;
  }
  return m;
}

std::vector<std::uint32_t> read_words(SimDriver& d, dev_ptr p, std::size_t bytes) {
  std::vector<std::uint32_t> v(bytes / 4);
  d.copy_to_host(v.data(), p, bytes);
  return v;
}

}  // namespace

TEST_SUITE("sim") {
  TEST_CASE("sim: options are validated") {
    auto with = [](auto&& edit) {
      SimOptions o;
      edit(o);
      return o;
    };
    CHECK_THROWS_AS(SimDriver(with([](SimOptions& o) { o.capacity = 0; })), std::invalid_argument);
    CHECK_THROWS_AS(SimDriver(with([](SimOptions& o) { o.granularity = 0; })), std::invalid_argument);
    CHECK_THROWS_AS(SimDriver(with([](SimOptions& o) { o.granularity = 3 * MiB; })), std::invalid_argument);
    CHECK_THROWS_AS(SimDriver(with([](SimOptions& o) { o.granularity = 1024; })), std::invalid_argument);
    CHECK_THROWS_AS(SimDriver(with([](SimOptions& o) { o.device_count = 0; })), std::invalid_argument);
    CHECK_THROWS_AS(SimDriver(with([](SimOptions& o) { o.device = 1; })), std::invalid_argument);
    CHECK_THROWS_WITH_AS(SimDriver(with([](SimOptions& o) { o.granularity = 3 * MiB; })),
                         doctest::Contains("power of two"), std::invalid_argument);
    CHECK_NOTHROW(SimDriver(with([](SimOptions& o) { o.granularity = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE)); })));
    SimDriver d;
    CHECK(std::string(d.kind()) == "sim");
    CHECK(d.granularity() == 2 * MiB);
    CHECK(d.mem_info().total == 80 * GiB);
    CHECK(d.mem_info().free == 80 * GiB);
  }

  TEST_CASE("sim: capacity OOM") {
    SimOptions o;
    o.capacity = 8 * MiB;
    SimDriver d(o);
    std::vector<phys_handle> hs;
    for (int i = 0; i < 4; ++i) hs.push_back(d.create(2 * MiB));
    CHECK(d.mem_info().free == 0);
    const SimDriver::Live before = d.live();
    auto err = catch_driver_error([&] { (void)d.create(2 * MiB); });
    REQUIRE(err.has_value());
    CHECK(err->is_out_of_memory());
    CHECK(err->code() == 2);
    CHECK(err->code_name() == "CUDA_ERROR_OUT_OF_MEMORY");
    CHECK(err->call() == "cuMemCreate");
    CHECK(std::string(err->what()).find("cuMemCreate") != std::string::npos);
    check_same(d.live(), before);
    CHECK(d.calls(Op::create) == 5);

    auto err2 = catch_driver_error([&] { (void)d.mem_alloc(1); });
    REQUIRE(err2.has_value());
    CHECK(err2->is_out_of_memory());
    CHECK(err2->call() == "cuMemAlloc");

    d.release(hs.back());
    hs.pop_back();
    CHECK(d.mem_info().free == 2 * MiB);
    const dev_ptr p = d.mem_alloc(MiB);  // fits now
    CHECK(d.live().physical_bytes == 7 * MiB);
    CHECK_THROWS_AS(d.create(2 * MiB), driver_error);  // 1 MiB left
    d.mem_free(p);
    hs.push_back(d.create(2 * MiB));
    for (auto h : hs) d.release(h);
    check_nothing_left(d);
  }

  TEST_CASE("sim: foreign usage") {
    SimOptions o;
    o.capacity = 10 * MiB;
    SimDriver d(o);
    d.set_foreign_usage(6 * MiB);
    CHECK(d.mem_info().total == 10 * MiB);
    CHECK(d.mem_info().free == 4 * MiB);
    const phys_handle h = d.create(4 * MiB);
    CHECK(d.mem_info().free == 0);
    auto err = catch_driver_error([&] { (void)d.create(2 * MiB); });
    REQUIRE(err.has_value());
    CHECK(err->is_out_of_memory());
    d.set_foreign_usage(20 * MiB);  // more than the capacity: nothing free, no underflow
    CHECK(d.mem_info().free == 0);
    d.set_foreign_usage(0);
    CHECK(d.mem_info().free == 6 * MiB);
    const phys_handle h2 = d.create(6 * MiB);
    d.release(h);
    d.release(h2);
    check_nothing_left(d);
  }

  TEST_CASE("sim: fault injection along the whole VMM sequence") {
    // For each op: arm the 2nd call, the 1st succeeds, the 2nd fails with the fault and changes
    // nothing, the 3rd succeeds again.
    SimDriver d(host_backed());
    const std::size_t g = d.granularity();
    int k = 0;  // how many calls of the current step have succeeded
    dev_ptr base = 0;
    std::vector<dev_ptr> bases;
    std::vector<phys_handle> hs;
    std::vector<dev_ptr> ptrs;

    auto step = [&](Op op, Fault fault, const char* call, const std::function<void()>& once) {
      const std::string name = call;
      CAPTURE(name);
      k = 0;
      const std::uint64_t calls0 = d.calls(op);
      d.inject_fault(op, 2, fault);
      once();
      CHECK(k == 1);
      const SimDriver::Live before = d.live();
      const bool was_accessible = base != 0 && d.is_accessible(base + std::size_t(k) * g, g);
      auto err = catch_driver_error(once);
      REQUIRE(err.has_value());
      CHECK(err->call() == call);
      if (fault == Fault::out_of_memory) {
        CHECK(err->code() == 2);
        CHECK(err->is_out_of_memory());
      } else {
        CHECK(err->code() == 999);
        CHECK(err->code_name() == "CUDA_ERROR_UNKNOWN");
        CHECK(std::string(err->what()).find("fault injected by the simulated device") != std::string::npos);
      }
      CHECK(k == 1);
      check_same(d.live(), before);
      if (base != 0) CHECK(d.is_accessible(base + std::size_t(k) * g, g) == was_accessible);
      once();
      CHECK(k == 2);
      CHECK(d.calls(op) == calls0 + 3);  // the failed call is counted
    };

    step(Op::reserve, Fault::out_of_memory, "cuMemAddressReserve", [&] { bases.push_back(d.reserve(4 * g)); ++k; });
    CHECK(bases.size() == 2);
    base = bases[0];
    step(Op::create, Fault::out_of_memory, "cuMemCreate", [&] { hs.push_back(d.create(g)); ++k; });
    step(Op::map, Fault::error, "cuMemMap", [&] { d.map(base + k * g, g, hs[std::size_t(k)]); ++k; });
    step(Op::set_access, Fault::error, "cuMemSetAccess", [&] { d.set_access(base + k * g, g); ++k; });
    step(Op::unmap, Fault::out_of_memory, "cuMemUnmap", [&] { d.unmap(base + k * g, g); ++k; });
    step(Op::release, Fault::error, "cuMemRelease", [&] { d.release(hs[std::size_t(k)]); ++k; });
    base = 0;
    step(Op::free_reserve, Fault::error, "cuMemAddressFree", [&] { d.free_reserve(bases[std::size_t(k)], 4 * g); ++k; });
    step(Op::mem_alloc, Fault::out_of_memory, "cuMemAlloc", [&] { ptrs.push_back(d.mem_alloc(1000)); ++k; });
    step(Op::mem_free, Fault::error, "cuMemFree", [&] { d.mem_free(ptrs[std::size_t(k)]); ++k; });

    const event_t e = d.event_create();
    step(Op::event_record, Fault::error, "cuEventRecord", [&] { d.event_record(e, nullptr); ++k; });
    step(Op::event_query, Fault::error, "cuEventQuery", [&] {
      const bool done = d.event_query(e);
      CHECK(done);
      ++k;
    });
    step(Op::stream_sync, Fault::error, "cuStreamSynchronize", [&] { d.stream_synchronize(nullptr); ++k; });
    step(Op::stream_sync, Fault::out_of_memory, "cuEventSynchronize", [&] { d.event_synchronize(e); ++k; });
    step(Op::stream_sync, Fault::error, "cuCtxSynchronize", [&] { d.device_synchronize(); ++k; });
    d.event_destroy(e);
    check_nothing_left(d);
  }

  TEST_CASE("sim: fault injection details") {
    SimDriver d;
    const std::size_t g = d.granularity();
    CHECK_THROWS_AS(d.inject_fault(Op::create, 0, Fault::error), std::invalid_argument);
    CHECK_THROWS_AS(d.inject_fault(Op::count_, 1, Fault::error), std::invalid_argument);

    // Several pending at once, on one op and on different ops; counting is per op.
    d.inject_fault(Op::create, 1, Fault::out_of_memory);
    d.inject_fault(Op::create, 3, Fault::error);
    d.inject_fault(Op::mem_alloc, 1, Fault::error);
    CHECK_THROWS_AS(d.create(g), driver_error);
    const phys_handle h = d.create(g);
    auto err = catch_driver_error([&] { (void)d.create(g); });
    REQUIRE(err.has_value());
    CHECK(err->code() == 999);
    CHECK(d.live().handles == 1);
    CHECK(d.calls(Op::create) == 3);
    CHECK_THROWS_AS(d.mem_alloc(g), driver_error);
    CHECK(d.live().mem_allocs == 0);

    // clear_faults disarms everything.
    d.inject_fault(Op::release, 1, Fault::error);
    d.clear_faults();
    d.release(h);

    // Export/import faults (posix_fd bookkeeping).
    SimOptions o;
    o.shareable = ShareableHandle::posix_fd;
    SimDriver s(o);
    const phys_handle h2 = s.create(g);
    s.inject_fault(Op::export_handle, 1, Fault::error);
    CHECK(catch_driver_error([&] { (void)s.export_handle(h2); }).value().call() == "cuMemExportToShareableHandle");
    const ExportedHandle ex = s.export_handle(h2);
    CHECK((::fcntl(ex.fd, F_GETFD) & FD_CLOEXEC) != 0);  // as the CUDA driver layer's are
    s.inject_fault(Op::import_handle, 1, Fault::out_of_memory);
    CHECK(catch_driver_error([&] { (void)s.import_handle(ex); }).value().is_out_of_memory());
    CHECK(s.live().handles == 1);
    const phys_handle h3 = s.import_handle(ex);
    CHECK(s.live().handles == 2);
    s.release(h2);
    s.release(h3);
    check_nothing_left(s);
    CHECK(s.calls(Op::export_handle) == 2);
    CHECK(s.calls(Op::import_handle) == 2);

    // Stream queries: either one counts as Op::stream_query, and fails with the call's own name.
    const stream_t st = d.stream_create();
    d.inject_fault(Op::stream_query, 2, Fault::error);
    CHECK(d.stream_capture_id(st) == 0);
    CHECK(catch_driver_error([&] { (void)d.stream_is_blocking(st); }).value().call() == "cuStreamGetFlags");
    d.inject_fault(Op::stream_query, 1, Fault::error);
    CHECK(catch_driver_error([&] { (void)d.stream_capture_id(st); }).value().call() == "cuStreamGetCaptureInfo");
    CHECK_FALSE(d.stream_is_blocking(st));
    CHECK(d.calls(Op::stream_query) == 4);
    d.stream_destroy(st);
  }

  TEST_CASE("sim: leak counters") {
    SimDriver d;
    const std::size_t g = d.granularity();
    const dev_ptr base = d.reserve(4 * g);
    const phys_handle h = d.create(2 * g);
    d.map(base, 2 * g, h);
    d.set_access(base, 2 * g);
    const dev_ptr p = d.mem_alloc(12345);
    const stream_t s = d.stream_create();
    const event_t e = d.event_create();
    SimDriver::Live l = d.live();
    CHECK(l.reservations == 1);
    CHECK(l.handles == 1);
    CHECK(l.mappings == 1);
    CHECK(l.mem_allocs == 1);
    CHECK(l.events == 1);
    CHECK(l.streams == 1);
    CHECK(l.physical_bytes == 2 * g + 12345);
    d.event_destroy(e);
    d.stream_destroy(s);
    d.mem_free(p);
    d.unmap(base, 2 * g);
    d.release(h);
    d.free_reserve(base, 4 * g);
    check_nothing_left(d);
    CHECK(d.calls(Op::map) == 1);
    CHECK(d.calls(Op::reserve) == 1);
    CHECK(d.calls(Op::event_record) == 0);
  }

  TEST_CASE("sim: a released handle keeps its memory until unmapped") {
    SimDriver d(host_backed());
    const std::size_t g = d.granularity();
    const dev_ptr base = d.reserve(2 * g);
    const phys_handle h = d.create(g);
    d.map(base, g, h);
    d.set_access(base, g);
    d.memset_d32(base, 0x77777777u, g / 4, nullptr);
    d.release(h);
    CHECK(d.live().handles == 0);
    CHECK(d.live().mappings == 1);
    CHECK(d.live().physical_bytes == g);
    CHECK(d.mem_info().free == 64 * MiB - g);
    expseg::test::check_words(d, base, g / 4, 0x77777777u);
    check_invalid(d, "cuMemRelease", [&] { d.release(h); });  // already released
    d.unmap(base, g);
    CHECK(d.live().physical_bytes == 0);
    d.free_reserve(base, 2 * g);
    check_nothing_left(d);
  }

  TEST_CASE("sim: CUDA rules are enforced with code 1 and no effect") {
    SimDriver d(host_backed());
    const std::size_t g = d.granularity();
    const dev_ptr base = d.reserve(8 * g);
    const phys_handle h1 = d.create(g);
    const phys_handle h2 = d.create(2 * g);
    const phys_handle h3 = d.create(g);
    d.map(base + g, 2 * g, h2);  // granules 1-2
    d.set_access(base + g, 2 * g);
    d.memset_d32(base + g, 0x12345678u, 2 * g / 4, nullptr);

    SUBCASE("granularity") {
      check_invalid(d, "cuMemAddressReserve", [&] { (void)d.reserve(g + 4096); });
      check_invalid(d, "cuMemAddressReserve", [&] { (void)d.reserve(0); });
      check_invalid(d, "cuMemCreate", [&] { (void)d.create(g / 2); });
      check_invalid(d, "cuMemCreate", [&] { (void)d.create(0); });
      check_invalid(d, "cuMemMap", [&] { d.map(base + 4096, g, h1); });
      check_invalid(d, "cuMemSetAccess", [&] { d.set_access(base + g, g + 4096); });
      check_invalid(d, "cuMemUnmap", [&] { d.unmap(base + g + 4096, g); });
      check_invalid(d, "cuMemAlloc", [&] { (void)d.mem_alloc(0); });
    }
    SUBCASE("map outside a reservation or over a mapping") {
      check_invalid(d, "cuMemMap", [&] { d.map(base + 8 * g, g, h1); });      // just past the end
      check_invalid(d, "cuMemMap", [&] { d.map(base + 7 * g, 2 * g, h2); });  // straddles the end
      check_invalid(d, "cuMemMap", [&] { d.map(base - g, g, h1); });          // just before
      check_invalid(d, "cuMemMap", [&] { d.map(0x1000000000, g, h1); });
      check_invalid(d, "cuMemMap", [&] { d.map(base + g, g, h1); });          // on h2's start
      check_invalid(d, "cuMemMap", [&] { d.map(base + 2 * g, g, h1); });      // inside h2
      check_invalid(d, "cuMemMap", [&] { d.map(base, 2 * g, h2); });         // overlaps h2's start
      check_invalid(d, "cuMemMap", [&] { d.map(base + 3 * g, 2 * g, h1); }); // size != handle size
      check_invalid(d, "cuMemMap", [&] { d.map(base + 3 * g, g, 424242); }); // unknown handle
      CHECK_FALSE(d.is_accessible(base + 3 * g, g));
    }
    SUBCASE("unmap whole mappings only") {
      check_invalid(d, "cuMemUnmap", [&] { d.unmap(base + g, g); });          // half of h2
      check_invalid(d, "cuMemUnmap", [&] { d.unmap(base + 2 * g, g); });      // other half
      check_invalid(d, "cuMemUnmap", [&] { d.unmap(base, 3 * g); });          // unmapped granule + h2
      check_invalid(d, "cuMemUnmap", [&] { d.unmap(base + g, 3 * g); });      // h2 + unmapped granule
      check_invalid(d, "cuMemUnmap", [&] { d.unmap(base + 5 * g, g); });      // nothing there
      d.map(base + 4 * g, g, h1);
      check_invalid(d, "cuMemUnmap", [&] { d.unmap(base + g, 4 * g); });      // gap at granule 3
      d.map(base + 3 * g, g, h3);
      d.unmap(base + g, 4 * g);  // three contiguous whole mappings in one call
      CHECK(d.live().mappings == 0);
      d.map(base + g, 2 * g, h2);
      d.set_access(base + g, 2 * g);
    }
    SUBCASE("set_access needs a fully mapped range") {
      check_invalid(d, "cuMemSetAccess", [&] { d.set_access(base, 2 * g); });
      check_invalid(d, "cuMemSetAccess", [&] { d.set_access(base + 2 * g, 2 * g); });
      check_invalid(d, "cuMemSetAccess", [&] { d.set_access(base + 6 * g, g); });
      d.map(base + 3 * g, g, h1);
      check_invalid(d, "cuMemSetAccess", [&] { d.set_access(base + g, 4 * g); });
      CHECK_FALSE(d.is_accessible(base + 3 * g, g));
      d.set_access(base + 2 * g, 2 * g);  // part of h2 and all of h1
      CHECK(d.is_accessible(base + g, 3 * g));
      d.unmap(base + 3 * g, g);
    }
    SUBCASE("free_reserve") {
      check_invalid(d, "cuMemAddressFree", [&] { d.free_reserve(base + g, 7 * g); });  // not a base
      check_invalid(d, "cuMemAddressFree", [&] { d.free_reserve(base, 4 * g); });      // wrong size
      check_invalid(d, "cuMemAddressFree", [&] { d.free_reserve(base, 8 * g); });      // mappings inside
      CHECK(d.is_accessible(base + g, 2 * g));
    }
    SUBCASE("unknown ids") {
      check_invalid(d, "cuMemRelease", [&] { d.release(999999); });
      check_invalid(d, "cuMemFree", [&] { d.mem_free(base); });
      const dev_ptr p = d.mem_alloc(4096);
      check_invalid(d, "cuMemFree", [&] { d.mem_free(p + 256); });  // interior pointer
      d.mem_free(p);
      check_invalid(d, "cuMemFree", [&] { d.mem_free(p); });  // double free
      const event_t bogus = reinterpret_cast<event_t>(std::uintptr_t{0xdead0});
      check_invalid(d, "cuEventRecord", [&] { d.event_record(bogus, nullptr); });
      check_invalid(d, "cuEventQuery", [&] { (void)d.event_query(bogus); });
      check_invalid(d, "cuEventSynchronize", [&] { d.event_synchronize(bogus); });
      check_invalid(d, "cuEventDestroy", [&] { d.event_destroy(bogus); });
      const event_t e = d.event_create();
      check_invalid(d, "cuStreamDestroy", [&] { d.stream_destroy(nullptr); });
      check_invalid(d, "cuStreamDestroy", [&] { d.stream_destroy(reinterpret_cast<stream_t>(bogus)); });
      d.event_destroy(e);
      check_invalid(d, "cuEventQuery", [&] { (void)d.event_query(e); });  // destroyed
    }
    // Nothing above moved or changed the data.
    expseg::test::check_words(d, base + g, 2 * g / 4, 0x12345678u);
    d.unmap(base + g, 2 * g);
    d.release(h1);
    d.release(h2);
    d.release(h3);
    d.free_reserve(base, 8 * g);
    check_nothing_left(d);
  }

  TEST_CASE("sim: host-backed data persists across remap; access is enforced") {
    SimDriver d(host_backed());
    const std::size_t g = d.granularity();
    const dev_ptr base = d.reserve(6 * g);
    CHECK(base % g == 0);
    const phys_handle a = d.create(g);
    const phys_handle b = d.create(g);
    d.map(base, g, a);
    CHECK_FALSE(d.is_accessible(base, g));  // mapped, no access yet
    check_invalid(d, "cuMemsetD32Async", [&] { d.memset_d32(base, 1, 1, nullptr); });
    d.set_access(base, g);
    CHECK(d.is_accessible(base, g));
    CHECK_FALSE(d.is_accessible(base, g + 4));
    d.map(base + g, g, b);
    d.set_access(base + g, g);
    CHECK(d.is_accessible(base, 2 * g));

    std::vector<std::uint32_t> pa(g / 4), pb(g / 4);
    for (std::size_t i = 0; i < pa.size(); ++i) {
      pa[i] = static_cast<std::uint32_t>(i);
      pb[i] = static_cast<std::uint32_t>(~i);
    }
    d.copy_from_host(base, pa.data(), g);
    d.copy_from_host(base + g, pb.data(), g);
    // Device addresses are host addresses in this mode.
    CHECK(reinterpret_cast<const std::uint32_t*>(base)[5] == 5u);

    // Swap the two handles' places: the data follows the handles.
    d.unmap(base, 2 * g);
    CHECK_FALSE(d.is_accessible(base, 4));
    check_invalid(d, "cuMemcpyDtoH", [&] { (void)read_words(d, base, 4); });
    d.map(base + 4 * g, g, a);
    d.map(base + 3 * g, g, b);
    d.set_access(base + 3 * g, 2 * g);
    CHECK(read_words(d, base + 4 * g, g) == pa);
    CHECK(read_words(d, base + 3 * g, g) == pb);
    check_invalid(d, "cuMemcpyHtoD", [&] { d.copy_from_host(base + 5 * g, pa.data(), 4); });
    check_invalid(d, "cuMemsetD32Async", [&] { d.memset_d32(base + 3 * g + 2, 1, 1, nullptr); });  // unaligned
    d.unmap(base + 3 * g, 2 * g);
    d.release(a);
    d.release(b);
    d.free_reserve(base, 6 * g);
    check_nothing_left(d);
  }

  TEST_CASE("sim: host-backed resources go back to the OS, also when leaked") {
    const std::size_t fds = open_fds();
    const Mappings before = process_mappings();
    std::uint64_t arena_bytes = 0;
    {
      SimOptions o = host_backed();
      o.shareable = ShareableHandle::posix_fd;
      SimDriver d(o);
      const std::size_t g = d.granularity();
      const dev_ptr base = d.reserve(4 * g);
      const phys_handle h = d.create(g);
      CHECK(open_fds() == fds + 1);  // one memfd per physical allocation
      const ExportedHandle ex = d.export_handle(h);
      CHECK(open_fds() == fds + 2);
      ::close(ex.fd);
      d.map(base, g, h);
      d.release(h);
      CHECK(open_fds() == fds + 1);  // still mapped
      d.unmap(base, g);
      CHECK(open_fds() == fds);
      // Left behind on purpose: the destructor unmaps and closes them.
      (void)d.create(g);
      (void)d.reserve(g);
      (void)d.mem_alloc(100);
      d.map(base, g, d.create(g));
      CHECK(open_fds() == fds + 2);
      arena_bytes = process_mappings().bytes - before.bytes;
    }
    CHECK(open_fds() == fds);
    // The host memory too: the arena (reservations, mappings) and cuMemAlloc's ranges are unmapped.
    // (The heap, or a sanitizer's allocator, may have mapped more meanwhile; the arena is far larger.)
    const Mappings after = process_mappings();
    CHECK(arena_bytes > 1 * GiB);
    CHECK(after.bytes < before.bytes + arena_bytes / 2);
  }

  TEST_CASE("sim: bookkeeping mode refuses data access") {
    SimDriver d;
    const std::size_t g = d.granularity();
    const dev_ptr base = d.reserve(g);
    CHECK(base >= 0x100000000000u);
    const phys_handle h = d.create(g);
    d.map(base, g, h);
    d.set_access(base, g);
    CHECK(d.is_accessible(base, g));
    auto err = catch_driver_error([&] { d.memset_d32(base, 0, 4, nullptr); });
    REQUIRE(err.has_value());
    CHECK(err->call() == "cuMemsetD32Async");
    CHECK(std::string(err->what()).find("host_backed") != std::string::npos);
    std::uint32_t x = 0;
    CHECK_THROWS_AS(d.copy_to_host(&x, base, 4), driver_error);
    CHECK_THROWS_AS(d.copy_from_host(base, &x, 4), driver_error);
    d.unmap(base, g);
    d.release(h);
    d.free_reserve(base, g);
  }

  TEST_CASE("sim: events on busy streams") {
    SimDriver d;
    const stream_t s = d.stream_create();
    const stream_t t = d.stream_create();
    CHECK(s != t);
    const event_t e1 = d.event_create();
    const event_t e2 = d.event_create();
    const event_t e3 = d.event_create();

    d.event_record(e3, s);  // recorded while idle: complete
    d.set_stream_busy(s, true);
    CHECK(d.event_query(e3));
    d.event_record(e1, s);
    CHECK_FALSE(d.event_query(e1));
    d.event_record(e2, t);  // other stream: not busy
    CHECK(d.event_query(e2));
    d.set_stream_busy(s, false);
    CHECK(d.event_query(e1));

    SUBCASE("stream_synchronize completes the stream's events") {
      d.set_stream_busy(s, true);
      d.set_stream_busy(t, true);
      d.event_record(e1, s);
      d.event_record(e2, t);
      d.stream_synchronize(s);
      CHECK(d.event_query(e1));
      CHECK_FALSE(d.event_query(e2));
      // The stream stays busy: work recorded later is pending again.
      d.event_record(e1, s);
      CHECK_FALSE(d.event_query(e1));
      d.set_stream_busy(s, false);
      d.set_stream_busy(t, false);
    }
    SUBCASE("device_synchronize completes every event") {
      d.set_stream_busy(s, true);
      d.set_stream_busy(nullptr, true);
      d.event_record(e1, s);
      d.event_record(e2, nullptr);
      CHECK_FALSE(d.event_query(e1));
      CHECK_FALSE(d.event_query(e2));
      d.device_synchronize();
      CHECK(d.event_query(e1));
      CHECK(d.event_query(e2));
      d.set_stream_busy(nullptr, false);
      d.set_stream_busy(s, false);
    }
    SUBCASE("event_synchronize completes that event and earlier ones on its stream") {
      d.set_stream_busy(s, true);
      d.event_record(e1, s);
      d.event_record(e2, s);
      d.event_record(e3, s);
      d.event_synchronize(e2);
      CHECK(d.event_query(e1));
      CHECK(d.event_query(e2));
      CHECK_FALSE(d.event_query(e3));
      d.event_record(e1, s);  // re-recorded: pending again
      CHECK_FALSE(d.event_query(e1));
      d.stream_destroy(s);  // queued work goes on after the stream is destroyed...
      CHECK_FALSE(d.event_query(e1));
      CHECK_FALSE(d.event_query(e3));
      const auto refused = catch_driver_error([&] { d.event_record(e2, s); });  // ...but nothing new is queued
      REQUIRE(refused.has_value());
      CHECK(refused->code() == 201);
      d.set_stream_busy(s, false);  // ...and completes
      CHECK(d.event_query(e1));
      CHECK(d.event_query(e3));
      CHECK(d.live().streams == 1);
      check_invalid(d, "cuStreamDestroy", [&] { d.stream_destroy(s); });  // already destroyed
      d.stream_destroy(t);
      d.event_destroy(e1);
      d.event_destroy(e2);
      d.event_destroy(e3);
      check_nothing_left(d);
      return;
    }
    d.stream_destroy(s);
    d.stream_destroy(t);
    d.event_destroy(e1);
    d.event_destroy(e2);
    d.event_destroy(e3);
    check_nothing_left(d);
  }

  TEST_CASE("sim: the legacy stream waits for blocking streams, and 0x2 is each thread's own stream") {
    // As measured on the H200: a synchronization of the legacy stream, or of an event recorded on
    // it, waits for another thread's per-thread stream, not for a non-blocking stream; a thread's
    // own per-thread stream does not wait for another thread's.
    SimDriver d;
    const auto per_thread = reinterpret_cast<stream_t>(std::uintptr_t{2});
    const stream_t nonblocking = d.stream_create();
    const event_t mine = d.event_create();
    const event_t theirs = d.event_create();
    const event_t side = d.event_create();
    const event_t legacy = d.event_create();
    std::thread([&] {  // another thread's kernel, still queued on its per-thread stream
      d.set_stream_busy(per_thread, true);
      d.event_record(theirs, per_thread);
    }).join();
    d.set_stream_busy(nonblocking, true);
    d.event_record(side, nonblocking);
    d.event_record(mine, per_thread);  // this thread's per-thread stream is idle
    CHECK(d.event_query(mine));
    CHECK_FALSE(d.event_query(theirs));

    SUBCASE("this thread's per-thread stream does not wait for another thread's") {
      d.stream_synchronize(per_thread);
      CHECK_FALSE(d.event_query(theirs));
      CHECK_FALSE(d.event_query(side));
    }
    SUBCASE("an event on the legacy stream waits for the blocking streams only") {
      d.event_record(legacy, nullptr);
      CHECK_FALSE(d.event_query(legacy));
      d.event_synchronize(legacy);
      CHECK(d.event_query(legacy));
      CHECK(d.event_query(theirs));
      CHECK_FALSE(d.event_query(side));
    }
    SUBCASE("a synchronization of the legacy stream, named 0x1 or nullptr, likewise") {
      d.stream_synchronize(reinterpret_cast<stream_t>(std::uintptr_t{1}));
      CHECK(d.event_query(theirs));
      CHECK_FALSE(d.event_query(side));
    }
    SUBCASE("a stream created blocking is waited for too; whether a stream blocks is refused while it captures") {
      const stream_t blocking = d.stream_create_blocking();
      CHECK(d.stream_is_blocking(blocking));
      CHECK_FALSE(d.stream_is_blocking(nonblocking));
      d.set_stream_busy(blocking, true);
      const event_t on_blocking = d.event_create();
      d.event_record(on_blocking, blocking);
      d.stream_synchronize(nullptr);
      CHECK(d.event_query(on_blocking));
      CHECK_FALSE(d.event_query(side));
      d.capture_begin(blocking);
      CHECK_THROWS_AS((void)d.stream_is_blocking(blocking), driver_error);
      CHECK_THROWS_AS(d.capture_end(blocking), driver_error);  // invalidated
      d.set_stream_busy(blocking, false);
      d.event_destroy(on_blocking);
      d.stream_destroy(blocking);
    }
    SUBCASE("it is permitted while a non-blocking stream captures, refused while a blocking one does") {
      const stream_t capturing = d.stream_create();
      d.capture_begin(capturing);
      d.stream_synchronize(nullptr);
      CHECK(d.event_query(theirs));
      CHECK_NOTHROW(d.graph_destroy(d.capture_end(capturing)));
      d.stream_destroy(capturing);
      d.capture_begin(per_thread);
      const auto refused = catch_driver_error([&] { d.event_record(legacy, nullptr); });
      REQUIRE(refused.has_value());
      CHECK(refused->code_name() == "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT");
      CHECK_THROWS_AS(d.stream_synchronize(nullptr), driver_error);
      CHECK_THROWS_AS(d.capture_end(per_thread), driver_error);  // invalidated
    }
    d.set_stream_busy(nonblocking, false);
    d.device_synchronize();
    CHECK(d.event_query(theirs));
    d.stream_destroy(nonblocking);
    for (event_t e : {mine, theirs, side, legacy}) d.event_destroy(e);
    check_nothing_left(d);
  }

  TEST_CASE("sim: streams not from stream_create are accepted (program or trace streams)") {
    SimDriver d;
    const auto foreign = reinterpret_cast<stream_t>(std::uintptr_t{0x7f0012345600});
    const event_t e = d.event_create();
    d.event_record(e, foreign);  // idle unless made busy
    CHECK(d.event_query(e));
    d.set_stream_busy(foreign, true);
    d.event_record(e, foreign);
    CHECK_FALSE(d.event_query(e));
    d.stream_synchronize(foreign);
    CHECK(d.event_query(e));
    d.set_stream_busy(foreign, false);
    CHECK(d.live().streams == 0);  // not counted, and cannot be destroyed
    check_invalid(d, "cuStreamDestroy", [&] { d.stream_destroy(foreign); });
    d.event_destroy(e);
    check_nothing_left(d);
  }

  TEST_CASE("sim: latency model") {
    SimOptions o;
    o.latency_model = true;
    o.capacity = 200 * GiB;
    SimDriver d(o);
    const std::size_t g = d.granularity();
    double t = 0;
    auto added_us = [&] {
      const double now = d.simulated_seconds();
      const double us = (now - t) * 1e6;
      t = now;
      return us;
    };
    const dev_ptr base = d.reserve(16 * GiB);
    CHECK(added_us() == doctest::Approx(24.0));
    const phys_handle h1 = d.create(2 * MiB);
    CHECK(added_us() == doctest::Approx(8.1));
    const phys_handle h2 = d.create(2 * MiB);
    const phys_handle h3 = d.create(2 * MiB);
    CHECK(added_us() == doctest::Approx(16.2));
    d.map(base, g, h1);
    d.map(base + g, g, h2);
    d.map(base + 2 * g, g, h3);
    CHECK(added_us() == doctest::Approx(3 * 0.7));
    d.set_access(base, 3 * g);  // cost follows the handles: 3 x the per-handle cost
    CHECK(added_us() == doctest::Approx(3 * 35.9));
    d.set_access(base + g, g);
    CHECK(added_us() == doctest::Approx(35.9));
    d.unmap(base, 3 * g);
    CHECK(added_us() == doctest::Approx(3 * 22.0));
    d.release(h1);
    CHECK(added_us() == doctest::Approx(10.2));

    // Table points and log-size interpolation.
    const phys_handle h64 = d.create(64 * MiB);
    CHECK(added_us() == doctest::Approx(8.7));
    const phys_handle h128 = d.create(128 * MiB);  // a third of the way from 64 to 512 MiB in log(size)
    CHECK(added_us() == doctest::Approx(8.7 + (27.3 - 8.7) / 3));
    const phys_handle h2g = d.create(2 * GiB);
    CHECK(added_us() == doctest::Approx(98.9));
    const phys_handle h4g = d.create(4 * GiB);  // clamped at the largest size
    CHECK(added_us() == doctest::Approx(98.9));
    d.map(base, 2 * GiB, h2g);
    CHECK(added_us() == doctest::Approx(1.1));
    d.set_access(base, 2 * GiB);
    CHECK(added_us() == doctest::Approx(94.6));
    d.unmap(base, 2 * GiB);
    CHECK(added_us() == doctest::Approx(42.1));
    d.release(h2g);
    CHECK(added_us() == doctest::Approx(624.8));
    d.release(h64);
    CHECK(added_us() == doctest::Approx(37.7));
    d.release(h128);
    d.release(h4g);
    d.release(h2);
    d.release(h3);
    added_us();

    const dev_ptr p = d.mem_alloc(2 * MiB);
    CHECK(added_us() == doctest::Approx(33.0));
    const dev_ptr q = d.mem_alloc(GiB);
    CHECK(added_us() == doctest::Approx(91.0));
    d.mem_free(p);
    CHECK(added_us() == doctest::Approx(29.0));
    d.mem_free(q);
    CHECK(added_us() == doctest::Approx(336.0));

    const event_t e = d.event_create();
    d.event_record(e, nullptr);
    CHECK(added_us() == doctest::Approx(0.5));
    (void)d.event_query(e);
    CHECK(added_us() == doctest::Approx(0.5));
    d.stream_synchronize(nullptr);
    CHECK(added_us() == doctest::Approx(5.0));
    d.event_synchronize(e);
    d.device_synchronize();
    CHECK(added_us() == doctest::Approx(10.0));
    CHECK(d.stream_capture_id(nullptr) == 0);
    CHECK(d.stream_is_blocking(nullptr));
    CHECK(added_us() == doctest::Approx(2 * 0.02));  // stream queries: ~20 ns each
    d.event_destroy(e);
    d.free_reserve(base, 16 * GiB);
    check_nothing_left(d);

    // The same time per operation: set_access 3 x 35.9 + 35.9 + 94.6 us over three calls; the syncs
    // (stream, event, context) under one name; the per-operation seconds add up to the total.
    const CallStats c = d.call_stats();
    CHECK(c.calls[static_cast<std::size_t>(Op::set_access)] == 3);
    CHECK(c.seconds[static_cast<std::size_t>(Op::set_access)] * 1e6 == doctest::Approx(4 * 35.9 + 94.6));
    CHECK(c.calls[static_cast<std::size_t>(Op::stream_sync)] == 3);
    CHECK(c.seconds[static_cast<std::size_t>(Op::stream_sync)] * 1e6 == doctest::Approx(15.0));
    CHECK(c.calls[static_cast<std::size_t>(Op::create)] == 7);
    CHECK(c.calls[static_cast<std::size_t>(Op::stream_query)] == 2);
    CHECK(c.seconds[static_cast<std::size_t>(Op::stream_query)] * 1e6 == doctest::Approx(0.04));
    CHECK(c.total_seconds() == doctest::Approx(d.simulated_seconds()));

    // Smaller than the table: clamped at 2 MiB.
    SimOptions small = o;
    small.granularity = 64 * 1024;
    SimDriver s(small);
    const phys_handle hs = s.create(64 * 1024);
    CHECK(s.simulated_seconds() * 1e6 == doctest::Approx(8.1));
    s.release(hs);

    // Model off: no time.
    SimDriver off;
    off.release(off.create(off.granularity()));
    CHECK(off.simulated_seconds() == 0.0);
  }

  TEST_CASE("sim: peers") {
    SimOptions o;
    o.device = 1;
    o.device_count = 4;
    SimDriver d(o);
    CHECK(d.device() == 1);
    CHECK(d.device_count() == 4);
    CHECK(d.can_access_peer(0));
    CHECK_FALSE(d.can_access_peer(1));
    CHECK(d.can_access_peer(3));
    CHECK_FALSE(d.can_access_peer(4));
    CHECK_FALSE(d.can_access_peer(-1));
    CHECK(d.access_devices() == std::vector<int>{1});
    CHECK(d.add_access_device(3));
    CHECK_FALSE(d.add_access_device(3));
    CHECK_FALSE(d.add_access_device(1));
    CHECK(d.add_access_device(0));
    CHECK(d.access_devices() == std::vector<int>{1, 3, 0});
    auto err = catch_driver_error([&] { (void)d.add_access_device(7); });
    REQUIRE(err.has_value());
    CHECK(err->code() == 101);
    CHECK(d.access_devices().size() == 3);

    // Context peer access (cuCtxEnablePeerAccess) is separate from the access list.
    CHECK(d.context_peers().empty());
    CHECK(d.enable_context_peer(2));
    CHECK_FALSE(d.enable_context_peer(2));
    CHECK_FALSE(d.enable_context_peer(1));
    CHECK(d.context_peers() == std::vector<int>{2});
    CHECK(d.access_devices() == std::vector<int>{1, 3, 0});
    err = catch_driver_error([&] { (void)d.enable_context_peer(4); });
    REQUIRE(err.has_value());
    CHECK(err->code() == 101);
    // As on CUDA, at most 8 of them: the 9th is CUDA_ERROR_TOO_MANY_PEERS and changes nothing.
    SimOptions many;
    many.device_count = 12;
    SimDriver big(many);
    for (int peer = 1; peer <= expseg::driver::kSimMaxContextPeers; ++peer) CHECK(big.enable_context_peer(peer));
    err = catch_driver_error([&] { (void)big.enable_context_peer(9); });
    REQUIRE(err.has_value());
    CHECK(err->code() == 711);
    CHECK(std::string(err->what()).find("CUDA_ERROR_TOO_MANY_PEERS") != std::string::npos);
    CHECK(big.context_peers().size() == 8);
    CHECK_FALSE(big.enable_context_peer(8));  // one already enabled is still fine
    for (int peer = 1; peer < 12; ++peer) CHECK(big.add_access_device(peer));  // the access list has no such limit

    SimDriver single;
    CHECK_FALSE(single.can_access_peer(1));
    CHECK(single.access_devices() == std::vector<int>{0});
  }

  TEST_CASE("sim: bookkeeping mode with a 141 GB capacity") {
    SimOptions o;
    o.capacity = 141'000'000'000;
    SimDriver d(o);
    CHECK(d.mem_info().total == 141'000'000'000u);
    const std::size_t g = d.granularity();
    const dev_ptr base = d.reserve(140 * GiB);
    CHECK(base >= 0x100000000000u);
    CHECK(base % g == 0);
    const phys_handle a = d.create(64 * GiB);
    const phys_handle b = d.create(64 * GiB);
    d.map(base, 64 * GiB, a);
    d.map(base + 64 * GiB, 64 * GiB, b);
    d.set_access(base, 128 * GiB);
    CHECK(d.is_accessible(base + 100 * GiB, GiB));
    CHECK_FALSE(d.is_accessible(base + 128 * GiB, g));
    CHECK(d.mem_info().free == 141'000'000'000u - 128 * GiB);
    CHECK(catch_driver_error([&] { (void)d.create(4 * GiB); }).value().is_out_of_memory());
    d.unmap(base, 128 * GiB);
    d.release(a);
    d.release(b);
    d.free_reserve(base, 140 * GiB);
    // Freed address ranges are taken again, first fit, as the driver reuses them: a process that
    // reserves and frees ranges for ever never runs out.
    const dev_ptr again = d.reserve(140 * GiB);
    CHECK(again == base);
    const dev_ptr p = d.mem_alloc(100);
    CHECK(p >= again + 140 * GiB);  // live ranges never overlap
    const dev_ptr q = d.mem_alloc(100);
    CHECK(q >= p + g);
    d.mem_free(p);
    CHECK(d.mem_alloc(100) == p);  // the freed one, below q
    d.free_reserve(again, 140 * GiB);
    const dev_ptr small = d.reserve(g);  // the first fit: the start of the freed 140 GiB
    CHECK(small == base);
    const dev_ptr next = d.reserve(g);
    CHECK(next == base + 2 * g);  // each range keeps a guard granule after it
    d.free_reserve(small, g);
    d.free_reserve(next, g);
    d.mem_free(p);
    d.mem_free(q);
    // Everything given back: the span is whole again, a range of all of it fits once more.
    const dev_ptr whole = d.reserve(140 * GiB);
    CHECK(whole == base);
    d.free_reserve(whole, 140 * GiB);
    check_nothing_left(d);
  }

  TEST_CASE("sim: export and import in-process") {
    SUBCASE("posix_fd, host-backed: same memory through two handles") {
      SimOptions o = host_backed();
      o.shareable = ShareableHandle::posix_fd;
      SimDriver d(o);
      CHECK(d.shareable_handle_type() == ShareableHandle::posix_fd);
      const std::size_t g = d.granularity();
      const phys_handle h = d.create(g);
      const ExportedHandle ex = d.export_handle(h);
      CHECK(ex.type == ShareableHandle::posix_fd);
      REQUIRE(ex.fd >= 0);
      const phys_handle imp = d.import_handle(ex);
      CHECK(imp != h);
      ::close(ex.fd);
      CHECK(d.live().handles == 2);
      CHECK(d.live().physical_bytes == g);  // no new memory
      const dev_ptr base = d.reserve(2 * g);
      d.map(base, g, h);
      d.map(base + g, g, imp);
      d.set_access(base, 2 * g);
      d.memset_d32(base, 0xFEEDBEEFu, g / 4, nullptr);
      expseg::test::check_words(d, base + g, g / 4, 0xFEEDBEEFu);
      d.unmap(base, 2 * g);
      d.release(h);
      CHECK(d.live().physical_bytes == g);  // the imported handle keeps it
      d.release(imp);
      d.free_reserve(base, 2 * g);
      check_nothing_left(d);
    }
    SUBCASE("posix_fd: the descriptor, not the bytes, names the memory (as CUDA imports it)") {
      // Was: the simulator read the bytes and ignored the fd, so an fd-plumbing bug passed here.
      for (const bool host : {true, false}) {
        CAPTURE(host);
        SimOptions o = host ? host_backed() : SimOptions{};
        o.shareable = ShareableHandle::posix_fd;
        SimDriver d(o);
        const phys_handle h = d.create(d.granularity());
        ExportedHandle ex = d.export_handle(h);
        ExportedHandle unrelated = ex;
        const int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
        REQUIRE(devnull >= 0);
        unrelated.fd = devnull;
        check_invalid(d, "cuMemImportFromShareableHandle", [&] { (void)d.import_handle(unrelated); });
        ::close(devnull);
        ExportedHandle retyped = ex;
        retyped.type = ShareableHandle::fabric;  // a posix_fd export read as a fabric handle
        check_invalid(d, "cuMemImportFromShareableHandle", [&] { (void)d.import_handle(retyped); });
        if (host) {
          ExportedHandle closed = ex;
          ::close(ex.fd);  // a descriptor already closed
          check_invalid(d, "cuMemImportFromShareableHandle", [&] { (void)d.import_handle(closed); });
        }
        d.release(h);
        check_nothing_left(d);
      }
    }
    SUBCASE("regression: posix_fd, host-backed: an open exported descriptor keeps released memory importable") {
      // CUDA (cuMemRelease): the memory is freed once every mapping is unmapped and every reference
      // to the handle, its shareable counterparts included, is released. Was: the simulator freed
      // it at the exporter's release, so an import through the still-open descriptor was refused.
      SimOptions o = host_backed();
      o.shareable = ShareableHandle::posix_fd;
      SimDriver d(o);
      const std::size_t g = d.granularity();
      const phys_handle h = d.create(g);
      const ExportedHandle ex = d.export_handle(h);
      REQUIRE(ex.fd >= 0);
      const dev_ptr base = d.reserve(g);
      d.map(base, g, h);
      d.set_access(base, g);
      d.memset_d32(base, 0xC0FFEE11u, g / 4, nullptr);
      d.unmap(base, g);
      d.release(h);  // the exporter is done with it; the descriptor is still open
      CHECK(d.live().handles == 0);
      const phys_handle imp = d.import_handle(ex);
      CHECK(d.live().handles == 1);
      CHECK(d.live().physical_bytes == g);
      d.map(base, g, imp);
      d.set_access(base, g);
      expseg::test::check_words(d, base, g / 4, 0xC0FFEE11u);  // the same memory, data intact
      d.unmap(base, g);
      d.release(imp);
      d.free_reserve(base, g);
      CHECK(d.live().physical_bytes == g);  // the open descriptor still holds it, as on CUDA
      // Once the descriptor is closed too, nothing names the memory any more.
      ::close(ex.fd);
      check_invalid(d, "cuMemImportFromShareableHandle", [&] { (void)d.import_handle(ex); });
      check_nothing_left(d);
    }
    SUBCASE("regression: posix_fd, host-backed: released memory an open descriptor keeps counts against the capacity") {
      // CUDA frees exported memory only once its descriptors are closed too, so until then it is
      // in use. Was: the simulator stopped counting it at the exporter's release, handed the bytes
      // out again, and an import through the descriptor then counted it again without the capacity
      // check (more in use than the device has); and it never forgot descriptors closed unimported.
      SimOptions o = host_backed(4 * 2 * MiB);
      o.shareable = ShareableHandle::posix_fd;
      SimDriver d(o);
      const std::size_t g = d.granularity();
      REQUIRE(o.capacity == 4 * g);
      const phys_handle h = d.create(2 * g);
      const ExportedHandle ex = d.export_handle(h);
      REQUIRE(ex.fd >= 0);
      d.release(h);  // the descriptor still holds the memory
      CHECK(d.live().physical_bytes == 2 * g);
      CHECK(d.mem_info().free == 2 * g);
      auto oom = catch_driver_error([&] { (void)d.create(4 * g); });
      REQUIRE(oom.has_value());
      CHECK(oom->is_out_of_memory());
      const phys_handle other = d.create(2 * g);  // what is really free
      const phys_handle imp = d.import_handle(ex);  // no new memory: it never stopped being used
      CHECK(d.live().physical_bytes == 4 * g);
      CHECK(d.mem_info().free == 0);
      d.release(imp);
      CHECK(d.live().physical_bytes == 4 * g);  // the descriptor is still open
      ::close(ex.fd);  // closed without another import: the memory goes
      CHECK(d.live().physical_bytes == 2 * g);
      CHECK(d.mem_info().free == 2 * g);
      d.release(other);
      const phys_handle all = d.create(4 * g);
      d.release(all);
      check_nothing_left(d);
    }
    SUBCASE("fabric, bookkeeping") {
      SimOptions o;
      o.shareable = ShareableHandle::fabric;
      SimDriver d(o);
      const phys_handle h = d.create(d.granularity());
      const ExportedHandle ex = d.export_handle(h);
      CHECK(ex.type == ShareableHandle::fabric);
      CHECK(ex.fd == -1);
      const phys_handle imp = d.import_handle(ex);
      d.release(h);
      d.release(imp);
      check_invalid(d, "cuMemImportFromShareableHandle", [&] { (void)d.import_handle(ex); });  // memory is gone
      check_invalid(d, "cuMemExportToShareableHandle", [&] { (void)d.export_handle(h); });
      SimDriver other(o);  // another device's handle
      check_invalid(other, "cuMemImportFromShareableHandle", [&] { (void)other.import_handle(ex); });
      check_nothing_left(d);
    }
    SUBCASE("no shareable type: export is an error") {
      SimDriver d;
      CHECK(d.shareable_handle_type() == ShareableHandle::none);
      CHECK(d.shareable_fallback_reason().empty());
      const phys_handle h = d.create(d.granularity());
      check_invalid(d, "cuMemExportToShareableHandle", [&] { (void)d.export_handle(h); });
      check_invalid(d, "cuMemImportFromShareableHandle", [&] { (void)d.import_handle(ExportedHandle{}); });
      d.release(h);
    }
    SUBCASE("ipc") {
      SimDriver d(host_backed());
      const dev_ptr p = d.mem_alloc(4096);
      const ExportedHandle ex = d.ipc_export(p);
      const dev_ptr q = d.ipc_open(ex);
      CHECK(q == p);
      d.memset_d32(p, 42, 1024, nullptr);
      expseg::test::check_words(d, q, 1024, 42);
      // Freed under an open import: undefined behaviour in CUDA, refused here (nothing changes).
      check_invalid(d, "cuMemFree", [&] { d.mem_free(p); });
      d.ipc_close(q);
      check_invalid(d, "cuIpcCloseMemHandle", [&] { d.ipc_close(q); });
      check_invalid(d, "cuIpcGetMemHandle", [&] { (void)d.ipc_export(p + 64); });
      CHECK(d.calls(Op::export_handle) == 2);
      CHECK(d.calls(Op::import_handle) == 1);
      d.mem_free(p);
      check_invalid(d, "cuIpcOpenMemHandle", [&] { (void)d.ipc_open(ex); });
      check_nothing_left(d);
    }
    SUBCASE("ipc: a new allocation at a freed one's address exports a new handle; the stale one opens nothing") {
      for (bool host : {false, true}) {
        CAPTURE(host);
        SimDriver d(host ? host_backed() : SimOptions{});
        const dev_ptr p = d.mem_alloc(4096);
        const ExportedHandle stale = d.ipc_export(p);
        CHECK(d.ipc_export(p).bytes == stale.bytes);  // the same allocation: the same handle
        d.mem_free(p);
        const dev_ptr q = d.mem_alloc(4096);
        REQUIRE(q == p);  // the freed range is taken again first
        const ExportedHandle fresh = d.ipc_export(q);
        CHECK(fresh.bytes != stale.bytes);
        // Was: the stale handle opened the new allocation, which its exporter never shared.
        check_invalid(d, "cuIpcOpenMemHandle", [&] { (void)d.ipc_open(stale); });
        const dev_ptr opened = d.ipc_open(fresh);
        CHECK(opened == q);
        d.ipc_close(opened);
        d.mem_free(q);
        check_nothing_left(d);
      }
    }
  }

  TEST_CASE("sim: bookkeeping drivers share one process address space, bounded by SimOptions::address_space") {
    constexpr std::size_t TiB = std::size_t{1} << 40;
    CHECK(SimOptions{}.address_space == std::size_t{1} << 47);  // 128 TiB, as a CUDA process has
    const std::size_t others = SimDriver::address_space_in_use();  // drivers other tests keep alive
    {
      // The default: a 1 PiB reservation (the most an expandable segment may ask) is refused.
      SimDriver d;
      auto err = catch_driver_error([&] { (void)d.reserve(1024 * TiB); });
      REQUIRE(err.has_value());
      CHECK(err->call() == "cuMemAddressReserve");
      CHECK(err->code() == 2);
      CHECK(err->is_out_of_memory());
      CHECK(d.live().reservations == 0);
      CHECK(SimDriver::address_space_in_use() == others);
    }
    // Lowered to 8 GiB past what others hold: two devices' drivers draw on it together.
    SimOptions o;
    o.device_count = 2;
    o.address_space = others + 8 * GiB;
    SimOptions o1 = o;
    o1.device = 1;
    SimDriver d0(o), d1(o1);
    const dev_ptr a = d0.reserve(4 * GiB);
    const dev_ptr b = d1.reserve(3 * GiB);
    const dev_ptr m = d1.mem_alloc(GiB - 100);  // a cuMemAlloc takes address space too, rounded to granules
    CHECK(SimDriver::address_space_in_use() == others + 8 * GiB);
    for (SimDriver* d : {&d0, &d1}) {
      const SimDriver::Live before = d->live();
      auto err = catch_driver_error([&] { (void)d->reserve(d->granularity()); });
      REQUIRE(err.has_value());
      CHECK(err->call() == "cuMemAddressReserve");
      CHECK(err->is_out_of_memory());
      CHECK(std::string(err->what()).find("address space") != std::string::npos);
      check_same(d->live(), before);
      err = catch_driver_error([&] { (void)d->mem_alloc(100); });
      REQUIRE(err.has_value());
      CHECK(err->call() == "cuMemAlloc");
      CHECK(err->is_out_of_memory());
      check_same(d->live(), before);
    }
    CHECK(SimDriver::address_space_in_use() == others + 8 * GiB);
    d1.mem_free(m);
    const dev_ptr c = d0.reserve(GiB);  // what the free gave back
    d0.free_reserve(a, 4 * GiB);
    d0.free_reserve(c, GiB);
    {
      // A driver destroyed with its reservations still made (a leak) gives their address space back.
      SimDriver leaky(o);
      (void)leaky.reserve(5 * GiB);
      CHECK(SimDriver::address_space_in_use() == others + 8 * GiB);
    }
    CHECK(SimDriver::address_space_in_use() == others + 3 * GiB);
    d1.free_reserve(b, 3 * GiB);
    CHECK(SimDriver::address_space_in_use() == others);
    check_nothing_left(d0);
    check_nothing_left(d1);
  }

  TEST_CASE("sim: many threads at once") {
    for (bool host : {false, true}) {
      CAPTURE(host);
      SimOptions o = host ? host_backed(256 * MiB) : SimOptions{};
      if (host) o.granularity = 64 * 1024;  // keeps page-touching cheap
      SimDriver d(o);
      const std::size_t g = d.granularity();
      constexpr int kThreads = 8, kRounds = 100;
      std::atomic<int> failures{0};
      std::vector<std::thread> threads;
      for (int t = 0; t < kThreads; ++t) {
        threads.emplace_back([&, t] {
          try {
            const stream_t s = d.stream_create();
            const event_t e = d.event_create();
            for (int i = 0; i < kRounds; ++i) {
              const dev_ptr base = d.reserve(4 * g);
              const phys_handle h = d.create(2 * g);
              d.map(base + g, 2 * g, h);
              d.set_access(base + g, 2 * g);
              if (host) {
                const auto v = static_cast<std::uint32_t>(t * 1000 + i);
                d.memset_d32(base + g, v, 2 * g / 4, s);
                std::uint32_t last = 0;
                d.copy_to_host(&last, base + 3 * g - 4, 4);
                if (last != v) ++failures;
              }
              d.event_record(e, s);
              if (!d.event_query(e)) ++failures;
              d.unmap(base + g, 2 * g);
              d.release(h);
              d.free_reserve(base, 4 * g);
              const dev_ptr p = d.mem_alloc(1000 + static_cast<std::size_t>(i));
              d.mem_free(p);
            }
            d.event_destroy(e);
            d.stream_destroy(s);
          } catch (...) {
            ++failures;
          }
        });
      }
      for (auto& th : threads) th.join();
      CHECK(failures.load() == 0);
      check_nothing_left(d);
      CHECK(d.calls(Op::map) == kThreads * kRounds);
      CHECK(d.calls(Op::mem_free) == kThreads * kRounds);
    }
  }
}
