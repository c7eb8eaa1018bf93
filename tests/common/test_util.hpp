// Helpers shared by the test suites.
#pragma once

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>
#include <string>

#include "allocator_impl.hpp"
#include "driver/sim_driver.hpp"
#include "expseg/allocator.hpp"
#include "expseg/config.hpp"

namespace testutil {

constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;

// A fresh directory per case ($TMPDIR/expseg-<tag>-<pid>), removed at the end.
struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const std::string& tag) {
    path = std::filesystem::temp_directory_path() / ("expseg-" + tag + "-" + std::to_string(::getpid()));
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::set<std::string> files() const {
    std::set<std::string> out;
    for (const auto& e : std::filesystem::directory_iterator(path)) out.insert(e.path().filename().string());
    return out;
  }
};

inline std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

// ThreadSanitizer keeps most of the address space for its shadow memory: the host-backed simulated
// device's fixed address arena (kArenaRegion) and multi-TiB reservations cannot be mapped there, so
// the tests of reproducible addresses are skipped under it (doctest reports them as skipped).
#if defined(__SANITIZE_THREAD__)
constexpr bool kThreadSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
constexpr bool kThreadSanitizer = true;
#else
constexpr bool kThreadSanitizer = false;
#endif
#else
constexpr bool kThreadSanitizer = false;
#endif

inline expseg::Config sim_config(expseg::BackendKind backend, std::size_t capacity = 80 * GiB, const std::string& extra = "") {
  expseg::Config c = expseg::Config::parse(extra);
  c.backend = backend;
  c.device = expseg::DeviceKind::sim;
  c.sim_capacity = capacity;
  return c;
}

// An allocator over a SimDriver the test keeps a handle to (fault injection, leak counters).
struct SimAllocator {
  std::shared_ptr<expseg::driver::SimDriver> sim;  // outlives the allocator: leak checks after destruction
  std::unique_ptr<expseg::Allocator> alloc;
  expseg::Allocator* operator->() { return alloc.get(); }
  expseg::Allocator& operator*() { return *alloc; }
};

inline SimAllocator make_sim_allocator(const expseg::Config& config, expseg::driver::SimOptions options = {}) {
  options.capacity = config.sim_capacity;
  options.granularity = config.sim_granularity;
  options.host_backed = config.sim_host_backed;
  options.latency_model = config.sim_latency;
  SimAllocator s;
  s.sim = std::make_shared<expseg::driver::SimDriver>(options);
  s.alloc = expseg::detail::AllocatorAccess::make(config, s.sim);
  return s;
}

inline std::uint64_t addr(const void* p) { return static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(p)); }
inline void* stream_id(std::uintptr_t n) { return reinterpret_cast<void*>(n); }

}  // namespace testutil
