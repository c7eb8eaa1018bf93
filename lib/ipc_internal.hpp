// IPC internals (lib/ipc.cpp): import through a driver the caller holds, for Allocator::import_ipc,
// expseg::import_ipc and tests that import without an Allocator (a CudaDriver of their own).
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "driver/driver.hpp"
#include "expseg/ipc.hpp"

namespace expseg::detail {

// The ranges Allocator::import_ipc mapped (posix_fd, fabric) that are still open, so that
// enable_peer_access grants a later peer these too ("everything this allocator maps, now and later").
// Shared with each such ImportedMemory, which may outlive the allocator and is closed without the
// allocator's lock: hence a lock of its own (taken after the allocator's).
struct ImportRegistry {
  std::mutex mu;
  std::map<driver::dev_ptr, std::size_t> ranges;  // reservation base -> bytes
  // A capture the allocator was told of is underway (set by the allocator, under mu): releasing an
  // import then would take a device synchronization (or cuIpcCloseMemHandle's wait), which the
  // capture refuses and which invalidates it. Imports closed meanwhile wait in `deferred` (their
  // State, owned) and are released when the last capture ends (drain_deferred).
  bool capturing = false;
  std::vector<std::unique_ptr<void, void (*)(void*)>> deferred;
  // set_access over every open range (the driver's access list has the new peer). Throws driver_error.
  void grant_all(driver::Driver& driver);
  // Sets `capturing`; when it turns false, releases the deferred imports (errors ignored, as a
  // destructor's). Called under the allocator's lock.
  void set_capturing(bool now) noexcept;
  // The allocator goes while a capture it was told of is underway: the deferred imports, and those
  // closed from now on (whether the capture still runs can no longer be asked), are left mapped for
  // good (their release's synchronization would invalidate the capture), with no driver call.
  void abandon_deferred() noexcept;
  bool abandoned = false;  // abandon_deferred ran (under mu)
};

// Whether `handle` was exported by this process (its exporter_nonce is this process's), whatever
// its pid says.
bool exported_here(const IpcMemHandle& handle) noexcept;

struct IpcAccess {
  // Maps `handle` through `driver` (kept alive by the result); registers the mapping in `registry`
  // (if any) until it is closed. The caller serialises this call with other users of the driver's
  // access list (set_access reads it; enable_peer_access changes it).
  static ImportedMemory import_with(std::shared_ptr<driver::Driver> driver, const IpcMemHandle& handle,
                                    std::shared_ptr<ImportRegistry> registry = nullptr);
};

}  // namespace expseg::detail
