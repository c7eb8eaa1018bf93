// Fault injection everywhere: for every driver operation the backends use and every call index a
// scenario reaches, that call fails (OOM, then another error) and:
//   - the caller gets out_of_memory, or a driver_error naming the CUDA call and the error, or the
//     allocator absorbs the failure (a retry, a fallback) and the operation succeeds;
//   - validate() holds and the stats agree with the device after every step;
//   - the allocator keeps serving (the scenario goes on, then everything is freed and allocated again);
//   - nothing leaks: after destroying the allocator, the simulated device holds no reservation,
//     physical handle, mapping, cuMemAlloc allocation or event;
//   - live allocations keep their bytes (host-backed device, a pattern per allocation).
// Scenarios cover growth, reclaim under a limit, release_cached (including freeing reservations)
// and cross-stream frees (record_stream, events, synchronization).
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "test_util.hpp"

using namespace testutil;
using expseg::BackendKind;
using expseg::kAllPools;
using expseg::driver::Fault;
using expseg::driver::Op;

namespace {

constexpr Op kOps[] = {Op::reserve,     Op::free_reserve, Op::create,       Op::release,     Op::map,
                       Op::unmap,       Op::set_access,   Op::mem_alloc,    Op::mem_free,    Op::event_record,
                       Op::event_query, Op::stream_sync,  Op::stream_query};

// The CUDA calls an Op stands for (stream_sync covers the three synchronizations).
bool names_op(Op op, const std::string& call) {
  if (op == Op::stream_sync) return call == "cuStreamSynchronize" || call == "cuEventSynchronize" || call == "cuCtxSynchronize";
  if (op == Op::stream_query) return call == "cuStreamGetCaptureInfo" || call == "cuStreamGetFlags";
  return call == expseg::driver::op_name(op);
}

struct Variant {
  const char* name;
  BackendKind backend;
  const char* config;
};
const Variant kVariants[] = {
    {"split_merge", BackendKind::split_merge, ""},
    {"split_merge cupy", BackendKind::split_merge, "policy:cupy"},
    {"expandable", BackendKind::expandable, ""},
};

// Runs a scenario step by step on one allocator, with at most one fault armed, and checks each step.
class Runner {
 public:
  Runner(const Variant& v, const std::string& scenario_config, Op op, std::uint64_t nth, std::optional<Fault> fault)
      : op_(op), fault_(fault) {
    std::string conf = "sim_host_backed:true,sim_granularity:2MiB";
    if (*v.config) conf += std::string(",") + v.config;
    if (!scenario_config.empty()) conf += "," + scenario_config;
    sa_ = make_sim_allocator(sim_config(v.backend, 512 * MiB, conf));
    s1_ = sa_.sim->stream_create();
    s2_ = sa_.sim->stream_create();
    if (fault) {
      target_ = sa_.sim->calls(op) + nth;
      sa_.sim->inject_fault(op, nth, *fault);
    }
  }

  void* s1() const { return s1_; }
  void* s2() const { return s2_; }
  std::uint64_t calls(Op op) const { return sa_.sim->calls(op); }
  std::size_t surfaced() const { return surfaced_; }
  std::size_t ooms() const { return ooms_; }
  bool fired() const { return fault_ && sa_.sim->calls(op_) >= target_; }
  std::string log() const { return log_.str(); }

  // --- scenario steps (each is checked) ---
  int alloc(std::size_t bytes, void* stream = nullptr) {
    int slot = -1;
    step("allocate " + std::to_string(bytes), [&] {
      void* p = nullptr;
      try {
        p = sa_->allocate(bytes, stream);
      } catch (const expseg::out_of_memory& e) {
        ++ooms_;
        step_oom_ = true;
        CHECK(e.report().requested_bytes == bytes);
        return;
      }
      REQUIRE(p != nullptr);
      CHECK(sa_.sim->is_accessible(addr(p), bytes));
      Slot s{p, bytes, next_tag_++};
      fill(s);
      slots_.push_back(s);
      slot = static_cast<int>(slots_.size() - 1);
    });
    return slot;
  }
  void free(int slot) {
    if (slot < 0 || slots_[static_cast<std::size_t>(slot)].p == nullptr) return;
    Slot& s = slots_[static_cast<std::size_t>(slot)];
    step("free slot " + std::to_string(slot), [&] {
      CHECK(intact(s));
      sa_->deallocate(s.p);  // a failure (cuEventRecord) leaves it live: freed again at the end
      s.p = nullptr;
    });
  }
  void record(int slot, void* stream) {
    if (slot < 0 || slots_[static_cast<std::size_t>(slot)].p == nullptr) return;
    step("record_stream", [&] { sa_->record_stream(slots_[static_cast<std::size_t>(slot)].p, stream); });
  }
  void busy(void* stream, bool b) { sa_.sim->set_stream_busy(stream, b); }
  void release() {
    step("release_cached", [&] { sa_->release_cached(); });
  }
  void limit(std::size_t bytes) {
    const std::size_t old = sa_->limit();
    step("set_limit " + std::to_string(bytes), [&] {
      try {
        sa_->set_limit(bytes);
      } catch (const expseg::driver_error&) {
        CHECK_MESSAGE(sa_->limit() == old, "a failed set_limit must leave the old limit in force");
        throw;
      }
    });
  }
  // Per step: 'M' when it ended in out_of_memory, else 'o'; and the step where the fault fired.
  std::string outcomes;
  int fired_step = -1;

  // Ends the run: no more faults, everything freed, the allocator serves again, nothing leaks.
  void finish() {
    sa_.sim->clear_faults();
    sa_->set_limit(0);
    busy(nullptr, false);
    busy(s1_, false);
    busy(s2_, false);
    for (Slot& s : slots_) {
      if (s.p == nullptr) continue;
      CHECK(intact(s));
      sa_->deallocate(s.p);
      s.p = nullptr;
    }
    sa_->release_cached();
    sa_->validate();
    auto st = sa_->stats();
    CHECK(st.allocated_bytes[kAllPools].current == 0);
    CHECK(st.reserved_bytes[kAllPools].current == 0);
    CHECK(sa_.sim->live().physical_bytes == 0);
    // Keeps serving: small, large and cross-stream requests.
    void* a = sa_->allocate(3 * MiB);
    void* b = sa_->allocate(100, s1_);
    void* c = sa_->allocate(40 * MiB, s2_);
    sa_->validate();
    for (void* p : {a, b, c}) sa_->deallocate(p);
    sa_->release_cached();
    sa_.alloc.reset();
    sa_.sim->stream_destroy(s1_);
    sa_.sim->stream_destroy(s2_);
    const auto live = sa_.sim->live();
    CHECK(live.reservations == 0);
    CHECK(live.handles == 0);
    CHECK(live.mappings == 0);
    CHECK(live.mem_allocs == 0);
    CHECK(live.events == 0);
    CHECK(live.streams == 0);
    CHECK(live.physical_bytes == 0);
  }

 private:
  struct Slot {
    void* p = nullptr;
    std::size_t size = 0;
    std::uint32_t tag = 0;
  };
  // First and last 4 KiB and one word per 512 KiB: enough to see memory moved or shared.
  template <class F>
  static void words(const Slot& s, F&& f) {
    auto* w = static_cast<std::uint32_t*>(s.p);
    const std::size_t n = s.size / 4;
    for (std::size_t i = 0; i < n; i += (i < 1024 || i + 1024 >= n) ? 1 : 131072) f(w[i], static_cast<std::uint32_t>(s.tag * 2654435761u + i));
  }
  static void fill(const Slot& s) {
    words(s, [](std::uint32_t& w, std::uint32_t v) { w = v; });
  }
  static bool intact(const Slot& s) {
    bool ok = true;
    words(s, [&](std::uint32_t& w, std::uint32_t v) { ok = ok && w == v; });
    return ok;
  }

  template <class F>
  void step(const std::string& what, F&& f) {
    step_oom_ = false;
    struct Outcome {
      Runner& r;
      bool fired_before;
      ~Outcome() {
        r.outcomes.push_back(r.step_oom_ ? 'M' : 'o');
        if (!fired_before && r.fired()) r.fired_step = static_cast<int>(r.outcomes.size()) - 1;
      }
    } outcome{*this, fired()};
    log_ << what;
    const auto before = sa_->stats();
    const bool fired_before = fired();
    try {
      f();
    } catch (const expseg::driver_error& e) {
      log_ << " -> " << e.what();
      ++surfaced_;
      // Only the injected fault may surface, once, naming its call and error.
      CHECK_MESSAGE(fault_.has_value(), std::string(e.what()));
      CHECK_MESSAGE(!fired_before, "a second driver_error after the fault had fired: " << std::string(e.what()));
      CHECK_MESSAGE(names_op(op_, e.call()), "driver_error names " << std::string(e.call()) << " for a fault on " << std::string(expseg::driver::op_name(op_)));
      if (fault_) {
        CHECK(e.code_name() == (*fault_ == Fault::out_of_memory ? "CUDA_ERROR_OUT_OF_MEMORY" : "CUDA_ERROR_UNKNOWN"));
        CHECK(e.is_out_of_memory() == (*fault_ == Fault::out_of_memory));
      }
      CHECK(std::string(e.what()).find(e.call()) != std::string::npos);
      CHECK(std::string(e.what()).find("fault injected") != std::string::npos);
    } catch (const std::exception& e) {
      FAIL_CHECK("step '" << what << "' threw " << std::string(e.what()));
    }
    log_ << "\n";
    try {
      sa_->validate();
    } catch (const std::exception& e) {
      FAIL_CHECK("validate() after '" << what << "': " << std::string(e.what()));
    }
    const auto after = sa_->stats();
    std::int64_t live = 0;
    for (const Slot& s : slots_) live += s.p != nullptr;
    CHECK(after.allocation[kAllPools].current == live);
    CHECK(after.allocated_bytes[kAllPools].current <= after.active_bytes[kAllPools].current);
    CHECK(after.active_bytes[kAllPools].current <= after.reserved_bytes[kAllPools].current);
    CHECK(static_cast<std::size_t>(after.reserved_bytes[kAllPools].current) == sa_.sim->live().physical_bytes);
    const std::size_t lim = sa_->limit();
    if (lim != 0 && after.reserved_bytes[kAllPools].current > before.reserved_bytes[kAllPools].current)
      CHECK(static_cast<std::size_t>(after.reserved_bytes[kAllPools].current) <= lim);
    for (const Slot& s : slots_)
      if (s.p != nullptr) CHECK(intact(s));
  }

  Op op_;
  std::optional<Fault> fault_;
  std::uint64_t target_ = 0;
  SimAllocator sa_;
  void* s1_ = nullptr;
  void* s2_ = nullptr;
  std::vector<Slot> slots_;
  std::uint32_t next_tag_ = 1;
  std::size_t surfaced_ = 0;
  std::size_t ooms_ = 0;
  bool step_oom_ = false;
  std::ostringstream log_;
};

struct Scenario {
  const char* name;
  const char* config;
  std::function<void(Runner&)> run;
};

const Scenario kScenarios[] = {
    {"growth", "",
     [](Runner& r) {
       int a = r.alloc(1 * MiB);
       int b = r.alloc(3 * MiB);
       int c = r.alloc(9 * MiB);
       int d = r.alloc(24 * MiB);
       r.free(b);
       int e = r.alloc(60 * MiB);
       int f = r.alloc(700);
       r.free(a);
       r.free(d);
       int g = r.alloc(30 * MiB);
       for (int s : {c, e, f, g}) r.free(s);
     }},
    {"reclaim under a limit", "limit:64MiB",
     [](Runner& r) {
       int a = r.alloc(20 * MiB);
       int b = r.alloc(20 * MiB);
       int c = r.alloc(20 * MiB);
       r.free(b);
       int d = r.alloc(30 * MiB);  // needs b's memory (and more) under the limit
       r.free(a);
       int e = r.alloc(12 * MiB, r.s1());  // another stream: memory moves only through a sync
       r.free(c);
       r.free(d);
       int f = r.alloc(50 * MiB);
       r.limit(32 * MiB);  // below what is held: cached memory goes back
       r.free(e);
       r.free(f);
       int g = r.alloc(28 * MiB);
       r.free(g);
     }},
    {"an idle handle moves under a limit", "limit:128MiB",
     [](Runner& r) {
       // At the limit with 4-frame handles (limit/16): c needs four new frames, and a's idle
       // 4-frame handle moves there (unmap, map, access) instead of being released for a new one.
       int a = r.alloc(8 * MiB);
       int b1 = r.alloc(118 * MiB);
       int b2 = r.alloc(2 * MiB);
       r.free(a);
       r.free(b2);
       int c = r.alloc(10 * MiB);
       r.free(b1);
       int d = r.alloc(8 * MiB, r.s1());  // another stream's arena: a's old place moves again
       r.free(c);
       r.free(d);
     }},
    {"release_cached", "expandable_va_size:32MiB",
     [](Runner& r) {
       int a = r.alloc(4 * MiB);
       int b = r.alloc(40 * MiB);  // larger than a segment's VA: a segment of its own
       int c = r.alloc(8 * MiB, r.s1());
       r.free(b);
       r.release();  // unmaps, releases, and frees the empty segment's reservation
       int d = r.alloc(50 * MiB);
       r.free(a);
       r.free(c);
       r.free(d);
       r.release();
       int e = r.alloc(2 * MiB);
       r.free(e);
     }},
    {"cross-stream frees", "limit:96MiB",
     [](Runner& r) {
       int a = r.alloc(6 * MiB);
       r.record(a, r.s1());
       r.busy(r.s1(), true);
       r.free(a);  // cuEventRecord on s1; the block waits
       int b = r.alloc(6 * MiB);  // cuEventQuery: not done, so not a's block
       r.busy(r.s1(), false);
       int c = r.alloc(1 * MiB);  // cuEventQuery: done, a's block is free again
       int d = r.alloc(30 * MiB, r.s2());
       r.record(d, r.s1());
       r.record(d, nullptr);
       r.busy(r.s1(), true);
       r.free(d);
       r.busy(nullptr, true);  // work queued on the default stream
       r.free(b);
       int e = r.alloc(70 * MiB, r.s2());  // tight: reclaim synchronizes before memory moves
       r.release();  // cuEventSynchronize for the pending free
       r.busy(r.s1(), false);
       r.busy(nullptr, false);
       for (int s : {c, e}) r.free(s);
       r.release();
     }},
};

struct Totals {
  std::size_t runs = 0, fired = 0, surfaced = 0, absorbed = 0, ooms = 0;
};

}  // namespace

TEST_SUITE("faults") {

TEST_CASE("faults: every call of every driver operation fails once, on both backends, and nothing leaks") {
  Totals total;
  std::set<std::string> reached;  // "variant op" pairs that some scenario reached
  for (const Variant& v : kVariants) {
    for (const Scenario& sc : kScenarios) {
      INFO("variant: " << std::string(v.name));
      INFO("scenario: " << std::string(sc.name));
      // A clean run first: it must pass, and it says how often each operation is called.
      std::map<Op, std::uint64_t> counts;
      std::string clean_outcomes;
      {
        Runner clean(v, sc.config, Op::create, 1, std::nullopt);
        sc.run(clean);
        for (Op op : kOps) counts[op] = clean.calls(op);
        CHECK(clean.surfaced() == 0);
        clean_outcomes = clean.outcomes;
        clean.finish();
      }
      for (Op op : kOps) {
        const std::uint64_t n = counts[op];
        if (n > 0) reached.insert(std::string(v.name) + " " + expseg::driver::op_name(op));
        for (std::uint64_t i = 1; i <= n; ++i) {
          for (Fault fault : {Fault::out_of_memory, Fault::error}) {
            const std::string op_name = expseg::driver::op_name(op);
            CAPTURE(op_name);
            CAPTURE(i);
            CAPTURE(n);
            const char* fault_name = fault == Fault::out_of_memory ? "OOM" : "error";
            INFO("fault: " << std::string(fault_name));
            Runner r(v, sc.config, op, i, fault);
            sc.run(r);
            INFO("steps:\n" << r.log());
            CHECK(r.fired());
            // A CUDA_ERROR_UNKNOWN is not an out-of-memory: the step it fired in may end in
            // out_of_memory only where the clean run's did too.
            if (fault == Fault::error && r.fired_step >= 0 && r.outcomes[static_cast<std::size_t>(r.fired_step)] == 'M')
              CHECK_MESSAGE(clean_outcomes[static_cast<std::size_t>(r.fired_step)] == 'M',
                            "an injected CUDA_ERROR_UNKNOWN reached the caller as out_of_memory");
            ++total.runs;
            total.fired += r.fired();
            total.surfaced += r.surfaced();
            total.absorbed += r.fired() && r.surfaced() == 0;
            total.ooms += r.ooms();
            r.finish();
          }
        }
      }
    }
  }
  MESSAGE("fault injection: " << total.runs << " runs, " << total.fired << " faults fired, " << total.surfaced
                              << " reached the caller as driver_error, " << total.absorbed << " absorbed or turned into OOM, "
                              << total.ooms << " OOMs");
  // Every operation each backend uses was reached by some scenario.
  for (const char* op : {"cuMemAlloc", "cuMemFree", "cuEventRecord", "cuEventQuery", "cuStreamSynchronize"}) {
    INFO("op: " << std::string(op));
    CHECK(reached.contains(std::string("split_merge ") + op));
    CHECK(reached.contains(std::string("split_merge cupy ") + op));
  }
  for (const char* op : {"cuMemAddressReserve", "cuMemAddressFree", "cuMemCreate", "cuMemRelease", "cuMemMap", "cuMemUnmap",
                         "cuMemSetAccess", "cuEventRecord", "cuEventQuery", "cuStreamSynchronize"}) {
    INFO("op: " << std::string(op));
    CHECK(reached.contains(std::string("expandable ") + op));
  }
}

TEST_CASE("faults: a failing cuEventRecord leaves the block live, and the free can be retried") {
  for (const Variant& v : kVariants) {
    INFO("variant: " << std::string(v.name));
    auto sa = make_sim_allocator(sim_config(v.backend, 1 * GiB, v.config));
    void* s1 = sa.sim->stream_create();
    void* p = sa->allocate(5 * MiB);
    sa->record_stream(p, s1);
    const auto before = sa->stats();
    sa.sim->inject_fault(Op::event_record, 1, Fault::error);
    try {
      sa->deallocate(p);
      FAIL("deallocate did not throw");
    } catch (const expseg::driver_error& e) {
      CHECK(e.call() == "cuEventRecord");
      CHECK(e.code_name() == "CUDA_ERROR_UNKNOWN");
    }
    const auto after = sa->stats();
    CHECK(after.allocation[kAllPools].current == before.allocation[kAllPools].current);
    CHECK(after.allocated_bytes[kAllPools].current == before.allocated_bytes[kAllPools].current);
    sa->validate();
    sa->deallocate(p);  // the retry succeeds
    sa->validate();
    sa.alloc.reset();
    sa.sim->stream_destroy(s1);
    CHECK(sa.sim->live().events == 0);
  }
}

TEST_CASE("faults: a failing cuEventQuery fails the allocation, and the pending free completes later") {
  for (const Variant& v : kVariants) {
    INFO("variant: " << std::string(v.name));
    auto sa = make_sim_allocator(sim_config(v.backend, 1 * GiB, v.config));
    void* s1 = sa.sim->stream_create();
    void* p = sa->allocate(5 * MiB);
    sa->record_stream(p, s1);
    sa->deallocate(p);
    sa.sim->inject_fault(Op::event_query, 1, Fault::error);
    try {
      (void)sa->allocate(1 * MiB);
      FAIL("allocate did not throw");
    } catch (const expseg::driver_error& e) {
      CHECK(e.call() == "cuEventQuery");
    }
    sa->validate();
    CHECK(sa->stats().allocation[kAllPools].current == 0);
    void* q = sa->allocate(1 * MiB);  // queries again: the free completes
    CHECK(sa->stats().active_bytes[kAllPools].current == sa->stats().allocated_bytes[kAllPools].current);
    sa->deallocate(q);
    sa.alloc.reset();
    sa.sim->stream_destroy(s1);
    CHECK(sa.sim->live().events == 0);
  }
}

}  // TEST_SUITE

// A capture question the driver fails (not for a stream gone) says nothing about the capture: a
// capture expseg was told of keeps its requests in its graph pool, and end_graph_pool refuses to
// guess that it ended. Was: the request was served from the stream's ordinary cache, which an eager
// request got after the capture while the graph replayed into it; and end_graph_pool dropped the
// route of a capture still running.
TEST_CASE("faults: a failed capture question keeps a told capture's requests in its pool, and end_graph_pool refuses") {
  for (BackendKind b : {BackendKind::split_merge, BackendKind::expandable}) {
    CAPTURE(b);
    auto s = make_sim_allocator(sim_config(b, 1024 * MiB));
    void* cs = s.sim->stream_create();
    s.sim->capture_begin(cs);
    s->begin_graph_pool(7, cs);
    s.sim->inject_fault(Op::stream_query, 1, Fault::error);
    void* p = s->allocate(4 * MiB, cs);
    void* q = s->allocate(4 * MiB, cs);
    const auto blocks = s->graph_pool_blocks(7);
    CHECK(blocks.size() == 2);
    CHECK(std::count_if(blocks.begin(), blocks.end(), [&](const auto& x) { return x.first == addr(p); }) == 1);
    // The capture still runs: end_graph_pool refuses, its question failed or not, and keeps the route.
    s.sim->inject_fault(Op::stream_query, 1, Fault::error);
    CHECK_THROWS_AS(s->end_graph_pool(7), expseg::driver_error);
    CHECK_THROWS_AS(s->end_graph_pool(7), expseg::error);  // "still running", as without a fault
    void* t = s->allocate(MiB, cs);
    CHECK(s->graph_pool_blocks(7).size() == 3);
    s->validate();
    const auto g = s.sim->capture_end(cs);
    s->end_graph_pool(7);
    s->deallocate(p);
    s->deallocate(q);
    s->deallocate(t);
    void* r = s->allocate(4 * MiB, cs);  // eager, after the capture: not the graph's memory
    CHECK(r != p);
    CHECK(r != q);
    s->deallocate(r);
    s.sim->graph_destroy(g);
    s->release_graph_pool(7);
    s->validate();
  }
}

// split_merge's optional clean-up before a new segment (an exited thread's cache, garbage collection):
// a cuMemFree refused there does not fail a request the limit and the device have room for. Was: the
// request failed with that driver_error.
TEST_CASE("faults: split_merge serves a request whose optional clean-up was refused by cuMemFree") {
  {
    auto c = sim_config(BackendKind::split_merge, 1024 * MiB, "garbage_collection_threshold:0.5");
    c.limit = expseg::Limit{200 * MiB, 0.0};
    auto s = make_sim_allocator(c);
    void* a = s->allocate(60 * MiB);
    void* b = s->allocate(60 * MiB);
    s->deallocate(a);
    s->deallocate(b);
    s.sim->inject_fault(Op::mem_free, 1, Fault::error);
    void* p = nullptr;
    CHECK_NOTHROW(p = s->allocate(70 * MiB));
    CHECK(p != nullptr);
    s->validate();
    s->deallocate(p);
  }
  {
    auto s = make_sim_allocator(sim_config(BackendKind::split_merge, 1024 * MiB));
    void* per_thread = reinterpret_cast<void*>(0x2);  // cudaStreamPerThread
    std::thread([&] { s->deallocate(s->allocate(30 * MiB, per_thread)); }).join();
    s.sim->inject_fault(Op::mem_free, 1, Fault::error);  // the exited thread's cached segment
    void* p = nullptr;
    CHECK_NOTHROW(p = s->allocate(50 * MiB));
    CHECK(p != nullptr);
    s->validate();
    s->deallocate(p);
  }
}

// Expandable's optional clean-up before a growth: an exited thread's cache (reap_retired) and,
// without a limit, the reclaim of idle memory before a new peak. A refused unmap there does not
// fail a request the device has room for (as split_merge's, above). Was: the request failed with
// that driver_error, and the reclaim's case had given back memory before it threw.
TEST_CASE("faults: expandable serves a request whose optional clean-up was refused by cuMemUnmap") {
  {
    auto s = make_sim_allocator(sim_config(BackendKind::expandable, 1024 * MiB));
    void* per_thread = reinterpret_cast<void*>(0x2);  // cudaStreamPerThread
    std::thread([&] { s->deallocate(s->allocate(30 * MiB, per_thread)); }).join();
    s.sim->inject_fault(Op::unmap, 1, Fault::error);  // the exited thread's idle handle
    void* p = nullptr;
    CHECK_NOTHROW(p = s->allocate(50 * MiB));
    CHECK(p != nullptr);
    s->validate();
    s->deallocate(p);
    s->release_cached();
    CHECK(s->stats().reserved_bytes[kAllPools].current == 0);
    s->validate();
  }
  {
    auto s = make_sim_allocator(sim_config(BackendKind::expandable, 1024 * MiB));  // no limit
    void* a = s->allocate(20 * MiB);
    void* x = s->allocate(2 * MiB);
    void* b = s->allocate(20 * MiB);
    void* y = s->allocate(40 * MiB);
    s->deallocate(a);
    s->deallocate(b);
    s.sim->inject_fault(Op::unmap, 2, Fault::error);  // the reclaim's first unmap goes, its second fails
    void* p = nullptr;
    CHECK_NOTHROW(p = s->allocate(70 * MiB));
    CHECK(p != nullptr);
    s->validate();
    for (void* q : {x, y, p}) s->deallocate(q);
    s->release_cached();
    CHECK(s->stats().reserved_bytes[kAllPools].current == 0);
    s->validate();
  }
}

// A capture expseg was not told of (PyTorch's CUDAPluggableAllocator passes none on) whose stream's
// capture question fails: asked again, and failing twice read as capturing, so expseg neither
// synchronizes the stream nor unmaps its idle memory. Was: read as "not capturing" at the first
// failure, the stream was synchronized, which the driver refused and which invalidated the capture
// (cuStreamEndCapture: 901). `twice`: the question fails on two calls in a row.
TEST_CASE("faults: a failed capture question does not let expandable synchronize an untold capture's stream") {
  for (int variant = 0; variant < 8; ++variant) {
    const bool twice = variant >= 4;
    const std::uint64_t call = 1 + static_cast<std::uint64_t>(variant % 4);
    CAPTURE(twice);
    CAPTURE(call);
    auto s = make_sim_allocator(sim_config(BackendKind::expandable, 512 * MiB, "limit:64MiB"));
    void* s1 = s.sim->stream_create();
    s->deallocate(s->allocate(40 * MiB, s1));  // 40 MiB idle in s1's arena
    s.sim->capture_begin(s1);
    s.sim->inject_fault(Op::stream_query, call, Fault::error);
    if (twice) s.sim->inject_fault(Op::stream_query, call + 1, Fault::error);
    CHECK_THROWS_AS(s->allocate(50 * MiB), expseg::out_of_memory);  // it would need s1's idle memory
    s->validate();
    expseg::driver::graph_t g = nullptr;
    CHECK_NOTHROW(g = s.sim->capture_end(s1));  // the capture is still valid
    s.sim->graph_destroy(g);
    s.sim->clear_faults();
    void* p = s->allocate(50 * MiB);  // the capture over, s1's idle memory moves
    s->deallocate(p);
    s->validate();
  }
  {
    auto s = make_sim_allocator(sim_config(BackendKind::expandable, 512 * MiB, "limit:64MiB"));
    void* s1 = s.sim->stream_create();
    s->deallocate(s->allocate(40 * MiB, s1));
    s.sim->capture_begin(s1);
    s.sim->inject_fault(Op::stream_query, 1, Fault::error);
    s.sim->inject_fault(Op::stream_query, 2, Fault::error);
    CHECK_NOTHROW(s->release_cached());  // s1's idle memory stays: its stream may be capturing
    CHECK(s->stats().reserved_bytes[kAllPools].current == 40 * static_cast<std::int64_t>(MiB));
    s->validate();
    expseg::driver::graph_t g = nullptr;
    CHECK_NOTHROW(g = s.sim->capture_end(s1));
    s.sim->graph_destroy(g);
    s->release_cached();
    CHECK(s->stats().reserved_bytes[kAllPools].current == 0);
  }
}
