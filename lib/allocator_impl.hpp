// The frontend's internals: Allocator::Impl (lock, live map, cross-stream frees, recorder, OOM
// reports) and detail::AllocatorAccess, through which tests and the replay engine reach the driver.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "backends/backend.hpp"
#include "core/live_map.hpp"
#include "core/mutex.hpp"
#include "driver/driver.hpp"
#include "expseg/allocator.hpp"
#include "ipc_internal.hpp"
#include "recorder.hpp"

namespace expseg {

// 1 EiB, PyTorch's bound: larger requests cannot be rounded without overflow, and no device has
// this much memory. They are refused up front: out_of_memory with a report, but no OOM of the
// allocator (num_ooms, the observer, oom_dump and the C API's callback do not see them).
inline constexpr std::size_t kMaxRequest = std::size_t{1} << 60;

namespace detail {
// The other-backend check of an OOM report (oom_report.cpp): a simulation of the live set, which
// may take seconds with millions of blocks, so it runs without the lock on a copy.
struct CounterfactualCheck {
  struct Live {
    std::uint64_t addr;
    std::size_t requested;
    driver::stream_t stream;
  };
  bool pending = false;    // build_oom_report left it to finish_counterfactual
  std::vector<Live> live;  // the live set, pending frees included, in no order
  Config config;
  std::size_t capacity = 0, granularity = 0, limit = 0, requested = 0;
  driver::stream_t stream = nullptr;
};
}  // namespace detail

struct Allocator::Impl final : backends::FrontendHooks {
  Impl(const Config& cfg, std::shared_ptr<driver::Driver> drv);
  ~Impl() override;

  void* allocate(std::size_t bytes, driver::stream_t stream);  // `stream`: a key (see stream_key)
  void deallocate(void* ptr);
  // The C API's free, which no caller retries (PyTorch's and CuPy's free return nothing): where
  // deallocate fails after the pointer was found (an event for another stream's use could not be
  // made or recorded), the block stays live no more: the device is synchronized, so no stream's
  // work uses it, and it is freed. Throws what deallocate throws only when that fails too.
  // Inline, so the C API's free makes one call into the allocator, not two.
  void deallocate_for_good(void* ptr) {
    try {
      deallocate(ptr);
    } catch (...) {
      recover_failed_deallocate(ptr);
    }
  }
  // deallocate_for_good's recovery; called only inside the handler of deallocate's exception.
  void recover_failed_deallocate(void* ptr);
  void record_stream(void* ptr, driver::stream_t stream);

  // FrontendHooks
  void on_map(std::uint64_t addr, std::size_t bytes, driver::stream_t stream) override;
  void on_unmap(std::uint64_t addr, std::size_t bytes, driver::stream_t stream) override;
  void synchronize_pending_frees() override;
  // Frees that synchronize_pending_frees can complete: queued behind events, or held for a capture
  // that has ended (one still underway keeps its frees held: a retry would find nothing new).
  bool has_pending_frees() const noexcept override {
    return pending_count != 0 || (!frees_after_capture.empty() && held_free_ready());
  }
  bool held_free_ready() const noexcept;
  bool routed_stream_captures() const noexcept override;

  // Before a backend's slow path maps or gives back memory: completes every pending free whose
  // events have completed (process_events), unless the request's stream captures.
  bool process_pending_frees() override;
  // Completes pending frees whose events have completed (PyTorch's process_events).
  void process_events();
  // The cached path's share of process_events where the backend asks process_pending_frees on its
  // slow path (expandable): the frees of the next kQueuesPolledPerRequest busy queues in turn, so
  // that a cached request makes at most three driver calls (the capture check and two event
  // queries) however many streams wait on record_stream'd work; with one or two such streams, as
  // before, every queue each request. split_merge walks every queue, as PyTorch's malloc does.
  void process_events_of_next_queues();
  static constexpr std::size_t kQueuesPolledPerRequest = 2;
  std::size_t next_polled_queue = 0;  // process_events_of_next_queues' turn, an index of busy_queues
  bool poll_every_queue = true;       // the backend does not ask process_pending_frees (split_merge)
  driver::stream_t asking_stream = nullptr;  // the stream the current request was made on (before routing)
  // Allocator::release_stream under the lock; `foreign_too`: also what expseg_cupy_malloc cached
  // under the stream's foreign key (expseg_release_stream). Refuses, nothing changed, before it
  // synchronizes the stream.
  void release_stream_locked(driver::stream_t stream, bool foreign_too);
  void finish_pending(core::Block* b) noexcept;
  void drop_retired_queues() noexcept;
  void drop_empty_queues() noexcept;
  [[noreturn, gnu::noinline, gnu::cold]] void throw_invalid_pointer(const char* op, std::uint64_t addr) const;
  // Context peer access (cuCtxEnablePeerAccess) for `peer` because of cuda_ipc imports: what an
  // expandable allocator needs only for them. Throws driver_error.
  void enable_context_peer_for_imports(int peer);
  // The OOM of allocate(): counts it, builds and records its report, calls the observer (without
  // `lock`) and throws out_of_memory. Out of line, so that allocate's fast path stays as it was.
  // `stream`: the key the backend was asked with (a graph pool's while routed); `asked_on`: the
  // stream the caller named, which the report shows.
  [[noreturn, gnu::noinline, gnu::cold]] void fail_allocation(std::unique_lock<core::Mutex>& lock, std::size_t bytes,
                                                              driver::stream_t stream, driver::stream_t asked_on);
  // The figures of a report that need no driver call and no walk (oom_report.cpp).
  void fill_report_figures(OomReport& r, std::size_t requested, driver::stream_t asked_on) const;
  using CounterfactualCheck = detail::CounterfactualCheck;
  // Builds the report of a failed allocation (oom_report.cpp). With `deferred`, a check to run is
  // left there (its sentence missing from the message) for finish_counterfactual.
  std::shared_ptr<OomReport> build_oom_report(std::size_t requested, driver::stream_t stream, driver::stream_t asked_on,
                                              CounterfactualCheck* deferred = nullptr);
  // Runs the check and adds its answer to the report; needs no lock. Never throws.
  void finish_counterfactual(OomReport& r, CounterfactualCheck& check) noexcept;
  std::atomic<void (*)()> counterfactual_probe{nullptr};  // tests: called as the check starts (read without the lock)
  // The report of an OOM whose full report found no host memory: the figures at hand and a short
  // message, or (no memory for that either) no_memory_report. Never throws.
  std::shared_ptr<const OomReport> short_oom_report(std::size_t requested, driver::stream_t asked_on) const noexcept;
  Snapshot snapshot_locked() const;
  // With oom_dump: writes the report, a snapshot, the config and the recorded events of this OOM
  // (oom_dump.cpp) and says where (or why not) in the report's message and dump_path. Never throws:
  // a dump that cannot be written must not hide the OOM.
  void write_oom_dump(OomReport& report) noexcept;

  Config config;
  std::shared_ptr<driver::Driver> driver;  // shared so tests can inspect a SimDriver after the allocator is gone
  Stats stats;
  backends::Context ctx;
  std::unique_ptr<backends::Backend> backend;
  // The sum of pool_keys' `live` counts (graph pools' blocks in the live map), which every free
  // reads: beside `backend`, read on every call and written rarely.
  std::size_t pool_live_blocks = 0;
  core::LiveMap live;
  // On a cache line of its own: waiters spin on it, and a neighbour written on every call (the live
  // map's size) would send the line back and forth between them and the holder.
  alignas(64) mutable core::Mutex mu;

  struct PendingFree {
    driver::event_t event;
    core::Block* block;
    // The event may have been recorded into a capture of its stream: one that another thread began
    // after free_after_uses found the stream not capturing. Such an event is never queried or waited
    // for while the stream captures (CUDA refuses it, CUDA_ERROR_CAPTURED_EVENT, and that query
    // invalidates captures), and is recorded again on the stream once the capture has ended.
    bool maybe_captured = false;
  };
  // A stream's pending frees in record order: a ring whose buffer grows only at a new high-water
  // mark (std::deque gives a node back every 32 pops and takes one every 32 pushes: heap traffic
  // on the cross-stream free path).
  class PendingQueue {
   public:
    bool empty() const noexcept { return count_ == 0; }
    std::size_t size() const noexcept { return count_; }
    const PendingFree& front() const noexcept { return buf_[head_]; }
    PendingFree& front() noexcept { return buf_[head_]; }
    void pop_front() noexcept {
      head_ = head_ + 1 == buf_.size() ? 0 : head_ + 1;
      --count_;
    }
    void pop_back() noexcept { --count_; }
    // May throw std::bad_alloc before anything changed.
    void push_back(const PendingFree& pf) {
      if (count_ == buf_.size()) grow();
      buf_[(head_ + count_) % buf_.size()] = pf;
      ++count_;
    }
    template <class F>
    void for_each(F&& f) const {
      for (std::size_t i = 0; i < count_; ++i) f(buf_[(head_ + i) % buf_.size()]);
    }

   private:
    void grow() {
      std::vector<PendingFree> next(std::max<std::size_t>(8, 2 * buf_.size()));
      for (std::size_t i = 0; i < count_; ++i) next[i] = buf_[(head_ + i) % buf_.size()];
      buf_.swap(next);
      head_ = 0;
    }
    std::vector<PendingFree> buf_;
    std::size_t head_ = 0;
    std::size_t count_ = 0;
  };
  struct StreamEvents {
    driver::stream_t stream;
    PendingQueue queue;
  };
  // Per stream, in record order; hashed, since a cross-stream free looks its streams' queues up.
  alignas(64) std::unordered_map<driver::stream_t, StreamEvents> pending;
  // The queues that hold frees, in the order they got them: what process_events walks (empty ones,
  // which may be many, are not). Its capacity always holds every queue, so adding one never throws.
  std::vector<StreamEvents*> busy_queues;
  void drop_emptied_queues() noexcept {
    std::erase_if(busy_queues, [](const StreamEvents* se) { return se->queue.empty(); });
  }
  // On the way out of a walk of busy_queues, also when a driver call throws.
  struct DropEmptiedQueues {
    Impl& m;
    ~DropEmptiedQueues() { m.drop_emptied_queues(); }
  };
  // process_events' work on one queue: its frees whose events have completed, in order.
  void process_queue(StreamEvents& se);
  std::uint64_t queue_steps = 0;  // tests: queues process_events and the cross-stream free's lookups looked at
  std::size_t pending_count = 0;
  // Whether the event of the free at the front of `se` can be queried or waited for now: one that
  // may have been recorded into a capture is recorded again on its stream once the capture has
  // ended (false while it lasts). May throw (the record), with the free still queued.
  bool front_event_usable(StreamEvents& se);
  std::uint64_t pending_retired_seen = 0;  // retired_keys_generation() at drop_retired_queues' last look
  bool retired_queue_left = false;         // that look left an exited thread's queue holding a free
  static constexpr std::size_t kQueueSweepMin = 32;
  std::size_t queue_sweep_at = kQueueSweepMin;  // drop_empty_queues' next look: at this many queues
  // Recycled events. Its capacity always holds every event, spare or pending (deallocate reserves
  // it), so that completing a pending free never allocates. release_cached destroys them.
  std::vector<driver::event_t> spare_events;
  // Events of a failed free whose record may have landed in a capture another thread began meanwhile
  // on the stream (the stream captures when the free gives them back), with that stream: neither
  // reused nor destroyed while it captures (see destroy_spare_events). Room for the events of a
  // free is reserved before they are recorded, so giving them back here cannot throw.
  std::vector<std::pair<driver::event_t, driver::stream_t>> captured_spares;
  void destroy_spare_events();
  // deallocate()'s events of the block being freed, kept between calls so that a cross-stream free
  // does not allocate (used under the lock only).
  std::vector<driver::event_t> free_events;

  // Graph pools (Allocator::begin_graph_pool). `capture_routes` non-empty: a capture allocates into
  // a pool (ctx.capturing is set then), and allocate() asks the driver which capture each request's
  // stream belongs to; empty, the cached path looks at nothing else.
  struct GraphPool {
    std::uint64_t id = 0;
    // A key (backends::new_graph_pool_key()) per stream that allocated into the pool (a stream
    // that began a capture, one routed by begin_pool_allocations, and apart from those a stream a
    // capture forked to, listed under an alias of it: route_to_pool): as in PyTorch's private
    // pools, memory freed on one stream serves that stream's requests only (eager work on the
    // stream, or the other branch of a forked graph, may still use it).
    std::vector<std::pair<driver::stream_t, driver::stream_t>> keys;  // stream -> key
    std::uint64_t uses = 0;  // begin_graph_pool and begin_pool_allocations calls not yet released
    // Keys an earlier release retired (their memory is given back) that live blocks still carry:
    // kept in pool_keys until those are freed, as the blocks belong to the pool (graph_pool_blocks)
    // till then. A pool at no use stays listed while it has such keys, and a later begin takes it up
    // again with new keys.
    std::size_t released_keys = 0;
  };
  struct CaptureRoute {
    std::uint64_t capture_id = 0;  // Driver::stream_capture_id of the capture's streams
    std::uint64_t pool = 0;
    driver::stream_t key = nullptr;
    driver::stream_t stream = nullptr;  // begin_graph_pool's stream (its key): has the capture ended?
    // Whether the capture may involve a stream that blocks (the legacy stream's work waits for it):
    // unless prepare_capture found its stream non-blocking, and until a request comes from another
    // stream of the capture (a fork, whose flags cannot be asked while it captures).
    bool may_block = true;
    // The streams the capture forked to that allocated, with their keys in the pool (route_to_pool).
    // A recording traces a fork's requests on its key, as a stream of their own (the fork's stream
    // may also allocate into a pool by itself, or begin a capture later: its own pool begin and end
    // must not pair with the fork's): a pool begin at its first request, and a pool end and a
    // release (the replay's begin took a use of the pool; the run's fork did not) at end_graph_pool,
    // when the begin was recorded.
    struct Fork {
      driver::stream_t stream = nullptr;
      driver::stream_t key = nullptr;
      bool begin_traced = false;
    };
    std::vector<Fork> forks;
  };
  std::unordered_map<std::uint64_t, GraphPool> graph_pools;  // by id
  // Every key of a listed pool, current or released -> the pool's id, and the blocks in the live map
  // that carry it (counted as they enter and leave it: a release, or a capture loop's thousands of
  // them, never walks the live blocks or the pools).
  struct PoolKey {
    std::uint64_t pool = 0;
    std::size_t live = 0;
    bool released = false;  // its pool was released: the key goes once `live` is 0
    bool queued = false;    // on unheld_keys
  };
  std::unordered_map<driver::stream_t, PoolKey> pool_keys;
  // Released keys whose count came to 0 since the last prune_graph_pools (each once: `queued`). Its
  // capacity holds every released key (release_graph_pool reserves it), so a free never allocates
  // here.
  std::vector<driver::stream_t> unheld_keys;
  std::size_t released_key_count = 0;  // keys in pool_keys with `released` set
  // A block enters or leaves the live map (allocate, free, their undos): graph pools' blocks counted.
  // (An OOM report's counterfactual allocator is handed keys of pools it does not list: not counted.)
  void live_insert(core::Block* b) noexcept {
    live.insert_reserved(b);
    pool_block_entered(b->stream);
  }
  core::Block* live_erase(std::uint64_t addr) noexcept {
    core::Block* b = live.erase(addr);
    // The count first: a free where no pool block is live tests one word it holds in cache anyway.
    if (pool_live_blocks != 0 && b != nullptr && backends::is_graph_pool_key(b->stream)) [[unlikely]] pool_block_left(b->stream);
    return b;
  }
  void pool_block_entered(driver::stream_t key) noexcept;
  void pool_block_left(driver::stream_t key) noexcept;
  // The id of the listed pool `key` is a key of (0: none).
  std::uint64_t pool_of_key(driver::stream_t key) const noexcept {
    const auto it = pool_keys.find(key);
    return it == pool_keys.end() ? 0 : it->second.pool;
  }
  std::vector<CaptureRoute> capture_routes;
  // Allocations outside a capture routed into a pool (begin_pool_allocations): a stream's key -> the
  // pool's key for that stream.
  struct EagerRoute {
    std::uint64_t pool = 0;
    driver::stream_t stream = nullptr;
    driver::stream_t key = nullptr;
  };
  std::vector<EagerRoute> eager_routes;
  // capture_routes or eager_routes non-empty: allocate() asks route_to_pool (one test on the cached path).
  bool routing = false;
  void update_routing() noexcept { routing = !capture_routes.empty() || !eager_routes.empty(); }
  GraphPool* find_graph_pool(std::uint64_t id) noexcept {
    const auto it = graph_pools.find(id);
    return it == graph_pools.end() ? nullptr : &it->second;
  }
  // The pool's key for requests of `stream` (made on its first begin there), in pool `p` (made
  // first when null); the pool's use is not taken. Strong guarantee.
  std::pair<GraphPool*, driver::stream_t> pool_key_for(std::uint64_t pool, driver::stream_t stream);
  // Drops the released keys that no live block carries any more (unheld_keys), and the pools at no
  // use left without keys. O(keys queued). Invalidates GraphPool pointers of dropped pools.
  void prune_graph_pools() noexcept;
  // Drops released key `k` (no live block carries it), and its pool when that leaves it without
  // use and keys.
  void drop_released_key(std::unordered_map<driver::stream_t, PoolKey>::iterator k) noexcept;
  // prepare_capture's answers live in ctx.prepared_captures (the backend watches those streams).
  static constexpr std::size_t kMaxPreparedCaptures = 16;
  // ctx.capturing and ctx.capture_spares_legacy from capture_routes.
  void update_capture_state() noexcept {
    update_routing();
    ctx.capturing = !capture_routes.empty();
    imports->set_capturing(ctx.capturing);  // imports closed during a capture wait for its end
    ctx.capture_spares_legacy =
        ctx.capturing && std::none_of(capture_routes.begin(), capture_routes.end(), [](const CaptureRoute& r) { return r.may_block; });
  }
  // Frees of blocks other streams used (record_stream) during a capture: their events cannot be
  // recorded and queried then; pending_free already (the caller freed them), their events are
  // recorded when the last capture ends (PyTorch defers them too). Also a free whose using stream
  // captures a graph expseg was not told of: an event recorded there would be part of the capture,
  // and no query could ever wait for it (CUDA_ERROR_CAPTURED_EVENT); held until that capture has
  // ended, looked at again before an OOM (synchronize_pending_frees) and by release_cached.
  std::vector<core::Block*> frees_after_capture;
  // free_held_after_capture's copy of the held frees; end_graph_pool reserves it before the end
  // commits, so the held frees' host memory cannot fail after it.
  std::vector<core::Block*> held_scratch;
  // `pool`, when given, receives the id of the pool the stream allocates into now (0: none).
  // `eager`: set when the route is a begin_pool_allocations stream's (the stream may capture untold).
  driver::stream_t route_to_pool(driver::stream_t stream, bool make = true, std::uint64_t* pool = nullptr, bool* eager = nullptr);
  // The stream a trace names for an allocation, free or mapping on `key`: for a graph pool's key, the
  // stream whose route into the pool made it (the trace's `pool begin` names that stream; also after
  // the route has ended, while the pool lists the key), else `key`; a fork's key is traced as it is.
  // (A block restore_graph_pool_block puts back is traced on that stream too, after a `pool restore`
  // line.) A pool's blocks so read as one stream's from allocate to free in the trace and the viewers.
  driver::stream_t traced_stream(driver::stream_t key) const noexcept;
  bool stream_capturing(driver::stream_t stream) const noexcept;
  // Whether the capture of another thread's per-thread stream (`key`) may still run. Only that
  // thread can name its stream, but a per-thread stream blocks: while it captures, the legacy
  // stream's question is refused (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, the capture stays valid), so
  // an answer proves it over. Its thread has exited: over too.
  bool other_threads_capture_may_run(driver::stream_t key) const noexcept;
  void free_held_after_capture();
  // Waits for the work that the streams which used `b` queued so far, where no event can stand for it
  // (a free's recovery): each stream alone, a device synchronization only when one fails.
  void synchronize_uses(const core::Block& b);  // frees_after_capture, once no capture allocates into a pool
  [[gnu::noinline]] void free_after_uses(core::Block* b, bool in_live);  // deallocate()'s part for a block other streams used

  // Per stream, the blocks that have it recorded (record_stream) and no event for it yet: live ones
  // and frees held in frees_after_capture (validate checks it against them). release_stream looks
  // a stream up here instead of walking the live blocks. An entry that drops to zero stays (no heap
  // traffic per record and free) until release_stream forgets the stream or a sweep once the
  // entries have doubled.
  std::unordered_map<driver::stream_t, std::size_t> recorded_uses;
  static constexpr std::size_t kRecordedSweepMin = 32;
  std::size_t recorded_sweep_at = kRecordedSweepMin;
  void add_recorded_use(driver::stream_t stream);  // may throw std::bad_alloc, nothing changed
  // `b` leaves the counted blocks: its events are recorded, or it is freed with its uses cleared.
  void drop_recorded_uses(const core::Block& b) noexcept {
    for (driver::stream_t s : b.stream_uses)
      if (const auto it = recorded_uses.find(s); it != recorded_uses.end() && it->second != 0) --it->second;
  }

  // Recently freed addresses, to tell a double free from a foreign pointer (0 = empty slot).
  std::array<std::uint64_t, 64> recent_frees{};
  unsigned recent_next = 0;

  Recorder recorder;
  std::shared_ptr<const OomReport> last_oom;
  // OOM reports begun, and the number of the one last_oom holds: a report finished without the
  // lock is not published over one that began after it.
  std::uint64_t oom_reports_begun = 0;
  std::uint64_t last_oom_seq = 0;
  // Made with the allocator, for an OOM that finds no host memory even for short_oom_report's.
  std::shared_ptr<const OomReport> no_memory_report;
  std::uint64_t oom_count = 0;  // OOMs in this allocator's life (oom_dump's %n); unlike stats.num_ooms, never reset
  bool limit_changed_while_recording = false;  // the trace's events did not all run under the current limit
  std::shared_ptr<const Allocator::OomObserver> oom_observer;  // null: none
  std::vector<int> peers;  // devices granted access to everything mapped (enable_peer_access completed)
  // import_ipc opened a cuda_ipc handle: memory reached through contexts, so peers need
  // cuCtxEnablePeerAccess for it whatever the backend (expandable's own memory does not).
  bool context_imports = false;
  // Mappings of import_ipc still open: enable_peer_access grants them too.
  std::shared_ptr<detail::ImportRegistry> imports = std::make_shared<detail::ImportRegistry>();
};

namespace detail {
struct AllocatorAccess {
  // An allocator over a driver the caller built (tests: a SimDriver with faults armed).
  static std::unique_ptr<Allocator> make(const Config& config, std::shared_ptr<driver::Driver> driver);
  static driver::Driver& driver(Allocator& a) { return *a.impl_->driver; }
  static void deallocate_for_good(Allocator& a, void* ptr) { a.impl_->deallocate_for_good(ptr); }
  static backends::Backend& backend(Allocator& a) { return *a.impl_->backend; }
  // The other-backend check of later OOM reports on or off (replay and scenarios keep only the first
  // report: the check replays the whole live set, so checking every OOM of a long run was quadratic).
  static void set_oom_counterfactual(Allocator& a, bool on) {
    std::lock_guard<core::Mutex> lock(a.impl_->mu);
    a.impl_->config.oom_counterfactual = on;
  }
  // expseg_release_stream: Allocator::release_stream, and what expseg_cupy_malloc cached under the
  // stream's foreign key (backends::foreign_stream_key), which Allocator::release_stream refuses.
  static void release_stream_with_foreign_key(Allocator& a, driver::stream_t stream) {
    std::lock_guard<core::Mutex> lock(a.impl_->mu);
    a.impl_->release_stream_locked(stream, true);
  }
  // The streams the cross-stream frees keep a queue for (tests).
  static std::size_t pending_streams(Allocator& a) {
    std::lock_guard<core::Mutex> lock(a.impl_->mu);
    return a.impl_->pending.size();
  }
  // Queues the cross-stream frees' paths have looked at so far (tests: the work per call).
  static std::uint64_t queue_steps(Allocator& a) {
    std::lock_guard<core::Mutex> lock(a.impl_->mu);
    return a.impl_->queue_steps;
  }
  // Walks of the live map so far (tests: whether a call walks the live blocks).
  static std::uint64_t live_walks(Allocator& a) {
    std::lock_guard<core::Mutex> lock(a.impl_->mu);
    return a.impl_->live.walks();
  }
  // The graph pools the allocator keeps entries for (tests).
  static std::size_t graph_pool_entries(Allocator& a) {
    std::lock_guard<core::Mutex> lock(a.impl_->mu);
    return a.impl_->graph_pools.size();
  }
  // The graph pool keys the allocator keeps entries for, current and released (tests).
  static std::size_t graph_pool_key_entries(Allocator& a) {
    std::lock_guard<core::Mutex> lock(a.impl_->mu);
    return a.impl_->pool_keys.size();
  }
  // Called as an OOM report's other-backend check starts (tests).
  static void set_counterfactual_probe(Allocator& a, void (*probe)()) {
    std::lock_guard<core::Mutex> lock(a.impl_->mu);
    a.impl_->counterfactual_probe = probe;
  }
  // Whether the allocator's lock is free now (tests; takes and leaves it when it is).
  static bool lock_free(Allocator& a) {
    if (!a.impl_->mu.try_lock()) return false;
    a.impl_->mu.unlock();
    return true;
  }
};
}  // namespace detail

// Throws config_error (naming the key) when the config's values cannot work together: device:sim
// settings the simulated device cannot honour (sim_granularity > sim_capacity, a capacity or an
// expandable reservation beyond its address span). Each key alone is checked when it is parsed;
// the bounds that keep the backends' arithmetic from overflowing are checked again here, for a
// Config built in code.
void check_config(const Config& config);
// Builds the driver a config asks for (SimDriver for device:sim, CudaDriver for device:cuda), after
// check_config; a negative device index (or one the simulated host lacks) is an expseg::error.
std::unique_ptr<driver::Driver> make_driver(const Config& config, int device);
// Throws expseg::error for a stream release_stream refuses whatever the allocator holds: the
// default, legacy and per-thread streams (the C API refuses them before a device has an allocator).
void refuse_unreleasable_stream(driver::stream_t stream);

// The devices the drivers make_driver builds for `config` see (Driver::device_count), without
// building one: every simulated device index, or cuDeviceGetCount (0 when CUDA is not usable).
int visible_device_count(const Config& config);

}  // namespace expseg
