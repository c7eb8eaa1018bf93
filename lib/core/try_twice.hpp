// Teardown's driver calls: destructors and releases that go on after a failure cannot report an
// error, so a call that fails is tried once more (a transient failure then leaks nothing), and what
// fails again is left to the device's cleanup at process exit.
#pragma once

#include <exception>

namespace expseg::core {

// Runs `f` until it returns without throwing, at most `tries` times. True when a try succeeded;
// otherwise the last failure is stored in `*failure` when given and still empty (the caller reports
// the first failure of a whole teardown). `tries` below 2 is for a call that must not be repeated
// (one whose failure may already have taken effect).
template <class F>
bool try_twice(F&& f, std::exception_ptr* failure = nullptr, int tries = 2) noexcept {
  for (int n = 1;; ++n) {
    try {
      f();
      return true;
    } catch (...) {
      if (n < tries) continue;
      if (failure != nullptr && !*failure) *failure = std::current_exception();
      return false;
    }
  }
}

}  // namespace expseg::core
