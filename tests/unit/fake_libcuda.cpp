// A stand-in for libcuda.so.1 that CudaDriver loads through EXPSEG_LIBCUDA (test cuda-fake), so that
// the driver layer's own logic (device setup, VMM support, the shareable-handle probe, error texts)
// runs on machines without a GPU. It allocates nothing on a device: addresses and handles are
// numbers. Only what cuda_driver.cpp asks for is served, at the ABI it asks for (the types below are
// cuda.h's, spelled without it: only lib/driver/ includes cuda.h). The test steers it through the
// expseg_fake_cuda_* functions (dlsym on the same library).
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <fcntl.h>
#include <unistd.h>

namespace {

using CUresult = int;
constexpr CUresult kSuccess = 0, kInvalidValue = 1, kOutOfMemory = 2, kNotInitialized = 3, kInvalidDevice = 101,
                   kNotFound = 500, kNotSupported = 801;
// cuda.h's CUdevice_attribute values the driver asks about.
constexpr int kAttrVmm = 102, kAttrPosixFd = 103, kAttrRdmaVmm = 110, kAttrFabric = 128;
constexpr std::size_t kGranularity = 2u << 20;
constexpr std::uint64_t kTotal = 80ull << 30;

struct State {
  std::mutex mu;
  bool initialized = false;
  int vmm = 1;                         // CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
  std::map<std::string, std::pair<CUresult, int>> failures;  // call -> (code, times left; -1 = always)
  std::map<std::string, int> calls;
  std::map<std::uint64_t, std::size_t> allocs;  // cuMemAlloc'ed: address -> bytes
  std::uint64_t next_address = 0x7f0000000000ull;
  std::uint64_t next_handle = 1;
  std::uint64_t used = 0;
  int ctx_object = 0;
  int stream_objects[64] = {};
  int next_stream = 0;
};
State& state() {
  static State* s = new State;
  return *s;
}
thread_local void* t_current = nullptr;
thread_local void* t_stack[16];
thread_local int t_depth = 0;

// Counts the call; returns the code injected for it (0: none).
CUresult enter(const char* call) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  ++s.calls[call];
  const auto it = s.failures.find(call);
  if (it == s.failures.end() || it->second.second == 0) return kSuccess;
  if (it->second.second > 0) --it->second.second;
  return it->second.first;
}
#define FAKE_ENTER(call)                              \
  if (CUresult injected = enter(#call); injected != 0) \
  return injected
#define FAKE_NEEDS_VMM \
  if (state().vmm == 0) return kNotSupported

}  // namespace

extern "C" {

// --- control, for the test ---
void expseg_fake_cuda_reset() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.vmm = 1;
  s.failures.clear();
  s.calls.clear();
}
void expseg_fake_cuda_set_vmm(int supported) { state().vmm = supported; }
// The next `times` calls of `call` fail with `code` (times -1: every call).
void expseg_fake_cuda_fail(const char* call, int code, int times) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.failures[call] = {code, times};
}
int expseg_fake_cuda_calls(const char* call) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  const auto it = s.calls.find(call);
  return it == s.calls.end() ? 0 : it->second;
}

// --- the driver API ---
static CUresult f_cuGetErrorName(CUresult r, const char** out) {
  switch (r) {
    case kSuccess: *out = "CUDA_SUCCESS"; return kSuccess;
    case kInvalidValue: *out = "CUDA_ERROR_INVALID_VALUE"; return kSuccess;
    case kOutOfMemory: *out = "CUDA_ERROR_OUT_OF_MEMORY"; return kSuccess;
    case kNotSupported: *out = "CUDA_ERROR_NOT_SUPPORTED"; return kSuccess;
    case kInvalidDevice: *out = "CUDA_ERROR_INVALID_DEVICE"; return kSuccess;
    default: *out = "CUDA_ERROR_UNKNOWN"; return kSuccess;
  }
}
static CUresult f_cuGetErrorString(CUresult r, const char** out) {
  *out = r == kOutOfMemory ? "out of memory" : r == kNotSupported ? "operation not supported" : "fake libcuda error";
  return kSuccess;
}
static CUresult f_cuInit(unsigned) {
  FAKE_ENTER(cuInit);
  state().initialized = true;
  return kSuccess;
}
static CUresult f_cuDeviceGetCount(int* n) {
  FAKE_ENTER(cuDeviceGetCount);
  *n = 1;
  return kSuccess;
}
static CUresult f_cuDeviceGet(int* dev, int ordinal) {
  FAKE_ENTER(cuDeviceGet);
  if (!state().initialized) return kNotInitialized;
  if (ordinal != 0) return kInvalidDevice;
  *dev = 0;
  return kSuccess;
}
static CUresult f_cuDeviceGetName(char* name, int len, int) {
  FAKE_ENTER(cuDeviceGetName);
  std::strncpy(name, "expseg fake GPU", static_cast<std::size_t>(len));
  return kSuccess;
}
static CUresult f_cuDeviceGetAttribute(int* value, int attr, int) {
  FAKE_ENTER(cuDeviceGetAttribute);
  const int vmm = state().vmm;
  switch (attr) {
    case kAttrVmm: *value = vmm; break;
    case kAttrPosixFd: *value = vmm; break;
    case kAttrRdmaVmm: *value = 0; break;
    case kAttrFabric: *value = 0; break;
    default: *value = 0; break;
  }
  return kSuccess;
}
static CUresult f_cuDeviceCanAccessPeer(int* can, int, int) {
  FAKE_ENTER(cuDeviceCanAccessPeer);
  *can = 0;
  return kSuccess;
}
static CUresult f_cuDevicePrimaryCtxRetain(void** ctx, int) {
  FAKE_ENTER(cuDevicePrimaryCtxRetain);
  *ctx = &state().ctx_object;
  return kSuccess;
}
static CUresult f_cuDevicePrimaryCtxRelease(int) {
  FAKE_ENTER(cuDevicePrimaryCtxRelease);
  return kSuccess;
}
static CUresult f_cuCtxGetCurrent(void** ctx) {
  *ctx = t_current;
  return kSuccess;
}
static CUresult f_cuCtxPushCurrent(void* ctx) {
  if (t_depth == 16) return kInvalidValue;
  t_stack[t_depth++] = t_current;
  t_current = ctx;
  return kSuccess;
}
static CUresult f_cuCtxPopCurrent(void** ctx) {
  if (t_depth == 0) return kInvalidValue;
  if (ctx != nullptr) *ctx = t_current;
  t_current = t_stack[--t_depth];
  return kSuccess;
}
static CUresult f_cuCtxEnablePeerAccess(void*, unsigned) { return kNotSupported; }
static CUresult f_cuCtxSynchronize() {
  FAKE_ENTER(cuCtxSynchronize);
  return kSuccess;
}
static CUresult f_cuMemGetInfo(std::size_t* free, std::size_t* total) {
  FAKE_ENTER(cuMemGetInfo);
  *total = kTotal;
  *free = kTotal - state().used;
  return kSuccess;
}
static CUresult f_cuMemGetAllocationGranularity(std::size_t* g, const void*, int) {
  FAKE_ENTER(cuMemGetAllocationGranularity);
  FAKE_NEEDS_VMM;
  *g = kGranularity;
  return kSuccess;
}
static CUresult f_cuMemAddressReserve(std::uint64_t* p, std::size_t bytes, std::size_t, std::uint64_t, unsigned long long) {
  FAKE_ENTER(cuMemAddressReserve);
  FAKE_NEEDS_VMM;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  *p = s.next_address;
  s.next_address += bytes + kGranularity;
  return kSuccess;
}
static CUresult f_cuMemAddressFree(std::uint64_t, std::size_t) {
  FAKE_ENTER(cuMemAddressFree);
  FAKE_NEEDS_VMM;
  return kSuccess;
}
static CUresult f_cuMemCreate(std::uint64_t* h, std::size_t, const void*, unsigned long long) {
  FAKE_ENTER(cuMemCreate);
  FAKE_NEEDS_VMM;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  *h = s.next_handle++;
  return kSuccess;
}
static CUresult f_cuMemRelease(std::uint64_t) {
  FAKE_ENTER(cuMemRelease);
  FAKE_NEEDS_VMM;
  return kSuccess;
}
static CUresult f_cuMemMap(std::uint64_t, std::size_t, std::size_t, std::uint64_t, unsigned long long) {
  FAKE_ENTER(cuMemMap);
  FAKE_NEEDS_VMM;
  return kSuccess;
}
static CUresult f_cuMemUnmap(std::uint64_t, std::size_t) {
  FAKE_ENTER(cuMemUnmap);
  FAKE_NEEDS_VMM;
  return kSuccess;
}
static CUresult f_cuMemSetAccess(std::uint64_t, std::size_t, const void*, std::size_t) {
  FAKE_ENTER(cuMemSetAccess);
  FAKE_NEEDS_VMM;
  return kSuccess;
}
static CUresult f_cuMemExportToShareableHandle(void* out, std::uint64_t, int type, unsigned long long) {
  FAKE_ENTER(cuMemExportToShareableHandle);
  FAKE_NEEDS_VMM;
  if (type != 1) return kNotSupported;  // CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR only
  const int fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return kOutOfMemory;
  std::memcpy(out, &fd, sizeof fd);
  return kSuccess;
}
static CUresult f_cuMemImportFromShareableHandle(std::uint64_t* h, void*, int type) {
  FAKE_ENTER(cuMemImportFromShareableHandle);
  FAKE_NEEDS_VMM;
  if (type != 1) return kNotSupported;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  *h = s.next_handle++;
  return kSuccess;
}
static CUresult f_cuMemAlloc(std::uint64_t* p, std::size_t bytes) {
  FAKE_ENTER(cuMemAlloc);
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (bytes == 0) return kInvalidValue;
  if (bytes > kTotal - s.used) return kOutOfMemory;
  *p = s.next_address;
  s.next_address += (bytes + 4095) / 4096 * 4096 + 4096;
  s.allocs[*p] = bytes;
  s.used += bytes;
  return kSuccess;
}
static CUresult f_cuMemFree(std::uint64_t p) {
  FAKE_ENTER(cuMemFree);
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  const auto it = s.allocs.find(p);
  if (it == s.allocs.end()) return kInvalidValue;
  s.used -= it->second;
  s.allocs.erase(it);
  return kSuccess;
}
static CUresult f_cuMemGetAddressRange(std::uint64_t* base, std::size_t* size, std::uint64_t p) {
  FAKE_ENTER(cuMemGetAddressRange);
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.allocs.upper_bound(p);
  if (it == s.allocs.begin()) return kNotFound;
  --it;
  if (p >= it->first + it->second) return kNotFound;
  if (base != nullptr) *base = it->first;
  if (size != nullptr) *size = it->second;
  return kSuccess;
}
static CUresult f_cuStreamCreate(void** stream, unsigned) {
  FAKE_ENTER(cuStreamCreate);
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  *stream = &s.stream_objects[s.next_stream++ % 64];
  return kSuccess;
}
static CUresult f_cuStreamGetFlags(void*, unsigned* flags) {
  *flags = 1;  // CU_STREAM_NON_BLOCKING
  return kSuccess;
}
static CUresult f_cuStreamGetCaptureInfo(void*, int* status, std::uint64_t* id, void**, const void**, std::size_t* n) {
  *status = 0;  // CU_STREAM_CAPTURE_STATUS_NONE
  if (id != nullptr) *id = 0;
  if (n != nullptr) *n = 0;
  return kSuccess;
}
static CUresult f_cuThreadExchangeStreamCaptureMode(int*) { return kSuccess; }
static CUresult f_cuEventCreate(void** event, unsigned) {
  FAKE_ENTER(cuEventCreate);
  *event = new int(0);
  return kSuccess;
}
static CUresult f_cuEventDestroy(void* event) {
  delete static_cast<int*>(event);
  return kSuccess;
}
// The fake device has no queue: work is complete when it is issued. The calls below do nothing;
// those of features the fake lacks (stream-ordered allocation, copies, legacy IPC, graphs) refuse.
struct CUipcMemHandleBytes {
  char reserved[64];
};
#define FAKE_DO(ret, name, params) \
  static CUresult f_##name params { return ret; }
FAKE_DO(kSuccess, cuStreamDestroy, (void*))
FAKE_DO(kSuccess, cuStreamSynchronize, (void*))
FAKE_DO(kSuccess, cuEventRecord, (void*, void*))
FAKE_DO(kSuccess, cuStreamWaitEvent, (void*, void*, unsigned))
FAKE_DO(kSuccess, cuEventQuery, (void*))
FAKE_DO(kSuccess, cuEventSynchronize, (void*))
FAKE_DO(kSuccess, cuMemsetD32Async, (std::uint64_t, unsigned, std::size_t, void*))
FAKE_DO(kNotSupported, cuMemAllocAsync, (std::uint64_t*, std::size_t, void*))
FAKE_DO(kNotSupported, cuMemFreeAsync, (std::uint64_t, void*))
FAKE_DO(kNotSupported, cuMemcpyDtoH, (void*, std::uint64_t, std::size_t))
FAKE_DO(kNotSupported, cuMemcpyHtoD, (std::uint64_t, const void*, std::size_t))
FAKE_DO(kNotSupported, cuIpcGetMemHandle, (CUipcMemHandleBytes*, std::uint64_t))
FAKE_DO(kNotSupported, cuIpcOpenMemHandle, (std::uint64_t*, CUipcMemHandleBytes, unsigned))
FAKE_DO(kNotSupported, cuIpcCloseMemHandle, (std::uint64_t))
FAKE_DO(kNotSupported, cuStreamBeginCapture, (void*, int))
FAKE_DO(kNotSupported, cuStreamEndCapture, (void*, void**))
FAKE_DO(kNotSupported, cuGraphInstantiateWithFlags, (void**, void*, unsigned long long))
FAKE_DO(kNotSupported, cuGraphLaunch, (void*, void*))
FAKE_DO(kNotSupported, cuGraphExecDestroy, (void*))
FAKE_DO(kNotSupported, cuGraphDestroy, (void*))
#undef FAKE_DO

struct Entry {
  const char* name;
  void* fn;
};
#define FAKE_ENTRY(name) {#name, reinterpret_cast<void*>(f_##name)}
static const Entry kEntries[] = {
    FAKE_ENTRY(cuGetErrorName), FAKE_ENTRY(cuGetErrorString), FAKE_ENTRY(cuInit), FAKE_ENTRY(cuDeviceGet),
    FAKE_ENTRY(cuDeviceGetCount), FAKE_ENTRY(cuDeviceGetName), FAKE_ENTRY(cuDeviceGetAttribute),
    FAKE_ENTRY(cuDeviceCanAccessPeer), FAKE_ENTRY(cuDevicePrimaryCtxRetain), FAKE_ENTRY(cuDevicePrimaryCtxRelease),
    FAKE_ENTRY(cuCtxGetCurrent), FAKE_ENTRY(cuCtxPushCurrent), FAKE_ENTRY(cuCtxPopCurrent),
    FAKE_ENTRY(cuCtxEnablePeerAccess), FAKE_ENTRY(cuCtxSynchronize), FAKE_ENTRY(cuMemGetInfo),
    FAKE_ENTRY(cuMemGetAllocationGranularity), FAKE_ENTRY(cuMemAddressReserve), FAKE_ENTRY(cuMemAddressFree),
    FAKE_ENTRY(cuMemCreate), FAKE_ENTRY(cuMemRelease), FAKE_ENTRY(cuMemMap), FAKE_ENTRY(cuMemUnmap),
    FAKE_ENTRY(cuMemSetAccess), FAKE_ENTRY(cuMemAlloc), FAKE_ENTRY(cuMemFree), FAKE_ENTRY(cuMemAllocAsync),
    FAKE_ENTRY(cuMemFreeAsync), FAKE_ENTRY(cuMemGetAddressRange), FAKE_ENTRY(cuStreamCreate),
    FAKE_ENTRY(cuStreamDestroy), FAKE_ENTRY(cuStreamGetFlags), FAKE_ENTRY(cuStreamSynchronize), FAKE_ENTRY(cuEventCreate),
    FAKE_ENTRY(cuEventDestroy), FAKE_ENTRY(cuEventRecord), FAKE_ENTRY(cuStreamWaitEvent), FAKE_ENTRY(cuEventQuery),
    FAKE_ENTRY(cuEventSynchronize), FAKE_ENTRY(cuMemsetD32Async), FAKE_ENTRY(cuMemcpyDtoH), FAKE_ENTRY(cuMemcpyHtoD),
    FAKE_ENTRY(cuMemExportToShareableHandle), FAKE_ENTRY(cuMemImportFromShareableHandle), FAKE_ENTRY(cuIpcGetMemHandle),
    FAKE_ENTRY(cuIpcOpenMemHandle), FAKE_ENTRY(cuIpcCloseMemHandle), FAKE_ENTRY(cuStreamGetCaptureInfo),
    FAKE_ENTRY(cuThreadExchangeStreamCaptureMode), FAKE_ENTRY(cuStreamBeginCapture), FAKE_ENTRY(cuStreamEndCapture),
    FAKE_ENTRY(cuGraphInstantiateWithFlags), FAKE_ENTRY(cuGraphLaunch), FAKE_ENTRY(cuGraphExecDestroy),
    FAKE_ENTRY(cuGraphDestroy),
};

// cuGetProcAddress_v2 (CUDA 12.0's ABI): an entry point the fake does not have is "not found",
// as a real driver too old for it says.
CUresult cuGetProcAddress_v2(const char* symbol, void** fn, int, unsigned long long, int* status) {
  for (const Entry& e : kEntries)
    if (std::strcmp(e.name, symbol) == 0) {
      *fn = e.fn;
      if (status != nullptr) *status = 0;  // CU_GET_PROC_ADDRESS_SUCCESS
      return kSuccess;
    }
  *fn = nullptr;
  if (status != nullptr) *status = 1;  // CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND
  return kNotFound;
}

}  // extern "C"
