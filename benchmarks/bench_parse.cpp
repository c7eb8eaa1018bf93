// Hostile input to the parsers: 1 MiB of what an attacker or a corrupt file could hand the
// configuration (EXPSEG_ALLOC_CONF, --conf) and JSON (OOM dumps, snapshots) parsers. Each must fail
// in time linear in its input, with a short message; the unit tests check the messages and where
// the parse stopped (tests/unit/test_config.cpp, test_json.cpp), this measures the time:
//   parse/config_hostile     every option given each 1 MiB hostile value, plus the pure-separator
//                            inputs and 20,000 repeated keys (the unit test's inputs)
//   parse/json_hostile/<k>   1 MiB of '[' (nesting), of 'a' (bad token), and an unterminated string
#include <benchmark/benchmark.h>

#include <exception>
#include <string>

#include "bench_fail.hpp"
#include "core/json.hpp"
#include "expseg/config.hpp"

namespace {

bool config_fails(const std::string& text) {
  try {
    (void)expseg::Config::parse(text);
    return false;
  } catch (const std::exception&) {
    return true;
  }
}

void bm_config_hostile(benchmark::State& st) {
  const std::string mb(1 << 20, 'a');
  const std::string values[] = {mb, std::string(1 << 20, '9'), "1." + std::string(1 << 20, '9') + "GiB",
                                std::string(1 << 20, '['), "-" + std::string(1 << 20, '1'), std::string("\x01\x02\xff", 3)};
  std::string many;
  for (int i = 0; i < 20000; ++i) many += "record:true,";
  many += "record:false";
  for (auto _ : st) {
    int failed = config_fails(mb);
    for (const auto& o : expseg::Config::options())
      for (const std::string& v : values) failed += config_fails(std::string(o.name) + ":" + v);
    failed += config_fails(std::string(1 << 20, ','));
    failed += config_fails(std::string(1 << 20, ']'));
    failed += config_fails("backend:" + std::string(1 << 20, ' ') + "x");
    failed += config_fails(many);
    benchmark::DoNotOptimize(failed);
  }
}
BENCHMARK(bm_config_hostile)->Name("parse/config_hostile")->Unit(benchmark::kMillisecond);

void bm_json_hostile(benchmark::State& st, std::string text) {
  for (auto _ : st) {
    try {
      (void)expseg::core::parse_json(text);
      expseg::bench::fail_run(st, "the hostile JSON parsed");
      break;
    } catch (const std::exception& e) {
      benchmark::DoNotOptimize(e.what());
    }
  }
}
BENCHMARK_CAPTURE(bm_json_hostile, nesting, std::string(1 << 20, '['))->Name("parse/json_hostile/nesting")->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(bm_json_hostile, token, std::string(1 << 20, 'a'))->Name("parse/json_hostile/token")->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(bm_json_hostile, unterminated, "\"" + std::string(1 << 20, 'a'))
    ->Name("parse/json_hostile/unterminated")
    ->Unit(benchmark::kMicrosecond);

}  // namespace
