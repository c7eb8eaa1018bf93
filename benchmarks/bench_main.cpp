// expseg_bench: Google Benchmark's main, plus the suite's registration (bench_alloc.cpp), which
// depends on whether a CUDA device is usable, so it runs at start-up rather than statically.
#include <benchmark/benchmark.h>

#include <cstdio>

#include "bench_common.hpp"
#include "bench_fail.hpp"

namespace expseg::bench {
void register_all();
}

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  expseg::bench::register_all();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  // The last warm subject gives its memory back here, not in a static destructor at exit.
  expseg::bench::Holder::instance().reset();
  // A failed benchmark is reported as failed runs in the output; the exit status says so too, so
  // that `meson test --benchmark` and scripts do not pass a run whose benchmarks all errored.
  for (const auto& [name, why] : expseg::bench::failures()) std::fprintf(stderr, "expseg_bench: %s failed: %s\n", name.c_str(), why.c_str());
  if (const std::size_t n = expseg::bench::failed_runs(); n != 0) {
    std::fprintf(stderr, "expseg_bench: %zu run(s) failed (ERROR OCCURRED above)\n", n);
    return 1;
  }
  return 0;
}
