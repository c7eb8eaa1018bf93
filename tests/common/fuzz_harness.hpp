// Model-based fuzzing of the Allocator on the host-backed simulated device.
//
// A Harness owns an allocator over a SimDriver (host-backed: allocations hold real bytes) seen
// through a spy driver, and a model of what the allocator must hold. It runs a randomized sequence
// of operations -- allocate of skewed sizes (mostly small, some huge, some absurd), free,
// record_stream + free with busy streams, set_stream_busy toggles, release_cached, set_limit,
// snapshot/stats reads, invalid pointers, and injected driver faults; with Options::graphs also CUDA
// graph captures into graph pools (Allocator::begin_graph_pool), streams a capture forks to, graph
// launches and destroys -- and
// after every operation checks:
//   - validate() holds;
//   - the model agrees: the live set (allocation count, requested bytes, snapshot blocks), pending
//     cross-stream frees, the stats identities (allocated <= active <= reserved; reserved <= limit
//     whenever the operation grew it; reserved == the simulated device's physical bytes; CuPy's
//     total == used + free; peaks >= currents; num_ooms counts the OOMs the caller saw);
//   - every live allocation holds the pattern written when it was allocated (checked at free, when
//     it becomes reused, and periodically for all), so no two live blocks overlap and no data moves
//     when memory is unmapped and mapped again;
//   - the stream contract: a block freed while a stream may still use it (record_stream, or a busy
//     allocation stream) is handed to another stream, completed as a pending free, or unmapped only
//     after that stream's work is known complete (the spy driver sees every event query and sync);
//     independently, the simulated device is told of the work busy streams queue on live blocks
//     (SimDriver::queue_use) and reports an unmap under work not yet complete (SimDriver::hazards);
//   - no driver call breaks a CUDA rule (the simulated device reports those as errors), and unmap /
//     cuMemFree never take memory a live or pending block lies in;
//   - graphs: a capture's allocations (each given a captured memset of its own value) stay apart
//     from every block not of the graph's pool while the graph lives; a launch writes only memory
//     of its pool (every other live block keeps its pattern, the launched graph's live blocks hold
//     its values); capture_end never fails (expseg made no call that invalidates the capture); a
//     block a capture's stream freed goes to no other stream of that capture (its forks: a replay
//     runs the branches side by side) while the capture lasts;
//     release_cached and set_limit during a capture throw expseg::error and change nothing;
//   - errors are the documented ones: out_of_memory for allocate, driver_error (naming the cu* call)
//     only when an injected fault fired during the operation, invalid_pointer for bad pointers; the
//     allocator's live set is unchanged after any throw and it keeps serving.
// At the end, finish() frees everything (or destroys the allocator with allocations still live) and
// checks that every reservation, handle, mapping, driver allocation and event went back.
//
// The decisions come from a Source: a seeded generator (unit and stress suites) or the bytes of a
// libFuzzer input (tests/fuzz/fuzz_allocator.cpp). A broken check throws fuzz::Failure whose message
// names the option set, the operation index and the recent operations (with the addresses allocate
// returned). A seed replays exactly: the simulated device's addresses depend only on the calls made
// (sim_driver.hpp), and Counters::digest tells whether two runs were the same.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "driver/driver.hpp"
#include "expseg/allocator.hpp"
#include "expseg/config.hpp"

namespace expseg::driver {
class SimDriver;
}

namespace fuzz {

class Failure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Where decisions come from.
class Source {
 public:
  virtual ~Source() = default;
  virtual bool exhausted() const = 0;
  virtual std::uint64_t next64() = 0;
  std::uint64_t below(std::uint64_t n) { return n ? next64() % n : 0; }
  bool chance(unsigned percent) { return below(100) < percent; }
  double unit() { return static_cast<double>(next64() >> 11) * 0x1.0p-53; }
};

// splitmix64, as expseg::ScenarioRng.
class RngSource final : public Source {
 public:
  explicit RngSource(std::uint64_t seed) : state_(seed) {}
  bool exhausted() const override { return false; }
  std::uint64_t next64() override;

 private:
  std::uint64_t state_;
};

// Reads decisions from fuzzer bytes: each decision takes the next two bytes; past the end
// everything reads as 0 and exhausted() is true.
class ByteSource final : public Source {
 public:
  ByteSource(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  bool exhausted() const override { return pos_ >= size_; }
  std::uint64_t next64() override;
  std::uint8_t byte() { return pos_ < size_ ? data_[pos_++] : 0; }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t pos_ = 0;
};

struct Options {
  expseg::BackendKind backend = expseg::BackendKind::expandable;
  expseg::PoolPolicy policy = expseg::PoolPolicy::pytorch;
  std::size_t capacity = std::size_t{256} << 20;     // simulated device memory
  std::size_t granularity = std::size_t{64} << 10;   // small: many frames, little host memory
  std::string extra_config;                          // more `key:value,...` for the Config
  bool faults = true;                                // arm injected driver faults
  bool multi_faults = false;                         // arm a fault while another is still pending
  unsigned validate_every = 1;                       // validate() after every n-th operation
  unsigned full_check_every = 64;                    // check every live pattern and the snapshot
  std::size_t max_live = 192;                        // above this many live allocations, free more
  unsigned streams = 3;                              // streams besides the default stream
  bool graphs = false;                               // CUDA graph captures, graph pools, launches
  bool verbose = false;                              // print every operation to stderr

  std::string describe() const;  // the options as text (for messages and replays)
};

// A few option sets covering both backends and their policies; the stress suite and the unit suite
// iterate over them, and `preset(i)` is how a failing run is named for replay.
std::size_t preset_count();
Options preset(std::size_t index);
// Options drawn from fuzzer bytes.
Options options_from(ByteSource& src);

struct Counters {
  std::uint64_t ops = 0;
  std::uint64_t allocs = 0;
  std::uint64_t frees = 0;
  std::uint64_t pending_frees = 0;
  std::uint64_t ooms = 0;
  std::uint64_t fragmentation_ooms = 0;
  std::uint64_t driver_errors = 0;   // driver_error seen by the caller
  std::uint64_t faults_armed = 0;
  std::uint64_t faults_fired = 0;
  std::uint64_t faults_absorbed = 0;  // fired, yet the operation succeeded (retry, fallback)
  std::uint64_t invalid_pointer_checks = 0;
  std::uint64_t release_cached = 0;
  std::uint64_t streams_released = 0;  // release_stream calls that succeeded
  std::uint64_t streams_refused = 0;   // and that were refused (blocks in use)
  std::uint64_t limit_changes = 0;
  std::uint64_t full_checks = 0;
  std::uint64_t bytes_checked = 0;
  std::uint64_t unmaps = 0;          // driver unmaps / cuMemFree seen (memory really moved)
  std::uint64_t busy_uses = 0;       // uses of live blocks by busy streams told to the simulated device
  std::uint64_t captures = 0;        // graph captures ended (kept graphs)
  std::uint64_t capture_allocs = 0;  // allocations made into a graph pool during a capture
  std::uint64_t forks = 0;           // streams a capture forked to (joined the capture)
  std::uint64_t fork_allocs = 0;     // allocations made on such a stream during the capture
  std::uint64_t warmup_allocs = 0;   // allocations routed into a graph pool outside a capture
  std::uint64_t restores = 0;        // blocks freed and restored where they were (restore_graph_pool_block)
  std::uint64_t launches = 0;        // graph launches
  std::uint64_t refused_in_capture = 0;  // release_cached/set_limit refused while capturing
  // FNV-1a of every operation's text and every address allocate returned: equal digests mean the
  // same run (a replay reproduces it only if the simulated device hands out the same addresses).
  std::uint64_t digest = 0xcbf29ce484222325ULL;
  void add(const Counters& o);
  std::string to_string() const;
};

class Spy;

class Harness {
 public:
  explicit Harness(const Options& options);
  ~Harness();
  Harness(const Harness&) = delete;
  Harness& operator=(const Harness&) = delete;

  // One randomized operation drawn from `src`, then the checks.
  void step(Source& src);
  // Operations until `max_ops` ran or the source is exhausted.
  void run(Source& src, std::size_t max_ops);
  // Ends the run: frees everything (or, if `free_all` is false, destroys the allocator with live
  // allocations) and checks that every driver resource went back. The harness is done afterwards.
  void finish(bool free_all = true);

  const Counters& counters() const noexcept { return counters_; }
  std::size_t live_allocations() const noexcept { return live_.size(); }  // in the model, now
  const Options& options() const noexcept { return options_; }
  expseg::Allocator& allocator() { return *alloc_; }

 private:
  friend class Spy;
  struct Live {
    std::uint64_t addr = 0;
    std::size_t size = 0;
    void* stream = nullptr;
    std::uint64_t tag = 0;
    std::vector<void*> uses;  // record_stream streams other than the allocation stream
    // Allocated by a capture into a graph pool: no pattern of the harness, the capture's memset
    // instead. `pool` is the pool's instance (a pool id released and begun again is a new one).
    std::uint64_t pool = 0;
    std::uint64_t graph = 0;      // the graph whose capture allocated it
    std::uint32_t value = 0;      // its captured memset's value
    bool known = false;           // the block holds `value` (its graph launched, nothing wrote it since)
  };
  struct Graph {
    std::uint64_t id = 0;         // the harness's number
    std::uint64_t pool_id = 0;    // begin_graph_pool's id
    std::uint64_t pool = 0;       // the pool's instance
    void* stream = nullptr;       // the capturing stream
    std::vector<void*> forks;     // the streams the capture forked to (until it ends)
    expseg::driver::graph_t exec = nullptr;
    std::vector<std::pair<std::uint64_t, std::size_t>> writes;  // captured memsets: address, bytes
    // Blocks the capture allocated and freed while it lasted, with the stream (branch) that
    // allocated them: a replay runs the branches side by side, so no other branch may get them.
    struct Freed {
      std::uint64_t addr = 0;
      std::size_t size = 0;
      void* stream = nullptr;
    };
    std::vector<Freed> freed;
  };
  struct Pending {
    Live block;
    std::uint64_t tick = 0;                // when it was freed (events recorded)
    std::vector<void*> busy;               // the uses that were busy then
    bool stream_busy = false;              // the allocation stream was busy then
  };
  struct Hazard {  // memory freed on a busy stream: may be reused only on that stream until it completes
    std::size_t size = 0;
    void* stream = nullptr;
    std::uint64_t tick = 0;
  };

  // Operations.
  void op_allocate(Source& src, bool on_capture = false);
  void op_free(Source& src);
  void op_record_stream(Source& src);
  void op_toggle_busy(Source& src);
  void op_release_cached();
  void op_release_stream(Source& src);
  bool free_live(std::map<std::uint64_t, Live>::iterator it);
  void op_set_limit(Source& src);
  void op_fault(Source& src);
  void op_invalid(Source& src);
  void op_reset_stats(Source& src);
  void op_graph(Source& src);
  void begin_capture(Source& src);
  void end_capture(std::size_t index);
  void fork_capture(Source& src);
  Graph* capture_on(void* stream);
  void launch_graph(Source& src);
  // CUDA graph trees' calls into a graph's pool outside a capture: a warm-up's allocations routed
  // into it (begin_pool_allocations), a block freed and restored where it was
  // (restore_graph_pool_block), and the pool's listing checked against the model.
  void warm_up(Source& src);
  void check_pool_listing(std::uint64_t pool_id);
  void destroy_graph(std::size_t index);
  void refused_in_capture(bool set_limit, std::size_t v);
  void check_graph_separation();
  void check_pool_value(const Live& l, const char* when);
  void full_check();

  // Checks.
  void after_op(const char* name);
  void check_stats();
  void resolve_pending();
  void check_pattern(const Live& l, const char* when, bool light = false);
  void write_pattern(const Live& l);
  void check_new_block(std::uint64_t addr, std::size_t size, void* stream);
  void on_driver_exception(const char* op, const std::exception& e);
  bool known_complete(void* stream, std::uint64_t tick) const;
  void queue_use(void* stream, const Live& l);
  void prune_hazards();
  std::size_t pick_size(Source& src);
  void* pick_stream(Source& src);
  [[noreturn]] void fail(const std::string& what);
  void note(const std::string& op);
  void note_result(std::uint64_t addr);
  void mix(const std::string& text);

  // Called by the spy driver.
  void spy_unmap(const char* call, std::uint64_t addr, std::size_t bytes, bool check_hazards);
  void spy_error(const std::string& what);

  Options options_;
  std::shared_ptr<expseg::driver::SimDriver> sim_;
  std::shared_ptr<Spy> spy_;
  std::unique_ptr<expseg::Allocator> alloc_;
  std::vector<void*> streams_;             // [0] is the default stream (nullptr)
  std::map<void*, bool> busy_;
  std::map<void*, std::uint64_t> complete_upto_;  // work queued on the stream up to this tick is done

  std::map<std::uint64_t, Live> live_;
  std::map<std::uint64_t, Pending> pending_;
  std::multimap<std::uint64_t, Hazard> hazards_;
  std::deque<std::uint64_t> freed_;         // recently freed addresses (for double frees)
  std::size_t live_requested_ = 0;
  std::uint64_t next_tag_ = 1;
  std::uint64_t tick_ = 1;
  std::int64_t ooms_seen_ = 0;
  std::int64_t reserved_before_ = 0;
  std::size_t limit_ = 0;
  // The stats at the last reset_accumulated_stats (zeros before any): a Stat's allocated - freed is
  // its current value less the current value then, its totals having restarted at 0 (as PyTorch's).
  expseg::Stats accumulated_base_{};

  // Graphs: the captures underway (up to two at once, on different streams into different pools;
  // exec null), the graphs kept after theirs.
  std::vector<Graph> captures_;
  std::vector<Graph> graphs_;
  std::map<std::uint64_t, std::uint64_t> pool_instance_;  // live pool id -> its instance
  std::map<std::uint64_t, std::uint64_t> pool_uses_;      // live pool id -> begins not yet released
  std::map<std::uint64_t, std::uint64_t> id_of_instance_;  // every pool instance -> its pool id
  std::uint64_t next_graph_ = 1;
  std::uint64_t next_pool_instance_ = 1;

  std::vector<std::pair<expseg::driver::Op, std::uint64_t>> armed_;  // (op, call number it fails)
  bool driver_threw_ = false;               // an injected fault fired during this operation
  std::string spy_failure_;
  Counters counters_;
  std::deque<std::string> history_;
  std::string op_text_;
  bool finished_ = false;
};

// Runs `ops` operations of preset-like `options` from `seed`, then finish(). Throws Failure whose
// message says how to replay the run.
Counters run_seed(const Options& options, std::uint64_t seed, std::size_t ops, const std::string& replay_hint = "");

}  // namespace fuzz
