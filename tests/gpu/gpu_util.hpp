// Helpers shared by the gpu suite's files: allocators on the real device and raw access to its driver.
#pragma once

#include <cstdint>
#include <string>

#include "allocator_impl.hpp"
#include "driver/driver.hpp"
#include "expseg/allocator.hpp"
#include "expseg/config.hpp"

namespace gputil {

inline expseg::Config cuda_config(expseg::BackendKind b, const std::string& extra = "") {
  expseg::Config c = expseg::Config::parse(extra);
  c.backend = b;
  c.device = expseg::DeviceKind::cuda;
  return c;
}

inline expseg::driver::Driver& driver_of(expseg::Allocator& a) { return expseg::detail::AllocatorAccess::driver(a); }
inline expseg::driver::dev_ptr dp(const void* p) { return static_cast<expseg::driver::dev_ptr>(reinterpret_cast<std::uintptr_t>(p)); }

}  // namespace gputil
