// libFuzzer target: the bytes of an input choose the options (backend, policy, device size,
// granularity, limit) and then every operation of the model-based harness
// (tests/common/fuzz_harness.hpp) -- allocations of skewed sizes, frees, record_stream with busy
// streams, release_cached, limit changes, bad pointers and injected driver faults -- on the
// host-backed simulated device, checking validate(), the model, the stats identities and every
// byte pattern after each operation, and that nothing leaks at the end.
//
// Build (clang only): CXX=clang++ meson setup build-fuzz -Dfuzz=true -Db_lundef=false -Dbenchmarks=false
//                     ninja -C build-fuzz tests/fuzz_allocator
// Run:                build-fuzz/tests/fuzz_allocator -max_total_time=600 -jobs=2 -workers=2 CORPUS_DIR
// A crash file replays with: build-fuzz/tests/fuzz_allocator crash-FILE   (EXPSEG_FUZZ_VERBOSE=1 prints
// every operation). EXPSEG_FUZZ_MULTI_FAULTS=1 arms several faults at once (double failures).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>

#include "fuzz_harness.hpp"

namespace {
bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' && *v != '0';
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const bool verbose = env_flag("EXPSEG_FUZZ_VERBOSE");
  static const bool multi_faults = env_flag("EXPSEG_FUZZ_MULTI_FAULTS");
  fuzz::ByteSource src(data, size);
  try {
    fuzz::Options o = fuzz::options_from(src);
    o.verbose = verbose;
    o.multi_faults = multi_faults;
    // How the run ends, read before the operations: they use up the input, and past its end every
    // byte reads 0, which would always pick destroy-with-blocks-live over free-all + leak check.
    const bool free_all = src.byte() % 4 != 0;
    fuzz::Harness h(o);
    h.run(src, 4000);
    h.finish(free_all);
  } catch (const fuzz::Failure& f) {
    std::fprintf(stderr, "\n%s\n", f.what());
    std::abort();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "\nunexpected exception: %s\n", e.what());
    std::abort();
  }
  return 0;
}
