// The driver contract and CUDA specifics on the real device (device 0).
#include <doctest/doctest.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <thread>

#include "driver/driver.hpp"
#include "driver_contract.hpp"

using namespace expseg::driver;

TEST_SUITE("driver") {
  TEST_CASE("driver: contract on CudaDriver device 0") {
    auto d = make_cuda_driver(0);
    REQUIRE(d != nullptr);
    CHECK(std::string(d->kind()) == "cuda");
    CHECK(d->device() == 0);
    CHECK(d->shareable_handle_type() == ShareableHandle::none);
    check_driver_contract(*d, true);
  }

  TEST_CASE("driver: the address space runs out on CudaDriver device 0") {
    // Reserves 16 TiB ranges until cuMemAddressReserve refuses (at most 1 PiB), frees them all, and
    // says how much the process got (the H200, driver 580.159.04: 112 TiB, of x86-64's 128 TiB).
    auto d = make_cuda_driver(0);
    REQUIRE(d != nullptr);
    check_address_space_limit(*d);
  }

  TEST_CASE("driver: CudaDriver works from a thread with no current context") {
    // The driver pushes its primary context for each call and pops it again; a fresh thread has none.
    auto d = make_cuda_driver(0);
    bool ok = false;
    std::string error;
    std::thread t([&] {
      try {
        const dev_ptr p = d->mem_alloc(d->granularity());
        d->memset_d32(p, 0xBEEFu, d->granularity() / 4, nullptr);
        std::uint32_t v = 0;
        d->copy_to_host(&v, p + d->granularity() - 4, 4);
        d->mem_free(p);
        ok = v == 0xBEEFu;
      } catch (const std::exception& e) {
        error = e.what();
      }
    });
    t.join();
    INFO(error);
    CHECK(ok);
    // Two drivers of the same device share the primary context; destroying one leaves the other working.
    {
      auto other = make_cuda_driver(0);
      other->release(other->create(other->granularity()));
    }
    d->release(d->create(d->granularity()));
  }

  TEST_CASE("driver: CUDA mem_info and device count") {
    std::string why = "unchanged";
    CHECK(cuda_usable(&why));
    CHECK(why.empty());
    CHECK(cuda_device_count() >= 1);
    auto d = make_cuda_driver(0);
    CHECK(d->device_count() == cuda_device_count());
    const MemInfo info = d->mem_info();
    CHECK(info.total > 0);
    CHECK(info.free <= info.total);
    MESSAGE("device 0: " << d->device_name() << ", " << info.total << " bytes, granularity " << d->granularity());

    // Physical memory shows up in mem_info: free drops by at least what was created and comes back
    // once it is released. Other users of the GPU may move free meanwhile, so a few tries count.
    const std::size_t bytes = 64 * d->granularity();
    bool seen_taken = false, seen_back = false;
    for (int attempt = 0; attempt < 5 && !(seen_taken && seen_back); ++attempt) {
      const MemInfo before = d->mem_info();
      const phys_handle h = d->create(bytes);
      const MemInfo after = d->mem_info();
      d->release(h);
      const MemInfo released = d->mem_info();
      CHECK(after.total == info.total);
      seen_taken = seen_taken || after.free + bytes <= before.free;
      seen_back = seen_back || released.free >= after.free + bytes;
    }
    CHECK(seen_taken);
    CHECK(seen_back);
  }

  TEST_CASE("driver: CUDA invalid device throws driver_error") {
    auto err = expseg::test::catch_driver_error([] { (void)make_cuda_driver(cuda_device_count() + 7); });
    REQUIRE(err.has_value());
    CHECK(err->call() == "cuDeviceGet");
    CHECK(err->code_name() == "CUDA_ERROR_INVALID_DEVICE");
  }

  TEST_CASE("driver: CUDA memory is created GPUDirect RDMA capable where the device supports it, and maps and holds data") {
    // The H200 reports GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED: create() then asks for
    // gpuDirectRDMACapable (cuMemCreate would fail with CUDA_ERROR_INVALID_VALUE on a bad flag).
    for (ShareableHandle type : {ShareableHandle::none, ShareableHandle::posix_fd}) {
      CudaOptions options;
      options.shareable = type;
      auto d = make_cuda_driver(0, options);
      MESSAGE("GPUDirect RDMA with VMM: " << std::string(d->gpu_direct_rdma() ? "yes" : "no"));
      if (d->device_name().find("H200") != std::string::npos) CHECK(d->gpu_direct_rdma());  // Hopper supports it
      const std::size_t g = d->granularity();
      const phys_handle h = d->create(2 * g);
      const dev_ptr va = d->reserve(2 * g);
      d->map(va, 2 * g, h);
      d->set_access(va, 2 * g);
      d->memset_d32(va, 0xC0FFEEu, 2 * g / 4, nullptr);
      std::vector<std::uint32_t> back(2 * g / 4);
      d->copy_to_host(back.data(), va, 2 * g);
      CHECK(std::all_of(back.begin(), back.end(), [](std::uint32_t v) { return v == 0xC0FFEEu; }));
      d->unmap(va, 2 * g);
      d->free_reserve(va, 2 * g);
      d->release(h);
    }
  }

  TEST_CASE("driver: CUDA ipc_export of a cuMemAlloc pointer") {
    auto d = make_cuda_driver(0);
    const dev_ptr p = d->mem_alloc(d->granularity());
    const ExportedHandle h = d->ipc_export(p);
    CHECK(h.bytes.size() == 64);
    CHECK(std::any_of(h.bytes.begin(), h.bytes.end(), [](std::uint8_t b) { return b != 0; }));
    d->mem_free(p);
  }

  TEST_CASE("driver: CUDA posix_fd export and in-process import") {
    CudaOptions options;
    options.shareable = ShareableHandle::posix_fd;
    auto d = make_cuda_driver(0, options);
    if (d->shareable_handle_type() != ShareableHandle::posix_fd) {
      // Linux with a current driver supports them: on the H200 (driver 580) a fallback is a failure.
      if (d->device_name().find("H200") != std::string::npos)
        FAIL("posix_fd handles unavailable on an H200: " << d->shareable_fallback_reason());
      // Only a device that says it has no posix_fd handles may skip the test: where the attribute says
      // yes and the probe's create/export/import still failed, the driver layer has a defect to show.
      if (d->shareable_fallback_reason().find("POSIX_FILE_DESCRIPTOR_SUPPORTED = 0") == std::string::npos)
        FAIL("the device reports posix_fd handles, but the probe failed: " << d->shareable_fallback_reason());
      WARN_MESSAGE(false, "posix_fd handles unavailable, the export and import were not tested: " << d->shareable_fallback_reason());
      CHECK_FALSE(d->shareable_fallback_reason().empty());
      return;
    }
    CHECK(d->shareable_fallback_reason().empty());
    const std::size_t g = d->granularity();
    const phys_handle h = d->create(g);
    const ExportedHandle ex = d->export_handle(h);
    CHECK(ex.type == ShareableHandle::posix_fd);
    REQUIRE(ex.fd >= 0);
    CHECK((::fcntl(ex.fd, F_GETFD) & FD_CLOEXEC) != 0);  // a child the process execs does not inherit it
    const phys_handle imported = d->import_handle(ex);
    CHECK(imported != 0);
    ::close(ex.fd);

    // Both handles name the same memory: write through one mapping, read through the other.
    const dev_ptr base = d->reserve(2 * g);
    d->map(base, g, h);
    d->map(base + g, g, imported);
    d->set_access(base, 2 * g);
    d->memset_d32(base, 0x600DF00Du, g / 4, nullptr);
    d->stream_synchronize(nullptr);
    expseg::test::check_words(*d, base + g, g / 4, 0x600DF00Du);
    d->unmap(base, 2 * g);
    d->free_reserve(base, 2 * g);
    d->release(imported);
    d->release(h);
  }

  TEST_CASE("driver: CUDA fabric request falls back with a reason, or works") {
    CudaOptions options;
    options.shareable = ShareableHandle::fabric;
    auto d = make_cuda_driver(0, options);
    MESSAGE("fabric request -> " << static_cast<int>(d->shareable_handle_type()) << ": "
                                 << d->shareable_fallback_reason());
    if (d->shareable_handle_type() == ShareableHandle::fabric) {
      CHECK(d->shareable_fallback_reason().empty());
      const phys_handle h = d->create(d->granularity());
      const ExportedHandle ex = d->export_handle(h);
      CHECK(ex.type == ShareableHandle::fabric);
      CHECK(std::any_of(ex.bytes.begin(), ex.bytes.end(), [](std::uint8_t b) { return b != 0; }));
      d->release(h);
    } else {
      CHECK_FALSE(d->shareable_fallback_reason().empty());
    }
  }

  TEST_CASE("driver: CUDA export without a shareable type is an error") {
    auto d = make_cuda_driver(0);
    const phys_handle h = d->create(d->granularity());
    auto err = expseg::test::catch_driver_error([&] { (void)d->export_handle(h); });
    REQUIRE(err.has_value());
    CHECK(err->call() == "cuMemExportToShareableHandle");
    d->release(h);
  }

  TEST_CASE("driver: CUDA stream-ordered allocations") {
    auto d = make_cuda_driver(0);
    const stream_t s = d->stream_create();
    const dev_ptr p = d->mem_alloc_async(std::size_t{1} << 20, s);
    CHECK(p != 0);
    d->memset_d32(p, 0xA11CA7EDu, (std::size_t{1} << 20) / 4, s);
    d->stream_synchronize(s);
    expseg::test::check_words(*d, p, (std::size_t{1} << 20) / 4, 0xA11CA7EDu);
    d->mem_free_async(p, s);
    d->stream_synchronize(s);
    d->stream_destroy(s);
  }

  TEST_CASE("driver: CUDA event on a non-blocking stream") {
    auto d = make_cuda_driver(0);
    const stream_t s = d->stream_create();
    const event_t e = d->event_create();
    d->event_record(e, s);
    d->stream_synchronize(s);
    CHECK(d->event_query(e));
    d->event_destroy(e);
    d->stream_destroy(s);
  }
}
