// Internals of the RMM allocation-log reader/writer (lib/trace/rmm_log.cpp), shared with tests and
// with other writers of the same format (the event recorder).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "expseg/trace.hpp"

namespace expseg::trace {

// The header write_trace writes.
inline constexpr std::string_view kRmmHeader = "Thread,Time,Action,Pointer,Size,Stream";

// Writes one CSV line (with its '\n') for `e` into `buf` and returns its length.
inline constexpr std::size_t kMaxEventLine = 128;
std::size_t format_event(const TraceEvent& e, char (&buf)[kMaxEventLine]) noexcept;

// "HH:MM:SS.ffffff" of `seconds`, rounded to microseconds; hours may exceed 23 (never wrap, so that
// times stay monotonic); negative or non-finite times are written as 00:00:00.000000.
std::string format_time(double seconds);

// Parses a Time field: "HH:MM:SS.ffffff", "HH:MM:SS:ffffff" or a plain non-negative number.
// Returns false (leaving `seconds` unspecified) when the text is none of these.
bool parse_time(std::string_view text, double& seconds) noexcept;

// The whole CSV text (header included) of `events`.
std::string format_trace(const std::vector<TraceEvent>& events, bool rmm_strict);

}  // namespace expseg::trace
