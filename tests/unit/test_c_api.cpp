// The C API (include/expseg/expseg.h) on the simulated device: per-device state, errors as codes
// and messages (never exceptions), OOM reports, JSON, the recorder. The C API's state is global to
// the process, so every case starts and ends with capi::reset_for_tests() (CApiFixture).
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include "c_api_internal.hpp"
#include "capi_fixture.hpp"
#include "core/json.hpp"
#include "expseg/allocator.hpp"
#include "expseg/errors.hpp"
#include "expseg/expseg.h"
#include "expseg/ipc.hpp"
#include "expseg/trace.hpp"

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

using expseg::core::JsonValue;
using expseg::core::parse_json;
using testutil::CApiFixture;

std::string last_error() { return expseg_last_error(); }

JsonValue stats(int device) {
  const char* s = expseg_stats_json(device);
  REQUIRE(s != nullptr);
  return parse_json(s);
}

std::int64_t stat(int device, const char* key) { return stats(device)[key].as_int(); }

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("expseg_test_c_api_" + std::to_string(::getpid()) + "_" + name)).string();
}

const char* const kBackends[] = {"split_merge", "expandable"};

bool fd_open(int fd) { return ::lseek(fd, 0, SEEK_CUR) != -1 || errno != EBADF; }

}  // namespace

TEST_SUITE("c_api") {

TEST_CASE_FIXTURE(CApiFixture, "version and an empty error state") {
  CHECK(std::string(expseg_version()) == EXPSEG_VERSION_STRING);
  CHECK(expseg_last_error_code() == EXPSEG_SUCCESS);
  CHECK(last_error().empty());
}

TEST_CASE_FIXTURE(CApiFixture, "size 0 gives NULL, free(NULL) does nothing, neither creates an allocator") {
  REQUIRE(expseg_configure("device:sim") == EXPSEG_SUCCESS);
  CHECK(expseg_malloc(0, 0, nullptr) == nullptr);
  CHECK(expseg_cupy_malloc(nullptr, 0, 0) == nullptr);
  expseg_free(nullptr, 0, 0, nullptr);
  expseg_cupy_free(nullptr, nullptr, 0);
  CHECK(expseg_last_error_code() == EXPSEG_SUCCESS);
  CHECK(expseg_device_initialized(0) == 0);
  // A negative size (ssize_t) is an error, not a huge request.
  CHECK(expseg_malloc(-1, 0, nullptr) == nullptr);
  CHECK(expseg_last_error_code() == EXPSEG_ERROR_INVALID_ARGUMENT);
}

TEST_CASE_FIXTURE(CApiFixture, "malloc/free through both pairs, on both backends; stats JSON follows") {
  for (const char* backend : kBackends) {
    const std::string name = backend;
    CAPTURE(name);
    expseg::capi::reset_for_tests();
    REQUIRE(expseg_configure((std::string("device:sim,sim_capacity:4GiB,backend:") + backend).c_str()) == EXPSEG_SUCCESS);
    CHECK(std::string(expseg_config(0)).find(std::string("backend:") + backend) != std::string::npos);

    void* a = expseg_malloc(static_cast<ssize_t>(3 * MiB), 0, nullptr);
    void* b = expseg_cupy_malloc(nullptr, 5 * MiB + 7, 0);
    REQUIRE(a != nullptr);
    REQUIRE(b != nullptr);
    CHECK(a != b);
    CHECK(expseg_device_initialized(0) == 1);
    CHECK(stat(0, "allocation.all.current") == 2);
    CHECK(stat(0, "requested_bytes.all.current") == static_cast<std::int64_t>(8 * MiB + 7));
    CHECK(stat(0, "allocated_bytes.all.current") >= static_cast<std::int64_t>(8 * MiB + 7));
    const JsonValue cupy = stats(0)["cupy"];
    CHECK(cupy["used_bytes"].as_int() == stat(0, "allocated_bytes.all.current"));

    expseg_free(a, static_cast<ssize_t>(3 * MiB), 0, nullptr);
    expseg_cupy_free(nullptr, b, 0);
    CHECK(expseg_last_error_code() == EXPSEG_SUCCESS);
    CHECK(stat(0, "allocation.all.current") == 0);
    CHECK(stat(0, "allocated_bytes.all.current") == 0);
    CHECK(stat(0, "allocated_bytes.all.peak") >= static_cast<std::int64_t>(8 * MiB));

    // release_cached gives the cache back; reset_peak_stats brings peaks down to current.
    CHECK(stat(0, "reserved_bytes.all.current") > 0);
    CHECK(expseg_release_cached(0) == EXPSEG_SUCCESS);
    CHECK(stat(0, "reserved_bytes.all.current") == 0);
    CHECK(expseg_reset_peak_stats(0) == EXPSEG_SUCCESS);
    CHECK(stat(0, "allocated_bytes.all.peak") == 0);
  }
}

TEST_CASE_FIXTURE(CApiFixture, "expseg_get_limit and expseg_reset_accumulated_stats: PyTorch's memory fraction and accumulated-stats reset") {
  REQUIRE(expseg_configure("device:sim,sim_capacity:4GiB,limit:1GiB") == EXPSEG_SUCCESS);
  // Before any allocator exists: resetting counters is a no-op, reading the limit a query; neither creates one.
  CHECK(expseg_reset_accumulated_stats(2) == EXPSEG_SUCCESS);
  CHECK(expseg_device_initialized(2) == 0);
  std::size_t limit = 7, total = 7;
  REQUIRE(expseg_get_limit(0, &limit, &total) == EXPSEG_SUCCESS);
  CHECK(limit == (std::size_t{1} << 30));
  CHECK(total == (std::size_t{4} << 30));
  CHECK(expseg_device_initialized(0) == 0);
  REQUIRE(expseg_set_limit(0, 0) == EXPSEG_SUCCESS);  // creates it
  CHECK(expseg_get_limit(0, &limit, nullptr) == EXPSEG_SUCCESS);  // either pointer may be NULL
  CHECK(limit == 0);
  CHECK(expseg_get_limit(0, nullptr, nullptr) == EXPSEG_SUCCESS);
  CHECK(expseg_get_limit(-1, &limit, &total) == EXPSEG_ERROR_INVALID_DEVICE);
  CHECK(expseg_reset_accumulated_stats(EXPSEG_MAX_DEVICES) == EXPSEG_ERROR_INVALID_DEVICE);
  CHECK(last_error().find("out of range") != std::string::npos);

  void* a = expseg_malloc(static_cast<ssize_t>(3 * MiB), 0, nullptr);
  void* b = expseg_malloc(static_cast<ssize_t>(5 * MiB), 0, nullptr);
  REQUIRE((a != nullptr && b != nullptr));
  expseg_free(a, 0, 0, nullptr);
  REQUIRE(expseg_set_limit(0, MiB) == EXPSEG_SUCCESS);
  CHECK(expseg_malloc(static_cast<ssize_t>(64 * MiB), 0, nullptr) == nullptr);  // needs new memory: over the limit
  CHECK(stat(0, "num_ooms") == 1);
  CHECK(stat(0, "allocation.all.allocated") == 2);
  CHECK(stat(0, "allocation.all.freed") == 1);
  CHECK(expseg_reset_accumulated_stats(0) == EXPSEG_SUCCESS);
  // Counters and a stat's allocated and freed restart at 0, as PyTorch's; gauges and peaks are
  // untouched.
  CHECK(stat(0, "num_ooms") == 0);
  CHECK(stat(0, "allocation.all.allocated") == 0);
  CHECK(stat(0, "allocation.all.freed") == 0);
  CHECK(stat(0, "allocation.all.current") == 1);
  CHECK(stat(0, "allocation.all.peak") == 2);
  CHECK(stat(0, "requested_bytes.all.current") == static_cast<std::int64_t>(5 * MiB));
  expseg_free(b, 0, 0, nullptr);
  CHECK(stat(0, "allocation.all.freed") == 1);
}

TEST_CASE_FIXTURE(CApiFixture, "expseg_config reports the limit expseg_set_limit set last") {
  REQUIRE(expseg_configure("device:sim,sim_capacity:4GiB,limit:50%") == EXPSEG_SUCCESS);
  REQUIRE(expseg_set_limit(0, 512 * MiB) == EXPSEG_SUCCESS);
  const std::string now = expseg_config(0);
  CHECK(now.find("limit:512MiB") != std::string::npos);  // was: limit:50%, the limit at creation
  CHECK(now.find("limit:50%") == std::string::npos);
  REQUIRE(expseg_set_limit(0, 0) == EXPSEG_SUCCESS);
  CHECK(std::string(expseg_config(0)).find("limit:0") != std::string::npos);
  CHECK(std::string(expseg_config(1)).find("limit:50%") != std::string::npos);  // a device not used yet: as configured
}

TEST_CASE_FIXTURE(CApiFixture, "a device not used yet reports the configured max_split_size, as PyTorch does") {
  // PyTorch's memory_stats() gives every device its configured max_split_size; a device with no
  // expseg allocator yet reported -1 (unlimited), then the configured value once it had one.
  for (const char* backend : kBackends) {
    const std::string name = backend;
    CAPTURE(name);
    expseg::capi::reset_for_tests();
    REQUIRE(expseg_configure((std::string("device:sim,max_split_size_mb:20,backend:") + backend).c_str()) == EXPSEG_SUCCESS);
    CHECK(stat(1, "max_split_size") == static_cast<std::int64_t>(20 * MiB));
    const char* snap = expseg_snapshot_json(1);
    REQUIRE(snap != nullptr);
    CHECK(parse_json(snap)["stats"]["max_split_size"].as_int() == static_cast<std::int64_t>(20 * MiB));
    CHECK(expseg_device_initialized(1) == 0);  // queries create no allocator
    void* p = expseg_malloc(32 * MiB, 1, nullptr);
    REQUIRE(p != nullptr);
    CHECK(stat(1, "max_split_size") == static_cast<std::int64_t>(20 * MiB));
    expseg_free(p, 0, 1, nullptr);
  }
  expseg::capi::reset_for_tests();
  CHECK(stat(0, "max_split_size") == -1);  // unlimited by default
}

TEST_CASE_FIXTURE(CApiFixture, "expseg_last_error's string stays valid until expseg_last_error is called again") {
  REQUIRE(expseg_configure("device:sim") == EXPSEG_SUCCESS);
  int on_the_stack = 0;
  expseg_free(&on_the_stack, 0, 0, nullptr);
  const char* first = expseg_last_error();
  const std::string copy = first;
  CHECK(copy.find("expseg_free") == 0);
  // Another failure with a longer message changes the error, not the string already handed out.
  CHECK(expseg_record_write(0, (std::string(300, 'x') + "/no/such/dir/t.csv").c_str()) != EXPSEG_SUCCESS);
  CHECK(std::string(first) == copy);
  CHECK(std::string(expseg_last_error()).find("expseg_record_write") == 0);
}

TEST_CASE_FIXTURE(CApiFixture, "a failing expseg_torch_malloc leaves the string expseg_last_error handed out valid") {
  REQUIRE(expseg_configure("device:sim") == EXPSEG_SUCCESS);
  int on_the_stack = 0;
  expseg_free(&on_the_stack, 0, 0, nullptr);
  const char* first = expseg_last_error();
  const std::string copy = first;
  REQUIRE(copy.find("expseg_free") == 0);
  // The exception carries the new message; the caller did not call expseg_last_error again.
  std::string what;
  try {
    (void)expseg_torch_malloc(64, 99999, nullptr);
  } catch (const std::runtime_error& e) {
    what = e.what();
  }
  CHECK(what.find("expseg_torch_malloc: device 99999 is out of range") == 0);
  CHECK(std::string(first) == copy);
  CHECK(std::string(expseg_last_error()) == what);
}

namespace {
// A thread_local made before the thread's first expseg call is destroyed after expseg's own
// per-thread state (reverse order): its destructor calls expseg as a static destructor at exit would.
struct LateCaller {
  std::string* out = nullptr;
  ~LateCaller() {
    if (out == nullptr) return;
    int on_the_stack = 0;
    expseg_free(&on_the_stack, 0, 0, nullptr);
    *out = std::to_string(expseg_last_error_code()) + " " + expseg_last_error();
    const char* s = expseg_stats_json(0);
    *out += s != nullptr && std::string(s).find("allocated_bytes.all.current") != std::string::npos ? " stats" : " no stats";
  }
};
}  // namespace

TEST_CASE_FIXTURE(CApiFixture, "C API calls after the thread's own state is destroyed (thread_local or static destructors) work") {
  REQUIRE(expseg_configure("device:sim") == EXPSEG_SUCCESS);
  std::string seen;
  std::thread([&] {
    thread_local LateCaller late;
    late.out = &seen;
    expseg_free(expseg_malloc(1024, 0, nullptr), 0, 0, nullptr);  // the thread's expseg state, made after `late`
  }).join();
  CHECK(seen.rfind(std::to_string(EXPSEG_ERROR_INVALID_POINTER) + " expseg_free: ", 0) == 0);
  CHECK(seen.find(" stats") != std::string::npos);
}

namespace {
// Two threads exit together, each calling expseg from a thread_local destructor: each must read
// back its own error and its own stats string.
std::atomic<int> g_late_ready{0};
std::atomic<int> g_late_wrong{0};
constexpr int kLateIterations = 2000;
std::atomic<int> g_late_iterations{0};  // iterations finished: no wrong answer only counts if they ran
struct LateRacer {
  std::uintptr_t id = 0;
  ~LateRacer() {
    if (id == 0) return;
    g_late_ready.fetch_add(1);
    while (g_late_ready.load() < 2) {
    }
    for (int i = 0; i < kLateIterations; ++i) {
      void* bogus = reinterpret_cast<void*>(id + 16 * static_cast<std::uintptr_t>(i));
      expseg_free(bogus, 0, 0, nullptr);
      char want[32];
      std::snprintf(want, sizeof want, "%p", bogus);
      if (std::strstr(expseg_last_error(), want) == nullptr) g_late_wrong.fetch_add(1);
      const char* js = expseg_stats_json(0);
      if (js == nullptr || std::strstr(js, "allocated_bytes.all.current") == nullptr) g_late_wrong.fetch_add(1);
      g_late_iterations.fetch_add(1);
    }
  }
};
}  // namespace

TEST_CASE_FIXTURE(CApiFixture, "C API calls from two exiting threads at once do not share their late state") {
  // Was: one shared late state, written by both threads without a lock: messages of the other
  // thread, and stats strings freed while being read (TSan: data race, heap-use-after-free).
  REQUIRE(expseg_configure("device:sim") == EXPSEG_SUCCESS);
  g_late_ready = 0;
  g_late_wrong = 0;
  g_late_iterations = 0;
  std::vector<std::thread> threads;
  for (std::uintptr_t t = 1; t <= 2; ++t)
    threads.emplace_back([t] {
      thread_local LateRacer racer;
      racer.id = t << 40;
      (void)expseg_last_error_code();  // the thread's expseg state, made after `racer`
    });
  for (auto& t : threads) t.join();
  // Both destructors ran, side by side, through every iteration.
  CHECK(g_late_ready.load() == 2);
  CHECK(g_late_iterations.load() == 2 * kLateIterations);
  CHECK(g_late_wrong.load() == 0);
}

TEST_CASE_FIXTURE(CApiFixture, "expseg_set_record_default: allocators created afterwards record, existing ones are left alone") {
  REQUIRE(expseg_configure("device:sim") == EXPSEG_SUCCESS);
  expseg_free(expseg_malloc(1024, 0, nullptr), 0, 0, nullptr);  // device 0 exists, not recording
  REQUIRE(expseg_set_record_default(1, 0) == EXPSEG_SUCCESS);
  expseg_free(expseg_malloc(4096, 1, nullptr), 0, 1, nullptr);
  REQUIRE(expseg_set_record_default(0, 0) == EXPSEG_SUCCESS);
  expseg_free(expseg_malloc(4096, 2, nullptr), 0, 2, nullptr);
  auto recorded = [](int device) {
    const std::string path = temp_path("default" + std::to_string(device) + ".csv");
    REQUIRE(expseg_record_write(device, path.c_str()) == EXPSEG_SUCCESS);
    const expseg::Trace t = expseg::read_trace(path);
    std::filesystem::remove(path);
    return std::count_if(t.events.begin(), t.events.end(), [](const expseg::TraceEvent& e) {
      return e.action == expseg::TraceAction::allocate || e.action == expseg::TraceAction::free;
    });
  };
  CHECK(recorded(0) == 0);
  CHECK(recorded(1) == 2);  // its allocate and free
  CHECK(recorded(2) == 0);
  // Device 1 recorded from its creation: complete. Restarted over its cached block: partial.
  int partial = -1;
  REQUIRE(expseg_record_partial(1, &partial) == EXPSEG_SUCCESS);
  CHECK(partial == 0);
  REQUIRE(expseg_record_start(1, 0) == EXPSEG_SUCCESS);
  REQUIRE(expseg_record_partial(1, &partial) == EXPSEG_SUCCESS);
  CHECK(partial == 1);
  REQUIRE(expseg_record_partial(5, &partial) == EXPSEG_SUCCESS);  // no allocator there: nothing recorded
  CHECK(partial == 0);
  CHECK(expseg_record_partial(1, nullptr) == EXPSEG_ERROR_INVALID_ARGUMENT);
  CHECK(expseg_record_partial(-1, &partial) == EXPSEG_ERROR_INVALID_DEVICE);
  CHECK(std::string(expseg_config(1)).find("record:true") != std::string::npos);
}

TEST_CASE_FIXTURE(CApiFixture, "expseg_torch_malloc throws out_of_memory with the report, and the allocator keeps serving") {
  REQUIRE(expseg_configure("device:sim,sim_capacity:4GiB,backend:expandable,limit:64MiB") == EXPSEG_SUCCESS);
  void* keep = expseg_torch_malloc(static_cast<ssize_t>(40 * MiB), 0, nullptr);
  REQUIRE(keep != nullptr);
  CHECK(expseg_torch_malloc(0, 0, nullptr) == nullptr);
  std::string what;
  try {
    (void)expseg_torch_malloc(static_cast<ssize_t>(40 * MiB), 0, nullptr);
  } catch (const expseg::out_of_memory& e) {
    what = e.what();
  }
  CHECK(what.find("Tried to allocate 40.00 MiB") != std::string::npos);
  CHECK(what.find("expseg verdict: limit") != std::string::npos);
  CHECK(expseg_last_error_code() == EXPSEG_ERROR_OUT_OF_MEMORY);
  CHECK(std::string(expseg_last_oom_report(0)) == what);
  CHECK_THROWS_WITH_AS(expseg_torch_malloc(-1, 0, nullptr), "expseg_torch_malloc: negative size (2^63 bytes or more read as size_t)", std::invalid_argument);
  CHECK_THROWS_AS(expseg_torch_malloc(64, 99999, nullptr), std::runtime_error);
  void* small = expseg_torch_malloc(static_cast<ssize_t>(8 * MiB), 0, nullptr);
  CHECK(small != nullptr);
  expseg_free(small, 0, 0, nullptr);
  expseg_free(keep, 0, 0, nullptr);
  CHECK(stat(0, "allocation.all.current") == 0);
}

TEST_CASE_FIXTURE(CApiFixture, "out of memory: NULL, a code, and a report retrievable from any thread") {
  REQUIRE(expseg_configure("device:sim,sim_capacity:4GiB,backend:split_merge,limit:64MiB") == EXPSEG_SUCCESS);
  CHECK(std::string(expseg_last_oom_report(0)).empty());  // no allocator, no OOM yet
  CHECK(std::string(expseg_last_oom_report_json(0)) == "null");

  void* keep = expseg_malloc(static_cast<ssize_t>(40 * MiB), 0, nullptr);
  REQUIRE(keep != nullptr);
  CHECK(expseg_malloc(static_cast<ssize_t>(40 * MiB), 0, nullptr) == nullptr);  // through the PyTorch entry point
  CHECK(expseg_last_error_code() == EXPSEG_ERROR_OUT_OF_MEMORY);
  CHECK(last_error().find("expseg_malloc") != std::string::npos);
  CHECK(last_error().find("out of memory") != std::string::npos);

  const std::string text = expseg_last_oom_report(0);
  CHECK(text.find("Tried to allocate") != std::string::npos);
  CHECK(text.find("limit") != std::string::npos);
  const JsonValue report = parse_json(expseg_last_oom_report_json(0));
  CHECK(report["requested_bytes"].as_int() == static_cast<std::int64_t>(40 * MiB));
  CHECK(report["limit_bytes"].as_int() == static_cast<std::int64_t>(64 * MiB));
  CHECK(report["verdict"].as_string() == "limit");
  CHECK(stat(0, "num_ooms") == 1);

  // The report belongs to the device, not the thread; the error code belongs to the thread.
  std::string other_text;
  int other_code = -1;
  std::thread([&] {
    other_text = expseg_last_oom_report(0);
    other_code = expseg_last_error_code();
  }).join();
  CHECK(other_text == text);
  CHECK(other_code == EXPSEG_SUCCESS);

  // The allocator keeps serving after the OOM.
  void* small = expseg_cupy_malloc(nullptr, 8 * MiB, 0);
  CHECK(small != nullptr);
  expseg_cupy_free(nullptr, small, 0);
  expseg_free(keep, 0, 0, nullptr);
  CHECK(stat(0, "allocation.all.current") == 0);
}

TEST_CASE_FIXTURE(CApiFixture, "out of memory: each thread keeps the report of its own failed allocation") {
  // The device's last report is the last OOM of any thread: a thread that failed and then read it
  // (tools/expseg.py's CuPy OutOfMemoryError) could get another thread's report, of another request.
  REQUIRE(expseg_configure("device:sim,sim_capacity:4GiB,backend:split_merge,limit:64MiB") == EXPSEG_SUCCESS);
  CHECK(std::string(expseg_thread_oom_report(0)).empty());
  CHECK(std::string(expseg_thread_oom_report_json(0)) == "null");
  CHECK(expseg_cupy_malloc(nullptr, 100 * MiB, 0) == nullptr);
  std::string other;
  std::thread([&] {
    CHECK(expseg_cupy_malloc(nullptr, 200 * MiB, 0) == nullptr);  // after this thread's OOM, before it reads
    other = expseg_thread_oom_report(0);
  }).join();
  CHECK(other.find("Tried to allocate 200.00 MiB") != std::string::npos);
  CHECK(std::string(expseg_last_oom_report(0)) == other);  // the device's last: the other thread's, as before
  const std::string mine = expseg_thread_oom_report(0);
  CHECK(mine.find("Tried to allocate 100.00 MiB") != std::string::npos);
  const JsonValue report = parse_json(expseg_thread_oom_report_json(0));
  CHECK(report["requested_bytes"].as_int() == static_cast<std::int64_t>(100 * MiB));
  CHECK(report["message"].as_string() == mine);
  CHECK(std::string(expseg_thread_oom_report(1)).empty());  // per device
  CHECK(expseg_thread_oom_report(EXPSEG_MAX_DEVICES) == nullptr);
  CHECK(expseg_last_error_code() == EXPSEG_ERROR_INVALID_DEVICE);
}

TEST_CASE_FIXTURE(CApiFixture, "the 800/500/300 story: CuPy's OOM under split_merge policy:cupy, success under expandable") {
  // What benchmarks/cupy_story.py does on the GPU through CuPy, here on the simulated device.
  for (const char* backend : kBackends) {
    const std::string name = backend;
    CAPTURE(name);
    expseg::capi::reset_for_tests();
    const std::string conf = std::string("device:sim,sim_capacity:141GiB,limit:2064MiB,backend:") + backend +
                             (std::string(backend) == "split_merge" ? ",policy:cupy" : "");
    REQUIRE(expseg_configure(conf.c_str()) == EXPSEG_SUCCESS);
    void* big = expseg_cupy_malloc(nullptr, 2000 * MiB, 0);
    REQUIRE(big != nullptr);
    expseg_cupy_free(nullptr, big, 0);
    void* a = expseg_cupy_malloc(nullptr, 800 * MiB, 0);
    void* b = expseg_cupy_malloc(nullptr, 500 * MiB, 0);
    void* c = expseg_cupy_malloc(nullptr, 300 * MiB, 0);
    REQUIRE((a && b && c));
    expseg_cupy_free(nullptr, b, 0);
    void* d = expseg_cupy_malloc(nullptr, 800 * MiB, 0);
    if (std::string(backend) == "expandable") {
      CHECK(d != nullptr);
      expseg_cupy_free(nullptr, d, 0);
    } else {
      CHECK(d == nullptr);
      CHECK(expseg_last_error_code() == EXPSEG_ERROR_OUT_OF_MEMORY);
      const std::string text = expseg_last_oom_report(0);
      CAPTURE(text);
      CHECK(text.find("Out of memory allocating 838,860,800 bytes") != std::string::npos);
      CHECK(text.find("limit set to: 2,164,260,864 bytes") != std::string::npos);
      CHECK(parse_json(expseg_last_oom_report_json(0))["verdict"].as_string() == "fragmentation");
    }
    expseg_clear_error();
    expseg_cupy_free(nullptr, a, 0);
    expseg_cupy_free(nullptr, c, 0);
    CHECK(expseg_last_error_code() == EXPSEG_SUCCESS);  // both frees succeeded
  }
}

TEST_CASE_FIXTURE(CApiFixture, "a bad configuration string is an error naming the key, and changes nothing") {
  REQUIRE(expseg_configure("device:sim,backend:expandable") == EXPSEG_SUCCESS);
  CHECK(expseg_configure("device:sim,bogus_key:1") == EXPSEG_ERROR_CONFIG);
  CHECK(expseg_last_error_code() == EXPSEG_ERROR_CONFIG);
  CHECK(last_error().find("bogus_key") != std::string::npos);
  CHECK(last_error().find("expseg_configure") != std::string::npos);
  CHECK(expseg_configure("limit:lots") == EXPSEG_ERROR_CONFIG);
  CHECK(last_error().find("limit") != std::string::npos);
  // The last good string still applies.
  const std::string conf = expseg_config(0);
  CHECK(conf.find("backend:expandable") != std::string::npos);
  CHECK(conf.find("device:sim") != std::string::npos);
  // NULL and "" go back to EXPSEG_ALLOC_CONF alone (unset here: the defaults).
  CHECK(expseg_configure(nullptr) == EXPSEG_SUCCESS);
  CHECK(std::string(expseg_config(0)).find("backend:split_merge") != std::string::npos);
  CHECK(expseg_device_initialized(0) == 0);
}

TEST_CASE_FIXTURE(CApiFixture, "configure is refused once an allocator exists") {
  REQUIRE(expseg_configure("device:sim") == EXPSEG_SUCCESS);
  void* p = expseg_cupy_malloc(nullptr, MiB, 1);
  REQUIRE(p != nullptr);
  CHECK(expseg_configure("device:sim,backend:expandable") == EXPSEG_ERROR_ALREADY_INITIALIZED);
  CHECK(last_error().find("device(s) 1") != std::string::npos);
  CHECK(std::string(expseg_config(1)).find("backend:split_merge") != std::string::npos);
  expseg_cupy_free(nullptr, p, 1);
}

TEST_CASE_FIXTURE(CApiFixture, "a bad EXPSEG_ALLOC_CONF fails allocator creation with a message naming it") {
  ::setenv("EXPSEG_ALLOC_CONF", "device:sim,nope:1", 1);
  CHECK(expseg_malloc(static_cast<ssize_t>(MiB), 0, nullptr) == nullptr);
  CHECK(expseg_last_error_code() == EXPSEG_ERROR_CONFIG);
  CHECK(last_error().find("EXPSEG_ALLOC_CONF") != std::string::npos);
  CHECK(last_error().find("nope") != std::string::npos);
  CHECK(expseg_device_initialized(0) == 0);
  CHECK(expseg_configure("backend:expandable") == EXPSEG_ERROR_CONFIG);  // checked over the environment
  ::setenv("EXPSEG_ALLOC_CONF", "device:sim,backend:expandable", 1);
  CHECK(std::string(expseg_config(0)).find("backend:expandable") != std::string::npos);
  void* p = expseg_malloc(static_cast<ssize_t>(MiB), 0, nullptr);
  CHECK(p != nullptr);
  expseg_free(p, 0, 0, nullptr);
}

TEST_CASE_FIXTURE(CApiFixture, "EXPSEG_ALLOC_CONF changed after the first allocator does not reach later devices") {
  // Was: the variable was read again at each device's first use, so a program that changed it (or
  // a library that set it) between the first uses of two devices gave them different backends and
  // limits, while expseg_configure was refused for the same change.
  auto config_of = [](int device) {
    const char* c = expseg_config(device);
    return std::string(c != nullptr ? c : "(NULL)");
  };
  ::setenv("EXPSEG_ALLOC_CONF", "device:sim,backend:expandable,limit:1GiB", 1);
  REQUIRE(expseg_configure("max_split_size_mb:64") == EXPSEG_SUCCESS);
  void* p = expseg_malloc(static_cast<ssize_t>(MiB), 0, nullptr);
  REQUIRE(p != nullptr);
  const std::string first = config_of(0);
  CHECK(first.find("backend:expandable") != std::string::npos);
  CHECK(first.find("limit:1GiB") != std::string::npos);
  CHECK(first.find("max_split_size_mb:64") != std::string::npos);
  ::setenv("EXPSEG_ALLOC_CONF", "device:sim,backend:split_merge,limit:2GiB", 1);
  CHECK(config_of(1) == first);  // what device 1 will be created with
  void* q = expseg_malloc(static_cast<ssize_t>(MiB), 1, nullptr);
  REQUIRE(q != nullptr);
  CHECK(config_of(1) == first);
  std::size_t limit = 0, total = 0;
  REQUIRE(expseg_get_limit(2, &limit, &total) == EXPSEG_SUCCESS);  // a device still without an allocator
  CHECK(limit == 1024 * MiB);
  // A bad variable now changes nothing either.
  ::setenv("EXPSEG_ALLOC_CONF", "device:sim,nope:1", 1);
  void* r = expseg_malloc(static_cast<ssize_t>(MiB), 2, nullptr);
  CHECK(r != nullptr);
  CHECK(config_of(2) == first);
  expseg_free(p, 0, 0, nullptr);
  expseg_free(q, 0, 1, nullptr);
  if (r != nullptr) expseg_free(r, 0, 2, nullptr);
  // After a reset (a new process, as far as the C API knows) the variable is read again.
  expseg::capi::reset_for_tests();
  ::setenv("EXPSEG_ALLOC_CONF", "device:sim,backend:split_merge,limit:2GiB", 1);
  CHECK(config_of(0).find("limit:2GiB") != std::string::npos);
}

TEST_CASE_FIXTURE(CApiFixture, "free of an unknown pointer is reported and harmless") {
  for (const char* backend : kBackends) {
    const std::string name = backend;
    CAPTURE(name);
    expseg::capi::reset_for_tests();
    REQUIRE(expseg_configure((std::string("device:sim,backend:") + backend).c_str()) == EXPSEG_SUCCESS);
    void* p = expseg_malloc(static_cast<ssize_t>(4 * MiB), 0, nullptr);
    REQUIRE(p != nullptr);

    // An interior pointer.
    expseg_free(static_cast<char*>(p) + 4096, 0, 0, nullptr);
    CHECK(expseg_last_error_code() == EXPSEG_ERROR_INVALID_POINTER);
    CHECK(last_error().find("expseg_free") != std::string::npos);
    expseg_clear_error();
    // Garbage.
    int on_the_stack = 0;
    expseg_cupy_free(nullptr, &on_the_stack, 0);
    CHECK(expseg_last_error_code() == EXPSEG_ERROR_INVALID_POINTER);
    CHECK(!last_error().empty());
    // A device that has no allocator, and an out-of-range device.
    expseg_clear_error();
    expseg_free(p, 0, 7, nullptr);
    CHECK(expseg_last_error_code() == EXPSEG_ERROR_INVALID_POINTER);
    CHECK(expseg_device_initialized(7) == 0);
    expseg_free(p, 0, 64, nullptr);
    CHECK(expseg_last_error_code() == EXPSEG_ERROR_INVALID_DEVICE);
    // record_stream of an unknown pointer too.
    CHECK(expseg_record_stream(&on_the_stack, 0, nullptr) == EXPSEG_ERROR_INVALID_POINTER);

    // Nothing changed: the allocation is still live and frees normally, once.
    CHECK(stat(0, "allocation.all.current") == 1);
    expseg_clear_error();
    expseg_free(p, 0, 0, nullptr);
    CHECK(expseg_last_error_code() == EXPSEG_SUCCESS);
    CHECK(stat(0, "allocation.all.current") == 0);
    expseg_free(p, 0, 0, nullptr);  // double free
    CHECK(expseg_last_error_code() == EXPSEG_ERROR_INVALID_POINTER);
    CHECK(last_error().find("double free") != std::string::npos);
    void* q = expseg_malloc(static_cast<ssize_t>(4 * MiB), 0, nullptr);
    CHECK(q != nullptr);
    expseg_free(q, 0, 0, nullptr);
  }
}

TEST_CASE_FIXTURE(CApiFixture, "several devices' states are kept apart") {
  // Host-backed, so that the two simulated devices hand out distinct addresses (as GPUs do).
  REQUIRE(expseg_configure("device:sim,sim_capacity:1GiB,sim_host_backed:true,backend:expandable") == EXPSEG_SUCCESS);
  void* p0 = expseg_malloc(static_cast<ssize_t>(3 * MiB), 0, nullptr);
  void* p1 = expseg_malloc(static_cast<ssize_t>(5 * MiB), 1, nullptr);
  void* p1b = expseg_cupy_malloc(nullptr, 1 * MiB, 1);
  REQUIRE((p0 && p1 && p1b));
  CHECK(expseg_device_initialized(0) == 1);
  CHECK(expseg_device_initialized(1) == 1);
  CHECK(expseg_device_initialized(2) == 0);
  CHECK(stat(0, "allocation.all.current") == 1);
  CHECK(stat(1, "allocation.all.current") == 2);
  CHECK(stat(0, "requested_bytes.all.current") == static_cast<std::int64_t>(3 * MiB));
  CHECK(stat(1, "requested_bytes.all.current") == static_cast<std::int64_t>(6 * MiB));
  CHECK(stat(2, "allocation.all.current") == 0);
  CHECK(parse_json(expseg_snapshot_json(0))["device"].as_int() == 0);
  CHECK(parse_json(expseg_snapshot_json(1))["device"].as_int() == 1);

  // A pointer of device 0 freed as device 1's: reported, and neither device changes.
  expseg_free(p0, 0, 1, nullptr);
  CHECK(expseg_last_error_code() == EXPSEG_ERROR_INVALID_POINTER);
  CHECK(stat(0, "allocation.all.current") == 1);
  CHECK(stat(1, "allocation.all.current") == 2);

  // Limits, peaks and recording are per device too.
  CHECK(expseg_set_limit(1, 8 * MiB) == EXPSEG_SUCCESS);
  CHECK(expseg_malloc(static_cast<ssize_t>(8 * MiB), 1, nullptr) == nullptr);
  void* p0b = expseg_malloc(static_cast<ssize_t>(8 * MiB), 0, nullptr);
  CHECK(p0b != nullptr);
  CHECK(stat(0, "num_ooms") == 0);
  CHECK(stat(1, "num_ooms") == 1);
  CHECK(std::string(expseg_last_oom_report(0)).empty());
  CHECK(!std::string(expseg_last_oom_report(1)).empty());

  expseg_free(p0, 0, 0, nullptr);
  expseg_free(p0b, 0, 0, nullptr);
  expseg_free(p1, 0, 1, nullptr);
  expseg_cupy_free(nullptr, p1b, 1);
  CHECK(stat(0, "allocation.all.current") == 0);
  CHECK(stat(1, "allocation.all.current") == 0);
}

TEST_CASE_FIXTURE(CApiFixture, "stats and snapshot JSON before and after the allocator exists") {
  REQUIRE(expseg_configure("device:sim,sim_capacity:4GiB,limit:25%,backend:expandable") == EXPSEG_SUCCESS);
  // Queries answer without creating the allocator.
  CHECK(stat(0, "reserved_bytes.all.peak") == 0);
  JsonValue snap = parse_json(expseg_snapshot_json(0));
  CHECK(snap["backend"].as_string() == "expandable");
  CHECK(snap["segments"].as_array().empty());
  // The limit and the device as expseg_get_limit gives them (was: 0 and 0, "no limit").
  CHECK(snap["limit_bytes"].as_int() == static_cast<std::int64_t>(1024 * MiB));
  CHECK(snap["device_total_bytes"].as_int() == static_cast<std::int64_t>(4096 * MiB));
  CHECK(expseg_device_initialized(0) == 0);

  void* p = expseg_malloc(static_cast<ssize_t>(3 * MiB + 5), 0, nullptr);
  REQUIRE(p != nullptr);
  snap = parse_json(expseg_snapshot_json(0));
  REQUIRE(!snap["segments"].as_array().empty());
  bool found = false;
  for (const JsonValue& seg : snap["segments"].as_array())
    for (const JsonValue& b : seg["blocks"].as_array())
      if (b["state"].as_string() == "allocated") {
        CHECK(b["requested"].as_int() == static_cast<std::int64_t>(3 * MiB + 5));
        found = true;
      }
  CHECK(found);
  CHECK(snap["stats"]["allocation.all.current"].as_int() == 1);
  CHECK(snap["limit_bytes"].as_int() == static_cast<std::int64_t>(1024 * MiB));
  CHECK(snap["device_total_bytes"].as_int() == static_cast<std::int64_t>(4096 * MiB));

  // Each string-returning function has its own buffer: one call does not overwrite another's result.
  const char* s = expseg_stats_json(0);
  const std::string copy = s;
  (void)expseg_snapshot_json(0);
  (void)expseg_config(0);
  CHECK(std::string(s) == copy);

  // Invalid devices.
  CHECK(expseg_stats_json(-1) == nullptr);
  CHECK(expseg_last_error_code() == EXPSEG_ERROR_INVALID_DEVICE);
  CHECK(expseg_snapshot_json(EXPSEG_MAX_DEVICES) == nullptr);
  CHECK(expseg_malloc(16, EXPSEG_MAX_DEVICES, nullptr) == nullptr);
  CHECK(expseg_last_error_code() == EXPSEG_ERROR_INVALID_DEVICE);
  CHECK(expseg_device_initialized(-3) == -1);
  expseg_free(p, 0, 0, nullptr);
}

TEST_CASE_FIXTURE(CApiFixture, "the recorder writes a trace that read_trace reads back") {
  REQUIRE(expseg_configure("device:sim,backend:expandable") == EXPSEG_SUCCESS);
  REQUIRE(expseg_record_start(0, 0) == EXPSEG_SUCCESS);
  CHECK(expseg_device_initialized(0) == 1);  // record_start creates the allocator
  std::vector<void*> ptrs;
  for (std::size_t i = 1; i <= 5; ++i) ptrs.push_back(expseg_malloc(static_cast<ssize_t>(i * MiB + i), 0, nullptr));
  for (void* p : ptrs) {
    REQUIRE(p != nullptr);
    expseg_free(p, 0, 0, nullptr);
  }
  REQUIRE(expseg_record_stop(0) == EXPSEG_SUCCESS);
  void* after = expseg_malloc(static_cast<ssize_t>(MiB), 0, nullptr);  // not recorded
  expseg_free(after, 0, 0, nullptr);

  for (const char* suffix : {".rmm.csv", ".rmm.csv.gz"}) {
    CAPTURE(suffix);
    const std::string path = temp_path(std::string("trace") + suffix);
    REQUIRE(expseg_record_write(0, path.c_str()) == EXPSEG_SUCCESS);
    const expseg::Trace t = expseg::read_trace(path);
    std::filesystem::remove(path);
    std::size_t allocs = 0, frees = 0;
    for (const expseg::TraceEvent& e : t.events) {
      if (e.action == expseg::TraceAction::allocate) {
        ++allocs;
        CHECK(e.size == allocs * MiB + allocs);
      }
      if (e.action == expseg::TraceAction::free) ++frees;
    }
    CHECK(allocs == 5);
    CHECK(frees == 5);
    CHECK_NOTHROW(expseg::validate_trace(t));
  }

  CHECK(expseg_record_write(0, nullptr) == EXPSEG_ERROR_INVALID_ARGUMENT);
  CHECK(expseg_record_write(0, "/nonexistent-dir-of-expseg/x.rmm.csv") == EXPSEG_ERROR_IO);
  CHECK(last_error().find("/nonexistent-dir-of-expseg/x.rmm.csv") != std::string::npos);
  // A device with no allocator writes an empty (header-only) trace.
  const std::string empty = temp_path("empty.rmm.csv");
  CHECK(expseg_record_write(3, empty.c_str()) == EXPSEG_SUCCESS);
  CHECK(expseg::read_trace(empty).events.empty());
  std::filesystem::remove(empty);
}

TEST_CASE_FIXTURE(CApiFixture, "record_stream on a live allocation") {
  REQUIRE(expseg_configure("device:sim,backend:split_merge") == EXPSEG_SUCCESS);
  void* p = expseg_malloc(static_cast<ssize_t>(MiB), 0, reinterpret_cast<expseg_stream_t>(0x10));
  REQUIRE(p != nullptr);
  CHECK(expseg_record_stream(p, 0, reinterpret_cast<expseg_stream_t>(0x20)) == EXPSEG_SUCCESS);
  expseg_free(p, 0, 0, nullptr);
  CHECK(expseg_last_error_code() == EXPSEG_SUCCESS);
  CHECK(stat(0, "allocation.all.current") == 0);
}

TEST_CASE_FIXTURE(CApiFixture, "a pointer given with a device that has no allocator is not called foreign to expseg") {
  // p is expseg's, of device 0; device 7 has no allocator. The message must not tell the user that
  // expseg did not allocate p: the device argument is what is wrong.
  REQUIRE(expseg_configure("device:sim") == EXPSEG_SUCCESS);
  void* p = expseg_malloc(static_cast<ssize_t>(MiB), 0, nullptr);
  REQUIRE(p != nullptr);
  expseg_free(p, 0, 7, nullptr);
  CHECK(expseg_last_error_code() == EXPSEG_ERROR_INVALID_POINTER);
  CHECK(last_error().find("not allocated by expseg") == std::string::npos);
  CHECK(last_error().find("device 7") != std::string::npos);
  CHECK(last_error().find("another device") != std::string::npos);
  CHECK(expseg_record_stream(p, 7, nullptr) == EXPSEG_ERROR_INVALID_POINTER);
  CHECK(last_error().find("not allocated by expseg") == std::string::npos);
  CHECK(last_error().find("device 7") != std::string::npos);
  CHECK(last_error().find("another device") != std::string::npos);
  expseg_clear_error();
  expseg_free(p, 0, 0, nullptr);
  CHECK(expseg_last_error_code() == EXPSEG_SUCCESS);
}

TEST_CASE_FIXTURE(CApiFixture, "record_stream of NULL does nothing, whether or not the device has an allocator") {
  // PyTorch records streams of empty tensors, whose pointer is NULL, also on a device that has
  // allocated nothing yet: as expseg_free(NULL), that is no error and creates nothing.
  REQUIRE(expseg_configure("device:sim") == EXPSEG_SUCCESS);
  CHECK(expseg_record_stream(nullptr, 3, reinterpret_cast<expseg_stream_t>(0x20)) == EXPSEG_SUCCESS);
  CHECK(expseg_last_error_code() == EXPSEG_SUCCESS);
  CHECK(expseg_device_initialized(3) == 0);
  void* p = expseg_malloc(static_cast<ssize_t>(MiB), 3, nullptr);
  REQUIRE(p != nullptr);
  CHECK(expseg_record_stream(nullptr, 3, reinterpret_cast<expseg_stream_t>(0x20)) == EXPSEG_SUCCESS);
  CHECK(expseg_last_error_code() == EXPSEG_SUCCESS);
  // Nothing recorded: the stream is no block's recorded use, which would refuse its release.
  CHECK(expseg_release_stream(3, reinterpret_cast<expseg_stream_t>(0x20)) == EXPSEG_SUCCESS);
  expseg_free(p, 0, 3, nullptr);
}

TEST_CASE_FIXTURE(CApiFixture, "concurrent first use creates one allocator per device") {
  REQUIRE(expseg_configure("device:sim,sim_capacity:8GiB,sim_host_backed:true,backend:expandable") == EXPSEG_SUCCESS);
  constexpr int kThreads = 8;
  constexpr int kDevices = 4;
  constexpr int kRounds = 200;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < kRounds; ++i) {
        const int device = (t + i) % kDevices;
        const std::size_t size = (static_cast<std::size_t>(i % 7) + 1) * 64 * 1024;
        void* p = i % 2 ? expseg_malloc(static_cast<ssize_t>(size), device, nullptr) : expseg_cupy_malloc(nullptr, size, device);
        if (p == nullptr) {
          failures.fetch_add(1);
          continue;
        }
        expseg_free(p, 0, device, nullptr);
        if (expseg_last_error_code() != EXPSEG_SUCCESS) failures.fetch_add(1);
      }
    });
  for (std::thread& th : threads) th.join();
  CHECK(failures.load() == 0);
  std::int64_t total = 0;
  for (int d = 0; d < kDevices; ++d) {
    CHECK(expseg_device_initialized(d) == 1);
    CHECK(stat(d, "allocation.all.current") == 0);
    total += stat(d, "allocation.all.allocated");
  }
  CHECK(total == kThreads * kRounds);
}

TEST_CASE_FIXTURE(CApiFixture, "a huge record_ring works; inconsistent simulated-device settings fail at expseg_configure") {
  // Was: configure accepted the ring, then every expseg_malloc failed with EXPSEG_ERROR_INTERNAL
  // (vector::reserve), and record_start(SIZE_MAX) threw out of the recorder.
  REQUIRE(expseg_configure("device:sim,record:true,record_ring:1000000000000") == EXPSEG_SUCCESS);
  void* p = expseg_malloc(1 << 20, 0, nullptr);
  REQUIRE(p != nullptr);
  expseg_free(p, 0, 0, nullptr);
  CHECK(expseg_record_start(0, SIZE_MAX) == EXPSEG_SUCCESS);
  p = expseg_malloc(1 << 20, 0, nullptr);
  REQUIRE(p != nullptr);
  expseg_free(p, 0, 0, nullptr);
  CHECK(expseg_last_error_code() == EXPSEG_SUCCESS);
  expseg::capi::reset_for_tests();

  // Checked together when configured, not at the first malloc; the message names the key.
  struct Case {
    const char* conf;
    const char* key;
  };
  for (const Case& c : {Case{"device:sim,sim_granularity:1TiB", "sim_granularity: 1TiB is larger than sim_capacity"},
                        Case{"device:sim,backend:expandable,sim_capacity:40000TiB", "expandable_va_size:"},
                        Case{"device:sim,expandable_va_size:65536TiB", "expandable_va_size:"}}) {
    CAPTURE(c.conf);
    CHECK(expseg_configure(c.conf) == EXPSEG_ERROR_CONFIG);
    CHECK(last_error().find(c.key) != std::string::npos);
    CHECK(expseg_device_initialized(0) == 0);
  }
  // The same settings on the CUDA device are not the simulator's business.
  CHECK(expseg_configure("device:cuda,sim_granularity:1TiB") == EXPSEG_SUCCESS);
}

// --- peers and IPC ------------------------------------------------------------------------------

TEST_CASE_FIXTURE(CApiFixture, "expseg_enable_peer_access grants a peer, on both backends; bad devices change nothing") {
  for (const char* backend : kBackends) {
    const std::string name = backend;
    CAPTURE(name);
    expseg::capi::reset_for_tests();
    REQUIRE(expseg_configure((std::string("device:sim,backend:") + backend).c_str()) == EXPSEG_SUCCESS);
    // Out-of-range indexes: refused before any allocator is created.
    CHECK(expseg_enable_peer_access(-1, 1) == EXPSEG_ERROR_INVALID_DEVICE);
    CHECK(expseg_enable_peer_access(EXPSEG_MAX_DEVICES, 1) == EXPSEG_ERROR_INVALID_DEVICE);
    CHECK(expseg_enable_peer_access(0, -1) == EXPSEG_ERROR_INVALID_DEVICE);
    CHECK(last_error().find("peer device -1") != std::string::npos);
    CHECK(expseg_enable_peer_access(0, EXPSEG_MAX_DEVICES) == EXPSEG_ERROR_INVALID_DEVICE);
    CHECK(expseg_last_error_code() == EXPSEG_ERROR_INVALID_DEVICE);
    CHECK(expseg_device_initialized(0) == 0);

    // (Every simulated device 0..254 exists, so no in-range peer is missing here; the C++ side's
    // "no device N" refusal is tested in test_multi_device.cpp.)
    // The device itself: nothing to do. A peer: granted, also to memory allocated before it.
    void* before = expseg_malloc(static_cast<ssize_t>(4 * MiB), 0, nullptr);
    REQUIRE(before != nullptr);
    expseg::Allocator* a = expseg::capi::allocator_for_tests(0);
    REQUIRE(a != nullptr);
    CHECK(a->device_info().access_devices == std::vector<int>{0});
    expseg_clear_error();
    CHECK(expseg_enable_peer_access(0, 0) == EXPSEG_SUCCESS);
    CHECK(a->device_info().access_devices == std::vector<int>{0});
    CHECK(expseg_enable_peer_access(0, 3) == EXPSEG_SUCCESS);
    CHECK(expseg_enable_peer_access(0, 3) == EXPSEG_SUCCESS);  // again: nothing to do
    CHECK(a->device_info().access_devices == std::vector<int>{0, 3});
    CHECK(expseg_last_error_code() == EXPSEG_SUCCESS);
    // Another device's allocator is created for its own grant, and is separate.
    CHECK(expseg_device_initialized(5) == 0);
    CHECK(expseg_enable_peer_access(5, 0) == EXPSEG_SUCCESS);
    CHECK(expseg_device_initialized(5) == 1);
    CHECK(expseg::capi::allocator_for_tests(5)->device_info().access_devices == std::vector<int>{5, 0});
    expseg_free(before, 0, 0, nullptr);
    CHECK(expseg_last_error_code() == EXPSEG_SUCCESS);
  }
}

TEST_CASE_FIXTURE(CApiFixture, "regression: expseg_enable_peer_access(d, d) does nothing, and creates no allocator") {
  REQUIRE(expseg_configure("device:sim") == EXPSEG_SUCCESS);
  CHECK(expseg_enable_peer_access(2, 2) == EXPSEG_SUCCESS);
  // Was: device 2's allocator was created, and the configuration could no longer be set.
  CHECK(expseg_device_initialized(2) == 0);
  CHECK(expseg_configure("device:sim,backend:expandable") == EXPSEG_SUCCESS);
  CHECK(expseg_last_error_code() == EXPSEG_SUCCESS);
  // Still checked: an out-of-range device is refused, whatever the peer.
  CHECK(expseg_enable_peer_access(EXPSEG_MAX_DEVICES, EXPSEG_MAX_DEVICES) == EXPSEG_ERROR_INVALID_DEVICE);
}

// Host-backed: the simulated device's addresses are host memory, so the importer reads the bytes.
TEST_CASE_FIXTURE(CApiFixture, "expseg_ipc_export / import / close round trip, both backends, with and without descriptors") {
  struct Case {
    const char* conf;
    bool fds;
  };
  const Case cases[] = {
      {"device:sim,sim_host_backed:true,sim_capacity:1GiB,backend:split_merge", false},
      {"device:sim,sim_host_backed:true,sim_capacity:1GiB,backend:expandable,ipc_handle:posix_fd,expandable_max_handle:2MiB", true},
      {"device:sim,sim_host_backed:true,sim_capacity:1GiB,backend:expandable,ipc_handle:fabric", false},
  };
  for (const Case& c : cases) {
    const std::string conf = c.conf;
    CAPTURE(conf);
    expseg::capi::reset_for_tests();
    REQUIRE(expseg_configure(c.conf) == EXPSEG_SUCCESS);
    const std::size_t n = 5 * MiB + 12345;
    void* p = expseg_malloc(static_cast<ssize_t>(n), 0, nullptr);
    REQUIRE(p != nullptr);
    for (std::size_t i = 0; i < n; ++i) static_cast<unsigned char*>(p)[i] = static_cast<unsigned char>(i * 7 + 1);

    const void* handle = nullptr;
    std::size_t handle_size = 0;
    const int* fds = nullptr;
    std::size_t nfds = 0;
    REQUIRE(expseg_ipc_export(p, 0, &handle, &handle_size, &fds, &nfds) == EXPSEG_SUCCESS);
    REQUIRE(handle != nullptr);
    CHECK(handle_size > 0);
    const std::vector<unsigned char> bytes(static_cast<const unsigned char*>(handle),
                                           static_cast<const unsigned char*>(handle) + handle_size);
    const std::vector<int> own(fds, fds + nfds);  // the caller's descriptors
    CHECK((nfds > 0) == c.fds);
    if (c.fds) CHECK(nfds >= 3);  // 2 MiB handles under 5 MiB and a bit
    for (int fd : own) CHECK(fd_open(fd));

    void* q = nullptr;
    std::size_t size = 0;
    REQUIRE(expseg_ipc_import(bytes.data(), bytes.size(), own.data(), own.size(), 0, &q, &size) == EXPSEG_SUCCESS);
    REQUIRE(q != nullptr);
    CHECK(size == n);
    CHECK(std::memcmp(p, q, n) == 0);
    for (int fd : own) CHECK(fd_open(fd));  // lent for the import, not closed by it

    if (c.fds) {
      // Without descriptors: taken from the exporter (this process) with pidfd_getfd, where allowed.
      void* r = nullptr;
      const int rc = expseg_ipc_import(bytes.data(), bytes.size(), nullptr, 0, 0, &r, nullptr);
      if (rc == EXPSEG_SUCCESS) {
        CHECK(std::memcmp(p, r, n) == 0);
        CHECK(expseg_ipc_close(r, 0) == EXPSEG_SUCCESS);
      } else {
        CHECK(rc == EXPSEG_ERROR_IPC);
        CHECK(r == nullptr);
        CHECK(last_error().find("SCM_RIGHTS") != std::string::npos);
        MESSAGE("pidfd_getfd refused here: " << last_error());
      }
    }
    for (int fd : own) ::close(fd);

    // Closed once; a second close, or one on another device, is refused and changes nothing.
    CHECK(expseg_ipc_close(q, 1) == EXPSEG_ERROR_INVALID_POINTER);
    CHECK(last_error().find("device 1") != std::string::npos);
    CHECK(expseg_ipc_close(q, 0) == EXPSEG_SUCCESS);
    CHECK(expseg_ipc_close(q, 0) == EXPSEG_ERROR_INVALID_POINTER);
    CHECK(last_error().find("already closed") != std::string::npos);
    expseg_clear_error();
    expseg_free(p, 0, 0, nullptr);
    CHECK(expseg_last_error_code() == EXPSEG_SUCCESS);
    CHECK(stat(0, "allocation.all.current") == 0);
  }
}

TEST_CASE_FIXTURE(CApiFixture, "expseg_ipc_export / import / close: every bad input is a code and a message") {
  REQUIRE(expseg_configure("device:sim,sim_host_backed:true,sim_capacity:1GiB,backend:expandable,ipc_handle:posix_fd,"
                           "expandable_max_handle:2MiB") == EXPSEG_SUCCESS);
  const void* handle = nullptr;
  std::size_t handle_size = 0;
  const int* fds = nullptr;
  std::size_t nfds = 0;
  int on_the_stack = 0;

  // Export. A device with no allocator yet: the pointer cannot be one of its allocations.
  CHECK(expseg_ipc_export(&on_the_stack, 0, &handle, &handle_size, &fds, &nfds) == EXPSEG_ERROR_INVALID_POINTER);
  CHECK(last_error().find("no expseg allocator") != std::string::npos);
  CHECK(expseg_device_initialized(0) == 0);
  void* p = expseg_malloc(static_cast<ssize_t>(4 * MiB), 0, nullptr);
  REQUIRE(p != nullptr);
  CHECK(expseg_ipc_export(p, 0, nullptr, &handle_size, &fds, &nfds) == EXPSEG_ERROR_INVALID_ARGUMENT);
  CHECK(expseg_ipc_export(p, 0, &handle, nullptr, &fds, &nfds) == EXPSEG_ERROR_INVALID_ARGUMENT);
  CHECK(expseg_ipc_export(p, 0, &handle, &handle_size, nullptr, &nfds) == EXPSEG_ERROR_INVALID_ARGUMENT);
  CHECK(expseg_ipc_export(p, 0, &handle, &handle_size, &fds, nullptr) == EXPSEG_ERROR_INVALID_ARGUMENT);
  CHECK(expseg_ipc_export(p, -1, &handle, &handle_size, &fds, &nfds) == EXPSEG_ERROR_INVALID_DEVICE);
  CHECK(expseg_ipc_export(p, EXPSEG_MAX_DEVICES, &handle, &handle_size, &fds, &nfds) == EXPSEG_ERROR_INVALID_DEVICE);
  CHECK(expseg_ipc_export(p, 3, &handle, &handle_size, &fds, &nfds) == EXPSEG_ERROR_INVALID_POINTER);  // another device
  CHECK(expseg_ipc_export(nullptr, 0, &handle, &handle_size, &fds, &nfds) == EXPSEG_ERROR_INVALID_POINTER);
  CHECK(expseg_ipc_export(&on_the_stack, 0, &handle, &handle_size, &fds, &nfds) == EXPSEG_ERROR_INVALID_POINTER);
  CHECK(expseg_ipc_export(static_cast<char*>(p) + 4096, 0, &handle, &handle_size, &fds, &nfds) ==
        EXPSEG_ERROR_INVALID_POINTER);  // inside an allocation, not its start
  CHECK(last_error().find("expseg_ipc_export") != std::string::npos);
  CHECK(handle == nullptr);
  CHECK(nfds == 0);

  REQUIRE(expseg_ipc_export(p, 0, &handle, &handle_size, &fds, &nfds) == EXPSEG_SUCCESS);
  const std::vector<unsigned char> bytes(static_cast<const unsigned char*>(handle),
                                         static_cast<const unsigned char*>(handle) + handle_size);
  const std::vector<int> own(fds, fds + nfds);
  REQUIRE(own.size() >= 2);  // 2 MiB handles under 4 MiB

  // Import.
  void* q = &on_the_stack;
  std::size_t size = 99;
  CHECK(expseg_ipc_import(bytes.data(), bytes.size(), own.data(), own.size(), 0, nullptr, &size) ==
        EXPSEG_ERROR_INVALID_ARGUMENT);
  CHECK(expseg_ipc_import(nullptr, bytes.size(), own.data(), own.size(), 0, &q, &size) == EXPSEG_ERROR_INVALID_ARGUMENT);
  CHECK(q == nullptr);  // set on every error
  CHECK(size == 0);
  CHECK(expseg_ipc_import(bytes.data(), 0, own.data(), own.size(), 0, &q, &size) == EXPSEG_ERROR_INVALID_ARGUMENT);
  CHECK(expseg_ipc_import(bytes.data(), bytes.size(), nullptr, own.size(), 0, &q, &size) == EXPSEG_ERROR_INVALID_ARGUMENT);
  CHECK(expseg_ipc_import(bytes.data(), bytes.size(), own.data(), own.size(), -1, &q, &size) == EXPSEG_ERROR_INVALID_DEVICE);
  CHECK(expseg_ipc_import(bytes.data(), bytes.size(), own.data(), own.size(), EXPSEG_MAX_DEVICES, &q, &size) ==
        EXPSEG_ERROR_INVALID_DEVICE);
  const std::vector<unsigned char> garbage(64, 0xab);
  CHECK(expseg_ipc_import(garbage.data(), garbage.size(), nullptr, 0, 0, &q, &size) == EXPSEG_ERROR_IPC);
  CHECK(expseg_ipc_import(bytes.data(), bytes.size() - 1, own.data(), own.size(), 0, &q, &size) == EXPSEG_ERROR_IPC);
  CHECK(expseg_ipc_import(bytes.data(), bytes.size(), own.data(), 1, 0, &q, &size) == EXPSEG_ERROR_IPC);
  CHECK(last_error().find(std::to_string(own.size()) + " file descriptors, 1 were given") != std::string::npos);
  const int negative[2] = {own[0], -5};
  CHECK(expseg_ipc_import(bytes.data(), bytes.size(), negative, 2, 0, &q, &size) == EXPSEG_ERROR_INVALID_ARGUMENT);
  CHECK(q == nullptr);
  // Descriptors that do not name the exported memory (each names the other piece's file): refused
  // before the driver sees them (was: left to the driver, which on CUDA maps whatever they name).
  const int swapped[2] = {own[1], own[0]};
  CHECK(expseg_ipc_import(bytes.data(), bytes.size(), swapped, 2, 0, &q, &size) == EXPSEG_ERROR_IPC);
  CHECK(last_error().find("names another file than the exporter's descriptor") != std::string::npos);
  CHECK(q == nullptr);
  CHECK(expseg_device_initialized(0) == 1);
  for (int fd : own) CHECK(fd_open(fd));  // none of the failures closed the caller's descriptors
  // Imported on a device whose simulated driver did not export it: refused (the sim imports in-process
  // only through the exporting device), before the device's allocator is created.
  CHECK(expseg_ipc_import(bytes.data(), bytes.size(), own.data(), own.size(), 2, &q, &size) == EXPSEG_ERROR_IPC);
  CHECK(expseg_device_initialized(2) == 0);
  CHECK(q == nullptr);

  // Close.
  CHECK(expseg_ipc_close(nullptr, 0) == EXPSEG_SUCCESS);  // as free(NULL)
  CHECK(expseg_ipc_close(nullptr, EXPSEG_MAX_DEVICES) == EXPSEG_SUCCESS);
  CHECK(expseg_ipc_close(p, -1) == EXPSEG_ERROR_INVALID_DEVICE);
  CHECK(expseg_ipc_close(p, 0) == EXPSEG_ERROR_INVALID_POINTER);  // an allocation, not an import
  CHECK(expseg_ipc_close(&on_the_stack, 6) == EXPSEG_ERROR_INVALID_POINTER);  // a device with no allocator
  CHECK(last_error().find("expseg_ipc_close") != std::string::npos);

  // After all that, the real thing still works, and the allocation is intact.
  REQUIRE(expseg_ipc_import(bytes.data(), bytes.size(), own.data(), own.size(), 0, &q, &size) == EXPSEG_SUCCESS);
  CHECK(size == 4 * MiB);
  CHECK(expseg_ipc_close(q, 0) == EXPSEG_SUCCESS);
  for (int fd : own) ::close(fd);
  CHECK(stat(0, "allocation.all.current") == 1);
  expseg_clear_error();
  expseg_free(p, 0, 0, nullptr);
  CHECK(expseg_last_error_code() == EXPSEG_SUCCESS);
}

TEST_CASE_FIXTURE(CApiFixture, "expseg_ipc_export: an expandable allocator without a shareable handle type says which key to set") {
  REQUIRE(expseg_configure("device:sim,backend:expandable") == EXPSEG_SUCCESS);
  void* p = expseg_malloc(static_cast<ssize_t>(MiB), 0, nullptr);
  REQUIRE(p != nullptr);
  const void* handle = nullptr;
  std::size_t handle_size = 0;
  const int* fds = nullptr;
  std::size_t nfds = 0;
  CHECK(expseg_ipc_export(p, 0, &handle, &handle_size, &fds, &nfds) == EXPSEG_ERROR_IPC);
  CHECK(expseg_last_error_code() == EXPSEG_ERROR_IPC);
  CHECK(last_error().find("ipc_handle:posix_fd") != std::string::npos);
  // A split_merge handle carries no descriptors: giving some is a mistake of the caller.
  expseg::capi::reset_for_tests();
  REQUIRE(expseg_configure("device:sim,backend:split_merge") == EXPSEG_SUCCESS);
  p = expseg_malloc(static_cast<ssize_t>(MiB), 0, nullptr);
  REQUIRE(p != nullptr);
  REQUIRE(expseg_ipc_export(p, 0, &handle, &handle_size, &fds, &nfds) == EXPSEG_SUCCESS);
  CHECK(nfds == 0);
  CHECK(fds == nullptr);
  const std::vector<unsigned char> bytes(static_cast<const unsigned char*>(handle),
                                         static_cast<const unsigned char*>(handle) + handle_size);
  const int one = 0;
  void* q = nullptr;
  CHECK(expseg_ipc_import(bytes.data(), bytes.size(), &one, 1, 0, &q, nullptr) == EXPSEG_ERROR_INVALID_ARGUMENT);
  CHECK(last_error().find("takes no file descriptors") != std::string::npos);
  REQUIRE(expseg_ipc_import(bytes.data(), bytes.size(), nullptr, 0, 0, &q, nullptr) == EXPSEG_SUCCESS);
  CHECK(q == p);  // in-process on the simulator: cuIpcOpenMemHandle gives the same address
  // Imports still open when the state is reset (a test's reset_for_tests) are closed with it.
  expseg_free(p, 0, 0, nullptr);
}

}  // TEST_SUITE

namespace {
struct OomCalls {
  std::vector<int> devices;
  std::vector<std::int64_t> requested;
  std::vector<int> error_inside;  // the thread's error code while the callback runs
  std::int64_t ooms_inside = -1;
};
extern "C" void record_oom(int device, const char* report_json, void* user_data) {
  auto* calls = static_cast<OomCalls*>(user_data);
  calls->devices.push_back(device);
  calls->requested.push_back(parse_json(report_json)["requested_bytes"].as_int());
  calls->error_inside.push_back(expseg_last_error_code());
  calls->ooms_inside = stat(device, "num_ooms");  // the callback may call expseg: no lock is held
  // An OOM of the callback's own allocation is not reported to it again.
  if (expseg_malloc(64 * MiB, device, nullptr) != nullptr) calls->devices.push_back(-1);
}
}  // namespace

// expseg.h: "sets *ptr (and *size when not NULL) ... (NULL and 0 on error)": a caller that passes
// only `size` (a NULL ptr is its mistake) must not read a stale or uninitialised size.
TEST_CASE_FIXTURE(CApiFixture, "regression: expseg_ipc_import sets *size to 0 on every error, a NULL ptr included") {
  std::size_t size = 99;
  const unsigned char junk[16] = {};
  CHECK(expseg_ipc_import(junk, sizeof junk, nullptr, 0, 0, nullptr, &size) == EXPSEG_ERROR_INVALID_ARGUMENT);
  CHECK(last_error().find("ptr must not be NULL") != std::string::npos);
  CHECK(size == 0);
  CHECK(expseg_device_initialized(0) == 0);
}

namespace {
// The serialized handle `make` builds in a fork child of this process (another process), its pid
// field set to this process's pid: what a process of another PID namespace (another container)
// that happens to have our pid sends.
template <class F>
std::vector<unsigned char> handle_from_other_process_with_our_pid(F&& make) {
  int pipefd[2];
  REQUIRE(::pipe(pipefd) == 0);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::close(pipefd[0]);
    int rc = 1;
    try {
      expseg::IpcMemHandle h = make();
      h.exporter_pid = ::getppid();
      const std::vector<std::uint8_t> bytes = h.serialize();
      if (::write(pipefd[1], bytes.data(), bytes.size()) == static_cast<ssize_t>(bytes.size())) rc = 0;
    } catch (...) {
    }
    ::_exit(rc);
  }
  ::close(pipefd[1]);
  std::vector<unsigned char> out;
  unsigned char buf[4096];
  for (ssize_t n; (n = ::read(pipefd[0], buf, sizeof buf)) > 0;) out.insert(out.end(), buf, buf + n);
  ::close(pipefd[0]);
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
  return out;
}
}  // namespace

// Whether a handle comes from this process was decided by its pid alone; another PID namespace's
// process may have the same pid. Was: such a handle was taken for this process's own.
TEST_CASE_FIXTURE(CApiFixture, "regression: expseg_ipc_import tells another process with our pid from this one") {
  SUBCASE("sim: another process's handle is not imported as this process's own") {
    REQUIRE(expseg_configure("device:sim,sim_host_backed:true,sim_capacity:1GiB,backend:split_merge") == EXPSEG_SUCCESS);
    void* p = expseg_malloc(static_cast<ssize_t>(4 * MiB), 0, nullptr);
    REQUIRE(p != nullptr);
    // The child's copy of the allocator exports its copy of the allocation.
    const std::vector<unsigned char> bytes = handle_from_other_process_with_our_pid([&] {
      const void* handle = nullptr;
      std::size_t handle_size = 0;
      const int* fds = nullptr;
      std::size_t nfds = 0;
      if (expseg_ipc_export(p, 0, &handle, &handle_size, &fds, &nfds) != EXPSEG_SUCCESS) throw std::runtime_error("export");
      return expseg::IpcMemHandle::deserialize({static_cast<const std::uint8_t*>(handle), handle_size});
    });
    void* q = nullptr;
    const int rc = expseg_ipc_import(bytes.data(), bytes.size(), nullptr, 0, 0, &q, nullptr);
    CHECK(rc == EXPSEG_ERROR_IPC);
    CHECK(q == nullptr);
    CHECK(last_error().find("in-process only") != std::string::npos);
    CHECK(last_error().find("another PID namespace") != std::string::npos);
    if (q != nullptr) CHECK(expseg_ipc_close(q, 0) == EXPSEG_SUCCESS);
    expseg_free(p, 0, 0, nullptr);
  }
  SUBCASE("cuda: another process's cuda_ipc handle is not refused as exported here") {
    REQUIRE(expseg_configure("device:cuda") == EXPSEG_SUCCESS);
    const std::vector<unsigned char> bytes = handle_from_other_process_with_our_pid([] {
      expseg::IpcMemHandle h;
      h.kind = expseg::IpcKind::cuda_ipc;
      h.device_kind = "cuda";
      h.size = MiB;
      h.range_bytes = 2 * MiB;
      h.pieces.resize(1);
      h.pieces[0].bytes = 2 * MiB;
      return h;
    });
    void* q = nullptr;
    const int rc = expseg_ipc_import(bytes.data(), bytes.size(), nullptr, 0, 0, &q, nullptr);
    // No GPU here (or a handle naming no memory on one): some failure, but not this one.
    CHECK(rc != EXPSEG_SUCCESS);
    CHECK(last_error().find("process that exported it") == std::string::npos);
  }
}

TEST_CASE_FIXTURE(CApiFixture, "expseg_set_oom_callback: called with the report before malloc returns NULL, on every entry point") {
  OomCalls calls;
  REQUIRE(expseg_configure("device:sim,sim_capacity:4GiB,backend:expandable,limit:64MiB") == EXPSEG_SUCCESS);
  REQUIRE(expseg_set_oom_callback(record_oom, &calls) == EXPSEG_SUCCESS);
  void* keep = expseg_malloc(40 * MiB, 1, nullptr);
  REQUIRE(keep != nullptr);
  CHECK(calls.devices.empty());  // not called when nothing fails
  CHECK(expseg_malloc(32 * MiB, 1, nullptr) == nullptr);
  CHECK(expseg_cupy_malloc(nullptr, 33 * MiB, 1) == nullptr);
  CHECK_THROWS_AS(expseg_torch_malloc(34 * MiB, 1, nullptr), expseg::out_of_memory);
  CHECK(calls.devices == std::vector<int>{1, 1, 1});
  CHECK(calls.requested == std::vector<std::int64_t>{32 * MiB, 33 * MiB, 34 * MiB});
  CHECK(calls.ooms_inside == 5);  // the 3 OOMs here and the callback's own (not reported again)
  CHECK(expseg_last_error_code() == EXPSEG_ERROR_OUT_OF_MEMORY);  // what the caller sees after the callback
  // NULL removes it.
  REQUIRE(expseg_set_oom_callback(nullptr, &calls) == EXPSEG_SUCCESS);
  CHECK(expseg_malloc(32 * MiB, 1, nullptr) == nullptr);
  CHECK(calls.devices.size() == 3);
  expseg_free(keep, 0, 1, nullptr);
  CHECK(expseg_last_error_code() == EXPSEG_ERROR_OUT_OF_MEMORY);  // unchanged by the successful free
}

TEST_CASE_FIXTURE(CApiFixture, "expseg_release_stream refuses the default, legacy and per-thread streams before the allocator exists too") {
  // Was: with no allocator yet, every stream was released (SUCCESS), so the same misuse passed or
  // failed depending on whether anything had been allocated before.
  REQUIRE(expseg_configure("device:sim") == EXPSEG_SUCCESS);
  for (int round = 0; round < 2; ++round) {
    CAPTURE(round);
    for (std::uintptr_t v : {std::uintptr_t{0}, std::uintptr_t{1}, std::uintptr_t{2}}) {
      CAPTURE(v);
      CHECK(expseg_release_stream(0, reinterpret_cast<expseg_stream_t>(v)) == EXPSEG_ERROR_INVALID_ARGUMENT);
      CHECK(last_error().find("only a stream the program created") != std::string::npos);
    }
    if (round == 0) {  // another stream: nothing cached for it, and a release creates no allocator
      CHECK(expseg_release_stream(0, reinterpret_cast<expseg_stream_t>(std::uintptr_t{0x5000})) == EXPSEG_SUCCESS);
      CHECK(expseg_device_initialized(0) == 0);
    }
    expseg_free(expseg_malloc(4096, 0, nullptr), 4096, 0, nullptr);  // the second round: with one
  }
}
