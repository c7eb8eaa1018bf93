// A driver that forwards every call to a simulated device: tests derive from it and override the
// calls whose behaviour they change (a call that fails, a capture another thread begins meanwhile).
#pragma once

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
  explicit ForwardingDriver(std::shared_ptr<expseg::driver::SimDriver> sim) : sim_(std::move(sim)) {}

  using dev_ptr = expseg::driver::dev_ptr;
  using phys_handle = expseg::driver::phys_handle;
  using stream_t = expseg::driver::stream_t;
  using event_t = expseg::driver::event_t;
  using graph_t = expseg::driver::graph_t;
  expseg::driver::SimDriver& sim() noexcept { return *sim_; }

  const char* kind() const noexcept override { return sim_->kind(); }
  int device() const noexcept override { return sim_->device(); }
  std::string device_name() const override { return sim_->device_name(); }
  std::size_t granularity() const noexcept override { return sim_->granularity(); }
  expseg::driver::MemInfo mem_info() override { return sim_->mem_info(); }
  expseg::driver::CallStats call_stats() const override { return sim_->call_stats(); }
  dev_ptr reserve(std::size_t bytes) override { return sim_->reserve(bytes); }
  void free_reserve(dev_ptr base, std::size_t bytes) override { sim_->free_reserve(base, bytes); }
  phys_handle create(std::size_t bytes) override { return sim_->create(bytes); }
  void release(phys_handle h) override { sim_->release(h); }
  void map(dev_ptr p, std::size_t bytes, phys_handle h) override { sim_->map(p, bytes, h); }
  void unmap(dev_ptr p, std::size_t bytes) override { sim_->unmap(p, bytes); }
  void set_access(dev_ptr p, std::size_t bytes) override { sim_->set_access(p, bytes); }
  dev_ptr mem_alloc(std::size_t bytes) override { return sim_->mem_alloc(bytes); }
  void mem_free(dev_ptr p) override { sim_->mem_free(p); }
  dev_ptr mem_alloc_async(std::size_t bytes, stream_t s) override { return sim_->mem_alloc_async(bytes, s); }
  void mem_free_async(dev_ptr p, stream_t s) override { sim_->mem_free_async(p, s); }
  stream_t stream_create() override { return sim_->stream_create(); }
  stream_t stream_create_blocking() override { return sim_->stream_create_blocking(); }
  void stream_destroy(stream_t s) override { sim_->stream_destroy(s); }
  bool stream_is_blocking(stream_t s) override { return sim_->stream_is_blocking(s); }
  event_t event_create() override { return sim_->event_create(); }
  void event_destroy(event_t e) override { sim_->event_destroy(e); }
  void event_record(event_t e, stream_t s) override { sim_->event_record(e, s); }
  bool event_query(event_t e) override { return sim_->event_query(e); }
  void event_synchronize(event_t e) override { sim_->event_synchronize(e); }
  void stream_synchronize(stream_t s) override { sim_->stream_synchronize(s); }
  void device_synchronize() override { sim_->device_synchronize(); }
  std::uint64_t stream_capture_id(stream_t s) override { return sim_->stream_capture_id(s); }
  void capture_begin(stream_t s, CaptureMode mode = CaptureMode::global) override { sim_->capture_begin(s, mode); }
  graph_t capture_end(stream_t s) override { return sim_->capture_end(s); }
  void graph_launch(graph_t g, stream_t s) override { sim_->graph_launch(g, s); }
  void graph_destroy(graph_t g) override { sim_->graph_destroy(g); }
  void stream_wait_event(stream_t s, event_t e) override { sim_->stream_wait_event(s, e); }
  void memset_d32(dev_ptr p, std::uint32_t v, std::size_t n, stream_t s) override { sim_->memset_d32(p, v, n, s); }
  void copy_to_host(void* dst, dev_ptr src, std::size_t bytes) override { sim_->copy_to_host(dst, src, bytes); }
  void copy_from_host(dev_ptr dst, const void* src, std::size_t bytes) override { sim_->copy_from_host(dst, src, bytes); }
  int device_count() override { return sim_->device_count(); }
  bool can_access_peer(int peer) override { return sim_->can_access_peer(peer); }
  bool add_access_device(int peer) override { return sim_->add_access_device(peer); }
  std::vector<int> access_devices() const override { return sim_->access_devices(); }
  bool enable_context_peer(int peer) override { return sim_->enable_context_peer(peer); }
  std::vector<int> context_peers() const override { return sim_->context_peers(); }
  expseg::driver::ShareableHandle shareable_handle_type() const noexcept override { return sim_->shareable_handle_type(); }
  bool gpu_direct_rdma() const noexcept override { return sim_->gpu_direct_rdma(); }
  std::string shareable_fallback_reason() const override { return sim_->shareable_fallback_reason(); }
  expseg::driver::ExportedHandle export_handle(phys_handle h) override { return sim_->export_handle(h); }
  phys_handle import_handle(const expseg::driver::ExportedHandle& e) override { return sim_->import_handle(e); }
  expseg::driver::ExportedHandle ipc_export(dev_ptr p) override { return sim_->ipc_export(p); }
  dev_ptr ipc_open(const expseg::driver::ExportedHandle& e) override { return sim_->ipc_open(e); }
  void ipc_close(dev_ptr p) override { sim_->ipc_close(p); }
  std::pair<dev_ptr, std::size_t> address_range(dev_ptr p) override { return sim_->address_range(p); }

 private:
  std::shared_ptr<expseg::driver::SimDriver> sim_;
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
