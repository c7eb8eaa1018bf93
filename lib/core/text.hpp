// Untrusted text (config values, fields of files expseg reads) quoted in messages.
#pragma once

#include <algorithm>
#include <string>
#include <string_view>

namespace expseg::core {

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

}  // namespace expseg::core
