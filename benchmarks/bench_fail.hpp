// Failed runs of the Google Benchmark suite: every benchmark reports its failures through fail_run
// or guarded (not SkipWithError directly), so that a failed repetition is reported and does not
// abort Google Benchmark 1.7.1's statistics.
#pragma once

#include <benchmark/benchmark.h>

#include <exception>
#include <map>
#include <string>

#include "bench_common.hpp"

namespace expseg::bench {

// Benchmarks that failed in this process: name -> the first error.
inline std::map<std::string, std::string>& failures() {
  static std::map<std::string, std::string> f;
  return f;
}

// Fails this run of the benchmark (SkipWithError) so that Google Benchmark 1.7.1 can still report
// the benchmark's repetitions: every repetition, failed or not, is reported (no
// ReportAggregatesOnly: it drops a failed repetition silently and aggregates the others), and
//  - its ComputeStats aborts the process unless every repetition, failed ones included, reports
//    the first one's iteration count; a run failed before its loop started reports 0, so the
//    loop (already failed: it runs no iteration) is started and ended here;
//  - it dereferences the first repetition's statistics, which a failed repetition has none of
//    (google/benchmark#1406, fixed after 1.7.1): guarded() fails every later run of a benchmark
//    that failed once, so a failed first repetition leaves no successful ones to aggregate.
// Runs failed in this process (fail_run), for expseg_bench's exit status.
inline std::size_t& failed_runs() {
  static std::size_t n = 0;
  return n;
}

inline void fail_run(benchmark::State& st, const std::string& why) {
  ++failed_runs();
  st.SkipWithError(why.c_str());
  if (st.iterations() == 0)  // 0 only while the loop has not started
    for (auto _ : st) {
    }
}

// Runs `body`, turning an exception into a failed run (the suite goes on with the next benchmark).
// Once `name` failed, its later runs (repetitions) fail at once with "an earlier repetition failed".
template <class F>
void guarded(benchmark::State& st, const std::string& name, F&& body) {
  if (auto it = failures().find(name); it != failures().end()) {
    fail_run(st, "an earlier repetition failed: " + it->second);
    return;
  }
  std::string why;
  try {
    body();
    return;
  } catch (const std::exception& e) {
    why = e.what();
  } catch (...) {
    why = "unknown exception";
  }
  Holder::instance().reset();  // a subject in an unknown state is not reused
  failures().emplace(name, why);
  fail_run(st, why);
}

}  // namespace expseg::bench
