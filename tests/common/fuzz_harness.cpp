// Model-based fuzzing harness (see fuzz_harness.hpp).
#include "fuzz_harness.hpp"

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <sstream>

#include "allocator_impl.hpp"
#include "driver/sim_driver.hpp"
#include "expseg/snapshot.hpp"
#include "expseg/stats.hpp"

namespace fuzz {

using expseg::BackendKind;
using expseg::kAllPools;
using expseg::Stats;
using expseg::driver::dev_ptr;
using expseg::driver::Fault;
using expseg::driver::Op;

namespace {

constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr std::size_t MiB = std::size_t{1} << 20;

std::uint64_t mix(std::uint64_t z) noexcept {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

std::string hex(std::uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%" PRIx64, v);
  return buf;
}

std::string stream_name(void* s) {
  std::string name(1, 's');  // appended piecewise: g++ 12 warns falsely (-Wrestrict) on "s" + std::string
  name += std::to_string(reinterpret_cast<std::uintptr_t>(s));
  return name;
}

bool contains(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

// The word offsets (in 8-byte words) of a block of `words` words that carry the pattern: all of a
// small block (up to 16 KiB); the first and last 2 KiB of a large one plus one word in every 4 KiB
// (blocks up to 4 MiB) or every half frame (`stride_words` is a frame; larger blocks), at an offset
// that varies with the tag. Every frame of a large block is sampled, so a frame mapped at the wrong
// place or lost shows up: the windows start at the block's start, not at a frame's, and a frame
// (at least two windows long) holds one of them whole wherever it begins. (Windows of a whole
// frame left 14-16% of the frames without a sample.)
// Writes and the check at free use the full set; periodic checks of every live block a light
// subset (every 7th word of a small block; 128 bytes at each end of a large one, and the same
// samples in between), which still covers every 4 KiB and every frame.
template <class F>
void for_each_sample(std::size_t words, std::uint64_t tag, std::size_t stride_words, F&& f, bool light = false) {
  if (words <= 2048) {
    const std::size_t step = light ? 7 : 1;  // light: every 7th word of a small block
    for (std::size_t i = 0; i < words; i += step) f(i);
    if (step != 1 && words != 0 && (words - 1) % step != 0) f(words - 1);
    return;
  }
  const std::size_t edge = light ? 16 : 256;
  for (std::size_t i = 0; i < edge; ++i) f(i);
  // The same grid for writes and both kinds of checks: light samples are a subset of the written.
  const std::size_t stride = words * 8 <= 4 * MiB ? 512 : std::max<std::size_t>(stride_words / 2, 512);
  for (std::size_t c = 256; c < words - 256; c += stride) {
    const std::size_t i = c + mix(tag ^ c) % stride;
    if (i < words - 256) f(i);
  }
  for (std::size_t i = words - edge; i < words; ++i) f(i);
}

std::uint64_t pattern_word(std::uint64_t tag, std::size_t i) noexcept { return mix(tag * 0x9E3779B97F4A7C15ULL + i); }

// A segment cached for a graph pool that is not released: its graphs' replays use it, so it stays.
bool of_live_graph_pool(std::uint64_t stream) noexcept {
  return expseg::backends::is_live_graph_pool_key(reinterpret_cast<expseg::driver::stream_t>(static_cast<std::uintptr_t>(stream)));
}

// expandable: a mapped run that no allocated or pending block touches holds only idle handles, which
// release_cached gives back (and set_limit, while over the limit). Outside live graph pools, whose
// memory stays with the graph. Empty when there is none.
std::string idle_mapped_run(const expseg::Snapshot& snap) {
  for (const auto& seg : snap.segments) {
    if (of_live_graph_pool(seg.stream)) continue;
    for (const auto& run : seg.mapped_ranges) {
      bool used = false;
      for (const auto& b : seg.blocks)
        if (b.state != expseg::BlockState::free_mapped && b.state != expseg::BlockState::free_unmapped && b.address < run.address + run.size &&
            run.address < b.address + b.size)
          used = true;
      if (!used) return "the idle mapped run " + hex(run.address) + "+" + std::to_string(run.size) + " of segment " + hex(seg.address);
    }
  }
  return {};
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Sources.

std::uint64_t RngSource::next64() {
  std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ULL);
  return mix(z);
}

std::uint64_t ByteSource::next64() {
  // Two bytes per decision keep fuzzer inputs short and mutations local; spread over 64 bits so
  // that `below(n)` for small n still sees every value.
  const std::uint8_t b = byte();
  const std::uint8_t c = byte();
  return (static_cast<std::uint64_t>(b) << 8 | c) * 0x0001000100010001ULL ^ (static_cast<std::uint64_t>(c) << 56);
}

// ---------------------------------------------------------------------------------------------
// Options.

std::string Options::describe() const {
  std::ostringstream os;
  os << "backend:" << expseg::to_string(backend) << ",policy:" << expseg::to_string(policy) << ",capacity:" << capacity
     << ",granularity:" << granularity;
  if (!extra_config.empty()) os << "," << extra_config;
  os << " (faults " << (faults ? (multi_faults ? "on, several at once" : "on") : "off") << ", streams " << streams << ", max_live " << max_live
     << (graphs ? ", graph captures" : "") << ")";
  return os.str();
}

namespace {
struct Preset {
  BackendKind backend;
  expseg::PoolPolicy policy;
  const char* extra;
};
const Preset kPresets[] = {
    {BackendKind::split_merge, expseg::PoolPolicy::pytorch, ""},
    {BackendKind::split_merge, expseg::PoolPolicy::pytorch, "limit:160MiB,max_split_size_mb:24,garbage_collection_threshold:0.7"},
    {BackendKind::split_merge, expseg::PoolPolicy::pytorch, "limit:200MiB,roundup_power2_divisions:4"},
    {BackendKind::split_merge, expseg::PoolPolicy::cupy, "limit:192MiB"},
    {BackendKind::expandable, expseg::PoolPolicy::pytorch, ""},
    {BackendKind::expandable, expseg::PoolPolicy::pytorch, "limit:160MiB"},
    {BackendKind::expandable, expseg::PoolPolicy::pytorch, "expandable_va_size:32MiB,expandable_max_handle:2MiB"},
    {BackendKind::expandable, expseg::PoolPolicy::pytorch, "limit:96MiB,expandable_max_handle:4MiB,oom_counterfactual:false"},
};
}  // namespace

std::size_t preset_count() { return std::size(kPresets); }

Options preset(std::size_t index) {
  const Preset& p = kPresets[index % std::size(kPresets)];
  Options o;
  o.backend = p.backend;
  o.policy = p.policy;
  o.extra_config = p.extra;
  return o;
}

Options options_from(ByteSource& src) {
  Options o = preset(src.byte());
  // Smaller devices keep each fuzzer execution short and reach the limits often.
  static constexpr std::size_t kCapacities[] = {32 * MiB, 64 * MiB, 128 * MiB, 256 * MiB};
  o.capacity = kCapacities[src.byte() % 4];
  const std::uint8_t g = src.byte();
  o.granularity = (g % 4 == 0) ? 2 * MiB : 64 * KiB;
  o.graphs = (g & 4) != 0;  // a bit of the same byte: inputs without graphs decode as before
  // Preset limits are sized for 256 MiB; on a smaller device they would exceed it (which is valid,
  // but then never binds), so scale them by dropping the preset limit and drawing one.
  std::string extra;
  std::istringstream items(o.extra_config);
  for (std::string item; std::getline(items, item, ',');) {
    if (item.rfind("limit:", 0) == 0 || item.rfind("expandable_va_size:", 0) == 0) continue;
    if (!extra.empty()) extra += ',';
    extra += item;
  }
  const std::uint8_t l = src.byte();
  if (l % 2) {
    if (!extra.empty()) extra += ',';
    extra += "limit:" + std::to_string(o.capacity / 8 * (1 + l / 2 % 8));
  }
  if (o.backend == BackendKind::expandable && src.byte() % 3 == 0) {
    if (!extra.empty()) extra += ',';
    extra += "expandable_va_size:" + std::to_string(o.capacity / 8);
  }
  o.extra_config = extra;
  o.max_live = 64;
  o.full_check_every = 16;
  return o;
}

void Counters::add(const Counters& o) {
  ops += o.ops;
  allocs += o.allocs;
  frees += o.frees;
  pending_frees += o.pending_frees;
  ooms += o.ooms;
  fragmentation_ooms += o.fragmentation_ooms;
  driver_errors += o.driver_errors;
  faults_armed += o.faults_armed;
  faults_fired += o.faults_fired;
  faults_absorbed += o.faults_absorbed;
  invalid_pointer_checks += o.invalid_pointer_checks;
  release_cached += o.release_cached;
  streams_released += o.streams_released;
  streams_refused += o.streams_refused;
  limit_changes += o.limit_changes;
  full_checks += o.full_checks;
  bytes_checked += o.bytes_checked;
  unmaps += o.unmaps;
  busy_uses += o.busy_uses;
  captures += o.captures;
  capture_allocs += o.capture_allocs;
  forks += o.forks;
  fork_allocs += o.fork_allocs;
  warmup_allocs += o.warmup_allocs;
  restores += o.restores;
  launches += o.launches;
  refused_in_capture += o.refused_in_capture;
  digest = (digest ^ o.digest) * 0x100000001b3ULL;
}

std::string Counters::to_string() const {
  std::ostringstream os;
  os << ops << " ops: " << allocs << " allocations, " << frees << " frees (" << pending_frees << " cross-stream), " << ooms
     << " OOMs (" << fragmentation_ooms << " fragmentation), " << faults_armed << " faults armed, " << faults_fired
     << " fired (" << driver_errors << " reached the caller, " << faults_absorbed << " absorbed), " << invalid_pointer_checks
     << " bad pointers, " << release_cached << " release_cached, " << streams_released << " streams released ("
     << streams_refused << " refused), " << limit_changes << " limit changes, " << unmaps
     << " unmaps/cuMemFree, " << busy_uses << " uses by busy streams, " << captures << " graph captures (" << capture_allocs
     << " allocations, " << forks << " forks, "
     << fork_allocs << " allocations on forks, " << warmup_allocs << " warm-up allocations, " << restores
     << " restores, " << launches
     << " launches, " << refused_in_capture << " refused calls), " << full_checks << " full checks, " << bytes_checked << " pattern bytes checked, digest "
     << hex(digest);
  return os.str();
}

// ---------------------------------------------------------------------------------------------
// The spy driver: forwards to the SimDriver and tells the harness what the allocator asked of the
// device -- event queries and syncs (what the allocator knows to be complete), unmaps and frees
// (checked against the live set), and every failure (injected, or a broken CUDA rule).

class Spy final : public expseg::driver::Driver {
 public:
  Spy(std::shared_ptr<expseg::driver::SimDriver> sim, Harness* h) : sim_(std::move(sim)), h_(h) {}
  void detach() noexcept { h_ = nullptr; }

  const char* kind() const noexcept override { return sim_->kind(); }
  int device() const noexcept override { return sim_->device(); }
  std::string device_name() const override { return sim_->device_name(); }
  std::size_t granularity() const noexcept override { return sim_->granularity(); }
  expseg::driver::MemInfo mem_info() override { return sim_->mem_info(); }
  expseg::driver::CallStats call_stats() const override { return sim_->call_stats(); }

  dev_ptr reserve(std::size_t bytes) override {
    return call([&] { return sim_->reserve(bytes); });
  }
  void free_reserve(dev_ptr base, std::size_t bytes) override {
    call([&] { sim_->free_reserve(base, bytes); });
  }
  expseg::driver::phys_handle create(std::size_t bytes) override {
    return call([&] { return sim_->create(bytes); });
  }
  void release(expseg::driver::phys_handle handle) override {
    call([&] { sim_->release(handle); });
  }
  void map(dev_ptr ptr, std::size_t bytes, expseg::driver::phys_handle handle) override {
    call([&] { sim_->map(ptr, bytes, handle); });
  }
  void unmap(dev_ptr ptr, std::size_t bytes) override {
    call([&] { sim_->unmap(ptr, bytes); });
    if (h_) h_->spy_unmap("cuMemUnmap", ptr, bytes, true);
  }
  void set_access(dev_ptr ptr, std::size_t bytes) override {
    call([&] { sim_->set_access(ptr, bytes); });
  }
  dev_ptr mem_alloc(std::size_t bytes) override {
    const dev_ptr p = call([&] { return sim_->mem_alloc(bytes); });
    allocs_[p] = bytes;
    return p;
  }
  void mem_free(dev_ptr ptr) override {
    call([&] { sim_->mem_free(ptr); });
    auto it = allocs_.find(ptr);
    if (it != allocs_.end()) {
      // cuMemFree synchronizes the device (CUDA waits for all work before freeing), so only the
      // live set and pending frees are checked, not the streams; afterwards everything queued so
      // far is complete.
      if (h_) h_->spy_unmap("cuMemFree", ptr, it->second, false);
      allocs_.erase(it);
    }
    if (h_) all_complete_ = h_->tick_;
  }
  expseg::driver::stream_t stream_create() override { return sim_->stream_create(); }
  expseg::driver::stream_t stream_create_blocking() override { return sim_->stream_create_blocking(); }
  bool stream_is_blocking(expseg::driver::stream_t stream) override { return query([&] { return sim_->stream_is_blocking(stream); }); }
  void stream_destroy(expseg::driver::stream_t stream) override { sim_->stream_destroy(stream); }
  expseg::driver::event_t event_create() override { return sim_->event_create(); }
  void event_destroy(expseg::driver::event_t event) override {
    events_.erase(event);
    sim_->event_destroy(event);
  }
  void event_record(expseg::driver::event_t event, expseg::driver::stream_t stream) override {
    call([&] { sim_->event_record(event, stream); });
    if (h_) events_[event] = Recorded{stream, h_->tick_};
  }
  bool event_query(expseg::driver::event_t event) override {
    const bool done = call([&] { return sim_->event_query(event); });
    if (done) completed(event);
    return done;
  }
  void event_synchronize(expseg::driver::event_t event) override {
    call([&] { sim_->event_synchronize(event); });
    completed(event);
  }
  void stream_synchronize(expseg::driver::stream_t stream) override {
    call([&] { sim_->stream_synchronize(stream); });
    if (h_) {
      auto& c = h_->complete_upto_[stream];
      c = std::max(c, h_->tick_);
    }
  }
  void device_synchronize() override {
    call([&] { sim_->device_synchronize(); });
    if (h_) all_complete_ = h_->tick_;
  }
  void memset_d32(dev_ptr ptr, std::uint32_t value, std::size_t count, expseg::driver::stream_t stream) override {
    sim_->memset_d32(ptr, value, count, stream);
  }
  std::uint64_t stream_capture_id(expseg::driver::stream_t stream) override { return query([&] { return sim_->stream_capture_id(stream); }); }
  void capture_begin(expseg::driver::stream_t stream, CaptureMode mode = CaptureMode::global) override { sim_->capture_begin(stream, mode); }
  expseg::driver::graph_t capture_end(expseg::driver::stream_t stream) override { return sim_->capture_end(stream); }
  void graph_launch(expseg::driver::graph_t graph, expseg::driver::stream_t stream) override { sim_->graph_launch(graph, stream); }
  void graph_destroy(expseg::driver::graph_t graph) override { sim_->graph_destroy(graph); }
  void copy_to_host(void* dst, dev_ptr src, std::size_t bytes) override { sim_->copy_to_host(dst, src, bytes); }
  void copy_from_host(dev_ptr dst, const void* src, std::size_t bytes) override { sim_->copy_from_host(dst, src, bytes); }
  int device_count() override { return sim_->device_count(); }
  bool can_access_peer(int peer) override { return sim_->can_access_peer(peer); }
  bool add_access_device(int peer) override { return sim_->add_access_device(peer); }
  bool enable_context_peer(int peer) override { return sim_->enable_context_peer(peer); }
  std::vector<int> context_peers() const override { return sim_->context_peers(); }
  std::vector<int> access_devices() const override { return sim_->access_devices(); }
  expseg::driver::ShareableHandle shareable_handle_type() const noexcept override { return sim_->shareable_handle_type(); }
  expseg::driver::ExportedHandle export_handle(expseg::driver::phys_handle handle) override { return sim_->export_handle(handle); }
  expseg::driver::phys_handle import_handle(const expseg::driver::ExportedHandle& e) override { return sim_->import_handle(e); }
  expseg::driver::ExportedHandle ipc_export(dev_ptr p) override { return sim_->ipc_export(p); }
  dev_ptr ipc_open(const expseg::driver::ExportedHandle& e) override { return sim_->ipc_open(e); }
  void ipc_close(dev_ptr p) override { sim_->ipc_close(p); }
  std::pair<dev_ptr, std::size_t> address_range(dev_ptr p) override { return sim_->address_range(p); }

  std::uint64_t all_complete() const noexcept { return all_complete_; }

 private:
  struct Recorded {
    expseg::driver::stream_t stream = nullptr;
    std::uint64_t tick = 0;
  };

  template <class F>
  auto call(F&& f) -> decltype(f()) {
    if (h_) ++h_->tick_;
    try {
      return f();
    } catch (const expseg::driver_error& e) {
      if (h_) {
        const std::string what = e.what();
        if (h_->options_.verbose) std::fprintf(stderr, "    driver: %s\n", what.c_str());
        if (contains(what, "fault injected by the simulated device")) {
          h_->driver_threw_ = true;
        } else if (!e.is_out_of_memory()) {
          // The simulated device reports a broken CUDA rule (map over a mapping, unmap of part of
          // a mapping, free of a reservation still mapped, a call a stream capture refuses, ...):
          // always an allocator bug.
          h_->spy_error(std::string(contains(what, "STREAM_CAPTURE") ? "the allocator invalidated a graph capture: "
                                                                       : "the allocator broke a CUDA rule: ") + what);
        }
      }
      throw;
    }
  }
  // A stream query: its errors are answers the allocator reads (906: a blocking stream captures), so
  // only an injected fault is noted.
  template <class F>
  auto query(F&& f) -> decltype(f()) {
    try {
      return f();
    } catch (const expseg::driver_error& e) {
      if (h_ && contains(e.what(), "fault injected by the simulated device")) h_->driver_threw_ = true;
      throw;
    }
  }
  void completed(expseg::driver::event_t event) {
    if (!h_) return;
    auto it = events_.find(event);
    if (it == events_.end()) return;
    auto& c = h_->complete_upto_[it->second.stream];
    c = std::max(c, it->second.tick);
  }

  std::shared_ptr<expseg::driver::SimDriver> sim_;
  Harness* h_;
  std::map<dev_ptr, std::size_t> allocs_;
  std::map<expseg::driver::event_t, Recorded> events_;
  std::uint64_t all_complete_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Harness.

Harness::Harness(const Options& options) : options_(options) {
  expseg::Config c = expseg::Config::parse(options.extra_config);
  c.backend = options.backend;
  c.policy = options.policy;
  c.device = expseg::DeviceKind::sim;
  c.sim_capacity = options.capacity;
  c.sim_granularity = options.granularity;
  c.sim_host_backed = true;
  expseg::driver::SimOptions so;
  so.capacity = options.capacity;
  so.granularity = options.granularity;
  so.host_backed = true;
  sim_ = std::make_shared<expseg::driver::SimDriver>(so);
  spy_ = std::make_shared<Spy>(sim_, this);
  alloc_ = expseg::detail::AllocatorAccess::make(c, spy_);
  limit_ = alloc_->limit();
  streams_.push_back(nullptr);
  for (unsigned i = 0; i < options.streams; ++i)  // with graphs, the last one blocks: captures on it forbid legacy work
    streams_.push_back(options.graphs && i + 1 == options.streams && i > 0 ? sim_->stream_create_blocking() : sim_->stream_create());
  for (void* s : streams_) busy_[s] = false;
}

Harness::~Harness() {
  spy_->detach();
  alloc_.reset();
  for (std::size_t i = 1; i < streams_.size(); ++i) {
    try {
      sim_->stream_destroy(streams_[i]);
    } catch (...) {
    }
  }
}

void Harness::note(const std::string& op) {
  op_text_.assign(1, '#');
  op_text_ += std::to_string(counters_.ops);
  op_text_ += ' ';
  op_text_ += op;
  if (options_.verbose) std::fprintf(stderr, "%s\n", op_text_.c_str());
  history_.push_back(op_text_);
  if (history_.size() > 40) history_.pop_front();
  mix(op_text_);
}

void Harness::mix(const std::string& text) {
  for (unsigned char c : text) counters_.digest = (counters_.digest ^ c) * 0x100000001b3ULL;
}

// What allocate returned, in the digest, the history and the verbose log: a replay can be compared
// with the failing run address by address.
void Harness::note_result(std::uint64_t addr) {
  const std::string result = " -> " + hex(addr);
  op_text_ += result;
  if (!history_.empty()) history_.back() = op_text_;
  if (options_.verbose) std::fprintf(stderr, "  %s\n", result.c_str());
  mix(result);
}

void Harness::fail(const std::string& what) {
  std::ostringstream os;
  os << "fuzz check failed at operation " << op_text_ << ": " << what << "\n  options: " << options_.describe()
     << "\n  recent operations (oldest first):";
  for (const std::string& h : history_) os << "\n    " << h;
  throw Failure(os.str());
}

void Harness::spy_error(const std::string& what) {
  if (spy_failure_.empty()) spy_failure_ = what;
}

bool Harness::known_complete(void* stream, std::uint64_t tick) const {
  if (spy_->all_complete() >= tick) return true;
  auto it = complete_upto_.find(stream);
  return it != complete_upto_.end() && it->second >= tick;
}

void Harness::spy_unmap(const char* call, std::uint64_t addr, std::size_t bytes, bool check_hazards) {
  const std::uint64_t end = addr + bytes;
  const std::string what = std::string(call) + " of " + hex(addr) + "+" + std::to_string(bytes);
  ++counters_.unmaps;
  auto it = live_.lower_bound(addr);
  if (it != live_.end() && it->first < end)
    spy_error(what + " takes memory of the live allocation " + hex(it->first) + "+" + std::to_string(it->second.size));
  if (it != live_.begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second.size > addr)
      spy_error(what + " takes memory of the live allocation " + hex(prev->first) + "+" + std::to_string(prev->second.size));
  }
  for (const auto& [a, p] : pending_) {
    if (a >= end || a + p.block.size <= addr) continue;
    for (void* s : p.busy)
      if (!known_complete(s, p.tick))
        spy_error(what + " takes memory of the pending free " + hex(a) + " while stream " + stream_name(s) + " may still use it");
  }
  for (auto h = hazards_.begin(); h != hazards_.end();) {
    const bool overlaps = h->first < end && h->first + h->second.size > addr;
    if (overlaps && check_hazards && !known_complete(h->second.stream, h->second.tick))
      spy_error(what + " takes memory freed at " + hex(h->first) + " on stream " + stream_name(h->second.stream) +
                " whose work is not known to be complete (no sync or completed event since)");
    // cuMemFree synchronizes the device: what it gives back is no hazard any more.
    if (overlaps && !check_hazards) h = hazards_.erase(h);
    else ++h;
  }
}

void Harness::on_driver_exception(const char* op, const std::exception& ex) {
  const auto* e = dynamic_cast<const expseg::driver_error*>(&ex);
  if (e == nullptr) fail(std::string(op) + " threw " + ex.what());
  if (!driver_threw_) fail(std::string(op) + " threw driver_error although no injected fault fired: " + e->what());
  if (e->call().rfind("cu", 0) != 0) fail(std::string(op) + ": driver_error does not name a cu* call: " + e->what());
  if (!contains(e->what(), e->call().c_str())) fail(std::string(op) + ": driver_error message does not name the call: " + e->what());
  ++counters_.driver_errors;
}

std::size_t Harness::pick_size(Source& src) {
  const std::size_t cap = options_.capacity;
  const unsigned r = static_cast<unsigned>(src.below(1000));
  auto log_uniform = [&](double lo, double hi) {
    const double e = lo + (hi - lo) * src.unit();
    const auto v = static_cast<std::size_t>(std::exp2(e));
    return std::max<std::size_t>(v, 1);
  };
  const double log_cap = std::log2(static_cast<double>(cap));
  if (r < 540) return log_uniform(0, 13);            // up to 8 KiB
  if (r < 800) return log_uniform(13, 20);           // up to 1 MiB
  if (r < 920) return log_uniform(20, 24);           // up to 16 MiB
  if (r < 965) return log_uniform(24, log_cap);      // up to the device
  if (r < 975) return log_uniform(log_cap, log_cap + 2);  // more than the device
  if (r < 990) {
    // Edges of the size classes and of the device.
    const std::size_t g = options_.granularity;
    const std::size_t edges[] = {511, 512, 513, 1 * MiB - 1, 1 * MiB, 1 * MiB + 1, 10 * MiB - 1, 10 * MiB, 10 * MiB + 1,
                                 g - 1, g, g + 1, 2 * MiB, 20 * MiB, limit_ ? limit_ : cap / 2, limit_ + 1, cap - g, cap};
    return edges[src.below(std::size(edges))];
  }
  const std::size_t absurd[] = {0, 0, SIZE_MAX, SIZE_MAX - 1, SIZE_MAX - 511, SIZE_MAX / 2, SIZE_MAX / 2 + 1,
                                std::size_t{1} << 60, (std::size_t{1} << 60) + 1, std::size_t{1} << 62, std::size_t{1} << 63, cap + 1};
  return absurd[src.below(std::size(absurd))];
}

void* Harness::pick_stream(Source& src) {
  // The default stream half of the time: most work is there.
  if (src.chance(50)) return nullptr;
  return streams_[src.below(streams_.size())];
}

void Harness::check_pattern(const Live& l, const char* when, bool light) {
  if (l.size == 0) return;
  if (!sim_->is_accessible(l.addr, l.size))
    fail("allocation " + hex(l.addr) + "+" + std::to_string(l.size) + " is not mapped and accessible " + when);
  if (l.pool != 0) {
    check_pool_value(l, when);
    return;
  }
  auto* words = reinterpret_cast<const std::uint64_t*>(static_cast<std::uintptr_t>(l.addr));
  const std::size_t n = l.size / 8;
  const std::size_t stride = options_.granularity / 8;
  std::size_t bad = SIZE_MAX;
  std::uint64_t checked = 0;
  for_each_sample(
      n, l.tag, stride,
      [&](std::size_t i) {
        ++checked;
        if (bad == SIZE_MAX && words[i] != pattern_word(l.tag, i)) bad = i;
      },
      light);
  const auto* bytes = reinterpret_cast<const unsigned char*>(words);
  const std::uint64_t tail = pattern_word(l.tag, ~std::uint64_t{0});
  for (std::size_t b = n * 8; b < l.size; ++b)
    if (bytes[b] != static_cast<unsigned char>(tail >> (8 * (b % 8))) && bad == SIZE_MAX) bad = b / 8;
  counters_.bytes_checked += checked * 8;
  if (bad != SIZE_MAX) {
    // Say whose bytes are there, if another live block's pattern explains them.
    std::string whose;
    const std::uint64_t at = l.addr + bad * 8;
    for (const auto& [a, other] : live_)
      if (a != l.addr && at >= a && at < a + other.size) whose = " (lies inside live allocation " + hex(a) + ")";
    fail("pattern of allocation " + hex(l.addr) + "+" + std::to_string(l.size) + " (stream " + stream_name(l.stream) +
         ") is corrupt " + when + " at byte offset " + std::to_string(bad * 8) + ": found " + hex(words[bad]) + ", wrote " +
         hex(pattern_word(l.tag, bad)) + whose);
  }
}

// A block a capture allocated holds its captured memset's value once its graph launched, until a
// launch of another graph of its pool wrote over it (known is cleared then).
void Harness::check_pool_value(const Live& l, const char* when) {
  if (!l.known) return;
  auto* words = reinterpret_cast<const std::uint32_t*>(static_cast<std::uintptr_t>(l.addr));
  const std::size_t n = l.size / 4;
  std::uint64_t checked = 0;
  for (std::size_t i = 0; i < n; i = i < 64 || i + 64 >= n ? i + 1 : std::min(n - 64, i + 997)) {
    ++checked;
    if (words[i] != l.value) {
      std::string whose;
      const std::uint64_t at = l.addr + i * 4;
      for (const auto& [a, other] : live_)
        if (a != l.addr && at >= a && at < a + other.size) whose = " (lies inside live allocation " + hex(a) + ")";
      fail("graph " + std::to_string(l.graph) + "'s block " + hex(l.addr) + "+" + std::to_string(l.size) + " is corrupt " + when +
           " at byte offset " + std::to_string(i * 4) + ": found " + hex(words[i]) + ", its launch wrote " + hex(l.value) + whose);
    }
  }
  counters_.bytes_checked += checked * 4;
}

void Harness::write_pattern(const Live& l) {
  auto* words = reinterpret_cast<std::uint64_t*>(static_cast<std::uintptr_t>(l.addr));
  const std::size_t n = l.size / 8;
  for_each_sample(n, l.tag, options_.granularity / 8, [&](std::size_t i) { words[i] = pattern_word(l.tag, i); });
  auto* bytes = reinterpret_cast<unsigned char*>(words);
  const std::uint64_t tail = pattern_word(l.tag, ~std::uint64_t{0});
  for (std::size_t b = n * 8; b < l.size; ++b) bytes[b] = static_cast<unsigned char>(tail >> (8 * (b % 8)));
}

// A block the allocator just handed out must not overlap a live one, may take a pending free's
// memory only once the streams that used it are known complete, and memory freed on a busy stream
// goes to another stream only once that stream's work is known complete.
void Harness::check_new_block(std::uint64_t addr, std::size_t size, void* stream) {
  const std::uint64_t end = addr + size;
  auto it = live_.lower_bound(addr);
  if (it != live_.end() && it->first < end)
    fail("new block " + hex(addr) + "+" + std::to_string(size) + " overlaps live allocation " + hex(it->first) + "+" +
         std::to_string(it->second.size));
  if (it != live_.begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second.size > addr)
      fail("new block " + hex(addr) + "+" + std::to_string(size) + " overlaps live allocation " + hex(prev->first) + "+" +
           std::to_string(prev->second.size));
  }
  for (auto p = pending_.begin(); p != pending_.end();) {
    const Pending& pd = p->second;
    if (pd.block.addr >= end || pd.block.addr + pd.block.size <= addr) {
      ++p;
      continue;
    }
    for (void* s : pd.busy)
      if (!known_complete(s, pd.tick))
        fail("new block " + hex(addr) + "+" + std::to_string(size) + " on stream " + stream_name(stream) +
             " reuses the pending free " + hex(pd.block.addr) + " while stream " + stream_name(s) +
             " (record_stream) may still use it");
    if (pd.stream_busy && pd.block.stream != stream && !known_complete(pd.block.stream, pd.tick))
      fail("new block on stream " + stream_name(stream) + " reuses memory freed on busy stream " + stream_name(pd.block.stream));
    p = pending_.erase(p);
  }
  for (const auto& [a, hz] : hazards_) {
    if (a >= end || a + hz.size <= addr || hz.stream == stream) continue;
    if (!known_complete(hz.stream, hz.tick))
      fail("new block " + hex(addr) + "+" + std::to_string(size) + " on stream " + stream_name(stream) +
           " reuses memory freed at " + hex(a) + " on stream " + stream_name(hz.stream) +
           " while that stream was busy, with no sync or completed event since");
  }
}

void Harness::prune_hazards() {
  for (auto it = hazards_.begin(); it != hazards_.end();) {
    if (known_complete(it->second.stream, it->second.tick)) it = hazards_.erase(it);
    else ++it;
  }
}

// Pending frees the allocator has completed since the last look: each must have waited for the
// streams recorded on it.
void Harness::resolve_pending() {
  if (pending_.empty()) return;
  const expseg::Snapshot snap = alloc_->snapshot();
  std::map<std::uint64_t, std::size_t> still;  // address -> size of pending_free blocks
  for (const auto& seg : snap.segments)
    for (const auto& b : seg.blocks)
      if (b.state == expseg::BlockState::pending_free) still[b.address] = b.size;
  for (auto it = pending_.begin(); it != pending_.end();) {
    const Pending& p = it->second;
    auto s = still.find(p.block.addr);
    if (s != still.end()) {
      if (s->second < p.block.size) fail("pending free " + hex(p.block.addr) + " shrank in the snapshot");
      ++it;
      continue;
    }
    for (void* st : p.busy)
      if (!known_complete(st, p.tick))
        fail("pending free " + hex(p.block.addr) + " was completed while stream " + stream_name(st) +
             " (record_stream) was busy and neither synchronized nor queried complete");
    if (p.stream_busy) hazards_.emplace(p.block.addr, Hazard{p.block.size, p.block.stream, p.tick});
    it = pending_.erase(it);
  }
  if (still.size() != pending_.size())
    fail("snapshot holds " + std::to_string(still.size()) + " pending frees, the model " + std::to_string(pending_.size()));
}

void Harness::check_stats() {
  const Stats s = alloc_->stats();
  const auto live = sim_->live();
  auto require = [&](bool ok, const std::string& what) {
    if (!ok) fail("stats: " + what);
  };
  const std::int64_t allocated = s.allocated_bytes[kAllPools].current;
  const std::int64_t active = s.active_bytes[kAllPools].current;
  const std::int64_t reserved = s.reserved_bytes[kAllPools].current;
  require(s.allocation[kAllPools].current == static_cast<std::int64_t>(live_.size()),
          "allocation.all.current " + std::to_string(s.allocation[kAllPools].current) + " != " + std::to_string(live_.size()) +
              " live allocations in the model");
  // A pending free still counts its request until its streams are done, as in PyTorch (after_op
  // has brought pending_ up to date).
  std::size_t pending_requested = 0;
  for (const auto& [addr, p] : pending_) pending_requested += p.block.size;
  require(s.requested_bytes[kAllPools].current == static_cast<std::int64_t>(live_requested_ + pending_requested),
          "requested_bytes.all.current " + std::to_string(s.requested_bytes[kAllPools].current) + " != model " +
              std::to_string(live_requested_) + " live + " + std::to_string(pending_requested) + " pending");
  require(allocated >= static_cast<std::int64_t>(live_requested_), "allocated_bytes below the requested bytes");
  require(allocated <= active, "allocated_bytes > active_bytes");
  require(active <= reserved, "active_bytes > reserved_bytes");
  require(reserved >= 0 && static_cast<std::size_t>(reserved) <= options_.capacity, "reserved_bytes outside [0, capacity]");
  require(static_cast<std::size_t>(reserved) == live.physical_bytes,
          "reserved_bytes " + std::to_string(reserved) + " != the device's physical bytes in use " + std::to_string(live.physical_bytes));
  if (options_.backend == BackendKind::expandable) {
    require(s.physical_handles.current == static_cast<std::int64_t>(live.handles), "physical_handles != the device's live handles");
    require(live.mem_allocs == 0, "expandable made cuMemAlloc allocations");
  } else {
    require(s.physical_handles.current == static_cast<std::int64_t>(live.mem_allocs), "physical_handles != the device's cuMemAlloc allocations");
    require(live.handles == 0 && live.mappings == 0 && live.reservations == 0, "split_merge holds VMM resources");
  }
  require(s.num_ooms == ooms_seen_, "num_ooms " + std::to_string(s.num_ooms) + " != OOMs the caller saw " + std::to_string(ooms_seen_));
  if (limit_ != 0 && reserved > reserved_before_)
    require(static_cast<std::size_t>(reserved) <= limit_,
            "reserved_bytes grew to " + std::to_string(reserved) + ", above the limit " + std::to_string(limit_));
  require(s.total_bytes() == s.used_bytes() + s.free_bytes() && s.free_bytes() >= 0, "CuPy total != used + free");
  require(s.n_free_blocks() >= 0, "n_free_blocks < 0");
#define EXPSEG_FUZZ_CHECK_STAT(name, help)                                                                           \
  for (int p = 0; p < expseg::kStatPools; ++p) {                                                                      \
    const expseg::Stat& st = s.name[p];                                                                               \
    require(st.current >= 0 && st.peak >= st.current && st.allocated - st.freed == st.current - accumulated_base_.name[p].current, \
            std::string(#name ".") + expseg::stat_pool_name(p) + " is inconsistent (current " + std::to_string(st.current) + \
                ", peak " + std::to_string(st.peak) + ", allocated " + std::to_string(st.allocated) + ", freed " +       \
                std::to_string(st.freed) + ")");                                                                      \
  }                                                                                                                   \
  require(s.name[kAllPools].current == s.name[expseg::kSmallPool].current + s.name[expseg::kLargePool].current,         \
          std::string(#name) + ": all != small + large");
  EXPSEG_POOL_STATS(EXPSEG_FUZZ_CHECK_STAT)
#undef EXPSEG_FUZZ_CHECK_STAT
  reserved_before_ = reserved;
}

void Harness::full_check() {
  ++counters_.full_checks;
  for (const auto& [a, l] : live_) check_pattern(l, "in a periodic check", true);
  // Pending frees may still be read by the streams recorded on them: their bytes must not change.
  for (const auto& [a, p] : pending_) check_pattern(p.block, "while its free is pending", true);
  const expseg::Snapshot snap = alloc_->snapshot();
  std::size_t allocated_blocks = 0;
  std::size_t mapped = 0;
  for (const auto& seg : snap.segments) {
    mapped += seg.mapped_bytes;
    std::uint64_t expect = seg.address;
    for (const auto& b : seg.blocks) {
      if (b.address != expect) fail("snapshot: blocks of segment " + hex(seg.address) + " do not tile it at " + hex(expect));
      expect = b.address + b.size;
      if (b.state != expseg::BlockState::allocated) continue;
      ++allocated_blocks;
      auto it = live_.find(b.address);
      if (it == live_.end()) fail("snapshot: allocated block " + hex(b.address) + " is not live in the model");
      if (b.requested != it->second.size) fail("snapshot: requested size of " + hex(b.address) + " differs from the model");
      if (it->second.pool == 0 && b.stream != reinterpret_cast<std::uintptr_t>(it->second.stream))
        fail("snapshot: stream of " + hex(b.address) + " differs");
      if (b.size < it->second.size) fail("snapshot: block " + hex(b.address) + " is smaller than its request");
    }
    if (expect != seg.address + seg.size) fail("snapshot: blocks do not cover segment " + hex(seg.address));
  }
  if (allocated_blocks != live_.size())
    fail("snapshot holds " + std::to_string(allocated_blocks) + " allocated blocks, the model " + std::to_string(live_.size()));
  const auto reserved = static_cast<std::size_t>(snap.stats.reserved_bytes[kAllPools].current);
  if (options_.backend == BackendKind::split_merge ? mapped != reserved : mapped > reserved)
    fail("snapshot: mapped bytes of the segments " + std::to_string(mapped) + " disagree with reserved " + std::to_string(reserved));
  // The JSON forms must not throw.
  if (counters_.full_checks % 8 == 1) {
    (void)snap.to_json();
    (void)snap.stats.to_json();
  }
}

void Harness::after_op(const char* name) {
  (void)name;
  if (!spy_failure_.empty()) fail(spy_failure_);
  if (driver_threw_) ++counters_.faults_fired;
  resolve_pending();
  if (!hazards_.empty()) prune_hazards();
  if (hazards_.size() > 4096) fail("model: hazards grow without bound");
  if (options_.validate_every != 0 && counters_.ops % options_.validate_every == 0) {
    try {
      alloc_->validate();
    } catch (const std::exception& e) {
      fail(std::string("validate() failed: ") + e.what());
    }
  }
  check_stats();
  if (!captures_.empty() || !graphs_.empty()) check_graph_separation();
  if (!sim_->hazards().empty()) fail("the simulated device saw a hazard: " + sim_->hazards().front());
  if (options_.full_check_every != 0 && counters_.ops % options_.full_check_every == 0) full_check();
}

// No live or pending block outside a graph's pool lies in memory the graph's launches write (the
// capture underway included): the pool keeps that memory from everyone else while the graph lives.
void Harness::check_graph_separation() {
  auto check = [&](const Graph& g) {
    for (const auto& [a, n] : g.writes) {
      auto it = live_.lower_bound(a);
      if (it != live_.begin()) --it;
      for (; it != live_.end() && it->first < a + n; ++it)
        if (it->first + it->second.size > a && it->second.pool != g.pool)
          fail("live allocation " + hex(it->first) + "+" + std::to_string(it->second.size) +
               (it->second.pool ? " of another graph pool" : "") + " lies in memory graph " + std::to_string(g.id) +
               " (pool " + std::to_string(g.pool_id) + ") writes at " + hex(a) + "+" + std::to_string(n));
      for (const auto& [pa, p] : pending_)
        if (pa < a + n && pa + p.block.size > a && p.block.pool != g.pool)
          fail("pending free " + hex(pa) + " lies in memory graph " + std::to_string(g.id) + " writes at " + hex(a));
    }
  };
  for (const Graph& g : captures_) check(g);
  for (const Graph& g : graphs_) check(g);
}

// --- operations --------------------------------------------------------------------------------

void Harness::op_allocate(Source& src, bool on_capture) {
  const std::size_t size = pick_size(src);
  void* stream = nullptr;
  if (on_capture && !captures_.empty()) {
    const Graph& c = captures_[src.below(captures_.size())];
    const std::size_t branch = src.below(1 + c.forks.size());  // the capturing stream or a fork
    stream = branch == 0 ? c.stream : c.forks[branch - 1];
  } else {
    stream = pick_stream(src);
  }
  note("allocate " + std::to_string(size) + " on " + stream_name(stream));
  const std::int64_t allocations_before = alloc_->stats().allocation[kAllPools].allocated;
  // A failed allocate gives back whatever it reserved or mapped (a growth that fails midway), unless
  // an injected fault hit the cleanup itself (single faults: only after an OOM).
  const std::int64_t reserved_at_call = alloc_->stats().reserved_bytes[kAllPools].current;
  const auto device_at_call = sim_->live();
  auto kept_nothing = [&](const char* how) {
    if (options_.multi_faults) return;
    const auto l = sim_->live();
    if (alloc_->stats().reserved_bytes[kAllPools].current > reserved_at_call || l.reservations > device_at_call.reservations ||
        l.handles > device_at_call.handles || l.mappings > device_at_call.mappings)
      fail(std::string("a failed allocate (") + how + ") kept memory or address space it took");
  };
  void* p = nullptr;
  try {
    p = alloc_->allocate(size, stream);
  } catch (const expseg::out_of_memory& e) {
    if (!driver_threw_) kept_nothing("out_of_memory");
    // 1 EiB and more is refused up front, as PyTorch's allocate() refuses it: not in num_ooms.
    if (size < (std::size_t{1} << 60)) ++ooms_seen_;
    ++counters_.ooms;
    const expseg::OomReport& r = e.report();
    if (r.requested_bytes != size) fail("OOM report names " + std::to_string(r.requested_bytes) + " bytes requested");
    // PyTorch's first sentence, or CuPy's for policy:cupy.
    const char* prefix = options_.policy == expseg::PoolPolicy::cupy && options_.backend == BackendKind::split_merge
                             ? "Out of memory allocating "
                             : "CUDA out of memory. Tried to allocate ";
    if (std::string(e.what()).rfind(prefix, 0) != 0) fail(std::string("OOM message: ") + e.what());
    if (r.verdict == expseg::OomVerdict::fragmentation) {
      ++counters_.fragmentation_ooms;
      if (size > options_.capacity) fail("a request larger than the device got the verdict fragmentation");
    }
    const auto last = alloc_->last_oom();
    if (!last || last->requested_bytes != size) fail("last_oom() does not describe the OOM just thrown");
    return;
  } catch (const expseg::driver_error& e) {
    on_driver_exception("allocate", e);
    kept_nothing("driver_error");
    return;
  } catch (const Failure&) {
    throw;
  } catch (const std::exception& e) {
    fail(std::string("allocate threw ") + e.what());
  }
  if (size == 0) {
    if (p != nullptr) fail("allocate(0) returned " + hex(reinterpret_cast<std::uintptr_t>(p)) + ", not nullptr");
    if (alloc_->stats().allocation[kAllPools].allocated != allocations_before) fail("allocate(0) counted an allocation");
    return;
  }
  const auto addr = static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(p));
  note_result(addr);
  if (p == nullptr) fail("allocate returned nullptr");
  if (addr % 512 != 0) fail("allocation " + hex(addr) + " is not 512-byte aligned");
  if (size > options_.capacity) fail("an allocation larger than the device succeeded");
  // Larger than the limit: only from memory held before the limit was lowered below it (PyTorch and
  // CuPy serve cached blocks without looking at the limit); never from new memory.
  if (limit_ != 0 && size > limit_ && static_cast<std::size_t>(reserved_before_) <= limit_)
    fail("an allocation larger than the limit succeeded while the allocator held less than the limit");
  if (live_.contains(addr)) fail("allocate returned the live address " + hex(addr));
  check_new_block(addr, size, stream);
  if (!sim_->is_accessible(addr, size)) fail("new allocation " + hex(addr) + "+" + std::to_string(size) + " is not accessible");
  Live l{addr, size, stream, next_tag_++, {}};
  if (Graph* capture = capture_on(stream)) {
    // The capture's work on the block: a memset recorded into the graph, of a value of its own,
    // written by the graph's launches.
    l.pool = capture->pool;
    l.graph = capture->id;
    l.value = static_cast<std::uint32_t>(fuzz::mix(capture->id << 32 ^ l.tag));
    for (const Graph::Freed& f : capture->freed)
      if (f.stream != stream && f.addr < addr + size && addr < f.addr + f.size)
        fail("capture of graph " + std::to_string(capture->id) + ": " + stream_name(stream) + " got " + hex(addr) + "+" +
             std::to_string(size) + ", memory its branch " + stream_name(f.stream) + " freed at " + hex(f.addr) +
             " (a replay runs the branches side by side)");
    if (stream != capture->stream) ++counters_.fork_allocs;
    if (size >= 4) {
      sim_->memset_d32(addr, l.value, size / 4, stream);
      capture->writes.emplace_back(addr, size / 4 * 4);
    }
    ++counters_.capture_allocs;
  } else {
    write_pattern(l);
  }
  queue_use(stream, l);
  live_[addr] = l;
  live_requested_ += size;
  ++counters_.allocs;
}

void Harness::op_free(Source& src) {
  if (live_.empty()) {
    note("free (nothing live)");
    return;
  }
  free_live(std::next(live_.begin(), static_cast<std::ptrdiff_t>(src.below(live_.size()))));
}

// Frees one live block as the caller would; false when the free failed (a driver error) and the
// block is still live.
bool Harness::free_live(std::map<std::uint64_t, Live>::iterator it) {
  const Live l = it->second;
  note("free " + hex(l.addr) + "+" + std::to_string(l.size) + " of " + stream_name(l.stream) +
       (l.uses.empty() ? "" : " (used on " + std::to_string(l.uses.size()) + " more streams)"));
  check_pattern(l, "at free");
  const std::uint64_t free_tick = tick_;  // before the events the free records
  try {
    alloc_->deallocate(reinterpret_cast<void*>(static_cast<std::uintptr_t>(l.addr)));
  } catch (const expseg::driver_error& e) {
    on_driver_exception("deallocate", e);
    if (l.uses.empty()) fail("deallocate of a block without record_stream called the driver");
    check_pattern(l, "after a failed free");
    return false;  // still live
  } catch (const Failure&) {
    throw;
  } catch (const std::exception& e) {
    fail(std::string("deallocate threw ") + e.what());
  }
  live_.erase(it);
  live_requested_ -= l.size;
  for (Graph& c : captures_)
    if (c.id == l.graph) c.freed.push_back({l.addr, l.size, l.stream});
  freed_.push_back(l.addr);
  if (freed_.size() > 32) freed_.pop_front();
  ++counters_.frees;
  if (!l.uses.empty()) {
    Pending p{l, free_tick, {}, busy_[l.stream]};
    for (void* s : l.uses)
      if (busy_[s]) p.busy.push_back(s);
    pending_[l.addr] = p;
    ++counters_.pending_frees;
  } else if (busy_[l.stream]) {
    // (A capture's block too: a graph pool serves what a stream freed to that stream's captures.)
    hazards_.emplace(l.addr, Hazard{l.size, l.stream, free_tick});
  }
  return true;
}

void Harness::op_record_stream(Source& src) {
  if (live_.empty()) {
    note("record_stream (nothing live)");
    return;
  }
  auto it = std::next(live_.begin(), static_cast<std::ptrdiff_t>(src.below(live_.size())));
  Live& l = it->second;
  void* s = streams_[src.below(streams_.size())];
  note("record_stream " + hex(l.addr) + " on " + stream_name(s));
  try {
    alloc_->record_stream(reinterpret_cast<void*>(static_cast<std::uintptr_t>(l.addr)), s);
  } catch (const std::exception& e) {
    fail(std::string("record_stream of a live block threw ") + e.what());
  }
  // A capture's block: the stream that captured it is its allocation stream while that stream
  // captures into its pool again; otherwise it is one more use.
  const Graph* c = capture_on(s);
  const bool own = l.pool != 0 ? c != nullptr && c->pool == l.pool && s == l.stream : s == l.stream;
  if (!own && std::find(l.uses.begin(), l.uses.end(), s) == l.uses.end()) l.uses.push_back(s);
  queue_use(s, l);
}

void Harness::op_toggle_busy(Source& src) {
  void* s = streams_[src.below(streams_.size())];
  const bool busy = !busy_[s];
  note(std::string("set_stream_busy ") + stream_name(s) + (busy ? " busy" : " idle"));
  sim_->set_stream_busy(s, busy);
  busy_[s] = busy;
  if (!busy) complete_upto_[s] = std::max(complete_upto_[s], tick_);
  // The stream's new work uses every live block allocated on it or recorded on it.
  if (busy)
    for (const auto& [a, l] : live_)
      if (l.stream == s || std::find(l.uses.begin(), l.uses.end(), s) != l.uses.end()) queue_use(s, l);
}

// Work queued on a busy stream that uses the block, told to the simulated device: it then reports an
// unmap of the block's memory before that work completes (sim_->hazards(), checked in after_op),
// apart from the model's own bookkeeping of busy streams.
void Harness::queue_use(void* stream, const Live& l) {
  if (!busy_[stream]) return;  // an idle stream's work is done at once
  sim_->queue_use(stream, l.addr, l.size);
  ++counters_.busy_uses;
}

// release_stream of a stream the harness made. Refused (expseg::error) while a block allocated on
// it is live or pending, or a live block has it recorded; it may also be refused while a pending
// free has it recorded (a free held for a capture records its events later). Done, the stream was
// synchronized and nothing is cached for it.
void Harness::op_release_stream(Source& src) {
  if (streams_.size() < 2) return;
  void* s = streams_[1 + src.below(streams_.size() - 1)];  // not the legacy default stream
  if (!captures_.empty()) {
    note(std::string("release_stream ") + stream_name(s) + " (skipped: a capture is underway)");
    return;
  }
  auto recorded = [&](const Live& l) { return std::find(l.uses.begin(), l.uses.end(), s) != l.uses.end(); };
  // Half the time as a program about to destroy the stream: its blocks, and those it was handed, are
  // freed first.
  if (src.chance(50)) {
    for (auto it = live_.begin(); it != live_.end();) {
      auto next = std::next(it);
      if ((it->second.pool == 0 && it->second.stream == s) || recorded(it->second))
        if (!free_live(it)) return;
      it = next;
    }
  }
  note(std::string("release_stream ") + stream_name(s));
  bool must_refuse = false;
  bool may_refuse = false;
  for (const auto& [addr, l] : live_) must_refuse = must_refuse || (l.pool == 0 && l.stream == s) || recorded(l);
  // A free still waiting for other streams' work refuses the stream, unless that work has passed
  // (release_stream completes such frees first, and frees held for a capture that has ended).
  for (const auto& [addr, p] : pending_) may_refuse = may_refuse || (p.block.pool == 0 && p.block.stream == s) || recorded(p.block);
  may_refuse = may_refuse || must_refuse;
  try {
    alloc_->release_stream(s);
  } catch (const expseg::driver_error& e) {
    on_driver_exception("release_stream", e);
    return;
  } catch (const Failure&) {
    throw;
  } catch (const expseg::error& e) {
    if (!may_refuse) fail(std::string("release_stream refused a stream nothing uses: ") + e.what());
    ++counters_.streams_refused;
    return;
  }
  if (must_refuse) fail("release_stream released a stream with blocks in use");
  ++counters_.streams_released;
  if (!spy_failure_.empty() || driver_threw_) return;
  resolve_pending();
  for (const auto& seg : alloc_->snapshot().segments)
    if (seg.stream == static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(s)))
      fail("release_stream left segment " + hex(seg.address) + " of the stream");
}

void Harness::op_release_cached() {
  if (!captures_.empty()) {
    refused_in_capture(false, 0);
    return;
  }
  note("release_cached");
  ++counters_.release_cached;
  try {
    alloc_->release_cached();
  } catch (const expseg::driver_error& e) {
    on_driver_exception("release_cached", e);
    return;
  } catch (const Failure&) {
    throw;
  } catch (const std::exception& e) {
    fail(std::string("release_cached threw ") + e.what());
  }
  if (!spy_failure_.empty() || driver_threw_) return;
  // Every pending free was waited for, and every cached byte that can go back went back.
  resolve_pending();
  if (!pending_.empty()) fail("release_cached left " + std::to_string(pending_.size()) + " pending frees");
  const Stats s = alloc_->stats();
  if (live_.empty() && pool_uses_.empty() && s.reserved_bytes[kAllPools].current != 0)
    fail("release_cached with nothing live left " + std::to_string(s.reserved_bytes[kAllPools].current) + " bytes reserved");
  if (options_.backend == BackendKind::split_merge) {
    const expseg::Snapshot snap = alloc_->snapshot();
    for (const auto& seg : snap.segments)
      if (seg.blocks.size() == 1 && seg.blocks[0].state == expseg::BlockState::free_mapped && !of_live_graph_pool(seg.stream))
        fail("release_cached kept the unsplit free segment " + hex(seg.address));
  } else if (const std::string idle = idle_mapped_run(alloc_->snapshot()); !idle.empty()) {
    fail("release_cached kept " + idle);
  }
}

void Harness::op_set_limit(Source& src) {
  const std::size_t cap = options_.capacity;
  const std::size_t reserved = static_cast<std::size_t>(alloc_->stats().reserved_bytes[kAllPools].current);
  std::size_t v = 0;
  switch (src.below(6)) {
    case 0: v = 0; break;
    case 1: v = cap / 8 + src.below(cap - cap / 8); break;
    case 2: v = reserved / 2 + 1; break;  // below what is held: cached memory must go back
    case 3: v = cap * 2; break;
    case 4: v = SIZE_MAX; break;
    default: v = (1 + src.below(8)) * cap / 8; break;
  }
  if (!captures_.empty()) {
    refused_in_capture(true, v);
    return;
  }
  note("set_limit " + std::to_string(v));
  ++counters_.limit_changes;
  bool threw = false;
  try {
    alloc_->set_limit(v);
  } catch (const expseg::driver_error& e) {
    on_driver_exception("set_limit", e);
    threw = true;
  } catch (const Failure&) {
    throw;
  } catch (const std::exception& e) {
    fail(std::string("set_limit threw ") + e.what());
  }
  if (threw && alloc_->limit() != limit_) fail("a set_limit that threw changed the limit (the old one must stay in force)");
  limit_ = alloc_->limit();
  if (!threw && limit_ != v) fail("limit() is " + std::to_string(limit_) + " after set_limit(" + std::to_string(v) + ")");
  // Lowering the limit gives back cached memory above it at once (when no fault interfered): held
  // memory ends at or under the limit, or no unsplit free segment is left to give back.
  if (!threw && !driver_threw_ && v != 0 && v < reserved && options_.backend == BackendKind::split_merge) {
    const expseg::Snapshot snap = alloc_->snapshot();
    if (static_cast<std::size_t>(alloc_->stats().reserved_bytes[kAllPools].current) > v)
      for (const auto& seg : snap.segments)
        if (seg.blocks.size() == 1 && seg.blocks[0].state == expseg::BlockState::free_mapped && !of_live_graph_pool(seg.stream))
          fail("set_limit below reserved kept the unsplit free segment " + hex(seg.address) + " while over the limit");
  }
  // expandable gives back idle handles until under the limit: still over it, none is left.
  if (!threw && !driver_threw_ && v != 0 && v < reserved && options_.backend == BackendKind::expandable &&
      static_cast<std::size_t>(alloc_->stats().reserved_bytes[kAllPools].current) > v)
    if (const std::string idle = idle_mapped_run(alloc_->snapshot()); !idle.empty()) fail("set_limit below reserved kept " + idle + " while over the limit");
}

void Harness::op_fault(Source& src) {
  static constexpr Op kVmm[] = {Op::reserve, Op::free_reserve, Op::create, Op::release, Op::map, Op::unmap, Op::set_access};
  static constexpr Op kCommon[] = {Op::event_record, Op::event_query, Op::stream_sync};
  static constexpr Op kPlain[] = {Op::mem_alloc, Op::mem_free};
  Op op;
  const unsigned r = static_cast<unsigned>(src.below(10));
  if (r < 3) op = kCommon[src.below(std::size(kCommon))];
  else if (r < 9) op = options_.backend == BackendKind::expandable ? kVmm[src.below(std::size(kVmm))] : kPlain[src.below(std::size(kPlain))];
  else op = static_cast<Op>(src.below(expseg::driver::kOpCount));
  // With graphs, not a stream query: cuStreamGetCaptureInfo fails only for a stream that does not
  // exist, and what expseg assumes then (no capture) is not what this model expects of a capture it
  // began. Without graphs no capture is expected: a failed query must leave the allocator consistent.
  if (op == Op::stream_query && options_.graphs) op = Op::event_query;
  const std::uint64_t nth = 1 + src.below(4);
  const Fault fault = src.chance(50) ? Fault::out_of_memory : Fault::error;
  std::erase_if(armed_, [&](const auto& a) { return sim_->calls(a.first) >= a.second; });
  if (!options_.multi_faults && !armed_.empty()) {
    // One fault at a time: the new one replaces a pending one that never fired.
    sim_->clear_faults();
    armed_.clear();
  }
  armed_.emplace_back(op, sim_->calls(op) + nth);
  note(std::string("inject_fault ") + expseg::driver::op_name(op) + " nth " + std::to_string(nth) +
       (fault == Fault::out_of_memory ? " OOM" : " error"));
  sim_->inject_fault(op, nth, fault);
  ++counters_.faults_armed;
}

void Harness::op_invalid(Source& src) {
  ++counters_.invalid_pointer_checks;
  const Stats before = alloc_->stats();
  auto expect = [&](const char* what, auto&& f, std::initializer_list<const char*> any_of) {
    try {
      f();
    } catch (const expseg::invalid_pointer& e) {
      const std::string msg = e.what();
      bool ok = false;
      for (const char* part : any_of) ok = ok || contains(msg, part);
      if (!ok) fail(std::string(what) + ": unexpected message: " + msg);
      return;
    } catch (const std::exception& e) {
      fail(std::string(what) + " threw something other than invalid_pointer: " + e.what());
    }
    fail(std::string(what) + " did not throw");
  };
  const unsigned kind = static_cast<unsigned>(src.below(5));
  if (kind == 0 && !freed_.empty()) {
    const std::uint64_t a = freed_[src.below(freed_.size())];
    if (live_.contains(a)) {
      note("double free (skipped: the address is live again)");
      return;
    }
    note("double free " + hex(a));
    expect("double free", [&] { alloc_->deallocate(reinterpret_cast<void*>(static_cast<std::uintptr_t>(a))); }, {"double free"});
  } else if (kind == 1 && !live_.empty()) {
    const Live& l = std::next(live_.begin(), static_cast<std::ptrdiff_t>(src.below(live_.size())))->second;
    // Inside the request, never at its start (blocks start on 512-byte boundaries).
    const std::uint64_t a = l.addr + 8 + 8 * src.below(l.size / 8 > 2 ? l.size / 8 - 1 : 1);
    note("free of interior pointer " + hex(a));
    expect("interior free", [&] { alloc_->deallocate(reinterpret_cast<void*>(static_cast<std::uintptr_t>(a))); },
           {"not the start of a live allocation", "double free"});
  } else if (kind == 2) {
    int local = 0;
    note("free of a stack pointer");
    expect("foreign free", [&] { alloc_->deallocate(&local); }, {"not allocated by this expseg allocator (device 0)"});
  } else if (kind == 3 && !freed_.empty()) {
    const std::uint64_t a = freed_[src.below(freed_.size())];
    if (live_.contains(a)) {
      note("record_stream of a freed pointer (skipped: live again)");
      return;
    }
    note("record_stream of freed pointer " + hex(a));
    expect("record_stream of a freed pointer",
           [&] { alloc_->record_stream(reinterpret_cast<void*>(static_cast<std::uintptr_t>(a)), streams_.back()); },
           {"record_stream of pointer", "double free"});
  } else {
    note("deallocate(nullptr)");
    try {
      alloc_->deallocate(nullptr);
    } catch (const std::exception& e) {
      fail(std::string("deallocate(nullptr) threw ") + e.what());
    }
  }
  const Stats after = alloc_->stats();
  if (after.allocation[kAllPools].current != before.allocation[kAllPools].current ||
      after.allocation[kAllPools].freed != before.allocation[kAllPools].freed ||
      after.reserved_bytes[kAllPools].current != before.reserved_bytes[kAllPools].current ||
      after.active_bytes[kAllPools].current != before.active_bytes[kAllPools].current)
    fail("a rejected pointer changed the stats");
}

void Harness::op_reset_stats(Source& src) {
  const bool peaks = src.chance(50);
  note(peaks ? "reset_peak_stats" : "reset_accumulated_stats");
  if (peaks) alloc_->reset_peak_stats();
  else alloc_->reset_accumulated_stats();
  if (!peaks) ooms_seen_ = 0;  // PyTorch's reset_accumulated_stats clears num_ooms too
  const Stats s = alloc_->stats();
  if (!peaks) accumulated_base_ = s;
  for (int p = 0; p < expseg::kStatPools; ++p) {
    if (peaks && (s.allocated_bytes[p].peak != s.allocated_bytes[p].current || s.reserved_bytes[p].peak != s.reserved_bytes[p].current))
      fail("reset_peak_stats left a peak above its current value");
    if (!peaks && (s.allocated_bytes[p].freed != 0 || s.reserved_bytes[p].allocated != 0))
      fail("reset_accumulated_stats left totals");
  }
}

// --- graph capture ------------------------------------------------------------------------------

void Harness::op_graph(Source& src) {
  const unsigned r = static_cast<unsigned>(src.below(100));
  if (!captures_.empty()) {
    if (r < 56) op_allocate(src, true);
    else if (r < 66) end_capture(src.below(captures_.size()));
    else if (r < 70) begin_capture(src);                      // a second capture at once
    else if (r < 80) fork_capture(src);                       // another stream joins a capture
    else if (r < 84 && !graphs_.empty()) launch_graph(src);  // another graph, on another stream
    else if (r < 92) src.chance(50) ? op_release_cached() : op_set_limit(src);
    else op_free(src);
    return;
  }
  if (r < 45 && graphs_.size() < 4) begin_capture(src);
  else if (r < 65 && !graphs_.empty()) launch_graph(src);
  else if (r < 80 && !graphs_.empty()) warm_up(src);
  else if (!graphs_.empty()) destroy_graph(src.below(graphs_.size()));
  else begin_capture(src);
}

Harness::Graph* Harness::capture_on(void* stream) {
  for (Graph& g : captures_)
    if (g.stream == stream || std::find(g.forks.begin(), g.forks.end(), stream) != g.forks.end()) return &g;
  return nullptr;
}

// A stream waits for an event recorded in a capture and so joins it, as torch.cuda.graph's
// side streams do: its allocations go into the capture's pool, apart from the capturing stream's
// (the branches run side by side in a replay), and its memsets into the graph, until the capture
// ends (the simulator joins it back then).
void Harness::fork_capture(Source& src) {
  if (captures_.empty() || streams_.size() < 3) return;
  Graph& c = captures_[src.below(captures_.size())];
  void* t = streams_[1 + src.below(streams_.size() - 1)];  // the legacy default stream cannot join
  if (capture_on(t) != nullptr) return;
  note("fork capture of graph " + std::to_string(c.id) + " on " + stream_name(c.stream) + " to " + stream_name(t));
  expseg::driver::event_t ev = nullptr;
  try {
    ev = sim_->event_create();
    sim_->event_record(ev, c.stream);
    sim_->stream_wait_event(t, ev);
  } catch (const expseg::driver_error& e) {  // an injected fault hit the harness's own event call
    if (ev != nullptr) sim_->event_destroy(ev);
    note(std::string("  fork skipped: ") + e.what());
    return;
  }
  sim_->event_destroy(ev);
  c.forks.push_back(t);
  ++counters_.forks;
}

void Harness::begin_capture(Source& src) {
  if (streams_.size() < 2 || captures_.size() >= 2) return;
  void* s = streams_[1 + src.below(streams_.size() - 1)];  // the legacy default stream cannot capture
  std::uint64_t pool_id = 1 + src.below(3);               // few ids: graphs share pools
  // Captures at once: on different streams, into different pools (each capture its own pool, as
  // torch.cuda.graph's captures in several threads).
  if (capture_on(s) != nullptr) return;
  for (const Graph& c : captures_)
    if (c.pool_id == pool_id) return;
  auto g = std::make_unique<Graph>();
  g->id = next_graph_++;
  g->pool_id = pool_id;
  g->stream = s;
  const bool prepare = src.chance(50);  // told whether s blocks: the legacy stream's idle memory may go back meanwhile
  note("begin capture of graph " + std::to_string(g->id) + " on " + stream_name(s) + " into pool " + std::to_string(pool_id) +
       (prepare ? " (prepared)" : ""));
  if (prepare) {
    try {
      alloc_->prepare_capture(s);
    } catch (const std::exception& e) {
      on_driver_exception("prepare_capture", e);  // an injected fault in its stream query: no capture then
      return;
    }
  }
  // Relaxed: captures overlap here and end in any order, which global mode's refusal of
  // cuGraphInstantiate during another capture would forbid.
  sim_->capture_begin(s, expseg::driver::Driver::CaptureMode::relaxed);
  try {
    alloc_->begin_graph_pool(pool_id, s);
  } catch (const std::exception& e) {
    fail(std::string("begin_graph_pool threw ") + e.what());
  }
  auto inst = pool_instance_.find(pool_id);
  if (inst == pool_instance_.end()) {
    inst = pool_instance_.emplace(pool_id, next_pool_instance_++).first;
    id_of_instance_[inst->second] = pool_id;
  }
  g->pool = inst->second;
  ++pool_uses_[pool_id];
  captures_.push_back(std::move(*g));
}

void Harness::end_capture(std::size_t index) {
  Graph& g = captures_[index];
  note("end capture of graph " + std::to_string(g.id) + " (" + std::to_string(g.writes.size()) + " captured memsets)");
  try {
    g.exec = sim_->capture_end(g.stream);
  } catch (const std::exception& e) {
    fail(std::string("capture_end threw (expseg invalidated the capture): ") + e.what());
  }
  Graph kept = std::move(g);
  captures_.erase(captures_.begin() + static_cast<std::ptrdiff_t>(index));
  graphs_.push_back(std::move(kept));
  ++counters_.captures;
  try {
    alloc_->end_graph_pool(graphs_.back().pool_id);
  } catch (const expseg::driver_error& e) {
    on_driver_exception("end_graph_pool", e);
  } catch (const Failure&) {
    throw;
  } catch (const std::exception& e) {
    fail(std::string("end_graph_pool threw ") + e.what());
  }
}

void Harness::launch_graph(Source& src) {
  const Graph& g = graphs_[src.below(graphs_.size())];
  void* s = streams_[src.below(streams_.size())];
  note("launch graph " + std::to_string(g.id) + " (pool " + std::to_string(g.pool_id) + ") on " + stream_name(s));
  try {
    sim_->graph_launch(g.exec, s);
  } catch (const std::exception& e) {
    fail(std::string("graph launch failed (memory it writes was unmapped): ") + e.what());
  }
  ++counters_.launches;
  // The graph's live blocks hold its values now; its writes may have gone over other blocks of its
  // pool (shared with other graphs, which the pool allows); nothing else may have changed.
  auto update = [&](Live& l) {
    if (l.pool != g.pool) return;
    if (l.graph == g.id) {
      l.known = true;
      return;
    }
    for (const auto& [a, n] : g.writes)
      if (a < l.addr + l.size && l.addr < a + n) l.known = false;
  };
  for (auto& [a, l] : live_) update(l);
  for (auto& [a, p] : pending_) update(p.block);
  full_check();
}

// The pool lists its live blocks, those allocated before an earlier release of its id included (as
// PyTorch's private pool, released and begun again, keeps its blocks still allocated).
void Harness::check_pool_listing(std::uint64_t pool_id) {
  std::vector<std::uint64_t> model;
  for (const auto& [a, l] : live_)
    if (l.pool != 0 && id_of_instance_.at(l.pool) == pool_id) model.push_back(a);
  std::vector<std::uint64_t> listed;
  for (const auto& [a, n] : alloc_->graph_pool_blocks(pool_id)) listed.push_back(a);
  if (listed != model)
    fail("graph_pool_blocks(" + std::to_string(pool_id) + ") lists " + std::to_string(listed.size()) + " blocks, the model holds " +
         std::to_string(model.size()) + " there");
}

// As PyTorch's CUDA graph trees between replays (no capture underway): allocations of a warm-up on a
// graph's stream go into its pool; then a block of the pool is freed and restored where it was.
void Harness::warm_up(Source& src) {
  const Graph& g = graphs_[src.below(graphs_.size())];
  const std::uint64_t pool_id = g.pool_id;
  void* s = g.stream;
  note("warm-up into pool " + std::to_string(pool_id) + " on " + stream_name(s));
  try {
    alloc_->begin_pool_allocations(pool_id, s);
  } catch (const std::exception& e) {
    fail(std::string("begin_pool_allocations threw ") + e.what());
  }
  ++pool_uses_[pool_id];
  const std::uint64_t instance = pool_instance_.at(pool_id);
  for (std::uint64_t n = 1 + src.below(3); n > 0; --n) {
    const std::size_t size = 512 + src.below(8 * options_.granularity);
    note("  allocate " + std::to_string(size) + " into the pool");
    void* p = nullptr;
    try {
      p = alloc_->allocate(size, s);
    } catch (const expseg::out_of_memory&) {
      ++ooms_seen_;
      ++counters_.ooms;
      continue;
    } catch (const expseg::driver_error& e) {
      on_driver_exception("allocate", e);
      continue;
    } catch (const Failure&) {
      throw;
    } catch (const std::exception& e) {
      fail(std::string("allocate into a pool threw ") + e.what());
    }
    const auto addr = static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(p));
    note_result(addr);
    check_new_block(addr, size, s);
    if (!sim_->is_accessible(addr, size)) fail("warm-up allocation " + hex(addr) + " is not accessible");
    // The pool's memory: its graphs' launches may write it (the trees replay only once such blocks are
    // dead), so no pattern is kept; the separation check covers everyone else.
    Live l{addr, size, s, next_tag_++, {}};
    l.pool = instance;
    queue_use(s, l);
    live_[addr] = l;
    live_requested_ += size;
    ++counters_.allocs;
    ++counters_.warmup_allocs;
  }
  try {
    alloc_->end_pool_allocations(pool_id, s);
    alloc_->release_graph_pool(pool_id);
  } catch (const std::exception& e) {
    fail(std::string("end_pool_allocations / release_graph_pool threw ") + e.what());
  }
  --pool_uses_[pool_id];
  check_pool_listing(pool_id);
  // A block of the pool freed and restored where it was: the trees' setCheckpointPoolState.
  std::vector<std::uint64_t> candidates;
  for (const auto& [a, l] : live_)
    if (l.pool == instance && l.graph == 0 && l.uses.empty() && captures_.empty()) candidates.push_back(a);  // a warm-up's
  if (candidates.empty()) return;
  Live l = live_.at(candidates[src.below(candidates.size())]);
  std::size_t block = 0;
  for (const auto& [a, n] : alloc_->graph_pool_blocks(pool_id))
    if (a == l.addr) block = n;
  if (block == 0) fail("live pool block " + hex(l.addr) + " is not in graph_pool_blocks");
  note("restore " + hex(l.addr) + "+" + std::to_string(block) + " in pool " + std::to_string(pool_id));
  void* p = reinterpret_cast<void*>(static_cast<std::uintptr_t>(l.addr));
  try {
    alloc_->deallocate(p);
    alloc_->restore_graph_pool_block(pool_id, p, block);
  } catch (const std::exception& e) {
    fail(std::string("free and restore of a pool block threw ") + e.what());
  }
  live_requested_ += block - l.size;  // the restored block asks for all of itself
  Live& restored = live_.at(l.addr);
  restored.size = block;
  restored.known = false;
  ++counters_.restores;
  check_pool_listing(pool_id);
}

void Harness::destroy_graph(std::size_t index) {
  const Graph g = graphs_[index];
  note("destroy graph " + std::to_string(g.id) + ", release pool " + std::to_string(g.pool_id));
  graphs_.erase(graphs_.begin() + static_cast<std::ptrdiff_t>(index));
  sim_->graph_destroy(g.exec);
  try {
    alloc_->release_graph_pool(g.pool_id);
  } catch (const std::exception& e) {
    fail(std::string("release_graph_pool threw ") + e.what());
  }
  if (--pool_uses_[g.pool_id] == 0) {
    pool_uses_.erase(g.pool_id);
    pool_instance_.erase(g.pool_id);
  }
}

// release_cached and set_limit during a capture: refused with expseg::error (giving memory back
// would synchronize), and nothing changed.
void Harness::refused_in_capture(bool set_limit, std::size_t v) {
  note(set_limit ? "set_limit " + std::to_string(v) + " during a capture" : std::string("release_cached during a capture"));
  ++counters_.refused_in_capture;
  const Stats before = alloc_->stats();
  const std::size_t limit = alloc_->limit();
  try {
    if (set_limit) alloc_->set_limit(v);
    else alloc_->release_cached();
    fail(std::string(set_limit ? "set_limit" : "release_cached") + " during a capture did not throw");
  } catch (const Failure&) {
    throw;
  } catch (const expseg::driver_error& e) {
    fail(std::string("refused call during a capture threw driver_error: ") + e.what());
  } catch (const expseg::error& e) {
    if (!contains(e.what(), "capture")) fail(std::string("refused call during a capture: unclear message: ") + e.what());
  } catch (const std::exception& e) {
    fail(std::string("refused call during a capture threw ") + e.what());
  }
  const Stats after = alloc_->stats();
  if (alloc_->limit() != limit) fail("a refused set_limit changed the limit");
  if (after.reserved_bytes[kAllPools].current != before.reserved_bytes[kAllPools].current ||
      after.active_bytes[kAllPools].current != before.active_bytes[kAllPools].current ||
      after.allocation[kAllPools].current != before.allocation[kAllPools].current)
    fail("a call refused during a capture changed the stats");
}

void Harness::step(Source& src) {
  if (finished_) fail("step after finish()");
  ++counters_.ops;
  ++tick_;
  driver_threw_ = false;
  const std::uint64_t driver_errors = counters_.driver_errors;
  const std::uint64_t ooms = counters_.ooms;
  const char* name = "op";
  // Graph operations: a draw of their own, only with graphs on (runs without keep their sequences);
  // more often while a capture is underway, so that captures allocate and end.
  if (options_.graphs && src.chance(captures_.empty() ? 4 : 30)) {
    op_graph(src);
    if (driver_threw_ && counters_.driver_errors == driver_errors && counters_.ooms == ooms) ++counters_.faults_absorbed;
    after_op("graph");
    return;
  }
  const unsigned r = static_cast<unsigned>(src.below(100));
  if (live_.size() >= options_.max_live && r < 70) {
    name = "free";
    op_free(src);
  } else if (r < 40) {
    name = "allocate";
    op_allocate(src);
  } else if (r < 64) {
    name = "free";
    op_free(src);
  } else if (r < 72) {
    name = "record_stream";
    op_record_stream(src);
  } else if (r < 81) {
    name = "set_stream_busy";
    op_toggle_busy(src);
  } else if (r < 83) {
    name = "release_cached";
    if (src.chance(25)) {
      name = "release_stream";
      op_release_stream(src);
    } else {
      op_release_cached();
    }
  } else if (r < 86) {
    name = "set_limit";
    op_set_limit(src);
  } else if (r < 91) {
    if (options_.faults) {
      name = "inject_fault";
      op_fault(src);
    } else {
      name = "allocate";
      op_allocate(src);
    }
  } else if (r < 95) {
    name = "invalid";
    op_invalid(src);
  } else if (r < 96) {
    name = "reset_stats";
    op_reset_stats(src);
  } else {
    name = "check";
    note("full check");
    full_check();
  }
  if (driver_threw_ && counters_.driver_errors == driver_errors && counters_.ooms == ooms) ++counters_.faults_absorbed;
  after_op(name);
}

void Harness::run(Source& src, std::size_t max_ops) {
  for (std::size_t i = 0; i < max_ops && !src.exhausted(); ++i) step(src);
}

void Harness::finish(bool free_all) {
  if (finished_) return;
  ++counters_.ops;
  note(free_all ? "finish: free everything, release_cached, destroy" : "finish: destroy with allocations live");
  driver_threw_ = false;
  sim_->clear_faults();
  armed_.clear();
  for (void* s : streams_) {
    sim_->set_stream_busy(s, false);
    busy_[s] = false;
    complete_upto_[s] = tick_;
  }
  // The capture underway ends; every graph is destroyed and its pool released.
  while (!captures_.empty()) end_capture(captures_.size() - 1);
  while (!graphs_.empty()) destroy_graph(graphs_.size() - 1);
  full_check();
  if (free_all) {
    for (const auto& [a, l] : live_) {
      check_pattern(l, "at the final free");
      try {
        alloc_->deallocate(reinterpret_cast<void*>(static_cast<std::uintptr_t>(a)));
      } catch (const std::exception& e) {
        fail(std::string("final deallocate threw ") + e.what());
      }
    }
    live_.clear();
    live_requested_ = 0;
    try {
      alloc_->release_cached();
    } catch (const std::exception& e) {
      fail(std::string("final release_cached threw ") + e.what());
    }
    after_op("finish");
    if (!pending_.empty()) fail("pending frees left after release_cached");
    const Stats s = alloc_->stats();
    if (s.allocated_bytes[kAllPools].current != 0 || s.active_bytes[kAllPools].current != 0 || s.reserved_bytes[kAllPools].current != 0)
      fail("memory still held after freeing everything and release_cached: reserved " +
           std::to_string(s.reserved_bytes[kAllPools].current) + ", active " + std::to_string(s.active_bytes[kAllPools].current));
    const auto l = sim_->live();
    if (l.handles || l.mappings || l.mem_allocs || l.physical_bytes)
      fail("driver resources held after release_cached: " + std::to_string(l.handles) + " handles, " + std::to_string(l.mappings) +
           " mappings, " + std::to_string(l.mem_allocs) + " cuMemAlloc allocations, " + std::to_string(l.physical_bytes) + " bytes");
  }
  // Destroying the allocator gives everything back, live allocations included.
  spy_->detach();
  alloc_.reset();
  for (std::size_t i = 1; i < streams_.size(); ++i) sim_->stream_destroy(streams_[i]);
  streams_.resize(1);
  const auto l = sim_->live();
  if (l.reservations || l.handles || l.mappings || l.mem_allocs || l.events || l.streams || l.physical_bytes)
    fail("leak after destroying the allocator: " + std::to_string(l.reservations) + " reservations, " + std::to_string(l.handles) +
         " handles, " + std::to_string(l.mappings) + " mappings, " + std::to_string(l.mem_allocs) + " cuMemAlloc allocations, " +
         std::to_string(l.events) + " events, " + std::to_string(l.physical_bytes) + " bytes");
  live_.clear();
  pending_.clear();
  hazards_.clear();
  finished_ = true;
}

Counters run_seed(const Options& options, std::uint64_t seed, std::size_t ops, const std::string& replay_hint) {
  try {
    Harness h(options);
    RngSource src(seed);
    h.run(src, ops);
    h.finish(src.chance(80));
    return h.counters();
  } catch (const Failure& f) {
    std::ostringstream os;
    os << "seed " << seed << ", " << ops << " operations: " << f.what();
    if (!replay_hint.empty()) os << "\n  replay: " << replay_hint;
    throw Failure(os.str());
  }
}

}  // namespace fuzz
