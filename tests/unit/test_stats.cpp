// Stats counters and their JSON; snapshot and OOM report JSON (stats.hpp, snapshot.hpp, errors.hpp).
#include <doctest/doctest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/json.hpp"
#include "expseg/errors.hpp"
#include "expseg/snapshot.hpp"
#include "expseg/stats.hpp"

using expseg::Stat;
using expseg::Stats;
using expseg::core::JsonValue;
using expseg::core::parse_json;

namespace {

// Every Stat of a Stats by its JSON prefix; the test's own walk over the X-macros.
std::vector<std::pair<std::string, Stat*>> all_stats(Stats& s) {
  std::vector<std::pair<std::string, Stat*>> out;
#define X(name, help) \
  for (int p = 0; p < expseg::kStatPools; ++p) out.emplace_back(std::string(#name ".") + expseg::stat_pool_name(p), &s.name[p]);
  EXPSEG_POOL_STATS(X)
#undef X
  out.emplace_back("oversize_allocations", &s.oversize_allocations);
  out.emplace_back("oversize_segments", &s.oversize_segments);
  out.emplace_back("physical_handles", &s.physical_handles);
  return out;
}

std::vector<std::pair<std::string, std::int64_t*>> all_counters(Stats& s) {
  std::vector<std::pair<std::string, std::int64_t*>> out;
#define X(name, help) out.emplace_back(#name, &s.name);
  EXPSEG_COUNTERS(X)
#undef X
  out.emplace_back("max_split_size", &s.max_split_size);
  out.emplace_back("num_free_blocks", &s.num_free_blocks);
  return out;
}

// A Stats whose every number is different.
Stats distinct_stats() {
  Stats s;
  std::int64_t n = 1000;
  for (auto& [name, st] : all_stats(s)) {
    st->increase(n + 7);
    st->increase(n + 3);
    st->decrease(n + 1);
    n += 1000;
  }
  for (auto& [name, c] : all_counters(s)) *c = ++n;
  return s;
}

std::size_t count_occurrences(const std::string& text, const std::string& needle) {
  std::size_t count = 0;
  for (std::size_t pos = text.find(needle); pos != std::string::npos; pos = text.find(needle, pos + 1)) ++count;
  return count;
}

}  // namespace

TEST_SUITE("stats") {

TEST_CASE("stats: Stat increase, decrease, peak and resets") {
  Stat s;
  s.increase(10);
  s.increase(5);
  CHECK(s.current == 15);
  CHECK(s.peak == 15);
  CHECK(s.allocated == 15);
  s.decrease(12);
  CHECK(s.current == 3);
  CHECK(s.peak == 15);
  CHECK(s.freed == 12);
  CHECK(s.current == s.allocated - s.freed);
  s.increase(4);
  CHECK(s.peak == 15);
  s.reset_peak();
  CHECK(s.peak == 7);
  s.reset_accumulated();  // as PyTorch: the totals restart at 0, current and peak stay
  CHECK(s.allocated == 0);
  CHECK(s.freed == 0);
  CHECK(s.current == 7);
  CHECK(s.peak == 7);
  s.increase(2);
  s.decrease(5);
  CHECK(s.allocated == 2);
  CHECK(s.freed == 5);
  CHECK(s.current == 4);
}

TEST_CASE("stats: pool names") {
  CHECK(std::string(expseg::stat_pool_name(expseg::kAllPools)) == "all");
  CHECK(std::string(expseg::stat_pool_name(expseg::kSmallPool)) == "small_pool");
  CHECK(std::string(expseg::stat_pool_name(expseg::kLargePool)) == "large_pool");
  CHECK(std::string(expseg::stat_pool_name(7)) == "unknown");
}

TEST_CASE("stats: reset_peaks and reset_accumulated reach every Stat") {
  Stats s = distinct_stats();
  s.reset_peaks();
  for (auto& entry : all_stats(s)) {
    const std::string& name = entry.first;
    Stat* st = entry.second;
    CAPTURE(name);
    CHECK(st->peak == st->current);
  }
  s = distinct_stats();
  const Stats before = s;
  s.reset_accumulated();
  for (auto& entry : all_stats(s)) {
    const std::string& name = entry.first;
    Stat* st = entry.second;
    CAPTURE(name);
    CHECK(st->freed == 0);
    CHECK(st->allocated == 0);
  }
  CHECK(s.num_alloc_retries == 0);
  CHECK(s.num_ooms == 0);
  CHECK(s.num_sync_all_streams == 0);
  CHECK(s.num_device_alloc == 0);
  CHECK(s.num_device_free == 0);
  CHECK(s.num_free_blocks == before.num_free_blocks);  // a gauge, not a total
  CHECK(s.max_split_size == before.max_split_size);
  CHECK(s.allocated_bytes[0].peak == before.allocated_bytes[0].peak);
}

TEST_CASE("stats: CuPy views of the same numbers") {
  Stats s;
  s.allocated_bytes[expseg::kAllPools].increase(300);
  s.reserved_bytes[expseg::kAllPools].increase(1000);
  s.num_free_blocks = 4;
  CHECK(s.used_bytes() == 300);
  CHECK(s.total_bytes() == 1000);
  CHECK(s.free_bytes() == 700);
  CHECK(s.total_bytes() == s.used_bytes() + s.free_bytes());
  CHECK(s.n_free_blocks() == 4);
}

TEST_CASE("stats: to_json has every PyTorch key exactly once with the right values") {
  Stats s = distinct_stats();
  const std::string json = s.to_json();
  const JsonValue v = parse_json(json);
  std::size_t expected_keys = 0;
  for (auto& entry : all_stats(s)) {
    const std::string& name = entry.first;
    const Stat* st = entry.second;
    for (const auto& [field, value] :
         {std::pair<const char*, std::int64_t>{"current", st->current}, {"peak", st->peak},
          {"allocated", st->allocated}, {"freed", st->freed}}) {
      const std::string key = name + "." + field;
      CAPTURE(key);
      REQUIRE(v.has(key));
      CHECK(v[key].as_int() == value);
      CHECK(count_occurrences(json, "\"" + key + "\":") == 1);
      ++expected_keys;
    }
  }
  for (auto& entry : all_counters(s)) {
    const std::string& name = entry.first;
    const std::int64_t* c = entry.second;
    CAPTURE(name);
    REQUIRE(v.has(name));
    CHECK(v[name].as_int() == *c);
    CHECK(count_occurrences(json, "\"" + name + "\":") == 1);
    ++expected_keys;
  }
  ++expected_keys;  // "cupy"
  CHECK(v.as_object().size() == expected_keys);
  CHECK(expected_keys == 9 * 3 * 4 + 3 * 4 + 5 + 2 + 1);

  // PyTorch's spelling, written out, so a change in the X-macros cannot go unnoticed.
  for (const char* key : {"allocation.all.current", "segment.large_pool.peak", "active.small_pool.allocated",
                          "inactive_split.all.freed", "allocated_bytes.small_pool.peak",
                          "allocated_bytes.large_pool.allocated", "allocated_bytes.all.freed",
                          "reserved_bytes.all.current", "active_bytes.large_pool.current",
                          "inactive_split_bytes.small_pool.freed", "requested_bytes.all.peak",
                          "oversize_allocations.current", "oversize_segments.peak", "num_alloc_retries",
                          "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free",
                          "max_split_size", "physical_handles.current", "physical_handles.peak",
                          "physical_handles.allocated", "physical_handles.freed", "num_free_blocks"}) {
    CAPTURE(key);
    CHECK(v.has(key));
  }
  const JsonValue& cupy = v["cupy"];
  CHECK(cupy.as_object().size() == 4);
  CHECK(cupy["used_bytes"].as_int() == s.used_bytes());
  CHECK(cupy["total_bytes"].as_int() == s.total_bytes());
  CHECK(cupy["free_bytes"].as_int() == s.free_bytes());
  CHECK(cupy["n_free_blocks"].as_int() == s.n_free_blocks());
}

TEST_CASE("stats: default Stats JSON reports an unlimited max_split_size as -1") {
  const JsonValue v = parse_json(Stats{}.to_json());
  CHECK(v["max_split_size"].as_int() == -1);
  CHECK(v["allocated_bytes.all.current"].as_int() == 0);
}

TEST_CASE("stats: snapshot JSON parses back with every field") {
  expseg::Snapshot snap;
  snap.backend = "expandable";
  snap.device = 3;
  snap.limit_bytes = 2164260864;
  snap.device_total_bytes = 150110011392;
  snap.stats.allocated_bytes[expseg::kAllPools].increase(4096);
  expseg::SegmentInfo seg;
  seg.address = 0x7f0000000000ull;
  seg.size = 64 << 20;
  seg.mapped_bytes = 4 << 20;
  seg.stream = 0xdeadbeefcafef00dull;
  seg.small_pool = false;
  seg.physical_handles = 2;
  seg.blocks.push_back({0x7f0000000000ull, 2 << 20, 1000, expseg::BlockState::allocated, 0xdeadbeefcafef00dull});
  seg.blocks.push_back({0x7f0000200000ull, 2 << 20, 0, expseg::BlockState::free_mapped, 0});
  seg.blocks.push_back({0x7f0000400000ull, 60 << 20, 0, expseg::BlockState::free_unmapped, 0});
  seg.mapped_ranges.push_back({0x7f0000000000ull, 4 << 20});
  snap.segments.push_back(seg);
  expseg::SegmentInfo small;
  small.address = 0x1000;
  small.size = 2 << 20;
  small.small_pool = true;
  small.blocks.push_back({0x1000, 2 << 20, 0, expseg::BlockState::pending_free, 1});
  snap.segments.push_back(small);

  const JsonValue v = parse_json(snap.to_json());
  CHECK(v["backend"].as_string() == "expandable");
  CHECK(v["device"].as_int() == 3);
  CHECK(v["limit_bytes"].as_int() == 2164260864);
  CHECK(v["device_total_bytes"].as_int() == 150110011392);
  CHECK(v["stats"]["allocated_bytes.all.current"].as_int() == 4096);
  CHECK(v["stats"]["cupy"]["used_bytes"].as_int() == 4096);
  const JsonValue& segs = v["segments"];
  REQUIRE(segs.as_array().size() == 2);
  const JsonValue& s0 = segs[0];
  CHECK(s0["address"].as_string() == "0x7f0000000000");
  CHECK(s0["size"].as_int() == 64 << 20);
  CHECK(s0["mapped_bytes"].as_int() == 4 << 20);
  CHECK(s0["stream"].as_string() == "0xdeadbeefcafef00d");
  CHECK(s0["pool"].as_string() == "large");
  CHECK(s0["physical_handles"].as_int() == 2);
  REQUIRE(s0["blocks"].as_array().size() == 3);
  CHECK(s0["blocks"][0]["address"].as_string() == "0x7f0000000000");
  CHECK(s0["blocks"][0]["size"].as_int() == 2 << 20);
  CHECK(s0["blocks"][0]["requested"].as_int() == 1000);
  CHECK(s0["blocks"][0]["state"].as_string() == "allocated");
  CHECK(s0["blocks"][0]["stream"].as_string() == "0xdeadbeefcafef00d");
  CHECK(s0["blocks"][1]["state"].as_string() == "free_mapped");
  CHECK(s0["blocks"][1]["stream"].as_string() == "0x0");
  CHECK(s0["blocks"][2]["state"].as_string() == "free_unmapped");
  REQUIRE(s0["mapped_ranges"].as_array().size() == 1);
  CHECK(s0["mapped_ranges"][0]["address"].as_string() == "0x7f0000000000");
  CHECK(s0["mapped_ranges"][0]["size"].as_int() == 4 << 20);
  const JsonValue& s1 = segs[1];
  CHECK(s1["pool"].as_string() == "small");
  CHECK(s1["address"].as_string() == "0x1000");
  CHECK(s1["blocks"][0]["state"].as_string() == "pending_free");
  CHECK(s1["mapped_ranges"].as_array().empty());
}

TEST_CASE("stats: BlockState, OomVerdict and Counterfactual names") {
  CHECK(std::string(to_string(expseg::BlockState::allocated)) == "allocated");
  CHECK(std::string(to_string(expseg::BlockState::pending_free)) == "pending_free");
  CHECK(std::string(to_string(expseg::BlockState::free_mapped)) == "free_mapped");
  CHECK(std::string(to_string(expseg::BlockState::free_unmapped)) == "free_unmapped");
  CHECK(std::string(to_string(expseg::OomVerdict::capacity)) == "capacity");
  CHECK(std::string(to_string(expseg::OomVerdict::limit)) == "limit");
  CHECK(std::string(to_string(expseg::OomVerdict::fragmentation)) == "fragmentation");
  CHECK(std::string(to_string(expseg::Counterfactual::not_evaluated)) == "not_evaluated");
  CHECK(std::string(to_string(expseg::Counterfactual::would_succeed)) == "would_succeed");
  CHECK(std::string(to_string(expseg::Counterfactual::would_fail)) == "would_fail");
}

TEST_CASE("stats: OOM report JSON parses back with every field") {
  expseg::OomReport r;
  r.backend = "split_merge";
  r.device = 1;
  r.stream = 0xabc;
  r.requested_bytes = 838860800;
  r.rounded_bytes = 838860800;
  r.device_total_bytes = 150110011392;
  r.device_free_bytes = 147456000000;
  r.limit_bytes = 2164260864;
  r.allocated_bytes = 1153433600;
  r.reserved_bytes = 2097152000;
  r.live_requested_bytes = 1153433000;
  r.live_footprint_bytes = 1153433600;
  r.page_slack_bytes = 3 * 524288;
  r.partial_pages = 2;
  r.largest_free_block_bytes = 524288000;
  r.free_blocks = 2;
  r.verdict = expseg::OomVerdict::fragmentation;
  r.other_backend = "expandable";
  r.counterfactual = expseg::Counterfactual::would_succeed;
  r.message = "CUDA out of memory. Tried to allocate 800.00 MiB.\n\"quoted\"";
  r.dump_path = "/tmp/oom-1.json";

  const JsonValue v = parse_json(r.to_json());
  CHECK(v.as_object().size() == 23);
  CHECK(v["dump_path"].as_string() == "/tmp/oom-1.json");
  CHECK(v["live_footprint_bytes"].as_int() == 1153433600);
  CHECK(v["page_slack_bytes"].as_int() == 3 * 524288);
  CHECK(v["partial_pages"].as_int() == 2);
  CHECK(v["snapshot"].is_null());
  CHECK(v["backend"].as_string() == "split_merge");
  CHECK(v["device"].as_int() == 1);
  CHECK(v["stream"].as_string() == "0xabc");
  CHECK(v["requested_bytes"].as_int() == 838860800);
  CHECK(v["rounded_bytes"].as_int() == 838860800);
  CHECK(v["device_total_bytes"].as_int() == 150110011392);
  CHECK(v["device_free_bytes"].as_int() == 147456000000);
  CHECK(v["limit_bytes"].as_int() == 2164260864);
  CHECK(v["allocated_bytes"].as_int() == 1153433600);
  CHECK(v["reserved_bytes"].as_int() == 2097152000);
  CHECK(v["reserved_unallocated_bytes"].as_int() == 943718400);
  CHECK(v["live_requested_bytes"].as_int() == 1153433000);
  CHECK(v["largest_free_block_bytes"].as_int() == 524288000);
  CHECK(v["free_blocks"].as_int() == 2);
  CHECK(v["verdict"].as_string() == "fragmentation");
  CHECK(v["other_backend"].as_string() == "expandable");
  CHECK(v["counterfactual"].as_string() == "would_succeed");
  CHECK(v["message"].as_string() == r.message);

  auto snap = std::make_shared<expseg::Snapshot>();
  snap->backend = "split_merge";
  snap->segments.resize(1);
  snap->segments[0].address = 0x2000;
  snap->stats.num_ooms = 1;
  r.snapshot = snap;
  const JsonValue with_snapshot = parse_json(r.to_json());
  CHECK(with_snapshot["snapshot"]["backend"].as_string() == "split_merge");
  CHECK(with_snapshot["snapshot"]["segments"][0]["address"].as_string() == "0x2000");
  CHECK(with_snapshot["snapshot"]["stats"]["num_ooms"].as_int() == 1);
  CHECK(with_snapshot["message"].as_string() == r.message);

  expseg::OomReport empty;
  const JsonValue e = parse_json(empty.to_json());
  CHECK(e["verdict"].as_string() == "capacity");
  CHECK(e["counterfactual"].as_string() == "not_evaluated");
  CHECK(e["reserved_unallocated_bytes"].as_int() == 0);
  CHECK(e["stream"].as_string() == "0x0");
}

}  // TEST_SUITE
