// A new user's walkthrough: the messages and scripts someone meets first, each checked against what
// the walkthrough found (the old message or behaviour is quoted in each case). The command line's
// side of it is in test_cli.cpp.
#include <doctest/doctest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "expseg/allocator.hpp"
#include "expseg/config.hpp"
#include "expseg/errors.hpp"
#include "expseg/report.hpp"
#include "expseg/scenarios.hpp"
#include "test_util.hpp"

#ifndef EXPSEG_SOURCE_DIR
#error "EXPSEG_SOURCE_DIR must name the source tree (tests/meson.build passes it)"
#endif

using namespace testutil;
using expseg::Allocator;
using expseg::Config;
using expseg::config_error;

namespace {

namespace fs = std::filesystem;

std::string parse_error(const std::string& text, std::string* key = nullptr) {
  try {
    (void)Config::parse(text);
  } catch (const config_error& e) {
    if (key) *key = e.key();
    return e.what();
  }
  FAIL("accepted: " << text);
  return "";
}

std::size_t count(const std::string& hay, const std::string& needle) {
  std::size_t n = 0;
  for (std::size_t at = hay.find(needle); at != std::string::npos; at = hay.find(needle, at + needle.size())) ++n;
  return n;
}

struct Shell {
  int status = -1;
  std::string out;  // stdout and stderr together
};

Shell shell(const std::string& cmd) {
  Shell r;
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  REQUIRE(p != nullptr);
  char buf[4096];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) r.out.append(buf, n);
  const int st = ::pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128;
  return r;
}

fs::path temp_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("expseg-usability-" + std::to_string(::getpid()) + "-" + name);
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

void write_script(const fs::path& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
  fs::permissions(path, fs::perms::owner_all, fs::perm_options::add);
}

}  // namespace

TEST_CASE("usability: key=value is answered with the key:value syntax, not with an unknown option") {
  // Was: "unknown option 'backend=expandable'; valid options are: backend, ..." (backend is listed).
  std::string key;
  const std::string m = parse_error("backend=expandable", &key);
  CAPTURE(m);
  CHECK(key == "backend");
  CHECK(m.find("use key:value") != std::string::npos);
  CHECK(m.find("e.g. backend:expandable") != std::string::npos);
  CHECK(m.find("unknown option") == std::string::npos);
  // An unknown key written with '=' is still unknown, with the hint.
  const std::string u = parse_error("limit:1GiB,foo=bar", &key);
  CHECK(key == "foo=bar");
  CHECK(u.find("unknown option 'foo=bar' (items are key:value") != std::string::npos);
}

TEST_CASE("usability: an oom_dump path cut at a ',' says why") {
  // Was: "unknown option 'b.json'; valid options are: ..." with no word of the comma.
  std::string key;
  const std::string m = parse_error("oom_dump:/tmp/a,b.json", &key);
  CAPTURE(m);
  CHECK(key == "b.json");
  CHECK(m.find("an oom_dump path cannot contain ','") != std::string::npos);
  // Not said after other keys.
  CHECK(parse_error("limit:1GiB,b.json").find("cannot contain") == std::string::npos);
  // The options table (`expseg config`) says it too.
  bool documented = false;
  for (const auto& o : Config::options())
    if (std::string_view(o.name) == "oom_dump") documented = std::string_view(o.help).find("no ','") != std::string_view::npos;
  CHECK(documented);
}

TEST_CASE("usability: size keys take G for GiB, and expandable_segments_reserve takes GiB") {
  // Was: limit:20G refused ("expected ... GiB") while expandable_segments_reserve:40GiB was refused
  // ("expected ... 40G"): each key took only the other's spelling.
  CHECK(Config::parse("limit:20G").limit == expseg::Limit{20 * GiB, 0.0});
  CHECK(Config::parse("limit:1.5g").limit == expseg::Limit{3 * GiB / 2, 0.0});
  CHECK(Config::parse("sim_capacity:80G").sim_capacity == 80 * GiB);
  CHECK(Config::parse("sim_granularity:2M").sim_granularity == 2 * MiB);
  CHECK(Config::parse("expandable_max_handle:64M").max_handle_size == 64 * MiB);
  CHECK(Config::parse("expandable_va_size:1T").va_size == std::size_t{1} << 40);
  CHECK(expseg::parse_bytes("4K") == 4 * KiB);
  CHECK(Config::parse("expandable_segments_reserve:40GiB").va_size == 40 * GiB);
  CHECK(Config::parse("expandable_segments_reserve:40GiB") == Config::parse("expandable_segments_reserve:40G"));
  CHECK(Config::parse("expandable_segments_reserve:1.5GiB").va_size == 3 * GiB / 2);
  CHECK(Config::parse("expandable_segments_reserve:512MiB").va_size == 512 * MiB);
  CHECK(Config::parse("expandable_segments_reserve:512MiB").va_fraction == 0.0);
  CHECK(Config::parse("expandable_segments_reserve_by_class:[decode:40GiB,prefill:0.5]") == Config{});
  // The messages name both spellings.
  const std::string bytes = parse_error("limit:20Q");
  CHECK(bytes.find("K, M, G, T are the same") != std::string::npos);
  const std::string reserve = parse_error("expandable_segments_reserve:20QiB");
  CHECK(reserve.find("40G") != std::string::npos);
  CHECK(reserve.find("40GiB") != std::string::npos);
  CHECK(parse_error("expandable_segments_reserve:2000TiB").find("at most 1048576G") != std::string::npos);
}

TEST_CASE("usability: a bad value's message names its key once") {
  // Was: "garbage_collection_threshold: garbage_collection_threshold is invalid, set it in (0.0, 1.0)",
  // and the same doubling for max_split_size_mb, max_non_split_rounding_mb and large_segment_size_mb.
  const std::pair<const char*, const char*> cases[] = {
      {"garbage_collection_threshold:2", "garbage_collection_threshold"},
      {"max_split_size_mb:3", "max_split_size_mb"},
      {"max_non_split_rounding_mb:3", "max_non_split_rounding_mb"},
      {"large_segment_size_mb:3", "large_segment_size_mb"},
  };
  for (const auto& [text, key] : cases) {
    const std::string m = parse_error(text);
    CAPTURE(m);
    CHECK(m.rfind(std::string(key) + ": ", 0) == 0);
    CHECK(count(m, key) == 1);
  }
  CHECK(parse_error("garbage_collection_threshold:2").find("set it in (0.0, 1.0)") != std::string::npos);
}

TEST_CASE("usability: a simulated capacity without a unit is answered with the unit, not with the page size") {
  // Was: "sim_granularity: 2MiB is larger than sim_capacity (80): the simulated device could not give
  // out a single page" for --conf device:sim,sim_capacity:80 (the unit left out).
  try {
    Allocator a(Config::parse("device:sim,sim_capacity:80"));
    FAIL("a simulated device of 80 bytes was accepted");
  } catch (const config_error& e) {
    const std::string m = e.what();
    CAPTURE(m);
    CHECK(m.rfind("sim_capacity: 80 bytes is less than one page", 0) == 0);
    CHECK(m.find("did you mean sim_capacity:80GiB?") != std::string::npos);
  }
  // A capacity given with its unit is not guessed at (was: "did you mean sim_capacity:524288GiB?").
  try {
    Allocator a(Config::parse("device:sim,sim_capacity:512KiB"));
    FAIL("a simulated device smaller than its page was accepted");
  } catch (const config_error& e) {
    const std::string m = e.what();
    CAPTURE(m);
    CHECK(m.rfind("sim_capacity: 512KiB (524288 bytes) is less than one page of the simulated device (sim_granularity 2MiB)", 0) == 0);
    CHECK(m.find("did you mean") == std::string::npos);
  }
  // 1024 typed bare reads as 1KiB: the hint still says what a bare number means, and the GiB form.
  try {
    Allocator a(Config::parse("device:sim,sim_capacity:1024"));
    FAIL("a simulated device smaller than its page was accepted");
  } catch (const config_error& e) {
    const std::string m = e.what();
    CAPTURE(m);
    CHECK(m.find("a size without a unit is a number of bytes: sim_capacity:1024GiB for 1024 GiB") != std::string::npos);
  }
  // A page size larger than a real capacity is still the page size's fault.
  try {
    Allocator a(Config::parse("device:sim,sim_capacity:1GiB,sim_granularity:4GiB"));
    FAIL("a page larger than the device was accepted");
  } catch (const config_error& e) {
    CHECK(std::string(e.what()).rfind("sim_granularity: 4GiB is larger than sim_capacity (1GiB)", 0) == 0);
  }
}

TEST_CASE("usability: one byte is '1 byte'") {
  // Was: "1 bytes" (a 1-byte limit: "1 bytes allowed", "the limit of 1 bytes").
  CHECK(expseg::format_bytes(1) == "1 byte");
  CHECK(expseg::format_bytes(0) == "0 bytes");
  CHECK(expseg::format_bytes(2) == "2 bytes");
}

// Without a loadable CUDA driver, the error says to use device:sim: test_cli.cpp (the CLI, on every
// machine through EXPSEG_LIBCUDA) and tests/python/test_glue.py (the C API's allocator on the GPU).

TEST_CASE("usability: the mixed-lifetimes story says what its runs show") {
  // Was: "... so a split pool holds far more than it uses": both backends reach the same peak reserved
  // (the 4 GiB limit); what differs is that split_merge fails a request (fragmentation) and expandable not.
  const expseg::ScenarioInfo* info = expseg::find_scenario("mixed-lifetimes");
  REQUIRE(info != nullptr);
  const std::string d(info->description);
  CHECK(d.find("far more than it uses") == std::string::npos);
  CHECK(d.find("4 GiB limit") != std::string::npos);
  CHECK(d.find("(fragmentation)") != std::string::npos);
  CHECK(d.find("serve every request") != std::string::npos);
  for (std::uint64_t seed : {0, 2, 5}) {  // 0: the story's own seed
    CAPTURE(seed);
    expseg::ScenarioOptions o;
    o.seed = seed;
    const expseg::ScenarioResult sm = expseg::run_scenario("mixed-lifetimes", sim_config(expseg::BackendKind::split_merge), o);
    const expseg::ScenarioResult ex = expseg::run_scenario("mixed-lifetimes", sim_config(expseg::BackendKind::expandable), o);
    CHECK(sm.ooms > 0);
    REQUIRE(sm.verdict.has_value());
    CHECK(*sm.verdict == expseg::OomVerdict::fragmentation);
    CHECK(ex.ooms == 0);
    CHECK(sm.peak_reserved_bytes > sm.peak_allocated_bytes);
    CHECK(static_cast<double>(sm.peak_reserved_bytes) < 1.25 * static_cast<double>(sm.peak_allocated_bytes));  // not "far more"
  }
}

TEST_CASE("usability: the HTML report shows the time in driver calls and a note") {
  // Was: only the host time, with no note, so a simulated run's expandable looked 17x slower.
  expseg::ReportGroup g;
  g.name = "story";
  for (const char* b : {"split_merge", "expandable"}) {
    expseg::ReportRun r;
    r.backend = b;
    r.seconds = 0.001;
    r.driver_seconds = std::string(b) == "split_merge" ? 0.155 : 0.0136;
    r.length = 2;
    r.series = {{0, 0, 0}, {1, 1, 1}};
    g.runs.push_back(r);
  }
  expseg::ReportOptions o;
  o.note = "Times on the simulated device: a note";
  const std::string page = expseg::render_html_report(std::span<const expseg::ReportGroup>(&g, 1), o);
  CHECK(page.find("<p class=\"note\">Times on the simulated device: a note</p>") != std::string::npos);
  CHECK(count(page, "<th>in driver</th>") == 1);
  CHECK(page.find("<td>155.0\xC2\xA0ms</td>") != std::string::npos);
  // A run that knows no driver time gets no such column.
  for (auto& r : g.runs) r.driver_seconds = 0;
  CHECK(expseg::render_html_report(std::span<const expseg::ReportGroup>(&g, 1)).find("in driver") == std::string::npos);
}

TEST_CASE("usability: tools/setup.sh checks meson's version and names the packages with cuda.h") {
  // Was: an old meson went on to fail inside meson.build, and a missing cuda.h said only "Install
  // the CUDA toolkit (/usr/local/cuda) or set CUDA_PATH". Run on a copy, with dpkg-query (every
  // package installed: no apt-get) and meson stubbed.
  const fs::path dir = temp_dir("setup");
  fs::create_directories(dir / "repo" / "tools");
  fs::create_directories(dir / "bin");
  fs::copy_file(EXPSEG_SOURCE_DIR "/tools/setup.sh", dir / "repo" / "tools" / "setup.sh");
  fs::copy_file(EXPSEG_SOURCE_DIR "/meson.build", dir / "repo" / "meson.build");
  write_script(dir / "bin" / "dpkg-query", "#!/bin/sh\nprintf 'install ok installed'\n");
  const std::string run = "cd '" + (dir / "repo").string() + "' && PATH='" + (dir / "bin").string() + "':\"$PATH\" ";

  write_script(dir / "bin" / "meson", "#!/bin/sh\necho 0.56.2\n");
  Shell r = shell(run + "tools/setup.sh");
  CAPTURE(r.out);
  CHECK(r.status == 1);
  CHECK(r.out.find("meson 0.56.2 is older than 0.63.0, which meson.build requires") != std::string::npos);
  CHECK(r.out.find("meson>=0.63.0") != std::string::npos);

  write_script(dir / "bin" / "meson", "#!/bin/sh\necho 1.2.0\n");
  r = shell(run + "CUDA_PATH='" + (dir / "no-cuda").string() + "' tools/setup.sh");
  CAPTURE(r.out);
  CHECK(r.status == 1);
  CHECK(r.out.find("cuda.h not found in " + (dir / "no-cuda").string() + "/include") != std::string::npos);
  CHECK(r.out.find("cuda-cudart-dev-13-0") != std::string::npos);
  CHECK(r.out.find("nvidia-cuda-dev") != std::string::npos);
  CHECK(r.out.find("older than") == std::string::npos);

  fs::create_directories(dir / "cuda" / "include");
  std::ofstream(dir / "cuda" / "include" / "cuda.h") << "\n";
  r = shell(run + "CUDA_PATH='" + (dir / "cuda").string() + "' tools/setup.sh");
  CHECK(r.status == 0);
  CHECK(r.out.find("expseg setup: ready") != std::string::npos);
  fs::remove_all(dir);
}

TEST_CASE("usability: tools/build.sh builds only EXPSEG_BUILD_TARGETS when given") {
  // tools/study.sh gives tools/expseg: the tests and benchmarks were most of its build. Run on a copy
  // with a configured build directory and ninja stubbed (it prints its arguments).
  const fs::path dir = temp_dir("build");
  fs::create_directories(dir / "repo" / "tools");
  fs::create_directories(dir / "repo" / "build");
  fs::create_directories(dir / "bin");
  fs::copy_file(EXPSEG_SOURCE_DIR "/tools/build.sh", dir / "repo" / "tools" / "build.sh");
  std::ofstream(dir / "repo" / "build" / "build.ninja") << "\n";
  write_script(dir / "bin" / "ninja", "#!/bin/sh\necho \"ninja $*\"\n");
  const std::string run = "cd '" + (dir / "repo").string() + "' && PATH='" + (dir / "bin").string() + "':\"$PATH\" ";
  Shell r = shell(run + "EXPSEG_BUILD_TARGETS=tools/expseg tools/build.sh build");
  CHECK(r.status == 0);
  CHECK(r.out == "ninja -C build tools/expseg\n");
  r = shell(run + "tools/build.sh build");
  CHECK(r.status == 0);
  CHECK(r.out == "ninja -C build\n");
  fs::remove_all(dir);
}
