// expseg configuration: THE options table and everything it drives (see config.hpp).
//
// Each option is one row of kEntries: name, type, default, help, how its value is parsed into a
// Config and how it is printed back. Config::parse/apply, to_string and options() all walk the
// same rows, so an option cannot be parsed but not printed, or listed but not parsed.
#include "expseg/config.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include "expseg/errors.hpp"
#include "core/text.hpp"

namespace expseg {

const char* to_string(BackendKind k) noexcept {
  switch (k) {
    case BackendKind::split_merge: return "split_merge";
    case BackendKind::expandable: return "expandable";
  }
  return "unknown";
}

const char* to_string(DeviceKind k) noexcept {
  switch (k) {
    case DeviceKind::cuda: return "cuda";
    case DeviceKind::sim: return "sim";
  }
  return "unknown";
}

const char* to_string(PoolPolicy p) noexcept {
  switch (p) {
    case PoolPolicy::pytorch: return "pytorch";
    case PoolPolicy::cupy: return "cupy";
  }
  return "unknown";
}

const char* to_string(PeerAccess p) noexcept {
  switch (p) {
    case PeerAccess::automatic: return "auto";
    case PeerAccess::none: return "none";
  }
  return "unknown";
}

const char* to_string(IpcHandle h) noexcept {
  switch (h) {
    case IpcHandle::none: return "none";
    case IpcHandle::posix_fd: return "posix_fd";
    case IpcHandle::fabric: return "fabric";
  }
  return "unknown";
}

std::size_t Config::expandable_va_bytes(std::size_t device_total) const noexcept {
  if (va_size != 0) return va_size;
  constexpr double kSaturate = 9.0e18;  // below 2^63: the cast is exact enough and cannot overflow
  if (va_fraction > 0.0) {
    // Rounded up: PyTorch's expandable_segments_reserve gives at least the share asked for.
    const double v = std::ceil(va_fraction * static_cast<double>(device_total));
    return v >= kSaturate ? SIZE_MAX : static_cast<std::size_t>(v);
  }
  return device_total > SIZE_MAX / 2 ? SIZE_MAX : 2 * device_total;
}

std::size_t Limit::resolve(std::size_t device_total) const noexcept {
  if (bytes != 0) return bytes;
  if (fraction > 0.0) {
    // In double, as PyTorch (fraction * total) and CuPy (int(total * fraction)) compute it, so 30% of
    // 10 is 3, not the 2 that the exact product of the double 0.3 would floor to.
    const double total = static_cast<double>(device_total);
    const double v = std::floor(fraction * total);
    if (v >= total) return device_total;
    // A fraction too small for one byte is still a limit: 0 here would mean "no limit" (at least 1).
    return v < 1 ? std::min<std::size_t>(device_total, 1) : static_cast<std::size_t>(v);
  }
  return 0;
}

namespace {

constexpr std::size_t kKiB = std::size_t{1} << 10;
constexpr std::size_t kMiB = std::size_t{1} << 20;

// ---- text helpers ------------------------------------------------------------------------------

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

std::string_view trim(std::string_view s) {
  while (!s.empty() && is_space(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_space(s.back())) s.remove_suffix(1);
  return s;
}

bool iequals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    char x = a[i], y = b[i];
    if (x >= 'A' && x <= 'Z') x = static_cast<char>(x - 'A' + 'a');
    if (y >= 'A' && y <= 'Z') y = static_cast<char>(y - 'A' + 'a');
    if (x != y) return false;
  }
  return true;
}

using core::clip;

[[noreturn]] void bad_value(std::string_view key, std::string_view value, const std::string& expected) {
  throw config_error(std::string(key),
                     std::string(key) + ": invalid value '" + clip(value) + "'; expected " + expected);
}

// ---- value parsers -----------------------------------------------------------------------------

bool all_digits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// Unsigned decimal integer; `what` describes the expected value for messages.
// A leading '+', as PyTorch's std::stoul/stoull take ("max_split_size_mb:+128"), but not "+-".
std::uint64_t parse_uint(std::string_view key, std::string_view v, const std::string& what) {
  if (!v.empty() && v.front() == '-') bad_value(key, v, what + " (negative numbers are not allowed)");
  std::string_view digits = v;
  if (digits.size() > 1 && digits.front() == '+') digits.remove_prefix(1);
  if (!all_digits(digits)) bad_value(key, v, what);
  std::uint64_t n = 0;
  auto r = std::from_chars(digits.data(), digits.data() + digits.size(), n);
  if (r.ec == std::errc::result_out_of_range) bad_value(key, v, what + " (the number is too large)");
  if (r.ec != std::errc() || r.ptr != digits.data() + digits.size()) bad_value(key, v, what);
  return n;
}

// Finite decimal number (exponent allowed, as the shortest-form printer may produce one; a leading
// '+', as PyTorch's std::stod takes, but not "+-").
double parse_double(std::string_view key, std::string_view v, const std::string& what) {
  double d = 0;
  std::string_view num = v;
  if (num.size() > 1 && num.front() == '+' && num[1] != '-' && num[1] != '+') num.remove_prefix(1);
  auto r = std::from_chars(num.data(), num.data() + num.size(), d, std::chars_format::general);
  if (r.ec != std::errc() || r.ptr != num.data() + num.size() || !std::isfinite(d)) bad_value(key, v, what);
  return d;
}

// Shortest decimal text that reads back as the same double, independent of the C locale.
std::string format_double(double d) {
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, d);
  return std::string(buf, r.ptr);
}

bool parse_bool(std::string_view key, std::string_view v) {
  if (v == "true" || v == "True" || v == "1") return true;
  if (v == "false" || v == "False" || v == "0") return false;
  bad_value(key, v, "a bool: true, false, True, False, 1 or 0");
}

const char* format_bool(bool b) { return b ? "true" : "false"; }

template <class E>
struct EnumName {
  const char* name;
  E value;
};

template <class E, std::size_t N>
E parse_enum(std::string_view key, std::string_view v, const EnumName<E> (&names)[N]) {
  for (const auto& n : names)
    if (v == n.name) return n.value;
  std::string list;
  for (const auto& n : names) {
    if (!list.empty()) list += ", ";
    list += n.name;
  }
  bad_value(key, v, "one of: " + list);
}

constexpr EnumName<BackendKind> kBackendNames[] = {
    {"split_merge", BackendKind::split_merge},
    {"expandable", BackendKind::expandable},
    {"native", BackendKind::split_merge},  // PyTorch's caching allocator: listed, parse_backend keeps the backend
};
constexpr EnumName<PoolPolicy> kPolicyNames[] = {{"pytorch", PoolPolicy::pytorch}, {"cupy", PoolPolicy::cupy}};
constexpr EnumName<DeviceKind> kDeviceNames[] = {{"cuda", DeviceKind::cuda}, {"sim", DeviceKind::sim}};
constexpr EnumName<PeerAccess> kPeerAccessNames[] = {{"auto", PeerAccess::automatic}, {"none", PeerAccess::none}};
constexpr EnumName<IpcHandle> kIpcNames[] = {
    {"none", IpcHandle::none}, {"posix_fd", IpcHandle::posix_fd}, {"fabric", IpcHandle::fabric}};

struct Unit {
  const char* name;
  std::size_t factor;
};
constexpr Unit kUnits[] = {
    {"", 1},
    {"B", 1},
    {"KB", 1000},
    {"MB", 1000 * 1000},
    {"GB", std::size_t{1000} * 1000 * 1000},
    {"TB", std::size_t{1000} * 1000 * 1000 * 1000},
    {"KiB", kKiB},
    {"MiB", kMiB},
    {"GiB", std::size_t{1} << 30},
    {"TiB", std::size_t{1} << 40},
    // One letter, as PyTorch's expandable_segments_reserve writes GiB (40G): powers of 1024.
    {"K", kKiB},
    {"M", kMiB},
    {"G", std::size_t{1} << 30},
    {"T", std::size_t{1} << 40},
};
constexpr const char* kBytesExpected =
    "a size in bytes: a number with an optional unit B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, "
    "GiB, TiB (powers of 1024; K, M, G, T are the same), e.g. 4096, 512KiB, 1.5GiB, 20G";

// Exact: the integer part is multiplied, the fraction is folded in digit by digit with floor
// division (Horner), so "1.5GiB" is 1610612736 without rounding through a double.
std::size_t parse_bytes_impl(std::string_view key, std::string_view text) {
  const std::string_view v = trim(text);
  if (v.empty()) bad_value(key, text, kBytesExpected);
  if (v.front() == '-') bad_value(key, v, std::string(kBytesExpected) + " (negative sizes are not allowed)");
  std::size_t i = 0;
  while (i < v.size() && v[i] >= '0' && v[i] <= '9') ++i;
  const std::string_view int_part = v.substr(0, i);
  std::string_view frac_part;
  if (i < v.size() && v[i] == '.') {
    const std::size_t f = ++i;
    while (i < v.size() && v[i] >= '0' && v[i] <= '9') ++i;
    frac_part = v.substr(f, i - f);
    if (frac_part.empty()) bad_value(key, v, kBytesExpected);
  }
  if (int_part.empty()) bad_value(key, v, kBytesExpected);
  const std::string_view unit = trim(v.substr(i));
  std::size_t factor = 0;
  for (const Unit& u : kUnits)
    if (iequals(unit, u.name)) factor = u.factor;
  if (factor == 0) bad_value(key, v, kBytesExpected);

  constexpr std::size_t kMax = std::numeric_limits<std::size_t>::max();
  const std::string too_large = std::string(kBytesExpected) + " (the size is larger than " + std::to_string(kMax) + " bytes)";
  std::size_t whole = 0;
  auto r = std::from_chars(int_part.data(), int_part.data() + int_part.size(), whole);
  if (r.ec == std::errc::result_out_of_range) bad_value(key, v, too_large);
  if (whole > kMax / factor) bad_value(key, v, too_large);
  std::size_t frac = 0;
  for (std::size_t k = frac_part.size(); k-- > 0;)
    frac = (static_cast<std::size_t>(frac_part[k] - '0') * factor + frac) / 10;  // < factor, no overflow
  const std::size_t base = whole * factor;
  if (frac > kMax - base) bad_value(key, v, too_large);
  // A nonzero size below one byte would read as 0, which most keys take for "none" or "default"
  // (limit:0.5 would be no limit at all).
  if (base + frac == 0 && v.find_first_of("123456789") < i)
    bad_value(key, v, std::string(kBytesExpected) + " (this is less than one byte" +
                          (key == "limit" ? "; a share of device memory is written as a percentage, e.g. 50%)" : ")"));
  // A count of bytes has no fraction ("1.9" and "1.5B" read as 1 byte); with a larger unit the
  // fraction below a byte is dropped ("1.3KiB" is 1331 bytes).
  if (factor == 1 && frac_part.find_first_not_of('0') != std::string_view::npos)
    bad_value(key, v, std::string(kBytesExpected) + " (a number of bytes is a whole number)");
  return base + frac;
}

// Canonical size text: the largest binary unit that divides it exactly.
std::string format_size_exact(std::size_t n) {
  if (n == 0) return "0";
  static constexpr Unit kBinary[] = {{"TiB", std::size_t{1} << 40}, {"GiB", std::size_t{1} << 30}, {"MiB", kMiB}, {"KiB", kKiB}};
  for (const Unit& u : kBinary)
    if (n % u.factor == 0) return std::to_string(n / u.factor) + u.name;
  return std::to_string(n);
}

// Percentages are parsed from the decimal text shifted by two places ("12.5" -> 12.5e-2), not by
// dividing a double by 100, so that every fraction the printer writes reads back bit-exact.
std::optional<double> parse_percent(std::string_view key, std::string_view v,
                                   const char* expected = "a percentage in [0%, 100%], e.g. 50% (0% is none)", double max_fraction = 1.0) {
  if (v.empty() || v.back() != '%') return std::nullopt;
  const std::string_view num = trim(v.substr(0, v.size() - 1));
  if (!num.empty() && num.front() == '-') bad_value(key, v, std::string(expected) + " (negative percentages are not allowed)");
  const std::size_t dot = num.find('.');
  const std::string_view ip = num.substr(0, dot);
  const std::string_view fp = dot == std::string_view::npos ? std::string_view() : num.substr(dot + 1);
  if (!all_digits(ip) || (dot != std::string_view::npos && !all_digits(fp))) bad_value(key, v, expected);
  if (num.size() > 4096) bad_value(key, v, expected);  // far beyond double precision: refuse, don't allocate
  std::string shifted(num);
  shifted += "e-2";
  double f = 0;
  auto r = std::from_chars(shifted.data(), shifted.data() + shifted.size(), f, std::chars_format::general);
  if (r.ec == std::errc::result_out_of_range) {
    // Underflow of a nonzero value; overflow cannot pass the range check below anyway.
    bad_value(key, v, expected);
  }
  if (r.ec != std::errc() || r.ptr != shifted.data() + shifted.size() || !(f <= max_fraction)) bad_value(key, v, expected);
  return f;  // 0 for "0%": no limit
}

std::string format_percent(double fraction) {
  // Shortest scientific form d.ddde±X of the fraction, then the decimal point moved two places.
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, fraction, std::chars_format::scientific);
  const std::string_view s(buf, static_cast<std::size_t>(r.ptr - buf));
  const std::size_t e = s.find('e');
  std::string digits;
  for (char c : s.substr(0, e))
    if (c != '.') digits += c;
  int exp10 = 0;
  std::string_view es = s.substr(e + 1);
  if (!es.empty() && es.front() == '+') es.remove_prefix(1);
  std::from_chars(es.data(), es.data() + es.size(), exp10);
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  const long point = static_cast<long>(exp10) + 2 + 1;  // digits before the decimal point
  const long n = static_cast<long>(digits.size());
  std::string out;
  if (point <= 0) {
    out = "0." + std::string(static_cast<std::size_t>(-point), '0') + digits;
  } else if (point >= n) {
    out = digits + std::string(static_cast<std::size_t>(point - n), '0');
  } else {
    out = digits.substr(0, static_cast<std::size_t>(point)) + "." + digits.substr(static_cast<std::size_t>(point));
  }
  return out + "%";
}

// ---- option parsers and printers ---------------------------------------------------------------

using Key = std::string_view;

void parse_backend(Config& c, Key key, std::string_view v) {
  if (v == "cudaMallocAsync")
    throw config_error(std::string(key),
                       std::string(key) + ": 'cudaMallocAsync' (PyTorch's stream-ordered CUDA allocator) is "
                       "not provided by expseg; expected one of: split_merge, expandable, native");
  // PyTorch's native caching allocator runs with or without expandable segments, which its own key
  // picks in any order: native keeps the backend (split_merge unless expandable_segments:True).
  if (v == "native") return;
  c.backend = parse_enum(key, v, kBackendNames);
}

void parse_sim_capacity(Config& c, Key key, std::string_view v) {
  const std::size_t n = parse_bytes_impl(key, v);
  if (n == 0) bad_value(key, v, "a size larger than 0, e.g. 80GiB");
  c.sim_capacity = n;
}

// The simulated device's largest page (driver::kSimMaxGranularity, a header config.cpp does not
// include): its devices' address spans start on multiples of it.
constexpr std::size_t kMaxSimGranularity = std::size_t{1} << 40;

void parse_sim_granularity(Config& c, Key key, std::string_view v) {
  const std::size_t n = parse_bytes_impl(key, v);
  if (n < 4 * kKiB || n > kMaxSimGranularity || !std::has_single_bit(n))
    bad_value(key, v, "a power of two that is a multiple of 4KiB, at most 1TiB, e.g. 2MiB");
  c.sim_granularity = n;
}

constexpr const char* kVaExpected = "0 (2x device memory), a size of at most 1024TiB (1 PiB), e.g. 256GiB, or a share of "
                                    "device memory, e.g. 112.5%";
// Far beyond any device, yet small enough that the product with a device's size stays finite.
constexpr double kMaxVaFraction = 1.0e6;
// The reserve a segment takes by default, 2x device memory: expandable_segments_reserve's cap.
constexpr double kFullReserveFraction = 2.0;

void parse_va_size(Config& c, Key key, std::string_view v) {
  if (auto f = parse_percent(key, v, kVaExpected, kMaxVaFraction)) {
    c.va_size = 0;
    c.va_fraction = *f;  // 0% is the default, as 0 is
    return;
  }
  const std::size_t n = parse_bytes_impl(key, v);
  if (n > kMaxExpandableVaSize) bad_value(key, v, kVaExpected);
  c.va_size = n;
  c.va_fraction = 0.0;
}

std::string format_va_size(const Config& c) {
  return c.va_fraction != 0.0 ? format_percent(c.va_fraction) : format_size_exact(c.va_size);
}

// PyTorch's expandable_segments_reserve (after 2.11): a positive fraction of device memory (0.5) or
// whole GiB with a G suffix (40G). PyTorch ignores a bad value with a warning; expseg refuses it, as
// it does every bad value. expseg also takes a size with any other unit of the size keys (40GiB,
// 512MiB), as expandable_va_size does.
constexpr const char* kReserveExpected =
    "a positive fraction of device memory (e.g. 0.5) or a size in GiB (e.g. 40G), or a size with a unit (e.g. 40GiB, 512MiB)";

struct ReserveSpec {
  bool gib;
  double value;
  std::size_t bytes = 0;  // a size with another unit (40GiB): its bytes; gib and value unused
};

bool ends_in_letter(std::string_view v) {
  const char c = v.empty() ? '\0' : v.back();
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z');
}

ReserveSpec parse_reserve_spec(Key key, std::string_view v) {
  const bool gib = !v.empty() && (v.back() == 'G' || v.back() == 'g');
  if (!gib && ends_in_letter(v)) {  // 40GiB, 512MiB, 1TB: a size, as for expandable_va_size
    std::size_t n = 0;
    try {
      n = parse_bytes_impl(key, v);
    } catch (const config_error&) {
      bad_value(key, v, kReserveExpected);
    }
    if (n == 0) bad_value(key, v, kReserveExpected);
    if (n > kMaxExpandableVaSize) bad_value(key, v, std::string(kReserveExpected) + " (at most 1048576G, 1 PiB)");
    return {false, 0.0, n};
  }
  std::string_view num = gib ? v.substr(0, v.size() - 1) : v;
  // The numbers PyTorch's stream extraction reads: decimals with an exponent (5e-1) and a leading
  // '+', which from_chars does not take; parse_double refuses inf, nan and hex floats.
  if (!num.empty() && num.front() == '+') num.remove_prefix(1);
  const bool number = !num.empty() && num.front() != '-' && num.front() != '+';
  const double d = number ? parse_double(key, num, kReserveExpected) : 0.0;
  if (!(d > 0.0) || (!gib && d > kMaxVaFraction)) bad_value(key, v, kReserveExpected);
  if (gib && d * static_cast<double>(std::size_t{1} << 30) > static_cast<double>(kMaxExpandableVaSize))
    bad_value(key, v, std::string(kReserveExpected) + " (at most 1048576G, 1 PiB)");
  return {gib, d};
}

// = expandable_va_size: 0.5 is 50%, 40G is 40GiB. A fraction is capped at the full reserve, as
// PyTorch caps it at its own (9/8 of device memory): expseg's is 2x device memory, its default.
void parse_segments_reserve(Config& c, Key key, std::string_view v) {
  const ReserveSpec r = parse_reserve_spec(key, v);
  if (r.bytes != 0) {
    c.va_size = r.bytes;
    c.va_fraction = 0.0;
  } else if (r.gib) {
    c.va_size = std::max<std::size_t>(1, static_cast<std::size_t>(std::ceil(r.value * static_cast<double>(std::size_t{1} << 30))));
    c.va_fraction = 0.0;
  } else {
    c.va_size = 0;
    c.va_fraction = std::min(r.value, kFullReserveFraction);
  }
}

// PyTorch's reserve per stream class, [name:F|NG,...]: expseg has no stream classes, so every
// segment reserves expandable_va_size; the list is checked and dropped.
void ignore_reserve_by_class(Config&, Key key, std::string_view v) {
  const char* expected = "a list [name:fraction-or-GiB,...], e.g. [decode:0.5,prefill:40G]";
  if (v.size() < 2 || v.front() != '[' || v.back() != ']') bad_value(key, v, expected);
  std::string_view rest = v.substr(1, v.size() - 2);
  if (trim(rest).empty()) return;
  while (true) {
    const std::size_t comma = rest.find(',');
    const std::string_view item = trim(rest.substr(0, comma));
    const std::size_t colon = item.find(':');
    if (item.empty() && comma == std::string_view::npos) break;  // one trailing comma, as PyTorch
    if (colon == std::string_view::npos || trim(item.substr(0, colon)).empty()) bad_value(key, v, expected);
    (void)parse_reserve_spec(key, trim(item.substr(colon + 1)));
    if (comma == std::string_view::npos) break;
    rest = rest.substr(comma + 1);
  }
}

void parse_limit(Config& c, Key key, std::string_view v) {
  if (auto f = parse_percent(key, v)) {
    c.limit = Limit{0, *f};
    return;
  }
  c.limit = Limit{parse_bytes_impl(key, v), 0.0};  // 0: no limit
}

std::string format_limit(const Limit& l) {
  if (l.bytes != 0) return format_size_exact(l.bytes);
  if (l.fraction != 0.0) return format_percent(l.fraction);
  return "0";
}

void parse_max_handle(Config& c, Key key, std::string_view v) {
  const std::size_t n = parse_bytes_impl(key, v);
  if (n % (2 * kMiB) != 0) bad_value(key, v, "0 (the policy default) or a multiple of 2MiB, e.g. 64MiB");
  c.max_handle_size = n;
}

void parse_expandable_segments(Config& c, Key key, std::string_view v) {
  c.backend = parse_bool(key, v) ? BackendKind::expandable : BackendKind::split_merge;
}

// PyTorch's MiB options. As PyTorch (std::min(val, SIZE_MAX / kMB)), a count of MiB whose bytes would
// not fit a size_t is clamped to the largest that does; a number past 2^64 - 1 is an error.
std::size_t parse_mib(Key key, std::string_view v, const std::string& what) {
  const std::uint64_t n = parse_uint(key, v, what);
  const std::uint64_t most = std::numeric_limits<std::size_t>::max() / kMiB;
  return static_cast<std::size_t>(std::min(n, most)) * kMiB;
}

// The MiB value of large_segment_size, the least max_split_size_mb and max_non_split_rounding_mb
// PyTorch takes (20 unless large_segment_size_mb is set; Config::apply parses that key first).
std::string large_mib(const Config& c) { return std::to_string(c.large_segment_size / kMiB); }

void parse_max_split_size(Config& c, Key key, std::string_view v) {
  if (v == "unlimited") {
    c.max_split_size = SIZE_MAX;
    return;
  }
  // PyTorch 2.9+ (AcceleratorAllocatorConfig): at least large_segment_size (kLargeBuffer, 20 MiB).
  const std::string what = "an integer number of MiB >= " + large_mib(c) + ", or unlimited";
  const std::size_t n = parse_mib(key, v, what);
  if (n < c.large_segment_size)
    throw config_error(std::string(key), std::string(key) + ": too small, must be >= " + large_mib(c) +
                                             " (got '" + clip(v) + "'); expected " + what);
  c.max_split_size = n;
}

void parse_max_non_split_rounding(Config& c, Key key, std::string_view v) {
  const std::string what = "an integer number of MiB >= " + large_mib(c);
  const std::size_t n = parse_mib(key, v, what);
  if (n < c.large_segment_size)
    throw config_error(std::string(key), std::string(key) + ": too small, must be >= " +
                                             large_mib(c) + " (got '" + clip(v) + "'); expected " + what);
  c.max_non_split_rounding = n;
}

// PyTorch after 2.11 (AcceleratorAllocatorConfig::parseLargeSegmentSize): more than 10 MiB.
void parse_large_segment_size(Config& c, Key key, std::string_view v) {
  const std::string what = "an integer number of MiB > 10, e.g. 32";
  const std::size_t n = parse_mib(key, v, what);
  if (n <= 10 * kMiB)
    throw config_error(std::string(key), std::string(key) + ": must be > 10 (got '" + clip(v) +
                                             "'); expected " + what);
  c.large_segment_size = n;
}

constexpr const char* kRoundupExpected =
    "a power of two (or 0 = off) for all intervals, or a list [MB:divisions,...,>:divisions] whose keys "
    "are powers of two in MB and whose divisions are powers of two or 0, e.g. [256:1,512:2,1024:4,>:8]";

// A number inside a roundup value; messages quote the whole value for context.
std::uint64_t roundup_number(Key key, std::string_view whole, std::string_view part, const char* role) {
  if (!part.empty() && part.front() == '-')
    bad_value(key, whole, std::string(kRoundupExpected) + " (" + role + " " + clip(part) + " is negative)");
  std::uint64_t n = 0;
  auto r = std::from_chars(part.data(), part.data() + part.size(), n);
  if (!all_digits(part) || r.ec != std::errc() || r.ptr != part.data() + part.size())
    bad_value(key, whole, std::string(kRoundupExpected) + " (" + role + " '" + clip(part) + "' is not a power of two)");
  return n;
}

std::size_t parse_divisions(Key key, std::string_view whole, std::string_view d) {
  const std::uint64_t n = roundup_number(key, whole, d, "divisions");
  if (n != 0 && !std::has_single_bit(n))
    bad_value(key, whole, std::string(kRoundupExpected) + " (divisions " + clip(d) + " is not a power of two or 0)");
  return static_cast<std::size_t>(n);
}

// PyTorch's parseRoundUpPower2Divisions. The key's value defines every interval: the ones it does
// not name are 0, so to_string's output reads back whatever came before.
void parse_roundup(Config& c, Key key, std::string_view v) {
  std::array<std::size_t, kRoundupIntervals> out{};
  if (v.front() != '[') {
    out.fill(parse_divisions(key, v, v));
    c.roundup_power2_divisions = out;
    return;
  }
  if (v.back() != ']' || v.size() < 2) {
    const std::size_t close = v.find(']');
    bad_value(key, v, std::string(kRoundupExpected) + (close == std::string_view::npos ? std::string(" (missing ']')")
                                                                                      : " (unexpected text '" + clip(v.substr(close + 1)) + "' after ']')"));
  }
  const std::string_view inner = trim(v.substr(1, v.size() - 2));
  if (inner.find_first_of("[]") != std::string_view::npos) bad_value(key, v, std::string(kRoundupExpected) + " (nested brackets)");
  bool first = true;
  bool any = false;
  std::size_t last_index = 0;
  std::size_t pos = 0;
  while (!inner.empty() && pos <= inner.size()) {
    std::size_t comma = inner.find(',', pos);
    if (comma == std::string_view::npos) comma = inner.size();
    const std::string_view entry = trim(inner.substr(pos, comma - pos));
    pos = comma + 1;
    // PyTorch takes one comma after the last entry ("[256:1,>:8,]"), as after the last item.
    if (entry.empty() && comma == inner.size() && any) break;
    any = true;
    const std::size_t colon = entry.find(':');
    if (entry.empty() || colon == std::string_view::npos)
      bad_value(key, v, std::string(kRoundupExpected) + " (entry '" + clip(entry) + "' is not MB:divisions)");
    const std::string_view k = trim(entry.substr(0, colon));
    const std::size_t divisions = parse_divisions(key, v, trim(entry.substr(colon + 1)));
    if (k == ">") {
      std::fill(out.begin() + static_cast<std::ptrdiff_t>(std::min(last_index + 1, out.size())), out.end(), divisions);
      continue;
    }
    const std::uint64_t boundary = roundup_number(key, v, k, "interval");
    if (!std::has_single_bit(boundary))
      bad_value(key, v, std::string(kRoundupExpected) + " (interval " + clip(k) + " is not a power of two)");
    const std::size_t index = std::min<std::size_t>(static_cast<std::size_t>(std::bit_width(boundary) - 1), kRoundupIntervals - 1);
    if (first) {
      std::fill(out.begin(), out.begin() + static_cast<std::ptrdiff_t>(index), divisions);
      first = false;
    }
    out[index] = divisions;
    last_index = index;
  }
  c.roundup_power2_divisions = out;
}

std::string format_roundup(const Config& c) {
  const auto& v = c.roundup_power2_divisions;
  if (std::all_of(v.begin(), v.end(), [&](std::size_t x) { return x == v[0]; })) return std::to_string(v[0]);
  // The first key fills the intervals before it, '>' fills those after the last key: name the end of
  // the leading run, the middle ones, then '>' for the trailing run.
  std::size_t a = 1;
  while (a < v.size() && v[a] == v[0]) ++a;
  std::size_t b = v.size() - 1;
  while (b > 0 && v[b - 1] == v.back()) --b;
  std::string out = "[";
  auto entry = [&out](const std::string& k, std::size_t d) {
    if (out.size() > 1) out += ',';
    out.append(k).append(":").append(std::to_string(d));
  };
  entry(std::to_string(std::size_t{1} << (a - 1)), v[0]);
  for (std::size_t i = a; i < b; ++i) entry(std::to_string(std::size_t{1} << i), v[i]);
  entry(">", v.back());
  out += ']';
  return out;
}

void parse_gc_threshold(Config& c, Key key, std::string_view v) {
  if (v == "off") {
    c.garbage_collection_threshold = 0.0;
    return;
  }
  const char* what = "a number in (0, 1), e.g. 0.8, or off";
  const double t = parse_double(key, v, what);
  if (!(t > 0.0 && t < 1.0))
    throw config_error(std::string(key), std::string(key) + ": '" + clip(v) + "' is out of range, set it in (0.0, 1.0); expected " + what);
  c.garbage_collection_threshold = t;
}

// PyTorch 2.9+ (CUDAAllocatorConfig, DeviceCachingAllocator::setMemoryFraction) takes [0, 1]: 1 sets
// no limit at all, 0 a limit of 0 bytes (no new memory at all). expseg's limit 0 is "none", so 0
// becomes the smallest limit there is, 1 byte, as set_per_process_memory_fraction(0) does in the glue.
void parse_memory_fraction(Config& c, Key key, std::string_view v) {
  const char* what = "a fraction of device memory in [0, 1], e.g. 0.5 (1: no limit; 0: nothing may be allocated)";
  const double f = parse_double(key, v, what);
  if (!(f >= 0.0 && f <= 1.0)) bad_value(key, v, what);
  if (f == 1.0) c.limit = Limit{};
  else if (f == 0.0) c.limit = Limit{1, 0.0};
  else c.limit = Limit{0, f};
}

// The letters that may follow '%' in an oom_dump pattern (expand_oom_dump_path replaces them).
constexpr bool is_oom_dump_token(char c) { return c == 'p' || c == 'd' || c == 'n' || c == '%'; }

// An oom_dump path pattern: "none" turns it off; every '%' must start %p, %d, %n or %%.
void parse_oom_dump(Config& c, Key key, std::string_view v) {
  if (v == "none") {
    c.oom_dump.clear();
    return;
  }
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (v[i] != '%') continue;
    const char next = i + 1 < v.size() ? v[i + 1] : '\0';
    if (!is_oom_dump_token(next))
      throw config_error(std::string(key), std::string(key) + ": '%" + clip(std::string_view(&next, next ? 1 : 0)) +
                                               "' at byte " + std::to_string(i) + " of '" + clip(v) +
                                               "'; expected a file path where % starts %p (process id), %d (device), "
                                               "%n (the OOM's number) or %% (a '%'), or none");
    ++i;
  }
  c.oom_dump.assign(v);
}

// Host-side PyTorch options: the value is checked as PyTorch checks it (to catch typos) and dropped.
void ignore_bool(Config&, Key key, std::string_view v) { (void)parse_bool(key, v); }
void ignore_count(Config&, Key key, std::string_view v) { (void)parse_uint(key, v, "a non-negative integer"); }

void ignore_register_threads(Config&, Key key, std::string_view v) {
  const std::uint64_t n = parse_uint(key, v, "an integer, a power of two from 1 to 128");
  if (!std::has_single_bit(n) || n > 128) bad_value(key, v, "an integer, a power of two from 1 to 128");
}

struct Entry {
  Config::Option opt;
  void (*parse)(Config&, Key, std::string_view);
  std::string (*print)(const Config&);  // nullptr: an alias or ignored key, left out of to_string()
};

// clang-format off
const Entry kEntries[] = {
  // --- expseg ---
  {{"backend", "split_merge|expandable", "split_merge",
    "allocator backend; PyTorch's 'native' keeps the one expandable_segments picks (split_merge by default)"},
   parse_backend, [](const Config& c) -> std::string { return to_string(c.backend); }},
  {{"policy", "pytorch|cupy", "pytorch", "split_merge preset: PyTorch's caching allocator or CuPy's memory pool"},
   [](Config& c, Key k, std::string_view v) { c.policy = parse_enum(k, v, kPolicyNames); },
   [](const Config& c) -> std::string { return to_string(c.policy); }},
  {{"device", "cuda|sim", "cuda", "the real GPU through the CUDA driver, or the simulated device"},
   [](Config& c, Key k, std::string_view v) { c.device = parse_enum(k, v, kDeviceNames); },
   [](const Config& c) -> std::string { return to_string(c.device); }},
  {{"sim_capacity", "bytes", "80GiB", "memory of the simulated device"},
   parse_sim_capacity, [](const Config& c) { return format_size_exact(c.sim_capacity); }},
  {{"sim_granularity", "bytes", "2MiB", "allocation granularity of the simulated device (power of two, multiple of 4KiB, at most 1TiB and sim_capacity)"},
   parse_sim_granularity, [](const Config& c) { return format_size_exact(c.sim_granularity); }},
  {{"sim_host_backed", "bool", "false", "simulated allocations are backed by host memory (memfd) and hold real bytes"},
   [](Config& c, Key k, std::string_view v) { c.sim_host_backed = parse_bool(k, v); },
   [](const Config& c) -> std::string { return format_bool(c.sim_host_backed); }},
  {{"sim_latency", "bool", "false", "simulated driver calls follow the H200 latency model"},
   [](Config& c, Key k, std::string_view v) { c.sim_latency = parse_bool(k, v); },
   [](const Config& c) -> std::string { return format_bool(c.sim_latency); }},
  {{"limit", "bytes|N%", "0", "memory limit: bytes, or a percentage of device memory; 0 = none"},
   parse_limit, [](const Config& c) { return format_limit(c.limit); }},
  {{"expandable_va_size", "bytes|N%", "0", "virtual address range reserved per expandable segment: bytes (at most 1024TiB) or a percentage of device memory; 0 = 2x device memory; a sixteenth of it once the segments hold 32TiB"},
   parse_va_size, format_va_size},
  {{"expandable_max_handle", "bytes", "0", "largest physical handle of the expandable backend (multiple of 2MiB); 0 = policy default"},
   parse_max_handle, [](const Config& c) { return format_size_exact(c.max_handle_size); }},
  {{"ipc_handle", "none|posix_fd|fabric", "none", "shareable handle type of expandable physical memory"},
   [](Config& c, Key k, std::string_view v) { c.ipc_handle = parse_enum(k, v, kIpcNames); },
   [](const Config& c) -> std::string { return to_string(c.ipc_handle); }},
  {{"peer_access", "auto|none", "auto",
    "C API: once allocators exist on two or more devices, expandable ones grant each other's devices access"},
   [](Config& c, Key k, std::string_view v) { c.peer_access = parse_enum(k, v, kPeerAccessNames); },
   [](const Config& c) -> std::string { return to_string(c.peer_access); }},
  {{"record", "bool", "false", "event recorder on from the start"},
   [](Config& c, Key k, std::string_view v) { c.record = parse_bool(k, v); },
   [](const Config& c) -> std::string { return format_bool(c.record); }},
  {{"record_ring", "count", "0", "keep only the last N recorded events; 0 = all"},
   [](Config& c, Key k, std::string_view v) { c.record_ring = parse_uint(k, v, "a non-negative integer (events)"); },
   [](const Config& c) { return std::to_string(c.record_ring); }},
  {{"oom_snapshot", "bool", "false", "attach a snapshot to every OOM report"},
   [](Config& c, Key k, std::string_view v) { c.oom_snapshot = parse_bool(k, v); },
   [](const Config& c) -> std::string { return format_bool(c.oom_snapshot); }},
  {{"oom_counterfactual", "bool", "true", "on OOM, check whether the other backend would have succeeded"},
   [](Config& c, Key k, std::string_view v) { c.oom_counterfactual = parse_bool(k, v); },
   [](const Config& c) -> std::string { return format_bool(c.oom_counterfactual); }},
  {{"oom_dump", "path|none", "none",
    "at every OOM write report, snapshot, config and recorded trace to this file (%p pid, %d device, %n OOM number); "
    "no ',' in it outside balanced [...] (items are separated by commas)"},
   parse_oom_dump, [](const Config& c) { return c.oom_dump.empty() ? std::string("none") : c.oom_dump; }},
  // --- PyTorch's keys, with PyTorch's meaning ---
  {{"large_segment_size_mb", "MiB", "20", "PyTorch: the segment split_merge gives a request of 1-10 MiB (> 10); also the least max_split_size_mb and the default max_non_split_rounding_mb"},
   parse_large_segment_size, [](const Config& c) { return large_mib(c); }},
  {{"max_split_size_mb", "MiB|unlimited", "unlimited", "PyTorch: blocks this large or larger are never split (>= large_segment_size_mb)"},
   parse_max_split_size,
   [](const Config& c) { return c.max_split_size == SIZE_MAX ? std::string("unlimited") : std::to_string(c.max_split_size / kMiB); }},
  {{"max_non_split_rounding_mb", "MiB", "20", "PyTorch: an oversize request may reuse a cached block up to this much larger (>= large_segment_size_mb, its default)"},
   parse_max_non_split_rounding, [](const Config& c) { return std::to_string(c.max_non_split_rounding / kMiB); }},
  {{"roundup_power2_divisions", "N|[MB:N,...,>:N]", "0", "PyTorch: round sizes up to 1/N steps between powers of two, per 1MiB..64GiB interval"},
   parse_roundup, format_roundup},
  {{"garbage_collection_threshold", "float|off", "off", "PyTorch: reclaim cached blocks when reserved memory passes this fraction of the limit"},
   parse_gc_threshold,
   [](const Config& c) { return c.garbage_collection_threshold == 0.0 ? std::string("off") : format_double(c.garbage_collection_threshold); }},
  {{"expandable_segments", "bool", "False", "PyTorch: True = backend:expandable, False = backend:split_merge"},
   parse_expandable_segments, nullptr},
  {{"per_process_memory_fraction", "float", "1", "PyTorch: limit to this fraction of device memory, in [0, 1] (= limit:N%; 1 = none, 0 = nothing may be allocated)"},
   parse_memory_fraction, nullptr},
  {{"expandable_segments_reserve", "float|NG", "2", "PyTorch: = expandable_va_size, as a fraction of device memory (0.5; at most the full reserve, 2) or GiB (40G; "
    "expseg also takes a size with a unit, 40GiB)"},
   parse_segments_reserve, nullptr},
  {{"expandable_segments_reserve_by_class", "[name:float|NG,...]", "[]", "PyTorch: VA reserve per stream class; expseg has no stream classes: checked, then ignored"},
   ignore_reserve_by_class, nullptr},
  {{"throw_on_cudamalloc_oom", "bool", "False", "PyTorch: refuse a request over the limit before calling the driver; expseg always does: checked, then ignored"},
   ignore_bool, nullptr},
  // --- PyTorch's host-side keys: accepted and ignored ---
  {{"release_lock_on_cudamalloc", "bool", "False", "PyTorch host-side option; ignored"}, ignore_bool, nullptr},
  {{"pinned_use_cuda_host_register", "bool", "False", "PyTorch host-side option; ignored"}, ignore_bool, nullptr},
  {{"pinned_num_register_threads", "count", "1", "PyTorch host-side option (a power of two, at most 128); ignored"}, ignore_register_threads, nullptr},
  {{"pinned_use_background_threads", "bool", "False", "PyTorch host-side option; ignored"}, ignore_bool, nullptr},
  {{"pinned_reserve_segment_size_mb", "count", "0", "PyTorch host-side option; ignored"}, ignore_count, nullptr},
  {{"pinned_max_round_threshold_mb", "count", "0", "PyTorch host-side option; ignored"}, ignore_count, nullptr},
  {{"pinned_max_cached_size_mb", "count", "0", "PyTorch host-side option; ignored"}, ignore_count, nullptr},
  {{"graph_capture_record_stream_reuse", "bool", "False",
    "PyTorch: reuse during a capture a block freed there that other streams used; ignored (expseg holds such frees until the capture ends)"},
   ignore_bool, nullptr},
  {{"pinned_free_catch_all", "bool", "False", "PyTorch host-side option; ignored"}, ignore_bool, nullptr},
  // PyTorch accepts its ROCm spellings in CUDA builds too.
  {{"release_lock_on_hipmalloc", "bool", "False", "PyTorch host-side option (ROCm spelling); ignored"}, ignore_bool, nullptr},
  {{"pinned_use_hip_host_register", "bool", "False", "PyTorch host-side option (ROCm spelling); ignored"}, ignore_bool, nullptr},
};
// clang-format on

constexpr std::size_t kNumEntries = std::size(kEntries);

const Entry* find_entry(std::string_view key) {
  for (const Entry& e : kEntries)
    if (key == e.opt.name) return &e;
  return nullptr;
}

std::string valid_keys() {
  std::string out;
  for (const Entry& e : kEntries) {
    if (!out.empty()) out += ", ";
    out += e.opt.name;
  }
  return out;
}

// The key of the item that starts at `item` (for messages about the item as a whole).
std::string item_key(std::string_view item) {
  const std::size_t colon = item.find(':');
  if (colon == std::string_view::npos) return "";
  const std::string_view key = trim(item.substr(0, colon));
  return key.find_first_of("[]") == std::string_view::npos ? clip(key) : "";
}

// Splits on commas outside [...]; brackets must balance.
std::vector<std::string_view> split_items(std::string_view text) {
  std::vector<std::string_view> items;
  if (trim(text).empty()) return items;
  std::size_t start = 0;
  int depth = 0;
  for (std::size_t i = 0; i <= text.size(); ++i) {
    const char c = i < text.size() ? text[i] : ',';
    if (c == '[') {
      ++depth;
    } else if (c == ']') {
      if (--depth < 0) {
        const std::string k = item_key(text.substr(start));
        throw config_error(k, (k.empty() ? std::string() : k + ": ") + "unbalanced ']' at byte " + std::to_string(i));
      }
    } else if (c == ',' && (depth == 0 || i == text.size())) {
      if (depth > 0) {
        const std::string k = item_key(text.substr(start));
        throw config_error(k, (k.empty() ? std::string() : k + ": ") + "'[' opened and never closed");
      }
      const std::string_view item = text.substr(start, i - start);
      // One trailing comma is accepted, as PyTorch does ("expandable_segments:True," is pasted often).
      if (i == text.size() && !items.empty() && trim(item).empty()) break;
      if (trim(item).empty())
        throw config_error("", "empty item at byte " + std::to_string(start) +
                                   " (expected key:value pairs separated by single commas)");
      items.push_back(item);
      start = i + 1;
    }
  }
  return items;
}

}  // namespace

std::size_t parse_bytes(std::string_view text, std::string_view key) { return parse_bytes_impl(key, text); }

std::string expand_oom_dump_path(std::string_view pattern, long pid, int device, std::uint64_t oom_number) {
  std::string out;
  for (std::size_t i = 0; i < pattern.size(); ++i) {
    const char next = i + 1 < pattern.size() ? pattern[i + 1] : '\0';
    if (pattern[i] != '%' || !is_oom_dump_token(next)) {
      out += pattern[i];
      continue;
    }
    ++i;
    if (next == 'p') out += std::to_string(pid);
    else if (next == 'd') out += std::to_string(device);
    else if (next == 'n') out += std::to_string(oom_number);
    else out += '%';
  }
  return out;
}

std::string format_bytes(std::size_t bytes) {
  if (bytes == 1) return "1 byte";
  if (bytes <= 1024) return std::to_string(bytes) + " bytes";
  double v = 0;
  const char* unit = nullptr;
  if (bytes <= kMiB) {
    v = static_cast<double>(bytes) / 1024.0;
    unit = " KiB";
  } else if (bytes <= (std::size_t{1} << 30)) {
    v = static_cast<double>(bytes) / 1048576.0;
    unit = " MiB";
  } else {
    v = static_cast<double>(bytes) / 1073741824.0;
    unit = " GiB";
  }
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::fixed, 2);  // locale-independent %.2f
  return std::string(buf, r.ptr) + unit;
}

std::string device_label(const Config& c, int device) {
  if (c.device == DeviceKind::sim) {
    // A whole number of a unit as --device sim:CAP writes it (1 GiB is "sim:1GiB", where
    // format_bytes, as PyTorch's format_size, says "1024.00 MiB").
    for (const auto& [unit, name] : {std::pair<std::size_t, const char*>{std::size_t{1} << 40, "TiB"},
                                     {std::size_t{1} << 30, "GiB"}, {std::size_t{1} << 20, "MiB"}, {std::size_t{1} << 10, "KiB"}})
      if (c.sim_capacity >= unit && c.sim_capacity % unit == 0) return "sim:" + std::to_string(c.sim_capacity / unit) + name;
    std::string compact;  // "80.50 GiB" -> "80.50GiB"
    for (char ch : format_bytes(c.sim_capacity))
      if (ch != ' ') compact += ch;
    if (compact.size() > 6 && compact.find(".00") != std::string::npos) compact.erase(compact.find(".00"), 3);
    return "sim:" + compact;
  }
  return "cuda:" + std::to_string(device);
}

void Config::apply(std::string_view text) {
  Config next = *this;  // a failed apply leaves *this as it was
  struct Item {
    const Entry* entry;
    std::string_view key, value;
  };
  std::vector<Item> parsed;
  std::string_view previous_key;  // of the item before, for the hint on an oom_dump path cut at a ','
  for (std::string_view item : split_items(text)) {
    const std::size_t colon = item.find(':');
    const std::string_view key = trim(item.substr(0, colon));
    if (key.empty()) throw config_error("", "empty key in item '" + clip(trim(item)) + "' (expected key:value)");
    const Entry* e = find_entry(key);
    const bool equals = key.find('=') != std::string_view::npos;
    if (!e && previous_key != "oom_dump" && equals) {
      // backend=expandable: the shell's or another tool's syntax; PyTorch's (and expseg's) is key:value.
      const std::string_view name = trim(key.substr(0, key.find('=')));
      // PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True pasted whole: the variable's name came along.
      if (name.ends_with("_ALLOC_CONF") || name.ends_with("_alloc_conf"))
        throw config_error(std::string(name), "'" + clip(name) + "=' is the name of a variable, not an item: the value is the list of "
                                                                 "key:value items alone, e.g. EXPSEG_ALLOC_CONF=" + clip(trim(trim(item).substr(trim(item).find('=') + 1))) +
                                                                 " (not EXPSEG_ALLOC_CONF=" + clip(name) + "=...)");
      const std::string_view rest = trim(trim(item).substr(trim(item).find('=') + 1));
      if (find_entry(name))
        throw config_error(std::string(name), "'" + clip(trim(item)) + "': use key:value, with ':' between key and value, "
                                                                        "not '=' (e.g. " + clip(name) + ":" + clip(rest) + ")");
    }
    if (!e) {
      // oom_dump:/tmp/a,b.json: the path was split at its ',' and its tail read as a key.
      const std::string hint = previous_key == "oom_dump"
                                   ? " (items are separated by commas, so an oom_dump path cannot contain ',': the "
                                     "path was cut there; choose one without ',')"
                               : equals ? " (items are key:value, with ':' between key and value, not '=')"
                                        : "";
      throw config_error(clip(key), "unknown option '" + clip(key) + "'" + hint + "; valid options are: " + valid_keys());
    }
    previous_key = key;
    if (colon == std::string_view::npos)
      throw config_error(std::string(key), std::string(key) + ": missing ':value'; expected " + std::string(key) +
                                               ":<" + e->opt.type + ">");
    const std::string_view value = trim(item.substr(colon + 1));
    if (value.empty())
      throw config_error(std::string(key), std::string(key) + ": empty value; expected a value of type " + e->opt.type);
    parsed.push_back({e, key, value});
  }
  // As PyTorch: large_segment_size_mb first, wherever it stands, since it bounds max_split_size_mb and
  // max_non_split_rounding_mb from below and sets the latter's default.
  bool large_set = false;
  for (const Item& it : parsed)
    if (it.entry->parse == parse_large_segment_size) {
      it.entry->parse(next, it.key, it.value);
      large_set = true;
    }
  // It sets max_non_split_rounding_mb's default: a value kept from before this text that is not
  // the previous default was set by an earlier layer and stays (later keys win; checked below).
  if (large_set && max_non_split_rounding == large_segment_size) next.max_non_split_rounding = next.large_segment_size;
  for (const Item& it : parsed)
    if (it.entry->parse != parse_large_segment_size) it.entry->parse(next, it.key, it.value);
  // Only values kept from before this text can be below it here (this text's own are checked as parsed).
  if (next.max_split_size < next.large_segment_size || next.max_non_split_rounding < next.large_segment_size) {
    const bool split = next.max_split_size < next.large_segment_size;
    const std::size_t other = split ? next.max_split_size : next.max_non_split_rounding;
    throw config_error("large_segment_size_mb", "large_segment_size_mb: " + large_mib(next) + " is more than " +
                                                    (split ? "max_split_size_mb" : "max_non_split_rounding_mb") + " (" +
                                                    std::to_string(other / kMiB) + ", set before); PyTorch requires " +
                                                    "both to be at least large_segment_size_mb");
  }
  *this = next;
}

std::vector<std::string> Config::keys_of(std::string_view text) {
  std::vector<std::string> keys;
  for (std::string_view item : split_items(text)) keys.emplace_back(trim(item.substr(0, item.find(':'))));
  return keys;
}

Config Config::parse(std::string_view text) {
  Config c;
  c.apply(text);
  return c;
}

Config Config::from_env() {
  const char* env = std::getenv("EXPSEG_ALLOC_CONF");
  if (env == nullptr) return Config{};
  try {
    return parse(env);
  } catch (const config_error& e) {
    throw config_error(e.key(), std::string("EXPSEG_ALLOC_CONF: ") + e.what());
  }
}

std::string Config::to_string() const {
  std::string out;
  for (const Entry& e : kEntries) {
    if (e.print == nullptr) continue;
    if (!out.empty()) out += ',';
    out += e.opt.name;
    out += ':';
    out += e.print(*this);
  }
  return out;
}

std::span<const Config::Option> Config::options() {
  static const std::array<Option, kNumEntries> table = [] {
    std::array<Option, kNumEntries> t{};
    for (std::size_t i = 0; i < kNumEntries; ++i) t[i] = kEntries[i].opt;
    return t;
  }();
  return table;
}

}  // namespace expseg
