// The driver contract: what every Driver implementation must do, checked the same way on the
// simulated device (tests/unit) and on the real GPU (tests/gpu).
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <future>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "driver/driver.hpp"
#include "expseg/errors.hpp"

namespace expseg::test {

// The driver_error `f` throws, or nullopt when it throws none.
template <class F>
std::optional<expseg::driver_error> catch_driver_error(F&& f) {
  try {
    f();
  } catch (const expseg::driver_error& e) {
    return e;
  }
  return std::nullopt;
}

// Reads `count` 32-bit words at `ptr` and checks that each equals `value`; reports the first mismatch.
inline void check_words(expseg::driver::Driver& d, expseg::driver::dev_ptr ptr, std::size_t count,
                        std::uint32_t value) {
  std::vector<std::uint32_t> words(count, ~value);
  d.copy_to_host(words.data(), ptr, count * sizeof(std::uint32_t));
  std::size_t bad = 0;
  while (bad < count && words[bad] == value) ++bad;
  INFO("first mismatch at word " << bad << " of " << count);
  CHECK(bad == count);
}

// Runs `undo` once: at run(), or at scope exit when a REQUIRE failed or a call threw first. A check
// frees what it creates on every path, so one that fails on a real GPU leaves the process as it
// found it (a leaked reservation of terabytes would starve every later test of address space).
template <class F>
class Undo {
 public:
  explicit Undo(F undo) : undo_(std::move(undo)) {}
  Undo(const Undo&) = delete;
  Undo& operator=(const Undo&) = delete;
  ~Undo() {
    if (done_) return;
    try {
      undo_();
    } catch (...) {  // unwinding already: the failure that got here is the one to report
    }
  }
  // A throw leaves it armed: the destructor tries again (what is left of it) during the unwinding.
  void run() {
    undo_();
    done_ = true;
  }

 private:
  F undo_;
  bool done_ = false;
};

}  // namespace expseg::test

// The address space is finite: what the allocator may ask for (expandable_va_size up to 1 PiB,
// 2x device memory per stream by default) runs out with CUDA_ERROR_OUT_OF_MEMORY from
// cuMemAddressReserve, which new_segment() takes as an address-range refusal. Reservations only
// (no memory behind them); every one is freed again, on every path.
inline void check_address_space_limit(expseg::driver::Driver& d) {
  using namespace expseg::driver;
  using expseg::test::catch_driver_error;
  constexpr std::size_t TiB = std::size_t{1} << 40;
  {
    const std::size_t pib = 1024 * TiB;  // kMaxExpandableVaSize
    dev_ptr far = 0;
    auto err = catch_driver_error([&] { far = d.reserve(pib); });
    if (!err.has_value()) d.free_reserve(far, pib);
    MESSAGE("a 1 PiB cuMemAddressReserve: " << std::string(err ? err->what() : "succeeded"));
    CHECK_MESSAGE(err.has_value(), "a 1 PiB cuMemAddressReserve must fail: no process addresses that much");
    if (err) {
      CHECK(err->call() == "cuMemAddressReserve");
      CHECK(err->is_out_of_memory());
    }
  }
  {
    // Exhaustion by many reservations, as many streams' segments do: 16 TiB at a time, at most 1 PiB.
    const std::size_t chunk = 16 * TiB;
    constexpr std::size_t kMaxChunks = 64;
    std::vector<dev_ptr> taken;
    taken.reserve(kMaxChunks);
    expseg::test::Undo free_taken([&] {
      while (!taken.empty()) {
        const dev_ptr p = taken.back();
        taken.pop_back();
        d.free_reserve(p, chunk);
      }
    });
    std::optional<expseg::driver_error> err;
    while (!err.has_value() && taken.size() < kMaxChunks) {
      dev_ptr p = 0;
      err = catch_driver_error([&] { p = d.reserve(chunk); });
      if (!err.has_value()) taken.push_back(p);
    }
    const std::size_t got_tib = taken.size() * (chunk / TiB);
    free_taken.run();
    MESSAGE("the device gave " << got_tib << " TiB of address space in 16 TiB reservations; then: "
                               << std::string(err ? err->what() : "never refused"));
    REQUIRE_MESSAGE(err.has_value(), "1 PiB of reservations must not fit");
    CHECK(err->call() == "cuMemAddressReserve");
    CHECK(err->is_out_of_memory());
    CHECK(got_tib > 0);  // else the refusal was of the size alone, not the address space running out
    // It all came back: the expandable backend's default reservation (2x device memory) fits again.
    const std::size_t g = d.granularity();
    const std::size_t usual = (2 * d.mem_info().total + g - 1) / g * g;
    dev_ptr again = 0;
    CHECK_NOTHROW(again = d.reserve(usual));
    if (again != 0) d.free_reserve(again, usual);
  }
}

// cuIpcGetMemHandle: "If a region of memory is freed with cuMemFree and a subsequent call to
// cuMemAlloc returns memory with the same device address, cuIpcGetMemHandle will return a unique
// handle for the new memory." A stale export must never name the new allocation.
inline void check_ipc_handle_unique_per_allocation(expseg::driver::Driver& d) {
  using namespace expseg::driver;
  const std::size_t g = d.granularity();
  const dev_ptr p = d.mem_alloc(g);
  expseg::test::Undo free_p([&] { d.mem_free(p); });
  const ExportedHandle before = d.ipc_export(p);
  free_p.run();
  const dev_ptr q = d.mem_alloc(g);
  expseg::test::Undo free_q([&] { d.mem_free(q); });
  const ExportedHandle after = d.ipc_export(q);
  free_q.run();
  if (q == p) {
    CHECK_MESSAGE(after.bytes != before.bytes, "a cuMemAlloc at a freed allocation's address must export a new handle");
  } else {
    MESSAGE("cuMemAlloc did not reuse the freed address: uniqueness not exercised");
  }
}

// cuMemCreate of more than is free (but no more than the device holds: what the allocator can ask
// for past its never_fits check) is CUDA_ERROR_OUT_OF_MEMORY, which map_one() needs to tell a
// memory refusal from a hard error.
inline void check_create_beyond_free_is_oom(expseg::driver::Driver& d) {
  using namespace expseg::driver;
  using expseg::test::catch_driver_error;
  const std::size_t g = d.granularity();
  const phys_handle held = d.create(g);  // so that free < total on the simulator too
  expseg::test::Undo release_held([&] { d.release(held); });
  const MemInfo now = d.mem_info();
  const std::size_t over = (now.free / g + 1) * g;
  REQUIRE(over <= now.total);
  phys_handle h = 0;
  auto err = catch_driver_error([&] { h = d.create(over); });
  if (!err.has_value()) d.release(h);  // another process freed memory meanwhile
  release_held.run();
  INFO("cuMemCreate of " << over << " bytes with " << now.free << " of " << now.total << " free");
  REQUIRE_MESSAGE(err.has_value(), "cuMemCreate of more than the free memory must fail");
  CHECK(err->call() == "cuMemCreate");
  CHECK(err->is_out_of_memory());
}

// An event recorded inside a capture: cuEventQuery refuses it (CUDA_ERROR_CAPTURED_EVENT) and the
// capture is invalidated; once the capture has ended, into a graph or invalidated, it answers
// CUDA_ERROR_INVALID_VALUE (both are what Allocator::Impl::process_events takes for "recorded in a
// capture"); recorded again outside the capture, it queries normally.
inline void check_captured_event_query(expseg::driver::Driver& d) {
  using namespace expseg::driver;
  using expseg::test::catch_driver_error;
  const stream_t s = d.stream_create();
  expseg::test::Undo destroy_stream([&] { d.stream_destroy(s); });
  const event_t e = d.event_create();
  expseg::test::Undo destroy_event([&] { d.event_destroy(e); });
  d.capture_begin(s);  // global, as torch.cuda.graph
  // Ends the capture if a call below threw while it was underway (run first: declared last).
  expseg::test::Undo end_capture([&] {
    if (d.stream_capture_id(s) == 0) return;
    graph_t gr = nullptr;
    (void)catch_driver_error([&] { gr = d.capture_end(s); });
    if (gr != nullptr) d.graph_destroy(gr);
  });
  d.event_record(e, s);
  auto during = catch_driver_error([&] { (void)d.event_query(e); });
  graph_t gr = nullptr;
  auto ended = catch_driver_error([&] { gr = d.capture_end(s); });
  if (gr != nullptr) d.graph_destroy(gr);
  const std::uint64_t capture_after_end = d.stream_capture_id(s);
  end_capture.run();
  // After the capture, before any other record.
  bool done_after = false;
  auto after = catch_driver_error([&] { done_after = d.event_query(e); });
  // Recorded outside a capture, it is an ordinary event again.
  d.event_record(e, s);
  d.stream_synchronize(s);
  bool done_again = false;
  auto again = catch_driver_error([&] { done_again = d.event_query(e); });
  destroy_event.run();
  destroy_stream.run();

  INFO("query during the capture: " << std::string(during ? during->what() : "no error"));
  INFO("capture end: " << std::string(ended ? ended->what() : "no error"));
  REQUIRE(during.has_value());
  CHECK(during->call() == "cuEventQuery");
  CHECK(during->code() == 907);  // CUDA_ERROR_CAPTURED_EVENT
  REQUIRE(ended.has_value());
  CHECK(ended->call() == "cuStreamEndCapture");
  CHECK(ended->code() == 901);  // CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
  CHECK(capture_after_end == 0);
  // After the capture ended, until recorded again: CUDA_ERROR_INVALID_VALUE (measured on the H200,
  // driver 580.159.04).
  const std::string answered = after ? after->what() : (done_after ? "complete" : "not ready");
  CHECK_MESSAGE((after.has_value() && after->code() == 1),
                "a query after the capture ended, before the event is recorded again: expected CUDA_ERROR_INVALID_VALUE, "
                "the driver answered: "
                    << answered);
  INFO("query after recording outside the capture: " << std::string(again ? again->what() : "no error"));
  CHECK_FALSE(again.has_value());
  CHECK(done_again);
}

// The same after a capture that ended into a graph (nothing queried during it), before and after
// the graph's launch; cuEventSynchronize answers as cuEventQuery.
inline void check_event_of_ended_capture(expseg::driver::Driver& d) {
  using namespace expseg::driver;
  using expseg::test::catch_driver_error;
  const stream_t s = d.stream_create();
  expseg::test::Undo destroy_stream([&] { d.stream_destroy(s); });
  const event_t e = d.event_create();
  expseg::test::Undo destroy_event([&] { d.event_destroy(e); });
  d.capture_begin(s, Driver::CaptureMode::relaxed);
  graph_t gr = nullptr;
  expseg::test::Undo end_capture([&] {
    if (d.stream_capture_id(s) != 0) (void)catch_driver_error([&] { gr = d.capture_end(s); });
    if (gr != nullptr) d.graph_destroy(gr);
  });
  d.event_record(e, s);
  gr = d.capture_end(s);
  REQUIRE(gr != nullptr);
  auto query = catch_driver_error([&] { (void)d.event_query(e); });
  auto sync = catch_driver_error([&] { d.event_synchronize(e); });
  d.graph_launch(gr, s);
  d.stream_synchronize(s);
  auto launched = catch_driver_error([&] { (void)d.event_query(e); });
  d.event_record(e, s);
  d.stream_synchronize(s);
  bool done = false;
  auto again = catch_driver_error([&] { done = d.event_query(e); });
  REQUIRE(query.has_value());
  CHECK(query->code() == 1);  // CUDA_ERROR_INVALID_VALUE
  REQUIRE(sync.has_value());
  CHECK(sync->code() == 1);
  REQUIRE(launched.has_value());
  CHECK(launched->code() == 1);
  CHECK_FALSE(again.has_value());
  CHECK(done);
}

// "cuMemMap can only create mappings on VA range reservations that are not currently mapped."
// Both a full and a partial overlap are refused, and the existing mapping is untouched.
inline void check_map_over_mapping_refused(expseg::driver::Driver& d, bool data_checks) {
  using namespace expseg::driver;
  using expseg::test::catch_driver_error;
  using expseg::test::Undo;
  const std::size_t g = d.granularity();
  // Undone in reverse: the mappings, then the handles, then the reservation.
  const dev_ptr base = d.reserve(4 * g);
  Undo free_base([&] { d.free_reserve(base, 4 * g); });
  const phys_handle a = d.create(2 * g);
  Undo release_a([&] { d.release(a); });
  const phys_handle b = d.create(g);
  Undo release_b([&] { d.release(b); });
  const phys_handle c = d.create(2 * g);
  Undo release_c([&] { d.release(c); });
  d.map(base, 2 * g, a);
  Undo unmap_a([&] { d.unmap(base, 2 * g); });
  d.set_access(base, 2 * g);
  if (data_checks) {
    d.memset_d32(base, 0x0A0A0A0Au, 2 * g / 4, nullptr);
    d.stream_synchronize(nullptr);
  }
  auto exact = catch_driver_error([&] { d.map(base + g, g, b); });        // inside a's mapping
  if (!exact) (void)catch_driver_error([&] { d.unmap(base + g, g); });    // a driver that took it: undone
  auto partial = catch_driver_error([&] { d.map(base + g, 2 * g, c); });  // a's second granule + a free one
  if (!partial) (void)catch_driver_error([&] { d.unmap(base + g, 2 * g); });
  CHECK_MESSAGE(exact.has_value(), "mapping over a mapped granule must throw");
  CHECK_MESSAGE(partial.has_value(), "a mapping overlapping a mapped granule must throw");
  if (exact) {
    CHECK(exact->call() == "cuMemMap");
    CHECK_FALSE(exact->is_out_of_memory());
  }
  if (partial) {
    CHECK(partial->call() == "cuMemMap");
    CHECK_FALSE(partial->is_out_of_memory());
  }
  if (data_checks) expseg::test::check_words(d, base, 2 * g / 4, 0x0A0A0A0Au);
  // Nothing of the refused calls remains: the free granules still take a mapping.
  d.map(base + 2 * g, 2 * g, c);
  Undo unmap_c([&] { d.unmap(base + 2 * g, 2 * g); });
  unmap_c.run();
  unmap_a.run();
  release_c.run();
  release_b.run();
  release_a.run();
  free_base.run();
}

// One handle mapped at two address ranges at once (CUDA allows it; cuMemMap refuses only mapped
// ranges, not mapped handles): both ranges reach the same bytes, so a page can serve two places
// that use disjoint parts of it, each written through its own range; unmapping one range leaves
// the other, and the handle is released once neither is mapped.
inline void check_handle_mapped_twice(expseg::driver::Driver& d, bool data_checks) {
  using namespace expseg::driver;
  using expseg::test::Undo;
  const std::size_t g = d.granularity();
  const std::size_t words = g / sizeof(std::uint32_t);
  const dev_ptr base = d.reserve(4 * g);
  Undo free_base([&] { d.free_reserve(base, 4 * g); });
  const phys_handle h = d.create(g);
  Undo release_h([&] { d.release(h); });
  d.map(base, g, h);
  Undo unmap_first([&] { d.unmap(base, g); });
  d.map(base + 3 * g, g, h);  // not adjacent: an alias anywhere in the reservation
  Undo unmap_second([&] { d.unmap(base + 3 * g, g); });
  d.set_access(base, g);
  d.set_access(base + 3 * g, g);
  if (data_checks) {
    // The head written through the first range, the tail through the second.
    d.memset_d32(base, 0x1EAD0001u, words / 2, nullptr);
    d.memset_d32(base + 3 * g + g / 2, 0x7A110002u, words / 2, nullptr);
    d.stream_synchronize(nullptr);
    for (const dev_ptr at : {base, base + 3 * g}) {
      expseg::test::check_words(d, at, words / 2, 0x1EAD0001u);
      expseg::test::check_words(d, at + g / 2, words / 2, 0x7A110002u);
    }
  }
  unmap_first.run();
  if (data_checks) {  // the other range still holds the page
    expseg::test::check_words(d, base + 3 * g, words / 2, 0x1EAD0001u);
    expseg::test::check_words(d, base + 3 * g + g / 2, words / 2, 0x7A110002u);
  }
  unmap_second.run();
  release_h.run();
  free_base.run();
}

// Two captures at once, as the capture modes allow them (CUstreamCaptureMode): cuGraphInstantiate,
// which ends a capture into a graph, is refused while another capture underway is global, or
// thread-local on the calling thread; and such a capture ends only on the thread that began it.
inline void check_capture_modes(expseg::driver::Driver& d, expseg::driver::stream_t s, expseg::driver::stream_t t) {
  using Mode = expseg::driver::Driver::CaptureMode;
  auto destroy = [&](expseg::driver::graph_t g) {
    if (g != nullptr) d.graph_destroy(g);
  };
  // Another global capture refuses the instantiation, and is invalidated by it.
  d.capture_begin(t);
  d.capture_begin(s, Mode::relaxed);
  expseg::driver::graph_t g = nullptr;
  auto refused = expseg::test::catch_driver_error([&] { g = d.capture_end(s); });
  destroy(g);
  g = nullptr;
  REQUIRE(refused.has_value());
  CHECK(refused->code() == 900);  // CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
  CHECK(d.stream_capture_id(s) == 0);  // s's capture has ended, its graph lost
  auto invalidated = expseg::test::catch_driver_error([&] { g = d.capture_end(t); });
  destroy(g);
  g = nullptr;
  REQUIRE(invalidated.has_value());
  CHECK(invalidated->code() == 901);  // CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
  CHECK(d.stream_capture_id(t) == 0);
  // A relaxed capture underway lets another one end, in either mode, and then ends itself.
  d.capture_begin(t, Mode::relaxed);
  d.capture_begin(s);
  CHECK_NOTHROW(g = d.capture_end(s));
  destroy(g);
  g = nullptr;
  CHECK_NOTHROW(g = d.capture_end(t));
  destroy(g);
  g = nullptr;
  // A thread-local capture restricts only its own thread: this one ends another capture meanwhile.
  // Ended on another thread, it fails (CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD) and is over: its own
  // thread then finds no capture to end (CUDA_ERROR_ILLEGAL_STATE, as for any stream not capturing).
  std::promise<void> begun;
  std::promise<void> go_on;
  std::optional<expseg::driver_error> ended_there;
  std::thread other([&] {
    d.capture_begin(t, Mode::thread_local_mode);
    begun.set_value();
    go_on.get_future().wait();
    expseg::driver::graph_t gt = nullptr;
    ended_there = expseg::test::catch_driver_error([&] { gt = d.capture_end(t); });
    if (gt != nullptr) d.graph_destroy(gt);
  });
  begun.get_future().wait();
  d.capture_begin(s);
  CHECK_NOTHROW(g = d.capture_end(s));
  destroy(g);
  g = nullptr;
  auto wrong_thread = expseg::test::catch_driver_error([&] { g = d.capture_end(t); });
  destroy(g);
  const std::uint64_t after_wrong_thread = d.stream_capture_id(t);
  go_on.set_value();
  other.join();
  REQUIRE(wrong_thread.has_value());
  CHECK(wrong_thread->code() == 908);
  CHECK(after_wrong_thread == 0);
  INFO("its own thread's end: " << std::string(ended_there ? ended_there->what() : "ok"));
  REQUIRE(ended_there.has_value());
  CHECK(ended_there->code() == 401);
  CHECK(d.stream_capture_id(t) == 0);
  auto not_capturing = expseg::test::catch_driver_error([&] { g = d.capture_end(s); });
  destroy(g);
  REQUIRE(not_capturing.has_value());
  CHECK(not_capturing->code() == 401);
}

// Runs the contract on `d`. data_checks: also write and read device memory (needs a real device or a
// host-backed simulator). Leaves no driver resources behind. check_address_space_limit runs apart
// (it takes all of the process's address space for a moment).
inline void check_driver_contract(expseg::driver::Driver& d, bool data_checks) {
  using namespace expseg::driver;
  using expseg::test::catch_driver_error;
  using expseg::test::check_words;

  // --- identity and granularity ---
  const std::string kind = d.kind();
  CHECK((kind == "cuda" || kind == "sim"));
  CHECK(d.device() >= 0);
  CHECK(d.device() < d.device_count());
  CHECK_FALSE(d.device_name().empty());
  const std::size_t g = d.granularity();
  REQUIRE(g >= 4096);
  CHECK((g & (g - 1)) == 0);
  const MemInfo info = d.mem_info();
  CHECK(info.total > 0);
  CHECK(info.free <= info.total);
  const std::vector<int> access = d.access_devices();
  REQUIRE_FALSE(access.empty());
  CHECK(access.front() == d.device());
  CHECK_FALSE(d.add_access_device(d.device()));  // this device is always granted
  CHECK_FALSE(d.enable_context_peer(d.device()));  // and reaches its own cuMemAlloc memory
  CHECK(d.context_peers().empty());
  CHECK_FALSE(d.can_access_peer(d.device()));

  // --- reserve 8 granules; map 3 handles (1, 1 and 2 granules) at granules 0, 1, 2-3 ---
  const CallStats calls_before = d.call_stats();
  const dev_ptr base = d.reserve(8 * g);
  REQUIRE(base != 0);
  CHECK(base % g == 0);
  const phys_handle h1 = d.create(g);
  const phys_handle h2 = d.create(g);
  const phys_handle h3 = d.create(2 * g);
  CHECK(h1 != 0);
  CHECK(h2 != 0);
  CHECK(h3 != 0);
  CHECK(h1 != h2);
  CHECK(h2 != h3);
  d.map(base, g, h1);
  d.map(base + g, g, h2);
  d.map(base + 2 * g, 2 * g, h3);
  d.set_access(base, 4 * g);  // one call over three handles
  {
    // Each call above counted once, with its time: measured on a GPU, modelled (or 0) on the simulator.
    const CallStats c = d.call_stats().since(calls_before);
    CHECK(c.calls[static_cast<std::size_t>(Op::reserve)] == 1);
    CHECK(c.calls[static_cast<std::size_t>(Op::create)] == 3);
    CHECK(c.calls[static_cast<std::size_t>(Op::map)] == 3);
    CHECK(c.calls[static_cast<std::size_t>(Op::set_access)] == 1);
    CHECK(c.calls[static_cast<std::size_t>(Op::unmap)] == 0);
    for (double sec : c.seconds) CHECK(sec >= 0.0);
    if (kind == "cuda") {
      CHECK(c.seconds[static_cast<std::size_t>(Op::create)] > 0.0);
      CHECK(c.seconds[static_cast<std::size_t>(Op::set_access)] > 0.0);
    }
    const auto named = c.by_call();
    CHECK(std::any_of(named.begin(), named.end(), [](const expseg::DriverCallTime& t) { return t.call == "cuMemSetAccess" && t.calls == 1; }));
  }

  const std::size_t words_per_granule = g / sizeof(std::uint32_t);
  if (data_checks) {
    // One pattern over all four granules, then one per handle: every page reads back what was written.
    d.memset_d32(base, 0xA5A5F00Du, 4 * words_per_granule, nullptr);
    d.stream_synchronize(nullptr);
    check_words(d, base, 4 * words_per_granule, 0xA5A5F00Du);
    d.memset_d32(base, 0x11111111u, words_per_granule, nullptr);
    d.memset_d32(base + g, 0x22222222u, words_per_granule, nullptr);
    d.memset_d32(base + 2 * g, 0x33333333u, 2 * words_per_granule, nullptr);
    d.stream_synchronize(nullptr);
    check_words(d, base, words_per_granule, 0x11111111u);
    check_words(d, base + g, words_per_granule, 0x22222222u);
    check_words(d, base + 2 * g, 2 * words_per_granule, 0x33333333u);

    // A distinct value in every word of h2, written from the host.
    std::vector<std::uint32_t> pattern(words_per_granule);
    for (std::size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<std::uint32_t>(i * 2654435761u + 7);
    d.copy_from_host(base + g, pattern.data(), g);
    std::vector<std::uint32_t> back(words_per_granule, 0);
    d.copy_to_host(back.data(), base + g, g);
    CHECK(back == pattern);

    // Physical memory persists: unmap h2 and map it again at granule 5; the data comes along.
    d.unmap(base + g, g);
    d.map(base + 5 * g, g, h2);
    d.set_access(base + 5 * g, g);
    std::fill(back.begin(), back.end(), 0u);
    d.copy_to_host(back.data(), base + 5 * g, g);
    CHECK(back == pattern);
    // The neighbours were not disturbed.
    check_words(d, base, words_per_granule, 0x11111111u);
    check_words(d, base + 2 * g, 2 * words_per_granule, 0x33333333u);
  } else {
    d.unmap(base + g, g);
    d.map(base + 5 * g, g, h2);
    d.set_access(base + 5 * g, g);
  }

  // --- errors carry the call's name ---
  {
    // An address range that was reserved and freed again is outside every reservation.
    const dev_ptr gone = d.reserve(2 * g);
    d.free_reserve(gone, 2 * g);
    auto err = catch_driver_error([&] { d.map(gone, g, h1); });
    REQUIRE_MESSAGE(err.has_value(), "mapping outside a reservation must throw");
    CHECK(err->call() == "cuMemMap");
    CHECK(err->code() != 0);
    CHECK_FALSE(err->is_out_of_memory());
    CHECK(std::string(err->what()).find("cuMemMap") != std::string::npos);
  }
  {
    const std::size_t absurd = ((std::size_t{1} << 50) + g - 1) / g * g;
    auto err = catch_driver_error([&] { (void)d.create(absurd); });
    REQUIRE_MESSAGE(err.has_value(), "a 1 PiB cuMemCreate must throw");
    CHECK(err->call() == "cuMemCreate");
    CHECK(err->code() != 0);
    CHECK_FALSE(err->code_name().empty());
  }
  {
    // A handle maps whole and a mapping unmaps whole (the H200, CUDA 13.0: CUDA_ERROR_NOT_SUPPORTED
    // and CUDA_ERROR_INVALID_VALUE). This is why expandable cannot give back or move the free frames
    // of a handle while a block uses the rest (the handle policy in expandable.cpp).
    auto part_map = catch_driver_error([&] { d.map(base + 6 * g, g, h3); });
    REQUIRE_MESSAGE(part_map.has_value(), "mapping one granule of a two-granule handle must throw");
    CHECK(part_map->call() == "cuMemMap");
    CHECK_FALSE(part_map->is_out_of_memory());
    auto part_unmap = catch_driver_error([&] { d.unmap(base + 2 * g, g); });
    REQUIRE_MESSAGE(part_unmap.has_value(), "unmapping half of a mapping must throw");
    CHECK(part_unmap->call() == "cuMemUnmap");
    CHECK_FALSE(part_unmap->is_out_of_memory());
  }
  // Nothing was disturbed by the failed calls.
  if (data_checks) {
    check_words(d, base, words_per_granule, 0x11111111u);
    check_words(d, base + 2 * g, 2 * words_per_granule, 0x33333333u);
  }

  check_handle_mapped_twice(d, data_checks);

  // --- tear down ---
  d.unmap(base, g);
  d.unmap(base + 2 * g, 2 * g);
  d.unmap(base + 5 * g, g);
  d.release(h1);
  d.release(h2);
  d.release(h3);
  d.free_reserve(base, 8 * g);

  // --- plain allocations ---
  {
    const std::size_t bytes = g + 4096;  // not a multiple of the granularity: cuMemAlloc takes any size
    const dev_ptr p = d.mem_alloc(bytes);
    REQUIRE(p != 0);
    CHECK(p % 256 == 0);
    // cuMemGetAddressRange: the allocation a pointer lies in (an IPC import checks a handle's size
    // with it), from its start or its inside.
    for (const dev_ptr inside : {p, p + bytes / 2, p + bytes - 1}) {
      const auto [range_base, range_bytes] = d.address_range(inside);
      CHECK(range_base == p);
      CHECK(range_bytes >= bytes);
      CHECK(range_bytes < bytes + g);
    }
    if (data_checks) {
      d.memset_d32(p, 0xC0FFEE11u, bytes / 4, nullptr);
      d.stream_synchronize(nullptr);
      check_words(d, p, bytes / 4, 0xC0FFEE11u);
      const std::uint32_t tail[4] = {1, 2, 3, 0xFFFFFFFFu};
      d.copy_from_host(p + bytes - sizeof tail, tail, sizeof tail);
      std::uint32_t back[4] = {};
      d.copy_to_host(back, p + bytes - sizeof tail, sizeof back);
      CHECK(back[0] == 1u);
      CHECK(back[1] == 2u);
      CHECK(back[2] == 3u);
      CHECK(back[3] == 0xFFFFFFFFu);
      check_words(d, p, bytes / 4 - 4, 0xC0FFEE11u);
    }
    d.mem_free(p);
    auto err = catch_driver_error([&] { d.mem_free(p); });  // double free
    REQUIRE(err.has_value());
    CHECK(err->call() == "cuMemFree");
    err = catch_driver_error([&] { (void)d.address_range(p); });  // in no allocation any more
    REQUIRE(err.has_value());
    CHECK(err->call() == "cuMemGetAddressRange");
  }

  // --- streams and events ---
  {
    const stream_t s = d.stream_create();
    REQUIRE(s != nullptr);
    const event_t e = d.event_create();
    REQUIRE(e != nullptr);
    const event_t e2 = d.event_create();
    CHECK(e2 != e);
    CHECK(d.event_query(e));  // never recorded: complete
    dev_ptr p = 0;
    if (data_checks) {
      p = d.mem_alloc(g);
      d.memset_d32(p, 0x5A5A5A5Au, g / 4, s);
    }
    d.event_record(e, s);
    d.event_synchronize(e);
    CHECK(d.event_query(e));
    if (data_checks) check_words(d, p, g / 4, 0x5A5A5A5Au);
    d.event_record(e2, nullptr);
    d.stream_synchronize(nullptr);
    CHECK(d.event_query(e2));
    d.event_record(e, s);
    d.stream_synchronize(s);
    CHECK(d.event_query(e));
    // Which streams the legacy stream waits for: not a created (non-blocking) one; a blocking one,
    // the legacy and the per-thread default streams. Each question is one counted stream query.
    const CallStats queries_before = d.call_stats();
    CHECK_FALSE(d.stream_is_blocking(s));
    CHECK(d.stream_capture_id(s) == 0);
    {
      const CallStats c = d.call_stats().since(queries_before);
      CHECK(c.calls[static_cast<std::size_t>(Op::stream_query)] == 2);
      const auto named = c.by_call();
      CHECK(std::any_of(named.begin(), named.end(), [](const expseg::DriverCallTime& t) { return t.call == "cuStreamGetCaptureInfo" && t.calls == 2; }));
    }
    CHECK(d.stream_is_blocking(nullptr));
    CHECK(d.stream_is_blocking(reinterpret_cast<stream_t>(std::uintptr_t{2})));
    const stream_t blocking = d.stream_create_blocking();
    CHECK(d.stream_is_blocking(blocking));
    // A fork: a stream that waits for an event recorded inside a capture joins it (same capture id)
    // until it joins back and the capture ends.
    d.capture_begin(s);
    d.event_record(e, s);
    d.stream_wait_event(blocking, e);
    CHECK(d.stream_capture_id(blocking) != 0);
    CHECK(d.stream_capture_id(blocking) == d.stream_capture_id(s));
    d.event_record(e2, blocking);
    d.stream_wait_event(s, e2);
    const expseg::driver::graph_t g = d.capture_end(s);
    CHECK(d.stream_capture_id(blocking) == 0);
    d.graph_destroy(g);
    check_capture_modes(d, s, blocking);
    d.stream_destroy(blocking);
    d.device_synchronize();
    if (p) d.mem_free(p);
    d.event_destroy(e2);
    d.event_destroy(e);
    d.stream_destroy(s);
  }

  // --- the codes the allocator depends on ---
  check_create_beyond_free_is_oom(d);
  check_captured_event_query(d);
  check_event_of_ended_capture(d);
  check_map_over_mapping_refused(d, data_checks);
  check_ipc_handle_unique_per_allocation(d);
}
