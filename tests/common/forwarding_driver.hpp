// A driver that forwards every call to another: tests derive from it and override the calls whose
// behaviour they change (a call that fails, a capture another thread begins meanwhile). Over a
// simulated device (sim() reaches it), or over the CUDA driver in the gpu suite.
#pragma once

#include <doctest/doctest.h>

#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "allocator_impl.hpp"
#include "driver/sim_driver.hpp"

namespace testutil {

class ForwardingDriver : public expseg::driver::Driver {
 public:
  explicit ForwardingDriver(std::shared_ptr<expseg::driver::SimDriver> sim) : sim_(sim.get()), inner_(std::move(sim)) {}
  explicit ForwardingDriver(std::shared_ptr<expseg::driver::Driver> inner) : inner_(std::move(inner)) {}

  using dev_ptr = expseg::driver::dev_ptr;
  using phys_handle = expseg::driver::phys_handle;
  using stream_t = expseg::driver::stream_t;
  using event_t = expseg::driver::event_t;
  using graph_t = expseg::driver::graph_t;
  expseg::driver::SimDriver& sim() noexcept {
    REQUIRE(sim_ != nullptr);  // made over a simulated device
    return *sim_;
  }

  const char* kind() const noexcept override { return inner_->kind(); }
  int device() const noexcept override { return inner_->device(); }
  std::string device_name() const override { return inner_->device_name(); }
  std::size_t granularity() const noexcept override { return inner_->granularity(); }
  expseg::driver::MemInfo mem_info() override { return inner_->mem_info(); }
  expseg::driver::CallStats call_stats() const override { return inner_->call_stats(); }
  dev_ptr reserve(std::size_t bytes) override { return inner_->reserve(bytes); }
  void free_reserve(dev_ptr base, std::size_t bytes) override { inner_->free_reserve(base, bytes); }
  phys_handle create(std::size_t bytes) override { return inner_->create(bytes); }
  void release(phys_handle h) override { inner_->release(h); }
  void map(dev_ptr p, std::size_t bytes, phys_handle h) override { inner_->map(p, bytes, h); }
  void unmap(dev_ptr p, std::size_t bytes) override { inner_->unmap(p, bytes); }
  void set_access(dev_ptr p, std::size_t bytes) override { inner_->set_access(p, bytes); }
  dev_ptr mem_alloc(std::size_t bytes) override { return inner_->mem_alloc(bytes); }
  void mem_free(dev_ptr p) override { inner_->mem_free(p); }
  dev_ptr mem_alloc_async(std::size_t bytes, stream_t s) override { return inner_->mem_alloc_async(bytes, s); }
  void mem_free_async(dev_ptr p, stream_t s) override { inner_->mem_free_async(p, s); }
  stream_t stream_create() override { return inner_->stream_create(); }
  stream_t stream_create_blocking() override { return inner_->stream_create_blocking(); }
  void stream_destroy(stream_t s) override { inner_->stream_destroy(s); }
  bool stream_is_blocking(stream_t s) override { return inner_->stream_is_blocking(s); }
  event_t event_create() override { return inner_->event_create(); }
  void event_destroy(event_t e) override { inner_->event_destroy(e); }
  void event_record(event_t e, stream_t s) override { inner_->event_record(e, s); }
  bool event_query(event_t e) override { return inner_->event_query(e); }
  void event_synchronize(event_t e) override { inner_->event_synchronize(e); }
  void stream_synchronize(stream_t s) override { inner_->stream_synchronize(s); }
  void device_synchronize() override { inner_->device_synchronize(); }
  std::uint64_t stream_capture_id(stream_t s) override { return inner_->stream_capture_id(s); }
  void capture_begin(stream_t s, CaptureMode mode = CaptureMode::global) override { inner_->capture_begin(s, mode); }
  graph_t capture_end(stream_t s) override { return inner_->capture_end(s); }
  void graph_launch(graph_t g, stream_t s) override { inner_->graph_launch(g, s); }
  void graph_destroy(graph_t g) override { inner_->graph_destroy(g); }
  void stream_wait_event(stream_t s, event_t e) override { inner_->stream_wait_event(s, e); }
  void memset_d32(dev_ptr p, std::uint32_t v, std::size_t n, stream_t s) override { inner_->memset_d32(p, v, n, s); }
  void copy_to_host(void* dst, dev_ptr src, std::size_t bytes) override { inner_->copy_to_host(dst, src, bytes); }
  void copy_from_host(dev_ptr dst, const void* src, std::size_t bytes) override { inner_->copy_from_host(dst, src, bytes); }
  int device_count() override { return inner_->device_count(); }
  bool can_access_peer(int peer) override { return inner_->can_access_peer(peer); }
  bool add_access_device(int peer) override { return inner_->add_access_device(peer); }
  std::vector<int> access_devices() const override { return inner_->access_devices(); }
  bool enable_context_peer(int peer) override { return inner_->enable_context_peer(peer); }
  std::vector<int> context_peers() const override { return inner_->context_peers(); }
  expseg::driver::ShareableHandle shareable_handle_type() const noexcept override { return inner_->shareable_handle_type(); }
  bool gpu_direct_rdma() const noexcept override { return inner_->gpu_direct_rdma(); }
  std::string shareable_fallback_reason() const override { return inner_->shareable_fallback_reason(); }
  expseg::driver::ExportedHandle export_handle(phys_handle h) override { return inner_->export_handle(h); }
  phys_handle import_handle(const expseg::driver::ExportedHandle& e) override { return inner_->import_handle(e); }
  expseg::driver::ExportedHandle ipc_export(dev_ptr p) override { return inner_->ipc_export(p); }
  dev_ptr ipc_open(const expseg::driver::ExportedHandle& e) override { return inner_->ipc_open(e); }
  void ipc_close(dev_ptr p) override { inner_->ipc_close(p); }
  std::pair<dev_ptr, std::size_t> address_range(dev_ptr p) override { return inner_->address_range(p); }

 private:
  expseg::driver::SimDriver* sim_ = nullptr;  // inner_, where it is a simulated device
  std::shared_ptr<expseg::driver::Driver> inner_;
};

// An allocator of `config` on a simulated device (its sim_capacity and sim_granularity) reached
// through test driver D (a ForwardingDriver): the device, the driver and the allocator.
template <class D>
auto wrapped_sim_allocator(const expseg::Config& config) {
  expseg::driver::SimOptions o;
  o.capacity = config.sim_capacity;
  o.granularity = config.sim_granularity;
  auto sim = std::make_shared<expseg::driver::SimDriver>(o);
  auto drv = std::make_shared<D>(sim);
  auto a = expseg::detail::AllocatorAccess::make(config, drv);
  return std::make_tuple(sim, drv, std::move(a));
}

}  // namespace testutil
