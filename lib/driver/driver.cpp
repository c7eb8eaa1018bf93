// Names of the driver operations (Op), as the CUDA calls that implement them.
#include "driver/driver.hpp"

namespace expseg::driver {

const char* op_name(Op op) noexcept {
  switch (op) {
    case Op::reserve: return "cuMemAddressReserve";
    case Op::free_reserve: return "cuMemAddressFree";
    case Op::create: return "cuMemCreate";
    case Op::release: return "cuMemRelease";
    case Op::map: return "cuMemMap";
    case Op::unmap: return "cuMemUnmap";
    case Op::set_access: return "cuMemSetAccess";
    case Op::mem_alloc: return "cuMemAlloc";
    case Op::mem_free: return "cuMemFree";
    case Op::event_record: return "cuEventRecord";
    case Op::event_query: return "cuEventQuery";
    case Op::stream_sync: return "cuStreamSynchronize";
    case Op::export_handle: return "cuMemExportToShareableHandle";
    case Op::import_handle: return "cuMemImportFromShareableHandle";
    case Op::stream_query: return "cuStreamGetCaptureInfo";
    case Op::count_: break;
  }
  return "unknown";
}

std::vector<DriverCallTime> CallStats::by_call() const {
  std::vector<DriverCallTime> out;
  for (std::size_t i = 0; i < kOpCount; ++i)
    if (calls[i] != 0) out.push_back({op_name(static_cast<Op>(i)), calls[i], seconds[i]});
  return out;
}

dev_ptr Driver::mem_alloc_async(std::size_t, stream_t) {
  throw driver_error("cuMemAllocAsync", 801, "CUDA_ERROR_NOT_SUPPORTED", std::string("not provided by the ") + kind() + " driver");
}

void Driver::mem_free_async(dev_ptr, stream_t) {
  throw driver_error("cuMemFreeAsync", 801, "CUDA_ERROR_NOT_SUPPORTED", std::string("not provided by the ") + kind() + " driver");
}

std::uint64_t Driver::stream_capture_id(stream_t) { return 0; }
bool Driver::stream_is_blocking(stream_t) { return false; }
stream_t Driver::stream_create_blocking() {
  throw driver_error("cuStreamCreate", 801, "CUDA_ERROR_NOT_SUPPORTED", std::string("not provided by the ") + kind() + " driver");
}

namespace {
[[noreturn]] void no_graphs(const char* call, const char* kind) {
  throw driver_error(call, 801, "CUDA_ERROR_NOT_SUPPORTED", std::string("not provided by the ") + kind + " driver");
}
}  // namespace

void Driver::capture_begin(stream_t, CaptureMode) { no_graphs("cuStreamBeginCapture", kind()); }
graph_t Driver::capture_end(stream_t) { no_graphs("cuStreamEndCapture", kind()); }
void Driver::graph_launch(graph_t, stream_t) { no_graphs("cuGraphLaunch", kind()); }
void Driver::graph_destroy(graph_t) { no_graphs("cuGraphExecDestroy", kind()); }
void Driver::stream_wait_event(stream_t, event_t) { no_graphs("cuStreamWaitEvent", kind()); }

}  // namespace expseg::driver
