// RMM allocation-log CSV: reading (plain or gzip), writing, pairing checks. See expseg/trace.hpp.
//
// Traces have millions of lines, so parsing works on string_views of lines (read_trace hands them
// on from 64 KiB chunks or from the gzip decoder's pieces, so the whole text is never in memory)
// with hand-rolled integer parsing (std::from_chars for fractional times); no iostreams, no regex,
// no per-line allocation.
#include "trace/rmm_log.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <memory>
#include <ostream>
#include <unordered_map>

#include "core/text.hpp"
#include "trace/inflate.hpp"

namespace expseg {

const char* to_string(TraceAction a) noexcept {
  switch (a) {
    case TraceAction::allocate: return "allocate";
    case TraceAction::free: return "free";
    case TraceAction::allocate_failure: return "allocate failure";
    case TraceAction::map: return "map";
    case TraceAction::unmap: return "unmap";
    case TraceAction::pool_begin: return "pool begin";
    case TraceAction::pool_end: return "pool end";
    case TraceAction::pool_release: return "pool release";
    case TraceAction::pool_restore: return "pool restore";
    case TraceAction::free_completed: return "free completed";
  }
  return "unknown";
}

namespace trace {
namespace {

enum Column : int { c_thread, c_time, c_action, c_pointer, c_size, c_stream, c_count, c_ignored = -1 };
constexpr std::array<std::string_view, c_count> kColumnNames = {"Thread", "Time", "Action", "Pointer", "Size", "Stream"};

constexpr bool is_space(char c) { return c == ' ' || c == '\t'; }

std::string_view trim(std::string_view s) {
  while (!s.empty() && is_space(s.front())) s.remove_prefix(1);
  while (!s.empty() && (is_space(s.back()) || s.back() == '\r')) s.remove_suffix(1);
  return s;
}

bool iequals(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return (x >= 'A' && x <= 'Z' ? char(x + 32) : x) == (y >= 'A' && y <= 'Z' ? char(y + 32) : y);
         });
}

// The offending text for a message: quoted, non-ASCII and control bytes escaped, cut at ~40 characters.
std::string quote(std::string_view s) {
  constexpr std::size_t kMax = 40;
  std::string q = "\"";
  for (std::size_t i = 0; i < s.size() && i < kMax; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x20 || c >= 0x7F || c == '"' || c == '\\') {
      char b[8];
      std::snprintf(b, sizeof b, "\\x%02x", c);
      q += b;
    } else {
      q += char(c);
    }
  }
  if (s.size() > kMax) q += "...";
  return q + "\"";
}

using core::hex;

enum class NumError { none, empty, negative, overflow, syntax };

// Hand-rolled: from_chars (base 16 especially) was the largest cost of parsing a line.
NumError parse_u64(std::string_view s, std::uint64_t& v) {
  if (s.empty()) return NumError::empty;
  if (s.front() == '-') return NumError::negative;
  std::uint64_t r = 0;
  for (std::size_t i = 0; i < s.size(); ++i) {
    const unsigned d = unsigned(s[i]) - '0';
    if (d > 9) return NumError::syntax;
    if (i >= 19 && (r > (UINT64_MAX - d) / 10)) {
      for (++i; i < s.size(); ++i)
        if (unsigned(s[i]) - '0' > 9) return NumError::syntax;
      return NumError::overflow;
    }
    r = r * 10 + d;
  }
  v = r;
  return NumError::none;
}

inline int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  c = char(c | 0x20);
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

// "0x..." hex or decimal. Bare hex digits are refused: "1000" would silently read as decimal in a
// file whose other pointers are bare hex, giving wrong identities. "(nil)" is 0: RMM's logger
// formats the pointer with printf's %p since its rapids-logger versions, which glibc prints so for a
// null pointer (every "allocate failure" line, a free of nullptr); RMM's own log parser reads it so.
NumError parse_address(std::string_view s, std::uint64_t& v) {
  if (s == "(nil)") {
    v = 0;
    return NumError::none;
  }
  if (s.size() >= 2 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) {
    s.remove_prefix(2);
    if (s.empty()) return NumError::syntax;
    while (s.size() > 1 && s.front() == '0') s.remove_prefix(1);
    std::uint64_t r = 0;
    for (char c : s) {
      const int d = hex_digit(c);
      if (d < 0) return NumError::syntax;
      r = r << 4 | unsigned(d);
    }
    if (s.size() > 16) return NumError::overflow;
    v = r;
    return NumError::none;
  }
  return parse_u64(s, v);
}

const char* num_reason(NumError e, bool address) {
  switch (e) {
    case NumError::empty: return "empty field";
    case NumError::negative: return "negative";
    case NumError::overflow: return "does not fit in 64 bits";
    default: return address ? "expected a 0x-prefixed hex or a decimal number" : "expected a decimal integer";
  }
}

bool parse_action(std::string_view s, TraceAction& a) {
  switch (s.size()) {
    case 3: if (s == "map") return a = TraceAction::map, true; break;
    case 4: if (s == "free") return a = TraceAction::free, true; break;
    case 5: if (s == "unmap") return a = TraceAction::unmap, true; break;
    case 8: if (s == "pool end") return a = TraceAction::pool_end, true; if (s == "allocate") return a = TraceAction::allocate, true; break;
    case 10: if (s == "pool begin") return a = TraceAction::pool_begin, true; if (s == "deallocate") return a = TraceAction::free, true; break;
    case 12: if (s == "pool release") return a = TraceAction::pool_release, true; if (s == "pool restore") return a = TraceAction::pool_restore, true; break;
    case 14: if (s == "free completed") return a = TraceAction::free_completed, true; break;
    case 16: if (s == "allocate failure") return a = TraceAction::allocate_failure, true; break;
    default: break;
  }
  return false;
}

bool all_digits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// What one event costs a replay: the TraceEvent (56 B), the replay's operation and index (56 B),
// and the vectors' spare capacity.
constexpr std::size_t kBytesPerEvent = 128;

std::size_t physical_memory_bytes() noexcept {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return std::size_t{64} << 30;  // unknown: assume a 64 GiB host
  return std::size_t(pages) * std::size_t(page);
}

// The most events one read may hold. A .gz inflates up to ~1000:1 and each ~12-byte line becomes an
// event of kBytesPerEvent in a replay: a 3 MB file could take all of a 23 GB host's memory (or the
// OOM killer's attention) before anything fails. By default a trace may take a quarter of the
// host's memory; EXPSEG_TRACE_MAX_EVENTS=N sets the count.
std::size_t max_events(const std::string& file) {
  if (const char* env = std::getenv("EXPSEG_TRACE_MAX_EVENTS"); env != nullptr && *env != '\0') {
    std::uint64_t n = 0;
    const std::string_view text(env);
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), n);
    if (ec != std::errc() || end != text.data() + text.size() || n == 0)
      throw trace_error(file, 0, "EXPSEG_TRACE_MAX_EVENTS=" + std::string(text) + ": expected a positive number of events");
    return static_cast<std::size_t>(n);
  }
  return std::max<std::size_t>(physical_memory_bytes() / 4 / kBytesPerEvent, 1'000'000);
}

// Parses CSV text one line at a time (the header, then one event per line that is not blank), so
// text in memory and text decoded from a stream take the same path.
struct Parser {
  const std::string& file;  // for messages
  std::size_t event_cap;    // max_events(), read before the file (an EXPSEG_TRACE_MAX_EVENTS error is not the file's)
  Trace t{};
  std::size_t line_no = 0;
  std::vector<int> roles{};  // empty until the header has been read

  [[noreturn]] void too_many_events() const {
    const bool from_env = std::getenv("EXPSEG_TRACE_MAX_EVENTS") != nullptr;
    fail(line_no, "more than " + std::to_string(event_cap) + " events" +
                      (from_env ? " (EXPSEG_TRACE_MAX_EVENTS)"
                                : ": a replay would need over " + std::to_string((event_cap * kBytesPerEvent) >> 20) +
                                      " MiB, a quarter of this host's memory (about " + std::to_string(kBytesPerEvent) +
                                      " bytes an event); set EXPSEG_TRACE_MAX_EVENTS=N to read more, or split the trace"));
  }

  [[noreturn]] void fail(std::size_t line, const std::string& msg) const { throw trace_error(file, line, msg); }

  // Column role of each header field, and the header's line number.
  std::vector<int> header(std::string_view line, std::size_t line_no) const {
    for (std::size_t i = 0; i < line.size(); ++i) {
      const auto c = static_cast<unsigned char>(line[i]);
      if (c == '\r' && i + 1 < line.size())
        fail(line_no, "carriage return inside a line: only \\n and \\r\\n line endings are supported");
      // Control bytes or invalid UTF-8 in the header: this is not a text file.
      const std::size_t utf8_len = c < 0x80 ? 1 : core::utf8_sequence_length(line.substr(i));
      if ((c < 0x20 && c != '\t' && c != '\r') || c == 0x7F || utf8_len == 0)
        fail(line_no, "not a CSV trace: binary data in the header line (byte " + hex(c) + " at column " +
                          std::to_string(i + 1) + ")");
      i += utf8_len - 1;
    }
    std::vector<int> roles;
    std::array<bool, c_count> seen{};
    for (std::size_t start = 0;;) {
      const std::size_t comma = line.find(',', start);
      const std::string_view name = trim(line.substr(start, comma == std::string_view::npos ? line.npos : comma - start));
      int role = c_ignored;
      for (int c = 0; c < c_count; ++c)
        if (iequals(name, kColumnNames[std::size_t(c)])) role = c;
      if (role != c_ignored) {
        if (seen[std::size_t(role)]) fail(line_no, "duplicate column " + std::string(kColumnNames[std::size_t(role)]) + " in the header");
        seen[std::size_t(role)] = true;
      }
      roles.push_back(role);
      if (comma == std::string_view::npos) break;
      start = comma + 1;
    }
    std::string missing;
    for (int c = 0; c < c_count; ++c)
      if (!seen[std::size_t(c)]) missing += (missing.empty() ? "" : ", ") + std::string(kColumnNames[std::size_t(c)]);
    if (!missing.empty())
      fail(line_no, "header is missing column(s) " + missing +
                        ": expected Thread,Time,Action,Pointer,Size,Stream (in any order), found " + quote(trim(line)));
    return roles;
  }

  [[noreturn]] void bad(std::size_t line_no, int col, std::string_view value, const char* reason) const {
    bad_line(line_no, "bad " + std::string(kColumnNames[std::size_t(col)]) + " " + quote(value) + ": " + reason);
  }
  // A data line that does not parse. A last line without its newline is most often one cut off as
  // it was written (a job killed mid-write, RMM's log not flushed): the message says so, since the
  // lines before it are whole.
  [[noreturn]] void bad_line(std::size_t line_no, const std::string& msg) const {
    if (!unterminated) fail(line_no, msg);
    fail(line_no, msg + "; this is the file's last line and it has no newline at its end, as when the process writing the log "
                        "stopped mid-line: delete it to read the lines before it");
  }
  bool unterminated = false;  // the line being parsed is the text's last and no newline ends it

  // One line, without its '\n'.
  void line(std::string_view line) {
    ++line_no;
    if (roles.empty()) {
      if (line_no == 1) {
        if (line.substr(0, 3) == "\xEF\xBB\xBF") line.remove_prefix(3);  // UTF-8 BOM
        if (is_gzip(line)) fail(1, "data is gzip-compressed: read the file with read_trace (or gunzip it first)");
      }
      if (!trim(line).empty()) roles = header(line, line_no);
      return;
    }
    const std::size_t ncols = roles.size();
    std::array<std::string_view, c_count> f;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty() || trim(line).empty()) return;
    std::size_t nfields = 0;
    const char* const lend = line.data() + line.size();
    for (const char* p = line.data();;) {
      const char* q = p;
      while (q != lend && *q != ',') ++q;  // fields are short: a loop beats a memchr call
      if (nfields < ncols && roles[nfields] != c_ignored) f[std::size_t(roles[nfields])] = std::string_view(p, std::size_t(q - p));
      ++nfields;
      if (q == lend) break;
      p = q + 1;
    }
    if (nfields != ncols)
      bad_line(line_no, "expected " + std::to_string(ncols) + " comma-separated fields (as in the header), found " +
                        std::to_string(nfields) + ": " + quote(line));
    for (auto& v : f)
      if (!v.empty() && (is_space(v.front()) || is_space(v.back()))) v = trim(v);

    TraceEvent e;
    e.line = line_no;
    if (auto err = parse_u64(f[c_thread], e.thread); err != NumError::none) bad(line_no, c_thread, f[c_thread], num_reason(err, false));
    if (!parse_time(f[c_time], e.time))
      bad(line_no, c_time, f[c_time], "expected HH:MM:SS.ffffff, HH:MM:SS:ffffff or a non-negative number");
    if (!parse_action(f[c_action], e.action))
      bad(line_no, c_action, f[c_action], "expected allocate, free, free completed, deallocate, allocate failure, map, unmap, pool begin, pool end, pool release or pool restore");
    if (auto err = parse_address(f[c_pointer], e.pointer); err != NumError::none) bad(line_no, c_pointer, f[c_pointer], num_reason(err, true));
    if (auto err = parse_u64(f[c_size], e.size); err != NumError::none) bad(line_no, c_size, f[c_size], num_reason(err, false));
    if (auto err = parse_address(f[c_stream], e.stream); err != NumError::none) bad(line_no, c_stream, f[c_stream], num_reason(err, true));
    if (t.events.size() >= event_cap) too_many_events();
    t.events.push_back(e);
  }

  Trace finish(const std::string& name) {
    if (roles.empty()) fail(0, "empty trace: no header");
    t.name = name;
    return std::move(t);
  }
};

// Splits a stream of text pieces into lines for `parser`; a line may span pieces. A line past
// kMaxLine bytes stops the read: CSV trace lines are short, and an endless one (a device file, a
// decompressed bomb of one line) must not fill memory.
class LineFeeder {
 public:
  static constexpr std::size_t kMaxLine = std::size_t{1} << 20;
  explicit LineFeeder(Parser& parser) : parser_(parser) {}
  void feed(std::string_view piece) {
    for (;;) {
      const std::size_t nl = piece.find('\n');
      if (nl == std::string_view::npos) {
        if (carry_.size() + piece.size() > kMaxLine) too_long();
        carry_.append(piece);
        return;
      }
      if (carry_.empty()) {
        if (nl == 0) {  // a run of empty lines, counted at once (a .gz may hold billions)
          const std::size_t run = std::min(piece.find_first_not_of('\n'), piece.size());
          parser_.line_no += run;
          piece.remove_prefix(run);
          continue;
        }
        if (nl > kMaxLine) too_long();  // a whole line in one piece (a .gz's pieces are larger)
        parser_.line(piece.substr(0, nl));
      } else {
        if (carry_.size() + nl > kMaxLine) too_long();
        carry_.append(piece.substr(0, nl));
        parser_.line(carry_);
        carry_.clear();
      }
      piece.remove_prefix(nl + 1);
    }
  }
  void finish() {
    if (!carry_.empty()) {
      parser_.unterminated = true;
      parser_.line(carry_);
    }
    carry_.clear();
  }

 private:
  [[noreturn]] void too_long() const {
    parser_.fail(parser_.line_no + 1, "line longer than 1 MiB: not a CSV trace");
  }
  Parser& parser_;
  std::string carry_;
};

char* put_2digits(char* p, unsigned v) {
  p[0] = char('0' + v / 10);
  p[1] = char('0' + v % 10);
  return p + 2;
}

// "HH:MM:SS.ffffff" into p (at most 26 bytes); returns the end.
char* put_time(char* p, double seconds) {
  constexpr double kMaxSeconds = 1e12;  // keeps microseconds inside int64
  std::uint64_t us = 0;
  if (std::isfinite(seconds) && seconds > 0) us = std::uint64_t(std::llround(std::min(seconds, kMaxSeconds) * 1e6));
  const std::uint64_t h = us / 3'600'000'000u;
  us %= 3'600'000'000u;
  if (h < 100) p = put_2digits(p, unsigned(h));
  else p = std::to_chars(p, p + 20, h).ptr;
  *p++ = ':';
  p = put_2digits(p, unsigned(us / 60'000'000u));
  us %= 60'000'000u;
  *p++ = ':';
  p = put_2digits(p, unsigned(us / 1'000'000u));
  us %= 1'000'000u;
  *p++ = '.';
  for (int i = 5; i >= 0; --i, us /= 10) p[i] = char('0' + us % 10);
  return p + 6;
}

// Streams the CSV through `sink(const char*, size_t)` in chunks.
template <class Sink>
void emit_trace(const std::vector<TraceEvent>& events, bool rmm_strict, Sink&& sink) {
  std::string chunk;
  chunk.reserve(1 << 16);
  chunk.append(kRmmHeader);
  chunk.push_back('\n');
  char line[kMaxEventLine];
  for (const auto& e : events) {
    if (rmm_strict && e.action != TraceAction::allocate && e.action != TraceAction::free) continue;
    chunk.append(line, format_event(e, line));
    if (chunk.size() > (1 << 16) - kMaxEventLine) {
      sink(chunk.data(), chunk.size());
      chunk.clear();
    }
  }
  if (!chunk.empty()) sink(chunk.data(), chunk.size());
}

}  // namespace

std::size_t format_event(const TraceEvent& e, char (&buf)[kMaxEventLine]) noexcept {
  // Widest line: 20 + 1 + 26 + 1 + 16 + 1 + 18 + 1 + 20 + 1 + 18 + 1 = 124 bytes.
  char* p = buf;
  char* const end = buf + kMaxEventLine;
  p = std::to_chars(p, end, e.thread).ptr;
  *p++ = ',';
  p = put_time(p, e.time);
  *p++ = ',';
  const char* a = to_string(e.action);
  const std::size_t alen = std::strlen(a);
  std::memcpy(p, a, alen);
  p += alen;
  *p++ = ',';
  *p++ = '0';
  *p++ = 'x';
  p = std::to_chars(p, end, e.pointer, 16).ptr;
  *p++ = ',';
  p = std::to_chars(p, end, e.size).ptr;
  *p++ = ',';
  *p++ = '0';
  *p++ = 'x';
  p = std::to_chars(p, end, e.stream, 16).ptr;
  *p++ = '\n';
  return std::size_t(p - buf);
}

std::string format_time(double seconds) {
  char b[32];
  return std::string(b, put_time(b, seconds));
}

bool parse_time(std::string_view s, double& seconds) noexcept {
  const char* p = s.data();
  const char* const end = p + s.size();
  auto digits = [&p, end](std::uint64_t& v, std::size_t min, std::size_t max) {
    const char* start = p;
    v = 0;
    while (p < end && *p >= '0' && *p <= '9' && std::size_t(p - start) < max) v = v * 10 + std::uint64_t(*p++ - '0');
    return std::size_t(p - start) >= min;
  };
  if (s.find(':') != std::string_view::npos) {
    std::uint64_t h, m, sec, frac = 0, scale = 1;
    if (!digits(h, 1, 9) || p == end || *p++ != ':') return false;
    if (!digits(m, 2, 2) || p == end || *p++ != ':') return false;
    if (!digits(sec, 2, 2) || m > 59 || sec > 60) return false;
    if (p != end) {
      if (*p != '.' && *p != ':') return false;
      ++p;
      const char* fstart = p;
      if (!digits(frac, 1, 9)) return false;
      for (auto i = fstart; i < p; ++i) scale *= 10;
    }
    if (p != end) return false;
    // One division of exact integers: the written "HH:MM:SS.ffffff" reads back bit-identical.
    // With up to 9 hour and 9 fraction digits the product can pass 2^64 (999999999:00:00.999999999):
    // then the whole seconds and the fraction are added in double instead of wrapping around.
    const std::uint64_t whole = h * 3600 + m * 60 + sec;  // < 2^42
    if (whole > (UINT64_MAX - frac) / scale) {
      seconds = double(whole) + double(frac) / double(scale);
      return true;
    }
    seconds = double(whole * scale + frac) / double(scale);
    return true;
  }
  if (s.size() <= 15 && all_digits(s)) {  // indexes, the common plain case; exact in a double
    std::uint64_t v = 0;
    for (char c : s) v = v * 10 + std::uint64_t(c - '0');
    seconds = double(v);
    return true;
  }
  if (s.empty() || s.front() == '-' || s.front() == '+') return false;
  const auto r = std::from_chars(p, end, seconds);
  return r.ec == std::errc() && r.ptr == end && std::isfinite(seconds) && seconds >= 0;
}

std::string format_trace(const std::vector<TraceEvent>& events, bool rmm_strict) {
  std::string out;
  out.reserve(events.size() * 48 + kRmmHeader.size() + 1);
  emit_trace(events, rmm_strict, [&out](const char* p, std::size_t n) { out.append(p, n); });
  return out;
}

}  // namespace trace

Trace parse_trace(std::string_view csv_text, const std::string& name) {
  trace::Parser parser{name, trace::max_events(name)};
  // Reserve for the lines that have text (a newline right after another ends a blank line), up to
  // kMaxReserve events: a small .csv.gz of blank lines must not reserve an event per newline.
  constexpr std::size_t kMaxReserve = std::size_t{1} << 20;
  // (The header's own newline stands in for a last line without one.)
  std::size_t estimate = 0;
  for (std::size_t i = 1; i < csv_text.size(); ++i) estimate += csv_text[i] == '\n' && csv_text[i - 1] != '\n';
  parser.t.events.reserve(std::min(estimate, kMaxReserve));
  while (!csv_text.empty()) {
    const std::size_t nl = csv_text.find('\n');
    parser.unterminated = nl == std::string_view::npos;
    parser.line(csv_text.substr(0, nl));
    csv_text.remove_prefix(nl == std::string_view::npos ? csv_text.size() : nl + 1);
  }
  return parser.finish(name);
}

// Reads as a stream: memory holds the events (and a gzip file's compressed bytes), never the whole
// text, so a trace of tens of millions of lines, or a small .gz that inflates to gigabytes, costs
// what its events cost.
namespace {

Trace read_trace_bytes(const std::string& path, std::size_t event_cap, bool& gzip) {
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> f(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (!f) throw trace_error(path, 0, std::string("cannot open trace file: ") + std::strerror(errno));
  trace::Parser parser{path, event_cap};
  trace::LineFeeder lines(parser);
  std::string compressed;  // a gzip file is read whole, then decoded as a stream
  std::size_t offset = 0;
  static constexpr std::size_t kChunk = std::size_t{1} << 16;
  std::unique_ptr<char[]> buf(new char[kChunk]);
  for (;;) {
    const std::size_t n = std::fread(buf.get(), 1, kChunk, f.get());
    if (offset == 0) gzip = trace::is_gzip(std::string_view(buf.get(), n));
    if (gzip) {
      compressed.append(buf.get(), n);
    } else {
      // A CSV trace is text: a NUL byte past the first chunk means binary input, and stopping
      // there keeps an endless device (/dev/zero, /dev/urandom) from running on. (A short binary
      // file gets the parser's more precise message.)
      if (const void* nul = offset == 0 ? nullptr : std::memchr(buf.get(), 0, n); nul != nullptr)
        throw trace_error(path, 0,
                          "not a CSV trace: binary data (a NUL byte at offset " +
                              std::to_string(offset + static_cast<std::size_t>(static_cast<const char*>(nul) - buf.get())) + ")");
      lines.feed(std::string_view(buf.get(), n));
    }
    offset += n;
    if (n < kChunk) break;
  }
  if (std::ferror(f.get())) throw trace_error(path, 0, std::string("cannot read trace file: ") + std::strerror(errno));
  if (gzip) {
    // A parse error stops the parsing, not the decoding: when the data is corrupt, the gzip check at
    // the member's end is the error to report, not the garbage text it produced.
    std::exception_ptr parse_error;
    std::string head;  // the first two decoded bytes
    const trace::ChunkSink to_lines = [&](std::string_view piece) {
      if (head.size() < 2) {
        head.append(piece.substr(0, 2 - head.size()));
        if (trace::is_gzip(head))
          throw trace_error(path, 0, "compressed twice (gzip inside gzip): gunzip it once, then read the result");
      }
      if (parse_error) return;
      try {
        lines.feed(piece);
      } catch (const trace_error&) {
        parse_error = std::current_exception();
      }
    };
    try {
      trace::gunzip(compressed, to_lines);
    } catch (const trace::gzip_error& e) {
      std::string what = std::string("corrupt gzip: ") + e.what();
      // The decoder hands on what it decoded before the data ran out: the lines parsed say how far.
      if (!parse_error && what.find("truncated") != std::string::npos)
        what += parser.line_no ? "; the last complete line is line " + std::to_string(parser.line_no) : "; not one complete line";
      throw trace_error(path, 0, what);
    }
    if (parse_error) std::rethrow_exception(parse_error);
  }
  lines.finish();
  return parser.finish(std::filesystem::path(path).filename().string());
}

}  // namespace

Trace read_trace(const std::string& path) {
  bool gzip = false;
  const std::size_t event_cap = trace::max_events(path);
  try {
    return read_trace_bytes(path, event_cap, gzip);
  } catch (const trace_error& e) {
    // A .gz that is not gzip was read as CSV (a browser may have unpacked it and kept the name);
    // when that fails, the CSV parser's complaint alone hides the real problem.
    if (gzip || !path.ends_with(".gz") || e.file() != path || std::string_view(e.what()).find(": cannot ") != std::string_view::npos) throw;
    const std::string what = e.what();
    const std::size_t prefix = path.size() + (e.line() != 0 ? 1 + std::to_string(e.line()).size() : 0) + 2;
    throw trace_error(path, e.line(),
                      "not gzip data, although the name ends in .gz (it does not start with gzip's bytes 1f 8b); read as a CSV trace, " +
                          (what.size() >= prefix ? what.substr(prefix) : what));
  }
}

void write_trace(std::ostream& out, const std::vector<TraceEvent>& events, bool rmm_strict) {
  trace::emit_trace(events, rmm_strict, [&out](const char* p, std::size_t n) { out.write(p, std::streamsize(n)); });
  if (!out) throw error("write_trace: the output stream failed");
}

namespace {
// Writes the trace to `path` as it is named (`gz` decides the compression). Throws on failure, which
// may leave part of a file.
void write_trace_in_place(const std::string& path, bool gz, const std::vector<TraceEvent>& events, bool rmm_strict) {
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> f(std::fopen(path.c_str(), "wb"), &std::fclose);
  if (!f) throw error("cannot write trace file " + path + ": " + std::strerror(errno));
  bool ok = true;
  auto put = [&f, &ok](const char* p, std::size_t n) { ok = ok && std::fwrite(p, 1, n, f.get()) == n; };
  if (gz) {
    const std::string z = trace::gzip_compress(trace::format_trace(events, rmm_strict));
    put(z.data(), z.size());
  } else {
    trace::emit_trace(events, rmm_strict, put);
  }
  const int err = ok ? 0 : errno;
  if (std::fclose(f.release()) != 0 && ok) ok = false;
  if (!ok) throw error("cannot write trace file " + path + ": " + std::strerror(err ? err : errno));
}
}  // namespace

// A regular file (or none) at `path` is replaced whole: the trace goes to a temporary file beside
// it, renamed over it once complete, so a failed write (a full disk) leaves the earlier trace, not
// half of a new one that reads back without an error. A FIFO, a device (/dev/stdout) or a symbolic
// link is written through, as named; so is a path whose directory takes no new file.
void write_trace_file(const std::string& path, const std::vector<TraceEvent>& events, bool rmm_strict) {
  const bool gz = path.size() > 3 && path.ends_with(".gz");
  struct stat st {};
  const bool absent = ::lstat(path.c_str(), &st) != 0 && errno == ENOENT;
  if (!absent && !S_ISREG(st.st_mode)) return write_trace_in_place(path, gz, events, rmm_strict);
  static std::atomic<std::uint64_t> counter{0};
  const std::string tmp = path + ".tmp" + std::to_string(::getpid()) + "." + std::to_string(counter.fetch_add(1, std::memory_order_relaxed));
  {
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0) return write_trace_in_place(path, gz, events, rmm_strict);  // no new file there: as named
    ::close(fd);
  }
  try {
    write_trace_in_place(tmp, gz, events, rmm_strict);
  } catch (...) {
    std::remove(tmp.c_str());
    throw;
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    throw error("cannot write trace file " + path + ": cannot rename " + tmp + " to it: " + std::strerror(err));
  }
}

void validate_trace(const Trace& trace) {
  std::unordered_map<std::uint64_t, std::size_t> live;  // pointer -> index of its allocate event
  live.reserve(1024);
  const auto& ev = trace.events;
  auto where = [&ev](std::size_t i) {
    return ev[i].line ? "line " + std::to_string(ev[i].line) : "event " + std::to_string(i);
  };
  auto fail = [&](std::size_t i, const std::string& msg) {
    throw trace_error(trace.name, ev[i].line, (ev[i].line ? "" : where(i) + ": ") + msg);
  };
  for (std::size_t i = 0; i < ev.size(); ++i) {
    const auto& e = ev[i];
    // allocate(0) gives nullptr (RMM, CUDA): many may be live at once; free(nullptr) is a no-op.
    if (e.pointer == 0 && (e.action == TraceAction::free || (e.action == TraceAction::allocate && e.size == 0))) continue;
    if (e.action == TraceAction::allocate && e.pointer == 0)
      fail(i, "allocation of " + std::to_string(e.size) + " bytes at pointer 0x0 (only a size-0 allocation gives a null pointer)");
    if (e.action == TraceAction::allocate) {
      const auto [it, inserted] = live.try_emplace(e.pointer, i);
      if (!inserted)
        fail(i, "pointer " + trace::hex(e.pointer) + " allocated again while live (allocated at " + where(it->second) + ")");
    } else if (e.action == TraceAction::free) {
      if (live.erase(e.pointer) == 0)
        fail(i, "free of pointer " + trace::hex(e.pointer) + " that is not live (never allocated, or already freed)");
    }
  }
}

}  // namespace expseg
