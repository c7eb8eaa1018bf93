// CudaDriver: the Driver interface on the CUDA driver API.
//
// libcuda.so.1 is dlopen'ed at run time (never linked), so the library builds and runs its simulated
// tests where no driver is installed. Only cuGetProcAddress comes from dlsym; every other entry point
// is obtained through it.
//
// ABI: cuGetProcAddress(name, cudaVersion) returns the newest ABI of `name` up to cudaVersion, and
// that is not always what cuda.h declares under the name: for 13000, "cuCtxSynchronize" is the
// CUDA 13 ABI cuCtxSynchronize(CUcontext), while cuda.h still declares cuCtxSynchronize(void) (seen
// on an H200, driver 580: CUDA_ERROR_CONTEXT_IS_DESTROYED). So each entry point is requested at the
// version whose ABI matches its declaration in cuda.h (decltype(&::cuX), which follows cuda.h's
// macros, e.g. cuMemAlloc -> cuMemAlloc_v2), and a static_assert checks that pairing against
// cudaTypedefs.h (PFN_cuX_vN), so a header upgrade that changes an ABI fails to compile instead of
// crashing. The few whose declaration differs between the toolkits expseg builds with (12.3+, 13.x) are
// pinned to one ABI and its PFN type instead (EXPSEG_CUDA_FIXED_ABI_ENTRY_POINTS).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "driver/driver.hpp"

#if defined(__CUDA_API_PER_THREAD_DEFAULT_STREAM) || defined(CUDA_API_PER_THREAD_DEFAULT_STREAM)
#error "expseg's driver layer assumes legacy default stream semantics"
#endif

namespace expseg::driver {
namespace {

static_assert(sizeof(CUmemFabricHandle) == sizeof(ExportedHandle::bytes));
static_assert(sizeof(CUipcMemHandle) == sizeof(ExportedHandle::bytes));
static_assert(sizeof(CUdeviceptr) == sizeof(dev_ptr));
static_assert(sizeof(CUmemGenericAllocationHandle) == sizeof(phys_handle));

// (name, the CUDA version whose ABI cuda.h declares for it). cuGetErrorName/cuGetErrorString come
// first: later failures while loading are named with them.
#define EXPSEG_CUDA_ENTRY_POINTS(X)                                                                    \
  X(cuGetErrorName, 6000) X(cuGetErrorString, 6000) X(cuInit, 2000) X(cuDeviceGet, 2000)              \
  X(cuDeviceGetCount, 2000) X(cuDeviceGetName, 2000) X(cuDeviceGetAttribute, 2000)                    \
  X(cuDeviceCanAccessPeer, 4000) X(cuDevicePrimaryCtxRetain, 7000) X(cuDevicePrimaryCtxRelease, 11000) \
  X(cuCtxGetCurrent, 4000) X(cuCtxPushCurrent, 4000) X(cuCtxPopCurrent, 4000)                         \
  X(cuCtxEnablePeerAccess, 4000)                                                                        \
  X(cuCtxSynchronize, 2000) X(cuMemGetInfo, 3020) X(cuMemGetAllocationGranularity, 10020)             \
  X(cuMemAddressReserve, 10020) X(cuMemAddressFree, 10020) X(cuMemCreate, 10020)                      \
  X(cuMemRelease, 10020) X(cuMemMap, 10020) X(cuMemUnmap, 10020) X(cuMemSetAccess, 10020)             \
  X(cuMemAlloc, 3020) X(cuMemFree, 3020) X(cuMemAllocAsync, 11020) X(cuMemFreeAsync, 11020)        \
  X(cuMemGetAddressRange, 3020)                                                                         \
  X(cuStreamCreate, 2000) X(cuStreamDestroy, 4000) X(cuStreamGetFlags, 5050)                          \
  X(cuStreamSynchronize, 2000) X(cuEventCreate, 2000) X(cuEventDestroy, 4000) X(cuEventRecord, 2000) \
  X(cuStreamWaitEvent, 3020)                                                                            \
  X(cuEventQuery, 2000) X(cuEventSynchronize, 2000) X(cuMemsetD32Async, 3020)                         \
  X(cuMemcpyDtoH, 3020) X(cuMemcpyHtoD, 3020) X(cuMemExportToShareableHandle, 10020)                  \
  X(cuMemImportFromShareableHandle, 10020) X(cuIpcGetMemHandle, 4010) X(cuIpcOpenMemHandle, 11000)    \
  X(cuIpcCloseMemHandle, 4010) X(cuThreadExchangeStreamCaptureMode, 10010)                           \
  X(cuStreamBeginCapture, 10010) X(cuStreamEndCapture, 10000) X(cuGraphInstantiateWithFlags, 11040)   \
  X(cuGraphLaunch, 10000) X(cuGraphExecDestroy, 10000) X(cuGraphDestroy, 10000)

// `name` is macro-expanded (cuMemAlloc -> cuMemAlloc_v2) in decltype and in the member name alike,
// so `api.cuMemAlloc` is the cuMemAlloc_v2 pointer; PFN_##name pastes the unexpanded name.
#define EXPSEG_CHECK_ABI(name, version)                                                      \
  static_assert(std::is_same_v<decltype(&::name), PFN_##name##_v##version>,                  \
                "cuda.h's declaration of " #name " is not the ABI of CUDA version " #version);
EXPSEG_CUDA_ENTRY_POINTS(EXPSEG_CHECK_ABI)
#undef EXPSEG_CHECK_ABI

// Entry points whose declaration in cuda.h differs between the toolkits expseg builds with (12.x and
// 13.x): each is requested at one fixed ABI and called through its cudaTypedefs.h type, whatever
// cuda.h maps the name to. cuStreamGetCaptureInfo is the 11.3 ABI (six arguments): CUDA 12's cuda.h
// declares that one and CUDA 13's the 12.3 ABI (seven, with edge data expseg never asks for); every
// driver since 11.3 serves it.
#define EXPSEG_CUDA_FIXED_ABI_ENTRY_POINTS(X) X(cuStreamGetCaptureInfo, 11030)

struct Api {
#define EXPSEG_DECLARE(name, version) decltype(&::name) name = nullptr;
  EXPSEG_CUDA_ENTRY_POINTS(EXPSEG_DECLARE)
#undef EXPSEG_DECLARE
#define EXPSEG_DECLARE_FIXED(name, version) PFN_##name##_v##version name = nullptr;
  EXPSEG_CUDA_FIXED_ABI_ENTRY_POINTS(EXPSEG_DECLARE_FIXED)
#undef EXPSEG_DECLARE_FIXED
};

// The process-wide state of libcuda: loaded once, never unloaded (unloading libcuda while other
// code may still hold its pointers, or at exit, is a known source of crashes).
struct Library {
  bool ok = false;     // libcuda loaded, every entry point found, cuInit succeeded
  int device_count = 0;
  Api api;
  // When !ok: the failure, as the fields of the driver_error make_cuda_driver throws.
  std::string call;
  int code = 0;
  std::string code_name;
  std::string description;
};

std::string error_name(const Api& api, CUresult r) {
  const char* name = nullptr;
  if (api.cuGetErrorName == nullptr || api.cuGetErrorName(r, &name) != CUDA_SUCCESS || name == nullptr)
    return "CUDA_ERROR_UNRECOGNIZED";
  return name;
}

std::string error_string(const Api& api, CUresult r) {
  const char* text = nullptr;
  if (api.cuGetErrorString == nullptr || api.cuGetErrorString(r, &text) != CUDA_SUCCESS || text == nullptr)
    return "unrecognized CUresult " + std::to_string(static_cast<int>(r));
  return text;
}

[[noreturn]] void throw_cuda(const Api& api, const char* call, CUresult r) {
  throw driver_error(call, static_cast<int>(r), error_name(api, r), error_string(api, r));
}

inline void check(const Api& api, CUresult r, const char* call) {
  if (r != CUDA_SUCCESS) throw_cuda(api, call, r);
}

// What a machine without a usable GPU can do instead (the failures of loading libcuda and of cuInit
// finding no device say it).
constexpr const char* kNoGpuHint = " (no GPU? use device:sim (EXPSEG_ALLOC_CONF=device:sim) to run on the simulated device)";

Library load_library() {
  Library lib;
  auto fail = [&lib](std::string call, int code, std::string code_name, std::string description) {
    lib.call = std::move(call);
    lib.code = code;
    lib.code_name = std::move(code_name);
    lib.description = std::move(description);
    return std::move(lib);
  };

  // EXPSEG_LIBCUDA names the driver library to load instead (the CUDA forward-compatibility
  // driver, /usr/local/cuda/compat/libcuda.so.1, say); only that one is tried then.
  void* handle = nullptr;
  if (const char* path = std::getenv("EXPSEG_LIBCUDA"); path != nullptr && *path != '\0') {
    handle = ::dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      const char* e = ::dlerror();
      return fail("dlopen", CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND",
                  std::string("cannot load the CUDA driver library that EXPSEG_LIBCUDA names: ") + (e ? e : path) + kNoGpuHint);
    }
  } else {
    handle = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  }
  if (handle == nullptr) {
    const char* e1 = ::dlerror();
    std::string first = e1 ? e1 : "unknown error";
    handle = ::dlopen("libcuda.so", RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      const char* e2 = ::dlerror();
      return fail("dlopen", CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND",
                  "cannot load the CUDA driver library: " + first + "; " + (e2 ? e2 : "unknown error") + kNoGpuHint);
    }
  }

  using GetProcV2 = PFN_cuGetProcAddress_v12000;
  static_assert(std::is_same_v<GetProcV2, decltype(&::cuGetProcAddress_v2)>);
  using GetProcV1 = PFN_cuGetProcAddress_v11030;
  GetProcV2 get_v2 = nullptr;
  GetProcV1 get_v1 = nullptr;
  if (void* sym = ::dlsym(handle, "cuGetProcAddress_v2")) {
    get_v2 = reinterpret_cast<GetProcV2>(sym);
  } else if (void* sym1 = ::dlsym(handle, "cuGetProcAddress")) {
    get_v1 = reinterpret_cast<GetProcV1>(sym1);
  } else {
    return fail("dlsym", CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND",
                "libcuda has neither cuGetProcAddress_v2 nor cuGetProcAddress (driver too old)");
  }

  // On failure returns the description of what went wrong; empty on success.
  // The default flags give the legacy-default-stream variants (not _ptds/_ptsz).
  auto get = [&](const char* symbol, int version, void** fn, CUresult* result) -> std::string {
    *fn = nullptr;
    if (get_v2 != nullptr) {
      CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SUCCESS;
      *result = get_v2(symbol, fn, version, CU_GET_PROC_ADDRESS_DEFAULT, &status);
      if (*result == CUDA_SUCCESS && status == CU_GET_PROC_ADDRESS_SUCCESS && *fn != nullptr) return {};
      if (status == CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT)
        return std::string(symbol) + " is not available for CUDA version " + std::to_string(version);
    } else {
      *result = get_v1(symbol, fn, version, CU_GET_PROC_ADDRESS_DEFAULT);
      if (*result == CUDA_SUCCESS && *fn != nullptr) return {};
    }
    return std::string(symbol) + " not found in the CUDA driver (driver too old?)";
  };

#define EXPSEG_LOAD(name, version)                                                             \
  {                                                                                            \
    void* fn = nullptr;                                                                        \
    CUresult r = CUDA_SUCCESS;                                                                 \
    std::string problem = get(#name, version, &fn, &r);                                        \
    if (!problem.empty()) {                                                                    \
      if (r == CUDA_SUCCESS) r = CUDA_ERROR_NOT_FOUND;                                         \
      return fail("cuGetProcAddress", static_cast<int>(r), error_name(lib.api, r), problem);   \
    }                                                                                          \
    lib.api.name = reinterpret_cast<decltype(lib.api.name)>(fn);                               \
  }
  EXPSEG_CUDA_ENTRY_POINTS(EXPSEG_LOAD)
  EXPSEG_CUDA_FIXED_ABI_ENTRY_POINTS(EXPSEG_LOAD)
#undef EXPSEG_LOAD

  if (CUresult r = lib.api.cuInit(0); r != CUDA_SUCCESS)
    return fail("cuInit", static_cast<int>(r), error_name(lib.api, r),
                error_string(lib.api, r) + (r == CUDA_ERROR_NO_DEVICE ? kNoGpuHint : ""));
  int count = 0;
  if (CUresult r = lib.api.cuDeviceGetCount(&count); r != CUDA_SUCCESS)
    return fail("cuDeviceGetCount", static_cast<int>(r), error_name(lib.api, r), error_string(lib.api, r));
  lib.device_count = count;
  lib.ok = true;
  return lib;
}

const Library& library() {
  // Thread-safe, once, and never destroyed: an allocator made or used while the process exits (a
  // static destructor, a thread still running during exit(), PyTorch freeing its tensors) reads it
  // after function-local statics are destroyed (its error strings freed: a use after free, ASan).
  static const Library* const lib = new Library(load_library());
  return *lib;
}

CUmemAllocationHandleType to_cu(ShareableHandle type) noexcept {
  switch (type) {
    case ShareableHandle::posix_fd: return CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    case ShareableHandle::fabric: return CU_MEM_HANDLE_TYPE_FABRIC;
    case ShareableHandle::none: break;
  }
  return CU_MEM_HANDLE_TYPE_NONE;
}

const char* shareable_name(ShareableHandle type) noexcept {
  switch (type) {
    case ShareableHandle::posix_fd: return "posix_fd";
    case ShareableHandle::fabric: return "fabric";
    case ShareableHandle::none: break;
  }
  return "none";
}

CUdeviceptr to_cu(dev_ptr p) noexcept { return static_cast<CUdeviceptr>(p); }
// The legacy default stream, named explicitly so the meaning of nullptr never depends on flags.
CUstream to_cu(stream_t s) noexcept { return s ? static_cast<CUstream>(s) : CU_STREAM_LEGACY; }
CUevent to_cu_event(event_t e) noexcept { return static_cast<CUevent>(e); }

[[noreturn]] void throw_invalid(const char* call, const std::string& description) {
  throw driver_error(call, CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", description);
}

class CudaDriver final : public Driver {
 public:
  CudaDriver(const Api& api, int device, const CudaOptions& options);
  ~CudaDriver() override;
  CudaDriver(const CudaDriver&) = delete;
  CudaDriver& operator=(const CudaDriver&) = delete;

  const char* kind() const noexcept override { return "cuda"; }
  int device() const noexcept override { return ordinal_; }
  std::string device_name() const override { return name_; }
  std::size_t granularity() const noexcept override { return granularity_; }

  MemInfo mem_info() override {
    CtxScope scope(*this);
    std::size_t free = 0, total = 0;
    check(api_, api_.cuMemGetInfo(&free, &total), "cuMemGetInfo");
    return {free, total};
  }

  dev_ptr reserve(std::size_t bytes) override {
    const Timed timed(*this, Op::reserve);
    CtxScope scope(*this);
    require_vmm("cuMemAddressReserve");
    CUdeviceptr p = 0;
    check(api_, api_.cuMemAddressReserve(&p, bytes, granularity_, 0, 0), "cuMemAddressReserve");
    return p;
  }
  void free_reserve(dev_ptr base, std::size_t bytes) override {
    const Timed timed(*this, Op::free_reserve);
    CtxScope scope(*this);
    check(api_, api_.cuMemAddressFree(to_cu(base), bytes), "cuMemAddressFree");
  }
  phys_handle create(std::size_t bytes) override {
    const Timed timed(*this, Op::create);
    CtxScope scope(*this);
    require_vmm("cuMemCreate");
    CUmemGenericAllocationHandle h = 0;
    check(api_, api_.cuMemCreate(&h, bytes, &prop_, 0), "cuMemCreate");
    return h;
  }
  void release(phys_handle handle) override {
    const Timed timed(*this, Op::release);
    CtxScope scope(*this);
    check(api_, api_.cuMemRelease(handle), "cuMemRelease");
  }
  void map(dev_ptr ptr, std::size_t bytes, phys_handle handle) override {
    const Timed timed(*this, Op::map);
    CtxScope scope(*this);
    check(api_, api_.cuMemMap(to_cu(ptr), bytes, 0, handle, 0), "cuMemMap");
  }
  void unmap(dev_ptr ptr, std::size_t bytes) override {
    const Timed timed(*this, Op::unmap);
    CtxScope scope(*this);
    check(api_, api_.cuMemUnmap(to_cu(ptr), bytes), "cuMemUnmap");
  }
  void set_access(dev_ptr ptr, std::size_t bytes) override {
    const Timed timed(*this, Op::set_access);
    CtxScope scope(*this);
    check(api_, api_.cuMemSetAccess(to_cu(ptr), bytes, access_.data(), access_.size()), "cuMemSetAccess");
  }

  // Relaxed capture mode for this thread around a call: in global mode (PyTorch's and CUDA's
  // default) a cuMemAlloc, cuMemFree, event query or synchronization of another stream made while
  // any stream captures fails and invalidates the capture, whichever thread makes it; relaxed, it is
  // permitted (measured on the H200, driver 580), as PyTorch relies on for cudaMalloc during graph
  // capture. The exchange pair costs about 21 ns.
  class RelaxedCapture {
   public:
    explicit RelaxedCapture(const Api& api) : api_(api) {
      check(api_, api_.cuThreadExchangeStreamCaptureMode(&mode_), "cuThreadExchangeStreamCaptureMode");
    }
    ~RelaxedCapture() { api_.cuThreadExchangeStreamCaptureMode(&mode_); }  // back to the caller's mode
    RelaxedCapture(const RelaxedCapture&) = delete;
    RelaxedCapture& operator=(const RelaxedCapture&) = delete;

   private:
    const Api& api_;
    CUstreamCaptureMode mode_ = CU_STREAM_CAPTURE_MODE_RELAXED;
  };

  dev_ptr mem_alloc(std::size_t bytes) override {
    const Timed timed(*this, Op::mem_alloc);
    CtxScope scope(*this);
    CUdeviceptr p = 0;
    CUresult r = CUDA_SUCCESS;
    {
      const RelaxedCapture relaxed(api_);
      r = api_.cuMemAlloc(&p, bytes);
    }
    check(api_, r, "cuMemAlloc");
    return p;
  }
  void mem_free(dev_ptr ptr) override {
    const Timed timed(*this, Op::mem_free);
    CtxScope scope(*this);
    CUresult r = CUDA_SUCCESS;
    {
      const RelaxedCapture relaxed(api_);
      r = api_.cuMemFree(to_cu(ptr));
    }
    check(api_, r, "cuMemFree");
  }
  dev_ptr mem_alloc_async(std::size_t bytes, stream_t stream) override {
    CtxScope scope(*this);
    CUdeviceptr p = 0;
    check(api_, api_.cuMemAllocAsync(&p, bytes, to_cu(stream)), "cuMemAllocAsync");
    return p;
  }
  void mem_free_async(dev_ptr ptr, stream_t stream) override {
    CtxScope scope(*this);
    check(api_, api_.cuMemFreeAsync(to_cu(ptr), to_cu(stream)), "cuMemFreeAsync");
  }

  stream_t stream_create() override { return create_stream(CU_STREAM_NON_BLOCKING); }
  stream_t stream_create_blocking() override { return create_stream(CU_STREAM_DEFAULT); }
  stream_t create_stream(unsigned int flags) {
    CtxScope scope(*this);
    CUstream s = nullptr;
    check(api_, api_.cuStreamCreate(&s, flags), "cuStreamCreate");
    return s;
  }
  bool stream_is_blocking(stream_t stream) override {
    const Timed timed(*this, Op::stream_query);
    CtxScope scope(*this);
    unsigned int flags = 0;
    CUresult r = CUDA_SUCCESS;
    {
      const RelaxedCapture relaxed(api_);  // permitted while another stream captures (measured)
      r = api_.cuStreamGetFlags(to_cu(stream), &flags);
    }
    check(api_, r, "cuStreamGetFlags");
    return (flags & CU_STREAM_NON_BLOCKING) == 0;
  }
  void stream_destroy(stream_t stream) override {
    if (stream == nullptr) throw_invalid("cuStreamDestroy", "the default stream cannot be destroyed");
    CtxScope scope(*this);
    check(api_, api_.cuStreamDestroy(static_cast<CUstream>(stream)), "cuStreamDestroy");
  }
  event_t event_create() override {
    CtxScope scope(*this);
    CUevent e = nullptr;
    check(api_, api_.cuEventCreate(&e, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
    return e;
  }
  void event_destroy(event_t event) override {
    CtxScope scope(*this);
    check(api_, api_.cuEventDestroy(to_cu_event(event)), "cuEventDestroy");
  }
  void event_record(event_t event, stream_t stream) override {
    const Timed timed(*this, Op::event_record);
    CtxScope scope(*this);
    check(api_, api_.cuEventRecord(to_cu_event(event), to_cu(stream)), "cuEventRecord");
  }
  void stream_wait_event(stream_t stream, event_t event) override {
    CtxScope scope(*this);
    check(api_, api_.cuStreamWaitEvent(to_cu(stream), to_cu_event(event), 0), "cuStreamWaitEvent");
  }
  bool event_query(event_t event) override {
    const Timed timed(*this, Op::event_query);
    CtxScope scope(*this);
    CUresult r = CUDA_SUCCESS;
    {
      const RelaxedCapture relaxed(api_);
      r = api_.cuEventQuery(to_cu_event(event));
    }
    if (r == CUDA_ERROR_NOT_READY) return false;
    check(api_, r, "cuEventQuery");
    return true;
  }
  void event_synchronize(event_t event) override {
    const Timed timed(*this, Op::stream_sync);
    CtxScope scope(*this);
    CUresult r = CUDA_SUCCESS;
    {
      const RelaxedCapture relaxed(api_);
      r = api_.cuEventSynchronize(to_cu_event(event));
    }
    check(api_, r, "cuEventSynchronize");
  }
  void stream_synchronize(stream_t stream) override {
    const Timed timed(*this, Op::stream_sync);
    CtxScope scope(*this);
    CUresult r = CUDA_SUCCESS;
    {
      const RelaxedCapture relaxed(api_);
      r = api_.cuStreamSynchronize(to_cu(stream));
    }
    check(api_, r, "cuStreamSynchronize");
  }
  void device_synchronize() override {
    const Timed timed(*this, Op::stream_sync);
    CtxScope scope(*this);
    check(api_, api_.cuCtxSynchronize(), "cuCtxSynchronize");
  }

  std::uint64_t stream_capture_id(stream_t stream) override {
    const Timed timed(*this, Op::stream_query);
    CtxScope scope(*this);
    CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
    cuuint64_t id = 0;
    check(api_, api_.cuStreamGetCaptureInfo(to_cu(stream), &status, &id, nullptr, nullptr, nullptr),
          "cuStreamGetCaptureInfo");
    return status == CU_STREAM_CAPTURE_STATUS_NONE ? 0 : id;  // an invalidated capture still has its id
  }
  void capture_begin(stream_t stream, CaptureMode mode) override {
    CtxScope scope(*this);
    const CUstreamCaptureMode cu = mode == CaptureMode::relaxed             ? CU_STREAM_CAPTURE_MODE_RELAXED
                                   : mode == CaptureMode::thread_local_mode ? CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
                                                                            : CU_STREAM_CAPTURE_MODE_GLOBAL;
    check(api_, api_.cuStreamBeginCapture(to_cu(stream), cu), "cuStreamBeginCapture");
  }
  graph_t capture_end(stream_t stream) override {
    CtxScope scope(*this);
    CUgraph graph = nullptr;
    check(api_, api_.cuStreamEndCapture(to_cu(stream), &graph), "cuStreamEndCapture");
    CUgraphExec exec = nullptr;
    const CUresult r = api_.cuGraphInstantiateWithFlags(&exec, graph, 0);
    api_.cuGraphDestroy(graph);  // the executable graph keeps what it needs
    check(api_, r, "cuGraphInstantiateWithFlags");
    return exec;
  }
  void graph_launch(graph_t graph, stream_t stream) override {
    CtxScope scope(*this);
    check(api_, api_.cuGraphLaunch(static_cast<CUgraphExec>(graph), to_cu(stream)), "cuGraphLaunch");
  }
  void graph_destroy(graph_t graph) override {
    CtxScope scope(*this);
    check(api_, api_.cuGraphExecDestroy(static_cast<CUgraphExec>(graph)), "cuGraphExecDestroy");
  }

  void memset_d32(dev_ptr ptr, std::uint32_t value, std::size_t count, stream_t stream) override {
    CtxScope scope(*this);
    check(api_, api_.cuMemsetD32Async(to_cu(ptr), value, count, to_cu(stream)), "cuMemsetD32Async");
  }
  void copy_to_host(void* dst, dev_ptr src, std::size_t bytes) override {
    CtxScope scope(*this);
    check(api_, api_.cuMemcpyDtoH(dst, to_cu(src), bytes), "cuMemcpyDtoH");
  }
  void copy_from_host(dev_ptr dst, const void* src, std::size_t bytes) override {
    CtxScope scope(*this);
    check(api_, api_.cuMemcpyHtoD(to_cu(dst), src, bytes), "cuMemcpyHtoD");
  }

  int device_count() override {
    int count = 0;
    check(api_, api_.cuDeviceGetCount(&count), "cuDeviceGetCount");
    return count;
  }
  // Whether `peer` can access memory that lives on this device: the direction set_access() grants.
  bool can_access_peer(int peer) override {
    if (peer == ordinal_) return false;
    CtxScope scope(*this);
    CUdevice peer_dev = 0;
    check(api_, api_.cuDeviceGet(&peer_dev, peer), "cuDeviceGet");
    int can = 0;
    check(api_, api_.cuDeviceCanAccessPeer(&can, peer_dev, dev_), "cuDeviceCanAccessPeer");
    return can != 0;
  }
  // `peer` as a CUdevice, once it is known to be a device that can reach this one's memory
  // (cuDeviceCanAccessPeer); both kinds of grant need that. Throws driver_error otherwise.
  CUdevice checked_peer(int peer) {
    const int count = device_count();
    if (peer < 0 || peer >= count)
      throw driver_error("cuDeviceGet", CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE",
                         "no device " + std::to_string(peer) + " to grant access to (" + std::to_string(count) +
                             " visible; CUDA_VISIBLE_DEVICES renumbers them)");
    if (!can_access_peer(peer))
      throw driver_error("cuDeviceCanAccessPeer", CUDA_ERROR_PEER_ACCESS_UNSUPPORTED,
                         "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
                         "device " + std::to_string(peer) + " cannot access memory of device " +
                             std::to_string(ordinal_) +
                             " (no peer-to-peer path between them: no NVLink or PCIe P2P, or P2P disabled by the "
                             "platform, e.g. IOMMU/ACS settings or a virtualised GPU)");
    CUdevice peer_dev = 0;
    check(api_, api_.cuDeviceGet(&peer_dev, peer), "cuDeviceGet");
    return peer_dev;
  }
  // Grants `peer` access to this device's virtual memory management memory (expandable, and what
  // import_ipc maps from posix_fd/fabric handles): the access descriptor list that set_access()
  // passes to cuMemSetAccess gains `peer` (the backend re-grants what is already mapped).
  // cuMemSetAccess needs no context-level peer access, so neither the peer's context nor CUDA's
  // limit of 8 cuCtxEnablePeerAccess peers is involved.
  bool add_access_device(int peer) override {
    for (int d : devices_)
      if (d == peer) return false;
    (void)checked_peer(peer);
    CUmemAccessDesc desc{};
    desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = peer;
    desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    access_.reserve(access_.size() + 1);  // reserve first: the pushes below then cannot throw halfway
    devices_.reserve(devices_.size() + 1);
    devices_.push_back(peer);
    access_.push_back(desc);
    return true;
  }
  // cuMemAlloc memory (split_merge, cuIpcOpenMemHandle'd memory) is reached through contexts: the
  // peer's primary context enables peer access to this device's primary context. The peer's primary
  // context is retained for this driver's lifetime: releasing it could destroy it, and the peer
  // access with it.
  bool enable_context_peer(int peer) override {
    if (peer == ordinal_) return false;
    for (int d : ctx_peers_)
      if (d == peer) return false;
    const CUdevice peer_dev = checked_peer(peer);
    CUcontext peer_ctx = nullptr;
    check(api_, api_.cuDevicePrimaryCtxRetain(&peer_ctx, peer_dev), "cuDevicePrimaryCtxRetain");
    try {
      ctx_peers_.reserve(ctx_peers_.size() + 1);  // reserve first: the pushes below then cannot throw halfway
      peer_devs_.reserve(peer_devs_.size() + 1);
      check(api_, api_.cuCtxPushCurrent(peer_ctx), "cuCtxPushCurrent");
      const CUresult r = api_.cuCtxEnablePeerAccess(ctx_, 0);
      CUcontext popped = nullptr;
      (void)api_.cuCtxPopCurrent(&popped);  // cannot fail: pushed above on this thread
      const std::string what = " (enabling access from device " + std::to_string(peer) + "'s primary context to device " +
                               std::to_string(ordinal_) + "'s, for its cuMemAlloc memory";
      if (r == CUDA_ERROR_TOO_MANY_PEERS)
        throw driver_error("cuCtxEnablePeerAccess", static_cast<int>(r), error_name(api_, r),
                           error_string(api_, r) + what +
                               ": CUDA allows a device at most 8 peers this way. Memory of the expandable backend "
                               "needs no context peer access: backend:expandable shares memory with any number of peers)");
      // Already enabled (by the application, PyTorch, or another driver of this device): it is enabled, as asked.
      if (r != CUDA_SUCCESS && r != CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED)
        throw driver_error("cuCtxEnablePeerAccess", static_cast<int>(r), error_name(api_, r),
                           error_string(api_, r) + what + ")");
      ctx_peers_.push_back(peer);
      peer_devs_.push_back(peer_dev);
    } catch (...) {
      (void)api_.cuDevicePrimaryCtxRelease(peer_dev);
      throw;
    }
    return true;
  }
  std::vector<int> context_peers() const override { return ctx_peers_; }
  std::vector<int> access_devices() const override { return devices_; }

  ShareableHandle shareable_handle_type() const noexcept override { return shareable_; }
  std::string shareable_fallback_reason() const override { return fallback_reason_; }
  bool gpu_direct_rdma() const noexcept override { return rdma_; }

  ExportedHandle export_handle(phys_handle handle) override {
    const Timed timed(*this, Op::export_handle);
    ExportedHandle out;
    out.type = shareable_;
    if (shareable_ == ShareableHandle::none)
      throw_invalid("cuMemExportToShareableHandle",
                    "physical memory is created without a shareable handle type (" +
                        (fallback_reason_.empty() ? std::string("CudaOptions::shareable is none")
                                                  : "CudaOptions::shareable fell back to none: " + fallback_reason_) +
                        ")");
    CtxScope scope(*this);
    if (shareable_ == ShareableHandle::posix_fd) {
      int fd = -1;
      check(api_, api_.cuMemExportToShareableHandle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
            "cuMemExportToShareableHandle");
      // The driver does not promise close-on-exec, and an inherited descriptor keeps the memory alive
      // in every program the process execs: set it, as the simulated device and recv_fds do.
      const int flags = ::fcntl(fd, F_GETFD);
      if (flags < 0 || (!(flags & FD_CLOEXEC) && ::fcntl(fd, F_SETFD, flags | FD_CLOEXEC) < 0)) {
        const int err = errno;
        ::close(fd);
        throw driver_error("cuMemExportToShareableHandle", CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN",
                           std::string("fcntl(FD_CLOEXEC) on the exported descriptor failed: ") + std::strerror(err));
      }
      out.fd = fd;
    } else {
      CUmemFabricHandle fabric{};
      check(api_, api_.cuMemExportToShareableHandle(&fabric, handle, CU_MEM_HANDLE_TYPE_FABRIC, 0),
            "cuMemExportToShareableHandle");
      std::memcpy(out.bytes.data(), &fabric, sizeof fabric);
    }
    return out;
  }
  phys_handle import_handle(const ExportedHandle& exported) override {
    const Timed timed(*this, Op::import_handle);
    require_vmm("cuMemImportFromShareableHandle");
    CUmemGenericAllocationHandle h = 0;
    switch (exported.type) {
      case ShareableHandle::posix_fd: {
        if (exported.fd < 0) throw_invalid("cuMemImportFromShareableHandle", "the exported file descriptor is negative");
        CtxScope scope(*this);
        void* os_handle = reinterpret_cast<void*>(static_cast<std::uintptr_t>(exported.fd));
        check(api_, api_.cuMemImportFromShareableHandle(&h, os_handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
              "cuMemImportFromShareableHandle");
        return h;
      }
      case ShareableHandle::fabric: {
        CtxScope scope(*this);
        CUmemFabricHandle fabric{};
        std::memcpy(&fabric, exported.bytes.data(), sizeof fabric);
        check(api_, api_.cuMemImportFromShareableHandle(&h, &fabric, CU_MEM_HANDLE_TYPE_FABRIC),
              "cuMemImportFromShareableHandle");
        return h;
      }
      case ShareableHandle::none: break;
    }
    throw_invalid("cuMemImportFromShareableHandle", "the exported handle has no shareable type");
  }
  ExportedHandle ipc_export(dev_ptr mem_alloc_ptr) override {
    const Timed timed(*this, Op::export_handle);
    CtxScope scope(*this);
    CUipcMemHandle h{};
    check(api_, api_.cuIpcGetMemHandle(&h, to_cu(mem_alloc_ptr)), "cuIpcGetMemHandle");
    ExportedHandle out;
    std::memcpy(out.bytes.data(), &h, sizeof h);
    return out;
  }
  dev_ptr ipc_open(const ExportedHandle& exported) override {
    const Timed timed(*this, Op::import_handle);
    CtxScope scope(*this);
    CUipcMemHandle h{};
    std::memcpy(&h, exported.bytes.data(), sizeof h);
    CUdeviceptr p = 0;
    check(api_, api_.cuIpcOpenMemHandle(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle");
    return p;
  }
  void ipc_close(dev_ptr ptr) override {
    CtxScope scope(*this);
    check(api_, api_.cuIpcCloseMemHandle(to_cu(ptr)), "cuIpcCloseMemHandle");
  }
  std::pair<dev_ptr, std::size_t> address_range(dev_ptr ptr) override {
    CtxScope scope(*this);
    CUdeviceptr base = 0;
    std::size_t bytes = 0;
    check(api_, api_.cuMemGetAddressRange(&base, &bytes, to_cu(ptr)), "cuMemGetAddressRange");
    return {base, bytes};
  }

 public:
  CallStats call_stats() const override {
    CallStats c;
    for (std::size_t i = 0; i < kOpCount; ++i) {
      c.calls[i] = op_calls_[i].load(std::memory_order_relaxed);
      c.seconds[i] = static_cast<double>(op_ns_[i].load(std::memory_order_relaxed)) * 1e-9;
    }
    return c;
  }

 private:
  // Counts one call of `op` and the time until the scope ends (the call, its context switch and
  // its error check; a failed call counts too). Relaxed atomics: a few ns against µs-long calls.
  class Timed {
   public:
    Timed(CudaDriver& d, Op op) noexcept : d_(d), op_(static_cast<std::size_t>(op)), t0_(std::chrono::steady_clock::now()) {}
    ~Timed() {
      const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0_).count();
      d_.op_calls_[op_].fetch_add(1, std::memory_order_relaxed);
      d_.op_ns_[op_].fetch_add(static_cast<std::uint64_t>(ns), std::memory_order_relaxed);
    }
    Timed(const Timed&) = delete;
    Timed& operator=(const Timed&) = delete;

   private:
    CudaDriver& d_;
    std::size_t op_;
    std::chrono::steady_clock::time_point t0_;
  };
  std::array<std::atomic<std::uint64_t>, kOpCount> op_calls_{};
  std::array<std::atomic<std::uint64_t>, kOpCount> op_ns_{};

  // Makes the device's primary context current for one call: pushes it only when another (or no)
  // context is current, and pops it at scope exit, so callers' own contexts stay as they were, on
  // any thread.
  class CtxScope {
   public:
    explicit CtxScope(const CudaDriver& d) : api_(d.api_) {
      CUcontext current = nullptr;
      check(api_, api_.cuCtxGetCurrent(&current), "cuCtxGetCurrent");
      if (current != d.ctx_) {
        check(api_, api_.cuCtxPushCurrent(d.ctx_), "cuCtxPushCurrent");
        pushed_ = true;
      }
    }
    ~CtxScope() {
      if (pushed_) {
        CUcontext popped = nullptr;
        (void)api_.cuCtxPopCurrent(&popped);  // cannot fail: we pushed it on this thread
      }
    }
    CtxScope(const CtxScope&) = delete;
    CtxScope& operator=(const CtxScope&) = delete;

   private:
    const Api& api_;
    bool pushed_ = false;
  };

  CUmemAllocationProp make_prop(ShareableHandle type) const noexcept {
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = to_cu(type);
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = ordinal_;
    // As PyTorch does, so that NICs (NCCL's registered user buffers) can reach expandable memory. Its
    // price: ~4.4 us more per cuMemMap and ~4 us per cuMemUnmap, nothing on the other calls (H100,
    // benchmarks/PERFORMANCE.md session 49): a tenth of random churn's driver time, none on cached paths.
    if (rdma_) prop.allocFlags.gpuDirectRDMACapable = 1;
    return prop;
  }
  std::string cuda_failure(const char* call, CUresult r) const {
    return std::string(call) + " failed: " + error_name(api_, r) + " (" + std::to_string(static_cast<int>(r)) +
           "): " + error_string(api_, r);
  }
  // Empty when physical memory of this type can be created, exported and imported back here; otherwise
  // why not. Needs ctx_ current.
  void init_vmm(ShareableHandle requested);  // the constructor's part for a device with VMM
  std::string probe_shareable(ShareableHandle type);
  // The VMM calls' refusal on a device without virtual memory management (no_vmm_ says why).
  void require_vmm(const char* call) const {
    if (!no_vmm_.empty()) throw driver_error(call, CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", no_vmm_);
  }

  const Api& api_;
  int ordinal_;
  CUdevice dev_ = 0;
  CUcontext ctx_ = nullptr;  // the device's primary context, retained for the object's lifetime
  std::string name_;
  std::size_t granularity_ = 0;  // 0 without VMM
  std::string no_vmm_;           // empty when the device supports VMM, else why the VMM calls refuse
  CUmemAllocationProp prop_{};  // what create() makes: pinned, on this device, shareable_ handles
  ShareableHandle shareable_ = ShareableHandle::none;
  bool rdma_ = false;  // CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED: create() asks for it
  std::string fallback_reason_;
  std::vector<int> devices_;             // this device first; devices_[i] is access_[i]'s location
  std::vector<CUmemAccessDesc> access_;  // READWRITE for each of devices_
  std::vector<int> ctx_peers_;           // enable_context_peer's peers; ctx_peers_[i] is peer_devs_[i]
  std::vector<CUdevice> peer_devs_;      // peers whose primary context this driver retains
};

CudaDriver::CudaDriver(const Api& api, int device, const CudaOptions& options) : api_(api), ordinal_(device) {
  check(api_, api_.cuDeviceGet(&dev_, device), "cuDeviceGet");
  check(api_, api_.cuDevicePrimaryCtxRetain(&ctx_, dev_), "cuDevicePrimaryCtxRetain");
  try {  // the destructor does not run if the constructor throws: release the context here
    CtxScope scope(*this);
    char name[256] = {};
    check(api_, api_.cuDeviceGetName(name, static_cast<int>(sizeof name - 1), dev_), "cuDeviceGetName");
    name_ = name;
    // A device without virtual memory management (some vGPU and virtualized setups) still serves
    // cuMemAlloc (split_merge) and cuIpcOpenMemHandle: the driver is built without the VMM queries
    // below, and the VMM calls refuse with no_vmm_ (granularity() is 0).
    int vmm = 0;
    check(api_, api_.cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev_),
          "cuDeviceGetAttribute(VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)");
    if (vmm == 0) {
      no_vmm_ = "device " + std::to_string(ordinal_) + " (" + name_ +
                ") does not support CUDA virtual memory management (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED "
                "is 0): cuMemAddressReserve, cuMemCreate and cuMemMap are not available; backend:split_merge works without them";
      if (options.shareable != ShareableHandle::none)
        fallback_reason_ = std::string(shareable_name(options.shareable)) + " handles are not available (" + no_vmm_ + "), using none";
    } else {
      init_vmm(options.shareable);
    }

    CUmemAccessDesc self{};
    self.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    self.location.id = ordinal_;
    self.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    devices_.push_back(ordinal_);
    access_.push_back(self);
  } catch (...) {
    (void)api_.cuDevicePrimaryCtxRelease(dev_);
    throw;
  }
}

void CudaDriver::init_vmm(ShareableHandle requested) {
  // Before the probe below: it creates memory with the same properties as create().
  int rdma = 0;
  check(api_, api_.cuDeviceGetAttribute(&rdma, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, dev_),
        "cuDeviceGetAttribute(GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED)");
  rdma_ = rdma != 0;

  ShareableHandle type = requested;
  while (type != ShareableHandle::none) {
    std::string problem = probe_shareable(type);
    if (problem.empty()) break;
    const ShareableHandle next = type == ShareableHandle::fabric ? ShareableHandle::posix_fd : ShareableHandle::none;
    if (!fallback_reason_.empty()) fallback_reason_ += "; ";
    fallback_reason_ += std::string(shareable_name(type)) + " handles are not available (" + problem + "), using " +
                        shareable_name(next);
    type = next;
  }
  shareable_ = type;
  prop_ = make_prop(type);
  check(api_, api_.cuMemGetAllocationGranularity(&granularity_, &prop_, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
        "cuMemGetAllocationGranularity");
}

CudaDriver::~CudaDriver() {
  // Errors are ignored: at process exit the driver may already be shutting down.
  for (CUdevice peer : peer_devs_) (void)api_.cuDevicePrimaryCtxRelease(peer);
  (void)api_.cuDevicePrimaryCtxRelease(dev_);
}

std::string CudaDriver::probe_shareable(ShareableHandle type) {
  const CUdevice_attribute attr = type == ShareableHandle::fabric
                                      ? CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED
                                      : CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED;
  const char* attr_name = type == ShareableHandle::fabric ? "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED"
                                                          : "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED";
  int supported = 0;
  if (CUresult r = api_.cuDeviceGetAttribute(&supported, attr, dev_); r != CUDA_SUCCESS)
    return cuda_failure("cuDeviceGetAttribute", r);
  if (supported == 0) return std::string("the device reports ") + attr_name + " = 0";

  // The attribute can say yes where the platform still refuses (fabric without IMEX channels in a
  // container): only creating memory tells.
  const CUmemAllocationProp prop = make_prop(type);
  std::size_t gran = 0;
  if (CUresult r = api_.cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
      r != CUDA_SUCCESS)
    return cuda_failure("cuMemGetAllocationGranularity", r);
  CUmemGenericAllocationHandle h = 0;
  if (CUresult r = api_.cuMemCreate(&h, gran, &prop, 0); r != CUDA_SUCCESS) {
    // A full device (other processes, this one's caches) says nothing about the handle type: the
    // type stays, unverified, rather than turning sharing off for the driver's lifetime.
    if (r == CUDA_ERROR_OUT_OF_MEMORY) return {};
    return "a probe " + cuda_failure("cuMemCreate", r);
  }
  // Creating can succeed where sharing is still refused (fabric without an IMEX channel): export the
  // probe, and import it back, as IPC will.
  std::string problem;
  const CUmemAllocationHandleType cu_type = to_cu(type);
  int fd = -1;
  CUmemFabricHandle fabric{};
  void* exported = type == ShareableHandle::fabric ? static_cast<void*>(&fabric) : static_cast<void*>(&fd);
  if (CUresult r = api_.cuMemExportToShareableHandle(exported, h, cu_type, 0); r != CUDA_SUCCESS) {
    problem = "a probe " + cuda_failure("cuMemExportToShareableHandle", r);
  } else {
    void* os_handle = type == ShareableHandle::fabric ? static_cast<void*>(&fabric)
                                                      : reinterpret_cast<void*>(static_cast<std::uintptr_t>(fd));
    CUmemGenericAllocationHandle imported = 0;
    if (CUresult r = api_.cuMemImportFromShareableHandle(&imported, os_handle, cu_type); r != CUDA_SUCCESS)
      problem = "a probe " + cuda_failure("cuMemImportFromShareableHandle", r);
    else
      (void)api_.cuMemRelease(imported);
    if (fd >= 0) ::close(fd);
  }
  check(api_, api_.cuMemRelease(h), "cuMemRelease");
  return problem;
}

}  // namespace

std::unique_ptr<Driver> make_cuda_driver(int device, const CudaOptions& options) {
  const Library& lib = library();
  if (!lib.ok) throw driver_error(lib.call, lib.code, lib.code_name, lib.description);
  return std::make_unique<CudaDriver>(lib.api, device, options);
}

bool cuda_usable(std::string* why) {
  try {
    const Library& lib = library();
    if (!lib.ok) {
      if (why) *why = lib.call + " failed: " + lib.code_name + " (" + std::to_string(lib.code) + "): " + lib.description;
      return false;
    }
    if (lib.device_count <= 0) {
      if (why) *why = "the CUDA driver reports no device";
      return false;
    }
    if (why) why->clear();
    return true;
  } catch (const std::exception& e) {  // only allocation failures can get here
    if (why) *why = e.what();
    return false;
  }
}

int cuda_device_count() {
  try {
    const Library& lib = library();
    return lib.ok ? lib.device_count : 0;
  } catch (const std::exception&) {
    return 0;
  }
}

}  // namespace expseg::driver
