// PyTorch fidelity of the configuration and of the OOM message, checked against PyTorch's own code
// (c10/core/AllocatorConfig.cpp, c10/cuda/CUDAAllocatorConfig.cpp, c10/cuda/CUDACachingAllocator.cpp).
#include <doctest/doctest.h>

#include <array>
#include <string>

#include "expseg/errors.hpp"
#include "test_util.hpp"

using namespace testutil;
using expseg::Allocator;
using expseg::BackendKind;
using expseg::Config;
using expseg::Limit;

namespace {

constexpr BackendKind kBoth[] = {BackendKind::split_merge, BackendKind::expandable};

// The message of the OOM a 2 GiB request gets on a 1 GiB device.
std::string oom_message(BackendKind b, const std::string& conf, std::size_t set_limit = 0) {
  Allocator a(sim_config(b, 1 * GiB, conf));
  if (set_limit != 0) a.set_limit(set_limit);
  try {
    (void)a.allocate(2 * GiB);
  } catch (const expseg::out_of_memory& e) {
    return e.what();
  }
  FAIL("a 2 GiB request on a 1 GiB device did not fail");
  return "";
}

}  // namespace

TEST_CASE("fidelity regression: no 'allowed' figure in the OOM message at a memory fraction of 1 or a limit of the whole device") {
  // PyTorch 2.9+ setMemoryFraction: `allowed_memory_maximum = std::nullopt; if (fraction < 1.0)
  // allowed_memory_maximum = ...`, and the OOM message adds "N allowed; " only
  // `if (allowed_memory_maximum.has_value())`.
  for (BackendKind b : kBoth) {
    CAPTURE(std::string(expseg::to_string(b)));
    for (const char* conf : {"", "per_process_memory_fraction:1", "limit:100%", "limit:1GiB", "limit:2GiB"}) {
      CAPTURE(conf);
      const std::string msg = oom_message(b, conf);
      CAPTURE(msg);
      CHECK(msg.find(" allowed; ") == std::string::npos);  // was: "1.00 GiB allowed; " (2.00 GiB for limit:2GiB)
      CHECK(msg.find("is free. Of the allocated memory") != std::string::npos);
    }
    const std::string set = oom_message(b, "", 1 * GiB);  // Allocator::set_limit (expseg_set_limit) to the device
    CHECK(set.find(" allowed; ") == std::string::npos);
    // A limit below the device's memory is PyTorch's fraction below 1: the figure is there.
    for (const char* conf : {"per_process_memory_fraction:0.5", "limit:50%", "limit:512MiB"}) {
      CAPTURE(conf);
      const std::string msg = oom_message(b, conf);
      CAPTURE(msg);
      CHECK(msg.find("is free. 512.00 MiB allowed; Of the allocated memory") != std::string::npos);
    }
  }
}

TEST_CASE("fidelity regression: per_process_memory_fraction takes PyTorch's [0, 1]: 1 is no limit, 0 lets nothing be allocated") {
  // PyTorch 2.9+ parsePerProcessMemoryFraction: `val_env >= 0.0 && val_env <= 1.0` ("set it in
  // [0.0, 1.0]"); setMemoryFraction(1.0) sets no limit, setMemoryFraction(0.0) a limit of 0 bytes.
  CHECK(Config::parse("per_process_memory_fraction:1").limit == Limit{});  // was: 100% (of the device)
  CHECK(Config::parse("limit:4GiB,per_process_memory_fraction:1").limit == Limit{});
  CHECK(Config::parse("per_process_memory_fraction:1").to_string() == Config{}.to_string());

  Config zero;
  CHECK_NOTHROW(zero = Config::parse("per_process_memory_fraction:0"));  // was: config_error, "(0, 1]"
  CHECK(zero.limit.is_set());
  CHECK(Config::parse(zero.to_string()) == zero);
  CHECK_NOTHROW((void)Config::parse("per_process_memory_fraction:0.0"));
  for (BackendKind b : kBoth) {
    CAPTURE(std::string(expseg::to_string(b)));
    Allocator a(sim_config(b, 80 * GiB, "per_process_memory_fraction:0"));
    CHECK(a.limit() != 0);
    try {
      (void)a.allocate(512);
      FAIL("an allocation succeeded under per_process_memory_fraction:0");
    } catch (const expseg::out_of_memory& e) {
      CHECK(e.report().verdict == expseg::OomVerdict::limit);
    }
    CHECK(a.stats().reserved_bytes[expseg::kAllPools].current == 0);
    a.validate();
  }
  for (const char* bad : {"-0.5", "1.01"}) {
    CAPTURE(bad);
    try {
      (void)Config::parse(std::string("per_process_memory_fraction:") + bad);
      FAIL("accepted");
    } catch (const expseg::config_error& e) {
      CHECK(std::string(e.what()).find("[0, 1]") != std::string::npos);
      CHECK(e.key() == "per_process_memory_fraction");
    }
  }
}

TEST_CASE("fidelity regression: roundup_power2_divisions takes one comma after the last entry of its list, as PyTorch does") {
  // PyTorch's parseRoundUpPower2Divisions reads an entry, then `if (tokenizer[i + 1] != "]")
  // checkToken(++i, ",")` and loops `while (++i < size && tokenizer[i] != "]")`: a comma before ']'
  // ends the list like ']' alone. A second comma, or a comma with no entry, is an error there too.
  using Arr = std::array<std::size_t, expseg::kRoundupIntervals>;
  const Arr ex = Config::parse("roundup_power2_divisions:[256:1,512:2,>:8]").roundup_power2_divisions;
  for (const char* conf : {"roundup_power2_divisions:[256:1,512:2,>:8,]", "roundup_power2_divisions:[256:1,512:2,>:8 , ]",
                           "roundup_power2_divisions:[256:1,512:2,>:8,],expandable_segments:True,"}) {
    CAPTURE(conf);
    Arr got{};
    CHECK_NOTHROW(got = Config::parse(conf).roundup_power2_divisions);  // was: config_error, "'' is not MB:divisions"
    CHECK(got == ex);
  }
  for (const char* bad : {"roundup_power2_divisions:[,]", "roundup_power2_divisions:[256:1,,]", "roundup_power2_divisions:[,256:1]"}) {
    CAPTURE(bad);
    CHECK_THROWS_AS((void)Config::parse(bad), expseg::config_error);
  }
}

// ---- keys of PyTorch releases after 2.11 (c10/core/AllocatorConfig.cpp, c10/cuda/CUDAAllocatorConfig.cpp) ----

namespace {

void check_config_fails(const std::string& text, const std::string& key, const std::string& part) {
  CAPTURE(text);
  try {
    (void)Config::parse(text);
    FAIL("accepted: " << text);
  } catch (const expseg::config_error& e) {
    CHECK(e.key() == key);
    CHECK_MESSAGE(std::string(e.what()).find(part) != std::string::npos, e.what());
  }
}

}  // namespace

TEST_CASE("fidelity regression: large_segment_size_mb is parsed first and bounds max_split_size_mb and max_non_split_rounding_mb") {
  // parseLargeSegmentSize: more than kMinLargeAlloc (10 MiB); parseArgs reads it before every other
  // key and then sets max_non_split_rounding_size_ to it; parseMaxSplitSize and
  // parseMaxNonSplitRoundingSize require at least large_segment_size_.
  const Config c = Config::parse("large_segment_size_mb:32");
  CHECK(c.large_segment_size == 32 * MiB);
  CHECK(c.max_non_split_rounding == 32 * MiB);
  CHECK(c.max_split_size == SIZE_MAX);
  CHECK(Config::parse("large_segment_size_mb:11").large_segment_size == 11 * MiB);
  check_config_fails("large_segment_size_mb:10", "large_segment_size_mb", "must be > 10");
  check_config_fails("large_segment_size_mb:0", "large_segment_size_mb", "must be > 10");
  check_config_fails("large_segment_size_mb:1.5", "large_segment_size_mb", "integer number of MiB");
  // Below 20 is allowed once the large segment is smaller (a PyTorch user's large_segment_size_mb:12).
  const Config small = Config::parse("max_split_size_mb:16,max_non_split_rounding_mb:14,large_segment_size_mb:12");
  CHECK(small.large_segment_size == 12 * MiB);
  CHECK(small.max_split_size == 16 * MiB);
  CHECK(small.max_non_split_rounding == 14 * MiB);
  // The order does not matter: large_segment_size_mb is applied first.
  check_config_fails("max_split_size_mb:24,large_segment_size_mb:32", "max_split_size_mb", "must be >= 32");
  check_config_fails("max_non_split_rounding_mb:24,large_segment_size_mb:32", "max_non_split_rounding_mb", "must be >= 32");
  CHECK(Config::parse("max_non_split_rounding_mb:64,large_segment_size_mb:32").max_non_split_rounding == 64 * MiB);
  CHECK(Config::parse("large_segment_size_mb:32,max_non_split_rounding_mb:64").max_non_split_rounding == 64 * MiB);
  // Without it the old bound stands.
  check_config_fails("max_split_size_mb:19", "max_split_size_mb", "must be >= 20");
  // Applied over an earlier max_split_size_mb below it: refused, and the config is left as it was.
  Config layered = Config::parse("max_split_size_mb:20");
  check_config_fails("max_split_size_mb:20,large_segment_size_mb:32", "max_split_size_mb", "must be >= 32");
  try {
    layered.apply("large_segment_size_mb:32");
    FAIL("a large segment above the max_split_size_mb set before was accepted");
  } catch (const expseg::config_error& e) {
    CHECK(e.key() == "large_segment_size_mb");
    CHECK(std::string(e.what()).find("max_split_size_mb (20, set before)") != std::string::npos);
  }
  CHECK(layered == Config::parse("max_split_size_mb:20"));
  // The canonical form reads back.
  CHECK(Config::parse(small.to_string()) == small);
  CHECK(Config::parse(c.to_string()) == c);
}

TEST_CASE("fidelity regression: split_merge gives a 1-10 MiB request a segment of large_segment_size_mb") {
  // get_allocation_size: size <= kSmallSize -> kSmallBuffer; size < kMinLargeAlloc ->
  // large_segment_size(); otherwise rounded up to kRoundLarge.
  for (const auto& row : {std::pair<const char*, std::size_t>{"", 20 * MiB},
                          std::pair<const char*, std::size_t>{"large_segment_size_mb:12", 12 * MiB},
                          std::pair<const char*, std::size_t>{"large_segment_size_mb:64", 64 * MiB}}) {
    const char* const conf = row.first;  // not a structured binding: clang 14 cannot capture one (CAPTURE)
    const std::size_t segment = row.second;
    CAPTURE(conf);
    Allocator a(sim_config(BackendKind::split_merge, 8 * GiB, conf));
    void* p = a.allocate(5 * MiB);
    CHECK(a.stats().reserved_bytes[expseg::kAllPools].current == static_cast<std::int64_t>(segment));
    void* s = a.allocate(512 * KiB);  // the small pool's 2 MiB segment, whatever the setting
    CHECK(a.stats().reserved_bytes[expseg::kAllPools].current == static_cast<std::int64_t>(segment + 2 * MiB));
    a.deallocate(p);
    a.deallocate(s);
    a.validate();
    Allocator b(sim_config(BackendKind::split_merge, 8 * GiB, conf));
    void* q = b.allocate(12 * MiB + 1);  // 10 MiB and more: rounded up to 2 MiB, whatever the setting
    CHECK(b.stats().reserved_bytes[expseg::kAllPools].current == static_cast<std::int64_t>(14 * MiB));
    b.deallocate(q);
  }
}

TEST_CASE("fidelity regression: expandable_segments_reserve sets the virtual range of an expandable segment") {
  // parseReserveSpec: a trailing G means GiB, otherwise a fraction of device memory; positive and
  // finite. (PyTorch keeps its default on a bad value, with a warning; expseg refuses bad values.)
  const Config half = Config::parse("expandable_segments_reserve:0.5");
  CHECK(half.va_fraction == 0.5);
  CHECK(half.va_size == 0);
  CHECK(half.expandable_va_bytes(80 * GiB) == 40 * GiB);
  CHECK(half.to_string().find("expandable_va_size:50%") != std::string::npos);
  CHECK(Config::parse(half.to_string()) == half);
  CHECK(Config::parse("expandable_va_size:50%") == half);
  CHECK(Config::parse("expandable_segments_reserve:40G").va_size == 40 * GiB);
  CHECK(Config::parse("expandable_segments_reserve:1.5g").va_size == 3 * GiB / 2);
  CHECK(Config::parse("expandable_segments_reserve:2").expandable_va_bytes(8 * GiB) == 16 * GiB);
  CHECK(Config::parse("expandable_va_size:112.5%").expandable_va_bytes(8 * GiB) == 9 * GiB);
  CHECK(Config::parse("expandable_va_size:0%") == Config{});
  // The last of the two keys wins, as for any one key.
  CHECK(Config::parse("expandable_va_size:1GiB,expandable_segments_reserve:0.5") == half);
  CHECK(Config::parse("expandable_segments_reserve:0.5,expandable_va_size:1GiB").va_fraction == 0.0);
  CHECK(Config::parse("expandable_segments_reserve:0.5,expandable_va_size:1GiB").va_size == GiB);
  // expseg also takes a size with a unit here ("1.5GiB", as expandable_va_size does; PyTorch ignores it):
  // test_regression_usability.cpp.
  for (const char* bad : {"0", "-1", "0G", "abc", "inf", "nan", "infG", "0x1p3", "1e", "G", "0GiB", "1.5XiB"})
    check_config_fails(std::string("expandable_segments_reserve:") + bad, "expandable_segments_reserve", "positive fraction");
  check_config_fails("expandable_segments_reserve:2000000G", "expandable_segments_reserve", "at most 1048576G");
  check_config_fails("expandable_va_size:-5%", "expandable_va_size", "negative");

  // The backend reserves that share: on an 8 GiB device, 0.125 is 1 GiB, so two 600 MiB blocks
  // need two segments; with the default (16 GiB) the second grows the first in place.
  for (const char* conf : {"", "expandable_segments_reserve:0.125", "expandable_va_size:12.5%"}) {
    CAPTURE(conf);
    auto sa = make_sim_allocator(sim_config(BackendKind::expandable, 8 * GiB, conf));
    void* p = sa->allocate(600 * MiB);
    void* q = sa->allocate(600 * MiB);
    const bool one_range = *conf == '\0';
    CHECK(sa.sim->live().reservations == (one_range ? 1u : 2u));
    CHECK((addr(q) == addr(p) + 600 * MiB) == one_range);
    sa->deallocate(p);
    sa->deallocate(q);
    sa->validate();
  }
  // A share is capped at the full reserve, 2x device memory, as PyTorch caps it at its own (9/8):
  // 1000000 reserved 8 PiB on an 8 GiB device.
  CHECK(Config::parse("expandable_segments_reserve:1000000").expandable_va_bytes(8 * GiB) == 16 * GiB);
  // A reservation larger than one segment may take is refused when the allocator is made.
  Config huge = sim_config(BackendKind::expandable, 8 * GiB, "expandable_va_size:100000000%");
  try {
    Allocator a(huge);
    (void)a.allocate(1);
    FAIL("an expandable segment of 8 PiB was reserved");
  } catch (const expseg::config_error& e) {
    CHECK(e.key() == "expandable_va_size");
  }
}

TEST_CASE("fidelity regression: throw_on_cudamalloc_oom, expandable_segments_reserve_by_class and pinned_free_catch_all are accepted") {
  // expseg refuses a request over the limit before any driver call, which is what
  // throw_on_cudamalloc_oom:True asks of PyTorch; it has no stream classes, so the per-class reserve
  // list only has its syntax checked (parseExpandableSegmentsReserveByClass: [name:spec,...]).
  CHECK(Config::parse("throw_on_cudamalloc_oom:True,pinned_free_catch_all:True") == Config{});
  CHECK(Config::parse("throw_on_cudamalloc_oom:False,expandable_segments_reserve_by_class:[decode:0.5,prefill:40G]") == Config{});
  CHECK(Config::parse("expandable_segments_reserve_by_class:[]") == Config{});
  CHECK(Config::parse("expandable_segments_reserve_by_class:[decode:0.5,]") == Config{});
  check_config_fails("throw_on_cudamalloc_oom:maybe", "throw_on_cudamalloc_oom", "'maybe'");
  check_config_fails("pinned_free_catch_all:2", "pinned_free_catch_all", "'2'");
  for (const char* bad : {"decode:0.5", "[decode]", "[:0.5]", "[decode:0]", "[decode:x]", "[,]", "[decode:0.5,,]"}) {
    CAPTURE(bad);
    check_config_fails(std::string("expandable_segments_reserve_by_class:") + bad, "expandable_segments_reserve_by_class", "");
  }
}
