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
    CAPTURE(expseg::to_string(b));
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
    CAPTURE(expseg::to_string(b));
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
