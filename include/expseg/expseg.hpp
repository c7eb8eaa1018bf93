// expseg: the whole C++ API in one include.
#pragma once

#include "expseg/allocator.hpp"
#include "expseg/config.hpp"
#include "expseg/errors.hpp"
#include "expseg/oom_dump.hpp"
#include "expseg/report.hpp"
#include "expseg/scenarios.hpp"
#include "expseg/snapshot.hpp"
#include "expseg/stats.hpp"
#include "expseg/trace.hpp"
