// The CUDA driver layer (lib/driver/cuda_driver.cpp) on a stand-in libcuda (fake_libcuda.cpp), on
// every machine: how CudaDriver sets up a device without CUDA virtual memory management, what an
// out-of-memory during its shareable-handle probe means, and what its refusals say. The real
// device's behaviour is the gpu suite's (test_driver_contract_cuda.cpp); these are the paths a
// GPU at hand does not take.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <dlfcn.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>

#include "driver/driver.hpp"
#include "expseg/allocator.hpp"
#include "expseg/config.hpp"
#include "expseg/errors.hpp"

#ifndef EXPSEG_FAKE_LIBCUDA
#error "EXPSEG_FAKE_LIBCUDA: the path of the built fake libcuda (tests/meson.build)"
#endif

namespace {

using namespace expseg;

constexpr int kOutOfMemory = 2, kNotSupported = 801;

// The fake's controls, from the same library CudaDriver loads (one dlopen'ed copy per path).
struct Fake {
  void (*reset)() = nullptr;
  void (*set_vmm)(int) = nullptr;
  void (*fail)(const char*, int, int) = nullptr;
  int (*calls)(const char*) = nullptr;
};
const Fake& fake() {
  static const Fake f = [] {
    void* lib = ::dlopen(EXPSEG_FAKE_LIBCUDA, RTLD_NOW | RTLD_LOCAL);
    REQUIRE_MESSAGE(lib != nullptr, "cannot load the fake libcuda: ", ::dlerror());
    Fake out;
    out.reset = reinterpret_cast<void (*)()>(::dlsym(lib, "expseg_fake_cuda_reset"));
    out.set_vmm = reinterpret_cast<void (*)(int)>(::dlsym(lib, "expseg_fake_cuda_set_vmm"));
    out.fail = reinterpret_cast<void (*)(const char*, int, int)>(::dlsym(lib, "expseg_fake_cuda_fail"));
    out.calls = reinterpret_cast<int (*)(const char*)>(::dlsym(lib, "expseg_fake_cuda_calls"));
    REQUIRE((out.reset && out.set_vmm && out.fail && out.calls));
    return out;
  }();
  f.reset();
  return f;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

Config cuda_config(const char* backend) {
  Config c = Config::parse(std::string("device:cuda,oom_snapshot:false,backend:") + backend);
  return c;
}

}  // namespace

TEST_CASE("cuda driver: the stand-in libcuda is the one loaded") {
  (void)fake();
  std::string why;
  REQUIRE_MESSAGE(driver::cuda_usable(&why), why);
  auto d = driver::make_cuda_driver(0);
  CHECK(std::string(d->kind()) == "cuda");
  CHECK(d->device_name() == "expseg fake GPU");
  CHECK(d->granularity() == (std::size_t{2} << 20));
}

TEST_CASE("cuda driver: a device without virtual memory management serves split_merge; the VMM calls refuse and say why") {
  const Fake& f = fake();
  f.set_vmm(0);
  driver::CudaOptions o;
  o.shareable = driver::ShareableHandle::posix_fd;
  std::unique_ptr<driver::Driver> d;
  REQUIRE_NOTHROW(d = driver::make_cuda_driver(0, o));
  // None of the VMM queries was made: such a device may refuse them (CUDA_ERROR_NOT_SUPPORTED).
  CHECK(f.calls("cuMemGetAllocationGranularity") == 0);
  CHECK(f.calls("cuMemCreate") == 0);
  CHECK(d->granularity() == 0);
  CHECK(d->shareable_handle_type() == driver::ShareableHandle::none);
  CHECK(contains(d->shareable_fallback_reason(), "posix_fd handles are not available"));
  CHECK(contains(d->shareable_fallback_reason(), "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"));

  const driver::dev_ptr p = d->mem_alloc(std::size_t{1} << 20);
  CHECK(p != 0);
  d->mem_free(p);

  auto refuses = [&](const char* call, auto&& fn) {
    CAPTURE(call);
    try {
      fn();
      FAIL("the VMM call was not refused");
    } catch (const driver_error& e) {
      CHECK(e.call() == call);
      CHECK(e.code() == kNotSupported);
      CHECK(contains(e.what(), "does not support CUDA virtual memory management"));
      CHECK(contains(e.what(), "backend:split_merge"));
    }
  };
  refuses("cuMemAddressReserve", [&] { (void)d->reserve(std::size_t{2} << 20); });
  refuses("cuMemCreate", [&] { (void)d->create(std::size_t{2} << 20); });
  driver::ExportedHandle ex;
  ex.type = driver::ShareableHandle::posix_fd;
  ex.fd = 0;
  refuses("cuMemImportFromShareableHandle", [&] { (void)d->import_handle(ex); });
  CHECK(f.calls("cuMemAddressReserve") == 0);  // refused before the driver is asked
}

TEST_CASE("cuda driver: without virtual memory management, split_merge allocates and reports its OOMs; expandable refuses to start") {
  const Fake& f = fake();
  f.set_vmm(0);
  {
    Config c = cuda_config("split_merge");
    c.apply("limit:32MiB");
    Allocator a(c);
    CHECK(a.device_info().granularity == 0);
    void* p = a.allocate(std::size_t{3} << 20);
    CHECK(p != nullptr);
    // An OOM under the limit: its other-backend check (expandable) cannot be asked on such a
    // device, and the report says so rather than simulating a device of granularity 0.
    // 3 + 20 MiB live fit the limit; a second 20 MiB segment does not.
    try {
      (void)a.allocate(std::size_t{20} << 20);
      FAIL("the allocation did not fail");
    } catch (const out_of_memory& e) {
      CHECK(e.report().counterfactual == Counterfactual::not_evaluated);
      CHECK(contains(e.what(), "The expandable backend was not asked: the device does not support CUDA virtual memory management"));
    }
    // The driver's own refusal, then the allocator goes on.
    a.deallocate(p);
    a.release_cached();
    f.fail("cuMemAlloc", kOutOfMemory, -1);
    CHECK_THROWS_AS((void)a.allocate(std::size_t{8} << 20), out_of_memory);
    f.fail("cuMemAlloc", kOutOfMemory, 0);
    void* q = a.allocate(std::size_t{8} << 20);
    CHECK(q != nullptr);
    a.deallocate(q);
  }
  try {
    Allocator a(cuda_config("expandable"));
    FAIL("the expandable backend started on a device without VMM");
  } catch (const error& e) {
    CHECK(contains(e.what(), "does not support CUDA virtual memory management"));
    CHECK(contains(e.what(), "use backend:split_merge"));
  }
}

TEST_CASE("cuda driver: an out-of-memory during the shareable-handle probe keeps the handle type; a refusal falls back") {
  const Fake& f = fake();
  driver::CudaOptions o;
  o.shareable = driver::ShareableHandle::posix_fd;
  SUBCASE("the device is full: the type stays, unverified") {
    f.fail("cuMemCreate", kOutOfMemory, 1);
    auto d = driver::make_cuda_driver(0, o);
    CHECK(f.calls("cuMemCreate") == 1);
    CHECK(d->shareable_handle_type() == driver::ShareableHandle::posix_fd);
    CHECK(d->shareable_fallback_reason().empty());
  }
  SUBCASE("the platform refuses the type: sharing falls back to none and says why") {
    f.fail("cuMemCreate", kNotSupported, 1);
    auto d = driver::make_cuda_driver(0, o);
    CHECK(d->shareable_handle_type() == driver::ShareableHandle::none);
    CHECK(contains(d->shareable_fallback_reason(), "a probe cuMemCreate failed"));
    CHECK(contains(d->shareable_fallback_reason(), "CUDA_ERROR_NOT_SUPPORTED"));
  }
}

TEST_CASE("cuda driver: an export without a shareable type names a fallback only where there was one") {
  const Fake& f = fake();
  {
    auto d = driver::make_cuda_driver(0);  // shareable none asked for
    const driver::phys_handle h = d->create(d->granularity());
    try {
      (void)d->export_handle(h);
      FAIL("exported");
    } catch (const driver_error& e) {
      CHECK(contains(e.what(), "CudaOptions::shareable is none"));
      CHECK_FALSE(contains(e.what(), "fell back"));
    }
    d->release(h);
  }
  driver::CudaOptions o;
  o.shareable = driver::ShareableHandle::posix_fd;
  f.fail("cuMemExportToShareableHandle", kNotSupported, 1);  // the probe's export
  auto d = driver::make_cuda_driver(0, o);
  REQUIRE(d->shareable_handle_type() == driver::ShareableHandle::none);
  const driver::phys_handle h = d->create(d->granularity());
  try {
    (void)d->export_handle(h);
    FAIL("exported");
  } catch (const driver_error& e) {
    CHECK(contains(e.what(), "fell back to none: posix_fd handles are not available (a probe cuMemExportToShareableHandle failed"));
  }
  d->release(h);
}

// The command line on the fake's one device: an index past it is a usage error named before any
// run (was: the "Device: cuda:5" line, then cuDeviceGet's CUDA_ERROR_INVALID_DEVICE, exit 1).
TEST_CASE("cli: --device cuda:N past the visible devices is a usage error that says how many there are") {
  const std::string err_file = "/tmp/expseg-cuda-fake-cli-" + std::to_string(::getpid()) + ".txt";
  auto run = [&](const std::string& device, std::string* err) {
    const std::string cmd = "env EXPSEG_LIBCUDA='" EXPSEG_FAKE_LIBCUDA "' '" EXPSEG_CLI "' scenario split-800-500-300 --json --device " + device +
                            " >/dev/null 2>'" + err_file + "'";
    const int st = std::system(cmd.c_str());
    std::ifstream f(err_file);
    err->assign(std::istreambuf_iterator<char>(f), {});
    std::remove(err_file.c_str());
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
  };
  std::string err;
  CHECK(run("cuda:5", &err) == 2);
  CHECK_MESSAGE(contains(err, "bad --device value 'cuda:5': no such device; 1 visible (cuda:0)"), err);
  CHECK_FALSE(contains(err, "CUDA_ERROR_INVALID_DEVICE"));
  CHECK(run("cuda:1", &err) == 2);
  CHECK_MESSAGE(contains(err, "no such device; 1 visible"), err);
}

int main(int argc, char** argv) {
  // Before anything loads the driver library (once per process): this test's libcuda is the fake.
  ::setenv("EXPSEG_LIBCUDA", EXPSEG_FAKE_LIBCUDA, 1);
  ::unsetenv("EXPSEG_ALLOC_CONF");
  doctest::Context ctx;
  ctx.applyCommandLine(argc, argv);
  return ctx.run();
}
