// IPC internals (lib/ipc.cpp): import through a driver the caller holds, for Allocator::import_ipc,
// expseg::import_ipc and tests that import without an Allocator (a CudaDriver of their own).
#pragma once

#include <memory>

#include "driver/driver.hpp"
#include "expseg/ipc.hpp"

namespace expseg::detail {

struct IpcAccess {
  // Maps `handle` through `driver` (kept alive by the result). The caller serialises this call with
  // other users of the driver's access list (set_access reads it; enable_peer_access changes it).
  static ImportedMemory import_with(std::shared_ptr<driver::Driver> driver, const IpcMemHandle& handle);
};

}  // namespace expseg::detail
