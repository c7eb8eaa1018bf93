// A free's event recorded into a capture that another thread began on the using stream between the
// free's check and its record (a race a review found with ThreadSanitizer probes: 1 run in 12).
// Was: the event stayed "last recorded in a capture", so every later query and synchronization
// failed with CUDA_ERROR_CAPTURED_EVENT: each allocation while frees were pending threw
// driver_error, release_cached and set_limit threw after all threads had finished, and each query
// invalidated the captures underway. The drivers below begin (and end) the capture inside
// cuEventRecord, where the other thread's cuStreamBeginCapture lands in that race.
#include <doctest/doctest.h>

#include <memory>

#include "allocator_impl.hpp"
#include "forwarding_driver.hpp"
#include "test_util.hpp"

using namespace testutil;
using expseg::BackendKind;
using expseg::kAllPools;

namespace {

class CaptureAtRecord final : public ForwardingDriver {
 public:
  using ForwardingDriver::ForwardingDriver;
  stream_t target = nullptr;  // the next event recorded on it lands in a capture begun just before
  bool end_at_once = false;   // and the capture ends right after the record (before any check)
  void event_record(event_t e, stream_t s) override {
    if (target == nullptr || s != target) {
      ForwardingDriver::event_record(e, s);
      return;
    }
    target = nullptr;
    sim().capture_begin(s);
    ForwardingDriver::event_record(e, s);
    if (end_at_once) sim().graph_destroy(sim().capture_end(s));
  }
};

std::int64_t requested(const expseg::Allocator& a) { return a.stats().requested_bytes[kAllPools].current; }

}  // namespace

TEST_SUITE("regression-streams") {

TEST_CASE("regression: a free whose event a capture begun meanwhile took waits for the capture's end, then completes") {
  for (BackendKind b : {BackendKind::split_merge, BackendKind::expandable}) {
    for (const bool end_at_once : {false, true}) {
      CAPTURE(expseg::to_string(b));
      CAPTURE(end_at_once);
      auto drv = std::make_shared<CaptureAtRecord>(std::make_shared<expseg::driver::SimDriver>());
      auto a = expseg::detail::AllocatorAccess::make(sim_config(b, 4 * GiB), drv);
      void* cs = drv->sim().stream_create();
      void* p = a->allocate(MiB);
      a->record_stream(p, cs);
      drv->target = cs;
      drv->end_at_once = end_at_once;
      a->deallocate(p);  // its event on cs lands in the capture
      CHECK(requested(*a) == static_cast<std::int64_t>(MiB));  // pending
      // Allocations meanwhile neither fail nor break the capture; the free stays pending while the
      // capture lasts.
      void* q = nullptr;
      CHECK_NOTHROW(q = a->allocate(2 * MiB));
      CHECK_NOTHROW(a->deallocate(q));
      if (!end_at_once) {
        CHECK(requested(*a) == static_cast<std::int64_t>(MiB));
        CHECK_NOTHROW(a->release_cached());  // its synchronization skips the free, breaks nothing
        expseg::driver::graph_t g = nullptr;
        CHECK_NOTHROW(g = drv->sim().capture_end(cs));  // not invalidated
        drv->sim().graph_destroy(g);
      }
      // After the capture: the event is recorded again and the free completes.
      CHECK_NOTHROW(q = a->allocate(2 * MiB));
      CHECK_NOTHROW(a->deallocate(q));
      CHECK_NOTHROW(q = a->allocate(2 * MiB));
      CHECK_NOTHROW(a->deallocate(q));
      CHECK(requested(*a) == 0);
      CHECK_NOTHROW(a->release_cached());
      CHECK_NOTHROW(a->set_limit(0));
      CHECK(a->stats().reserved_bytes[kAllPools].current == 0);
      a->validate();
      a.reset();
      drv->sim().stream_destroy(cs);
    }
  }
}

TEST_CASE("regression: a free whose event landed in a capture completes at release_cached after the capture ended") {
  // The synchronization path (release_cached, set_limit, the retry before an OOM) with no
  // allocation in between to query the event first.
  for (BackendKind b : {BackendKind::split_merge, BackendKind::expandable}) {
    for (const bool end_at_once : {false, true}) {
      CAPTURE(expseg::to_string(b));
      CAPTURE(end_at_once);
      auto drv = std::make_shared<CaptureAtRecord>(std::make_shared<expseg::driver::SimDriver>());
      auto a = expseg::detail::AllocatorAccess::make(sim_config(b, 4 * GiB), drv);
      void* cs = drv->sim().stream_create();
      void* p = a->allocate(MiB);
      a->record_stream(p, cs);
      drv->target = cs;
      drv->end_at_once = end_at_once;
      a->deallocate(p);
      if (!end_at_once) drv->sim().graph_destroy(drv->sim().capture_end(cs));
      CHECK_NOTHROW(a->release_cached());
      CHECK(requested(*a) == 0);
      CHECK(a->stats().reserved_bytes[kAllPools].current == 0);
      a->validate();
      a.reset();
      drv->sim().stream_destroy(cs);
    }
  }
}

}  // TEST_SUITE
