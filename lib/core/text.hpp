// Untrusted text (config values, fields of files expseg reads) quoted in messages.
#pragma once

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <string>
#include <string_view>

namespace expseg::core {

// An address or stream in messages: "0x7f12ab00".
inline std::string hex(std::uint64_t v) {
  char b[2 + 16] = {'0', 'x'};
  const auto r = std::to_chars(b + 2, b + sizeof b, v, 16);
  return std::string(b, r.ptr);
}

// Bounded, so a 1 MB hostile value gives a short message, and printable ASCII only: control and
// non-ASCII bytes (invalid UTF-8 included) are written \xNN, as the trace parser quotes them, so a
// message is always valid text that cannot drive a terminal (a backslash is \x5c).
inline std::string clip(std::string_view s, std::size_t max_bytes = 64) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  const std::size_t n = std::min(s.size(), max_bytes);
  for (std::size_t i = 0; i < n; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x20 || c >= 0x7f || c == '\\') {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 0xf];
    } else {
      out += s[i];
    }
  }
  if (s.size() > max_bytes) out += "... (" + std::to_string(s.size()) + " bytes)";
  return out;
}

// Length of the well-formed UTF-8 sequence (RFC 3629: no overlong forms, no surrogates, at most
// U+10FFFF) at the start of `s`, whose first byte is >= 0x80; 0 when there is none.
inline std::size_t utf8_sequence_length(std::string_view s) noexcept {
  const auto b = [&s](std::size_t i) { return static_cast<unsigned char>(s[i]); };
  const unsigned char c = b(0);
  std::size_t n = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // the allowed range of the second byte
  if (c >= 0xC2 && c <= 0xDF) n = 2;
  else if (c >= 0xE0 && c <= 0xEF) n = 3, lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
  else if (c >= 0xF0 && c <= 0xF4) n = 4, lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
  if (n == 0 || s.size() < n || b(1) < lo || b(1) > hi) return 0;
  for (std::size_t k = 2; k < n; ++k)
    if ((b(k) & 0xC0) != 0x80) return 0;
  return n;
}

// Appends `s` with every byte that is not part of well-formed UTF-8 replaced by U+FFFD, so JSON
// (RFC 8259) and HTML built from file names and trace fields stay valid UTF-8. `plain(c, out)`
// writes an ASCII byte (escaping as the format needs).
template <class Plain>
void append_utf8(std::string& out, std::string_view s, Plain&& plain) {
  for (std::size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      plain(static_cast<char>(c), out);
      ++i;
    } else if (const std::size_t n = utf8_sequence_length(s.substr(i)); n != 0) {
      out.append(s.substr(i, n));
      i += n;
    } else {
      out += "\xEF\xBF\xBD";  // U+FFFD
      ++i;
    }
  }
}

}  // namespace expseg::core
