// Shared pieces of the expseg benchmark suite: the allocators under test ("subjects"), the holder
// that keeps one warm subject per benchmark, and the anchors' random generator.
//
// Every workload is a template over a subject type, so the expseg path is a direct call into
// Allocator::allocate/deallocate (no extra virtual dispatch in the timed loop). Subjects:
//   ExpsegSubject          expseg::Allocator (split_merge or expandable, device:sim or device:cuda)
//   CuMemAllocSubject      cuMemAlloc / cuMemFree through the driver layer (GPU only)
//   CuMemAllocAsyncSubject cuMemAllocAsync / cuMemFreeAsync on the driver's default pool (GPU only)
//   CapiSubject            expseg_malloc / expseg_free: what PyTorch's CUDAPluggableAllocator calls
// All three are safe to call from several threads at once (expseg takes its lock; the CUDA driver
// is thread-safe and CudaDriver keeps no mutable state on these calls).
#pragma once

#include <array>
#include <cstdlib>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "c_api_internal.hpp"
#include "allocator_impl.hpp"
#include "driver/driver.hpp"
#include "expseg/allocator.hpp"
#include "expseg/config.hpp"
#include "expseg/expseg.h"

namespace expseg::bench {

using driver::stream_t;

inline constexpr std::size_t KiB = std::size_t{1} << 10;
inline constexpr std::size_t MiB = std::size_t{1} << 20;
inline constexpr std::size_t GiB = std::size_t{1} << 30;

// The CUDA driver the baselines use: made once, never destroyed (destroying driver objects from
// static destructors at exit races libcuda's own teardown).
driver::Driver& cuda_driver();

// ---------------------------------------------------------------------------------------------
// Subjects.

class Subject {
 public:
  virtual ~Subject() = default;
};

// Streams created through a driver, destroyed with the subject.
class StreamSet {
 public:
  explicit StreamSet(driver::Driver* drv) : drv_(drv) {}
  StreamSet(const StreamSet&) = delete;
  StreamSet& operator=(const StreamSet&) = delete;
  ~StreamSet() {
    for (stream_t s : streams_) {
      try {
        drv_->stream_synchronize(s);
        drv_->stream_destroy(s);
      } catch (...) {
      }
    }
  }
  // The i-th stream of this subject (created on first use). Not thread-safe: call before threads start.
  stream_t get(std::size_t i) {
    while (streams_.size() <= i) streams_.push_back(drv_->stream_create());
    return streams_[i];
  }

 private:
  driver::Driver* drv_;
  std::vector<stream_t> streams_;
};

class ExpsegSubject final : public Subject {
 public:
  explicit ExpsegSubject(const Config& config)
      : a_(std::make_unique<Allocator>(config, 0)), streams_(&detail::AllocatorAccess::driver(*a_)) {}
  // Members go in reverse order: the streams (they belong to the allocator's driver) before the
  // allocator, which gives back everything, live blocks included.
  void* alloc(std::size_t bytes, stream_t stream) { return a_->allocate(bytes, stream); }
  void free(void* p, stream_t) { a_->deallocate(p); }
  stream_t stream(std::size_t i) { return streams_.get(i); }
  Allocator& allocator() { return *a_; }

 private:
  std::unique_ptr<Allocator> a_;
  StreamSet streams_;
};

class CuMemAllocSubject final : public Subject {
 public:
  CuMemAllocSubject() : drv_(cuda_driver()), streams_(&drv_) {}
  void* alloc(std::size_t bytes, stream_t) { return reinterpret_cast<void*>(static_cast<std::uintptr_t>(drv_.mem_alloc(bytes))); }
  void free(void* p, stream_t) { drv_.mem_free(static_cast<driver::dev_ptr>(reinterpret_cast<std::uintptr_t>(p))); }
  stream_t stream(std::size_t i) { return streams_.get(i); }

 private:
  driver::Driver& drv_;
  StreamSet streams_;
};

class CuMemAllocAsyncSubject final : public Subject {
 public:
  CuMemAllocAsyncSubject() : drv_(cuda_driver()), streams_(&drv_) {}
  ~CuMemAllocAsyncSubject() override {
    try {
      drv_.device_synchronize();
    } catch (...) {
    }
  }
  void* alloc(std::size_t bytes, stream_t stream) {
    return reinterpret_cast<void*>(static_cast<std::uintptr_t>(drv_.mem_alloc_async(bytes, stream)));
  }
  void free(void* p, stream_t stream) {
    drv_.mem_free_async(static_cast<driver::dev_ptr>(reinterpret_cast<std::uintptr_t>(p)), stream);
  }
  stream_t stream(std::size_t i) { return streams_.get(i); }

 private:
  driver::Driver& drv_;
  StreamSet streams_;
};

// The C API's allocator of device 0, made from `conf` over the defaults, as the C++ targets' (the C
// API would add EXPSEG_ALLOC_CONF: it is cleared for this process). The C API has one allocator per
// device, so one CapiSubject lives at a time (the holder's rule).
class CapiSubject final : public Subject {
 public:
  explicit CapiSubject(const std::string& conf) {
    ::unsetenv("EXPSEG_ALLOC_CONF");
    capi::reset_for_tests();
    if (expseg_configure(conf.c_str()) != EXPSEG_SUCCESS) throw std::runtime_error(expseg_last_error());
  }
  ~CapiSubject() override { capi::reset_for_tests(); }
  CapiSubject(const CapiSubject&) = delete;
  CapiSubject& operator=(const CapiSubject&) = delete;
  void* alloc(std::size_t bytes, stream_t stream) {
    void* p = expseg_malloc(static_cast<ssize_t>(bytes), 0, stream);
    if (p == nullptr) [[unlikely]] throw std::runtime_error(expseg_last_error());
    return p;
  }
  void free(void* p, stream_t stream) { expseg_free(p, 0, 0, stream); }
};

// ---------------------------------------------------------------------------------------------
// The holder: one subject (and one piece of workload state) alive at a time, keyed by the
// benchmark's name. Google Benchmark calls a benchmark function several times while it settles on
// an iteration count; the subject survives those calls, so its cache stays warm, and it is
// destroyed (giving all its memory back) when the next benchmark starts. Results therefore do not
// depend on which benchmarks ran before. A benchmark that makes its own allocators (growth, the
// scenarios, replay, driver_batching) resets the holder first for the same reason.

class Holder {
 public:
  template <class S>
  S& subject(const std::string& key, const std::function<std::unique_ptr<S>()>& make, bool* fresh = nullptr) {
    if (key != key_ || !subject_) {
      reset();
      subject_ = make();
      key_ = key;
      if (fresh) *fresh = true;
    } else if (fresh) {
      *fresh = false;
    }
    return static_cast<S&>(*subject_);
  }
  // Workload state that lives as long as the subject (destroyed before it).
  template <class T, class... Args>
  T& state(Args&&... args) {
    if (!state_) {
      auto p = std::make_shared<T>(std::forward<Args>(args)...);
      state_ = p;
      return *p;
    }
    return *static_cast<T*>(state_.get());
  }
  void reset() {
    state_.reset();
    subject_.reset();
    key_.clear();
  }
  static Holder& instance() {
    static Holder h;
    return h;
  }

 private:
  std::string key_;
  std::unique_ptr<Subject> subject_;
  std::shared_ptr<void> state_;
};

// ---------------------------------------------------------------------------------------------
// The random churn of the PyTorch anchor measurement (churn_ns), step for step: 64 slots; each
// step picks a slot, frees what it holds, and allocates 256 B << (0..14) plus up to as much again
// (256 B to 8 MiB, log-uniform-ish), from a xorshift64 generator seeded as the anchor seeds it.

struct AnchorRng {
  std::uint64_t x;
  explicit AnchorRng(std::uint64_t seed) : x(seed * 0x9E3779B97F4A7C15ULL + 1) {}
  std::uint64_t next() noexcept {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return x;
  }
};

template <class S>
class Churn {
 public:
  static constexpr std::size_t kSlots = 64;
  Churn(S& s, stream_t stream, std::uint64_t seed) : s_(s), stream_(stream), rng_(seed) {}
  Churn(const Churn&) = delete;
  Churn& operator=(const Churn&) = delete;
  ~Churn() { drain(); }
  void step() {
    const std::size_t k = rng_.next() % kSlots;
    if (slot_[k] != nullptr) {
      s_.free(slot_[k], stream_);
      slot_[k] = nullptr;
    }
    std::size_t sz = std::size_t{256} << (rng_.next() % 15);
    sz += rng_.next() % sz;
    slot_[k] = s_.alloc(sz, stream_);
  }
  void drain() noexcept {
    for (void*& p : slot_) {
      if (p == nullptr) continue;
      try {
        s_.free(p, stream_);
      } catch (...) {
      }
      p = nullptr;
    }
  }

 private:
  S& s_;
  stream_t stream_;
  AnchorRng rng_;
  std::array<void*, kSlots> slot_{};
};

}  // namespace expseg::bench
