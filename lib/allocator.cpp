#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cstdio>
#include <stdexcept>
#include <sstream>
#include <string_view>
#include <utility>

#include "allocator_impl.hpp"
#include "driver/sim_driver.hpp"
#include "core/text.hpp"
#include "core/try_twice.hpp"

namespace expseg {

using core::Block;
using core::BlockStatus;

namespace {

// An event last recorded in a capture (one expseg was not told of, underway at a free's record)
// cannot be queried until it is recorded again: CUDA_ERROR_CAPTURED_EVENT (907) while the capture
// is underway, and once it has ended CUDA_ERROR_INVALID_VALUE (1), measured on the H200 (driver
// 580), in every capture mode, whether the capture ended into a graph or was invalidated. The
// allocator's events are its own, so either code means that.
constexpr int kCapturedEventCode = 907;
constexpr int kEndedCaptureEventCode = 1;
bool recorded_in_capture(const driver_error& e) noexcept {
  return e.code() == kCapturedEventCode || e.code() == kEndedCaptureEventCode;
}

using core::hex;

// A driver failure after a call committed its change: the same call and code, its text followed by
// `after`, which says what was done, what was not and when it is retried.
[[noreturn]] void throw_after_commit(const driver_error& e, const std::string& after) {
  const std::string prefix = e.call() + " failed: " + e.code_name() + " (" + std::to_string(e.code()) + "): ";
  const std::string_view what = e.what();
  const std::string_view description = what.starts_with(prefix) ? what.substr(prefix.size()) : what;
  throw driver_error(e.call(), e.code(), e.code_name(), std::string(description) + "; " + after);
}

// Flips a stream (or stream key) into a value no stream or key has (a CUstream is a user-space
// address below 2^48; keys carry 0xFFFF or 0xFFFE in their top 16 bits): a fork's entry in
// GraphPool::keys.
constexpr std::uintptr_t kForkAliasBit = std::uintptr_t{2} << 48;
// Whether a GraphPool::keys entry is a fork's alias: its bit 49 differs from a stream's or key's
// (0 below 2^48, 1 under the 0xFFFF/0xFFFE tags, whose bit 63 is set).
inline bool is_fork_alias(driver::stream_t s) noexcept {  // not constexpr: reinterpret_cast (clang refuses it)
  const auto v = reinterpret_cast<std::uintptr_t>(s);
  return ((v >> 49) & 1) != (v >> 63);
}

// Exact size text that reads back as a config value ("128TiB", "3145728").
std::string size_value(std::size_t n) {
  static constexpr std::pair<std::size_t, const char*> kUnits[] = {
      {std::size_t{1} << 40, "TiB"}, {std::size_t{1} << 30, "GiB"}, {std::size_t{1} << 20, "MiB"}, {std::size_t{1} << 10, "KiB"}};
  if (n != 0)
    for (const auto& [factor, unit] : kUnits)
      if (n % factor == 0) return std::to_string(n / factor) + unit;
  return std::to_string(n);
}

// The stream as the backends and the pending frees know it.
driver::stream_t stream_key(driver::stream_t s) noexcept {
  return reinterpret_cast<std::uintptr_t>(s) == backends::kPerThreadStream ? backends::per_thread_key() : s;
}

// Where to record an event for work queued on `s` (a stream_key) so far: a per-thread stream only
// from its own thread; another thread's, through the legacy default stream, which waits for all
// earlier work of every blocking stream, every thread's per-thread stream included.
driver::stream_t event_stream(driver::stream_t s) noexcept {
  if (!backends::is_stream_key(s)) return s;
  return s == backends::calling_thread_key() ? reinterpret_cast<driver::stream_t>(backends::kPerThreadStream) : nullptr;
}

}  // namespace

namespace {
// The capture `key`'s stream belongs to, 0 for none. The legacy stream's question answers
// CUDA_ERROR_STREAM_CAPTURE_IMPLICIT while a blocking stream captures (that capture stays valid):
// the legacy stream itself never captures.
std::uint64_t capture_of_stream(driver::Driver& d, driver::stream_t key) {
  try {
    return d.stream_capture_id(backends::capture_query_stream(key));
  } catch (const driver_error& e) {
    if (e.code() == driver::Driver::kCaptureImplicitCode && backends::is_legacy_stream(key)) return 0;
    throw;
  }
}

// The keys of PyTorch's split_merge rules that `c` sets to other than their defaults.
std::vector<std::string> pytorch_rules_set(const Config& c) {
  const Config defaults;
  std::vector<std::string> keys;
  if (c.max_split_size != defaults.max_split_size) keys.emplace_back("max_split_size_mb");
  // large_segment_size_mb raises max_non_split_rounding_mb's default to itself: only another value was set.
  if (c.max_non_split_rounding != defaults.max_non_split_rounding && c.max_non_split_rounding != c.large_segment_size)
    keys.emplace_back("max_non_split_rounding_mb");
  if (c.large_segment_size != defaults.large_segment_size) keys.emplace_back("large_segment_size_mb");
  if (c.roundup_power2_divisions != defaults.roundup_power2_divisions) keys.emplace_back("roundup_power2_divisions");
  if (c.garbage_collection_threshold != defaults.garbage_collection_threshold) keys.emplace_back("garbage_collection_threshold");
  return keys;
}
}  // namespace

Config Config::with_backend(BackendKind b, std::vector<std::string>* reset) const {
  Config c = *this;
  c.backend = b;
  std::vector<std::string> keys;
  if (b == BackendKind::split_merge && c.policy == PoolPolicy::cupy) {
    keys = pytorch_rules_set(c);
    const Config defaults;
    c.max_split_size = defaults.max_split_size;
    c.max_non_split_rounding = defaults.max_non_split_rounding;
    c.large_segment_size = defaults.large_segment_size;
    c.roundup_power2_divisions = defaults.roundup_power2_divisions;
    c.garbage_collection_threshold = defaults.garbage_collection_threshold;
  }
  if (reset != nullptr) *reset = std::move(keys);
  return c;
}

void check_config(const Config& c) {
  // Each key is checked alone when parsed; these are also checked here for a Config built in code.
  // expandable_va_size as config.cpp bounds it: the expandable backend rounds it up to a page.
  if (c.va_size > kMaxExpandableVaSize)
    throw config_error("expandable_va_size", "expandable_va_size: " + size_value(c.va_size) +
                                                 " is too large; expected 0 (2x device memory) or a size of at most 1024TiB (1 PiB)");
  // At most one form (config.hpp), and a share as the parser takes it: to_string prints the share
  // when there is one, which must be what the backend reserves and must read back.
  if (c.va_fraction != 0.0 && (c.va_size != 0 || !(c.va_fraction > 0.0 && c.va_fraction <= 1.0e6)))
    throw config_error("expandable_va_size", "expandable_va_size: a share of device memory (va_fraction " +
                                                 std::to_string(c.va_fraction) + ") " +
                                                 (c.va_size != 0 ? "and a size (va_size) are both set; expected one of them"
                                                                 : "out of range; expected a share in (0%, 100000000%]"));
  // split_merge gives a request below 10 MiB a segment of large_segment_size: a smaller one would
  // hold less than the block handed out of it (the parser's bound, > 10 MiB).
  if (c.large_segment_size <= std::size_t{10} << 20)
    throw config_error("large_segment_size_mb", "large_segment_size_mb: " + size_value(c.large_segment_size) +
                                                    " is too small; expected more than 10 MiB, e.g. 20");
  // PyTorch's bound on the two, which the parser applies too: else to_string would print a config
  // that does not read back.
  if (c.max_split_size < c.large_segment_size || c.max_non_split_rounding < c.large_segment_size) {
    const bool split = c.max_split_size < c.large_segment_size;
    throw config_error("large_segment_size_mb", "large_segment_size_mb: " + size_value(c.large_segment_size) + " is more than " +
                                                    (split ? "max_split_size_mb (" + size_value(c.max_split_size)
                                                           : "max_non_split_rounding_mb (" + size_value(c.max_non_split_rounding)) +
                                                    "); expected both to be at least large_segment_size_mb");
  }
  // The other keys as their parsers bound them, for a Config built in code: else to_string() prints
  // what does not read back (an oom_dump's configuration, replayed by `expseg explain`, lost).
  const double gc = c.garbage_collection_threshold;
  if (!(gc == 0.0 || (gc > 0.0 && gc < 1.0)))
    throw config_error("garbage_collection_threshold", "garbage_collection_threshold: " + std::to_string(gc) +
                                                           " is out of range; expected 0 (off) or a number in (0, 1), e.g. 0.8");
  for (const std::size_t d : c.roundup_power2_divisions)
    if (d != 0 && !std::has_single_bit(d))
      throw config_error("roundup_power2_divisions", "roundup_power2_divisions: " + std::to_string(d) +
                                                         " divisions in an interval; expected a power of two, or 0 (off)");
  if (c.max_handle_size % (std::size_t{2} << 20) != 0)
    throw config_error("expandable_max_handle", "expandable_max_handle: " + size_value(c.max_handle_size) +
                                                    " is not a multiple of 2MiB; expected 0 (the policy default) or a multiple of 2MiB, e.g. 64MiB");
  const auto whole_mib = [](const char* key, std::size_t bytes) {
    if (bytes != SIZE_MAX && bytes % (std::size_t{1} << 20) != 0)
      throw config_error(key, std::string(key) + ": " + size_value(bytes) + " is not a whole number of MiB, as the key is written");
  };
  whole_mib("max_split_size_mb", c.max_split_size);
  whole_mib("max_non_split_rounding_mb", c.max_non_split_rounding);
  whole_mib("large_segment_size_mb", c.large_segment_size);
  // CuPy's pool has none of PyTorch's rules: split_merge under policy:cupy would drop them without a word.
  if (c.backend == BackendKind::split_merge && c.policy == PoolPolicy::cupy) {
    if (const std::vector<std::string> keys = pytorch_rules_set(c); !keys.empty()) {
      std::string names;
      for (const std::string& k : keys) names += (names.empty() ? "" : ", ") + k;
      throw config_error("policy", "policy:cupy: CuPy's memory pool has none of PyTorch's rules (" + names +
                                       "), which split_merge under policy:cupy would ignore; drop them, or use policy:pytorch");
    }
  }
  // A limit is bytes or a share in (0, 1], as limit:N% and per_process_memory_fraction parse it.
  if (c.limit.fraction != 0.0 && (c.limit.bytes != 0 || !(c.limit.fraction > 0.0 && c.limit.fraction <= 1.0)))
    throw config_error("limit", "limit: a share of device memory (fraction " + std::to_string(c.limit.fraction) + ") " +
                                    (c.limit.bytes != 0 ? "and a size (bytes) are both set; expected one of them"
                                                        : "out of range; expected a share in (0%, 100%]"));
  // An oom_dump pattern set in code reads back from its key:value form, as the dump's configuration is
  // replayed from it: no ',' or unbalanced brackets, no spaces around it, not the word none, every '%'
  // a token. Checked by the parser itself, so the two cannot drift apart.
  if (!c.oom_dump.empty()) {
    Config probe;
    try {
      probe.apply("oom_dump:" + c.oom_dump);
    } catch (const config_error& e) {
      throw config_error("oom_dump", "oom_dump: '" + c.oom_dump + "' would not read back from EXPSEG_ALLOC_CONF's syntax: " + e.what());
    }
    if (probe.oom_dump != c.oom_dump)
      throw config_error("oom_dump", "oom_dump: '" + c.oom_dump + "' reads back from EXPSEG_ALLOC_CONF's syntax as '" +
                                         (probe.oom_dump.empty() ? std::string("none") : probe.oom_dump) +
                                         "' (spaces around a path are trimmed, and none turns dumps off); expected a file path");
  }
  // The simulated device's keys are printed whatever the device, so each is held to its parser's bound
  // whatever the device is; how they fit together is the simulated device's business alone (below).
  const std::size_t g = c.sim_granularity;
  if (c.sim_capacity == 0) throw config_error("sim_capacity", "sim_capacity: must be larger than 0, e.g. 80GiB");
  if (g < 4096 || g > driver::kSimMaxGranularity || !std::has_single_bit(g))
    throw config_error("sim_granularity", "sim_granularity: " + size_value(g) +
                                              " is not a power of two that is a multiple of 4KiB, at most 1TiB, e.g. 2MiB");
  if (c.device != DeviceKind::sim) return;
  // A capacity under a MiB is most likely a unit left out (sim_capacity:80), not a page size too
  // large. A value that a unit gives exactly (512KiB, or 1024 typed bare: the text is gone here) gets
  // the hint in a form true of either.
  if (g > c.sim_capacity && c.sim_capacity < (std::size_t{1} << 20)) {
    const std::string bytes = std::to_string(c.sim_capacity);
    const std::string shown = size_value(c.sim_capacity);
    throw config_error("sim_capacity", "sim_capacity: " + (shown == bytes ? bytes + " bytes" : shown + " (" + bytes + " bytes)") +
                                           " is less than one page of the simulated device (sim_granularity " + size_value(g) + "); " +
                                           (shown == bytes ? "a size without a unit is a number of bytes: did you mean sim_capacity:" + bytes + "GiB?"
                                                           : "expected at least one page (a size without a unit is a number of bytes: "
                                                             "sim_capacity:" + bytes + "GiB for " + bytes + " GiB)"));
  }
  if (g > c.sim_capacity)
    throw config_error("sim_granularity", "sim_granularity: " + size_value(g) + " is larger than sim_capacity (" +
                                              size_value(c.sim_capacity) + "): the simulated device could not give out a "
                                              "single page; expected sim_granularity <= sim_capacity");
  // One range (a cuMemAlloc of all memory, an expandable segment's reservation) and its guard granule
  // must fit the device's address span. (Host-backed ranges are host mmaps, which say ENOMEM.)
  const std::size_t max_range = driver::kSimAddressSpan - g;
  const std::string span = "the simulated device's address span is 64 PiB (65536TiB), of which one range takes at most all but "
                           "one page of sim_granularity (" + size_value(g) + ")";
  if (c.sim_capacity > max_range)
    throw config_error("sim_capacity", "sim_capacity: " + size_value(c.sim_capacity) + " is more than the simulated device can "
                                           "address: " + span + "; expected at most 65535TiB");
  if (c.backend == BackendKind::expandable) {
    // As ExpandableBackend reserves: expandable_va_size (bytes or a share of sim_capacity), or 2x
    // sim_capacity when it is 0. Saturated at SIZE_MAX, so no product or rounding overflows. Its
    // bound, 1 PiB a segment, is below the span: checked here, so that expseg_configure and the
    // expseg_get_limit query refuse what creating the allocator would.
    const std::size_t va = c.expandable_va_bytes(c.sim_capacity);
    if (va > kMaxExpandableVaSize) {
      const std::string what = c.va_size != 0        ? size_value(va)
                               : c.va_fraction != 0.0 ? "a share of sim_capacity = " + size_value(va) + ","
                                                      : "the default, 2x sim_capacity = " + size_value(va) + ",";
      throw config_error("expandable_va_size", "expandable_va_size: " + what + " is more than one segment may reserve: at most "
                                                   "1024TiB (1 PiB); set expandable_va_size (e.g. 1024TiB) or a smaller sim_capacity");
    }
  }
}

void Config::validate() const { check_config(*this); }

std::unique_ptr<driver::Driver> make_driver(const Config& config, int device) {
  if (device < 0) throw error("expseg: device " + std::to_string(device) + ": device indices start at 0");
  check_config(config);
  if (config.device == DeviceKind::sim) {
    if (device >= driver::kSimMaxDevices)
      throw error("expseg: device " + std::to_string(device) + ": the simulated host has devices 0 to " +
                  std::to_string(driver::kSimMaxDevices - 1));
    driver::SimOptions o;
    o.capacity = config.sim_capacity;
    o.granularity = config.sim_granularity;
    o.host_backed = config.sim_host_backed;
    o.latency_model = config.sim_latency;
    o.device = device;
    // A simulated host of every device index an allocator may have: allocators of different device
    // indices are separate devices with disjoint addresses, and any two may be granted peer access.
    // The count is the same from every device, as cuDeviceGetCount's is.
    o.device_count = driver::kSimMaxDevices;  // as visible_device_count says
    o.shareable = static_cast<driver::ShareableHandle>(config.ipc_handle);
    try {
      return std::make_unique<driver::SimDriver>(o);
    } catch (const std::invalid_argument& e) {
      // What check_config cannot see (e.g. a granularity below the host's page size): still an expseg::error.
      throw error(std::string("expseg: the simulated device cannot be built: ") + e.what());
    }
  }
  driver::CudaOptions o;
  o.shareable = static_cast<driver::ShareableHandle>(config.ipc_handle);
  return driver::make_cuda_driver(device, o);
}

int visible_device_count(const Config& config) {
  return config.device == DeviceKind::sim ? driver::kSimMaxDevices : driver::cuda_device_count();
}

bool cuda_available(std::string* why) { return driver::cuda_usable(why); }

int cuda_device_count() { return driver::cuda_device_count(); }

Allocator::Impl::Impl(const Config& cfg, std::shared_ptr<driver::Driver> drv)
    : config(cfg), driver(std::move(drv)), ctx{*driver, config, stats} {
  ctx.device_total = driver->mem_info().total;
  ctx.limit = config.limit.resolve(ctx.device_total);
  ctx.hooks = this;
  backend = config.backend == BackendKind::expandable ? backends::make_expandable(ctx) : backends::make_split_merge(ctx);
  poll_every_queue = config.backend != BackendKind::expandable;  // expandable asks process_pending_frees
  if (config.record) recorder.start(config.record_ring);
  auto r = std::make_shared<OomReport>();
  r->backend = to_string(config.backend);
  r->device = driver->device();
  r->device_total_bytes = ctx.device_total;
  r->device_free_known = false;  // not read: no figure
  r->verdict = OomVerdict::unknown;
  r->message = "CUDA out of memory. expseg: host memory also ran out, so this out-of-memory error has no report "
               "(the request's size and the figures are not known)";
  no_memory_report = std::move(r);
}

Allocator::Impl::~Impl() {
  // The observer first, while everything still works: what it captured may free memory here.
  oom_observer.reset();
  // Imports closed during a capture go now (each holds the registry: left there, they would leak);
  // unless a capture expseg was told of is still underway, whose release's synchronization would
  // invalidate it: then they are left mapped (leaked), as expandable leaves its memory.
  // A capture told of may have ended without end_graph_pool (the program raised in between): asked.
  if (ctx.capturing) {
    bool underway = false;
    for (const CaptureRoute& r : capture_routes) {
      if (backends::is_per_thread_key(r.stream) && r.stream != backends::calling_thread_key()) {
        underway = underway || other_threads_capture_may_run(r.stream);
        continue;
      }
      try {
        underway = underway || driver->stream_capture_id(backends::capture_query_stream(r.stream)) == r.capture_id;
      } catch (...) {  // a stream the driver no longer knows captures nothing
      }
    }
    ctx.capturing = underway;  // what the backend's destructor goes by too
  }
  if (ctx.capturing) imports->abandon_deferred();
  else imports->set_capturing(false);
  // Graph pools still in use go with the allocator: their keys leave the process-wide registry.
  for (const auto& [id, p] : graph_pools)
    for (const auto& [stream, key] : p.keys) backends::retire_graph_pool_key(key);
  // Pending frees hold events; the backend gives all memory back in its destructor. A failing
  // cuEventDestroy is tried once more (core::try_twice), as the backends' destructors do with theirs.
  auto destroy_event = [&](driver::event_t e) noexcept { core::try_twice([&] { driver->event_destroy(e); }); };
  for (const StreamEvents* se : busy_queues) se->queue.for_each([&](const PendingFree& pf) { destroy_event(pf.event); });
  for (driver::event_t e : spare_events) destroy_event(e);
  for (const auto& [e, s] : captured_spares) destroy_event(e);
  backend.reset();
}

// Inlined into Allocator::allocate, its one caller (the cached path saves a call).
[[gnu::always_inline]] inline void* Allocator::Impl::allocate(std::size_t bytes, driver::stream_t stream) {
  if (bytes == 0) return nullptr;
  std::unique_lock<core::Mutex> lock(mu);
  const driver::stream_t asked_on = stream;
  bool eager = false;
  if (routing) [[unlikely]] stream = route_to_pool(stream, true, nullptr, &eager);
  // No event query while the request's stream captures: it would invalidate the capture.
  if (pending_count != 0 && !ctx.capturing && !stream_capturing(asked_on)) [[unlikely]] {
    if (poll_every_queue)
      process_events();
    else
      process_events_of_next_queues();
  }
  asking_stream = asked_on;
  // Room in the live table before the backend hands out a block: a bad_alloc growing it afterwards
  // would leave the block allocated with no pointer to free it by.
  live.reserve_one();
  // 1 EiB and more never reaches the backend (PyTorch refuses it up front too): no retry, no cache
  // flush for a request no device can serve.
  Block* b = nullptr;
  if (bytes < kMaxRequest) {
    // A begin_pool_allocations stream's request reaches the backend under its pool's key: the slow
    // path's capture question asks the stream itself (CaptureScope), which may capture untold.
    // Only around the backend's call, under the lock (the OOM path lets the lock go).
    const backends::RoutedFrom routed(ctx, eager, asked_on);
    b = backend->allocate(bytes, stream);
  }
  if (b != nullptr) {
    live.insert_reserved(b);
    // Graph pools' blocks are counted per key (live_insert); they come only through routing.
    if (routing) [[unlikely]] pool_block_entered(b->stream);
    if (recorder.enabled()) recorder.add(TraceAction::allocate, b->addr, bytes, routing ? traced_stream(stream) : stream);
    return reinterpret_cast<void*>(static_cast<std::uintptr_t>(b->addr));
  }
  fail_allocation(lock, bytes, stream, asked_on);
}

void Allocator::Impl::fail_allocation(std::unique_lock<core::Mutex>& lock, std::size_t bytes, driver::stream_t stream,
                                      driver::stream_t asked_on) {
  // 1 EiB and more is refused up front, as PyTorch's allocate() refuses it before its allocator
  // runs: the caller gets out_of_memory with a report, but the allocator had no OOM (num_ooms,
  // the observer and oom_dump do not see it).
  const bool refused_up_front = bytes >= kMaxRequest;
  if (!refused_up_front) {
    stats.num_ooms += 1;
    ++oom_count;
  }
  const std::uint64_t seq = ++oom_reports_begun;
  // The other-backend check runs after the lock is let go, on a copy of the live set; with a dump,
  // which holds the report whole and is written under the lock (it is of this moment), before it.
  const bool dump = !config.oom_dump.empty() && !refused_up_front;
  CounterfactualCheck check;
  std::shared_ptr<OomReport> full;
  try {
    full = build_oom_report(bytes, stream, asked_on, dump ? nullptr : &check);
  } catch (const std::bad_alloc&) {
    // No host memory for the report: the caller still gets the OOM (PyTorch's OutOfMemoryError, the
    // C API's code, last_oom()), with a short report below. Building it changed nothing.
  }
  if (recorder.enabled()) recorder.add(TraceAction::allocate_failure, 0, bytes, traced_stream(stream));
  std::shared_ptr<const OomReport> report;
  if (full) {
    if (dump) write_oom_dump(*full);
    if (check.pending) {
      lock.unlock();
      finish_counterfactual(*full, check);
      lock.lock();
    }
    report = std::move(full);
  } else {
    report = short_oom_report(bytes, asked_on);
  }
  if (seq > last_oom_seq) {  // not when an OOM that began later has published its report meanwhile
    last_oom = report;
    last_oom_seq = seq;
  }
  const std::shared_ptr<const Allocator::OomObserver> observer = refused_up_front ? nullptr : oom_observer;
  lock.unlock();
  // An OOM of this allocator inside its own observer (it may allocate) is not observed again: no
  // recursion. Another allocator's OOM there goes to that allocator's observer (up to a depth of 8).
  thread_local std::array<const Impl*, 8> observing{};
  thread_local std::size_t depth = 0;
  const auto active = observing.begin() + static_cast<std::ptrdiff_t>(depth);
  if (observer && depth < observing.size() && std::find(observing.begin(), active, this) == active) {
    observing[depth++] = this;
    struct Leave {
      ~Leave() { --depth; }
    } leave;
    (*observer)(*report);
  }
  throw out_of_memory(std::move(report));
}

void Allocator::Impl::throw_invalid_pointer(const char* op, std::uint64_t addr) const {
  std::ostringstream os;
  os << "expseg: " << op << " of pointer " << hex(addr) << ": ";
  const bool recently_freed = addr != 0 && std::find(recent_frees.begin(), recent_frees.end(), addr) != recent_frees.end();
  if (recently_freed) {
    // "double free" only for a free: a record_stream (or export) of freed memory is a use after free.
    if (std::string_view(op) == "free") os << "double free";
    else os << op << " after free";
    os << " (this allocation was already freed)";
  } else if (backend->contains(addr)) {
    os << "not the start of a live allocation (an interior pointer, or memory already freed)";
  } else {
    os << "not allocated by this expseg allocator (device " << driver->device()
       << "): a foreign pointer, or one from another device's allocator";
  }
  throw invalid_pointer(os.str());
}

void Allocator::Impl::deallocate(void* ptr) {
  if (ptr == nullptr) return;
  const auto addr = static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(ptr));
  const core::LockGuard lock(mu);
  Block* b = live_erase(addr);
  if (b == nullptr) throw_invalid_pointer("free", addr);
  if (b->stream_uses.empty()) [[likely]] {
    if (recorder.enabled()) recorder.add(TraceAction::free, addr, b->requested, traced_stream(b->stream));
    backend->free(b);
  } else if (!ctx.capturing) {
    free_after_uses(b, true);
  } else {
    try {
      frees_after_capture.push_back(b);
    } catch (...) {
      live_insert(b);  // right after its erase: room for it
      throw;
    }
    if (recorder.enabled()) recorder.add(TraceAction::free, addr, b->requested, traced_stream(b->stream));
    // Freed for the caller now (stats, snapshot, validate's live count), as PyTorch's free counts it;
    // only its events wait for the capture's end.
    backend->begin_pending_free(b);
  }
  recent_frees[recent_next++ % recent_frees.size()] = addr;
}

// Called inside the handler of deallocate's exception, which `throw;` rethrows.
void Allocator::Impl::recover_failed_deallocate(void* ptr) {
  try {
    throw;
  } catch (const invalid_pointer&) {
    throw;
  } catch (...) {
    const auto addr = static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(ptr));
    const core::LockGuard lock(mu);
    Block* b = live_erase(addr);  // back in the live map, unchanged, after the failure
    if (b == nullptr) throw;
    try {
      synchronize_uses(*b);
    } catch (...) {
      live_insert(b);  // right after its erase: room for it
      throw;
    }
    drop_recorded_uses(*b);
    b->stream_uses.clear();
    if (recorder.enabled()) recorder.add(TraceAction::free, addr, b->requested, traced_stream(b->stream));
    backend->free(b);
    recent_frees[recent_next++ % recent_frees.size()] = addr;
  }
}

// A device synchronization would also wait for, and invalidate, a capture underway on a stream
// unrelated to the block (one expseg was not told of: a C API free recovering from a failed event
// record broke it). A stream that cannot be synchronized (destroyed since its use was recorded)
// falls back to the device's synchronization, as before.
void Allocator::Impl::synchronize_uses(const Block& b) {
  try {
    for (const stream_t s : b.stream_uses) driver->stream_synchronize(event_stream(s));
  } catch (const driver_error&) {
    driver->device_synchronize();
  }
}

// A block out of the live map that other streams used (record_stream) goes back to the backend once
// their work queued so far has passed. `in_live`: it left the live map just now, and goes back there
// if this fails (a free held during a capture, frees_after_capture, is not in it).
void Allocator::Impl::free_after_uses(Block* b, bool in_live) {
  const std::uint64_t addr = b->addr;
  // Record an event on every stream that used the block; the free completes when all have passed.
  // Everything that can fail (host memory, the driver) happens before the block changes state,
  // and is undone when it fails: the block then stays live, as if the call had not been made.
  // A using stream that captures a graph expseg was not told of (a told capture holds the free in
  // deallocate): no event can stand for its work, so the free waits for that capture's end.
  for (driver::stream_t s : b->stream_uses) {
    if (!stream_capturing(event_stream(s))) continue;
    try {
      frees_after_capture.push_back(b);
    } catch (...) {
      if (in_live) live_insert(b);  // right after its erase: room for it
      throw;
    }
    if (in_live) {
      if (recorder.enabled()) recorder.add(TraceAction::free, addr, b->requested, traced_stream(b->stream));
      backend->begin_pending_free(b);
    }
    return;
  }
  std::vector<driver::event_t>& events = free_events;
  events.clear();
  std::size_t recorded = 0;
  std::size_t queued = 0;
  auto queue_of = [&](driver::stream_t s) -> StreamEvents* {
    ++queue_steps;
    const auto it = pending.find(s);
    return it == pending.end() ? nullptr : &it->second;
  };
  try {
    events.reserve(b->stream_uses.size());
    // Room for every event, spare or pending, in spare_events: the undo below cannot throw, and
    // neither can the completion of a pending free (finish_pending's callers), which has already
    // taken the block out of its queue when the event goes back to spare_events.
    // Doubling: a new high-water mark of events costs a reallocation now and then, not each time.
    if (const std::size_t n = spare_events.size() + pending_count + b->stream_uses.size(); n > spare_events.capacity())
      spare_events.reserve(std::max(n, 2 * spare_events.capacity()));
    if (const std::size_t n = captured_spares.size() + b->stream_uses.size(); n > captured_spares.capacity())
      captured_spares.reserve(std::max(n, 2 * captured_spares.capacity()));
    for (driver::stream_t s : b->stream_uses) {
      driver::event_t e = nullptr;
      if (spare_events.empty()) {
        e = driver->event_create();
      } else {
        e = spare_events.back();
        spare_events.pop_back();
      }
      events.push_back(e);  // capacity reserved: cannot throw
      driver->event_record(e, event_stream(s));
      ++recorded;
    }
    for (std::size_t i = 0; i < events.size(); ++i) {
      const driver::stream_t s = b->stream_uses[i];
      StreamEvents* se = queue_of(s);
      if (se == nullptr) {
        drop_retired_queues();
        drop_empty_queues();
        se = &pending.try_emplace(s, StreamEvents{s, {}}).first->second;
      }
      if (busy_queues.capacity() < pending.size()) busy_queues.reserve(std::max(pending.size(), 2 * busy_queues.capacity()));
      const bool was_empty = se->queue.empty();
      // A capture another thread began since the check above may hold the event now (asked after
      // every record, so a capture begun before one of them is seen).
      se->queue.push_back(PendingFree{events[i], b, stream_capturing(event_stream(s))});
      if (was_empty) busy_queues.push_back(se);  // capacity reserved
      ++queued;
    }
  } catch (...) {
    for (std::size_t i = queued; i-- > 0;) queue_of(b->stream_uses[i])->queue.pop_back();
    drop_emptied_queues();
    // An event recorded on a stream that captures now may be part of that capture (begun by another
    // thread after the check above): kept apart until it ends. Both lists have room reserved.
    for (std::size_t i = 0; i < events.size(); ++i) {
      const driver::stream_t s = event_stream(b->stream_uses[i]);
      if (i < recorded && stream_capturing(s)) captured_spares.emplace_back(events[i], s);
      else spare_events.push_back(events[i]);
    }
    if (in_live) live_insert(b);  // right after its erase: room for it
    throw;
  }
  if (recorder.enabled() && in_live) recorder.add(TraceAction::free, addr, b->requested, traced_stream(b->stream));  // nothing can fail now
  pending_count += events.size();
  drop_recorded_uses(*b);  // its events stand for the uses now
  if (in_live) backend->begin_pending_free(b);  // a free held during a capture is pending already
  b->pending_events = static_cast<std::uint32_t>(events.size());
}

void Allocator::Impl::record_stream(void* ptr, driver::stream_t stream) {
  if (ptr == nullptr) return;  // as deallocate(nullptr): PyTorch records streams of empty tensors
  const auto addr = static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(ptr));
  stream = stream_key(stream);
  std::lock_guard<core::Mutex> lock(mu);
  Block* b = live.find(addr);
  if (b == nullptr) throw_invalid_pointer("record_stream", addr);
  if (stream == b->stream) return;  // the allocation stream is always waited for
  // A capture's block carries its pool's key as its stream: the stream that allocated it, while it
  // allocates into that pool again, is its allocation stream. That stream has two keys in the pool,
  // one as a capture's own stream and one as a stream a capture forked to (route_to_pool); either
  // is its own, whichever way it captures now.
  if (routing && backends::is_graph_pool_key(b->stream)) {
    std::uint64_t pool = 0;
    if (route_to_pool(stream, false, &pool) == b->stream) return;
    if (const GraphPool* p = pool != 0 ? find_graph_pool(pool) : nullptr) {
      const auto alias = reinterpret_cast<driver::stream_t>(reinterpret_cast<std::uintptr_t>(stream) ^ kForkAliasBit);
      for (const auto& [s, k] : p->keys)
        if (k == b->stream && (s == stream || s == alias)) return;
    }
  }
  if (std::find(b->stream_uses.begin(), b->stream_uses.end(), stream) != b->stream_uses.end()) return;
  b->stream_uses.push_back(stream);  // may throw: nothing changed
  try {
    add_recorded_use(stream);
  } catch (...) {
    b->stream_uses.pop_back();
    throw;
  }
}

void Allocator::Impl::add_recorded_use(driver::stream_t stream) {
  const auto [it, made] = recorded_uses.try_emplace(stream, 0);
  ++it->second;
  if (!made || recorded_uses.size() < recorded_sweep_at) return;
  // Streams a program stopped using (a stream per request) would otherwise keep their entries.
  std::erase_if(recorded_uses, [](const auto& entry) { return entry.second == 0; });
  recorded_sweep_at = std::max(kRecordedSweepMin, 2 * recorded_uses.size());
}

// The pool key of a request on a stream of a capture that allocates into a graph pool, or on a
// stream routed by begin_pool_allocations; `stream` otherwise. Asks the driver (~20 ns), only while
// some capture allocates into a pool. A stream the capture forked to gets a key of its own in the
// pool (made at its first request; `make` false: nullptr instead), as PyTorch keys a private pool's
// blocks by stream: a block the capture freed on one stream would otherwise serve another stream
// of the same graph, whose replay runs the two streams' work side by side.
driver::stream_t Allocator::Impl::route_to_pool(driver::stream_t stream, bool make, std::uint64_t* pool, bool* eager) {
  if (backends::is_graph_pool_key(stream)) return stream;
  std::uint64_t id = 0;
  if (!capture_routes.empty()) {
    try {
      id = driver->stream_capture_id(backends::capture_query_stream(stream));
    } catch (const driver_error&) {
      // A stream of a capture expseg was told of (its own, or one it forked to) keeps its route: the
      // capture counts as underway until end_graph_pool (was: a failed question sent the request
      // out of the graph's pool, to memory an eager request could get while the graph replays into it).
      for (const CaptureRoute& r : capture_routes) {
        const bool fork = std::any_of(r.forks.begin(), r.forks.end(), [&](const CaptureRoute::Fork& f) { return f.stream == stream; });
        if (r.stream == stream || fork) id = r.capture_id;
      }
    }
  }
  if (id != 0)
    for (CaptureRoute& r : capture_routes)
      if (r.capture_id == id) {
        if (pool) *pool = r.pool;
        if (stream == r.stream) return r.key;
        if (!r.may_block) {  // a stream the capture forked to: it may block
          r.may_block = true;
          update_capture_state();
        }
        for (const CaptureRoute::Fork& f : r.forks)
          if (f.stream == stream) return f.key;
        if (!make) return nullptr;
        r.forks.reserve(r.forks.size() + 1);
        // The pool's key for the stream as a fork, kept apart from its key as a capture's own stream
        // (or a begin_pool_allocations stream): a recording traces the fork on that key, and a
        // replay, which sees it as a stream of its own, then reuses memory as the run did. A later
        // fork to the stream in the pool takes the same key up again.
        const auto alias = reinterpret_cast<driver::stream_t>(reinterpret_cast<std::uintptr_t>(stream) ^ kForkAliasBit);
        const driver::stream_t key = pool_key_for(r.pool, alias).second;
        r.forks.push_back(CaptureRoute::Fork{stream, key, recorder.enabled()});  // capacity reserved
        if (recorder.enabled()) recorder.add(TraceAction::pool_begin, r.pool, 0, key);
        return key;
      }
  // A begin_pool_allocations stream stays in its pool whether it captures or not (was: one that
  // captured untold left the pool while a told capture ran elsewhere, for none otherwise).
  for (const EagerRoute& e : eager_routes)
    if (e.stream == stream) {
      if (pool) *pool = e.pool;
      if (eager) *eager = true;
      return e.key;
    }
  return stream;
}

driver::stream_t Allocator::Impl::traced_stream(driver::stream_t key) const noexcept {
  if (!backends::is_graph_pool_key(key)) return key;
  for (const CaptureRoute& r : capture_routes)
    if (r.key == key) return r.stream;
  for (const EagerRoute& e : eager_routes)
    if (e.key == key) return e.stream;
  if (const auto k = pool_keys.find(key); k != pool_keys.end())
    if (const auto p = graph_pools.find(k->second.pool); p != graph_pools.end())
      for (const auto& [s, pk] : p->second.keys)
        if (pk == key) return is_fork_alias(s) ? key : s;
  return key;  // a released pool's key (its blocks' frees), or a fork's
}

bool Allocator::Impl::held_free_ready() const noexcept {
  if (ctx.capturing) return false;  // a told capture's held frees wait for its end_graph_pool
  return std::any_of(frees_after_capture.begin(), frees_after_capture.end(), [&](const Block* b) {
    return std::none_of(b->stream_uses.begin(), b->stream_uses.end(),
                        [&](driver::stream_t s) { return stream_capturing(event_stream(s)); });
  });
}

// The legacy stream while a blocking stream captures, untold ones included, counts as capturing:
// work recorded on it would be refused and invalidate that capture. So does a stream whose question
// failed twice (backends::capture_question): what that holds back (a synchronization, an event) is
// tried again at a later question.
bool Allocator::Impl::stream_capturing(driver::stream_t stream) const noexcept {
  if (backends::is_graph_pool_key(stream)) return true;
  return backends::capture_question(*driver, backends::capture_query_stream(stream));
}

// The queues of per-thread streams whose threads have exited, once empty: no event is recorded on
// those streams again, and process_events walks every queue. Looked at when a stream's first queue
// is made (not on the cached path), and only after a thread has exited since the last look or
// while such a queue still held a free then.
void Allocator::Impl::drop_retired_queues() noexcept {
  const std::uint64_t gen = backends::retired_keys_generation();
  if (gen == pending_retired_seen && !retired_queue_left) return;
  pending_retired_seen = gen;
  retired_queue_left = false;
  std::erase_if(pending, [&](const auto& entry) {
    const StreamEvents& se = entry.second;
    if (!backends::is_per_thread_key(se.stream) || !backends::is_retired_key(se.stream)) return false;
    if (!se.queue.empty()) retired_queue_left = true;
    return se.queue.empty();
  });
}

// The empty queues, once there are many: streams a program destroyed (a stream per request, say)
// would otherwise keep theirs for good (process_events walks only busy ones). A
// queue made again later costs one small allocation on that stream's next cross-stream free. The
// next sweep waits until the queues have doubled: amortized constant work per queue made.
void Allocator::Impl::drop_empty_queues() noexcept {
  if (pending.size() < queue_sweep_at) return;
  std::erase_if(pending, [](const auto& entry) { return entry.second.queue.empty(); });
  queue_sweep_at = std::max(kQueueSweepMin, 2 * pending.size());
}

// A block out of its queue must reach the backend: nothing from the pop to the free may throw.
void Allocator::Impl::finish_pending(Block* b) noexcept {
  if (--b->pending_events != 0) return;
  if (recorder.enabled()) recorder.add(TraceAction::free_completed, b->addr, b->requested, traced_stream(b->stream));
  backend->free(b);
}

bool Allocator::Impl::front_event_usable(StreamEvents& se) {
  PendingFree& pf = se.queue.front();
  if (!pf.maybe_captured) return true;
  const driver::stream_t s = event_stream(se.stream);
  if (stream_capturing(s)) return false;
  driver->event_record(pf.event, s);  // after the capture's work, which the graph's launches repeat
  pf.maybe_captured = false;
  return true;
}

bool Allocator::Impl::routed_stream_captures() const noexcept {
  for (const EagerRoute& e : eager_routes) {
    // Another thread's per-thread stream cannot be named here (it blocks: the legacy stream's
    // question covers it).
    if (backends::is_per_thread_key(e.stream) && e.stream != backends::calling_thread_key()) continue;
    if (stream_capturing(e.stream)) return true;
  }
  return false;
}

bool Allocator::Impl::other_threads_capture_may_run(driver::stream_t key) const noexcept {
  if (backends::is_retired_key(key)) return false;  // its thread has exited
  try {
    return driver->stream_capture_id(nullptr) != 0;
  } catch (...) {  // CUDA_ERROR_STREAM_CAPTURE_IMPLICIT (a blocking stream captures: maybe this one), or no answer
    return true;
  }
}

bool Allocator::Impl::process_pending_frees() {
  if (pending_count == 0 || ctx.capturing || stream_capturing(asking_stream)) return false;
  const std::size_t before = pending_count;
  process_events();
  return pending_count != before;
}

void Allocator::Impl::process_events_of_next_queues() {
  const std::size_t turns = std::min(kQueuesPolledPerRequest, busy_queues.size());  // each queue once at most
  for (std::size_t n = 0; n < turns; ++n) {
    if (next_polled_queue >= busy_queues.size()) next_polled_queue = 0;
    StreamEvents& se = *busy_queues[next_polled_queue];
    process_queue(se);
    if (se.queue.empty())  // out of busy_queues; the next queue moves into its place, and its turn
      busy_queues.erase(busy_queues.begin() + static_cast<std::ptrdiff_t>(next_polled_queue));
    else
      ++next_polled_queue;
  }
}

void Allocator::Impl::process_events() {
  const DropEmptiedQueues drop{*this};
  for (StreamEvents* busy : busy_queues) process_queue(*busy);
}

// process_events' work on one queue: its frees whose events have completed, in order.
void Allocator::Impl::process_queue(StreamEvents& se) {
  ++queue_steps;
  while (!se.queue.empty()) {
    if (!front_event_usable(se)) break;  // its stream captures: the free waits for the capture's end
    PendingFree pf = se.queue.front();
    bool done = false;
    try {
      done = driver->event_query(pf.event);  // throws with the free still queued
    } catch (const driver_error& e) {
      if (!recorded_in_capture(e)) throw;
      se.queue.front().maybe_captured = true;
      (void)front_event_usable(se);  // recorded again now if the capture has ended; asked next time
    }
    if (!done) break;
    se.queue.pop_front();
    --pending_count;
    spare_events.push_back(pf.event);  // within the capacity deallocate reserved: cannot throw
    finish_pending(pf.block);
  }
}

void Allocator::Impl::synchronize_pending_frees() {
  stats.num_sync_all_streams += 1;  // counted on every call, events or not, as PyTorch does
  // Held frees whose capture (one expseg was not told of) has ended get their events now.
  if (!frees_after_capture.empty() && held_free_ready()) free_held_after_capture();
  if (pending_count == 0) return;
  const DropEmptiedQueues drop{*this};
  for (StreamEvents* busy : busy_queues) {
    StreamEvents& se = *busy;
    while (!se.queue.empty()) {
      if (!front_event_usable(se)) break;  // its stream captures: the free waits for the capture's end
      try {
        driver->event_synchronize(se.queue.front().event);  // throws with the free still queued
      } catch (const driver_error& e) {
        if (!recorded_in_capture(e)) throw;
        se.queue.front().maybe_captured = true;
        if (!front_event_usable(se)) break;
        driver->event_synchronize(se.queue.front().event);  // recorded again, outside any capture
      }
      const PendingFree pf = se.queue.front();
      se.queue.pop_front();
      --pending_count;
      spare_events.push_back(pf.event);  // within the capacity deallocate reserved: cannot throw
      finish_pending(pf.block);
    }
  }
}

void Allocator::Impl::on_map(std::uint64_t addr, std::size_t bytes, driver::stream_t stream) {
  if (recorder.enabled()) recorder.add(TraceAction::map, addr, bytes, traced_stream(stream));
}

void Allocator::Impl::on_unmap(std::uint64_t addr, std::size_t bytes, driver::stream_t stream) {
  if (recorder.enabled()) recorder.add(TraceAction::unmap, addr, bytes, traced_stream(stream));
}

Snapshot Allocator::Impl::snapshot_locked() const {
  Snapshot s;
  s.backend = to_string(config.backend);
  s.device = driver->device();
  s.limit_bytes = ctx.limit;
  s.device_total_bytes = ctx.device_total;
  backend->snapshot(s.segments);
  std::sort(s.segments.begin(), s.segments.end(), [](const SegmentInfo& a, const SegmentInfo& b) { return a.address < b.address; });
  for (SegmentInfo& seg : s.segments) {
    const auto key = reinterpret_cast<driver::stream_t>(static_cast<std::uintptr_t>(seg.stream));
    if (!backends::is_graph_pool_key(key)) continue;
    if (const std::uint64_t pool = pool_of_key(key); pool != 0) seg.graph_pool = pool;
  }
  s.stats = stats;
  return s;
}

// ---------------------------------------------------------------------------------------------

Allocator::Allocator(const Config& config, int device) : impl_(std::make_unique<Impl>(config, make_driver(config, device))) {}
Allocator::Allocator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Allocator::~Allocator() = default;

// The stream as the backends know it (cudaStreamPerThread: the calling thread's key), translated
// here so that Impl::allocate, which takes keys, stays small enough to inline.
void* Allocator::allocate(std::size_t bytes, stream_t stream) { return impl_->allocate(bytes, stream_key(stream)); }
void Allocator::deallocate(void* ptr) { impl_->deallocate(ptr); }
void Allocator::record_stream(void* ptr, stream_t stream) { impl_->record_stream(ptr, stream); }

void Allocator::begin_graph_pool(std::uint64_t pool, stream_t capture_stream) {
  if (pool == 0) throw error("begin_graph_pool: pool 0 is not a pool id (use any other number)");
  const driver::stream_t key = stream_key(capture_stream);
  std::lock_guard<core::Mutex> lock(impl_->mu);
  Impl& m = *impl_;
  const std::uint64_t capture = capture_of_stream(*m.driver, key);
  if (capture == 0 || backends::is_graph_pool_key(key))
    throw error("begin_graph_pool: the stream is not capturing; begin the capture (cuStreamBeginCapture, torch.cuda.graph) first");
  for (const Impl::CaptureRoute& r : m.capture_routes)
    if (r.capture_id == capture)
      throw error("begin_graph_pool: this capture allocates into graph pool " + std::to_string(r.pool) + " already");
  m.capture_routes.reserve(m.capture_routes.size() + 1);  // nothing below throws once the pool exists
  const auto [graph_pool, pool_key] = m.pool_key_for(pool, key);
  graph_pool->uses += 1;
  // prepare_capture's answer for this stream, asked before the capture began (it cannot be now).
  bool may_block = true;
  if (auto p = std::find_if(m.ctx.prepared_captures.begin(), m.ctx.prepared_captures.end(), [&](const auto& e) { return e.first == key; });
      p != m.ctx.prepared_captures.end()) {
    may_block = p->second;
    m.ctx.prepared_captures.erase(p);
  }
  m.capture_routes.push_back(Impl::CaptureRoute{capture, pool, pool_key, key, may_block, {}});
  m.update_capture_state();
  if (m.recorder.enabled()) m.recorder.add(TraceAction::pool_begin, pool, 0, key);
}

std::pair<Allocator::Impl::GraphPool*, driver::stream_t> Allocator::Impl::pool_key_for(std::uint64_t pool, driver::stream_t stream) {
  GraphPool* p = find_graph_pool(pool);
  const bool made = p == nullptr;
  if (made) {
    p = &graph_pools.try_emplace(pool, GraphPool{pool, {}, 0, {}}).first->second;  // may throw: nothing changed
  }
  for (const auto& [s, k] : p->keys)
    if (s == stream) return {p, k};
  driver::stream_t key = nullptr;
  try {
    p->keys.reserve(p->keys.size() + 1);
    key = backends::new_graph_pool_key();
    pool_keys.try_emplace(key, PoolKey{pool});
    p->keys.emplace_back(stream, key);  // capacity reserved
    return {p, key};
  } catch (...) {
    if (key != nullptr) backends::retire_graph_pool_key(key);
    if (made) graph_pools.erase(pool);
    throw;
  }
}

void Allocator::Impl::pool_block_entered(driver::stream_t key) noexcept {
  if (!backends::is_graph_pool_key(key)) return;
  if (const auto k = pool_keys.find(key); k != pool_keys.end()) {
    k->second.live += 1;
    pool_live_blocks += 1;
  }
}

void Allocator::Impl::pool_block_left(driver::stream_t key) noexcept {
  const auto it = pool_keys.find(key);
  if (it == pool_keys.end()) return;
  PoolKey& k = it->second;
  pool_live_blocks -= 1;
  if (--k.live != 0 || !k.released || k.queued) return;
  k.queued = true;
  unheld_keys.push_back(key);  // capacity holds every released key (release_graph_pool)
}

void Allocator::Impl::drop_released_key(std::unordered_map<driver::stream_t, PoolKey>::iterator k) noexcept {
  const std::uint64_t id = k->second.pool;
  pool_keys.erase(k);
  released_key_count -= 1;
  const auto p = graph_pools.find(id);
  p->second.released_keys -= 1;
  if (p->second.uses == 0 && p->second.keys.empty() && p->second.released_keys == 0) graph_pools.erase(p);
}

void Allocator::Impl::prune_graph_pools() noexcept {
  for (const driver::stream_t key : unheld_keys) {
    const auto k = pool_keys.find(key);
    k->second.queued = false;
    if (k->second.live == 0) drop_released_key(k);  // else carried again (a failed free's undo)
  }
  unheld_keys.clear();
}

void Allocator::begin_pool_allocations(std::uint64_t pool, stream_t stream) {
  if (pool == 0) throw error("begin_pool_allocations: pool 0 is not a pool id (use any other number)");
  const driver::stream_t key = stream_key(stream);
  std::lock_guard<core::Mutex> lock(impl_->mu);
  Impl& m = *impl_;
  if (backends::is_graph_pool_key(key)) throw error("begin_pool_allocations: not a stream");
  if (capture_of_stream(*m.driver, key) != 0)
    throw error("begin_pool_allocations: the stream is capturing; a capture allocates into a pool through begin_graph_pool");
  for (const Impl::EagerRoute& e : m.eager_routes)
    if (e.stream == key)
      throw error("begin_pool_allocations: the stream allocates into graph pool " + std::to_string(e.pool) + " already");
  m.eager_routes.reserve(m.eager_routes.size() + 1);  // nothing below throws once the pool exists
  const auto [graph_pool, pool_key] = m.pool_key_for(pool, key);
  graph_pool->uses += 1;
  m.eager_routes.push_back(Impl::EagerRoute{pool, key, pool_key});
  m.update_routing();
  if (m.recorder.enabled()) m.recorder.add(TraceAction::pool_begin, pool, 0, key);
}

void Allocator::end_pool_allocations(std::uint64_t pool, stream_t stream) {
  const driver::stream_t key = stream_key(stream);
  std::lock_guard<core::Mutex> lock(impl_->mu);
  Impl& m = *impl_;
  auto e = std::find_if(m.eager_routes.begin(), m.eager_routes.end(), [&](const Impl::EagerRoute& r) { return r.pool == pool && r.stream == key; });
  if (e == m.eager_routes.end())
    throw error("end_pool_allocations: the stream does not allocate into graph pool " + std::to_string(pool) + " (begin_pool_allocations)");
  if (m.recorder.enabled()) m.recorder.add(TraceAction::pool_end, pool, 0, key);
  m.eager_routes.erase(e);
  m.update_routing();
}

std::vector<std::pair<std::uint64_t, std::size_t>> Allocator::graph_pool_blocks(std::uint64_t pool) const {
  std::lock_guard<core::Mutex> lock(impl_->mu);
  Impl& m = *impl_;
  std::vector<std::pair<std::uint64_t, std::size_t>> out;
  if (m.find_graph_pool(pool) == nullptr) return out;
  m.live.for_each([&](const Block* b) {
    if (b->status == core::BlockStatus::allocated && backends::is_graph_pool_key(b->stream) && m.pool_of_key(b->stream) == pool)
      out.emplace_back(b->addr, b->size);
  });
  std::sort(out.begin(), out.end());
  return out;
}

void Allocator::restore_graph_pool_block(std::uint64_t pool, void* ptr, std::size_t size) {
  const auto addr = static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(ptr));
  std::lock_guard<core::Mutex> lock(impl_->mu);
  Impl& m = *impl_;
  Impl::GraphPool* p = m.find_graph_pool(pool);
  if (p == nullptr || p->uses == 0)
    throw error("restore_graph_pool_block: no graph pool " + std::to_string(pool) + " (never begun, or released)");
  if (size == 0 || addr % 512 != 0 || size % 512 != 0)
    throw error("restore_graph_pool_block: " + hex(addr) + " and " + std::to_string(size) + " B must be nonzero multiples of 512 B");
  if (m.live.find(addr) != nullptr) throw error("restore_graph_pool_block: " + hex(addr) + " is allocated already");
  m.live.reserve_one();  // before the backend hands the block out (see allocate)
  for (const auto& [s, key] : p->keys) {
    Block* b = m.backend->allocate_at(key, addr, size);
    if (b == nullptr) continue;
    m.live_insert(b);
    if (m.recorder.enabled()) {  // the block's allocation, marked as a restore into the pool's memory for stream s
      m.recorder.add(TraceAction::pool_restore, pool, 0, s);
      m.recorder.add(TraceAction::allocate, b->addr, size, s);
    }
    return;
  }
  throw error("restore_graph_pool_block: [" + hex(addr) + ", +" + std::to_string(size) + " B) is not free memory of graph pool " +
              std::to_string(pool));
}

void Allocator::prepare_capture(stream_t stream) {
  const driver::stream_t key = stream_key(stream);
  std::lock_guard<core::Mutex> lock(impl_->mu);
  Impl& m = *impl_;
  if (backends::is_graph_pool_key(key)) throw error("prepare_capture: not a stream");
  m.ctx.prepared_captures.reserve(Impl::kMaxPreparedCaptures);  // nothing below allocates
  const driver::stream_t query = backends::capture_query_stream(key);
  // Asking a capturing stream's flags would invalidate its capture.
  if (m.driver->stream_capture_id(query) != 0)
    throw error("prepare_capture: the stream captures already; call it before cuStreamBeginCapture");
  // The default streams block: the legacy stream itself, and each thread's per-thread stream.
  const bool blocks = backends::is_legacy_stream(key) || backends::is_per_thread_key(key) || m.driver->stream_is_blocking(query);
  auto p = std::find_if(m.ctx.prepared_captures.begin(), m.ctx.prepared_captures.end(), [&](const auto& e) { return e.first == key; });
  if (p != m.ctx.prepared_captures.end()) {
    p->second = blocks;
    return;
  }
  if (m.ctx.prepared_captures.size() == Impl::kMaxPreparedCaptures) m.ctx.prepared_captures.erase(m.ctx.prepared_captures.begin());
  m.ctx.prepared_captures.emplace_back(key, blocks);
}

void Allocator::end_graph_pool(std::uint64_t pool) {
  std::lock_guard<core::Mutex> lock(impl_->mu);
  Impl& m = *impl_;
  // One capture's routing per end (as PyTorch's endAllocateToPool): captures may share a pool, and
  // the others go on allocating into it. The one whose capture has ended. While every one still
  // captures, the end is refused: the capture's later requests would leave the pool, and eager
  // blocks could then get memory the graph writes when replayed.
  auto route = m.capture_routes.end();
  bool ended = false;
  bool other_thread = false;  // a capture on another thread's per-thread stream, which only it can ask about
  for (auto r = m.capture_routes.begin(); r != m.capture_routes.end(); ++r) {
    if (r->pool != pool) continue;
    route = r;
    if (backends::is_per_thread_key(r->stream) && r->stream != backends::calling_thread_key()) {
      // cudaStreamPerThread names the caller's own stream: asked from here, the capturing thread's
      // capture would read as ended.
      if (!m.other_threads_capture_may_run(r->stream)) {
        ended = true;
        break;
      }
      other_thread = true;
      continue;
    }
    std::uint64_t id = 0;
    try {
      id = m.driver->stream_capture_id(backends::capture_query_stream(r->stream));
    } catch (const driver_error& e) {
      // A stream the driver no longer knows captures nothing; any other failure leaves the capture's
      // end unknown: refused, with nothing changed yet (was: read as ended, dropping the route of a
      // capture that still ran).
      if (!driver::Driver::stream_gone(e)) throw;
    }
    if (id != r->capture_id) {
      ended = true;
      break;
    }
  }
  if (route == m.capture_routes.end()) throw error("end_graph_pool: no capture allocates into graph pool " + std::to_string(pool));
  if (!ended && other_thread)
    throw error("end_graph_pool: the capture allocating into graph pool " + std::to_string(pool) +
                " runs on another thread's per-thread stream (cudaStreamPerThread), which only that thread can ask about, "
                "and the legacy stream's capture question does not show it ended (a blocking stream may capture, or the "
                "driver did not answer): call end_graph_pool from that thread, after its capture ends");
  if (!ended)
    throw error("end_graph_pool: the capture allocating into graph pool " + std::to_string(pool) +
                " is still running; end the capture (cuStreamEndCapture) first");
  // The last capture's end frees what was held for it: its host memory now, before the end commits.
  if (m.capture_routes.size() == 1) m.held_scratch.reserve(m.frees_after_capture.size());
  if (m.recorder.enabled()) {
    for (const Impl::CaptureRoute::Fork& f : route->forks) {
      if (!f.begin_traced) continue;  // the recording began after the fork's first request
      m.recorder.add(TraceAction::pool_end, pool, 0, f.key);
      m.recorder.add(TraceAction::pool_release, pool, 0, nullptr);
    }
    m.recorder.add(TraceAction::pool_end, pool, 0, route->stream);
  }
  m.capture_routes.erase(route);
  m.update_capture_state();
  if (m.ctx.capturing) return;
  // The end is done whatever follows: a failure below must not read as an end not made (a retry
  // would find no capture), so its error says what was done and what is left.
  try {
    m.free_held_after_capture();
  } catch (const driver_error& e) {
    m.backend->reap_released();
    const std::size_t left = m.frees_after_capture.size();
    throw_after_commit(e, "end_graph_pool(" + std::to_string(pool) + "): the capture's end is done (its routing into graph pool " +
                              std::to_string(pool) + " is gone: do not call end_graph_pool for it again), but " + std::to_string(left) +
                              " free(s) held during the capture could not be completed (no event, and the device synchronization "
                              "failed): they stay held and are retried at the next end_graph_pool, release_cached(), "
                              "release_stream() of a stream they used, or a request that would otherwise run out of memory");
  } catch (...) {
    m.backend->reap_released();
    throw;
  }
  m.backend->reap_released();  // a capture loop allocates only while capturing: give released pools back now
}

// The frees of blocks other streams used, held back during a capture: as usual now. Should one
// fail (no event), the device is synchronized and the block freed at once. Should that fail too,
// the rest stay held for the next end_graph_pool or release_cached (which gives them back).
void Allocator::Impl::free_held_after_capture() {
  // Taken out first: a free whose stream still captures (one expseg was not told of) goes back in.
  // The list keeps its capacity, so neither that nor putting back what is left when something
  // throws allocates.
  std::vector<Block*>& held = held_scratch;
  held.reserve(frees_after_capture.size());  // may throw: nothing changed (end_graph_pool reserved it already)
  held.assign(frees_after_capture.begin(), frees_after_capture.end());
  frees_after_capture.clear();
  struct PutBack {
    std::vector<Block*>& held;
    std::vector<Block*>& to;
    ~PutBack() { to.insert(to.end(), held.begin(), held.end()); }
  } put_back{held, frees_after_capture};
  while (!held.empty()) {
    Block* b = held.back();
    try {
      free_after_uses(b, false);
    } catch (...) {
      synchronize_uses(*b);
      drop_recorded_uses(*b);
      b->stream_uses.clear();
      if (recorder.enabled()) recorder.add(TraceAction::free_completed, b->addr, b->requested, traced_stream(b->stream));
      backend->free(b);
    }
    held.pop_back();
  }
}

void Allocator::release_graph_pool(std::uint64_t pool) {
  std::lock_guard<core::Mutex> lock(impl_->mu);
  Impl& m = *impl_;
  Impl::GraphPool* p = m.find_graph_pool(pool);
  if (p == nullptr || p->uses == 0) throw error("release_graph_pool: no graph pool " + std::to_string(pool) + " (never begun, or released as often as begun)");
  if (p->uses > 1) {
    p->uses -= 1;
    if (m.recorder.enabled()) m.recorder.add(TraceAction::pool_release, pool, 0, nullptr);
    return;
  }
  if (std::any_of(m.capture_routes.begin(), m.capture_routes.end(), [&](const Impl::CaptureRoute& r) { return r.pool == pool; }))
    throw error("release_graph_pool: a capture still allocates into graph pool " + std::to_string(pool) + " (end_graph_pool first)");
  if (std::any_of(m.eager_routes.begin(), m.eager_routes.end(), [&](const Impl::EagerRoute& r) { return r.pool == pool; }))
    throw error("release_graph_pool: a stream still allocates into graph pool " + std::to_string(pool) + " (end_pool_allocations first)");
  // Room for every released key on unheld_keys: a free that leaves one unheld never allocates.
  m.unheld_keys.reserve(m.released_key_count + p->keys.size());  // may throw: nothing changed
  p->uses = 0;
  for (const auto& [s, key] : p->keys) {
    backends::retire_graph_pool_key(key);  // the backends give its memory back from their next look
    const auto k = m.pool_keys.find(key);
    if (k->second.live == 0) {
      m.pool_keys.erase(k);
    } else {  // kept while live blocks carry it
      k->second.released = true;
      m.released_key_count += 1;
      p->released_keys += 1;
    }
  }
  p->keys.clear();
  if (m.recorder.enabled()) m.recorder.add(TraceAction::pool_release, pool, 0, nullptr);
  // This pool goes unless live blocks carry its keys; so do the keys released earlier whose blocks
  // have all been freed since, and their pools. Nothing throws: once the release commits above,
  // nothing can fail (a give-back that fails is retried at the next reap).
  if (p->released_keys == 0) m.graph_pools.erase(pool);
  m.prune_graph_pools();
  if (!m.ctx.capturing) m.backend->reap_released();
}

void Allocator::release_cached() {
  std::lock_guard<core::Mutex> lock(impl_->mu);
  if (impl_->ctx.capturing)
    throw error("release_cached: a CUDA graph capture allocates into a graph pool; giving memory back would synchronize and invalidate it");
  // Frees still held after a capture whose end could not free them: they are given back too.
  if (!impl_->frees_after_capture.empty()) impl_->free_held_after_capture();
  impl_->backend->release_cached();
  impl_->prune_graph_pools();     // released pools whose last blocks have been freed
  impl_->destroy_spare_events();  // after the backend's release, whose synchronization completes pending frees
}

void Allocator::Impl::destroy_spare_events() {
  // Kept at their peak count otherwise. The capacity stays: it must hold the pending frees' events.
  // Holding the lock does not keep captures away: another thread may begin one (untold, or before
  // its begin_graph_pool) on a stream between a free's capture check and its record. Completed
  // frees give back events queried complete, outside any capture; a failed free gives back what it
  // recorded, and an event whose stream captures then may be that capture's: it waits in
  // captured_spares, and goes only once its stream captures no more (CUDA documents no use of an
  // event handle by a capture underway; HIP's captures list their events, and once kept a
  // destroyed one).
  while (!spare_events.empty()) {
    driver->event_destroy(spare_events.back());  // throws with the event still spare
    spare_events.pop_back();
  }
  for (std::size_t i = captured_spares.size(); i-- > 0;) {
    const auto [e, s] = captured_spares[i];
    if (stream_capturing(s)) continue;
    driver->event_destroy(e);  // throws with the event still kept
    captured_spares.erase(captured_spares.begin() + static_cast<std::ptrdiff_t>(i));
  }
}

void refuse_unreleasable_stream(driver::stream_t stream) {
  const auto v = reinterpret_cast<std::uintptr_t>(stream);
  if (stream == nullptr || v == backends::kPerThreadStream || v == backends::kLegacyStream || backends::is_stream_key(stream))
    throw error("release_stream: only a stream the program created can be released (not the default, legacy or per-thread stream)");
}

void Allocator::release_stream(stream_t stream) {
  std::lock_guard<core::Mutex> lock(impl_->mu);
  impl_->release_stream_locked(stream, false);
}

void Allocator::Impl::release_stream_locked(stream_t stream, bool foreign_too) {
  refuse_unreleasable_stream(stream);
  if (ctx.capturing)
    throw error("release_stream: a CUDA graph capture allocates into a graph pool; synchronizing would invalidate it");
  if (backends::stream_captures(ctx, stream)) throw error("release_stream: the stream is capturing");
  // Frees the caller made are no use of the stream: those held for a capture (one expseg was not
  // told of) that has ended get their events, and those whose events have passed complete. Was:
  // such a free kept the stream refused until release_cached.
  if (!frees_after_capture.empty() && held_free_ready()) free_held_after_capture();
  if (pending_count != 0) process_events();
  if (const std::size_t in_use = backend->stream_bytes_in_use(stream); in_use != 0)
    throw error("release_stream: " + std::to_string(in_use) +
                " bytes of blocks allocated on the stream are in use (live, or freed and waiting for other streams): free them first");
  const stream_t key = backends::foreign_stream_key(stream);
  if (foreign_too)
    if (const std::size_t in_use = backend->stream_bytes_in_use(key); in_use != 0)
      throw error("release_stream: " + std::to_string(in_use) +
                  " bytes of blocks expseg_cupy_malloc allocated on the stream are in use (live, or freed and waiting for other streams): free them first");
  const auto counted = recorded_uses.find(stream);
  if (const std::size_t recorded = counted == recorded_uses.end() ? 0 : counted->second; recorded != 0)
    throw error("release_stream: " + std::to_string(recorded) +
                " block(s) have the stream recorded (record_stream) and are not freed yet: an event would be recorded on it");
  // A stream routed into a graph pool would stay routed, under its handle, past its destruction: a
  // new stream given the same handle would allocate into the pool.
  for (const EagerRoute& r : eager_routes)
    if (r.stream == stream)
      throw error("release_stream: the stream allocates into graph pool " + std::to_string(r.pool) +
                  " (begin_pool_allocations): end_pool_allocations first");
  driver->stream_synchronize(stream);  // its queued work, and the events of frees that waited for it
  if (pending_count != 0) process_events();
  // The backends take the stream as synchronized (the foreign key's memory is the same stream's
  // work): no further synchronization, so no capture elsewhere is at stake.
  backend->release_stream(stream);
  if (foreign_too) backend->release_stream(key);
  for (const stream_t q : {stream, key})
    if (const auto it = pending.find(q); it != pending.end() && it->second.queue.empty()) pending.erase(it);
  recorded_uses.erase(stream);  // at zero, checked above
  // Forgotten everywhere else too, so that nothing asks a destroyed stream about captures: a
  // prepare_capture answer for it (the backend watches those streams), and events kept until its
  // capture ended (it captures no more: checked above).
  std::erase_if(ctx.prepared_captures, [&](const auto& e) { return e.first == stream; });
  for (std::size_t i = captured_spares.size(); i-- > 0;) {
    if (captured_spares[i].second != stream) continue;
    driver->event_destroy(captured_spares[i].first);  // throws with the event still kept
    captured_spares.erase(captured_spares.begin() + static_cast<std::ptrdiff_t>(i));
  }
}

Stats Allocator::stats() const {
  std::lock_guard<core::Mutex> lock(impl_->mu);
  return impl_->stats;
}

void Allocator::reset_peak_stats() {
  std::lock_guard<core::Mutex> lock(impl_->mu);
  impl_->stats.reset_peaks();
}

void Allocator::reset_accumulated_stats() {
  std::lock_guard<core::Mutex> lock(impl_->mu);
  impl_->stats.reset_accumulated();
}

void Allocator::set_limit(std::size_t bytes) {
  std::lock_guard<core::Mutex> lock(impl_->mu);
  if (impl_->ctx.capturing)
    throw error("set_limit: a CUDA graph capture allocates into a graph pool; giving memory back would synchronize and invalidate it");
  const std::size_t old = impl_->ctx.limit;
  impl_->ctx.limit = bytes;
  try {
    impl_->backend->on_limit_changed();
  } catch (...) {
    impl_->ctx.limit = old;  // a failed give-back leaves the old limit in force
    throw;
  }
  // The configuration reports the limit in force (expseg_config, OOM dumps, whose replay runs under it).
  if (bytes != old) impl_->config.limit = Limit{bytes, 0.0};
  // A trace has no limit events: an OOM dump says the replay's single limit is not the run's.
  if (bytes != old && impl_->recorder.enabled() && !impl_->recorder.empty()) impl_->limit_changed_while_recording = true;
}

std::size_t Allocator::limit() const {
  std::lock_guard<core::Mutex> lock(impl_->mu);
  return impl_->ctx.limit;
}

Snapshot Allocator::snapshot() const {
  std::lock_guard<core::Mutex> lock(impl_->mu);
  return impl_->snapshot_locked();
}

void Allocator::set_oom_observer(OomObserver observer) {
  auto next = observer ? std::make_shared<const OomObserver>(std::move(observer)) : nullptr;
  {
    std::lock_guard<core::Mutex> lock(impl_->mu);
    impl_->oom_observer.swap(next);
  }
  // `next` now holds the old observer: destroyed here, after the lock, since what it captured may
  // free memory of this allocator (a reserve released on OOM) or of another one.
}

std::optional<OomReport> Allocator::last_oom() const {
  std::lock_guard<core::Mutex> lock(impl_->mu);
  if (!impl_->last_oom) return std::nullopt;
  return *impl_->last_oom;
}

void Allocator::start_recording(std::size_t ring) {
  std::lock_guard<core::Mutex> lock(impl_->mu);
  Impl& m = *impl_;
  // Cached memory counts too: a replay starts without the run's segments, so its fragmentation
  // differs. So does a graph pool in use by more than the routes traced below (a graph captured
  // earlier keeps its pool): the trace's releases of it find no begin.
  std::uint64_t pool_uses = 0;
  for (const auto& [id, p] : m.graph_pools) pool_uses += p.uses;
  const bool partial = m.live.size() != 0 || m.pending_count != 0 || m.stats.reserved_bytes[kAllPools].current != 0 ||
                       pool_uses != m.capture_routes.size() + m.eager_routes.size();
  m.recorder.start(ring, partial);
  m.limit_changed_while_recording = false;  // a fresh recording
  // The routes into graph pools underway begin the trace, as if begun now: their requests go into
  // the pools in a replay, and their pool end (and release) pair with these.
  for (Impl::CaptureRoute& r : m.capture_routes) {
    m.recorder.add(TraceAction::pool_begin, r.pool, 0, r.stream);
    for (Impl::CaptureRoute::Fork& f : r.forks) {
      m.recorder.add(TraceAction::pool_begin, r.pool, 0, f.key);
      f.begin_traced = true;
    }
  }
  for (const Impl::EagerRoute& e : m.eager_routes) m.recorder.add(TraceAction::pool_begin, e.pool, 0, e.stream);
}

void Allocator::stop_recording() {
  std::lock_guard<core::Mutex> lock(impl_->mu);
  impl_->recorder.stop();
}

bool Allocator::recording() const {
  std::lock_guard<core::Mutex> lock(impl_->mu);
  return impl_->recorder.enabled();
}

std::vector<TraceEvent> Allocator::recorded() const {
  std::lock_guard<core::Mutex> lock(impl_->mu);
  return impl_->recorder.events();
}

bool Allocator::recorded_partial() const {
  std::lock_guard<core::Mutex> lock(impl_->mu);
  return impl_->recorder.partial();
}

Snapshot Allocator::snapshot_with_recorded(std::vector<TraceEvent>& events) const {
  std::lock_guard<core::Mutex> lock(impl_->mu);
  events = impl_->recorder.events();
  return impl_->snapshot_locked();
}

void Allocator::enable_peer_access(int peer) {
  std::lock_guard<core::Mutex> lock(impl_->mu);
  driver::Driver& d = *impl_->driver;
  const int self = d.device();
  if (peer == self) return;
  const std::string what = "expseg: enable_peer_access(" + std::to_string(peer) + ") on device " + std::to_string(self) + ": ";
  const int count = d.device_count();
  if (peer < 0 || peer >= count)
    throw error(what + "no device " + std::to_string(peer) + " (" + std::to_string(count) + " " + d.kind() +
                " devices visible)");
  if (!d.can_access_peer(peer))
    throw error(what + "device " + std::to_string(peer) + " cannot access memory of device " + std::to_string(self) +
                " (cuDeviceCanAccessPeer: no peer-to-peer path between them, e.g. no NVLink/PCIe P2P, or P2P "
                "disabled by the platform)");
  // Memory reached through contexts (split_merge's cuMemAlloc, cuda_ipc imports) needs
  // cuCtxEnablePeerAccess, which CUDA allows for at most 8 peers of a device: an expandable
  // allocator asks for it only once it has imported such memory. First, as the step that can be
  // refused. Then the driver's access list gains the peer: all that expandable memory (and what
  // import_ipc mapped from posix_fd/fabric handles) needs; and the backend extends the grant to what
  // is already mapped. If that fails halfway, the peer is not recorded as granted and a later call
  // grants everything again.
  if (impl_->config.backend == BackendKind::split_merge)
    (void)d.enable_context_peer(peer);
  else if (impl_->context_imports)
    impl_->enable_context_peer_for_imports(peer);
  (void)d.add_access_device(peer);
  std::vector<int>& granted = impl_->peers;
  if (std::find(granted.begin(), granted.end(), peer) != granted.end()) return;
  granted.reserve(granted.size() + 1);
  try {
    impl_->backend->on_peer_added(peer);
    impl_->imports->grant_all(d);  // and what import_ipc mapped
  } catch (const driver_error& e) {
    // Part of the memory is granted, and the call can be repeated (cuMemSetAccess may be repeated
    // over memory already granted).
    throw_after_commit(e, what + "access to the memory already mapped was granted only in part (memory mapped from now on is "
                                 "granted); call enable_peer_access again to complete it");
  }
  granted.push_back(peer);
}

void Allocator::Impl::enable_context_peer_for_imports(int peer) {
  try {
    (void)driver->enable_context_peer(peer);
  } catch (const driver_error& e) {
    // The driver's way out (backend:expandable) does not apply: this allocator is expandable; the
    // split_merge exporter's memory is what needs the context peers.
    constexpr int kTooManyPeers = 711;  // CUDA_ERROR_TOO_MANY_PEERS
    if (e.code() != kTooManyPeers || config.backend == BackendKind::split_merge) throw;
    throw driver_error(e.call(), e.code(), e.code_name(),
                       "device " + std::to_string(peer) + " cannot get peer access to device " +
                           std::to_string(driver->device()) + "'s context, which CUDA allows for at most 8 peers of a "
                           "device: this expandable allocator needs it only for memory it imported from a split_merge "
                           "exporter (cuda_ipc handles, opened with cuIpcOpenMemHandle). An exporter with "
                           "backend:expandable and ipc_handle:posix_fd (or ipc_handle:fabric) hands out memory that "
                           "any number of peers reach without it");
  }
}

void Allocator::validate() const {
  std::lock_guard<core::Mutex> lock(impl_->mu);
  const Impl& m = *impl_;
  m.backend->validate();
  auto fail = [](const std::string& what) { throw error("frontend invariant broken: " + what); };
  m.live.for_each([&](const Block* b) {
    if (b->status != BlockStatus::allocated) fail("live map holds a block that is not allocated");
    if (m.live.find(b->addr) != b) fail("live map does not find a block by its address");
  });
  if (static_cast<std::int64_t>(m.live.size()) != m.stats.allocation[kAllPools].current)
    fail("live map size differs from allocation.all.current");
  std::size_t queued = 0;
  std::size_t busy = 0;
  std::unordered_map<const Block*, std::uint32_t> events_of;  // queue entries per pending block
  for (const auto& [s, se] : m.pending) {
    queued += se.queue.size();
    busy += se.queue.empty() ? 0 : 1;
    se.queue.for_each([&](const Impl::PendingFree& pf) {
      if (pf.block->status != BlockStatus::pending_free || pf.block->pending_events == 0) fail("pending queue holds a block not pending");
      events_of[pf.block] += 1;
    });
  }
  if (queued != m.pending_count) fail("pending_count is wrong");
  // A block's count of events still to complete is its entries in the queues: one more, and it is
  // never freed; one less, and it is freed while a stream may still use it.
  for (const auto& [b, n] : events_of)
    if (b->pending_events != n) fail("a pending block's pending_events differs from its entries in the queues");
  // Frees held during a capture: pending for the caller, no event yet, out of the live map.
  for (const Block* b : m.frees_after_capture)
    if (b->status != BlockStatus::pending_free || events_of.contains(b) || m.live.find(b->addr) == b)
      fail("a free held during a capture is not pending, has events, or is still live");
  // recorded_uses: the streams recorded on live blocks and held frees, each block counted once.
  std::unordered_map<stream_t, std::size_t> uses;
  auto count_uses = [&](const Block* b) {
    for (stream_t s : b->stream_uses) uses[s] += 1;
  };
  m.live.for_each(count_uses);
  std::for_each(m.frees_after_capture.begin(), m.frees_after_capture.end(), count_uses);
  for (const auto& [s, n] : m.recorded_uses)
    if (n != 0 && (!uses.contains(s) || uses.at(s) != n)) fail("recorded_uses differs from the streams recorded on live blocks and held frees");
  for (const auto& [s, n] : uses)
    if (!m.recorded_uses.contains(s) || m.recorded_uses.at(s) != n) fail("recorded_uses misses streams recorded on live blocks or held frees");
  // pool_keys' counts: the live blocks that carry each key; released keys kept while carried or
  // queued; unheld_keys the queued ones, with room for every released key.
  std::unordered_map<stream_t, std::size_t> carried;
  m.live.for_each([&](const Block* b) {
    if (backends::is_graph_pool_key(b->stream)) carried[b->stream] += 1;
  });
  std::size_t released = 0;
  std::unordered_map<std::uint64_t, std::size_t> released_per_pool;
  for (const auto& [key, k] : m.pool_keys) {
    if (k.live != (carried.contains(key) ? carried.at(key) : 0)) fail("a graph pool key's live count differs from the live blocks that carry it");
    if (!m.graph_pools.contains(k.pool)) fail("a graph pool key of no listed pool");
    if (k.released) {
      released += 1;
      released_per_pool[k.pool] += 1;
      if (k.live == 0 && !k.queued) fail("a released key no live block carries is neither dropped nor queued");
    }
    if (k.queued && (!k.released || std::count(m.unheld_keys.begin(), m.unheld_keys.end(), key) != 1))
      fail("a queued graph pool key is not on unheld_keys once");
  }
  std::size_t pool_blocks = 0;
  for (const auto& [key, k] : m.pool_keys) pool_blocks += k.live;
  if (pool_blocks != m.pool_live_blocks) fail("pool_live_blocks is not the sum of the keys' live counts");
  if (released != m.released_key_count || m.unheld_keys.capacity() < released) fail("released_key_count is wrong, or unheld_keys lacks room");
  for (const stream_t key : m.unheld_keys)
    if (!m.pool_keys.contains(key) || !m.pool_keys.at(key).queued) fail("unheld_keys holds a key not queued");
  std::size_t current_keys = 0;
  for (const auto& [id, p] : m.graph_pools) {
    if (p.released_keys != (released_per_pool.contains(id) ? released_per_pool.at(id) : 0)) fail("a graph pool's released_keys is wrong");
    if (p.uses == 0 && p.released_keys == 0) fail("a graph pool at no use without released keys is still listed");
    // Its current keys: in pool_keys under it, not released (a key missing there is never retired,
    // its memory never given back); none once its uses are released.
    if (p.uses == 0 && !p.keys.empty()) fail("a graph pool at no use keeps current keys");
    for (const auto& [stream, key] : p.keys) {
      const auto k = m.pool_keys.find(key);
      if (k == m.pool_keys.end() || k->second.pool != id || k->second.released) fail("a graph pool's key is not a current key of it in pool_keys");
    }
    current_keys += p.keys.size();
  }
  if (current_keys + released != m.pool_keys.size()) fail("pool_keys holds a key that is neither a pool's current key nor released");
  // Routing: captures allocate into pools iff ctx.capturing; each route's key is its pool's.
  if (m.ctx.capturing != !m.capture_routes.empty()) fail("ctx.capturing disagrees with the capture routes");
  for (const Impl::CaptureRoute& r : m.capture_routes) {
    const auto k = m.pool_keys.find(r.key);
    if (k == m.pool_keys.end() || k->second.pool != r.pool || k->second.released) fail("a capture route's key is not a current key of its pool");
  }
  if (busy != m.busy_queues.size() ||
      std::any_of(m.busy_queues.begin(), m.busy_queues.end(), [](const Impl::StreamEvents* se) { return se->queue.empty(); }))
    fail("busy_queues is not the queues that hold frees");
  const Stats& s = m.stats;
  if (s.allocated_bytes[kAllPools].current > s.active_bytes[kAllPools].current) fail("allocated_bytes > active_bytes");
  if (s.active_bytes[kAllPools].current > s.reserved_bytes[kAllPools].current) fail("active_bytes > reserved_bytes");
  for (int p = 0; p < kStatPools; ++p)
    if (s.allocated_bytes[p].peak < s.allocated_bytes[p].current || s.reserved_bytes[p].peak < s.reserved_bytes[p].current)
      fail("a peak is below its current value");
}

Config Allocator::config() const {
  std::lock_guard<core::Mutex> lock(impl_->mu);  // set_limit writes its limit
  return impl_->config;
}
BackendKind Allocator::backend() const noexcept { return impl_->config.backend; }
int Allocator::device() const noexcept { return impl_->driver->device(); }

DeviceInfo Allocator::device_info() const {
  std::lock_guard<core::Mutex> lock(impl_->mu);
  DeviceInfo d;
  d.index = impl_->driver->device();
  d.kind = impl_->driver->kind();
  d.name = impl_->driver->device_name();
  const driver::MemInfo mi = impl_->driver->mem_info();
  d.total_bytes = mi.total;
  d.free_bytes = mi.free;
  d.granularity = impl_->driver->granularity();
  d.ipc_handle = static_cast<IpcHandle>(impl_->driver->shareable_handle_type());
  d.ipc_fallback_reason = impl_->driver->shareable_fallback_reason();
  d.gpu_direct_rdma = impl_->driver->gpu_direct_rdma();
  // The peers whose grant completed: after a re-grant failed halfway, the driver's list already
  // has the peer, but memory mapped before cannot be reached from it until a call completes.
  d.access_devices = {d.index};
  d.access_devices.insert(d.access_devices.end(), impl_->peers.begin(), impl_->peers.end());
  return d;
}

std::unique_ptr<Allocator> detail::AllocatorAccess::make(const Config& config, std::shared_ptr<driver::Driver> driver) {
  return std::unique_ptr<Allocator>(new Allocator(std::make_unique<Allocator::Impl>(config, std::move(driver))));
}

}  // namespace expseg
