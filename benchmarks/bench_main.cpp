// expseg_bench: Google Benchmark's main, plus the suite's registration (bench_alloc.cpp), which
// depends on whether a CUDA device is usable, so it runs at start-up rather than statically.
#include <benchmark/benchmark.h>

#include "bench_common.hpp"

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
  return 0;
}
