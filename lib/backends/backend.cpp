// The backend interface is header-only (its stat bookkeeping is inline, on the cached path); this
// file keeps the layer's translation unit in the build.
#include "backends/backend.hpp"
