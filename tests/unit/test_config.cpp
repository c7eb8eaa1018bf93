// Configuration: the options table, EXPSEG_ALLOC_CONF syntax, PyTorch's keys, sizes (config.hpp).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <initializer_list>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "expseg/allocator.hpp"
#include "expseg/config.hpp"
#include "expseg/errors.hpp"

using expseg::BackendKind;
using expseg::Config;
using expseg::config_error;
using expseg::DeviceKind;
using expseg::IpcHandle;
using expseg::Limit;
using expseg::PoolPolicy;

namespace {

constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;
constexpr std::size_t TiB = std::size_t{1} << 40;

std::string_view trim_spaces(std::string_view s) {
  while (!s.empty() && s.front() == ' ') s.remove_prefix(1);
  while (!s.empty() && s.back() == ' ') s.remove_suffix(1);
  return s;
}

struct Failure {
  bool threw = false;
  std::string key;
  std::string message;
};

// Parses `text` expecting a config_error; returns its key and message.
Failure parse_failure(std::string_view text) {
  Failure f;
  try {
    (void)Config::parse(text);
  } catch (const config_error& e) {
    f.threw = true;
    f.key = e.key();
    f.message = e.what();
  }
  return f;
}

bool contains(const std::string& s, std::string_view part) { return s.find(part) != std::string::npos; }

// Checks that `text` fails naming `key`, and that the message holds each of `parts`.
void check_fails(std::string_view text, std::string_view key, std::initializer_list<std::string_view> parts = {}) {
  CAPTURE(text);
  const Failure f = parse_failure(text);
  REQUIRE(f.threw);
  CAPTURE(f.message);
  CHECK(f.key == key);
  if (!key.empty()) CHECK(contains(f.message, key));
  for (std::string_view p : parts) {
    CAPTURE(p);
    CHECK(contains(f.message, p));
  }
}

std::vector<std::string> option_names() {
  std::vector<std::string> names;
  for (const auto& o : Config::options()) names.emplace_back(o.name);
  return names;
}

std::size_t parse_size(std::string_view text) { return expseg::parse_bytes(text); }

}  // namespace

TEST_SUITE("config") {

TEST_CASE("config: empty text and whitespace give the defaults") {
  CHECK(Config::parse("") == Config{});
  CHECK(Config::parse("   \t ") == Config{});
  const Config c;
  CHECK(c.backend == BackendKind::split_merge);
  CHECK(c.policy == PoolPolicy::pytorch);
  CHECK(c.device == DeviceKind::cuda);
  CHECK(c.sim_capacity == 80 * GiB);
  CHECK(c.sim_granularity == 2 * MiB);
  CHECK_FALSE(c.limit.is_set());
  CHECK(c.max_split_size == SIZE_MAX);
  CHECK(c.oom_counterfactual);
}

TEST_CASE("config: the options table lists every key once with its type, default and help") {
  const auto opts = Config::options();
  std::set<std::string> seen;
  for (const auto& o : opts) {
    CAPTURE(o.name);
    CHECK(seen.insert(o.name).second);
    CHECK(std::string(o.type).size() > 0);
    CHECK(std::string(o.help).size() > 0);
    // Every documented default is itself a valid value.
    CHECK_NOTHROW((void)Config::parse(std::string(o.name) + ":" + o.default_value));
  }
  for (const char* key : {"backend", "policy", "device", "sim_capacity", "sim_granularity", "sim_host_backed",
                          "sim_latency", "limit", "expandable_va_size", "expandable_max_handle", "ipc_handle", "peer_access",
                          "record", "record_ring", "oom_snapshot", "oom_counterfactual", "oom_dump", "expandable_segments",
                          "max_split_size_mb", "max_non_split_rounding_mb", "roundup_power2_divisions",
                          "garbage_collection_threshold", "per_process_memory_fraction",
                          "release_lock_on_cudamalloc", "pinned_use_cuda_host_register",
                          "pinned_num_register_threads", "pinned_use_background_threads",
                          "pinned_reserve_segment_size_mb", "graph_capture_record_stream_reuse",
                          "release_lock_on_hipmalloc", "pinned_use_hip_host_register", "large_segment_size_mb",
                          "expandable_segments_reserve", "expandable_segments_reserve_by_class",
                          "throw_on_cudamalloc_oom", "pinned_free_catch_all"}) {
    CAPTURE(key);
    CHECK(seen.count(key) == 1);
  }
  CHECK(seen.size() == 38);
}

TEST_CASE("config: documented defaults are the defaults of Config and of to_string") {
  const std::string canon = Config{}.to_string();
  for (const auto& o : Config::options()) {
    const std::string item = std::string(o.name) + ":" + o.default_value;
    if (!contains(canon, item)) continue;  // aliases and ignored keys are not printed
    CAPTURE(item);
    CHECK(Config::parse(item) == Config{});
  }
  CHECK(canon ==
        "backend:split_merge,policy:pytorch,device:cuda,sim_capacity:80GiB,sim_granularity:2MiB,"
        "sim_host_backed:false,sim_latency:false,limit:0,expandable_va_size:0,expandable_max_handle:0,"
        "ipc_handle:none,peer_access:auto,record:false,record_ring:0,oom_snapshot:false,oom_counterfactual:true,"
        "oom_dump:none,large_segment_size_mb:20,max_split_size_mb:unlimited,max_non_split_rounding_mb:20,"
        "roundup_power2_divisions:0,garbage_collection_threshold:off");
}

TEST_CASE("config: expseg keys") {
  CHECK(Config::parse("backend:expandable").backend == BackendKind::expandable);
  CHECK(Config::parse("backend:split_merge").backend == BackendKind::split_merge);
  CHECK(Config::parse("backend:native").backend == BackendKind::split_merge);
  CHECK(Config::parse("policy:cupy").policy == PoolPolicy::cupy);
  CHECK(Config::parse("policy:pytorch").policy == PoolPolicy::pytorch);
  CHECK(Config::parse("device:sim").device == DeviceKind::sim);
  CHECK(Config::parse("device:cuda").device == DeviceKind::cuda);
  CHECK(Config::parse("sim_capacity:141GB").sim_capacity == 141'000'000'000ull);
  CHECK(Config::parse("sim_granularity:64KiB").sim_granularity == 64 * KiB);
  CHECK(Config::parse("sim_granularity:4096").sim_granularity == 4096);
  CHECK(Config::parse("sim_host_backed:true").sim_host_backed);
  CHECK(Config::parse("sim_latency:1").sim_latency);
  CHECK(Config::parse("limit:20GiB").limit == Limit{20 * GiB, 0.0});
  CHECK(Config::parse("limit:50%").limit == Limit{0, 0.5});
  CHECK(Config::parse("limit:12.5%").limit == Limit{0, 0.125});
  CHECK(Config::parse("limit:100%").limit == Limit{0, 1.0});
  CHECK_FALSE(Config::parse("limit:0").limit.is_set());
  CHECK_FALSE(Config::parse("limit:20GiB,limit:0").limit.is_set());
  CHECK(Config::parse("expandable_va_size:1TiB").va_size == TiB);
  CHECK(Config::parse("expandable_max_handle:64MiB").max_handle_size == 64 * MiB);
  CHECK(Config::parse("expandable_max_handle:0").max_handle_size == 0);
  CHECK(Config::parse("ipc_handle:posix_fd").ipc_handle == IpcHandle::posix_fd);
  CHECK(Config::parse("ipc_handle:fabric").ipc_handle == IpcHandle::fabric);
  CHECK(Config::parse("ipc_handle:none").ipc_handle == IpcHandle::none);
  CHECK(Config::parse("record:True").record);
  CHECK(Config::parse("record_ring:1000").record_ring == 1000);
  CHECK(Config::parse("oom_snapshot:true").oom_snapshot);
  CHECK_FALSE(Config::parse("oom_counterfactual:False").oom_counterfactual);

  const Config c = Config::parse(" backend : expandable , device:sim,limit: 2 GiB ,record_ring:5 ");
  CHECK(c.backend == BackendKind::expandable);
  CHECK(c.device == DeviceKind::sim);
  CHECK(c.limit.bytes == 2 * GiB);
  CHECK(c.record_ring == 5);
}

TEST_CASE("config: bools take true/false/True/False/1/0 only") {
  for (const char* t : {"true", "True", "1"}) CHECK(Config::parse(std::string("record:") + t).record);
  for (const char* f : {"false", "False", "0"}) CHECK_FALSE(Config::parse(std::string("oom_counterfactual:") + f).oom_counterfactual);
  for (const char* bad : {"yes", "TRUE", "2", "on", "t"})
    check_fails(std::string("record:") + bad, "record", {bad, "true, false, True, False, 1 or 0"});
}

TEST_CASE("config: enum values are checked and the valid ones listed") {
  check_fails("backend:foo", "backend", {"'foo'", "split_merge", "expandable", "native"});
  check_fails("policy:numpy", "policy", {"'numpy'", "pytorch", "cupy"});
  check_fails("device:rocm", "device", {"'rocm'", "cuda", "sim"});
  check_fails("ipc_handle:win32", "ipc_handle", {"'win32'", "none", "posix_fd", "fabric"});
  check_fails("backend:Expandable", "backend", {"'Expandable'"});
  check_fails("backend:cudaMallocAsync", "backend", {"cudaMallocAsync", "expseg", "not provided", "split_merge"});
}

TEST_CASE("config: sizes with units") {
  CHECK(parse_size("4096") == 4096);
  CHECK(parse_size("0") == 0);
  CHECK(parse_size("4096B") == 4096);
  CHECK(parse_size("512KiB") == 512 * KiB);
  CHECK(parse_size("20MiB") == 20 * MiB);
  CHECK(parse_size("2GiB") == 2 * GiB);
  CHECK(parse_size("3TiB") == 3 * TiB);
  CHECK(parse_size("1.5GiB") == 3 * GiB / 2);
  CHECK(parse_size("0.5KiB") == 512);
  CHECK(parse_size("2GB") == 2'000'000'000ull);
  CHECK(parse_size("1KB") == 1000);
  CHECK(parse_size("7MB") == 7'000'000);
  CHECK(parse_size("2TB") == 2'000'000'000'000ull);
  CHECK(parse_size("2gib") == 2 * GiB);
  CHECK(parse_size("2gb") == 2'000'000'000ull);
  CHECK(parse_size("2 GiB") == 2 * GiB);
  CHECK(parse_size(" 8b ") == 8);
  CHECK(parse_size("1.0009765625KiB") == 1025);
  CHECK_THROWS_AS((void)parse_size("1.9B"), config_error);  // a count of bytes has no fraction
  CHECK_THROWS_AS((void)parse_size("0.1B"), config_error);
  CHECK(parse_size("1.00B") == 1);
  CHECK(parse_size("18446744073709551615") == SIZE_MAX);
  CHECK(parse_size("16777215.99999999999999999999TiB") == 16777215 * TiB + (TiB - 1));
}

TEST_CASE("config: bad sizes name the key, the value and the units") {
  for (const char* bad : {"", "abc", "GiB", "1.GiB", ".5GiB", "1e9", "12XB", "1KIBB", "1,5GiB", "0x10", "inf", "nan", "1 2"}) {
    CAPTURE(bad);
    try {
      (void)expseg::parse_bytes(bad, "sim_capacity");
      FAIL("no error");
    } catch (const config_error& e) {
      CHECK(e.key() == "sim_capacity");
      CHECK(contains(e.what(), "sim_capacity"));
      CHECK(contains(e.what(), "KiB, MiB, GiB, TiB"));
    }
  }
  check_fails("sim_capacity:-1GiB", "sim_capacity", {"'-1GiB'", "negative"});
  check_fails("sim_capacity:18446744073709551616", "sim_capacity", {"larger than 18446744073709551615 bytes"});
  check_fails("sim_capacity:16777216TiB", "sim_capacity", {"16777216TiB", "larger than"});
  check_fails("limit:18446744073709551615.5KiB", "limit", {"larger than"});
  check_fails("limit:16777215.99999999999999999999TiB1", "limit", {"KiB, MiB, GiB, TiB"});
  CHECK_THROWS_AS((void)parse_size("18446744073709551615.5"), config_error);
  check_fails("limit:99999999999999999999999999999999999999GB", "limit", {"larger than"});
  check_fails("sim_capacity:0", "sim_capacity", {"'0'", "larger than 0"});
  check_fails("sim_granularity:3000", "sim_granularity", {"'3000'", "power of two", "4KiB"});
  check_fails("sim_granularity:2KiB", "sim_granularity", {"power of two", "multiple of 4KiB"});
  check_fails("sim_granularity:0", "sim_granularity", {"power of two"});
  check_fails("expandable_max_handle:3MiB", "expandable_max_handle", {"'3MiB'", "multiple of 2MiB"});
  check_fails("record_ring:-1", "record_ring", {"'-1'", "negative"});
  check_fails("record_ring:1.5", "record_ring", {"'1.5'", "integer"});
  check_fails("record_ring:99999999999999999999", "record_ring", {"too large"});
}

TEST_CASE("config: limit as a percentage") {
  CHECK(Config::parse("limit:0.5%").limit.fraction == 0.005);
  CHECK(Config::parse("limit: 25 %").limit.fraction == 0.25);
  CHECK_FALSE(Config::parse("limit:0%").limit.is_set());
  check_fails("limit:150%", "limit", {"'150%'", "[0%, 100%]"});
  check_fails("limit:-5%", "limit", {"negative"});
  check_fails("limit:abc%", "limit", {"'abc%'", "percentage"});
  check_fails("limit:%", "limit", {"percentage"});
  check_fails("limit:1e2%", "limit", {"percentage"});
  check_fails("limit:50%%", "limit", {"percentage"});
}

TEST_CASE("config: Limit::resolve") {
  CHECK(Limit{}.resolve(1000) == 0);
  CHECK(Limit{4096, 0}.resolve(1000) == 4096);
  CHECK(Limit{0, 0.5}.resolve(1001) == 500);
  CHECK(Limit{0, 1.0}.resolve(SIZE_MAX) == SIZE_MAX);
  CHECK(Limit{0, 0.25}.resolve(141 * GiB) == 141 * GiB / 4);
  CHECK(Limit{0, 0.3}.resolve(10) == 3);
  CHECK(Limit{0, 0.5}.resolve(0) == 0);
  CHECK(Config::parse("limit:50%").limit.resolve(80 * GiB) == 40 * GiB);
  CHECK(Config::parse("per_process_memory_fraction:0.25").limit.resolve(80 * GiB) == 20 * GiB);
}

TEST_CASE("config: format_bytes follows PyTorch's format_size") {
  CHECK(expseg::format_bytes(0) == "0 bytes");
  CHECK(expseg::format_bytes(1024) == "1024 bytes");
  CHECK(expseg::format_bytes(1025) == "1.00 KiB");
  CHECK(expseg::format_bytes(1536) == "1.50 KiB");
  CHECK(expseg::format_bytes(MiB) == "1024.00 KiB");
  CHECK(expseg::format_bytes(MiB + 1) == "1.00 MiB");
  CHECK(expseg::format_bytes(800 * MiB) == "800.00 MiB");
  CHECK(expseg::format_bytes(900 * MiB) == "900.00 MiB");
  CHECK(expseg::format_bytes(GiB) == "1024.00 MiB");
  CHECK(expseg::format_bytes(2064 * MiB) == "2.02 GiB");
  CHECK(expseg::format_bytes(150110011392ull) == "139.80 GiB");
}

TEST_CASE("config: enum names") {
  CHECK(std::string(to_string(BackendKind::split_merge)) == "split_merge");
  CHECK(std::string(to_string(BackendKind::expandable)) == "expandable");
  CHECK(std::string(to_string(DeviceKind::cuda)) == "cuda");
  CHECK(std::string(to_string(DeviceKind::sim)) == "sim");
  CHECK(std::string(to_string(PoolPolicy::pytorch)) == "pytorch");
  CHECK(std::string(to_string(PoolPolicy::cupy)) == "cupy");
  CHECK(std::string(to_string(IpcHandle::none)) == "none");
  CHECK(std::string(to_string(IpcHandle::posix_fd)) == "posix_fd");
  CHECK(std::string(to_string(IpcHandle::fabric)) == "fabric");
}

TEST_CASE("config: PyTorch's expandable_segments, max_split_size_mb, max_non_split_rounding_mb") {
  for (const char* t : {"True", "true", "1"}) CHECK(Config::parse(std::string("expandable_segments:") + t).backend == BackendKind::expandable);
  for (const char* f : {"False", "false", "0"})
    CHECK(Config::parse(std::string("backend:expandable,expandable_segments:") + f).backend == BackendKind::split_merge);
  check_fails("expandable_segments:maybe", "expandable_segments", {"'maybe'", "True"});

  CHECK(Config::parse("max_split_size_mb:21").max_split_size == 21 * MiB);
  CHECK(Config::parse("max_split_size_mb:512").max_split_size == 512 * MiB);
  CHECK(Config::parse("max_split_size_mb:512,max_split_size_mb:unlimited").max_split_size == SIZE_MAX);
  CHECK(Config::parse("max_split_size_mb:20").max_split_size == 20 * MiB);  // PyTorch 2.9+: >= 20
  check_fails("max_split_size_mb:19", "max_split_size_mb", {"max_split_size_mb: too small, must be >= 20", "'19'"});
  check_fails("max_split_size_mb:0", "max_split_size_mb", {"max_split_size_mb: too small, must be >= 20"});
  check_fails("max_split_size_mb:-1", "max_split_size_mb", {"negative"});
  check_fails("max_split_size_mb:1.5", "max_split_size_mb", {"'1.5'", "integer number of MiB"});
  check_fails("max_split_size_mb:64MiB", "max_split_size_mb", {"'64MiB'", "integer number of MiB"});
  // As PyTorch: a count of MiB past what a size_t holds in bytes is clamped to the largest that fits
  // (std::min(val, SIZE_MAX / kMB)); a number past 2^64 - 1 is an error.
  constexpr std::size_t kMostMiB = (SIZE_MAX >> 20) << 20;
  CHECK(Config::parse("max_split_size_mb:17592186044415").max_split_size == kMostMiB);
  CHECK(Config::parse("max_split_size_mb:17592186044416").max_split_size == kMostMiB);
  CHECK(Config::parse("max_split_size_mb:18446744073709551615").max_split_size == kMostMiB);
  CHECK(Config::parse("max_non_split_rounding_mb:99999999999999999").max_non_split_rounding == kMostMiB);
  CHECK(Config::parse("large_segment_size_mb:18446744073709551615").large_segment_size == kMostMiB);
  check_fails("max_split_size_mb:18446744073709551616", "max_split_size_mb", {"too large"});

  CHECK(Config::parse("max_non_split_rounding_mb:20").max_non_split_rounding == 20 * MiB);
  CHECK(Config::parse("max_non_split_rounding_mb:1024").max_non_split_rounding == GiB);
  check_fails("max_non_split_rounding_mb:19", "max_non_split_rounding_mb", {"max_non_split_rounding_mb: too small, must be >= 20"});
  check_fails("max_non_split_rounding_mb:x", "max_non_split_rounding_mb", {"'x'", "MiB"});
}

TEST_CASE("config: PyTorch's roundup_power2_divisions, single value and bracketed list") {
  using Arr = std::array<std::size_t, expseg::kRoundupIntervals>;
  auto all = [](std::size_t v) { Arr a; a.fill(v); return a; };
  CHECK(Config::parse("roundup_power2_divisions:4").roundup_power2_divisions == all(4));
  CHECK(Config::parse("roundup_power2_divisions:1").roundup_power2_divisions == all(1));
  CHECK(Config::parse("roundup_power2_divisions:0").roundup_power2_divisions == all(0));

  // PyTorch's documented example: 256 MB is interval 8; the intervals before the first key get its value.
  const Arr ex = Config::parse("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]").roundup_power2_divisions;
  CHECK(ex == Arr{1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 4, 8, 8, 8, 8, 8});
  CHECK(Config::parse("roundup_power2_divisions: [ 256 : 1 , 512:2, 1024:4 , > : 8 ] ").roundup_power2_divisions == ex);
  CHECK(Config::parse("roundup_power2_divisions:[1:2,>:4]").roundup_power2_divisions ==
        Arr{2, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4});
  // '>' first: as PyTorch, it fills after interval 0, which keeps its value (0).
  CHECK(Config::parse("roundup_power2_divisions:[>:8]").roundup_power2_divisions ==
        Arr{0, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8});
  // Keys beyond 32768 MB clamp to the last interval; only the listed ones are set after the first.
  CHECK(Config::parse("roundup_power2_divisions:[4:2,1048576:16]").roundup_power2_divisions ==
        Arr{2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 16});
  CHECK(Config::parse("roundup_power2_divisions:[]").roundup_power2_divisions == all(0));
  // A later roundup_power2_divisions replaces the whole array.
  CHECK(Config::parse("roundup_power2_divisions:8,roundup_power2_divisions:[2:1]").roundup_power2_divisions ==
        Arr{1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0});
  // The brackets keep their commas: the next key still parses.
  const Config c = Config::parse("roundup_power2_divisions:[256:1,>:8],backend:expandable");
  CHECK(c.backend == BackendKind::expandable);
  CHECK(c.roundup_power2_divisions[15] == 8);

  const char* key = "roundup_power2_divisions";
  check_fails("roundup_power2_divisions:3", key, {"'3'", "power of two"});
  check_fails("roundup_power2_divisions:[256:3]", key, {"power of two", "divisions 3"});
  check_fails("roundup_power2_divisions:[100:2]", key, {"interval 100", "power of two"});
  check_fails("roundup_power2_divisions:[0:2]", key, {"interval 0"});
  check_fails("roundup_power2_divisions:[256:1", key, {"never closed"});
  check_fails("roundup_power2_divisions:[256:1,512:2", key, {"never closed"});
  check_fails("roundup_power2_divisions:256:1]", key, {"unbalanced ']'"});
  check_fails("roundup_power2_divisions:[256]", key, {"'256' is not MB:divisions"});
  check_fails("roundup_power2_divisions:[256:1,,512:2]", key, {"is not MB:divisions"});
  check_fails("roundup_power2_divisions:[256:1,,]", key, {"is not MB:divisions"});  // one trailing comma only, as PyTorch
  check_fails("roundup_power2_divisions:[,]", key, {"is not MB:divisions"});
  check_fails("roundup_power2_divisions:[[256:1]]", key, {"nested"});
  check_fails("roundup_power2_divisions:[256:-1]", key, {"negative"});
  check_fails("roundup_power2_divisions:[256:x]", key, {"[MB:divisions"});
  check_fails("roundup_power2_divisions:[a:1]", key, {"'[a:1]'"});
  check_fails("roundup_power2_divisions:[256:1]x", key, {"unexpected text 'x' after ']'"});
}

TEST_CASE("config: PyTorch's garbage_collection_threshold and per_process_memory_fraction") {
  CHECK(Config::parse("garbage_collection_threshold:0.6").garbage_collection_threshold == 0.6);
  CHECK(Config::parse("garbage_collection_threshold:0.6,garbage_collection_threshold:off").garbage_collection_threshold == 0.0);
  for (const char* bad : {"0", "1", "1.5", "-0.2"})
    check_fails(std::string("garbage_collection_threshold:") + bad, "garbage_collection_threshold",
                {bad, "set it in (0.0, 1.0)"});
  for (const char* bad : {"nan", "inf", "abc", "0.5x"})
    check_fails(std::string("garbage_collection_threshold:") + bad, "garbage_collection_threshold", {bad, "(0, 1)"});

  CHECK(Config::parse("per_process_memory_fraction:0.5").limit == Limit{0, 0.5});
  CHECK(Config::parse("per_process_memory_fraction:1").limit == Limit{});  // PyTorch: 1 sets no limit
  CHECK(Config::parse("per_process_memory_fraction:0").limit == Limit{1, 0.0});  // PyTorch: 0 bytes; ours: 1 byte
  CHECK(Config::parse("limit:4GiB,per_process_memory_fraction:0.5").limit == Limit{0, 0.5});
  CHECK(Config::parse("per_process_memory_fraction:0.5,limit:4GiB").limit == Limit{4 * GiB, 0});
  for (const char* bad : {"1.01", "-0.5", "nan", "50%"})
    check_fails(std::string("per_process_memory_fraction:") + bad, "per_process_memory_fraction", {bad, "[0, 1]"});
}

TEST_CASE("config: PyTorch's host-side keys are accepted and ignored, but their values are checked") {
  const Config c = Config::parse(
      "release_lock_on_cudamalloc:True,pinned_use_cuda_host_register:True,pinned_num_register_threads:8,"
      "pinned_use_background_threads:True,pinned_reserve_segment_size_mb:64,graph_capture_record_stream_reuse:False");
  CHECK(c == Config{});
  check_fails("release_lock_on_cudamalloc:sure", "release_lock_on_cudamalloc", {"'sure'", "True"});
  check_fails("pinned_num_register_threads:many", "pinned_num_register_threads", {"'many'", "integer"});
}

TEST_CASE("config: PyTorch parity: the newer pinned keys, register threads, a leading '+', the reserve's cap") {
  // PyTorch accepts the pinned_max_* keys (host-side: checked, ignored here), refuses register
  // thread counts that are no power of two or above 128, reads doubles with std::stod (a leading
  // '+'), and caps expandable_segments_reserve's fraction at the full reserve. Each was an
  // "unknown option", an accepted bad value, a refused good one, or a reserve of 100000x the device.
  CHECK(Config::parse("expandable_segments:True,pinned_max_round_threshold_mb:1,pinned_max_cached_size_mb:1") ==
        Config::parse("expandable_segments:True"));
  CHECK(Config::parse("pinned_num_register_threads:128") == Config{});
  for (const char* bad : {"0", "3", "256"})
    check_fails(std::string("pinned_num_register_threads:") + bad, "pinned_num_register_threads", {bad, "power of two"});
  CHECK(Config::parse("garbage_collection_threshold:+0.5").garbage_collection_threshold == 0.5);
  CHECK(Config::parse("per_process_memory_fraction:+0.5").limit == Config::parse("limit:50%").limit);
  for (const char* bad : {"+-0.5", "++0.5", "+"})
    check_fails(std::string("garbage_collection_threshold:") + bad, "garbage_collection_threshold", {bad});
  CHECK(Config::parse("expandable_segments_reserve:4").to_string() == Config::parse("expandable_va_size:200%").to_string());
  CHECK(Config::parse("expandable_segments_reserve:100000").to_string() == Config::parse("expandable_va_size:200%").to_string());
  CHECK(Config::parse("expandable_segments_reserve:0.5").to_string() == Config::parse("expandable_va_size:50%").to_string());
}

TEST_CASE("config regression: PyTorch's '+', and messages that say what is wrong") {
  // max_split_size_mb:+128 was refused (PyTorch's stoull takes the '+'); text after a roundup list's
  // ']' reported as "missing ']'"; a pasted "PYTORCH_CUDA_ALLOC_CONF=..." as "use ':' not '='".
  CHECK(Config::parse("max_split_size_mb:+128").max_split_size == 128 * MiB);
  CHECK(Config::parse("record_ring:+7").record_ring == 7);
  for (const char* bad : {"+", "+-1", "++1"}) check_fails(std::string("max_split_size_mb:") + bad, "max_split_size_mb", {bad});
  check_fails("roundup_power2_divisions:[256:1,>:4] x", "roundup_power2_divisions", {"unexpected text ' x' after ']'"});
  check_fails("roundup_power2_divisions:[256:1,>:4", "roundup_power2_divisions", {"'[' opened and never closed"});
  check_fails("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", "PYTORCH_CUDA_ALLOC_CONF",
              {"'PYTORCH_CUDA_ALLOC_CONF=' is the name of a variable, not an item", "e.g. EXPSEG_ALLOC_CONF=expandable_segments:True"});
  check_fails("EXPSEG_ALLOC_CONF=backend:expandable,limit:1GiB", "EXPSEG_ALLOC_CONF", {"e.g. EXPSEG_ALLOC_CONF=backend:expandable"});
}

TEST_CASE("config regression: a Config built in code is held to each key's bounds, and policy:cupy refuses PyTorch's rules") {
  // Was accepted by Allocator, its to_string() then not reading back (an oom_dump's configuration lost
  // to `expseg explain`), or rounded down; under policy:cupy, split_merge ignored PyTorch's keys without a word.
  auto refused = [](const Config& c, const char* key, std::string_view part) {
    CAPTURE(key);
    try {
      c.validate();
      FAIL("accepted: " << c.to_string());
    } catch (const config_error& e) {
      CHECK(e.key() == key);
      CHECK(contains(e.what(), part));
    }
  };
  Config c;
  c.garbage_collection_threshold = 1.5;
  refused(c, "garbage_collection_threshold", "out of range");
  c.garbage_collection_threshold = std::nan("");
  refused(c, "garbage_collection_threshold", "out of range");
  c = Config{};
  c.roundup_power2_divisions[3] = 3;
  refused(c, "roundup_power2_divisions", "3 divisions");
  c = Config{};
  c.max_handle_size = 3 * MiB;
  refused(c, "expandable_max_handle", "multiple of 2MiB");
  c = Config{};
  c.max_split_size = 25 * MiB + 512;
  refused(c, "max_split_size_mb", "whole number of MiB");
  c = Config{};
  c.max_non_split_rounding = 25 * MiB + 512;
  refused(c, "max_non_split_rounding_mb", "whole number of MiB");
  // An oom_dump path that its key:value form cannot carry (was accepted, and the dump's configuration
  // then did not read back: `expseg explain` replayed with the defaults).
  for (const auto& [path, part] : std::initializer_list<std::pair<const char*, const char*>>{
           {"/tmp/dump,%n.json", "cannot contain ','"}, {"/tmp/a%q", "%p (process id)"}, {"/tmp/]x[", "unbalanced ']'"},
           {" /tmp/x", "reads back from EXPSEG_ALLOC_CONF's syntax as '/tmp/x'"}, {"none", "as 'none'"}}) {
    CAPTURE(path);
    c = Config{};
    c.oom_dump = path;
    refused(c, "oom_dump", part);
  }
  c = Config{};
  c.oom_dump = "/tmp/dumps/oom-%p-%n.json";
  CHECK_NOTHROW(c.validate());
  CHECK(Config::parse(c.to_string()) == c);
  // The simulated device's keys are printed for a GPU configuration too, so they are bounded there too.
  c = Config{};
  c.device = expseg::DeviceKind::cuda;
  c.sim_capacity = 0;
  refused(c, "sim_capacity", "larger than 0");
  c.sim_capacity = Config{}.sim_capacity;
  c.sim_granularity = 3000;
  refused(c, "sim_granularity", "power of two");
  // What passes prints what reads back.
  c = Config{};
  c.garbage_collection_threshold = 0.5;
  c.roundup_power2_divisions.fill(4);
  c.max_handle_size = 64 * MiB;
  c.max_split_size = 256 * MiB;
  CHECK_NOTHROW(c.validate());
  CHECK(Config::parse(c.to_string()) == c);

  for (const char* keys : {"max_split_size_mb:128", "roundup_power2_divisions:4", "garbage_collection_threshold:0.5",
                           "large_segment_size_mb:32", "max_non_split_rounding_mb:64"}) {
    CAPTURE(keys);
    const Config cupy = Config::parse(std::string("policy:cupy,") + keys);
    const std::string key(std::string_view(keys).substr(0, std::string_view(keys).find(':')));
    refused(cupy, "policy", "policy:cupy: CuPy's memory pool has none of PyTorch's rules (");
    refused(cupy, "policy", key);
    CHECK_NOTHROW(Config::parse(std::string("policy:pytorch,") + keys).validate());
    CHECK_NOTHROW(Config::parse(std::string("policy:cupy,backend:expandable,") + keys).validate());  // policy is split_merge's
  }
  CHECK_NOTHROW(Config::parse("policy:cupy,limit:1GiB").validate());
  // large_segment_size_mb alone names itself, not the max_non_split_rounding_mb it raises to its own
  // size (was: both named, though the user set one).
  try {
    Config::parse("policy:cupy,large_segment_size_mb:32").validate();
    FAIL("refused");
  } catch (const config_error& e) {
    CHECK(std::string(e.what()).find("(large_segment_size_mb)") != std::string::npos);
  }
  try {
    Config::parse("policy:cupy,large_segment_size_mb:32,max_non_split_rounding_mb:64").validate();
    FAIL("refused");
  } catch (const config_error& e) {
    CHECK(std::string(e.what()).find("(max_non_split_rounding_mb, large_segment_size_mb)") != std::string::npos);
  }
  // And where a configuration takes effect: the C API refuses it before any allocator exists.
  CHECK_THROWS_AS(expseg::Allocator(Config::parse("device:sim,policy:cupy,max_split_size_mb:128")), config_error);
}

TEST_CASE("config: a pasted PYTORCH_CUDA_ALLOC_CONF works") {
  const Config c = Config::parse(
      "expandable_segments:True,max_split_size_mb:128,garbage_collection_threshold:0.8,"
      "roundup_power2_divisions:[256:1,512:2,1024:4,>:8],release_lock_on_cudamalloc:True");
  CHECK(c.backend == BackendKind::expandable);
  CHECK(c.max_split_size == 128 * MiB);
  CHECK(c.garbage_collection_threshold == 0.8);
  CHECK(c.roundup_power2_divisions[10] == 4);
  CHECK(Config::parse("backend:native,max_split_size_mb:200").max_split_size == 200 * MiB);
  // PyTorch accepts one trailing comma, and its ROCm spellings of host-side keys.
  CHECK(Config::parse("expandable_segments:True,").backend == BackendKind::expandable);
  CHECK(Config::parse("max_split_size_mb:64 , ").max_split_size == 64 * MiB);
  CHECK(Config::parse("release_lock_on_hipmalloc:True,pinned_use_hip_host_register:False") == Config{});
}

TEST_CASE("config: PyTorch's backend:native names its caching allocator, with or without expandable segments") {
  // In PyTorch, backend picks native or cudaMallocAsync and expandable_segments is a mode of native,
  // whatever their order: "expandable_segments:True,backend:native" is the native allocator with
  // expandable segments, i.e. expseg's expandable backend.
  CHECK(Config::parse("expandable_segments:True,backend:native").backend == BackendKind::expandable);
  CHECK(Config::parse("backend:native,expandable_segments:True").backend == BackendKind::expandable);
  CHECK(Config::parse("expandable_segments:False,backend:native").backend == BackendKind::split_merge);
  CHECK(Config::parse("backend:native").backend == BackendKind::split_merge);
  CHECK(Config::parse("expandable_segments:True,max_split_size_mb:256,backend:native,garbage_collection_threshold:0.6").backend ==
        BackendKind::expandable);
}

TEST_CASE("config: unknown keys name the key and list every valid key") {
  for (const char* text : {"bakend:expandable", "Backend:expandable", "max_split_size:100", "foo"}) {
    CAPTURE(text);
    const Failure f = parse_failure(text);
    REQUIRE(f.threw);
    const std::string key = std::string(text).substr(0, std::string(text).find(':'));
    CHECK(f.key == key);
    CHECK(contains(f.message, "unknown option '" + key + "'"));
    for (const std::string& name : option_names()) {
      CAPTURE(name);
      CHECK(contains(f.message, name));
    }
  }
}

TEST_CASE("config: syntax errors") {
  check_fails("backend:expandable,,device:sim", "", {"empty item"});
  check_fails(",backend:expandable", "", {"empty item"});
  check_fails("backend:expandable,,", "", {"empty item"});
  check_fails(",", "", {"empty item"});
  check_fails("backend:expandable, ,device:sim", "", {"empty item"});
  check_fails(":expandable", "", {"empty key"});
  check_fails("backend", "backend", {"missing ':value'", "split_merge|expandable"});
  check_fails("backend:", "backend", {"empty value", "split_merge|expandable"});
  check_fails("limit:  ", "limit", {"empty value"});
  check_fails("backend:expandable:sim", "backend", {"'expandable:sim'"});
  check_fails("]", "", {"unbalanced ']'"});
  check_fails("[", "", {"never closed"});
}

TEST_CASE("config: later keys win, and a failed apply leaves the config unchanged") {
  CHECK(Config::parse("backend:expandable,backend:split_merge").backend == BackendKind::split_merge);
  CHECK(Config::parse("expandable_segments:True,backend:split_merge").backend == BackendKind::split_merge);
  CHECK(Config::parse("backend:split_merge,expandable_segments:True").backend == BackendKind::expandable);

  Config c = Config::parse("backend:expandable,limit:4GiB");
  c.apply("device:sim");
  CHECK(c.backend == BackendKind::expandable);
  CHECK(c.device == DeviceKind::sim);
  const Config before = c;
  CHECK_THROWS_AS(c.apply("record:true,limit:8GiB,policy:bogus"), config_error);
  CHECK(c == before);
  CHECK_THROWS_AS(c.apply("record:true,unknown_key:1"), config_error);
  CHECK(c == before);
  CHECK_THROWS_AS(c.apply("record:true,,"), config_error);
  CHECK(c == before);
  c.apply("");
  CHECK(c == before);
}

// How fast these fail is measured by benchmarks/bench_parse.cpp (parse/config_hostile), not by a
// wall-clock bound here.
TEST_CASE("config: hostile input fails with a short, clear message") {
  const std::string mb(1 << 20, 'a');
  {
    const Failure f = parse_failure(mb);
    REQUIRE(f.threw);
    CHECK(contains(f.message, "unknown option"));
    CHECK(contains(f.message, "1048576 bytes"));
    CHECK(f.message.size() < 2000);
  }
  for (const auto& o : Config::options()) {
    CAPTURE(o.name);
    for (const std::string& value : {mb, std::string(1 << 20, '9'), "1." + std::string(1 << 20, '9') + "GiB",
                                     std::string(1 << 20, '[') , "-" + std::string(1 << 20, '1'), std::string("\x01\x02\xff", 3)}) {
      const Failure f = parse_failure(std::string(o.name) + ":" + value);
      if (!f.threw) continue;  // e.g. a long fraction of a size is valid
      CHECK(f.key == o.name);
      CHECK(f.message.size() < 2000);
    }
  }
  CHECK(parse_failure(std::string(1 << 20, ',')).threw);
  CHECK(parse_failure(std::string(1 << 20, ']')).threw);
  CHECK(parse_failure("backend:" + std::string(1 << 20, ' ') + "x").threw);
  CHECK(Config::parse("backend:" + std::string(1 << 20, ' ') + "expandable").backend == BackendKind::expandable);
  std::string many;
  for (int i = 0; i < 20000; ++i) many += "record:true,";
  many += "record:false";
  CHECK_FALSE(Config::parse(many).record);
}

TEST_CASE("config: from_env reads EXPSEG_ALLOC_CONF") {
  ::unsetenv("EXPSEG_ALLOC_CONF");
  CHECK(Config::from_env() == Config{});
  ::setenv("EXPSEG_ALLOC_CONF", "", 1);
  CHECK(Config::from_env() == Config{});
  ::setenv("EXPSEG_ALLOC_CONF", "backend:expandable,device:sim,limit:50%", 1);
  const Config c = Config::from_env();
  CHECK(c.backend == BackendKind::expandable);
  CHECK(c.device == DeviceKind::sim);
  CHECK(c.limit.fraction == 0.5);
  ::setenv("EXPSEG_ALLOC_CONF", "backend:bogus", 1);
  try {
    (void)Config::from_env();
    FAIL("no error");
  } catch (const config_error& e) {
    CHECK(e.key() == "backend");
    CHECK(contains(e.what(), "EXPSEG_ALLOC_CONF"));
    CHECK(contains(e.what(), "'bogus'"));
  }
  ::unsetenv("EXPSEG_ALLOC_CONF");
}

TEST_CASE("config: to_string normalises PyTorch aliases") {
  const std::string s = Config::parse("expandable_segments:True,per_process_memory_fraction:0.5").to_string();
  CHECK(contains(s, "backend:expandable"));
  CHECK(contains(s, "limit:50%"));
  CHECK_FALSE(contains(s, "expandable_segments"));
  CHECK_FALSE(contains(s, "per_process_memory_fraction"));
  CHECK(contains(Config::parse("limit:1.5GiB").to_string(), "limit:1536MiB"));
  CHECK(contains(Config::parse("limit:4097").to_string(), "limit:4097,"));
  CHECK(contains(Config::parse("per_process_memory_fraction:0.123").to_string(), "limit:12.3%"));
  CHECK(contains(Config::parse("limit:0.0001%").to_string(), "limit:0.0001%"));
  CHECK(contains(Config::parse("max_split_size_mb:100").to_string(), "max_split_size_mb:100,"));
  CHECK(contains(Config::parse("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]").to_string(),
                 "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]"));
  CHECK(contains(Config::parse("roundup_power2_divisions:[>:8]").to_string(), "roundup_power2_divisions:[1:0,>:8]"));
  CHECK(contains(Config::parse("roundup_power2_divisions:16").to_string(), "roundup_power2_divisions:16,"));
  CHECK(contains(Config::parse("garbage_collection_threshold:0.7").to_string(), "garbage_collection_threshold:0.7"));
}

TEST_CASE("config: parse(to_string()) == config for randomized configs") {
  std::mt19937_64 rng(20261129);
  auto pick = [&](std::uint64_t n) { return rng() % n; };
  auto unit_real = [&] { return std::uniform_real_distribution<double>(0.0, 1.0)(rng); };
  for (int round = 0; round < 5000; ++round) {
    Config c;
    c.backend = static_cast<BackendKind>(pick(2));
    c.policy = static_cast<PoolPolicy>(pick(2));
    c.device = static_cast<DeviceKind>(pick(2));
    c.sim_capacity = pick(2) ? (pick(1u << 20) + 1) * MiB : 1 + pick(SIZE_MAX);
    c.sim_granularity = std::size_t{1} << (12 + pick(29));  // 4KiB .. 1TiB
    c.sim_host_backed = pick(2);
    c.sim_latency = pick(2);
    switch (pick(4)) {
      case 0: c.limit = Limit{}; break;
      case 1: c.limit = Limit{1 + pick(SIZE_MAX - 1), 0}; break;
      case 2: c.limit = Limit{(1 + pick(1000)) * GiB, 0}; break;
      default: {
        double f = unit_real();
        if (pick(4) == 0) f = std::ldexp(f, -static_cast<int>(pick(1000)));
        if (pick(8) == 0) f = 1.0;
        if (f == 0.0) f = 0.5;
        c.limit = Limit{0, f};
      }
    }
    c.va_size = pick(2) ? pick((std::size_t{1} << 50) + 1) : pick(1024) * GiB;  // at most 1 PiB
    if (pick(8) == 0) c.va_size = std::size_t{1} << 50;
    c.max_handle_size = pick(1u << 20) * 2 * MiB;
    c.ipc_handle = static_cast<IpcHandle>(pick(3));
    c.peer_access = static_cast<expseg::PeerAccess>(pick(2));
    c.record = pick(2);
    c.record_ring = pick(2) ? pick(SIZE_MAX) : pick(100);
    c.oom_snapshot = pick(2);
    c.oom_counterfactual = pick(2);
    if (pick(2)) {  // a path of the characters a value can hold, with and without % sequences
      static constexpr std::string_view kChars = "/._-:%pdnab 0~";
      const std::size_t n = 1 + pick(24);
      for (std::size_t i = 0; i < n; ++i) c.oom_dump += kChars[pick(kChars.size())];
      c.oom_dump = std::string(trim_spaces(c.oom_dump));
      // Make every '%' valid: a pattern that does not parse is a different test.
      for (std::size_t i = 0; i < c.oom_dump.size(); ++i)
        if (c.oom_dump[i] == '%') {
          if (i + 1 == c.oom_dump.size() || std::string_view("pdn%").find(c.oom_dump[i + 1]) == std::string_view::npos)
            c.oom_dump.insert(i + 1, 1, 'n');
          ++i;
        }
      if (c.oom_dump == "none") c.oom_dump.clear();
    }
    c.max_split_size = pick(3) == 0 ? SIZE_MAX : (21 + pick((SIZE_MAX >> 20) - 20)) * MiB;
    c.max_non_split_rounding = (20 + pick(pick(2) ? 1000 : (SIZE_MAX >> 20) - 19)) * MiB;
    if (pick(3) != 0) {
      for (auto& d : c.roundup_power2_divisions) d = pick(3) == 0 ? 0 : std::size_t{1} << pick(pick(2) ? 4 : 64);
      if (pick(2)) {  // runs, as real configs have
        const std::size_t cut = pick(16);
        for (std::size_t i = cut; i < 16; ++i) c.roundup_power2_divisions[i] = c.roundup_power2_divisions[cut];
      }
    }
    if (pick(2)) {
      c.garbage_collection_threshold = unit_real();
      if (c.garbage_collection_threshold == 0.0) c.garbage_collection_threshold = 0.25;
    }
    const std::string text = c.to_string();
    CAPTURE(text);
    Config back;
    REQUIRE_NOTHROW(back = Config::parse(text));
    REQUIRE(back == c);
    REQUIRE(back.to_string() == text);
  }
}

TEST_CASE("config: a non-zero limit too small for one byte stays a limit of 1 byte") {
  // floor(fraction * total) is 0 for these, and a limit of 0 means "no limit".
  CHECK(Limit{0, 1e-300}.resolve(80 * GiB) == 1);
  CHECK(Config::parse("per_process_memory_fraction:1e-300").limit.resolve(80 * GiB) == 1);
  CHECK(Config::parse("limit:0.0000000001%").limit.resolve(80 * GiB) == 1);
  CHECK(Limit{0, 0.1}.resolve(9) == 1);
  CHECK(Limit{0, 0.1}.resolve(10) == 1);
  CHECK(Limit{0, 0.1}.resolve(20) == 2);
  // 0 is still "no limit", however it is written.
  CHECK(Config::parse("limit:0%").limit.resolve(80 * GiB) == 0);
  CHECK(Config::parse("limit:0").limit.resolve(80 * GiB) == 0);
  CHECK(Config::parse("limit:0.000").limit.resolve(80 * GiB) == 0);
  // A byte count below one byte is an error, not 0 ("no limit", "the default"): limit:0.5 was no limit.
  check_fails("limit:0.5", "limit", {"'0.5'", "less than one byte", "50%"});
  check_fails("limit:0.9B", "limit", {"less than one byte"});
  check_fails("expandable_va_size:0.5", "expandable_va_size", {"less than one byte"});
  check_fails("expandable_max_handle:0.0001KiB", "expandable_max_handle", {"less than one byte"});
  // A count of bytes has no fraction (was: limit:1.5 and limit:1.9B were a 1-byte limit); below a
  // larger unit, the fraction of a byte is dropped.
  check_fails("limit:1.5", "limit", {"'1.5'", "a number of bytes is a whole number"});
  check_fails("limit:1.9B", "limit", {"'1.9B'", "a number of bytes is a whole number"});
  CHECK(Config::parse("limit:2.000").limit.bytes == 2);
  CHECK(Config::parse("limit:0.001KiB").limit.bytes == 1);
  CHECK(Config::parse("limit:1.3KiB").limit.bytes == 1331);
}

TEST_CASE("config: simulated-device and expandable sizes are bounded so that they cannot overflow") {
  CHECK(Config::parse("sim_granularity:1TiB").sim_granularity == TiB);
  check_fails("sim_granularity:2TiB", "sim_granularity", {"'2TiB'", "at most 1TiB"});
  check_fails("sim_granularity:9223372036854775808", "sim_granularity", {"at most 1TiB"});
  CHECK(Config::parse("expandable_va_size:1024TiB").va_size == 1024 * TiB);
  check_fails("expandable_va_size:65536TiB", "expandable_va_size", {"'65536TiB'", "at most 1024TiB"});
  check_fails("expandable_va_size:18446744073709551615", "expandable_va_size", {"at most 1024TiB"});
  check_fails("expandable_va_size:1025TiB", "expandable_va_size", {"at most 1024TiB"});
  // record_ring needs no bound: the recorder reserves lazily, any ring works (test_allocator.cpp).
  CHECK(Config::parse("record_ring:18446744073709551615").record_ring == SIZE_MAX);
}

TEST_CASE("config: messages quote non-ASCII and control bytes as \\xNN") {
  const Failure key = parse_failure("b\xff\xfe" "ackend:x");
  REQUIRE(key.threw);
  CAPTURE(key.message);
  CHECK(contains(key.message, "unknown option 'b\\xff\\xfeackend'"));
  CHECK(key.key == "b\\xff\\xfeackend");
  const Failure value = parse_failure("backend:expand\xc3(able\x01\\");
  REQUIRE(value.threw);
  CAPTURE(value.message);
  CHECK(contains(value.message, "'expand\\xc3(able\\x01\\x5c'"));
  for (const Failure& f : {key, value}) {
    std::size_t unprintable = 0;
    for (char c : f.message) unprintable += static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f;
    CHECK(unprintable == 0);
  }
}

}  // TEST_SUITE

TEST_CASE("config: oom_dump takes a path pattern, none turns it off, and a bad % names the key") {
  CHECK(Config{}.oom_dump.empty());
  CHECK(Config::parse("oom_dump:/tmp/oom-%p-%d-%n.json").oom_dump == "/tmp/oom-%p-%d-%n.json");
  CHECK(Config::parse("oom_dump:/tmp/a:b/100%%.json").oom_dump == "/tmp/a:b/100%%.json");  // ':' after the first is the path's
  CHECK(Config::parse("oom_dump:/tmp/x.json,oom_dump:none").oom_dump.empty());
  const Config c = Config::parse("oom_dump:dumps/oom-%n.json");
  CHECK(Config::parse(c.to_string()) == c);
  CHECK(c.to_string().find(",oom_dump:dumps/oom-%n.json,") != std::string::npos);
  for (const char* bad : {"oom_dump:/tmp/oom-%q.json", "oom_dump:/tmp/oom-%", "oom_dump:%s"}) {
    CAPTURE(bad);
    try {
      (void)Config::parse(bad);
      FAIL("accepted");
    } catch (const config_error& e) {
      CHECK(e.key() == "oom_dump");
      CHECK(std::string(e.what()).find("%p (process id), %d (device), %n (the OOM's number)") != std::string::npos);
    }
  }
  CHECK(expseg::expand_oom_dump_path("/d/oom-%p-%d-%n.json", 4242, 3, 17) == "/d/oom-4242-3-17.json");
  CHECK(expseg::expand_oom_dump_path("100%%-%n%n", 1, 0, 2) == "100%-22");
  CHECK(expseg::expand_oom_dump_path("plain.json", 1, 0, 2) == "plain.json");
}

#ifdef EXPSEG_SOURCE_DIR
TEST_CASE("config: every option `expseg config` lists is in README's configuration table, and every key there is an option") {
  std::ifstream f(EXPSEG_SOURCE_DIR "/README.md");
  REQUIRE(f.good());
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string readme = ss.str();
  const std::size_t begin = readme.find("\n## Configuration\n");
  REQUIRE(begin != std::string::npos);
  const std::size_t end = readme.find("\n## ", begin + 1);
  std::set<std::string> documented;  // the backticked names in the first column of the table
  std::stringstream section(readme.substr(begin, end - begin));
  for (std::string line; std::getline(section, line);) {
    if (line.rfind("| `", 0) != 0) continue;
    const std::string first = line.substr(1, line.find('|', 1) - 1);
    for (std::size_t at = first.find('`'); at != std::string::npos; at = first.find('`', first.find('`', at + 1) + 1)) {
      const std::size_t close = first.find('`', at + 1);
      REQUIRE(close != std::string::npos);
      documented.insert(first.substr(at + 1, close - at - 1));
    }
  }
  std::set<std::string> options;
  for (const Config::Option& o : Config::options()) options.insert(o.name);
  for (const std::string& name : options) {
    INFO(name);
    CHECK(documented.count(name) == 1);
  }
  for (const std::string& name : documented) {
    INFO(name);
    CHECK(options.count(name) == 1);
  }
}
#endif
