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

}  // namespace expseg::test

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
// host-backed simulator). Leaves no driver resources behind.
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
    // the legacy and the per-thread default streams.
    CHECK_FALSE(d.stream_is_blocking(s));
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
}
